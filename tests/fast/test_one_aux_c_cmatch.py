"""fast/one_aux.py ``match_one``'s walk in C (fast/_core.c "composed tree: cmatch",
``one_match``) against the same function's Python code, in one process.

Two caches driven alike: one runs ``match_one`` as it is (the C walk, where it does not
decline), its twin with ``one_aux._one_match`` off for each of its calls (the Python code).
After every step the two must agree on everything a match writes or reads: each node's
fields (stamps included), each record, the component's LRU order, the clock, the counters,
the leaf heap entry by entry in list order (the C walk pushes the same entries with heapq's
comparisons, so even the list's order is the same), and the results.  Scenarios: SWA and
Mamba at pages 1 and 16, locks, splits, tombstones, evictions, a disabled cache, errors;
recorded random sequences in lockstep."""

from __future__ import annotations

import dataclasses
import gc
import sys
from array import array
from contextlib import contextmanager

import pytest

from aux_twins import Counting, Twins, pages, replay_in_lockstep, result_view, tree_state

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config, record  # noqa: E402
from uniradix.fast import one_aux  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


@contextmanager
def python_match():
    """``match_one`` without its C walk (the Python code below the call runs)."""
    saved = one_aux._one_match
    one_aux._one_match = None
    try:
        yield
    finally:
        one_aux._one_match = saved


def state(cache) -> dict:
    """Everything a match may write (tests/aux_twins.py ``tree_state``)."""
    return tree_state(cache)


# ---- recorded random sequences in lockstep --------------------------------------------------


