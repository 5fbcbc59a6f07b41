"""Bad input gets a clear typed error and changes nothing.

Each case runs twice: through ``SpecAdapter.apply`` (the observation must be
``{"error": "<TypeName>", ...}``) and directly through the rule functions (``pytest.raises``).
Either way the canonical snapshot, the pool (allocated pages, free count, freed log), the clock
and the live handles must be exactly as before.  The state has content, so "unchanged" means
something: A=[10,11,12,13] and B=[10,11,30,31,32] inserted (a split node [10,11] with two
children) and a lock held on B.
"""

from __future__ import annotations

import copy

import pytest

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.spec import cache as rules
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import (
    AllocatorError,
    CacheError,
    ConfigError,
    HandleError,
    InvalidInput,
    NodeNotFound,
    Unsupported,
)
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import LockHandle, Node, all_nodes

A = [10, 11, 12, 13]
B = [10, 11, 30, 31, 32]


def fingerprint(state):
    """Everything a rejected step must leave alone."""
    return {
        "snapshot": copy.deepcopy(snapshot(state)),
        "allocated": state.kv.allocated_pages(),
        "available": state.kv.available_size(),
        "freed_log": list(state.kv._freed_log),
        "clock": state.clock,
        "handles": dict(state.handles),
        "next_serial": state.next_serial,
        "stamps": sorted((n.path_units(), str(n.extra_key), n.stamp) for n in all_nodes(state)),
    }


def loaded_adapter(**cfg) -> SpecAdapter:
    ad = SpecAdapter(CacheConfig(kv_slots=64, **cfg))
    steps = [
        ({"i": 0, "op": "alloc", "args": {"n": 4}}, {"slots": [1, 2, 3, 4]}),
        ({"i": 1, "op": "insert", "args": {"tokens": A, "value": [1, 2, 3, 4]}},
         {"prefix_len": 0, "freed": []}),
        ({"i": 2, "op": "alloc", "args": {"n": 5}}, {"slots": [5, 6, 7, 8, 9]}),
        ({"i": 3, "op": "insert", "args": {"tokens": B, "value": [5, 6, 7, 8, 9]}},
         {"prefix_len": 2, "freed": [5, 6]}),
        ({"i": 4, "op": "lock", "args": {"node": {"tokens": B, "extra_key": None}}},
         {"handle": 4}),
        ({"i": 5, "op": "alloc", "args": {"n": 2}}, {"slots": [5, 6]}),  # spare, caller-held
    ]
    for step, want in steps:
        assert ad.apply(step) == want
        assert ad.violations() == []
    return ad


@pytest.fixture
def ad() -> SpecAdapter:
    return loaded_adapter()


def rejected(ad: SpecAdapter, step: dict, error: str) -> None:
    ad.state.kv.take_freed()  # the freed log is per step: apply() clears it first anyway
    before = fingerprint(ad.state)
    obs = ad.apply(step)
    assert obs.get("error") == error, obs
    assert set(obs) <= {"error", "message"}
    assert obs.get("message"), "a rejection should say why"
    assert fingerprint(ad.state) == before
    assert ad.violations() == []


def raises_unchanged(state, exc, fn, *args, **kwargs):
    before = fingerprint(state)
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value)
    assert fingerprint(state) == before
    assert sanity_check(state) == []
    return info.value


# ----------------------------------------------------------------------------------------------
# Through the adapter
# ----------------------------------------------------------------------------------------------

BAD_TOKEN_LISTS = [
    pytest.param([10.0, 11], id="float"),
    pytest.param([10, "11"], id="string"),
    pytest.param([True, 11], id="bool"),
    pytest.param([10, None], id="None-inside"),
    pytest.param(None, id="None"),
    pytest.param("1011", id="a-string"),
    pytest.param({"a": 1}, id="dict"),
]


@pytest.mark.parametrize("tokens", BAD_TOKEN_LISTS)
def test_adapter_insert_bad_tokens(ad, tokens):
    rejected(ad, {"i": 9, "op": "insert", "args": {"tokens": tokens, "value": [5, 6]}},
             "InvalidInput")


