"""The storage tier's metrics (fast/metrics.py ``StorageTierMetrics``) under upstream's names and
labels, wired from fast/tiers/storage.py's completion points: a backup and a prefetch through the
file store, then a scrape over loopback."""

from __future__ import annotations

import json
import types
import urllib.request

import pytest

torch = pytest.importorskip("torch")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402

from uniradix import fast, kernels  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.fast.metrics import STORAGE_BANDWIDTH_BUCKETS, StorageLabels, serve_metrics  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

PS = 4
TOKENS = list(range(40, 52))  # 3 pages
LABELS = {"storage_backend": "file", "tp_rank": "0", "dp_rank": "0", "pp_rank": "0",
          "pp_size": "1", "attn_cp_rank": "0", "attn_cp_size": "1"}


def _cache(tmp_path, reg):
    """A cache built as SGLang builds it: metrics first, then ``init_hicache`` with
    ``--hicache-storage-backend file`` (the storage series join the metrics made before)."""
    geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
    dev = kernels.DevicePool.allocate(geo, 32 + PS)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 64 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(32, PS, "kv"), torch, whole_pages=True)
    params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                  token_to_kv_pool_allocator=alloc, page_size=PS,
                                  enable_metrics=True, metrics_registry=reg)
    args = types.SimpleNamespace(
        hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0,
        hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config=json.dumps(
            {"file_path": str(tmp_path), "prefetch_threshold": PS}))
    cache = fast.UnifiedRadixCache(params)
    params.hicache = HiCacheConfig(host_slots=64, device_kv=dev, host_kv=host, copy_impl="torch",
                                   load_back_threshold=0)
    cache.init_hicache(args, params)
    return cache, alloc, geo


def series(**extra):
    """A series' labels as the exposition writes them (sorted by name)."""
    return ",".join(f'{k}="{v}"' for k, v in sorted({**LABELS, **extra}.items()))


def value(reg, name):
    got = reg.get_sample_value(name, LABELS)
    return 0.0 if got is None else got


def test_a_backup_and_a_prefetch_through_the_file_store_are_scraped(tmp_path):
    reg = CollectorRegistry()
    cache, alloc, geo = _cache(tmp_path, reg)
    tier = cache.storage_tier
    assert tier.metrics is not None and cache.metrics.storage == StorageLabels("file")
    with pytest.raises(fast.InvalidInput, match="registered already"):
        cache.metrics.add_storage(StorageLabels("file"))
    page_bytes = tier.backend.page_layout.page_bytes
    assert page_bytes == PS * geo.layers * 2 * geo.heads * geo.head_dim * 4  # K and V, float32
    assert value(reg, "sglang:backuped_tokens_total") == 0
    # a backup: the host write's ack backs the node up; its ack drained counts its tokens
    cache.insert(fast.InsertParams(key=fast.RadixKey(TOKENS), value=alloc.alloc(len(TOKENS))))
    cache.check_hicache_events()
    assert tier.wait_idle(10)
    assert value(reg, "sglang:backuped_tokens_total") == 0  # written, its ack not drained yet
    cache.check_hicache_events()
    assert value(reg, "sglang:backuped_tokens_total") == len(TOKENS)
    assert value(reg, "sglang:backup_pgs_count") == 1 and value(reg, "sglang:backup_pgs_sum") == 3
    assert value(reg, "sglang:backup_bandwidth_count") == 1
    assert value(reg, "sglang:backup_bandwidth_sum") > 0
    assert value(reg, "sglang:prefetch_pgs_count") == 0
    # gone from the device and the host: a prefetch reads the three pages back from the files
    cache.evict(fast.EvictParams(num_tokens=len(TOKENS)))
    assert cache.evict_host(len(TOKENS)) == len(TOKENS)
    assert cache.prefetch_from_storage("r1", cache.root_node, TOKENS) == len(TOKENS)
    assert tier.wait_idle(10)
    assert value(reg, "sglang:prefetched_tokens_total") == 0  # read, not in the tree yet
    assert cache.check_prefetch_progress("r1") is True
    assert cache.pop_prefetch_loaded_tokens("r1") == len(TOKENS)
    assert value(reg, "sglang:prefetched_tokens_total") == len(TOKENS)
    assert value(reg, "sglang:prefetch_pgs_count") == 1 and value(reg, "sglang:prefetch_pgs_sum") == 3
    assert value(reg, "sglang:prefetch_bandwidth_count") == 1
    # a second prefetch reads the pages again, but the tree holds them on the host already:
    # one more read batch, no prefetched tokens (upstream counts what the tree gained)
    assert cache.prefetch_from_storage("r2", cache.root_node, TOKENS) == len(TOKENS)
    assert tier.wait_idle(10) and cache.check_prefetch_progress("r2") is True
    assert cache.pop_prefetch_loaded_tokens("r2") == 0
    assert value(reg, "sglang:prefetched_tokens_total") == len(TOKENS)
    assert value(reg, "sglang:prefetch_pgs_count") == 2
    cache.check_hicache_events()
    assert cache.violations() == []
    with serve_metrics(reg) as server:
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            text = resp.read().decode()
    tier.close()
    top = str(float(STORAGE_BANDWIDTH_BUCKETS[-1]))
    assert f"sglang:prefetched_tokens_total{{{series()}}} {float(len(TOKENS))}" in text
    assert f"sglang:backuped_tokens_total{{{series()}}} {float(len(TOKENS))}" in text
    assert f"sglang:prefetch_pgs_bucket{{{series(le='1.0')}}} 0.0" in text
    assert f"sglang:prefetch_pgs_bucket{{{series(le='5.0')}}} 2.0" in text
    assert f"sglang:backup_pgs_bucket{{{series(le='5.0')}}} 1.0" in text
    assert f"sglang:prefetch_bandwidth_bucket{{{series(le=top)}}}" in text
    assert f"sglang:backup_bandwidth_bucket{{{series(le='+Inf')}}} 1.0" in text


def test_without_metrics_the_storage_tier_reports_nothing(tmp_path):
    geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 64 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(32, PS, "kv"), torch, whole_pages=True)
    store = fast.storage.FileStore(tmp_path)
    store.register_mem_pool_host(host)
    from uniradix.fast.tiers.storage import StorageConfig
    cfg = HiCacheConfig(host_slots=64, io="sync", host_kv=host,
                        device_kv=kernels.DevicePool.allocate(geo, 32 + PS), copy_impl="torch",
                        storage=StorageConfig(backend=store, io="threads", prefetch_threshold=PS))
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS,
        hicache=cfg))
    assert cache.storage_tier.metrics is None and cache.metrics is None
    cache.insert(fast.InsertParams(key=fast.RadixKey(TOKENS), value=alloc.alloc(len(TOKENS))))
    cache.check_hicache_events()
    assert cache.storage_tier.wait_idle(10)
    cache.check_hicache_events()
    assert len(store) == 3
    cache.storage_tier.close()
