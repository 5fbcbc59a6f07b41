"""``uniradix bench``: requests/s of cache work, measured the same way for every implementation.

One scheduler loop (:func:`run_bench`) drives any implementation through upstream SGLang's
*native* tree-level API. Only the names differ between implementations, and they come from an
:class:`ApiBundle`: ``RadixKey``, ``MatchPrefixParams``, ``InsertParams``, ``EvictParams`` and
how to build the cache over an allocator. Implementations by name:

* ``spec``: the executable spec behind :mod:`uniradix.conformance.adapters.spec_api`;
* ``fast``: ``uniradix.fast`` (imported lazily; :class:`ImplMissing` while it lacks the API);
* ``upstream``: sglang's own ``UnifiedRadixCache`` (Full component, device tier), only where
  sglang imports (:func:`uniradix.conformance.adapters.upstream.load_upstream`).

The scheduler, per request, in arrival order, with ``inflight`` (16) requests running, FIFO::

    m = match_prefix(MatchPrefixParams(key=RadixKey(prompt)))        # array('q') token ids
    r = inc_lock_ref(m.last_device_node)
    need = round_up(len(prompt) + n_output - len(m.device_indices), page_size)
    if free slots < need: evict(EvictParams(num_tokens=need - free))
    slots = allocator.alloc(need)            # abort (dec_lock_ref) when still too few
    ... when the request is the oldest of a full batch, or at the end, it finishes:
    insert(InsertParams(key=RadixKey(tokens[:aligned]), value=slots[:aligned],
                        prev_prefix_len=len(m.device_indices)))
    allocator.free(slots[aligned:])          # the unaligned tail page, if any
    dec_lock_ref(m.last_device_node, r.to_dec_params())

**Steps.**  Everything a feature adds to that loop is a :class:`Step` plugged into it, never a
copy of the loop: the host tier's load back after the match and its ack poll per request
(conformance/bench/host.py), SWA's eviction of both pools' shortfalls and Mamba's state slot per
request (conformance/bench/hybrid.py).  A bundle carries its steps (``ApiBundle.steps``); any
combination composes (Full+SWA+Mamba, a host tier with either), and
conformance/bench/configs.py builds each implementation for a configuration, refusing what its
declared capabilities lack.

``tokens`` is the prompt followed by the request's output tokens, ``aligned`` its length rounded
down to whole pages. The allocator of ``fast`` and ``upstream`` is :class:`FreeListAllocator`, a
production-style free list over a tensor (no per-slot Python work, as SGLang's own allocators);
the spec's wrapper needs the slot checks of the environment's
:class:`~uniradix.spec.world.PagedPool` and runs over it (``array('q')`` values instead of
tensors when torch is not installed). Slot numbers may differ between the two allocators; no
cache decision depends on them, and :func:`compare` checks that the outcomes agree.

**What is timed** (``time.perf_counter`` around each call, nothing else; ``--clock cpu``:
``time.thread_time``, less the clock's own cost): the five cache calls
``match_prefix``, ``inc_lock_ref``, ``evict``, ``insert`` and ``dec_lock_ref``, including the pool
frees they trigger (an insert frees duplicate slots; an evict frees the evicted nodes' slots).
Not timed: building keys, values and parameter objects, the harness's own ``alloc`` and tail
``free``, concatenating slot tensors, and the workload generator. ``requests/s`` is finished
requests divided by the summed time of those calls; per-op times are kept as lists and reported
as medians. For the spec the conversion between tensors/arrays and the lists it takes happens
inside the wrapper and is timed with it. Python's garbage collector stays on (it is part of
each implementation's cost); a full collection runs before each measured run, and by default
(``--gc freeze``, :func:`gc_during_run`) the objects that exist then are frozen for the run, as
SGLang's ``/freeze_gc`` does in a warmed-up server.

Where the allocator runs over the pool model (the spec), the pool's ``free`` (a per-slot Python
check in :class:`~uniradix.spec.world.PagedPool`) is the environment's work, yet inside the timed
evict and insert calls; it is timed on its own too and reported as ``pool%`` (its share of the
timed time) and ``ex-pool`` (requests/s without it), so
that the cache's own speed can be read apart from the world model's. Hit rate counts every
request that was matched, aborted ones included.

**What must agree**: hit rate (matched prompt tokens / prompt tokens), evicted tokens (the sum of
``num_tokens_evicted``), aborted requests and a digest of every request's (matched length,
tokens evicted for it, insert ``prefix_len``). Every conforming implementation gives identical
numbers on the same workload; :func:`compare` raises :class:`ConformanceMismatch` otherwise.

Workloads:

* ``shared-prefix``: the request stream of :func:`uniradix.conformance.env.workload.shared_prefix_requests`
  (20k requests, 300 system prompts with Zipf popularity, 100-2,000 tokens each plus an 8-64 token
  question, 1-32 output tokens, a 200k-token pool, 16 in flight). ``requests`` below 20k uses
  ``SharedPrefix.scaled`` (pool and prompt set shrunk to keep eviction about as frequent). Output
  token ids are a fixed function of (request index, position).
* ``mooncake``: the conversation trace of the Mooncake FAST'25 release (kvcache-ai/Mooncake,
  FAST25-release/traces, Apache-2.0), packaged as ``data/mooncake_conversation.jsonl.gz``
  (12,031 requests). Block id ``b`` (512 tokens) expands to token ids ``b * 512 + j + 1`` for
  position ``j``, cut to ``input_length``, so two requests share exactly the prefix their shared
  blocks describe; request ``r`` decodes ``output_length`` tokens with ids ``2**40 + r * 4096 + t``
  (never a prompt token). Pool: :data:`MOONCAKE_KV_SLOTS` = 4,194,304 tokens (8,192 blocks),
  under 5% of the trace's ~94M distinct prefix tokens, so the cache evicts from about the 350th
  request on, yet large enough for 16 requests in flight (the longest request is 126,527 tokens
  with its output) and for a useful hit rate: on the first 3,000 requests it gives 0.18, against
  0.05 for a 1M-token pool and about 0.31 (counted in blocks) for an unbounded one. ``requests``
  (``--limit``) takes the first N requests.

Memory (:func:`memory_per_token`) is a deep ``sys.getsizeof`` walk, described there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import gzip
import hashlib
import importlib.resources
import json
import os
import statistics
import struct
import sys
import time
import types
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from uniradix.conformance.adapters import spec_api
from uniradix.conformance.bench import alloc_time as pool_timing
from uniradix.conformance.bench import subcommand_main
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.conformance.env.workload import SharedPrefix, shared_prefix_requests
from uniradix.spec.world import PagedPool

IMPLS = ("spec", "fast", "upstream")  # the default set
# Conforming implementations outside the default set: upstream's UnifiedRadixCache on its Rust
# tree core (sglang 0.5.17+; build a venv with that release to measure it).
EXTRA_IMPLS = ("upstream-rust",)
# Speed peers that are not conforming implementations: measured side by side and their outcomes
# shown, but not required to match (upstream's C++ tree keeps its own LRU order).
PEERS = ("upstream-cpp",)
# fast with KV events and/or metrics on (``--events``): (events, metrics, on the composed
# Python tree) per name; each is compared with plain fast in the same alternating rounds
# (``ratios`` "<name>/fast"). Events move a Full cache off the C core onto the composed tree
# (fast/compat.py PYTHON_TREE): "fast+pytree" is that tree without events, so
# "fast+events/fast+pytree" is the events' own cost.
OBSERVED = {"fast+pytree": (False, False, True), "fast+events": (True, False, True),
            "fast+metrics": (False, True, False), "fast+events+metrics": (True, True, True)}
KNOWN_IMPLS = IMPLS + EXTRA_IMPLS + PEERS + tuple(OBSERVED)
WORKLOADS = ("shared-prefix", "mooncake")
# --components: the aux components beside Full (conformance/bench/configs.py)
COMPONENT_CHOICES = ("full", "swa", "mamba", "swa+mamba")
OPS = ("match", "lock", "evict", "insert", "unlock")
# the KV allocator under fast / upstream (--allocator): the bench's FreeListAllocator, or
# sglang's own (TokenToKVPoolAllocator at page 1, PagedTokenToKVPoolAllocator above; only where
# sglang imports; outside Full its SWA allocator and pools: conformance/bench/sglang_alloc.py).
# The spec always runs over the environment's pool model.
ALLOCATORS = ("freelist", "sglang")
# where the scheduler loop's value tensors (the slots it allocates and inserts) and the KV
# allocator of fast / upstream live (--device): production keeps them on the GPU.  The spec
# runs over the environment's pool model, on the CPU only.
DEVICES = ("cpu", "cuda")
# what a timed call is measured with: ``wall`` (time.perf_counter, the default) or ``cpu``
# (time.thread_time: this thread's CPU time, blind to other processes on a shared machine,
# less the clock's own cost per call: :func:`clock_cost`)
CLOCKS = ("wall", "cpu")
# --gc: what the garbage collector does around each measured run (gc_during_run)
GC_MODES = ("freeze", "collect")


@contextlib.contextmanager
def gc_during_run(mode: str) -> Iterator[None]:
    """Python's garbage collector around one measured run, for ``--gc mode`` (:data:`GC_MODES`).
    Both modes run a full collection first and leave the collector on, so each implementation's
    own garbage is collected, and paid for, as it is made. ``freeze`` then moves every object
    that exists before the run (the interpreter's modules, torch, sglang, the workload, the
    fresh cache) to the permanent generation, as SGLang's ``/freeze_gc`` does in a warmed-up
    server: a full collection during the run walks only what the run made, not the whole
    process's heap (here 0.2-0.3 s each, landing at random in one timed call); it unfreezes
    after the run. ``collect`` (the bench before 2026-12-04) does not freeze."""
    if mode not in GC_MODES:
        raise ValueError(f"unknown gc mode {mode!r}; known: {', '.join(GC_MODES)}")
    gc.collect()
    if mode == "freeze":
        gc.freeze()
    try:
        yield
    finally:
        if mode == "freeze":
            gc.unfreeze()


def clock_cost(clock: Callable[[], float], samples: int = 2001) -> float:
    """The median reading of ``clock() - clock()`` back to back: what one timed call adds by
    reading the clock around it (subtracted from every ``cpu`` sample)."""
    out = []
    for _ in range(samples):
        t0 = clock()
        out.append(clock() - t0)
    return statistics.median(out)


def bench_clock(name: str) -> tuple[Callable[[], float], float]:
    """The clock of ``--clock name`` and the cost subtracted from each of its samples (0 for
    ``wall``: today's numbers stay as they were)."""
    if name == "wall":
        return time.perf_counter, 0.0
    if name == "cpu":
        return time.thread_time, clock_cost(time.thread_time)
    raise ValueError(f"unknown clock {name!r}; known: {', '.join(CLOCKS)}")

MOONCAKE_FILE = "mooncake_conversation.jsonl.gz"
MOONCAKE_BLOCK = 512
MOONCAKE_KV_SLOTS = 1 << 22
MOONCAKE_OUT_BASE = 1 << 40
MOONCAKE_OUT_STRIDE = 4096  # > the trace's longest output (2,000 tokens)


class ImplMissing(ImportError):
    """The implementation cannot be built in this interpreter (the message says why)."""


class ConformanceMismatch(AssertionError):
    """Two implementations disagreed on hit rate, evictions, aborts or the per-request digest."""


# --------------------------------------------------------------------------------------------
# Allocators over the environment's pool
# --------------------------------------------------------------------------------------------


class FreeListAllocator:
    """A production-style KV allocator (as SGLang's token-to-KV allocators work): free slots in
    a tensor, ``alloc`` takes slots from its front, ``free`` queues the freed tensor and the
    queue is merged only when the front runs short.  No per-slot Python work, so the timed cache
    calls measure the cache, not the world model.  Frees are whole pages in order (the cache
    frees node values, which are), so the free list stays a run of whole pages and the front
    ``need`` slots always are whole pages.  Slot numbers differ from the lowest-first
    :class:`PagedPool`; a cache's decisions do not depend on them, so hit rate and evictions are
    the same as over the pool (``compare`` checks the outcomes agree)."""

    # frees are queued in order: one free of a concatenation is the same as one per piece, and
    # a free keeps its tensor at a constant cost, so fast/frees.py frees long pieces each with
    # a call rather than copy them into one (QUEUE)
    uniradix_free_order = "queue"

    def __init__(self, usable_slots: int, page_size: int, torch_module,
                 device: str = "cpu") -> None:
        self.torch = torch_module
        self.page_size = page_size
        self.device = torch_module.device(device)
        self._free = torch_module.arange(page_size, usable_slots + page_size,
                                         dtype=torch_module.int64, device=self.device)
        self._released: list = []
        self._released_slots = 0

    def available_size(self) -> int:
        return len(self._free) + self._released_slots

    def alloc(self, need_size: int):
        if need_size > len(self._free) + self._released_slots:
            return None
        if need_size > len(self._free):
            self._free = self.torch.cat([self._free] + self._released)
            self._released, self._released_slots = [], 0
        taken, self._free = self._free[:need_size], self._free[need_size:]
        return taken

    def free(self, free_index) -> None:
        n = free_index.numel()  # as SGLang's allocators do; len() is a Python-level wrapper
        if n:
            self._released.append(free_index)
            self._released_slots += n

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """SGLang 0.5.17+'s name for freeing part of a request's row (``start_pos`` lets a
        paged allocator skip its page dedup); here the same as :meth:`free`."""
        self.free(free_index)


class TimedPagedPool(PagedPool):
    """The environment's pool, keeping the time spent in :meth:`free` (``free_seconds``): the
    part of the timed cache calls that is the world's, not the cache's, reported separately."""

    def __init__(self, usable_slots: int, page_size: int = 1, name: str = "kv",
                  clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(usable_slots, page_size, name)
        self.free_seconds = 0.0
        self.clock = clock

    def free(self, slots) -> None:
        t0 = self.clock()
        try:
            super().free(slots)
        finally:
            self.free_seconds += self.clock() - t0


def sglang_allocator(usable_slots: int, page_size: int, device: str = "cpu"):
    """sglang's own KV allocator for ``page_size`` on ``device``, as its model runner builds it
    (``need_sort`` off: no disaggregation; no KV pool behind it, which alloc/free never read).
    :class:`ImplMissing` where sglang does not import."""
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
    try:
        torch = load_upstream().torch  # (the import workarounds sglang needs on a CPU box)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    except (UpstreamMissing, Exception) as e:  # absent, or an install that fails at import
        raise ImplMissing(f"--allocator sglang: sglang's allocators do not import here "
                          f"({type(e).__name__}: {e})") from e
    if page_size == 1:
        return TokenToKVPoolAllocator(usable_slots, torch.float16, device, None, False)
    return PagedTokenToKVPoolAllocator(usable_slots, page_size, torch.float16, device, None, False)


def make_allocator(kind: str, usable_slots: int, page_size: int, torch_module,
                   device: str = "cpu"):
    """The KV allocator ``kind`` (:data:`ALLOCATORS`) on ``device`` for a fast or upstream cache, its
    ``free`` calls counted (:func:`count_frees`; before the cache is built, since a cache may
    keep the bound method)."""
    if kind == "freelist":
        alloc = FreeListAllocator(usable_slots, page_size, torch_module, device)
    elif kind == "sglang":
        alloc = sglang_allocator(usable_slots, page_size, device)
    else:
        raise ValueError(f"unknown allocator {kind!r}; known: {', '.join(ALLOCATORS)}")
    count_frees(alloc)
    return alloc


def count_frees(alloc: Any, method: str = "free", pool: str = "kv") -> None:
    """Count the calls to ``alloc.<method>`` from now on in ``alloc._bench_free_calls`` (for
    ``free``; a one-item list), through an instance attribute wrapping the bound method (the
    class is untouched, so fast/frees.py still recognises the allocator; a batch it writes in
    one step counts as one call); the unwrapped method stays in ``alloc._bench_raw_free`` for
    the harness's own frees.  With ``--alloc-time`` the wrapper also times the outermost calls
    under ``pool`` (conformance/bench/alloc_time.py ``wrap``, ``watch_pools``)."""
    pool_timing.wrap(alloc, method, pool)


# --alloc-time: the C core's free timer clock for each bench clock (fast/_core.c free_timer)
_CORE_FREE_CLOCK = {"wall": 1, "cpu": 2}


class AllocTimer:
    """The time a run's cache calls spend inside the pools' frees (``--alloc-time``): every
    free the bench wrapped (:func:`count_frees`, conformance/bench/alloc_time.py: the KV
    allocator, an SWA allocator's frees and sub-allocators, the Mamba state allocator, the
    host pools; nested calls once), fast/frees.py's direct list writes into those pools, and
    the C core's native frees (fast/_core.c ``free_timer``: the writes into sglang's exact
    allocators' lists that stand for their ``free`` calls).  All on the run's clock.
    :meth:`read` is the running total in seconds; :meth:`by_pool` splits it."""

    def __init__(self, allocator: Any, clock: str, timer: Callable[[], float]) -> None:
        timing = getattr(allocator, "_bench_free_timing", None)
        if timing is None:
            raise ValueError("--alloc-time: the allocator's free is not wrapped by count_frees")
        timing[1] = 0.0
        self.timing: list = timing
        self.core = sys.modules.get("uniradix.fast._core")
        if self.core is not None and not hasattr(self.core, "free_timer"):
            self.core = None  # an older build: no native free timer
        self.code = _CORE_FREE_CLOCK[clock]
        self.native = 0.0
        if self.core is not None:
            self.core.free_timer(self.code)  # reset, and on
        pool_timing.TIMING.start(timer, self._flush)

    def _flush(self, drop: bool = False) -> None:
        """Take the C core's sum so far (and reset it): counted, or ``drop``ped (its time was
        inside a call timed otherwise)."""
        if self.core is not None:
            got = self.core.free_timer(self.code)
            if not drop:
                self.native += got

    def read(self) -> float:
        self._flush()
        return pool_timing.TIMING.seconds + self.native

    def by_pool(self) -> dict[str, float]:
        """Seconds per pool (pool_timing.POOLS; ``native``: the C core's writes)."""
        out = dict(pool_timing.TIMING.by_pool)
        if self.core is not None:
            out["native"] = self.native
        return out

    def stop(self) -> float:
        total = self.read()
        if self.core is not None:
            self.core.free_timer(0)
        pool_timing.TIMING.stop()
        return total


def _torch_or_none():
    try:
        import torch
    except (ImportError, OSError):  # absent, or a broken install: run without it
        return None
    return torch


# --------------------------------------------------------------------------------------------
# API bundles: what differs between implementations
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ApiBundle:
    name: str
    version: str
    RadixKey: Any
    MatchPrefixParams: Any
    InsertParams: Any
    EvictParams: Any
    values: Any  # spec_api.TorchValues or ArrayValues: how the harness builds and joins values
    # pool -> (cache, allocator, *other parts the steps use, e.g. the Mamba request pool);
    # hybrid.hybrid_bundle's own: (kv_slots, page_size) -> (cache, allocator, request pool)
    build: Callable[..., tuple]
    # the loop's per-feature steps (each call makes a fresh Step for one run) and the
    # configuration they make (the label after the workload's name: "swa", "write_back", ...)
    steps: tuple[Callable[[], Step], ...] = ()
    label: str = ""


def workload_label(workload: str, config: str) -> str:
    """``shared-prefix`` + ``swa`` -> ``shared-prefix+swa``: how the JSON and the dashboard
    name a configuration (conformance/bench/results.py ``split_workload``); ``full`` and the
    empty label are the plain workload."""
    return workload if config in ("", "full") else f"{workload}+{config}"


def spec_bundle() -> ApiBundle:
    torch = _torch_or_none()
    values = spec_api.TorchValues(torch) if torch is not None else spec_api.ArrayValues()

    def build(pool: PagedPool):
        alloc = PoolAllocator(pool, torch)
        params = spec_api.CacheInitParams(disable=False, req_to_token_pool=None,
                                          token_to_kv_pool_allocator=alloc,
                                          page_size=pool.page_size)
        return spec_api.UnifiedRadixCache(params, values), alloc

    return ApiBundle("spec", "spec", spec_api.RadixKey, spec_api.MatchPrefixParams,
                     spec_api.InsertParams, spec_api.EvictParams, values, build)


FAST_NAMES = ("UnifiedRadixCache", "CacheInitParams", "RadixKey", "MatchPrefixParams",
              "InsertParams", "EvictParams")


def fast_bundle(allocator: str = "freelist", device: str = "cpu", events: bool = False,
                metrics: bool = False, python_tree: bool = False) -> ApiBundle:
    try:
        import uniradix.fast as fast
    except ImportError as e:
        raise ImplMissing(f"fast: uniradix.fast does not import ({type(e).__name__}: {e})") from e
    missing = [n for n in FAST_NAMES if not hasattr(fast, n)]
    if missing:
        raise ImplMissing("fast: uniradix.fast does not exist yet (it does not provide "
                          + ", ".join(missing) + ")")
    torch = _torch_or_none()
    if torch is None:
        raise ImplMissing("fast: torch is not installed in this interpreter")
    values = spec_api.TorchValues(torch)
    if allocator == "sglang":
        return _fast_from_sglang_objects(fast, values, device)

    def build(pool: PagedPool):
        alloc = make_allocator(allocator, pool.num_pages * pool.page_size, pool.page_size, torch,
                               device)
        params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=alloc, page_size=pool.page_size,
                                      enable_kv_cache_events=events, enable_metrics=metrics)
        if python_tree:  # the composed tree by name (what events run on)
            from uniradix.fast.hybrid import HybridRadixCache
            return HybridRadixCache(params), alloc
        return fast.UnifiedRadixCache(params), alloc

    return ApiBundle("fast", getattr(fast, "__version__", "dev"), fast.RadixKey,
                     fast.MatchPrefixParams, fast.InsertParams, fast.EvictParams, values, build)


def _fast_from_sglang_objects(fast: Any, values: Any, device: str = "cpu") -> ApiBundle:
    """fast as an engine runs it in place of sglang's cache: built from sglang's own
    ``CacheInitParams`` over sglang's allocator, and called with sglang's ``RadixKey`` and param
    types (the drop-in boundary, fast/compat.py), exactly as ``upstream_bundle`` builds and
    calls sglang's cache."""
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
    try:
        up = load_upstream()
    except UpstreamMissing as e:
        raise ImplMissing(f"fast: --allocator sglang needs sglang ({e})") from e

    def build(pool: PagedPool):
        alloc = make_allocator("sglang", pool.num_pages * pool.page_size, pool.page_size,
                               up.torch, device)
        params = up.CacheInitParams(disable=False, req_to_token_pool=None,
                                    token_to_kv_pool_allocator=alloc, page_size=pool.page_size,
                                    is_eagle=False, tree_components=(up.ComponentType.FULL,))
        return fast.UnifiedRadixCache(params), alloc

    return ApiBundle("fast", getattr(fast, "__version__", "dev"), up.RadixKey,
                     up.MatchPrefixParams, up.InsertParams, up.EvictParams, values, build)


TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


def tree_core_in_use(cache: Any) -> str:
    """Which tree core an upstream ``UnifiedRadixCache`` runs on: ``python`` or ``rust`` on a
    release with a pluggable core (0.5.17+: the class of its ``tree_core``; sglang may fall back
    from the one asked for to the Python core), ``python`` on a release without one (the tree
    lives in the cache object itself), ``unknown (<class>)`` otherwise."""
    core = getattr(cache, "tree_core", None)
    if core is None:
        return "python"
    kind = type(core)
    where = f"{kind.__module__}.{kind.__qualname__}"
    if "rust" in where.lower():
        return "rust"
    if kind.__module__.endswith("unified_tree_core") and kind.__name__ == "UnifiedTreeCore":
        return "python"
    return f"unknown ({where})"


def match_result_problem(result: Any) -> str | None:
    """Why the bench loop cannot read a peer's match result (``None`` when it can): the loop
    takes the matched slots from ``device_indices``, which sglang's later releases dropped
    (0.5.23 reports ``device_prefix_len`` and keeps the slots on the nodes)."""
    if hasattr(result, "device_indices") and hasattr(result, "last_device_node"):
        return None
    fields = getattr(type(result), "_fields", None) or sorted(
        n for n in dir(result) if not n.startswith("_"))
    return (f"its MatchResult has no device_indices (fields: {', '.join(fields)}); the bench "
            f"loop reads the matched slots from device_indices, as 0.5.13.post1 returns them")


def upstream_bundle(tree_core: str | None = None, allocator: str = "freelist",
                    device: str = "cpu") -> ApiBundle:
    """sglang's ``UnifiedRadixCache``, pinned to the tree core its name says: ``upstream`` on the
    Python tree, ``upstream-rust`` (``tree_core="rust"``) on the Rust one.  On a release with a
    pluggable core (0.5.17+, where the Rust core is the default) the core is set explicitly and
    a probe cache checks which one was built; :class:`ImplMissing` says why when the core cannot
    be pinned or the bench loop cannot read the release's match results."""
    from uniradix.conformance.adapters.upstream import (
        UpstreamMissing,
        load_upstream,
        rust_tree_core_available,
    )
    name = "upstream" if tree_core is None else f"upstream-{tree_core}"
    want = tree_core or "python"
    try:
        up = load_upstream()
    except UpstreamMissing as e:
        raise ImplMissing(f"{name}: {e}") from e
    pluggable = rust_tree_core_available()
    if tree_core == "rust" and not pluggable:
        raise ImplMissing(f"{name}: sglang {up.version} has no Rust tree core (0.5.17 and "
                          f"later have one; measure it in a venv with such a release)")
    values = spec_api.TorchValues(up.torch)
    from uniradix.conformance.bench.peers_newer import adapter_for  # (a newer release's match)
    adapt, note = adapter_for(name, want, up)

    def build(pool: PagedPool):
        alloc = make_allocator(allocator, pool.num_pages * pool.page_size, pool.page_size,
                               up.torch, device)
        params = up.CacheInitParams(disable=False, req_to_token_pool=None,
                                    token_to_kv_pool_allocator=alloc, page_size=pool.page_size,
                                    is_eagle=False, tree_components=(up.ComponentType.FULL,))
        before = os.environ.get(TREE_CORE_ENV)
        if pluggable:  # read by the constructor only; set even for the Python core (not the
            os.environ[TREE_CORE_ENV] = want  # default on the releases that have this switch)
        try:
            return adapt(up.UnifiedRadixCache(params)), alloc
        finally:
            if before is None:
                os.environ.pop(TREE_CORE_ENV, None)
            else:
                os.environ[TREE_CORE_ENV] = before

    try:  # a probe: the core really built, and the match result the loop reads
        probe, _ = build(PagedPool(16, 1, "probe"))
        got = tree_core_in_use(probe)
        problem = match_result_problem(probe.match_prefix(up.MatchPrefixParams(
            key=up.RadixKey(array("q", [1, 2, 3])))))
    except Exception as e:
        raise ImplMissing(f"{name}: sglang {up.version}'s cache cannot be built here "
                          f"({type(e).__name__}: {e})") from e
    if got != want:
        raise ImplMissing(f"{name}: asked sglang {up.version} for its {want} tree core "
                          f"({TREE_CORE_ENV}={want}) and it built the {got} one")
    if problem is not None:
        raise ImplMissing(f"{name}: sglang {up.version}: {problem}")
    version = f"sglang {up.version} ({got} tree core{note})"
    return ApiBundle(name, version, up.RadixKey, up.MatchPrefixParams,
                     up.InsertParams, up.EvictParams, values, build)


@dataclasses.dataclass
class CppInsertResult:
    prefix_len: int


class UpstreamCppCache:
    """Upstream's C++ radix tree (``RadixCacheCpp``) behind the bench's five calls.

    ``RadixCacheCpp`` has no tree-level ``insert(InsertParams)``: its ``cache_finished_req``
    inserts through the tree and then frees the duplicate slots ``value[prev_prefix_len:
    prefix_len]`` itself. :meth:`insert` does exactly those two things, so the timed insert
    covers the same work as the other implementations' (whose insert frees duplicates
    inside). The other four calls are ``RadixCacheCpp``'s own methods."""

    def __init__(self, cls: Any, params: Any, allocator: Any) -> None:
        server_args = types.SimpleNamespace(hicache_write_policy="write_through",
                                            enable_hierarchical_cache=False)
        self.allocator = allocator
        self.cache = cls(params, server_args)
        self.match_prefix = self.cache.match_prefix
        self.inc_lock_ref = self.cache.inc_lock_ref
        self.dec_lock_ref = self.cache.dec_lock_ref
        self.evict = self.cache.evict

    def insert(self, params: Any) -> CppInsertResult:
        prefix_len = self.cache._insert(params.key, params.value)
        if params.prev_prefix_len < prefix_len:
            self.allocator.free(params.value[params.prev_prefix_len:prefix_len])
        return CppInsertResult(prefix_len)


def cpp_tree_problem(cache: Any) -> str | None:
    """Why ``cache`` (a ``RadixCacheCpp``) is not on upstream's compiled C++ tree (``None`` when
    it is): its ``tree`` must be an instance of a class from a compiled extension module."""
    tree = getattr(cache, "tree", None)
    if tree is None:
        return f"{type(cache).__name__} has no tree"
    kind = type(tree)
    where = getattr(sys.modules.get(kind.__module__), "__file__", None) or ""
    # torch's extension loader does not always register the module; pybind11 marks its classes
    if where.endswith((".so", ".pyd")) or "pybind11" in type(kind).__name__:
        return None
    return (f"its tree is {kind.__module__}.{kind.__qualname__}, not a class of a compiled "
            f"extension ({where or 'no file'})")


def upstream_cpp_bundle(allocator: str = "freelist", device: str = "cpu") -> ApiBundle:
    """Upstream's ``RadixCacheCpp``, checked to run on its compiled C++ tree."""
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream, load_upstream_cpp
    try:
        up = load_upstream()
        cls = load_upstream_cpp()
    except UpstreamMissing as e:
        raise ImplMissing(f"upstream-cpp: {e}") from e
    values = spec_api.TorchValues(up.torch)

    def build(pool: PagedPool):
        alloc = make_allocator(allocator, pool.num_pages * pool.page_size, pool.page_size,
                               up.torch, device)
        alloc.get_kvcache = lambda: None  # read by the constructor, unused without a host tier
        params = up.CacheInitParams(disable=False, req_to_token_pool=None,
                                    token_to_kv_pool_allocator=alloc, page_size=pool.page_size,
                                    enable_kv_cache_events=False)
        return UpstreamCppCache(cls, params, alloc), alloc

    try:  # later releases read a server runtime context in the constructor
        probe, _ = build(PagedPool(16, 1, "probe"))
        problem = cpp_tree_problem(probe.cache) or match_result_problem(probe.match_prefix(
            up.MatchPrefixParams(key=up.RadixKey(array("q", [1, 2, 3])))))
    except Exception as e:
        raise ImplMissing(f"upstream-cpp: RadixCacheCpp of sglang {up.version} cannot be built "
                          f"outside a server ({type(e).__name__}: {e}); measure it with "
                          f"0.5.13.post1") from e
    if problem is not None:
        raise ImplMissing(f"upstream-cpp: sglang {up.version}: {problem}")
    return ApiBundle("upstream-cpp", f"sglang {up.version} RadixCacheCpp", up.RadixKey,
                     up.MatchPrefixParams, up.InsertParams, up.EvictParams, values, build)


def observed_fast_bundle(name: str, allocator: str = "freelist", device: str = "cpu") -> ApiBundle:
    """fast with the KV events and/or metrics of ``OBSERVED[name]`` on (the events drained
    once per request); over the bench's own allocator only."""
    events, metrics, python_tree = OBSERVED[name]
    if allocator != "freelist":
        raise ImplMissing(f"{name}: measured over the bench's freelist allocator only")
    if metrics:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as e:
            raise ImplMissing(f"{name}: prometheus_client is not installed (the metrics "
                              "extra)") from e
    bundle = fast_bundle(allocator, device, events=events, metrics=metrics,
                         python_tree=python_tree)
    return dataclasses.replace(bundle, name=name, steps=(DrainEvents,) if events else ())


BUNDLES: dict[str, Callable[..., ApiBundle]] = {
    "spec": lambda allocator="freelist", device="cpu": spec_bundle(),  # the pool model, CPU
    "fast": fast_bundle, "upstream": upstream_bundle,
    "upstream-rust": lambda allocator="freelist", device="cpu": upstream_bundle("rust", allocator,
                                                                                device),
    "upstream-cpp": upstream_cpp_bundle,
    **{name: functools.partial(observed_fast_bundle, name) for name in OBSERVED}}


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here (``None`` when torch sees a CUDA device)."""
    torch = _torch_or_none()
    if torch is None:
        return "torch is not installed in this interpreter"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} here has no CUDA device (torch.cuda.is_available() is False)"
    return None


def get_bundle(name: str, allocator: str = "freelist", device: str = "cpu") -> ApiBundle:
    """The API bundle of an implementation over the KV allocator ``allocator``
    (:data:`ALLOCATORS`; the spec ignores it) with its values and allocator on ``device``
    (:data:`DEVICES`; the spec runs on the CPU only); :class:`ImplMissing` when it cannot be
    built here."""
    if name not in BUNDLES:
        raise ValueError(f"unknown implementation {name!r}; known: {', '.join(KNOWN_IMPLS)}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; known: {', '.join(ALLOCATORS)}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
    if device != "cpu":
        if name == "spec":
            raise ImplMissing("spec: runs over the environment's pool model, on the CPU only")
        why = cuda_problem()
        if why is not None:
            raise ImplMissing(f"{name}: --device {device}: {why}")
    if allocator == "sglang" and name != "spec":
        sglang_allocator(16, 1)  # ImplMissing here, not in the middle of a run
    if allocator == "freelist" and device == "cpu":  # (every builder's default; registered
        return BUNDLES[name]()                      # test builders take none)
    return BUNDLES[name](allocator=allocator, device=device)


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchWorkload:
    """A request stream and the world it runs in. ``stream()`` yields (prompt, output tokens),
    both ``array('q')``, deterministically."""

    name: str
    page_size: int
    kv_slots: int
    requests: int
    inflight: int
    stream: Callable[[], Iterator[tuple[array, array]]]
    detail: str = ""


def _output_tokens(r: int, n: int) -> array:
    return array("q", [(r * 7919 + t * 104729) % 31999 + 1 for t in range(n)])


def shared_prefix_workload(page_size: int = 1, requests: int | None = None,
                           base: SharedPrefix | None = None) -> BenchWorkload:
    """``SharedPrefix()`` (or ``base``) at ``page_size``, scaled down to ``requests``."""
    w = dataclasses.replace(base or SharedPrefix(), page_size=page_size)
    if requests is not None and requests < w.requests:
        w = w.scaled(requests)

    def stream():
        for r, (_rid, tokens, n_out) in enumerate(shared_prefix_requests(w)):
            yield array("q", tokens), _output_tokens(r, n_out)

    return BenchWorkload("shared-prefix", page_size, w.kv_slots, w.requests, w.inflight, stream,
                         f"{w.prompts} prompts, Zipf s={w.zipf_s}")


_MOONCAKE_ROWS: list | None = None


def mooncake_rows() -> list[tuple[int, int, tuple]]:
    """(input_length, output_length, hash_ids) of every request of the packaged trace."""
    global _MOONCAKE_ROWS
    if _MOONCAKE_ROWS is None:
        ref = importlib.resources.files("uniradix.conformance") / "data" / MOONCAKE_FILE
        with ref.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            rows = []
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    rows.append((int(d["input_length"]), int(d["output_length"]),
                                 tuple(d["hash_ids"])))
        _MOONCAKE_ROWS = rows
    return _MOONCAKE_ROWS


def mooncake_prompt(input_length: int, hash_ids: Sequence[int]) -> array:
    """Block ``b`` is the token ids ``b * 512 + j + 1`` (j = 0..511); cut to input_length."""
    out = array("q")
    for b in hash_ids:
        base = b * MOONCAKE_BLOCK + 1
        out.extend(range(base, base + MOONCAKE_BLOCK))
    del out[input_length:]
    return out


def mooncake_output(r: int, output_length: int) -> array:
    base = MOONCAKE_OUT_BASE + r * MOONCAKE_OUT_STRIDE
    return array("q", range(base, base + output_length))


def mooncake_workload(page_size: int = 16, requests: int | None = None,
                      kv_slots: int = MOONCAKE_KV_SLOTS, inflight: int = 16) -> BenchWorkload:
    rows = mooncake_rows()
    n = len(rows) if requests is None else min(requests, len(rows))
    kv = -(-kv_slots // page_size) * page_size

    def stream():
        for r in range(n):
            inp, out, ids = rows[r]
            yield mooncake_prompt(inp, ids), mooncake_output(r, out)

    return BenchWorkload("mooncake", page_size, kv, n, inflight, stream,
                         "conversation trace, 512-token blocks")


def make_workload(name: str, page_size: int, requests: int | None = None) -> BenchWorkload:
    if name == "shared-prefix":
        return shared_prefix_workload(page_size, requests)
    if name == "mooncake":
        return mooncake_workload(page_size, requests)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


# --------------------------------------------------------------------------------------------
# The scheduler loop
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchStats:
    impl: str
    version: str
    workload: str
    page_size: int
    kv_slots: int
    values: str = ""
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0
    evict_calls: int = 0
    seconds: float = 0.0  # summed time of the timed calls
    pool_free_seconds: float = 0.0  # of which: the pool's free (the environment's work)
    wall_seconds: float = 0.0  # the whole run, generator and harness included
    digest: str = ""
    cached_tokens: int = 0  # slots the tree holds at the end (pool slots in use)
    # calls to the KV allocator's free made by the timed cache calls (None: not counted)
    free_calls: int | None = None
    clock: str = "wall"  # CLOCKS: what the op times were measured with
    op_times: dict = dataclasses.field(default_factory=lambda: {op: [] for op in OPS})
    # --alloc-time: seconds of the timed calls spent inside the allocator's frees (AllocTimer),
    # in all and per op (None: not measured)
    alloc_seconds: float | None = None
    op_alloc_seconds: dict = dataclasses.field(default_factory=dict)
    alloc_pools: dict = dataclasses.field(default_factory=dict)  # of which per pool (AllocTimer)
    alloc_calls: dict = dataclasses.field(default_factory=dict)  # the frees timed, per pool

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def pool_share(self) -> float:
        return self.pool_free_seconds / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s_ex_pool(self) -> float:
        """Requests/s counting the cache's own work only (the pool's frees taken out)."""
        own = self.seconds - self.pool_free_seconds
        return self.requests / own if own > 0 else 0.0

    @property
    def alloc_share(self) -> float | None:
        """--alloc-time: the share of the timed seconds spent inside the pools' frees."""
        if self.alloc_seconds is None:
            return None
        return self.alloc_seconds / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s_ex_alloc(self) -> float | None:
        """--alloc-time: requests/s counting the timed seconds outside the pools' frees."""
        if self.alloc_seconds is None:
            return None
        own = self.seconds - self.alloc_seconds
        return self.requests / own if own > 0 else 0.0

    def op_medians_us(self) -> dict[str, float]:
        return {op: statistics.median(ts) * 1e6 for op, ts in self.op_times.items() if ts}

    def outcome(self) -> dict:
        """What every conforming implementation must reproduce exactly."""
        return {"requests": self.requests, "aborted": self.aborted,
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "evicted_tokens": self.evicted_tokens, "digest": self.digest}

    def summary(self) -> dict:
        return {"impl": self.impl, "version": self.version, "workload": self.workload,
                "page_size": self.page_size, "kv_slots": self.kv_slots, "values": self.values,
                "requests": self.requests, "aborted": self.aborted,
                "requests_per_s": round(self.requests_per_s, 1),
                "requests_per_s_ex_pool": round(self.requests_per_s_ex_pool, 1),
                "pool_free_share": round(self.pool_share, 4),
                "hit_rate": round(self.hit_rate, 6), "evicted_tokens": self.evicted_tokens,
                "evict_calls": self.evict_calls, "cached_tokens": self.cached_tokens,
                "free_calls": self.free_calls, "clock": self.clock,
                "timed_s": round(self.seconds, 4), "wall_s": round(self.wall_seconds, 3),
                "digest": self.digest,
                "op_median_us": {k: round(v, 2) for k, v in self.op_medians_us().items()},
                "op_calls": {k: len(v) for k, v in self.op_times.items()},
                "alloc_s": None if self.alloc_seconds is None else round(self.alloc_seconds, 6),
                "op_alloc_s": {k: round(v, 6) for k, v in self.op_alloc_seconds.items()},
                "alloc_s_by_pool": {k: round(v, 6) for k, v in self.alloc_pools.items()},
                "alloc_calls_by_pool": dict(self.alloc_calls),
                "alloc_share": _round_or_none(self.alloc_share, 4),
                "requests_per_s_ex_alloc": _round_or_none(self.requests_per_s_ex_alloc, 1),
                "op_total_s": {k: round(sum(v), 6) for k, v in self.op_times.items()}}


