"""The storage tier (L3, HiCache storage) of the Full component: one function per rule.

Host copies are written through to a storage service under content keys (spec/pagekeys.py), and
a new request prefetches from it the pages it would otherwise recompute.  The rules follow the
seed (``write_backup_storage``, ``prefetch_from_storage``, ``can_terminate_prefetch``,
``check_prefetch_progress``, ``terminate_prefetch``, ``pop_prefetch_loaded_tokens``,
``release_aborted_request``, ``drain_storage_control_queues``) and its controller, with one
tensor-parallel rank (every all-reduce is the identity).

**Page keys.**  With storage on, every node keeps the keys of its pages (``Node.page_keys``): a
new leaf's are chained from its parent's last key (from the namespace of its ``extra_key`` under
the root), a split cuts the list, and a node a prefetch inserts takes the keys the prefetch read.

**The environment** (like the host I/O queues, nothing completes by itself):

* the *store*: key -> the units of the page stored under it;
* *backups*: one per ``write_backup_storage``, queued; ``storage_backup`` writes the oldest ones
  (all their pages) and acks them;
* *prefetches*: queued; ``storage_query`` runs the hit query of the oldest not-yet-queried ones
  (the storage hit is the longest run of stored pages from the start; below the threshold the
  prefetch is revoked and all its host slots are released, else the slots beyond the hit are
  released); ``storage_load`` reads the next pages of one prefetch in flight (a page whose key is
  no longer stored, or a terminated prefetch, ends the transfer; the end releases the slots not
  loaded);
* a logical clock (``storage_tick``) that the ``timeout`` stop policy reads.

The cache sees the environment only through the three control queues it drains in
``check_hicache_events``: revoked request ids, acked backups (their host locks are released),
and host slots to release (freed to the host pool then).

**Differences from the seed** (docs/SPEC.md, "Storage tier"): a prefetch under the root takes
the request's ``extra_key`` (the seed takes the root's, None); a write-through write split while
in flight backs every fragment up to storage (as 0.5.13.post1; the seed only the lower part);
under EAGLE prefetch keys are bigram keys like backup keys (0.5.13.post1 hashes raw tokens,
so its EAGLE prefetches never hit); a second prefetch for a request id that has one in flight
is refused; under write-through a prefetch hangs no host-only node below a node without a host
copy (``may_take_host_child``; the seed and 0.5.13.post1 do).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import cache as rules
from . import host
from .core import Ack, CacheState, InsertArgs, Node, Plugin, all_nodes, up
from .errors import InvalidInput, Unsupported
from .keys import common_prefix_len
from .pagekeys import chain_keys, check_units, namespace_prior, split_keys

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")

# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Backup:
    """One write of a node's host copy to storage (the controller's StorageOperation)."""

    serial: int
    node: Node
    keys: tuple[str, ...]
    units: tuple[Any, ...]  # the node's units, page by page what is stored under each key
    lock: object          # the host lock it holds until its ack is drained
    done: bool = False


@dataclasses.dataclass(eq=False)
class Prefetch:
    """One prefetch (the controller's PrefetchOperation plus the cache's ongoing entry)."""

    serial: int
    rid: str
    anchor: Node
    units: tuple[Any, ...]  # the page-aligned units to fetch (the prefetch key)
    extra_key: str | None
    slots: tuple[int, ...]  # the host slots taken for it, one per unit
    last_key: str | None
    anchor_lock: object
    start: int            # the logical clock at submission
    queried: bool = False
    keys: tuple[str, ...] = ()  # the keys of the hit pages (set by the hit query)
    completed: int = 0    # tokens loaded so far
    terminated: bool = False
    transfer_done: bool = False  # the environment released what it will release
    released_from: int | None = None  # slots[released_from:] went to the release queue
    taken: int = 0        # slots[:taken] were handed to the cache (inserted, freed, released)
    loaded: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # (key, units) read


@dataclasses.dataclass(eq=False)
class StorageTier:
    store: dict[str, Any] = dataclasses.field(default_factory=dict)  # key -> units of the page
    backups: list[Backup] = dataclasses.field(default_factory=list)  # submission order
    prefetches: list[Prefetch] = dataclasses.field(default_factory=list)  # the environment's
    ongoing: dict[str, Prefetch] = dataclasses.field(default_factory=dict)  # rid -> the cache's
    ongoing_backup: dict[int, Backup] = dataclasses.field(default_factory=dict)  # by serial
    revoke_queue: list[str] = dataclasses.field(default_factory=list)    # rids
    ack_backup_queue: list[Backup] = dataclasses.field(default_factory=list)
    release_queue: list[Any] = dataclasses.field(default_factory=list)   # host slot pages
    loaded_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # rid -> loaded
    occupied: int = 0     # prefetch_tokens_occupied
    clock: int = 0        # the environment's logical clock
    next_serial: int = 1
    # pending write-through acks split in flight: id(Ack) -> the fragments, top-down
    fragments: dict[int, list[Node]] = dataclasses.field(default_factory=dict)


def attach_storage_tier(state: CacheState) -> None:
    """Give a fresh cache with a host tier its storage tier (``config.storage``)."""
    if state.host is None:
        raise Unsupported("the storage tier needs a host tier (host_slots > 0)")
    state.storage = StorageTier()


def enabled(state: CacheState) -> bool:
    return getattr(state, "storage", None) is not None


def key_mode(state: CacheState) -> str:
    return state.config.storage_key_mode


def capacity_limit(state: CacheState) -> int:
    """The controller's prefetch capacity: 80% of the host pool beyond the device pool's size."""
    return max(0, (4 * (state.config.host_slots - state.config.kv_slots)) // 5)


def query_threshold(state: CacheState) -> int:
    """The controller's threshold on the storage hit (never below one page)."""
    return max(state.config.prefetch_threshold, state.config.page_size)


