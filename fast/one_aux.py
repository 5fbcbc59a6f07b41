"""Fast paths of the composed tree (fast/hybrid.py) for its most common shape: exactly one aux
component (the stock SWA or Mamba plug-in), no host tier, the ``lru`` eviction order.

Each function here is one of ``HybridRadixCache``'s general paths written out for that shape,
with the same effects, checks and errors: the calls through the component hooks are inlined and
the Full walk and the component's walk share one loop.  ``HybridRadixCache`` picks them once at
construction (``_pick_fast_paths``); every other shape runs the general paths.  Why they hold:

* the one component's record on a node is ``node.aux[0]``;
* without a host tier every node in the tree holds Full data (only a host tier leaves evicted
  nodes in the tree), so a lock's Full walk starts at the node itself, and every node of a
  locked path is attached (a node with a Full lock is never evicted);
* the leaf test needs only the node's own fields, so a node that a fused walk has finished
  with can go on the eviction heap at once; the general path pushes the same entries (a node
  whose Full and aux counts both reached 0 twice, as its ``unlocked`` list holds it twice), in
  another order, which the heap does not see: its entries are ordered by (stamp, node id).

tests/fast/test_one_aux.py drives each fast path and its general path through the same
scenarios and compares the trees.

With the C core built, each of these functions first hands the call to its C twin in
fast/_core.c ("composed tree" sections: ``one_match``, ``clock_inc`` / ``clock_dec``,
``one_plan`` / ``one_insert``, ``aux_evict_swa`` / ``aux_evict_mamba``), which does the same
steps on the same objects; where the twin declines (None, nothing changed) the Python code
below runs, and it is the whole path with ``UNIRADIX_PURE_PYTHON=1``.
tests/fast/test_one_aux_c_*.py run each twin against the Python code.
"""

from __future__ import annotations

from array import array
from heapq import heappop, heappush
from typing import Any

import torch

from . import compat, keys, policies
from .cache import STRIDE, UnifiedRadixCache, _core
from .components import MAMBA_ID, SWA_ID, AuxData
from .components.mamba import mamba_state
from .components.swa import SWA_SPLIT_EPOCH, lock_window, split_off_skipped
from .errors import HandleError, InvalidInput, NodeNotFound
from .frees import FreeBatch, release
from .node import Node
from .params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictResult,
    IncLockRefResult,
    InsertResult,
    MatchResult,
)
from .radix_key import RadixKey, as_token_array
from .structures import LruList
from .token_range import check_token_range

FULL = 0  # the Full component's id in skip_lock_node_ids
_INF = float("inf")
_INT64 = torch.int64
_cat = torch.cat
_narrow_copy = torch.narrow_copy
_PLAN = UnifiedRadixCache._plan  # (insert_one plans in C where the cache's is this one)

if _core is not None:
    # the slot offsets of the node, record and LRU-end classes, so the C core's paths of the
    # composed tree read their fields in place (fast/_core.c "Python-node fields")
    _core.setup_pynode(Node, AuxData, type(LruList().head))
    # the lock paths below in C ("composed tree: clock"): their result classes, errors, keys
    _core.setup_clock(IncLockRefResult, DecLockRefResult, DecLockRefParams, NodeNotFound,
                      HandleError, SWA_ID, MAMBA_ID, SWA_SPLIT_EPOCH)
    _core.one_match_setup(heappush)
#: :func:`match_one`'s walk in C (fast/_core.c "composed tree: cmatch"), or None: Python's
_one_match = _core.one_match if _core is not None else None


def _key_parts(key: Any) -> tuple[array, Any, bool]:
    """``key``'s token ids as ``array('q')``, its extra key and its ``is_bigram``, as
    ``compat.as_radix_key`` would make them, without building the ``RadixKey``: for an object
    of sglang's ``RadixKey`` shape (what a scheduler passes) with an ``array('q')`` of token
    ids, the array itself (what ``RadixKey`` keeps: nothing to convert or check), with a list,
    ``radix_key.as_token_array`` of it (what ``RadixKey`` makes of it: one C pass where the
    core is built, its errors otherwise); anything else, or anything ``as_radix_key`` would
    refuse, through ``as_radix_key`` itself (its checks, its errors, its order).
    (fast/host_full.py's paths read their keys here too.)"""
    if key.__class__ is not RadixKey:
        toks: Any = getattr(key, "token_ids", None)
        cls = toks.__class__
        if cls is list or cls is array:
            ek, bigram = getattr(key, "extra_key", None), getattr(key, "is_bigram", None)
            if (ek is None or ek.__class__ is str) and (bigram is True or bigram is False):
                if cls is array:
                    if toks.typecode == "q":
                        return toks, ek, bigram
                else:  # (the key's other fields are checked: its errors are the tokens')
                    return as_token_array(toks), ek, bigram
        key = compat.as_radix_key(key)
    toks = key.token_ids
    return toks if toks.__class__ is array else array("q", toks), key.extra_key, key.is_bigram