def _round_or_none(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


@dataclasses.dataclass
class Request:
    """One request from its match to its finish: the loop's own bookkeeping, which the steps
    read and extend (a load back adds ``loaded`` device slots, a Mamba step holds ``state``)."""

    prompt: array
    output: array
    node: Any  # the node it locks: the match's last device node, or where a load back ended
    indices: Any  # its matched device slots, loaded ones included
    need: int = 0  # fresh slots it takes (whole pages)
    loaded: int = 0  # of ``indices``: tokens loaded back from the host tier
    evicted: int = 0  # Full tokens evicted to admit it
    dec: Any = None  # the unlock's params
    state: Any = None  # the Mamba state slot it holds (None: none)
    tokens: array | None = None  # prompt + output, once admitted
    slots: Any = None  # indices + fresh slots, once admitted
    matched: int = 0  # len(indices) at admission
    aux_evicted: dict[str, int] = dataclasses.field(default_factory=dict)  # step -> units


class Step:
    """A per-feature plug-in of :func:`run_bench`'s scheduler loop (the host tier, SWA, Mamba:
    conformance/bench/host.py and hybrid.py).  The loop calls each hook of every step of the
    run, in the bundle's order; every default does nothing, so a step states only what its
    feature adds.  A step's own cache calls are timed through :meth:`Run.timed` under the op
    names in ``ops`` (besides :data:`OPS`); evictions go through :meth:`Run.evict`, which
    counts them for every step."""

    name = "step"
    ops: tuple[str, ...] = ()

    def start(self, run: Run) -> None:
        """The run's cache is built: bind to it (and to its allocators, ``run.parts``)."""

    def after_match(self, run: Run, req: Request, match: Any) -> None:
        """After ``match_prefix``, before the lock (the host tier loads its hit back here)."""

    def make_room(self, run: Run, req: Request) -> None:
        """Evict for ``req.need`` fresh slots.  Overridden by at most one step of a run, which
        then replaces the Full default (evict the shortfall of ``allocator.available_size()``)."""

    def admit(self, run: Run, req: Request) -> bool:
        """What ``req`` needs besides its slots (False: it aborts, its slots not taken)."""
        return True

    def count_evicted(self, req: Request, result: Any) -> None:
        """An evict result (from any evict of the request): count this step's units."""

    def admitted_fields(self, req: Request) -> tuple[int, ...]:
        """This step's numbers in the digest's admission record (they must agree)."""
        return ()

    def aborted(self, run: Run, req: Request) -> None:
        """``req`` aborts (its slots were not taken): undo what :meth:`admit` took."""

    def insert_params(self, run: Run, req: Request, params: Any) -> None:
        """Extend the ``InsertParams`` of ``req``'s finishing insert."""

    def inserted(self, run: Run, req: Request, result: Any) -> tuple[int, ...]:
        """After the insert: release what the cache did not keep; the digest's numbers."""
        return ()

    def prefilled(self, run: Run, req: Request) -> tuple[int, ...]:
        """``req`` is admitted and its prompt computed (the scheduler's prefill): Mamba caches
        the prompt's state here through :meth:`Run.cache_unfinished`.  Returns this step's
        numbers for the digest (they must agree)."""
        return ()

    def request_done(self, run: Run) -> None:
        """Once per request, admitted or aborted (a scheduler step: the host tier's acks)."""


class Run:
    """One run of :func:`run_bench`: the cache, its allocator, the build's other parts, the
    parameter types and the stats, as the steps see them."""

    def __init__(self, bundle: ApiBundle, built: tuple, stats: BenchStats,
                 steps: Sequence[Step]) -> None:
        self.cache, self.allocator = built[0], built[1]
        self.parts = built[2:]  # e.g. the Mamba request pool (conformance/bench/hybrid.py)
        self.api = bundle
        self.values = bundle.values
        self.stats = stats
        self.steps = steps
        self.clock: Callable[[], float] = time.perf_counter  # run_bench's ``clock``
        self.alloc: AllocTimer | None = None  # --alloc-time

    def timed(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its time added to ``op``'s (and with ``--alloc-time`` the time it
        spent inside the allocator's frees to ``op``'s share of that)."""
        clock, alloc = self.clock, self.alloc
        a0 = 0.0 if alloc is None else alloc.read()
        t0 = clock()
        out = fn(*args)
        self.stats.op_times[op].append(clock() - t0)
        if alloc is not None:
            shares = self.stats.op_alloc_seconds
            shares[op] = shares.get(op, 0.0) + alloc.read() - a0
        return out

    def cache_unfinished(self, req: Request, length: int, **fields: Any) -> Any:
        """What a scheduler's ``cache_unfinished_req`` does after a prefill, for the first
        ``length`` tokens of ``req``'s prompt (page-aligned down): a timed insert (``fields``
        extend its ``InsertParams``), then a timed match of the same key, the lock moved
        from ``req.node`` to the match's last device node, and the request's slots up to
        the match replaced by the tree's (the insert freed its duplicates).  Returns the
        insert's result (None: that prefix is not beyond what the request already holds
        from the tree, and nothing is inserted)."""
        ps = self.stats.page_size
        aligned = min(length, len(req.prompt)) // ps * ps
        if aligned <= req.matched:
            return None
        api = self.api
        key = api.RadixKey(req.prompt[:aligned])
        params = api.InsertParams(key=key, value=req.slots[:aligned],
                                  prev_prefix_len=req.matched)
        for name, value in fields.items():
            setattr(params, name, value)
        result = self.timed("insert", self.cache.insert, params)
        m = self.timed("match", self.cache.match_prefix,
                       api.MatchPrefixParams(key=api.RadixKey(req.prompt[:aligned])))
        new = m.device_indices
        self.timed("unlock", self.cache.dec_lock_ref, req.node, req.dec)
        lock = self.timed("lock", self.cache.inc_lock_ref, m.last_device_node)
        req.dec = lock.to_dec_params() if hasattr(lock, "to_dec_params") else None
        req.node = m.last_device_node
        n = len(new)
        if n > len(req.slots):
            raise RuntimeError(f"{self.stats.impl}: the prompt's match after its insert "
                                      f"holds {n} slots, the request only {len(req.slots)}")
        req.slots = self.values.cat(new, req.slots[n:])
        req.matched = n
        return result

    def evict(self, req: Request, **params: Any) -> Any:
        """A timed ``evict(EvictParams(**params))`` for ``req``, counted in the stats, the
        request and every step."""
        ep = self.api.EvictParams(**params)
        result = self.timed("evict", self.cache.evict, ep)
        n = int(result.num_tokens_evicted)
        self.stats.evicted_tokens += n
        self.stats.evict_calls += 1
        req.evicted += n
        for step in self.steps:
            step.count_evicted(req, result)
        return result


class DrainEvents(Step):
    """The scheduler's ``take_events()`` once per request (one scheduler step: its events go
    to the publisher), timed as part of the events' cost."""

    name = "events"
    ops = ("take_events",)

    def request_done(self, run: Run) -> None:
        run.timed("take_events", run.cache.take_events)


