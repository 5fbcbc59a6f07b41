"""``uniradix bench --allocator sglang`` beyond Full (conformance/bench/sglang_alloc.py): fast and
upstream each over its own instance of sglang's allocators and pools, fast built from sglang's
``CacheInitParams``; identical outcomes; refusals by name.

The tests that build sglang's objects need sglang (the upstream venv: scripts/upstream-venv.sh;
VENV/bin/python -m pytest tests/conformance/bench/test_bench_sglang_alloc.py) and skip
elsewhere; the last one runs where sglang does not import and checks that the configurations
are then recorded as not measured, never run over the bench's own free lists.
"""

from __future__ import annotations

import json

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.bench import configs as C
from uniradix.conformance.bench import loop as bench
from uniradix.conformance.env.workload import SharedPrefix

HAVE_SGLANG = upstream_mod.upstream_available()
needs_sglang = pytest.mark.skipif(
    not HAVE_SGLANG, reason="upstream sglang is not importable here (build the venv with "
                            "scripts/upstream-venv.sh and run pytest with its python)")

# SWA (window 512, an SWA pool of half the KV pool) needs a pool of a few windows to evict
HYBRID = SharedPrefix(requests=150, prompts=10, prompt_min=100, prompt_max=900, kv_slots=4096,
                      inflight=4)


def _sglang_classes():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.memory_pool_host import (
        HostPoolGroup,
        MambaPoolHost,
        MHATokenToKVPoolHost,
    )
    return {"swa": SWATokenToKVPoolAllocator, "token": TokenToKVPoolAllocator,
            "paged": PagedTokenToKVPoolAllocator, "req": HybridReqToTokenPool,
            "host": MHATokenToKVPoolHost, "group": HostPoolGroup, "mamba_host": MambaPoolHost}


CASES = [("swa", 1), ("swa", 16), ("mamba", 1), ("swa+mamba", 16), ("write_through", 16),
         ("write_back+swa", 1), ("write_through+mamba", 16)]


@pytest.mark.upstream
@needs_sglang
@pytest.mark.parametrize("name,page_size", CASES, ids=[f"{n}-p{p}" for n, p in CASES])
def test_each_configuration_runs_over_sglangs_own_objects_with_identical_outcomes(name,
                                                                                 page_size):
    pytest.importorskip("torch", reason="torch is not installed")
    k = _sglang_classes()
    config = C.BenchConfig.parse(name)
    for impl in ("fast", "upstream"):
        bundle = C.config_bundle(impl, config, page_size, "sglang")
        assert bundle.RadixKey.__module__.startswith("sglang.")  # called with sglang's types
        cache, loop_alloc, req_pool = bundle.build(bench.PagedPool(4096, page_size, "kv"))
        alloc = cache.token_to_kv_pool_allocator
        want = k["swa"] if "swa" in config.components else k["token" if page_size == 1
                                                               else "paged"]
        assert type(alloc) is want, (impl, type(alloc))
        assert getattr(loop_alloc, "sglang", loop_alloc) is alloc  # the loop allocates from it
        if "mamba" in config.components:
            assert type(req_pool) is k["req"] and cache.req_to_token_pool is req_pool
        if config.hicache:
            host = cache.cache_controller.mem_pool_host
            if impl == "upstream" and config.aux:  # the KV host pool anchors sglang's group
                assert type(host) is k["group"]
                host = host.anchor_entry.host_pool
            assert type(host) is k["host"], (impl, type(host))
            if impl == "fast":
                aux_pools = [c.host_allocator for c in cache.components]
            else:
                aux_pools = [getattr(cache, a) for a in ("swa_kv_pool_host", "mamba_pool_host")
                             if getattr(cache, a, None) is not None]
            assert [type(p) for p in aux_pools] == [
                k["host"] if c == "swa" else k["mamba_host"] for c in config.aux]
    cmp = bench.compare(["fast", "upstream"], bench.shared_prefix_workload(page_size, base=HYBRID),
                        repeats=1, strict=False, allocator="sglang", config=config)
    assert not cmp.missing and cmp.identical, (cmp.missing, cmp.mismatches)
    s = cmp.runs["fast"][0]
    assert s.requests > HYBRID.requests // 2 and s.hit_rate > 0.2, (s.requests, s.hit_rate)
    if "swa" in config.components or config.hicache:
        assert s.evicted_tokens > 0  # the pools ran short: the allocators' frees were driven
    if config.hicache:
        assert any("sglang's host pools" in n for n in cmp.notes)
        if "swa" in config.components:
            assert len(s.op_times["load_back"]) > 0


