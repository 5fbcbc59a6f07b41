"""SWA and Mamba as steps of the scheduler loop (conformance/bench/loop.py): ``uniradix bench
--components swa|mamba|swa+mamba`` and every configuration with an aux component
(conformance/bench/configs.py builds ``fast`` and upstream's cache, the seed-era SWA component,
for them).  The spec's upstream-style wrapper has the Full component only, so the spec is not
measured here.

What a hybrid model adds to the loop (same workloads, same timing: only the cache calls are
timed, the pool frees they trigger included):

* **SWA** (:class:`SwaStep`; window 512, an SWA pool of half the KV pool): ``alloc(n)`` needs n
  full and n SWA slots; when either is short the loop evicts with ``num_tokens`` and
  ``swa_num_tokens`` set to the shortfalls.  :class:`SwaFreeListAllocator` is loop.py's free
  list twice (full, SWA) plus the full -> SWA map as a tensor; for upstream the same class is
  mixed into its ``SWATokenToKVPoolAllocator``.
* **Mamba** (:class:`MambaStep`; 256 state slots): each request takes a state slot at
  admission (evicting one state, ``mamba_num=1``, when none is free; aborting when still none),
  hands it to its insert as ``mamba_value`` and frees it when the insert answers
  ``mamba_exist``; the branching seqlen uses chunk size 64.  After admission (the prefill)
  it caches a copy of the state with the prompt, as a scheduler's ``cache_unfinished_req``
  does with the Mamba extra buffer (:meth:`MambaStep.prefilled`): that is what later
  requests sharing the prefix hit.

What must agree across implementations: hit rate, evicted tokens and, in the digest, each
request's matched length, Full and aux units evicted for it, insert ``prefix_len`` and
``mamba_exist``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

from uniradix.conformance.bench.alloc_time import harness_free, watch_pools, wrap
from uniradix.conformance.bench.loop import (
    ApiBundle,
    BenchStats,
    BenchWorkload,
    Comparison,
    FreeListAllocator,
    Request,
    Run,
    Step,
    compare,
    run_bench,
)

COMPONENTS = ("full", "swa", "mamba")
CHUNK = 64  # the Mamba chunk size (conformance/bench/configs.py's MAMBA_CHUNK)


class SwaFreeListAllocator(FreeListAllocator):
    """Full slots and SWA slots as two free lists, and the map full -> SWA (0 = none) as a
    tensor: ``free`` releases both, ``free_swa`` the SWA ones only, no per-slot Python work."""

    # a call reads and writes the map (torch calls each time): one call of a concatenation
    # costs less than a call per piece, so not the free list's QUEUE (fast/frees.py)
    uniradix_free_order = "append"

    def __init__(self, usable_slots: int, swa_slots: int, page_size: int, torch_module) -> None:
        FreeListAllocator.__init__(self, usable_slots, page_size, torch_module)
        self.swa = FreeListAllocator(swa_slots, page_size, torch_module)
        self.full_to_swa = torch_module.zeros(usable_slots + page_size, dtype=torch_module.int64)
        # the sides apart (SGLang's names), as a host tier's load back takes them
        self.full_attn_allocator = types.SimpleNamespace(
            alloc=self.alloc_full_only, free=self._free_full,
            available_size=self.full_available_size)
        self.swa_attn_allocator = self.swa
        self.is_not_in_free_group = True
        watch_pools(self)  # its frees counted (and with --alloc-time timed), nested ones once

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

    def alloc_full_only(self, need_size: int):
        """Full slots alone (a host tier's load back pairs the SWA slots it takes itself,
        :meth:`set_full_to_swa_mapping`)."""
        return FreeListAllocator.alloc(self, need_size)

    def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
        self.full_to_swa[full_indices] = swa_indices

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
        wrap(self.mamba_allocator, "free", "mamba")  # (as alloc_time.watch_pools)
        self.mamba_pool = self.mamba_allocator
        self.enable_mamba_extra_buffer = False


class SwaStep(Step):
    """Make room in both pools: evict the Full and the SWA shortfall in one call."""

    name = "swa"

    def make_room(self, run: Run, req: Request) -> None:
        alloc = run.allocator
        short_full = req.need - alloc.full_available_size()
        short_swa = req.need - alloc.swa_available_size()
        if short_full > 0 or short_swa > 0:
            run.evict(req, num_tokens=max(0, short_full), swa_num_tokens=max(0, short_swa))

    def count_evicted(self, req: Request, result: Any) -> None:
        req.aux_evicted["swa"] = (req.aux_evicted.get("swa", 0)
                                  + int(result.swa_num_tokens_evicted))

    def admitted_fields(self, req: Request) -> tuple[int, ...]:
        return (req.aux_evicted.get("swa", 0),)


class MambaStep(Step):
    """A state slot per request: taken at admission (one state evicted when none is free),
    handed to the insert, freed when the insert answers ``mamba_exist``."""

    name = "mamba"

    def start(self, run: Run) -> None:
        req_pool = run.parts[0]
        self.states: Any = req_pool.mamba_allocator
        self._branching: dict[int, int] = {}  # id(request) -> its match's branching seqlen

    def admit(self, run: Run, req: Request) -> bool:
        if req.state is not None:  # a host tier's load back gave it one
            return True
        req.state = self.states.alloc(1)
        if req.state is None:
            run.evict(req, num_tokens=0, mamba_num=1)
            req.state = self.states.alloc(1)
        return req.state is not None

    def count_evicted(self, req: Request, result: Any) -> None:
        req.aux_evicted["mamba"] = (req.aux_evicted.get("mamba", 0)
                                    + int(result.mamba_num_evicted))

    def admitted_fields(self, req: Request) -> tuple[int, ...]:
        return (req.aux_evicted.get("mamba", 0),)

    def aborted(self, run: Run, req: Request) -> None:
        self._branching.pop(id(req), None)
        if req.state is not None:
            harness_free(self.states, req.state)

    def after_match(self, run: Run, req: Request, match: Any) -> None:
        branching = getattr(match, "mamba_branching_seqlen", None)
        self._branching[id(req)] = int(branching) if branching is not None else 0

    def prefilled(self, run: Run, req: Request) -> tuple[int, ...]:
        # the scheduler's cache_unfinished_req after the prefill, with the state tracked as
        # SGLang's Mamba extra buffer tracks it: at the match's branching seqlen when the
        # match gave one (the KV match went past the last state: the next request sharing
        # that prefix then hits it), else at the prompt's last chunk boundary.  The state
        # goes into a fresh slot (one state evicted when none is free; nothing cached when
        # still none) and is freed when the tree already holds one there.  Without this step
        # only the finished prompt + output holds a state, which no later prompt of these
        # workloads reaches: Mamba would never hit.
        branching = self._branching.pop(id(req), 0)
        length = branching if branching > req.matched else len(req.prompt) // CHUNK * CHUNK
        if length <= req.matched:
            return (0, 0, 0, 0)
        slot = self.states.alloc(1)
        if slot is None:
            run.evict(req, num_tokens=0, mamba_num=1)
            slot = self.states.alloc(1)
        if slot is None:
            return (length, 0, 0, 0)
        result = run.cache_unfinished(req, length, mamba_value=slot)
        exist = result is None or bool(getattr(result, "mamba_exist", False))
        if exist:
            harness_free(self.states, slot)  # (the scheduler's free, not the cache's)
        return (length, 1, 0 if result is None else int(result.prefix_len), int(exist))

    def insert_params(self, run: Run, req: Request, params: Any) -> None:
        params.mamba_value = req.state

    def inserted(self, run: Run, req: Request, result: Any) -> tuple[int, ...]:
        exist = bool(getattr(result, "mamba_exist", False))
        if exist:
            harness_free(self.states, req.state)
        return (int(exist),)


# --------------------------------------------------------------------------------------------
# ``--components swa|mamba`` by implementation name (tests and older callers)
# --------------------------------------------------------------------------------------------


def _config(kind: str) -> Any:
    from uniradix.conformance.bench.configs import BenchConfig
    return BenchConfig(("full",) + tuple(kind.split("+")))


def hybrid_bundle(impl: str, kind: str, page_size: int = 1) -> ApiBundle:
    """``fast`` or ``upstream`` built for ``kind`` (``swa``, ``mamba``, ``swa+mamba``); its
    ``build`` takes ``(kv_slots, page_size)`` and returns (cache, allocator, request pool)."""
    from uniradix.conformance.bench.configs import config_bundle
    bundle = config_bundle(impl, _config(kind), page_size)
    inner = bundle.build

    def build(kv_slots: int, ps: int) -> tuple:
        return inner(types.SimpleNamespace(num_pages=kv_slots // ps, page_size=ps))
    return dataclasses.replace(bundle, build=build)


def run_hybrid_bench(bundle: ApiBundle, workload: BenchWorkload, kind: str) -> BenchStats:
    """One run of :func:`hybrid_bundle`'s ``bundle`` (its ``build`` as that gives it)."""
    assert bundle.label == _config(kind).name, (bundle.label, kind)
    build = bundle.build
    return run_bench(dataclasses.replace(
        bundle, build=lambda pool: build(pool.num_pages * pool.page_size, pool.page_size)),
        workload)


def compare_hybrid(impls: Sequence[str], workload: BenchWorkload, kind: str, repeats: int = 3,
                   strict: bool = True, log: Callable[[str], None] | None = None) -> Comparison:
    """loop.compare for a hybrid model."""
    return compare(impls, workload, repeats=repeats, strict=strict, log=log,
                   config=_config(kind))
