"""Fast paths of the composed tree (fast/hybrid.py) for its most common shape: exactly one aux
component (the stock SWA or Mamba plug-in), no host tier, the ``lru`` eviction order.

Each function here is one of ``HybridRadixCache``'s general paths written out for that shape,
with the same effects, checks and errors: the calls through the component hooks are inlined and
the Full walk and the component's walk share one loop.  ``HybridRadixCache`` picks them once at
construction (``_pick_fast_paths``); every other shape runs the general paths.  Why they hold:

* without a host tier every node in the tree holds Full data (only a host tier leaves evicted
  nodes in the tree), so a lock's Full walk starts at the node itself, and every node of a
  locked path is attached (a node with a Full lock is never evicted);
* the leaf test needs only the node's own fields, so a node that a fused walk has finished
  with can go on the eviction heap at once; the general path pushes the same entries (a node
  whose Full and aux counts both reached 0 twice, as its ``unlocked`` list holds it twice), in
  another order, which the heap does not see: its entries are ordered by (stamp, node id).

tests/fast/test_one_aux.py drives each fast path and its general path through the same
scenarios and compares the trees.
"""

from __future__ import annotations

from array import array
from heapq import heappush
from typing import Any

import torch

from . import compat
from .cache import STRIDE
from .components import MAMBA_ID, SWA_ID
from .components.swa import SWA_SPLIT_EPOCH, split_off_skipped
from .errors import HandleError, NodeNotFound
from .keys import shared_len
from .node import Node
from .params import DecLockRefParams, DecLockRefResult, IncLockRefResult, MatchResult
from .radix_key import RadixKey

FULL = 0  # the Full component's id in skip_lock_node_ids
_INF = float("inf")
_cat = torch.cat


def _not_attached() -> NodeNotFound:
    return NodeNotFound("the node is not in the tree")


def _unlocked_twice() -> HandleError:
    return HandleError("dec_lock_ref: this path is not locked (released twice?)")


# ----------------------------------------------------------------------------------------------
# match_prefix (SWA or Mamba)
# ----------------------------------------------------------------------------------------------


def match_one(cache: Any, params: Any) -> MatchResult | None:
    """``HybridRadixCache.match_prefix`` with its one component's validator inlined (SWA: a
    run of contiguous SWA units up to the node reaching the window, restarted at a tombstone;
    Mamba: a state on the node, the same rule with a window of 0), and ``path_to_front``,
    ``_stamp_path`` and the leaf push of the matched node in one walk up.  None for what it
    leaves to the general path: an EAGLE bigram key and a Mamba copy-on-write match."""
    key = params.key
    if key.__class__ is not RadixKey:
        key = compat.as_radix_key(key)
    if key.is_bigram:
        return None
    comp = cache.components[0]
    window = cache._inline_window
    if window == 0 and getattr(params, "cow_mamba", False):
        return None
    toks = key.token_ids
    units = toks if toks.__class__ is array else array("q", toks)
    root = cache.root_node
    ps = cache.page_size
    n = len(units) - len(units) % ps
    if cache.disable or n == 0:
        return MatchResult(cache._empty, root, root, root, 0, 0, 0, None, None)
    ek = key.extra_key
    i = comp.i
    node, pos, chunks = root, 0, []
    best, best_chunks = root, 0
    run = _INF
    while pos < n:
        # (keys.child_key and keys.step_len, inlined as in the general path)
        ck = units[pos] if ps == 1 else tuple(units[pos: pos + ps])
        child = node.children.get(ck if ek is None else (ek, ck))
        if child is None or child.value is None:
            break
        ckey = child.key
        k = len(ckey)
        split = pos + k > n or units[pos: pos + k] != ckey
        if split:
            k = shared_len(ckey, units, pos, n, ps)
            child = cache._split(child, k)
        chunks.append(child.value)
        node, pos = child, pos + k
        if child.aux[i].value is None:
            run = 0
        else:
            run += k
            if run >= window:
                best, best_chunks = child, len(chunks)
        if split:  # the match ends inside the old node
            break
    # the matched path: its records to the front of the list (node first), its stamps (the
    # node newest, each ancestor one older, the root included)
    lru = comp.lru
    prev = lru.head
    clock = cache._clock + STRIDE
    cache._clock = clock
    cur = best
    while cur is not root:
        cur.last_access_time = clock
        clock -= 1
        rec = cur.aux[i]
        if rec.value is not None:  # (LruList.move_after, inlined)
            rec.lru_prev.lru_next = rec.lru_next
            rec.lru_next.lru_prev = rec.lru_prev
            nxt = prev.lru_next
            rec.lru_prev, rec.lru_next = prev, nxt
            prev.lru_next = nxt.lru_prev = rec
            prev = rec
        cur = cur.parent
    root.last_access_time = clock
    if best is not root and best.lock_ref == 0 and best.aux_lock == 0 \
            and best.dev_children == 0:  # (``_push_if_leaf``: it holds data, it is attached)
        heappush(cache._heap, (best.last_access_time, best))
    if best_chunks == 0:
        indices = cache._empty
    elif best_chunks == 1:
        indices = chunks[0]
    else:
        indices = _cat(chunks if best_chunks == len(chunks) else chunks[:best_chunks])
    branching = None
    if window == 0 and len(chunks) > best_chunks:
        c = cache.mamba_cache_chunk_size
        aligned = pos // c * c
        branching = aligned if aligned > 0 else None
    return MatchResult(indices, best, best, best, 0, 0, 0, branching, None)


