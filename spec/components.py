"""Hybrid models: the SWA and Mamba components (the seed's ``SWAComponent`` / ``MambaComponent``).

A hybrid model keeps, besides the Full KV (the tree's ``value``), the data of one *aux*
component on some nodes:

* **SWA** (sliding-window attention layers): per token an SWA slot, found through the KV pool's
  map full slot -> SWA slot (:class:`~uniradix.spec.world.HybridKVPool`).  A node can drop its
  SWA data and keep its Full data: it is then an SWA *tombstone*.  A match only needs the last
  ``sliding_window`` tokens of SWA data, so a lock protects one window above the locked node.
* **Mamba** (state-space layers): one state slot per node, meaningful only where a sequence
  ends; a match may only stop at a node that holds a state.  A lock protects that node only.

The data of one component on one node is an :class:`AuxData` in ``node.aux[name]``.  Read in
this order: data and pools, the two plug-ins (:class:`SWAComponent`, :class:`MambaComponent`:
their hooks of spec/core.py ``Plugin`` in rule order: match validators, split, insert hooks,
locks, freeing their data), eviction (priorities, cascade, per-component LRU), queries and
invariants.

Each component's LRU order is *not* stored: the seed moves a node to the front of its aux LRU
list exactly when it stamps the node (touch on the insert walk, the matched path, a split, a
new leaf, a Mamba state committed), and a node joins a list only at a moment its stamp is the
newest among the list's members.  So the LRU order of a component is the order of the access
stamps among the nodes holding its data (:func:`lru_order`); fast keeps real lists, and the
lockstep run compares them with this query.  One exception, with SWA and Mamba in one tree: a
state committed to an existing node moves it in the Mamba list only (:func:`refresh_mamba_only`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from . import cache as rules
from . import host
from .config import CacheConfig
from .core import CacheState, InsertArgs, LockHandle, MatchOutcome, MatchWalk, Node, Plugin, all_nodes, up
from .errors import InvalidInput
from .queries import is_device_leaf
from .world import HybridKVPool, PagedPool

AUX = ("swa", "mamba")


@dataclasses.dataclass(eq=False)
class AuxData:
    """One aux component's data on one node."""

    value: tuple[int, ...] | None = None  # SWA: an SWA slot per unit; Mamba: (state slot,)
    lock_ref: int = 0
    boundary: int | None = None  # SWA: the mark of the node where a window lock stopped
    # host tier (spec/host.py): the host copy (Mamba: (host state slot,)), host locks, and
    # when the data joined the component's host LRU list (it is there while host-only and
    # not host-locked; the list keeps the order the data joined in)
    host_value: tuple[int, ...] | None = None
    host_lock_ref: int = 0
    host_joined: int = 0
    host_boundary: int | None = None  # SWA: as ``boundary``, for a window host lock
    # Full + SWA + Mamba: (the stamp the node's place in this list dates from, the node stamp
    # it holds for); see refresh_mamba_only.  Outdated as soon as the node is stamped again.
    lru_pin: tuple[tuple[int, int], tuple[int, int]] | None = None


def aux_names(state: CacheState) -> tuple[str, ...]:
    return tuple(c.name for c in aux_components(state))


def aux_components(state: CacheState) -> list[AuxComponent]:
    """The configured aux components' plug-ins, in the config's order."""
    return [p for p in state.plugins if isinstance(p, AuxComponent)]


def data(node: Node, name: str) -> AuxData:
    """The component's data on ``node`` (created empty on first use)."""
    d = node.aux.get(name)
    if d is None:
        d = node.aux[name] = AuxData()
    return d


def has(node: Node, name: str) -> bool:
    d = node.aux.get(name)
    return d is not None and d.value is not None


def any_aux_lock(node: Node) -> bool:
    return any(d.lock_ref > 0 for d in node.aux.values())


def window(state: CacheState) -> int:
    assert state.config.sliding_window is not None  # CacheConfig.validate: SWA needs one
    return state.config.sliding_window


@dataclasses.dataclass(eq=False)
class SWAHostLock:
    """What an SWA host lock locked, for its unlock: as a window lock on the device, one
    window of host copies above the node, skipping the nodes without one, and the mark of the
    node where the window filled up (None: it never did)."""

    skipped: list[Node]
    boundary: int | None


# ----------------------------------------------------------------------------------------------
# The plug-ins
# ----------------------------------------------------------------------------------------------


class AuxComponent(Plugin):
    """What the SWA and Mamba plug-ins share: a name (their key in ``node.aux``), an eviction
    priority, how their device data on a node is freed and checked."""

    name: str = ""
    #: eviction priority on a leaf / on an internal node: higher is evicted later, and evicting
    #: a component on a node also evicts every component of lower or equal priority there
    #: (cascade; Full has (0, 2) and is only ever evicted with its leaf)
    priority: tuple[int, int] = (0, 0)

    def free_data(self, state: CacheState, node: Node, d: AuxData) -> None:
        """Give the component's device data on ``node`` back to its pool."""
        raise NotImplementedError

    def data_errors(self, state: CacheState, node: Node, d: AuxData, held: dict[int, Node]
                    ) -> list[str]:
        """The component's invariants on its data ``d`` on ``node`` (which has Full data)."""
        return []

    def drop_device_leaf(self, state: CacheState, leaf: Node, tracker: dict[str, int]) -> None:
        drop_aux(state, leaf, self, tracker)


