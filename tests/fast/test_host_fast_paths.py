"""The host tier's specialised paths against the general paths they stand for: each scenario runs
on two caches built alike, one as built (the specialised paths) and one with each specialised
path replaced by the general one it equals, and the two must agree step by step (results, the
whole tree, the counters, the in-flight locks)."""

import random
import types
from array import array

import pytest

torch = pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast import host_full  # noqa: E402
from uniradix.fast.errors import HandleError  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig, HostDecLockRefParams, InitLoadBackParams  # noqa: E402
from uniradix.fast.hybrid import HybridRadixCache  # noqa: E402
from uniradix.fast.node import Node  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402


def _cache(policy: str, io: str, page: int, threshold: int = 1):
    alloc = PoolAllocator(PagedPool(48, page, "kv"), torch)
    cfg = HiCacheConfig(host_slots=64, write_policy=policy, io=io, load_back_threshold=0,
                        write_through_threshold=threshold)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=page, hicache=cfg))
    return cache, alloc


def _general(cache) -> None:
    """Put ``cache`` on the general paths the specialised ones equal."""
    tier = cache.tier
    tier.controller.ack_only = False  # every backup through ``submit_write``
    tier.__dict__.pop("write_backup", None)  # (``_write_backup_full``: ``write_backup`` itself)
    tier._full_write_lock = lambda node: cache.inc_lock_ref(node).to_dec_params()
    tier._full_write_unlock = lambda anchor: cache.dec_lock_ref(
        anchor, HostDecLockRefParams(anchor=anchor))
    cache.check_hicache_events = types.MethodType(HybridRadixCache.check_hicache_events, cache)
    cache._new_node = types.MethodType(HybridRadixCache._new_node, cache)
    cache._touch = types.MethodType(HybridRadixCache._touch, cache)
    cache._match_fast = cache._insert_fast = None  # (fast/host_full.py's paths)
    cache._inc_lock_fast = cache._dec_lock_host = None


def _tree(cache) -> list:
    out, stack = [], [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        here = path + (tuple(node.key),)
        out.append((here, None if node.value is None else node.value.tolist(),
                    None if node.host_value is None else node.host_value.tolist(),
                    node.lock_ref, node.host_lock_ref, node.last_access_time, node.hit_count,
                    node.dev_children, node.aux))
        stack.extend((c, here) for c in node.children.values())
    tier = cache.tier
    return sorted(out, key=repr) + [
        cache._evictable, cache._protected, tier.host_tokens, len(tier.host_leaves),
        sorted(len(e.node.key) for e in tier.ongoing_write_through.values()),
        sorted(len(e.node.key) for e in tier.ongoing_load_back.values()),
        len(tier.controller.ack_write_queue), len(tier.controller.ack_load_queue),
        sorted(cache._owned)]  # (the slot ledger: validate_slots is on over the pool model)


def _heaps(cache) -> list:
    """The heaps' entries, stale ones too (the same pushes, in any order)."""
    return [sorted((s, _path(n)) for s, n in cache._heap),
            sorted((s, _path(n)) for s, n in cache.tier.host_leaf_heap.entries)]


def _path(node) -> tuple:
    """A node named by its path's keys (ids differ between two caches)."""
    out = []
    while node is not None:
        out.append(tuple(node.key))
        node = node.parent
    return tuple(out)


def _key(rng: random.Random, tokens: list, rich: bool) -> object:
    """uniradix's ``RadixKey``, or (``rich``) sometimes an object of sglang's ``RadixKey`` shape
    with a list or an ``array('q')`` of token ids, sometimes with an extra key."""
    ek = rng.choice([None, None, "a"]) if rich else None
    shape = rng.randrange(3) if rich else 0
    if shape == 0:
        return fast.RadixKey(tokens, ek)
    toks = tokens if shape == 1 else array("q", tokens)
    return types.SimpleNamespace(token_ids=toks, extra_key=ek, is_bigram=False)


def _step(cache, alloc, rng: random.Random, page: int, rich: bool = False,
          held: list | None = None) -> object:
    """One random step; ``rich``: the keys a scheduler passes, the caller's own prefix,
    chunked inserts, and locks held in ``held`` ((node, unlock params)) and released."""
    op = rng.random()
    # (rich: a tail shorter than a page, cut off by the insert and the match)
    tokens = [rng.randrange(3) for _ in range(page * rng.randrange(1, 5)
                                              + (rng.randrange(page) if rich else 0))]
    key = _key(rng, tokens, rich)
    if op < 0.4:
        slots = alloc.alloc(len(tokens) - len(tokens) % page)
        if slots is None:
            return cache.evict(fast.EvictParams(num_tokens=len(tokens))).num_tokens_evicted
        prev, chunked = 0, False
        if rich:  # the caller's own prefix: the slots of a match, its length as prev_prefix_len
            m = cache.match_prefix(fast.MatchPrefixParams(key=key))
            prev = len(m.device_indices)
            slots = torch.cat([m.device_indices, slots[prev:]])
            chunked = rng.random() < 0.3
        if len(slots) < len(tokens):  # (the tail past the last whole page)
            slots = torch.cat([slots, torch.zeros(len(tokens) - len(slots), dtype=torch.int64)])
        r = cache.insert(fast.InsertParams(key=key, value=slots, prev_prefix_len=prev,
                                           chunked=chunked))
        return (r.prefix_len, r.total_len, r.mamba_exist)
    if held is not None and op < 0.5:  # a lock of a match's node (maybe evicted), or an unlock
        if held and (op < 0.45 or len(held) > 4):
            node, params = held.pop(rng.randrange(len(held)))
            try:
                r = cache.dec_lock_ref(node, params)
            except HandleError as e:  # (a path locked twice, unlocked three times)
                return ("refused", str(e))
            return r.delta
        m = cache.match_prefix(fast.MatchPrefixParams(key=key))
        node = m.best_match_node if rng.random() < 0.5 else m.last_device_node
        if node is cache.root_node:
            return None
        r = cache.inc_lock_ref(node)
        params = r.to_dec_params()
        held.append((node, params))
        if rng.random() < 0.1:
            held.append((node, params))  # (the same unlock twice: the second is refused)
        return (r.delta, {k: len(v) for k, v in r.skip_lock_node_ids.items()}, _path(r.anchor))
    if op < 0.6:
        m = cache.match_prefix(fast.MatchPrefixParams(key=key))
        if rich:
            return (m.device_indices.tolist(), _path(m.last_device_node),
                    _path(m.best_match_node), m.host_hit_length)
        if not m.host_hit_length:
            return (m.device_indices.tolist(), 0)
        req = types.SimpleNamespace(last_node=m.last_device_node)
        idx, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, 0, None, req))
        cache.ready_to_load_host_cache()
        return (m.device_indices.tolist(), idx.tolist())
    if op < 0.75:
        return cache.evict(fast.EvictParams(num_tokens=rng.randrange(1, 12))).num_tokens_evicted
    if op < 0.8:
        return cache.evict_host(rng.randrange(1, 12))
    if op < 0.9 and cache.tier.controller.io == "manual":
        cache.cache_controller.complete(rng.randrange(-1, 3), rng.randrange(-1, 3))
        return None
    return cache.check_hicache_events()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("io", ["sync", "manual"])
