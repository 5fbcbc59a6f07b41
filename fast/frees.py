"""Batched frees: hand back what one cache call releases in as few allocator calls as the
allocator's own semantics allow, leaving its free list exactly as one call per piece would.

Whether ``free(cat(a, b))`` equals ``free(a); free(b)`` depends on the allocator, so the cache
asks :func:`free_order` what a ``free``-like method does with a concatenation:

* :data:`APPEND`: the slots are appended to the free list (or its release queue) in the order
  given, so a concatenation in free order is the same as the pieces one by one: one
  ``torch.cat`` and one call.  sglang 0.5.13.post1's ``TokenToKVPoolAllocator`` (page 1), its
  ``MambaSlotAllocator``, its host pools (``HostKVCache.free`` and relatives), its
  ``SWATokenToKVPoolAllocator`` when both its sub-allocators append, and any allocator while
  it is inside a scheduler free group (``free_group_begin`` .. ``free_group_end``: the pieces
  are queued and concatenated at the end anyway).
* :data:`PER_CALL`: anything else, one call per piece, as before.  This includes sglang
  0.5.13.post1's ``PagedTokenToKVPoolAllocator`` (page size > 1): its ``free`` puts
  ``unique(slots // page_size)``, sorted, in front of its free list, so one call over several
  pieces sorts their pages together and leaves a different order.  Pieces could be grouped
  where each piece's pages all lie below the previous piece's (then the sorted union equals
  the per-piece blocks); that was built and measured (shared-prefix, page 16, 20k requests):
  it saved 9% of the calls, and finding the groups (a ``torch.cat`` and a ``tolist`` of the
  slots) took a third of ``evict``'s time, more than the calls saved, so it was taken out.

An allocator outside sglang declares its semantics with a class attribute
``uniradix_free_order`` (:data:`APPEND` or :data:`PER_CALL`); the conformance environment's
pools and the bench's free list declare :data:`APPEND` (their state does not depend on the order
of frees within a call, and they log every freed slot).

Every function here keeps the pieces' order within each call, so an allocator that logs the
slots it is given (the conformance runs' ``freed`` effects) sees the same sequence of slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

APPEND = "append"
PER_CALL = "per_call"

_ORDERS = (APPEND, PER_CALL)

# sglang's free methods whose semantics are known (module, qualified name) -> order; "swa" ones
# depend on the SWA allocator's sub-allocators (see free_order).
_KNOWN: dict[tuple[str | None, str | None], str] = {
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.free"): APPEND,
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator.free"): PER_CALL,
    ("sglang.srt.mem_cache.allocator.mamba", "MambaSlotAllocator.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "HostKVCache.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "MambaPoolHost.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "LogicalHostPool.free"): APPEND,
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.free"): "swa",
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.free_swa"): "swa_only",
}


def free_order(alloc: Any, method: str = "free") -> str:
    """What ``alloc.<method>`` does with a concatenation of pieces: :data:`APPEND` or
    :data:`PER_CALL` (see the module docstring).  Read at each call,
    so a scheduler free group that opens or closes in between is seen."""
    if getattr(alloc, "is_not_in_free_group", True) is False and method == "free":
        return APPEND  # queued, concatenated in order by free_group_end
    declared = getattr(type(alloc), "uniradix_free_order", None)
    if declared in _ORDERS:
        return declared
    fn = getattr(type(alloc), method, None)
    known = _KNOWN.get((getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)))
    if known is None:
        return PER_CALL
    if known == "swa":
        subs = (getattr(alloc, "full_attn_allocator", None), getattr(alloc, "swa_attn_allocator", None))
        return APPEND if all(s is not None and free_order(s) == APPEND for s in subs) else PER_CALL
    if known == "swa_only":
        sub = getattr(alloc, "swa_attn_allocator", None)
        return APPEND if sub is not None and free_order(sub) == APPEND else PER_CALL
    return known


def release(alloc: Any, pieces: Sequence[torch.Tensor], method: str = "free") -> int:
    """Free ``pieces`` (1-D slot tensors, in the order one call each would free them) through
    ``alloc.<method>`` in as few calls as :func:`free_order` allows.  Returns the number of
    allocator calls made."""
    k = len(pieces)
    if k == 0:
        return 0
    fn = getattr(alloc, method)
    if k == 1:
        fn(pieces[0])
        return 1
    order = free_order(alloc, method)
    if order == APPEND:
        fn(torch.cat(list(pieces)))  # torch.cat takes a list or tuple, not any Sequence
        return 1
    for p in pieces:
        fn(p)
    return k



class FreeBatch:
    """The named batch of frees one eviction emits, in free order, handed back at its end.

    ``runs``: the KV allocator's pieces as runs of ``(method, [slots, ...])``, a new run each
    time the method changes (``"free"``: a leaf's Full slots, with their SWA slots through the
    allocator's map; ``"free_swa"``: the SWA slots of a node that becomes an SWA tombstone), so
    the runs keep the order of the frees.  ``states``: the Mamba state slots, for the Mamba
    allocator.  ``release`` hands each run and the states back through :func:`release`."""

    __slots__ = ("runs", "states")

    def __init__(self) -> None:
        self.runs: list[tuple[str, list[torch.Tensor]]] = []
        self.states: list[torch.Tensor] = []

    def add(self, method: str, slots: torch.Tensor) -> None:
        """Queue ``slots`` for ``alloc.<method>``.  O(1)."""
        runs = self.runs
        if runs and runs[-1][0] == method:
            runs[-1][1].append(slots)
        else:
            runs.append((method, [slots]))

    def release(self, alloc: Any, state_alloc: Any = None) -> None:
        """Free every run through ``alloc`` and the states through ``state_alloc``, in as few
        calls as each allocator allows."""
        for method, pieces in self.runs:
            release(alloc, pieces, method)
        if self.states:
            release(state_alloc, self.states)
