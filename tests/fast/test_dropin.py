"""The drop-in boundary without sglang (fast/compat.py): SGLang-shaped keys, settings honoured or
refused by name, and the request path as SGLang 0.5.13.post1's scheduler drives it (regression
tests for the double free in cache_finished_req and the fill_ids read of
cache_unfinished_req).  tests/fast/test_dropin_upstream.py does the same with sglang's own objects."""

from __future__ import annotations

import types
from array import array

import pytest
import torch

import uniradix.fast as fast
import uniradix.fast.cache as fast_cache
from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.compat import REFUSED
from uniradix.spec.world import PagedPool


class ForeignKey:
    """A key of SGLang's RadixKey shape that is not uniradix's type."""

    __slots__ = ("token_ids", "extra_key", "is_bigram")

    def __init__(self, token_ids, extra_key=None, is_bigram=False):
        self.token_ids, self.extra_key, self.is_bigram = token_ids, extra_key, is_bigram


class Req:
    """The fields SGLang 0.5.13.post1's Req has for the cache (no ``fill_ids``: the computed
    tokens come from ``get_fill_ids()``)."""

    def __init__(self, tokens, row: int, root) -> None:
        self.origin_input_ids = array("q", tokens)
        self.output_ids = array("q")
        self.extra_key = None
        self.req_pool_idx = row
        self.kv_committed_len = 0
        self.fill_len = 0
        self.cache_protected_len = 0
        self.last_node = root
        self.swa_uuid_for_lock = None

    def get_fill_ids(self) -> array:
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]

    def pop_committed_kv_cache(self) -> int:
        return self.kv_committed_len


def make(page_size=4, slots=64, **kw):
    pool = PagedPool(slots, page_size)
    alloc = PoolAllocator(pool, torch, whole_pages=True)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=kw.pop("disable", False), req_to_token_pool=ReqToTokenPool(rows=2, cols=32),
        token_to_kv_pool_allocator=alloc, page_size=page_size, **kw))
    return cache, alloc, pool


def tree_slots(cache) -> list:
    return [s for n in cache.all_nodes() if n is not cache.root_node for s in n.value.tolist()]


def run_request(cache, alloc, tokens, committed):
    """Admit on row 0 with no prefix, compute ``committed`` tokens (their pages allocated, only
    the computed positions written to the row, as SGLang does), and return the request."""
    ps = cache.page_size
    req = Req(tokens, 0, cache.root_node)
    slots = alloc.alloc(-(-committed // ps) * ps)
    cache.req_to_token_pool.req_to_token[0, :committed] = slots[:committed]
    req.kv_committed_len = req.fill_len = committed
    return req


# -- the double free ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["insert", "no_insert", "disabled"])
def test_finished_req_frees_only_its_committed_slots_from_a_reused_row(mode):
    """Row 0 first holds request A's 8 slots (cached by the tree, or freed when the cache is
    disabled), then request B's 6: the row's positions 6 and 7 still name A's slots.  Finishing B
    must free B's own pages only (page 4, 6 committed: its second page), never A's, which the tree
    holds."""
    cache, alloc, pool = make(disable=(mode == "disabled"))
    a = run_request(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8], 8)
    cache.cache_finished_req(a)
    held = tree_slots(cache) if mode != "disabled" else []
    alloc.alloc(4)  # another request's page: B's pages are not A's (a disabled cache freed A's)
    pool.take_freed()
    b = run_request(cache, alloc, [9, 9, 9, 9, 7, 7], 6)
    b_slots = cache.req_to_token_pool.req_to_token[0, :6].tolist()
    cache.cache_finished_req(b, is_insert=(mode != "no_insert"))
    freed = pool.take_freed()
    assert not set(freed) & set(held), f"freed slots the tree holds: {sorted(set(freed) & set(held))}"
    assert all(pool.is_allocated(s) for s in tree_slots(cache))
    if mode == "insert":  # B's first page is cached, its partial second page is freed whole
        assert freed == [b_slots[4] - b_slots[4] % 4 + j for j in range(4)]
    else:  # everything B owns goes back
        assert set(b_slots) <= set(freed) and len(freed) == 8
    cache.sanity_check()


def test_unfinished_req_reads_get_fill_ids():
    """0.5.13.post1's Req has no ``fill_ids``: a chunked prefill caches ``get_fill_ids()``."""
    cache, alloc, pool = make()
    req = run_request(cache, alloc, list(range(1, 12)), 8)
    assert not hasattr(req, "fill_ids")
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 8 and cache.protected_size() == 8
    assert req.last_node is not cache.root_node and req.swa_uuid_for_lock is None


def test_unfinished_req_on_a_disabled_cache_keeps_the_row_as_prefix():
    cache, alloc, pool = make(disable=True)
    req = run_request(cache, alloc, list(range(1, 12)), 6)
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == cache.req_to_token_pool.req_to_token[0, :6].tolist()


def test_disable_finished_insert_frees_instead_of_caching():
    cache, alloc, pool = make(disable_finished_insert=True)
    req = run_request(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8], 8)
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 0 and len(pool.take_freed()) == 8


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("eviction_policy", "random"), ("eviction_policy", 3)]
                         + [(f, 1.5 if f == "cache_ttl_seconds" else {0: object} if f.startswith("component")
                             else True) for f, _, _ in REFUSED])
