"""Batched frees: hand back what one cache call releases in as few allocator calls as the
allocator's own semantics allow, leaving its free list exactly as one call per piece would.

Whether ``free(cat(a, b))`` equals ``free(a); free(b)`` depends on the allocator, so the cache
asks :func:`free_order` what a ``free``-like method does with a concatenation:

* :data:`APPEND`: the slots are appended to the free list (or its release queue) in the order
  given, so a concatenation in free order is the same as the pieces one by one: one
  ``torch.cat`` and one call.  For exactly sglang's ``TokenToKVPoolAllocator``, under the
  conditions of :data:`PAGED` below, not even that: :func:`append_release` writes
  ``cat([list, *pieces])`` into it, one copy instead of two.  sglang 0.5.13.post1's
  ``TokenToKVPoolAllocator`` (page 1), its ``MambaSlotAllocator``, its host pools
  (``HostKVCache.free`` and relatives), its
  ``SWATokenToKVPoolAllocator`` when both its sub-allocators append, and any allocator while
  it is inside a scheduler free group (``free_group_begin`` .. ``free_group_end``: the pieces
  are queued and concatenated at the end anyway).
* :data:`PAGED`: sglang 0.5.13.post1's ``PagedTokenToKVPoolAllocator`` (page size > 1).  Its
  ``free`` puts ``unique(slots // page_size)``, sorted, in front of its free list
  (``free_pages``; with ``need_sort``, in front of ``release_pages``, which is sorted into the
  free list when an alloc runs short), so one call over several pieces would sort their pages
  together and leave a different order.  k calls leave ``[u_k, ..., u_2, u_1, old]``, where
  ``u_i`` is the sorted distinct pages of piece i; :func:`paged_release` computes exactly the
  front ``[u_k, ..., u_1]`` in one step (on CPU one pass of the C core over the slots,
  ``_core.paged_front``; elsewhere a segment-wise sorted unique, one ``torch.unique`` over the
  keys ``(k - i, page)``) and writes it with one concatenation, instead of k uniques and k
  concatenations onto the whole free list.  The batch therefore writes the allocator's list
  itself, so it is taken only where the result is known to be the one ``free`` would leave:
  the exact sglang class (a subclass may free differently), outside a free group (where
  ``free`` only queues), not in sglang's debug mode (``SGLANG_DEBUG_MEMORY_POOL``: its
  per-call checks run, one call per piece), int64 slots, and no ``free`` set on the instance
  unless that wrapper only observes (it carries ``uniradix_on_batch``, called with the number
  of pieces each time a batch is written; the bench counts calls this way).  Anywhere else
  the allocator gets :data:`PER_CALL`.
* :data:`PER_CALL`: anything else, one call per piece.

The C core (``fast/_core.c``, "native frees") takes the exact sglang classes itself on the
CPU (:func:`native_kind` tells it which class is which): for the Full cache's evict and
insert, and through :func:`release` for every other path (hybrid, host tier; the Mamba slot
allocator and the host pools, which append to ``free_slots``; the SWA allocator in its own
steps, :func:`swa_release`, all of them in one C call, ``swa_free``).  Where the list
appends, it keeps spare room after it, so a free writes only the new slots (docs/COMPAT.md
"Frees").  Without the C core (``UNIRADIX_PURE_PYTHON=1``) the Python code below runs, with
the same results.

An allocator outside sglang declares its semantics with a class attribute
``uniradix_free_order`` (:data:`APPEND`, :data:`QUEUE` or :data:`PER_CALL`); the conformance
environment's pools declare :data:`APPEND` (their state does not depend on the order of frees
within a call, and they log every freed slot), the bench's free list :data:`QUEUE`:

* :data:`QUEUE`: :data:`APPEND`'s semantics, and a ``free`` that keeps the tensor it is given
  (queued until an ``alloc`` merges the queue) at a small constant cost a call.  A
  concatenation would be a copy of every slot for nothing, so :func:`release` frees each
  piece with a call of its own where the pieces are long (over :data:`QUEUE_JOIN_MAX` slots
  on average: the copy costs more than the calls) and one concatenation where they are short
  (the C core's evict likewise).

Every function here keeps the pieces' order within each call, so an allocator that logs the
slots it is given (the conformance runs' ``freed`` effects) sees the same sequence of slots.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

APPEND = "append"
PER_CALL = "per_call"
PAGED = "paged"
QUEUE = "queue"

_ORDERS = (APPEND, PER_CALL, QUEUE)

#: under :data:`QUEUE`, the average piece length (slots) up to which one concatenation is
#: freed rather than each piece (fast/_core.c ``QUEUE_JOIN_MAX`` is the same number): copying
#: 2 KiB costs about what a call and a tensor view cost
QUEUE_JOIN_MAX = 256

# sglang's free methods whose semantics are known (module, qualified name) -> order; "swa" ones
# depend on the SWA allocator's sub-allocators (see free_order).
_KNOWN: dict[tuple[str | None, str | None], str] = {
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.free"): APPEND,
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator.free"): PAGED,
    ("sglang.srt.mem_cache.allocator.mamba", "MambaSlotAllocator.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "HostKVCache.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "MambaPoolHost.free"): APPEND,
    ("sglang.srt.mem_cache.memory_pool_host", "LogicalHostPool.free"): APPEND,
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.free"): "swa",
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator.free_swa"): "swa_only",
}


def free_order(alloc: Any, method: str = "free") -> str:
    """What ``alloc.<method>`` does with a concatenation of pieces: :data:`APPEND`,
    :data:`QUEUE` (declared only), :data:`PAGED` or :data:`PER_CALL` (see the module
    docstring).  Read at each call,
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
    if known == PAGED:
        return PAGED if _paged_batch_ok(alloc) else PER_CALL
    if known == "swa_only":
        sub = getattr(alloc, "swa_attn_allocator", None)
        return APPEND if sub is not None and free_order(sub) == APPEND else PER_CALL
    return known


