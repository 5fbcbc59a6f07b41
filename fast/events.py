"""The cache's KV events (``enable_kv_cache_events=True``): what a cache-aware router is told
about the pages the cache holds, queued as the cache changes and handed over by
``take_events()`` (upstream's API: the scheduler publishes each step's list through
:mod:`uniradix.fast.kv_events`'s publisher).

The stream is the spec's (``uniradix.spec.events``, docs/EVENTS.md): one event per page, a
page being cached on ``GPU`` while its node holds device slots and on ``CPU_PINNED`` while it
holds a host copy whose write has been acknowledged.  So folding the stream
(:class:`~uniradix.fast.event_fold.RouterView`) gives exactly the cached pages per medium after
every call.  :class:`CacheEvents` is called from one-line hooks of the composed tree
(fast/hybrid.py) and its host tier (fast/tiers/host.py), each behind one ``is not None`` test,
so a cache without events pays that test and nothing else:

=====================================  ===================================================
hook                                   events
=====================================  ===================================================
a new leaf (insert)                    ``BlockStored`` GPU, each page of the leaf
an evicted node restored (insert)      ``BlockStored`` GPU, each page of the node
load back (host tier)                  ``BlockStored`` GPU, each page of the loaded nodes
a device leaf deleted (eviction)       ``BlockRemoved`` GPU, each page, last page first
a device leaf evicted to the host      ``BlockRemoved`` GPU
a backup's write acknowledged          ``BlockStored`` CPU_PINNED, the pages written
a host leaf evicted                    ``BlockRemoved`` CPU_PINNED
a storage prefetch's host-only node    ``BlockStored`` CPU_PINNED, each page of the node
``reset``                              ``AllBlocksCleared``
=====================================  ===================================================

A split changes no page (a page's hash names its whole prefix), so it emits nothing.

**Block hashes.**  A page's key is the SHA-256 chain of spec/pagekeys.py (the previous page's
32-byte digest, then each unit as 4 bytes little-endian unsigned; a bigram feeds both tokens),
and its block hash the digest's first 8 bytes read big-endian as a signed int64.  The chain of a
path with an ``extra_key`` starts from that key's namespace digest in ``"namespaced"`` mode (the
default) and from nothing in ``"compat"`` mode (0.5.13.post1's hashes, which make two tenants'
identical pages one hash).  The mode is the uniradix setting ``kv_events_key_mode``.  Each
node keeps its pages' digests in its ``pk`` slot once computed (a split leaves the lower part
with the tail of its list, and the upper part takes its own from the head of that list, or
chains them from its parent's when the lower part is gone), so a page is hashed about once
while it is cached.

Page keys take tokens in [0, 2**32) (spec/pagekeys.py): a cache with events or a storage tier
refuses an insert with a token outside that range before it changes anything
(fast/token_range.py ``check_token_range``, called by fast/hybrid.py).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any

from .errors import InvalidInput
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["GPU", "CPU_PINNED", "KEY_MODES", "CacheEvents", "events_for"]

GPU = "GPU"
CPU_PINNED = "CPU_PINNED"
KEY_MODES = ("namespaced", "compat")
NAMESPACE_TAG = b"uniradix/extra_key\x00"
_sha256 = hashlib.sha256
_BIG_ENDIAN = sys.byteorder == "big"  # page keys hash tokens as 4 bytes little-endian
assert array("I").itemsize == 4, "page keys need a 4-byte unsigned array type"


def _namespace(extra_key: Any, key_mode: str) -> bytes | None:
    """What the first page of a path absorbs before its units."""
    if extra_key is None or key_mode == "compat":
        return None
    ek = extra_key if isinstance(extra_key, str) else str(extra_key)
    return _sha256(NAMESPACE_TAG + ek.encode("utf-8")).digest()


def _unit_bytes(units: Any, bigram: bool) -> bytes:
    """``units`` as the page keys hash them: each token 4 bytes little-endian unsigned."""
    flat = [t for u in units for t in u] if bigram else units
    words = array("I", flat)  # one C loop (the tokens were checked: check_token_range)
    if _BIG_ENDIAN:
        words.byteswap()
    return words.tobytes()


def _chain(prior: bytes | None, raw: bytes, step: int, pages: int) -> list[bytes]:
    """The digests of ``pages`` pages of ``step`` bytes each of ``raw``, chained from
    ``prior`` (one sha256 call per page over the prior digest and the page's bytes)."""
    out = []
    sha = _sha256
    for start in range(0, pages * step, step):
        page = raw[start:start + step]
        prior = sha(prior + page if prior else page).digest()
        out.append(prior)
    return out


def _from_split_child(node: Any, pages: int, ps: int) -> tuple[bytes, ...] | None:
    """The digests of ``node``, an upper part of a split, from the list its lower part still
    holds (the whole node's, cut lazily), or None.  A node without digests is such an upper
    part: every other node gets its digests when its pages are first stored."""
    for child in node.children.values():
        cpk = getattr(child, "pk", None)
        if cpk is not None:
            above = len(cpk) - len(child.key) // ps  # the digests of the parts above the child
            if above >= pages:
                return cpk[above - pages: above]
    return None


def _block_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class CacheEvents:
    """The event queue of one cache (see the module docstring).  ``page_size``: the cache's;
    ``key_mode``: ``"namespaced"`` or ``"compat"``; ``bigram``: EAGLE keys (units are token
    pairs, exposed as pairs in ``token_ids``)."""

    __slots__ = ("page_size", "key_mode", "bigram", "queue", "_pending")

    def __init__(self, page_size: int, key_mode: str = "namespaced", bigram: bool = False) -> None:
        if key_mode not in KEY_MODES:
            raise InvalidInput(f"kv_events_key_mode must be one of {KEY_MODES}, got {key_mode!r}")
        self.page_size = page_size
        self.key_mode = key_mode
        self.bigram = bigram
        self.queue: list[KVCacheEvent] = []
        # host writes not yet acknowledged: ack id -> the written pages' (hash, parent, units)
        self._pending: dict[int, list[tuple[int, int | None, list]]] = {}

    def take(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first (the queue is emptied)."""
        out, self.queue = self.queue, []
        return out

    # -- page keys ---------------------------------------------------------------------------
    def _digests(self, node: Any) -> tuple[bytes, ...]:
        """The digests of ``node``'s pages (attached, not the root), computed once per node."""
        ps = self.page_size
        todo = []
        cur = node
        while True:
            pk = getattr(cur, "pk", None)
            pages = len(cur.key) // ps
            if pk is not None and len(pk) >= pages:
                if len(pk) > pages:  # split: this node kept the lower part
                    pk = pk[len(pk) - pages:]
                    cur.pk = pk
                break
            pk = _from_split_child(cur, pages, ps)
            if pk is not None:
                cur.pk = pk
                break
            up = cur.parent
            if up is None or up.parent is None:  # ``cur`` is a child of the root
                pk = None
                todo.append(cur)
                break
            todo.append(cur)
            cur = up
        prior: bytes | None
        if pk is None:
            prior = _namespace(todo[-1].extra_key, self.key_mode)
        else:
            prior = pk[-1] if pk else None
        bigram = self.bigram
        step = 4 * ps * (2 if bigram else 1)  # bytes per page
        for n in reversed(todo):
            key = n.key
            out = _chain(prior, _unit_bytes(key, bigram), step, len(key) // ps)
            if out:
                prior = out[-1]
            n.pk = tuple(out)
        return node.pk

    def _parent_hash(self, node: Any) -> int | None:
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        pk = self._digests(parent)
        return _block_hash(pk[-1]) if pk else self._parent_hash(parent)

    def _pages(self, node: Any) -> list[tuple[int, int | None, list]]:
        """``node``'s pages as (hash, parent hash, units), in order."""
        ps = self.page_size
        key = node.key
        units = list(key) if self.bigram else key.tolist()  # EAGLE: (token, next token) pairs
        parent = self._parent_hash(node)
        from_bytes = int.from_bytes
        out = []
        start = 0
        for digest in self._digests(node):
            h = from_bytes(digest[:8], "big", signed=True)
            out.append((h, parent, units[start:start + ps]))
            parent = h
            start += ps
        return out

    # -- hooks -------------------------------------------------------------------------------
    def stored(self, node: Any) -> None:
        """``node``'s pages became cached on the device."""
        ps = self.page_size
        self.queue.extend([BlockStored([h], parent, units, ps, None, GPU)
                           for h, parent, units in self._pages(node)])

    def removed(self, node: Any) -> None:
        """``node``'s pages left the device (call while it is still attached)."""
        self.queue.extend(BlockRemoved([_block_hash(d)], GPU) for d in reversed(self._digests(node)))

    def host_written(self, ack_id: int, node: Any) -> None:
        """A backup of ``node`` to the host was submitted (announced at its ack)."""
        self._pending[ack_id] = self._pages(node)

    def host_acked(self, ack_id: int) -> None:
        """The write ``ack_id`` was acknowledged: its pages are cached on the host."""
        pages = self._pending.pop(ack_id, None)
        if pages:
            ps = self.page_size
            self.queue.extend([BlockStored([h], parent, units, ps, None, CPU_PINNED)
                               for h, parent, units in pages])

    def host_stored(self, node: Any) -> None:
        """``node``'s pages became cached on the host with no write to wait for (a storage
        prefetch inserted them as a host-only node)."""
        ps = self.page_size
        self.queue.extend([BlockStored([h], parent, units, ps, None, CPU_PINNED)
                           for h, parent, units in self._pages(node)])

    def host_removed(self, node: Any) -> None:
        """``node``'s host copy goes (call while it is still attached).  Its write has been
        acknowledged: only a host leaf loses its copy, and a node whose write is in flight is
        none (write-through keeps it locked on the device until the ack; write-back waits for
        its acks at once)."""
        self.queue.extend(BlockRemoved([_block_hash(d)], CPU_PINNED)
                          for d in reversed(self._digests(node)))

    def cleared(self) -> None:
        """Everything is gone (``reset``)."""
        self._pending.clear()
        self.queue.append(AllBlocksCleared())


def events_for(params: Any) -> CacheEvents | None:
    """The event queue ``params`` asks for (``enable_kv_cache_events``; the uniradix setting
    ``kv_events_key_mode``, default ``"namespaced"``), or None."""
    if not getattr(params, "enable_kv_cache_events", False):
        return None
    mode = getattr(params, "kv_events_key_mode", None) or "namespaced"
    page = params.page_size
    return CacheEvents(page, mode, bool(params.is_eagle))
