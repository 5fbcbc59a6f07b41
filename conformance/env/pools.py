"""The environment's KV pool (:class:`~uniradix.spec.world.PagedPool`) behind SGLang's allocator
interface, for every implementation that takes an allocator object: upstream's cache, the fast
path, and the spec's upstream-style wrapper."""

from __future__ import annotations

from array import array
from typing import Any

from uniradix.spec.errors import AllocatorError
from uniradix.spec.world import PagedPool


class PoolAllocator:
    """``alloc`` returns the slots (an int64 tensor, or ``array('q')`` without torch) or ``None``
    when too few are free (SGLang's convention); ``free`` hands slots back to the pool, which logs
    them as the step's ``freed`` effect.  ``check_free`` and ``is_allocated`` let the fast path
    check slot ownership before an insert changes anything (it looks for them).

    ``whole_pages=True`` frees as SGLang's ``PagedTokenToKVPoolAllocator`` does: a free of some
    slots of a page releases the whole page (a request's partial last page, whose unused
    slots are in no row); a slot given twice, or a page not allocated, is still an error."""

    # the pool is lowest-first and logs every slot: a batched free (fast/frees.py) leaves it
    # and the ``freed`` effect as one free per piece would
    uniradix_free_order = "append"

    def __init__(self, pool: PagedPool, torch_module: Any | None = None,
                 whole_pages: bool = False) -> None:
        self.pool = pool
        self.whole_pages = whole_pages
        self.page_size = pool.page_size
        self._torch = torch_module
        self.device = torch_module.device("cpu") if torch_module is not None else "cpu"

    def alloc(self, need_size: int):
        try:
            slots = self.pool.alloc(int(need_size))
        except AllocatorError:
            return None
        if self._torch is None:
            return array("q", slots)
        return self._torch.tensor(slots, dtype=self._torch.int64, device="cpu")

    def free(self, free_index) -> None:
        slots = free_index.tolist() if hasattr(free_index, "tolist") else list(free_index)
        if slots and self.whole_pages and self.page_size > 1:
            if len(set(slots)) != len(slots):
                raise AllocatorError(f"{self.pool.name} free: a slot given twice")
            ps = self.page_size
            slots = [p * ps + j for p in sorted({s // ps for s in slots}) for j in range(ps)]
        if slots:
            self.pool.free(slots)

    def available_size(self) -> int:
        return self.pool.available_size()

    def check_free(self, slots) -> None:
        self.pool.check_free(slots)

    def is_allocated(self, slot: int) -> bool:
        return self.pool.is_allocated(slot)

    def clear(self) -> None:
        self.pool.reset()
