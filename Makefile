# The README's two commands. On a fresh clone they need only Python >= 3.10 and a C compiler:
#
#   make train    trains the default model (configs/default.yaml); ARGS="key=value ..." overrides
#   make test     runs the test suite (what CI runs); ARGS="tests/training -x" narrows it
#
# Each creates the virtual environment .venv/ on first use, installs torch and the package with
# the extras it needs, then runs. Later calls reuse it: each install step leaves a stamp file in
# .venv/ and is redone only when pyproject.toml (or TORCH_VERSION) changes. Remove .venv/ to start
# afresh. With an environment of your own, use pip install -e ".[test]" instead (docs/guide.md, "Install").

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: train test test-asan lint gpu-check bench bench-run

train: $(VENV)/.installed-train
	$(PY) scripts/train.py $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(ARGS)

# The C-backed tests with the C library built under AddressSanitizer and UBSan (SSM_CPU_SANITIZE=1,
# ssm/native/build.py; a cache entry of its own): a read or write out of bounds, a use after free or
# undefined behaviour in a kernel stops the run with a report. Python is not instrumented, so the
# ASan runtime of the compiler that builds the library is preloaded (gcc's; with clang set
# ASAN_LIB to its libclang_rt.asan); leaks are not checked (the interpreter's own). Not part of
# `make test`: it takes several minutes (the compile, and the kernels at -O1 under ASan).
ASAN_TESTS ?= tests/native tests/ops tests/scan/test_cpu_backend.py tests/scan/test_subnormals.py \
    tests/scan/test_selective_scan.py tests/scan/test_linear_scan.py tests/scan/test_step.py \
    tests/scan/test_properties.py tests/models/test_mamba2_decode.py tests/models/test_mamba3_decode.py
ASAN_LIB ?= $(shell $${CC:-cc} -print-file-name=libasan.so)
test-asan: $(VENV)/.installed-test
	SSM_CPU_SANITIZE=1 LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	    $(PY) -m pytest -p no:cacheprovider $(ASAN_TESTS) $(ARGS)

# Every GPU path proved and timed in one command (scripts/gpu_check.py): on a machine with CUDA,
# with that machine's own python3 and no install step; without CUDA, the same plan as a dry run.
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	PYTHONPATH=. $(PYTHON) scripts/gpu_check.py --out $(GPU_CHECK_OUT) $(ARGS)

# Lint and format check (ruff, configured in pyproject.toml); CI runs it before the tests.
lint: $(VENV)/.installed-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# BENCHMARKS.md's tables and pictures, measured again on this machine: each command replaces its own
# section of BENCHMARKS.md (the device's: a GPU run keeps the CPU sections) and draws its picture
# under docs/bench/. Its run time on a quiet machine is not yet measured (on a loaded 2-core CPU the
# first seven commands took 40 minutes, most of it the peers' training steps). BENCH_DEVICE
# (cuda when nvidia-smi sees a GPU, else cpu) and BENCH_ARGS (e.g. --repeats 9) go to every command;
# `make bench-run` runs the commands without the install step.
BENCH_DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
BENCH_ARGS ?=
BENCH = $(PY) scripts/benchmark.py --device $(BENCH_DEVICE) --markdown BENCHMARKS.md $(BENCH_ARGS)
PICTURES = docs/bench

bench: $(VENV)/.installed-train $(VENV)/.installed-bench
	@$(MAKE) --no-print-directory bench-run

bench-run:
	$(BENCH) --op selective --skip ref --lengths 256,512,1024,2048,4096 --repeats 3 --warmup 1 \
	    --plot $(PICTURES)/selective-scan-vs-length-$(BENCH_DEVICE).png
	$(BENCH) --op selective
	$(BENCH) --op linear
	$(BENCH) --op trapezoidal --length 256 --repeats 3 --warmup 1
	$(BENCH) --op ssd
	$(BENCH) --op layer
	$(BENCH) --op saved --dtype bfloat16 --d-model 768 --state 128 --headdim 64 --length 512
	$(BENCH) --op train-step --mixers Mamba1,Mamba2,Mamba3 --repeats 3 --warmup 1 \
	    --plot $(PICTURES)/train-step-per-mixer-$(BENCH_DEVICE).png
	$(BENCH) --op generate --d-model 768 --layers 24 --positions 1,16,128,1024,4096 --new-tokens 32 \
	    --plot $(PICTURES)/decode-vs-position-$(BENCH_DEVICE).png
	$(BENCH) --op decode
	$(BENCH) --op hybrid
	$(BENCH) --op packed
	$(BENCH) --op cold-start
	$(if $(filter cpu,$(BENCH_DEVICE)),$(BENCH) --op memory --new-tokens 64)

# The package, editable, with the extras the command needs (test includes train). It also brings
# the dependencies of torch when torch came from a wheel on disk without them.
$(VENV)/.installed-%: pyproject.toml $(VENV)/.torch-$(TORCH_VERSION)
	@echo "installing ssm-scan[$*] into $(VENV)"
	@$(PIP) install --quiet -e ".[$*]"
	@touch $@

# torch, the build that fits the machine: a wheel already on this machine's disk when pip finds
# one (offline, --no-index: pip's configured find-links); else the CUDA build from the package
# index when an NVIDIA GPU is present, the CPU build (a fraction of the size) when not.
$(VENV)/.torch-$(TORCH_VERSION): | $(PY)
	@if $(PIP) install --quiet --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null; then \
	    echo "torch $(TORCH_VERSION): a wheel on this machine's disk"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
	    echo "torch $(TORCH_VERSION): an NVIDIA GPU is present; the CUDA build from the package index"; \
	    $(PIP) install --quiet "torch==$(TORCH_VERSION)"; \
	else \
	    echo "torch $(TORCH_VERSION): no NVIDIA GPU; the CPU build from $(TORCH_CPU_INDEX)"; \
	    $(PIP) install --quiet "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	fi
	@if nvidia-smi -L >/dev/null 2>&1 && $(PIP) show torch 2>/dev/null | grep -q '^Version: .*+cpu'; then \
	    echo "warning: this machine has an NVIDIA GPU but the torch wheel on its disk is a CPU build;"; \
	    echo "  for the GPU: $(PIP) install --force-reinstall torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cu128"; \
	fi
	@touch $@

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(None if sys.version_info >= (3, 10) else "ssm needs Python >= 3.10; $(PYTHON) is " + sys.version.split()[0] + ": make PYTHON=python3.X ...")'
	@echo "creating $(VENV) with $$($(PYTHON) --version)"
	@$(PYTHON) -m venv $(VENV)