class SWAComponent(AuxComponent):
    name = "swa"
    priority = (0, 1)
    insert_args = frozenset({"swa_evicted_seqlen"})

    def match_validator(self, state: CacheState, device_only: bool) -> Callable[[Node], bool]:
        """One window of SWA data above the node (with a host tier and not ``device_only``:
        on the device or on the host; a load back brings the host part back)."""
        return swa_validator(window(state), host=not device_only and state.host is not None)

    def finish_match(self, state: CacheState, outcome: MatchOutcome, walk: MatchWalk
                     ) -> MatchOutcome:
        """With a host tier: the SWA units of the best node's window that are on the host
        only (what a load back of it brings back)."""
        if state.host is None:
            return outcome
        hit = sum(len(data(n, "swa").host_value or ())
                  for n in swa_load_window(state, outcome.best_match_node))
        return dataclasses.replace(outcome, swa_host_hit_length=hit)

    def split(self, state: CacheState, upper: Node, child: Node, split_len: int) -> None:
        """The values and host copies are cut at the same point, the upper part inherits the
        lock counts and takes the lock-boundary marks (a window lock that stopped at the child
        stops at its top part now; a window lock or host lock that skipped the child skips its
        top part too: the top part may get SWA data back later, which that lock never took).
        An upper part whose SWA data is on the host only joins the SWA host LRU list as its
        newest; the child keeps its place there."""
        if not child.aux:
            return
        c, u = data(child, "swa"), data(upper, "swa")
        u.lock_ref, u.host_lock_ref = c.lock_ref, c.host_lock_ref
        if c.value is not None:
            u.value, c.value = c.value[:split_len], c.value[split_len:]
        u.boundary, c.boundary = c.boundary, None
        u.host_boundary, c.host_boundary = c.host_boundary, None
        if c.host_value is not None:
            u.host_value, c.host_value = c.host_value[:split_len], c.host_value[split_len:]
            if u.value is None and u.host_lock_ref == 0:
                join_host_lru(state, u)
        for lock in state.handles.values():  # a window lock that skipped the child skips both
            if "swa" in lock.aux and any(n is child for n in lock.aux["swa"][0]):
                skipped, boundary = lock.aux["swa"]
                lock.aux["swa"] = (skipped + (upper,), boundary)
        if state.host is not None:
            for handle in state.host.host_locks.values():
                for _, token in handle.aux:
                    if isinstance(token, SWAHostLock) and any(n is child for n in token.skipped):
                        token.skipped.append(upper)

    def check_insert(self, state: CacheState, plan: list[tuple[Node, int]],
                     value: tuple[int, ...], args: InsertArgs) -> InsertArgs:
        """An insert may not restore an SWA tombstone that ``prev_prefix_len`` cuts (its own
        slots would be freed)."""
        start = 0
        for node, shared in plan:
            inside = start < args.prev_prefix_len < start + shared
            if inside and node.value is not None and not has(node, "swa") \
                    and args.swa_evicted_seqlen < start + shared:
                raise InvalidInput("insert: prev_prefix_len falls inside an SWA tombstone that "
                                   "this insert would restore (its own slots would be freed)")
            start += shared
        return args

    def insert_overlap(self, state: CacheState, node: Node, start: int, shared: int,
                       fresh: tuple[int, ...], args: InsertArgs) -> int:
        """SWA overlap ownership: an SWA tombstone whose units the request computed itself
        (past ``prev_prefix_len``) and that lie inside the request's window (from
        ``swa_evicted_seqlen`` on) takes the request's slots: its old full slots are freed and
        the fresh ones, with their SWA slots, become its data.  When the window starts inside
        the node, the node is split there first and only the part inside takes them.

        Except where a lock holds the tombstone (:func:`swa_tombstone_held`): another
        request's matched prefix runs through it and reads its full slots, so they are never
        freed; the tombstone keeps them and stays a tombstone, and the request's slots are
        duplicates, freed as in Full.  (The seed frees them: issue 18; docs/SPEC.md.)"""
        if args.prev_prefix_len >= start + shared or has(node, "swa") \
                or swa_tombstone_held(node):
            return shared
        assert node.value is not None
        if args.swa_evicted_seqlen <= start:
            state.kv.free(list(node.value))
            restore_swa(state, node, fresh)
            return 0
        if args.swa_evicted_seqlen < start + shared:
            cut = args.swa_evicted_seqlen - start
            state.kv.free(list(node.value[cut:]))
            rules.split_node(state, node, cut)
            restore_swa(state, node, fresh[cut:])
            return cut
        return shared

    def recover_after_unevict(self, state: CacheState, node: Node, start: int,
                              args: InsertArgs) -> None:
        """An evicted node an insert gave device data back gets its SWA data back from the
        fresh slots too, for the part inside the request's window."""
        if has(node, "swa"):
            return
        assert node.value is not None
        if args.swa_evicted_seqlen <= start:
            restore_swa(state, node, node.value)
        elif args.swa_evicted_seqlen < start + len(node.key):
            rules.split_node(state, node, args.swa_evicted_seqlen - start)
            restore_swa(state, node, node.value)

    def skip_leaf(self, state: CacheState, start: int, rest_len: int, args: InsertArgs) -> bool:
        """A new leaf wholly outside the request's window would be born a tombstone; the
        insert does not create it (and frees its slots)."""
        return args.swa_evicted_seqlen >= start + rest_len

    def commit_insert(self, state: CacheState, node: Node, is_new_leaf: bool, start: int,
                      args: InsertArgs) -> bool:
        """New leaves only: the part inside the window (from ``swa_evicted_seqlen`` on; the
        leaf is split there when the window starts inside it) takes the mapped SWA slots."""
        if not is_new_leaf:
            return False
        cut = args.swa_evicted_seqlen - start
        if cut < len(node.key):
            if cut > 0:
                rules.split_node(state, node, cut)
            assert node.value is not None  # a new leaf holds the insert's full slots
            data(node, "swa").value = swa_pool(state).translate(node.value)
        return False

    def lock(self, state: CacheState, handle: LockHandle) -> None:
        """Lock one window of SWA data above the node (skipping tombstones) and mark the node
        where the window filled up."""
        handle.aux["swa"] = lock_swa_window(state, handle.node)

    def unlock(self, state: CacheState, handle: LockHandle) -> None:
        if "swa" in handle.aux:
            unlock_swa_window(handle.node, *handle.aux["swa"])

    def free_data(self, state: CacheState, node: Node, d: AuxData) -> None:
        assert node.value is not None
        swa_pool(state).free_swa(list(node.value))

    # the host tier (spec/host.py)
    def backup(self, state: CacheState, node: Node) -> bool:
        """A node's backup copies its SWA data too, to fresh SWA host slots (when the SWA host
        pool is short, SWA host data is evicted for room: as many units as the backup needs);
        without room the backup fails.  An SWA tombstone backs up its Full data only."""
        d = node.aux.get("swa")
        if d is None or d.value is None or d.host_value is not None:
            return True
        pool, n = host_swa_pool(state), len(d.value)
        if pool.available_size() < n:
            evict_swa_host(state, n)
        if pool.available_size() < n:
            return False
        d.host_value = tuple(pool.alloc(n))
        assert state.host is not None
        state.host.swa_copies.append(("backup", list(d.value), list(d.host_value)))
        return True

    def drop_host(self, state: CacheState, node: Node, tracker: dict[str, int]) -> None:
        d = node.aux.get("swa")
        if d is None or d.host_value is None:
            return
        assert d.host_lock_ref == 0
        host_swa_pool(state).free(list(d.host_value))
        tracker["swa"] = tracker.get("swa", 0) + len(d.host_value)
        d.host_value = None

    def wants_load_back(self, state: CacheState, node: Node) -> bool:
        """Some SWA data of the node's window is on the host only."""
        return bool(swa_load_window(state, node))

    def reserve_load_back(self, state: CacheState, node: Node) -> bool:
        """The window's host-only SWA data is what this load back brings back: noted before
        the room-making, which may change it."""
        assert state.host is not None
        state.host.swa_load = (swa_load_window(state, node), [])
        return True

    def alloc_load_back(self, state: CacheState, node: Node) -> bool:
        """Fresh SWA slots for the window's host-only SWA data (when the SWA pool is short, SWA
        data is evicted for room: as many units as the load needs).  The load back fails when
        none can be had, or when the room-making took the node or changed what is to be loaded
        (write-back backups make host room): upstream loads the host slots it noted before,
        whoever holds them now (docs/SPEC.md)."""
        assert state.host is not None and state.host.swa_load is not None
        planned = state.host.swa_load[0]
        n = sum(len(data(x, "swa").host_value or ()) for x in planned)
        pool = swa_pool(state).swa
        if pool.available_size() < n:
            evict(state, 0, swa_num_tokens=n)
        if pool.available_size() < n or not self._still_planned(state, node, planned):
            state.host.swa_load = None
            return False
        state.host.swa_load = (planned, pool.alloc(n))
        return True

    def cancel_load_back(self, state: CacheState, node: Node) -> None:
        assert state.host is not None and state.host.swa_load is not None
        swa_pool(state).swa.free(state.host.swa_load[1])
        state.host.swa_load = None

    def _still_planned(self, state: CacheState, node: Node, planned: list[Node]) -> bool:
        if not rules.is_in_tree(state, node):
            return False
        now = swa_load_window(state, node)
        return len(now) == len(planned) and all(a is b for a, b in zip(now, planned, strict=True))

    def commit_load_back(self, state: CacheState, node: Node) -> None:
        """Each loaded node takes its share of the fresh SWA slots, mapped from its full slots,
        top-down; each joins the SWA LRU list as its newest (without a new access stamp: the
        Full eviction order does not change)."""
        assert state.host is not None and state.host.swa_load is not None
        planned, slots = state.host.swa_load
        state.host.swa_load = None
        kv, start = swa_pool(state), 0
        for x in planned:
            d = data(x, "swa")
            assert d.host_value is not None and x.value is not None
            chunk = slots[start: start + len(d.host_value)]
            start += len(chunk)
            kv.full_to_swa.update(zip(x.value, chunk, strict=True))
            d.value = tuple(chunk)
            d.lru_pin = ((rules.tick(state), 0), x.stamp)
            state.host.swa_copies.append(("load", list(d.host_value), list(chunk)))

    def host_lock(self, state: CacheState, node: Node) -> SWAHostLock | None:
        """Lock one window of SWA host copies above the node (skipping nodes without one), as
        a device lock does with the device data; host-locked data leaves the SWA host LRU
        list."""
        return None if node.is_root else lock_swa_host_window(state, node)

    def host_unlock(self, state: CacheState, node: Node, token: object) -> None:
        assert isinstance(token, SWAHostLock)
        unlock_swa_host_window(state, node, token)

    def data_errors(self, state: CacheState, node: Node, d: AuxData, held: dict[int, Node]
                    ) -> list[str]:
        """SWA data is the mapped SWA slots of the Full data, allocated."""
        assert d.value is not None and node.value is not None
        if d.value != swa_pool(state).translate(node.value) or 0 in d.value:
            return [f"[aux] {node!r} SWA slots are not the mapped ones"]
        if any(not swa_pool(state).swa.is_allocated(s) for s in d.value):
            return [f"[aux] {node!r} holds SWA slots the pool says are free"]
        return []


