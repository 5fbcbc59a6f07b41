"""Lock paths of the composed tree (fast/hybrid.py) with a host tier and exactly one aux
component (the stock SWA or Mamba plug-in), the ``lru`` eviction order: ``inc_lock_host_aux``
and ``dec_lock_host_aux``, and ``write_lock`` (the write-through
backup's lock, ``HostTier.write_backup``).

They hand the call to fast/one_aux.py's lock paths (``inc_lock_one`` / ``dec_lock_one``, with
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
_pick_fast_paths`` picks these once at construction; tests/fast/test_host_aux_paths.py drives
them and the general paths through the same random steps and compares the trees step by step.
"""

from __future__ import annotations

from typing import Any

from . import one_aux
from .node import Node
from .params import DecLockRefParams, DecLockRefResult
from .tiers.host import HostDecLockRefParams, HostIncLockRefResult

FULL = 0  # the Full component's id in skip_lock_node_ids


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