# ----------------------------------------------------------------------------------------------
# Page keys on nodes (hooks from the tree's rules)
# ----------------------------------------------------------------------------------------------


def prior_of(state: CacheState, parent: Node, extra_key: str | None) -> str | None:
    """The key a child of ``parent`` chains from: the parent's last page key, or under the root
    the namespace of ``extra_key``."""
    if parent.is_root or not parent.page_keys:
        return namespace_prior(extra_key, key_mode(state))
    return parent.page_keys[-1]


def key_new_leaf(state: CacheState, leaf: Node) -> None:
    """A new node's page keys, chained from its parent."""
    leaf.page_keys = chain_keys(leaf.key, state.config.page_size,
                                prior_of(state, up(leaf), leaf.extra_key))


def split_node_keys(state: CacheState, upper: Node, child: Node) -> None:
    """A split cuts the key list; a pending write-through write of ``child`` now covers both
    parts (both are backed up to storage when it is acked)."""
    if child.page_keys is not None:
        upper.page_keys, child.page_keys = split_keys(child.page_keys, len(upper.key),
                                                      state.config.page_size)
    tier = state.storage
    for ack in state.host.writes:
        frags = tier.fragments.get(id(ack), [ack.node])
        if any(f is child for f in frags):
            out = []
            for f in frags:
                out.extend([upper, child] if f is child else [f])
            tier.fragments[id(ack)] = out


def node_expected_keys(state: CacheState, node: Node) -> tuple[str, ...]:
    """The keys a node's pages must carry: the chain over its whole path, this node's part."""
    ps = state.config.page_size
    path = node.path_units()
    keys = chain_keys(path, ps, namespace_prior(node.extra_key, key_mode(state)))
    start = (len(path) - len(node.key)) // ps
    return keys[start:]


