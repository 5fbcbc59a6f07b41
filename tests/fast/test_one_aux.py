"""fast/one_aux.py: each one-component fast path against the general path it stands for.

Two fast adapters over the same recorded workload in lockstep: one cache runs the fast paths
``HybridRadixCache`` picks at construction, the other has them switched off (the general
paths: component hooks, separate walks).  Every step's observations, snapshots and invariants
must agree, and the two Full eviction heaps must hold the same entries (the fast paths push
the same ones in another order)."""

from __future__ import annotations

import pytest

from stories import replay_twins
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import COW_CONFIGS, make_config, record
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.fast.cache import _core
from uniradix.fast.hybrid import FAST_PATHS, HybridRadixCache


def heap_entries(cache: HybridRadixCache) -> list:
    """The Full heap's entries as (stamp, the node's keys from the top), sorted (node ids
    differ between two caches of one process)."""
    def path(node):
        out = []
        while node is not None:
            out.append((node.extra_key, tuple(node.key)))
            node = node.parent
        return tuple(reversed(out))
    return sorted((stamp, path(node)) for stamp, node in cache._heap)


def general_paths(adapter, names=FAST_PATHS):
    """``adapter`` with its cache's fast paths (the attributes ``names``) switched off before
    every step (a reset step builds a new cache)."""
    apply = adapter.apply

    def apply_general(step):
        for name in names:
            setattr(adapter.cache, name, None)
        return apply(step)

    adapter.apply = apply_general
    return adapter


@pytest.mark.parametrize("name,seed", [("swa-w8-p1", 1), ("swa-w8-p4", 2), ("swa-w32-p1", 3),
                                       ("mamba-p1", 4), ("mamba-cow-p1", 5)])
def test_fast_paths_equal_the_general_paths(name, seed):
    config = make_config(name, seed)
    steps = record(make_adapter("fast", config), config, seed, 300, check_violations=False,
                   cow=name in COW_CONFIGS)  # (copy-on-write matches: the general path)
    fast_one, general = make_adapter("fast", config), general_paths(make_adapter("fast", config))
    assert all(getattr(fast_one.cache, n) is not None for n in FAST_PATHS)
    ls = Lockstep([fast_one, general], ["fast paths", "general paths"], events=False)

    def same_heaps(step):
        assert heap_entries(fast_one.cache) == heap_entries(general.cache), step

    ops = set(replay_twins(ls, steps, same_heaps))
    assert all(getattr(general.cache, n) is None for n in FAST_PATHS)
    assert {"lock", "unlock", "insert", "match_prefix", "evict"} <= ops, ops


@pytest.mark.parametrize("name", ["full-swa-mamba-p1", "hicache-wt-p1", "host-swa-wt-p1"])
def test_other_shapes_run_the_general_paths(name):
    cache = make_adapter("fast", make_config(name, 1)).cache
    # (Full alone over a host tier: fast/host_full.py's match and insert,
    # tests/fast/test_host_fast_paths.py)
    # (one aux component over a host tier: fast/host_aux.py's match and locks,
    # tests/fast/test_host_aux_paths.py; its insert where the C core is built,
    # tests/fast/test_host_aux_insert_twin.py)
    # (SWA and Mamba together: the general match's pair branch and the general locks in C
    # where the core is built, tests/fast/test_pair_match.py, test_pair_locks.py; the general
    # evict written out, test_pair_evict.py; the whole insert in C, test_pair_insert_api.py)
    special = {"_match_fast", "_insert_fast", "_inc_lock_fast"} if name == "hicache-wt-p1" \
        else {"_match_fast", "_inc_lock_fast"} | ({"_insert_fast"} if _core is not None else set()) \
        if name == "host-swa-wt-p1" \
        else {"_match_fast", "_insert_fast", "_inc_lock_fast", "_dec_lock_fast", "_evict_fast"} \
        if _core is not None else {"_evict_fast"}
    assert all((getattr(cache, n, None) is None) == (n not in special) for n in FAST_PATHS)
    assert (cache._dec_lock_host is not None) == (name != "full-swa-mamba-p1")
