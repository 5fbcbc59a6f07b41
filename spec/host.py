"""The host tier (HiCache) of the Full component: one function per rule, named after it.

A node's KV data can live on the device (``Node.value``), on the host (``Node.host_value``) or
both.  The host tier adds these rules to the device tier of :mod:`uniradix.spec.cache`:

* **backup** (``write_backup``): a node's device slots are copied to fresh host slots.  Under
  ``write_through`` / ``write_through_selective`` an insert that brings a node's hit count to
  ``write_through_threshold`` backs it up (its parent first, so a backed-up node always has a
  backed-up parent) and the node stays locked until the write's ack is processed.  Under
  ``write_back`` a node is backed up only when it is evicted, and that eviction waits for the
  write (no lock).
* **eviction to host**: a device leaf with a host copy loses its device slots and stays in the
  tree; one without a copy is deleted (write-through) or backed up first (write-back).
* **host eviction** (``evict_host``): the oldest *host leaf* (evicted, backed up, childless, not
  host-locked) loses its host slots and leaves the tree, with its tombstone ancestors.
* **load back** (``init_load_back``): the evicted segment above a matched node is copied back
  into fresh device slots (evicting device leaves for room), and the node stays locked until the
  load's ack is processed.
* **the I/O queues** (the environment): every write and every load is one *ack*, queued in
  submission order, not done.  ``io_complete`` marks the oldest acks done; the cache notices only
  at ``writing_check`` / ``loading_check`` (``check_hicache_events``), which pop the done prefix
  of each queue and release the locks of the work they finish.

State added to the device tier's (all primary): per node ``host_value`` and ``host_lock_ref``;
per cache a :class:`HostTier` holding the host pool, the two ack queues (each ack names its node
and the lock it holds) and the live host-lock handles.  Host leaves and the host eviction order
are recomputed by the queries below, as the device ones are.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from . import cache as rules
from .core import Ack, CacheState, MatchOutcome, MatchWalk, Node, Plugin, all_nodes, up
from .errors import HandleError, InvalidInput, NodeNotFound
from .keys import oldest
from .policies import eviction_key
from .queries import device_leaves
from .world import PagedPool

# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class HostLockHandle:
    """What ``inc_host_lock_ref`` hands out.  ``locked`` is False when the node had no host copy
    (the seed then changes nothing, and so does the matching ``dec_host_lock_ref``)."""

    serial: int
    node: Node
    locked: bool
    # the plug-ins that host-locked their data too, each with what it locked
    aux: tuple[tuple[Plugin, object], ...] = ()


@dataclasses.dataclass(eq=False)
class HostTier:
    pool: PagedPool                                   # the host KV pool (environment)
    writes: list[Ack] = dataclasses.field(default_factory=list)  # oldest first
    loads: list[Ack] = dataclasses.field(default_factory=list)   # oldest first
    host_locks: dict[int, HostLockHandle] = dataclasses.field(default_factory=dict)  # by serial
    next_serial: int = 1
    # the environment's log of the copies it was asked for, in order (like the pools' freed
    # logs): ("backup", device slots, host slots) / ("load", host slots, device slots)
    copies: list[tuple[str, list[int], list[int]]] = dataclasses.field(default_factory=list)
    # Mamba (spec/components.py): the host state pool, its copies as above, and the counter
    # that orders the aux components' host LRU lists
    mamba_pool: PagedPool | None = None
    mamba_copies: list[tuple[str, list[int], list[int]]] = dataclasses.field(default_factory=list)
    next_join: int = 1
    # SWA (spec/components.py): the SWA host pool (one SWA host slot per unit, page size as
    # the KV pool's), its copies as above, and what a load back in progress took: the nodes
    # whose SWA data it brings back (top-down) and their fresh SWA slots
    swa_pool: PagedPool | None = None
    swa_copies: list[tuple[str, list[int], list[int]]] = dataclasses.field(default_factory=list)
    swa_load: tuple[list[Node], list[int]] | None = None
    # Mamba: the state slot a load back in progress took for the node (None between them)
    mamba_load: int | None = None
    # Mamba: the state slot the last load back took for the requester (its own copy of the
    # loaded state; None when it took none); the requester's from then on, like alloc's slots
    request_state: int | None = None


def attach_host_tier(state: CacheState) -> None:
    """Give a fresh cache its host tier (``config.host_slots`` usable host slots)."""
    config = state.config
    mamba_pool = swa_pool = None
    if "swa" in config.components:  # SWA host slots: host_swa_slots, else host_slots
        n = config.host_swa_slots if config.host_swa_slots is not None else config.host_slots
        swa_pool = PagedPool(n, config.page_size, "host_swa")  # the default of docs/TRACE.md
    if "mamba" in config.components:  # host state slots: host_mamba_slots, else 2 x mamba_slots
        n = config.host_mamba_slots if config.host_mamba_slots is not None \
            else 2 * config.mamba_slots  # the default of docs/TRACE.md (upstream's)
        mamba_pool = PagedPool(n, 1, "host_mamba")
    state.host = HostTier(pool=PagedPool(config.host_slots, config.page_size, "host"),
                          mamba_pool=mamba_pool, swa_pool=swa_pool)


def write_back_policy(state: CacheState) -> bool:
    return state.config.write_policy == "write_back"


def backed_up(node: Node) -> bool:
    return node.host_value is not None


# ----------------------------------------------------------------------------------------------
# Queries (recomputed on every question)
# ----------------------------------------------------------------------------------------------


def is_host_leaf(node: Node) -> bool:
    """An evictable host leaf: not the root, evicted from the device, backed up, not
    host-locked (by any component) and childless."""
    return (not node.is_root and node.value is None and node.host_value is not None
            and node.host_lock_ref == 0 and not node.children
            and all(d.host_lock_ref == 0 for d in node.aux.values()))


def host_leaves(state: CacheState) -> list[Node]:
    return [n for n in all_nodes(state) if is_host_leaf(n)]


def host_eviction_order(state: CacheState) -> list[Node]:
    """The current host leaves in the eviction policy's order (lru: oldest access first)."""
    return sorted(host_leaves(state), key=lambda n: eviction_key(state, n))