@pytest.mark.parametrize("hicache", [False, True])
def test_unhonoured_settings_are_refused_by_name(field, value, hicache):
    kw = {field: value}
    if hicache:
        kw["hicache"] = fast.HiCacheConfig(host_slots=32)
    with pytest.raises(fast.Unsupported, match=field):
        make(**kw)


@pytest.mark.parametrize("field, value", [("pp_size", 2), ("attn_cp_size", 2)])
def test_host_tier_refuses_what_it_cannot_do(field, value):
    make(**{field: value})  # the device tier takes it
    with pytest.raises(fast.Unsupported, match=field):
        make(hicache=fast.HiCacheConfig(host_slots=32), **{field: value})


def test_default_and_inert_settings_pass():
    cache, _, _ = make(eviction_policy="LRU", chunked_prefill_size=512, sliding_window_size=8,
                       pp_size=2, component_registry_override={})
    assert isinstance(cache, fast.UnifiedRadixCache)


def test_settings_missing_from_the_params_object_take_their_defaults():
    """SGLang's CacheInitParams has no validate_slots / mamba_cache_chunk_size / hicache."""
    alloc = PoolAllocator(PagedPool(16, 1), torch)
    params = types.SimpleNamespace(disable=False, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=alloc, page_size=1, is_eagle=False,
                                   tree_components=None)
    cache = fast.UnifiedRadixCache(params)
    assert type(cache) is fast.UnifiedRadixCache and cache.validate_slots


# -- keys -----------------------------------------------------------------------------------------


def test_foreign_keys_work_and_take_the_c_path():
    cache, alloc, _ = make(page_size=1)
    k = ForeignKey(array("q", [1, 2, 3]))
    assert cache.insert(fast.InsertParams(key=k, value=alloc.alloc(3))).prefix_len == 0
    m = cache.match_prefix(fast.MatchPrefixParams(key=ForeignKey([1, 2, 3, 4])))
    assert len(m.device_indices) == 3
    if fast_cache.NATIVE:
        r = fast_cache._api_match(cache, fast.MatchPrefixParams(key=ForeignKey(array("q", [1, 2]))))
        assert r is not None and len(r.device_indices) == 2
        # not plain: declined by C, converted and checked in Python
        assert fast_cache._api_match(cache, fast.MatchPrefixParams(key=ForeignKey(array("i", [1])))) is None
    with pytest.raises(fast.InvalidInput):
        cache.match_prefix(fast.MatchPrefixParams(key=ForeignKey([1], extra_key=3)))
    with pytest.raises(fast.InvalidInput):
        cache.match_prefix(fast.MatchPrefixParams(key=[1, 2]))
    cache.sanity_check()


