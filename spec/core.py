"""The primary state of the cache (docs/DESIGN.md, "primary state only").

Stored: the tree (nodes with key, parent, children by child key), each node's device value,
lock count, access stamp and hit count (and, for the eviction policies, creation stamp and
priority), the logical clock, the issued lock handles, and the
environment's KV pool.  Nothing derived is stored: evictable/protected sizes, leaf sets and the
eviction order are computed from scratch by the queries in :mod:`uniradix.spec.queries`.

This module sits below every rule: the state's types, then the hooks through which the plug-ins
of the components (spec/components.py: SWA, Mamba) and tiers (spec/host.py, spec/storage.py)
take part in the cache's rules (spec/cache.py), declared once as :class:`Plugin`.
:mod:`uniradix.spec.state` composes a fresh state with the plug-ins its config names.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from .config import CacheConfig
from .world import PagedPool

Stamp = tuple[int, int]  # (tick, rank): compared lexicographically; see cache.stamp_match_path


@dataclasses.dataclass(eq=False)
class Node:
    """One radix-tree node: ``key`` holds the units from the parent's end to this node's end."""

    key: tuple[Any, ...]  # units: tokens, or bigrams under EAGLE (spec/keys.py)
    extra_key: str | None
    parent: Node | None
    value: tuple[int, ...] | None  # device KV slots, one per unit; None = evicted (a tombstone)
    stamp: Stamp
    lock_ref: int = 0
    hit_count: int = 0
    children: dict[Any, Node] = dataclasses.field(default_factory=dict)
    # Hybrid models (spec/components.py): per aux component ("swa", "mamba") its AuxData here.
    aux: dict[str, Any] = dataclasses.field(default_factory=dict)
    # host tier (spec/host.py): host KV slots, one per unit (None = no host copy), host locks
    host_value: tuple[int, ...] | None = None
    host_lock_ref: int = 0
    # eviction policies (spec/policies.py): when the node's data was created, and the highest
    # priority of an insert through it
    created: Stamp = (0, 0)
    priority: int = 0
    # storage tier (spec/storage.py): the keys of this node's pages (None without storage)
    page_keys: tuple[str, ...] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def evicted(self) -> bool:
        return not self.is_root and self.value is None

    def path_units(self) -> tuple[Any, ...]:
        """All units from the root to this node's end."""
        parts = []
        node: Node | None = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(u for part in reversed(parts) for u in part)

    def ancestors_to_root(self) -> Iterator[Node]:
        """This node, its parent, ... up to but excluding the root."""
        node: Node | None = self
        while node is not None and not node.is_root:
            yield node
            node = node.parent

    def __repr__(self) -> str:  # node ids are private; name a node by its path
        return f"Node(extra_key={self.extra_key!r}, path_len={len(self.path_units())})"


@dataclasses.dataclass(eq=False)
class LockHandle:
    """What ``inc_lock_ref`` hands out and ``dec_lock_ref`` takes back.

    A lock runs from ``node`` up to (not including) the root, minus ``skipped``: the evicted
    bottom segment at lock time, remembered so that a tombstone restored later is never
    unlocked by a lock that did not lock it.  The path is walked again at unlock time, so a
    node split in between (whose new upper part inherited the lock count) is covered.
    """

    serial: int
    node: Node
    skipped: tuple[Node, ...]
    # Hybrid models (spec/components.py): per aux component, what its unlock needs.
    aux: dict[str, Any] = dataclasses.field(default_factory=dict)

    def locked_nodes(self) -> list[Node]:
        return [n for n in self.node.ancestors_to_root() if not any(n is s for s in self.skipped)]


@dataclasses.dataclass(eq=False)
class CacheState:
    config: CacheConfig
    kv: PagedPool
    root: Node
    clock: int = 0
    handles: dict[int, LockHandle] = dataclasses.field(default_factory=dict)  # serial -> live
    next_serial: int = 1
    requests: dict[str, Any] = dataclasses.field(default_factory=dict)  # rid -> Request (spec/requests.py)
    # Hybrid models (spec/components.py): the Mamba state pool (None without Mamba) and the
    # next SWA lock-boundary mark.  With SWA, ``kv`` is a HybridKVPool (spec/world.py).
    mamba: PagedPool | None = None
    next_boundary: int = 1
    host: Any = None  # spec/host.py HostTier when config.host_slots > 0, else None
    sessions: dict[str, Any] = dataclasses.field(default_factory=dict)  # id -> SessionSlot
    storage: Any = None  # spec/storage.py StorageTier when config.storage, else None
    # The plug-ins of the configured components and tiers, composed once by spec/state.py
    # ``new_state``: the cache's rules run their hooks in this order (``Plugin`` below).
    plugins: tuple[Plugin, ...] = ()