def oldest_host_leaf(state: CacheState) -> Node | None:
    leaves = host_leaves(state)
    if not leaves:
        return None
    return leaves[oldest([eviction_key(state, n) for n in leaves])]


def host_size(state: CacheState) -> int:
    """Host tokens held by the tree."""
    return sum(len(n.host_value) for n in all_nodes(state) if n.host_value is not None)


def host_tree_slots(state: CacheState) -> list[int]:
    return [s for n in all_nodes(state) if n.host_value is not None for s in n.host_value]


def host_hit_length(best: Node, last_device: Node) -> int:
    """Host tokens between the device match and the full match: the host copies of the evicted
    nodes from ``best`` up to (excluding) ``last_device``."""
    n, cur = 0, best
    while cur is not last_device and not cur.is_root:
        if cur.host_value is not None:
            n += len(cur.host_value)
        cur = up(cur)
    return n


def evicted_segment(node: Node) -> list[Node]:
    """The evicted nodes from ``node`` up to the first device node, top-down (what a load back
    of ``node`` copies)."""
    seg, cur = [], node
    while cur.evicted:
        seg.append(cur)
        cur = up(cur)
    seg.reverse()
    return seg


# ----------------------------------------------------------------------------------------------
# The plug-in: the host tier's hooks in the device tier's rules
# ----------------------------------------------------------------------------------------------