@pytest.mark.parametrize("page", [1, 2])
def test_specialised_host_paths_equal_the_general_ones(policy, io, page):
    (a, alloc_a), (b, alloc_b) = _cache(policy, io, page), _cache(policy, io, page)
    assert a._new_node is Node  # (no aux component: a new node is a plain Node)
    _general(b)
    ra, rb = random.Random(7), random.Random(7)
    for step in range(300):
        got_a, got_b = _step(a, alloc_a, ra, page), _step(b, alloc_b, rb, page)
        assert got_a == got_b, step
        assert _tree(a) == _tree(b), step
        if step % 20 == 0:  # (the written-out leaf tests keep the leaf sets and heaps right)
            assert a.violations() == [], step
    assert a.violations() == [] and b.violations() == []


def test_the_write_lock_equals_inc_lock_ref():
    """The write-through lock and unlock written out: the same counts, the same unlock params,
    the same state after the unlock, and a second unlock refused with nothing changed."""
    cache, alloc = _cache("write_back", "sync", 1)  # (write-back: no lock of its own)
    for toks in ([1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]):
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(len(toks))))
    node = cache.find_node(fast.RadixKey([1, 2, 3, 6, 7]))
    before = _tree(cache)
    general = cache.inc_lock_ref(node).to_dec_params()
    locked = _tree(cache)
    cache.dec_lock_ref(node, general)
    assert _tree(cache) == before
    special = cache.tier._full_write_lock(node)
    assert _tree(cache) == locked
    assert (special.anchor, special.skip_lock_node_ids, special.swa_uuid_for_lock,
            special.swa_uuid_for_host_lock) == (general.anchor, general.skip_lock_node_ids,
                                                general.swa_uuid_for_lock,
                                                general.swa_uuid_for_host_lock)
    cache.tier._full_write_unlock(special.anchor)
    assert _tree(cache) == before and cache.violations() == []
    with pytest.raises(HandleError, match="not locked"):  # released twice: refused, unchanged
        cache.tier._full_write_unlock(special.anchor)
    assert _tree(cache) == before


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 2])
@pytest.mark.parametrize("threshold", [1, 3])
def test_host_full_paths_equal_the_general_ones(policy, page, threshold):
    """fast/host_full.py's insert and match (what a cache with the Full component alone over a
    host tier runs) against the general paths, with the keys a scheduler passes (sglang's
    ``RadixKey`` shape, list or array token ids, extra keys), a tail shorter than a page, the
    caller's own prefix (``prev_prefix_len``) and chunked inserts."""
    (a, alloc_a), (b, alloc_b) = (_cache(policy, "manual", page, threshold),
                                  _cache(policy, "manual", page, threshold))
    assert a._insert_fast is host_full.insert_host and a._match_fast is host_full.match_host
    assert a.tier.write_backup == a.tier._write_backup_full
    assert a._inc_lock_fast is host_full.inc_lock_host
    assert a._dec_lock_host is host_full.dec_lock_host
    answered = {"insert": 0, "match": 0}

    def counted(name, fn):
        def call(cache, params):
            out = fn(cache, params)
            answered[name] += out is not None
            return out
        return call
    a._insert_fast = counted("insert", host_full.insert_host)
    a._match_fast = counted("match", host_full.match_host)
    _general(b)
    ra, rb = random.Random(11), random.Random(11)
    held_a: list = []
    held_b: list = []
    for step in range(400):
        got_a = _step(a, alloc_a, ra, page, True, held_a)
        got_b = _step(b, alloc_b, rb, page, True, held_b)
        assert got_a == got_b, step
        assert _tree(a) == _tree(b), step
        assert a._clock == b._clock and _heaps(a) == _heaps(b), step
        if step % 25 == 0:
            assert a.violations() == [], step
    assert a.violations() == [] and b.violations() == []
    assert answered["insert"] > 50 and answered["match"] > 50  # (the fast paths ran)