class MambaComponent(AuxComponent):
    name = "mamba"
    priority = (0, 0)
    insert_args = frozenset({"mamba_value"})

    def match_validator(self, state: CacheState, device_only: bool) -> Callable[[Node], bool]:
        """The node holds a state (with a host tier and not ``device_only``: on the device or
        on the host; a load back brings it back)."""
        return mamba_validator if device_only else mamba_host_validator

    def finish_match(self, state: CacheState, outcome: MatchOutcome, walk: MatchWalk
                     ) -> MatchOutcome:
        """The branching point (none with a host tier, as the seed); with a host tier, a
        best node whose state is on the host only counts one state of host hit (a load back
        brings it back)."""
        if state.host is not None:
            d = outcome.best_match_node.aux.get("mamba")
            hit = 1 if d is not None and d.value is None and d.host_value is not None else 0
            return dataclasses.replace(outcome, mamba_host_hit_length=hit)
        branching = branching_seqlen(state, walk.walked_len, walk.best_chunks,
                                     walk.walked_chunks)
        return dataclasses.replace(outcome, mamba_branching_seqlen=branching)

    def split(self, state: CacheState, upper: Node, child: Node, split_len: int) -> None:
        """The state (and its host copy) stays on the child; the upper part has none and no
        lock."""
        if not child.aux:
            return
        data(child, "mamba")
        u = data(upper, "mamba")
        u.value, u.lock_ref = None, 0

    def check_insert(self, state: CacheState, plan: list[tuple[Node, int]],
                     value: tuple[int, ...], args: InsertArgs) -> InsertArgs:
        """The insert must carry one allocated state slot the tree does not hold."""
        if args.mamba_value is None:
            raise InvalidInput("insert: the Mamba component needs a mamba_value")
        mv = tuple(rules.check_int_list("mamba_value", args.mamba_value))
        if len(mv) != 1:
            raise InvalidInput(f"insert: mamba_value must be one slot, got {list(mv)}")
        assert state.mamba is not None
        if not state.mamba.is_allocated(mv[0]):
            raise InvalidInput(f"insert: mamba slot {mv[0]} is not allocated")
        if any(has(n, "mamba") and n.aux["mamba"].value == mv for n in all_nodes(state)):
            raise InvalidInput(f"insert: mamba slot {mv[0]} is already the tree's")
        return dataclasses.replace(args, mamba_value=mv)

    def commit_insert(self, state: CacheState, node: Node, is_new_leaf: bool, start: int,
                      args: InsertArgs) -> bool:
        """A new leaf, or a node without a state, takes ``mamba_value`` and becomes the most
        recent; a node that has a state keeps it, becomes the most recent, and the insert
        answers ``mamba_exist`` (the caller keeps its slot)."""
        d = data(node, "mamba")
        assert args.mamba_value is None or isinstance(args.mamba_value, tuple)
        if is_new_leaf:
            d.value = args.mamba_value
        elif d.value is None:
            d.value = args.mamba_value
            refresh_mamba_only(state, node)
        else:
            refresh_mamba_only(state, node)
            return True
        return False

    def lock(self, state: CacheState, handle: LockHandle) -> None:
        """Lock the node itself."""
        handle.aux["mamba"] = lock_mamba_node(handle.node)

    def unlock(self, state: CacheState, handle: LockHandle) -> None:
        if handle.aux.get("mamba"):
            d = data(handle.node, "mamba")
            if d.lock_ref > 0:
                d.lock_ref -= 1

    def free_data(self, state: CacheState, node: Node, d: AuxData) -> None:
        assert state.mamba is not None and d.value is not None
        state.mamba.free(list(d.value))

    # the host tier (spec/host.py)
    def backup(self, state: CacheState, node: Node) -> bool:
        """A node's backup copies its state too, to a fresh host state slot (the oldest
        host-only states are evicted for room); without one the backup fails."""
        d = node.aux.get("mamba")
        if d is None or d.value is None or d.host_value is not None:
            return True
        pool = host_mamba_pool(state)
        if pool.available_size() < 1:
            evict_mamba_host(state, 1)
        if pool.available_size() < 1:
            return False
        d.host_value = tuple(pool.alloc(1))
        assert state.host is not None
        state.host.mamba_copies.append(("backup", list(d.value), list(d.host_value)))
        return True

    def drop_host(self, state: CacheState, node: Node, tracker: dict[str, int]) -> None:
        d = node.aux.get("mamba")
        if d is None or d.host_value is None:
            return
        assert d.host_lock_ref == 0
        host_mamba_pool(state).free(list(d.host_value))
        tracker["mamba"] = tracker.get("mamba", 0) + len(d.host_value)
        d.host_value = None

    def wants_load_back(self, state: CacheState, node: Node) -> bool:
        """The matched node's state is on the host only."""
        d = node.aux.get("mamba")
        return d is not None and d.value is None and d.host_value is not None

    def reserve_load_back(self, state: CacheState, node: Node) -> bool:
        """The requester's own state slot, taken before the load back weighs its size (one
        state is evicted for room when the pool is empty); none to be had: the load back fails
        (upstream asserts instead, docs/SPEC.md).  A requester that holds a slot already
        (``init_load_back``'s ``request_slot``) keeps it: nothing is taken."""
        assert state.mamba is not None and state.host is not None
        if state.host.request_state is not None:
            return True
        if state.mamba.available_size() < 1:
            evict(state, 0, mamba_num=1)
        if state.mamba.available_size() < 1:
            return False
        state.host.request_state = state.mamba.alloc(1)[0]
        return True

    def alloc_load_back(self, state: CacheState, node: Node) -> bool:
        """The node's state comes back to a fresh device state slot (one state is evicted for
        room when the pool is empty), taken after the full slots.  When none can be had
        (every device state locked, for example by pending write-through acks), or the
        room-making took the node or its host state (write-back backups make host room), the
        load back fails: upstream asserts instead (docs/SPEC.md)."""
        assert state.mamba is not None and state.host is not None
        if state.mamba.available_size() < 1:
            evict(state, 0, mamba_num=1)
        # under write-back that eviction's backups may have evicted host states, this one too
        if state.mamba.available_size() < 1 or not rules.is_in_tree(state, node) \
                or not self.wants_load_back(state, node):
            return False
        state.host.mamba_load = state.mamba.alloc(1)[0]
        return True

    def cancel_load_back(self, state: CacheState, node: Node) -> None:
        assert state.mamba is not None and state.host is not None
        assert state.host.mamba_load is not None
        state.mamba.free([state.host.mamba_load])
        state.host.mamba_load = None

    def commit_load_back(self, state: CacheState, node: Node) -> None:
        """The node takes its state slot and the host state is copied there (and into the
        requester's own slot); the node joins the Mamba list as its newest, without a new
        access stamp (the Full eviction order does not move)."""
        assert state.host is not None and state.host.mamba_load is not None
        d = data(node, "mamba")
        assert d.host_value is not None and d.value is None
        d.value, state.host.mamba_load = (state.host.mamba_load,), None
        state.host.mamba_copies.append(("load", list(d.host_value), list(d.value)))
        if state.host.request_state is not None:  # and into the requester's own slot
            state.host.mamba_copies.append(("load", list(d.host_value), [state.host.request_state]))
        d.lru_pin = ((rules.tick(state), 0), node.stamp)

    def host_lock(self, state: CacheState, node: Node) -> bool | None:
        d = node.aux.get("mamba")
        if node.is_root or d is None or d.host_value is None:
            return None
        d.host_lock_ref += 1
        return True

    def host_unlock(self, state: CacheState, node: Node, token: object) -> None:
        d = data(node, "mamba")
        assert d.host_lock_ref > 0
        d.host_lock_ref -= 1
        if d.host_lock_ref == 0 and d.value is None and d.host_value is not None:
            join_host_lru(state, d)  # host-only and unlocked again: the newest of the list

    def data_errors(self, state: CacheState, node: Node, d: AuxData, held: dict[int, Node]
                    ) -> list[str]:
        """A Mamba state is one allocated slot held once."""
        assert state.mamba is not None and d.value is not None
        if len(d.value) != 1 or not state.mamba.is_allocated(d.value[0]):
            return [f"[aux] {node!r} Mamba state {d.value} is not one allocated slot"]
        if d.value[0] in held:
            return [f"[aux] Mamba slot {d.value[0]} held twice"]
        held[d.value[0]] = node
        return []


