"""What the fast storage tier (fast/tiers/storage.py) releases on ``close()``: its storage
thread always; the I/O gloo group it derived from the cache's ``tp_cache_group`` (destroyed
after a barrier over it, so on every rank) and a backend it built from SGLang's server
arguments (closed); never a group or a backend the caller gave it.  A second close does
nothing, and a closed tier starts no backup and no prefetch.  The derived group's destruction
runs on two ranks in tests/fast/test_fast_storage_tp.py (its close at the end)."""

from __future__ import annotations

import json
import threading
import types

import pytest

torch = pytest.importorskip("torch")

from storage_caches import server_args_cache  # noqa: E402
from uniradix import fast, kernels  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.fast.storage import FileStore  # noqa: E402
from uniradix.fast.tiers.storage import StorageConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

PS = 4

class _CountingStore(FileStore):
    """The caller's backend: the tier must leave it open."""

    closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


def _storage_threads() -> int:
    return sum(t.name == "uniradix-storage" and t.is_alive() for t in threading.enumerate())


def test_close_stops_the_thread_leaves_the_callers_backend_open_and_starts_nothing_after(tmp_path):
    store = _CountingStore(str(tmp_path))
    geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
    dev = kernels.DevicePool.allocate(geo, 64 + PS)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 160 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(64, PS, "kv"), torch, whole_pages=True)
    store.register_mem_pool_host(host)
    storage = StorageConfig(backend=store, io="threads", prefetch_threshold=PS,
                            prefetch_stop_policy="wait_complete")
    cfg = HiCacheConfig(host_slots=160, io="sync", device_kv=dev, host_kv=host, copy_impl="torch",
                        load_back_threshold=0, storage=storage)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS,
        hicache=cfg))
    tier = cache.storage_tier
    before = _storage_threads()
    assert before >= 1
    a = list(range(100, 124))
    cache.insert(fast.InsertParams(key=fast.RadixKey(a), value=alloc.alloc(len(a))))
    cache.check_hicache_events()
    assert tier.wait_idle(30)
    cache.check_hicache_events()
    stored = len(list(tmp_path.glob("*.urxp")))
    assert stored == 6
    tier.close()
    assert _storage_threads() == before - 1 and not tier._workers
    tier.close()  # a second close: nothing happens
    assert store.closes == 0  # the caller's backend stays open
    # a closed tier starts nothing: no prefetch, no backup of a new node
    assert tier.prefetch_from_storage("r", cache.root_node, a) == 0
    b = list(range(300, 316))
    cache.insert(fast.InsertParams(key=fast.RadixKey(b), value=alloc.alloc(len(b))))
    cache.check_hicache_events()
    assert tier.backups == [] and tier.ongoing_backup == {}
    assert len(list(tmp_path.glob("*.urxp"))) == stored
    assert cache.violations() == []


def test_close_closes_a_backend_built_from_server_args_once(tmp_path, monkeypatch):
    closes: list[object] = []
    monkeypatch.setattr(FileStore, "close", lambda self: closes.append(self))
    cache, alloc, _, _ = server_args_cache(
        "file", {"prefetch_threshold": PS, "file_path": str(tmp_path)})
    tier = cache.storage_tier
    cache.insert(fast.InsertParams(key=fast.RadixKey(list(range(8))), value=alloc.alloc(8)))
    cache.check_hicache_events()
    assert tier.wait_idle(10)
    tier.close()
    assert closes == [tier.backend]
    assert not any(t.name == "uniradix-storage" and t.is_alive() for t in threading.enumerate())
    tier.close()
    assert closes == [tier.backend]  # closed once


def test_a_closed_manual_tier_refuses_the_io_steps_and_starts_nothing():
    dev_pool = PagedPool(32, PS, "kv")
    alloc = PoolAllocator(dev_pool, torch, whole_pages=True)
    cfg = HiCacheConfig(host_slots=64, storage=StorageConfig(prefetch_threshold=PS))
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS,
        hicache=cfg))
    tier = cache.storage_tier
    tier.close()
    for step in (lambda: tier.run_queries(-1), lambda: tier.run_load("r", -1),
                 lambda: tier.run_backups(-1), lambda: tier.tick(1)):
        with pytest.raises(fast.InvalidInput, match="closed"):
            step()
    assert tier.prefetch_from_storage("r", cache.root_node, list(range(16))) == 0
    cache.insert(fast.InsertParams(key=fast.RadixKey(list(range(8))), value=alloc.alloc(8)))
    cache.check_hicache_events()
    assert tier.backups == [] and tier.ongoing_backup == {}
    assert cache.violations() == []


def test_a_tier_that_fails_to_build_closes_the_backend_it_was_given_to_own(tmp_path, monkeypatch):
    """A backend built from server arguments is closed when the tier refuses to build (here: no
    host tier), and is not closed twice by anyone later."""
    from uniradix.fast.tiers import storage as fstorage
    closes: list[object] = []
    monkeypatch.setattr(FileStore, "close", lambda self: closes.append(self))
    geo = kernels.KVGeometry.mha(1, 1, 8, PS, torch.float32)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 32 + PS, pin_memory=False)
    args = types.SimpleNamespace(
        hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config=json.dumps({"file_path": str(tmp_path)}))
    config = fstorage.storage_config_from_server_args(args, PS, host)
    no_host_tier = types.SimpleNamespace(tier=None, components=())
    with pytest.raises(fast.Unsupported, match="needs a host tier"):
        fstorage.StorageTier(no_host_tier, config)
    assert closes == [config.backend]
    with pytest.raises(fast.Unsupported, match="needs a host tier"):
        fstorage.StorageTier(no_host_tier, config)  # claimed already: not closed again
    assert closes == [config.backend]
