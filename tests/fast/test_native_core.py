"""The C core (fast/_core.c): the node type's Python surface, the switch, and no leaks.

A production cache runs for weeks: inserts, matches, locks, evictions and resets must leave no
references behind (objects, tensors, memory).  These tests run on whichever implementation is
in use (``uniradix.fast.cache.NATIVE``); the node-type and heap tests need the C core.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
from array import array

import pytest
import torch

import uniradix.fast as fast
from uniradix.fast import cache as cache_mod

native = pytest.mark.skipif(not cache_mod.NATIVE, reason="the C core is not in use")


class Alloc:
    """A minimal production-style allocator: frees are only counted (no slot checks)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.freed = 0

    def free(self, t) -> None:
        self.freed += t.numel()


def make(page_size=1, **kw):
    return fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Alloc(),
        page_size=page_size, **kw))


def key(tokens, extra_key=None):
    return fast.RadixKey(array("q", tokens), extra_key)


def test_switch_is_reported():
    assert isinstance(cache_mod.NATIVE, bool)
    if os.environ.get("UNIRADIX_PURE_PYTHON") == "1":
        assert not cache_mod.NATIVE and cache_mod.TreeNode is cache_mod.PyTreeNode


def test_pure_python_switch_in_a_fresh_interpreter():
    env = dict(os.environ, UNIRADIX_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", "import uniradix.fast.cache as c; "
                          "print(c.NATIVE, c.TreeNode is c.PyTreeNode)"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_node_surface_is_the_python_nodes():
    node = cache_mod.TreeNode(array("q", [1, 2]), torch.tensor([5, 6]), None, "ek", 7)
    assert node.children == {} and node.parent is None and node.ck is None
    assert list(node.key) == [1, 2] and node.extra_key == "ek"
    assert node.lock_ref == 0 and node.hit_count == 0 and node.dev_children == 0
    assert node.last_access_time == 7 and node.evicted is False
    child = cache_mod.TreeNode(array("q", [3]), None, node, None, 8, ck=3)
    assert child.evicted is True and child.ck == 3 and child.id > node.id
    node.children[3] = child
    node.lock_ref += 2
    node.last_access_time = 1 << 50
    assert node.lock_ref == 2 and node.last_access_time == 1 << 50
    assert repr(node) == f"TreeNode(id={node.id}, key_len=2, lock_ref=2)"
    assert (node < child) is True and (child < node) is False
    assert sorted([(1, child), (1, node)])[0][1] is node


@native
def test_c_heap_agrees_with_heapq():
    import heapq
    rng = random.Random(3)
    nodes = [cache_mod.TreeNode(array("q"), None, None, None, 0) for _ in range(20)]
    mine, ref = [], []
    for _ in range(3000):
        if rng.random() < 0.55 or not ref:
            e = (rng.randrange(50), rng.choice(nodes))
            cache_mod._core.heappush(mine, e)
            heapq.heappush(ref, e)
        else:
            assert cache_mod._core.heappop(mine) == heapq.heappop(ref)
    assert sorted(mine) == sorted(ref)
    while ref:
        assert cache_mod._core.heappop(mine) == heapq.heappop(ref)


def _workload(cache, rng, rounds=300, page_size=1):
    """Random inserts, matches, locks, unlocks and evictions; returns nothing it held."""
    slot = [page_size]
    locked = []
    for _ in range(rounds):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 6) * page_size)]
        ek = rng.choice([None, None, "a"])
        m = cache.match_prefix(fast.MatchPrefixParams(key=key(prompt, ek)))
        if rng.random() < 0.3:
            locked.append((m.last_device_node, cache.inc_lock_ref(m.last_device_node).to_dec_params()))
        n = len(prompt)
        v = torch.arange(slot[0], slot[0] + n, dtype=torch.int64)
        slot[0] += n
        cache.insert(fast.InsertParams(key=key(prompt, ek), value=v,
                                       prev_prefix_len=len(m.device_indices)))
        if locked and rng.random() < 0.3:
            node, dec = locked.pop(rng.randrange(len(locked)))
            cache.dec_lock_ref(node, dec)
        if rng.random() < 0.2:
            cache.evict(fast.EvictParams(num_tokens=rng.randrange(1, 10)))
        del m
    for node, dec in locked:
        cache.dec_lock_ref(node, dec)
    assert cache.violations() == []


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


