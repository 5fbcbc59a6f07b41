"""Key arithmetic: the pure helpers of the radix tree (RadixKey semantics).

A key is a tuple of *units*.  Normally a unit is a token id; in EAGLE mode (bigram view) a unit
is the pair of two consecutive tokens, so ``n`` tokens give ``n - 1`` units and two keys share a
unit only when they share both tokens.  The tree works in whole pages of ``page_size`` units:
a node's children are told apart by their first page (and, at the root, by the ``extra_key``
namespace), and prefixes are only ever shared in whole pages.

Every helper here is a pure function with PEP 316 ``pre:``/``post:`` contracts, checked by
CrossHair in the test suite (tests/test_crosshair.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, TypeVar

Unit = Hashable  # an int token, or a (token, token) pair in bigram view
# The same, spelled out for CrossHair: left as Hashable, it also draws elements of arbitrary
# classes whose __eq__ fails on symbolic arguments (a false report, not a spec property).
UnitValue = int | tuple[int, int]


def bigram_view(tokens: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The EAGLE bigram units of a token sequence: ``(t[i], t[i+1])`` for each i.

    post: len(__return__) == max(0, len(tokens) - 1)
    post: all(__return__[i] == (tokens[i], tokens[i + 1]) for i in range(len(__return__)))
    """
    return tuple((tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1))


def to_units(tokens: Sequence[int], bigram: bool) -> tuple[UnitValue, ...]:
    """The logical units of a token sequence: the tokens themselves, or their bigram view.

    post: len(__return__) == (max(0, len(tokens) - 1) if bigram else len(tokens))
    """
    return bigram_view(tokens) if bigram else tuple(tokens)


# Any: the units are ints or (token, token) pairs as ``bigram`` says, which no static type can tie.
def units_to_tokens(units: Sequence[Any], bigram: bool) -> list[int]:
    """Inverse of :func:`to_units` for a non-empty bigram key (the raw tokens it spans).

    pre: bigram == False or all(isinstance(u, tuple) and len(u) == 2 for u in units)
    post: (not bigram) or len(units) == 0 or len(__return__) == len(units) + 1
    post: bigram or len(__return__) == len(units)
    """
    if not bigram:
        return list(units)
    if len(units) == 0:
        return []
    return [units[0][0]] + [u[1] for u in units]


def page_aligned_len(n: int, page_size: int) -> int:
    """The longest whole-page length not above ``n``.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= __return__ <= n
    post: n - __return__ < page_size
    """
    return n - n % page_size


def child_key(units: Sequence[UnitValue], page_size: int) -> tuple[UnitValue, ...]:
    """The first page of a key: what tells a node's children apart.

    pre: page_size >= 1
    pre: len(units) >= page_size
    post: len(__return__) == page_size
    post: all(__return__[i] == units[i] for i in range(page_size))
    """
    return tuple(units[:page_size])


def namespaced_child_key(extra_key: str | None, units: Sequence[UnitValue],
                         page_size: int) -> tuple[str | None, tuple[UnitValue, ...]]:
    """A child key within its ``extra_key`` namespace: keys with different extra_keys never
    share a node, because their child keys differ at the root.

    pre: page_size >= 1
    pre: len(units) >= page_size
    post: __return__[0] == extra_key
    post: len(__return__[1]) == page_size
    """
    return (extra_key, child_key(units, page_size))


def common_prefix_len(a: Sequence[UnitValue], b: Sequence[UnitValue], page_size: int) -> int:
    """Length of the longest common prefix of two keys, in whole pages.

    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= __return__ <= min(len(a), len(b))
    post: all(a[i] == b[i] for i in range(__return__))
    post: (__return__ + page_size > min(len(a), len(b))) or any(a[__return__ + j] != b[__return__ + j] for j in range(page_size))
    """  # noqa: E501 (CrossHair reads each PEP 316 condition from one line)
    n = min(len(a), len(b))
    same = 0
    while same < n and a[same] == b[same]:
        same += 1
    return page_aligned_len(same, page_size)


def split_point_ok(key_len: int, split_len: int, page_size: int) -> bool:
    """A node of ``key_len`` units can be split after ``split_len`` units: both parts keep at
    least one whole page.

    pre: page_size >= 1
    post: __return__ == (0 < split_len < key_len and split_len % page_size == 0 and key_len % page_size == 0)
    """
    return 0 < split_len < key_len and split_len % page_size == 0 and key_len % page_size == 0


class Ordered(Protocol):
    """What :func:`oldest` compares: stamps, and the eviction keys made of them."""

    def __lt__(self, other: Any, /) -> bool: ...


StampT = TypeVar("StampT", bound=Ordered)


def oldest(stamps: Sequence[StampT]) -> int:
    """Victim selection: the index of the oldest access stamp (stamps are distinct), or of the
    smallest eviction key (spec/policies.py).

    pre: len(stamps) > 0
    post: 0 <= __return__ < len(stamps)
    post: all(stamps[__return__] <= s for s in stamps)
    """
    best = 0
    for i in range(1, len(stamps)):
        if stamps[i] < stamps[best]:
            best = i
    return best
