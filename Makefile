# Two entry points (README.md): `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: run test bench check nightly install upstream-venv corpus gpu-bench clean

# Editable: the tests and commands always run the working tree (fast/_core.c is rebuilt when it
# or the build files change).
$(VENV)/.installed: pyproject.toml setup.py fast/_core.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first, where none is present (any other torch spec pulls a multi-GB CUDA build)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/uniradix run --json bench-results/run.json

test: install
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); ($$S apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || echo "libibverbs1 could not be installed: the Mooncake tests will skip"; }
	$(PY) -m pytest -q

bench: install
	mkdir -p bench-results
	$(PY) -m pytest tests/bench --benchmark-enable --benchmark-only --benchmark-json=bench-results/bench.json -q

# Bounded exhaustive exploration, spec and fast in lockstep (docs/CHECKS.md).
check: install
	$(VENV)/bin/uniradix check --exhaustive --jobs 2

# The Hypothesis lockstep machine with the CrossHair backend, 2,000 runs of 200 steps.
nightly: install
	$(PY) -m pytest tests/test_nightly.py --hypothesis-profile=nightly -q

# On a GPU machine: kernel tests on the GPU, then GB/s of the HiCache copy kernels
# (docs/KERNELS.md); needs no network, under 10 minutes.
gpu-bench:
	scripts/gpu-bench.sh

# Throwaway virtualenv with upstream sglang 0.5.13.post1 (never a project dependency).
upstream-venv:
	scripts/upstream-venv.sh .venv-upstream

# Re-record the golden corpus from upstream (see tests/corpus/upstream/README.md).
corpus: upstream-venv
	scripts/record-upstream.sh .venv-upstream tests/corpus/upstream

clean:
	rm -rf $(VENV) build *.egg-info bench-results
