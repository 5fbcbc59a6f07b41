#!/usr/bin/env bash
# GPU check and benchmark of the HiCache copy kernels, in one command that fits a 10-minute slot
# on a bare GPU machine with no network:
#   1. pick a Python that has a CUDA build of torch and triton (PYTHON, else python3); the
#      project's own venv holds the CPU build of torch, so it is not used; nothing is installed;
#   2. make `uniradix` importable from this checkout without installing it (a throwaway folder
#      with a `uniradix` package whose kernels, spec and conformance link to this checkout and
#      whose fast links to fast/'s files), and build fast's C core for this Python into that
#      folder (at most 30 s; where it cannot be built, fast runs its pure-Python code and the
#      scheduler JSON says so in "fast_core");
#   3. run the kernel tests on the GPU (pinned host pool, side stream, events; at most 120 s;
#      skip with --no-tests); a failure is reported and the benchmark still runs;
#   4. run `python -m uniradix.kernels.bench` (its flags pass through: --quick, --json FILE,
#      --budget SECONDS; the budget defaults to 180 s here, under a 230 s timeout);
#   (0. with --wheels DIR: install the wheels of DIR, made by scripts/gpu-wheels.sh on a machine
#      with network, into a throwaway folder on PYTHONPATH, without network or dependencies, so
#      sglang 0.5.13.post1 imports and step 5 measures upstream beside fast; at most 30 s)
#   5. run the scheduler loop of `uniradix bench` with the cache's index tensors (the loop's
#      slots and the KV allocator) on the GPU, `--device cuda`, fast beside upstream where
#      sglang imports in this Python (else fast alone: the JSON's "not_measured" says why), 3
#      alternating rounds: shared-prefix, 1,000 requests, pages 1 and 16 (a 45 s budget under a
#      70 s timeout; bench-results/scheduler-cuda.json), then the first 500 Mooncake requests,
#      page 16 (a 40 s timeout; bench-results/scheduler-cuda-mooncake.json); `uniradix dashboard
#      --add` reads both (configuration "+cuda"); where sglang imports, last the production
#      setting: both caches over sglang's own allocators with CUDA tensors (`--allocator
#      sglang`), 1,000 Mooncake requests, pages 1 and 16, 2 rounds (a 40 s budget under a 60 s
#      timeout; bench-results/scheduler-cuda-sglang.json); skip with --no-sched.
# The steps' timeouts add up to under 10 minutes (30 + 30 + 120 + 230 + 70 + 40 + 60 s, plus
# the checks).
# Usage: scripts/gpu-bench.sh [--no-tests] [--no-sched] [--quick] [--json FILE] [--budget S]
#        [--wheels DIR] [--cpu-smoke]
#        (--cpu-smoke: no GPU needed; runs this script's steps on the CPU, Triton interpreted,
#         the scheduler step with --device cpu on 60 requests, to bench-results/scheduler-cpu.json)
#        (default JSON: bench-results/kernels-gpu.json)
# Exit status: non-zero when the tests or the benchmark's result checks failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
# a path relative to the caller's folder still names the same Python after the `cd`s below
case "$py" in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac

run_tests=1
run_sched=1
args=()
json_given=0
budget_given=0
cpu_smoke=0
wheels=""
want_wheels=0
for a in "$@"; do
  if [ "$want_wheels" = 1 ]; then wheels=$a; want_wheels=0; continue; fi
  case "$a" in
    --wheels) want_wheels=1 ;;
    --wheels=*) wheels=${a#--wheels=} ;;
    --cpu-smoke) cpu_smoke=1; args+=("$a") ;;
    --no-tests) run_tests=0 ;;
    --no-sched) run_sched=0 ;;
    --json|--json=*) json_given=1; args+=("$a") ;;
    --budget|--budget=*) budget_given=1; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
[ "$want_wheels" = 0 ] || { echo "gpu-bench: --wheels needs a folder" >&2; exit 2; }
[ "$json_given" = 1 ] || args+=(--json "$root/bench-results/kernels-gpu.json")
[ "$budget_given" = 1 ] || args+=(--budget 180)

if ! GPU_BENCH_CPU_SMOKE=$cpu_smoke "$py" - <<'EOF'
import os, sys
try:
    import torch
except ImportError:
    sys.exit("gpu-bench: no torch in this Python; set PYTHON to one with a CUDA build of torch and triton")
if not torch.cuda.is_available() and os.environ["GPU_BENCH_CPU_SMOKE"] != "1":
    sys.exit(f"gpu-bench: torch {torch.__version__} sees no CUDA device; this needs a GPU and a CUDA build of torch")
try:
    import triton
except ImportError:
    sys.exit("gpu-bench: triton is not importable; it comes with CUDA builds of torch")
