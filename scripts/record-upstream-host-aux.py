"""Record golden traces of the host tier with SWA or Mamba from upstream SGLang, in one process.

Usage (with the upstream virtualenv's python, uniradix importable there):

    python scripts/record-upstream-host-aux.py OUT_DIR CONFIGS COUNT [STEPS] [TIMEOUT_S]

e.g. ``python scripts/record-upstream-host-aux.py tests/corpus/upstream-host-swa
host-swa-wt-p1,host-swa-wb-p1 20 300``.  CONFIGS is comma-separated (``host-{swa,mamba}-{wt,wb}-
p{1,4}``, conformance/explore/driver.py's HOST_AUX_NAMES).  For each config, seeds 1, 2, ... until COUNT
traces are written; STEPS default 300.  Each trace is what ``python -m
uniradix.conformance.explore.driver --impl upstream --config C --seed K --steps STEPS`` records
(upstream's sanity_check() after every step).  A seed upstream fails on (an assertion, a
sanity-check violation, a crash) or that runs past TIMEOUT_S seconds (default 20; a trace takes
a few; 0.5.13.post1's SWA and Mamba eviction can loop forever under write-back, docs/SPEC.md)
is reported, writes no file, and the next seed is tried.  Files: OUT_DIR/<config>-s<seed, 3
digits>.jsonl.
"""

import signal
import sys
import time

from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import RecordingError, _source, make_config, record
from uniradix.conformance.traces.trace import dump_trace, make_header


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run(argv: list) -> int:
    if len(argv) not in (3, 4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    out, configs, count = argv[0], argv[1], int(argv[2])
    steps = int(argv[3]) if len(argv) > 3 else 300
    timeout = int(argv[4]) if len(argv) > 4 else 20
    signal.signal(signal.SIGALRM, _alarm)
    skipped = 0
    for name in configs.split(","):
        written, seed, t0 = 0, 0, time.monotonic()
        while written < count:
            seed += 1
            path = f"{out}/{name}-s{seed:03d}.jsonl"
            config = make_config(name, seed)
            adapter = make_adapter("upstream", config)
            signal.alarm(timeout)
            try:
                trace = record(adapter, config, seed, steps)
            except _Timeout:
                print(f"{path}: skipped, upstream ran past {timeout} s (a step that never ends)")
                skipped += 1
                continue
            except Exception as e:  # noqa: BLE001 - an upstream crash: report, try the next seed
                why = "rejected a step or broke an invariant" if isinstance(e, RecordingError) \
                    else "crashed"
                print(f"{path}: skipped, upstream {why}: {type(e).__name__}: {str(e)[:300]}")
                skipped += 1
                continue
            finally:
                signal.alarm(0)
            dump_trace(path, make_header(config, _source("upstream", adapter, name, seed),
                                         seed=seed), trace)
            written += 1
        print(f"{name}: {written} traces of {steps} steps, seeds 1..{seed}, "
              f"{time.monotonic() - t0:.0f} s")
    print(f"{skipped} seeds skipped")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
