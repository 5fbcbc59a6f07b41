"""Record golden traces with KV events from upstream SGLang (tests/corpus/upstream-events).

Usage (with the upstream virtualenv's python, uniradix importable there):

    python scripts/record-upstream-events.py OUT_DIR "CONFIG..." FIRST-LAST [STEPS]

For each config (conformance/explore/driver.py's CONFIG_NAMES) and seed it runs the scheduler-like
driver against 0.5.13.post1's ``UnifiedRadixCache`` with its KV-event mixin on (every upstream
adapter turns it on: conformance/adapters/upstream.py, upstream_host.py, upstream_hybrid.py,
upstream_host_aux.py) and writes OUT_DIR/<config>-s<seed, 3 digits>.jsonl: every step with
its ``ret`` and the events upstream emitted during it (docs/TRACE.md, "KV events"), the header
with ``event_key_mode: "compat"``. It is ``python -m uniradix.conformance.explore.driver --impl upstream
--config C --seed K --steps N --events`` (or ``uniradix record --impl upstream --workload random
--events ...``) per trace, in one process (sglang is imported once).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    out, configs, seeds = argv[0], argv[1].split(), argv[2]
    steps = int(argv[3]) if len(argv) == 4 else 300
    first, last = (int(x) for x in seeds.split("-"))
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.explore.driver import _source, make_config, record
    from uniradix.conformance.traces.events import event_source
    from uniradix.conformance.traces.trace import dump_trace, make_header

    os.makedirs(out, exist_ok=True)
    for name in configs:
        for seed in range(first, last + 1):
            config = make_config(name, seed)
            adapter = make_adapter("upstream", config)
            mode = event_source(adapter).key_mode
            trace = record(adapter, config, seed, steps, events=True)
            header = make_header(config, _source("upstream", adapter, name, seed), seed=seed,
                                 event_key_mode=mode)
            path = os.path.join(out, f"{name}-s{seed:03d}.jsonl")
            dump_trace(path, header, trace)
            n = sum(len(s["events"]) for s in trace)
            print(f"{path}: {len(trace)} steps, {n} events", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
