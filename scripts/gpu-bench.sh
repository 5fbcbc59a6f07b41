#!/usr/bin/env bash
# GPU check and benchmark of the HiCache copy kernels, in one command that fits a 10-minute slot
# on a bare GPU machine with no network:
#   1. pick a Python that has a CUDA build of torch and triton (PYTHON, else python3); the
#      project's own venv holds the CPU build of torch, so it is not used; nothing is installed;
#   2. make `uniradix.kernels` importable from this checkout without installing it (a throwaway
#      folder with a `uniradix` package whose `kernels` links to kernels/);
#   3. run the kernel tests on the GPU (pinned host pool, side stream, events; at most 150 s;
#      skip with --no-tests); a failure is reported and the benchmark still runs;
#   4. run `python -m uniradix.kernels.bench` (its flags pass through: --quick, --json FILE,
#      --budget SECONDS; the budget defaults to 330 s here so the whole script ends within 10 minutes).
# Usage: scripts/gpu-bench.sh [--no-tests] [--quick] [--json FILE] [--budget S] [--cpu-smoke]
#        (--cpu-smoke: no GPU needed; runs this script's steps on the CPU, Triton interpreted)
#        (default JSON: bench-results/kernels-gpu.json)
# Exit status: non-zero when the tests or the benchmark's result checks failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}

run_tests=1
args=()
json_given=0
budget_given=0
cpu_smoke=0
for a in "$@"; do
  case "$a" in
    --cpu-smoke) cpu_smoke=1; args+=("$a") ;;
    --no-tests) run_tests=0 ;;
    --json|--json=*) json_given=1; args+=("$a") ;;
    --budget|--budget=*) budget_given=1; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
[ "$json_given" = 1 ] || args+=(--json "$root/bench-results/kernels-gpu.json")
[ "$budget_given" = 1 ] || args+=(--budget 330)

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
mkdir -p "$shim/uniradix"
: > "$shim/uniradix/__init__.py"
ln -s "$root/kernels" "$shim/uniradix/kernels"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$cpu_smoke" = 1 ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
cd "$root"

tests_rc=0
if [ "$run_tests" = 1 ]; then
  echo "gpu-bench: kernel tests on the GPU (slow ones included)"
  timeout 150 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels.py || tests_rc=$?
  [ "$tests_rc" = 0 ] || echo "gpu-bench: kernel tests FAILED or timed out (status $tests_rc); benchmarking anyway"
fi
echo "gpu-bench: benchmark"
bench_rc=0
timeout 400 "$py" -m uniradix.kernels.bench "${args[@]}" || bench_rc=$?
[ "$bench_rc" = 0 ] || echo "gpu-bench: benchmark exited with status $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
