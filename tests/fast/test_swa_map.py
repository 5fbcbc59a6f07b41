"""The SWA map read by the C core (fast/_core.c ``swa_gather``, ``swa_leaf``; fast/components/
swa.py ``sglang_map_pool``): where the allocator and its pool are exactly sglang's, an SWA
node's slots come from ``full_to_swa_index_mapping`` read directly instead of through
``translate_loc_from_full_to_swa``, and a new leaf's Full and SWA slots from one C call.
The values must be the method's: checked on the functions alone (against torch's indexing),
on the decision (which allocators qualify), and on whole caches over sglang's allocator, one
reading the map and its twin calling the method, in lockstep over random requests."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.components import swa as swa_mod  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@needs_core
@pytest.mark.parametrize("seed", range(4))
def test_swa_gather_and_swa_leaf_equal_torch_indexing(seed):
    rng = random.Random(seed)
    mapping = _i64([rng.randrange(0, 1000) for _ in range(200)])
    for _ in range(50):
        full = _i64([rng.randrange(0, 200) for _ in range(rng.randrange(0, 40))])
        got = _core.swa_gather(mapping, full)
        assert got.dtype == torch.int64 and got.tolist() == mapping[full].tolist()
        # a slice of a longer tensor (a view with an offset), as a request's slots are
        value = torch.cat([_i64([7, 8, 9]), full])[3:]
        start = rng.randrange(0, len(full) + 1)
        length = rng.randrange(0, len(full) - start + 1)
        leaf, leaf_swa = _core.swa_leaf(value, start, length, mapping)
        want = torch.narrow_copy(value, 0, start, length)
        assert leaf.tolist() == want.tolist() and leaf.dtype == torch.int64
        assert leaf.data_ptr() != value.data_ptr() + 8 * start or length == 0  # a copy
        assert leaf_swa.tolist() == mapping[want].tolist()


@needs_core
def test_swa_gather_declines_what_torch_would_wrap_or_refuse():
    mapping = _i64(range(10))
    assert _core.swa_gather(mapping, _i64([10])) is None  # torch raises
    assert _core.swa_gather(mapping, _i64([-1])) is None  # torch wraps
    assert _core.swa_gather(mapping, torch.tensor([1, 2], dtype=torch.int32)) is None
    assert _core.swa_gather(mapping, _i64([1, 2, 3, 4])[::2]) is None  # not contiguous
    assert _core.swa_gather(mapping.to(torch.int32), _i64([1])) is None
    value = _i64([1, 2, 3])
    assert _core.swa_leaf(value, 2, 2, mapping) is None  # past the end
    assert _core.swa_leaf(value, -1, 1, mapping) is None
    assert _core.swa_leaf(_i64([1, 20]), 0, 2, mapping) is None  # a slot outside the map
    # the map is read ahead (prefetched) and checked in the same pass: a bad slot far into a
    # long list, and one just outside the range read, are declined / ignored alike
    for bad in (10, -1, 2**62):
        long = [j % 10 for j in range(300)]
        long[200] = bad
        assert _core.swa_gather(mapping, _i64(long)) is None
        assert _core.swa_leaf(_i64(long), 0, 300, mapping) is None
        assert _core.swa_leaf(_i64(long), 0, 200, mapping)[1].tolist() == long[:200]
        assert _core.swa_gather(mapping, _i64(long)[:200]).tolist() == long[:200]


@pytest.mark.parametrize("general", [False, True])
def test_insert_refuses_prev_inside_a_tombstone_it_would_restore(general):
    """The one-component insert's inlined SWA check (``SwaComponent.check_insert``), as the
    general path's: ``prev_prefix_len`` inside an SWA tombstone that the insert's window would
    restore is refused before anything changes."""
    from uniradix.conformance.bench.hybrid import SwaFreeListAllocator
    from uniradix.fast.hybrid import FAST_PATHS

    alloc = SwaFreeListAllocator(64, 32, 1, torch)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        tree_components=("full", "swa"), sliding_window_size=2))
    assert cache._insert_fast is not None
    if general:
        for name in FAST_PATHS:
            setattr(cache, name, None)
    slots = alloc.alloc(6)
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4, 5, 6]), value=slots,
                                   swa_evicted_seqlen=4))  # [1..4] a tombstone, [5, 6] SWA
    value = torch.cat([slots[:2], alloc.alloc(3)])
    before = (_tree(cache), alloc.available_size(), alloc.swa.available_size())
    with pytest.raises(fast.InvalidInput, match="inside an SWA tombstone"):
        cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4, 7]), value=value,
                                       prev_prefix_len=2))
    assert (_tree(cache), alloc.available_size(), alloc.swa.available_size()) == before


# ---- over sglang's allocator (the upstream venv) --------------------------------------------


def _sglang():
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        torch_mod = load_upstream().torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return torch_mod, SWATokenToKVPoolAllocator, SWAKVPool


def _alloc(slots: int, ps: int, alloc_cls=None, pool_cls=None):
    t, swa_cls, kv_cls = _sglang()
    kv = (pool_cls or kv_cls)(size=slots, size_swa=slots // 2, page_size=ps, dtype=t.float16,
                              head_num=1, head_dim=1, swa_attention_layer_ids=[1],
                              full_attention_layer_ids=[0], enable_kvcache_transpose=False,
                              device="cpu")
    return (alloc_cls or swa_cls)(slots, slots // 2, page_size=ps, dtype=t.float16,
                                  device="cpu", kvcache=kv, need_sort=False)


def _cache(alloc, ps: int, window: int):
    return fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=("full", "swa"), sliding_window_size=window))


@pytest.mark.upstream
def test_map_pool_only_for_sglang_own_classes():
    _, swa_cls, kv_cls = _sglang()
    alloc = _alloc(64, 1)
    assert swa_mod.sglang_map_pool(alloc) is (alloc._kvcache if _core is not None else None)

    class Alloc(swa_cls):
        pass

    class Pool(kv_cls):
        pass

    assert swa_mod.sglang_map_pool(_alloc(64, 1, alloc_cls=Alloc)) is None
    assert swa_mod.sglang_map_pool(_alloc(64, 1, pool_cls=Pool)) is None
    patched = _alloc(64, 1)
    patched.translate_loc_from_full_to_swa = lambda full: full  # (an instance method)
    assert swa_mod.sglang_map_pool(patched) is None
    patched = _alloc(64, 1)
    patched._kvcache.translate_loc_from_full_to_swa = lambda full: full
    assert swa_mod.sglang_map_pool(patched) is None
    # and a cache over such an allocator calls the method
    calls = []
    alloc = _alloc(64, 1)
    method = alloc.translate_loc_from_full_to_swa
    alloc.translate_loc_from_full_to_swa = lambda full: calls.append(1) or method(full)
    cache = _cache(alloc, 1, 4)
    slots = alloc.alloc(6)
    cache.insert(fast.InsertParams(key=fast.RadixKey(list(range(6))), value=slots))
    assert calls and cache.swa.map_pool is None


def _tree(cache) -> list:
    """Every node top-down (children in key order): key, Full slots, SWA slots, locks."""
    out, todo = [], [cache.root_node]
    while todo:
        node = todo.pop()
        rec = node.aux[0] if node is not cache.root_node else None
        out.append((tuple(node.key) if node is not cache.root_node else (),
                    None if node.value is None else node.value.tolist(),
                    None if rec is None or rec.value is None else rec.value.tolist(),
                    node.lock_ref, node.aux_lock))
        todo.extend(sorted(node.children.values(), key=lambda c: tuple(c.key), reverse=True))
    return out


def _alloc_state(a) -> list:
    out = []
    for s in (a.full_attn_allocator, a.swa_attn_allocator):
        out += [s.free_pages.tolist(), s.release_pages.tolist()]
    return out + [a.full_to_swa_index_mapping.tolist()]


def _take(alloc, n: int, ps: int):
    if ps == 1:
        return alloc.alloc(n)
    from uniradix.conformance.bench import sglang_alloc
    return sglang_alloc.PagedSwaAlloc(alloc).alloc(n)


@pytest.mark.upstream
@pytest.mark.parametrize(("ps", "window"), [(1, 4), (1, 16), (4, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_cache_reading_the_map_equals_its_twin_calling_the_method(ps, window, seed,
                                                                  monkeypatch):
    """Random requests (shared prefixes, an evicted SWA window on some, evictions when the
    pool runs short) on a cache reading sglang's map and on its twin whose component calls
    ``translate_loc_from_full_to_swa``: the same results, trees and allocator state at every
    step."""
    _sglang()
    if _core is None:
        pytest.skip("the C core is not built or not in use")
    rng = random.Random(seed)
    allocs = [_alloc(512, ps), _alloc(512, ps)]
    caches = [_cache(a, ps, window) for a in allocs]
    assert caches[0].swa.map_pool is allocs[0]._kvcache
    caches[1].swa.map_pool = None  # the twin: the allocator's method
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    # per translate call: (whether the reading cache made it, whether it read the map); per
    # swa_leaf call: whether it was handed the reading cache's map
    reads: list[tuple[bool, bool]] = []
    leaves: list[bool] = []
    translate, swa_leaf = swa_mod.SwaComponent.translate, _core.swa_leaf
    reader = caches[0].swa

    def counting(self, full):
        reads.append((self is reader, self.map_pool is not None))
        return translate(self, full)

    def counting_leaf(*args):
        leaves.append(args[3] is reader.map_pool.full_to_swa_index_mapping)
        return swa_leaf(*args)

    monkeypatch.setattr(swa_mod.SwaComponent, "translate", counting)
    monkeypatch.setattr(_core, "swa_leaf", counting_leaf)
    for _ in range(150):
        tokens = rng.choice(prompts) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 24))]
        tokens = tokens[: len(tokens) // ps * ps]
        if not tokens:
            continue
        pick = rng.randrange(4)  # the caller's evicted SWA window (the same for both)
        outs = []
        for cache, alloc in zip(caches, allocs, strict=True):
            m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
            lock = cache.inc_lock_ref(m.last_device_node)
            matched = len(m.device_indices)
            need = len(tokens) - matched
            short = need - alloc.full_available_size()
            short_swa = need - alloc.swa_available_size()
            ev = cache.evict(fast.EvictParams(num_tokens=max(short, 0),
                                              swa_num_tokens=max(short_swa, 0)))
            fresh = _take(alloc, need, ps) if need else torch.empty(0, dtype=torch.int64)
            if fresh is None:
                cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
                outs.append(("aborted", ev.num_tokens_evicted, ev.swa_num_tokens_evicted))
                continue
            value = torch.cat([m.device_indices, fresh.to(torch.int64)])
            e = (0, 0, matched // ps * ps, len(tokens) // 2 // ps * ps)[pick]
            res = cache.insert(fast.InsertParams(
                key=fast.RadixKey(tokens), value=value, prev_prefix_len=matched,
                swa_evicted_seqlen=e))
            cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
            outs.append((m.device_indices.tolist(), ev.num_tokens_evicted,
                         ev.swa_num_tokens_evicted, res.prefix_len))
        assert outs[0] == outs[1]
        assert _tree(caches[0]) == _tree(caches[1])
        assert _alloc_state(allocs[0]) == _alloc_state(allocs[1])
        for cache in caches:
            assert cache.violations() == []
    # the reading cache read the map on every translate, the twin never did, both translated,
    # and every leaf swa_leaf made came from the reading cache's map
    assert set(reads) == {(True, True), (False, False)}, set(reads)
    assert len(leaves) > 0 and all(leaves), leaves
