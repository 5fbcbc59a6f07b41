"""Paths of the composed tree (fast/hybrid.py) with a host tier and exactly one aux component
(the stock SWA or Mamba plug-in), the ``lru`` eviction order, plain keys: ``match_host_aux``
(the general match with the validators written out, below) and the locks ``inc_lock_host_aux``
and ``dec_lock_host_aux``, and ``write_lock`` (the write-through backup's lock,
``HostTier.write_backup``).

The locks hand the call to fast/one_aux.py's lock paths (``inc_lock_one`` / ``dec_lock_one``, with
their C twins ``clock_inc`` / ``clock_dec``), which are the general paths written out for one
aux component without a host tier, wherever the host tier makes no difference to the call, and
decline (return None having changed nothing, the general path then runs) everywhere else.  Why
the calls they answer are the same as the general path's:

* they answer only for a node that is attached and holds device data (or the root).  A node
  with device data has device data on every ancestor (an evicted node has no device child), so
  the general path's ``_inc_lock_py`` skips nothing, its anchor is the node, and the Full lock
  counts from the node up to the root: what ``inc_lock_one`` does.  The component's lock is
  the same walk in both (SWA: ``lock_window``; Mamba: the node's state), host copies play no
  part in a device lock;
* an unlock is answered only with the params of such a lock (``HostDecLockRefParams`` whose
  anchor is the node itself, no Full node skipped): the general path then undoes the Full lock
  from the anchor, which is the node, with nothing skipped, as ``dec_lock_one`` does from the
  node; every node of that path is Full-locked and so holds device data and is attached (the
  general path's walk to a detached node's former parent, ``SwaComponent._up``, never runs);
  the pushes of the new leaves are the same entries in another order (fast/one_aux.py's
  docstring says why that order is not seen).

An evicted node (its lock skips the evicted bottom segment and anchors above it), a detached
node, a disabled cache and any other params go to the general path.  ``HybridRadixCache.
_pick_fast_paths`` picks these once at construction (the match only for plain keys, with the
hooks it calls as the class has them); tests/fast/test_host_aux_paths.py drives them and the
general paths through the same recorded steps in lockstep and compares the trees step by step.

The insert, ``insert_host_aux``, is ``_insert`` itself for that shape: its checks in its order
here, then the rest in C (``_core.host_aux_insert``, fast/_core.c "host tier: one aux
component's insert"), the same steps from the root's stamp on; where either declines (the slot
ledger, KV events, a storage tier, a disabled cache, bigram keys, odd types) ``_insert`` runs
from its start (tests/fast/test_host_aux_insert_twin.py runs the two in lockstep).

The device evict of such a cache, fast/hybrid.py ``_evict_units(want, wants)`` (the heap loop
with ``HostTier.evict_leaf`` and the component's part of ``_drop_device``, then the
component's ``drive``, the passed-over leaves, write-back's check, the batch's release, the
compaction), has a C twin, ``_core.host_aux_evict`` (fast/_core.c "host tier: one aux
component's device evict"), which ``_evict_units`` calls first where ``_pick_fast_paths`` set
``_host_aux_evict`` (the eviction hooks as the class has them); the plug-in classes it writes
out are registered below.  It calls the tier's ``_take_host`` (with the component's
``backup``), ``write_backup``, ``writing_check`` and the cache's ``_release`` as the Python
path does, and declines (None, nothing changed) before its first pop where the cache is not
the plain case (tests/fast/test_host_aux_evict_twin.py runs the two in lockstep).
"""

from __future__ import annotations

from typing import Any

from . import host_full, keys, one_aux
from .cache import _core, _match_result
from .components.mamba import MambaComponent
from .components.swa import SwaComponent
from .node import Node
from .params import DecLockRefParams, DecLockRefResult, InsertResult, MatchResult
from .tiers.host import HostDecLockRefParams, HostIncLockRefResult

FULL = 0  # the Full component's id in skip_lock_node_ids
_INF = float("inf")
if _core is not None:  # the plug-ins the device evict's twin writes out (fast/_core.c "host
    # tier: one aux component's device evict", called by fast/hybrid.py ``_evict_units``)
    _core.host_aux_evict_setup(SwaComponent, MambaComponent)


