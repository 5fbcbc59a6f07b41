"""Speed of ``uniradix.fast`` in two source trees side by side, in one process (A/B).

Each tree's ``fast/`` package (with its compiled C core, ``fast/_core*.so``: build it in that
tree with ``python setup.py build_ext --inplace``) is copied to a temporary folder and imported
under its own module name (``_ab_base_fast``, ``_ab_head_fast``), so two versions, or the same
tree twice (the noise floor), run in one interpreter over the same torch.  For each
configuration both caches are built the same way from the same parameters and driven through
the same workload by the bench's scheduler loop (conformance/bench/loop.py ``run_bench`` with the
steps of conformance/bench/host.py and hybrid.py; only the cache calls are timed), in
alternating rounds ``base, head, head, base, base, head, ...`` on one torch thread.  The timer
is this thread's CPU time less the clock's own cost per timed call (``--clock cpu``, the
default: other jobs on a shared machine barely move it) or the bench's wall clock
(``--clock wall``).  What was loaded before the rounds is frozen out of the garbage
collector's walks (``gc.freeze``), so its collections walk the runs' own objects.  Reported
per configuration and workload: each side's timed seconds per round, their medians, the ratio
``head/base`` of the medians (below 1: head is faster), the median of the adjacent pairs'
ratios and each side's median time per op; and whether both sides gave identical outcomes
(hit tokens per request, evicted tokens, aborts and the bench's per-request digest).
Differing outcomes make the exit status 1.

Where the two trees' APIs differ the script adapts (never the trees): parameters a tree's
``CacheInitParams`` or ``HiCacheConfig`` lacks are not passed, and a cache a tree refuses to
build is reported as refused with its own error (e.g. a host tier with SWA or Mamba before
issue 12).

Run (the harness is the ``uniradix`` on the path; the head defaults to this checkout)::

    python scripts/ab-speed.py --base PATH_TO_OLD_CHECKOUT [--head PATH] [--rounds 8]
        [--configs full:1,full:16,swa:1,mamba:1,write_through:1,write_back:1]
        [--workloads shared-prefix,mooncake] [--requests 1000] [--mooncake-requests 200]
        [--clock cpu|wall] [--json out.json]
    python scripts/ab-speed.py --base PATH_TO_OLD_CHECKOUT --opcodes [--requests 300] ...

``--opcodes`` replaces the timed rounds with a count that does not depend on the machine's
load: one run per side (after the warm-up runs, untraced) under ``sys.settrace`` with opcode
events, the loop's clock replaced by the running count of Python opcodes executed, so each
timed cache call's "time" is the opcodes run inside it (its callees' included; code in C, such
as the Full C core, counts nothing).  The table gives, per op, each side's opcodes per call
and ``head/base``; outcomes are compared as in the timed mode.  Each count includes the
loop's few opcodes between reading the clock and making the call (the same for both sides).

docs/PERFORMANCE.md ("Side by side with the commit before the composable cache") has the
figures it gave.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from uniradix.conformance.adapters import spec_api
from uniradix.conformance.bench import configs as C
from uniradix.conformance.bench import loop as B
from uniradix.conformance.bench.host import HostFreeList, HostStep
from uniradix.conformance.bench.hybrid import MambaReqPool, MambaStep, SwaFreeListAllocator, SwaStep

HERE = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = "full:1,full:16,swa:1,mamba:1,write_through:1,write_back:1," \
                  "write_through+swa:1,write_back+swa:1,write_through+mamba:1,write_back+mamba:1"
SIDES = ("base", "head")
CLOCKS = ("cpu", "wall")


class Refused(Exception):
    """A tree cannot build the cache for a configuration (the message says why)."""


# --------------------------------------------------------------------------------------------
# Loading a tree's fast/ under its own name
# --------------------------------------------------------------------------------------------


def load_fast(tree: Path, alias: str, require_core: bool = True) -> types.ModuleType:
    """``tree``'s ``fast/`` package imported as ``alias`` from a private copy (a second dlopen
    of one C core file would share its static state, so the same tree twice needs two files)."""
    src = tree / "fast"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"ab-speed: {tree} has no fast/__init__.py")
    if require_core and not list(src.glob("_core*.so")):
        raise SystemExit(f"ab-speed: {tree} has no compiled C core (fast/_core*.so); build it "
                         f"there with `python setup.py build_ext --inplace`")
    tmp = Path(tempfile.mkdtemp(prefix="ab-speed-"))
    atexit.register(shutil.rmtree, tmp, True)
    dst = tmp / alias
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    spec = importlib.util.spec_from_file_location(alias, dst / "__init__.py",
                                                  submodule_search_locations=[str(dst)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    native = bool(getattr(sys.modules.get(f"{alias}.cache"), "NATIVE", False))
    if require_core and not native:
        raise SystemExit(f"ab-speed: {tree}'s C core did not load (fast.cache.NATIVE is False)")
    return mod


# --------------------------------------------------------------------------------------------
# Building one side's cache for a configuration
# --------------------------------------------------------------------------------------------


def _fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build_cache(mod: types.ModuleType, config: C.BenchConfig, kv_slots: int,
                page_size: int) -> tuple:
    """(cache, KV allocator, request pool) of ``mod`` for ``config``, as the bench's
    conformance/bench/configs.py ``fast_build`` builds fast; :class:`Refused` when ``mod``
    cannot."""
    alloc, req_pool = C.allocators(config.components, kv_slots, page_size, torch,
                                   SwaFreeListAllocator, MambaReqPool)
    kw: dict[str, Any] = {}
    if config.aux:
        kw.update(tree_components=config.components, mamba_cache_chunk_size=C.MAMBA_CHUNK,
                  sliding_window_size=C.SWA_WINDOW if "swa" in config.components else None)
    if config.hicache:
        host: dict[str, Any] = dict(
            host_allocator=HostFreeList(2 * kv_slots, page_size, torch),
            write_policy=config.hicache, write_through_threshold=1, load_back_threshold=0,
            io="sync")
        known = _fields(mod.HiCacheConfig)
        # the aux host pools as the bench gives them (free lists), where the tree takes them
        if "swa" in config.components and "host_swa_allocator" in known:
            host["host_swa_allocator"] = HostFreeList(2 * kv_slots, page_size, torch)
        if "mamba" in config.components and "host_mamba_allocator" in known:
            host["host_mamba_allocator"] = HostFreeList(C.MAMBA_HOST_SLOTS, 1, torch)
        kw["hicache"] = mod.HiCacheConfig(**host)
    lacking = sorted(set(kw) - _fields(mod.CacheInitParams))
    if lacking:
        raise Refused(f"its CacheInitParams has no {', '.join(lacking)}")
    params = mod.CacheInitParams(disable=False, req_to_token_pool=req_pool,
                                 token_to_kv_pool_allocator=alloc, page_size=page_size, **kw)
    try:
        cache = mod.UnifiedRadixCache(params)
    except Exception as e:  # the tree's own refusal (Unsupported, InvalidInput, ...)
        raise Refused(f"{type(e).__name__}: {e}") from e
    return cache, alloc, req_pool


def tree_kind(cache: Any, mod: types.ModuleType) -> str:
    """Which tree runs: the class, and ``c core`` when it is the C-core class with the core on."""
    cls = type(cache).__name__
    core = getattr(cache, "core", None)
    if core is None:  # (older trees: only cache.py's class has the C core)
        native = getattr(sys.modules.get(f"{mod.__name__}.cache"), "NATIVE", False)
        core = "c" if native and type(cache) is mod.UnifiedRadixCache else "python"
    return f"{cls} ({'c core' if core == 'c' else 'python'})"


class HitLog(B.Step):
    """Keeps each request's matched tokens at admission (loaded ones included), in order."""

    name = "hits"

    def __init__(self, sink: list[int]) -> None:
        self.sink = sink

    def admitted_fields(self, req: B.Request) -> tuple[int, ...]:
        self.sink.append(int(req.matched))
        return ()


