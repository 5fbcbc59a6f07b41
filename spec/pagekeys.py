"""Page keys of the storage tier: the content names under which pages are stored and found.

A page's key is a SHA-256 digest, written as 64 lowercase hex digits, over

1. the previous page's key as its 32 raw bytes (nothing for the first page of a chain), then
2. each unit of the page, a token as 4 bytes little-endian unsigned; an EAGLE bigram unit
   ``(a, b)`` feeds ``a`` then ``b``.

So a key names a page *and everything before it*: two pages share a key only when their whole
prefixes are equal.  This is sglang 0.5.13.post1's chain (its ``get_hash_str`` and the radix
key's ``hash_page``); the fixed vectors in tests/test_pagekeys.py were produced by that function.

**Tenant isolation.**  0.5.13.post1 leaves the request's ``extra_key`` (LoRA id, cache salt) out
of the chain, so two tenants whose prompts share tokens share stored KV.  uniradix namespaces the
chain instead (``key_mode="namespaced"``, the default): the first page of a key with an
``extra_key`` absorbs, in place of a previous key, the *namespace digest*
``sha256(b"uniradix/extra_key\\0" + extra_key.encode("utf-8"))``.  Keys without an ``extra_key``
are the same in both modes.  ``key_mode="compat"`` computes every key the 0.5.13.post1 way, for a
store shared with 0.5.13.post1 servers (and their cross-tenant sharing).

``block_hash`` is the 64-bit id KV events use for a page: the key's first 16 hex digits as a
signed int64.

Every helper is pure, with PEP 316 contracts.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import cast

from .errors import InvalidInput

KEY_MODES = ("namespaced", "compat")
NAMESPACE_TAG = b"uniradix/extra_key\x00"
TOKEN_LIMIT = 2 ** 32  # a token is stored as 4 bytes unsigned
HEX_DIGITS = "0123456789abcdef"
# how many (prior, page) -> key results page_key remembers: the storage invariants re-key every
# node's path after every step, so the same pages come back again and again
MEMO_PAGES = 1 << 16

UnitValue = int | tuple[int, int]


def is_page_key(key: object) -> bool:
    """A well-formed page key: 64 lowercase hex digits.

    post: __return__ == (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key))
    """  # noqa: E501 (CrossHair reads each PEP 316 condition from one line)
    # (stripping every hex digit from both ends leaves nothing exactly when all 64 are hex digits)
    return isinstance(key, str) and len(key) == 64 and not key.strip(HEX_DIGITS)


def _check_token(t: object) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_LIMIT:
        raise InvalidInput(f"page key: token {t!r} is not an integer in [0, 2**32)")


def check_units(units: tuple[UnitValue, ...]) -> None:
    """InvalidInput unless every token of ``units`` is an integer in [0, 2**32)."""
    _check_page(units)


def _check_page(page: tuple[UnitValue, ...]) -> None:
    """Every token of ``page`` is an integer in [0, 2**32) (an EAGLE unit: a pair of them)."""
    if page and set(map(type, page)) == {int}:  # the common case, checked in C: plain ints
        ints = cast("tuple[int, ...]", page)
        if 0 <= min(ints) and max(ints) < TOKEN_LIMIT:
            return
    for unit in page:
        for t in (unit if isinstance(unit, tuple) else (unit,)):
            _check_token(t)


@functools.lru_cache(maxsize=MEMO_PAGES)
def _page_digest(page: tuple[UnitValue, ...], prior: str | None) -> str:
    """The key of a checked ``page`` after a checked ``prior`` (memoised: a key depends on
    nothing else)."""
    hasher = hashlib.sha256()
    if prior:
        hasher.update(bytes.fromhex(prior))
    for unit in page:
        for t in (unit if isinstance(unit, tuple) else (unit,)):
            hasher.update(t.to_bytes(4, "little", signed=False))
    return hasher.hexdigest()


def page_key(units: Sequence[UnitValue], prior: str | None = None) -> str:
    """The key of one page of ``units`` following a page keyed ``prior`` (None: the first page).

    An empty ``prior`` counts as none (as 0.5.13.post1's truthiness test does).

    pre: prior is None or prior == "" or is_page_key(prior)
    post: is_page_key(__return__)
    """
    if prior and not is_page_key(prior):
        raise InvalidInput(f"page key: prior {prior!r} is not a page key")
    page = tuple(units)
    _check_page(page)
    return _page_digest(page, prior or None)


def namespace_prior(extra_key: str | None, key_mode: str = "namespaced") -> str | None:
    """What the first page of a chain absorbs before its units: the namespace digest of
    ``extra_key`` in namespaced mode, nothing without an ``extra_key`` or in compat mode.

    post: (__return__ is None) == (extra_key is None or key_mode == "compat")
    post: __return__ is None or is_page_key(__return__)
    """
    if key_mode not in KEY_MODES:
        raise InvalidInput(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
    if extra_key is None or key_mode == "compat":
        return None
    return hashlib.sha256(NAMESPACE_TAG + extra_key.encode("utf-8")).hexdigest()


def chain_keys(units: Sequence[UnitValue], page_size: int,
               prior: str | None = None) -> tuple[str, ...]:
    """The keys of ``units`` cut into pages of ``page_size`` (a short last page is keyed as it
    is), chained from ``prior``.

    pre: page_size >= 1
    post: len(__return__) == (len(units) + page_size - 1) // page_size
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidInput(f"page key: page_size must be an integer >= 1, got {page_size!r}")
    run = tuple(units)
    if run and prior and not is_page_key(prior):  # (no page: nothing to chain it to)
        raise InvalidInput(f"page key: prior {prior!r} is not a page key")
    _check_page(run)
    return _chain_digests(run, page_size, prior or None)


@functools.lru_cache(maxsize=MEMO_PAGES // 4)
def _chain_digests(run: tuple[UnitValue, ...], page_size: int,
                   prior: str | None) -> tuple[str, ...]:
    """``chain_keys`` of a checked run (memoised: a node's keys are asked for after every
    step, by the storage invariants and the KV events)."""
    keys = []
    last = prior
    for start in range(0, len(run), page_size):
        last = _page_digest(run[start: start + page_size], last)
        keys.append(last)
    return tuple(keys)


def path_keys(units: Sequence[UnitValue], page_size: int, extra_key: str | None,
              key_mode: str = "namespaced") -> tuple[str, ...]:
    """The keys of a whole path from the root (its first page chained from the namespace).

    pre: page_size >= 1
    post: len(__return__) == (len(units) + page_size - 1) // page_size
    """
    return chain_keys(units, page_size, namespace_prior(extra_key, key_mode))


def split_keys(keys: Sequence[str], split_len: int,
               page_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A node split after ``split_len`` units cuts its key list after ``split_len // page_size``
    pages: the upper part keeps the first keys, the lower the rest (keys never change, since a
    key names its whole prefix).

    pre: page_size >= 1
    pre: 0 <= split_len
    post: __return__[0] + __return__[1] == tuple(keys)
    post: len(__return__[0]) == min(len(keys), split_len // page_size)
    """
    cut = split_len // page_size
    return tuple(keys[:cut]), tuple(keys[cut:])


def block_hash(key: str) -> int:
    """The 64-bit block id of a page for KV events: the first 16 hex digits of its key read as
    an unsigned 64-bit number, then as a signed int64 (two's complement).

    pre: is_page_key(key)
    post: -(2 ** 63) <= __return__ < 2 ** 63
    post: __return__ % (2 ** 64) == int(key[:16], 16)
    """
    if not is_page_key(key):
        raise InvalidInput(f"block_hash: {key!r} is not a page key")
    value = int(key[:16], 16)
    return value - 2 ** 64 if value >= 2 ** 63 else value