@pytest.mark.parametrize("tokens", BAD_TOKEN_LISTS)
def test_adapter_match_bad_tokens(ad, tokens):
    rejected(ad, {"i": 9, "op": "match_prefix", "args": {"tokens": tokens}}, "InvalidInput")


@pytest.mark.parametrize("value", [[5.0, 6], [5, "6"], [5, True], [5, None], None])
def test_adapter_insert_bad_value(ad, value):
    rejected(ad, {"i": 9, "op": "insert", "args": {"tokens": [20, 21], "value": value}},
             "InvalidInput")


@pytest.mark.parametrize("step", [
    pytest.param({"op": "insert", "args": {"tokens": [20, 21, 22], "value": [5, 6]}},
                 id="value-shorter"),
    pytest.param({"op": "insert", "args": {"tokens": [20], "value": [5, 6]}}, id="value-longer"),
    pytest.param({"op": "insert", "args": {"tokens": A, "value": [5, 6, 7, 8],
                                           "prev_prefix_len": -1}}, id="prev_prefix_len=-1"),
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [5, 6],
                                           "prev_prefix_len": 0.0}}, id="prev_prefix_len-float"),
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [5, 6],
                                           "chunked": 1}}, id="chunked-not-bool"),
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [5, 6],
                                           "extra_key": 7}}, id="extra_key-not-str"),
    pytest.param({"op": "insert", "args": {"tokens": [20, 21]}}, id="missing-value"),
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [5, 6], "bogus": 1}},
                 id="unknown-arg"),
    pytest.param({"op": "evict", "args": {"num_tokens": -1}}, id="evict-1"),
    pytest.param({"op": "evict", "args": {"num_tokens": True}}, id="evict-bool"),
    pytest.param({"op": "alloc", "args": {"n": -4}}, id="alloc-4"),
    pytest.param({"op": "alloc", "args": {"n": 2.0}}, id="alloc-float"),
    pytest.param({"op": "match_prefix", "args": {"tokens": A, "extra_key": ["x"]}},
                 id="match-extra_key-list"),
    pytest.param({"op": "lock", "args": {"node": A}}, id="lock-path-not-an-object"),
    pytest.param({"op": "free", "args": {"slots": [5.0]}}, id="free-float"),
    # new slots that are not allocated (63, 64 were never handed out)
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [63, 64]}},
                 id="insert-unallocated"),
    # the same slot twice
    pytest.param({"op": "insert", "args": {"tokens": [20, 21], "value": [5, 5]}},
                 id="insert-repeated-slot"),
    # duplicates (value[0:2] for the cached [10,11]) that the pool could not take back
    pytest.param({"op": "insert", "args": {"tokens": [10, 11, 40], "value": [63, 64, 5]}},
                 id="insert-duplicates-unallocated"),
])
def test_adapter_invalid_input(ad, step):
    rejected(ad, dict(step, i=9), "InvalidInput")


def test_adapter_unknown_op(ad):
    rejected(ad, {"i": 9, "op": "frobnicate", "args": {}}, "UnknownOp")
    rejected(ad, {"i": 9, "args": {}}, "UnknownOp")


@pytest.mark.parametrize("op", ["evict_host", "load_back", "io_complete",
                                "check_hicache_events", "mamba_alloc", "mamba_free"])
def test_adapter_host_tier_ops_unsupported(ad, op):
    rejected(ad, {"i": 9, "op": op, "args": {}}, "Unsupported")


@pytest.mark.parametrize("components", [("full", "swa"), ("full", "swa", "mamba")])
def test_adapter_takes_a_host_tier_with_swa(components):
    """A host tier with SWA (and Mamba): the SWA host pool holds host_swa_slots, by default
    host_slots (test_spec_host_swa)."""
    for host_swa_slots, usable in ((None, 64), (16, 16)):
        ad = SpecAdapter(CacheConfig(components=components, sliding_window=4, swa_slots=64,
                                     mamba_slots=4, host_slots=64, host_swa_slots=host_swa_slots))
        assert ad.host_swa_pool.available_size() == usable