def inc_lock_host_aux(cache: Any, node: Any) -> HostIncLockRefResult | None:
    """``HybridRadixCache.inc_lock_ref`` for a node with device data (or the root) on a host
    tier with one aux component: ``one_aux.inc_lock_one``'s lock, its result with the node as
    the anchor.  None, before anything changes, for anything else."""
    root = cache.root_node
    if node.__class__ is not Node or cache.disable:
        return None
    if node is not root and (node.value is None or node.parent is None):
        return None
    r = one_aux.inc_lock_one(cache, node)
    return HostIncLockRefResult(r.delta, r.swa_uuid_for_lock, r.swa_uuid_for_host_lock,
                                r.skip_lock_node_ids, node)


def write_lock(cache: Any, node: Any) -> HostDecLockRefParams | None:
    """``cache.inc_lock_ref(node).to_dec_params()`` where ``inc_lock_host_aux`` answers: the
    lock a write-through backup of ``node`` (attached, with device data) holds until its ack,
    its params made from ``inc_lock_one``'s result at once (that result is dropped, so its
    skip sets need no copy).  None, before anything changes, where it declines."""
    if node.__class__ is not Node or cache.disable or node.value is None \
            or node.parent is None:
        return None
    r = one_aux.inc_lock_one(cache, node)
    return HostDecLockRefParams(r.swa_uuid_for_lock, r.swa_uuid_for_host_lock,
                                r.skip_lock_node_ids, node)


def dec_lock_host_aux(cache: Any, node: Any, params: Any) -> DecLockRefResult | None:
    """``HybridRadixCache.dec_lock_ref`` with the params of a lock ``inc_lock_host_aux``
    answers (anchored at the node, no Full node skipped) on a node with device data (or the
    root): ``one_aux.dec_lock_one``.  None, before anything changes, for anything else."""
    if params.__class__ is not HostDecLockRefParams or params.anchor is not node \
            or node.__class__ is not Node or cache.disable:
        return None
    if node is not cache.root_node and (node.value is None or node.parent is None):
        return None
    skips = params.skip_lock_node_ids
    if skips.__class__ is not dict or skips.get(FULL):
        return None
    return one_aux.dec_lock_one(cache, node, DecLockRefParams(
        params.swa_uuid_for_lock, params.swa_uuid_for_host_lock, skips))


def match_host_aux(cache: Any, params: Any) -> MatchResult | None:
    """``HybridRadixCache.match_prefix`` with a host tier and one stock aux component, its
    validators written out: the walk through device nodes and evicted nodes with a host copy
    (split at a partial match through ``_split``); the match ends at the deepest node the host
    validator accepts (SWA: a run of one window of SWA data on the device or the host, restarted
    at a node with neither; Mamba: a state on the device or the host), its device part at the
    deepest node with device data the device validator accepts (SWA data, a state on the
    device).  Both validators see every node of the walk, as the general path calls them.
    Then the component's list moves (``path_to_front``), the stamps (``_stamp_tiered_path``)
    and the host hits as there.  None, before anything changes, for a disabled cache, an EAGLE
    bigram key and a copy-on-write Mamba match.  Where the C core is built, the walk and the
    rest after the key are its ``host_match`` with the component (fast/_core.c "host tier:
    Full match, locks, acks"); the code below runs where it declines."""
    if cache.disable or getattr(params, "cow_mamba", False):
        return None
    parts = host_full.match_key(cache, params)
    if parts is None or isinstance(parts, MatchResult):
        return parts
    units, ek, n = parts
    comp, is_swa, _ = cache._one_aux
    window = comp.window if is_swa else 0
    core = host_full._core
    if core is not None:  # (the rest in one C call, the same steps: fast/_core.c host_match)
        done = core.host_match(cache, units, ek, n, comp, is_swa, window)
        if done is not None:
            return done
    root = cache.root_node
    ps = cache.page_size
    node, pos, chunks = root, 0, []
    best = best_device = root
    best_chunks = 0
    host_run = dev_run = _INF  # (SWA: the contiguous units each validator has counted)
    step = keys.match_step
    split_at = cache._split
    while pos < n:
        child, k, split = step(node.children, units, pos, n, ps, ek)
        if child is None or (child.value is None and child.host_value is None):
            break
        if split:
            child = split_at(child, k)
        value = child.value
        if value is not None:
            chunks.append(value)
        node, pos = child, pos + k
        rec = child.aux[0]
        if is_swa:
            if rec.value is None:
                dev_run = 0
                dev_ok = False
                if rec.host_value is None:
                    host_run = 0
                else:
                    host_run += k
                    if host_run >= window:
                        best = child
            else:
                host_run += k
                if host_run >= window:
                    best = child
                dev_run += k
                dev_ok = dev_run >= window
        elif rec.value is None:
            dev_ok = False
            if rec.host_value is not None:
                best = child
        else:
            best = child
            dev_ok = True
        if dev_ok and value is not None:
            best_device, best_chunks = child, len(chunks)
        if split:  # the match ends inside the old node
            break
    # (``path_to_front(best)``)
    lru = comp.lru
    prev = lru.head
    cur: Any = best
    while cur is not root:
        rec = cur.aux[0]
        if rec.value is not None:
            lru.move_after(prev, rec)
            prev = rec
        cur = cur.parent
    if best_chunks == 0:  # (``_indices``)
        indices = cache._empty
    elif best_chunks == 1:
        indices = chunks[0]
    else:
        indices = cache._indices(chunks if best_chunks == len(chunks) else chunks[:best_chunks])
    cache._stamp_tiered_path(best)
    swa_hit = mamba_hit = 0
    if best is not root:
        if is_swa:
            swa_hit = comp.host_hit(best)
        else:  # (``wants_load_back``: the state on the host only)
            rec = best.aux[0]
            mamba_hit = 1 if rec.value is None and rec.host_value is not None else 0
    host_hit = cache.tier.host_hit(best, best_device) if best is not best_device else 0
    return _match_result((indices, best_device, best, best, host_hit, swa_hit, mamba_hit,
                          None, None))