SWA = SWAComponent()
MAMBA = MambaComponent()
COMPONENTS: dict[str, AuxComponent] = {"swa": SWA, "mamba": MAMBA}  # by config name


def plugins_for(config: CacheConfig) -> tuple[AuxComponent, ...]:
    """The aux components a config names, in its order (spec/state.py composes them)."""
    return tuple(COMPONENTS[c] for c in config.components if c in COMPONENTS)


# ----------------------------------------------------------------------------------------------
# Match validators: may a match stop at this node?
# ----------------------------------------------------------------------------------------------


def swa_validator(window_len: int, host: bool = False) -> Callable[[Node], bool]:
    """SWA: the contiguous run of SWA data ending at the node must reach one window.  The run
    starts unbounded at the root and restarts at 0 after a tombstone (``host``: SWA data on
    the host only counts too)."""
    run = [float("inf")]

    def valid(node: Node) -> bool:
        if not has(node, "swa") and not (host and has_host(node, "swa")):
            run[0] = 0
            return False
        run[0] += len(node.key)
        return run[0] >= window_len

    return valid


def mamba_validator(node: Node) -> bool:
    """Mamba: the node itself holds a state."""
    return has(node, "mamba")


def mamba_host_validator(node: Node) -> bool:
    """Mamba with a host tier: the node holds a state on the device or on the host."""
    d = node.aux.get("mamba")
    return d is not None and (d.value is not None or d.host_value is not None)


