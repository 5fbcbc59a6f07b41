"""``uniradix bench --hicache POLICY``: the benchmark of conformance/bench/loop.py with a host tier.

The same workloads and the same scheduler loop, plus what SGLang's scheduler does with HiCache:
a host pool of **twice the device pool** (slot bookkeeping only, as the device pool: no KV data
moves in either implementation), write-through (threshold 1) or write-back as asked,
``load_back_threshold`` 0; per request, after the match::

    if m.host_hit_length > 0:                              # a host part: load it back
        idx, node = init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                      req=<last_node = m.last_device_node>))
        ready_to_load_host_cache()
    ... lock(node), evict / alloc, later insert and unlock as in loop.py
    check_hicache_events()                                 # once per request (a scheduler step)

Transfers complete when they are submitted (what a copy engine that keeps up looks like to the
cache), so each ``check_hicache_events`` releases every finished write and load.

Timed, besides loop.py's five calls: ``load_back`` (``init_load_back`` plus
``ready_to_load_host_cache``) and ``events`` (``check_hicache_events``).  Implementations:
``fast`` (``uniradix.fast`` with ``CacheInitParams(hicache=...)``) and ``upstream`` (0.5.13.post1
with the controller of conformance/adapters/upstream_host.py, completing on submit); the spec's
upstream-style wrapper has no host tier, so it is reported as not measured.  Outcomes (hit rate
counting device and loaded tokens, evictions, aborts, per-request digest) must be identical.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import struct
import time
from collections.abc import Callable
from typing import Any

from uniradix.conformance.bench import loop as B

HOST_OPS = B.OPS + ("load_back", "events")
POLICIES = ("write_through", "write_back")


class HostFreeList(B.FreeListAllocator):
    """The host pool: the same free list, plus ``clear`` (upstream's reset clears it)."""

    def __init__(self, usable_slots: int, page_size: int, torch_module) -> None:
        super().__init__(usable_slots, page_size, torch_module)
        self._usable = usable_slots

    def clear(self) -> None:
        B.FreeListAllocator.__init__(self, self._usable, self.page_size, self.torch)


class _Req:
    def __init__(self, last_node: Any) -> None:
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0


def build_fast(kv_slots: int, ps: int, policy: str):
    import torch

    from uniradix import fast
    from uniradix.fast.hicache import HiCacheConfig, InitLoadBackParams
    alloc = B.FreeListAllocator(kv_slots, ps, torch)
    host = HostFreeList(2 * kv_slots, ps, torch)
    cfg = HiCacheConfig(host_allocator=host, write_policy=policy, write_through_threshold=1,
                        load_back_threshold=0, io="sync")
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps,
        hicache=cfg))
    return cache, alloc, fast, InitLoadBackParams, "dev"


def build_upstream(kv_slots: int, ps: int, policy: str):
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
    from uniradix.conformance.adapters.upstream_host import ModelController
    try:
        up = load_upstream()
    except UpstreamMissing as e:
        raise B.ImplMissing(f"upstream: {e}") from e
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    alloc = B.FreeListAllocator(kv_slots, ps, up.torch)
    host = HostFreeList(2 * kv_slots, ps, up.torch)
    cache = up.UnifiedRadixCache(up.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps,
        is_eagle=False, tree_components=(up.ComponentType.FULL,)))
    ctrl = ModelController(policy, host, alloc, done_on_submit=True)
    cache.cache_controller = ctrl
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    cache.components[up.ComponentType.FULL]._full_kv_pool_host = host
    names = type("Names", (), {"RadixKey": up.RadixKey, "MatchPrefixParams": up.MatchPrefixParams,
                               "InsertParams": up.InsertParams, "EvictParams": up.EvictParams})
    return cache, alloc, names, InitLoadBackParams, f"sglang {up.version}"


BUILDERS: dict[str, Callable] = {"fast": build_fast, "upstream": build_upstream}