def bundle_for(mod: types.ModuleType, config: C.BenchConfig, label: str,
               hits: list[int]) -> B.ApiBundle:
    steps: list[Any] = []
    if config.hicache:
        steps.append(functools.partial(HostStep, mod.InitLoadBackParams))
    if "swa" in config.components:
        steps.append(SwaStep)
    if "mamba" in config.components:
        steps.append(MambaStep)
    steps.append(functools.partial(HitLog, hits))

    def build(pool: Any) -> tuple:
        return build_cache(mod, config, pool.num_pages * pool.page_size, pool.page_size)

    return B.ApiBundle(label, "dev", mod.RadixKey, mod.MatchPrefixParams, mod.InsertParams,
                       mod.EvictParams, spec_api.TorchValues(torch), build, tuple(steps),
                       config.name)


# --------------------------------------------------------------------------------------------
# The clock
# --------------------------------------------------------------------------------------------


def clock_cost(clock: Any, n: int = 20000) -> float:
    """The median of two back-to-back readings' difference: what one timed interval adds."""
    ds = []
    for _ in range(n):
        a = clock()
        ds.append(clock() - a)
    return statistics.median(ds)


@contextlib.contextmanager
def bench_clock(kind: str) -> Any:
    """The loop's timer (it reads ``time.perf_counter`` of conformance/bench/loop.py's ``time``):
    ``wall`` leaves it; ``cpu`` makes it this thread's CPU time (``time.thread_time``), which a
    machine shared with other jobs disturbs far less than wall time (time spent descheduled is
    not counted)."""
    if kind == "wall":
        yield
        return
    saved = B.time
    B.time = types.SimpleNamespace(perf_counter=time.thread_time)  # type: ignore[assignment]
    try:
        yield
    finally:
        B.time = saved


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RowCommon:
    """What every table row holds: the configuration and workload, each side's cache kind or
    refusal, and whether the sides' outcomes matched."""

    config: str
    page_size: int
    workload: str
    requests: int
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    identical: bool | None = None
    differences: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Row(RowCommon):
    seconds: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {s: [] for s in SIDES})
    # per side, per op: the op's summed seconds in each timed run
    op_seconds: dict[str, dict[str, list[float]]] = dataclasses.field(
        default_factory=lambda: {s: {} for s in SIDES})
    order: list[str] = dataclasses.field(default_factory=list)
    hit_rate: float | None = None

    def median(self, side: str) -> float | None:
        ts = self.seconds[side]
        return statistics.median(ts) if ts else None

    @property
    def ratio(self) -> float | None:
        """median(head) / median(base)."""
        b, h = self.median("base"), self.median("head")
        return h / b if b and h is not None else None

    @property
    def pair_ratio(self) -> float | None:
        """The median of head/base over the adjacent pairs of rounds."""
        pairs = [h / b for b, h in zip(self.seconds["base"], self.seconds["head"], strict=True) if b]
        return statistics.median(pairs) if pairs else None

    def op_medians(self, side: str) -> dict[str, float]:
        return {op: statistics.median(ts) for op, ts in self.op_seconds[side].items() if ts}

    def summary(self) -> dict:
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        return {"config": self.config, "page_size": self.page_size, "workload": self.workload,
                "requests": self.requests, "kinds": self.kinds, "refused": self.refused,
                "identical_outcomes": self.identical, "differences": self.differences,
                "hit_rate": r(self.hit_rate),
                "seconds": {s: [round(t, 5) for t in ts] for s, ts in self.seconds.items()},
                "order": self.order, "median_s": {s: r(self.median(s)) for s in SIDES},
                "op_median_s": {s: {op: round(v, 6) for op, v in self.op_medians(s).items()}
                                for s in SIDES},
                "ratio_head_over_base": r(self.ratio), "pair_ratio_median": r(self.pair_ratio)}


