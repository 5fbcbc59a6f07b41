"""The two ordering structures of the fast caches, written once: ``LazyHeap`` and ``LruList``.

Every cache in ``uniradix.fast`` keeps an eviction order over some of its nodes (the evictable
device leaves; the host leaves; the nodes holding SWA or Mamba data).  Those orders change on
every match and insert, and only their oldest end is ever consumed, so each is kept with the
cheapest structure that answers "oldest member" in its access pattern:

* ``LazyHeap``: a binary heap (``heapq``) of ``(stamp, node)`` entries with lazy deletion.  A
  node is pushed whenever it becomes a member or gets a new stamp while it is one; nothing is
  ever removed from the middle.  A popped entry counts only if it is still *live*: the node
  still carries that stamp (``last_access_time``) and still is a member (a predicate the
  owner supplies, because membership is a fact about the tree, not about the heap).
  Compaction drops stale entries: at the end of an eviction when they outnumber live ones,
  and at the end of every public call that can push once the heap outgrew its ``cap`` (twice
  the live entries the last compaction kept, plus ``COMPACT_MIN``), so a heap that is touched
  again and again with no eviction between stays O(live) in size too, amortized O(1) a push.
* ``LruList``: a doubly linked list threaded through the members themselves (``lru_prev`` /
  ``lru_next`` attributes on the node), between two sentinels, so moving a node to the front
  or removing it from the middle is O(1) with no allocation and no branch for an end.  Used
  where the order is "recency" alone and a member must leave the order immediately (the aux
  data of a hybrid cache), which a lazy heap cannot do.

Costs below use n = entries in the heap (live and stale), m = members of the list.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

#: ``is_member(node)``: whether a node belongs to the order now (its entry is live when it
#: also still carries the entry's stamp as ``last_access_time``).
MemberPredicate = Callable[[Any], bool]

#: A heap of this many entries or fewer is never compacted (it is not worth a pass).
COMPACT_MIN = 64


class LazyHeap:
    """A min-heap of ``(stamp, node)`` with lazy deletion; the oldest stamp comes out first.

    Why it exists: the eviction order of a radix cache moves on every touch of a leaf.  Keeping
    a sorted structure exact would cost O(log n) per touch *and* a removal per touch; pushing a
    fresh entry and letting the old one go stale costs one O(log n) push, and the stale entries
    are skipped when popped or dropped by ``compact``.  Ties on the stamp are broken by the
    node's ``__lt__`` (the fast node types order by id), so the pop order is a function of the
    entries alone, not of the list's layout.

    ``entries`` is a plain ``list`` with ``heapq``'s invariant, public on purpose: the C core
    (``fast/_core.c``) pushes to and pops from this same list object (it reads the owner's
    ``_heap`` attribute, which is this list), and hot Python loops alias it to call ``heapq``
    directly.  ``compact`` therefore rewrites the list in place and never replaces it.
    """

    __slots__ = ("entries", "cap")

    #: None: entries are keyed by the stamp (``last_access_time``); an eviction policy's
    #: ``KeyedHeap`` (fast/policies.py) keys them by ``key_of(node)`` instead
    key_of: Any = None

    def __init__(self) -> None:
        self.entries: list = []
        #: the length past which ``upkeep`` compacts: set by every ``compact`` to twice the
        #: live entries kept plus ``COMPACT_MIN``, so the pushes between two compactions pay
        #: for the second one (the C core reads it, fast/_core.c ``heap_upkeep``)
        self.cap: int = COMPACT_MIN

    def __len__(self) -> int:
        """Entries, live and stale.  O(1)."""
        return len(self.entries)

    def __bool__(self) -> bool:
        """Whether any entry is left.  O(1)."""
        return bool(self.entries)

    def push(self, stamp: int, node: Any) -> None:
        """Add the entry ``(stamp, node)``.  O(log n)."""
        heapq.heappush(self.entries, (stamp, node))

    def pop(self) -> tuple:
        """Remove and return the smallest entry, live or stale (the caller checks).  O(log n).
        Raises IndexError when empty."""
        return heapq.heappop(self.entries)

    def clear(self) -> None:
        """Drop every entry (in place).  O(n)."""
        self.entries.clear()
        self.cap = COMPACT_MIN

    def live(self, is_member: MemberPredicate) -> dict:
        """``{id(node): (stamp, node)}`` for the live entries, one per node.  O(n); the
        predicate runs only for entries whose stamp is still the node's."""
        return {id(n): (s, n) for s, n in self.entries
                if n.last_access_time == s and is_member(n)}

    def live_ids(self, is_member: MemberPredicate) -> set:
        """``id`` of every node with a live entry.  O(n)."""
        return {id(n) for s, n in self.entries if n.last_access_time == s and is_member(n)}

    def ordered(self, is_member: MemberPredicate) -> list:
        """The nodes of the live entries in the order pops would yield them, each once.
        O(n log n); introspection only."""
        seen, out = set(), []
        for s, n in sorted(self.entries):
            if id(n) not in seen and n.last_access_time == s and is_member(n):
                seen.add(id(n))
                out.append(n)
        return out

    def needs_compaction(self, live_bound: int) -> bool:
        """Whether stale entries clearly outnumber live ones, given an upper bound on the live
        count (a cheap estimate from the owner's counters).  O(1)."""
        n = len(self.entries)
        return n > COMPACT_MIN and n > 4 * (live_bound + 16)

    def upkeep(self, is_member: MemberPredicate) -> None:
        """Compact where the heap outgrew ``cap``: the end of every public call of the owner
        that can push (touches with no eviction between would otherwise pile up stale
        entries for ever).  O(1), or O(n) when it compacts, amortized O(1) a push."""
        if len(self.entries) > self.cap:
            self.compact(is_member)

    def compact(self, is_member: MemberPredicate) -> None:
        """Keep only the live entries, one per node, and restore the heap invariant, in place
        (the list object stays the same); ``cap`` becomes twice what is kept plus
        ``COMPACT_MIN``.  Dropping stale entries changes no pop order (a pop skips them).
        O(n)."""
        live = list(self.live(is_member).values())
        heapq.heapify(live)
        self.entries[:] = live
        self.cap = 2 * len(live) + COMPACT_MIN