class HostTierPlugin(Plugin):
    drives_eviction = True

    def finish_match(self, state: CacheState, outcome: MatchOutcome, walk: MatchWalk
                     ) -> MatchOutcome:
        """A match with a host tier walks through evicted nodes that have a host copy: the
        walk's end is the best match, the device match ends above it (``cache.match_prefix``),
        and the host hit length counts the host copies in between."""
        best, last_device = outcome.best_match_node, outcome.last_device_node
        return dataclasses.replace(outcome, host_hit_length=host_hit_length(best, last_device))

    def split(self, state: CacheState, upper: Node, child: Node, split_len: int) -> None:
        """A split cuts the host copy at the same point as the key.  The host lock stays with
        the lower part (the node it was taken on).  A device lock that skipped the evicted
        ``child`` skips its new upper part too (both were evicted when the lock was taken)."""
        if child.host_value is not None:
            k = len(upper.key)
            upper.host_value = child.host_value[:k]
            child.host_value = child.host_value[k:]
        for handle in state.handles.values():
            if any(s is child for s in handle.skipped):
                handle.skipped = handle.skipped + (upper,)

    def on_hit(self, state: CacheState, node: Node) -> None:
        """Write-through: a node whose hit count reached the threshold is backed up."""
        if write_back_policy(state):
            return
        if not backed_up(node) and node.hit_count >= state.config.write_through_threshold:
            write_backup(state, node)

    def evict_device(self, state: CacheState, num_tokens: int) -> int:
        return evict(state, num_tokens)

    def evict_leaf(self, state: CacheState, leaf: Node, tracker: dict[str, int]) -> bool:
        return evict_leaf(state, leaf, tracker)

    def reset(self, state: CacheState) -> None:
        reset_host_tier(state)


HOST_PLUGIN = HostTierPlugin()


# ----------------------------------------------------------------------------------------------
# Backup (device -> host)
# ----------------------------------------------------------------------------------------------


def write_backup(state: CacheState, node: Node, write_back: bool = False) -> int:
    """Copy ``node``'s device data to fresh host slots; return the number of slots written
    (0 = not backed up: the host pool could not make room).

    Write-through backs the parent up first (and gives up if that fails).  When the host pool
    is short, host leaves are evicted for room.  The write is queued as one ack; a write-through
    write locks the node (and its path) until the ack is processed."""
    assert node.value is not None and node.host_value is None
    parent = up(node)
    if not write_back and not parent.is_root and not backed_up(parent):
        if write_backup(state, parent) <= 0:
            return 0
    host = state.host
    n = len(node.value)
    avail = host.pool.available_size()
    if avail < n:
        needed = n - avail
        if evict_host(state, needed) < needed:
            return 0
    host_value = tuple(host.pool.alloc(n))
    done: list[Plugin] = []
    for plugin in state.plugins:  # each component backs its own data up (Mamba: the state)
        if not plugin.backup(state, node):
            for p in done:
                p.drop_host(state, node, {})
            host.pool.free(list(host_value))
            return 0
        done.append(plugin)
    node.host_value = host_value
    host.copies.append(("backup", list(node.value), list(node.host_value)))
    lock = None if write_back else rules.inc_lock_ref(state, node)
    host.writes.append(Ack(node, lock))
    return n


# ----------------------------------------------------------------------------------------------
# Device eviction with a host tier
# ----------------------------------------------------------------------------------------------


def evict(state: CacheState, num_tokens: int) -> int:
    """Free at least ``num_tokens`` device tokens, oldest device leaf first (``evict_leaf``;
    a leaf it passes over is not taken again in this eviction).  Under write-back the eviction
    ends by waiting for every pending write."""
    tracker: dict[str, int] = {"full": 0}
    passed_over: list[Node] = []
    while tracker["full"] < num_tokens:
        victim = rules.oldest_device_leaf_except(state, passed_over)
        if victim is None:
            break
        if not evict_leaf(state, victim, tracker):
            passed_over.append(victim)
    if write_back_policy(state):
        wait_for_writes(state)
    return tracker["full"]


