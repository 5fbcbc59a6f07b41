"""Full + SWA + Mamba in one tree on the fast path (fast/hybrid.py with both component
plug-ins), fast only (the spec models one aux component so far): hand-worked cases of the
seed's rules where the two components meet (match validators together, the eviction cascade
by priority, locks, leaf eviction), and random workloads that check the cache's invariants
(``violations``) and the pools (no slot leaked or lost) after every step.

Pools (spec/world.py) are lowest-first with slot 0 reserved: with page_size 1 the first
``alloc(n)`` gives Full slots ``[1 .. n]`` and SWA slots ``[1 .. n]``; Mamba states from 1.
"""

from __future__ import annotations

import random

import pytest
import torch

from uniradix import fast
from uniradix.conformance.adapters.fast_hybrid import MambaReqPool, SwaPoolAllocator
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.world import HybridKVPool, PagedPool


class World:
    """A Full + SWA + Mamba fast cache over the spec's pools, driven like a scheduler."""

    def __init__(self, page_size: int = 1, window: int = 4, kv: int = 64, mamba: int = 8,
                 chunk: int = 2, comps: tuple = ("full", "swa", "mamba")) -> None:
        self.pool = HybridKVPool(kv, kv, page_size)
        self.mpool = PagedPool(mamba, 1, "mamba")
        self.alloc = SwaPoolAllocator(self.pool, torch)
        self.rtt = MambaReqPool(self.mpool)
        self.cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=self.rtt, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, tree_components=comps,
            sliding_window_size=window, mamba_cache_chunk_size=chunk))

    def t(self, xs) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.int64)

    def key(self, tokens) -> fast.RadixKey:
        return fast.RadixKey(list(tokens))

    def match(self, tokens) -> fast.MatchResult:
        return self.cache.match_prefix(fast.MatchPrefixParams(key=self.key(tokens)))

    def insert(self, tokens, value, prev: int = 0, e: int = 0,
               state: int | None = None) -> fast.InsertResult:
        st = self.t([state]) if state is not None else self.t(self.mpool.alloc(1))
        r = self.cache.insert(fast.InsertParams(key=self.key(tokens), value=self.t(value),
                                                prev_prefix_len=prev, mamba_value=st,
                                                swa_evicted_seqlen=e))
        if int(st[0]) not in self.states():  # not taken: the caller's to free
            self.mpool.free([int(st[0])])
        return r

    def evict(self, full: int = 0, swa: int = 0, mamba: int = 0) -> fast.EvictResult:
        return self.cache.evict(fast.EvictParams(num_tokens=full, swa_num_tokens=swa,
                                                 mamba_num=mamba))

    def node(self, tokens):
        return self.cache.find_node(self.key(tokens))

    def swa(self, tokens):
        v = self.node(tokens).aux[self.cache.swa.i].value
        return None if v is None else v.tolist()

    def mamba(self, tokens):
        v = self.node(tokens).aux[self.cache.mamba.i].value
        return None if v is None else v.tolist()

    def states(self) -> set:
        i = self.cache.mamba.i
        return {int(n.aux[i].value[0]) for n in self.cache.all_nodes()
                if n.aux[i].value is not None}

    def check(self) -> None:
        """The cache's invariants, and every allocated slot of each pool held by the tree."""
        c = self.cache
        assert c.violations() == []
        full, swa = set(), set()
        for n in c.all_nodes():
            if n is c.root_node:
                continue
            full.update(n.value.tolist())
            v = n.aux[c.swa.i].value
            if v is not None:
                swa.update(v.tolist())
        ps = self.pool.page_size
        assert {s // ps for s in full} == set(self.pool.allocated_pages())
        assert {s // ps for s in swa} == set(self.pool.swa.allocated_pages())
        assert self.states() == set(self.mpool.allocated_pages())


T4, T6 = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]


def two_nodes(w: World) -> None:
    """A = [1..4] (slots 1..4, state 1), B = A + [5, 6] (slots 5, 6, state 2)."""
    w.insert(T4, w.pool.alloc(4))
    assert w.insert(T6, [1, 2, 3, 4] + w.pool.alloc(2), prev=4).prefix_len == 4
    assert (w.swa(T4), w.mamba(T4), w.swa(T6), w.mamba(T6)) == ([1, 2, 3, 4], [1], [5, 6], [2])
    w.check()


def test_a_match_ends_where_both_validators_accept():
    w = World(window=4, chunk=2)
    two_nodes(w)
    m = w.match(T6)  # B: a window of SWA data (6 units) and a state
    assert m.device_indices.tolist() == T6 and m.mamba_branching_seqlen is None
    assert w.evict(mamba=1).mamba_num_evicted == 1  # oldest state: A's (B was touched last)
    assert (w.mamba(T4), w.swa(T4)) == (None, [1, 2, 3, 4])  # Mamba (0) does not cascade
    m = w.match(T4)  # A has SWA data but no state: nothing matches; the walk went 4 units
    assert m.device_indices.tolist() == [] and m.mamba_branching_seqlen == 4
    assert w.match(T6).device_indices.tolist() == T6
    w.check()


def test_dropping_swa_on_an_internal_node_cascades_to_its_mamba_state():
    w = World(window=2)
    two_nodes(w)
    # SWA list oldest first: A (touched by B's insert), then B; A is internal
    r = w.evict(swa=1)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted) == (0, 4, 1)
    assert (w.swa(T4), w.mamba(T4)) == (None, None)  # SWA 1 >= Mamba 0: both dropped
    assert w.mpool.allocated_pages() == frozenset({2})
    assert w.match(T6).device_indices.tolist() == T6  # B's own window suffices (2 >= 2)
    w.check()


