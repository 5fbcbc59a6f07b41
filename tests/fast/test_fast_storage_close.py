"""What the fast storage tier (fast/tiers/storage.py) releases on ``close()``: its storage
thread always; the I/O gloo group it derived from the cache's ``tp_cache_group`` (destroyed
after a barrier over it, so on every rank) and a backend it built from SGLang's server
arguments (closed); never a group or a backend the caller gave it.  A second close does
nothing, and a closed tier starts no backup and no prefetch.  The two-rank test runs two
processes over gloo on loopback, as tests/fast/test_fast_storage_tp.py does."""

from __future__ import annotations

import json
import threading
import types

import pytest

from ranks import run_ranks

torch = pytest.importorskip("torch")

from uniradix import fast, kernels  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.fast.storage import FileStore  # noqa: E402
from uniradix.fast.tiers.storage import StorageConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

PS = 4

RANK = r'''
import json, os, sys, threading, torch, torch.distributed as dist
from uniradix import fast, kernels
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.hicache import HiCacheConfig
from uniradix.fast.storage import FileStore
from uniradix.fast.tiers.storage import StorageConfig
from uniradix.spec.world import PagedPool

rank, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group, io_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
PS = 4
geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)

class CountingStore(FileStore):  # the caller's backend: the tier must not close it
    closes = 0
    def close(self):
        CountingStore.closes += 1
        super().close()

def alive(group):
    """Whether ``group`` is still a process group here (a destroyed one is unknown)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True

def sums(group):
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())

def storage_threads():
    return sum(t.name == "uniradix-storage" and t.is_alive() for t in threading.enumerate())

def run(mode, directory):
    groups = dict(tp_group=group, tp_io_group=io_group) if mode == "given" else {}
    os.makedirs(directory)
    store = CountingStore(directory)
    dev = kernels.DevicePool.allocate(geo, 64 + PS)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 160 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(64, PS, "kv"), torch, whole_pages=True)
    store.register_mem_pool_host(host)
    storage = StorageConfig(backend=store, io="threads", prefetch_threshold=PS,
                            prefetch_stop_policy="wait_complete", **groups)
    cfg = HiCacheConfig(host_slots=160, io="sync", device_kv=dev, host_kv=host, copy_impl="torch",
                        load_back_threshold=0, storage=storage)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS,
        hicache=cfg, tp_cache_group=None if mode == "given" else group))
    tier = cache.storage_tier
    io = tier.config.tp_io_group
    out = {"threads_before": storage_threads(), "io_alive_before": alive(io)}
    # use the I/O group (a hit query reduces over it) before closing
    A = list(range(100, 124))
    cache.insert(fast.InsertParams(key=fast.RadixKey(A), value=alloc.alloc(len(A))))
    cache.check_hicache_events()
    assert tier.wait_idle(30)
    cache.check_hicache_events()
    out["requested"] = tier.prefetch_from_storage("r", cache.root_node, list(range(100, 140)))
    while not tier.check_prefetch_progress("r"):
        pass
    assert tier.wait_idle(30)
    cache.check_hicache_events()

    tier.close()
    out["io_alive_after"] = alive(io)
    out["group_alive_after"] = alive(group) and sums(group) == 2  # the caller's group still works
    out["threads_after"] = storage_threads()
    tier.close()  # a second close: nothing happens (no collective, no error)
    out["second_close_ok"] = True
    out["backend_closes"] = CountingStore.closes
    # a closed tier starts nothing: no prefetch, no backup of a new node
    B = list(range(300, 316))
    out["requested_closed"] = tier.prefetch_from_storage("s", cache.root_node, B)
    cache.insert(fast.InsertParams(key=fast.RadixKey(B), value=alloc.alloc(len(B))))
    cache.check_hicache_events()
    out["pending_backups"] = len(tier.backups) + len(tier.ongoing_backup)
    out["violations"] = cache.violations()
    return out

results = {mode: run(mode, f"{directory}/{mode}") for mode in ("derived", "given")}
assert alive(group) and alive(io_group) and sums(io_group) == 2  # the caller's groups
dist.barrier(group=group)
dist.destroy_process_group()
print("RESULT " + json.dumps(results))
'''


def test_close_releases_what_the_tier_created_and_only_that(tmp_path):
    dirs = [tmp_path / f"rank{rank}" for rank in (0, 1)]
    for d in dirs:
        d.mkdir()
    res = run_ranks(RANK, [[str(d)] for d in dirs])
    for by_mode in res:
        for mode, r in by_mode.items():
            assert r["threads_before"] == 1 and r["threads_after"] == 0
            assert r["io_alive_before"] is True
            # the derived I/O group is gone on every rank; a given one is the caller's: kept
            assert r["io_alive_after"] is (mode == "given"), mode
            assert r["group_alive_after"] is True
            assert r["second_close_ok"] is True
            assert r["backend_closes"] == 0  # the caller's backend stays open
            assert r["requested"] == 40 and r["requested_closed"] == 0
            assert r["pending_backups"] == 0 and r["violations"] == []


def _server_args_cache(tmp_path, backend: str, extra: dict):
    geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
    dev = kernels.DevicePool.allocate(geo, 32 + PS)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 64 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(32, PS, "kv"), torch, whole_pages=True)
    params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                  token_to_kv_pool_allocator=alloc, page_size=PS)
    args = types.SimpleNamespace(
        hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0,
        hicache_storage_backend=backend, hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": PS, **extra}))
    cache = fast.UnifiedRadixCache(params)
    params.hicache = HiCacheConfig(host_slots=64, device_kv=dev, host_kv=host, copy_impl="torch")
    cache.init_hicache(args, params)
    return cache, alloc


def test_close_closes_a_backend_built_from_server_args_once(tmp_path, monkeypatch):
    closes: list[object] = []
    monkeypatch.setattr(FileStore, "close", lambda self: closes.append(self))
    cache, alloc = _server_args_cache(tmp_path, "file", {"file_path": str(tmp_path)})
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