def evict_leaf(state: CacheState, leaf: Node, tracker: dict[str, int]) -> bool:
    """Evict one device leaf with a host tier; the units freed per component go to
    ``tracker``.  A backed-up leaf is evicted to the host (it stays in the tree).  Under
    write-back a leaf without a copy is backed up first and the eviction waits for the write;
    a leaf whose backup fails (the host pools cannot make room) keeps its data: False, the
    caller passes it over.  Otherwise a leaf without a copy is deleted (the device tier's
    rule)."""
    if not backed_up(leaf) and write_back_policy(state):
        if write_backup(state, leaf, write_back=True) == 0:
            return False
        wait_for_writes(state)
    if backed_up(leaf):
        tracker["full"] = tracker.get("full", 0) + evict_to_host(state, leaf, tracker)
        return True
    assert leaf.value is not None
    tracker["full"] = tracker.get("full", 0) + len(leaf.value)
    for plugin in state.plugins:  # the aux components' data goes with the leaf
        plugin.drop_device_leaf(state, leaf, tracker)
    rules.evict_device_leaf(state, leaf)
    return True


def evict_to_host(state: CacheState, node: Node, tracker: dict[str, int]) -> int:
    """Device -> host demotion: the device slots go back to the pool, with every aux
    component's device data on the node; the node stays, with its host copies."""
    assert node.value is not None and node.host_value is not None
    n = len(node.value)
    for plugin in state.plugins:
        plugin.drop_device_leaf(state, node, tracker)
    state.kv.free(list(node.value))
    node.value = None
    return n


# ----------------------------------------------------------------------------------------------
# Host eviction
# ----------------------------------------------------------------------------------------------


def evict_host(state: CacheState, num_tokens: int) -> int:
    """Free at least ``num_tokens`` host tokens if possible: take the oldest host leaf, again
    and again.  Returns the host tokens freed."""
    rules.check_count("num_tokens", num_tokens)
    freed = 0
    while freed < num_tokens:
        victim = oldest_host_leaf(state)
        if victim is None:
            break
        freed += evict_host_leaf(state, victim)
    return freed


def evict_host_leaf(state: CacheState, leaf: Node) -> int:
    """A host leaf's host slots go back to the host pool and it leaves the tree; ancestors left
    as childless tombstones go too."""
    host_value = leaf.host_value
    assert host_value is not None
    n = len(host_value)
    for plugin in state.plugins:  # every component's host data goes with it
        plugin.drop_host(state, leaf, {})
    state.host.pool.free(list(host_value))
    leaf.host_value = None
    parent = up(leaf)
    rules.remove_from_parent(state, leaf)
    rules.delete_tombstone_ancestors(state, parent)
    return n


# ----------------------------------------------------------------------------------------------
# Load back (host -> device)
# ----------------------------------------------------------------------------------------------