def branching_seqlen(state: CacheState, walked_len: int, best_chunks: int, walked_chunks: int
                     ) -> int | None:
    """Mamba: when the walk went past the last node holding a state, the matched length
    rounded down to ``mamba_cache_chunk_size`` (None when that is 0, or when it did not).

    pre: walked_len >= 0 and 0 <= best_chunks <= walked_chunks
    post: __return__ is None or (__return__ > 0 and __return__ % state.config.mamba_cache_chunk_size == 0)
    """
    if walked_chunks <= best_chunks:
        return None
    chunk = state.config.mamba_cache_chunk_size
    aligned = walked_len // chunk * chunk
    return aligned if aligned > 0 else None


def has_host(node: Node, name: str) -> bool:
    d = node.aux.get(name)
    return d is not None and d.host_value is not None


def swa_load_window(state: CacheState, node: Node) -> list[Node]:
    """The nodes of ``node``'s window (one window of SWA data, on the device or the host,
    from the node up) whose SWA data is on the host only, top-down: what a load back of the
    node brings back.  The window ends early at a node with SWA data on neither."""
    out, size, cur = [], 0, node
    while not cur.is_root and size < window(state):
        d = cur.aux.get("swa")
        if d is not None and d.value is not None:
            size += len(d.value)
        elif d is not None and d.host_value is not None:
            out.append(cur)
            size += len(d.host_value)
        else:
            break
        cur = up(cur)
    out.reverse()
    return out


