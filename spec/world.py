"""Environment models: the world the cache lives in (TRACE.md, "Pools").

The cache never invents slot numbers; it only hands slots back. Every pool is page-granular and
lowest-first so that a replay is deterministic:

* ``usable_slots`` slots (a multiple of ``page_size``) are usable; page 0 is reserved besides,
  so usable pages are ``1 .. usable_slots // page_size`` and slot ids run over
  ``[page_size, usable_slots + page_size)``.
* ``alloc(n)`` (``n`` a multiple of ``page_size``) returns the ``n // page_size`` lowest free
  pages, ascending, as a flat slot list, or raises when too few are free.
* ``free(slots)`` returns whole pages.  Freeing a slot outside the pool, a slot that is not
  allocated, the same slot twice, or only part of a page is an :class:`AllocatorError`, raised
  before anything is freed.

Each pool keeps a log of the slots freed since the last :meth:`PagedPool.take_freed`, which is
how a trace step's *effects* (``freed``) are observed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from .config import CacheConfig
from .errors import AllocatorError, InvalidInput


class PagedPool:
    """A page-granular, lowest-first slot pool."""

    def __init__(self, usable_slots: int, page_size: int = 1, name: str = "kv") -> None:
        if page_size < 1 or usable_slots < 0 or usable_slots % page_size:
            raise InvalidInput(
                f"{name} pool: usable_slots={usable_slots} must be a non-negative multiple of "
                f"page_size={page_size}")
        self.name = name
        self.page_size = page_size
        self.num_pages = usable_slots // page_size
        self._free_pages: list[int] = list(range(1, self.num_pages + 1))  # a heap
        self._allocated: set[int] = set()
        self._freed_log: list[int] = []

    # -- queries -------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free slots."""
        return len(self._free_pages) * self.page_size

    def is_allocated(self, slot: int) -> bool:
        return (slot // self.page_size) in self._allocated

    def allocated_pages(self) -> frozenset[int]:
        return frozenset(self._allocated)

    # -- operations ----------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Take the ``n // page_size`` lowest free pages; return their slots ascending."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"{self.name} alloc: n must be a non-negative int, got {n!r}")
        if n % self.page_size:
            raise InvalidInput(f"{self.name} alloc: n={n} is not a multiple of page_size={self.page_size}")
        pages_needed = n // self.page_size
        if pages_needed > len(self._free_pages):
            raise AllocatorError(
                f"{self.name} alloc: {n} slots requested, {self.available_size()} free")
        pages = [heapq.heappop(self._free_pages) for _ in range(pages_needed)]
        self._allocated.update(pages)
        ps = self.page_size
        return [p * ps + j for p in pages for j in range(ps)]

    def check_free(self, slots: Iterable[int]) -> list[int]:
        """Validate a free without doing it; return the pages it would release."""
        slots = list(slots)
        ps = self.page_size
        seen: set[int] = set()
        per_page: dict[int, int] = {}
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int):
                raise InvalidInput(f"{self.name} free: slot {s!r} is not an int")
            if s in seen:
                raise AllocatorError(f"{self.name} free: slot {s} given twice")
            seen.add(s)
            page = s // ps
            if page < 1 or page > self.num_pages:
                raise AllocatorError(f"{self.name} free: slot {s} is outside the pool")
            if page not in self._allocated:
                raise AllocatorError(f"{self.name} free: slot {s} is not allocated")
            per_page[page] = per_page.get(page, 0) + 1
        partial = sorted(p for p, k in per_page.items() if k != ps)
        if partial:
            raise AllocatorError(
                f"{self.name} free: only part of page(s) {partial[:5]} given (page_size={ps})")
        return sorted(per_page)

    def free(self, slots: Iterable[int]) -> None:
        """Return whole pages to the pool (all-or-nothing)."""
        slots = list(slots)
        pages = self.check_free(slots)
        for p in pages:
            self._allocated.discard(p)
            heapq.heappush(self._free_pages, p)
        self._freed_log.extend(slots)

    def take_freed(self) -> list[int]:
        """The slots freed since the last call, sorted ascending; clears the log."""
        out = sorted(self._freed_log)
        self._freed_log.clear()
        return out

    def reset(self) -> None:
        """Everything free again (the environment's own reset, not the cache's)."""
        self._free_pages = list(range(1, self.num_pages + 1))
        self._allocated.clear()
        self._freed_log.clear()


# ----------------------------------------------------------------------------------------------
# Hybrid models (TRACE.md, "Pools"): the SWA allocator and the Mamba state pool
# ----------------------------------------------------------------------------------------------


class HybridKVPool(PagedPool):
    """The KV pool of a model with sliding-window layers: full slots (this pool) and SWA slots
    (``self.swa``), both lowest-first, and the map full slot -> SWA slot (0 = none).

    ``alloc(n)`` takes n full slots, then n SWA slots, and maps them pairwise; it fails, taking
    nothing, when either pool is short.  ``free(slots)`` releases the full slots and, through
    the map, their SWA slots (the map entries become 0).  ``free_swa(slots)`` releases only the
    SWA slots mapped from these full slots: that is how the cache drops SWA data and keeps the
    full data.  The freed-slot log of ``self.swa`` is the step effect ``swa_freed``.
    """

    def __init__(self, usable_slots: int, swa_slots: int, page_size: int = 1) -> None:
        super().__init__(usable_slots, page_size, "kv")
        self.swa = PagedPool(swa_slots, page_size, "swa")
        self.full_to_swa: dict[int, int] = {}

    def alloc(self, n: int) -> list[int]:
        if isinstance(n, int) and not isinstance(n, bool) and n > self.swa.available_size():
            raise AllocatorError(f"swa alloc: {n} slots requested, {self.swa.available_size()} free")
        full = super().alloc(n)
        swa = self.swa.alloc(n)
        self.full_to_swa.update(zip(full, swa, strict=True))
        return full

    def translate(self, full_slots: Iterable[int]) -> tuple[int, ...]:
        """The SWA slot of each full slot (0 where it has none)."""
        return tuple(self.full_to_swa.get(s, 0) for s in full_slots)

    def mapped_swa(self, full_slots: Iterable[int]) -> list[int]:
        return [w for w in self.translate(full_slots) if w > 0]

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        self.check_free(slots)
        swa = self.mapped_swa(slots)
        self.swa.check_free(swa)
        super().free(slots)
        self.free_swa(slots)

    def free_swa(self, full_slots: Iterable[int]) -> None:
        full_slots = list(full_slots)
        self.swa.free(self.mapped_swa(full_slots))
        for s in full_slots:
            self.full_to_swa.pop(s, None)

    def reset(self) -> None:
        super().reset()
        self.swa.reset()
        self.full_to_swa.clear()


def hybrid_pools(config: CacheConfig) -> tuple[PagedPool, PagedPool | None]:
    """The KV pool and the Mamba pool (or None) of a hybrid config: with SWA the KV pool is a
    :class:`HybridKVPool`; with Mamba a page-size-1 pool of ``mamba_slots`` states."""
    if "swa" in config.components:
        kv: PagedPool = HybridKVPool(config.kv_slots, config.swa_slots, config.page_size)
    else:
        kv = PagedPool(config.kv_slots, config.page_size, "kv")
    mamba = PagedPool(config.mamba_slots, 1, "mamba") if "mamba" in config.components else None
    return kv, mamba
