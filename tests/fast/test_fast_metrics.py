"""The cache's own metrics (``enable_metrics=True``; fast/metrics.py ``wire_cache_metrics``,
docs/EVENTS.md "Metrics"): evictions on the C core and on the composed tree, per component, load
backs from the host tier, the size gauges, on the caller's registry, scraped over loopback."""

from __future__ import annotations

import urllib.request

import pytest

torch = pytest.importorskip("torch")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402

from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.conformance.explore.driver import make_config, record  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig, InitLoadBackParams  # noqa: E402
from uniradix.fast.metrics import serve_metrics  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

CT = {"cache_type": "UnifiedRadixCache"}


def value(reg, name, **labels):
    got = reg.get_sample_value(name, {**CT, **labels})
    return 0.0 if got is None else got


def full_cache(reg, events=False, **kw):
    alloc = PoolAllocator(PagedPool(64, 1, "kv"), torch)
    c = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        enable_metrics=True, metrics_registry=reg, enable_kv_cache_events=events, **kw))
    return c, alloc


def insert(c, alloc, tokens):
    c.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=alloc.alloc(len(tokens))))


@pytest.mark.parametrize("events", [False, True], ids=["c-core", "python-tree"])
def test_evictions_are_counted_and_timed_on_the_callers_registry(events):
    reg = CollectorRegistry()
    c, alloc = full_cache(reg, events)
    assert c.metrics is not None and c.metrics.registry is reg
    assert (c.core == "python") == events or not fast.cache.NATIVE
    insert(c, alloc, [1, 2, 3])
    insert(c, alloc, [1, 2, 9, 9])
    node = c.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 9, 9]))).last_device_node
    c.inc_lock_ref(node)
    assert value(reg, "uniradix:evictable_size", component="full") == 1
    assert value(reg, "uniradix:protected_size", component="full") == 4
    assert c.evict(fast.EvictParams(num_tokens=0)).num_tokens_evicted == 0
    assert value(reg, "sglang:eviction_duration_seconds_count") == 0  # nothing evicted: nothing seen
    assert c.evict(fast.EvictParams(num_tokens=5)).num_tokens_evicted == 1
    assert value(reg, "sglang:evicted_tokens_total") == 1
    assert value(reg, "uniradix:evicted_by_component_total", component="full") == 1
    assert value(reg, "sglang:eviction_duration_seconds_count") == 1
    assert value(reg, "uniradix:evictable_size", component="full") == 0


def test_metrics_off_leaves_the_cache_untouched():
    alloc = PoolAllocator(PagedPool(8, 1, "kv"), torch)
    c = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1))
    assert c.metrics is None
    assert not {"evict", "_evict_units"} & set(vars(c))  # the class's own methods run


def test_a_registry_of_another_kind_is_refused():
    with pytest.raises(fast.InvalidInput, match="CollectorRegistry"):
        full_cache(object())


@pytest.mark.parametrize("name", ["full-swa-mamba-p1", "swa-w8-p4", "mamba-p1"])
def test_hybrid_evictions_per_component_match_what_the_cache_returned(name):
    config = make_config(name, 2)
    steps = record(make_adapter("spec", config), config, 2, 300)
    adapter = make_adapter("fast", config)
    reg = CollectorRegistry()
    adapter.params.enable_metrics = True
    adapter.params.metrics_registry = reg
    adapter.cache = fast.UnifiedRadixCache(adapter.params)
    want = {"full": 0, "swa": 0, "mamba": 0}
    for step in steps:
        obs = adapter.apply(step)
        if step["op"] == "evict" and "error" not in obs:
            want["full"] += obs.get("num_tokens_evicted", 0)
            want["swa"] += obs.get("swa_num_tokens_evicted", 0)
            want["mamba"] += obs.get("mamba_num_evicted", 0)
    assert want["full"] > 0
    for comp in adapter.cache.component_names:
        # evictions a step other than evict makes (room for an insert) count as well
        assert value(reg, "uniradix:evicted_by_component_total", component=comp) >= want[comp]
    total = sum(value(reg, "uniradix:evicted_by_component_total", component=c)
                for c in adapter.cache.component_names)
    assert value(reg, "sglang:evicted_tokens_total") == total
    for comp in adapter.cache.component_names:
        ev = getattr(adapter.cache, f"{comp}_evictable_size")()
        assert value(reg, "uniradix:evictable_size", component=comp) == ev


def test_load_backs_are_counted_with_their_tokens():
    reg = CollectorRegistry()
    alloc = PoolAllocator(PagedPool(16, 1, "kv"), torch)
    cfg = HiCacheConfig(host_slots=32, write_policy="write_through", io="sync",
                        load_back_threshold=0, copy_impl="torch")
    c = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        hicache=cfg, enable_metrics=True, metrics_registry=reg))
    insert(c, alloc, [1, 2, 3])
    c.check_hicache_events()
    assert c.evict(fast.EvictParams(num_tokens=1)).num_tokens_evicted == 3
    assert value(reg, "sglang:evicted_tokens_total") == 3
    m = c.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3])))
    req = type("Req", (), {"last_node": m.last_device_node})()
    idx, _ = c.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, None, req))
    assert len(idx) == 3
    assert value(reg, "sglang:load_back_tokens_total") == 3
    assert value(reg, "sglang:load_back_duration_seconds_count") == 1


def test_a_scrape_over_loopback_shows_the_caches_series():
    reg = CollectorRegistry()
    c, alloc = full_cache(reg)
    insert(c, alloc, [4, 5, 6, 7])
    c.evict(fast.EvictParams(num_tokens=4))
    with serve_metrics(reg) as server:
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            text = resp.read().decode()
    assert 'sglang:evicted_tokens_total{cache_type="UnifiedRadixCache"} 4.0' in text
    assert 'uniradix:evictable_size{cache_type="UnifiedRadixCache",component="full"} 0.0' in text
    assert "sglang:eviction_duration_seconds_bucket" in text
