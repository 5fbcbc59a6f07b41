"""Full + SWA + Mamba in one tree (spec/components.py with both aux components at once).

Hand-worked stories on the spec (tests/stories.py: invariants after every step, a rejected step
changes nothing), then the Hypothesis machine over drawn configs.  Upstream 0.5.13.post1 runs
the same tree-level scenarios in tests/conformance/adapters/test_upstream_hybrid.py.

Pool reminder: page 0 is reserved and pools are lowest-first, so with page_size 1 the first
``alloc(n)`` returns ``[1 .. n]`` and takes SWA slots ``[1 .. n]`` too.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from stories import Story
from uniradix.conformance.explore.machine import draw_swa_mamba_config, make_machine
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError

BOTH = dict(components=("full", "swa", "mamba"), kv_slots=32, swa_slots=32, sliding_window=2,
            mamba_slots=4, mamba_cache_chunk_size=1)


def paths(order: list) -> list:
    return [o["tokens"] for o in order]


def test_config_takes_both_aux_components_in_either_order():
    """Upstream keeps ``tree_components`` in the order given and runs every hook in it, so
    both orders of the two aux components are configs of their own."""
    for order in (["full", "swa", "mamba"], ["full", "mamba", "swa"]):
        c = CacheConfig.from_dict({"components": order, "sliding_window": 4,
                                   "swa_slots": 8, "mamba_slots": 2, "kv_slots": 8})
        assert c.components == tuple(order)
    for bad in (["swa", "mamba"], ["full", "swa", "mamba", "swa"], ["mamba", "full", "swa"]):
        with pytest.raises(ConfigError, match="components must be one of"):
            CacheConfig.from_dict({"components": bad, "sliding_window": 4})
    with pytest.raises(ConfigError, match="sliding_window"):
        CacheConfig.from_dict({"components": ["full", "swa", "mamba"]})


def two_level(s: Story) -> None:
    """A = [1,2,3,4] (full/SWA slots 1..4, state 1), B = A + [5,6] (slots 5,6, state 2)."""
    assert s.step("alloc", n=6) == {"slots": [1, 2, 3, 4, 5, 6], "swa_slots": [1, 2, 3, 4, 5, 6]}
    assert s.step("mamba_alloc", n=2) == {"slots": [1, 2]}
    r = s.step("insert", tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    assert (r["prefix_len"], r["mamba_exist"]) == (0, False)
    r = s.step("insert", tokens=[1, 2, 3, 4, 5, 6], value=[1, 2, 3, 4, 5, 6],
               prev_prefix_len=4, mamba_value=[2])
    assert (r["prefix_len"], r["mamba_exist"], r["freed"]) == (4, False, [])


def test_match_needs_both_validators():
    s = Story(**BOTH)
    two_level(s)
    # Mamba: only A and B hold states; SWA (window 2): both hold their SWA data.
    m = s.step("match_prefix", tokens=[1, 2, 3, 4, 5, 6, 7])
    assert (m["device_indices"], m["last_device_node"]) == ([1, 2, 3, 4, 5, 6], 6)
    # SWA-evict A only (B is the newest: A is the oldest in the SWA list; it is internal, so
    # it becomes an SWA tombstone, and its state goes with it: Mamba's priority is lower)
    e = s.step("evict", num_tokens=0, swa_num_tokens=1)
    assert (e["num_tokens_evicted"], e["swa_num_tokens_evicted"], e["mamba_num_evicted"]) \
        == (0, 4, 1)
    assert (e["freed"], e["swa_freed"], e["mamba_freed"]) == ([], [1, 2, 3, 4], [1])
    # A match of A alone fails both validators now; B is still a valid end (its own SWA data
    # fills the window of 2, and it holds a state)
    assert s.step("match_prefix", tokens=[1, 2, 3, 4])["device_indices"] == []
    assert s.step("match_prefix", tokens=[1, 2, 3, 4, 5, 6])["last_device_node"] == 6


def test_mamba_eviction_of_an_internal_node_keeps_its_swa_data():
    s = Story(**BOTH)
    two_level(s)
    e = s.step("evict", num_tokens=0, mamba_num=1)  # A: the oldest state, internal
    assert (e["num_tokens_evicted"], e["swa_num_tokens_evicted"], e["mamba_num_evicted"]) \
        == (0, 0, 1)
    assert (e["swa_freed"], e["mamba_freed"]) == ([], [1])
    snap = s.a.snapshot()
    (a,) = [n for n in snap["nodes"] if n["path"]["tokens"] == [1, 2, 3, 4]]
    assert a["swa"]["value"] == [1, 2, 3, 4] and a["mamba"]["value"] is None


def test_a_lock_holds_one_window_of_swa_and_the_node_state():
    s = Story(**BOTH)
    two_level(s)
    h = s.step("lock", node={"tokens": [1, 2, 3, 4, 5, 6], "extra_key": None})["handle"]
    sz = s.step("sizes")
    # Full: the whole path locked; SWA: one window (B's two units); Mamba: B's state only
    assert (sz["full_protected"], sz["swa_protected"], sz["mamba_protected"]) == (6, 2, 1)
    assert (sz["swa_evictable"], sz["mamba_evictable"]) == (4, 1)
    e = s.step("evict", num_tokens=6, swa_num_tokens=6, mamba_num=2)
    # nothing is a device leaf; SWA tombstones A (and its state with it); B keeps everything
    assert (e["num_tokens_evicted"], e["swa_num_tokens_evicted"], e["mamba_num_evicted"]) \
        == (0, 4, 1)
    s.step("unlock", handle=h)
    e = s.step("evict", num_tokens=1)
    assert (e["num_tokens_evicted"], e["freed"], e["swa_freed"], e["mamba_freed"]) \
        == (2, [5, 6], [5, 6], [2])


def test_a_state_committed_to_a_split_node_moves_it_in_the_mamba_list_only():
    """The insert of [1,2] splits A: the new upper node U is stamped, then the rest of A (A')
    is stamped by the split, so A' is newer than U in both lists; the state committed to U
    moves U to the front of the Mamba list only (0.5.13.post1's component does the same)."""
    s = Story(**BOTH)
    assert s.step("alloc", n=4)["slots"] == [1, 2, 3, 4]
    assert s.step("mamba_alloc", n=2) == {"slots": [1, 2]}
    s.step("insert", tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    r = s.step("insert", tokens=[1, 2], value=[1, 2], prev_prefix_len=2, mamba_value=[2])
    assert (r["prefix_len"], r["mamba_exist"]) == (2, False)
    snap = s.a.snapshot()
    assert paths(snap["swa_lru_order"]) == [[1, 2], [1, 2, 3, 4]]
    assert paths(snap["mamba_lru_order"]) == [[1, 2, 3, 4], [1, 2]]
    # SWA eviction takes U first (internal: a tombstone, with its state); Mamba's then A'
    e = s.step("evict", num_tokens=0, swa_num_tokens=1)
    assert (e["swa_freed"], e["mamba_freed"]) == ([1, 2], [2])
    # a later stamp of U (a match through it) ends the pin: both lists by stamp again
    s.step("match_prefix", tokens=[1, 2, 3, 4])
    snap = s.a.snapshot()
    assert paths(snap["swa_lru_order"]) == [[1, 2, 3, 4]]
    assert paths(snap["mamba_lru_order"]) == [[1, 2, 3, 4]]


def test_hypothesis_machine_on_full_swa_mamba():
    """Lockstep spec vs spec (the fast path's Full + SWA + Mamba is built separately), tree-level
    ops (the machine leaves request-level ops out with SWA and Mamba; conform's segments and
    tests/spec/test_requests_hybrid.py run them): every step's invariants, rejections leave the
    state unchanged, both runs agree."""
    Machine = make_machine(["spec", "spec"], name="SwaMambaMachine", draw=draw_swa_mamba_config)
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=15, stateful_step_count=50, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
