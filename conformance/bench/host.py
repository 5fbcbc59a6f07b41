"""The host tier as a step of the scheduler loop (conformance/bench/loop.py): ``uniradix bench
--hicache POLICY`` and every configuration with a host tier (conformance/bench/configs.py).

What SGLang's scheduler does with HiCache, added to the loop by :class:`HostStep`: a host pool
of **twice the device pool** (slot bookkeeping only, as the device pool: no KV data moves in
either implementation), write-through (threshold 1) or write-back as asked,
``load_back_threshold`` 0; per request, after the match::

    if m.host_hit_length > 0:                              # a host part: load it back
        idx, node = init_load_back(InitLoadBackParams(m.best_match_node, host_hit_length=0,
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
counting device and loaded tokens, evictions, aborts, per-request digest with the loaded
tokens) must be identical.

The load back is driven as the trace's ``load_back`` op is (:data:`LOAD_BACK_RULE`): no host
hit lengths in ``InitLoadBackParams`` nor on the request, so only an evicted best match node is
loaded (docs/SPEC.md, ``init_load_back``).  Given the match's host hit lengths, 0.5.13.post1 also
loads the aux host data (an SWA window, a Mamba state) under a best node whose Full data is
still on the device; the spec and fast do not, so the outcomes then differ: ``bench --impl
fast,upstream --components swa --hicache write_through --page-size 1 --requests 1000`` had hit
rates 0.7534 (fast) and 0.8974 (upstream) that way, the two parting at request 135 (a prompt
whose 623-token best node had its Full data on the device and its SWA window on the host
only).  Each comparison with a host tier carries this rule in its ``notes``.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from uniradix.conformance.bench import alloc_time
from uniradix.conformance.bench import loop as B

HOST_OPS = B.OPS + ("load_back", "events")
LOAD_BACK_RULE = ("load back as the trace's load_back op (docs/SPEC.md init_load_back): no host "
                  "hit lengths, so only an evicted best node is loaded; 0.5.13.post1 given the "
                  "match's host hit lengths also loads aux host data under a device node")
POLICIES = ("write_through", "write_back")


class HostFreeList(B.FreeListAllocator):
    """The host pool: the same free list, plus ``clear`` (upstream's reset clears it)."""

    def __init__(self, usable_slots: int, page_size: int, torch_module) -> None:
        super().__init__(usable_slots, page_size, torch_module)
        self._usable = usable_slots
        alloc_time.wrap(self, "free", "host")  # counted (and with --alloc-time timed)

    def clear(self) -> None:
        B.FreeListAllocator.__init__(self, self._usable, self.page_size, self.torch)


class _Req:
    """What ``init_load_back`` reads from a request."""

    def __init__(self, last_node: Any) -> None:
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.mamba_pool_idx = None


class HostStep(B.Step):
    """Load a host hit back after the match (timed ``load_back``); poll the acks once per
    request (timed ``events``).  The loaded tokens join the request's matched slots and are
    a number of the digest."""

    name = "host"
    ops = ("load_back", "events")
    # True: give ``init_load_back`` the match's host hit lengths, as SGLang's scheduler does
    # (the outcomes of the spec's rule and 0.5.13.post1's then differ: module docstring)
    scheduler_hit_lengths = False

    def __init__(self, load_params: Any) -> None:
        self.LoadParams = load_params  # the implementation's InitLoadBackParams

    def start(self, run: B.Run) -> None:
        cache = run.cache
        self._init_load_back = cache.init_load_back
        self._ready = cache.ready_to_load_host_cache
        self._events = cache.check_hicache_events

    def after_match(self, run: B.Run, req: B.Request, match: Any) -> None:
        if match.host_hit_length <= 0:
            return
        # the trace's load back (LOAD_BACK_RULE): no host hit lengths, so upstream loads only
        # an evicted best node, as the spec and fast do
        lengths = self.scheduler_hit_lengths
        lp = self.LoadParams(best_match_node=match.best_match_node,
                             host_hit_length=match.host_hit_length if lengths else 0,
                             mem_quota=None, req=_Req(req.node))
        if lengths:
            lp.req.swa_host_hit_length = getattr(match, "swa_host_hit_length", 0)
            lp.req.mamba_host_hit_length = getattr(match, "mamba_host_hit_length", 0)

        def load_back() -> Any:
            out = self._init_load_back(lp)
            self._ready()
            return out
        new, req.node = run.timed("load_back", load_back)
        if lp.req.mamba_pool_idx is not None:  # the load back gave the request a Mamba state
            req.state = lp.req.mamba_pool_idx.reshape(1)
        req.loaded = len(new)
        if req.loaded:
            req.indices = run.values.cat(req.indices, new)

    def admitted_fields(self, req: B.Request) -> tuple[int, ...]:
        return (req.loaded,)

    def request_done(self, run: B.Run) -> None:
        run.timed("events", self._events)


class HostGroup(HostFreeList):
    """The KV host pool as the anchor of upstream's host pool group: ``entry_map`` holds the
    aux host pools (SWA or Mamba) and their device allocators."""

    def __init__(self, usable_slots: int, page_size: int, torch_module) -> None:
        super().__init__(usable_slots, page_size, torch_module)
        self.entry_map: dict = {}

    def clear(self) -> None:
        super().clear()
        for entry in self.entry_map.values():
            entry.host_pool.clear()


def wire_upstream_host(cache: Any, alloc: Any, policy: str, up: Any, kv_slots: int,
                       page_size: int, aux: tuple[str, ...] = (), req_pool: Any = None,
                       mamba_host_slots: int = 0) -> Any:
    """Give sglang's ``cache`` a host tier: a host free list of twice ``kv_slots`` behind the
    model controllers of conformance/adapters/upstream_host.py (Full) and upstream_host_aux.py
    (with one aux component: its host pool, twice ``kv_slots`` for SWA or ``mamba_host_slots``
    for Mamba, and upstream's own allocation of the aux transfers), transfers completing on
    submit, write-through threshold 1, load-back threshold 0.  Returns the controller."""
    from uniradix.conformance.adapters.upstream_host import ModelController
    ct = up.ComponentType
    if not aux:
        host: Any = HostFreeList(2 * kv_slots, page_size, up.torch)
        ctrl: Any = ModelController(policy, host, alloc, done_on_submit=True)
    else:
        ctrl, host = _aux_controller(cache, alloc, policy, up, kv_slots, page_size, aux,
                                     req_pool, mamba_host_slots)
        cache.full_kv_pool_host = host
    cache.cache_controller = ctrl
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    cache.components[ct.FULL]._full_kv_pool_host = host
    return ctrl


def _aux_controller(cache: Any, alloc: Any, policy: str, up: Any, kv_slots: int,
                    page_size: int, aux: tuple[str, ...], req_pool: Any,
                    mamba_host_slots: int) -> tuple[Any, HostGroup]:
    """Upstream's hybrid cache controller over the bench's free lists (one aux component)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from uniradix.conformance.adapters.upstream_host_aux import AuxModelController
    if len(aux) != 1:
        raise B.ImplMissing("upstream: a host tier with SWA and Mamba together (its host "
                            "adapter takes one aux component)")
    ct, torch = up.ComponentType, up.torch
    group = HostGroup(2 * kv_slots, page_size, torch)
    if aux == ("swa",):
        aux_host = HostFreeList(2 * kv_slots, page_size, torch)
        group.entry_map[PoolName.SWA] = types.SimpleNamespace(
            name=PoolName.SWA, host_pool=aux_host, device_pool=None,
            is_primary_index_anchor=False,
            host_evict_fn=lambda n: cache.evict_host(n, ct.SWA),
            device_evict_fn=lambda n: cache.evict(EvictParams(swa_num_tokens=n)),
            device_alloc_fn=alloc.swa.alloc, device_free_fn=alloc.swa.free)
        cache.components[ct.SWA]._swa_kv_pool_host = aux_host
        cache.swa_kv_pool_host = aux_host
        full_alloc = alloc.alloc_full_only  # the SWA slots are taken and paired separately
    else:
        states = req_pool.mamba_allocator
        aux_host = HostFreeList(mamba_host_slots, 1, torch)
        group.entry_map[PoolName.MAMBA] = types.SimpleNamespace(
            name=PoolName.MAMBA, host_pool=aux_host, device_pool=None,
            is_primary_index_anchor=False,
            host_evict_fn=lambda n: cache.evict_host(n, ct.MAMBA),
            device_evict_fn=lambda n: cache.evict(EvictParams(mamba_num=n)),
            device_alloc_fn=states.alloc, device_free_fn=states.free)
        cache.components[ct.MAMBA]._mamba_pool_host = aux_host
        cache.mamba_pool_host = aux_host
        full_alloc = alloc.alloc
    anchor: Any = group  # (the adapter's pool-model group has the same surface)
    ctrl = AuxModelController(policy, anchor, full_alloc, alloc.free,
                              HybridCacheController._resolve_pool_transfers_allocation, torch)
    ctrl.done_on_submit = True  # (the bench: a copy engine that keeps up)
    return ctrl, group


# --------------------------------------------------------------------------------------------
# ``--hicache`` with the Full component, by implementation name (tests and older callers)
# --------------------------------------------------------------------------------------------


def _config(policy: str) -> Any:
    from uniradix.conformance.bench.configs import BenchConfig
    return BenchConfig(hicache=policy)


def build_fast(kv_slots: int, ps: int, policy: str) -> tuple:
    """(cache, allocator, API module, InitLoadBackParams, version) of fast with a host tier."""
    from uniradix import fast
    from uniradix.conformance.bench.configs import fast_build
    from uniradix.fast.hicache import InitLoadBackParams
    cache, alloc, _ = fast_build(_config(policy), kv_slots, ps)
    return cache, alloc, fast, InitLoadBackParams, "dev"


def build_upstream(kv_slots: int, ps: int, policy: str) -> tuple:
    """The same for sglang's cache (:class:`~uniradix.conformance.bench.loop.ImplMissing`
    where sglang does not import)."""
    from uniradix.conformance.bench.configs import upstream_builder
    bundle = upstream_builder(_config(policy))
    cache, alloc, _ = bundle.build(B.PagedPool(kv_slots, ps, "kv"))
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    return cache, alloc, bundle, InitLoadBackParams, bundle.version


BUILDERS: dict[str, Callable] = {"fast": build_fast, "upstream": build_upstream}


def run_bench_host(impl: str, workload: B.BenchWorkload, policy: str) -> B.BenchStats:
    """One run of ``workload`` on ``impl`` (built by ``BUILDERS[impl]``) with a host tier."""
    from uniradix.conformance.bench.configs import config_bundle
    bundle = config_bundle(impl, _config(policy), workload.page_size)

    def build(pool: Any) -> tuple:
        return BUILDERS[impl](pool.num_pages * pool.page_size, pool.page_size, policy)[:2]
    return B.run_bench(dataclasses.replace(bundle, build=build), workload)


def compare_host(impls: Sequence[str], workload: B.BenchWorkload, policy: str,
                 repeats: int = 3, log: Callable[[str], None] | None = None) -> B.Comparison:
    """loop.compare with a host tier of write policy ``policy``."""
    return B.compare(impls, workload, repeats=repeats, strict=False, log=log,
                     config=_config(policy))


def print_host_ops(cmp: B.Comparison, out: Any = None) -> None:
    """The host tier's own calls (median us), which loop.py's table leaves out."""
    out = sys.stdout if out is None else out
    for impl in cmp.runs:
        med = cmp.median_ops_us(impl)
        calls = len(cmp.runs[impl][0].op_times["load_back"]) if cmp.runs[impl] else 0
        print(f"  {impl:<9}load_back us {med.get('load_back', float('nan')):>9.1f} "
              f"({calls} calls)  events us {med.get('events', float('nan')):>7.1f}", file=out)
