"""The evict of the composed tree (fast/hybrid.py) with the stock SWA and Mamba plug-ins together
and no host tier ("the pair", ``HybridRadixCache._pair``), the ``lru`` order, not EAGLE:
``HybridRadixCache.evict`` (``_evict_units``, then each component's ``AuxComponent.drive``)
with every call per evicted node written out.

The steps are the general driver's, in its order: the oldest evictable leaves off the Full heap
(``_delete_leaf``: the KV event, each record's ``drop`` as a leaf, the Full slots as a
``"free"`` run, ``_detach_leaf``, the parent pushed when that made it a leaf), then each
component's list from its oldest record, in component order (a leaf leaves the tree whole; an
internal node loses the component's data: SWA a tombstone, its SWA slots a ``"free_swa"`` run,
and by the cascade (``_cascade``: Mamba's priority 0 is below SWA's 1) the node's unlocked
Mamba state; a Mamba drop cascades to nothing), then ``cache._release`` of the ``FreeBatch``
and the heap's compaction check.  The same nodes in the same order, the same frees in the same
runs, the same counts, KV events and heap entries.

With the C core built the loops run in C first (fast/_core.c "composed tree: pair evict",
``pair_evict``: the same steps on the same objects, filling the same ``FreeBatch``); where it
declines (None, nothing changed) the Python loops below run, and they are the whole path with
``UNIRADIX_PURE_PYTHON=1``.  tests/fast/test_pair_evict.py runs both against the general
driver.
"""

from __future__ import annotations

from typing import Any

from .cache import _core
from .frees import FreeBatch
from .one_aux import _compact_if_stale, _evict_wants, _pop_leaf, _unhook, _unlink
from .params import EvictResult


def _drop_state(mamba: Any, rec: Any, t: list, batch: FreeBatch) -> None:
    """The Mamba plug-in's ``drop`` of the state record ``rec`` holds (unlocked, no host
    tier): counted in ``t``, off its list, the state onto ``batch.states``."""
    t[2] += 1
    mamba.evictable -= 1
    _unlink(rec)
    batch.states.append(rec.value)
    rec.value = None


def _delete_leaf(cache: Any, node: Any, t: list, batch: FreeBatch, si: int, mi: int,
                 heap: list, root: Any) -> None:
    """``HybridRadixCache._delete_leaf`` of device leaf ``node`` for the pair, written out:
    the KV event, the SWA record's data (its slots go back with the Full slots, through the
    allocator's map), the Mamba state (onto ``batch.states``), the Full slots (a ``"free"``
    run), then it leaves the tree and its parent may become a leaf.  ``t``: the units freed
    (Full, SWA, Mamba); ``si`` / ``mi``: the SWA and Mamba records' places in ``node.aux``."""
    events = cache._events
    if events is not None:
        events.removed(node)
    k = len(node.key)
    aux = node.aux
    rec = aux[si]
    if rec.value is not None:
        t[1] += k
        cache.swa.evictable -= k
        _unlink(rec)
        rec.value = None
    rec = aux[mi]
    if rec.value is not None:
        _drop_state(cache.mamba, rec, t, batch)
    batch.add("free", node.value)
    t[0] += k
    cache._evictable -= k
    node.value = None  # (``_detach_leaf``)
    _unhook(node, heap, root)


def _loops(cache: Any, want: int, swa_want: int, mamba_want: int, batch: FreeBatch) -> list:
    """The evict's loops (what ``_core.pair_evict`` does in C): the oldest evictable leaves
    off the heap until ``want`` Full units went, then each component's drive in component
    order.  Returns the units freed (Full, SWA, Mamba)."""
    swa, mamba = cache.swa, cache.mamba
    si, mi = swa.i, mamba.i
    heap = cache._heap
    root = cache.root_node
    t = [0, 0, 0]  # units freed: Full, SWA, Mamba
    while t[0] < want:  # the oldest evictable leaves
        node = _pop_leaf(heap)
        if node is None:
            break
        _delete_leaf(cache, node, t, batch, si, mi, heap, root)
    for comp in cache.components:  # each component's drive, in component order
        is_swa = comp is swa
        j = 1 if is_swa else 2
        aux_want = swa_want if is_swa else mamba_want
        head = comp.lru.head
        x = comp.lru.tail.lru_prev
        while t[j] < aux_want and x is not head:  # the list from its oldest
            nxt = x.lru_prev  # NOTE: evicting x never unlinks another record of the list
            if x.lock == 0:
                node = x.node
                if node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
                        and node.value is not None and node.parent is not None:
                    _delete_leaf(cache, node, t, batch, si, mi, heap, root)
                elif is_swa:  # (``drop``: a tombstone, its SWA slots freed; the cascade)
                    k = len(node.key)
                    t[1] += k
                    swa.evictable -= k
                    _unlink(x)
                    batch.add("free_swa", node.value)
                    x.value = None
                    rec = node.aux[mi]
                    if rec.value is not None and rec.lock == 0:
                        _drop_state(mamba, rec, t, batch)
                else:  # (``drop``: the state; SWA's priority is above Mamba's: no cascade)
                    _drop_state(mamba, x, t, batch)
            x = nxt
    return t


def evict_pair(cache: Any, params: Any) -> EvictResult | None:
    """``HybridRadixCache.evict`` for the pair (see the module docstring); None for what it
    leaves to the general path (:func:`fast.one_aux._evict_wants`)."""
    wants = _evict_wants(cache, params)
    if wants is None:
        return None
    want, swa_want, mamba_want = wants
    batch = FreeBatch()
    try:
        # the loops in C (fast/_core.c "composed tree: pair evict"), else in Python
        t = None if _core is None else _core.pair_evict(
            cache, cache.swa, cache.mamba, want, swa_want, mamba_want, batch.runs, batch.states)
        if t is None:
            t = _loops(cache, want, swa_want, mamba_want, batch)
    finally:
        cache._release(batch)
    _compact_if_stale(cache, cache._heap)
    return EvictResult(t[0], t[1], t[2])