@pytest.mark.parametrize("page_size", [1, 2])
def test_no_growth_across_rounds_and_resets(page_size):
    rng = random.Random(11)
    cache = make(page_size)
    counts, nodes = [], []
    for _r in range(8):
        _workload(cache, rng, page_size=page_size)
        cache.evict(fast.EvictParams(num_tokens=1 << 62))
        assert cache.evictable_size() == 0 and cache.protected_size() == 0
        cache.reset()
        gc.collect()
        counts.append(len(gc.get_objects()))
        nodes.append(sum(1 for o in gc.get_objects() if type(o) is cache_mod.TreeNode))
    # after warm-up, the object count is flat and only the root node is alive
    assert max(counts[2:]) - min(counts[2:]) <= 20, counts
    assert nodes[-1] == 1, nodes
    if sys.platform.startswith("linux"):
        before = _rss_kb()
        for _ in range(6):
            _workload(cache, rng, rounds=400, page_size=page_size)
            cache.reset()
        gc.collect()
        assert _rss_kb() - before < 8 * 1024  # KiB: no steady growth


def test_value_tensor_refcounts_come_back():
    cache = make()
    v = torch.arange(10, 18, dtype=torch.int64)
    base = sys.getrefcount(v)
    cache.insert(fast.InsertParams(key=key([1, 2, 3, 4, 5, 6, 7, 8]), value=v))
    assert sys.getrefcount(v) == base  # the tree copies the caller's slots
    m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4, 5, 6, 7, 8])))
    node = m.last_device_node
    # the node keeps its slots as C memory; node.value is a view of that memory, made on the
    # first read and kept on the node; a one-node match hands out that same view
    held = m.device_indices
    assert node.value is held and held.tolist() == v.tolist()
    del m
    in_tree = sys.getrefcount(held)

    def node_refs():  # references to node, less the heap's (stale entries are expected)
        # node_refs is not called after `del node` below
        return sys.getrefcount(node) - sum(1 for _, n in cache._heap if n is node)  # noqa: F821

    before = node_refs()
    # splitting replaces the node's slots: the view of the old ones is dropped by the tree
    m2 = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4])))
    assert sys.getrefcount(held) == in_tree - 1
    del m2
    assert node_refs() == before
    for _ in range(100):
        r = cache.inc_lock_ref(node)
        cache.dec_lock_ref(node, r.to_dec_params())
    assert node_refs() == before
    lower = node.value
    lower_refs = sys.getrefcount(lower)
    assert cache.evict(fast.EvictParams(num_tokens=100)).num_tokens_evicted == 8
    assert sys.getrefcount(lower) == lower_refs - 1  # the evicted node let go of its slots
    assert node.value is None and node.parent is None
    del node, lower, held
    cache.reset()
    gc.collect()
    assert sys.getrefcount(v) == base


def test_errors_leave_no_references():
    cache = make()
    v = torch.arange(1, 5, dtype=torch.int64)
    cache.insert(fast.InsertParams(key=key([1, 2, 3, 4]), value=v))
    node = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4]))).last_device_node
    refs = sys.getrefcount(node)
    for _ in range(200):
        with pytest.raises(fast.HandleError):
            cache.dec_lock_ref(node)
        with pytest.raises(fast.InvalidInput):
            cache.insert(fast.InsertParams(key=key([1, 2]), value=v))
    assert sys.getrefcount(node) == refs
    assert cache.violations() == []


class LogAlloc(Alloc):
    def __init__(self) -> None:
        super().__init__()
        self.log: list = []

    def free(self, t) -> None:
        self.log.append(t.tolist())


def _state(cache) -> dict:
    """Everything observable of a cache, node ids replaced by paths."""
    def path(node):
        parts = []
        while node is not None and node is not cache.root_node:
            parts.append((node.extra_key, tuple(node.key)))
            node = node.parent
        return repr(tuple(reversed(parts)))
    nodes = sorted((path(n), None if n.value is None else n.value.tolist(), n.lock_ref,
                    n.last_access_time, n.dev_children, repr(n.ck)) for n in cache.all_nodes())
    heap = sorted((s, path(n), n.parent is None) for s, n in cache._heap)
    return {"nodes": nodes, "heap": heap, "order": [path(n) for n in cache.eviction_order()],
            "clock": cache._clock, "sizes": (cache._evictable, cache._protected),
            "freed": cache.token_to_kv_pool_allocator.log}