def test_a_leaf_leaves_with_all_its_data_and_locks_hold_every_component():
    w = World(window=4)
    two_nodes(w)
    lock = w.cache.inc_lock_ref(w.node(T6))
    assert (w.cache.swa_protected_size(), w.cache.mamba_protected_size()) == (6, 1)
    r = w.evict(full=10, swa=10, mamba=10)
    # B locked (all three components), A's Full data locked by the path: only A's state goes
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted) == (0, 0, 1)
    w.check()
    w.cache.dec_lock_ref(w.node(T6), lock.to_dec_params())
    r = w.evict(full=2)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted) == (2, 2, 1)
    assert w.mpool.allocated_pages() == frozenset() and w.pool.allocated_pages() == frozenset(
        {1, 2, 3, 4})
    w.check()


def test_swa_outside_the_window_and_the_state_on_the_split_leaf():
    w = World(window=2)
    # e = 4: the caller already freed the SWA slots of [0, 4); the new leaf is split there
    slots = w.pool.alloc(6)
    w.alloc.free_swa(w.t(slots[:4]))
    r = w.insert(T6, slots, e=4)
    assert r.prefix_len == 0 and not r.mamba_exist
    assert (w.swa(T4), w.mamba(T4), w.swa(T6), w.mamba(T6)) == (None, None, [5, 6], [1])
    w.check()
    # e past the end: no leaf, the slots and the state go back
    slots = w.pool.alloc(2)
    w.alloc.free_swa(w.t(slots))
    assert w.insert([9, 9], slots, e=2).prefix_len == 0
    w.check()