# ----------------------------------------------------------------------------------------------
# match_prefix (SWA or Mamba)
# ----------------------------------------------------------------------------------------------


def match_one(cache: Any, params: Any) -> MatchResult | None:
    """``HybridRadixCache.match_prefix`` with its one component's validator inlined (SWA: a
    run of contiguous SWA units up to the node reaching the window, restarted at a tombstone;
    Mamba: a state on the node, the same rule with a window of 0), and ``path_to_front``,
    ``_stamp_path`` and the leaf push of the matched node in one walk up.  None for what it
    leaves to the general path: an EAGLE bigram key and a Mamba copy-on-write match."""
    if _one_match is not None:  # (all of it in C; None: it left the call to this code)
        result = _one_match(cache, params)
        if result is not None:
            return result
    units, ek, bigram = _key_parts(params.key)
    if bigram:
        return None
    comp = cache.components[0]
    window = cache._inline_window
    if window == 0 and getattr(params, "cow_mamba", False):
        return None
    root = cache.root_node
    ps = cache.page_size
    n = len(units) - len(units) % ps
    if cache.disable or n == 0:
        return MatchResult(cache._empty, root, root, root, 0, 0, 0, None, None)
    node, pos, chunks = root, 0, []
    best, best_chunks = root, 0
    run = _INF
    step = keys.match_step
    while pos < n:
        child, k, split = step(node.children, units, pos, n, ps, ek)
        if child is None or child.value is None:
            break
        if split:
            child = cache._split(child, k)
        chunks.append(child.value)
        node, pos = child, pos + k
        if child.aux[0].value is None:
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
        rec = cur.aux[0]
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
# insert (SWA or Mamba)
# ----------------------------------------------------------------------------------------------


def check_swa_prev(swa: Any, plan: list, prev: int, params: Any, e: int) -> None:
    """``SwaComponent.check_insert`` where it can raise, for the one-component inserts (this
    module's ``insert_one``, fast/host_aux.py ``insert_host_aux``): only a plan node that
    ``prev_prefix_len`` cuts inside, inside the window, an SWA tombstone with Full data (a
    node before prev cannot hold it: nothing to check at 0)."""
    if not prev:
        return
    start = 0
    for child, shared in plan:
        if start < prev < start + shared and e < start + shared \
                and child.value is not None and child.aux[0].value is None:
            swa.check_insert(plan, prev, params, e)  # (raises)
        start += shared