def _outcome(stats: B.BenchStats, hits: list[int]) -> dict:
    return dict(stats.outcome(), hits=list(hits))


def _probe(mods: dict[str, types.ModuleType], config: C.BenchConfig, page_size: int,
           row: Any) -> tuple[dict[str, list[int]], dict[str, B.ApiBundle]]:
    """Each side's bundle for ``config`` and the list its hit log fills; a probe build per side
    names its tree in ``row.kinds``, or says in ``row.refused`` why it cannot build it."""
    hits: dict[str, list[int]] = {s: [] for s in SIDES}
    bundles = {s: bundle_for(mods[s], config, s, hits[s]) for s in SIDES}
    for s in SIDES:
        try:
            cache = bundles[s].build(types.SimpleNamespace(num_pages=64, page_size=page_size))[0]
            row.kinds[s] = tree_kind(cache, mods[s])
        except Refused as e:
            row.refused[s] = str(e)
    return hits, bundles


def measure(mods: dict[str, types.ModuleType], config: C.BenchConfig, page_size: int,
            workload: B.BenchWorkload, rounds: int, warmup: int,
            log: Any = None, clock: str = "wall", per_call: float = 0.0) -> Row:
    """``rounds`` timed runs per side (after ``warmup`` untimed ones), alternating, timed with
    ``clock`` (:data:`CLOCKS`) less ``per_call`` seconds per timed call (the clock's own)."""
    row = Row(config.name, page_size, workload.name, workload.requests)
    hits, bundles = _probe(mods, config, page_size, row)
    if row.refused:
        return row
    reference: dict | None = None
    order = [s for i in range(warmup + rounds) for s in (SIDES if i % 2 == 0 else SIDES[::-1])]
    for n, side in enumerate(order):
        hits[side].clear()
        with bench_clock(clock):
            stats = B.run_bench(bundles[side], workload)
        ops = {op: sum(ts) - per_call * len(ts) for op, ts in stats.op_times.items() if ts}
        stats.seconds = sum(ops.values())
        got = _outcome(stats, hits[side])
        if reference is None:
            reference = got
            row.hit_rate = stats.hit_rate
        elif got != reference:
            row.differences.append(_difference(reference, got, side, n))
        if n >= 2 * warmup:
            row.seconds[side].append(stats.seconds)
            for op, t in ops.items():
                row.op_seconds[side].setdefault(op, []).append(t)
            row.order.append(side)
        if log is not None:
            log(f"    {side:<5}{stats.seconds * 1e3:10.1f} ms" + ("  (warm-up)"
                                                                 if n < 2 * warmup else ""))
    row.identical = not row.differences
    return row