def _config(name: str, seed: int, page: int):
    config = make_config(name, seed)
    if page == 1:
        return config
    return dataclasses.replace(config, page_size=page, kv_slots=config.kv_slots * page // 2,
                               swa_slots=config.swa_slots * page // 2)


@needs_core
@pytest.mark.parametrize("name,page,seed", [
    ("swa-w8-p1", 1, 1), ("swa-w32-p1", 1, 2), ("swa-w8-p4", 4, 3), ("swa-w8-p1", 16, 4),
    ("mamba-p1", 1, 5), ("mamba-p1", 1, 6), ("mamba-p1", 16, 7)])
def test_c_match_equals_python_match_in_lockstep(name, page, seed, monkeypatch):
    config = _config(name, seed, page)
    steps = record(make_adapter("fast", config), config, seed, 400, check_violations=False)
    c_side, py_side = make_adapter("fast", config), make_adapter("fast", config)
    apply = py_side.apply

    def apply_python(step):
        with python_match():
            return apply(step)

    py_side.apply = apply_python
    counting = Counting(one_aux._one_match)
    monkeypatch.setattr(one_aux, "_one_match", counting)
    replay_in_lockstep(c_side, py_side, steps, ["C match", "Python match"])
    # the C walk ran (the twin's calls went to Python: only the C side counts)
    assert counting.taken == counting.calls > 20


# ---- scenarios on one cache and its twin ----------------------------------------------------


class Twin(Twins):
    """``c`` runs ``match_one`` as it is, ``py`` without its C walk."""

    def __init__(self, config):
        super().__init__(make_adapter("fast", config), make_adapter("fast", config))
        assert self.c.cache._match_fast is one_aux.match_one

    def run(self, side, fn):
        if side is self.py:
            with python_match():
                return fn()
        return fn()

    def match(self, tokens, extra_key=None, key=None):
        """A match on both caches directly (the whole result, the nodes as paths, or the
        error); ``key``: the key object to pass (default: a RadixKey of the tokens)."""
        params = fast.MatchPrefixParams(key=fast.RadixKey(list(tokens), extra_key))
        if key is not None:
            params.key = key
        return self.both(lambda side: result_view(side.cache.match_prefix(params)))


class NoExtra:
    """A key with token ids and no other attribute."""

    def __init__(self, token_ids):
        self.token_ids = token_ids


class SglKey:
    """An object of sglang's RadixKey shape (what a scheduler passes): a list of token ids."""

    def __init__(self, token_ids, extra_key=None, is_bigram=False):
        self.token_ids, self.extra_key, self.is_bigram = token_ids, extra_key, is_bigram


def _twin(kind: str, ps: int, **extra):
    base = make_config("swa-w8-p1" if kind == "swa" else "mamba-p1", 1)
    fields = dict(page_size=ps, kv_slots=4096)
    if kind == "swa":
        fields.update(swa_slots=4096, sliding_window=2 * ps)
    else:
        fields.update(mamba_slots=64)
    fields.update(extra)
    return Twin(dataclasses.replace(base, **fields))


def _insert(t: Twin, tokens, prev=0, **extra):
    slots = t("alloc", n=len(tokens) - prev)["slots"]
    value = list(range(1, prev + 1)) if prev else []  # (the first prev slots are the tree's)
    return t("insert", tokens=tokens, value=value + slots, prev_prefix_len=prev, **extra)


@needs_core
@pytest.mark.parametrize("ps", [1, 16])
def test_swa_scenario(ps, monkeypatch):
    counting = Counting(one_aux._one_match)
    monkeypatch.setattr(one_aux, "_one_match", counting)
    t = _twin("swa", ps)
    a = pages(ps, *range(1, 7))
    t.match(a)  # an empty tree
    _insert(t, a, swa_evicted_seqlen=2 * ps)  # pages 1-2 a tombstone, 3-6 SWA data
    t.match(a)
    t.match(a[:3 * ps])  # the run from the tombstone is one page: the window is two
    t.match(a[:4 * ps] + pages(ps, 9))  # a split inside the data node
    t.match(a[:ps] + pages(ps, 9))  # a split inside the tombstone
    _insert(t, a[:3 * ps] + pages(ps, 7, 8))  # a branch
    t.match(a[:3 * ps] + pages(ps, 7))
    h = t("lock", node={"tokens": a[:4 * ps], "extra_key": None})["handle"]
    t.match(a)  # the locked path: no leaf push for a locked node
    t("evict", num_tokens=0, swa_num_tokens=3 * ps)  # tombstones where the data was oldest
    t.match(a)
    t.match(a[:3 * ps] + pages(ps, 7, 8))
    t("unlock", handle=h)
    t("evict", num_tokens=2 * ps, swa_num_tokens=0)
    t.match(a)
    _insert(t, a, extra_key="tenant")  # another namespace
    t.match(a, "tenant")
    t.match(a[: ps - 1] if ps > 1 else [])  # no whole page: the empty answer
    t.match(a + [5] * (ps - 1) if ps > 1 else a + [5])
    assert counting.taken == counting.calls >= 12


@needs_core
@pytest.mark.parametrize("ps", [1, 16])
def test_mamba_scenario(ps, monkeypatch):
    counting = Counting(one_aux._one_match)
    monkeypatch.setattr(one_aux, "_one_match", counting)
    t = _twin("mamba", ps)
    a = pages(ps, *range(1, 9))
    (state1,) = t("mamba_alloc", n=1)["slots"]
    _insert(t, a[:3 * ps], mamba_value=[state1])
    (state2,) = t("mamba_alloc", n=1)["slots"]
    _insert(t, a, prev=3 * ps, mamba_value=[state2])
    t.match(a)
    t.match(a[:6 * ps])  # a split below the state: the branching length is answered
    t.match(a[:2 * ps])  # a split above the first state: nothing matched, a branching length
    t("evict", num_tokens=0, mamba_num=1)  # the oldest state goes: a node without one
    t.match(a)
    t.match(a[:5 * ps] + pages(ps, 9))
    h = t("lock", node={"tokens": a[:3 * ps], "extra_key": None})["handle"]
    t.match(a[:3 * ps])
    t("unlock", handle=h)
    t("evict", num_tokens=8 * ps, mamba_num=0)
    t.match(a)
    assert counting.taken == counting.calls >= 7


@needs_core
def test_disabled_cache_and_errors(monkeypatch):
    t = Twin(dataclasses.replace(make_config("swa-w8-p1", 1), disable=True))
    t.match([1, 2, 3])
    t = _twin("swa", 1)
    a = pages(1, *range(1, 6))
    _insert(t, a)
    # the split raises after it split: both raise it, both trees have the split and nothing
    # after it (the C walk stops where the Python code does)
    for side in (t.c, t.py):
        real = side.cache._split

        def failing(child, k, real=real):
            real(child, k)
            raise RuntimeError("split failed")

        side.cache._split = failing
    t("match_prefix", tokens=a[:2] + [77])
    t("match_prefix", tokens=a)  # no split: runs through
    for side in (t.c, t.py):
        del side.cache._split
    t("match_prefix", tokens=a[:3] + [77])


@needs_core
@pytest.mark.parametrize("ps", [1, 16])
def test_key_shapes(ps, monkeypatch):
    """The key read in C (uniradix's RadixKey in place, sglang's shape with a list of ints
    read once) and what it leaves to the Python code, which converts or refuses it: the same
    answers and errors either way."""
    counting = Counting(one_aux._one_match)
    monkeypatch.setattr(one_aux, "_one_match", counting)
    t = _twin("swa", ps)
    a = pages(ps, *range(1, 6))
    _insert(t, a)
    _insert(t, a[: 2 * ps] + pages(ps, 8), extra_key="ns")
    t.match(a, key=SglKey(list(a)))
    t.match(a, key=SglKey(a[: 3 * ps] + pages(ps, 9)))  # a split
    t.match(a, key=SglKey(a[: 2 * ps] + pages(ps, 8), "ns"))
    t.match(a, key=SglKey(array("q", a)))  # (how the bench calls it: an array)
    t.match(a, key=SglKey(array("q", a[: 2 * ps] + pages(ps, 8)), "ns"))
    t.match(a, key=SglKey(list(a), None, True))  # a bigram: the general path
    assert counting.taken == 5 and counting.calls == 6
    declined = [
        SglKey([True] + a[1:]),  # a bool: refused
        SglKey([a[0], 2 ** 70] + a[2:]),  # too large for int64: refused
        SglKey(tuple(a)),  # a tuple: converted by as_radix_key
        SglKey(list(a), b"ns"),  # an extra_key that is not a str
        SglKey(list(a), None, 0),  # an is_bigram that is not a bool
        SglKey(list(map(type("Tok", (int,), {}), a))),  # an int subclass: array converts it
        fast.RadixKey(a, is_bigram=True),
        object(),  # no token ids
        SglKey(array("l", a)),  # an array of another typecode: refused
        SglKey(array("q", a), type("Ns", (str,), {})("ns")),  # a str subclass: converted
        SglKey(array("q", a), None, None),  # an is_bigram that is not a bool: refused
        SglKey(array("q", a), None, True),  # a bigram: the general path
        NoExtra(array("q", a)),  # no extra_key: refused
    ]
    for key in declined:
        t.match(a, key=key)
    assert counting.taken == 5 and counting.calls == 6 + len(declined)
    ours = fast.RadixKey(a)
    ours.token_ids = list(a)  # not an array: converted by the Python code
    t.match(a, key=ours)
    assert counting.taken == 5


@needs_core
def test_declines_change_nothing():
    """What the C walk leaves to the Python code (a node it may not read by offset, a key
    that is not an array) comes back None with nothing changed."""
    t = _twin("swa", 1)
    a = pages(1, *range(1, 6))
    _insert(t, a)
    cache = t.c.cache
    params = fast.MatchPrefixParams(key=fast.RadixKey(a))
    node = next(iter(cache.root_node.children.values()))
    before = state(cache)
    key = node.key
    node.key = list(node.key)  # (EAGLE's shape: match_step_py's)
    assert one_aux._one_match(cache, params) is None
    node.key = key
    assert state(cache) == before
    rec = node.aux
    node.aux = [rec[0]]  # a list, not a tuple: Python's indexing, not the offset
    assert one_aux._one_match(cache, params) is None
    node.aux = rec
    cache._inline_window = 2 ** 80
    assert one_aux._one_match(cache, params) is None
    cache._inline_window = 0
    params.cow_mamba = True  # (Mamba's copy-on-write: the general path)
    assert one_aux._one_match(cache, params) is None
    assert state(cache) == before
    params.cow_mamba = False
    assert one_aux._one_match(cache, params) is not None


@needs_core
def test_no_reference_leaks():
    """A match run many times holds no new reference to the nodes, records, list ends or
    the empty tensor, and the process does not grow."""
    t = _twin("swa", 16)
    a = pages(16, *range(1, 9))
    _insert(t, a, swa_evicted_seqlen=32)
    _insert(t, a[:48] + pages(16, 20, 21))
    cache = t.c.cache
    comp = cache.components[0]
    params = fast.MatchPrefixParams(key=SglKey(a))
    short = fast.MatchPrefixParams(key=fast.RadixKey(a[:8]))
    long_ = fast.MatchPrefixParams(key=SglKey(a * 3))  # (over 256 tokens: C memory)
    arr = fast.MatchPrefixParams(key=SglKey(array("q", a)))
    objs = [cache.root_node, comp.lru.head, comp.lru.tail, cache._empty, cache]
    stack = list(cache.root_node.children.values())
    while stack:  # every node, its record and its slots
        node = stack.pop()
        objs += [node, node.aux[0], node.value, node.aux[0].value, node.last_access_time]
        stack.extend(node.children.values())
    for _ in range(50):
        one_aux._one_match(cache, params)
    cache._heap.clear()
    gc.collect()
    counts = [sys.getrefcount(o) for o in objs]
    rss = _rss()
    for _ in range(20000):
        r = one_aux._one_match(cache, params)
        one_aux._one_match(cache, short)
        one_aux._one_match(cache, long_)
        one_aux._one_match(cache, arr)
        cache._heap.clear()
    assert r is not None and len(r.device_indices) == len(a)
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in objs] == counts
    assert _rss() - rss < 4 << 20


@needs_core
@pytest.mark.parametrize("field", ["lock_ref", "aux_lock", "dev_children"])
def test_leaf_push_reads_each_count(field):
    """The matched node goes on the heap only when all three of its counts are 0; each count
    set alone on both twins (a state the request path does not make for ``aux_lock``) must
    keep it off in both."""
    t = _twin("swa", 1)
    a = pages(1, *range(1, 6))
    _insert(t, a)
    for side in (t.c, t.py):
        (node,) = side.cache.root_node.children.values()
        setattr(node, field, getattr(node, field) + 1)
        side.cache._heap.clear()
    t.match(a)
    assert t.c.cache._heap == []


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
