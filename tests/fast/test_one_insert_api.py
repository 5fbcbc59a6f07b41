"""fast/one_aux.py ``insert_one`` whole in C for one stock aux component, SWA alone or Mamba
alone (fast/_core.c "composed tree: one_insert_api": the key read in place, the argument
checks, the cut to whole pages, the plan, the component's checks, the state's copy, the root's
stamp, then ``one_insert``'s walk, leaf and commit) against the Python function, in one
process.

Two caches driven alike, both without the slot ledger (the C entry declines with it on): one
runs ``insert`` as it is (``_insert_fast`` is ``one_insert_api``, counted; ``insert_one`` where
it declines), its twin ``insert_one`` itself (``_insert_fast`` that function, nothing in front).
After every step the two must agree on the tree (each node's fields and records, stamps
included), the LRU order, the leaf heap entry by entry, the clock and counters, the free lists
of the allocators, the frees released, and the results or errors.  Recorded random sequences at
pages 1, 4 and 16; random requests over the bench's free-list allocators with random
``prev_prefix_len`` (inside SWA tombstones too), ``swa_evicted_seqlen``, ``chunked`` and
``priority``; every kind of bad argument (declined with nothing changed, then refused alike);
the settings it leaves to Python; keys of SGLang's ``RadixKey`` shape (SGLang's own class in
the upstream venv); and no reference left behind.  The drivers are
tests/fast/test_pair_insert_api.py's (the pair's C entry), with this entry's two sides."""

from __future__ import annotations

import dataclasses
import sys
from array import array

import pytest

from aux_twins import Counting, assert_no_leaks, pages, tree_state

torch = pytest.importorskip("torch")

from test_one_aux_c_cevict import _outcome  # noqa: E402
from test_pair_insert_api import (  # noqa: E402
    ShapedKey,
    _build,
    _compare,
    _no_ledger,
    check_bad_arguments,
    check_random_requests,
    check_recorded,
    check_sglang_keys,
)
from test_pair_insert_api import _api as pair_api  # noqa: E402

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config  # noqa: E402
from uniradix.fast import one_aux  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

pytestmark = pytest.mark.skipif(_core is None or not hasattr(_core, "one_insert_api"),
                                reason="the C core is not built or not in use")
SWA, MAMBA = ("full", "swa"), ("full", "mamba")
ORDERS = [SWA, MAMBA]
IDS = ["swa", "mamba"]


def _api(cache) -> Counting:
    """``cache`` on the C entry (``insert_one`` behind it), counted (taken: not None)."""
    assert cache._one_insert and cache._insert_next is one_aux.insert_one
    return pair_api(cache, _core.one_insert_api)


def _python(cache):
    """``cache`` on ``insert_one`` itself, nothing in front of it."""
    _no_ledger(cache)
    assert cache._insert_fast is _core.one_insert_api
    cache._insert_fast, cache._insert_next = one_aux.insert_one, None
    return cache


ON = (_api, _python)


# ----------------------------------------------------------------------------------------------
# Recorded runs
# ----------------------------------------------------------------------------------------------


def _config(name: str, seed: int, ps: int):
    """Config ``name`` at its page size, or at page 4 (Mamba) or 16 with room for it."""
    config = make_config(name, seed)
    if ps == 4 and config.page_size != 4:
        config = dataclasses.replace(config, page_size=4, kv_slots=1024)
    if ps == 16:
        config = dataclasses.replace(config, page_size=16, kv_slots=4096,
                                     **({"swa_slots": 4096, "sliding_window": 32}
                                        if "swa" in config.components else
                                        {"mamba_slots": 64, "mamba_cache_chunk_size": 16}))
    return config


@pytest.mark.parametrize("name,seed,ps", [
    ("swa-w8-p1", 31, 1), ("swa-w32-p1", 32, 1), ("swa-w8-p4", 33, 4), ("swa-w8-p4", 34, 16),
    ("mamba-p1", 35, 1), ("mamba-p1", 36, 4), ("mamba-p1", 37, 16)])