@pytest.mark.parametrize("raw", [
    {"page_size": 1, "bogus": 3},
    {"kv_slot": 16},
    {"page_size": 0},
    {"page_size": 4, "kv_slots": 6},
    {"components": ["full", "swa"]},  # swa without a sliding window
    {"page_size": 4, "host_slots": 8, "host_swa_slots": 6},
    {"write_policy": "write_sometimes"},
    {"eagle": 1},
    [("page_size", 1)],
])
def test_config_errors(raw):
    with pytest.raises(ConfigError):
        CacheConfig.from_dict(raw)


def test_adapter_unlock_twice_and_never_issued(ad):
    assert ad.apply({"i": 9, "op": "unlock", "args": {"handle": 4}}) == {}
    assert ad.violations() == []
    rejected(ad, {"i": 10, "op": "unlock", "args": {"handle": 4}}, "HandleError")
    rejected(ad, {"i": 10, "op": "unlock", "args": {"handle": 999}}, "HandleError")
    rejected(ad, {"i": 10, "op": "unlock", "args": {"handle": "4"}}, "HandleError")
    rejected(ad, {"i": 10, "op": "unlock", "args": {"handle": None}}, "HandleError")


def test_adapter_lock_reusing_a_live_handle_number(ad):
    rejected(ad, {"i": 4, "op": "lock", "args": {"node": {"tokens": A, "extra_key": None}}},
             "HandleError")


@pytest.mark.parametrize("path", [
    pytest.param({"tokens": [10, 11, 12], "extra_key": None}, id="ends-inside-a-node"),
    pytest.param({"tokens": [10], "extra_key": None}, id="ends-inside-the-top-node"),
    pytest.param({"tokens": [99], "extra_key": None}, id="does-not-exist"),
    pytest.param({"tokens": A + [14], "extra_key": None}, id="past-a-leaf"),
    pytest.param({"tokens": [10, 11], "extra_key": "x"}, id="wrong-extra_key"),
    pytest.param({"tokens": [10, 11], "extra_key": ""}, id="empty-string-extra_key"),
])
def test_adapter_lock_not_a_node(ad, path):
    rejected(ad, {"i": 9, "op": "lock", "args": {"node": path}}, "NodeNotFound")


@pytest.mark.parametrize("slots", [
    pytest.param([40], id="unallocated"),
    pytest.param([5, 5], id="same-slot-twice"),
    pytest.param([0], id="reserved-page-0"),
    pytest.param([65], id="outside-the-pool"),
    pytest.param([5, 6, 40], id="all-or-nothing"),
])
def test_adapter_free_errors(ad, slots):
    rejected(ad, {"i": 9, "op": "free", "args": {"slots": slots}}, "AllocatorError")


def test_adapter_double_free(ad):
    assert ad.apply({"i": 9, "op": "free", "args": {"slots": [5, 6]}}) == {}
    rejected(ad, {"i": 10, "op": "free", "args": {"slots": [5]}}, "AllocatorError")


def test_adapter_partial_page_free():
    ad = SpecAdapter(CacheConfig(page_size=4, kv_slots=32))
    assert ad.apply({"i": 0, "op": "alloc", "args": {"n": 8}}) == {
        "slots": [4, 5, 6, 7, 8, 9, 10, 11]}
    assert ad.apply({"i": 1, "op": "insert", "args": {
        "tokens": [1, 2, 3, 4], "value": [4, 5, 6, 7]}}) == {"prefix_len": 0, "freed": []}
    rejected(ad, {"i": 2, "op": "free", "args": {"slots": [8, 9]}}, "AllocatorError")
    rejected(ad, {"i": 2, "op": "alloc", "args": {"n": 3}}, "InvalidInput")  # not whole pages
    rejected(ad, {"i": 2, "op": "alloc", "args": {"n": 32}}, "AllocatorError")  # 24 free


def test_adapter_alloc_too_many(ad):
    rejected(ad, {"i": 9, "op": "alloc", "args": {"n": 1000}}, "AllocatorError")


# ----------------------------------------------------------------------------------------------
# Directly through the rule functions
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def st(ad):
    return ad.state