def swa_tombstone_held(node: Node) -> bool:
    """An SWA tombstone (Full data, no SWA data) that a lock holds: some holder's matched
    prefix runs through it and reads its full slots."""
    return node.value is not None and not has(node, "swa") and node.lock_ref > 0


def restore_swa(state: CacheState, node: Node, full_value: tuple[int, ...]) -> None:
    """A node takes ``full_value`` as its Full data and the mapped SWA slots as its SWA data."""
    node.value = tuple(full_value)
    data(node, "swa").value = swa_pool(state).translate(node.value)


def refresh_mamba_only(state: CacheState, node: Node) -> None:
    """A state committed to an existing node stamps it and moves it to the front of the Mamba
    list only: with SWA too, the node keeps its place in the SWA list (a split on the insert's
    way may have put another node in front of it there since its last stamp).  That place is
    pinned to the stamp it dates from, for as long as the node keeps the new stamp."""
    swa = node.aux.get("swa")
    since = None
    if swa is not None and swa.value is not None:
        since = lru_key(node, "swa")
    rules.touch(state, node)
    if swa is not None and since is not None:
        swa.lru_pin = (since, node.stamp)


# ----------------------------------------------------------------------------------------------
# Locks
# ----------------------------------------------------------------------------------------------


def lock_swa_window(state: CacheState, node: Node) -> tuple[tuple[Node, ...], int | None]:
    """Returns ``(skipped nodes, boundary mark or None)`` for the unlock."""
    size, boundary = 0, None
    skipped: list[Node] = []
    cur = node
    while not cur.is_root and size < window(state):
        d = data(cur, "swa")
        if d.value is None:
            skipped.append(cur)
        else:
            d.lock_ref += 1
            size += len(d.value)
            if size >= window(state):
                if d.boundary is None:
                    d.boundary = state.next_boundary
                    state.next_boundary += 1
                boundary = d.boundary
        cur = up(cur)
    return tuple(skipped), boundary


def lock_swa_host_window(state: CacheState, node: Node) -> SWAHostLock:
    """A window lock on the SWA host copies (``lock_swa_window``'s walk over ``host_value``)."""
    size, boundary = 0, None
    skipped: list[Node] = []
    cur = node
    while not cur.is_root and size < window(state):
        d = data(cur, "swa")
        if d.host_value is None:
            skipped.append(cur)
        else:
            d.host_lock_ref += 1
            size += len(d.host_value)
            if size >= window(state):
                if d.host_boundary is None:
                    d.host_boundary = state.next_boundary
                    state.next_boundary += 1
                boundary = d.host_boundary
        cur = up(cur)
    return SWAHostLock(skipped, boundary)


def unlock_swa_host_window(state: CacheState, node: Node, lock: SWAHostLock) -> None:
    """``unlock_swa_window``'s walk over the host locks; data host-only and unlocked again
    joins the SWA host LRU list as its newest."""
    cur = node
    while not cur.is_root:
        d = data(cur, "swa")
        if any(cur is s for s in lock.skipped) or d.host_lock_ref == 0:
            cur = up(cur)
            continue
        d.host_lock_ref -= 1
        if d.host_lock_ref == 0 and d.value is None and d.host_value is not None:
            join_host_lru(state, d)
        if lock.boundary is not None and d.host_boundary == lock.boundary:
            return
        cur = up(cur)


def lock_mamba_node(node: Node) -> bool:
    """Returns whether the node was locked (it was skipped when it held no state)."""
    if node.is_root or not has(node, "mamba"):
        return False
    data(node, "mamba").lock_ref += 1
    return True


def unlock_swa_window(node: Node, skipped: tuple[Node, ...], boundary: int | None) -> None:
    """Walk up from the node: skip the nodes the lock skipped and nodes without an SWA lock,
    take one lock off the others, and stop after the node carrying the lock's boundary mark
    (at the root when the window never filled up)."""
    cur = node
    while not cur.is_root:
        d = data(cur, "swa")
        if any(cur is s for s in skipped) or d.lock_ref == 0:
            cur = up(cur)
            continue
        d.lock_ref -= 1
        if boundary is not None and d.boundary == boundary:
            return
        cur = up(cur)


# ----------------------------------------------------------------------------------------------
# Eviction
# ----------------------------------------------------------------------------------------------


def lru_order(state: CacheState, name: str) -> list[Node]:
    """The component's LRU list, oldest first: the nodes holding its data, by access stamp."""
    return sorted((n for n in all_nodes(state) if not n.is_root and has(n, name)),
                  key=lambda n: lru_key(n, name))


def lru_key(node: Node, name: str) -> tuple[int, int]:
    """Where the node stands in the component's LRU list: its access stamp, unless a Mamba-only
    refresh pinned its SWA place to an older one (:func:`refresh_mamba_only`)."""
    d = node.aux.get(name)
    stamp: tuple[int, int] = node.stamp
    if d is not None and d.lru_pin is not None and d.lru_pin[1] == stamp:
        pinned: tuple[int, int] = d.lru_pin[0]
        return pinned
    return stamp


def drop_aux(state: CacheState, node: Node, comp: AuxComponent, tracker: dict[str, int]) -> None:
    """Free one component's device data on a node (it becomes a tombstone for it)."""
    d = data(node, comp.name)
    if d.value is None:
        return
    assert d.lock_ref == 0
    tracker[comp.name] = tracker.get(comp.name, 0) + len(d.value)
    comp.free_data(state, node, d)
    d.value = None
    if d.host_value is not None and d.host_lock_ref == 0:  # host-only now: joins the host LRU
        join_host_lru(state, d)


def drop_all_aux(state: CacheState, node: Node, tracker: dict[str, int]) -> None:
    """A device leaf leaves the tree: every aux component's data goes with it."""
    for comp in aux_components(state):
        drop_aux(state, node, comp, tracker)


