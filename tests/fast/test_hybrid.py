"""The SWA and Mamba components (spec/components.py, fast/hybrid.py), rule by rule.

Each story runs its steps on the spec and on the fast path side by side (same observations,
same canonical snapshot, no invariant violated after any step) and checks the observations
against values worked out by hand from the rules; the comments show the working.

Pool reminder: page 0 is reserved and pools are lowest-first, so with page_size 1 the first
``alloc(n)`` returns ``[1 .. n]``, and with SWA it takes SWA slots ``[1 .. n]`` too.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from stories import Pair
from uniradix import fast
from uniradix.conformance.explore.machine import draw_hybrid_config, make_machine
from uniradix.fast import cache as cache_mod

SWA = dict(components=("full", "swa"), kv_slots=32, swa_slots=32, sliding_window=4)
MAMBA = dict(components=("full", "mamba"), kv_slots=32, mamba_slots=4, mamba_cache_chunk_size=4)


class Both(Pair):
    """A spec adapter and a fast adapter stepped together. (tests/stories.py ``Pair``)"""

    def node(self, tokens: list) -> dict:
        return {"tokens": tokens, "extra_key": None}

    def aux(self, name: str) -> dict:
        """Path length -> the component's value on that node."""
        return {len(n["path"]["tokens"]): n[name]["value"] for n in self.spec.snapshot()["nodes"]}


T6, T9 = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]


def two_nodes(c: Both) -> None:
    """A = [1..6] (slots 1..6), B = A + [7, 8, 9] (slots 7..9); SWA data on both."""
    assert c("alloc", n=6) == {"slots": T6, "swa_slots": T6}
    c("insert", tokens=T6, value=T6)
    assert c("alloc", n=3) == {"slots": [7, 8, 9], "swa_slots": [7, 8, 9]}
    c("insert", tokens=T9, value=T9, prev_prefix_len=6)


# ----------------------------------------------------------------------------------------------
# SWA
# ----------------------------------------------------------------------------------------------


def test_swa_tombstone_is_evicted_oldest_first_and_breaks_the_window():
    c = Both(**SWA)
    two_nodes(c)
    assert c.aux("swa") == {6: T6, 9: [7, 8, 9]}
    # SWA list, oldest first: A (touched by the second insert), then the new leaf B.  One SWA
    # unit asked: A is not a device leaf (B holds Full data), so it becomes a tombstone.
    assert c("evict", num_tokens=0, swa_num_tokens=1) == {
        "num_tokens_evicted": 0, "swa_num_tokens_evicted": 6, "freed": [], "swa_freed": T6}
    assert c.aux("swa") == {6: None, 9: [7, 8, 9]}
    # A match needs 4 contiguous SWA units: A resets the run to 0, B brings it to 3 only.
    m = c("match_prefix", tokens=T9, extra_key=None)
    assert (m["device_indices"], m["last_device_node"]) == ([], 0)
    assert c("sizes") == {"full_evictable": 9, "full_protected": 0, "swa_evictable": 3,
                          "swa_protected": 0}


def test_swa_window_lock_stops_at_its_boundary_and_skips_tombstones():
    c = Both(**SWA)
    two_nodes(c)
    # B holds 3 < 4 SWA units, so the lock goes on to A (3 + 6 >= 4): both SWA-locked.
    assert c("lock", node=c.node(T9)) == {"handle": 4}  # steps 0..3 were two_nodes
    assert c("sizes")["swa_protected"] == 9
    c("unlock", handle=4)
    assert c("sizes")["swa_protected"] == 0
    c("evict", num_tokens=0, swa_num_tokens=1)  # A becomes a tombstone (as above)
    # Now the lock skips A and reaches the root without filling the window: B alone.
    c("lock", node=c.node(T9))
    assert c("sizes")["swa_protected"] == 3
    # A locked SWA node is never a victim: B is locked, A has no SWA data: nothing to evict.
    assert c("evict", num_tokens=0, swa_num_tokens=5)["swa_num_tokens_evicted"] == 0


def test_swa_insert_restores_a_tombstone_from_the_callers_slots():
    c = Both(**SWA)
    two_nodes(c)
    c("evict", num_tokens=0, swa_num_tokens=1)  # A: SWA tombstone, Full slots 1..6 kept
    # Lowest-first: full slots 10..15 (1..9 are the tree's); SWA slots 1..6 are free again.
    assert c("alloc", n=6) == {"slots": [10, 11, 12, 13, 14, 15], "swa_slots": T6}
    # The caller computed A's tokens itself (prev_prefix_len 0): A takes the fresh slots, its
    # old full slots go back (their SWA slots went with the tombstone), nothing else is freed.
    r = c("insert", tokens=T6, value=[10, 11, 12, 13, 14, 15])
    assert r == {"prefix_len": 6, "freed": T6, "swa_freed": []}
    assert c.aux("swa") == {6: T6, 9: [7, 8, 9]}
    m = c("match_prefix", tokens=T9, extra_key=None)
    assert m["device_indices"] == [10, 11, 12, 13, 14, 15, 7, 8, 9]