# --------------------------------------------------------------------------------------------
# Opcode counts (--opcodes)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OpcodeRow(RowCommon):
    """One configuration and workload counted once per side: per op, calls and opcodes."""

    calls: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {s: {} for s in SIDES})
    opcodes: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {s: {} for s in SIDES})

    def total(self, side: str) -> int:
        return sum(self.opcodes[side].values())

    @property
    def ratio(self) -> float | None:
        """head's opcodes over base's, all ops together."""
        b = self.total("base")
        return self.total("head") / b if b else None

    def summary(self) -> dict:
        return {"config": self.config, "page_size": self.page_size, "workload": self.workload,
                "requests": self.requests, "kinds": self.kinds, "refused": self.refused,
                "identical_outcomes": self.identical, "differences": self.differences,
                "calls": self.calls, "opcodes": self.opcodes,
                "total": {s: self.total(s) for s in SIDES},
                "ratio_head_over_base": None if self.ratio is None else round(self.ratio, 4)}


@contextlib.contextmanager
def opcode_clock() -> Any:
    """The loop's timer made the count of Python opcodes this thread has executed since entry
    (``sys.settrace`` with ``f_trace_opcodes`` on every frame; line events off).  The reader is
    C code (a bound ``list.__getitem__`` behind ``functools.partial``), so reading it adds no
    opcodes of its own."""
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        return local

    saved = B.time
    B.time = types.SimpleNamespace(  # type: ignore[assignment]
        perf_counter=functools.partial(count.__getitem__, 0))
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
        B.time = saved


def count_opcodes(mods: dict[str, types.ModuleType], config: C.BenchConfig, page_size: int,
                  workload: B.BenchWorkload, warmup: int = 1) -> OpcodeRow:
    """Each side's opcodes per op over one run of ``workload`` (``warmup`` untraced runs per
    side first, so first-call work such as lazy imports is not counted)."""
    row = OpcodeRow(config.name, page_size, workload.name, workload.requests)
    hits, bundles = _probe(mods, config, page_size, row)
    if row.refused:
        return row
    reference: dict | None = None
    for n, side in enumerate([s for _ in range(warmup) for s in SIDES] + list(SIDES)):
        hits[side].clear()
        if n < warmup * len(SIDES):
            stats = B.run_bench(bundles[side], workload)
        else:
            with opcode_clock():
                stats = B.run_bench(bundles[side], workload)
            for op, counts in stats.op_times.items():
                if counts:
                    row.calls[side][op] = len(counts)
                    row.opcodes[side][op] = int(sum(counts))
        got = _outcome(stats, hits[side])
        if reference is None:
            reference = got
        elif got != reference:
            row.differences.append(_difference(reference, got, side, n))
    row.identical = not row.differences
    return row


