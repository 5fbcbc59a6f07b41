"""Invariants of the cache state, each a function returning the violations it finds.

:func:`sanity_check` runs them all (the seed's ``sanity_check``, as data rather than an
exception).  An empty list means the state is sound.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from . import components, queries, requests, sessions
from .core import read_only
from .host import host_invariants
from .keys import namespaced_child_key
from .state import CacheState, all_nodes, up
from .storage import storage_invariants


def tree_structure(state: CacheState) -> list[str]:
    """Parent and child pointers agree; child keys are the children's first pages; keys are
    non-empty whole pages; a namespace never mixes below the root; values fit keys."""
    ps = state.config.page_size
    errors = []
    root = state.root
    if root.parent is not None or root.key != () or root.value != ():
        errors.append("[root] the root must have no parent, an empty key and an empty value")
    for node in all_nodes(state):
        for ck, child in node.children.items():
            if child.parent is not node:
                errors.append(f"[tree] {child!r}: parent pointer does not point at its parent")
            if len(child.key) == 0 or len(child.key) % ps:
                errors.append(f"[tree] {child!r}: key length {len(child.key)} is not whole pages")
                continue
            if ck != namespaced_child_key(child.extra_key, child.key, ps):
                errors.append(f"[tree] {child!r}: filed under a child key that is not its first page")
            if not node.is_root and child.extra_key != node.extra_key:
                errors.append(f"[tree] {child!r}: extra_key differs from its parent's")
            if child.value is not None and len(child.value) != len(child.key):
                errors.append(f"[tree] {child!r}: {len(child.value)} slots for {len(child.key)} units")
    return errors


def data_presence(state: CacheState) -> list[str]:
    """Every node keeps data (a device value or a host copy); device data needs device data
    above it (eviction only ever takes leaves)."""
    errors = []
    for node in all_nodes(state):
        if node.is_root:
            continue
        if node.value is None and node.host_value is None:
            errors.append(f"[data] {node!r} is dead: no device data and no host copy")
        elif node.value is not None and not up(node).is_root and up(node).value is None:
            errors.append(f"[data] {node!r} holds device data below an evicted parent")
    return errors


def lock_hierarchy(state: CacheState) -> list[str]:
    """Lock counts are never negative, never sit on evicted data, never exceed the parent's,
    and equal exactly the number of live handles whose locked path runs through the node."""
    errors = []
    expected: Counter[int] = Counter()
    for handle in state.handles.values():
        for n in ([] if state.config.disable else handle.locked_nodes()):
            expected[id(n)] += 1
    for node in all_nodes(state):
        if node.is_root:
            continue
        if node.lock_ref < 0:
            errors.append(f"[lock] {node!r} lock_ref={node.lock_ref} < 0")
        if node.value is None and node.lock_ref > 0:
            errors.append(f"[lock] {node!r} is evicted but lock_ref={node.lock_ref}")
        if not up(node).is_root and up(node).lock_ref < node.lock_ref:
            errors.append(f"[lock] {node!r} lock_ref={node.lock_ref} exceeds its parent's "
                          f"{up(node).lock_ref}")
        if node.lock_ref != expected[id(node)]:
            errors.append(f"[lock] {node!r} lock_ref={node.lock_ref} but {expected[id(node)]} "
                          f"live handle(s) lock it")
    return errors


def leaf_qualification(state: CacheState) -> list[str]:
    """Every evictable device leaf is an unlocked non-root node with device data and no child
    with device data; every such node is one."""
    errors = []
    leaves = {id(n) for n in queries.device_leaves(state)}
    for node in all_nodes(state):
        should = (not node.is_root and node.value is not None and node.lock_ref == 0
                  and not any(c.value is not None for c in node.children.values()))
        if should != (id(node) in leaves):
            errors.append(f"[leaf] {node!r}: leaf set membership {id(node) in leaves}, "
                          f"expected {should}")
    return errors


def size_accounting(state: CacheState) -> list[str]:
    """Evictable + protected = all device tokens in the tree; every tree slot is allocated in
    the pool and held by exactly one node position."""
    errors = []
    ev, pr, total = (queries.evictable_size(state), queries.protected_size(state),
                     queries.total_size(state))
    if ev + pr != total:
        errors.append(f"[size] evictable {ev} + protected {pr} != device tokens {total}")
    slots = queries.tree_slots(state)
    twice = sorted(s for s, k in Counter(slots).items() if k > 1)
    if twice:
        errors.append(f"[size] slots held twice in the tree: {twice[:8]}")
    unallocated = sorted(s for s in set(slots) if not state.kv.is_allocated(s))
    if unallocated:
        errors.append(f"[size] tree holds slots the pool says are free: {unallocated[:8]}")
    return errors


def request_rows(state: CacheState) -> list[str]:
    """A running request's row starts with exactly the tree's slots along its locked path
    (its protected prefix); the slots it owns after that are allocated and not the tree's."""
    errors = []
    tree = set(queries.tree_slots(state))
    for rid, req in state.requests.items():
        if not req.admitted:
            continue
        path_slots = [s for n in reversed(list(req.lock.node.ancestors_to_root()))
                      if n.value is not None for s in n.value]
        if req.row[: req.cache_protected_len] != path_slots[: req.cache_protected_len] or \
                len(path_slots) < req.cache_protected_len:
            errors.append(f"[request] {rid}: protected prefix is not the tree's slots on its path")
        own = req.row[req.cache_protected_len:]
        if any(s in tree for s in own):
            errors.append(f"[request] {rid}: owns slots the tree holds")
        if any(not state.kv.is_allocated(s) for s in own):
            errors.append(f"[request] {rid}: owns slots the pool says are free")
    return errors


INVARIANTS: tuple[Callable[[CacheState], list[str]], ...] = (
    tree_structure, data_presence, lock_hierarchy, leaf_qualification, size_accounting,
    request_rows, host_invariants)
INVARIANTS += (components.aux_invariants, components.aux_host_invariants)  # hybrid models
INVARIANTS += (sessions.session_invariants,)  # streaming sessions (spec/sessions.py)
INVARIANTS += (storage_invariants,)  # storage tier (spec/storage.py)
INVARIANTS += (requests.request_state_slots,)  # requests' Mamba state slots (spec/requests.py)


def sanity_check(state: CacheState) -> list[str]:
    """All violated invariants, as messages; [] when the state is sound."""
    with read_only(state):  # they only read it: one walk of the tree for all of them
        return [msg for inv in INVARIANTS for msg in inv(state)]

