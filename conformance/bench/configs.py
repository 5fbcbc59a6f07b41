"""Bench configurations: which components and which host tier one comparison runs, and how
``fast`` and ``upstream`` are built for each (conformance/bench/loop.py drives them all with one
scheduler loop; the features are its steps: conformance/bench/host.py, hybrid.py).

A :class:`BenchConfig` is a component set (``full``, ``full+swa``, ``full+mamba``,
``full+swa+mamba``) and an optional host tier write policy.  Its name is the dashboard's
configuration (conformance/bench/results.py): ``full``, ``swa``, ``mamba``, ``swa+mamba``,
``write_through``, ``write_back``, ``write_through+swa``, ... .  :data:`MATRIX` is every
configuration ``uniradix bench --matrix`` measures.

Who runs what is not listed here: :func:`config_bundle` asks the implementation's declared
capabilities (conformance/adapters/capabilities.py) and refuses what they lack, by name
(``ImplMissing``, recorded in the comparison's ``missing``), so a capability an implementation
gains is measured as soon as it is declared.  Beyond the declarations, the bench itself drives:

* the Full configuration of every implementation (loop.py's bundles: spec, fast, upstream,
  upstream-rust, upstream-cpp);
* every other configuration on ``fast`` and ``upstream`` only (the spec's upstream-style
  wrapper, conformance/adapters/spec_api.py, has the Full component on the device tier only;
  upstream's Rust and C++ trees are pinned for the Full component);
* upstream's host tier with one aux component at a time: its hybrid cache controller over the
  bench's free lists (conformance/bench/host.py, as conformance/adapters/upstream_host_aux.py
  drives it over the pool model).

With ``--allocator sglang`` every configuration of fast and upstream is built over sglang's own
allocators and pools instead, fast from sglang's ``CacheInitParams``
(conformance/bench/sglang_alloc.py); the capability refusals above come first.

Sizes (as the hybrid and host benches had them): an SWA window of :data:`SWA_WINDOW` with an
SWA pool of half the KV pool; :data:`MAMBA_SLOTS` Mamba state slots, chunk size
:data:`MAMBA_CHUNK`; a host pool of twice the device pool (the SWA host pool the same, the
Mamba host pool :data:`MAMBA_HOST_SLOTS`), write-through threshold 1, load-back threshold 0,
transfers complete on submit.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

from uniradix.conformance.adapters import spec_api
from uniradix.conformance.bench import loop as B
from uniradix.spec.config import CacheConfig

SWA_WINDOW = 512
MAMBA_SLOTS = 256
MAMBA_CHUNK = 64
MAMBA_HOST_SLOTS = 2 * MAMBA_SLOTS  # the host Mamba pool (TRACE.md's default: twice the device's)
WRITE_POLICIES = ("write_through", "write_back")
# the implementations the bench builds in a configuration other than Full
CONFIG_IMPLS = ("fast", "upstream")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """A component set and an optional host tier (its write policy)."""

    components: tuple[str, ...] = ("full",)
    hicache: str | None = None

    def __post_init__(self) -> None:
        if self.components not in (("full",), ("full", "swa"), ("full", "mamba"),
                                   ("full", "swa", "mamba")):
            raise ValueError(f"components must be full, full+swa, full+mamba or "
                             f"full+swa+mamba, got {'+'.join(self.components)}")
        if self.hicache is not None and self.hicache not in WRITE_POLICIES:
            raise ValueError(f"hicache must be one of {', '.join(WRITE_POLICIES)}, "
                             f"got {self.hicache!r}")

    @property
    def aux(self) -> tuple[str, ...]:
        return self.components[1:]

    @property
    def name(self) -> str:
        """The dashboard's configuration: the write policy, then the aux components."""
        parts = ([self.hicache] if self.hicache else []) + list(self.aux)
        return "+".join(parts) or "full"

    @property
    def is_full(self) -> bool:
        """The Full component on the device tier alone (loop.py's own bundles)."""
        return self.components == ("full",) and self.hicache is None

    def cache_config(self, page_size: int, kv_slots: int = 4096) -> CacheConfig:
        """The trace-format config this bench configuration is (for the capability check)."""
        return CacheConfig(
            page_size=page_size, components=self.components, kv_slots=kv_slots,
            host_slots=2 * kv_slots if self.hicache else 0,
            write_policy=self.hicache or "write_through",
            sliding_window=SWA_WINDOW if "swa" in self.components else None,
            swa_slots=kv_slots // 2 if "swa" in self.components else 0,
            mamba_slots=MAMBA_SLOTS if "mamba" in self.components else 0,
            mamba_cache_chunk_size=MAMBA_CHUNK)

    @classmethod
    def parse(cls, name: str) -> BenchConfig:
        """The inverse of :attr:`name`: ``write_back+swa`` -> host tier write-back with SWA."""
        parts = [p for p in name.split("+") if p] if name != "full" else []
        policy = None
        if parts and parts[0] in WRITE_POLICIES:
            policy = parts.pop(0)
        if any(p not in ("swa", "mamba") for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"unknown bench configuration {name!r}")
        comps = ("full",) + tuple(c for c in ("swa", "mamba") if c in parts)
        return cls(comps, policy)