def release(alloc: Any, pieces: Sequence[torch.Tensor], method: str = "free",
            holder: Any = None) -> int:
    """Free ``pieces`` (1-D slot tensors, in the order one call each would free them) through
    ``alloc.<method>`` in as few calls as :func:`free_order` allows; where the C core can write
    the allocator's list as those calls would leave it (:func:`native_release`; for sglang's SWA
    allocator the C core's ``swa_free``, which does :func:`swa_release`'s steps in one call,
    that function running where it declines), it does, without copying the list.
    ``holder``: whose tail buffer the list may grow into (default the allocator's own,
    :func:`tail_holder`).  Returns the number of allocator calls made (a batch written in one
    step counts one)."""
    k = len(pieces)
    if k == 0:
        return 0
    if method == "free" or method == "free_swa":  # sglang's SWA allocator: one C call
        core = sys.modules.get(_CORE)
        if core is not None:
            if core is not _SWA_READY[0]:
                _setup_swa(core)
            if type(pieces) is not list:
                pieces = list(pieces)
            if core.swa_free(alloc, pieces, method == "free_swa"):
                return 1
    if method == "free" and native_release(alloc, pieces, holder):
        return 1
    if (method == "free" or method == "free_swa") and swa_release(alloc, pieces, method):
        return 1
    if k == 1:  # one call per piece is what every order stands for: no order to work out
        getattr(alloc, method)(pieces[0])
        return 1
    fn = getattr(alloc, method)
    order = free_order(alloc, method)
    if order == QUEUE:
        if sum(p.numel() for p in pieces) > QUEUE_JOIN_MAX * k:  # long pieces: no copy
            for p in pieces:
                fn(p)
            return k
        order = APPEND
    if order == APPEND:
        if method == "free" and append_release(alloc, pieces):
            return 1
        fn(torch.cat(list(pieces)))  # torch.cat takes a list or tuple, not any Sequence
        return 1
    if order == PAGED and paged_release(alloc, pieces):
        return 1
    for p in pieces:
        fn(p)
    return k


# native_kind's answers (the C core's classes of allocator, fast/_core.c "native frees")
NATIVE_NONE, NATIVE_APPEND, NATIVE_PAGED, NATIVE_SLOTS, NATIVE_HOST = 0, 1, 2, 3, 4
_HOST = "sglang.srt.mem_cache.memory_pool_host"
_EXACT: dict[tuple[str, str, Any], int] = {  # (module, class, its free's qualname) -> kind
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator",
     "TokenToKVPoolAllocator.free"): NATIVE_APPEND,
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator",
     "PagedTokenToKVPoolAllocator.free"): NATIVE_PAGED,
    ("sglang.srt.mem_cache.allocator.mamba", "MambaSlotAllocator",
     "MambaSlotAllocator.free"): NATIVE_SLOTS,
    (_HOST, "MHATokenToKVPoolHost", "HostKVCache.free"): NATIVE_HOST,
    (_HOST, "MLATokenToKVPoolHost", "HostKVCache.free"): NATIVE_HOST,
    (_HOST, "MambaPoolHost", "MambaPoolHost.free"): NATIVE_HOST,
}
_FREE_MODULES = {"TokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator.token",
                 "PagedTokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator.paged",
                 "MambaSlotAllocator": "sglang.srt.mem_cache.allocator.mamba",
                 "MHATokenToKVPoolHost": _HOST, "MLATokenToKVPoolHost": _HOST,
                 "MambaPoolHost": _HOST}


