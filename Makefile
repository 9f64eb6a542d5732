# vlrl: `make test` and `make demo` work on a fresh clone; each installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
NNODES ?= 1
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
ARTIFACTS ?= artifacts
ARGS ?=

.PHONY: install test test-fast demo demo-gpu demo-agent clean sft-tiny clevr geo3k merge

install: $(STAMP)

# torch is installed on its own first: on CPU machines the pinned CPU build comes from local disk;
# any torch already in the range (the GPU image's 2.11) is kept as is.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $@

test: install
	$(PY) -m pytest -q -x tests

test-fast: install
	$(PY) -m pytest -q -x tests -m "not slow"

clean:
	rm -rf $(ARTIFACTS) runs

# The CPU demo: demo-size Qwen2.5-VL + generated CLEVR, SFT warm start, then GRPO on 2 ranks.
demo: install
	$(PY) tools/demo.py --nproc $(NPROC) $(ARGS)

# The same demo on one GPU with the vLLM engine (needs CUDA and `pip install -e ".[vllm]"`);
# about 3 minutes on one H200.
demo-gpu: install
	$(PY) tools/demo.py --nproc 1 rollout.engine=vllm $(ARGS)

# The agent demo on CPU: the demo-size Qwen2.5-VL learns to call image_zoom_in_tool on generated zoom data
# (SFT on tool-using trajectories, then GRPO with the tool); prints the held-out accuracy without and with tools.
demo-agent: install
	$(PY) tools/demo_agent.py --nproc $(NPROC) $(ARGS)

sft-tiny: install
	$(PY) tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out $(ARTIFACTS)/tiny_qwen2_5_vl --overwrite
	$(PY) tools/make_dataset.py --kind clevr --n 256 --seed 0 --out $(ARTIFACTS)/clevr_train.parquet --size 56x56
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) train.py --config configs/sft_clevr_tiny.yaml $(ARGS)

# Real models: MODEL=/path/to/Qwen2.5-VL-3B-Instruct DATA=/path/to/train.parquet [EVAL=...] [NPROC=8] [NNODES=1]
# Multi-node: NNODES=N RDZV=host:port on every node.
MODEL ?=
DATA  ?=
EVAL  ?=
RDZV  ?= localhost:29500
LAUNCH = $(PY) -m torch.distributed.run --nnodes $(NNODES) --nproc-per-node $(NPROC) \
	$(if $(filter 1,$(NNODES)),--standalone,--rdzv-backend c10d --rdzv-endpoint $(RDZV))
RECIPE_ARGS = $(if $(MODEL),model.path=$(MODEL)) $(if $(DATA),data.train_path=$(DATA)) $(if $(EVAL),data.eval_path=$(EVAL)) $(ARGS)

clevr: install
	$(LAUNCH) train.py --config configs/clevr_qwen2_5_vl_3b.yaml $(RECIPE_ARGS)

geo3k: install
	$(LAUNCH) train.py --config configs/geo3k_qwen2_5_vl_7b.yaml $(RECIPE_ARGS)

# make merge CKPT=runs/X/checkpoints/step_N OUT=merged/
merge: install
	$(PY) tools/checkpoint_merge.py --checkpoint $(CKPT) --out $(OUT)
