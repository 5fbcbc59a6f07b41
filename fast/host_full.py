"""Fast paths of the composed tree (fast/hybrid.py) with a host tier and no aux component: the
Full component alone over HiCache's host tier (fast/tiers/host.py), the ``lru`` eviction order,
plain (not EAGLE) keys.

The paths: ``insert_host``, ``match_host``, ``inc_lock_host`` and ``dec_lock_host`` (the host
tier's own backup for that shape is ``HostTier._write_backup_full``, fast/tiers/host.py).  Each
function here is one of ``HybridRadixCache``'s general paths written out for that shape,
with the same effects, checks, errors and order: the method calls the general path makes per
walked node (``_touch``, ``_stamp``, ``_push_if_leaf``, ``_ck``, ``_free``) are inlined, and the
key is read without building a ``RadixKey``.  ``HybridRadixCache._pick_fast_paths`` picks them
once at construction where the cache has that shape and the stock hooks; each one declines
(returns None having changed nothing) where the call needs what it does not write out (a
disabled cache, KV events, a storage tier, an EAGLE bigram key; an unlock without
the anchor of a lock this cache took), and the general path then runs.  Why they hold:

* with no aux component a node's ``aux`` is empty and ``aux_lock`` 0, so a touch is the stamp
  alone and the leaf test reads the Full fields only;
* a node of an insert's plan is attached, so its leaf test needs no parent check; a new leaf
  is unlocked, childless and holds device data, so it is an evictable leaf;
* with no validator a match ends where its walk ends (the general path's ``plain`` case), its
  device part the walk's last node with device data;
* a lock's anchor holds device data and a lock count, so it is not evicted while the lock is
  held: an unlock walks from it up to the root, as ``_full_write_unlock`` does.

tests/fast/test_host_fast_paths.py drives these paths and the general ones through the same
random steps and compares the results and the whole trees step by step.

C twins (fast/_core.c "host tier: Full match, locks, acks"): where the C core is built,
``match_host`` (after its key), ``inc_lock_host`` and ``dec_lock_host`` call ``host_match``,
``host_inc`` and ``host_dec`` first, and the host tier's ``_full_write_unlock`` and
``writing_check`` (its common case: ``_Event`` acks, no tp group, KV events, storage tier or
aux component) call ``host_unlock`` and ``host_writing`` where the cache has these paths (the
stock hooks).  Each twin takes the same steps in the same order and answers None, having changed
nothing, where it does not write a case out; the Python code here then runs, and stays the
reference and the fallback (``UNIRADIX_PURE_PYTHON=1``).  tests/fast/test_host_lock_twins.py
runs the twins against these functions in lockstep.

``insert_host`` has a C twin, ``_core.host_insert`` (fast/_core.c "host tier: Full insert"),
called once its checks, key and plan are done here: the same steps from the root's stamp on,
with ``HostTier._write_backup_full`` written out in C where the tier's ``write_backup`` is that
method and its written-out case holds (anything else calls the tier's ``write_backup``), and
the new leaf, the ack's event, the write lock's params and the answer made as their
``__init__`` makes them (the leaf's id drawn from fast/node.py's counter).  It declines (None,
nothing changed; the Python loop below runs) a plan entry that is not a ``Node``, units that
are not an int64 buffer, a heap or queue of frees that is not a plain list, a tier that is not
exactly ``HostTier``, a clock or threshold that is not a plain int.  The loop here stays the
reference and, without the core (``UNIRADIX_PURE_PYTHON=1``), the path;
tests/fast/test_host_insert_twin.py runs the two in lockstep (node ids included).

The device eviction of such a cache, fast/hybrid.py ``_evict_units(want)`` (its heap loop with
``HostTier.evict_leaf`` per leaf, the write-back check, the batch's release, the compaction),
has a C twin too, ``_core.host_evict`` (fast/_core.c "host tier: Full device evict", set up
below), which ``_evict_units`` calls first where ``_pick_fast_paths`` set ``_host_evict``;
it declines (None, nothing changed) before its first pop where the cache is not the plain
case (tests/fast/test_host_evict_twin.py runs the two in lockstep).
"""

from __future__ import annotations

from heapq import heappush
from typing import Any

import torch