def run_bench_host(impl: str, workload: B.BenchWorkload, policy: str) -> B.BenchStats:
    """One run of ``workload`` on ``impl`` with a host tier (see the module docstring)."""
    import torch
    ps = workload.page_size
    cache, allocator, api, LoadParams, version = BUILDERS[impl](workload.kv_slots, ps, policy)
    RadixKey, MatchP, InsertP, EvictP = (api.RadixKey, api.MatchPrefixParams, api.InsertParams,
                                         api.EvictParams)
    stats = B.BenchStats(impl, version, f"{workload.name}+{policy}", ps, workload.kv_slots,
                         values="torch")
    stats.op_times = {op: [] for op in HOST_OPS}
    t_match, t_lock, t_evict, t_insert, t_unlock, t_load, t_events = (
        stats.op_times[op] for op in HOST_OPS)
    digest = hashlib.blake2b(digest_size=16)
    pack = struct.Struct("<qqq").pack
    clock = time.perf_counter
    running: collections.deque = collections.deque()

    def finish(req: B._Running) -> None:
        aligned = len(req.tokens) // ps * ps
        params = InsertP(key=RadixKey(req.tokens[:aligned]), value=req.slots[:aligned],
                         prev_prefix_len=req.matched)
        t0 = clock()
        result = cache.insert(params)
        t_insert.append(clock() - t0)
        if aligned < len(req.slots):
            allocator.free(req.slots[aligned:])
        t0 = clock()
        cache.dec_lock_ref(req.node, req.dec)
        t_unlock.append(clock() - t0)
        digest.update(pack(2, int(result.prefix_len), 0))
        stats.requests += 1

    gc.collect()
    wall0 = clock()
    for prompt, output in workload.stream():
        while len(running) >= workload.inflight:
            finish(running.popleft())
        params = MatchP(key=RadixKey(prompt))
        t0 = clock()
        m = cache.match_prefix(params)
        t_match.append(clock() - t0)
        node, indices, loaded = m.last_device_node, m.device_indices, 0
        if m.host_hit_length > 0:
            lp = LoadParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length,
                            mem_quota=None, req=_Req(node))
            t0 = clock()
            new, node = cache.init_load_back(lp)
            cache.ready_to_load_host_cache()
            t_load.append(clock() - t0)
            loaded = len(new)
            if loaded:
                indices = torch.cat([indices, new]) if len(indices) else new
        t0 = clock()
        lock = cache.inc_lock_ref(node)
        t_lock.append(clock() - t0)
        dec = lock.to_dec_params()
        matched = len(indices)
        stats.prompt_tokens += len(prompt)
        stats.hit_tokens += matched
        need = -(-(len(prompt) + len(output) - matched) // ps) * ps
        evicted = 0
        short = need - allocator.available_size()
        if short > 0:
            t0 = clock()
            result = cache.evict(EvictP(num_tokens=short))
            t_evict.append(clock() - t0)
            evicted = int(result.num_tokens_evicted)
            stats.evicted_tokens += evicted
            stats.evict_calls += 1
        fresh = allocator.alloc(need)
        digest.update(pack(1, matched * 1_000_003 + loaded, evicted))
        if fresh is None:
            t0 = clock()
            cache.dec_lock_ref(node, dec)
            t_unlock.append(clock() - t0)
            digest.update(pack(3, 0, 0))
            stats.aborted += 1
        else:
            slots = torch.cat([indices, fresh]) if len(indices) else fresh
            running.append(B._Running(prompt + output, slots, matched, node, dec))
        t0 = clock()
        cache.check_hicache_events()
        t_events.append(clock() - t0)
    while running:
        finish(running.popleft())
    stats.wall_seconds = clock() - wall0
    stats.seconds = sum(sum(ts) for ts in stats.op_times.values())
    stats.digest = digest.hexdigest()
    stats.cached_tokens = workload.kv_slots - allocator.available_size()
    return stats


def compare_host(impls, workload: B.BenchWorkload, policy: str, repeats: int = 3,
                 log: Callable[[str], None] | None = None) -> B.Comparison:
    """Alternate the implementations ``repeats`` rounds (order rotated each round); outcomes
    must agree (``cmp.identical``)."""
    usable, missing = [], {}
    for impl in impls:
        if impl not in BUILDERS:
            missing[impl] = "no host tier behind its upstream-style API"
            continue
        try:
            BUILDERS[impl](64, workload.page_size, policy)
        except (B.ImplMissing, ImportError) as e:
            missing[impl] = str(e)
            continue
        usable.append(impl)
    cmp = B.Comparison(f"{workload.name}+{policy}", workload.page_size, workload.requests,
                       workload.kv_slots, {impl: [] for impl in usable}, missing)
    for rep in range(repeats):
        k = rep % len(usable) if usable else 0
        for impl in usable[k:] + usable[:k]:
            s = run_bench_host(impl, workload, policy)
            cmp.runs[impl].append(s)
            if log is not None:
                log(f"  {cmp.workload} p{workload.page_size} round {rep + 1}/{repeats} "
                    f"{impl:<8} {s.requests_per_s:>10.1f} req/s  ({s.wall_seconds:.1f} s wall)")
    cmp.mismatches = B.check_identical([s for runs in cmp.runs.values() for s in runs])
    cmp.identical = not cmp.mismatches
    return cmp


def print_host_ops(cmp: B.Comparison, out=None) -> None:
    """The host tier's own calls (median us), which loop.py's table leaves out."""
    import sys
    out = sys.stdout if out is None else out
    for impl in cmp.runs:
        med = cmp.median_ops_us(impl)
        calls = len(cmp.runs[impl][0].op_times["load_back"]) if cmp.runs[impl] else 0
        print(f"  {impl:<9}load_back us {med.get('load_back', float('nan')):>9.1f} "
              f"({calls} calls)  events us {med.get('events', float('nan')):>7.1f}", file=out)
