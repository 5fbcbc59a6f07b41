"""Derived quantities, each computed from scratch over the primary state.

These are the numbers a fast implementation keeps incrementally (counters, leaf sets, heaps);
the spec recomputes them on every question so that there is nothing to get out of sync.
"""

from __future__ import annotations

from .core import CacheState, Node, all_nodes
from .keys import oldest
from .policies import eviction_key


def is_device_leaf(node: Node) -> bool:
    """An evictable device leaf: not the root, holds device data, unlocked, and no child
    holds device data (evicted children do not count)."""
    if node.is_root or node.value is None or node.lock_ref > 0:
        return False
    if any(d.lock_ref > 0 for d in node.aux.values()):  # hybrid models: any component's lock
        return False
    return all(child.value is None for child in node.children.values())


def device_leaves(state: CacheState) -> list[Node]:
    return [n for n in all_nodes(state) if is_device_leaf(n)]


def device_eviction_order(state: CacheState) -> list[Node]:
    """The current evictable device leaves in the eviction policy's order (lru: oldest
    access first; spec/policies.py), the order evict takes them in, as long as no other leaf
    appears meanwhile."""
    return sorted(device_leaves(state), key=lambda n: eviction_key(state, n))


def oldest_device_leaf(state: CacheState) -> Node | None:
    """The victim of the next device eviction, or None when nothing is evictable."""
    leaves = device_leaves(state)
    if not leaves:
        return None
    return leaves[oldest([eviction_key(state, n) for n in leaves])]


def evictable_size(state: CacheState) -> int:
    """Device tokens in unlocked nodes."""
    return sum(len(n.value) for n in all_nodes(state)
               if not n.is_root and n.value is not None and n.lock_ref == 0)


def protected_size(state: CacheState) -> int:
    """Device tokens in locked nodes."""
    return sum(len(n.value) for n in all_nodes(state)
               if not n.is_root and n.value is not None and n.lock_ref > 0)


def total_size(state: CacheState) -> int:
    """Device tokens held by the tree."""
    return sum(len(n.value) for n in all_nodes(state) if not n.is_root and n.value is not None)


def tree_slots(state: CacheState) -> list[int]:
    """Every device slot the tree holds (with repetitions, if the tree is corrupt)."""
    return [s for n in all_nodes(state) if not n.is_root and n.value is not None for s in n.value]