FULL = BenchConfig()
# every configuration --matrix measures (issue 15 item 4)
MATRIX: tuple[BenchConfig, ...] = (
    FULL, BenchConfig(("full", "swa")), BenchConfig(("full", "mamba")),
    BenchConfig(("full", "swa", "mamba")),
    BenchConfig(hicache="write_through"), BenchConfig(hicache="write_back"),
    BenchConfig(("full", "swa"), "write_through"), BenchConfig(("full", "swa"), "write_back"),
    BenchConfig(("full", "mamba"), "write_through"), BenchConfig(("full", "mamba"), "write_back"),
)


def capability_gaps(impl: str, config: BenchConfig, page_size: int) -> list[str]:
    """What ``config`` at ``page_size`` needs that ``impl`` does not declare (empty: none)."""
    from uniradix.conformance.adapters.capabilities import CAPABILITIES
    caps = CAPABILITIES.get(impl)
    if caps is None:
        return [f"no declared capabilities for {impl!r}"]
    return caps.missing(config.cache_config(page_size))


def config_bundle(impl: str, config: BenchConfig, page_size: int,
                  allocator: str = "freelist") -> B.ApiBundle:
    """``impl`` built for ``config`` at ``page_size``, with the loop's steps for it, over the KV
    allocator ``allocator`` (loop.py ``ALLOCATORS``: the bench's free lists, or sglang's own
    allocators and pools, conformance/bench/sglang_alloc.py);
    :class:`~uniradix.conformance.bench.loop.ImplMissing` says why when it is refused (its
    capabilities, or what the bench drives: module docstring) or cannot be built here."""
    if config.is_full:
        return B.get_bundle(impl)
    if impl not in CONFIG_IMPLS:
        why = ("the spec's upstream-style wrapper (conformance/adapters/spec_api.py) has the "
               "Full component on the device tier only" if impl == "spec" else
               "measured in the Full configuration only (a tree pinned for the Full component)")
        raise B.ImplMissing(f"{impl}: {why}")
    gaps = capability_gaps(impl, config, page_size)
    if gaps:
        raise B.ImplMissing(f"{impl}: refused: it does not model " + ", ".join(gaps)
                            + " (its declared capabilities)")
    if allocator == "sglang":
        from uniradix.conformance.bench.sglang_alloc import config_bundle as over_sglang
        bundle = over_sglang(impl, config)
    else:
        make = fast_builder if impl == "fast" else upstream_builder
        bundle = make(config)
    try:  # a probe: the cache builds here (an Unsupported or an import error says why not)
        bundle.build(B.PagedPool(64 * page_size, page_size, "probe"))
    except Exception as e:
        raise B.ImplMissing(f"{impl}: its cache for {config.name} at page {page_size} cannot "
                            f"be built here ({type(e).__name__}: {e})") from e
    return bundle


def _steps(config: BenchConfig, load_params: Any) -> tuple[Callable[[], B.Step], ...]:
    """The loop's steps for ``config`` (the host tier first: it loads back before the lock)."""
    from uniradix.conformance.bench.host import HostStep
    from uniradix.conformance.bench.hybrid import MambaStep, SwaStep
    out: list[Callable[[], B.Step]] = []
    if config.hicache:
        out.append(functools.partial(HostStep, load_params))
    if "swa" in config.components:
        out.append(SwaStep)
    if "mamba" in config.components:
        out.append(MambaStep)
    return tuple(out)


def _by_pool(build: Callable[[int, int], tuple]) -> Callable[[Any], tuple]:
    """A ``(kv_slots, page_size)`` builder as the loop calls it, with the run's pool."""
    return lambda pool: build(pool.num_pages * pool.page_size, pool.page_size)