def test_recorded_runs_in_lockstep(name, seed, ps):
    check_recorded(_config(name, seed, ps), seed, ON)


# ----------------------------------------------------------------------------------------------
# Random requests, bad arguments, SGLang's keys (tests/fast/test_pair_insert_api.py's drivers)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS, ids=IDS)
@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(2))
def test_random_requests_over_free_lists(ps, order, seed):
    check_random_requests(ps, order, seed, ON)


@pytest.mark.parametrize("order", ORDERS, ids=IDS)
@pytest.mark.parametrize("ps", [1, 4])
def test_bad_arguments_are_declined_with_nothing_changed(ps, order):
    check_bad_arguments(ps, order, ON, _core.one_insert_api)


@pytest.mark.parametrize("order", ORDERS, ids=IDS)
@pytest.mark.parametrize("kind", ["shaped", "sglang"])
@pytest.mark.parametrize("ps", [1, 16])
def test_keys_of_sglang_shape_are_read_in_place(ps, kind, order):
    check_sglang_keys(ps, kind, order, ON)


def test_prev_inside_a_tombstone_is_refused_by_python_with_nothing_changed():
    sides = [_build(1, SWA, python, on=ON) for python in (False, True)]
    toks = pages(1, *range(1, 13))
    for cache, alloc, _, _ in sides:  # a node of 8 with a leaf of 4 below, then the 8 evicted
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks[:8]), value=alloc.alloc(8)))
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), prev_prefix_len=8, value=torch.cat(
            [alloc.alloc(0), cache.match_prefix(fast.MatchPrefixParams(
                key=fast.RadixKey(toks[:8]))).device_indices, alloc.alloc(4)])))
        cache.evict(fast.EvictParams(num_tokens=0, swa_num_tokens=8))
    _compare(sides, "setup")
    c = sides[0][0]
    assert c.swa.evictable == 4
    params = fast.InsertParams(key=fast.RadixKey(toks), value=torch.arange(12), prev_prefix_len=3)
    before = tree_state(c)
    assert _core.one_insert_api(c, params) is None
    assert tree_state(c) == before
    outs = [_outcome(lambda s=s: s[0].insert(params)) for s in sides]
    assert outs[0] == outs[1] and outs[0][0] == "raised" and "tombstone" in outs[0][2]
    _compare(sides, "refused")
    assert _core.one_insert_api(c, dataclasses.replace(params, prev_prefix_len=0)) is not None


def test_the_tree_keeps_its_own_state():
    """Mamba: the state the tree keeps is its own copy (``mamba_state``), as the twin's: a
    later write to the caller's tensor changes neither tree."""
    sides = [_build(1, MAMBA, python, on=ON) for python in (False, True)]
    for k in (3, 5, 5):  # (a new leaf, a longer one, the same node again: a state there)
        mvs = [torch.tensor([40 + k]) for _ in sides]
        outs = [_outcome(lambda s=s, mv=mv, k=k: s[0].insert(fast.InsertParams(
            key=fast.RadixKey(pages(1, *range(1, k + 1))), value=torch.arange(k),
            prev_prefix_len=min(k, 3), mamba_value=mv))) for s, mv in zip(sides, mvs, strict=True)]
        assert outs[0] == outs[1]
        for mv in mvs:
            mv[0] = -1
        _compare(sides, k)
    assert sides[0][3].taken == 3