def load_back(state: CacheState, node: Node, mem_quota: int | None) -> bool:
    """Copy the evicted segment ending at ``node`` back to fresh device slots.

    The path is locked while room is made.  Nothing is loaded when the segment is shorter than
    ``load_back_threshold`` or longer than ``mem_quota`` plus what the lock just protected, or
    when evicting device leaves cannot make room (or, under write-back, their backups evicted
    ``node`` from the host to make host room).  A load is queued as one ack and locks
    ``node``'s path until the ack is processed."""
    segment = evicted_segment(node)
    assert all(n.host_value is not None for n in segment)
    host_values = [n.host_value for n in segment if n.host_value is not None]
    n_tokens = sum(len(hv) for hv in host_values)
    aux = [p for p in state.plugins if p.wants_load_back(state, node)]
    guard = rules.inc_lock_ref(state, node)
    delta = sum(len(n.value or ()) for n in guard.locked_nodes() if n.lock_ref == 1)
    for plugin in aux:  # what the requester takes first (Mamba: its own state slot)
        if not plugin.reserve_load_back(state, node):
            rules.dec_lock_ref(state, guard)
            return False
    if (n_tokens < state.config.load_back_threshold and not aux) or (
            mem_quota is not None and n_tokens > mem_quota + delta):
        rules.dec_lock_ref(state, guard)
        return False
    avail = state.kv.available_size()
    if avail < n_tokens:
        needed = n_tokens - avail
        # write-back backups during this eviction may evict host leaves, ``node`` among them:
        # then there is nothing left to load
        if rules.evict(state, needed) < needed or not rules.is_in_tree(state, node):
            rules.dec_lock_ref(state, guard)
            return False
    # full slots only (with SWA the KV pool pairs no SWA slots with them: the SWA plug-in
    # takes those for the window it loads, and maps them)
    device = PagedPool.alloc(state.kv, n_tokens)
    for k, plugin in enumerate(aux):  # each component takes its device slots, all or nothing
        if not plugin.alloc_load_back(state, node):  # (SWA: the window's; Mamba: a state)
            for taken in reversed(aux[:k]):
                taken.cancel_load_back(state, node)
            state.kv.free(device)
            rules.dec_lock_ref(state, guard)
            return False
    state.host.copies.append(("load", [s for hv in host_values for s in hv], list(device)))
    rules.dec_lock_ref(state, guard)
    start = 0
    for n, hv in zip(segment, host_values, strict=True):
        n.value = tuple(device[start: start + len(hv)])
        start += len(hv)
    for plugin in aux:
        plugin.commit_load_back(state, node)
    state.host.loads.append(Ack(node, rules.inc_lock_ref(state, node)))
    return True


def init_load_back(state: CacheState, node: Node, last_device_node: Node,
                   mem_quota: int | None, request_slot: int | None = None
                   ) -> tuple[tuple[int, ...], Node]:
    """The scheduler's entry: load ``node``'s evicted segment if there is one and return the
    device slots now between ``last_device_node`` and ``node`` with the new last device node;
    on no load, ``((), last_device_node)``.  Mamba: ``request_slot`` is the requester's own
    state slot when it holds one (``req.mamba_pool_idx``); a load back of a host-only state
    copies it there and takes no fresh slot for the requester (upstream does the same)."""
    check_ancestor(last_device_node, node)
    if mem_quota is not None:
        rules.check_count("mem_quota", mem_quota)
    assert state.host is not None
    if request_slot is not None:
        check_request_slot(state, request_slot)
    state.host.request_state = request_slot
    # the seed's guard: only an evicted node is loaded back (a state on the host only under a
    # node still on the device stays there; docs/SPEC.md)
    if node.evicted and load_back(state, node, mem_quota):
        chunks: list[tuple[int, ...]] = []
        cur = node
        while cur is not last_device_node:
            assert cur.value is not None  # just loaded, or on the device already
            chunks.append(cur.value)
            cur = up(cur)
        indices = tuple(s for chunk in reversed(chunks) for s in chunk)
        if indices:
            return indices, node
    return (), last_device_node


def check_request_slot(state: CacheState, slot: int) -> None:
    """A requester's own Mamba state slot: allocated, and not a state the tree holds."""
    if state.mamba is None:
        raise InvalidInput("load_back: a request state slot given to a cache without Mamba")
    if isinstance(slot, bool) or not isinstance(slot, int) or not state.mamba.is_allocated(slot):
        raise InvalidInput(f"load_back: the request's state slot {slot!r} is not an allocated "
                           "Mamba slot")
    if any(n.aux["mamba"].value == (slot,) for n in all_nodes(state) if "mamba" in n.aux):
        raise InvalidInput(f"load_back: the request's state slot {slot} is a state the tree holds")


def check_ancestor(upper: Node, lower: Node) -> None:
    cur: Node | None = lower
    while cur is not None:
        if cur is upper:
            return
        cur = cur.parent
    raise InvalidInput("load_back: last_device_node is not on the path of the node")


# ----------------------------------------------------------------------------------------------
# The I/O queues and their checks
# ----------------------------------------------------------------------------------------------