def insert_one(cache: Any, params: Any) -> InsertResult | None:
    """``HybridRadixCache._insert`` (inside ``insert``, which releases the frees) with the walk
    planned inline (``_plan``), each walked node touched inline (``_touch``: stamp, leaf push,
    its record to the front), the new leaf made and pushed inline, and the component's commit
    inline (SWA: the leaf's SWA data inside the window; Mamba: the state on the last node).
    The checks are the general path's, in its order.  None, before anything changes, for an
    EAGLE bigram key (the general path's)."""
    value = params.value
    units, ek, bigram = _key_parts(params.key)
    if bigram:
        return None
    total = len(units)
    if not isinstance(value, torch.Tensor) or value.dtype is not _INT64 or \
            value.shape != (total,):  # (dtypes are singletons; a torch.Size is a tuple)
        raise InvalidInput("value must be a 1-D int64 tensor with one slot per token")
    prev = params.prev_prefix_len
    if prev.__class__ is not int or prev < 0:  # (tiers/host.py count_arg)
        raise InvalidInput(f"prev_prefix_len must be a non-negative int, got {prev!r}")
    chunked = params.chunked
    if chunked is not True and chunked is not False:
        raise InvalidInput(f"chunked must be a bool, got {chunked!r}")
    priority = getattr(params, "priority", 0)
    if priority.__class__ is not int:
        policies.check_priority(priority)
    ps = cache.page_size
    n = len(units) - len(units) % ps
    if n < len(units):
        units = units[:n]
    if n < total:
        value = value[:n]  # (a slice: the view torch.narrow makes, in half its time)
    root = cache.root_node
    # the walk, before anything changes (``_plan``): (node, units shared), the last one cut
    if _core is not None and type(cache)._plan is _PLAN:  # (the same walk, one C call)
        plan = _core.one_plan(root, units, ek, ps, keys.match_step)
    else:
        plan = cache._plan(ek, units)
    if cache.validate_slots and not cache.disable:
        cache._check_slot_list(plan, value.tolist(), prev)
    swa = cache.swa
    e = params.swa_evicted_seqlen
    if swa is not None:  # (``_check_aux`` with ``SwaComponent.check_insert``, inlined)
        if e.__class__ is not int or e < 0 or e % ps or params.mamba_value is not None:
            _, e = cache._check_aux(plan, prev, params)  # (raises: its checks, its order)
        if cache.disable:
            return InsertResult(prefix_len=0)
        check_swa_prev(swa, plan, prev, params, e)
        prepared = None
    elif e.__class__ is int and e == 0 and not cache.validate_slots:
        # Mamba: ``_check_aux`` and the component's ``check_insert`` for what passes their
        # setting checks without a call (no SWA setting, no slot ledger to consult)
        if cache.disable:  # (a disabled cache checks only the settings)
            return InsertResult(prefix_len=0)
        prepared = mamba_state(params.mamba_value)
    else:
        checked, e = cache._check_aux(plan, prev, params)
        if cache.disable:  # (after the checks: a disabled cache refuses bad input as the spec)
            return InsertResult(prefix_len=0)
        prepared = checked[0]
    if cache._events is not None:
        check_token_range(units, False)  # page keys take [0, 2**32) (fast/token_range.py)
    cache._clock += STRIDE  # (``_stamp`` of the root: never a leaf)
    root.last_access_time = cache._clock
    if n == 0:
        return InsertResult(prefix_len=0, total_len=total, mamba_exist=True)
    comp = cache.components[0]
    lru = comp.lru
    head = lru.head
    heap = cache._heap
    # Mamba over the C core without a slot ledger, inside ``insert`` (its queue of frees):
    # the duplicates are queued here and written at the end (see the end of this function)
    deferred = cache._deferred
    direct = swa is None and deferred is not None and _core is not None \
        and not cache.validate_slots
    if _core is not None:  # the rest in C, the same steps (fast/_core.c "composed tree: cinsert")
        done = _core.one_insert(cache, comp, swa, plan, value, units, ek, prev, e, n, total,
                                prepared, direct, ps)
        if done is not None:
            return done
    node, pos = root, 0
    for child, shared in plan:
        # ``_touch``: the newest stamp, a fresh heap entry for a leaf, its record to the front
        cache._clock += STRIDE
        stamp = child.last_access_time = cache._clock
        if child.lock_ref == 0 and child.aux_lock == 0 and child.dev_children == 0:
            heappush(heap, (stamp, child))
        rec = child.aux[0]
        if rec.value is not None:  # (LruList.move_after to the front, inlined)
            rec.lru_prev.lru_next = rec.lru_next
            rec.lru_next.lru_prev = rec.lru_prev
            nxt = head.lru_next
            rec.lru_prev, rec.lru_next = head, nxt
            head.lru_next = nxt.lru_prev = rec
        if shared < len(child.key):
            child = cache._split(child, shared)
        end = pos + shared
        # a locked SWA tombstone keeps its slots (another holder reads them; docs/SPEC.md)
        if swa is not None and prev < end and child.aux[0].value is None \
                and child.lock_ref == 0:
            taken = swa.overlap(child, pos, shared, value, prev, e)
        else:
            taken = shared
        lo = prev if prev > pos else pos
        if lo < pos + taken:  # this node's duplicates: one piece per node, as upstream frees
            if direct:  # (``_free``, inlined: ``insert`` releases its queue at its end)
                deferred.append(value[lo:pos + taken])
            else:
                cache._free(value[lo:pos + taken])
        node, pos = child, end
    target, is_new = node, False
    both = None  # (a new leaf's Full and SWA slots from ``swa_leaf``)
    if pos < n:
        if swa is not None and e >= n:  # (``skips_leaf``: wholly outside the window)
            cache._free(value[pos:n])  # no leaf: the slots go back
            return InsertResult(prefix_len=pos, mamba_exist=False)
        cache._clock += STRIDE
        rest = units[pos:]
        ck = rest[0] if ps == 1 else tuple(rest[0: ps])
        if ek is not None:
            ck = (ek, ck)
        # the leaf's Full slots (a copy: the caller's tensor is not kept) and, where its SWA
        # data will be all of it (the window starts at or before it), its SWA slots: over
        # sglang's own map both in one C call (``swa_leaf``), else torch and ``translate``
        if swa is not None and e <= pos and swa.map_pool is not None:
            both = _core.swa_leaf(value, pos, n - pos, swa.map_pool.full_to_swa_index_mapping)
        full = _narrow_copy(value, 0, pos, n - pos) if both is None else both[0]
        leaf = Node(rest, full, node, ek, cache._clock, ck)
        leaf.aux = (AuxData(leaf),)
        node.children[ck] = leaf
        node.dev_children += 1
        cache._evictable += n - pos
        if cache.validate_slots:  # (``_own``)
            cache._owned.update(leaf.value.tolist())
        heappush(heap, (leaf.last_access_time, leaf))  # (a new leaf: unlocked, no children)
        if cache._events is not None:
            cache._events.stored(leaf)
        target, is_new = leaf, True
    exist = False
    if swa is not None:  # (``SwaComponent.commit``)
        if is_new and e - pos < len(target.key):
            if e - pos > 0:
                cache._split(target, e - pos)
            # (``AuxComponent.set`` of a new leaf, inlined: unlocked, no host copy)
            rec = target.aux[0]
            rec.value = comp.translate(target.value) if both is None else both[1]
            nxt = head.lru_next
            rec.lru_prev, rec.lru_next = head, nxt
            head.lru_next = nxt.lru_prev = rec
            comp.evictable += len(target.key)
    elif is_new or target.aux[0].value is None:  # (``MambaComponent.commit``)
        rec = target.aux[0]  # (``AuxComponent.set``: no host copy without a host tier)
        rec.value = prepared
        nxt = head.lru_next  # (LruList.push_front, inlined)
        rec.lru_prev, rec.lru_next = head, nxt
        head.lru_next = nxt.lru_prev = rec
        if rec.lock:
            comp.protected += 1
        else:
            comp.evictable += 1
        if comp.tracks_slots:
            comp.on_set(prepared)
        if not is_new:
            cache._stamp(target)
    else:
        lru.move_after(head, target.aux[0])
        cache._stamp(target)
        exist = True
    if direct and deferred:
        # ``insert``'s release of its queue (one ``release`` of the pieces in order, after
        # this returns), written by the C core here without the layers of fast/frees.py
        # ``release`` in front of it; where the C core declines (nothing changed), the
        # pieces stay queued and ``insert`` releases them as before
        try:
            done = _core.native_release(None, cache.token_to_kv_pool_allocator, deferred)
        except BaseException:
            deferred.clear()  # (tried once, as ``insert``'s release would have: no retry)
            raise
        if done:
            deferred.clear()
    return InsertResult(pos, total, exist)