def cascade(state: CacheState, node: Node, trigger: AuxComponent, is_leaf: bool,
            tracker: dict[str, int]) -> None:
    """Evicting ``trigger`` on a node also evicts the other aux components of lower or equal
    priority there (Full is only ever evicted with its leaf)."""
    which = 0 if is_leaf else 1
    for comp in aux_components(state):
        if comp is not trigger and comp.priority[which] <= trigger.priority[which]:
            drop_aux(state, node, comp, tracker)


def evict_aux(state: CacheState, comp: AuxComponent, request: int, tracker: dict[str, int]
              ) -> None:
    """Free at least ``request`` units of one component: walk its LRU list oldest first,
    skipping nodes it has locked; a device leaf is evicted whole (it leaves the tree), any
    other node becomes a tombstone for the component (cascading to lower priorities).  The
    order is the list's at the start: eviction changes no stamp and no lock."""
    name = comp.name
    for node in [n for n in lru_order(state, name) if data(n, name).lock_ref == 0]:
        if tracker.get(name, 0) >= request:
            return
        if not has(node, name):
            continue
        if is_device_leaf(node):
            evict_leaf(state, node, tracker)  # passed over: its data stays, the walk goes on
        else:
            drop_aux(state, node, comp, tracker)
            cascade(state, node, comp, False, tracker)


def evict(state: CacheState, num_tokens: int, swa_num_tokens: int = 0, mamba_num: int = 0
          ) -> dict[str, int]:
    """The seed's ``evict``: Full drives first (oldest device leaves, whole), then each aux
    component drives its own request from its LRU list.  Each component stops as soon as the
    units freed of it, by any driver, reach its request.  Returns the units freed per
    component."""
    rules.check_count("num_tokens", num_tokens)
    requests = {"swa": rules.check_count("swa_num_tokens", swa_num_tokens),
                "mamba": rules.check_count("mamba_num", mamba_num)}
    tracker = {"full": 0, "swa": 0, "mamba": 0}
    if state.config.disable:
        return tracker
    passed_over: list[Node] = []
    while tracker["full"] < num_tokens:
        victim = rules.oldest_device_leaf_except(state, passed_over)
        if victim is None:
            break
        if not evict_leaf(state, victim, tracker):
            passed_over.append(victim)
    for comp in aux_components(state):
        evict_aux(state, comp, requests[comp.name], tracker)
    if state.host is not None and host.write_back_policy(state):
        host.wait_for_writes(state)
    return tracker


def evict_leaf(state: CacheState, leaf: Node, tracker: dict[str, int]) -> bool:
    """One device leaf leaves the device, with every component's data: deleted, or with a
    host tier the host tier's way (evicted to the host, perhaps backed up first; False: passed
    over, nothing changed)."""
    for plugin in state.plugins:
        if plugin.drives_eviction:
            return plugin.evict_leaf(state, leaf, tracker)
    assert leaf.value is not None
    tracker["full"] = tracker.get("full", 0) + len(leaf.value)
    drop_all_aux(state, leaf, tracker)
    rules.evict_device_leaf(state, leaf)
    return True


# ----------------------------------------------------------------------------------------------
# The host tier: the Mamba component's host data
# ----------------------------------------------------------------------------------------------


def host_mamba_pool(state: CacheState) -> PagedPool:
    assert state.host is not None
    pool: PagedPool | None = state.host.mamba_pool
    assert pool is not None
    return pool


def host_swa_pool(state: CacheState) -> PagedPool:
    assert state.host is not None
    pool: PagedPool | None = state.host.swa_pool
    assert pool is not None
    return pool


def evict_swa_host(state: CacheState, num: int) -> int:
    """Free at least ``num`` SWA host units: walk the SWA host LRU list oldest first; a host
    leaf leaves the tree with all its host data, any other node loses its SWA host data (and,
    cascading, Mamba's).  Returns the SWA host units freed."""
    tracker: dict[str, int] = {"swa": 0}
    for node in host_lru_order(state, "swa"):
        if tracker["swa"] >= num:
            break
        if not rules.is_in_tree(state, node) or not has_host(node, "swa"):
            continue
        if host.is_host_leaf(node):
            before = host_swa_pool(state).available_size()
            host.evict_host_leaf(state, node)
            tracker["swa"] += host_swa_pool(state).available_size() - before
        else:
            SWA.drop_host(state, node, tracker)
            for comp in aux_components(state):
                if comp is not SWA and comp.priority[1] <= SWA.priority[1]:
                    comp.drop_host(state, node, {})
    return tracker["swa"]


def swa_pool(state: CacheState) -> HybridKVPool:
    """With SWA the KV pool is a HybridKVPool (spec/world.py): full slots mapped to SWA slots."""
    assert isinstance(state.kv, HybridKVPool)
    return state.kv


def join_host_lru(state: CacheState, d: AuxData) -> None:
    """Data that became host-only (and is not host-locked) joins its component's host LRU
    list as the newest member."""
    assert state.host is not None
    d.host_joined = state.host.next_join
    state.host.next_join += 1


def host_lru_order(state: CacheState, name: str) -> list[Node]:
    """The component's host LRU list, oldest first: the nodes whose data of it is on the host
    only and not host-locked, in the order they joined."""
    members = [n for n in all_nodes(state) if not n.is_root for d in [n.aux.get(name)]
               if d is not None and d.value is None and d.host_value is not None
               and d.host_lock_ref == 0]
    return sorted(members, key=lambda n: n.aux[name].host_joined)