def allocators(components: tuple[str, ...], kv_slots: int, page_size: int, torch: Any,
               swa_cls: Any, mamba_cls: Any) -> tuple[Any, Any]:
    """The KV allocator (free lists, with an SWA pool of half the KV pool for SWA) and the
    request pool holding the Mamba state allocator (None without Mamba)."""
    if "swa" in components:
        alloc = swa_cls(kv_slots, kv_slots // 2 // page_size * page_size, page_size, torch)
    else:
        alloc = B.FreeListAllocator(kv_slots, page_size, torch)
        B.count_frees(alloc)  # (--alloc-time; SwaFreeListAllocator counts its own)
    return alloc, (mamba_cls(MAMBA_SLOTS, torch) if "mamba" in components else None)


def fast_builder(config: BenchConfig) -> B.ApiBundle:
    """``uniradix.fast`` for ``config``: :func:`fast_build` behind the loop's steps."""
    torch = B._torch_or_none()
    if torch is None:
        raise B.ImplMissing("fast: torch is not installed in this interpreter")
    try:
        import uniradix.fast as fast
        from uniradix.fast.hicache import InitLoadBackParams
    except ImportError as e:
        raise B.ImplMissing(f"fast: uniradix.fast does not import ({e})") from e
    build = functools.partial(fast_build, config)
    return B.ApiBundle("fast", getattr(fast, "__version__", "dev"), fast.RadixKey,
                       fast.MatchPrefixParams, fast.InsertParams, fast.EvictParams,
                       spec_api.TorchValues(torch), _by_pool(build),
                       _steps(config, InitLoadBackParams), config.name)


def fast_build(config: BenchConfig, kv_slots: int, page_size: int) -> tuple:
    """(cache, KV allocator, request pool) of ``uniradix.fast`` for ``config``."""
    import torch

    import uniradix.fast as fast
    from uniradix.conformance.bench.hybrid import MambaReqPool, SwaFreeListAllocator
    alloc, req_pool = allocators(config.components, kv_slots, page_size, torch,
                                 SwaFreeListAllocator, MambaReqPool)
    kw: dict[str, Any] = {}
    if config.aux:
        kw.update(tree_components=config.components, mamba_cache_chunk_size=MAMBA_CHUNK,
                  sliding_window_size=SWA_WINDOW if "swa" in config.components else None)
    if config.hicache:
        from uniradix.conformance.bench.host import HostFreeList
        from uniradix.fast.hicache import HiCacheConfig
        kw["hicache"] = HiCacheConfig(
            host_allocator=HostFreeList(2 * kv_slots, page_size, torch),
            write_policy=config.hicache, write_through_threshold=1, load_back_threshold=0,
            io="sync",
            # the aux host pools as upstream's (conformance/bench/host.py wire_upstream_host):
            # the bench's free lists, not fast's own heap allocator (its per-page Python work
            # on a 4M-token Mooncake pool made fast's inserts 25x upstream's)
            host_swa_allocator=(HostFreeList(2 * kv_slots, page_size, torch)
                                if "swa" in config.components else None),
            host_mamba_allocator=(HostFreeList(MAMBA_HOST_SLOTS, 1, torch)
                                  if "mamba" in config.components else None))
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
        page_size=page_size, **kw))
    return cache, alloc, req_pool


def upstream_builder(config: BenchConfig) -> B.ApiBundle:
    """sglang 0.5.13.post1's ``UnifiedRadixCache`` for ``config`` (the seed-era SWA component,
    as for the golden corpus; the host tier through the controller of
    conformance/adapters/upstream_host.py, transfers completing on submit)."""
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
    try:
        up = load_upstream()
        hy = None
        if config.aux:
            from uniradix.conformance.adapters.upstream_hybrid import load_hybrid
            hy = load_hybrid()
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    except UpstreamMissing as e:
        raise B.ImplMissing(f"upstream: {e}") from e
    build = functools.partial(upstream_build, config, up, hy)
    return B.ApiBundle("upstream", f"sglang {up.version}", up.RadixKey, up.MatchPrefixParams,
                       up.InsertParams, up.EvictParams, spec_api.TorchValues(up.torch),
                       _by_pool(build), _steps(config, InitLoadBackParams), config.name)


