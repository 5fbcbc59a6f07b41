"""KV events: what a cache-aware router is told about the pages the cache holds.

A router (SGLang's, Dynamo, llm-d) never sees the tree.  It folds a stream of three events into
the set of pages cached per *medium* (``"GPU"``: the device; ``"CPU_PINNED"``: the host tier):

* ``BlockStored``: pages became cached on a medium (hashes, the hash of the page before the
  first one, token ids, block size, LoRA id, medium);
* ``BlockRemoved``: pages stopped being cached on a medium (hashes, medium);
* ``AllBlocksCleared``: every page on every medium is gone (a flush).

**The spec's stream is derived from primary state**, never recorded by the rules: after each
step, :meth:`EventEmitter.step` computes the pages cached per medium (:func:`cached_pages`) and
emits the difference with the pages after the previous step.  So the router's invariant
(folding the stream from the start gives exactly the cached pages per medium, after every step)
holds by construction, and the stream is the *correct* one that an implementation's is compared
with.  A step's events come in this order: ``AllBlocksCleared`` when the step was a flush, then
one ``BlockRemoved`` per page that left a medium (``GPU`` then ``CPU_PINNED``, each in reverse
tree order: a child's pages before its parent's, a node's last page first), then one
``BlockStored`` per page that became cached (``GPU`` then ``CPU_PINNED``, in tree order: a
parent's pages before its children's).  One event per page, as SGLang 0.5.13.post1 emits them.

**What "cached on a medium" means.**

* ``GPU``: a page of a node (not the root) with a device value (``Node.value``), whatever the
  locks and in-flight loads (a load back makes its pages cached when it is submitted, as the
  device slots are then the pages' home).
* ``CPU_PINNED``: a page of a node with a host copy (``Node.host_value``) *whose write has been
  acknowledged*: a host copy still being written is not readable, so it is announced when the
  cache processes the write's ack (``writing_check``), as 0.5.13.post1 does.  The ack queue
  names the written node, but a match may split that node while the write is in flight, so the
  emitter notes the host slots of every write when it first sees the ack (after the step that
  submitted it) and treats a host page as in flight while its host slot is among them.
  Pages the storage tier's prefetch inserts as host-only nodes are cached on ``CPU_PINNED`` when
  they are inserted.

**Block hashes.**  A page's block hash is its page key (:mod:`uniradix.spec.pagekeys`, the
SHA-256 chain of the page and everything before it) cut to its first 64 bits, read as a signed
int64 (:func:`uniradix.spec.pagekeys.block_hash`).  The chain's mode is the config's
``storage_key_mode``: ``namespaced`` (the default) starts the chain of a path with an
``extra_key`` from that key's namespace digest, so two tenants' identical prompts are two pages
with two hashes; ``compat`` hashes as 0.5.13.post1 does (no ``extra_key``), which makes two
tenants' identical pages one hash: a router's fold then breaks (a removal of one tenant's page
hides the other's; docs/SPEC.md).  Pages are identified internally by their namespaced key,
whatever the mode the hashes are rendered in.

``token_ids`` are the page's units: token ids, or in EAGLE mode the ``(token, token)`` bigrams
(0.5.13.post1 also exposes bigram pages as pairs).  ``block_size`` is the page's unit count,
``lora_id`` is always None (the spec has no LoRA adapters; an ``extra_key`` is not one).

Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .core import CacheState, Node
from .errors import InvalidInput
from .pagekeys import KEY_MODES, block_hash, chain_keys, namespace_prior

__all__ = ["GPU", "CPU_PINNED", "MEDIA", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "Event", "CachedPage", "cached_pages", "pending_host_slots", "EventEmitter",
           "to_wire", "from_wire", "canonical"]

GPU = "GPU"
CPU_PINNED = "CPU_PINNED"
MEDIA = (GPU, CPU_PINNED)


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[Any, ...]
    block_size: int
    lora_id: int | None
    medium: str


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True)
class CachedPage:
    """One page cached on a medium: its hash, its parent page's hash (None: the first page of
    a path) and its units."""

    block_hash: int
    parent_block_hash: int | None
    units: tuple[Any, ...]


# A medium's pages: namespaced page key -> page, in tree order (parents first).
MediumPages = dict[str, CachedPage]


# What a node's pages are, given where its chain starts: its pages by namespaced key (in
# order), the last namespaced key, the last rendered key and the last page's hash.
NodePages = tuple[dict[str, CachedPage], str | None, str | None, int | None]
# (namespaced prior, rendered prior, parent page's hash, the node's units) -> its pages
KeyMemo = dict[tuple[str | None, str | None, int | None, tuple[Any, ...]], NodePages]
MEMO_LIMIT = 1 << 16  # entries a memo keeps before it starts over


def _node_pages(node: Node, ns_prior: str | None, prior: str | None, parent_hash: int | None,
                page: int, rendered: bool) -> NodePages:
    """A node's pages, chained from ``ns_prior`` (namespaced keys, the pages' identity) and,
    when ``rendered``, from ``prior`` (the keys the hashes are rendered from)."""
    ns_keys = chain_keys(node.key, page, ns_prior)
    keys = chain_keys(node.key, page, prior) if rendered else ns_keys
    pages: dict[str, CachedPage] = {}
    parent = parent_hash
    for idx, (ns_key, key) in enumerate(zip(ns_keys, keys, strict=True)):
        bh = block_hash(key)
        pages[ns_key] = CachedPage(bh, parent, tuple(node.key[idx * page:(idx + 1) * page]))
        parent = bh
    return (pages, ns_keys[-1] if ns_keys else ns_prior, keys[-1] if keys else prior, parent)


def _root_prior(extra_key: str | None, key_mode: str) -> str | None:
    return namespace_prior(extra_key, key_mode)


def pending_host_slots(state: CacheState, known: dict[int, tuple[Any, frozenset[int]]]) -> frozenset[int]:
    """The host slots of writes not yet acknowledged by the cache.  ``known`` maps ``id(ack)``
    to ``(ack, slots)`` and is updated: a new ack's slots are its node's host slots now (call
    this after every step), an ack no longer queued is dropped.

    post: all(isinstance(s, int) for s in __return__)
    """
    host: Any = state.host
    if host is None:
        known.clear()
        return frozenset()
    queued = {id(ack): ack for ack in host.writes}
    for key in [k for k in known if k not in queued]:
        del known[key]
    for key, ack in queued.items():
        if key not in known:
            known[key] = (ack, frozenset(ack.node.host_value or ()))
    out: set[int] = set()
    for _, slots in known.values():
        out |= slots
    return frozenset(out)


def cached_pages(state: CacheState, key_mode: str | None = None,
                 pending: frozenset[int] = frozenset(),
                 memo: KeyMemo | None = None) -> dict[str, MediumPages]:
    """The pages cached per medium (``GPU``, ``CPU_PINNED``), each keyed by its namespaced page
    key, in tree order.  ``key_mode`` renders the hashes (default: the config's
    ``storage_key_mode``); ``pending``: host slots whose write is not acknowledged yet;
    ``memo``: a cache of nodes' pages kept across calls (a pure function of its key, so only a
    cache)."""
    mode = key_mode if key_mode is not None else state.config.storage_key_mode
    if mode not in KEY_MODES:
        raise InvalidInput(f"key_mode must be one of {KEY_MODES}, got {mode!r}")
    page = state.config.page_size
    rendered = mode != "namespaced"
    gpu: MediumPages = {}
    cpu: MediumPages = {}
    # (node, namespaced prior, rendered prior, parent page's rendered hash)
    stack: list[tuple[Node, str | None, str | None, int | None]] = []
    for child in reversed(_children(state.root)):
        stack.append((child, _root_prior(child.extra_key, "namespaced"),
                      _root_prior(child.extra_key, mode), None))
    while stack:
        node, ns_prior, prior, parent_hash = stack.pop()
        k = (ns_prior, prior, parent_hash, node.key)
        found = memo.get(k) if memo is not None else None
        if found is None:
            found = _node_pages(node, ns_prior, prior, parent_hash, page, rendered)
            if memo is not None:
                if len(memo) >= MEMO_LIMIT:
                    memo.clear()
                memo[k] = found
        pages, next_ns, next_prior, last_hash = found
        if node.value is not None:
            gpu.update(pages)
        host_value: tuple[Any, ...] | None = node.host_value
        if host_value is not None:
            if not pending or pending.isdisjoint(host_value):
                cpu.update(pages)
            else:
                for idx, (ns_key, cp) in enumerate(pages.items()):
                    if host_value[idx * page] not in pending:
                        cpu[ns_key] = cp
        for child in reversed(_children(node)):
            stack.append((child, next_ns, next_prior, last_hash))
    return {GPU: gpu, CPU_PINNED: cpu}


def _children(node: Node) -> list[Node]:
    """A node's children, in the order the tree holds them (deterministic for a step list)."""
    return list(node.children.values())