def native_kind(cls: type) -> int:
    """Whether ``cls`` is exactly one of sglang 0.5.13.post1's allocators whose list may be
    written directly (:func:`append_release`, :func:`paged_release`, and the C core's native
    frees): :data:`NATIVE_APPEND` for ``TokenToKVPoolAllocator``, :data:`NATIVE_PAGED` for
    ``PagedTokenToKVPoolAllocator``, :data:`NATIVE_SLOTS` for ``MambaSlotAllocator``
    (``free`` appends to ``free_slots``), :data:`NATIVE_HOST` for the host pools
    ``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and ``MambaPoolHost`` (``free`` appends
    to ``free_slots`` under the pool's lock), each with that ``free`` on the class; else
    :data:`NATIVE_NONE` (a subclass, which may free differently, or anything else)."""
    fn = getattr(cls, "free", None)
    qual = getattr(fn, "__qualname__", None)
    if getattr(fn, "__module__", None) != _FREE_MODULES.get(cls.__name__):
        return NATIVE_NONE
    return _EXACT.get((cls.__module__, cls.__name__, qual), NATIVE_NONE)


# sglang 0.5.13.post1's host pool allocs that fast/_core.c ``host_take`` writes out: the class
# -> its alloc's qualname (``HostKVCache.alloc`` and ``MambaPoolHost.alloc``: under the pool's
# lock, an assert or a ValueError on a size that is not a multiple of ``page_size``, None when
# short, else the front of ``free_slots``, which keeps the rest)
_HOST_ALLOCS = {"MHATokenToKVPoolHost": "HostKVCache.alloc",
                "MLATokenToKVPoolHost": "HostKVCache.alloc",
                "MambaPoolHost": "MambaPoolHost.alloc"}


def native_alloc_ok(cls: type) -> bool:
    """Whether ``cls`` is exactly one of sglang's host pools whose ``alloc`` the C core may do
    itself (:func:`host_alloc`): that class of sglang's module, with that ``alloc`` on it."""
    fn = getattr(cls, "alloc", None)
    return cls.__module__ == _HOST and getattr(fn, "__module__", None) == _HOST \
        and _HOST_ALLOCS.get(cls.__name__) == getattr(fn, "__qualname__", None)


def host_alloc(pool: Any, n: int) -> Any:
    """``pool.alloc(n)`` for a backup, which keeps a copy of what it gets: through the C core
    where it writes that alloc out (``_core.host_take``: the same list left in the pool, the
    slots as a tensor of their own, so the caller's copy of a view is not needed), else the
    pool's own call (whose answer may be a view of its list: the caller copies it)."""
    core = _native_core()
    if core is not None:
        got = core.host_take(pool, n)
        if got is not NotImplemented:
            return got
    return pool.alloc(n)


def _exact_ok(alloc: Any, kind: int) -> bool:
    """Whether ``alloc``'s list may be written as ``kind`` frees would leave it: that exact
    class, outside a free group, not in sglang's debug mode, and no ``free`` set on the instance
    unless it only observes (see :data:`PAGED`)."""
    if native_kind(type(alloc)) != kind:
        return False
    # the paged class always has debug_mode (missing: not that class); the token one has none
    if getattr(alloc, "debug_mode", kind == NATIVE_PAGED) or alloc.is_not_in_free_group is not True:
        return False
    inst = alloc.__dict__.get("free")
    return inst is None or callable(getattr(inst, "uniradix_on_batch", None))


def _paged_batch_ok(alloc: Any) -> bool:
    """Whether :func:`paged_release` may write ``alloc``'s list (see :data:`PAGED`)."""
    return _exact_ok(alloc, NATIVE_PAGED)


