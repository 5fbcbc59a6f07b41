"""Page keys (spec/pagekeys.py) hash each token as 4 bytes unsigned, so a cache that keys its
pages (KV events, fast/events.py; the storage tier, fast/tiers/storage.py) takes tokens in
[0, 2**32) only, and refuses others as the spec does (``InvalidInput``) before it changes
anything.  Standard library only (the events extra need not be installed)."""

from __future__ import annotations

from array import array
from typing import Any

from .errors import InvalidInput

__all__ = ["check_token_range"]

TOKEN_LIMIT = 2 ** 32


def check_token_range(units: Any, bigram: bool) -> None:
    """``InvalidInput`` naming the first token of ``units`` (token ids, or with ``bigram`` token
    pairs) outside [0, 2**32).  One C-level pass over the tokens."""
    flat = [t for u in units for t in u] if bigram else units
    try:
        array("I", flat)
    except OverflowError:
        bad = next(t for t in flat if not 0 <= t < TOKEN_LIMIT)
        raise InvalidInput(f"page key: token {bad!r} is not an integer in [0, 2**32)") from None