def diff_events(before: dict[str, MediumPages], after: dict[str, MediumPages],
                cleared: bool = False) -> list[Event]:
    """The events that take a router from ``before`` to ``after`` (module docstring order).
    With ``cleared`` the step was a flush: ``AllBlocksCleared`` replaces every removal."""
    events: list[Event] = []
    if cleared:
        events.append(AllBlocksCleared())
        before = {m: {} for m in MEDIA}
    for medium in MEDIA:
        old, new = before.get(medium, {}), after.get(medium, {})
        for key in reversed(list(old)):
            if key not in new:
                events.append(BlockRemoved((old[key].block_hash,), medium))
    for medium in MEDIA:
        old, new = before.get(medium, {}), after.get(medium, {})
        for key, cp in new.items():
            if key not in old:
                events.append(BlockStored((cp.block_hash,), cp.parent_block_hash, cp.units,
                                          len(cp.units), None, medium))
    return events


class EventEmitter:
    """The spec's event stream for one cache.  Call :meth:`step` after every step (``cleared``
    when the step was an accepted flush); it returns that step's events.  ``key_mode``: the
    chain the hashes are rendered in (default: the config's ``storage_key_mode``)."""

    def __init__(self, state: CacheState, key_mode: str | None = None) -> None:
        self.key_mode = key_mode if key_mode is not None else state.config.storage_key_mode
        if self.key_mode not in KEY_MODES:
            raise InvalidInput(f"key_mode must be one of {KEY_MODES}, got {self.key_mode!r}")
        self._acks: dict[int, tuple[Any, frozenset[int]]] = {}
        self._memo: KeyMemo = {}
        self._pages: dict[str, MediumPages] = {m: {} for m in MEDIA}
        self._pages = self.pages_of(state)

    def pages_of(self, state: CacheState) -> dict[str, MediumPages]:
        return cached_pages(state, self.key_mode, pending_host_slots(state, self._acks), self._memo)

    def step(self, state: CacheState, cleared: bool = False) -> list[Event]:
        after = self.pages_of(state)
        events = diff_events(self._pages, after, cleared)
        self._pages = after
        return events

    def hashes(self) -> dict[str, frozenset[int]]:
        """The block hashes cached per medium after the last step (what a router's fold must
        hold)."""
        return {m: frozenset(cp.block_hash for cp in self._pages[m].values()) for m in MEDIA}


