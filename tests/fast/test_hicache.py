"""The host tier end to end: the fast path's HiCache API, its controller moving real KV with the
copy kernels, spec and fast in lockstep over io_complete orders (with the KV-integrity check in
each host layout), and a planted host-copy mix-up the KV check must see."""

import pytest

torch = pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.env.kvcheck import KVChecked, kv_checked  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.conformance.explore.conform import run_conform  # noqa: E402
from uniradix.conformance.explore.lockstep import VIOLATION  # noqa: E402
from uniradix.fast.hicache import Ack, HiCacheConfig, HiCacheRadixCache, InFlight, InitLoadBackParams  # noqa: E402
from uniradix.spec.config import CacheConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402


def _cache(io="sync", kv=16, host=32, policy="write_through", device_kv=None, host_kv=None,
           load_back_threshold=0):
    pool = PagedPool(kv, 1, "kv")
    alloc = PoolAllocator(pool, torch)
    cfg = HiCacheConfig(host_slots=host, write_policy=policy, io=io,
                        load_back_threshold=load_back_threshold, device_kv=device_kv,
                        host_kv=host_kv, copy_impl="torch")
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        hicache=cfg))
    return cache, alloc


def _insert(cache, alloc, tokens):
    slots = alloc.alloc(len(tokens))
    cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=slots))
    assert cache.violations() == []
    return slots


def test_params_with_hicache_build_the_host_tier_cache():
    cache, _ = _cache()
    assert isinstance(cache, HiCacheRadixCache) and isinstance(cache, fast.UnifiedRadixCache)
    assert cache.core == "python" and "host tier" in cache.core_reason
    with pytest.raises(fast.Unsupported, match="already has a host tier"):
        cache.init_hicache(None, None)
    plain = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None,
        token_to_kv_pool_allocator=PoolAllocator(PagedPool(8, 1, "kv"), torch), page_size=1))
    assert type(plain) is fast.UnifiedRadixCache


def test_sync_io_write_through_evict_to_host_and_load_back():
    cache, alloc = _cache(io="sync")
    _insert(cache, alloc, [1, 2, 3])
    a = cache.find_node(fast.RadixKey([1, 2, 3]))
    assert a.host_value.tolist() == [1, 2, 3] and a.lock_ref == 1   # write in flight
    cache.check_hicache_events()                                  # sync: already done
    assert a.lock_ref == 0
    assert cache.evict(fast.EvictParams(num_tokens=1)).num_tokens_evicted == 3
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3, 4])))
    assert m.host_hit_length == 3 and m.best_match_node is a and len(m.device_indices) == 0
    req = type("Req", (), {"last_node": m.last_device_node})()
    idx, last = cache.init_load_back(InitLoadBackParams(a, m.host_hit_length, None, req))
    cache.ready_to_load_host_cache()
    assert idx.tolist() == [1, 2, 3] and last is a and a.lock_ref == 1
    cache.check_hicache_events()
    assert a.lock_ref == 0 and cache.violations() == []
    assert cache.evict_host(3) == 0          # a is on the device again: no host leaf
    assert cache.host_size() == 3


def test_manual_io_keeps_locks_until_complete():
    cache, alloc = _cache(io="manual")
    _insert(cache, alloc, [4, 5])
    node = cache.find_node(fast.RadixKey([4, 5]))
    cache.check_hicache_events()
    assert node.lock_ref == 1
    # in-flight work is named: the ack in the queue, the transfer the cache waits for
    ack, = cache.cache_controller.ack_write_queue
    assert isinstance(ack, Ack) and ack.node_ids == [node.id] and not ack.finish_event.query()
    entry = cache.ongoing_write_through[node.id]
    assert isinstance(entry, InFlight) and entry.node is node and entry.lock is not None
    cache.cache_controller.complete(1, 0)
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.violations() == []


def test_controller_moves_real_kv_with_the_kernels():
    from uniradix import kernels
    geo = kernels.KVGeometry.mha(2, 2, 4, 1, torch.float32)
    dev = kernels.DevicePool.allocate(geo, 17)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 33, pin_memory=False)
    dev.buffer.copy_(torch.randn_like(dev.buffer))
    cache, alloc = _cache(io="sync", device_kv=dev, host_kv=host)
    slots = _insert(cache, alloc, [7, 8, 9])
    want = dev.buffer[:, :, slots].clone()
    cache.check_hicache_events()                     # the write is done: unlocked
    assert cache.evict(fast.EvictParams(num_tokens=3)).num_tokens_evicted == 3
    dev.buffer[:, :, slots] = float("nan")           # the device copy is gone
    node = cache.find_node(fast.RadixKey([7, 8, 9]))
    req = type("Req", (), {"last_node": cache.root_node})()
    idx, _ = cache.init_load_back(InitLoadBackParams(node, 3, None, req))
    assert torch.equal(dev.buffer[:, :, idx], want)


