"""Mooncake end to end through fast's storage tier: `UnifiedRadixCache` with a host tier and the
storage tier on `MooncakeStore`, against a `mooncake_master` on loopback that the fixture starts
(skipped only where the mooncake package does not import; `make test` installs it and the
libibverbs1 it needs, so CI runs these).

Stories, each with the KV compared exactly as tests/fast/test_fast_storage.py does with the file
store: pages go device -> host -> Mooncake and come back (prefetch -> host -> device) into the
same cache after a reset and into a second cache on its own Mooncake client; and the master
restarted mid-run: while it is down reads are misses and backups fail; after it is back the old
pages are misses (the new master knows no objects), nothing wrong is loaded, the trees stay
consistent, and backups work again once the client has re-mounted; and a Mooncake client that
fails, times out, reads short or fails a backup (a FaultyBackend around it): a miss or the pages
read before the fault, with the host pool untouched beyond them, or nothing stored."""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from storage_caches import server_args_cache
from uniradix import fast, kernels
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.hicache import HiCacheConfig, InitLoadBackParams
from uniradix.fast.storage import (
    Fault,
    FaultyBackend,
    MooncakeMaster,
    MooncakeStore,
    mooncake_available,
)
from uniradix.fast.tiers import storage as fstorage
from uniradix.spec.world import PagedPool

_WHY = mooncake_available()
if _WHY is not None:
    pytest.skip(f"Mooncake is not usable here ({_WHY}); install the dev extra "
                "(mooncake-transfer-engine-non-cuda) and libibverbs1", allow_module_level=True)

PS = 4                                  # tokens per page
SEGMENT = 32 << 20                      # bytes each client gives the distributed pool
TOKENS = list(range(100, 124))          # 6 pages
_namespaces = (f"e2e{i}" for i in itertools.count())


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


class World:
    """A cache with real KV (device pool, host pool) whose storage tier runs on its own Mooncake
    client in ``namespace`` (caches in one namespace share pages)."""

    def __init__(self, address: str, namespace: str, kv: int = 256, host: int = 512,
                 faulty: bool = False) -> None:
        self.geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
        self.dev = kernels.DevicePool.allocate(self.geo, kv + PS)
        self.host = kernels.HostPool.allocate(self.geo, kernels.Layout.PAGE_FIRST, host + PS,
                                              pin_memory=False)
        self.alloc = PoolAllocator(PagedPool(kv, PS, "kv"), torch, whole_pages=True)
        self.store = MooncakeStore(address, global_segment_size=SEGMENT, namespace=namespace)
        # ``faulty``: the tier reaches the store through a FaultyBackend (``self.faults``)
        self.faults = FaultyBackend(self.store) if faulty else None
        backend = self.faults if self.faults is not None else self.store
        backend.register_mem_pool_host(self.host)  # (the wrapper registers the store too)
        storage = fstorage.StorageConfig(backend=backend, io="threads", prefetch_threshold=PS,
                                         prefetch_stop_policy="best_effort")
        cfg = HiCacheConfig(host_slots=host, io="sync", device_kv=self.dev, host_kv=self.host,
                            copy_impl="torch", load_back_threshold=0, storage=storage)
        self.cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=PS, hicache=cfg))
        self.tier = self.cache.storage_tier

    def compute(self, tokens: list[int]) -> torch.Tensor:
        """Insert ``tokens`` with fresh random KV (written through to host, then backed up)."""
        slots = self.alloc.alloc(len(tokens))
        self.dev.buffer[:, :, slots] = torch.randn(self.dev.buffer[:, :, slots].shape)
        kv = self.dev.buffer[:, :, slots].clone()
        self.cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=slots))
        return kv

    def settle(self) -> None:
        self.cache.check_hicache_events()
        assert self.tier.wait_idle(30)
        self.cache.check_hicache_events()
        assert self.cache.violations() == []
        assert self.tier.ongoing_backup == {} and self.tier.held_host_slots() == []

    def prefetch(self, rid: str, tokens: list[int]) -> tuple[int, int]:
        n = self.tier.prefetch_from_storage(rid, self.cache.root_node, tokens)
        assert self.tier.wait_idle(30)
        assert self.tier.check_prefetch_progress(rid)
        self.cache.check_hicache_events()
        assert self.cache.violations() == [] and self.tier.occupied == 0
        assert self.tier.held_host_slots() == []
        return n, self.tier.pop_prefetch_loaded_tokens(rid)

    def load(self, tokens: list[int]) -> torch.Tensor:
        """Match ``tokens``, load the host part back to the device; the device KV of the match."""
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
        req = type("Req", (), {"last_node": m.last_device_node})()
        self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, None, req))
        self.cache.ready_to_load_host_cache()
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
        assert len(m.device_indices) == len(tokens)
        return self.dev.buffer[:, :, m.device_indices].clone()

    def hit(self, tokens: list[int]) -> tuple[int, int]:
        """(device, host) tokens of ``tokens`` the tree holds."""
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
        return len(m.device_indices), m.host_hit_length

    def keys(self, tokens: list[int]) -> list[str]:
        return list(fstorage.chain_keys(tokens, PS, None))

    def close(self) -> None:
        self.tier.close()
        self.store.close()


