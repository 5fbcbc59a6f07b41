"""``RadixKey``: the token ids of a request, with its ``extra_key`` namespace (upstream's name
and constructor).

Token ids are kept as ``array('q')``: slices and comparisons of arrays run in C, which is what
makes prefix matching fast (one slice compare per node instead of one Python compare per
token).  A list is converted once, at construction, and checked to hold ints only.
"""

from __future__ import annotations

from array import array
from typing import Any

from .errors import InvalidInput

#: the C core's conversion of a list of ints (fast/_core.c ``token_array``: one pass, each
#: item exactly an int in int64, else None and the conversion below answers), set by
#: fast/cache.py where the core is loaded
from_list: Any = None


def as_token_array(token_ids) -> array:
    """``token_ids`` as ``array('q')``; InvalidInput for anything but ints (bools included)."""
    if type(token_ids) is array and token_ids.typecode == "q":
        return token_ids
    if from_list is not None and type(token_ids) is list:
        arr = from_list(token_ids)
        if arr is not None:
            return arr
    if isinstance(token_ids, (list, tuple)):
        try:
            arr = array("q", token_ids)
        except (TypeError, OverflowError):
            raise InvalidInput("token ids must be ints") from None
        if bool in map(type, token_ids):  # (map: the types are compared in C, no generator)
            raise InvalidInput("token ids must be ints, not bools")
        return arr
    if hasattr(token_ids, "tolist"):  # a tensor or numpy array of integers
        dtype = str(getattr(token_ids, "dtype", ""))
        if "int" not in dtype or "uint8" == dtype.split(".")[-1]:
            raise InvalidInput(f"token ids must be integers, got dtype {dtype}")
        return array("q", token_ids.tolist())
    raise InvalidInput(f"token ids must be a list or array('q') of ints, got {type(token_ids).__name__}")


class RadixKey:
    """Token ids plus namespace.  ``is_bigram`` marks an EAGLE key (units are token pairs)."""

    __slots__ = ("token_ids", "extra_key", "is_bigram")

    def __init__(self, token_ids, extra_key: str | None = None, is_bigram: bool = False):
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidInput(f"extra_key must be None or a string, got {extra_key!r}")
        self.token_ids = as_token_array(token_ids)
        self.extra_key = extra_key
        self.is_bigram = is_bigram

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(0, n - 1) if self.is_bigram else n

    def __iter__(self):
        """The units: the tokens, or under EAGLE the consecutive token pairs."""
        t = self.token_ids
        if self.is_bigram:
            return zip(t, t[1:], strict=False)  # consecutive pairs: one fewer than tokens
        return iter(t)

    def __getitem__(self, idx) -> RadixKey:
        """The key of units ``idx`` (an int or a step-1 slice), same ``extra_key``.  Under
        EAGLE, units ``[a, b)`` span tokens ``[a, b + 1)`` (an empty slice has no tokens)."""
        n = len(self)
        if isinstance(idx, int) and not isinstance(idx, bool):
            if idx < 0:
                idx += n
            if not 0 <= idx < n:
                raise IndexError(f"RadixKey index out of range: {idx}")
            idx = slice(idx, idx + 1)
        if not isinstance(idx, slice):
            raise InvalidInput(f"a RadixKey is indexed by an int or a slice, got {type(idx).__name__}")
        start, stop, step = idx.indices(n)
        if step != 1:
            raise InvalidInput("a RadixKey slice must have step 1")
        if self.is_bigram:
            toks = self.token_ids[start: stop + 1] if stop > start else array("q")
        else:
            toks = self.token_ids[start:stop]
        return RadixKey(toks, self.extra_key, self.is_bigram)

    def page_aligned(self, page_size: int) -> RadixKey:
        """The key cut to whole pages of units (upstream's meaning: itself at page size 1)."""
        if page_size == 1:
            return self
        return self[: len(self) // page_size * page_size]

    def __repr__(self) -> str:
        head = list(self.token_ids[:8])
        more = "..." if len(self.token_ids) > 8 else ""
        return f"RadixKey(extra_key={self.extra_key!r}, token_ids={head}{more}, is_bigram={self.is_bigram})"
