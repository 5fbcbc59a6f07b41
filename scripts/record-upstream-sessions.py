"""Record tests/corpus/upstream-sessions from upstream SGLang's request path with streaming
sessions (conformance/adapters/upstream_requests.py), in one process.

Usage (with the upstream virtualenv's python, uniradix importable there):

    python scripts/record-upstream-sessions.py OUT_DIR FIRST-LAST [STEPS]

e.g. ``python scripts/record-upstream-sessions.py tests/corpus/upstream-sessions 1-10 400``:
for each seed, ``sessions-p1`` and ``sessions-p4`` (``conform``'s configs, the pool size drawn
from the seed), written as OUT_DIR/<config>-s<seed, 3 digits>.jsonl.  The spec runs in lockstep
while the steps are drawn and upstream's sanity_check() runs after every step; a recording with
a finding is reported (no file) and the others go on.
"""

import sys

from uniradix.conformance.adapters.upstream_requests import SESSION_CONFIGS, record_sessions


def run(argv: list) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    out, seeds = argv[:2]
    steps = int(argv[2]) if len(argv) == 3 else 400
    first, last = (int(x) for x in seeds.split("-"))
    failed = 0
    for seed in range(first, last + 1):
        for config in SESSION_CONFIGS:
            path = f"{out}/{config}-s{seed:03d}.jsonl"
            try:
                rec = record_sessions(config, seed, steps, path)
                print(f"{path}: {len(rec)} steps")
            except Exception as e:  # noqa: BLE001 - a finding or an upstream crash: report, go on
                print(f"{path}: not recorded: {type(e).__name__}: {e}")
                failed += 1
    print(f"{failed} recordings failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