class _Sentinel:
    """An end of an ``LruList``: only the two link attributes."""

    __slots__ = ("lru_prev", "lru_next")

    def __init__(self) -> None:
        self.lru_prev: Any = None
        self.lru_next: Any = None

    def __repr__(self) -> str:
        return "<lru sentinel>"


class LruList:
    """An intrusive doubly linked list of nodes, newest at the front (``head`` side).

    Why it exists: the aux data of a hybrid cache (SWA windows, Mamba states) is evicted
    oldest first, and a node leaves the order the moment it loses its aux data, often from the
    middle.  Links stored on the nodes (``lru_prev`` / ``lru_next``, which the node type must
    provide, ``None`` when not a member) make every operation O(1) without allocating, and the
    two sentinels ``head`` and ``tail`` mean no operation branches on an empty list or an end.

    Walking from the oldest end: ``x = lst.tail.lru_prev`` then ``x = x.lru_prev`` until
    ``x is lst.head``; a hot loop may do that itself (it is the documented layout).
    """

    __slots__ = ("head", "tail")

    def __init__(self) -> None:
        self.head = _Sentinel()
        self.tail = _Sentinel()
        self.head.lru_next, self.tail.lru_prev = self.tail, self.head

    def insert_after(self, prev: Any, node: Any) -> None:
        """Link ``node`` (not a member) right after ``prev`` (a member or ``head``).  O(1)."""
        nxt = prev.lru_next
        node.lru_prev, node.lru_next = prev, nxt
        prev.lru_next = nxt.lru_prev = node

    def push_front(self, node: Any) -> None:
        """Link ``node`` (not a member) as the newest.  O(1)."""
        self.insert_after(self.head, node)

    def remove(self, node: Any) -> None:
        """Unlink ``node`` (a member) and clear its links.  O(1)."""
        node.lru_prev.lru_next = node.lru_next
        node.lru_next.lru_prev = node.lru_prev
        node.lru_prev = node.lru_next = None

    def move_to_front(self, node: Any) -> None:
        """Make member ``node`` the newest.  O(1)."""
        self.move_after(self.head, node)

    def move_after(self, prev: Any, node: Any) -> None:
        """Move member ``node`` right after ``prev`` (a member or ``head``, not ``node``).
        O(1).  (Unlink and link inlined: this runs for every node of a matched path.)"""
        node.lru_prev.lru_next = node.lru_next
        node.lru_next.lru_prev = node.lru_prev
        nxt = prev.lru_next
        node.lru_prev, node.lru_next = prev, nxt
        prev.lru_next = nxt.lru_prev = node

    def oldest(self) -> Any | None:
        """The oldest member, or None when empty.  O(1)."""
        x = self.tail.lru_prev
        return None if x is self.head else x

    def __iter__(self) -> Iterator[Any]:
        """The members oldest first.  O(1) per step; do not unlink the next member while
        iterating (unlinking the current one is fine)."""
        x, head = self.tail.lru_prev, self.head
        while x is not head:
            prev = x.lru_prev
            yield x
            x = prev

    def oldest_first(self) -> list:
        """The members, oldest first.  O(m)."""
        return list(self)

    def violations(self, members: set) -> list[str]:
        """The list checked against ``members`` (the ids of the nodes that should be in it):
        linked both ways, no cycle, reaches its tail, exactly those nodes.  O(m)."""
        errors, seen = [], set()
        prev, x = self.head, self.head.lru_next
        while x is not None and x is not self.tail:
            if x.lru_prev is not prev:
                errors.append(f"[lru] broken back link at {x!r}")
            if id(x) in seen:
                errors.append(f"[lru] cycle at {x!r}")
                break
            seen.add(id(x))
            prev, x = x, x.lru_next
        if x is None:
            errors.append("[lru] the list does not reach its tail")
        if seen != members:
            errors.append(f"[lru] list holds {len(seen)} nodes, {len(members)} hold aux data "
                          f"(or different ones)")
        return errors