@native
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_c_paths_step_for_step_with_the_python_paths(page_size, monkeypatch):
    """The C entry points (slot validation off, as in production) against the pure-Python
    methods on the same random calls: same results, errors, stamps, heap, frees."""
    rng = random.Random(page_size)
    mk = lambda: fast.UnifiedRadixCache(fast.CacheInitParams(  # noqa: E731
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=LogAlloc(),
        page_size=page_size))
    a, b = mk(), mk()
    slot = [page_size]
    locks: list = []

    def both(name, *args):
        out = []
        for cache, py in ((a, False), (b, True)):
            fn = getattr(cache, "_" + name + "_py" if py and name != "evict" else name) \
                if not (py and name == "evict") else cache._evict_py_api
            xargs = [x[py] if isinstance(x, tuple) and len(x) == 2 and x
                     and isinstance(x[0], (cache_mod.TreeNode,)) else x for x in args]
            if py:
                monkeypatch.setattr(cache_mod, "NATIVE", False)
            try:
                out.append(("ok", fn(*xargs)))
            except Exception as e:  # noqa: BLE001 - compared below
                out.append(("error", type(e).__name__))
            finally:
                monkeypatch.setattr(cache_mod, "NATIVE", True)
        return out

    for step in range(1500):
        r = rng.random()
        toks = [rng.randrange(4) for _ in range(rng.randrange(0, 5) * page_size + rng.choice([0, 0, 0, 1]))]
        ek = rng.choice([None, None, "x"])
        if r < 0.35:
            (ka, ma), (kb, mb) = both("match_prefix", fast.MatchPrefixParams(key=key(toks, ek)))
            assert ka == kb == "ok"
            assert ma.device_indices.tolist() == mb.device_indices.tolist()
            if rng.random() < 0.4:
                (_, la), (_, lb) = both("inc_lock_ref", (ma.last_device_node, mb.last_device_node))
                assert la.delta == lb.delta
                locks.append(((ma.last_device_node, mb.last_device_node),
                              (la.to_dec_params(), lb.to_dec_params())))
        elif r < 0.7:
            n = len(toks)
            v = torch.arange(slot[0], slot[0] + n, dtype=torch.int64)
            slot[0] += n + page_size
            prev = rng.randrange(0, n + 2)
            chunked = rng.choice([False, False, True, 1])
            (ka, ia), (kb, ib) = both("insert", fast.InsertParams(key=key(toks, ek), value=v,
                                                                  prev_prefix_len=prev, chunked=chunked))
            assert ka == kb and (ka == "error" and ia == ib or ia.prefix_len == ib.prefix_len)
        elif r < 0.85 and locks:
            (na, nb), (da, db) = locks.pop(rng.randrange(len(locks)))
            for cache, node, d, name in ((a, na, da, "dec_lock_ref"), (b, nb, db, "_dec_lock_ref_py")):
                if cache is b:
                    monkeypatch.setattr(cache_mod, "NATIVE", False)
                try:
                    res = getattr(cache, name)(node, d)
                    assert res.delta is not None
                finally:
                    monkeypatch.setattr(cache_mod, "NATIVE", True)
        else:
            want = rng.choice([0, 1, 3, 8, 100, -1])
            (ka, ea), (kb, eb) = both("evict", fast.EvictParams(num_tokens=want))
            assert ka == kb and (ka == "error" or ea.num_tokens_evicted == eb.num_tokens_evicted)
        assert _state(a) == _state(b), step
    assert a.violations() == [] and b.violations() == []


@native
def test_c_page_hash_is_cpythons_tuple_hash():
    """The C lookup probes children with its own hash of the page tuple; it must be CPython's
    (a difference would only cost speed: a miss is looked up again with the real key)."""
    rng = random.Random(5)
    page_hash = cache_mod._core.page_hash
    checked = 0
    for _ in range(3000):
        ps = rng.choice([2, 3, 16, 64])
        hi = rng.choice([10, 1 << 20, 1 << 40, (1 << 61) - 2])
        page = [rng.randrange(hi) for _ in range(ps)]
        ek = rng.choice([None, "x", "namespace-7", ""])
        want = hash(tuple(page)) if ek is None else hash((ek, tuple(page)))
        got = page_hash(array("q", page), ek)
        if got is not None:
            assert got == want, (page, ek)
            checked += 1
    assert checked > 2500
    if sys.version_info < (3, 13) and sys.maxsize > 2 ** 32:
        assert cache_mod._core.probing()  # its import-time self-test agreed
    assert page_hash(array("q", [-1, 2]), None) is None  # not covered: the real key is built


