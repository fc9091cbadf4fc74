# Quick start:  make demo   (a silent checkpointing failure of the installed transformers, without and with the plugin)
#               make test   (the test suite)
# Both create the virtual environment they need (.venv) on first use.

PYTHON ?= python3
VENV ?= .venv
TF ?= 5.23.0
TRL ?= 1.16.0
PEFT ?= 0.21.2
TORCH ?= 2.13.0
BNB ?= 0.50.2
# extra packages for an environment (CI's transformers 5 one gets DeepSpeed for the ZeRO-3 tests; the default .venv
# of `make demo` / `make test` does not: its tests that need DeepSpeed are skipped there)
EXTRA ?=
# pytest workers (pytest-xdist), each test file on one worker: the multi-process tests of a file share a port
WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-tf$(TF)-trl$(TRL)$(if $(EXTRA),-$(subst =,,$(EXTRA)))

.PHONY: venv demo test lint matrix clean bench-startup bench-pth bench-overhead bench-modes bench-zero3 readme

venv: $(STAMP)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH)"
	$(PY) -m pip install -q "torch==$(TORCH)" "transformers==$(TF)" "trl==$(TRL)" "peft==$(PEFT)" "bitsandbytes==$(BNB)" $(EXTRA) -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check trl_gc_plugin tests examples benchmarks
	$(PY) -m ruff format --check trl_gc_plugin

readme: venv
	$(PY) -m trl_gc_plugin rules --update-readme README.md

bench-startup: venv
	$(PY) benchmarks/startup.py

bench-pth: venv
	$(PY) benchmarks/pth_cost.py

bench-overhead: venv
	$(PY) benchmarks/callback_overhead.py

bench-zero3: venv
	$(PY) benchmarks/zero3_old_deepspeed.py

bench-modes: venv
	$(PY) -m pip install -q "matplotlib>=3.7"
	$(PY) benchmarks/modes.py

# The CI matrix: latest transformers 5 + TRL (+ DeepSpeed); transformers 4.57 + latest TRL; transformers 4.57 +
# TRL 0.26 (the TRL that enables checkpointing inside the trainer's __init__).
matrix:
	$(MAKE) test VENV=.venv-tf5 TF=5.23.0 TRL=1.16.0 EXTRA=deepspeed==0.19.8
	$(MAKE) test VENV=.venv-tf4 TF=4.57.6 TRL=1.16.0
	ZOO=slice $(MAKE) test VENV=.venv-tf4-trl026 TF=4.57.6 TRL=0.26.2

clean:
	rm -rf .venv .venv-* dist build *.egg-info