# ----------------------------------------------------------------------------------------------
# SWA
# ----------------------------------------------------------------------------------------------


def inc_lock_swa(cache: Any, node: Any) -> IncLockRefResult:
    """``HybridRadixCache.inc_lock_ref`` (``_check_attached``, ``_inc_lock_py``,
    ``SwaComponent.lock``) in one walk: the Full lock up to the root and, while the window is
    not full, the SWA lock (tombstones skipped and remembered, the window's end marked)."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise _not_attached()
    result = IncLockRefResult()
    if cache.disable:
        return result
    swa = cache.swa
    i, window = swa.i, swa.window
    cur: Any = node
    delta = size = 0
    while cur is not root:
        k = len(cur.key)
        if cur.lock_ref == 0:
            delta += k
        cur.lock_ref += 1
        if size < window:
            rec = cur.aux[i]
            if rec.value is None:
                result.skip_lock_node_ids.setdefault(SWA_ID, set()).add(cur.id)
                result.skip_lock_node_ids[SWA_SPLIT_EPOCH] = {-1 - swa._split_epoch}
            else:
                if rec.lock == 0:
                    swa.evictable -= k
                    swa.protected += k
                rec.lock += 1
                cur.aux_lock += 1
                size += k
                if size >= window:
                    if rec.boundary is None:
                        rec.boundary = swa._next_boundary
                        swa._next_boundary += 1
                    result.swa_uuid_for_lock = rec.boundary
        cur = cur.parent
    cache._evictable -= delta
    cache._protected += delta
    result.delta = delta
    return result


def dec_lock_swa(cache: Any, node: Any, params: DecLockRefParams | None) -> DecLockRefResult:
    """``HybridRadixCache.dec_lock_ref`` (``_dec_full_lock``, ``SwaComponent.unlock``, the
    pushes of the new leaves) for ``params`` None or a plain ``DecLockRefParams``: every Full
    count is checked first (a refused unlock changes nothing), then one walk undoes the Full
    lock up to the root and the SWA lock up to the window's end mark."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise _not_attached()
    if cache.disable:
        return DecLockRefResult()
    if params is None:
        skip: Any = ()
        sskip: Any = ()
        boundary = None
    else:
        skips = params.skip_lock_node_ids
        skip = skips.get(FULL, ())
        sskip = skips.get(SWA_ID, ())
        boundary = params.swa_uuid_for_lock
    cur: Any = node
    while cur is not root:
        if cur.lock_ref <= 0 and cur.id not in skip:
            raise _unlocked_twice()
        cur = cur.parent
    seen = -1 - min(params.skip_lock_node_ids.get(SWA_SPLIT_EPOCH, (0,))) \
        if sskip and params is not None else 0
    swa = cache.swa
    i, heap = swa.i, cache._heap
    cur, delta, walking = node, 0, True
    while cur is not root:
        full0 = swa0 = False
        if cur.id not in skip:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                delta += len(cur.key)
                full0 = True
        if walking:
            rec = cur.aux[i]
            if rec.lock and cur.id not in sskip \
                    and not (sskip and split_off_skipped(rec, sskip, seen)):
                if rec.lock == 1:
                    k = len(cur.key)
                    swa.evictable += k
                    swa.protected -= k
                    swa0 = True
                rec.lock -= 1
                cur.aux_lock -= 1
                if boundary and rec.boundary == boundary:
                    walking = False
        if (full0 or swa0) and cur.lock_ref == 0 and cur.aux_lock == 0 \
                and cur.dev_children == 0 and cur.value is not None:
            entry = (cur.last_access_time, cur)
            heappush(heap, entry)
            if full0 and swa0:
                heappush(heap, entry)
        cur = cur.parent
    cache._evictable += delta
    cache._protected -= delta
    return DecLockRefResult(delta=delta)