def append_release(alloc: Any, pieces: Sequence[torch.Tensor]) -> bool:
    """sglang's ``TokenToKVPoolAllocator`` (page 1) under the conditions of :func:`_exact_ok`:
    its list becomes ``cat([list, *pieces])`` in one step, one copy where a ``free`` of the
    concatenated pieces makes two (the pieces, then the list with them), the same as one
    ``free`` per piece leaves it (``free`` appends; with ``need_sort`` to ``release_pages``).
    Returns False, having changed nothing, where that is not known to hold or a piece is not
    a 1-D int64 tensor on the list's device."""
    if not _exact_ok(alloc, NATIVE_APPEND):
        return False
    name = "release_pages" if alloc.need_sort else "free_pages"
    target = getattr(alloc, name)
    if not isinstance(target, torch.Tensor) or target.dtype is not torch.int64 or target.dim() != 1:
        return False
    dev = target.device
    if any(type(p) is not torch.Tensor or p.dtype is not torch.int64 or p.dim() != 1
           or p.device != dev for p in pieces):
        return False
    live = [p for p in pieces if p.numel()]  # free ignores an empty piece
    if not live:
        return True
    setattr(alloc, name, torch.cat([target, *live]))
    observer = alloc.__dict__.get("free")
    if observer is not None:
        observer.uniradix_on_batch(len(pieces))
    return True


def paged_release(alloc: Any, pieces: Sequence[torch.Tensor]) -> bool:
    """Leave ``alloc`` (a :data:`PAGED` allocator) exactly as ``alloc.free(p)`` for each piece
    ``p`` in turn would, in one step.  Returns False, having changed nothing, where the pieces
    are not 1-D int64 tensors on the allocator's device (the caller then frees them one by
    one, as upstream would)."""
    target = alloc.release_pages if alloc.need_sort else alloc.free_pages
    core = _native_core()
    buf = None
    if core is not None and target.is_cpu:
        buf = core.paged_front(pieces if type(pieces) is list else list(pieces), alloc.page_size)
    if buf is not None:  # the C pass read every piece (CPU, int64, 1-D, contiguous)
        if not buf:
            return True  # only empty pieces: free ignores them
        front = torch.frombuffer(buf, dtype=torch.int64)
    else:
        live = [p for p in pieces if p.numel()]  # free ignores an empty piece
        if not live:
            return True
        dev = target.device
        if any(p.dtype is not torch.int64 or p.device != dev or p.dim() != 1 for p in live):
            return False
        by_torch = _front_by_torch(live, alloc.page_size)
        if by_torch is None:
            return False
        front = by_torch
    if alloc.need_sort:
        alloc.release_pages = torch.cat((front, alloc.release_pages))
    else:
        alloc.free_pages = torch.cat((front, alloc.free_pages))
    observer = alloc.__dict__.get("free")
    if observer is not None:
        observer.uniradix_on_batch(len(pieces))
    return True


class TailHolder:
    """Where the C core keeps one allocator list's tail buffer (fast/_core.c "native frees":
    ``_free_tail``, the buffer the list is a view of, and ``_free_tail_hw``, the highest index
    ever written into it; ``_free_tail_at``, the buffer and its capacity as the C core made
    it, which spares it reading them through torch again)."""

    __slots__ = ("_free_tail", "_free_tail_hw", "_free_tail_at", "_free_head", "__weakref__")

    def __init__(self) -> None:
        # a paged list's buffer with room before the list (fast/_core.c "a paged list's head
        # buffer"): a free writes its pages there instead of copying the list
        self._free_head: torch.Tensor | None = None
        self._free_tail: torch.Tensor | None = None
        self._free_tail_hw = 0
        # (buffer, capacity) as the C core made it, so it reads only the buffer's data pointer
        self._free_tail_at: tuple[torch.Tensor, int] | None = None


_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tail_holder(alloc: Any) -> TailHolder:
    """``alloc``'s own :class:`TailHolder` (one per allocator, kept while it lives)."""
    h = _HOLDERS.get(alloc)
    if h is None:
        h = _HOLDERS[alloc] = TailHolder()
    return h


def native_release(alloc: Any, pieces: Sequence[torch.Tensor], holder: Any = None) -> bool:
    """Leave ``alloc`` as ``alloc.free(p)`` for each piece in turn would, through the C core
    (fast/_core.c "native frees"), which appends the pieces to the list without copying it
    where it can: ``alloc`` one of :func:`native_kind`'s exact classes, its list and every
    piece a 1-D int64 CPU tensor, and for the KV allocators outside a free group and sglang's
    debug mode, no ``free`` on the instance unless it only observes.  ``holder``: whose tail
    buffer the list grows into (default :func:`tail_holder` of ``alloc``).  False, with
    nothing changed, anywhere else (and always without the C core)."""
    core = sys.modules.get(_CORE)
    if core is None:
        return False
    if core is not _SWA_READY[0]:
        _setup_swa(core)
    # (holder None: the C core checks the kind itself and finds the allocator's own holder)
    return bool(core.native_release(holder, alloc,
                                    pieces if type(pieces) is list else list(pieces)))