def io_complete(state: CacheState, writes: int, loads: int) -> None:
    """The environment finishes transfers: the ``writes`` oldest not-done write acks and the
    ``loads`` oldest not-done load acks are done (-1: all).  The cache is not told."""
    for name, k in (("writes", writes), ("loads", loads)):
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InvalidInput(f"io_complete: {name} must be an int >= -1, got {k!r}")
    for queue, k in ((state.host.writes, writes), (state.host.loads, loads)):
        for ack in queue:
            if k == 0:
                break
            if not ack.done:
                ack.done = True
                k -= 1


def release(state: CacheState, ack: Ack) -> None:
    if ack.lock is not None:
        rules.dec_lock_ref(state, ack.lock)


def writing_check(state: CacheState) -> None:
    """Process finished writes: pop the done prefix of the write queue, unlocking each node."""
    queue = state.host.writes
    while queue and queue[0].done:
        ack = queue.pop(0)
        release(state, ack)
        for plugin in state.plugins:  # the storage tier backs the node up
            plugin.after_write_ack(state, ack)


def wait_for_writes(state: CacheState) -> None:
    """Write-back: wait for every pending write (they all complete now) and process them."""
    for ack in state.host.writes:
        ack.done = True
    writing_check(state)


def loading_check(state: CacheState) -> None:
    """Process finished loads: pop the done prefix of the load queue, unlocking each path."""
    queue = state.host.loads
    while queue and queue[0].done:
        release(state, queue.pop(0))


def check_hicache_events(state: CacheState) -> None:
    writing_check(state)
    loading_check(state)
    for plugin in state.plugins:  # the storage tier: its control queues
        plugin.check_events(state)


# ----------------------------------------------------------------------------------------------
# Host locks
# ----------------------------------------------------------------------------------------------


def inc_host_lock_ref(state: CacheState, node: Node) -> HostLockHandle:
    """Protect ``node``'s host copy from host eviction (only that node; a node without a host
    copy is left as it is)."""
    if node is not state.root and not rules.is_in_tree(state, node):
        raise NodeNotFound("inc_host_lock_ref: the node is not in the tree")
    host = state.host
    locked = not state.config.disable and node.host_value is not None
    aux = () if state.config.disable else tuple(
        (p, token) for p in state.plugins for token in [p.host_lock(state, node)]
        if token is not None)
    handle = HostLockHandle(host.next_serial, node, locked, aux)
    host.next_serial += 1
    host.host_locks[handle.serial] = handle
    if locked:
        node.host_lock_ref += 1
    return handle


def dec_host_lock_ref(state: CacheState, handle: HostLockHandle) -> None:
    host = state.host
    if not isinstance(handle, HostLockHandle) or host.host_locks.get(handle.serial) is not handle:
        raise HandleError("dec_host_lock_ref: this handle was never issued or is already released")
    del host.host_locks[handle.serial]
    if handle.locked:
        assert handle.node.host_lock_ref > 0
        handle.node.host_lock_ref -= 1
    for plugin, token in handle.aux:
        plugin.host_unlock(state, handle.node, token)


# ----------------------------------------------------------------------------------------------
# Reset
# ----------------------------------------------------------------------------------------------


def reset_host_tier(state: CacheState) -> None:
    """Flush: the host pool is cleared, queued acks and host locks are forgotten."""
    state.host.pool.reset()
    state.host.writes.clear()
    state.host.loads.clear()
    state.host.host_locks.clear()
    state.host.copies.clear()
    if state.host.mamba_pool is not None:
        state.host.mamba_pool.reset()
    state.host.mamba_copies.clear()
    if state.host.swa_pool is not None:
        state.host.swa_pool.reset()
    state.host.swa_copies.clear()
    state.host.swa_load = None
    state.host.mamba_load = None


# ----------------------------------------------------------------------------------------------
# Invariants (the host parts of the seed's sanity_check)
# ----------------------------------------------------------------------------------------------


def host_invariants(state: CacheState) -> list[str]:
    if state.host is None:
        return []
    return (host_data(state) + host_locks(state) + host_accounting(state)
            + in_flight(state))