def insert_host_aux(cache: Any, params: Any) -> InsertResult | None:
    """``HybridRadixCache._insert`` (inside ``insert``, which releases the frees queued on
    ``cache._deferred``) for one stock SWA or Mamba plug-in over a host tier: its checks in
    its order (the key read as fast/host_full.py ``insert_host`` reads it, ``insert_args``,
    the cut to whole pages, the plan in one C call, the component's checks as
    fast/one_aux.py ``insert_one`` writes ``_check_aux`` out), then the rest in one C call,
    ``_core.host_aux_insert`` (fast/_core.c "host tier: one aux component's insert"): the
    same steps from the root's stamp on.  None, before anything changes, for a disabled
    cache, KV events, a storage tier, the slot ledger, an EAGLE bigram key, outside
    ``insert`` (no queue of frees) and wherever the C call declines: ``_insert`` then runs
    from its start, with its own checks and errors.  ``_pick_fast_paths`` picks it only
    where the core is built and the hooks it writes out are the class's
    (tests/fast/test_host_aux_insert_twin.py runs both in lockstep)."""
    if cache.disable or cache._events is not None or cache.storage_tier is not None \
            or cache.validate_slots:
        return None
    deferred = cache._deferred
    if deferred.__class__ is not list:
        return None
    units, ek, bigram = one_aux._key_parts(params.key)
    if bigram:
        return None
    total = len(units)
    value, prev, chunked, _ = host_full.insert_args(params, params.value, total)
    ps = cache.page_size
    n = total - total % ps
    if n < total:
        units = units[:n]
        value = value[:n]  # (a view)
    plan = _core.one_plan(cache.root_node, units, ek, ps, keys.match_step)
    comp, is_swa, _ = cache._one_aux
    e = params.swa_evicted_seqlen
    if is_swa:  # (``_check_aux`` with ``SwaComponent.check_insert``, as insert_one has it)
        if e.__class__ is not int or e < 0 or e % ps or params.mamba_value is not None:
            _, e = cache._check_aux(plan, prev, params)  # (raises: its checks, its order)
        one_aux.check_swa_prev(comp, plan, prev, params, e)
        prepared = None
    elif e.__class__ is int and e == 0:  # (Mamba without the slot ledger: ``mamba_state``'s
        prepared = params.mamba_value  # checks and copy, the last checks, made in the C call)
    else:
        cache._check_aux(plan, prev, params)  # (raises: a setting Mamba refuses)
        return None
    return _core.host_aux_insert(cache, comp, comp if is_swa else None, plan, value, units, ek,
                                 prev, chunked, e, n, total, ps, deferred, prepared)