# ----------------------------------------------------------------------------------------------
# Mamba
# ----------------------------------------------------------------------------------------------


def inc_lock_mamba(cache: Any, node: Any) -> IncLockRefResult:
    """``HybridRadixCache.inc_lock_ref`` (``_check_attached``, ``_inc_lock_py``,
    ``MambaComponent.lock``): the Full lock up to the root, then the node's state (a node
    without one is skipped and remembered)."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise _not_attached()
    result = IncLockRefResult()
    if cache.disable:
        return result
    cur: Any = node
    delta = 0
    while cur is not root:
        if cur.lock_ref == 0:
            delta += len(cur.key)
        cur.lock_ref += 1
        cur = cur.parent
    cache._evictable -= delta
    cache._protected += delta
    result.delta = delta
    if node is not root:
        mamba = cache.mamba
        rec = node.aux[mamba.i]
        if rec.value is None:
            result.skip_lock_node_ids.setdefault(MAMBA_ID, set()).add(node.id)
        else:
            if rec.lock == 0:
                mamba.evictable -= 1
                mamba.protected += 1
            rec.lock += 1
            node.aux_lock += 1
    return result


def dec_lock_mamba(cache: Any, node: Any, params: DecLockRefParams | None) -> DecLockRefResult:
    """``HybridRadixCache.dec_lock_ref`` (``_dec_full_lock``, ``MambaComponent.unlock``, the
    pushes of the new leaves) for ``params`` None or a plain ``DecLockRefParams``: every Full
    count is checked first, then the node (Full and state), then its ancestors (Full)."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise _not_attached()
    if cache.disable:
        return DecLockRefResult()
    if params is None:
        skip: Any = ()
        mskip: Any = ()
    else:
        skips = params.skip_lock_node_ids
        skip = skips.get(FULL, ())
        mskip = skips.get(MAMBA_ID, ())
    cur: Any = node
    while cur is not root:
        if cur.lock_ref <= 0 and cur.id not in skip:
            raise _unlocked_twice()
        cur = cur.parent
    if node is root:
        return DecLockRefResult(delta=0)
    heap = cache._heap
    delta = 0
    full0 = m0 = False
    if node.id not in skip:
        node.lock_ref -= 1
        if node.lock_ref == 0:
            delta = len(node.key)
            full0 = True
    mamba = cache.mamba
    rec = node.aux[mamba.i]
    if rec.lock > 0 and node.id not in mskip:
        if rec.lock == 1:
            mamba.evictable += 1
            mamba.protected -= 1
            m0 = True
        rec.lock -= 1
        node.aux_lock -= 1
    if (full0 or m0) and node.lock_ref == 0 and node.aux_lock == 0 \
            and node.dev_children == 0 and node.value is not None:
        entry = (node.last_access_time, node)
        heappush(heap, entry)
        if full0 and m0:
            heappush(heap, entry)
    cur = node.parent
    while cur is not root:
        if cur.id not in skip:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                delta += len(cur.key)
                if cur.aux_lock == 0 and cur.dev_children == 0 and cur.value is not None:
                    heappush(heap, (cur.last_access_time, cur))
        cur = cur.parent
    cache._evictable += delta
    cache._protected -= delta
    return DecLockRefResult(delta=delta)
