"""Component plug-ins of the composed cache (fast/hybrid.py): SWA (``swa.py``) and Mamba
(``mamba.py``), each with the hooks of the seed's vocabulary (match validator, split, insert
overlap, commit insert, locks, eviction priority and drive, build / commit host transfers).

The tree (fast/hybrid.py) owns the Full component; each aux component owns its data on every
node (an :class:`AuxData` record, at the component's position in ``node.aux``), its LRU list
of the records holding data, its evictable / protected counters, and its checks.  Adding a
component is adding a plug-in here: the tree calls the hooks in component order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..frees import FreeBatch
from ..structures import LruList

SWA_ID, MAMBA_ID = 1, 2  # component ids in skip_lock_node_ids (upstream's ComponentType)


class AuxData:
    """One aux component's data on one node: ``value`` (SWA slots, or the Mamba state as a
    one-slot tensor; None on a tombstone), its lock count, the SWA lock-boundary mark, the
    links of the component's LRU list (the list holds exactly the records with a value), and
    with a host tier the host copy ``host_value``, its lock count ``host_lock`` and the SWA
    host-lock boundary mark ``host_boundary``."""

    __slots__ = ("node", "value", "lock", "boundary", "lru_prev", "lru_next", "host_value",
                 "host_lock", "host_boundary", "former_parent", "split_from")

    def __init__(self, node: Any) -> None:
        self.node = node
        self.value: torch.Tensor | None = None
        self.lock = 0
        self.boundary: int | None = None
        self.lru_prev: Any = None
        self.lru_next: Any = None
        self.host_value: torch.Tensor | None = None
        self.host_lock = 0
        self.host_boundary: int | None = None
        self.former_parent: Any = None  # the parent when the node left the tree (lock walks)
        # SWA: (split epoch, id) of the node each split cut this one off, newest first
        self.split_from: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        return f"AuxData(node={self.node!r})"


Validator = Callable[[Any, int], bool]


class AuxComponent:
    """The hooks one aux component gives the tree; ``i`` is its position in ``node.aux``."""

    name = ""
    component_id = 0
    internal_priority = 0  # eviction priority on an internal node (Full's is 2; a leaf: all 0)

    def __init__(self, cache: Any, i: int) -> None:
        self.cache = cache
        self.i = i
        self.reset()

    # -- sizes -----------------------------------------------------------------------------
    def units(self, node: Any) -> int:
        """Units of this component's data on ``node`` (which has some)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every record (the cache's ``reset``)."""
        self.lru = LruList()  # the records holding data, newest first
        self.evictable = 0
        self.protected = 0
        # with a host tier: the records whose data is on the host only and not host-locked,
        # oldest first, in the order they joined (an insertion-ordered dict: O(1) moves)
        self.host_lru: dict[AuxData, None] = {}

    # -- data ------------------------------------------------------------------------------
    def set(self, node: Any, value: torch.Tensor) -> None:
        """``node`` takes data (it had none): front of the list, counted by its lock."""
        rec = node.aux[self.i]
        rec.value = value
        self.lru.push_front(rec)
        if rec.host_value is not None:  # on the device again: off the host list
            self.host_lru.pop(rec, None)
        if rec.lock:
            self.protected += self.units(node)
        else:
            self.evictable += self.units(node)
        if self.tracks_slots:
            self.on_set(value)

    tracks_slots = False  # True: ``on_set`` keeps a slot ledger (Mamba with validate_slots)

    def on_set(self, value: torch.Tensor) -> None:
        """Slot bookkeeping when data enters the tree (Mamba: the owned-state set)."""

    def drop(self, node: Any, tracker: list, batch: FreeBatch, leaf: bool) -> None:
        """Evict this component's data from ``node`` (unlocked): counted in ``tracker``, off
        the list, its slots queued on ``batch`` (``leaf``: the node leaves the tree with its
        Full slots)."""
        rec = node.aux[self.i]
        k = self.units(node)
        tracker[self.i + 1] += k
        self.evictable -= k
        self.lru.remove(rec)
        self.queue_free(node, rec.value, batch, leaf)
        rec.value = None
        if rec.host_value is not None and rec.host_lock == 0:  # host-only now: the newest
            self.host_lru[rec] = None

    def queue_free(self, node: Any, value: torch.Tensor, batch: FreeBatch, leaf: bool) -> None:
        raise NotImplementedError

    # -- match -----------------------------------------------------------------------------
    def validator(self) -> Validator:
        """A fresh match validator: called for each node of the walk in order with the units
        walked into it; True where a match may end there for this component."""
        raise NotImplementedError

    def host_validator(self) -> Validator:
        """The validator with a host tier: True where a match may end when host data counts
        (a load back brings it back); default the device one."""
        return self.validator()

    def path_to_front(self, node: Any) -> None:
        """The matched node and its ancestors holding data to the front of the list, node
        first."""
        lru = self.lru
        prev = lru.head
        root = self.cache.root_node
        i = self.i
        while node is not root:
            rec = node.aux[i]
            if rec.value is not None:
                lru.move_after(prev, rec)
                prev = rec
            node = node.parent

    def touch(self, node: Any) -> None:
        """A node on an insert's walk: front of the list where it holds data."""
        rec = node.aux[self.i]
        if rec.value is not None:
            self.lru.move_to_front(rec)

    # -- split -----------------------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """``upper`` (new) took ``child``'s first ``k`` units."""
        raise NotImplementedError

    # -- insert ----------------------------------------------------------------------------
    def check_insert(self, plan: list, prev: int, params: Any, e: int) -> Any:
        """The component's checks of an insert before anything changes; returns what
        ``commit`` needs."""
        return None

    def skips_leaf(self, pos: int, n: int, e: int) -> bool:
        """True when no leaf may be made for ``units[pos:n]``."""
        return False

    def commit(self, target: Any, is_new: bool, pos: int, prepared: Any, e: int,
               result: dict) -> None:
        """Attach the component's data to the insert's last node ``target``."""

    # -- requests --------------------------------------------------------------------------
    def prepare_caching_req(self, req: Any, params: Any, finished: bool) -> None:
        """Fill this component's insert data in ``params`` from the request (the request
        path, fast/compat.py, before its insert)."""

    def cleanup_caching_req(self, req: Any, finished: bool, result: Any, params: Any) -> None:
        """Release what the request no longer needs (after the request path's insert;
        ``result`` None: no insert happened)."""

    # -- locks -----------------------------------------------------------------------------
    def lock(self, node: Any, result: Any) -> None:
        raise NotImplementedError

    def unlock(self, node: Any, params: Any, unlocked: list) -> None:
        """Undo ``lock``; nodes whose lock count reached 0 go on ``unlocked``."""
        raise NotImplementedError

    def _lock_rec(self, node: Any, rec: AuxData, k: int) -> None:
        if rec.lock == 0:
            self.evictable -= k
            self.protected += k
        rec.lock += 1
        node.aux_lock += 1

    def _unlock_rec(self, node: Any, rec: AuxData, k: int, unlocked: list) -> None:
        if rec.lock == 1:
            self.evictable += k
            self.protected -= k
            unlocked.append(node)
        rec.lock -= 1
        node.aux_lock -= 1

    # -- the host tier (fast/tiers/host.py): build / commit host transfers -------------------
    def attach_host(self, tier: Any, config: Any) -> None:
        """A host tier is composed with the cache (``config``: its ``HiCacheConfig``)."""

    def backup(self, node: Any) -> bool:
        """``node`` is being backed up (its Full host slots are taken): build this
        component's host copy of its data there, if it has any.  False: no host room, the
        backup fails (the tier undoes what the components before did, ``drop_host``)."""
        return True

    def drop_host(self, node: Any) -> int:
        """``node``'s host copy goes (host eviction, or a failed backup): free this
        component's host data there; returns its units freed."""
        return 0

    def evict_host_oldest(self, num: int) -> int:
        """Free at least ``num`` of this component's host units, the host list oldest first
        (``_evict_host_rec`` frees one record's, ``_host_rec_live`` says which records it
        takes); returns the units freed.  The records a walk over a copy of the whole list
        would take, in its order, but taken one at a time from the list's front: each record
        taken leaves the list and taking one adds none, so the cost is O(records taken), not
        O(host-only records) per call.  Where a taken record stays listed, or the front
        record is not live (neither happens, by the list's invariant), the walk over a copy
        takes over from there."""
        lru = self.host_lru
        freed = 0
        while freed < num and lru:
            rec = next(iter(lru))
            if not self._host_rec_live(rec):
                break
            freed += self._evict_host_rec(rec)
            if rec in lru:
                return freed + self._evict_host_walk(num - freed, rec)
        if freed < num and lru:
            freed += self._evict_host_walk(num - freed, None)
        return freed

    def _evict_host_walk(self, num: int, after: Any) -> int:
        """``evict_host_oldest`` over a copy of the host list (from after ``after``)."""
        recs = list(self.host_lru)
        if after is not None:
            recs = recs[recs.index(after) + 1:]
        freed = 0
        for rec in recs:
            if freed >= num:
                break
            if self._host_rec_live(rec):
                freed += self._evict_host_rec(rec)
        return freed

    def _host_rec_live(self, rec: AuxData) -> bool:
        """Whether ``evict_host_oldest`` takes a listed record: its node is in the tree and
        the record holds host data."""
        return rec.node.parent is not None and rec.host_value is not None

    def _evict_host_rec(self, rec: AuxData) -> int:
        """Free one listed record's host data (``evict_host_oldest``); returns units freed."""
        raise NotImplementedError

    def wants_load_back(self, node: Any) -> bool:
        """A load back of ``node`` must bring this component's data back too."""
        return False

    def reserve_load_back(self, node: Any) -> bool:
        """What the requester takes before the load back weighs its size (False: it fails)."""
        return True

    def alloc_load_back(self, node: Any) -> bool:
        """After the Full data of a load back of ``node`` took its device slots: take the
        device slots this component's host data comes back to (False: none can be had, or the
        room-making took what was to be loaded; nothing of this component's taken, it fails)."""
        return True

    def cancel_load_back(self, node: Any) -> None:
        """A later component's ``alloc_load_back`` failed: give back what this one took."""

    def commit_load_back(self, node: Any) -> None:
        """The load back of ``node`` succeeded and the Full data is on the device again: give
        the node the slots ``alloc_load_back`` took (this component's copies)."""

    def host_lock(self, node: Any) -> Any:
        """``inc_host_lock_ref(node)``: protect this component's host data there; returns what
        it locked, for ``host_unlock`` (None: nothing)."""
        return None

    def host_unlock(self, node: Any, token: Any) -> None:
        """Undo ``host_lock`` (``token``: what it returned; None from a caller that kept no
        lock result: undo one lock of the component's host data at ``node``)."""

    # -- eviction --------------------------------------------------------------------------
    def drive(self, want: int, tracker: list, batch: FreeBatch) -> None:
        """Evict from the list's oldest end, skipping records this component has locked, until
        ``want`` units of it are freed: an evictable device leaf leaves the tree with all its
        data; any other node loses this component's data and, by priority, that of the
        components below it (``cache._cascade``)."""
        cache = self.cache
        i = self.i
        head = self.lru.head
        x = self.lru.tail.lru_prev
        while tracker[i + 1] < want and x is not head:
            nxt = x.lru_prev  # NOTE: evicting x never unlinks another record of this list
            if x.lock == 0:
                node = x.node
                # (``cache._is_leaf(node)``, written out)
                if node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0 \
                        and node.value is not None and node.parent is not None:
                    cache._evict_leaf(node, tracker, batch)
                else:
                    self.drop(node, tracker, batch, False)
                    cache._cascade(node, self, tracker, batch)
            x = nxt

    # -- checks ----------------------------------------------------------------------------
    def violations(self, node: Any, errors: list, acc: dict) -> None:
        """Check this component's record on ``node`` (attached, holds Full data); ``acc``
        collects the recounts (``ev``, ``pr``, ``members``, ``values``)."""
        rec = node.aux[self.i]
        if rec.node is not node:
            errors.append(f"[aux] {node!r}: {self.name} record belongs to another node")
        if rec.lock < 0:
            errors.append(f"[lock] {node!r}: {self.name} lock count < 0")
        if rec.lock > node.lock_ref:
            errors.append(f"[lock] {node!r}: {self.name} lock exceeds the Full lock")
        if rec.value is None:
            if rec.lock:
                errors.append(f"[aux] {node!r}: a {self.name} tombstone is locked")
            return
        acc["members"].add(id(rec))
        acc["values"].append(rec.value)
        acc["pr" if rec.lock else "ev"] += len(rec.value)
        self.value_violations(node, rec.value, errors)

    def host_violations(self, node: Any, errors: list, acc: dict) -> None:
        """With a host tier, this component's record on any node (evicted ones too): host data
        needs the node's Full host copy, host locks sit on host data, an evicted node holds no
        device data of it, and the host list holds exactly the host-only unlocked records."""
        rec = node.aux[self.i]
        if rec.value is not None and node.value is None:
            errors.append(f"[aux] {node!r}: {self.name} device data on an evicted node")
        if rec.host_lock < 0 or (rec.host_lock > 0 and rec.host_value is None):
            errors.append(f"[aux-host] {node!r}: {self.name} host_lock={rec.host_lock} without "
                          "host data")
        if rec.host_value is None:
            return
        if node.host_value is None:
            errors.append(f"[aux-host] {node!r}: {self.name} host data without a Full host copy")
        acc["host_values"].append(rec.host_value)
        if rec.value is None and rec.host_lock == 0:
            acc["host_members"].add(id(rec))

    def host_tree_violations(self, acc: dict, errors: list) -> None:
        if {id(r) for r in self.host_lru} != acc["host_members"]:
            errors.append(f"[aux-host] the {self.name} host list differs from its host-only "
                          "records")
        held = [s for v in acc["host_values"] for s in v.tolist()]
        if len(set(held)) != len(held):
            errors.append(f"[aux-host] a {self.name} host slot is held twice in the tree")

    def value_violations(self, node: Any, value: torch.Tensor, errors: list) -> None:
        """The component's own checks of a value it holds."""

    def tree_violations(self, acc: dict, errors: list) -> None:
        if (acc["ev"], acc["pr"]) != (self.evictable, self.protected):
            errors.append(f"[size] {self.name} counters {self.evictable}/{self.protected}, "
                          f"recomputed {acc['ev']}/{acc['pr']}")
        errors.extend(self.lru.violations(acc["members"]))
