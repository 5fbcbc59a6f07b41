#!/usr/bin/env bash
# GPU check and benchmark of the HiCache copy kernels, in one command that fits a 10-minute slot
# on a bare GPU machine with no network:
#   1. pick a Python that has a CUDA build of torch and triton (PYTHON, else python3); the
#      project's own venv holds the CPU build of torch, so it is not used; nothing is installed;
#   2. make `uniradix.kernels` importable from this checkout without installing it (a throwaway
#      folder with a `uniradix` package whose `kernels` links to kernels/);
#   3. run the kernel tests on the GPU (pinned host pool, side stream, events; skip with --no-tests);
#   4. run `python -m uniradix.kernels.bench` (its flags pass through: --quick, --json FILE).
# Usage: scripts/gpu-bench.sh [--no-tests] [--quick] [--json FILE]   (default JSON: bench-results/kernels-gpu.json)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}

run_tests=1
args=()
json_given=0
for a in "$@"; do
  case "$a" in
    --no-tests) run_tests=0 ;;
    --json|--json=*) json_given=1; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
[ "$json_given" = 1 ] || args+=(--json "$root/bench-results/kernels-gpu.json")

if ! "$py" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu-bench: no torch in this Python; set PYTHON to one with a CUDA build of torch and triton")
if not torch.cuda.is_available():
    sys.exit(f"gpu-bench: torch {torch.__version__} sees no CUDA device; this needs a GPU and a CUDA build of torch")
try:
    import triton
except ImportError:
    sys.exit("gpu-bench: triton is not importable; it comes with CUDA builds of torch")
print(f"gpu-bench: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
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
unset TRITON_INTERPRET
cd "$root"

if [ "$run_tests" = 1 ]; then
  echo "gpu-bench: kernel tests on the GPU"
  timeout 240 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels.py
fi
echo "gpu-bench: benchmark"
timeout 480 "$py" -m uniradix.kernels.bench "${args[@]}"