# ----------------------------------------------------------------------------------------------
# Locks (SWA or Mamba)
# ----------------------------------------------------------------------------------------------


def inc_lock_one(cache: Any, node: Any) -> IncLockRefResult:
    """``inc_lock_one_py`` in C where the C core is built (fast/_core.c "composed tree:
    clock": the same steps); the Python function where the C one declines the call."""
    if _core is not None:
        done = _core.clock_inc(cache, node)
        if done is not None:
            return done
    return inc_lock_one_py(cache, node)


def inc_lock_one_py(cache: Any, node: Any) -> IncLockRefResult:
    """``HybridRadixCache.inc_lock_ref`` (``_check_attached``, ``_inc_lock_py``, the
    component's ``lock``).  SWA: one walk takes the Full lock up to the root and, while the
    window is not full, the SWA lock (tombstones skipped and remembered, the window's end
    marked).  Mamba: the Full walk, then the node's state (a node without one is skipped and
    remembered)."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise NodeNotFound("the node is not in the tree")
    result = IncLockRefResult()
    if cache.disable:
        return result
    comp, is_swa, _ = cache._one_aux
    if is_swa:
        delta = lock_window(comp, node, result, root, True)
    else:  # (the Full walk: every node holds Full data without a host tier, none is skipped)
        delta = cache._inc_lock_py(root, node, result)
        if node is not root:
            rec = node.aux[0]
            if rec.value is None:
                result.skip_lock_node_ids.setdefault(MAMBA_ID, set()).add(node.id)
            else:
                if rec.lock == 0:
                    comp.evictable -= 1
                    comp.protected += 1
                rec.lock += 1
                node.aux_lock += 1
    cache._evictable -= delta
    cache._protected += delta
    result.delta = delta
    return result


def _push_unlocked(heap: list, node: Any, twice: bool) -> None:
    """The general path's ``_push_if_leaf`` of a node on its ``unlocked`` list, where it stands
    once per count that reached 0 (``twice``: its Full and its component's): an evictable leaf
    now goes on the heap that many times.  (Attached: it was on a locked path.)"""
    if node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
            and node.value is not None:
        entry = (node.last_access_time, node)
        heappush(heap, entry)
        if twice:
            heappush(heap, entry)


def dec_lock_one(cache: Any, node: Any, params: DecLockRefParams | None) -> DecLockRefResult:
    """``dec_lock_one_py`` in C where the C core is built (fast/_core.c "composed tree:
    clock": the same steps); the Python function where the C one declines the call."""
    if _core is not None:
        done = _core.clock_dec(cache, node, params)
        if done is not None:
            return done
    return dec_lock_one_py(cache, node, params)


def dec_lock_one_py(cache: Any, node: Any, params: DecLockRefParams | None) -> DecLockRefResult:
    """``HybridRadixCache.dec_lock_ref`` (``_dec_full_lock``, the component's ``unlock``, the
    pushes of the new leaves) for ``params`` None or a plain ``DecLockRefParams``.  Every Full
    count is checked first (a refused unlock changes nothing).  SWA: then one walk undoes the
    Full lock up to the root and the SWA lock up to the window's end mark.  Mamba: the node
    (Full and state), then its ancestors (Full)."""
    root = cache.root_node
    if not isinstance(node, Node) or (node is not root and node.parent is None):
        raise NodeNotFound("the node is not in the tree")
    if cache.disable:
        return DecLockRefResult()
    comp, is_swa, comp_id = cache._one_aux
    if params is None:
        skip: Any = ()
        cskip: Any = ()  # the component's skipped nodes
    else:
        skips = params.skip_lock_node_ids
        skip = skips.get(FULL, ())
        cskip = skips.get(comp_id, ())
    cur: Any = node
    while cur is not root:
        if cur.lock_ref <= 0 and cur.id not in skip:
            raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
        cur = cur.parent
    heap = cache._heap
    cur, delta = node, 0
    if is_swa:
        boundary = params.swa_uuid_for_lock if params is not None else None
        seen = -1 - min(params.skip_lock_node_ids.get(SWA_SPLIT_EPOCH, (0,))) \
            if cskip and params is not None else 0
        while cur is not root:  # up to the window's end mark: Full and SWA
            full0 = swa0 = end = False
            if cur.id not in skip:
                cur.lock_ref -= 1
                if cur.lock_ref == 0:
                    delta += len(cur.key)
                    full0 = True
            rec = cur.aux[0]
            if rec.lock and cur.id not in cskip \
                    and not (cskip and split_off_skipped(rec, cskip, seen)):
                if rec.lock == 1:
                    k = len(cur.key)
                    comp.evictable += k
                    comp.protected -= k
                    swa0 = True
                rec.lock -= 1
                cur.aux_lock -= 1
                end = rec.boundary is not None and rec.boundary == boundary  # (marks: >= 1)
            if full0 or swa0:
                _push_unlocked(heap, cur, full0 and swa0)
            cur = cur.parent
            if end:
                break
    elif node is not root:
        full0 = m0 = False
        if node.id not in skip:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta = len(node.key)
                full0 = True
        rec = node.aux[0]
        if rec.lock > 0 and node.id not in cskip:
            if rec.lock == 1:
                comp.evictable += 1
                comp.protected -= 1
                m0 = True
            rec.lock -= 1
            node.aux_lock -= 1
        if full0 or m0:
            _push_unlocked(heap, node, full0 and m0)
        cur = node.parent
    while cur is not root:  # the rest of the path: Full only
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


# ----------------------------------------------------------------------------------------------
# evict (SWA or Mamba)
# ----------------------------------------------------------------------------------------------


def _evict_wants(cache: Any, params: Any) -> tuple[int, int, int] | None:
    """``params``' three amounts (Full tokens, SWA tokens, Mamba states) where the evicts below
    take the call; None for what they leave to the general path: an amount that is not a
    non-negative int (the general path refuses it), a cache with its own
    ``_evict_units`` (enable_metrics wraps it, fast/metrics.py), and a disabled cache (the
    general path answers it: nothing evicted)."""
    if "_evict_units" in cache.__dict__ or cache.disable:
        return None
    want = params.num_tokens
    swa_want, mamba_want = params.swa_num_tokens, params.mamba_num
    if want.__class__ is not int or swa_want.__class__ is not int \
            or mamba_want.__class__ is not int or want < 0 or swa_want < 0 or mamba_want < 0:
        return None
    return want, swa_want, mamba_want


def evict_one(cache: Any, params: Any) -> EvictResult | None:
    """``HybridRadixCache.evict`` (``_evict_units``, then the component's ``drive``) with the
    calls per evicted node written out: the Full leaf deletion is :func:`_delete_leaf_one`,
    the component's ``drop`` of an internal node's data is inline (one component: no cascade).
    Frees go through the same ``FreeBatch`` and ``_release``.  None for what it leaves to the
    general path (:func:`_evict_wants`)."""
    wants = _evict_wants(cache, params)
    if wants is None:
        return None
    want, swa_want, mamba_want = wants
    comp, is_swa, _ = cache._one_aux
    if not is_swa and _core is not None and not cache.validate_slots:
        return _evict_mamba(cache, comp, want, mamba_want)
    tracker = [0, 0]  # Full units, the component's units
    batch = FreeBatch()
    heap = cache._heap
    try:
        while tracker[0] < want and heap:
            stamp, node = heappop(heap)
            # (the entry is live: its stamp is the node's and the node is an evictable leaf)
            if node.last_access_time != stamp or node.lock_ref or node.aux_lock \
                    or node.dev_children or node.value is None or node.parent is None:
                continue
            _delete_leaf_one(cache, comp, is_swa, node, tracker, batch)
        aux_want = swa_want if is_swa else mamba_want
        lru = comp.lru
        head = lru.head
        x = lru.tail.lru_prev
        while tracker[1] < aux_want and x is not head:
            nxt = x.lru_prev  # NOTE: evicting x never unlinks another record of the list
            if x.lock == 0:
                node = x.node
                if node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
                        and node.value is not None and node.parent is not None:
                    _delete_leaf_one(cache, comp, is_swa, node, tracker, batch)
                else:  # (``AuxComponent.drop``, not a leaf: SWA frees its slots, a tombstone)
                    k = len(node.key) if is_swa else 1
                    tracker[1] += k
                    comp.evictable -= k
                    later = x.lru_next  # (LruList.remove; ``nxt`` is x's older neighbour)
                    nxt.lru_next = later
                    later.lru_prev = nxt
                    x.lru_prev = x.lru_next = None
                    if is_swa:
                        batch.add("free_swa", node.value)
                    else:
                        batch.states.append(x.value)
                    x.value = None
            x = nxt
    finally:
        cache._release(batch)
    _compact_if_stale(cache, heap)
    return EvictResult(tracker[0], tracker[1] if is_swa else 0, 0 if is_swa else tracker[1])


def _pop_leaf(heap: list) -> Any:
    """The oldest live entry's node off the leaf heap (an entry is live while its stamp is the
    node's and the node is an evictable leaf; stale ones are dropped), None once it is empty."""
    while heap:
        stamp, node = heappop(heap)
        if node.last_access_time == stamp and not node.lock_ref and not node.aux_lock \
                and not node.dev_children and node.value is not None \
                and node.parent is not None:
            return node
    return None


def _unlink(rec: Any) -> None:
    """``LruList.remove`` of a component record (its neighbours joined)."""
    prev, nxt = rec.lru_prev, rec.lru_next
    prev.lru_next = nxt
    nxt.lru_prev = prev
    rec.lru_prev = rec.lru_next = None


def _unhook(node: Any, heap: list, root: Any) -> None:
    """The end of ``_detach_leaf`` for a leaf whose slots and data already went: it leaves its
    parent, and the parent, if that made it an evictable leaf, goes on the heap
    (``_push_if_leaf``).  Shared by the written-out evicts below."""
    parent = node.parent
    del parent.children[node.ck]
    node.parent = None
    parent.dev_children -= 1
    if parent is not root and parent.dev_children == 0 and parent.lock_ref == 0 \
            and parent.aux_lock == 0 and parent.value is not None and parent.parent is not None:
        heappush(heap, (parent.last_access_time, parent))


def _compact_if_stale(cache: Any, heap: list) -> None:
    """The end of an evict: ``LazyHeap.needs_compaction`` of the leaf heap, its bound on the
    live entries from the Full counter, written out, and the compaction where it says so.
    Shared by the written-out evicts (here and fast/pair_evict.py)."""
    live = cache._evictable // cache.page_size
    if len(heap) > 64 and len(heap) > 4 * (live + 16):
        cache._leaf_heap.compact(cache._is_leaf)


def evict_swa(cache: Any, params: Any) -> EvictResult | None:
    """:func:`evict_one` for the SWA component with every call per node written out: the
    Full leaf deletions (``_delete_leaf_one``) of both loops, the tombstones of the second,
    the leaf pushes, the counters in locals.  The same nodes in the same order, the same frees
    in the same runs, the same counts.  (Over sglang's allocators the SWA pool is the one that
    runs short: nearly all of an evict is the second loop, the SWA list from its oldest.)"""
    wants = _evict_wants(cache, params)
    if wants is None:
        return None
    want, swa_want, mamba_want = wants
    comp = cache._one_aux[0]
    batch = FreeBatch()
    heap = cache._heap
    root = cache.root_node
    events = cache._events
    add = batch.add
    full = swa_units = 0  # Full units, SWA units
    try:
        done = None if _core is None else _core.aux_evict_swa(cache, comp, want, swa_want,
                                                               batch.runs)
        if done is not None:  # (the loops below, in C: fast/_core.c "composed tree: cevict")
            full, swa_units = done
            want = swa_want = 0  # (nothing left for the loops below)
        while full < want:  # the oldest evictable leaves
            node = _pop_leaf(heap)
            if node is None:
                break
            # (``_delete_leaf_one``: its SWA data goes with its Full slots, through the map)
            if events is not None:
                events.removed(node)
            rec = node.aux[0]
            k = len(node.key)
            if rec.value is not None:
                swa_units += k
                comp.evictable -= k
                _unlink(rec)
                rec.value = None
            add("free", node.value)
            full += k
            cache._evictable -= k
            node.value = None  # (``_detach_leaf``)
            _unhook(node, heap, root)
        lru = comp.lru
        head = lru.head
        x = lru.tail.lru_prev
        while swa_units < swa_want and x is not head:  # the SWA list from its oldest
            nxt = x.lru_prev  # NOTE: evicting x never unlinks another record of the list
            if x.lock == 0:
                node = x.node
                k = len(node.key)
                leaf = node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
                    and node.value is not None and node.parent is not None
                if leaf and events is not None:
                    events.removed(node)
                swa_units += k  # (the record leaves the list; ``nxt``, its older
                comp.evictable -= k  # neighbour, stays where it is)
                _unlink(x)
                if leaf:  # (``_delete_leaf_one``, as above)
                    x.value = None
                    add("free", node.value)
                    full += k
                    cache._evictable -= k
                    node.value = None
                    _unhook(node, heap, root)
                else:  # (``AuxComponent.drop``, not a leaf: SWA frees its slots, a tombstone)
                    add("free_swa", node.value)
                    x.value = None
            x = nxt
    finally:
        cache._release(batch)
    _compact_if_stale(cache, heap)
    return EvictResult(full, swa_units, 0)


def _evict_mamba(cache: Any, comp: Any, want: int, mamba_want: int) -> EvictResult:
    """:func:`evict_one` for the Mamba component over the C core without a slot ledger, every
    call per node written out (``_delete_leaf_one``, ``AuxComponent.drop``, the leaf pushes)
    and the frees handed to the C core's ``native_release`` directly: the same nodes in the
    same order, the same two writes (the KV slots of the deleted leaves in deletion order,
    then the states in drop order) as ``FreeBatch.release`` makes through fast/frees.py
    ``release``, which still runs for an allocator the C core declines (``native_release``
    answers False with nothing changed: not one of its exact classes, a free group, the
    first call before fast/frees.py set it up, ...).  An evict frees two lists, so the
    layers of ``release`` in front of each write were a third of its time."""
    kv: list = []  # the deleted leaves' Full slots, in deletion order
    states: list = []  # the dropped states, in drop order
    heap = cache._heap
    root = cache.root_node
    events = cache._events
    full = units = 0  # Full units, states
    try:
        done = _core.aux_evict_mamba(cache, comp, want, mamba_want, kv, states)
        if done is not None:  # (the loops below, in C: fast/_core.c "composed tree: cevict")
            full, units = done
            want = mamba_want = 0  # (nothing left for the loops below)
        while full < want:  # the oldest evictable leaves
            node = _pop_leaf(heap)
            if node is None:
                break
            # (``_delete_leaf_one``: its state goes, then its Full slots)
            if events is not None:
                events.removed(node)
            rec = node.aux[0]
            if rec.value is not None:
                units += 1
                comp.evictable -= 1
                _unlink(rec)
                states.append(rec.value)
                rec.value = None
            kv.append(node.value)
            k = len(node.key)
            full += k
            cache._evictable -= k
            node.value = None  # (``_detach_leaf``)
            _unhook(node, heap, root)
        head = comp.lru.head
        x = comp.lru.tail.lru_prev
        while units < mamba_want and x is not head:  # the state list from its oldest
            nxt = x.lru_prev  # NOTE: evicting x never unlinks another record of the list
            if x.lock == 0:
                node = x.node
                leaf = node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
                    and node.value is not None and node.parent is not None
                if leaf and events is not None:  # (``_delete_leaf_one``: before any change)
                    events.removed(node)
                units += 1  # (the record leaves the list; ``nxt``, its older neighbour,
                comp.evictable -= 1  # stays where it is)
                _unlink(x)
                states.append(x.value)
                x.value = None
                if leaf:  # (``_delete_leaf_one``, as above: then its Full slots)
                    kv.append(node.value)
                    k = len(node.key)
                    full += k
                    cache._evictable -= k
                    node.value = None
                    _unhook(node, heap, root)
            x = nxt
    finally:  # (``_release``: the KV list's write, then the states'; no ledger to update)
        if kv:
            alloc = cache.token_to_kv_pool_allocator
            if not _core.native_release(None, alloc, kv):
                release(alloc, kv)
        if states:
            alloc = comp.allocator
            if not _core.native_release(None, alloc, states):
                release(alloc, states)
    _compact_if_stale(cache, heap)
    return EvictResult(full, 0, units)


def _delete_leaf_one(cache: Any, comp: Any, is_swa: bool, node: Any, tracker: list,
                     batch: Any) -> None:
    """``HybridRadixCache._delete_leaf`` of device leaf ``node`` for one component: its
    component data (``drop`` as a leaf: a Mamba state onto ``batch.states``; SWA slots go back
    with the Full slots), its Full slots (a ``"free"`` run), then it leaves the tree and its
    parent may become a leaf."""
    if cache._events is not None:
        cache._events.removed(node)
    rec = node.aux[0]
    k = len(node.key)
    if rec.value is not None:
        u = k if is_swa else 1
        tracker[1] += u
        comp.evictable -= u
        prev, nxt = rec.lru_prev, rec.lru_next  # (LruList.remove)
        prev.lru_next = nxt
        nxt.lru_prev = prev
        rec.lru_prev = rec.lru_next = None
        if not is_swa:
            batch.states.append(rec.value)
        rec.value = None
    batch.add("free", node.value)
    tracker[0] += k
    cache._evictable -= k
    node.value = None  # (``_detach_leaf``)
    parent = node.parent
    del parent.children[node.ck]
    node.parent = None
    parent.dev_children -= 1
    if parent is not cache.root_node and parent.dev_children == 0:
        cache._push_if_leaf(parent)
