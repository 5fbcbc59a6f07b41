"""Eviction policies: which evictable node goes first (``--radix-eviction-policy``).

sglang 0.5.13.post1's ``UnifiedRadixCache`` takes ``CacheInitParams.eviction_policy``, one of
the names in :data:`POLICIES`; the seed knows only LRU.  A policy is stated here once, as a sort
key over nodes: the eviction order is the evictable leaves sorted by the key, smallest first,
and the victim is the smallest.  Every key ends with the access stamp, which is what upstream
falls back on when two keys tie (its heap holds ``(key, node)`` pairs and nodes compare by last
access), and which makes every key distinct.

What a node carries for the policies (spec/core.py ``Node``):

- ``stamp``: the last access (the logical clock, spec/cache.py);
- ``created``: when the node was made; a split's upper node takes the child's (both parts
  hold data created together), so ``created`` survives splits;
- ``hit_count``: hits counted on inserts (spec/cache.py ``count_hit``);
- ``priority``: the insert's priority (upstream's ``InsertParams.priority``, the request's
  priority at the scheduler); every node an insert walks through keeps the larger of its own
  and the insert's, a new leaf takes the insert's, a split's upper node the child's.

Where the policy applies: the Full component's device-leaf eviction (alone and in front of
SWA / Mamba, spec/components.py) and host-leaf eviction (spec/host.py).  The aux components
(SWA, Mamba) evict from their own LRU lists whatever the policy, as 0.5.13.post1 does.

Hit counting: the seed counts hits only with a host tier and starts a split's upper node at 0.
0.5.13.post1 counts them without a host tier too and copies the child's count to the upper
node.  LFU and SLRU read the counts, so every policy except ``lru`` follows 0.5.13.post1 here
(docs/SPEC.md); ``lru`` keeps the seed's rule, so every existing trace and snapshot stays as it
was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .config import POLICIES
from .core import CacheState, Node

Stamp = tuple[int, int]  # (tick, rank), see spec/cache.py
# A place in an eviction order: ints and stamps, compared left to right (smallest goes first).
EvictionKey = tuple[int | tuple[int, ...], ...]

# SLRU: a node with at least this many hits is in the protected segment (0.5.13.post1's default)
SLRU_PROTECTED_HITS = 2


class NodeFacts(NamedTuple):
    """What a policy may read of a node."""

    stamp: Stamp
    created: Stamp
    hit_count: int
    priority: int


def newest_first(stamp: tuple[int, ...]) -> tuple[int, ...]:
    """A stamp whose order is the reverse of ``stamp``'s (for MRU and FILO).

    post: len(__return__) == len(stamp)
    post: all(a == -b for a, b in zip(__return__, stamp))
    """
    return tuple(-x for x in stamp)


def lru_key(f: NodeFacts) -> EvictionKey:
    """Least recently used first.

    post: __return__ == (f.stamp,)
    """
    return (f.stamp,)


def lfu_key(f: NodeFacts) -> EvictionKey:
    """Fewest hits first; among equal counts, least recently used first.

    post: __return__[0] == f.hit_count
    """
    return (f.hit_count, f.stamp)


def fifo_key(f: NodeFacts) -> EvictionKey:
    """Oldest creation first (a split keeps the creation of the data); ties by last access.

    post: __return__ == (f.created, f.stamp)
    """
    return (f.created, f.stamp)


def mru_key(f: NodeFacts) -> EvictionKey:
    """Most recently used first.

    post: __return__ == (newest_first(f.stamp),)
    """
    return (newest_first(f.stamp),)


def filo_key(f: NodeFacts) -> EvictionKey:
    """Newest creation first; ties by last access, least recent first.

    post: __return__ == (newest_first(f.created), f.stamp)
    """
    return (newest_first(f.created), f.stamp)


def priority_key(f: NodeFacts) -> EvictionKey:
    """Lowest priority first; within a priority, least recently used first.

    post: __return__[0] == f.priority
    """
    return (f.priority, f.stamp)


def slru_segment(hit_count: int) -> int:
    """Segmented LRU: 0 = probationary (fewer than SLRU_PROTECTED_HITS hits), 1 = protected.

    post: __return__ == (1 if hit_count >= SLRU_PROTECTED_HITS else 0)
    """
    return 1 if hit_count >= SLRU_PROTECTED_HITS else 0


def slru_key(f: NodeFacts) -> EvictionKey:
    """The probationary segment before the protected one; least recently used first in each.

    post: __return__ == (slru_segment(f.hit_count), f.stamp)
    """
    return (slru_segment(f.hit_count), f.stamp)


KEYS: dict[str, Callable[[NodeFacts], EvictionKey]] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "fifo": fifo_key,
    "mru": mru_key,
    "filo": filo_key,
    "priority": priority_key,
    "slru": slru_key,
}
assert tuple(KEYS) == POLICIES


def facts(node: Node) -> NodeFacts:
    return NodeFacts(node.stamp, node.created, node.hit_count, node.priority)


def eviction_key(state: CacheState, node: Node) -> EvictionKey:
    """The node's place in the eviction order of the cache's policy (smallest goes first)."""
    return KEYS[state.config.eviction_policy](facts(node))


# ----------------------------------------------------------------------------------------------
# The node facts the policies need, kept by the tree rules (spec/cache.py calls these)
# ----------------------------------------------------------------------------------------------


def follows_upstream_hit_counts(state: CacheState) -> bool:
    """Whether hits follow 0.5.13.post1's rules (counted without a host tier, copied on a
    split) rather than the seed's: under every policy but ``lru``."""
    return state.config.eviction_policy != "lru"


def inherit_on_split(state: CacheState, upper: Node, child: Node) -> None:
    """A split's upper node: the child's creation and priority (and, under 0.5.13.post1's
    hit rules, its hit count)."""
    upper.created = child.created
    upper.priority = child.priority
    if follows_upstream_hit_counts(state):
        upper.hit_count = child.hit_count


def raise_priority(node: Node, priority: int) -> None:
    """An insert walking through ``node`` raises its priority to the insert's."""
    if not node.is_root:
        node.priority = higher_priority(node.priority, priority)


def higher_priority(a: int, b: int) -> int:
    """The priority a node keeps when an insert of priority ``b`` meets it at ``a``.

    post: __return__ >= a and __return__ >= b
    post: __return__ in (a, b)
    """
    return a if a >= b else b