from . import keys, policies
from .cache import STRIDE, UnifiedRadixCache, _core, _match_result, lock_walk
from .errors import InvalidInput
from .frees import FreeBatch
from .node import Node
from .one_aux import _key_parts
from .params import DecLockRefResult, InsertResult, MatchResult
from .structures import LazyHeap
from .tiers import host as _host
from .tiers.host import (
    Ack,
    HostDecLockRefParams,
    HostIncLockRefResult,
    HostTier,
    InFlight,
    _Event,
    count_arg,
)

FULL = 0  # the Full component's id in skip_lock_node_ids
_INT64 = torch.int64
_narrow_copy = torch.narrow_copy
_cat = torch.cat
_PLAN = UnifiedRadixCache._plan  # (the walk in one C call where the cache's is this one)
if _core is not None:  # the classes the C twins (fast/_core.c "host tier") check and build
    _core.host_setup(HostTier, LazyHeap, HostIncLockRefResult, DecLockRefResult,
                     HostDecLockRefParams, _Event, Ack, InFlight)


def _declines(cache: Any) -> bool:
    """What the insert leaves to the general path: a disabled cache, KV events, a storage
    tier below the host tier."""
    return cache.disable or cache._events is not None or cache.storage_tier is not None


# ----------------------------------------------------------------------------------------------
# insert
# ----------------------------------------------------------------------------------------------


def insert_args(params: Any, value: Any, n_tokens: int) -> tuple[torch.Tensor, int, bool, int]:
    """An insert's checks after its key's, in the composed tree's order (its general path's and
    ``insert_host``'s): ``value`` a 1-D int64 tensor of ``n_tokens`` slots, ``prev_prefix_len``
    a non-negative int, ``chunked`` a bool, ``priority`` an int (None read as 0).  Returns
    (value, prev_prefix_len, chunked, priority)."""
    if not isinstance(value, torch.Tensor) or value.dtype is not _INT64 or \
            value.shape != (n_tokens,):  # (dtypes are singletons; a torch.Size is a tuple)
        raise InvalidInput("value must be a 1-D int64 tensor with one slot per token")
    prev = params.prev_prefix_len
    if prev.__class__ is not int or prev < 0:
        count_arg("prev_prefix_len", prev)  # (raises)
    chunked = params.chunked
    if chunked is not True and chunked is not False:
        raise InvalidInput(f"chunked must be a bool, got {chunked!r}")
    priority = getattr(params, "priority", 0)
    if priority.__class__ is not int:
        priority = policies.check_priority(priority)
    return value, prev, chunked, priority