def test_radix_key_slicing_and_page_aligned():
    k = fast.RadixKey([1, 2, 3, 4, 5, 6], "ns")
    assert list(k[1:3].token_ids) == [2, 3] and k[1:3].extra_key == "ns"
    assert list(k[-1].token_ids) == [6] and list(k) == [1, 2, 3, 4, 5, 6]
    assert list(k.page_aligned(4).token_ids) == [1, 2, 3, 4] and k.page_aligned(1) is k
    b = fast.RadixKey([1, 2, 3, 4, 5, 6], is_bigram=True)  # 5 units
    assert len(b) == 5 and list(b) == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert list(b.page_aligned(4).token_ids) == [1, 2, 3, 4, 5] and len(b[2:2].token_ids) == 0
    with pytest.raises(IndexError):
        k[6]
    with pytest.raises(fast.InvalidInput):
        k[::2]


# -- the rest of the engine-facing surface --------------------------------------------------------


def test_available_and_evictable_str():
    cache, alloc, _ = make(page_size=1, slots=16)
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3]), value=alloc.alloc(3)))
    assert cache.available_and_evictable_str() == (
        "Available full tokens: 16 (full_available_size=13 + full_evictable_size_=3)\n")


def test_init_hicache_turns_the_cache_into_the_host_tier():
    cache, alloc, _ = make(page_size=1, slots=16)
    alloc.size = 16
    args = types.SimpleNamespace(hicache_write_policy="write_back", hicache_ratio=2.0,
                                 hicache_size=0, hicache_storage_backend=None)
    params = types.SimpleNamespace(disable=False, req_to_token_pool=None, page_size=1,
                                   token_to_kv_pool_allocator=alloc, is_eagle=False,
                                   tree_components=None)
    with pytest.raises(fast.Unsupported, match="hicache_storage_backend"):
        cache.init_hicache(types.SimpleNamespace(**{**vars(args), "hicache_storage_backend": "file"}),
                           params)
    cache.init_hicache(args, params)
    assert isinstance(cache, fast.HiCacheRadixCache) and cache.write_policy == "write_back"
    assert cache.cache_controller.mem_pool_host.available_size() == 32
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2]), value=alloc.alloc(2)))
    cache.sanity_check()


def test_host_tier_takes_the_same_request_path():
    cache, alloc, pool = make(hicache=fast.HiCacheConfig(host_slots=64))
    assert isinstance(cache, fast.HiCacheRadixCache)
    a = run_request(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    cache.cache_unfinished_req(a)
    assert a.cache_protected_len == 8 and cache.protected_size() == 8
    cache.cache_finished_req(a)
    assert pool.take_freed() == [a.prefix_indices[8].item() // 4 * 4 + j for j in range(4)]
    cache.check_hicache_events()  # the write-through backup's lock goes with its ack
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    cache.sanity_check()


def test_mamba_copy_on_write_fills_the_request_as_upstream():
    alloc = PoolAllocator(PagedPool(32, 1), torch)
    states = PoolAllocator(PagedPool(4, 1, "mamba"), torch)
    rtp = types.SimpleNamespace(mamba_allocator=states)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
        page_size=1, tree_components=("full", "mamba")))
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2]), value=alloc.alloc(2),
                                   mamba_value=states.alloc(1)))
    req = types.SimpleNamespace(mamba_pool_idx=None, mamba_cow_src_index=None,
                                mamba_needs_clear=True)
    cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2]), cow_mamba=True, req=req))
    assert req.mamba_cow_src_index.tolist() == [1] and int(req.mamba_pool_idx) == 2
    assert req.mamba_needs_clear is False
    with pytest.raises(fast.InvalidInput, match="request"):  # upstream asserts it
        cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2]), cow_mamba=True))