def expected_keys_by_node(state: CacheState) -> dict[int, tuple[str, ...]]:
    """``node_expected_keys`` of every node but the root (by ``id``), in one walk down from
    the root.  Where the path above a node fills whole pages, the chain over its path is the
    chain over its parent's path continued from the parent's last key (a key names its whole
    prefix), so each node costs only its own pages; elsewhere the whole path is chained."""
    ps = state.config.page_size
    out: dict[int, tuple[str, ...]] = {}
    # (node, units above it, the expected keys of its parent: () under the root)
    stack: list[tuple[Node, int, tuple[str, ...]]] = [
        (child, 0, ()) for child in state.root.children.values()]
    while stack:
        node, above, parent_keys = stack.pop()
        if above % ps:
            keys = node_expected_keys(state, node)
        else:
            prior = parent_keys[-1] if parent_keys else namespace_prior(node.extra_key,
                                                                        key_mode(state))
            keys = chain_keys(node.key, ps, prior)
        out[id(node)] = keys
        stack.extend((child, above + len(node.key), keys) for child in node.children.values())
    return out


# ----------------------------------------------------------------------------------------------
# Backup to storage
# ----------------------------------------------------------------------------------------------


def after_write_ack(state: CacheState, ack: Ack) -> None:
    """A processed host write backs its node (every fragment, if it was split) up to storage."""
    frags = state.storage.fragments.pop(id(ack), [ack.node])
    for node in frags:
        write_backup_storage(state, node)


def write_backup_storage(state: CacheState, node: Node) -> None:
    """Queue a write of ``node``'s host copy to storage under its page keys; the node is
    host-locked until the write's ack is drained."""
    if not enabled(state) or node.host_value is None or not rules.is_in_tree(state, node):
        return
    tier = state.storage
    assert node.page_keys is not None  # every node has its keys with a storage tier
    backup = Backup(tier.next_serial, node, tuple(node.page_keys), tuple(node.key),
                    host.inc_host_lock_ref(state, node))
    tier.next_serial += 1
    tier.backups.append(backup)
    tier.ongoing_backup[backup.serial] = backup


# ----------------------------------------------------------------------------------------------
# Prefetch
# ----------------------------------------------------------------------------------------------


def prefetch_from_storage(state: CacheState, rid: str, anchor: Node, tokens: list[int],
                          extra_key: str | None) -> int:
    """Start prefetching ``tokens`` (what follows ``anchor``'s path) for request ``rid``.

    Nothing happens (0) when the anchor is neither the root nor backed up (the scheduler's
    condition), below ``prefetch_threshold`` aligned units or while the prefetches in flight
    occupy the capacity.  Otherwise the anchor is host-locked and host slots are taken
    for every unit, evicting host leaves once if short (the seed evicts as many tokens as the
    prefetch wants), else cut to what is free if that still reaches the threshold.  Returns the
    units requested."""
    tier = state.storage
    if not isinstance(rid, str):
        raise InvalidInput(f"prefetch: rid must be a string, got {rid!r}")
    if rid in tier.ongoing:
        raise InvalidInput(f"prefetch: request {rid!r} already has a prefetch in flight")
    tokens = rules.check_int_list("tokens", tokens)
    if state.config.disable or (not anchor.is_root and anchor.host_value is None):
        return 0  # the scheduler prefetches only below the root or a backed-up node
    ps = state.config.page_size
    units = rules.aligned_units(state, tokens)
    if not anchor.is_root:
        extra_key = anchor.extra_key
    if len(units) < state.config.prefetch_threshold or tier.occupied >= capacity_limit(state):
        return 0
    lock = host.inc_host_lock_ref(state, anchor)
    pool = state.host.pool
    n = len(units)
    if pool.available_size() < n:
        host.evict_host(state, n)
    if pool.available_size() < n:
        avail = pool.available_size()
        n = avail - avail % ps
        if n < state.config.prefetch_threshold:
            host.dec_host_lock_ref(state, lock)
            return 0
        units = units[:n]
    slots = tuple(pool.alloc(n))
    last_key = prior_of(state, anchor, extra_key)
    op = Prefetch(tier.next_serial, rid, anchor, tuple(units), extra_key, slots, last_key, lock,
                  tier.clock)
    tier.next_serial += 1
    tier.prefetches.append(op)
    tier.ongoing[rid] = op
    tier.occupied += n
    return n


