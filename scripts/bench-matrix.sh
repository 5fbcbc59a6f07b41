#!/usr/bin/env bash
# Every bench configuration in one command (issue 15 item 4): `uniradix bench --matrix` (Full,
# SWA, Mamba, Full+SWA+Mamba, the host tier write-through and write-back, and the host tier
# with SWA and with Mamba) on shared-prefix and Mooncake, pages 1 and 16, fast beside upstream
# 0.5.13.post1's Python cache and its C++ tree (a speed peer, Full only) in one process,
# alternating rounds, torch pinned to one thread, outcomes checked identical; `--memory` adds
# bytes per cached token of every configuration.  What an implementation refuses is recorded
# with the reason (conformance/bench/configs.py).  Then the JSON is filed for the dashboard
# (`uniradix dashboard --add`, bench-results/history/ and bench-results/dashboard.html).
#
# Runs under the upstream venv's Python (PYTHON, default .venv-upstream/bin/python: upstream
# is measured only where sglang imports), at low priority (nice -n 10).
# Usage: scripts/bench-matrix.sh [extra `uniradix bench` flags, e.g. --budget 1200]
#   REQUESTS (default 500: the scaled shared-prefix workload and the first N Mooncake
#   requests), REPEAT (default 3), MEMORY_REQUESTS (default 100), OUT (default
#   bench-results/matrix.json), IMPLS (default fast,upstream,upstream-cpp)
# Exit status: the bench's (1 when an outcome differed), else the dashboard's.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv-upstream/bin/python}
out=${OUT:-bench-results/matrix.json}
cd "$root" || exit 2
mkdir -p "$(dirname "$out")"
nice -n 10 "$py" -m uniradix.conformance.bench.loop --matrix \
    --impl "${IMPLS:-fast,upstream,upstream-cpp}" --workload shared-prefix,mooncake \
    --page-size 1,16 --requests "${REQUESTS:-500}" --repeat "${REPEAT:-3}" \
    --memory --memory-requests "${MEMORY_REQUESTS:-100}" --json "$out" "$@"
status=$?
if [ -f "$out" ]; then
    "$py" -m uniradix.conformance.bench.dashboard --add "$out"
    dashboard=$?
    [ "$status" -eq 0 ] && status=$dashboard
fi
exit "$status"