@pytest.mark.parametrize("py", [False, True], ids=["c-core", "python"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_frees_duplicates_one_call_per_node(page_size, py, monkeypatch):
    """An insert whose duplicates span several nodes frees one range per node, in path order,
    as upstream does (an allocator that declares nothing gets one call per piece: a paged
    allocator's free list depends on it); an unevicted node in between is not freed."""
    if not py and not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    if py:
        monkeypatch.setattr(cache_mod, "NATIVE", False)
    ps = page_size
    c = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=LogAlloc(),
        page_size=ps))
    ins = c.insert if not py else c._insert_py
    toks = list(range(1, 1 + 6 * ps))
    slots = lambda lo, n: torch.arange(lo, lo + n, dtype=torch.int64)  # noqa: E731
    ins(fast.InsertParams(key=key(toks[:2 * ps]), value=slots(1000, 2 * ps)))
    ins(fast.InsertParams(key=key(toks[:4 * ps]), value=slots(2000, 4 * ps)))
    ins(fast.InsertParams(key=key(toks), value=slots(3000, 6 * ps)))
    log = c.token_to_kv_pool_allocator.log
    assert log == [list(range(2000, 2000 + 2 * ps)),
                   list(range(3000, 3000 + 2 * ps)), list(range(3000 + 2 * ps, 3000 + 4 * ps))]
    del log[:]
    ins(fast.InsertParams(key=key(toks), value=slots(4000, 6 * ps), prev_prefix_len=ps))
    assert log == [list(range(4000 + ps, 4000 + 2 * ps)),
                   list(range(4000 + 2 * ps, 4000 + 4 * ps)),
                   list(range(4000 + 4 * ps, 4000 + 6 * ps))]


def _slots_of(node):
    """The C-memory slots object the node holds (fast/_core.c Slots), or None."""
    return next((o for o in gc.get_referents(node) if type(o).__name__ == "Slots"), None)


@native
def test_node_slots_are_c_memory_and_value_is_a_view():
    cache = make()
    v = torch.arange(100, 112, dtype=torch.int64)
    cache.insert(fast.InsertParams(key=key(list(range(12))), value=v))
    node = cache.match_prefix(fast.MatchPrefixParams(key=key(list(range(12))))).last_device_node
    slots = _slots_of(node)
    assert slots is not None and len(slots) == 12
    assert sys.getsizeof(slots) == sys.getsizeof(_slots_of(node)) >= 12 * 8
    view = node.value  # made on the first read, then the same tensor until the value changes
    assert node.value is view and view.dtype == torch.int64 and view.tolist() == v.tolist()
    # a write through the view is the tree's slots, as it was when the value was a tensor
    view[3] = 7
    cache.insert(fast.InsertParams(key=key(list(range(14))), value=torch.arange(200, 214)))
    m = cache.match_prefix(fast.MatchPrefixParams(key=key(list(range(14)))))
    assert m.device_indices.tolist() == [100, 101, 102, 7] + list(range(104, 112)) + [212, 213]
    m.device_indices[4] = 9  # a multi-node match's tensor is its own: the tree is unchanged
    assert node.value[4].item() == 104


@native
@pytest.mark.parametrize("value, error", [
    (torch.arange(10, 18)[::2], None),  # int64, 1-D, not contiguous: the dtype/shape check
    (torch.arange(5, 9, dtype=torch.int32), "1-D int64"),
    (torch.arange(10, 14).reshape(2, 2), "1-D int64"),
    (torch.arange(10, 13), "3 slots for 4 tokens"),
])
def test_insert_of_a_value_that_is_not_plain_int64_data(value, error):
    """A value the C core cannot read as plain int64 memory is checked by dtype and shape
    (fast/_core.c ``int64_1d_len``); a wrong one is refused by name and leaves no node."""
    cache = make(validate_slots=False)
    params = fast.InsertParams(key=key([1, 2, 3, 4]), value=value)
    if error is None:
        assert cache.insert(params).prefix_len == 0
        m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4])))
        assert m.device_indices.tolist() == value.tolist()
    else:
        with pytest.raises(fast.InvalidInput, match=error):
            cache.insert(params)
        assert cache.root_node.children == {} and cache.evictable_size() == 0


@native
def test_match_concatenates_c_slots_and_tensors_set_from_python():
    cache = make()
    cache.insert(fast.InsertParams(key=key([1, 2, 3, 4]), value=torch.arange(10, 14)))
    cache.insert(fast.InsertParams(key=key([1, 2, 3, 4, 5, 6]), value=torch.arange(20, 26)))
    m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4, 5, 6])))
    assert m.device_indices.tolist() == [10, 11, 12, 13, 24, 25]
    leaf = m.last_device_node
    # a value set from Python stays that tensor (here not contiguous: torch.cat's path)
    t = torch.arange(30, 34)[::2]
    leaf.value = t
    assert leaf.value is t and _slots_of(leaf) is None
    m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4, 5, 6])))
    assert m.device_indices.tolist() == [10, 11, 12, 13, 30, 32]
    # a split of the Python-set value gives each half its own slots
    m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4, 5, 7])))
    assert m.device_indices.tolist() == [10, 11, 12, 13, 30]
    assert t.tolist() == [30, 32]
    evicted = cache.evict(fast.EvictParams(num_tokens=100)).num_tokens_evicted
    # frees through the allocator's own free (not one the C core writes into): tensors
    assert evicted == 6 and cache.token_to_kv_pool_allocator.freed == 4 + 6