def completed_all(state: CacheState, op: Prefetch) -> bool:
    return len(op.keys) > 0 and op.completed == len(op.keys) * state.config.page_size


def timed_out(state: CacheState, op: Prefetch) -> bool:
    c = state.config
    clock: int = state.storage.clock
    return clock - op.start > c.prefetch_timeout_base + len(op.keys) * c.prefetch_timeout_per_page


def can_terminate_prefetch(state: CacheState, op: Prefetch) -> bool:
    """The stop policy: ``best_effort`` stops at once; ``wait_complete`` when every hit page is
    loaded; ``timeout`` then too, or once the clock passed base + per-page cost; any policy
    when the prefetch ended itself (a miss while loading)."""
    policy = state.config.prefetch_stop_policy
    if policy == "best_effort":
        return True
    done = completed_all(state, op)
    can = done if policy == "wait_complete" else (done or timed_out(state, op))
    return can or op.terminated


def check_prefetch_progress(state: CacheState, rid: str) -> bool:
    """True when ``rid`` has no prefetch in flight (any more).  A prefetch the stop policy lets
    end is terminated: the pages loaded so far are inserted below the anchor as host-only nodes
    (pages the tree already holds are freed), the anchor is unlocked, and the tokens newly
    loaded are kept for ``pop_prefetch_loaded_tokens``."""
    tier = state.storage
    op = tier.ongoing.get(rid)
    if op is None:
        return True
    if not can_terminate_prefetch(state, op):
        return False
    op.terminated = True
    done = op.completed
    ps = state.config.page_size
    prefix_len, inserted = insert_host(state, op.anchor, op.extra_key, op.units[:done],
                                       op.slots[:done], op.keys[: done // ps])
    # the slots of pages the tree already held, and of pages it may not take (see insert_host)
    state.host.pool.free(list(op.slots[:prefix_len]) + list(op.slots[prefix_len + inserted:done]))
    op.taken = done
    host.dec_host_lock_ref(state, op.anchor_lock)
    del tier.ongoing[rid]
    tier.occupied -= len(op.units)
    tier.loaded_tokens[rid] = inserted
    forget_if_finished(tier, op)
    return True


def may_take_host_child(state: CacheState, node: Node) -> bool:
    """Whether a prefetch may hang new host-only pages below ``node``: under write-through only
    below the root or a backed-up node (the backup rule "a backed-up node has a backed-up
    parent", spec/host.py ``write_backup``).  A prefetch's anchor is backed up, but the walk
    below it can end in a device-only node (its write-through backup failed for lack of host
    room, or it has not reached the threshold yet); a host-only child there would be lost when
    that node is evicted (write-through deletes a device leaf without a copy).  Under
    write-back a device-only node is backed up when evicted, so any node may take it."""
    return host.write_back_policy(state) or node.is_root or host.backed_up(node)


def insert_host(state: CacheState, node: Node, extra_key: str | None, units: tuple[Any, ...],
                slots: tuple[int, ...], keys: tuple[str, ...]) -> tuple[int, int]:
    """Insert host-only pages below ``node`` (the seed's ``_insert_helper_host``): walk the
    matching children (touching each, splitting a partial match); the rest becomes one new
    evicted node holding the host slots and keys, when the node the walk ended in may take it
    (``may_take_host_child``; else the rest is dropped, 0.5.13.post1 inserts it anyway).
    Returns the length the tree already had and the length inserted."""
    rules.touch(state, node)
    ps = state.config.page_size
    matched = 0
    while units:
        child = rules.find_child(state, node, extra_key, units)
        if child is None:
            break
        rules.touch(state, child)
        shared = common_prefix_len(child.key, units, ps)
        units, slots, keys = units[shared:], slots[shared:], keys[shared // ps:]
        matched += shared
        if shared < len(child.key):
            child = rules.split_node(state, child, shared)
        node = child
    if not units or not may_take_host_child(state, node):
        return matched, 0
    leaf = Node(key=tuple(units), extra_key=extra_key, parent=node,
                value=None, stamp=(rules.tick(state), 0), host_value=tuple(slots),
                page_keys=tuple(keys))
    node.children[rules.child_key_of(state, leaf.extra_key, leaf.key)] = leaf
    return matched, len(units)


def terminate_prefetch(state: CacheState, rid: str) -> None:
    """Mark ``rid``'s prefetch terminated (it loads nothing more); it stays in flight until
    ``check_prefetch_progress``."""
    op = state.storage.ongoing.get(rid)
    if op is not None:
        op.terminated = True


def pop_prefetch_loaded_tokens(state: CacheState, rid: str) -> int:
    loaded: int = state.storage.loaded_tokens.pop(rid, 0)
    return loaded


def release_aborted_request(state: CacheState, rid: str) -> None:
    """An aborted request's prefetch is terminated and dropped: the anchor is unlocked and the
    slots loaded so far go to the release queue (the environment releases the rest)."""
    tier = state.storage
    tier.loaded_tokens.pop(rid, None)
    op = tier.ongoing.pop(rid, None)
    if op is None:
        return
    op.terminated = True
    done = op.completed
    host.dec_host_lock_ref(state, op.anchor_lock)
    release(state, op.slots[:done])
    op.taken = done
    tier.occupied -= len(op.units)
    forget_if_finished(tier, op)


def release(state: CacheState, slots: tuple[int, ...]) -> None:
    """Host slots go to the release queue, page by page."""
    ps = state.config.page_size
    for k in range(0, len(slots), ps):
        state.storage.release_queue.append(tuple(slots[k: k + ps]))


def forget_if_finished(tier: StorageTier, op: Prefetch) -> None:
    if op.transfer_done and op.rid not in tier.ongoing and any(p is op for p in tier.prefetches):
        tier.prefetches.remove(op)


# ----------------------------------------------------------------------------------------------
# Draining the control queues
# ----------------------------------------------------------------------------------------------


def drain_storage_control_queues(state: CacheState) -> None:
    """Revoked prefetches leave (anchor unlocked), acked backups release their host locks, and
    released host slots go back to the host pool."""
    tier = state.storage
    while tier.revoke_queue:
        rid = tier.revoke_queue.pop(0)
        op = tier.ongoing.pop(rid, None)
        if op is None:
            continue
        host.dec_host_lock_ref(state, op.anchor_lock)
        tier.occupied = max(0, tier.occupied - len(op.units))
        forget_if_finished(tier, op)
    while tier.ack_backup_queue:
        backup = tier.ack_backup_queue.pop(0)
        if tier.ongoing_backup.pop(backup.serial, None) is not None:
            host.dec_host_lock_ref(state, backup.lock)
    slots = [s for page in tier.release_queue for s in page]
    tier.release_queue.clear()
    if slots:
        state.host.pool.free(slots)


# ----------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------


def check_k(name: str, k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise InvalidInput(f"{name} must be an int >= -1, got {k!r}")
    return k


def storage_backup(state: CacheState, count: int) -> int:
    """The environment writes the ``count`` oldest pending backups (-1: all): every page is
    stored under its key, and each backup is acked.  Returns the backups written."""
    check_k("storage_backup: count", count)
    tier = state.storage
    ps = state.config.page_size
    done = 0
    while tier.backups and count != 0:
        b = tier.backups.pop(0)
        for i, key in enumerate(b.keys):
            tier.store[key] = tuple(b.units[i * ps: (i + 1) * ps])
        b.done = True
        tier.ack_backup_queue.append(b)
        done += 1
        count -= 1
    return done


def storage_query(state: CacheState, count: int) -> int:
    """The environment runs the hit query of the ``count`` oldest prefetches not yet queried
    (-1: all).  Returns how many it ran."""
    check_k("storage_query: count", count)
    tier = state.storage
    ran = 0
    for op in list(tier.prefetches):
        if count == 0:
            break
        if op.queried:
            continue
        hit_query(state, op)
        ran += 1
        count -= 1
    return ran


def hit_query(state: CacheState, op: Prefetch) -> None:
    """The storage hit: the longest run of stored pages from the first.  Below the controller's
    threshold the request is revoked and every slot released; else the slots beyond the hit
    are released and the hit pages wait for ``storage_load``."""
    tier = state.storage
    ps = state.config.page_size
    keys = chain_keys(op.units, ps, op.last_key)
    hit = 0
    while hit < len(keys) and keys[hit] in tier.store:
        hit += 1
    op.queried = True
    if hit * ps < query_threshold(state):
        tier.revoke_queue.append(op.rid)
        release(state, op.slots)
        op.released_from = 0
        op.transfer_done = True
        tier.prefetches.remove(op)
        return
    op.keys = keys[:hit]
    release(state, op.slots[hit * ps:])
    op.released_from = hit * ps


def storage_load(state: CacheState, rid: str, pages: int) -> int:
    """The environment reads the next ``pages`` pages (-1: all) of ``rid``'s oldest prefetch
    in flight (queried, transfer not ended; none: nothing happens).  A terminated prefetch reads
    nothing; a page no longer stored ends the transfer (and terminates the prefetch).  When the
    transfer ends, the slots not loaded are released.  Returns the pages read."""
    check_k("storage_load: pages", pages)
    tier = state.storage
    op = next((p for p in tier.prefetches
               if p.rid == rid and p.queried and not p.transfer_done), None)
    if op is None:
        return 0
    ps = state.config.page_size
    read = 0
    while pages != 0 and not op.terminated and op.completed < len(op.keys) * ps:
        key = op.keys[op.completed // ps]
        if key not in tier.store:
            op.terminated = True
            break
        op.loaded.append((key, tier.store[key]))
        op.completed += ps
        read += 1
        pages -= 1
    if op.terminated or op.completed == len(op.keys) * ps:
        end_transfer(state, op)
    return read


def end_transfer(state: CacheState, op: Prefetch) -> None:
    release(state, op.slots[op.completed: op.released_from])
    op.released_from = op.completed
    op.transfer_done = True
    forget_if_finished(state.storage, op)


def storage_tick(state: CacheState, ticks: int) -> None:
    if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
        raise InvalidInput(f"storage_tick: ticks must be an int >= 0, got {ticks!r}")
    state.storage.clock += ticks


def attach_storage_backend(state: CacheState) -> tuple[bool, str]:
    """Runtime attach: the seed (and 0.5.13.post1) refuse it on the unified cache, changing
    nothing; storage is configured at startup (``config.storage``)."""
    return False, "runtime storage attach is not supported; configure storage at startup"


def detach_storage_backend(state: CacheState) -> tuple[bool, str]:
    """Runtime detach: refused like attach, changing nothing."""
    return False, "runtime storage detach is not supported; restart without storage"


def clear_storage(state: CacheState) -> bool:
    """The backend is cleared: nothing stays stored (operations in flight carry on; a page read
    after this is a miss)."""
    state.storage.store.clear()
    return True


# ----------------------------------------------------------------------------------------------
# Reset
# ----------------------------------------------------------------------------------------------


def reset_storage_tier(state: CacheState) -> None:
    """Flush: the cache forgets its prefetches and backups in flight (the host pool they held
    is cleared with the host tier); the store and the clock stay."""
    tier = state.storage
    store, clock = tier.store, tier.clock
    state.storage = StorageTier(store=store, clock=clock)


# ----------------------------------------------------------------------------------------------
# The plug-in: the storage tier's hooks in the tree's and the host tier's rules
# ----------------------------------------------------------------------------------------------


class StorageTierPlugin(Plugin):
    def split(self, state: CacheState, upper: Node, child: Node, split_len: int) -> None:
        split_node_keys(state, upper, child)

    def check_insert(self, state: CacheState, plan: list[tuple[Node, int]],
                     value: tuple[int, ...], args: InsertArgs) -> InsertArgs:
        """A page key holds each token as 4 bytes: a new unit's token outside [0, 2**32) is
        refused before the insert changes anything (the units the tree holds were checked)."""
        check_units(args.units[sum(shared for _, shared in plan):])
        return args

    def new_leaf(self, state: CacheState, leaf: Node) -> None:
        key_new_leaf(state, leaf)

    def after_write_ack(self, state: CacheState, ack: Ack) -> None:
        after_write_ack(state, ack)

    def check_events(self, state: CacheState) -> None:
        drain_storage_control_queues(state)

    def held_host_slots(self, state: CacheState) -> list[int]:
        return held_host_slots(state)

    def reset(self, state: CacheState) -> None:
        reset_storage_tier(state)


STORAGE_PLUGIN = StorageTierPlugin()


# ----------------------------------------------------------------------------------------------
# Queries and invariants
# ----------------------------------------------------------------------------------------------


def held_host_slots(state: CacheState) -> list[int]:
    """Host slots the storage tier holds outside the tree: the prefetches' not yet handed over
    or released, and the release queue's."""
    tier = state.storage
    out = [s for page in tier.release_queue for s in page]
    seen = set()
    for op in list(tier.ongoing.values()) + tier.prefetches:
        if id(op) in seen:
            continue
        seen.add(id(op))
        end = len(op.slots) if op.released_from is None else op.released_from
        out.extend(op.slots[op.taken: end])
    return out


def storage_invariants(state: CacheState) -> list[str]:
    if not enabled(state):
        return []
    errors = []
    tier = state.storage
    ps = state.config.page_size
    by_node = expected_keys_by_node(state)
    for node in all_nodes(state):
        if node.is_root:
            continue
        if node.page_keys is None or tuple(node.page_keys) != by_node[id(node)]:
            errors.append(f"[storage-keys] {node!r}: page keys do not match its tokens")
    for op in tier.prefetches + list(tier.ongoing.values()):
        expected = chain_keys(op.units, ps, op.last_key)
        if tuple(op.keys) != tuple(expected[: len(op.keys)]):
            errors.append(f"[storage-load] prefetch of {op.rid!r}: hit keys off the chain")
        for i, (key, units) in enumerate(op.loaded):
            if key != expected[i] or tuple(units) != tuple(op.units[i * ps: (i + 1) * ps]):
                errors.append(f"[storage-load] prefetch of {op.rid!r}: page {i} loaded data "
                              "not stored under its key")
        if op.completed != len(op.loaded) * ps:
            errors.append(f"[storage-load] prefetch of {op.rid!r}: completed tokens disagree "
                          "with the pages read")
    for rid, op in tier.ongoing.items():
        if op.rid != rid or not rules.is_in_tree(state, op.anchor) and not op.anchor.is_root:
            errors.append(f"[storage] prefetch of {rid!r}: its anchor is not in the tree")
    occupied = sum(len(op.units) for op in tier.ongoing.values())
    if occupied != tier.occupied:
        errors.append(f"[storage] prefetch_tokens_occupied={tier.occupied}, in flight {occupied}")
    for serial, b in tier.ongoing_backup.items():
        if b.node.host_lock_ref <= 0:
            errors.append(f"[storage] backup {serial} of {b.node!r} does not hold a host lock")
    slots = held_host_slots(state)
    if len(set(slots)) != len(slots):
        errors.append("[storage] host slots held twice by prefetches / the release queue")
    tree = set(host.host_tree_slots(state))
    both = sorted(set(slots) & tree)
    if both:
        errors.append(f"[storage] host slots held by both the tree and a prefetch: {both[:8]}")
    return errors