def run_bench(bundle: ApiBundle, workload: BenchWorkload,
              progress: Callable[[int, int], None] | None = None,
              keep: list | None = None, clock: str = "wall",
              alloc_time: bool = False, gc_mode: str = "freeze") -> BenchStats:
    """Drive one fresh cache of ``bundle`` through ``workload``, with the bundle's steps; see
    the module docstring.  ``keep``, when given, receives (cache, allocator, pool, *the build's
    other parts) after the run.  ``clock`` (:data:`CLOCKS`) times the calls; the run's wall
    time is always ``time.perf_counter``.  ``alloc_time``: also the time the calls spend inside
    the allocator's frees (:class:`AllocTimer`; ``alloc_seconds`` and, per op,
    ``op_alloc_seconds`` of the stats).  ``gc_mode``: the collector around the run
    (:func:`gc_during_run`)."""
    ps = workload.page_size
    timer, cost = bench_clock(clock)
    pool = TimedPagedPool(workload.kv_slots, ps, name="kv", clock=timer)
    built = bundle.build(pool)
    cache, allocator = built[0], built[1]
    free_calls = getattr(allocator, "_bench_free_calls", None)  # see make_allocator
    harness_free = getattr(allocator, "_bench_raw_free", allocator.free)
    RadixKey, MatchP, InsertP = bundle.RadixKey, bundle.MatchPrefixParams, bundle.InsertParams
    values = bundle.values
    stats = BenchStats(bundle.name, bundle.version, workload_label(workload.name, bundle.label),
                       ps, workload.kv_slots, values=values.name, clock=clock)
    steps = [make() for make in bundle.steps]
    for step in steps:
        stats.op_times.update({op: [] for op in step.ops})
    run = Run(bundle, built, stats, steps)
    run.clock = timer
    # (an allocator count_frees did not wrap, the spec's pool model: not measured)
    timeable = alloc_time and getattr(allocator, "_bench_free_timing", None) is not None
    pool_timing.TIMING.stop()  # (a run that raised may have left the pools' timer on)
    alloc = run.alloc = AllocTimer(allocator, clock, timer) if timeable else None
    for step in steps:
        step.start(run)
    rooms = [s for s in steps if type(s).make_room is not Step.make_room]
    if len(rooms) > 1:
        raise ValueError("steps " + ", ".join(s.name for s in rooms) + " each make room; at "
                         "most one step of a run may replace the Full default")
    room = rooms[0] if rooms else None
    t_match, t_lock, _t_evict, t_insert, t_unlock = (stats.op_times[op] for op in OPS)
    digest = hashlib.blake2b(digest_size=16)
    running: collections.deque[Request] = collections.deque()

    def record(*fields: int) -> None:
        digest.update(struct.pack(f"<{len(fields)}q", *fields))

    def finish(req: Request) -> None:
        tokens = req.tokens
        assert tokens is not None
        aligned = len(tokens) // ps * ps
        params = InsertP(key=RadixKey(tokens[:aligned]), value=req.slots[:aligned],
                         prev_prefix_len=req.matched)
        for step in steps:
            step.insert_params(run, req, params)
        a0 = 0.0 if alloc is None else alloc.read()
        t0 = timer()
        result = cache.insert(params)
        t1 = timer()
        t_insert.append(t1 - t0)
        if alloc is not None:
            shares = stats.op_alloc_seconds
            shares["insert"] = shares.get("insert", 0.0) + alloc.read() - a0
        if aligned < len(req.slots):
            before = pool.free_seconds
            with pool_timing.quiet():  # (an SWA allocator's sub-allocators are wrapped too)
                harness_free(req.slots[aligned:])
            pool.free_seconds = before  # the harness's own free is not cache work
        fields: tuple[int, ...] = ()
        for step in steps:
            fields += step.inserted(run, req, result)
        t0 = timer()
        cache.dec_lock_ref(req.node, req.dec)
        t1 = timer()
        t_unlock.append(t1 - t0)
        record(2, int(result.prefix_len), 0, *fields)
        stats.requests += 1
        if progress is not None:
            progress(stats.requests + stats.aborted, workload.requests)

    with gc_during_run(gc_mode):
        wall0 = time.perf_counter()
        for prompt, output in workload.stream():
            while len(running) >= workload.inflight:
                finish(running.popleft())
            params = MatchP(key=RadixKey(prompt))
            t0 = timer()
            m = cache.match_prefix(params)
            t1 = timer()
            t_match.append(t1 - t0)
            req = Request(prompt, output, m.last_device_node, m.device_indices)
            for step in steps:
                step.after_match(run, req, m)
            t0 = timer()
            lock = cache.inc_lock_ref(req.node)
            t1 = timer()
            t_lock.append(t1 - t0)
            req.dec = lock.to_dec_params() if hasattr(lock, "to_dec_params") else None
            req.matched = matched = len(req.indices)
            stats.prompt_tokens += len(prompt)
            stats.hit_tokens += matched
            req.need = -(-(len(prompt) + len(output) - matched) // ps) * ps
            if room is not None:
                room.make_room(run, req)
            else:
                short = req.need - allocator.available_size()
                if short > 0:
                    run.evict(req, num_tokens=short)
            admitted = all([step.admit(run, req) for step in steps])
            fresh = allocator.alloc(req.need) if admitted else None
            extra: tuple[int, ...] = ()
            for step in steps:
                extra += step.admitted_fields(req)
            record(1, matched, req.evicted, *extra)
            if fresh is None:
                for step in steps:
                    step.aborted(run, req)
                t0 = timer()
                cache.dec_lock_ref(req.node, req.dec)
                t1 = timer()
                t_unlock.append(t1 - t0)
                record(3, 0, 0)
                stats.aborted += 1
            else:
                req.tokens = prompt + output
                req.slots = values.cat(req.indices, fresh)
                running.append(req)
                cached: tuple[int, ...] = ()
                for step in steps:
                    cached += step.prefilled(run, req)
                if cached:
                    record(4, req.matched, *cached)
            for step in steps:
                step.request_done(run)
        while running:
            finish(running.popleft())
        stats.wall_seconds = time.perf_counter() - wall0
    if alloc is not None:
        stats.alloc_seconds = alloc.stop()
        stats.alloc_pools = alloc.by_pool()
        stats.alloc_calls = dict(pool_timing.TIMING.calls)
    if cost:  # the cpu clock: each sample less the clock's own cost (never below 0)
        for times in stats.op_times.values():
            times[:] = [max(0.0, t - cost) for t in times]
    stats.seconds = sum(sum(ts) for ts in stats.op_times.values())
    stats.digest = digest.hexdigest()
    stats.pool_free_seconds = pool.free_seconds
    held = getattr(allocator, "full_available_size", allocator.available_size)  # (SWA: Full)
    stats.cached_tokens = workload.kv_slots - held()
    stats.free_calls = None if free_calls is None else free_calls[0]
    if keep is not None:
        keep.extend((cache, allocator, pool) + tuple(built[2:]))
    return stats


# --------------------------------------------------------------------------------------------
# Side-by-side comparison
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    workload: str
    page_size: int
    requests: int
    kv_slots: int
    runs: dict  # impl -> [BenchStats], one per repeat
    missing: dict  # impl -> why it was not measured
    identical: bool = True
    mismatches: list = dataclasses.field(default_factory=list)
    # outcomes of speed peers (PEERS) that differ from the conforming ones: reported, not failed
    peer_differences: list = dataclasses.field(default_factory=list)
    allocator: str = "freelist"  # the KV allocator of fast / upstream (ALLOCATORS)
    device: str = "cpu"  # where their values and allocator live (DEVICES)
    clock: str = "wall"  # what the calls were timed with (CLOCKS)
    # how this configuration drives the implementations, where that is a rule of its own (the
    # host tier's load back: conformance/bench/host.py LOAD_BACK_RULE); in the JSON and output
    notes: list = dataclasses.field(default_factory=list)
    alloc_time: bool = False  # --alloc-time: the runs measured the time inside the allocator
    gc: str = "freeze"  # the collector around each run (GC_MODES, gc_during_run)

    def median_rps(self, impl: str) -> float:
        return statistics.median(s.requests_per_s for s in self.runs[impl])

    def median_rps_ex_pool(self, impl: str) -> float:
        return statistics.median(s.requests_per_s_ex_pool for s in self.runs[impl])

    def median_pool_share(self, impl: str) -> float:
        return statistics.median(s.pool_share for s in self.runs[impl])

    def median_ops_us(self, impl: str) -> dict[str, float]:
        per_run = [s.op_medians_us() for s in self.runs[impl]]
        ops = list(dict.fromkeys(op for d in per_run for op in d))  # OPS, plus the host tier's
        return {op: statistics.median(d[op] for d in per_run if op in d) for op in ops}

    def median_alloc_seconds(self, impl: str) -> float | None:
        """The median over rounds of the seconds ``impl``'s timed calls spent inside the
        allocator's frees (None: not measured)."""
        got = [s.alloc_seconds for s in self.runs.get(impl, []) if s.alloc_seconds is not None]
        return statistics.median(got) if got else None

    def median_alloc_share(self, impl: str) -> float | None:
        """The median over rounds of ``impl``'s share of its timed seconds inside the pools'
        frees (None: not measured)."""
        return pool_timing.median_or_none(s.alloc_share for s in self.runs.get(impl, []))

    def median_rps_ex_alloc(self, impl: str) -> float | None:
        """The median over rounds of ``impl``'s requests/s without its time inside the
        pools' frees (None: not measured)."""
        return pool_timing.median_or_none(s.requests_per_s_ex_alloc
                                         for s in self.runs.get(impl, []))

    def cap(self, a: str = "fast", b: str = "upstream") -> float | None:
        """``b``'s median timed seconds over ``a``'s median seconds inside the allocator's frees:
        the most ``a``/``b`` could reach if everything ``a`` does besides those frees (which
        ``b`` pays too) cost nothing.  None where not measured or the outcomes differ."""
        mine = self.median_alloc_seconds(a)
        if not self.identical or mine is None or b not in self.runs or not self.runs[b]:
            return None
        theirs = statistics.median(s.seconds for s in self.runs[b])
        return theirs / mine if mine > 0 else None

    def ratio(self, a: str, b: str) -> float | None:
        """req/s of ``a`` over ``b``; None when either was not measured, or when both are
        conforming implementations whose outcomes differ (a speed ratio over different work
        means nothing: ``ratios_withheld`` in the summary says so)."""
        if not self.identical and a not in PEERS and b not in PEERS:
            return None
        if a in self.runs and b in self.runs and self.median_rps(b):
            return self.median_rps(a) / self.median_rps(b)
        return None

    def summary(self) -> dict:
        first = {impl: runs[0] for impl, runs in self.runs.items()}
        # a run off the CPU is its own configuration for the dashboard (conformance/bench/results.py
        # reads "<workload>+<config>"): its numbers are not comparable with the CPU figures
        workload = self.workload if self.device == "cpu" else f"{self.workload}+{self.device}"
        return {
            "workload": workload, "page_size": self.page_size, "requests": self.requests,
            "kv_slots": self.kv_slots, "repeats": max((len(r) for r in self.runs.values()), default=0),
            "allocator": self.allocator, "device": self.device, "clock": self.clock,
            "gc": self.gc, "identical_outcomes": self.identical, "mismatches": self.mismatches,
            "ratios_withheld": (None if self.identical else
                                "the outcomes differ (mismatches): no speed ratio between "
                                "conforming implementations"),
            "notes": self.notes,
            "alloc_time": self.alloc_time,
            "cap": None if self.cap() is None else round(self.cap() or 0.0, 3),
            "peer_differences": self.peer_differences,
            "missing": self.missing,
            "impls": {impl: {
                "version": first[impl].version,
                "requests_per_s_median": round(self.median_rps(impl), 1),
                "requests_per_s_runs": [round(s.requests_per_s, 1) for s in runs],
                "requests_per_s_ex_pool_median": round(self.median_rps_ex_pool(impl), 1),
                "pool_free_share_median": round(self.median_pool_share(impl), 4),
                "op_median_us": {k: round(v, 2) for k, v in self.median_ops_us(impl).items()},
                "hit_rate": round(first[impl].hit_rate, 6),
                "evicted_tokens": first[impl].evicted_tokens,
                "free_calls": first[impl].free_calls,
                "alloc_s_median": (None if self.median_alloc_seconds(impl) is None
                                   else round(self.median_alloc_seconds(impl) or 0.0, 6)),
                "alloc_share_median": _round_or_none(self.median_alloc_share(impl), 4),
                "requests_per_s_ex_alloc_median": _round_or_none(self.median_rps_ex_alloc(impl),
                                                                 1),
                "alloc_s_by_pool_median": {
                    pool: round(statistics.median(s.alloc_pools.get(pool, 0.0) for s in runs), 6)
                    for pool in pool_timing.POOLS if any(pool in s.alloc_pools for s in runs)},
                "aborted": first[impl].aborted,
                "digest": first[impl].digest,
                "runs": [s.summary() for s in runs],
            } for impl, runs in self.runs.items()},
            "ratios": {k: (None if v is None else round(v, 3)) for k, v in (
                ("fast/spec", self.ratio("fast", "spec")),
                ("fast/upstream", self.ratio("fast", "upstream")),
                ("upstream/spec", self.ratio("upstream", "spec")),
                ("fast/upstream-rust", self.ratio("fast", "upstream-rust")),
                ("fast/upstream-cpp", self.ratio("fast", "upstream-cpp")),
                *((f"{name}/fast", self.ratio(name, "fast")) for name in OBSERVED
                  if name in self.runs),
                *((f"{name}/fast+pytree", self.ratio(name, "fast+pytree"))
                  for name in ("fast+events", "fast+events+metrics")
                  if name in self.runs and "fast+pytree" in self.runs))},
        }


def check_identical(stats: Iterable[BenchStats]) -> list[str]:
    """Differences in what every implementation must reproduce, against the first run."""
    stats = list(stats)
    if not stats:
        return []
    ref = stats[0]
    out = []
    for s in stats[1:]:
        a, b = ref.outcome(), s.outcome()
        diff = [k for k in a if a[k] != b[k]]
        if diff:
            out.append(f"{s.impl} differs from {ref.impl} on {s.workload} page {s.page_size}: "
                       + ", ".join(f"{k} {a[k]} vs {b[k]}" for k in diff))
    return out


def compare(impls: Sequence[str], workload: BenchWorkload, repeats: int = 3,
            strict: bool = True, log: Callable[[str], None] | None = None,
            repeats_for: dict | None = None, allocator: str = "freelist",
            device: str = "cpu", config: Any = None, clock: str = "wall",
            alloc_time: bool = False, gc_mode: str = "freeze") -> Comparison:
    """Run every available implementation ``repeats`` times on ``workload`` (``repeats_for``
    overrides that per implementation), alternating them and rotating the order each round so
    that machine noise hits all alike; fast and upstream over the KV allocator ``allocator``
    (:data:`ALLOCATORS`) on ``device`` (:data:`DEVICES`), in the configuration ``config`` (a
    :class:`~uniradix.conformance.bench.configs.BenchConfig`; None: Full on the device tier).
    An implementation that refuses the configuration or cannot be built is recorded in
    ``missing`` with the reason.  ``clock`` (:data:`CLOCKS`) times the calls; ``alloc_time``
    also the time inside the allocator's frees (:class:`AllocTimer`); ``gc_mode`` the collector
    around each run (:func:`gc_during_run`).  Raises
    :class:`ConformanceMismatch` (when ``strict``) if any outcome differs."""
    repeats_for = dict(repeats_for or {})
    bundles, missing = {}, {}
    label = "" if config is None else config.name
    for impl in impls:
        try:
            if config is None or config.is_full:
                bundles[impl] = get_bundle(impl, allocator, device)
            else:
                from uniradix.conformance.bench.configs import config_bundle
                bundles[impl] = config_bundle(impl, config, workload.page_size, allocator)
        except ImplMissing as e:
            missing[impl] = str(e)
    cmp = Comparison(workload_label(workload.name, label), workload.page_size, workload.requests,
                     workload.kv_slots, {impl: [] for impl in bundles}, missing,
                     allocator=allocator, device=device, clock=clock, alloc_time=alloc_time,
                     gc=gc_mode)
    if config is not None and config.hicache:
        from uniradix.conformance.bench.host import LOAD_BACK_RULE
        cmp.notes.append(LOAD_BACK_RULE)
        if allocator == "sglang":
            from uniradix.conformance.bench.sglang_alloc import CONTROLLER_NOTE
            cmp.notes.append(CONTROLLER_NOTE)
    order = list(bundles)
    rounds = max([repeats_for.get(i, repeats) for i in order] or [0])
    for rep in range(rounds):
        k = rep % len(order) if order else 0
        for impl in order[k:] + order[:k]:
            if rep >= repeats_for.get(impl, repeats) or impl in cmp.missing:
                continue
            try:
                s = run_bench(bundles[impl], workload, clock=clock, alloc_time=alloc_time,
                              gc_mode=gc_mode)
            except Exception as e:  # a speed peer may not take this workload at all
                if impl not in PEERS:
                    raise
                why = (str(e).strip().splitlines() or [""])[0][:160]
                cmp.missing[impl] = f"failed on {workload.name}: {type(e).__name__}: {why}"
                del cmp.runs[impl]
                continue
            cmp.runs[impl].append(s)
            if log is not None:
                log(f"  {cmp.workload} p{workload.page_size} round {rep + 1}/{rounds} "
                    f"{impl:<8} {s.requests_per_s:>10.1f} req/s  ({s.wall_seconds:.1f} s wall)")
    every = [s for impl, runs in cmp.runs.items() if impl not in PEERS for s in runs]
    cmp.mismatches = check_identical(every)
    cmp.peer_differences = check_identical(
        every[:1] + [s for impl, runs in cmp.runs.items() if impl in PEERS for s in runs[:1]])
    cmp.identical = not cmp.mismatches
    if strict and cmp.mismatches:
        raise ConformanceMismatch("; ".join(cmp.mismatches))
    return cmp


# --------------------------------------------------------------------------------------------
# Memory: bytes per cached token of the tree's own structures
# --------------------------------------------------------------------------------------------


def _is_shared_object(obj: Any) -> bool:
    """Objects that belong to the program, not to one tree: not counted, not walked."""
    import types
    return isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                            types.MethodType, types.CodeType, types.FrameType,
                            types.MethodDescriptorType, types.WrapperDescriptorType,
                            types.GetSetDescriptorType, types.MemberDescriptorType))


