"""Prometheus metrics of the cache, under upstream SGLang's names and label sets.

Operators' dashboards already chart 0.5.13.post1's radix-cache and HiCache-storage metrics; the
cache reports the same series, so a dashboard works unchanged:

=====================================  =========  ==============================================
name                                   type       labels
=====================================  =========  ==============================================
sglang:evicted_tokens_total            counter    cache_type (+ extra labels)
sglang:eviction_duration_seconds       histogram  cache_type (+ extra labels)
sglang:load_back_tokens_total          counter    cache_type (+ extra labels)
sglang:load_back_duration_seconds      histogram  cache_type (+ extra labels)
sglang:prefetched_tokens_total         counter    storage labels (+ extra labels)
sglang:backuped_tokens_total           counter    storage labels (+ extra labels)
sglang:prefetch_pgs                    histogram  storage labels (+ extra labels)
sglang:backup_pgs                      histogram  storage labels (+ extra labels)
sglang:prefetch_bandwidth              histogram  storage labels (+ extra labels), GB/s
sglang:backup_bandwidth                histogram  storage labels (+ extra labels), GB/s
uniradix:evicted_by_component_total    counter    cache_type, component (+ extra labels)
uniradix:evictable_size                gauge      cache_type, component (+ extra labels)
uniradix:protected_size                gauge      cache_type, component (+ extra labels)
=====================================  =========  ==============================================

The storage labels are upstream's: ``storage_backend, tp_rank, dp_rank, pp_rank, pp_size,
attn_cp_rank, attn_cp_size``. The ``uniradix:`` series are ours (upstream has no per-component
eviction count nor size gauges). Everything is registered on the caller's
``CollectorRegistry``, never on prometheus_client's global one. Upstream reads bucket overrides
from ``SGLANG_BUCKET_EVICTION_DURATION`` / ``SGLANG_BUCKET_LOAD_BACK_DURATION``; here they are
constructor arguments (:func:`buckets_from_env` reads the same variables for a caller who wants it).

Cost: each ``on_*`` call is one or two prometheus_client updates on pre-bound children (a lock
and an add each, well under a microsecond per update).
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from .errors import InvalidInput

__all__ = ["CacheMetrics", "StorageLabels", "StorageTierMetrics", "storage_labels", "MetricsServer",
           "serve_metrics", "wire_cache_metrics",
           "buckets_from_env", "EVICTION_BUCKETS", "LOAD_BACK_BUCKETS", "STORAGE_PAGES_BUCKETS",
           "STORAGE_BANDWIDTH_BUCKETS", "COMPONENTS"]

# Upstream's default buckets (0.5.13.post1).
EVICTION_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009,
    0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0)
LOAD_BACK_BUCKETS: tuple[float, ...] = EVICTION_BUCKETS
STORAGE_PAGES_BUCKETS: tuple[float, ...] = (1, 5, 10, 50, 100)
STORAGE_BANDWIDTH_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1, 5, 10, 50, 100)

#: The cache's components (``uniradix.spec.components``).
COMPONENTS = ("full", "swa", "mamba")

_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class StorageLabels:
    """The label values upstream puts on its storage-tier series."""

    storage_backend: str
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.storage_backend, str) or not self.storage_backend:
            raise InvalidInput(f"storage_backend must be a non-empty string, "
                               f"got {self.storage_backend!r}")
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            if type(v) is not int or v < 0:
                raise InvalidInput(f"storage label {f.name} must be an integer >= 0, got {v!r}")

    def as_dict(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


def buckets_from_env(name: str, default: Sequence[float]) -> tuple[float, ...]:
    """Buckets from a comma-separated environment variable (upstream's convention), else
    ``default``. Raises :class:`InvalidInput` naming the variable when a value is not a number or
    the values are not increasing."""
    raw = os.environ.get(name, "")
    if not raw:
        return tuple(default)
    try:
        out = tuple(float(x) for x in raw.split(","))
    except ValueError:
        raise InvalidInput(f"{name}={raw!r}: every bucket must be a number") from None
    _check_buckets(name, out)
    return out


def _check_buckets(what: str, buckets: Sequence[float]) -> tuple[float, ...]:
    b = tuple(buckets)
    if not b or any(not isinstance(x, (int, float)) or isinstance(x, bool) for x in b) \
            or any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
        raise InvalidInput(f"{what}: buckets must be a non-empty increasing list of numbers, "
                           f"got {list(b)!r}")
    return b


def _check_count(name: str, value: int) -> None:
    if type(value) is not int or value < 0:
        raise InvalidInput(f"{name} must be an integer >= 0, got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidInput(f"{name} must be a number >= 0, got {value!r}")


class CacheMetrics:
    """The metrics one cache reports, registered on ``registry``.

    ``cache_type`` is upstream's label value (its class name, ``UnifiedRadixCache``);
    ``components`` the components whose sizes and evictions are reported; ``extra_labels`` the
    constant labels every series carries (upstream's ``--extra-metric-labels``); ``storage`` the
    storage-tier labels, or None when the cache has no storage tier (the storage series are then
    not registered and the storage calls are refused).

    Every ``on_*``/``set_*`` call checks its arguments and raises :class:`InvalidInput` before
    changing anything.
    """

    def __init__(self, registry: CollectorRegistry, cache_type: str = "UnifiedRadixCache",
                 components: Iterable[str] = ("full",),
                 extra_labels: Mapping[str, str] | None = None,
                 storage: StorageLabels | None = None,
                 eviction_buckets: Sequence[float] = EVICTION_BUCKETS,
                 load_back_buckets: Sequence[float] = LOAD_BACK_BUCKETS) -> None:
        if not isinstance(registry, CollectorRegistry):
            raise InvalidInput(f"registry must be a prometheus_client CollectorRegistry, "
                               f"got {type(registry).__name__}")
        if not isinstance(cache_type, str) or not cache_type:
            raise InvalidInput(f"cache_type must be a non-empty string, got {cache_type!r}")
        comps = tuple(components)
        bad = [c for c in comps if c not in COMPONENTS]
        if bad or not comps or len(set(comps)) != len(comps):
            raise InvalidInput(f"components must be distinct names from {COMPONENTS}, "
                               f"got {list(comps)!r}")
        if storage is not None and not isinstance(storage, StorageLabels):
            raise InvalidInput(f"storage must be StorageLabels or None, got {storage!r}")
        extra = dict(extra_labels or {})
        reserved = {"cache_type", "component"} | {f.name for f in fields(StorageLabels)}
        for k, v in extra.items():
            if not isinstance(k, str) or not _LABEL_RE.match(k) or k.startswith("__"):
                raise InvalidInput(f"extra label name {k!r} is not a valid Prometheus label name")
            if k in reserved:
                raise InvalidInput(f"extra label {k!r} clashes with a label the cache sets")
            if not isinstance(v, str):
                raise InvalidInput(f"extra label {k!r} must have a string value, got {v!r}")
        ev_b = _check_buckets("eviction_buckets", eviction_buckets)
        lb_b = _check_buckets("load_back_buckets", load_back_buckets)

        self.registry = registry
        self.components = comps
        self.storage: StorageLabels | None = None
        self._lock = threading.Lock()  # on_evict updates several series; keep them together
        base = {"cache_type": cache_type, **extra}
        names = list(base)
        reg = registry
        self._evicted = Counter("sglang:evicted_tokens", "The number of tokens evicted from GPU to CPU.",
                                names, registry=reg).labels(**base)
        self._evict_s = Histogram("sglang:eviction_duration_seconds",
                                  "Time taken to evict memory from GPU to CPU in seconds.",
                                  names, registry=reg, buckets=ev_b).labels(**base)
        self._loaded = Counter("sglang:load_back_tokens", "The number of tokens loaded from CPU to GPU.",
                               names, registry=reg).labels(**base)
        self._load_s = Histogram("sglang:load_back_duration_seconds",
                                 "Time taken to load memory from CPU to GPU in seconds.",
                                 names, registry=reg, buckets=lb_b).labels(**base)
        comp_names = names + ["component"]
        by_comp = Counter("uniradix:evicted_by_component", "Tokens (SWA, full) or states (Mamba) "
                          "evicted from the device, per component.", comp_names, registry=reg)
        evictable = Gauge("uniradix:evictable_size", "Evictable size of a component on the "
                          "device (tokens; states for Mamba).", comp_names, registry=reg)
        protected = Gauge("uniradix:protected_size", "Size of a component held by locks on the "
                          "device (tokens; states for Mamba).", comp_names, registry=reg)
        self._by_comp = {c: by_comp.labels(**base, component=c) for c in comps}
        self._evictable = {c: evictable.labels(**base, component=c) for c in comps}
        self._protected = {c: protected.labels(**base, component=c) for c in comps}
        self._extra = extra
        if storage is not None:
            self.add_storage(storage)

    def add_storage(self, storage: StorageLabels) -> None:
        """Register the storage-tier series with ``storage``'s labels (a cache that gains a
        storage tier after its metrics were made: ``init_hicache``).  Refused when they are
        registered already."""
        if not isinstance(storage, StorageLabels):
            raise InvalidInput(f"storage must be StorageLabels, got {storage!r}")
        if self.storage is not None:
            raise InvalidInput("the storage series are registered already")
        reg = self.registry
        s = {**storage.as_dict(), **self._extra}
        sn = list(s)
        self._prefetched = Counter("sglang:prefetched_tokens", "Number of prefetched prompt "
                                   "tokens.", sn, registry=reg).labels(**s)
        self._backuped = Counter("sglang:backuped_tokens", "Number of backuped tokens.", sn,
                                 registry=reg).labels(**s)
        self._prefetch_pgs = Histogram("sglang:prefetch_pgs", "Histogram of prefetch pages "
                                       "of batches.", sn, registry=reg,
                                       buckets=STORAGE_PAGES_BUCKETS).labels(**s)
        self._backup_pgs = Histogram("sglang:backup_pgs", "Histogram of backup pages of "
                                     "batches.", sn, registry=reg,
                                     buckets=STORAGE_PAGES_BUCKETS).labels(**s)
        self._prefetch_bw = Histogram("sglang:prefetch_bandwidth", "Histogram of prefetch "
                                      "bandwidth in GB/s.", sn, registry=reg,
                                      buckets=STORAGE_BANDWIDTH_BUCKETS).labels(**s)
        self._backup_bw = Histogram("sglang:backup_bandwidth", "Histogram of backup "
                                    "bandwidth in GB/s.", sn, registry=reg,
                                    buckets=STORAGE_BANDWIDTH_BUCKETS).labels(**s)
        self.storage = storage

    def _check_component(self, component: str) -> None:
        if component not in self._by_comp:
            raise InvalidInput(f"component {component!r} is not one of this cache's "
                               f"{self.components}")

    # -- device tier -------------------------------------------------------------------------------

    def on_evict(self, evicted: Mapping[str, int], seconds: float) -> None:
        """One ``evict`` call that took ``seconds`` and evicted ``evicted[component]`` per
        component. As upstream: nothing is recorded when nothing was evicted; otherwise the
        duration is observed once and ``sglang:evicted_tokens_total`` grows by the sum over the
        components."""
        if not isinstance(evicted, Mapping):
            raise InvalidInput(f"evicted must map component -> count, got {evicted!r}")
        for c, n in evicted.items():
            self._check_component(c)
            _check_count(f"evicted[{c!r}]", n)
        _check_seconds("seconds", seconds)
        total = sum(evicted.values())
        if total == 0:
            return
        with self._lock:
            self._evict_s.observe(seconds)
            self._evicted.inc(total)
            for c, n in evicted.items():
                if n:
                    self._by_comp[c].inc(n)

    def _record_evict(self, counts: Iterable[tuple[str, int]], total: int, seconds: float) -> None:
        """:meth:`on_evict` for a cache's own numbers (``total`` > 0, the sum of ``counts``),
        without the argument checks (a wired cache calls this on every eviction)."""
        with self._lock:
            self._evict_s.observe(seconds)
            self._evicted.inc(total)
            by_comp = self._by_comp
            for c, n in counts:
                if n:
                    by_comp[c].inc(n)

    def on_load_back(self, tokens: int, seconds: float) -> None:
        """One successful load-back of ``tokens`` device tokens from the host (upstream observes
        every successful load-back, so ``tokens`` may be 0)."""
        _check_count("tokens", tokens)
        _check_seconds("seconds", seconds)
        with self._lock:
            self._load_s.observe(seconds)
            self._loaded.inc(tokens)

    def set_sizes(self, component: str, evictable: int, protected: int) -> None:
        """The component's current evictable and protected sizes on the device."""
        self._check_component(component)
        _check_count("evictable", evictable)
        _check_count("protected", protected)
        with self._lock:
            self._evictable[component].set(evictable)
            self._protected[component].set(protected)

    def track_sizes(self, component: str, evictable: Callable[[], int],
                    protected: Callable[[], int]) -> None:
        """Read the component's sizes from ``evictable()`` / ``protected()`` when the registry
        is collected (nothing on the cache's hot path); replaces :meth:`set_sizes` values."""
        self._check_component(component)
        if not callable(evictable) or not callable(protected):
            raise InvalidInput("track_sizes needs two callables")
        self._evictable[component].set_function(evictable)
        self._protected[component].set_function(protected)

    # -- storage tier ------------------------------------------------------------------------------

    def _need_storage(self) -> None:
        if self.storage is None:
            raise InvalidInput("this CacheMetrics has no storage tier (pass storage=StorageLabels)")

    def on_prefetched(self, tokens: int) -> None:
        """Tokens a storage prefetch brought in (0 records nothing, as upstream)."""
        self._need_storage()
        _check_count("tokens", tokens)
        if tokens:
            self._prefetched.inc(tokens)

    def on_backuped(self, tokens: int) -> None:
        """Tokens backed up to storage (0 records nothing, as upstream)."""
        self._need_storage()
        _check_count("tokens", tokens)
        if tokens:
            self._backuped.inc(tokens)

    def on_storage_batches(self, prefetch_pages: Sequence[int] = (),
                           backup_pages: Sequence[int] = (),
                           prefetch_gbps: Sequence[float] = (),
                           backup_gbps: Sequence[float] = ()) -> None:
        """Per-I/O-batch figures a storage backend collected since the last call (upstream's
        ``StorageMetrics``): pages per prefetch / backup batch and their bandwidths in GB/s."""
        self._need_storage()
        for name, pages in (("prefetch_pages", prefetch_pages), ("backup_pages", backup_pages)):
            for v in pages:
                _check_count(name, v)
        for name, gbps in (("prefetch_gbps", prefetch_gbps), ("backup_gbps", backup_gbps)):
            for x in gbps:
                _check_seconds(name, x)
        observed: tuple[tuple[Histogram, Sequence[float]], ...] = (
            (self._prefetch_pgs, prefetch_pages), (self._backup_pgs, backup_pages),
            (self._prefetch_bw, prefetch_gbps), (self._backup_bw, backup_gbps))
        with self._lock:
            for h, vals in observed:
                for value in vals:
                    h.observe(value)

    def _batch(self, pages_h: Histogram, bw_h: Histogram, pages: int, gbps: float | None) -> None:
        with self._lock:
            pages_h.observe(pages)
            if gbps is not None:
                bw_h.observe(gbps)


class StorageTierMetrics:
    """What a cache's storage tier (fast/tiers/storage.py) reports, as its ``metrics``, at its
    completion points: the tokens a finished prefetch put into the tree
    (``check_prefetch_progress``; upstream's ``loaded_from_storage``), the tokens each backup
    wrote once its ack is drained (``check_hicache_events``), and each backend call of a
    prefetch read (``batch_get_v1``) or a backup (``batch_set_v1``): its pages and, when the
    backend knows its page size in bytes (``page_layout.page_bytes``, uniradix's backends), its
    bandwidth in GB/s.  Upstream collects the per-batch figures in its Mooncake and 3FS backends
    only; here every backend call is measured the same way (no backend, the conformance store
    in memory: no calls, so no batch figures)."""

    __slots__ = ("metrics", "page_bytes")

    def __init__(self, metrics: CacheMetrics, page_bytes: int | None) -> None:
        metrics._need_storage()
        self.metrics = metrics
        self.page_bytes = page_bytes

    def prefetched(self, tokens: int) -> None:
        if tokens > 0:
            self.metrics._prefetched.inc(tokens)

    def backuped(self, tokens: int) -> None:
        if tokens > 0:
            self.metrics._backuped.inc(tokens)

    def batch(self, backup: bool, pages: int, seconds: float) -> None:
        """One backend call of ``pages`` pages that took ``seconds``."""
        m = self.metrics
        m._batch(m._backup_pgs if backup else m._prefetch_pgs,
                 m._backup_bw if backup else m._prefetch_bw, pages,
                 pages * self.page_bytes / seconds / 1e9 if self.page_bytes and seconds > 0 else None)


def storage_labels(tier: Any) -> StorageLabels:
    """The storage labels of a storage tier: ``storage_backend`` is ``file`` for the file store,
    ``mooncake`` for Mooncake (upstream's ``--hicache-storage-backend`` names), ``memory`` for the
    in-memory store of conformance runs, else the backend's class name; ``tp_rank`` its rank in
    ``tp_group`` (0 without one)."""
    backend = tier.backend
    name = "memory" if backend is None else _BACKEND_NAMES.get(type(backend).__name__,
                                                                type(backend).__name__)
    group = tier.config.tp_group
    rank = 0
    if group is not None:
        import torch.distributed as dist
        rank = int(dist.get_rank(group=group))
    return StorageLabels(name, tp_rank=rank)


_BACKEND_NAMES = {"FileStore": "file", "MooncakeStore": "mooncake"}


def _page_bytes(backend: Any) -> int | None:
    """A backend's bytes per page (its registered host pool's page layout), or None."""
    if backend is None:
        return None
    try:
        n = backend.page_layout.page_bytes
    except Exception:  # noqa: BLE001 (no host pool registered, or not a uniradix backend)
        return None
    return n if type(n) is int and n > 0 else None


class MetricsServer:
    """An HTTP endpoint serving one registry in Prometheus text format (``GET /metrics``)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        if type(port) is not int or not 0 <= port <= 65535:
            raise InvalidInput(f"port must be an integer in 0..65535, got {port!r}")
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise InvalidInput(f"metrics endpoint: cannot listen on {host}:{port}: {exc}") from None
        self.host = host
        self.port: int = self._server.server_port
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``host:port`` (loopback and an ephemeral port by default;
    the bound port is ``.port``). Close it when done."""
    return MetricsServer(registry, host, port)


# ------------------------------------------------------------------------------------------------
# A cache's own metrics (``enable_metrics=True``)
# ------------------------------------------------------------------------------------------------

_SIZE_METHODS = {"full": ("full_evictable_size", "full_protected_size"),
                 "swa": ("swa_evictable_size", "swa_protected_size"),
                 "mamba": ("mamba_evictable_size", "mamba_protected_size")}


def _size_reader(ref: weakref.ReferenceType, method: str) -> Callable[[], int]:
    def read() -> int:
        cache = ref()
        return 0 if cache is None else int(getattr(cache, method)())
    return read


def wire_cache_metrics(cache: Any, params: Any) -> CacheMetrics:
    """Report ``cache``'s metrics (upstream's ``enable_metrics``) on ``params.metrics_registry``
    (a uniradix setting; default a new ``CollectorRegistry``), as ``cache.metrics``:

    * evictions: each ``evict`` call that freed something (on the composed tree, each eviction
      run, including the ones a load back makes room with, as upstream's ``evict`` calls do)
      observes its duration and adds its units per component;
    * load backs (host tier): each successful one observes its duration and its tokens;
    * the evictable / protected gauges per component, read from the cache when the registry is
      collected.

    The eviction and load-back wrappers are instance attributes over the class's methods, so a
    cache without metrics runs exactly the code it runs now.  Called again on the same cache
    (``init_hicache`` rebuilds it in place), the same ``CacheMetrics`` is wired again."""
    from . import compat  # (no import cycle at module load)
    for name in ("evict", "_evict_units"):
        cache.__dict__.pop(name, None)
    m = cache.__dict__.get("metrics")
    if m is None:
        registry = getattr(params, "metrics_registry", None)
        if registry is None:
            registry = CollectorRegistry()
        m = CacheMetrics(registry, components=compat.component_names(params.tree_components))
    cache.metrics = m
    ref = weakref.ref(cache)
    for comp in m.components:
        ev, pr = _SIZE_METHODS[comp]
        m.track_sizes(comp, _size_reader(ref, ev), _size_reader(ref, pr))
    cls = type(cache)
    clock = time.perf_counter
    names = ["full"] + [c.name for c in getattr(cache, "components", ())]
    if hasattr(cls, "_evict_units"):  # the composed tree: every eviction run
        evict_units = cls._evict_units

        def _evict_units(want: int, wants: dict | None = None) -> list:
            t0 = clock()
            tracker = evict_units(cache, want, wants)
            total = sum(tracker)
            if total:
                m._record_evict(zip(names, tracker, strict=False), total, clock() - t0)
            return tracker
        cache._evict_units = _evict_units
    else:  # the C core's cache: what evict freed
        evict = cls.evict

        def _evict(params: Any) -> Any:
            t0 = clock()
            result = evict(cache, params)
            n = result.num_tokens_evicted
            if n:
                m._record_evict((("full", n),), n, clock() - t0)
            return result
        cache.evict = _evict
    storage = getattr(cache, "storage_tier", None)
    if storage is not None:  # the storage tier's completion points (fast/tiers/storage.py)
        if m.storage is None:
            m.add_storage(storage_labels(storage))
        storage.metrics = StorageTierMetrics(m, _page_bytes(storage.backend))
    tier = getattr(cache, "tier", None)
    if tier is not None:
        tier.__dict__.pop("load_back", None)
        load_back = type(tier).load_back

        def _load_back(node: Any, mem_quota: int | None = None) -> bool:
            tokens, cur = 0, node
            while cur.evicted:
                tokens += len(cur.host_value)
                cur = cur.parent
            t0 = clock()
            ok = load_back(tier, node, mem_quota)
            if ok:
                m.on_load_back(tokens, clock() - t0)
            return ok
        tier.load_back = _load_back
    return m
