"""The fast storage tier (fast/tiers/storage.py; its corpus replays in
tests/conformance/traces/test_storage_corpus.py): the plug-in's page keys against the spec's,
and production mode (io="threads") with the file store: KV written through to files, a
prefetch hit after a restart of the cache on the same store, and faults (failing, raising,
short and slow reads, failed writes, a corrupt file) ending as misses or partial hits with the
tree consistent and only the right KV loaded."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from storage_caches import server_args_cache  # noqa: E402
from stories import LockstepFace  # noqa: E402
from uniradix import fast, kernels  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig, InitLoadBackParams  # noqa: E402
from uniradix.fast.storage import Fault, FaultyBackend, FileStore  # noqa: E402
from uniradix.fast.tiers import storage as fstorage  # noqa: E402
from uniradix.spec import pagekeys  # noqa: E402
from uniradix.spec.config import CacheConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

PS = 4  # tokens per page in the production tests


# -- conformance -------------------------------------------------------------------------------


def test_page_keys_are_the_specs():
    units = [(1, 2), (2, 3), (3, 4)]
    for mode in ("namespaced", "compat"):
        for ek in (None, "tenant"):
            prior = fstorage.namespace_prior(ek, mode)
            assert prior == pagekeys.namespace_prior(ek, mode)
            toks = list(range(7, 30))
            assert fstorage.chain_keys(toks, 4, prior) == pagekeys.chain_keys(toks, 4, prior)
    assert fstorage.chain_keys(units, 2, None) == pagekeys.chain_keys(units, 2, None)


def test_fast_adapter_declares_and_builds_the_storage_tier():
    cfg = CacheConfig(kv_slots=32, host_slots=64, page_size=1, storage=True, prefetch_threshold=1)
    ad = make_adapter("fast", cfg)
    assert ad.cache.storage_tier is not None and ad.cache.storage_tier.capacity == 25
    assert "storage" in ad.snapshot()


def test_storage_config_is_checked_by_name():
    with pytest.raises(fast.InvalidInput, match="prefetch_stop_policy"):
        fstorage.StorageConfig(prefetch_stop_policy="never").validate()
    with pytest.raises(fast.InvalidInput, match="needs a backend"):
        fstorage.StorageConfig(io="threads").validate()
    with pytest.raises(fast.InvalidInput, match="io"):
        fstorage.StorageConfig(io="async").validate()


# -- production mode ---------------------------------------------------------------------------


class World:
    """A cache with real KV: a device pool, a host pool and the file store in ``directory``."""

    def __init__(self, directory, backend_wrap=None, kv=32, host=64, policy="best_effort",
                 timeout_base=1.0):
        self.geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)
        self.dev = kernels.DevicePool.allocate(self.geo, kv + PS)
        self.host = kernels.HostPool.allocate(self.geo, kernels.Layout.PAGE_FIRST, host + PS,
                                              pin_memory=False)
        self.alloc = PoolAllocator(PagedPool(kv, PS, "kv"), torch, whole_pages=True)
        self.store = FileStore(directory)
        self.backend = backend_wrap(self.store) if backend_wrap else self.store
        self.backend.register_mem_pool_host(self.host)
        storage = fstorage.StorageConfig(backend=self.backend, io="threads",
                                         prefetch_threshold=PS, prefetch_stop_policy=policy,
                                         prefetch_timeout_base=timeout_base)
        cfg = HiCacheConfig(host_slots=host, io="sync", device_kv=self.dev, host_kv=self.host,
                            copy_impl="torch", load_back_threshold=0, storage=storage)
        self.cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=PS, hicache=cfg))
        self.tier = self.cache.storage_tier

    def compute(self, tokens):
        """Insert ``tokens`` with freshly computed (random) KV; returns that KV."""
        slots = self.alloc.alloc(len(tokens))
        self.dev.buffer[:, :, slots] = torch.randn(self.dev.buffer[:, :, slots].shape)
        kv = self.dev.buffer[:, :, slots].clone()
        self.cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=slots))
        return kv

    def settle(self):
        """Acks processed, storage threads idle, their acks drained."""
        self.cache.check_hicache_events()
        assert self.tier.wait_idle(10)
        self.cache.check_hicache_events()
        assert self.cache.violations() == []

    def prefetch(self, rid, tokens):
        n = self.tier.prefetch_from_storage(rid, self.cache.root_node, tokens)
        assert self.tier.wait_idle(10)
        for _ in range(1000):
            if self.tier.check_prefetch_progress(rid):
                break
        self.cache.check_hicache_events()
        assert self.cache.violations() == []
        return n, self.tier.pop_prefetch_loaded_tokens(rid)

    def load(self, tokens):
        """Match ``tokens`` and load their host part back; the device KV of the match."""
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
        req = type("Req", (), {"last_node": m.last_device_node})()
        idx, _ = self.cache.init_load_back(InitLoadBackParams(
            m.best_match_node, m.host_hit_length, None, req))
        self.cache.ready_to_load_host_cache()
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
        return self.dev.buffer[:, :, m.device_indices].clone()

    def close(self):
        self.tier.close()
        assert not any(t.is_alive() for t in self.tier._workers)


TOKENS = list(range(100, 124))  # 6 pages


def _write(tmp_path):
    w = World(tmp_path)
    kv = w.compute(TOKENS)
    w.settle()
    assert len(w.store) == len(TOKENS) // PS
    assert w.tier.ongoing_backup == {}
    w.close()
    return kv


def test_backup_then_prefetch_hit_after_a_restart(tmp_path):
    kv = _write(tmp_path)
    w = World(tmp_path)  # a restarted cache, the same store directory
    assert w.prefetch("r1", TOKENS) == (len(TOKENS), len(TOKENS))
    assert torch.equal(w.load(TOKENS), kv)
    assert w.cache.violations() == [] and w.tier.occupied == 0
    w.close()


def test_a_partial_store_gives_the_stored_prefix(tmp_path):
    kv = _write(tmp_path)
    w = World(tmp_path)
    longer = TOKENS + list(range(500, 508))
    n, loaded = w.prefetch("r1", longer)
    assert (n, loaded) == (len(longer), len(TOKENS))
    assert torch.equal(w.load(TOKENS), kv)
    w.close()


def test_prefetch_below_what_the_tree_holds_frees_the_duplicates(tmp_path):
    kv = _write(tmp_path)
    w = World(tmp_path)
    assert w.prefetch("r1", TOKENS[:8])[1] == 8
    free = w.cache.cache_controller.mem_pool_host.available_size()
    assert w.prefetch("r2", TOKENS)[1] == len(TOKENS) - 8
    assert w.cache.cache_controller.mem_pool_host.available_size() == free - (len(TOKENS) - 8)
    assert torch.equal(w.load(TOKENS), kv)
    w.close()


@pytest.mark.parametrize("fault,hit", [
    (Fault("get", "fail"), 0),
    (Fault("get", "raise"), 0),
    (Fault("exists", "raise"), 0),
    (Fault("get", "short", keep=2), 2 * PS),
    (Fault("get", "timeout", delay_s=0.01), 0),
])
def test_faults_end_as_misses_with_the_tree_consistent(tmp_path, fault, hit):
    kv = _write(tmp_path)
    w = World(tmp_path, backend_wrap=lambda s: FaultyBackend(s).inject(fault))
    host_free = w.cache.cache_controller.mem_pool_host.available_size()
    n, loaded = w.prefetch("r1", TOKENS)
    assert n == len(TOKENS) and loaded == hit
    # nothing held outside the tree: the slots not loaded went back to the host pool
    assert w.cache.cache_controller.mem_pool_host.available_size() == host_free - hit
    if hit:
        assert torch.equal(w.load(TOKENS[:hit]), kv[:, :, :hit])
    else:
        m = w.cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(TOKENS)))
        assert m.host_hit_length == 0 and len(m.device_indices) == 0
    w.close()


def test_a_failed_backup_stores_nothing_and_releases_its_host_lock(tmp_path):
    w = World(tmp_path, backend_wrap=lambda s: FaultyBackend(s).inject(Fault("set", "fail", times=-1)))
    w.compute(TOKENS)
    w.settle()
    assert len(w.store) == 0 and w.tier.ongoing_backup == {}
    node = w.cache.find_node(fast.RadixKey(TOKENS))
    assert node.host_lock_ref == 0
    w.close()


def test_a_corrupt_page_file_is_a_miss_from_there(tmp_path):
    kv = _write(tmp_path)
    files = sorted(tmp_path.glob("*.urxp"))
    assert len(files) == len(TOKENS) // PS
    # corrupt the third page's file: the page keys say which file is which
    keys = pagekeys.chain_keys(TOKENS, PS, None)
    victim = FileStore(tmp_path)._path(keys[2])
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 3)
        f.write(b"\xff\xfe\xfd")
    w = World(tmp_path)
    n, loaded = w.prefetch("r1", TOKENS)
    assert loaded == 2 * PS  # the pages before the corrupt one
    assert torch.equal(w.load(TOKENS[:2 * PS]), kv[:, :, :2 * PS])
    w.close()


def test_wait_complete_waits_for_a_slow_read(tmp_path):
    kv = _write(tmp_path)
    w = World(tmp_path, backend_wrap=lambda s: FaultyBackend(s).inject(
        Fault("get", "slow", delay_s=0.2)), policy="wait_complete")
    tier = w.tier
    assert tier.prefetch_from_storage("r1", w.cache.root_node, TOKENS) == len(TOKENS)
    assert tier.check_prefetch_progress("r1") is False  # still reading
    assert tier.wait_idle(10)
    assert tier.check_prefetch_progress("r1") is True
    assert tier.pop_prefetch_loaded_tokens("r1") == len(TOKENS)
    w.cache.check_hicache_events()
    assert torch.equal(w.load(TOKENS), kv)
    w.close()


def test_abort_releases_the_prefetch(tmp_path):
    _write(tmp_path)
    w = World(tmp_path)
    free = w.cache.cache_controller.mem_pool_host.available_size()
    assert w.tier.prefetch_from_storage("r1", w.cache.root_node, TOKENS) == len(TOKENS)
    w.tier.release_aborted_request("r1")
    assert w.tier.wait_idle(10)
    w.cache.check_hicache_events()
    assert w.cache.cache_controller.mem_pool_host.available_size() == free
    assert w.cache.violations() == [] and w.tier.occupied == 0
    w.close()


def test_manual_steps_are_refused_in_threads_mode(tmp_path):
    w = World(tmp_path)
    with pytest.raises(fast.Unsupported, match="threads"):
        w.tier.run_queries(-1)
    w.close()


def test_server_args_attach_the_file_store(tmp_path):
    """SGLang's `--hicache-storage-backend file` through `init_hicache`, as the host tier is."""
    import types
    cache, alloc, args, params = server_args_cache(
        "file", {"file_path": str(tmp_path), "prefetch_threshold": 8,
                 "prefetch_timeout_per_ki_token": 1.0}, prefetch_policy="wait_complete")
    tier = cache.storage_tier
    assert isinstance(tier.backend, FileStore) and tier.threads
    assert tier.config.prefetch_stop_policy == "wait_complete" and tier.threshold == 8
    assert tier.config.prefetch_timeout_per_page == PS / 1024
    slots = alloc.alloc(8)
    cache.insert(fast.InsertParams(key=fast.RadixKey(list(range(8))), value=slots))
    cache.check_hicache_events()
    assert tier.wait_idle(10)
    assert len(list(tmp_path.glob("*.urxp"))) == 2
    tier.close()
    bad = types.SimpleNamespace(**{**vars(args), "hicache_storage_backend_extra_config": '{"x": 1}'})
    with pytest.raises(fast.Unsupported, match=r"\['x'\]"):
        fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=PS)).init_hicache(bad, params)
    other = types.SimpleNamespace(**{**vars(args), "hicache_storage_backend": "nixl"})
    with pytest.raises(fast.Unsupported, match="nixl"):
        fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=PS)).init_hicache(other, params)