def new_root() -> Node:
    return Node(key=(), extra_key=None, parent=None, value=(), stamp=(0, 0))


def up(node: Node) -> Node:
    """The parent of a node that is not the root."""
    assert node.parent is not None
    return node.parent


def all_nodes(state: CacheState) -> list[Node]:
    """Every node, root first, in depth-first order."""
    taken = _READING.get(id(state))
    if taken is not None:  # inside read_only(state): the tree is as it was when that began
        return list(taken)
    out, stack = [], [state.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


# the node list of each state a read-only pass is running on, by id of the state (read_only)
_READING: dict[int, list[Node]] = {}


@contextlib.contextmanager
def read_only(state: CacheState) -> Iterator[None]:
    """A pass that only reads ``state`` (the invariants, the snapshot) walks the tree once:
    inside it :func:`all_nodes` returns the list taken when it began.  A speed-up only: the
    pass must not change the state (nothing in it may add, drop or move a node)."""
    if id(state) in _READING:  # nested in another read-only pass on the same state
        yield
        return
    _READING[id(state)] = all_nodes(state)
    try:
        yield
    finally:
        del _READING[id(state)]


# ----------------------------------------------------------------------------------------------
# What the rules hand the hooks
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MatchOutcome:
    device_indices: tuple[int, ...]
    last_device_node: Node
    last_host_node: Node
    best_match_node: Node
    host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None  # hybrid models: Mamba only
    mamba_host_hit_length: int = 0  # host tier with Mamba: 1 when the best node's state is host-only
    swa_host_hit_length: int = 0  # host tier with SWA: host-only SWA units in the best node's window


@dataclasses.dataclass(frozen=True)
class MatchWalk:
    """How far a match walked: ``walked_len`` units in ``walked_chunks`` device chunks, of
    which the first ``best_chunks`` end at the node every validator accepted."""

    walked_len: int
    walked_chunks: int
    best_chunks: int


@dataclasses.dataclass(frozen=True)
class InsertArgs:
    """An insert's arguments the plug-ins read, checked: where the request's own slots start
    (``prev_prefix_len``), where its sliding window starts (SWA) and its state slot (Mamba)."""

    prev_prefix_len: int
    swa_evicted_seqlen: int = 0
    mamba_value: object = None  # the caller's until the Mamba plug-in's check: then a 1-tuple
    units: tuple[Any, ...] = ()  # the key's units (page-aligned), as the insert will walk them


@dataclasses.dataclass(eq=False)
class Ack:
    """One in-flight host transfer (spec/host.py): a backup of ``node`` (a write) or a load
    back ending at ``node``.

    ``done`` belongs to the environment (``io_complete`` sets it); ``lock`` is the cache's: the
    lock the transfer holds until its ack is processed (None for a write-back backup)."""

    node: Node
    lock: LockHandle | None
    done: bool = False


# ----------------------------------------------------------------------------------------------
# The hooks, declared once
# ----------------------------------------------------------------------------------------------


class Plugin:
    """A component or tier's part in the cache's rules: one method per hook, in the order the
    rules of spec/cache.py meet them.  Every default leaves the rule as the Full component's
    device tier has it, so a plug-in overrides only the hooks it takes part in.  The rules
    call each hook on every plug-in of ``state.plugins``, in that order."""

    #: the insert arguments this plug-in reads (an insert passing another one is refused)
    insert_args: frozenset[str] = frozenset()
    #: whether this plug-in drives device eviction (the host tier only: spec/state.py)
    drives_eviction: bool = False

    # match
    def match_validator(self, state: CacheState, device_only: bool
                        ) -> Callable[[Node], bool] | None:
        """A fresh predicate fed the matched nodes top-down: may the match stop here (on the
        device only: may the device part of the match stop here)?"""
        return None

    def finish_match(self, state: CacheState, outcome: MatchOutcome, walk: MatchWalk
                     ) -> MatchOutcome:
        """The match's answer with this plug-in's part filled in."""
        return outcome

    # tree structure
    def split(self, state: CacheState, upper: Node, child: Node, split_len: int) -> None:
        """``child`` was cut after ``split_len`` units; ``upper`` is its new first part."""

    def new_leaf(self, state: CacheState, leaf: Node) -> None:
        """An insert added ``leaf``."""

    # insert
    def check_insert(self, state: CacheState, plan: list[tuple[Node, int]],
                     value: tuple[int, ...], args: InsertArgs) -> InsertArgs:
        """Refuse (InvalidInput, nothing changed) an insert this plug-in cannot take; returns
        ``args`` with this plug-in's arguments normalised."""
        return args

    def insert_overlap(self, state: CacheState, node: Node, start: int, shared: int,
                       fresh: tuple[int, ...], args: InsertArgs) -> int:
        """The insert walks through ``node``'s device data; returns where in ``fresh`` this
        plug-in took the request's slots over (``shared``: it took none)."""
        return shared

    def recover_after_unevict(self, state: CacheState, node: Node, start: int,
                              args: InsertArgs) -> None:
        """The insert gave the evicted ``node`` device data back."""

    def skip_leaf(self, state: CacheState, start: int, rest_len: int, args: InsertArgs) -> bool:
        """Whether the insert must not create its new leaf (its slots are freed)."""
        return False

    def commit_insert(self, state: CacheState, node: Node, is_new_leaf: bool, start: int,
                      args: InsertArgs) -> bool:
        """After the walk, this plug-in's data on the insert's last node; returns whether the
        node already held it (Mamba's ``mamba_exist``)."""
        return False

    def on_hit(self, state: CacheState, node: Node) -> None:
        """An insert counted a hit on ``node``."""

    # locks
    def lock(self, state: CacheState, handle: LockHandle) -> None:
        """After the Full path lock of ``handle``."""

    def unlock(self, state: CacheState, handle: LockHandle) -> None:
        """After the Full path unlock of ``handle``."""

    # eviction
    def evict_device(self, state: CacheState, num_tokens: int) -> int:
        """Drive device eviction (only when ``drives_eviction``); returns the tokens freed."""
        raise NotImplementedError(f"{type(self).__name__} does not drive eviction")

    def evict_leaf(self, state: CacheState, leaf: Node, tracker: dict[str, int]) -> bool:
        """Evict one device leaf the way this tier does (only when ``drives_eviction``);
        False: the leaf was passed over and nothing changed."""
        raise NotImplementedError(f"{type(self).__name__} does not drive eviction")

    def drop_device_leaf(self, state: CacheState, leaf: Node, tracker: dict[str, int]) -> None:
        """``leaf`` leaves the device: free this plug-in's device data on it (counted in
        ``tracker``)."""

    # the host tier's transfers (spec/host.py): each plug-in builds and commits its own
    def backup(self, state: CacheState, node: Node) -> bool:
        """Back this plug-in's device data on ``node`` up to its host pool, as part of the
        node's backup; False: no host room (nothing changed, the backup fails)."""
        return True

    def drop_host(self, state: CacheState, node: Node, tracker: dict[str, int]) -> None:
        """Free this plug-in's host data on ``node`` (host eviction, a failed backup)."""

    def wants_load_back(self, state: CacheState, node: Node) -> bool:
        """Whether a load back of ``node`` has data of this plug-in to bring back."""
        return False

    def reserve_load_back(self, state: CacheState, node: Node) -> bool:
        """Before a load back of ``node`` weighs its size (the path locked): take what the
        requester needs of this plug-in's device data; False: none can be had (the load back
        fails; what was taken stays the requester's)."""
        return True

    def alloc_load_back(self, state: CacheState, node: Node) -> bool:
        """After the Full data of a load back of ``node`` took its device slots (the seed's
        controller allocates the other pools after the KV pool): take the device slots this
        plug-in's host data comes back to; False: none can be had, or the room-making took
        what was to be loaded (nothing of this plug-in's taken, the load back fails)."""
        return True

    def cancel_load_back(self, state: CacheState, node: Node) -> None:
        """A later plug-in's ``alloc_load_back`` failed: give back what this one took."""

    def commit_load_back(self, state: CacheState, node: Node) -> None:
        """The load back of ``node`` succeeded and the Full data is on the device again: give
        the loaded nodes the slots ``alloc_load_back`` took (this plug-in's copies)."""

    def host_lock(self, state: CacheState, node: Node) -> object | None:
        """After a host lock of ``node``: what this plug-in locked (handed back to
        ``host_unlock``), or None when it locked nothing."""
        return None

    def host_unlock(self, state: CacheState, node: Node, token: object) -> None:
        """Undo a ``host_lock`` that returned ``token``."""

    def after_write_ack(self, state: CacheState, ack: Ack) -> None:
        """A host write was processed."""

    def check_events(self, state: CacheState) -> None:
        """The host tier's queues were processed (``check_hicache_events``)."""

    def held_host_slots(self, state: CacheState) -> list[int]:
        """Host slots this plug-in holds outside the tree."""
        return []

    # reset
    def reset(self, state: CacheState) -> None:
        """Flush: this plug-in's state is emptied with the cache."""
