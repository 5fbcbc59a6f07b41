"""The tiny storage universes of ``uniradix check --exhaustive`` (conformance/explore/exhaustive_storage.py):
every state reachable within a small depth satisfies the spec's invariants, and the dedup key
sees the storage environment."""

from __future__ import annotations

from uniradix.conformance.explore.exhaustive import parse_universe
from uniradix.conformance.explore.exhaustive_storage import (
    STORAGE_UNIVERSES,
    StorageSpecAdapter,
    explore_storage,
)


def test_storage_universe_depth_3_is_clean():
    u = STORAGE_UNIVERSES["storage-p1"]
    res = explore_storage(u, ["spec", "spec"], depth=3, progress=False)
    assert res.finding is None, str(res.finding)
    assert res.complete and res.states > 100
    assert parse_universe("storage-p1") is u


def test_fingerprint_sees_the_environment():
    u = STORAGE_UNIVERSES["storage-p1"]
    a, b = StorageSpecAdapter(u.config()), StorageSpecAdapter(u.config())
    for ad in (a, b):
        ad.apply({"i": 0, "op": "prefetch_from_storage",
                  "args": {"rid": "p0", "node": {"tokens": []}, "tokens": [1, 1]}})
    assert a.snapshot() == b.snapshot() and a.fingerprint() == b.fingerprint()
    a.apply({"i": 1, "op": "storage_query", "args": {"count": 1}})  # revoked: queues change
    b.apply({"i": 1, "op": "storage_tick", "args": {"ticks": 0}})
    assert a.fingerprint() != b.fingerprint()
