"""Pure key helpers of the fast path: the same arithmetic as ``uniradix.spec.keys`` over the
fast path's representations (a node key is an ``array('q')`` of tokens, or a list of token
pairs under EAGLE; a child key is the bare first unit at page size 1, a tuple of the first page
otherwise, namespaced as ``(extra_key, page)`` when the key has an ``extra_key``).

The cache inlines these on its hottest paths (a call costs as much as the work); the lockstep
runs check those copies, and CrossHair's ``diffbehavior`` checks these functions against the
spec's (tests/fast/test_crosshair_equiv.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import Any


def child_key(extra_key: Hashable | None, units: Sequence, pos: int, page_size: int) -> Any:
    """The child key of the page of ``units`` starting at ``pos``."""
    ck = units[pos] if page_size == 1 else tuple(units[pos: pos + page_size])
    return ck if extra_key is None else (extra_key, ck)


def aligned_len(n: int, page_size: int) -> int:
    """The longest whole-page length not above ``n``."""
    return n - n % page_size


def shared_len(ckey: Sequence, units: Sequence, pos: int, n: int, page_size: int) -> int:
    """Whole-page length of the common prefix of ``ckey`` and ``units[pos:n]``, given that
    their first page is shared: bisection on C-level slice compares, O(log len) compares
    instead of a per-token loop."""
    lo, hi = page_size, min(len(ckey), n - pos)
    # invariant: ckey[:lo] == units[pos:pos+lo]; the answer is < hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ckey[lo:mid] == units[pos + lo: pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo - lo % page_size


def bigram_units(tokens: Sequence[int], bigram: bool) -> Sequence:
    """The tree's units of a token sequence: the tokens themselves, or under EAGLE the list of
    consecutive pairs (``n`` tokens give ``n - 1`` units)."""
    # EAGLE bigram units pair each token with the next: the shifted side is one shorter.
    return list(zip(tokens, tokens[1:], strict=False)) if bigram else tokens


def aligned_units_len(n_tokens: int, page_size: int, bigram: bool) -> int:
    """How many units of ``n_tokens`` tokens the tree keeps: the units, cut to whole pages."""
    n = max(0, n_tokens - 1) if bigram else n_tokens
    return n - n % page_size


def step_len(ckey: Sequence, units: Sequence, pos: int, n: int, page_size: int) -> int:
    """How far a walk (match or insert) goes into a child whose first page ``units[pos:]``
    shares: the whole child when ``units[pos:n]`` holds all of it (one slice compare), else
    the whole-page common length, where the child is split."""
    end = pos + len(ckey)
    if end <= n and units[pos:end] == ckey:
        return len(ckey)
    return shared_len(ckey, units, pos, n, page_size)


#: :func:`match_step`'s answer where no child holds the page
NO_STEP: tuple = (None, 0, False)


def match_step_py(children: dict, units: Sequence, pos: int, n: int, page_size: int,
                  extra_key: Hashable | None) -> tuple:
    """One step of a walk down the tree (match or insert) from a node with ``children``: the
    child holding the page of ``units`` at ``pos`` (:func:`child_key`), how far the walk goes
    into it (:func:`step_len`) and whether that ends inside it (``(child, k, split)``: ``split``
    when ``k < len(child.key)``, the caller splits the child there), or :data:`NO_STEP`.
    ``pos < n``, ``n`` whole pages.  This is the definition; the C core's ``match_step``
    (fast/_core.c) gives the same answers for ``array('q')`` units and keys and calls this
    for anything else (EAGLE's bigram lists)."""
    ck = units[pos] if page_size == 1 else tuple(units[pos: pos + page_size])
    child = children.get(ck if extra_key is None else (extra_key, ck))
    if child is None:
        return NO_STEP
    ckey = child.key
    k = len(ckey)
    if pos + k <= n and units[pos: pos + k] == ckey:
        return child, k, False
    return child, shared_len(ckey, units, pos, n, page_size), True


#: the step the walks use: :func:`match_step_py`, or the C core's where :func:`bind_core` set it
match_step: Callable[..., tuple] = match_step_py


def bind_core(core: Any) -> None:
    """Make :data:`match_step` the C core's (``core``: fast/_core.c's module, loaded by
    fast/cache.py), with :func:`match_step_py` as its fallback.  Called once, at import, before
    the modules that walk import the name."""
    global match_step
    core.match_step_setup(match_step_py, NO_STEP)
    match_step = core.match_step


def heap_victim(heap: list, live: Callable[[Any, Any], bool]) -> Any:
    """Victim selection over a lazily deleted heap of ``(stamp, node)``: pop entries until one
    is live (``live(stamp, node)``: the stamp is still the node's and the node is an evictable
    leaf) and return its node; None when the heap runs out.  Pops from ``heap``."""
    while heap:
        stamp, node = heapq.heappop(heap)
        if live(stamp, node):
            return node
    return None


def live_order(heap: Sequence, live: Callable[[Any, Any], bool]) -> list:
    """The order ``heap_victim`` would take the live nodes in (each once), without popping."""
    seen, out = set(), []
    for stamp, node in sorted(heap):
        if live(stamp, node) and node not in seen:
            seen.add(node)
            out.append(node)
    return out