def deep_sizeof(root: Any, exclude: Iterable[Any] = ()) -> int:
    """Bytes reachable from ``root``: ``sys.getsizeof`` of every distinct object reachable
    through ``gc.get_referents`` (plus instance ``__dict__``\\ s), and for torch tensors the
    bytes of each distinct storage once. Types, modules, functions and code are neither
    counted nor walked; nor is anything in ``exclude`` (or reachable only through it)."""
    torch = sys.modules.get("torch")
    tensor_type = torch.Tensor if torch is not None else ()
    seen = {id(x) for x in exclude}
    storages: set = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or _is_shared_object(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if tensor_type and isinstance(obj, tensor_type):
            st = obj.untyped_storage()
            key = st.data_ptr()
            if key not in storages:
                storages.add(key)
                total += st.nbytes()
            continue
        d = getattr(obj, "__dict__", None) if not isinstance(obj, dict) else None
        if isinstance(d, dict):
            stack.append(d)
        stack.extend(gc.get_referents(obj))
    return total


@dataclasses.dataclass
class MemoryReport:
    impl: str
    page_size: int
    requests: int
    cached_tokens: int
    tree_bytes: int
    config: str = "full"  # the bench configuration (conformance/bench/configs.py)

    @property
    def bytes_per_token(self) -> float:
        return self.tree_bytes / self.cached_tokens if self.cached_tokens else 0.0

    def summary(self) -> dict:
        return {"impl": self.impl, "config": self.config, "page_size": self.page_size,
                "requests": self.requests, "cached_tokens": self.cached_tokens,
                "tree_bytes": self.tree_bytes,
                "bytes_per_token": round(self.bytes_per_token, 2)}


def memory_per_token(impl: str, page_size: int = 16, requests: int = 100,
                     config: Any = None) -> MemoryReport:
    """Bytes per cached token of the tree's own structures, in the configuration ``config``
    (a :class:`~uniradix.conformance.bench.configs.BenchConfig`; None: Full on the device
    tier).

    Method: the first ``requests`` requests of the Mooncake trace go through :func:`run_bench`
    with a pool large enough that nothing is evicted (with SWA, twice that: the SWA pool is
    half the KV pool); then :func:`deep_sizeof` walks the cache object (tree nodes, keys,
    values, host values, and whatever indexes the implementation keeps: leaf sets, LRU lists,
    counters), excluding the world: the allocators (an SWA allocator's sub-allocators too) and
    the environment's pool, the Mamba request pool, the host pools (the aux ones too, wherever
    the implementation keeps them), and for upstream the bench's model of its
    cache controller (conformance/adapters/upstream_host.py; fast's own controller is fast's
    and is counted).
    The total is divided by the KV slots the tree holds.  A deep getsizeof walk rather than
    tracemalloc, because tracemalloc does not see torch's tensor storage (allocated outside
    Python's allocators); the walk counts each tensor storage once at its full size.  Memory an
    implementation holds outside Python objects and torch storages (a C++ tree, say) is seen
    only as far as its objects' ``__sizeof__`` report it, so speed peers (:data:`PEERS`) are
    not measured.
    """
    if impl in PEERS:
        raise ImplMissing(f"{impl}: its tree lives in C++ memory that a getsizeof walk cannot see")
    if config is None or config.is_full:
        bundle, name, aux = get_bundle(impl), "full", False
    else:
        from uniradix.conformance.bench.configs import config_bundle
        bundle, name, aux = config_bundle(impl, config, page_size), config.name, bool(config.aux)
    base = mooncake_workload(page_size, requests)
    rows = mooncake_rows()[:base.requests]
    room = sum(-(-(i + o) // page_size) * page_size for i, o, _ in rows) + page_size
    w = dataclasses.replace(base, kv_slots=2 * room if aux else room)
    keep: list = []
    stats = run_bench(bundle, w, keep=keep)
    if stats.evicted_tokens or stats.aborted:
        raise AssertionError(f"memory run evicted {stats.evicted_tokens} tokens")
    cache, *world = keep
    controller = getattr(cache, "cache_controller", None)
    if controller is not None:
        host = getattr(controller, "mem_pool_host", None)
        world.append(host)
        world.extend(e.host_pool for e in (getattr(host, "entry_map", None) or {}).values())
        if type(controller).__module__.startswith("uniradix.conformance"):
            world.append(controller)  # the bench's model of upstream's controller
    # the world's parts that the tree reaches by another way than through the objects above:
    # an SWA allocator's two sub-allocators (fast's host tier keeps the full one), and each
    # aux component's host pool (fast keeps it on the component; upstream's is in entry_map)
    for x in list(world):
        world.extend(getattr(x, name, None) for name in ("full_attn_allocator",
                                                          "swa_attn_allocator"))
    world.extend(getattr(c, "host_allocator", None) for c in getattr(cache, "components", ()))
    gc.collect()
    tree_bytes = deep_sizeof(cache, exclude=[x for x in world if x is not None])
    return MemoryReport(impl, page_size, w.requests, stats.cached_tokens, tree_bytes, name)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _page_sizes(value: str) -> list[int]:
    try:
        out = [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"page sizes must be integers, got {value!r}") from None
    if not out or any(p < 1 for p in out):
        raise argparse.ArgumentTypeError(f"page sizes must be >= 1, got {value!r}")
    return out


def _choices(what: str, known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty list of names out of ``known``."""
    def parse(value: str) -> list[str]:
        out = _csv(value)
        if not out or any(v not in known for v in out):
            raise argparse.ArgumentTypeError(f"{what} are {', '.join(known)}; got {value!r}")
        return out
    return parse


_impls = _choices("implementations", KNOWN_IMPLS)
_workloads = _choices("workloads", WORKLOADS)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to a ``uniradix`` subcommand parser set."""
    b = subparsers.add_parser(
        "bench", help="requests/s of cache work per implementation, side by side",
        description="Run the same scheduler loop over upstream's tree-level API on each "
                    "implementation, alternating them, and compare requests/s of cache work, "
                    "per-op medians and hit rates (conformance/bench/loop.py says what is timed).")
    b.add_argument("--impl", type=_impls, default=list(IMPLS),
                   help="comma-separated implementations (default spec,fast,upstream; those "
                        "that cannot be built here are reported and skipped). upstream-rust: "
                        "upstream's cache on its Rust tree core (sglang 0.5.17+); upstream-cpp: "
                        "upstream's C++ radix tree, a speed peer whose outcomes may differ")
    b.add_argument("--workload", type=_workloads, default=["shared-prefix"],
                   help="shared-prefix or mooncake, or both comma-separated (default shared-prefix)")
    b.add_argument("--page-size", type=_page_sizes, default=[1, 16],
                   help="comma-separated page sizes (default 1,16)")
    b.add_argument("--requests", "--limit", dest="requests", type=int, default=None,
                   help="requests per run (shared-prefix: scaled workload below 20000; mooncake: "
                        "the first N of 12031). Default: the whole workload")
    b.add_argument("--repeat", type=int, default=3,
                   help="rounds per implementation, alternating (default 3; medians reported)")
    b.add_argument("--spec-repeat", type=int, default=None,
                   help="rounds for the spec, which is 10-100x slower (default: --repeat)")
    b.add_argument("--memory", action="store_true",
                   help="also report bytes per cached token of each tree (Mooncake, no eviction)")
    b.add_argument("--memory-requests", type=int, default=100,
                   help="Mooncake requests for --memory (default 100)")
    b.add_argument("--hicache", choices=["write_through", "write_back"], default=None,
                   help="with a host tier of twice the device pool and this write policy "
                        "(conformance/bench/host.py; fast and upstream)")
    b.add_argument("--allocator", choices=ALLOCATORS, default="freelist",
                   help="the KV allocator under fast and upstream: freelist (the bench's own, "
                        "default) or sglang (sglang's TokenToKVPoolAllocator at page 1, "
                        "PagedTokenToKVPoolAllocator above; with SWA, Mamba and a host tier "
                        "its SWA allocator, request pool and host pools: "
                        "conformance/bench/sglang_alloc.py; needs sglang; the spec stays on "
                        "the pool model)")
    b.add_argument("--torch-threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads for every implementation (default 1: more "
                        "threads give every implementation multi-ms tails on long index "
                        "tensors); recorded in the JSON")
    b.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="what each timed cache call is measured with: wall (time.perf_counter, "
                        "default) or cpu (time.thread_time: this thread's CPU time, which other "
                        "processes on a shared machine do not inflate, less the clock's own "
                        "cost per call); recorded in the JSON")
    b.add_argument("--gc", choices=GC_MODES, default="freeze", dest="gc_mode",
                   help="the garbage collector around each measured run, for every "
                        "implementation alike: freeze (default: a full collection, then "
                        "gc.freeze() so collections during the run walk only what the run "
                        "made, as SGLang's /freeze_gc in a warmed-up server) or collect (a full "
                        "collection only, the bench before 2026-12-04); the collector stays on "
                        "either way; recorded in the JSON")
    b.add_argument("--alloc-time", action="store_true",
                   help="also time what the timed calls spend inside the KV allocator's frees "
                        "(its free() calls, and the C core's direct writes into sglang's "
                        "allocators' lists that stand for them), per run and for evict and "
                        "insert, on the --clock; prints the cap: upstream's timed seconds over "
                        "fast's seconds inside the frees. Every configuration: also the SWA "
                        "allocator's, the Mamba state allocator's and the host pools' frees; "
                        "in the JSON")
    b.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the scheduler loop's value tensors and the KV allocator of fast "
                        "and upstream live (default cpu; cuda: the production setting, refused "
                        "with status 2 where torch sees no CUDA device; the spec is CPU only; "
                        "Full only); a cuda comparison is the dashboard configuration "
                        "'<workload>+cuda'")
    b.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no further comparison once this many seconds have passed (the "
                        "skipped ones are listed in the JSON's 'skipped'); with --json the file "
                        "is rewritten after every comparison, so a run cut short keeps what it "
                        "measured. Default: no budget")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    b.add_argument("--events", action="store_true",
                   help="also run fast with KV events on (drained once per request), with "
                        "metrics on, with both, and on the composed Python tree without them "
                        "(fast+pytree: where events run), alternating with plain fast in the "
                        "same rounds; the JSON's ratios give '<name>/fast' and "
                        "'fast+events/fast+pytree' (the overheads). Full on the device tier, "
                        "the freelist allocator; needs fast in --impl")
    b.add_argument("--components", choices=COMPONENT_CHOICES, default="full",
                   help="hybrid models: swa, mamba or swa+mamba (Full+SWA+Mamba) runs fast and "
                        "upstream only (conformance/bench/hybrid.py; default full); combines "
                        "with --hicache where an implementation declares it")
    b.add_argument("--matrix", action="store_true",
                   help="every configuration (conformance/bench/configs.py MATRIX: full, swa, "
                        "mamba, swa+mamba, write_through, write_back, and the host tier with "
                        "swa and with mamba) on each --workload and --page-size; an "
                        "implementation that refuses one is recorded with the reason. Not "
                        "with --components or --hicache")
    b.set_defaults(func=cmd_bench)
    return b


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def print_comparison(cmp: Comparison, out=None) -> None:
    out = sys.stdout if out is None else out
    p = lambda s="": print(s, file=out)  # noqa: E731
    where = "" if getattr(cmp, "device", "cpu") == "cpu" else f" (values and allocator on {cmp.device})"
    p(f"{cmp.workload}{where}, page {cmp.page_size}: {cmp.requests} requests, {cmp.kv_slots}-token pool, "
      f"{max((len(r) for r in cmp.runs.values()), default=0)} rounds (medians)")
    w = max([9] + [len(i) + 1 for i in list(cmp.runs) + list(cmp.missing)])
    p(f"  {'impl':<{w}}{'rounds':>6}{'req/s':>10}{'ex-pool':>10}{'pool%':>6}  "
      + "".join(f"{op + ' us':>11}" for op in OPS)
      + f"{'hit rate':>10}{'evicted':>11}{'aborted':>8}")
    for impl, runs in cmp.runs.items():
        med = cmp.median_ops_us(impl)
        s = runs[0]
        # --alloc-time: ex-pool and pool% are the time inside the pools' frees where measured
        ex, share = cmp.median_rps_ex_alloc(impl), cmp.median_alloc_share(impl)
        if ex is None or share is None:
            ex, share = cmp.median_rps_ex_pool(impl), cmp.median_pool_share(impl)
        p(f"  {impl:<{w}}{len(runs):>6}{cmp.median_rps(impl):>10.1f}"
          f"{ex:>10.1f}{100 * share:>6.1f}  "
          + "".join(f"{med[op]:>11.1f}" if op in med else f"{'-':>11}" for op in OPS)
          + f"{s.hit_rate:>10.4f}{s.evicted_tokens:>11}{s.aborted:>8}")
    for impl, why in cmp.missing.items():
        p(f"  {impl:<{w}}not measured: {why}")
    p("  req/s: finished requests / summed time of the cache calls; ex-pool: the same without "
      "the pool's frees (pool%)"
      + ("; with --alloc-time, for fast and upstream, the pools' frees they measured"
         if cmp.alloc_time else ""))
    for note in cmp.notes:
        p(f"  note: {note}")
    if not cmp.identical:
        p("  ratios (req/s): withheld, the outcomes differ (below): the implementations did "
          "different work"
          + "".join(f"; fast/{peer} {_fmt_ratio(cmp.ratio('fast', peer))} (speed peer)"
                    for peer in PEERS if peer in cmp.runs))
    else:
        p(f"  ratios (req/s): fast/spec {_fmt_ratio(cmp.ratio('fast', 'spec'))}, "
          f"fast/upstream {_fmt_ratio(cmp.ratio('fast', 'upstream'))}, "
          f"upstream/spec {_fmt_ratio(cmp.ratio('upstream', 'spec'))}"
          + "".join(f", fast/{peer} {_fmt_ratio(cmp.ratio('fast', peer))}"
                    for peer in ("upstream-rust", "upstream-cpp") if peer in cmp.runs))
    observed = [name for name in OBSERVED if name in cmp.runs]
    if observed:  # --events: the overhead of events / metrics over plain fast
        p("  events and metrics (req/s, same rounds): "
          + ", ".join(f"{name}/fast {_fmt_ratio(cmp.ratio(name, 'fast'))}" for name in observed)
          + (f"; on the composed tree: fast+events/fast+pytree "
             f"{_fmt_ratio(cmp.ratio('fast+events', 'fast+pytree'))}"
             if "fast+events" in cmp.runs and "fast+pytree" in cmp.runs else ""))
    counted = [(impl, runs[0].free_calls) for impl, runs in cmp.runs.items()
               if runs[0].free_calls is not None]
    if counted:
        p(f"  allocator: {cmp.allocator}; its free() calls per run from the timed cache calls: "
          + ", ".join(f"{impl} {n}" for impl, n in counted))
    timed = [impl for impl in cmp.runs if cmp.median_alloc_seconds(impl) is not None]
    if timed:  # --alloc-time
        parts = []
        for impl in timed:
            runs = cmp.runs[impl]
            inside = cmp.median_alloc_seconds(impl) or 0.0
            total = statistics.median(s.seconds for s in runs)
            ops = {op: statistics.median(s.op_alloc_seconds.get(op, 0.0) for s in runs)
                   for op in ("evict", "insert")}
            parts.append(f"{impl} {inside:.4f} of {total:.4f} s ({100 * inside / total:.1f}%"
                         if total else f"{impl} {inside:.4f} s (")
            parts[-1] += "; " + ", ".join(f"{op} {v:.4f}" for op, v in ops.items())
            pools = {pool: statistics.median(s.alloc_pools.get(pool, 0.0) for s in runs)
                     for pool in pool_timing.POOLS if any(pool in s.alloc_pools for s in runs)}
            parts[-1] += "; " + ", ".join(f"{k} {v:.4f}" for k, v in pools.items()) + ")"
        p("  inside the allocator's frees (medians): " + "; ".join(parts))
        if cmp.cap() is not None:
            p(f"  cap: upstream's timed seconds / fast's seconds inside the allocator's frees = "
              f"{_fmt_ratio(cmp.cap())} (fast/upstream if nothing else fast does cost anything)")
    names = ", ".join(i for i in cmp.runs if i not in PEERS)
    if not cmp.runs:
        p("  nothing measured (every implementation refused or could not be built)")
    elif cmp.identical:
        p(f"  identical hit rate, evictions, aborts and per-request digest across {names}: yes")
    else:
        p("  OUTCOMES DIFFER: " + "; ".join(cmp.mismatches))
    for diff in cmp.peer_differences:
        p(f"  (speed peer, not a conforming implementation) {diff}")


def bench_configs(args: argparse.Namespace) -> list:
    """The configurations a ``bench`` command line asks for (``BenchConfig`` objects)."""
    from uniradix.conformance.bench.configs import MATRIX, BenchConfig
    if getattr(args, "matrix", False):
        return list(MATRIX)
    comps = getattr(args, "components", "full")
    aux = () if comps == "full" else tuple(comps.split("+"))
    return [BenchConfig(("full",) + aux, getattr(args, "hicache", None))]


def cmd_bench(args: argparse.Namespace) -> int:
    say = lambda s: print(f"uniradix bench: {s}", file=sys.stderr)  # noqa: E731
    if getattr(args, "matrix", False) and (getattr(args, "hicache", None)
                                           or getattr(args, "components", "full") != "full"):
        say("--matrix runs every configuration; it takes no --components or --hicache")
        return 2
    configs = bench_configs(args)
    only_full = all(c.is_full for c in configs)
    allocator = getattr(args, "allocator", "freelist")
    threads = getattr(args, "torch_threads", 1)
    if threads < 1:
        say(f"--torch-threads must be at least 1, got {threads}")
        return 2
    device = getattr(args, "device", "cpu")
    if device != "cpu" and getattr(args, "clock", "wall") == "cpu":
        say(f"--clock cpu with --device {device}: CPU time leaves out the time a call waits on "
            f"the device; use --clock wall")
        return 2
    if device != "cpu":
        if not only_full:
            say(f"--device {device} runs the Full configuration only (the host tier and hybrid "
                f"benches build their own allocators on the CPU)")
            return 2
        why = cuda_problem()
        if why is not None:
            say(f"--device {device} is not available: {why}")
            return 2
    if getattr(args, "events", False):
        if "fast" not in args.impl:
            say("--events compares fast with events and metrics on against plain fast: "
                "--impl must include fast")
            return 2
        if not only_full or allocator != "freelist":
            say("--events runs the Full configuration over the freelist allocator only")
            return 2
        args.impl = list(args.impl) + [n for n in OBSERVED if n not in args.impl]
    alloc_time = getattr(args, "alloc_time", False)
    budget = getattr(args, "budget", None)
    if budget is not None and budget <= 0:
        say(f"--budget must be positive, got {budget}")
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    clock = getattr(args, "clock", "wall")
    gc_mode = getattr(args, "gc_mode", "freeze")
    results: dict = {"comparisons": [], "memory": [], "allocator": allocator, "device": device,
                     "clock": clock, "gc": gc_mode}
    if "fast" in args.impl:  # the C core, or the pure-Python fallback (a Python it was not
        try:                 # built for, or UNIRADIX_PURE_PYTHON=1)
            from uniradix.fast.cache import NATIVE
            results["fast_core"] = "C" if NATIVE else "pure Python"
        except ImportError:
            pass
    started = time.perf_counter()
    torch = _torch_or_none()
    if torch is not None:
        torch.set_num_threads(threads)
        results["torch_threads"] = torch.get_num_threads()
        log(f"torch intra-op threads: {results['torch_threads']}; allocator: {allocator}; "
            f"device: {device}; clock: {clock}; gc: {gc_mode}")
    status = 0
    for config in configs:
        for wname in args.workload:
            for ps in args.page_size:
                where = f"{workload_label(wname, config.name)} page {ps}"
                if budget is not None and time.perf_counter() - started > budget:
                    results.setdefault("skipped", []).append(
                        f"{where}: the {budget:g} s budget was spent")
                    print(f"{where}: skipped, the {budget:g} s budget was spent\n")
                    continue
                workload = make_workload(wname, ps, args.requests)
                spec_rounds = {} if args.spec_repeat is None else {"spec": max(1, args.spec_repeat)}
                cmp = compare(args.impl, workload, repeats=max(1, args.repeat), strict=False,
                              log=log, repeats_for=spec_rounds, allocator=allocator,
                              device=device, config=None if config.is_full else config,
                              clock=clock, alloc_time=alloc_time, gc_mode=gc_mode)
                print_comparison(cmp)
                if config.hicache:
                    from uniradix.conformance.bench.host import print_host_ops
                    print_host_ops(cmp)
                summary = cmp.summary()
                if torch is not None:  # every step and implementation must have left the pin
                    summary["torch_threads"] = torch.get_num_threads()
                    if summary["torch_threads"] != threads:
                        print(f"  TORCH THREADS CHANGED during this comparison: {threads} "
                              f"pinned, {summary['torch_threads']} after it (pinned again)")
                        torch.set_num_threads(threads)
                        status = 1
                print()
                results["comparisons"].append(summary)
                for impl, why in summary["missing"].items():  # at the top too
                    results.setdefault("not_measured", {}).setdefault(impl, why)
                if not cmp.identical:
                    status = 1
                if args.json and budget is not None:
                    write_json(args.json, results, quiet=True)
    if args.memory:
        print(f"memory: bytes per cached token of the tree (Mooncake, first "
              f"{args.memory_requests} requests, no eviction; deep getsizeof walk)")
        for config in configs:
            for impl in args.impl:
                for ps in args.page_size:
                    try:
                        rep = memory_per_token(impl, ps, args.memory_requests,
                                               None if config.is_full else config)
                    except ImplMissing as e:
                        print(f"  {config.name:<20}{impl:<13}page {ps:>3}: not measured: {e}")
                        results.setdefault("memory_not_measured", []).append(
                            {"impl": impl, "config": config.name, "page_size": ps,
                             "why": str(e)})
                        continue
                    print(f"  {config.name:<20}{impl:<13}page {ps:>3}: "
                          f"{rep.bytes_per_token:>8.1f} bytes/token "
                          f"({rep.tree_bytes} bytes for {rep.cached_tokens} tokens)")
                    results["memory"].append(rep.summary())
    if getattr(args, "matrix", False):
        from uniradix.conformance.bench.configs import matrix_table
        print("\nmatrix: fast's requests/s and its ratio to each peer (medians), bytes per "
              "cached token")
        print("\n".join(matrix_table(results)))
    if alloc_time and len(results["comparisons"]) > 1:
        print("\nwhere the time goes (--alloc-time, medians; conformance/bench/alloc_time.py)")
        print("\n".join(pool_timing.alloc_table(results)))
    if args.json:
        write_json(args.json, results)
    return status


def write_json(path: str, results: dict, quiet: bool = False) -> None:
    """Write results for dashboards (creating the folder) and say where (unless ``quiet``)."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    if not quiet:
        print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m uniradix.conformance.bench.loop ...``: the same as ``uniradix bench ...``."""
    return subcommand_main("bench", add_bench_parser, argv)


if __name__ == "__main__":
    # run the imported module, not this __main__ copy: configs.py, host.py and hybrid.py import
    # uniradix.conformance.bench.loop, whose ImplMissing and Step must be the ones compare uses
    from uniradix.conformance.bench import loop as _loop
    sys.exit(_loop.main())