def test_swa_evicted_seqlen_skips_a_leaf_outside_the_window_and_splits_one_across_it():
    c = Both(**SWA)
    c("alloc", n=6)
    # The window starts at 6: the whole new leaf lies before it; no leaf, its slots freed.
    r = c("insert", tokens=T6, value=T6, swa_evicted_seqlen=6)
    assert r == {"prefix_len": 0, "freed": T6, "swa_freed": T6}
    assert c.spec.snapshot()["nodes"] == []
    c("alloc", n=6)
    # The window starts at 2: the leaf is split there; [1, 2] is born a tombstone.
    c("insert", tokens=T6, value=T6, swa_evicted_seqlen=2)
    assert c.aux("swa") == {2: None, 6: [3, 4, 5, 6]}
    assert c("sizes")["swa_evictable"] == 4


def test_swa_leaf_eviction_frees_full_and_swa_slots():
    c = Both(**SWA)
    two_nodes(c)
    # Full drives first: the oldest device leaf is B (A has a child with Full data); its 3
    # units are enough, and its SWA slots go with it.
    assert c("evict", num_tokens=3, swa_num_tokens=0) == {
        "num_tokens_evicted": 3, "swa_num_tokens_evicted": 3, "freed": [7, 8, 9],
        "swa_freed": [7, 8, 9]}


# ----------------------------------------------------------------------------------------------
# Mamba
# ----------------------------------------------------------------------------------------------


def mamba_two_nodes(c: Both) -> None:
    """A = [1..6] with state 1, B = A + [7, 8, 9] with state 2."""
    assert c("mamba_alloc", n=2) == {"slots": [1, 2]}
    c("alloc", n=6)
    assert c("insert", tokens=T6, value=T6, mamba_value=[1])["mamba_exist"] is False
    c("alloc", n=3)
    c("insert", tokens=T9, value=T9, prev_prefix_len=6, mamba_value=[2])


def test_mamba_state_on_the_new_leaf_and_mamba_exist_when_the_node_has_one():
    c = Both(**MAMBA)
    mamba_two_nodes(c)
    assert c.aux("mamba") == {6: [1], 9: [2]}
    c("mamba_alloc", n=1)  # slot 3
    # Everything is cached already and B has a state: the caller keeps slot 3.
    r = c("insert", tokens=T9, value=T9, prev_prefix_len=9, mamba_value=[3])
    assert r == {"prefix_len": 9, "mamba_exist": True, "freed": [], "mamba_freed": []}
    assert c.aux("mamba") == {6: [1], 9: [2]}
    # An empty key caches nothing: the caller keeps its slot too.
    assert c("insert", tokens=[], value=[], mamba_value=[3])["mamba_exist"] is True


def test_mamba_match_stops_at_a_node_with_a_state_and_reports_branching_seqlen():
    c = Both(**MAMBA)
    mamba_two_nodes(c)
    # [1..8] ends inside B: B is split at 8; the upper part [7, 8] has no state (it stays on
    # the lower part), so the match stops at A.  The walk went past A: 8 units, chunk 4 -> 8.
    m = c("match_prefix", tokens=[1, 2, 3, 4, 5, 6, 7, 8], extra_key=None)
    assert (m["device_indices"], m["last_device_node"], m["mamba_branching_seqlen"]) == \
        (T6, 6, 8)
    assert c.aux("mamba") == {6: [1], 8: None, 9: [2]}
    m = c("match_prefix", tokens=T9, extra_key=None)
    assert (m["last_device_node"], m["mamba_branching_seqlen"]) == (9, None)


def test_mamba_eviction_tombstones_internal_states_and_lock_protects_one_node():
    c = Both(**MAMBA)
    mamba_two_nodes(c)
    assert c("lock", node=c.node(T9)) == {"handle": 5}  # steps 0..4 were mamba_two_nodes
    # Only B's state is locked; A's is the oldest unlocked one and A is internal: tombstone.
    assert c("sizes") == {"full_evictable": 0, "full_protected": 9, "mamba_evictable": 1,
                          "mamba_protected": 1}
    assert c("evict", num_tokens=0, mamba_num=2) == {
        "num_tokens_evicted": 0, "mamba_num_evicted": 1, "freed": [], "mamba_freed": [1]}
    c("unlock", handle=5)
    # B is a device leaf now: evicting its state takes the whole leaf.
    assert c("evict", num_tokens=0, mamba_num=1) == {
        "num_tokens_evicted": 3, "mamba_num_evicted": 1, "freed": [7, 8, 9], "mamba_freed": [2]}


