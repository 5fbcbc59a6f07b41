"""``uniradix bench --alloc-time`` in every configuration: the time the timed cache calls spend
inside the pools' frees, per implementation, and what that leaves (conformance/bench/loop.py
``count_frees``, ``AllocTimer``).

One mechanism, :func:`wrap`, which loop.py's ``count_frees`` is: an instance attribute wrapping a
pool's bound free method, so the class is untouched and fast/frees.py still recognises the pool,
carrying ``uniradix_on_batch`` (an observing wrapper: fast's batched frees stay on, the batch
counted as one call).  The bench wraps, before each cache is built (a cache or a controller may
keep the bound method), every pool a configuration frees into (:func:`watch_pools`):

* ``kv``: the KV allocator's ``free``, and for SWA its ``free_swa`` and both sub-allocators'
  ``free`` (the SWA allocator's own frees call them: nested calls are counted once, by the
  outermost, :class:`FreeTiming` ``depth``);
* ``mamba``: the Mamba state allocator's ``free``;
* ``host``: each host pool's ``free`` (the KV host pool, the SWA and Mamba host pools).

Besides the calls, fast writes some frees straight into the list of an exact sglang allocator:
the C core's native frees (fast/_core.c ``free_timer``, summed by ``AllocTimer`` as ``native``)
and fast/frees.py's ``append_release`` and ``paged_release`` (the Python path: the composed tree's
batches).  While a timer runs, those two functions are observed the same way (:func:`_observe`:
their time goes to the pool they write, under the same depth; the C core's time inside them is
left to them, so it is counted once).  Frees the harness makes itself (the tail page, the Mamba
step's state frees: the scheduler's, not the cache's) go through :func:`quiet` and are not timed.

:func:`alloc_table` is the ``--matrix`` summary: per row fast/upstream, each side's pool share,
its requests/s without the pool time, and the cap.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

POOLS = ("kv", "mamba", "host", "native")  # the pools time is reported for (native: the C core)
BATCH_WRITERS = ("append_release", "paged_release")  # fast/frees.py's direct list writes


class FreeTiming:
    """The one running total every wrapped free adds to while a run's timer is on (``clock``
    set); runs are sequential, so one is enough.  ``depth`` > 0 while a timed free (or a
    harness free, :func:`quiet`) is running: a free inside it is not timed again."""

    def __init__(self) -> None:
        self.clock: Callable[[], float] | None = None
        self.depth = 0
        self.seconds = 0.0
        self.by_pool: dict[str, float] = {}
        self.calls: dict[str, int] = {}  # outermost timed calls per pool
        self.flush: Callable[[bool], None] | None = None  # AllocTimer: the C core's timer
        self._restore: list[tuple[Any, str, Any]] = []

    def start(self, clock: Callable[[], float], flush: Callable[[bool], None] | None) -> None:
        """Zero the totals and time from now on with ``clock``; observe fast/frees.py's list
        writes where fast is loaded."""
        self.stop()
        self.clock, self.flush = clock, flush
        self.depth, self.seconds, self.by_pool, self.calls = 0, 0.0, {}, {}
        frees = sys.modules.get("uniradix.fast.frees")
        for name in BATCH_WRITERS if frees is not None else ():
            fn = getattr(frees, name, None)
            if callable(fn):
                self._restore.append((frees, name, fn))
                setattr(frees, name, _observe(self, fn))

    def stop(self) -> None:
        """Time nothing more; put fast/frees.py's functions back."""
        self.clock = self.flush = None
        self.depth = 0
        for module, name, fn in reversed(self._restore):
            setattr(module, name, fn)
        self._restore = []

    def timed(self, pool: str, box: list | None, fn: Callable[..., Any], args: tuple,
              kwargs: dict, wrote: Callable[[Any], bool] | None = None) -> Any:
        """``fn(*args, **kwargs)``, its time added to ``pool``'s (and ``box[1]``); with
        ``wrote``, only where ``wrote(result)`` (a list write that did not happen is not a
        free: the caller frees otherwise, and that is timed then)."""
        clock = self.clock
        assert clock is not None
        self.depth = 1
        t0 = clock()
        out: Any = False
        try:
            out = fn(*args, **kwargs)
            return out
        finally:
            dt = clock() - t0
            self.depth = 0
            if wrote is None or wrote(out):
                self.seconds += dt
                self.by_pool[pool] = self.by_pool.get(pool, 0.0) + dt
                self.calls[pool] = self.calls.get(pool, 0) + 1
                if box is not None:
                    box[1] += dt


TIMING = FreeTiming()


