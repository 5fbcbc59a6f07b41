"""What a router knows: a KV event stream folded into the set of cached blocks per medium.

A cache-aware router never sees the cache; it sees ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared`` and keeps, per server, which block hashes are cached on which medium. The
router's invariant (issue 17) is that this fold, applied from the first batch on, equals the set
of pages the cache holds per medium after every step. :class:`RouterView` is that fold, written
once so that tests and the lockstep compare against the same thing a router computes.

Standard library only. Events are told apart by their class *name* and read by attribute, so the
fold takes :mod:`uniradix.fast.kv_events` structs, upstream SGLang's own event classes, or any
object with the same names and fields (a spec's, for instance).

Cost: O(hashes in the event) per event; memory O(blocks cached).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["RouterView", "StoredBlock", "Anomaly", "FoldError", "MEDIUM_RANK"]

# The media from the fastest on (SGLang's StorageMedium values); an unknown medium ranks last.
MEDIUM_RANK = {"GPU": 0, "CPU_PINNED": 1, "DISK": 2, "EXTERNAL": 3}


class FoldError(ValueError):
    """Raised by a strict :class:`RouterView` on the first anomaly."""


@dataclass(frozen=True)
class StoredBlock:
    """What a router learns about one cached block."""

    parent: int | None
    token_ids: tuple[int, ...]
    lora_id: int | None


@dataclass(frozen=True)
class Anomaly:
    """A point where the stream contradicts the router's view. ``kind`` is one of
    ``duplicate-store`` (a hash stored on a medium that already holds it), ``unknown-remove``
    (removing a hash the medium does not hold), ``orphan-store`` (a parent held neither on the
    medium nor on a faster one, :data:`MEDIUM_RANK`), ``bad-store`` (``token_ids`` not
    ``block_size`` per hash), ``seq-gap`` (batches missing: ``detail`` says which),
    ``unknown-event``."""

    kind: str
    seq: int | None
    medium: str | None
    block_hash: int | None
    detail: str = ""


class RouterView:
    """The fold. ``apply_batch(seq, events)`` for a live stream (it tracks sequence numbers,
    skips batches already applied, as after an overlapping replay, and notes gaps);
    ``apply(event)`` for one event. ``cached(medium)`` is the router's answer.

    ``default_medium`` stands for an event whose ``medium`` is None (older producers leave it out;
    upstream's emitter means the device then). ``strict`` raises :class:`FoldError` on the first
    anomaly instead of recording it in ``anomalies``: the offending event (or the batch, for a
    sequence gap) is then not applied; earlier events of the same batch stay applied.
    """

    def __init__(self, default_medium: str = "GPU", strict: bool = False) -> None:
        self.default_medium = default_medium
        self.strict = strict
        self.anomalies: list[Anomaly] = []
        self.next_seq: int | None = None  # the sequence number the next live batch should have
        self._blocks: dict[str, dict[int, StoredBlock]] = {}
        self._seq: int | None = None

    # -- queries -----------------------------------------------------------------------------------

    def cached(self, medium: str) -> frozenset[int]:
        """The block hashes cached on ``medium``. O(blocks on it)."""
        return frozenset(self._blocks.get(medium, ()))

    def snapshot(self) -> dict[str, frozenset[int]]:
        """Every medium that holds a block, with its hashes."""
        return {m: frozenset(b) for m, b in self._blocks.items() if b}

    def block(self, medium: str, block_hash: int) -> StoredBlock | None:
        return self._blocks.get(medium, {}).get(block_hash)

    def __len__(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    # -- folding -----------------------------------------------------------------------------------

    def apply_batch(self, seq: int | None, events: Iterable[Any]) -> bool:
        """Apply one batch's events. With a ``seq``: a batch older than the next expected one is
        skipped (returns False); a newer one is applied after recording a ``seq-gap``."""
        if seq is not None:
            if self.next_seq is not None and seq < self.next_seq:
                return False
            if self.next_seq is not None and seq > self.next_seq:
                self._anomaly("seq-gap", seq, None, None,
                              f"batches {self.next_seq}..{seq - 1} missing")
            self.next_seq = seq + 1
        self._seq = seq
        for ev in events:
            self.apply(ev)
        return True

    def apply(self, event: Any) -> None:
        name = type(event).__name__
        if name == "BlockStored":
            self._stored(event)
        elif name == "BlockRemoved":
            self._removed(event)
        elif name == "AllBlocksCleared":
            self._blocks.clear()
        else:
            self._anomaly("unknown-event", self._seq, None, None, name)

    def _medium(self, event: Any) -> str:
        m = event.medium
        if m is None:
            return self.default_medium
        return getattr(m, "value", m)  # upstream passes its StorageMedium enum in-process

    def _stored(self, ev: Any) -> None:
        medium = self._medium(ev)
        hashes = list(ev.block_hashes)
        tokens = list(ev.token_ids)
        size = ev.block_size
        if len(hashes) == 1:
            chunks = [tuple(tokens)]
        elif size > 0 and len(tokens) == size * len(hashes):
            chunks = [tuple(tokens[i * size:(i + 1) * size]) for i in range(len(hashes))]
        else:
            self._anomaly("bad-store", self._seq, medium, hashes[0] if hashes else None,
                          f"{len(tokens)} tokens for {len(hashes)} block(s) of {size}")
            return
        held = self._blocks.get(medium, {})
        found: list[tuple[str, int, str]] = []  # checked before anything changes (strict mode)
        parent, added = ev.parent_block_hash, set()
        for h in hashes:
            if parent is not None and parent not in added and not self._parent_held(medium, parent):
                found.append(("orphan-store", h, f"parent {parent}"))
            if h in held or h in added:
                found.append(("duplicate-store", h, ""))
            added.add(h)
            parent = h
        for kind, h, detail in found:
            self._anomaly(kind, self._seq, medium, h, detail)
        held = self._blocks.setdefault(medium, {})
        parent = ev.parent_block_hash
        for h, toks in zip(hashes, chunks, strict=True):
            held[h] = StoredBlock(parent, toks, ev.lora_id)
            parent = h

    def _parent_held(self, medium: str, parent: int) -> bool:
        """A stored block's parent must be held on its medium or a faster one: a host page may
        follow a page that is on the device only (a write-back cache backs leaves up without
        their parents), a device page never follows one that is on the host only."""
        rank = MEDIUM_RANK.get(medium, len(MEDIUM_RANK))
        return any(parent in self._blocks.get(m, ()) for m, r in MEDIUM_RANK.items() if r < rank) \
            or parent in self._blocks.get(medium, ())

    def _removed(self, ev: Any) -> None:
        medium = self._medium(ev)
        held = self._blocks.get(medium, {})
        hashes = list(ev.block_hashes)
        for h in hashes:
            if h not in held:
                self._anomaly("unknown-remove", self._seq, medium, h)
        for h in hashes:
            held.pop(h, None)

    def _anomaly(self, kind: str, seq: int | None, medium: str | None,
                 block_hash: int | None, detail: str = "") -> None:
        a = Anomaly(kind, seq, medium, block_hash, detail)
        if self.strict:
            raise FoldError(f"{kind} at seq {seq} medium {medium} hash {block_hash} {detail}".strip())
        self.anomalies.append(a)