# ----------------------------------------------------------------------------------------------
# Settings left to Python, when the entry is chosen
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS, ids=IDS)
def test_settings_left_to_python(order):
    """The slot ledger, a disabled cache, KV events, the flag off, a policy order, a tier, a
    queue that is not a list (Mamba): declined with nothing changed.  EAGLE, a policy and a
    subclass with its own ``_plan`` or a step that is not the C core's: never chosen
    (``insert_one`` is)."""
    cache, alloc, _, _ = _build(1, order, False, on=ON)
    mv = torch.tensor([3]) if "mamba" in order else None
    params = fast.InsertParams(key=fast.RadixKey(pages(1, *range(1, 6))), value=alloc.alloc(5),
                               mamba_value=mv)
    before = tree_state(cache)
    settings = [("validate_slots", False, True), ("disable", False, True),
                ("_events", None, object()), ("_one_insert", True, False),
                ("_policy_key", None, len), ("storage_tier", None, object()),
                ("tier", None, object())]
    if mv is not None:
        settings.append(("_deferred", None, ()))
    for name, off, on in settings:
        setattr(cache, name, on)
        assert _core.one_insert_api(cache, params) is None, name
        setattr(cache, name, off)
        assert tree_state(cache) == before
    assert _core.one_insert_api(cache, params) is not None
    base = make_config("swa-w8-p1" if "swa" in order else "mamba-p1", 1)
    for other in (dict(eagle=True), dict(eviction_policy="lfu")):
        assert make_adapter("fast", dataclasses.replace(base, **other)).cache._one_insert is False
    plain = make_adapter("fast", base).cache
    assert plain._insert_fast is _core.one_insert_api
    cls = type(plain)
    plain.__class__ = type("Own", (cls,), {"_plan": lambda self, *a: cls._plan(self, *a)})
    plain._pick_fast_paths()
    assert plain._insert_fast is one_aux.insert_one and plain._insert_next is None
    plain.__class__ = cls
    plain._pick_fast_paths()
    assert plain._insert_fast is _core.one_insert_api


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS, ids=IDS)
def test_no_reference_left_behind(order):
    """The same inserts over and over (taken with the path there, cut to whole pages, no whole
    page, a Mamba state already there or a fresh one, declined): the reference counts of what
    the C entry reads and the number of live objects do not grow."""
    cache, alloc, states, counting = _build(4, order, False, on=ON)
    mamba = "mamba" in order
    toks = array("q", range(1, 19))
    slots = alloc.alloc(20)[:18]
    mv = torch.tensor([11]) if mamba else None
    cache.insert(fast.InsertParams(key=fast.RadixKey(toks[:16]), value=slots[:16],
                                   mamba_value=states.alloc(1).reshape(1) if mamba else None))
    key = fast.RadixKey(toks, "ns")
    shaped = ShapedKey(toks)
    many = [
        fast.InsertParams(key=fast.RadixKey(toks[:16]), value=slots[:16], prev_prefix_len=16,
                          mamba_value=mv),
        fast.InsertParams(key=shaped, value=slots, prev_prefix_len=16, mamba_value=mv,
                          swa_evicted_seqlen=0 if mamba else 4),
        fast.InsertParams(key=fast.RadixKey(toks[:3]), value=slots[:3], mamba_value=mv),
        fast.InsertParams(key=key, value=slots, prev_prefix_len=-1, mamba_value=mv),
        fast.InsertParams(key=key, value=slots, mamba_value=None if mamba else mv,
                          swa_evicted_seqlen=0 if mamba else 3),
    ]
    taken = []

    def run():
        before = counting.taken
        for p in many:
            _outcome(lambda p=p: cache.insert(p))
        taken.append(counting.taken - before)

    def marks():
        return tuple(sys.getrefcount(o) for o in (
            cache, cache.root_node, cache.components, cache.components[0],
            cache.components[0].lru.head, cache.swa, cache._heap,
            key, toks, shaped, slots, mv, *many))

    heap = len(cache._heap)

    def run_and_trim():  # (the leaf heap's lazy entries of a run dropped: a prefix is a heap)
        run()
        del cache._heap[heap:]

    assert_no_leaks(run_and_trim, marks)
    assert taken[-1] == 3, taken  # (the first three taken, the bad two declined)