def wrap(alloc: Any, method: str = "free", pool: str = "kv") -> None:
    """Count the calls to ``alloc.<method>`` in ``alloc._bench_<method>_calls`` (a one-item
    list; a batch fast/frees.py writes in one step counts as one call) and, while
    :data:`TIMING` runs, time the outermost ones under ``pool`` (their seconds also in
    ``alloc._bench_<method>_timing[1]``); the unwrapped method stays in
    ``alloc._bench_raw_<method>`` for the harness's own frees.  A method already wrapped is
    left as it is."""
    if f"_bench_raw_{method}" in vars(alloc):
        return
    raw = getattr(alloc, method)
    box = [0]
    timing: list = [pool, 0.0]  # [the pool it counts for, seconds inside raw]
    watch = TIMING

    def free(*args: Any, **kwargs: Any) -> Any:
        box[0] += 1
        if watch.clock is None or watch.depth:  # off, or inside a timed free: counted there
            return raw(*args, **kwargs)
        return watch.timed(pool, timing, raw, args, kwargs)

    def on_batch(pieces: int) -> None:  # fast wrote a batch of frees as one call
        box[0] += 1
        # a write straight into the list (the C core's native frees: their time is the
        # ``native`` pool's) is one call of this pool; one inside a timed call (an observed
        # append_release / paged_release) was counted there
        if watch.clock is not None and not watch.depth:
            watch.calls[pool] = watch.calls.get(pool, 0) + 1

    free.uniradix_on_batch = on_batch  # type: ignore[attr-defined]
    setattr(alloc, method, free)
    setattr(alloc, f"_bench_{method}_calls", box)
    setattr(alloc, f"_bench_raw_{method}", raw)
    setattr(alloc, f"_bench_{method}_timing", timing)
    if method == "free":
        alloc._bench_pool = pool  # what fast/frees.py's list writes into it count for


def watch_pools(kv: Any, mamba: Any = None, hosts: Iterable[Any] = ()) -> None:
    """:func:`wrap` every free of a configuration's pools (module docstring): the KV allocator
    (with SWA its ``free_swa`` and sub-allocators too), the Mamba state allocator, the host
    pools.  Call it before the cache is built."""
    wrap(kv, "free", "kv")
    if callable(getattr(type(kv), "free_swa", None)):
        wrap(kv, "free_swa", "kv")
    for side in ("full_attn_allocator", "swa_attn_allocator"):
        sub = getattr(kv, side, None)
        if sub is not None:
            wrap(sub, "free", "kv")
    if mamba is not None:
        wrap(mamba, "free", "mamba")
    for host in hosts:
        if host is not None:
            wrap(host, "free", "host")


def _observe(watch: FreeTiming, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fast/frees.py's ``fn(alloc, pieces, ...)`` (a direct write into ``alloc``'s list), timed
    under the pool ``alloc`` is wrapped for; the C core's timer is read before (its time so far
    counts) and after (its time inside this call is this call's: dropped).  A call that
    returns False wrote nothing (fast then calls the pool's ``free``, timed there): not counted."""
    def observed(alloc: Any, *args: Any, **kwargs: Any) -> Any:
        pool = getattr(alloc, "__dict__", {}).get("_bench_pool")
        if watch.clock is None or watch.depth or pool is None:
            return fn(alloc, *args, **kwargs)
        flush = watch.flush
        if flush is not None:
            flush(False)
        try:
            return watch.timed(pool, None, fn, (alloc, *args), kwargs, wrote=bool)
        finally:
            if flush is not None:
                flush(True)
    observed.__wrapped__ = fn  # type: ignore[attr-defined]
    return observed


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The harness's own frees: nothing freed inside is timed."""
    TIMING.depth += 1
    try:
        yield
    finally:
        TIMING.depth -= 1


def harness_free(pool: Any, slots: Any) -> None:
    """Free ``slots`` into ``pool`` as the scheduler does, not as cache work: its unwrapped
    ``free``, nothing under it timed (an SWA allocator's sub-allocators are wrapped too)."""
    raw = getattr(pool, "_bench_raw_free", None) or pool.free
    with quiet():
        raw(slots)


# --------------------------------------------------------------------------------------------
# The --matrix summary
# --------------------------------------------------------------------------------------------


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def alloc_table(results: dict) -> list[str]:
    """Where the time goes, per comparison of a ``bench --alloc-time`` JSON: fast/upstream,
    each side's share of its timed seconds inside the pools' frees (``pool%``), its requests/s
    without that time (``ex-pool``) and the cap (upstream's timed seconds over fast's seconds
    inside the frees: the best fast/upstream if fast's own work cost nothing)."""
    lines = [f"{'config':<20}{'workload':<15}{'page':>5}{'fast/upstream':>15}"
             f"{'pool% fast':>12}{'pool% up':>10}{'ex-pool fast':>14}{'ex-pool up':>12}"
             f"{'cap':>9}"]
    for c in results.get("comparisons", []):
        if not c.get("alloc_time"):
            continue
        base, _, config = str(c["workload"]).partition("+")
        impls = c.get("impls") or {}
        f, u = impls.get("fast") or {}, impls.get("upstream") or {}
        r = (c.get("ratios") or {}).get("fast/upstream")
        cap = c.get("cap")
        ex = [d.get("requests_per_s_ex_alloc_median") for d in (f, u)]
        lines.append(
            f"{config or 'full':<20}{base:<15}{c['page_size']:>5}"
            + (f"{r:>14.2f}x" if r is not None else f"{'-':>15}")
            + f"{_pct(f.get('alloc_share_median')):>12}{_pct(u.get('alloc_share_median')):>10}"
            + "".join(f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"
                      for v, w in zip(ex, (14, 12), strict=True))
            + (f"{cap:>8.2f}x" if cap is not None else f"{'-':>9}"))
    return lines


def median_or_none(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None