def insert_host(cache: Any, params: Any) -> InsertResult | None:
    """``HybridRadixCache._insert`` (inside ``insert``, which releases the frees queued on
    ``cache._deferred``) for Full over a host tier: the checks in the general path's order,
    the walk planned in one C call where the core is built (``_plan`` otherwise), each walked
    node stamped and pushed inline (``_touch``), the caller's duplicates queued inline
    (``_free``), hits counted inline (write-through backs a node up through
    ``HostTier.write_backup``), the new leaf made, pushed and counted inline.  Splits and
    restored evicted nodes go through the cache's own ``_split`` / ``_unevict``; with the slot
    ledger (``validate_slots``) the caller's slots are checked as the general path checks them
    and the ledger kept inline.  None, before anything changes, where ``_declines`` says so,
    for an EAGLE bigram key, and outside ``insert`` (no queue of frees)."""
    if _declines(cache):
        return None
    deferred = cache._deferred
    if deferred is None:
        return None
    units, ek, bigram = _key_parts(params.key)
    if bigram:
        return None
    total = len(units)
    value, prev, chunked, _ = insert_args(params, params.value, total)
    ps = cache.page_size
    n = total - total % ps
    if n < total:
        units = units[:n]
        value = value[:n]  # (a view)
    root = cache.root_node
    if _core is not None and type(cache)._plan is _PLAN:  # (the same walk, one C call)
        plan = _core.one_plan(root, units, ek, ps, keys.match_step)
    else:
        plan = cache._plan(ek, units)
    owned = cache._owned if cache.validate_slots else None  # the slot ledger, if kept
    if owned is not None:  # (the caller's slots: each page whole, allocated, not the tree's)
        slots = value.tolist()
        cache._check_slot_list(plan, slots, prev)
        cache.tier.check_unevict_slots(plan, slots)
    if params.swa_evicted_seqlen != 0 or params.mamba_value is not None:
        cache._check_aux(plan, prev, params)  # (raises: a setting that needs a component)
    if _core is not None:  # (the rest in one C call: fast/_core.c "host tier: Full insert")
        done = _core.host_insert(cache, plan, value, units, ek, prev, chunked, n, total, ps,
                                 deferred, owned)
        if done is not None:
            return done
    clock = cache._clock + STRIDE  # (``_stamp`` of the root: locked, never a leaf)
    cache._clock = clock
    root.last_access_time = clock
    if n == 0:
        return InsertResult(0, total, False)
    tier = cache.tier
    hits = not chunked and not tier.write_back  # write-through counts an insert's hits
    threshold = tier.write_through_threshold
    heap = cache._heap
    node, pos = root, 0
    for child, shared in plan:
        # ``_touch`` (with no aux component: ``_stamp`` and ``_push_if_leaf``), written out
        clock = cache._clock + STRIDE
        cache._clock = clock
        child.last_access_time = clock
        if child.value is not None:
            if child.lock_ref == 0 and child.aux_lock == 0 and child.dev_children == 0:
                heappush(heap, (clock, child))  # (attached: a plan node)
        else:
            tier.restamped(child)
        if shared < len(child.key):
            child = cache._split(child, shared)
        end = pos + shared
        if child.value is None:  # evicted to the host: the fresh slots are its own again
            cache._unevict(child, value, pos)  # (its slots taken: no duplicates to free)
        else:
            lo = prev if prev > pos else pos
            if lo < end:  # this node's duplicates: one piece per node (``_free``; the ledger
                # holds none of them: the checks above refused a caller's slot from
                # prev_prefix_len on that the tree holds)
                deferred.append(value[lo:end])
        if hits:  # (``HostTier.count_hit``: ``child`` holds device data here)
            count = child.hit_count + 1
            child.hit_count = count
            if child.host_value is None and count >= threshold:
                tier.write_backup(child)
        node, pos = child, end
    if pos < n:
        clock = cache._clock + STRIDE
        cache._clock = clock
        rest = units[pos:]
        ck = rest[0] if ps == 1 else tuple(rest[:ps])  # (``_ck``)
        if ek is not None:
            ck = (ek, ck)
        leaf = Node(rest, _narrow_copy(value, 0, pos, n - pos), node, ek, clock, ck)
        node.children[ck] = leaf
        node.dev_children += 1
        cache._evictable += n - pos
        if owned is not None:  # (``_own``)
            owned.update(leaf.value.tolist())
        heappush(heap, (clock, leaf))  # (an evictable leaf: unlocked, childless, device data)
        # (the general path's ``host_leaves.discard(node)`` changes nothing here: ``node`` is
        # the root or holds device data, restored above if it was evicted, so no host leaf)
        if hits:  # (``count_hit`` of the new leaf: it has no host copy)
            leaf.hit_count = 1
            if 1 >= threshold:
                tier.write_backup(leaf)
    return InsertResult(pos, total, False)


if _core is not None:  # what the C twin's written-out backup stands for (``_write_backup_full``)
    _core.host_insert_setup(_host.HostTier, _host.HostTier._write_backup_full,
                            _host.HostTier._full_write_lock, _host._Event, _host.Ack,
                            _host.InFlight, HostDecLockRefParams)
    # what the device evict's twin stands for (fast/_core.c "host tier: Full device evict",
    # called by fast/hybrid.py ``_evict_units``) and the batch it builds
    _core.host_evict_setup(_host.HostTier.evict_leaf, FreeBatch)


# ----------------------------------------------------------------------------------------------
# match_prefix
# ----------------------------------------------------------------------------------------------


def match_key(cache: Any, params: Any) -> tuple[Any, Any, int] | MatchResult | None:
    """A host-tier match's key as the fast paths read it (``one_aux._key_parts``): (units,
    extra key, whole-page length); the general path's empty result for a key shorter than a
    page; None for an EAGLE bigram key (the general path answers it).  (fast/host_aux.py's
    match reads its key here too.)"""
    units, ek, bigram = _key_parts(params.key)
    if bigram:
        return None
    n = len(units)
    n -= n % cache.page_size
    if n == 0:
        root = cache.root_node
        return _match_result((cache._empty, root, root, root, 0, 0, 0, None, None))
    return units, ek, n


