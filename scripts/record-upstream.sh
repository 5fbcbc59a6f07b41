#!/usr/bin/env bash
# Record golden traces from upstream SGLang's UnifiedRadixCache (Full component, device tier).
# Usage: scripts/record-upstream.sh [VENV] [OUT_DIR] [COUNT] [STEPS]
#   VENV     upstream virtualenv (default .venv-upstream; built by scripts/upstream-venv.sh if absent)
#   OUT_DIR  where the traces go (default tests/corpus/upstream)
#   COUNT    traces per config (default 24), seeds 1..COUNT
#   STEPS    steps per trace (default 400)
# Configs: full-p1, full-p4 (default), or CONFIGS="..." with any of conformance/explore/driver.py's
# CONFIG_NAMES (the hybrid models: swa-w8-p1 swa-w8-p4 swa-w32-p1 mamba-p1).
# Files: OUT_DIR/<config>-s<seed, 3 digits>.jsonl
# Every step is followed by upstream's sanity_check(); a violation fails the recording.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-upstream}
out=${2:-tests/corpus/upstream}
count=${3:-24}
steps=${4:-400}
configs=${CONFIGS:-"full-p1 full-p4"}

# (a bare `import sglang` fails: it imports torchvision, which the adapter stubs out)
if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import importlib.metadata as m; m.version("sglang")' 2>/dev/null; }; then
  scripts/upstream-venv.sh "$venv"
fi
if ! "$venv/bin/python" -c 'import uniradix.conformance.explore.driver' 2>/dev/null; then
  "$venv/bin/pip" install -q --no-deps -e .
fi

mkdir -p "$out"
for config in $configs; do
  for seed in $(seq 1 "$count"); do
    file=$(printf '%s/%s-s%03d.jsonl' "$out" "$config" "$seed")
    "$venv/bin/python" -m uniradix.conformance.explore.driver --impl upstream --config "$config" \
      --seed "$seed" --steps "$steps" --out "$file"
  done
done
echo "recorded $(ls "$out"/*.jsonl | wc -l) traces in $out ($(du -sh "$out" | cut -f1))"