def test_upstream_method_names_on_the_cache(tmp_path):
    kv = _write(tmp_path)
    w = World(tmp_path)
    cache = w.cache
    assert cache.enable_storage
    assert cache.prefetch_from_storage("r1", cache.root_node, TOKENS) == len(TOKENS)
    assert w.tier.wait_idle(10)
    assert cache.check_prefetch_progress("r1") is True
    assert cache.pop_prefetch_loaded_tokens("r1") == len(TOKENS)
    cache.release_aborted_request("r1")  # nothing in flight: nothing happens
    assert torch.equal(w.load(TOKENS), kv)
    assert cache.clear_storage_backend() and len(w.store) == 0
    w.close()


class _SpecAndFast(LockstepFace):
    """The spec and fast behind one adapter face, every step in lockstep (snapshots and
    invariants compared after each)."""

    def __init__(self, config) -> None:
        super().__init__(config, "fast")


def _storage_machine():
    import sys
    from pathlib import Path
    here = str(Path(__file__).resolve().parents[1] / "conformance" / "explore")
    if here not in sys.path:
        sys.path.insert(0, here)
    from test_storage_machine import make_machine, storage_configs
    return make_machine(_SpecAndFast, storage_configs())


def test_storage_machine_spec_and_fast_in_lockstep():
    """The Hypothesis storage machine (pages 1 and 2, both write policies, every stop policy)
    on the spec and fast in lockstep."""
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(_storage_machine(), settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, database=None))


@pytest.mark.slow
def test_storage_machine_spec_and_fast_in_lockstep_long():
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(_storage_machine(), settings=settings(
        max_examples=1500, stateful_step_count=80, deadline=None, database=None))


def test_a_prefetch_whose_keys_cannot_be_computed_is_a_miss_and_the_thread_lives(tmp_path):
    """Tokens outside a page key's range (4 bytes unsigned) fail the hit query: revoked, the
    storage thread goes on serving the next prefetch."""
    kv = _write(tmp_path)
    w = World(tmp_path)
    free = w.cache.cache_controller.mem_pool_host.available_size()
    assert w.prefetch("bad", [-1] * 8) == (8, 0)
    assert w.cache.cache_controller.mem_pool_host.available_size() == free
    assert w.prefetch("r1", TOKENS) == (len(TOKENS), len(TOKENS))
    assert torch.equal(w.load(TOKENS), kv)
    w.close()