def test_host_full_paths_decline_and_refuse_alike():
    """Where the fast paths decline (an EAGLE bigram key, a disabled cache) the general path
    answers, and bad input is refused with the general path's error, nothing changed."""
    (a, alloc_a), (b, _) = _cache("write_through", "sync", 1), _cache("write_through", "sync", 1)
    _general(b)
    bigram = fast.RadixKey([1, 2, 3], is_bigram=True)
    assert host_full.insert_host(a, fast.InsertParams(key=bigram, value=alloc_a.alloc(3))) is None
    assert host_full.match_host(a, fast.MatchPrefixParams(key=bigram)) is None
    bad = [fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(3, dtype=torch.int64)),
           fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(2, dtype=torch.int32)),
           fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(2, dtype=torch.int64),
                             prev_prefix_len=-1),
           fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(2, dtype=torch.int64),
                             chunked=1),
           fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(2, dtype=torch.int64),
                             priority="high"),
           fast.InsertParams(key=fast.RadixKey([1, 2]), value=torch.zeros(2, dtype=torch.int64),
                             swa_evicted_seqlen=2),
           fast.InsertParams(key=types.SimpleNamespace(token_ids=[1, True], extra_key=None,
                                                       is_bigram=False),
                             value=torch.zeros(2, dtype=torch.int64)),
           fast.InsertParams(key=types.SimpleNamespace(token_ids=array("l", [1, 2]),
                                                       extra_key=None, is_bigram=False),
                             value=torch.zeros(2, dtype=torch.int64))]
    for params in bad:
        errors = []
        for cache in (a, b):
            before = _tree(cache)
            with pytest.raises(Exception) as e:
                cache.insert(params)
            errors.append((type(e.value), str(e.value)))
            assert _tree(cache) == before
        assert errors[0] == errors[1], params
    a.disable = True
    assert host_full.insert_host(a, fast.InsertParams(key=fast.RadixKey([1]),
                                                      value=alloc_a.alloc(1))) is None
    assert host_full.match_host(a, fast.MatchPrefixParams(key=fast.RadixKey([1]))) is None


def test_full_backup_backs_the_parent_up_first():
    """A node reaching the write-through threshold below a parent without a host copy (the
    upper part of a split, its hit count restarted): the parent is backed up first, by the
    written-out backup as by ``write_backup``."""
    (a, alloc_a), (b, alloc_b) = (_cache("write_through", "sync", 1, 3),
                                  _cache("write_through", "sync", 1, 3))
    _general(b)
    for toks in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4]):
        for cache, alloc in ((a, alloc_a), (b, alloc_b)):
            slots = alloc.alloc(len(toks))
            cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=slots))
        assert _tree(a) == _tree(b) and _heaps(a) == _heaps(b)
    upper = a.find_node(fast.RadixKey([1, 2]))
    lower = a.find_node(fast.RadixKey([1, 2, 3, 4]))
    assert upper.host_value is not None and lower.host_value is not None
    assert a.violations() == [] and b.violations() == []
