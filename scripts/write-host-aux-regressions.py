"""Write the hand-made regression traces of the host tier with Mamba
(tests/corpus/regressions-host-aux/), the spec as the recorder: every step's ``ret`` is what
the spec answers.  Run from the repository root: ``python scripts/write-host-aux-regressions.py``.

Each trace walks into one upstream 0.5.13.post1 defect of this area (docs/SPEC.md, "The host
tier with Mamba") and ends with ``sizes`` and a full-tree probe, so a replay also shows that the
spec ended with nothing lost.
"""

from __future__ import annotations

import os

from uniradix.conformance.adapters import SpecAdapter
from uniradix.conformance.lockstep import comparable
from uniradix.conformance.trace import dump_trace, make_header
from uniradix.spec.config import CacheConfig

OUT = os.path.join("tests", "corpus", "regressions-host-aux")


def path(tokens: list) -> dict:
    return {"tokens": tokens, "extra_key": None}


def record(name: str, config: CacheConfig, source: str, steps: list) -> None:
    adapter = SpecAdapter(config)
    out = []
    for i, (op, args) in enumerate(steps):
        step = {"i": i, "op": op, "args": args}
        ret = comparable(adapter.apply(step))
        assert "error" not in ret, (name, step, ret)
        assert adapter.violations() == [], (name, step, adapter.violations())
        out.append(dict(step, ret=ret))
    dump_trace(os.path.join(OUT, name), make_header(config, source), out)
    print(f"wrote {os.path.join(OUT, name)} ({len(out)} steps)")


def insert(tokens: list, slots: list, m: int) -> tuple:
    return ("insert", {"tokens": tokens, "extra_key": None, "value": slots, "mamba_value": [m]})


def main() -> None:
    record(
        "host-mamba-wb-evict-passes-over-failed-backup.jsonl",
        CacheConfig(page_size=1, components=("full", "mamba"), kv_slots=16, host_slots=4,
                    mamba_slots=4, host_mamba_slots=4, write_policy="write_back"),
        "uniradix spec, hand-written: write-back with Mamba; the host pool is full of a backup "
        "whose node is back on the device, and the least recently used Mamba leaf cannot be "
        "backed up; a Mamba eviction passes it over, evicts the next leaf and ends (upstream "
        "0.5.13.post1 loops for ever on the first leaf)",
        [("alloc", {"n": 4}), ("mamba_alloc", {"n": 1}),
         insert([1, 2, 3, 4], [1, 2, 3, 4], 1),
         ("evict", {"num_tokens": 4}),
         ("alloc", {"n": 2}), ("mamba_alloc", {"n": 1}),
         insert([9, 10], [1, 2], 1),
         ("match_prefix", {"tokens": [1, 2, 3, 4], "extra_key": None}),
         ("load_back", {"node": path([1, 2, 3, 4]), "last_device_node": path([]),
                        "mem_quota": None}),
         ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
         ("evict", {"num_tokens": 0, "mamba_num": 1}),
         ("evict", {"num_tokens": 0, "mamba_num": 5}),
         ("sizes", {}),
         ("evict", {"num_tokens": 16})])
    record(
        "host-mamba-load-back-with-every-state-locked.jsonl",
        CacheConfig(page_size=1, components=("full", "mamba"), kv_slots=16, host_slots=32,
                    mamba_slots=2, host_mamba_slots=4, write_through_threshold=1),
        "uniradix spec, hand-written: write-through with Mamba; a node's state is on the host "
        "only and both device state slots are locked by pending write-through acks; its load "
        "back fails and changes nothing, and succeeds once the writes are acked (upstream "
        "0.5.13.post1 fails an assertion)",
        [("alloc", {"n": 3}), ("mamba_alloc", {"n": 1}),
         insert([1, 2, 3], [1, 2, 3], 1),
         ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
         ("evict", {"num_tokens": 3}),
         ("alloc", {"n": 2}), ("mamba_alloc", {"n": 1}), insert([5, 6], [1, 2], 1),
         ("alloc", {"n": 2}), ("mamba_alloc", {"n": 1}), insert([7, 8], [3, 4], 2),
         ("match_prefix", {"tokens": [1, 2, 3], "extra_key": None}),
         ("load_back", {"node": path([1, 2, 3]), "last_device_node": path([]),
                        "mem_quota": None}),
         ("sizes", {}),
         ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
         ("match_prefix", {"tokens": [1, 2, 3], "extra_key": None}),
         ("load_back", {"node": path([1, 2, 3]), "last_device_node": path([]),
                        "mem_quota": None}),
         ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
         ("sizes", {}),
         ("evict", {"num_tokens": 16, "mamba_num": 2})])


if __name__ == "__main__":
    main()