@pytest.mark.parametrize("tokens", BAD_TOKEN_LISTS)
def test_rules_bad_tokens(st, tokens):
    raises_unchanged(st, InvalidInput, rules.insert, st, tokens, None, [5, 6])
    raises_unchanged(st, InvalidInput, rules.match_prefix, st, tokens, None)
    raises_unchanged(st, InvalidInput, rules.find_node, st, tokens, None)


def test_rules_value_length(st):
    raises_unchanged(st, InvalidInput, rules.insert, st, [20, 21, 22], None, [5, 6])
    raises_unchanged(st, InvalidInput, rules.insert, st, [20], None, [5, 6])


def test_rules_negative_counts(st):
    raises_unchanged(st, InvalidInput, rules.evict, st, -1)
    raises_unchanged(st, InvalidInput, rules.insert, st, A, None, [5, 6, 63, 64],
                     prev_prefix_len=-1)
    raises_unchanged(st, InvalidInput, st.kv.alloc, -4)


def test_rules_insert_slots(st):
    raises_unchanged(st, InvalidInput, rules.insert, st, [20, 21], None, [63, 64])
    raises_unchanged(st, InvalidInput, rules.insert, st, [20, 21], None, [5, 5])
    raises_unchanged(st, InvalidInput, rules.insert, st, [10, 11, 40], None, [63, 64, 5])


def test_rules_handles(st):
    h = st.handles[1]  # the lock on B (serial 1)
    rules.dec_lock_ref(st, h)
    assert sanity_check(st) == []
    raises_unchanged(st, HandleError, rules.dec_lock_ref, st, h)
    forged = LockHandle(serial=1, node=h.node, skipped=())
    raises_unchanged(st, HandleError, rules.dec_lock_ref, st, forged)
    raises_unchanged(st, HandleError, rules.dec_lock_ref, st, 1)


def test_rules_lock_not_a_node(st):
    raises_unchanged(st, NodeNotFound, rules.find_node, st, [10, 11, 12], None)
    raises_unchanged(st, NodeNotFound, rules.find_node, st, [99], None)
    raises_unchanged(st, NodeNotFound, rules.find_node, st, [10, 11], "x")
    stray = Node(key=(10, 11), extra_key=None, parent=st.root, value=(5, 6), stamp=(0, 0))
    raises_unchanged(st, NodeNotFound, rules.inc_lock_ref, st, stray)


def test_rules_allocator(st):
    raises_unchanged(st, AllocatorError, st.kv.free, [40])
    raises_unchanged(st, AllocatorError, st.kv.free, [5, 5])
    raises_unchanged(st, AllocatorError, st.kv.free, [5, 6, 40])
    raises_unchanged(st, AllocatorError, st.kv.alloc, 1000)


def test_every_error_is_a_cache_error():
    for exc in (AllocatorError, ConfigError, HandleError, InvalidInput, NodeNotFound,
                Unsupported):
        assert issubclass(exc, CacheError)


# ----------------------------------------------------------------------------------------------
# Slot ownership on insert (found as spec bugs while writing these tests, now rejected)
# ----------------------------------------------------------------------------------------------


def test_insert_slots_the_tree_already_holds(ad):
    rejected(ad, {"i": 9, "op": "insert", "args": {"tokens": [20, 21], "value": [1, 2]}},
             "InvalidInput")


def test_insert_duplicates_that_are_tree_slots(ad):
    rejected(ad, {"i": 9, "op": "insert", "args": {"tokens": A, "value": [1, 2, 3, 4]}},
             "InvalidInput")


def test_insert_value_not_whole_pages():
    ad = SpecAdapter(CacheConfig(page_size=4, kv_slots=32))
    assert ad.apply({"i": 0, "op": "alloc", "args": {"n": 8}})["slots"] == [4, 5, 6, 7, 8, 9,
                                                                            10, 11]
    rejected(ad, {"i": 1, "op": "insert", "args": {"tokens": [1, 2, 3, 4],
                                                   "value": [4, 5, 6, 8]}}, "InvalidInput")