def match_host(cache: Any, params: Any) -> MatchResult | None:
    """``HybridRadixCache.match_prefix`` for Full over a host tier: the walk through device
    nodes and evicted nodes with a host copy (splitting at a partial match through the cache's
    ``_split``), the device part the walk's device nodes, the stamps as
    ``_stamp_tiered_path`` gives them (each stamped node pushed where it may be a device leaf,
    re-entered on the host heap where it is a host leaf), and the host tokens below the device
    part as ``HostTier.host_hit`` counts them, all written out.  None, before anything
    changes, for a disabled cache and an EAGLE bigram key."""
    if cache.disable:
        return None
    parts = match_key(cache, params)
    if parts is None or isinstance(parts, MatchResult):
        return parts
    units, ek, n = parts
    if _core is not None:  # (the rest in one C call: the same steps)
        done = _core.host_match(cache, units, ek, n)
        if done is not None:
            return done
    root = cache.root_node
    ps = cache.page_size
    node, pos, chunks = root, 0, []
    last_device = root
    step = keys.match_step
    while pos < n:
        child, k, split = step(node.children, units, pos, n, ps, ek)
        if child is None:
            break
        value = child.value
        if value is None:
            if child.host_value is None:
                break
            if split:
                child = cache._split(child, k)
                value = child.value
        elif split:
            child = cache._split(child, k)
            value = child.value
        if value is not None:
            chunks.append(value)
            last_device = child
        node, pos = child, pos + k
        if split:
            break
    # (``_indices``)
    if not chunks:
        indices = cache._empty
    elif len(chunks) == 1:
        indices = chunks[0]
    else:
        indices = _cat(chunks)
    # (``_stamp_tiered_path(node)``)
    tier = cache.tier
    heap = cache._heap
    clock = cache._clock + STRIDE
    cache._clock = clock
    cur: Any = node
    while cur is not root:
        cur.last_access_time = clock
        if cur.value is None:
            tier.restamped(cur)
        elif cur.dev_children == 0 and cur.lock_ref == 0 and cur.aux_lock == 0:
            heappush(heap, (clock, cur))  # (attached: on the path)
        clock -= 1
        cur = cur.parent
    root.last_access_time = clock
    host_hit = 0
    if node is not last_device:  # (``HostTier.host_hit(node, last_device)``)
        cur = node
        while cur is not last_device and cur is not root:
            host = cur.host_value
            if host is not None:
                host_hit += host.shape[0]
            cur = cur.parent
    return _match_result((indices, last_device, node, node, host_hit, 0, 0, None, None))


# ----------------------------------------------------------------------------------------------
# Locks
# ----------------------------------------------------------------------------------------------


def inc_lock_host(cache: Any, node: Any) -> HostIncLockRefResult:
    """``HybridRadixCache.inc_lock_ref`` for Full over a host tier: the node's attachment
    checked (``_check_attached``), the evicted bottom segment skipped and remembered, its first
    node with device data the anchor, that node up to the root one lock more (``_inc_lock_py``
    and the anchor's walk as one walk).  A disabled cache gets the empty result, as there."""
    if _core is not None:  # (one C call: the same steps)
        done = _core.host_inc(cache, node)
        if done is not None:
            return done
    cache._check_attached(node)
    result = HostIncLockRefResult()
    if cache.disable:
        return result
    root = cache.root_node
    cur = node
    if cur is not root and cur.value is None:
        skipped = set()
        while cur is not root and cur.value is None:
            skipped.add(cur.id)
            cur = cur.parent
        result.skip_lock_node_ids = {FULL: skipped}
    result.anchor = cur
    delta = lock_walk(cur, root)
    cache._evictable -= delta
    cache._protected += delta
    result.delta = delta
    return result


def dec_lock_host(cache: Any, node: Any, params: Any) -> DecLockRefResult | None:
    """``HybridRadixCache.dec_lock_ref`` for Full over a host tier with the params of a lock
    it took (``HostDecLockRefParams`` with an anchor): ``HostTier._full_write_unlock`` of the
    anchor (every node from it up to the root one lock less, all checked first, the new
    leaves pushed in the walk's order), without the general path's list of unlocked nodes.
    None, before anything changes, for other params (the general path answers them)."""
    if _core is not None:  # (one C call: the same steps)
        done = _core.host_dec(cache, node, params)
        if done is not None:
            return done
    if params.__class__ is not HostDecLockRefParams:
        return None
    anchor = params.anchor
    if anchor is None:
        return None
    if cache.disable:
        return DecLockRefResult()
    return DecLockRefResult(delta=cache.tier._full_write_unlock(anchor))
