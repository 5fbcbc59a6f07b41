# Two entry points (README.md): `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: run test lint bench check nightly install browser ibverbs upstream-venv corpus gpu-bench clean

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
	$(VENV)/bin/uniradix run --json bench-results/run.json --dashboard bench-results/dashboard.html

# The default suite on TEST_JOBS pytest-xdist workers (default 2, CI's cores), a test file per
# worker (module fixtures run once); TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 2
test: install browser ibverbs lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

# ruff over the tree, then mypy over the four packages, both reported before either fails the
# target (docs/LINT.md; settings in pyproject.toml). mypy reads the packages by their installed
# names from links under build/typecheck/uniradix/; its report names files by their repo paths.
lint: install
	@mkdir -p build/typecheck/uniradix
	@for p in spec fast kernels conformance; do ln -sfn ../../../$$p build/typecheck/uniradix/$$p; done
	@rc=0; echo "$(VENV)/bin/ruff check ."; $(VENV)/bin/ruff check . || rc=1; \
	  echo "$(VENV)/bin/mypy"; out=$$($(VENV)/bin/mypy 2>&1) || rc=1; \
	  printf '%s\n' "$$out" | sed 's#^build/typecheck/uniradix/##'; exit $$rc

# Headless Chromium for tests/conformance/bench/test_dashboard_browser.py: Debian's package, installed only where
# no chromium is on PATH (as root, with apt-get; otherwise the browser test skips and says why).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing Debian's chromium for the dashboard's browser test"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium fonts-dejavu-core >/dev/null; \
	else \
	  echo "make: no chromium and no root apt-get to install it: the browser test will skip"; \
	fi

# Debian's libibverbs1, which the Mooncake store's wheel links against (tests/fast/storage/test_mooncake_store.py),
# installed only where the loader cannot find it.
ibverbs:
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); ($$S apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || echo "libibverbs1 could not be installed: the Mooncake tests will skip"; }

bench: install
	mkdir -p bench-results
	$(PY) -m pytest tests/bench --benchmark-enable --benchmark-only --benchmark-json=bench-results/bench.json -q
	$(VENV)/bin/uniradix dashboard --results bench-results/history --add bench-results/bench.json --out bench-results/dashboard.html

# Bounded exhaustive exploration, spec and fast in lockstep (docs/CHECKS.md).
check: install
	$(VENV)/bin/uniradix check --exhaustive --jobs 2

# The Hypothesis lockstep machine with the CrossHair backend, 2,000 runs of 200 steps.
# The seed rotates with the date (NIGHTLY_SEED=N to repeat a night): seeds no run has used find
# what the fixed ones no longer do.  A finding's shrunk trace goes to nightly-findings/.
NIGHTLY_SEED    ?= $(shell date -u +%Y%m%d)
NIGHTLY_SECONDS ?= 1200
nightly: install
	$(PY) -m pytest tests/conformance/explore/test_nightly.py --hypothesis-profile=nightly -q
	$(VENV)/bin/uniradix conform --impls spec,fast --check-kv --no-progress \
	    --seconds $(NIGHTLY_SECONDS) --seed $(NIGHTLY_SEED) --out nightly-findings
	UNIRADIX_PURE_PYTHON=1 $(VENV)/bin/uniradix conform --impls spec,fast --check-kv --no-progress \
	    --seconds $(NIGHTLY_SECONDS) --seed $$(( $(NIGHTLY_SEED) + 1 )) --out nightly-findings

# On a GPU machine: kernel tests on the GPU, then GB/s of the HiCache copy kernels
# (docs/KERNELS.md); needs no network, under 10 minutes.
# (GPU_BENCH_ARGS="--wheels .whl --budget 180" brings sglang along: docs/KERNELS.md)
gpu-bench:
	scripts/gpu-bench.sh $(GPU_BENCH_ARGS)

# Throwaway virtualenv with upstream sglang 0.5.13.post1 (never a project dependency).
upstream-venv:
	scripts/upstream-venv.sh .venv-upstream

# Re-record the golden corpus from upstream (see tests/corpus/upstream/README.md).
corpus: upstream-venv
	scripts/record-upstream.sh .venv-upstream tests/corpus/upstream

clean:
	rm -rf $(VENV) build *.egg-info bench-results
