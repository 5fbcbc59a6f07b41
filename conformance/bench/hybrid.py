"""``uniradix bench --components swa|mamba``: the scheduler loop of :mod:`uniradix.conformance.bench.loop`
for hybrid models, ``fast`` (fast/hybrid.py) side by side with upstream's cache (the seed-era SWA
component, or Mamba; conformance/adapters/upstream_hybrid.py).  The spec's upstream-style wrapper has the
Full component only, so the spec is not measured here.

The loop is loop.py's (same workloads, same timing: only the cache calls ``match_prefix``,
``inc_lock_ref``, ``evict``, ``insert``, ``dec_lock_ref`` are timed, the pool frees they trigger
included), with what a hybrid model adds:

* **SWA** (window :data:`SWA_WINDOW`, an SWA pool of half the KV pool): ``alloc(n)`` needs n full
  and n SWA slots; when either is short the loop evicts with ``num_tokens`` and
  ``swa_num_tokens`` set to the shortfalls.  :class:`SwaFreeListAllocator` is loop.py's free
  list twice (full, SWA) plus the full -> SWA map as a tensor; for upstream the same class is
  mixed into its ``SWATokenToKVPoolAllocator``.
* **Mamba** (page size 1, :data:`MAMBA_SLOTS` state slots): each request takes a state slot at
  admission (evicting one state, ``mamba_num=1``, when none is free; aborting when still none),
  hands it to its insert as ``mamba_value`` and frees it when the insert answers
  ``mamba_exist``; the branching seqlen uses chunk size :data:`MAMBA_CHUNK`.

What must agree across implementations: hit rate, evicted tokens and, in the digest, each
request's matched length, Full and aux units evicted for it, insert ``prefix_len`` and
``mamba_exist``.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import struct
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from uniradix.conformance.bench.loop import (
    OPS,
    ApiBundle,
    BenchStats,
    BenchWorkload,
    Comparison,
    ConformanceMismatch,
    FreeListAllocator,
    ImplMissing,
    _torch_or_none,
    check_identical,
)

SWA_WINDOW = 512
MAMBA_SLOTS = 256
MAMBA_CHUNK = 64
COMPONENTS = ("full", "swa", "mamba")


class SwaFreeListAllocator(FreeListAllocator):
    """Full slots and SWA slots as two free lists, and the map full -> SWA (0 = none) as a
    tensor: ``free`` releases both, ``free_swa`` the SWA ones only, no per-slot Python work."""

    def __init__(self, usable_slots: int, swa_slots: int, page_size: int, torch_module) -> None:
        FreeListAllocator.__init__(self, usable_slots, page_size, torch_module)
        self.swa = FreeListAllocator(swa_slots, page_size, torch_module)
        self.full_to_swa = torch_module.zeros(usable_slots + page_size, dtype=torch_module.int64)
        self.full_attn_allocator = types.SimpleNamespace(
            free=self._free_full, available_size=self.full_available_size)
        self.is_not_in_free_group = True

    def full_available_size(self) -> int:
        return FreeListAllocator.available_size(self)

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa.available_size())

    def alloc(self, need_size: int):
        if need_size > self.full_available_size() or need_size > self.swa.available_size():
            return None
        full = FreeListAllocator.alloc(self, need_size)
        self.full_to_swa[full] = self.swa.alloc(need_size)
        return full

    def _free_full(self, free_index) -> None:
        FreeListAllocator.free(self, free_index)

    def free(self, free_index) -> None:
        if free_index.numel():
            FreeListAllocator.free(self, free_index)
            self.free_swa(free_index)

    def free_swa(self, free_index) -> None:
        swa = self.full_to_swa[free_index]
        swa = swa[swa > 0]
        if swa.numel():
            self.swa.free(swa)
        self.full_to_swa[free_index] = 0

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa[kv_indices]


class MambaReqPool:
    """A request pool holding only what the cache uses: the Mamba state allocator."""

    def __init__(self, slots: int, torch_module) -> None:
        self.mamba_allocator = FreeListAllocator(slots, 1, torch_module)
        self.mamba_pool = self.mamba_allocator
        self.enable_mamba_extra_buffer = False


def hybrid_bundle(impl: str, kind: str) -> ApiBundle:
    """``fast`` or ``upstream`` built for ``kind`` (``swa`` or ``mamba``)."""
    torch = _torch_or_none()
    if torch is None:
        raise ImplMissing(f"{impl}: torch is not installed in this interpreter")
    from uniradix.conformance.adapters import spec_api
    values = spec_api.TorchValues(torch)
    if impl == "fast":
        import uniradix.fast as fast

        def build(kv_slots: int, page_size: int):
            alloc, req_pool = _allocators(kind, kv_slots, page_size, torch, SwaFreeListAllocator,
                                          MambaReqPool)
            params = fast.CacheInitParams(
                disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
                page_size=page_size, tree_components=("full", kind),
                sliding_window_size=SWA_WINDOW if kind == "swa" else None,
                mamba_cache_chunk_size=MAMBA_CHUNK)
            return fast.UnifiedRadixCache(params), alloc, req_pool

        return ApiBundle("fast", "dev", fast.RadixKey, fast.MatchPrefixParams, fast.InsertParams,
                         fast.EvictParams, values, build)
    if impl == "upstream":
        from uniradix.conformance.adapters.upstream import UpstreamMissing
        try:
            from uniradix.conformance.adapters.upstream_hybrid import load_hybrid
            hy = load_hybrid()
        except UpstreamMissing as e:
            raise ImplMissing(f"upstream: {e}") from e
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        up = hy.up
        swa_cls = type("UpstreamSwaFreeList", (SwaFreeListAllocator, SWATokenToKVPoolAllocator), {})
        mamba_cls = type("UpstreamMambaReqPool", (MambaReqPool, HybridReqToTokenPool), {})

        def build(kv_slots: int, page_size: int):
            alloc, req_pool = _allocators(kind, kv_slots, page_size, torch, swa_cls, mamba_cls)
            ct = up.ComponentType
            override = None
            if kind == "swa":
                override = {ct.SWA: hy.SeedEraSWAComponent}
            else:
                hy.server_args._global_server_args = types.SimpleNamespace(
                    mamba_cache_chunk_size=MAMBA_CHUNK)
            params = up.CacheInitParams(
                disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
                page_size=page_size, is_eagle=False,
                tree_components=(ct.FULL, ct.SWA if kind == "swa" else ct.MAMBA),
                sliding_window_size=SWA_WINDOW if kind == "swa" else None,
                component_registry_override=override)
            return up.UnifiedRadixCache(params), alloc, req_pool

        return ApiBundle("upstream", f"sglang {up.version}", up.RadixKey, up.MatchPrefixParams,
                         up.InsertParams, up.EvictParams, values, build)
    raise ImplMissing(f"{impl}: not measured with {kind} (hybrid models are measured on fast "
                      f"and upstream only; the spec's wrapper is Full only)")


def _allocators(kind: str, kv_slots: int, page_size: int, torch, swa_cls, mamba_cls) -> tuple:
    if kind == "swa":
        swa_slots = kv_slots // 2 // page_size * page_size
        return swa_cls(kv_slots, swa_slots, page_size, torch), None
    return FreeListAllocator(kv_slots, page_size, torch), mamba_cls(MAMBA_SLOTS, torch)


def run_hybrid_bench(bundle: ApiBundle, workload: BenchWorkload, kind: str) -> BenchStats:
    """loop.py's loop with the SWA or Mamba additions (module docstring)."""
    ps = workload.page_size
    cache, alloc, req_pool = bundle.build(workload.kv_slots, ps)
    # Mamba's state allocator (used only when kind == "mamba"): upstream's or uniradix's, untyped
    mamba: Any = req_pool.mamba_allocator if req_pool is not None else None
    RadixKey, MatchP, InsertP, EvictP = (bundle.RadixKey, bundle.MatchPrefixParams,
                                         bundle.InsertParams, bundle.EvictParams)
    values = bundle.values
    stats = BenchStats(bundle.name, bundle.version, f"{workload.name}+{kind}", ps,
                       workload.kv_slots, values=values.name)
    t_match, t_lock, t_evict, t_insert, t_unlock = (stats.op_times[op] for op in OPS)
    digest = hashlib.blake2b(digest_size=16)
    pack = struct.Struct("<qqqq").pack
    clock = time.perf_counter
    running: collections.deque = collections.deque()

    def evict(**kw) -> tuple:
        t0 = clock()
        r = cache.evict(EvictP(**kw))
        t_evict.append(clock() - t0)
        stats.evict_calls += 1
        aux = r.swa_num_tokens_evicted if kind == "swa" else r.mamba_num_evicted
        stats.evicted_tokens += int(r.num_tokens_evicted)
        return int(r.num_tokens_evicted), int(aux)

    def finish(req) -> None:
        tokens, slots, matched, node, dec, state = req
        aligned = len(tokens) // ps * ps
        params = InsertP(key=RadixKey(tokens[:aligned]), value=slots[:aligned],
                         prev_prefix_len=matched)
        if state is not None:
            params.mamba_value = state
        t0 = clock()
        result = cache.insert(params)
        t_insert.append(clock() - t0)
        if aligned < len(slots):
            alloc.free(slots[aligned:])
        exist = bool(getattr(result, "mamba_exist", False)) if state is not None else False
        if exist:
            mamba.free(state)
        t0 = clock()
        cache.dec_lock_ref(node, dec)
        t_unlock.append(clock() - t0)
        digest.update(pack(2, int(result.prefix_len), int(exist), 0))
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
        node = m.last_device_node
        t0 = clock()
        lock = cache.inc_lock_ref(node)
        t_lock.append(clock() - t0)
        dec = lock.to_dec_params()
        matched = len(m.device_indices)
        stats.prompt_tokens += len(prompt)
        stats.hit_tokens += matched
        need = -(-(len(prompt) + len(output) - matched) // ps) * ps
        ev_full = ev_aux = 0
        if kind == "swa":
            short_full = need - alloc.full_available_size()
            short_swa = need - alloc.swa_available_size()
            if short_full > 0 or short_swa > 0:
                ev_full, ev_aux = evict(num_tokens=max(0, short_full),
                                        swa_num_tokens=max(0, short_swa))
        elif need > alloc.available_size():
            ev_full, ev_aux = evict(num_tokens=need - alloc.available_size())
        state = None
        if kind == "mamba":
            state = mamba.alloc(1)
            if state is None:
                f, a = evict(num_tokens=0, mamba_num=1)
                ev_full, ev_aux = ev_full + f, ev_aux + a
                state = mamba.alloc(1)
        fresh = alloc.alloc(need) if (kind != "mamba" or state is not None) else None
        digest.update(pack(1, matched, ev_full, ev_aux))
        if fresh is None:
            if state is not None:
                mamba.free(state)
            t0 = clock()
            cache.dec_lock_ref(node, dec)
            t_unlock.append(clock() - t0)
            digest.update(pack(3, 0, 0, 0))
            stats.aborted += 1
            continue
        slots = values.cat(m.device_indices, fresh)
        running.append((prompt + output, slots, matched, node, dec, state))
    while running:
        finish(running.popleft())
    stats.wall_seconds = clock() - wall0
    stats.seconds = sum(sum(ts) for ts in stats.op_times.values())
    stats.digest = digest.hexdigest()
    stats.cached_tokens = workload.kv_slots - alloc.available_size()
    return stats


def compare_hybrid(impls: Sequence[str], workload: BenchWorkload, kind: str, repeats: int = 3,
                   strict: bool = True, log: Callable[[str], None] | None = None) -> Comparison:
    """bench.compare for a hybrid model: alternating rounds, outcomes checked identical."""
    if kind == "mamba" and workload.page_size != 1:
        raise ValueError("Mamba is measured at page size 1 only (upstream needs it)")
    bundles, missing = {}, {}
    for impl in impls:
        try:
            bundles[impl] = hybrid_bundle(impl, kind)
        except ImplMissing as e:
            missing[impl] = str(e)
    cmp = Comparison(f"{workload.name}+{kind}", workload.page_size, workload.requests,
                     workload.kv_slots, {impl: [] for impl in bundles}, missing)
    order = list(bundles)
    for rep in range(repeats):
        k = rep % len(order) if order else 0
        for impl in order[k:] + order[:k]:
            s = run_hybrid_bench(bundles[impl], workload, kind)
            cmp.runs[impl].append(s)
            if log is not None:
                log(f"  {cmp.workload} p{workload.page_size} round {rep + 1}/{repeats} "
                    f"{impl:<8} {s.requests_per_s:>10.1f} req/s  ({s.wall_seconds:.1f} s wall)")
    cmp.mismatches = check_identical([s for runs in cmp.runs.values() for s in runs])
    cmp.identical = not cmp.mismatches
    if strict and cmp.mismatches:
        raise ConformanceMismatch("; ".join(cmp.mismatches))
    return cmp
