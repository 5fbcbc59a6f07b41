"""Pure key helpers of the fast path: the same arithmetic as ``uniradix.spec.keys`` over the
fast path's representations (a node key is an ``array('q')`` of tokens, or a list of token
pairs under EAGLE; a child key is the bare first unit at page size 1, a tuple of the first page
otherwise, namespaced as ``(extra_key, page)`` when the key has an ``extra_key``).

The cache inlines these on its hottest paths (a call costs as much as the work); the lockstep
runs check those copies, and CrossHair's ``diffbehavior`` checks these functions against the
spec's (tests/test_crosshair_equiv.py).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence


def child_key(extra_key: Optional[Hashable], units: Sequence, pos: int, page_size: int) -> Any:
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