# ----------------------------------------------------------------------------------------------
# The wire's array form (SGLang 0.5.13.post1's msgpack arrays, as JSON): what traces carry
# ----------------------------------------------------------------------------------------------


def _wire_units(units: Sequence[Any]) -> list[Any]:
    return [list(u) if isinstance(u, tuple) else u for u in units]


def to_wire(event: Any) -> list[Any]:
    """An event as the array 0.5.13.post1 puts on the wire (docs/EVENTS.md): ``["BlockStored",
    hashes, parent, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", hashes,
    medium]`` or ``["AllBlocksCleared"]``.  Takes any object with the events' class names and
    fields (the spec's, uniradix.fast's or SGLang's own; an enum medium becomes its value)."""
    name = type(event).__name__
    if name == "BlockStored":
        return ["BlockStored", [int(h) for h in event.block_hashes],
                None if event.parent_block_hash is None else int(event.parent_block_hash),
                _wire_units(event.token_ids), int(event.block_size),
                event.lora_id, _medium(event.medium)]
    if name == "BlockRemoved":
        return ["BlockRemoved", [int(h) for h in event.block_hashes], _medium(event.medium)]
    if name == "AllBlocksCleared":
        return ["AllBlocksCleared"]
    raise InvalidInput(f"not a KV event: {name}")


def _medium(m: Any) -> str | None:
    if m is None:
        return None
    value = getattr(m, "value", m)
    if not isinstance(value, str):
        raise InvalidInput(f"medium {m!r} is not a string")
    return value


def from_wire(item: Any) -> Event:
    """The inverse of :func:`to_wire` (bigram units come back as pairs); ``InvalidInput`` on
    anything else."""
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise InvalidInput(f"not a KV event array: {item!r}")
    name = item[0]
    try:
        if name == "BlockStored" and len(item) == 7:
            _, hashes, parent, tokens, size, lora, medium = item
            return BlockStored(tuple(_int(h) for h in hashes),
                               None if parent is None else _int(parent),
                               tuple(tuple(t) if isinstance(t, list) else t for t in tokens),
                               _int(size), None if lora is None else _int(lora),
                               GPU if medium is None else str(medium))
        if name == "BlockRemoved" and len(item) == 3:
            _, hashes, medium = item
            return BlockRemoved(tuple(_int(h) for h in hashes), GPU if medium is None else str(medium))
        if name == "AllBlocksCleared" and len(item) == 1:
            return AllBlocksCleared()
    except TypeError:
        pass
    raise InvalidInput(f"not a KV event array: {item!r}")


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidInput(f"{x!r} is not an integer")
    return x


def canonical(events: Sequence[Any]) -> list[str]:
    """A step's events as a sorted list of their JSON-like reprs: two streams that differ only
    in the order of a step's events (which a router's fold does not see, since the spec never
    removes and stores one page on one medium in one step) compare equal."""
    return sorted(repr(to_wire(from_wire(e if isinstance(e, list) else to_wire(e)))) for e in events)
