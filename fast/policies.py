"""Eviction policies on the composed tree (``CacheInitParams.eviction_policy``): the orders of
spec/policies.py as heap keys over fast/node.py's nodes, and the node facts they read.

The spec states each policy once, as a sort key over nodes whose last element is the access
stamp; the evictable device leaves (and, with a host tier, the host leaves) go smallest key
first.  Here each key is computed from the node's own fields (``last_access_time``,
``created``, ``hit_count``, ``priority``; fast/node.py), and the orders are ``KeyedHeap``\\ s:
the ``LazyHeap`` of fast/structures.py with ``(key, node)`` entries instead of
``(stamp, node)``.  An entry is live while the node's key is still the entry's key (so a
touch, a hit or a priority change that moves a leaf makes its old entry stale, and the tree
pushes a fresh one, as it already does after a touch).

``lru`` keeps the plain ``LazyHeap`` and every hot path exactly as it was (no key call, no
extra push): only the other policies take the code below.  Where the policies apply, as in the
spec (docs/SPEC.md "Eviction policies"): the Full component's device-leaf eviction (alone and
in front of SWA / Mamba) and host-leaf eviction.  The aux components evict from their own LRU
lists under every policy, as 0.5.13.post1 does, so they need nothing here.

Hit counts and priorities (spec/policies.py): under every policy but ``lru`` a non-chunked
insert counts a hit on each node it walks through or adds even without a host tier
(0.5.13.post1's rule; with a host tier the tier counts them, as under ``lru``), and a split's
upper node takes the child's count; every node an insert walks through keeps the larger of its
priority and the insert's, a new leaf takes the insert's, a split's upper node the child's;
``created`` is the stamp a node's data was first inserted at, kept by both parts of a split.

Costs: each key O(1) (one small tuple); a push O(log n) for n heap entries; the extra work of
a non-``lru`` insert O(d) key computations and pushes for the d nodes it walks (only a leaf is
pushed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from .errors import InvalidInput, Unsupported
from .structures import LazyHeap, MemberPredicate

#: the policy names, as 0.5.13.post1 knows them (it lower-cases the setting first)
POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")

#: SLRU: a node with at least this many hits is in the protected segment (upstream's default)
SLRU_PROTECTED_HITS = 2

KeyFn = Callable[[Any], Any]


def policy_name(value: Any) -> str:
    """The policy ``value`` names, lower-cased as upstream reads it; ``Unsupported`` naming
    ``eviction_policy`` and the value for anything else.  O(1)."""
    name = value.lower() if isinstance(value, str) else None
    if name not in POLICIES:
        raise Unsupported(f"CacheInitParams.eviction_policy={value!r} is not supported; "
                          f"known: {', '.join(POLICIES)} (any case)")
    return name


# -- the keys (spec/policies.py's, over fast nodes: smallest goes first); each O(1) -----------

def lfu_key(n: Any) -> tuple:
    """Fewest hits first, then least recently used."""
    return (n.hit_count, n.last_access_time)


def fifo_key(n: Any) -> tuple:
    """Oldest creation first, then least recently used."""
    return (n.created, n.last_access_time)


def mru_key(n: Any) -> int:
    """Most recently used first."""
    return -n.last_access_time


def filo_key(n: Any) -> tuple:
    """Newest creation first, then least recently used."""
    return (-n.created, n.last_access_time)


def priority_key(n: Any) -> tuple:
    """Lowest priority first, then least recently used."""
    return (n.priority, n.last_access_time)


def slru_key(n: Any) -> tuple:
    """The probationary segment (fewer than ``SLRU_PROTECTED_HITS`` hits) before the protected
    one, least recently used first in each."""
    return (1 if n.hit_count >= SLRU_PROTECTED_HITS else 0, n.last_access_time)


#: the key of each policy but ``lru`` (whose order is the stamp alone: the plain LazyHeap)
KEYS: dict[str, KeyFn] = {
    "lfu": lfu_key,
    "fifo": fifo_key,
    "mru": mru_key,
    "filo": filo_key,
    "priority": priority_key,
    "slru": slru_key,
}
assert set(KEYS) | {"lru"} == set(POLICIES)


class KeyedHeap(LazyHeap):
    """A ``LazyHeap`` whose entries are ``(key_of(node), node)``: the order of one policy.

    An entry is live while ``key_of(node)`` still equals its key and the node is still a
    member (the owner's predicate).  ``push(stamp, node)`` takes the ``LazyHeap`` call as it is
    and computes the key itself, so a caller written for the stamp order pushes the policy's
    entry unchanged.  Costs as ``LazyHeap``'s, plus one O(1) key per entry looked at."""

    __slots__ = ("key_of",)

    def __init__(self, key_of: KeyFn) -> None:
        super().__init__()
        self.key_of: KeyFn | None = key_of

    def push(self, stamp: Any, node: Any) -> None:
        """Add ``(key_of(node), node)`` (``stamp`` is not read: the key holds it).
        O(log n)."""
        assert self.key_of is not None
        heapq.heappush(self.entries, (self.key_of(node), node))

    def _live_entries(self, is_member: MemberPredicate) -> list:
        key_of = self.key_of
        assert key_of is not None
        return [(k, n) for k, n in self.entries if key_of(n) == k and is_member(n)]

    def live(self, is_member: MemberPredicate) -> dict:
        """``{id(node): (key, node)}`` for the live entries.  O(n)."""
        return {id(n): (k, n) for k, n in self._live_entries(is_member)}

    def live_ids(self, is_member: MemberPredicate) -> set:
        """``id`` of every node with a live entry.  O(n)."""
        return {id(n) for _, n in self._live_entries(is_member)}

    def ordered(self, is_member: MemberPredicate) -> list:
        """The nodes of the live entries in pop order, each once.  O(n log n)."""
        seen, out = set(), []
        for _, n in sorted(self._live_entries(is_member)):
            if id(n) not in seen:
                seen.add(id(n))
                out.append(n)
        return out


def heap_for(policy: str) -> LazyHeap:
    """The ordering structure of ``policy``: the plain stamp heap for ``lru``, a
    ``KeyedHeap`` otherwise.  O(1)."""
    key_of = KEYS.get(policy)
    return LazyHeap() if key_of is None else KeyedHeap(key_of)


def check_priority(value: Any) -> int:
    """An insert's priority: an int (any sign), None read as 0 as upstream does;
    ``InvalidInput`` otherwise.  O(1)."""
    if value is None:
        return 0
    if value.__class__ is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(f"insert: priority must be an int, got {value!r}")
        return int(value)
    return value


# -- the composed tree's hooks (fast/hybrid.py calls these only under a policy but lru) --------

def attach(cache: Any) -> None:
    """Put ``cache`` (a ``HybridRadixCache`` whose ``eviction_policy`` is not ``lru``) on its
    policy: ``_push_if_leaf`` pushes the policy's key (an instance attribute in front of the
    class's stamp push, which ``lru`` keeps), and a host tier's host-leaf heap becomes a
    ``KeyedHeap``.  Called once at construction, after the tier is attached.  O(1)."""
    key_of = KEYS[cache.eviction_policy]
    is_leaf = cache._is_leaf
    heappush = heapq.heappush

    def push_if_leaf(node: Any) -> None:
        if is_leaf(node):
            heappush(cache._heap, (key_of(node), node))

    cache._push_if_leaf = push_if_leaf
    tier = getattr(cache, "tier", None)
    if tier is not None:
        tier.host_leaf_heap = KeyedHeap(key_of)


def inherit_on_split(upper: Any, child: Any) -> None:
    """A split's upper node takes the child's creation, priority and hit count.  O(1)."""
    upper.created = child.created
    upper.priority = child.priority
    upper.hit_count = child.hit_count


def walked(cache: Any, node: Any, priority: int, chunked: bool) -> None:
    """An insert walked through ``node`` (after its split, un-evict and the tier's hit): it
    keeps the larger priority, counts a hit where the tier does not (no host tier, not
    chunked), and takes a fresh heap entry if it is an evictable leaf.  O(log n)."""
    if priority > node.priority:
        node.priority = priority
    if cache.tier is None and not chunked and node.value is not None:
        node.hit_count += 1
    cache._push_if_leaf(node)


def new_leaf(cache: Any, leaf: Any, priority: int, chunked: bool) -> None:
    """An insert added ``leaf`` (after the components' commit and the tier's hit; the tree
    gave it the insert's priority when it made it, before a commit could split it): a hit
    where the tier does not count one, and a fresh heap entry.  O(log n)."""
    assert leaf.priority == priority
    if cache.tier is None and not chunked:
        leaf.hit_count += 1
    cache._push_if_leaf(leaf)
