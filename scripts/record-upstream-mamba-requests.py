"""Record tests/corpus/upstream-mamba-requests from upstream SGLang's request path for a Full +
Mamba cache, with and without the Mamba extra buffer
(conformance/adapters/upstream_requests.py ``MambaUpstreamRequestAdapter``), in one process.

Usage (with the upstream virtualenv's python, uniradix importable there):

    python scripts/record-upstream-mamba-requests.py OUT_DIR CONFIGS COUNT [STEPS]

e.g. ``python scripts/record-upstream-mamba-requests.py tests/corpus/upstream-mamba-requests
mamba-xbuf-p1,mamba-xbuf-p4 20 300``.  CONFIGS is comma-separated (``mamba-xbuf-p1``,
``mamba-xbuf-p4``, ``mamba``: ``conform``'s configs, the pool sizes drawn from the seed).  For
each config, seeds 1, 2, ... until COUNT traces are written (STEPS each, default 300), as
OUT_DIR/<config>-s<seed, 3 digits>.jsonl.  The spec runs in lockstep while the steps are drawn
and upstream's sanity_check() runs after every step; chunked prefill is kept page-aligned.  A
seed with a finding, or one that reaches a state where the spec departs from upstream on
purpose (docs/SPEC.md "The Mamba extra buffer"), is reported, writes no file, and the next seed
is tried.
"""

import sys
import time

from uniradix.conformance.adapters.upstream_requests import MAMBA_CONFIGS, record_mamba


def run(argv: list) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    out, configs, count = argv[0], argv[1].split(","), int(argv[2])
    steps = int(argv[3]) if len(argv) == 4 else 300
    unknown = [c for c in configs if c not in MAMBA_CONFIGS]
    if unknown:
        print(f"unknown config(s) {unknown}; known: {MAMBA_CONFIGS}", file=sys.stderr)
        return 2
    skipped = 0
    for name in configs:
        written, seed, t0 = 0, 0, time.monotonic()
        while written < count:
            seed += 1
            path = f"{out}/{name}-s{seed:03d}.jsonl"
            try:
                rec = record_mamba(name, seed, steps, path)
            except Exception as e:  # noqa: BLE001 - a finding, a departure or a crash: go on
                print(f"{path}: skipped: {type(e).__name__}: {str(e)[:300]}", flush=True)
                skipped += 1
                continue
            written += 1
            print(f"{path}: {len(rec)} steps", flush=True)
        print(f"{name}: {written} traces of {steps} steps, seeds 1..{seed}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    print(f"{skipped} seeds skipped")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
