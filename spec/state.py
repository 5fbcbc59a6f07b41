"""The primary state of the cache (docs/DESIGN.md, "primary state only").

Stored: the tree (nodes with key, parent, children by child key), each node's device value,
lock count, access stamp and hit count (and, for the eviction policies, creation stamp and
priority), the logical clock, the issued lock handles, and the
environment's KV pool.  Nothing derived is stored: evictable/protected sizes, leaf sets and the
eviction order are computed from scratch by the queries in :mod:`uniradix.spec.queries`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from .config import CacheConfig
from .world import PagedPool

Stamp = tuple  # (tick, rank): compared lexicographically; see cache.stamp_match_path


@dataclasses.dataclass(eq=False)
class Node:
    """One radix-tree node: ``key`` holds the units from the parent's end to this node's end."""

    key: tuple
    extra_key: Optional[str]
    parent: Optional["Node"]
    value: Optional[tuple]  # device KV slots, one per unit; None = evicted (a tombstone)
    stamp: Stamp
    lock_ref: int = 0
    hit_count: int = 0
    children: dict = dataclasses.field(default_factory=dict)
    # Hybrid models (spec/components.py): per aux component ("swa", "mamba") its data here.
    aux: dict = dataclasses.field(default_factory=dict)
    # host tier (spec/host.py): host KV slots, one per unit (None = no host copy), host locks
    host_value: Optional[tuple] = None
    host_lock_ref: int = 0
    # eviction policies (spec/policies.py): when the node's data was created, and the highest
    # priority of an insert through it
    created: Stamp = (0, 0)
    priority: int = 0
    # storage tier (spec/storage.py): the keys of this node's pages (None without storage)
    page_keys: Optional[tuple] = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def evicted(self) -> bool:
        return not self.is_root and self.value is None

    def path_units(self) -> tuple:
        """All units from the root to this node's end."""
        parts = []
        node: Optional[Node] = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(u for part in reversed(parts) for u in part)

    def ancestors_to_root(self) -> Iterator["Node"]:
        """This node, its parent, ... up to but excluding the root."""
        node: Optional[Node] = self
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
    skipped: tuple
    # Hybrid models (spec/components.py): per aux component, what its unlock needs.
    aux: dict = dataclasses.field(default_factory=dict)

    def locked_nodes(self) -> list[Node]:
        return [n for n in self.node.ancestors_to_root() if not any(n is s for s in self.skipped)]


@dataclasses.dataclass(eq=False)
class CacheState:
    config: CacheConfig
    kv: PagedPool
    root: Node
    clock: int = 0
    handles: dict = dataclasses.field(default_factory=dict)  # serial -> LockHandle (live)
    next_serial: int = 1
    requests: dict = dataclasses.field(default_factory=dict)  # rid -> Request (the req_to_token table)
    # Hybrid models (spec/components.py): the Mamba state pool (None without Mamba) and the
    # next SWA lock-boundary mark.  With SWA, ``kv`` is a HybridKVPool (spec/world.py).
    mamba: Optional[PagedPool] = None
    next_boundary: int = 1
    host: Optional[object] = None  # spec/host.py HostTier when config.host_slots > 0, else None
    sessions: dict = dataclasses.field(default_factory=dict)  # streaming sessions: id -> SessionSlot
    storage: Optional[object] = None  # spec/storage.py StorageTier when config.storage, else None


def new_root() -> Node:
    return Node(key=(), extra_key=None, parent=None, value=(), stamp=(0, 0))


def new_state(config: CacheConfig) -> CacheState:
    """An empty cache over a fresh KV pool of ``config.kv_slots`` usable slots (hybrid models:
    the pools of spec/world.py), and a host tier over ``config.host_slots`` host slots when there
    are any."""
    if config.components != ("full",):  # hybrid models: pools of spec/world.py
        from .world import hybrid_pools
        kv, mamba = hybrid_pools(config)
        state = CacheState(config=config, kv=kv, root=new_root(), mamba=mamba)
    else:
        state = CacheState(config=config, kv=PagedPool(config.kv_slots, config.page_size, "kv"),
                           root=new_root())
    if config.has_host_tier:
        from .host import attach_host_tier
        attach_host_tier(state)
    if config.storage:
        from .storage import attach_storage_tier
        attach_storage_tier(state)
    return state


def all_nodes(state: CacheState) -> list[Node]:
    """Every node, root first, in depth-first order."""
    out, stack = [], [state.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