_SWA = ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator")


def swa_class_ok(cls: type) -> bool:
    """Whether ``cls`` is exactly sglang's ``SWATokenToKVPoolAllocator`` with its own ``free``
    and ``free_swa`` (the class part of :func:`_swa_exact`, which the C core's ``swa_free``
    caches per class and methods)."""
    if (cls.__module__, cls.__name__) != _SWA:
        return False
    for name in ("free", "free_swa"):
        fn = getattr(cls, name, None)
        if getattr(fn, "__qualname__", None) != f"{_SWA[1]}.{name}" \
                or getattr(fn, "__module__", None) != _SWA[0]:
            return False
    return True


_CORE = f"{__package__}._core"
_SWA_READY: list[Any] = [None]  # the C core module setup_swa_frees was called on


def _setup_swa(core: Any) -> None:
    """Hand the C core ``swa_free``'s class check and the tail holders (once per module)."""
    core.setup_swa_frees(swa_class_ok, tail_holder)
    _SWA_READY[0] = core


def _swa_exact(alloc: Any, method: str) -> int:
    """Whether ``alloc`` is exactly sglang's ``SWATokenToKVPoolAllocator`` with its own
    ``free`` and ``free_swa`` (no instance ``free`` or ``free_swa`` unless it only observes:
    it carries ``uniradix_on_batch``, called once per batch written), outside a free group
    for ``free``, over two sub-allocators of one exact class: its :func:`native_kind`
    (:data:`NATIVE_APPEND` at page 1, :data:`NATIVE_PAGED` above), else :data:`NATIVE_NONE`."""
    if not swa_class_ok(type(alloc)):
        return NATIVE_NONE
    inst = alloc.__dict__
    for name in ("free", "free_swa"):  # an instance method only where it only observes
        own = inst.get(name)
        if own is not None and not callable(getattr(own, "uniradix_on_batch", None)):
            return NATIVE_NONE
    if method == "free" and alloc.is_not_in_free_group is not True:
        return NATIVE_NONE
    kinds = {native_kind(type(getattr(alloc, s, None)))
             for s in ("full_attn_allocator", "swa_attn_allocator")}
    return kinds.pop() if len(kinds) == 1 and kinds <= {NATIVE_APPEND, NATIVE_PAGED} \
        else NATIVE_NONE


def swa_release(alloc: Any, pieces: Sequence[torch.Tensor], method: str = "free") -> bool:
    """Leave sglang's ``SWATokenToKVPoolAllocator`` as ``alloc.<method>(p)`` for each piece in
    turn would, in its own steps: ``free`` is the full sub-allocator's free of the piece
    (:func:`native_release`), then ``free_swa``; that is the gather of
    ``full_to_swa_index_mapping`` at the piece, the values > 0 kept, the swa sub-allocator's
    free of them and the mapping zeroed at the piece (the C core's ``swa_take`` for every
    piece, then one :func:`native_release` of what each piece gave).  At page 1 no free list
    is copied; at page > 1 (paged sub-allocators) each list is written once for all the
    pieces, as :func:`paged_release`.  ``free``'s checks of both sub-allocators' sizes run
    once at the end.  False, with nothing changed, where :func:`_swa_exact` does not hold or
    the C core is absent; where a step past the first cannot be native, sglang's own methods
    finish it, one call per piece."""
    core = _native_core()
    if core is None:
        return False
    kind = _swa_exact(alloc, method)
    if not kind:
        return False
    full, swa = alloc.full_attn_allocator, alloc.swa_attn_allocator
    pieces = pieces if type(pieces) is list else list(pieces)
    if method == "free" and not native_release(full, pieces):
        return False
    res = core.swa_take(alloc.full_to_swa_index_mapping, pieces)
    if res is None:
        if method == "free":  # the full side is done: free_swa of each piece, as free goes on
            for p in pieces:
                alloc.free_swa(p)
        else:
            return False
    elif res[0].shape[0]:
        taken, lens = res
        parts = [taken] if kind == NATIVE_APPEND else list(taken.split(lens))
        if not native_release(swa, parts):
            for p in parts:  # (at page 1 the sub-allocator appends: one part, one free)
                swa.free(p)
    if method == "free":
        assert full.available_size() <= full.size  # noqa: S101 -- free's own checks
        assert swa.available_size() <= swa.size  # noqa: S101
    observer = alloc.__dict__.get(method)
    if observer is not None:
        observer.uniradix_on_batch(len(pieces))
    return True