@pytest.mark.upstream
@needs_sglang
def test_a_host_tier_with_swa_and_mamba_is_refused_for_upstream_by_name_with_the_reason():
    from uniradix.conformance.bench import sglang_alloc
    config = C.BenchConfig(("full", "swa", "mamba"), "write_through")
    with pytest.raises(bench.ImplMissing, match=r"upstream: --allocator sglang, "
                       r"write_through\+swa\+mamba: refused: .*SWA and Mamba together"):
        sglang_alloc.config_bundle("upstream", config)
    with pytest.raises(bench.ImplMissing, match="SWA and Mamba together"):
        C.config_bundle("upstream", config, 1, "sglang")  # (its capabilities refuse it first)


def test_the_cli_runs_a_configuration_over_sglang_or_records_why_not(tmp_path, capsys):
    """``bench --allocator sglang --components swa`` is no longer refused: where sglang imports
    both implementations run over its allocators; where it does not, both are recorded as not
    measured with the reason (never run over the bench's own free lists)."""
    pytest.importorskip("torch", reason="torch is not installed")
    out = tmp_path / "b.json"
    rc = bench.main(["--impl", "fast,upstream", "--allocator", "sglang", "--components", "swa",
                     "--requests", "40", "--page-size", "1", "--repeat", "1", "--json",
                     str(out)])
    data = json.loads(out.read_text())
    (c,) = data["comparisons"]
    assert data["allocator"] == "sglang" and c["workload"] == "shared-prefix+swa"
    from uniradix.conformance.bench import results as R
    (fig,) = R.normalize(data, file=str(out))["figures"]["throughput"]
    assert fig["allocator"] == "sglang"  # the dashboard's record keeps it
    old = dict(c)
    del old["allocator"]  # a bench JSON from before the key
    (fig,) = R.normalize({"comparisons": [old], "memory": []}, file="old.json")["figures"][
        "throughput"]
    assert fig["allocator"] == "freelist"
    if HAVE_SGLANG:
        assert rc == 0 and set(c["impls"]) == {"fast", "upstream"} and not c["missing"]
    else:
        assert set(c["missing"]) == {"fast", "upstream"} and not c["impls"]
        for impl, why in c["missing"].items():
            assert why.startswith(f"{impl}: --allocator sglang, swa: not measured: "), why


@pytest.mark.upstream
@needs_sglang
def test_host_mamba_load_backs_give_the_request_its_state_as_upstreams_do(monkeypatch):
    """write_through+mamba over 1,000 shared-prefix requests (page 1): fast's ``init_load_back``
    kept the requester's state slot from ``req.mamba_pool_idx``, so the loop took a second one
    at admission; the outcomes parted at about request 530 ("OUTCOMES DIFFER")."""
    pytest.importorskip("torch", reason="torch is not installed")
    from uniradix.fast.hybrid import HybridRadixCache
    given = []
    orig = HybridRadixCache.init_load_back

    def init_load_back(self, params):
        out = orig(self, params)
        given.append(getattr(params.req, "mamba_pool_idx", None) is not None)
        return out
    monkeypatch.setattr(HybridRadixCache, "init_load_back", init_load_back)
    config = C.BenchConfig.parse("write_through+mamba")
    cmp = bench.compare(["fast", "upstream"], bench.shared_prefix_workload(1, requests=1000),
                        repeats=1, strict=False, allocator="sglang", config=config)
    assert not cmp.missing and cmp.identical, (cmp.missing, cmp.mismatches)
    assert any(given)  # a load back brought a host-only state back for its request
