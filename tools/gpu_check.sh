#!/usr/bin/env bash
# The GPU validation batch on tiny models: bf16 SFT steps, policy packed vs padded, the torch
# engine against the policy, and (when vllm imports) the vLLM engine and GRPO steps with it.
#   bash tools/gpu_check.sh OUTDIR
set -u
OUT=${1:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PY=${PY:-python3}
$PY tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out "$OUT/tiny" --overwrite > "$OUT/build.log" 2>&1
$PY tools/make_dataset.py --kind clevr --n 96 --seed 0 --out "$OUT/clevr.parquet" --size 56x56 >> "$OUT/build.log" 2>&1
LP="--model $OUT/tiny --data $OUT/clevr.parquet --task clevr --num-prompts 16 --n 4 --max-new-tokens 32"
timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 train.py --config configs/sft_clevr_tiny.yaml \
  model.path="$OUT/tiny" data.train_path="$OUT/clevr.parquet" trainer.run_dir="$OUT/sft" trainer.max_steps=2 \
  > "$OUT/sft_bf16.log" 2>&1; echo "sft rc=$?" >> "$OUT/summary.txt"
timeout 120 $PY tools/logprob_check.py $LP --engine torch --out "$OUT/lp_torch.json" > "$OUT/lp_torch.log" 2>&1
echo "lp_torch rc=$?" >> "$OUT/summary.txt"
if $PY -c "import vllm" 2>/dev/null; then
  timeout 150 $PY tools/logprob_check.py $LP --engine vllm --out "$OUT/lp_vllm.json" > "$OUT/lp_vllm.log" 2>&1
  echo "lp_vllm rc=$?" >> "$OUT/summary.txt"
  timeout 150 $PY -m torch.distributed.run --standalone --nproc-per-node 1 train.py --config configs/demo.yaml \
    model.path="$OUT/tiny" data.train_path="$OUT/clevr.parquet" data.eval_path="$OUT/clevr.parquet" \
    trainer.run_dir="$OUT/grpo_vllm" trainer.max_steps=3 rollout.engine=vllm trainer.eval_every=0 \
    trainer.eval_samples=16 data.min_pixels=3136 data.max_pixels=3136 rollout.gpu_memory_utilization=0.3 \
    > "$OUT/grpo_vllm.log" 2>&1; echo "grpo_vllm rc=$?" >> "$OUT/summary.txt"
  cp "$OUT/grpo_vllm/metrics.jsonl" "$OUT/grpo_vllm_metrics.jsonl" 2>/dev/null
fi
cp "$OUT/sft/metrics.jsonl" "$OUT/sft_bf16_metrics.jsonl" 2>/dev/null
rm -rf "$OUT/tiny" "$OUT/sft" "$OUT/grpo_vllm" "$OUT/clevr.parquet"
cat "$OUT/summary.txt"