def test_write_back_passes_over_a_leaf_whose_backup_fails():
    cache, alloc = _cache(kv=8, host=2, policy="write_back")
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [7, 8])
    assert cache.evict(fast.EvictParams(num_tokens=1)).num_tokens_evicted == 2
    assert cache.find_node(fast.RadixKey([1, 2, 3])).value is not None
    assert cache.violations() == []


def test_load_back_below_threshold_loads_nothing():
    cache, alloc = _cache(load_back_threshold=4)
    _insert(cache, alloc, [1, 2])
    cache.check_hicache_events()
    cache.evict(fast.EvictParams(num_tokens=2))
    node = cache.find_node(fast.RadixKey([1, 2]))
    req = type("Req", (), {"last_node": cache.root_node})()
    idx, last = cache.init_load_back(InitLoadBackParams(node, 2, None, req))
    assert len(idx) == 0 and last is cache.root_node and node.value is None


@pytest.mark.parametrize("layout,name", [("layer_first", "hicache-wt-p1"),
                                         ("page_first", "hicache-wb-p4"),
                                         ("page_first_direct", "hicache-wt-p4"),
                                         ("layer_first", "hicache-wb-p1")])
def test_spec_and_fast_lockstep_with_kv_integrity(name, layout):
    """A short version of `uniradix conform --config hicache-* --check-kv`, one host layout
    each (the long runs are in docs/CHECKS.md)."""
    def checked(impl):
        def build(config):
            return KVChecked(make_adapter(impl, config), config, host_layout=layout)
        build.impl_name = impl
        return build
    res = run_conform([checked("spec"), checked("fast")], steps=300, seed=11, config=name,
                      out=None, progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)


def test_kv_check_sees_a_host_copy_mix_up(monkeypatch):
    """A backup that writes the right slot numbers but swaps the data of two tokens: the slot
    bookkeeping (and lockstep) cannot see it; the host fingerprints do."""
    import uniradix.conformance.env.kvcheck as kc
    orig = kc.HostKV.run

    def swapped(self, copies):
        bad = [(k, s, list(reversed(d)) if k == "backup" and len(d) > 1 else d)
               for k, s, d in copies]
        orig(self, bad)
    monkeypatch.setattr(kc.HostKV, "run", swapped)
    res = run_conform([kv_checked("spec"), kv_checked("fast")], steps=300, seed=3,
                      config="hicache-wt-p1", out=None, progress=False, log=lambda m: None,
                      shrink_seconds=5)
    assert res.finding is not None and res.finding.kind == VIOLATION
    assert "host slot" in str(res.finding)


def test_spec_fast_agree_on_a_host_tier_config_with_every_policy():
    for policy in ("write_through", "write_through_selective", "write_back"):
        cfg = CacheConfig(kv_slots=24, host_slots=36, write_policy=policy,
                          write_through_threshold=2 if policy != "write_through" else 1)
        res = run_conform(["spec", "fast"], steps=300, seed=2, config=cfg, out=None,
                          progress=False, log=lambda m: None)
        assert res.finding is None, str(res.finding)


def test_spec_vs_fast_machine_with_a_host_tier():
    """The Hypothesis machine on host configs: Hypothesis orders io_complete, acks polling,
    load backs, host evictions and host locks against the tree operations."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from uniradix.conformance.explore.machine import draw_host_config, make_machine
    run_state_machine_as_test(
        make_machine(["spec", "fast"], draw=draw_host_config, name="HostMachine"),
        settings=settings(max_examples=12, stateful_step_count=50, deadline=None,
                          database=None, suppress_health_check=list(HealthCheck)))


def test_upstream_adapter_reads_host_op_args_as_the_spec_does():
    """The upstream adapter checks args before upstream sees them; the host ops' args (as
    conformance/adapters/host_ops.py reads them) must pass, and unknown or missing ones must not (a
    conform run against upstream once rejected every io_complete)."""
    from uniradix.conformance.adapters.upstream import _check_args
    from uniradix.spec.config import CacheConfig
    from uniradix.spec.errors import InvalidInput
    cfg = CacheConfig(host_slots=64)
    node = {"tokens": [1], "extra_key": None}
    good = {"evict_host": {"num_tokens": 1},
            "load_back": {"node": node, "last_device_node": node, "mem_quota": None},
            "io_complete": {"writes": 0, "loads": 2}, "check_hicache_events": {},
            "host_lock": {"node": node}, "host_unlock": {"handle": 3}}
    for op, args in good.items():
        _check_args(cfg, op, args)
    _check_args(cfg, "io_complete", {})
    for op, args in (("io_complete", {"writes": 0, "bogus": 1}), ("load_back", {"node": node}),
                     ("host_unlock", {})):
        with pytest.raises(InvalidInput):
            _check_args(cfg, op, args)