def close_all(*worlds: World | None) -> None:
    """Close the worlds (a Mooncake client takes about 2 s to close)."""
    for w in worlds:
        if w is not None:
            w.close()


def seeded(address: str) -> tuple[str, World, torch.Tensor]:
    """A new namespace and a world over it whose cache computed TOKENS and backed them up to
    Mooncake (closed again if that fails)."""
    ns = next(_namespaces)
    a = World(address, ns)
    try:
        kv = a.compute(TOKENS)
        a.settle()
    except BaseException:
        a.close()
        raise
    return ns, a, kv


def test_device_host_mooncake_and_back_into_a_reset_cache_and_a_second_cache(master):
    ns, a, kv = seeded(master.address)
    b = None
    try:
        stats = a.store.get_stats()
        assert stats.pages_set == len(TOKENS) // PS and stats.failed_sets == 0
        assert a.store.batch_exists(a.keys(TOKENS)) == len(TOKENS) // PS

        # A second cache on its own client: the pages live in the first client's segment and
        # travel over TCP into this cache's host pool, then to its device.
        b = World(master.address, ns)
        assert b.hit(TOKENS) == (0, 0)
        assert b.prefetch("r1", TOKENS) == (len(TOKENS), len(TOKENS))
        assert b.hit(TOKENS) == (0, len(TOKENS))
        assert torch.equal(b.load(TOKENS), kv)
        assert b.store.get_stats().pages_get == len(TOKENS) // PS

        # The first cache reset (tree and pools emptied, the store kept), every buffer wiped:
        # whatever comes back came from Mooncake.
        a.cache.reset()
        a.dev.buffer.zero_()
        a.host.buffer.zero_()
        assert a.hit(TOKENS) == (0, 0)
        longer = TOKENS + list(range(600, 608))      # two pages never stored: a partial hit
        assert a.prefetch("r2", longer) == (len(longer), len(TOKENS))
        assert torch.equal(a.load(TOKENS), kv)
        assert a.hit(longer) == (len(TOKENS), 0)
    finally:
        a.store.clear()
        close_all(a, b)


