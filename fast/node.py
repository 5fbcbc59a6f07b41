"""The node of every pure-Python path of ``uniradix.fast`` (the device-only Full cache without
the C core, the host tier, the hybrid caches): one class, with a slot for each plug-in's data.

The tree's own fields: ``children`` (child key -> node), ``parent`` (None once detached),
``key`` (``array('q')`` of units; EAGLE: a list of pairs), ``ck`` (the key this node is filed
under in its parent), ``extra_key``, ``last_access_time`` (stamp), ``hit_count``, ``id``.
The eviction policies' (fast/policies.py): ``created`` (the stamp the node's data was first
inserted at; a split's upper node takes the child's) and ``priority`` (the highest insert
priority through it).
The Full component's: ``value`` (device slots, an int64 tensor; None when evicted),
``lock_ref``, ``dev_children`` (children holding device data, so the leaf test is O(1)).
The host tier's (fast/tiers/host.py): ``host_value`` (host slots; None when not backed up),
``host_lock_ref``.  The aux components' (fast/components/): ``aux``, one ``AuxData`` record per
component (empty without any), and ``aux_lock``, the sum of their lock counts.  KV events
(fast/events.py): ``pk``, the node's page digests, set only once computed (unset otherwise).

The C core (fast/_core.c) has its own node type with the tree's and the Full component's
fields, the same ordering and repr; it serves the device-only Full cache only.
"""

from __future__ import annotations

import itertools
from typing import Any

_ids = itertools.count(1)


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
                 "hit_count", "extra_key", "dev_children", "id", "ck",
                 "host_value", "host_lock_ref", "aux", "aux_lock", "created", "priority",
                 "pk",  # the KV events' page keys (fast/events.py)
                 "page_keys")  # the storage tier's (fast/tiers/storage.py): unset until asked
    # (get_last_hash_value below reads them; the root's is the tier's RootKeys marker)
    page_keys: tuple[str, ...]

    def __init__(self, key: Any, value: Any, parent: Node | None, extra_key: Any,
                 stamp: int, ck: Any = None) -> None:
        self.ck = ck
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = stamp
        self.hit_count = 0
        self.extra_key = extra_key
        self.dev_children = 0
        self.id = next(_ids)
        self.host_value: Any = None
        self.host_lock_ref = 0
        self.aux: tuple = ()
        self.aux_lock = 0
        self.created = stamp
        self.priority = 0

    def __lt__(self, other: Node) -> bool:  # heap ties: the same stamp pushed twice
        return self.id < other.id

    @property
    def evicted(self) -> bool:
        return self.parent is not None and self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def get_last_hash_value(self) -> str | None:
        """The storage key of this node's last page, which SGLang's scheduler hands to
        ``prefetch_from_storage`` as ``last_hash``: the last of the storage tier's page keys
        (fast/tiers/storage.py; computed on first use from the node's path).  None for the root
        (it has no pages), a node out of the tree, and any node of a cache without a storage
        tier: upstream's nodes carry no hash values then either.  The storage tier marks its
        tree's root (``page_keys`` an empty ``RootKeys`` naming the tier), so nodes need no
        slot of their own for it.  Cost: O(1) once computed, else O(path length)."""
        keys = getattr(self, "page_keys", None)
        if keys is None:
            root = self
            while root.parent is not None:
                root = root.parent
            tier = getattr(getattr(root, "page_keys", None), "tier", None)
            if tier is None or root is not tier.cache.root_node:
                return None
            keys = tier.keys_of(self)
        return keys[-1] if keys else None

    def __repr__(self) -> str:
        extra = ""
        if self.host_value is not None or self.value is None:
            extra += f", device={self.value is not None}, host={self.host_value is not None}"
        if self.aux:
            aux = ",".join("-" if r.value is None else str(len(r.value)) for r in self.aux)
            extra += f", aux={aux}, aux_lock={self.aux_lock}"
        return f"TreeNode(id={self.id}, key_len={len(self.key)}, lock_ref={self.lock_ref}{extra})"
