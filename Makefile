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
# pytest workers (pytest-xdist), each test file on one worker
WORKERS ?= 2
# The slice of the suite run in the floor, middle and latest environments of `make matrix` (`make test-slice`):
# the engine and capability tables, the rules reproduced with real trainers (Trainer, SFT, DPO, GRPO), the post-init
# patch and the CLI/config checker, the settings layer, the policy table, the checkpoint primitives and the rules
# whose facts depend on the transformers release (MoE router logits, models that refuse checkpointing), and the
# model route for loops without a Trainer (it patches the enable methods each release spells its own way), and the
# lean selective policy on the zoo (which aten ops each release's models run decides what it keeps). It touches
# every module and the trainers' real code paths; the trainer x variant matrix, distributed, DeepSpeed, FSDP, the
# zoo's training runs and startup tests stay in the full environments.
SLICE ?= tests/test_capabilities.py tests/test_engine.py tests/test_rules_v2.py tests/test_patching.py \
	tests/test_check_cli.py tests/test_cli.py tests/test_no_trace.py tests/test_copies.py tests/test_settings.py \
	tests/test_policy.py tests/test_ckpt.py tests/test_moe_router.py tests/test_model_cannot_checkpoint.py \
	tests/test_loop.py tests/test_lean_selective.py
# What the newest torch changes most (FSDP2's internals, selective checkpointing, offloading, the planner's figures, the
# recompute's context_fn: SAC modes and the SDPA backend switches):
# run beside SLICE in the `latest` environment, whose torch is the newest the registry serves (a CUDA build: what GPU
# users install, run here on the CPU).
TORCH_SLICE ?= tests/test_fsdp.py tests/test_planner.py tests/test_planner_mixed.py tests/test_plan_check.py \
	tests/test_plan_integration.py tests/test_selective_peft.py tests/test_activation_offloading.py tests/test_recompute.py
# An empty TF / TRL / PEFT / BNB / TORCH installs the latest release the registry offers (the `latest` CI environment).
pin = $(if $(2),"$(1)==$(2)","$(1)")
PY := $(VENV)/bin/python
# pip's own configuration may cap torch (a constraint file for the wheels a machine keeps on disk: 2.14.1 on the
# project's machines); an environment that asks for the newest torch (UNCAPPED=1) installs without pip's configuration
PIP = $(if $(UNCAPPED),PIP_CONFIG_FILE=/dev/null )$(PY) -m pip
STAMP := $(VENV)/.installed-torch$(TORCH)-tf$(TF)-trl$(TRL)-peft$(PEFT)$(if $(EXTRA),-$(subst =,,$(EXTRA)))

.PHONY: venv demo test test-slice test-launchers lint matrix clean bench-startup bench-pth bench-overhead bench-parity bench-modes bench-zero3 bench-vs-compile bench-planner readme gpu-evidence

venv: $(STAMP)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(call pin,torch,$(TORCH))
	$(PIP) install -q $(call pin,torch,$(TORCH)) $(call pin,transformers,$(TF)) $(call pin,trl,$(TRL)) \
		$(call pin,peft,$(PEFT)) $(call pin,bitsandbytes,$(BNB)) $(EXTRA) -e ".[test]"
	$(PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|peft|accelerate|deepspeed|bitsandbytes) '
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

test-slice: venv
	$(PY) -m pytest -n $(WORKERS) --dist loadfile $(SLICE) $(PYTEST_ARGS)

# The launcher integrations against the real launcher, in its own environment (its releases pin their own
# transformers/TRL, so it is not one of the matrix's): Axolotl 0.19.0 from the registry (transformers 5.16.1, TRL 1.9.0)
# on CPU, `axolotl train` included, through its `plugins:` line and through `TRL_GC_PLUGIN=1`. Not part of `make
# test`; the package is installed from this checkout (editable, no dependencies: Axolotl's pins stay).
AXOLOTL ?= 0.19.0
AXO_VENV ?= .venv-axolotl
AXO_STAMP := $(AXO_VENV)/.installed-axolotl$(AXOLOTL)-torch$(TORCH)