def _native_core() -> Any:
    """The C core's module where the fast cache loaded it (not under UNIRADIX_PURE_PYTHON=1,
    nor where it is not built), else None."""
    return sys.modules.get(f"{__package__}._core")


def _front_by_torch(live: list[torch.Tensor], page_size: int) -> torch.Tensor | None:
    """:func:`paged_release`'s front in torch ops (any device): one sorted unique over the keys
    ``(segment, page - lo)``, the piece freed last in segment 0.  None where the keys would
    overflow int64."""
    k = len(live)
    pages = (torch.cat(live) if k > 1 else live[0]) // page_size
    if k == 1:
        return torch.unique(pages)
    # (on a GPU each value read back to the host waits for the device: one read for both
    # bounds, and the segment ids' length given, so the sorted unique is the only other wait)
    lo, hi = torch.stack(torch.aminmax(pages)).tolist()
    span = hi - lo + 1
    if span * k >= 1 << 62:
        return None
    dev = pages.device
    seg = torch.repeat_interleave(
        torch.arange(k - 1, -1, -1, dtype=torch.int64, device=dev),
        torch.tensor([p.shape[0] for p in live], dtype=torch.int64, device=dev),
        output_size=pages.shape[0])
    keys = torch.unique((pages - lo) + seg * span)  # sorted: by segment, then page
    return keys % span + lo


def release_ranges(alloc: Any, value: torch.Tensor, bounds: Sequence[int],
                   holder: Any = None) -> int:
    """Free ``value[lo:hi]`` for each ``(lo, hi)`` in ``bounds`` (flat: ``lo0, hi0, lo1, hi1,
    ...``, in free order, one range per node as upstream frees them) through ``alloc.free`` in
    as few calls as :func:`free_order` allows (through :func:`release`); under :data:`APPEND`
    and :data:`QUEUE` adjacent ranges are freed as one slice (a view, no copy).  Returns the
    number of allocator calls made."""
    if len(bounds) == 2:  # one range: one call whatever the order, as in release
        return release(alloc, [value[bounds[0]:bounds[1]]], holder=holder)
    order = free_order(alloc)
    if order == PAGED:
        return release(alloc, [value[bounds[i]:bounds[i + 1]] for i in range(0, len(bounds), 2)],
                       holder=holder)
    if order == APPEND or order == QUEUE:
        merged: list[torch.Tensor] = []
        lo, hi = bounds[0], bounds[1]
        for i in range(2, len(bounds), 2):
            if bounds[i] == hi:
                hi = bounds[i + 1]
            else:
                merged.append(value[lo:hi])
                lo, hi = bounds[i], bounds[i + 1]
        merged.append(value[lo:hi])
        return release(alloc, merged, holder=holder)
    return release(alloc, [value[bounds[i]:bounds[i + 1]] for i in range(0, len(bounds), 2)],
                   holder=holder)


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
        calls as each allocator allows (runs of both of sglang's SWA allocator's methods: one
        C call for all of them, :func:`_swa_runs`)."""
        runs = self.runs
        if len(runs) > 1 and _swa_runs(alloc, runs):
            runs = []
        for method, pieces in runs:
            release(alloc, pieces, method)
        if self.states:
            release(state_alloc, self.states)


def _swa_runs(alloc: Any, runs: list[tuple[str, list[torch.Tensor]]]) -> bool:
    """Runs of ``free`` and ``free_swa`` (an SWA evict's leaves and tombstones, in free order)
    through the C core's ``swa_free`` in one call, one byte per piece saying whose it is: the
    full sub-allocator's list gets ``free``'s pieces in order (``free_swa`` never touches it)
    and the SWA side is ``free_swa`` of every piece in turn, which is what the runs in turn
    leave, both lists and the map.  False, with nothing changed, where it declines (not
    exactly sglang's SWA allocator, a free group, ...: the runs then go one by one)."""
    core = sys.modules.get(_CORE)
    if core is None:
        return False
    if core is not _SWA_READY[0]:
        _setup_swa(core)
    pieces: list[torch.Tensor] = []
    which = bytearray()
    for method, part in runs:
        if method != "free" and method != "free_swa":
            return False
        pieces += part
        which += (b"\x01" if method == "free" else b"\x00") * len(part)
    return bool(core.swa_free(alloc, pieces, bytes(which)))