@functools.cache
def _upstream_pool_classes() -> tuple[Any, Any]:
    """The bench's free lists mixed into sglang's SWA allocator and hybrid request pool
    classes (upstream's components check those types)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from uniradix.conformance.bench.hybrid import MambaReqPool, SwaFreeListAllocator
    return (type("UpstreamSwaFreeList", (SwaFreeListAllocator, SWATokenToKVPoolAllocator), {}),
            type("UpstreamMambaReqPool", (MambaReqPool, HybridReqToTokenPool), {}))


def upstream_build(config: BenchConfig, up: Any, hy: Any, kv_slots: int, page_size: int) -> tuple:
    """(cache, KV allocator, request pool) of sglang's cache for ``config``."""
    swa_cls, mamba_cls = _upstream_pool_classes() if config.aux else (None, None)
    alloc, req_pool = allocators(config.components, kv_slots, page_size, up.torch, swa_cls,
                                 mamba_cls)
    ct = up.ComponentType
    named = {"full": ct.FULL, "swa": ct.SWA, "mamba": ct.MAMBA}
    kw: dict[str, Any] = {}
    if config.aux:
        if "mamba" in config.components:  # upstream reads the chunk size from server args
            hy.server_args._global_server_args = types.SimpleNamespace(
                mamba_cache_chunk_size=MAMBA_CHUNK,
                strip_thinking_cache=False)  # (what sglang's Req reads when it is cached)
        kw.update(
            sliding_window_size=SWA_WINDOW if "swa" in config.components else None,
            component_registry_override=({ct.SWA: hy.SeedEraSWAComponent}
                                         if "swa" in config.components else None),
            # lifts upstream's page-size-1 check for Mamba (as the hybrid and host adapters do)
            enable_mamba_extra_buffer=((len(config.components) == 3 or bool(config.hicache))
                                       and page_size > 1))
    cache = up.UnifiedRadixCache(up.CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
        page_size=page_size, is_eagle=False,
        tree_components=tuple(named[c] for c in config.components), **kw))
    if config.hicache:
        from uniradix.conformance.bench.host import wire_upstream_host
        wire_upstream_host(cache, alloc, config.hicache, up, kv_slots, page_size, config.aux,
                           req_pool, MAMBA_HOST_SLOTS)
    return cache, alloc, req_pool


def matrix_table(results: dict) -> list[str]:
    """The ratios of a ``--matrix`` run's JSON (``uniradix bench --json``), one line per
    configuration, workload and page size: the requests/s of fast and upstream, fast's ratio
    to each peer, whether the outcomes were identical (``one``: a single conforming
    implementation measured, nothing to compare), and who was not measured; then bytes per
    cached token."""
    peers = ("upstream", "upstream-cpp")
    lines = [f"{'config':<20}{'workload':<15}{'page':>5}{'fast req/s':>12}{'upstream req/s':>16}"
             + "".join(f"{'fast/' + p:>19}" for p in peers) + "  identical  not measured"]
    for c in results.get("comparisons", []):
        base, _, config = str(c["workload"]).partition("+")
        impls = c.get("impls") or {}
        rps = "".join(f"{impls[i]['requests_per_s_median']:>{w}.1f}" if i in impls
                      else f"{'-':>{w}}" for i, w in (("fast", 12), ("upstream", 16)))
        ratios = c.get("ratios") or {}
        cells = "".join(f"{ratios[f'fast/{p}']:>18.2f}x" if ratios.get(f"fast/{p}") is not None
                        else f"{'-':>19}" for p in peers)
        extra = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()
                          if v is not None and k not in {f"fast/{p}" for p in peers})
        gone = ", ".join(sorted(c.get("missing") or {}))
        conforming = [i for i in impls if i not in B.PEERS]
        same = ("-" if not conforming else "one" if len(conforming) == 1
                else "yes" if c.get("identical_outcomes") else "NO")
        lines.append(f"{config or 'full':<20}{base:<15}{c['page_size']:>5}{rps}{cells}  "
                     f"{same:<9}  {gone}" + (f" ({extra})" if extra else ""))
    mem: dict[tuple[str, int], dict[str, float]] = {}
    for m in results.get("memory", []):
        mem.setdefault((m.get("config", "full"), m["page_size"]), {})[m["impl"]] = \
            m["bytes_per_token"]
    if mem:
        lines += ["", f"{'config':<20}{'page':>5}{'fast B/token':>14}{'upstream B/token':>18}"
                  f"{'fast/upstream':>15}"]
        for (config, ps), row in mem.items():
            f, u = row.get("fast"), row.get("upstream")
            cell = lambda v: f"{v:>.1f}" if v is not None else "-"  # noqa: E731
            lines.append(f"{config:<20}{ps:>5}{cell(f):>14}{cell(u):>18}"
                         + (f"{f / u:>14.2f}x" if f is not None and u else f"{'-':>15}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m uniradix.conformance.bench.configs FILE``: the table of a ``--matrix`` JSON."""
    import json
    import sys
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m uniradix.conformance.bench.configs MATRIX_JSON", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        print("\n".join(matrix_table(json.load(f))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