$(AXO_STAMP):
	$(PYTHON) -m venv $(AXO_VENV)
	$(AXO_VENV)/bin/python -m pip install -q "torch==$(TORCH)"
	$(AXO_VENV)/bin/python -m pip install -q "torch==$(TORCH)" "axolotl==$(AXOLOTL)" pytest hypothesis
	$(AXO_VENV)/bin/python -m pip install -q --no-deps -e .  # its .pth: `TRL_GC_PLUGIN=1 axolotl train` (no plugins line)
	$(AXO_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(axolotl|torch|transformers|trl|peft|accelerate) '
	rm -f $(AXO_VENV)/.installed-*
	touch $@

# LLaMA-Factory 0.9.5 (transformers 5.6.0, TRL 0.24.0, PEFT 0.18.1), the plugin installed editable (its `.pth` is what
# `TRL_GC_PLUGIN=1 llamafactory-cli train` needs). The registry's torchvision/torchaudio wheels do not load against
# torch 2.13.0+cpu (`torchvision::nms does not exist`); LLaMA-Factory needs neither for text SFT, but its
# `data/mm_plugin.py` imports torchaudio at the top: torchvision is removed and torchaudio replaced by an empty module.
LLAMAFACTORY ?= 0.9.5
LF_VENV ?= .venv-llamafactory
LF_STAMP := $(LF_VENV)/.installed-llamafactory$(LLAMAFACTORY)-torch$(TORCH)

$(LF_STAMP):
	$(PYTHON) -m venv $(LF_VENV)
	$(LF_VENV)/bin/python -m pip install -q "torch==$(TORCH)"
	$(LF_VENV)/bin/python -m pip install -q "torch==$(TORCH)" "llamafactory==$(LLAMAFACTORY)" pytest hypothesis
	$(LF_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio
	$(LF_VENV)/bin/python -c "import pathlib, sysconfig; p = pathlib.Path(sysconfig.get_paths()['purelib'], 'torchaudio'); \
		p.mkdir(exist_ok=True); (p / '__init__.py').write_text('# empty: text SFT never calls torchaudio\n')"
	$(LF_VENV)/bin/python -m pip install -q --no-deps -e .
	$(LF_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(llamafactory|torch|transformers|trl|peft|accelerate) '
	rm -f $(LF_VENV)/.installed-*
	touch $@

# OpenRLHF 0.11.2 (transformers 5.15.0, DeepSpeed 0.19.6), installed without its dependencies: it pins flash-attn
# (no build without CUDA), ray, vllm and wandb, none of which its Actor / SFTLoss path needs on CPU; the ones that path
# imports are installed by name, and tests/stubs/flash_attn stands in for the flash-attn names it imports at module
# level (sample packing and ring attention; the functions raise if called).
OPENRLHF ?= 0.11.2
ORLHF_VENV ?= .venv-openrlhf
ORLHF_STAMP := $(ORLHF_VENV)/.installed-openrlhf$(OPENRLHF)-torch$(TORCH)

$(ORLHF_STAMP):
	$(PYTHON) -m venv $(ORLHF_VENV)
	$(ORLHF_VENV)/bin/python -m pip install -q "torch==$(TORCH)"
	$(ORLHF_VENV)/bin/python -m pip install -q "torch==$(TORCH)" "transformers==5.15.0" "deepspeed==0.19.6" peft \
		accelerate einops pylatexenc jsonlines datasets optree torchmetrics loralib pytest hypothesis
	$(ORLHF_VENV)/bin/python -m pip install -q --no-deps "openrlhf==$(OPENRLHF)"
	$(ORLHF_VENV)/bin/python -m pip install -q --no-deps -e .
	$(ORLHF_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(openrlhf|torch|transformers|deepspeed|peft) '
	rm -f $(ORLHF_VENV)/.installed-*
	touch $@

test-launchers: $(AXO_STAMP) $(LF_STAMP) $(ORLHF_STAMP)
	PYTHONPATH=$(CURDIR) $(AXO_VENV)/bin/python -m pytest tests/test_launchers_axolotl.py $(PYTEST_ARGS)
	$(LF_VENV)/bin/python -m pytest -p no:xdist -m launchers tests/test_launchers_llamafactory.py $(PYTEST_ARGS)
	DS_ACCELERATOR=cpu $(ORLHF_VENV)/bin/python -m pytest -p no:xdist -m launchers tests/test_launchers_openrlhf.py \
		$(PYTEST_ARGS)

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

bench-parity: venv
	$(PY) benchmarks/parity_memory.py --rounds 2

bench-zero3: venv
	$(PY) benchmarks/zero3_old_deepspeed.py

# The planner against torch.compile's own activation_memory_budget (docs/benchmarks.md): under 15 minutes on 2 cores
bench-vs-compile: venv
	$(PY) benchmarks/vs_compile.py

# Per-block mixed plans against the uniform candidates: the share of full checkpointing's overhead removed
bench-planner: venv
	$(PY) benchmarks/planner_mixed.py

# The GPU-only figures (benchmarks/gpu_evidence.py), on a machine with a CUDA device, in its own Python (the lent GPU
# machines hold torch and transformers and reach no registry: no venv is built): under 8 minutes on one H100 / H200.
gpu-evidence:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_evidence.py $(if $(EVIDENCE_DIR),--out-dir $(EVIDENCE_DIR))

bench-modes: venv
	$(PY) -m pip install -q "matplotlib>=3.7"
	$(PY) benchmarks/modes.py

# PRUNE=1 (CI, `.ci/run`): an environment is removed once its tests have run, all but .venv-tf5 (the lint's), and the
# free disk is printed before each: the two CUDA builds of torch (2.14.1, the newest) take about 6 GB each, and a CI
# machine's free disk varies (a run stopped on "No space left on device" installing the newest torch after the five
# environments before it, about 13 GB, were still on disk). Locally the environments stay.
disk = @df -h . | awk 'NR==2 {print "disk before $(1): " $$4 " free"}'
prune = $(if $(PRUNE),rm -rf $(1))

# The CI matrix (README "Compatibility"): the full suite on transformers 5.23 + TRL 1.16 (+ DeepSpeed), and on
# transformers 4.57 + TRL 1.16 with the architecture zoo cut to one architecture of each kind and both MoE routers
# (ZOO=slice: the whole zoo is 43% of the suite's time) and without the tests marked `line_independent` (config files
# read with pinned versions, the start-up hook's mechanism, the package's shape); SLICE plus the trainer matrix and
# the TRL checks on TRL 0.26 (the TRL that enables checkpointing inside the trainer's __init__); SLICE at the floor of
# pyproject.toml (transformers 4.53.2 + TRL 0.20.0, the lowest TRL 0.20 resolves with, PEFT 0.13.2, accelerate
# 1.4.0), at a middle 5.x on torch 2.14.1 in one environment (5.17: every_n_layers and offload read by transformers,
# no activation_* fields yet; torch 2.14.1: the newest pip's cap allows, the CUDA wheel, run without a GPU) and at the
# latest releases, unpinned and torch uncapped (UNCAPPED=1 bypasses pip's global cap for that venv only), with
# TORCH_SLICE, the tests that read torch internals (FSDP2, policies, meters), so a new release shows up as a CI result.
matrix:
	$(call disk,.venv-tf5)
	$(MAKE) test VENV=.venv-tf5 TF=5.23.0 TRL=1.16.0 EXTRA=deepspeed==0.19.8
	$(call disk,.venv-tf4)
	ZOO=slice $(MAKE) test VENV=.venv-tf4 TF=4.57.6 TRL=1.16.0 PYTEST_ARGS='-m "not line_independent"'
	$(call prune,.venv-tf4)
	$(call disk,.venv-tf4-trl026)
	$(MAKE) test-slice VENV=.venv-tf4-trl026 TF=4.57.6 TRL=0.26.2 \
		SLICE="$(SLICE) tests/test_matrix.py tests/test_model_state.py tests/test_check_trl.py"
	$(call prune,.venv-tf4-trl026)
	$(call disk,.venv-floor)
	$(MAKE) test-slice VENV=.venv-floor TF=4.53.2 TRL=0.20.0 PEFT=0.13.2 EXTRA=accelerate==1.4.0
	$(call prune,.venv-floor)
	$(call disk,.venv-tf517-torch214)
	$(MAKE) test-slice VENV=.venv-tf517-torch214 TF=5.17.0 TRL=1.16.0 TORCH=2.14.1
	$(call prune,.venv-tf517-torch214)
	$(call disk,.venv-latest)
	$(MAKE) test-slice VENV=.venv-latest TF= TRL= PEFT= BNB= TORCH= UNCAPPED=1 SLICE="$(SLICE) $(TORCH_SLICE)"
	$(call prune,.venv-latest)

clean:
	rm -rf .venv .venv-* dist build *.egg-info