# ----------------------------------------------------------------------------------------------
# Rejected steps: the same error type on both sides, nothing changed (Both checks snapshots)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, op, args, error", [
    (MAMBA, "insert", dict(tokens=T6, value=T6), "InvalidInput"),  # no mamba_value
    (MAMBA, "insert", dict(tokens=T6, value=T6, mamba_value=[4]), "InvalidInput"),  # not allocated
    (MAMBA, "insert", dict(tokens=T6, value=T6, mamba_value=[1, 2]), "InvalidInput"),
    (MAMBA, "mamba_free", dict(slots=[1]), "InvalidInput"),  # the tree's state slot
    (MAMBA, "evict", dict(num_tokens=0, mamba_num=-1), "InvalidInput"),
    (SWA, "insert", dict(tokens=T6, value=T6, mamba_value=[1]), "InvalidInput"),
    (SWA, "evict", dict(num_tokens=0, swa_num_tokens="2"), "InvalidInput"),
    (SWA, "mamba_alloc", dict(n=1), "Unsupported"),
])
def test_rejected_steps_change_nothing(cfg, op, args, error):
    c = Both(**cfg)
    c("alloc", n=6)
    if cfg is MAMBA:
        c("mamba_alloc", n=3)
        c("insert", tokens=[9, 9], value=[5, 6], mamba_value=[1])
    assert c(op, **args)["error"] == error


def test_swa_rejects_unaligned_window_start_and_prev_inside_a_tombstone():
    c = Both(**dict(SWA, page_size=2, kv_slots=32, swa_slots=32))
    c("alloc", n=6)
    assert c("insert", tokens=T6, value=T6, swa_evicted_seqlen=3)["error"] == "InvalidInput"
    c("insert", tokens=T6, value=T6, swa_evicted_seqlen=4)  # [1..4] tombstone, [5, 6] SWA
    c("alloc", n=4)  # slots 8..11
    # prev_prefix_len 2 lies inside the tombstone [1..4], which this insert would restore
    r = c("insert", tokens=[1, 2, 3, 4], value=[1, 2, 8, 9], prev_prefix_len=2)
    assert r["error"] == "InvalidInput"


def test_fast_dispatches_hybrid_configs_and_keeps_the_full_path():
    class Pool:
        mamba_allocator = object()

    class SwaAlloc:
        device = None

        def translate_loc_from_full_to_swa(self, x):
            return x

        def free_swa(self, x):
            pass

        def free(self, x):
            pass
    p = fast.CacheInitParams(disable=False, req_to_token_pool=Pool(),
                             token_to_kv_pool_allocator=SwaAlloc(), page_size=1,
                             tree_components=("full", "mamba"))
    hybrid = fast.UnifiedRadixCache(p)
    assert type(hybrid).__name__ == "HybridRadixCache"
    assert isinstance(hybrid, fast.UnifiedRadixCache)  # one type, whatever the params
    assert hybrid.core == "python" and "hybrid" in hybrid.core_reason
    p.tree_components, p.sliding_window_size = ("full", "swa"), 4
    swa = fast.UnifiedRadixCache(p)
    SwaAlloc.size = 16  # what init_hicache sizes the host pool from
    # a host tier with SWA needs the allocator's sides apart (a load back pairs them itself)
    with pytest.raises(fast.InvalidInput, match="full_attn_allocator"):
        swa.init_hicache(types.SimpleNamespace(hicache_ratio=2.0), p)
    assert swa.tier is None and type(swa).__name__ == "HybridRadixCache"  # unchanged
    p.tree_components = ("full",)
    full = fast.UnifiedRadixCache(p)
    assert type(full) is fast.UnifiedRadixCache
    assert full.core == ("c" if cache_mod.NATIVE else "python") and full.core_reason


# ----------------------------------------------------------------------------------------------
# The Hypothesis machine over hybrid configs
# ----------------------------------------------------------------------------------------------


def test_hybrid_machine_spec_vs_fast_is_clean():
    Machine = make_machine(["spec", "fast"], name="HybridMachine",
                           draw=draw_hybrid_config)
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=20, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


# ----------------------------------------------------------------------------------------------
# The hybrid benchmark loop (conformance/bench/hybrid.py) on a small workload
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_hybrid_bench_loop_runs(kind):
    from uniradix.conformance.bench.hybrid import compare_hybrid
    from uniradix.conformance.bench.loop import make_workload
    cmp = compare_hybrid(["fast", "spec"], make_workload("shared-prefix", 1, 150), kind,
                         repeats=1)
    (s,) = cmp.runs["fast"]
    assert "spec" in cmp.missing  # the spec's upstream-style wrapper is Full only
    assert s.requests + s.aborted == 150 and s.requests > 0 and s.requests_per_s > 0
    if kind == "swa":  # the scaled pool (and its half-size SWA pool) runs short
        assert s.evicted_tokens > 0