where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU smoke run"
print(f"gpu-bench: {where}, torch {torch.__version__}, triton {triton.__version__}, "
      f"python {sys.version.split()[0]}")
EOF
then
  exit 1
fi

shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
if [ -n "$wheels" ]; then
  ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "gpu-bench: no wheels in $wheels (scripts/gpu-wheels.sh makes them)"; exit 2; }
  if timeout 30 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$shim/site" "$wheels"/*.whl >"$shim/pip.log" 2>&1; then
    export PYTHONPATH="$shim/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu-bench: $(ls "$wheels"/*.whl | wc -l) wheels of $wheels installed for this run"
  else
    echo "gpu-bench: installing the wheels of $wheels failed; upstream will be missing:"
    tail -5 "$shim/pip.log"
  fi
fi
mkdir -p "$shim/uniradix/fast"
: > "$shim/uniradix/__init__.py"
for p in kernels spec conformance; do ln -s "$root/$p" "$shim/uniradix/$p"; done
for f in "$root"/fast/*; do
  case "$f" in *.so) ;; *) ln -s "$f" "$shim/uniradix/fast/" ;; esac  # (a core of another Python)
done
if (cd "$shim" && timeout 30 "$py" -c '
import sys
from setuptools import Extension, setup
setup(script_args=["-q", "build_ext", "--build-lib", "ext", "--build-temp", "tmp"],
      ext_modules=[Extension("uniradix.fast._core", [sys.argv[1]])])' "$root/fast/_core.c" \
    >/dev/null 2>&1) && cp "$shim"/ext/uniradix/fast/_core*.so "$shim/uniradix/fast/" 2>/dev/null; then
  echo "gpu-bench: fast's C core built for this Python"
else
  echo "gpu-bench: fast's C core could not be built for this Python; fast uses one already" \
       "installed for it, else its pure-Python code (the scheduler JSON's fast_core says which)"
fi
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$cpu_smoke" = 1 ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
cd "$root"

tests_rc=0
if [ "$run_tests" = 1 ]; then
  echo "gpu-bench: kernel tests on the GPU (slow ones included)"
  timeout 120 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_kernels.py || tests_rc=$?
  [ "$tests_rc" = 0 ] || echo "gpu-bench: kernel tests FAILED or timed out (status $tests_rc); benchmarking anyway"
fi
echo "gpu-bench: benchmark"
bench_rc=0
timeout 230 "$py" -m uniradix.kernels.bench "${args[@]}" || bench_rc=$?
[ "$bench_rc" = 0 ] || echo "gpu-bench: benchmark exited with status $bench_rc"

sched_rc=0
if [ "$run_sched" = 1 ]; then
  if [ "$cpu_smoke" = 1 ]; then
    device=cpu; sched=(--workload shared-prefix,mooncake --page-size 16 --requests 60 --repeat 1)
  else
    device=cuda; sched=(--workload shared-prefix --page-size 1,16 --requests 1000 --repeat 3)
  fi
  sched_json="$root/bench-results/scheduler-$device.json"
  echo "gpu-bench: scheduler loop with the cache's index tensors on $device"
  rm -f "$sched_json"
  timeout 70 "$py" -m uniradix.conformance.bench.loop --impl fast,upstream --device "$device" \
    "${sched[@]}" --budget 45 --json "$sched_json" || sched_rc=$?
  if [ "$cpu_smoke" != 1 ]; then
    timeout 40 "$py" -m uniradix.conformance.bench.loop --impl fast,upstream --device "$device" \
      --workload mooncake --page-size 16 --requests 500 --repeat 3 \
      --json "$root/bench-results/scheduler-$device-mooncake.json" || sched_rc=$?
    if "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"; then
      timeout 60 "$py" -m uniradix.conformance.bench.loop --impl fast,upstream --device "$device" \
        --allocator sglang --workload mooncake --page-size 1,16 --requests 1000 --repeat 2 \
        --budget 40 --json "$root/bench-results/scheduler-$device-sglang.json" || sched_rc=$?
    else
      echo "gpu-bench: sglang does not import here: no run over its allocators (--wheels DIR)"
    fi
  fi
  [ "$sched_rc" = 0 ] || echo "gpu-bench: scheduler bench exited with status $sched_rc"
  "$py" - "$sched_json" <<'EOF' || true
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(f"gpu-bench: no scheduler JSON at {sys.argv[1]}")
missing = d.get("not_measured", {})
print(f"gpu-bench: {sys.argv[1]}: fast on its {d.get('fast_core')} core, "
      + ("fast alone (" + "; ".join(f"{k}: {v}" for k, v in missing.items()) + ")"
         if missing else "fast and upstream side by side"))
EOF
fi
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$sched_rc" = 0 ]
