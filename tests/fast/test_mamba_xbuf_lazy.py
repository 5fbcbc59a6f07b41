"""The fast path's lazy Mamba extra buffer settings (fast/compat.py
``check_extra_buffer_lazy``): honoured with the extra buffer, its invalid combinations refused
by name with nothing built."""

from __future__ import annotations

import types

import pytest
import torch

import uniradix.fast as fast
from uniradix.conformance.adapters.fast_hybrid import MambaReqPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.world import PagedPool


def build(pool=None, **kw):
    pool = pool if pool is not None else MambaReqPool(PagedPool(8, 1, "mamba"))
    kv = PagedPool(64, 1)
    return fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool,
        token_to_kv_pool_allocator=PoolAllocator(kv, torch),
        page_size=1, tree_components=("full", "mamba"), **kw))


def test_honoured_with_the_extra_buffer():
    cache = build(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=True)
    assert cache.mamba.extra_buffer and cache.mamba.extra_buffer_lazy
    req = types.SimpleNamespace(mamba_ping_pong_track_buffer=torch.tensor([-1, 3]),
                                mamba_next_track_idx=1)
    assert cache.mamba.keep_index(req) == 1  # lazy: the slot the next index names
    assert not build(enable_mamba_extra_buffer=True).mamba.extra_buffer_lazy


def test_lazy_track_point_takes_a_fresh_slot_and_frees_the_old():
    cache = build(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=True)
    alloc = cache.mamba.allocator
    own, track = alloc.alloc(1), alloc.alloc(1)
    req = types.SimpleNamespace(mamba_pool_idx=own[0],
                                mamba_ping_pong_track_buffer=torch.tensor([int(track[0]), -1]),
                                mamba_next_track_idx=0, mamba_last_track_seqlen=None)
    before = alloc.available_size()
    assert cache.mamba.lazy_track_point(req, 8) is True
    buf = req.mamba_ping_pong_track_buffer.tolist()
    assert req.mamba_next_track_idx == 1 and buf[0] == -1 and buf[1] not in (-1, int(track[0]))
    assert req.mamba_last_track_seqlen == 8 and alloc.available_size() == before
    with pytest.raises(fast.InvalidInput, match="both track positions"):
        req.mamba_ping_pong_track_buffer[0] = int(track[0])
        cache.mamba.lazy_track_point(req, 16)


@pytest.mark.parametrize("kw, pool_attrs, words", [
    ({"enable_mamba_extra_buffer_lazy": True}, {}, "without enable_mamba_extra_buffer"),
    ({"enable_mamba_extra_buffer": True, "enable_mamba_extra_buffer_lazy": True},
     {"enable_mamba_extra_buffer_lazy": False}, "the req_to_token_pool's"),
    ({"enable_mamba_extra_buffer": True},
     {"enable_mamba_extra_buffer_lazy": True}, "the req_to_token_pool's"),
    ({"enable_mamba_extra_buffer": True, "enable_mamba_extra_buffer_lazy": True},
     {"enable_mamba_extra_buffer_lazy": True, "mamba_ping_pong_track_buffer_size": 1},
     "1 ping-pong position"),
])
def test_invalid_combinations_refused_by_name(kw, pool_attrs, words):
    pool = MambaReqPool(PagedPool(8, 1, "mamba"))
    for k, v in pool_attrs.items():
        setattr(pool, k, v)
    with pytest.raises(fast.Unsupported, match="enable_mamba_extra_buffer_lazy") as e:
        build(pool, **kw)
    assert words in str(e.value)


def test_not_a_bool_refused():
    with pytest.raises(fast.InvalidInput, match="enable_mamba_extra_buffer_lazy"):
        build(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy="yes")