def evict_mamba_host(state: CacheState, num: int) -> int:
    """Free at least ``num`` host states: walk the Mamba host LRU list oldest first; a host
    leaf leaves the tree with all its host data, any other node only loses its host state.
    Returns the host states freed."""
    tracker: dict[str, int] = {"mamba": 0}
    for node in host_lru_order(state, "mamba"):
        if tracker["mamba"] >= num:
            break
        if not rules.is_in_tree(state, node):
            continue
        if host.is_host_leaf(node):
            before = host_mamba_pool(state).available_size()
            host.evict_host_leaf(state, node)
            tracker["mamba"] += host_mamba_pool(state).available_size() - before
        else:
            MAMBA.drop_host(state, node, tracker)
    return tracker["mamba"]


# ----------------------------------------------------------------------------------------------
# Queries and invariants
# ----------------------------------------------------------------------------------------------


def aux_size(state: CacheState, name: str, locked: bool) -> int:
    """Units of the component's data in nodes it has locked (protected) or not (evictable)."""
    return sum(len(d.value) for n in all_nodes(state) if not n.is_root
               for d in [n.aux.get(name)] if d is not None and d.value is not None
               and (d.lock_ref > 0) == locked)


def sizes(state: CacheState) -> dict[str, int]:
    out = {}
    for name in aux_names(state):
        out[f"{name}_evictable"] = aux_size(state, name, False)
        out[f"{name}_protected"] = aux_size(state, name, True)
    return out


def aux_host_invariants(state: CacheState) -> list[str]:
    """The host side of the aux components: host data needs the node's Full host copy; SWA
    host data is one host slot per unit, a host state one host slot; each allocated in its
    host pool and held once, and the host pools hold nothing else; host locks are never
    negative and sit on host data only."""
    if state.host is None:
        return []
    errors: list[str] = []
    pools = {"swa": state.host.swa_pool, "mamba": state.host.mamba_pool}
    held: dict[str, dict[int, Node]] = {name: {} for name in pools}
    for node in all_nodes(state):
        for name, d in node.aux.items():
            if d.host_lock_ref < 0 or (d.host_lock_ref > 0 and d.host_value is None):
                errors.append(f"[aux-host] {node!r} {name} host_lock_ref={d.host_lock_ref} "
                              "without host data")
            if d.host_value is None:
                continue
            if node.host_value is None:
                errors.append(f"[aux-host] {node!r} holds {name} host data without a Full "
                              "host copy")
            pool = pools.get(name)
            units = 1 if name == "mamba" else len(node.key)
            if pool is None or len(d.host_value) != units \
                    or any(not pool.is_allocated(s) for s in d.host_value):
                errors.append(f"[aux-host] {node!r} {name} host data {list(d.host_value)} is "
                              f"not {units} allocated host slot(s)")
                continue
            for s in d.host_value:
                if s in held[name]:
                    errors.append(f"[aux-host] {name} host slot {s} held twice")
                held[name][s] = node
    for name, pool in pools.items():
        if pool is None:
            continue
        pages = {s // pool.page_size for s in held[name]}
        leaked = sorted(pool.allocated_pages() - pages)
        if leaked:
            errors.append(f"[aux-host] {name} host pages allocated but held by no node: "
                          f"{leaked[:8]}")
    return errors


def aux_invariants(state: CacheState) -> list[str]:
    """Aux data needs Full data; SWA data is the mapped SWA slots of the Full data; a Mamba
    state is one allocated slot held once; locks are never negative, sit on data only and
    never exceed the Full lock on the same node; the root holds no aux data."""
    errors: list[str] = []
    names = aux_names(state)
    held: dict[int, Node] = {}
    for node in all_nodes(state):
        for name, d in node.aux.items():
            if name not in names:
                errors.append(f"[aux] {node!r} holds data of unconfigured component {name}")
                continue
            if node.is_root:
                if d.value is not None or d.lock_ref:
                    errors.append(f"[aux] the root holds {name} data or locks")
                continue
            if d.lock_ref < 0:
                errors.append(f"[aux] {node!r} {name} lock_ref={d.lock_ref} < 0")
            if d.lock_ref > node.lock_ref:
                errors.append(f"[aux] {node!r} {name} lock_ref={d.lock_ref} exceeds the Full "
                              f"lock {node.lock_ref}")
            if d.value is None:
                if d.lock_ref > 0:
                    errors.append(f"[aux] {node!r} {name} is a tombstone but locked")
                continue
            if node.value is None:
                errors.append(f"[aux] {node!r} holds {name} data without Full data")
                continue
            errors.extend(COMPONENTS[name].data_errors(state, node, d, held))
    if "swa" in names and not state.config.disable:
        errors.extend(swa_lock_counts(state))
    return errors


def swa_lock_counts(state: CacheState) -> list[str]:
    """Every SWA lock count equals the number of live window locks whose unlock takes one off
    the node: the nodes from the lock's node up that it did not skip, up to the node carrying
    its boundary mark (to the root when the window never filled up)."""
    expected: Counter[int] = Counter()
    for handle in state.handles.values():
        if "swa" not in handle.aux:
            continue
        skipped, boundary = handle.aux["swa"]
        cur = handle.node
        while not cur.is_root:
            if not any(cur is s for s in skipped):
                expected[id(cur)] += 1
                if boundary is not None and data(cur, "swa").boundary == boundary:
                    break
            cur = up(cur)
    errors = []
    for node in all_nodes(state):
        d = node.aux.get("swa")
        count = 0 if d is None else d.lock_ref
        if not node.is_root and count != expected[id(node)]:
            errors.append(f"[aux] {node!r} swa lock_ref={count} but {expected[id(node)]} live "
                          f"window lock(s) take one off it")
    return errors