def format_opcode_row(row: OpcodeRow) -> list[str]:
    head = _row_head(row)
    if row.refused:
        return [head]
    lines = [head + f"{row.total('base'):>12,}{row.total('head'):>12,}{_ratio_text(row.ratio):>8}  "
             + ("yes" if row.identical else "NO")]
    base, head_ = row.opcodes["base"], row.opcodes["head"]
    for op in [*base, *(o for o in head_ if o not in base)]:
        per = {s: (row.opcodes[s][op] / row.calls[s][op] if row.calls[s].get(op) else None)
               for s in SIDES}
        r = (per["head"] / per["base"]) if per["base"] and per["head"] is not None else None
        lines.append(f"    {op:<12}" + "".join(
            f"{s} {row.calls[s].get(op, 0):>6} calls {'-' if per[s] is None else f'{per[s]:9.1f}'}"
            f"/call   " for s in SIDES) + f"h/b {_ratio_text(r)}")
    lines += [f"    DIFFERENT OUTCOMES: {d}" for d in row.differences]
    return lines


def _difference(ref: dict, got: dict, side: str, n: int) -> str:
    keys = [k for k in ref if k != "hits" and ref[k] != got[k]]
    a, b = ref["hits"], got["hits"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 None if len(a) == len(b) else min(len(a), len(b)))
    where = "" if first is None else (f"; request {first}: hit tokens "
                                      f"{a[first] if first < len(a) else '-'} (first run) vs "
                                      f"{b[first] if first < len(b) else '-'}")
    return f"run {n} ({side}): {', '.join(keys) or 'hits'} differ{where}"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def materialized(workload: B.BenchWorkload) -> B.BenchWorkload:
    """``workload`` with its stream generated once (every run replays the same arrays, which
    the loop only reads), so the rounds spend their wall time on the cache."""
    items = list(workload.stream())
    return dataclasses.replace(workload, stream=lambda: iter(items))


def parse_configs(value: str) -> list[tuple[C.BenchConfig, int]]:
    """``full:1,write_back+swa:16`` -> [(BenchConfig, page size), ...]."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        name, _, page = item.partition(":")
        try:
            out.append((C.BenchConfig.parse(name), int(page or 1)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{item!r}: {e}") from e
    return out


def _ratio_text(v: float | None) -> str:
    """A ratio as the tables print it ("-" where there is none)."""
    return "-" if v is None else f"{v:.3f}"


def _row_head(row: RowCommon) -> str:
    """A row's first columns; for a refused configuration, the whole line (who refused, why)."""
    head = f"{row.config:<20}{row.workload:<14}{row.page_size:>4}"
    if row.refused:
        head += "  refused: " + "; ".join(f"{s}: {w}" for s, w in row.refused.items())
    return head


def format_row(row: Row) -> list[str]:
    head = _row_head(row)
    if row.refused:
        return [head]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    lines = [head + f"{ms(row.median('base')):>10}{ms(row.median('head')):>10}"
             f"{_ratio_text(row.ratio):>9}{_ratio_text(row.pair_ratio):>9}  "
             + ("yes" if row.identical else "NO")]
    for s in SIDES:
        lines.append(f"    {s} ({row.kinds.get(s, '?')}) ms: "
                     + " ".join(f"{t * 1e3:.1f}" for t in row.seconds[s]))
        lines.append("      median ms per op: " + ", ".join(
            f"{op} {t * 1e3:.1f}" for op, t in row.op_medians(s).items()))
    lines += [f"    DIFFERENT OUTCOMES: {d}" for d in row.differences]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the older checkout (its root)")
    p.add_argument("--head", type=Path, default=HERE,
                   help="the newer checkout (default: this one)")
    p.add_argument("--configs", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS),
                   help=f"CONFIG:PAGE,... (bench configuration names; default {DEFAULT_CONFIGS})")
    p.add_argument("--workloads", default="shared-prefix,mooncake",
                   help="comma-separated: shared-prefix, mooncake")
    p.add_argument("--requests", type=int, default=1000, help="shared-prefix requests")
    p.add_argument("--mooncake-requests", type=int, default=200,
                   help="the first N requests of the Mooncake trace")
    p.add_argument("--rounds", type=int, default=8, help="timed runs per side (alternating)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per side first")
    p.add_argument("--clock", choices=CLOCKS, default="cpu",
                   help="cpu: this thread's CPU time less the clock's own cost per call "
                        "(default; robust on a shared machine); wall: the bench's perf_counter")
    p.add_argument("--allow-pure-python", action="store_true",
                   help="run a tree without its compiled C core")
    p.add_argument("--opcodes", action="store_true",
                   help="count the Python opcodes run inside the cache calls (one traced run "
                        "per side after --warmup untraced ones; --rounds and --clock unused) "
                        "instead of timing rounds: deterministic, so a loaded machine does not "
                        "move it")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    p.add_argument("--quiet", action="store_true", help="no per-run lines")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in B.WORKLOADS:
            p.error(f"unknown workload {w!r}; known: {', '.join(B.WORKLOADS)}")
    if args.rounds < 1 or args.warmup < 0 or args.requests < 1 or args.mooncake_requests < 1:
        p.error("--rounds, --requests and --mooncake-requests must be >= 1, --warmup >= 0")
    torch.set_num_threads(1)
    mods = {s: load_fast(getattr(args, s).resolve(), f"_ab_{s}_fast",
                         require_core=not args.allow_pure_python) for s in SIDES}
    # what is loaded now (torch, both trees, the harness) leaves the collector's walks: the
    # collections inside the timed calls and before each run then walk the runs' own objects
    gc.collect()
    gc.freeze()
    try:
        return _run_opcodes(args, mods) if args.opcodes else _run(args, mods)
    finally:
        gc.unfreeze()