def test_a_master_restarted_mid_run(master):
    """Stop and restart `mooncake_master` between the caches' operations (a private master: the
    module's stays up for the other tests)."""
    with MooncakeMaster() as m:
        ns = next(_namespaces)
        a = World(m.address, ns)
        b = World(m.address, ns)
        try:
            kv = a.compute(TOKENS)
            a.settle()
            assert a.store.batch_exists(a.keys(TOKENS)) == len(TOKENS) // PS

            m.stop()
            # Down: b's prefetch is a miss (nothing loaded, every slot back), a's backup fails.
            host_before = b.host.buffer.clone()
            free = b.cache.cache_controller.mem_pool_host.available_size()
            assert b.prefetch("down", TOKENS) == (len(TOKENS), 0)
            assert b.hit(TOKENS) == (0, 0)
            assert b.cache.cache_controller.mem_pool_host.available_size() == free
            assert torch.equal(b.host.buffer, host_before)
            second = list(range(300, 316))
            failed = a.store.get_stats().failed_sets
            kv2 = a.compute(second)
            a.settle()               # the backup is acked unwritten: its host lock is released
            assert a.store.get_stats().failed_sets > failed
            assert a.cache.find_node(fast.RadixKey(second)).host_lock_ref == 0
            assert a.hit(second) == (len(second), 0)       # the tree keeps the device copy

            m.start()
            # Back, but empty: the pages stored before are misses, never stale data.
            assert b.prefetch("empty", TOKENS) == (len(TOKENS), 0)
            assert b.hit(TOKENS) == (0, 0)
            assert torch.equal(b.host.buffer, host_before)
            assert b.store.batch_exists(b.keys(TOKENS)) == 0

            # Once a's client has re-mounted its segment, backups are written again and b reads
            # them with the right KV.
            deadline = time.monotonic() + 20
            for attempt in itertools.count():
                third = list(range(1000 + 100 * attempt, 1012 + 100 * attempt))
                kv3 = a.compute(third)
                a.settle()
                if a.store.batch_exists(a.keys(third)) == len(third) // PS:
                    break
                assert time.monotonic() < deadline, "the client did not come back after the restart"
                time.sleep(0.2)
            assert b.prefetch("back", third) == (len(third), len(third))
            assert torch.equal(b.load(third), kv3)
            # What a holds is untouched by all this.
            assert torch.equal(a.load(TOKENS), kv) and torch.equal(a.load(second), kv2)
        finally:
            close_all(a, b)


def test_faults_over_mooncake_end_as_misses_or_failed_backups(master):
    """Through the whole cache over Mooncake, one fault at a time on one client (the cache reset
    and its buffers wiped between them, so whatever reaches the device came from Mooncake)."""
    ns, a, kv = seeded(master.address)
    b = None
    try:
        b = World(master.address, ns, faulty=True)
        assert b.faults is not None
        for fault, hit in ((Fault("get", "short", keep=2), 2 * PS), (Fault("get", "fail"), 0),
                           (Fault("exists", "fail"), 0),
                           (Fault("get", "timeout", delay_s=0.01), 0)):
            b.cache.reset()
            b.dev.buffer.zero_()
            b.host.buffer.zero_()
            b.faults.inject(fault)
            assert b.prefetch(f"r-{fault.op}-{fault.kind}", TOKENS) == (len(TOKENS), hit), fault
            assert b.hit(TOKENS) == (0, hit), fault
            # nothing beyond the pages read reached the host pool
            assert b.host.buffer.count_nonzero() == kv[:, :, :hit].count_nonzero(), fault
            if hit:
                assert torch.equal(b.load(TOKENS[:hit]), kv[:, :, :hit])
            b.settle()
        # a backup the client fails: nothing stored, its host lock released, and a prefetch of
        # those tokens afterwards is a miss
        other = list(range(700, 716))
        b.faults.inject(Fault("set", "fail", times=-1))
        b.compute(other)
        b.settle()
        b.faults.clear_faults()
        assert b.store.batch_exists(b.keys(other)) == 0
        assert b.cache.find_node(fast.RadixKey(other)).host_lock_ref == 0
        b.cache.reset()
        assert b.prefetch("r-after-failed-backup", other) == (len(other), 0)
        assert b.hit(other) == (0, 0)
    finally:
        a.store.clear()
        close_all(a, b)


def test_close_releases_a_mooncake_client_built_from_server_args(master):
    """SGLang's `--hicache-storage-backend mooncake`: the tier built the client, so its close
    unregisters the host pool and closes the client (once; a second close does nothing)."""
    cache, alloc, _, _ = server_args_cache("mooncake", {
        "master_server_address": master.address, "global_segment_size": SEGMENT,
        "namespace": next(_namespaces), "prefetch_threshold": PS})
    tier = cache.storage_tier
    store = tier.backend
    assert isinstance(store, MooncakeStore) and store._registered is not None
    cache.insert(fast.InsertParams(key=fast.RadixKey(TOKENS), value=alloc.alloc(len(TOKENS))))
    cache.check_hicache_events()
    assert tier.wait_idle(30)
    cache.check_hicache_events()
    assert tier.ongoing_backup == {}
    tier.close()
    assert store._store is None and store._registered is None  # client closed, buffer unregistered
    tier.close()
    assert tier.prefetch_from_storage("r", cache.root_node, TOKENS) == 0
