"""The host tier as a step of the scheduler loop (conformance/bench/loop.py): ``uniradix bench
--hicache POLICY`` and every configuration with a host tier (conformance/bench/configs.py).

What SGLang's scheduler does with HiCache, added to the loop by :class:`HostStep`: a host pool
of **twice the device pool** (slot bookkeeping only, as the device pool: no KV data moves in
either implementation), write-through (threshold 1) or write-back as asked,
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
counting device and loaded tokens, evictions, aborts, per-request digest with the loaded
tokens) must be identical.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
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
        lp = self.LoadParams(best_match_node=match.best_match_node,
                             host_hit_length=match.host_hit_length, mem_quota=None,
                             req=_Req(req.node))

        def load_back() -> Any:
            out = self._init_load_back(lp)
            self._ready()
            return out
        new, req.node = run.timed("load_back", load_back)
        req.loaded = len(new)
        if req.loaded:
            req.indices = run.values.cat(req.indices, new)

    def admitted_fields(self, req: B.Request) -> tuple[int, ...]:
        return (req.loaded,)

    def request_done(self, run: B.Run) -> None:
        run.timed("events", self._events)


def wire_upstream_host(cache: Any, alloc: Any, policy: str, up: Any, kv_slots: int,
                       page_size: int) -> Any:
    """Give sglang's ``cache`` a host tier: a host free list of twice ``kv_slots`` behind the
    model controller of conformance/adapters/upstream_host.py (transfers complete on submit),
    write-through threshold 1, load-back threshold 0.  Returns the controller."""
    from uniradix.conformance.adapters.upstream_host import ModelController
    host = HostFreeList(2 * kv_slots, page_size, up.torch)
    ctrl = ModelController(policy, host, alloc, done_on_submit=True)
    cache.cache_controller = ctrl
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    cache.components[up.ComponentType.FULL]._full_kv_pool_host = host
    return ctrl


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