def _cases(args: argparse.Namespace, log: Any) -> Any:
    """(configuration, page size, workload) for each of ``args``'s configurations and
    workloads, in order, each named on ``log`` first."""
    for config, ps in args.configs:
        for w in args.workloads:
            n = args.requests if w == "shared-prefix" else args.mooncake_requests
            workload = materialized(B.make_workload(w, ps, n))
            if log:
                log(f"{config.name} {w} page {ps} ({workload.requests} requests)")
            yield config, ps, workload


def _run(args: argparse.Namespace, mods: dict[str, types.ModuleType]) -> int:
    log = None if args.quiet else functools.partial(print, flush=True)
    rows: list[Row] = []
    per_call = clock_cost(time.thread_time) if args.clock == "cpu" else 0.0
    print(f"base {args.base}  head {args.head}  rounds {args.rounds} per side "
          f"(+{args.warmup} warm-up), one torch thread; times: the timed cache calls, "
          f"{args.clock} clock" + (f" less {per_call * 1e9:.0f} ns per call (the clock's own)"
                                   if per_call else ""), flush=True)
    for config, ps, workload in _cases(args, log):
        t0 = time.perf_counter()
        rows.append(measure(mods, config, ps, workload, args.rounds, args.warmup, log,
                            args.clock, per_call))
        if log:
            log(f"    ({time.perf_counter() - t0:.1f} s)")
    return _report(args, f"{'base ms':>10}{'head ms':>10}{'h/b':>9}{'pairs':>9}", rows,
                   format_row, {"rounds": args.rounds, "warmup": args.warmup,
                                "clock": args.clock, "clock_cost_s": per_call})


def _report(args: argparse.Namespace, columns: str, rows: Sequence[Row] | Sequence[OpcodeRow],
            fmt: Callable[[Any], list[str]], settings: dict) -> int:
    """The table of ``rows`` (``columns`` after the common ones), the JSON file when asked for
    (the sides, ``settings``, the rows' summaries); 1 when a row's sides' outcomes differ."""
    print(f"\n{'config':<20}{'workload':<14}{'page':>4}{columns}  identical")
    for row in rows:
        print("\n".join(fmt(row)))
    if args.json:
        args.json.write_text(json.dumps({"base": str(args.base), "head": str(args.head),
                                         **settings, "rows": [r.summary() for r in rows]},
                                        indent=1) + "\n")
    return 1 if any(r.identical is False for r in rows) else 0


def _run_opcodes(args: argparse.Namespace, mods: dict[str, types.ModuleType]) -> int:
    log = None if args.quiet else functools.partial(print, flush=True)
    rows: list[OpcodeRow] = []
    print(f"base {args.base}  head {args.head}  Python opcodes inside the cache calls, one "
          f"traced run per side (+{args.warmup} untraced warm-up)", flush=True)
    for config, ps, workload in _cases(args, log):
        rows.append(count_opcodes(mods, config, ps, workload, args.warmup))
    return _report(args, f"{'base ops':>12}{'head ops':>12}{'h/b':>8}", rows, format_opcode_row,
                   {"mode": "opcodes", "warmup": args.warmup})


if __name__ == "__main__":
    raise SystemExit(main())
