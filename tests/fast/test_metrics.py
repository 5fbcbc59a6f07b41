"""uniradix.fast.metrics: upstream's series on the caller's registry, and a scrape over loopback."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from uniradix.fast.errors import InvalidInput
from uniradix.fast.metrics import (
    EVICTION_BUCKETS,
    CacheMetrics,
    StorageLabels,
    buckets_from_env,
    serve_metrics,
)

STORAGE = StorageLabels("file", tp_rank=1, dp_rank=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                        attn_cp_size=1)
BASE = {"cache_type": "UnifiedRadixCache"}
STORE = {"storage_backend": "file", "tp_rank": "1", "dp_rank": "2", "pp_rank": "0",
         "pp_size": "1", "attn_cp_rank": "0", "attn_cp_size": "1"}


def value(reg, name, labels):
    v = reg.get_sample_value(name, labels)
    assert v is not None, f"no sample {name}{labels}"
    return v


def test_eviction_is_recorded_once_per_call_with_the_sum_over_components():
    reg = CollectorRegistry()
    m = CacheMetrics(reg, components=("full", "swa"))
    m.on_evict({"full": 10, "swa": 4}, 0.004)
    m.on_evict({"full": 0, "swa": 0}, 0.5)  # nothing evicted: nothing recorded, as upstream
    assert value(reg, "sglang:evicted_tokens_total", BASE) == 14
    assert value(reg, "sglang:eviction_duration_seconds_count", BASE) == 1
    assert value(reg, "sglang:eviction_duration_seconds_sum", BASE) == pytest.approx(0.004)
    assert value(reg, "sglang:eviction_duration_seconds_bucket", {**BASE, "le": "0.004"}) == 1
    assert value(reg, "sglang:eviction_duration_seconds_bucket", {**BASE, "le": "0.003"}) == 0
    assert value(reg, "uniradix:evicted_by_component_total", {**BASE, "component": "swa"}) == 4
    assert value(reg, "uniradix:evicted_by_component_total", {**BASE, "component": "full"}) == 10


def test_upstream_buckets_and_label_sets():
    reg = CollectorRegistry()
    CacheMetrics(reg, storage=STORAGE)
    fams = {f.name: f for f in reg.collect()}
    ev = fams["sglang:eviction_duration_seconds"]
    les = [float(s.labels["le"]) for s in ev.samples if s.name.endswith("_bucket")]
    assert les[:-1] == list(EVICTION_BUCKETS) and les[-1] == float("inf")
    for name in ("sglang:evicted_tokens", "sglang:load_back_tokens",
                 "sglang:eviction_duration_seconds", "sglang:load_back_duration_seconds"):
        assert {k for s in fams[name].samples for k in s.labels} - {"le"} == {"cache_type"}, name
    for name in ("sglang:prefetched_tokens", "sglang:backuped_tokens", "sglang:prefetch_pgs",
                 "sglang:backup_pgs", "sglang:prefetch_bandwidth", "sglang:backup_bandwidth"):
        assert {k for s in fams[name].samples for k in s.labels} - {"le"} == set(STORE), name
    bw = [float(s.labels["le"]) for s in fams["sglang:backup_bandwidth"].samples
          if s.name.endswith("_bucket")]
    assert bw == [0.1, 0.5, 1, 5, 10, 50, 100, float("inf")]


def test_load_back_sizes_and_storage():
    reg = CollectorRegistry()
    m = CacheMetrics(reg, components=("full", "mamba"), extra_labels={"model": "m1"},
                     storage=STORAGE)
    m.on_load_back(128, 0.02)
    m.on_load_back(0, 0.001)
    m.set_sizes("mamba", evictable=3, protected=1)
    m.set_sizes("full", evictable=400, protected=64)
    m.on_prefetched(256)
    m.on_prefetched(0)
    m.on_backuped(512)
    m.on_storage_batches(prefetch_pages=[4, 60], backup_pages=[2], prefetch_gbps=[0.7],
                         backup_gbps=[12.0])
    base = {**BASE, "model": "m1"}
    store = {**STORE, "model": "m1"}
    assert value(reg, "sglang:load_back_tokens_total", base) == 128
    assert value(reg, "sglang:load_back_duration_seconds_count", base) == 2
    assert value(reg, "uniradix:evictable_size", {**base, "component": "mamba"}) == 3
    assert value(reg, "uniradix:protected_size", {**base, "component": "full"}) == 64
    assert value(reg, "sglang:prefetched_tokens_total", store) == 256
    assert value(reg, "sglang:backuped_tokens_total", store) == 512
    assert value(reg, "sglang:prefetch_pgs_count", store) == 2
    assert value(reg, "sglang:prefetch_pgs_bucket", {**store, "le": "5.0"}) == 1
    assert value(reg, "sglang:backup_bandwidth_sum", store) == 12.0
    assert value(reg, "sglang:prefetch_bandwidth_bucket", {**store, "le": "1.0"}) == 1


def test_nothing_lands_on_the_global_registry():
    before = {f.name for f in REGISTRY.collect()}
    CacheMetrics(CollectorRegistry(), storage=STORAGE)
    assert {f.name for f in REGISTRY.collect()} == before


@pytest.mark.parametrize("call, needle", [
    (lambda m: m.on_evict({"swa": 1}, 0.1), "component"),
    (lambda m: m.on_evict({"full": -1}, 0.1), "evicted"),
    (lambda m: m.on_evict({"full": 1}, -0.1), "seconds"),
    (lambda m: m.on_evict([("full", 1)], 0.1), "evicted"),
    (lambda m: m.on_load_back(1.5, 0.1), "tokens"),
    (lambda m: m.on_load_back(1, float("nan")), "seconds"),
    (lambda m: m.set_sizes("full", 1, -2), "protected"),
    (lambda m: m.on_prefetched(5), "storage"),
    (lambda m: m.on_storage_batches(prefetch_pages=[1]), "storage"),
])
def test_bad_calls_are_refused_and_change_nothing(call, needle):
    reg = CollectorRegistry()
    m = CacheMetrics(reg)
    m.on_evict({"full": 7}, 0.01)
    with pytest.raises(InvalidInput, match=needle):
        call(m)
    assert value(reg, "sglang:evicted_tokens_total", BASE) == 7
    assert value(reg, "sglang:eviction_duration_seconds_count", BASE) == 1
    assert value(reg, "sglang:load_back_duration_seconds_count", BASE) == 0


@pytest.mark.parametrize("kwargs, needle", [
    ({"components": ("full", "ssm")}, "components"),
    ({"components": ()}, "components"),
    ({"components": ("full", "full")}, "components"),
    ({"extra_labels": {"cache_type": "x"}}, "clashes"),
    ({"extra_labels": {"tp_rank": "x"}}, "clashes"),
    ({"extra_labels": {"bad-name": "x"}}, "label name"),
    ({"extra_labels": {"model": 3}}, "string value"),
    ({"cache_type": ""}, "cache_type"),
    ({"eviction_buckets": (0.2, 0.1)}, "eviction_buckets"),
    ({"storage": {"storage_backend": "file"}}, "storage"),
])
def test_bad_construction_is_refused(kwargs, needle):
    with pytest.raises(InvalidInput, match=needle):
        CacheMetrics(CollectorRegistry(), **kwargs)


def test_storage_labels_are_checked():
    with pytest.raises(InvalidInput, match="storage_backend"):
        StorageLabels("")
    with pytest.raises(InvalidInput, match="tp_rank"):
        StorageLabels("file", tp_rank=-1)


def test_buckets_from_env(monkeypatch):
    monkeypatch.delenv("SGLANG_BUCKET_EVICTION_DURATION", raising=False)
    assert buckets_from_env("SGLANG_BUCKET_EVICTION_DURATION", (1.0,)) == (1.0,)
    monkeypatch.setenv("SGLANG_BUCKET_EVICTION_DURATION", "0.1,0.5,2")
    assert buckets_from_env("SGLANG_BUCKET_EVICTION_DURATION", (1.0,)) == (0.1, 0.5, 2.0)
    monkeypatch.setenv("SGLANG_BUCKET_EVICTION_DURATION", "0.1,x")
    with pytest.raises(InvalidInput, match="SGLANG_BUCKET_EVICTION_DURATION"):
        buckets_from_env("SGLANG_BUCKET_EVICTION_DURATION", (1.0,))
    monkeypatch.setenv("SGLANG_BUCKET_EVICTION_DURATION", "2,1")
    with pytest.raises(InvalidInput, match="SGLANG_BUCKET_EVICTION_DURATION"):
        buckets_from_env("SGLANG_BUCKET_EVICTION_DURATION", (1.0,))


def test_scrape_over_loopback():
    reg = CollectorRegistry()
    m = CacheMetrics(reg, components=("full", "swa"), storage=STORAGE)
    m.on_evict({"full": 32, "swa": 8}, 0.003)
    m.set_sizes("swa", 100, 20)
    m.on_backuped(64)
    with serve_metrics(reg) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in fams.values() for s in f.samples}
    assert samples[("sglang:evicted_tokens_total", (("cache_type", "UnifiedRadixCache"),))] == 40
    assert samples[("uniradix:evictable_size", (("cache_type", "UnifiedRadixCache"),
                                               ("component", "swa")))] == 100
    assert samples[("sglang:backuped_tokens_total", tuple(sorted(STORE.items())))] == 64
    # closed: the port no longer answers
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_server_refuses_a_bad_port():
    with pytest.raises(InvalidInput, match="port"):
        serve_metrics(CollectorRegistry(), port=70_000)