def _random_step(w: World, rng: random.Random, locks: list) -> None:
    c, ps = w.cache, w.pool.page_size
    op = rng.random()
    if op < 0.5:
        n = rng.randrange(1, 7) * ps
        toks = [rng.randrange(3) for _ in range(n)]
        m = w.match(toks)
        p = len(m.device_indices)
        if w.pool.available_size() < n - p or w.pool.swa.available_size() < n - p \
                or w.mpool.available_size() < 1:
            w.evict(full=n, swa=n, mamba=1)
            return
        value = m.device_indices.tolist() + w.pool.alloc(n - p)
        e = rng.choice([0, 0, p, rng.randrange(0, n + 1) // ps * ps])
        own = [s for i, s in enumerate(value) if i >= p and i < e]
        if own:
            w.alloc.free_swa(w.t(own))  # the caller's SWA slots outside its window
        try:
            w.insert(toks, value, prev=p, e=e)
        except fast.InvalidInput:  # prev inside a tombstone the insert would restore
            w.pool.free(value[p:])
    elif op < 0.65:
        nodes = [n for n in c.all_nodes() if n is not c.root_node]
        if nodes:
            node = rng.choice(nodes)
            locks.append((node, c.inc_lock_ref(node)))
    elif op < 0.8 and locks:
        node, r = locks.pop(rng.randrange(len(locks)))
        c.dec_lock_ref(node, r.to_dec_params())
    else:
        w.evict(full=rng.randrange(4) * ps, swa=rng.randrange(4) * ps, mamba=rng.randrange(2))


@pytest.mark.parametrize("page_size,window,seed", [(1, 2, 1), (1, 4, 2), (2, 4, 3), (2, 2, 4)])
def test_random_workloads_keep_every_invariant(page_size, window, seed):
    rng = random.Random(seed)
    w = World(page_size=page_size, window=window, kv=48, mamba=6)
    locks: list = []
    for _ in range(300):
        _random_step(w, rng, locks)
        w.check()
    while locks:
        node, r = locks.pop()
        w.cache.dec_lock_ref(node, r.to_dec_params())
    w.evict(full=1000, swa=1000, mamba=1000)
    w.check()
    assert w.pool.allocated_pages() == frozenset() and w.mpool.allocated_pages() == frozenset()


def _snapshot(w: World, log: list) -> tuple:
    """Everything two caches fed the same steps must agree on: each node (in tree order) with
    its key, slots, stamp, locks and aux data, each aux list's order, the sizes, the heap's
    live entries and the frees the allocator received, in order."""
    c = w.cache
    nodes = list(c.all_nodes())
    at = {id(n): i for i, n in enumerate(nodes)}
    tree = [(at.get(id(n.parent)), list(n.key), None if n.value is None else n.value.tolist(),
             n.lock_ref, n.last_access_time, n.aux_lock,
             [(None if r.value is None else r.value.tolist(), r.lock) for r in n.aux])
            for n in nodes]
    lists = [[at[id(n)] for n in c.lru_order(name)] for name in ("swa", "mamba")]
    heap = sorted((s, at[id(n)]) for s, n in c._heap
                  if id(n) in at and n.last_access_time == s and c._is_leaf(n))
    return (tree, lists, heap, c.evictable_size(), c.protected_size(), c.swa_evictable_size(),
            c.swa_protected_size(), c.mamba_evictable_size(), c.mamba_protected_size(),
            list(log))


def _logged(w: World) -> list:
    """The allocator's frees, in order (observing instance methods in front of its own)."""
    log: list = []
    for name in ("free", "free_swa"):
        own = getattr(w.alloc, name)

        def call(slots, _own=own, _name=name):
            log.append((_name, slots.tolist()))
            return _own(slots)
        setattr(w.alloc, name, call)
    return log


@pytest.mark.parametrize("comps", [("full", "swa", "mamba"), ("full", "mamba", "swa")])
@pytest.mark.parametrize("page_size,window,seed", [(1, 2, 5), (2, 4, 6), (1, 4, 7)])
def test_the_inlined_pair_path_matches_the_per_component_path(comps, page_size, window, seed):
    """fast/hybrid.py writes the stock SWA + Mamba plug-ins' hooks out (``_pair``: match
    validators and list moves, insert checks and commits, a leaf's drops; ``_inline_touch``):
    the same steps on a cache taking the plug-ins' own calls end in the same state after
    every step, with the same frees in the same order, in either component order."""
    worlds, logs, locks = [], [], []
    for inline in (True, False):
        w = World(page_size=page_size, window=window, kv=48, mamba=6, comps=comps)
        if not inline:
            w.cache._pair = None
            w.cache._inline_touch = False
        else:
            assert w.cache._pair is not None and w.cache._inline_touch
        worlds.append(w)
        logs.append(_logged(w))
        locks.append([])
    rngs = [random.Random(seed), random.Random(seed)]
    for _ in range(300):
        for w, rng, lk in zip(worlds, rngs, locks, strict=True):
            _random_step(w, rng, lk)
        assert _snapshot(worlds[0], logs[0]) == _snapshot(worlds[1], logs[1])
    for w in worlds:
        w.check()


# ----------------------------------------------------------------------------------------------
# The request path (cache_unfinished_req / cache_finished_req) with SWA, Mamba and both
# ----------------------------------------------------------------------------------------------


class Req:
    """The fields SGLang 0.5.13.post1's Req has for a hybrid cache."""

    def __init__(self, tokens, row: int, root) -> None:
        self.origin_input_ids = list(tokens)
        self.output_ids: list = []
        self.extra_key = None
        self.req_pool_idx = row
        self.kv_committed_len = 0
        self.fill_len = 0
        self.cache_protected_len = 0
        self.last_node = root
        self.swa_uuid_for_lock = None
        self.swa_evicted_seqlen = 0
        self.mamba_pool_idx = None

    def get_fill_ids(self) -> list:
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]

    def pop_committed_kv_cache(self) -> int:
        return self.kv_committed_len


class ReqWorld(World):
    """A World for one of the component sets; requests admitted as a scheduler does."""

    def __init__(self, comps: tuple, page_size: int = 1, window: int = 2) -> None:
        self.pool = HybridKVPool(64, 64, page_size) if "swa" in comps else PagedPool(64, page_size)
        self.mpool = PagedPool(8, 1, "mamba")
        self.alloc = (SwaPoolAllocator if "swa" in comps else PoolAllocator)(self.pool, torch)
        self.rtt = MambaReqPool(self.mpool)
        self.cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=self.rtt, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, tree_components=("full",) + comps,
            sliding_window_size=window if "swa" in comps else None, mamba_cache_chunk_size=2))
        self.rows = list(range(16))  # free rows of the request table

    def admit(self, tokens) -> Req:
        c = self.cache
        req = Req(tokens, self.rows.pop(0), c.root_node)
        m = self.match(tokens)
        p = len(m.device_indices)
        lock = c.inc_lock_ref(m.last_device_node)
        req.last_node, req.dec_lock_params = m.last_device_node, lock.to_dec_params()
        req.swa_uuid_for_lock = lock.swa_uuid_for_lock
        req.cache_protected_len = p
        row = self.rtt.req_to_token[req.req_pool_idx]
        row[:p] = m.device_indices
        row[p:len(tokens)] = self.t(self.pool.alloc(len(tokens) - p))
        if c.mamba is not None:
            req.mamba_pool_idx = self.t(self.mpool.alloc(1))[0]
        return req

    def states(self) -> set:
        if self.cache.mamba is None:
            return set()
        return super().states()

    def check(self, reqs=()) -> None:
        """Invariants, and each pool's slots held by the tree or a running request."""
        c = self.cache
        assert c.violations() == []
        full = set()
        for n in c.all_nodes():
            if n is not c.root_node:
                full.update(n.value.tolist())
        states = self.states()
        for r in reqs:
            full.update(self.rtt.req_to_token[r.req_pool_idx, :len(r.origin_input_ids)].tolist())
            if r.mamba_pool_idx is not None:
                states.add(int(r.mamba_pool_idx))
        ps = self.pool.page_size
        assert {s // ps for s in full} == set(self.pool.allocated_pages())
        assert states == set(self.mpool.allocated_pages())


@pytest.mark.parametrize("comps", [("swa",), ("mamba",), ("swa", "mamba")])
def test_requests_go_through_the_request_path(comps):
    w = ReqWorld(comps)
    a = w.admit([1, 2, 3, 4, 5, 6])
    a.kv_committed_len = a.fill_len = 6
    w.cache.cache_finished_req(a)  # A's state (if any) now the tree's
    assert w.match([1, 2, 3, 4, 5, 6]).device_indices.tolist() == [1, 2, 3, 4, 5, 6]
    w.check()
    b = w.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert b.cache_protected_len == 6
    b.fill_len = 8
    w.cache.cache_unfinished_req(b, chunked=True)  # a copy of B's state goes to the tree
    assert b.cache_protected_len == 8 and len(b.last_node.key) == 2
    if "mamba" in comps:
        assert w.mamba([1, 2, 3, 4, 5, 6, 7, 8]) is not None
        assert int(b.mamba_pool_idx) not in w.states()  # the tree holds a copy
    w.check([b])
    b.kv_committed_len = 8
    w.cache.cache_finished_req(b)  # the node has a state: B's own is freed
    assert b.mamba_pool_idx is None
    w.check()
    assert w.cache.full_protected_size() == 0


def test_a_finished_request_hands_its_window_over():
    w = ReqWorld(("swa", "mamba"), window=2)
    a = w.admit([1, 2, 3, 4, 5, 6])
    row = w.rtt.req_to_token[a.req_pool_idx]
    w.alloc.free_swa(row[:4])  # the scheduler freed the SWA slots that left the window
    a.swa_evicted_seqlen = 4
    a.kv_committed_len = a.fill_len = 6
    w.cache.cache_finished_req(a)
    assert (w.swa([1, 2, 3, 4]), w.swa([1, 2, 3, 4, 5, 6])) == (None, [5, 6])
    assert w.mamba([1, 2, 3, 4, 5, 6]) == [1]
    w.check()


@pytest.mark.parametrize("comps,seed", [(("swa",), 1), (("mamba",), 2), (("swa", "mamba"), 3)])
def test_random_requests_keep_every_invariant(comps, seed):
    rng = random.Random(seed)
    w = ReqWorld(comps, page_size=rng.choice([1, 2]))
    ps = w.pool.page_size
    running: list = []
    for _ in range(80):
        if running and (rng.random() < 0.5 or len(running) > 3):
            r = running.pop(rng.randrange(len(running)))
            n = len(r.origin_input_ids)
            if r.fill_len < n and rng.random() < 0.5:
                r.fill_len = rng.randrange(r.fill_len, n + 1)
                w.cache.cache_unfinished_req(r, chunked=True)
                running.append(r)
            else:
                r.kv_committed_len = r.fill_len = n
                w.cache.cache_finished_req(r, is_insert=rng.random() < 0.9)
                w.rows.append(r.req_pool_idx)
        else:
            n = rng.randrange(1, 6) * ps
            w.evict(full=n, swa=n, mamba=1)
            if w.pool.available_size() < n or w.mpool.available_size() < 2:
                continue
            running.append(w.admit([rng.randrange(2) for _ in range(n)]))
            running[-1].fill_len = running[-1].cache_protected_len
        w.check(running)
