"""A fast cache with a host tier whose storage tier is built from SGLang's server arguments
(``--hicache-storage-backend ...`` through ``init_hicache``), for the storage tests under
tests/fast/ (importing this needs torch: skip first)."""

import json
import types
from typing import Any

import torch

from uniradix import fast, kernels
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.hicache import HiCacheConfig
from uniradix.spec.world import PagedPool


def server_args_cache(backend: str, extra_config: dict[str, Any], *, page_size: int = 4,
                      prefetch_policy: str = "best_effort") -> tuple[Any, Any, Any, Any]:
    """A write-through cache of 32 device and 64 host slots whose storage tier ``backend``
    is built from server arguments with ``extra_config`` as its JSON extra config: the cache,
    its allocator, the server arguments and the init params (to build another from them)."""
    geo = kernels.KVGeometry.mha(2, 2, 4, page_size, torch.float32)
    dev = kernels.DevicePool.allocate(geo, 32 + page_size)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 64 + page_size,
                                     pin_memory=False)
    alloc = PoolAllocator(PagedPool(32, page_size, "kv"), torch, whole_pages=True)
    params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                  token_to_kv_pool_allocator=alloc, page_size=page_size)
    args = types.SimpleNamespace(
        hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0,
        hicache_storage_backend=backend, hicache_storage_prefetch_policy=prefetch_policy,
        hicache_storage_backend_extra_config=json.dumps(extra_config))
    cache = fast.UnifiedRadixCache(params)
    params.hicache = HiCacheConfig(host_slots=64, device_kv=dev, host_kv=host, copy_impl="torch")
    cache.init_hicache(args, params)
    return cache, alloc, args, params