def host_data(state: CacheState) -> list[str]:
    """Host copies fit their keys; under write-through a backed-up node has a backed-up parent;
    no node is both an evictable device leaf and a host leaf."""
    errors = []
    wb = write_back_policy(state)
    for node in all_nodes(state):
        if node.is_root:
            if node.host_value is not None or node.host_lock_ref:
                errors.append("[host] the root holds host data or a host lock")
            continue
        if node.host_value is not None and len(node.host_value) != len(node.key):
            errors.append(f"[host] {node!r}: {len(node.host_value)} host slots for "
                          f"{len(node.key)} units")
        if (node.host_value is not None and not wb and not up(node).is_root
                and up(node).host_value is None):
            errors.append(f"[host] {node!r} is backed up but its parent is not")
    dev = {id(n) for n in device_leaves(state)}
    both = [n for n in host_leaves(state) if id(n) in dev]
    if both:
        errors.append(f"[leaf] {both[0]!r} is both a device leaf and a host leaf")
    return errors


def host_locks(state: CacheState) -> list[str]:
    """Host lock counts equal the live host-lock handles that locked each node, and sit only on
    nodes with a host copy."""
    errors = []
    expected: Counter[int] = Counter()
    for h in state.host.host_locks.values():
        if h.locked:
            expected[id(h.node)] += 1
    for node in all_nodes(state):
        if node.host_lock_ref != expected[id(node)]:
            errors.append(f"[host-lock] {node!r} host_lock_ref={node.host_lock_ref} but "
                          f"{expected[id(node)]} live host lock(s)")
        if node.host_lock_ref > 0 and node.host_value is None:
            errors.append(f"[host-lock] {node!r} is host-locked without a host copy")
    return errors


def host_accounting(state: CacheState) -> list[str]:
    """Every host slot the tree holds is allocated and held once, and the host pool holds
    nothing else (only the cache allocates host slots)."""
    errors = []
    slots = host_tree_slots(state)
    twice = sorted(s for s, k in Counter(slots).items() if k > 1)
    if twice:
        errors.append(f"[host-size] host slots held twice: {twice[:8]}")
    pool = state.host.pool
    tree_pages = {s // pool.page_size for s in slots}
    if not tree_pages <= pool.allocated_pages():  # (a slot is allocated when its page is)
        errors.append("[host-size] the tree holds host slots the host pool says are free")
    for plugin in state.plugins:  # the storage tier: prefetch slots and the release queue
        tree_pages |= {s // pool.page_size for s in plugin.held_host_slots(state)}
    leaked = sorted(pool.allocated_pages() - tree_pages)
    if leaked:
        errors.append(f"[host-size] host pages allocated but held by no node: {leaked[:8]}")
    return errors


def in_flight(state: CacheState) -> list[str]:
    """Every in-flight transfer's node is in the tree; a write's node is backed up and a
    load's node is on the device; each holds its lock (on a locked node); done acks form a
    prefix of each queue (completion goes oldest first)."""
    errors = []
    for kind, queue in (("write", state.host.writes), ("load", state.host.loads)):
        seen_pending = False
        for ack in queue:
            node = ack.node
            if not rules.is_in_tree(state, node):
                errors.append(f"[in-flight] {kind} of {node!r}: the node is not in the tree")
                continue
            if kind == "write" and node.host_value is None:
                errors.append(f"[in-flight] write of {node!r}: the node has no host copy")
            if kind == "load" and node.value is None:
                errors.append(f"[in-flight] load of {node!r}: the node has no device data")
            if ack.lock is not None and (state.handles.get(ack.lock.serial) is not ack.lock
                                         or node.lock_ref <= 0):
                errors.append(f"[in-flight] {kind} of {node!r} does not hold its lock")
            if ack.done and seen_pending:
                errors.append(f"[in-flight] a done {kind} ack follows a pending one")
            seen_pending = seen_pending or not ack.done
    return errors
