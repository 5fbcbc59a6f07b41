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
this order: data and pools, match validators, split, insert hooks, locks, eviction (priorities,
cascade, per-component LRU), queries and invariants.

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
from typing import Callable, Optional

from .errors import InvalidInput
from .state import CacheState, LockHandle, Node, all_nodes

AUX = ("swa", "mamba")

# Eviction priority on a leaf / on an internal node: higher is evicted later, and evicting a
# component on a node also evicts every component of lower or equal priority there (cascade).
PRIORITY = {"full": (0, 2), "swa": (0, 1), "mamba": (0, 0)}


@dataclasses.dataclass(eq=False)
class AuxData:
    """One aux component's data on one node."""

    value: Optional[tuple] = None  # SWA: one SWA slot per unit; Mamba: (state slot,); None = none
    lock_ref: int = 0
    boundary: Optional[int] = None  # SWA: the mark of the node where a window lock stopped
    # Full + SWA + Mamba: (the stamp the node's place in this list dates from, the node stamp
    # it holds for); see refresh_mamba_only.  Outdated as soon as the node is stamped again.
    lru_pin: Optional[tuple[tuple[int, int], tuple[int, int]]] = None


def aux_names(state: CacheState) -> tuple:
    return tuple(c for c in state.config.components if c in AUX)


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
    return state.config.sliding_window


# ----------------------------------------------------------------------------------------------
# Match validators: may a match stop at this node?
# ----------------------------------------------------------------------------------------------


def match_validators(state: CacheState) -> list[Callable[[Node], bool]]:
    """One predicate per aux component, fed the matched nodes top-down (Full needs nothing
    more: the walk only visits nodes with device data)."""
    out = []
    for name in aux_names(state):
        out.append(swa_validator(window(state)) if name == "swa" else mamba_validator)
    return out


def swa_validator(window_len: int) -> Callable[[Node], bool]:
    """SWA: the contiguous run of SWA data ending at the node must reach one window.  The run
    starts unbounded at the root and restarts at 0 after a tombstone."""
    run = [float("inf")]

    def valid(node: Node) -> bool:
        if not has(node, "swa"):
            run[0] = 0
            return False
        run[0] += len(node.key)
        return run[0] >= window_len

    return valid


def mamba_validator(node: Node) -> bool:
    """Mamba: the node itself holds a state."""
    return has(node, "mamba")


def branching_seqlen(state: CacheState, walked_len: int, best_chunks: int, walked_chunks: int
                     ) -> Optional[int]:
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


# ----------------------------------------------------------------------------------------------
# Split: aux data follows the cut
# ----------------------------------------------------------------------------------------------


def split_aux(state: CacheState, upper: Node, child: Node, split_len: int) -> None:
    """SWA: the values are cut at the same point, the upper part inherits the lock count and
    takes the lock-boundary mark (a window lock that stopped at the child stops at its top
    part now).  Mamba: the state stays on the child; the upper part has none and no lock."""
    for name in aux_names(state):
        c = data(child, name)
        u = data(upper, name)
        if name == "swa":
            u.lock_ref = c.lock_ref
            if c.value is not None:
                u.value, c.value = c.value[:split_len], c.value[split_len:]
            u.boundary, c.boundary = c.boundary, None
        else:
            u.value, u.lock_ref = None, 0


# ----------------------------------------------------------------------------------------------
# Insert hooks
# ----------------------------------------------------------------------------------------------


def check_aux_args(state: CacheState, mamba_value, swa_evicted_seqlen) -> int:
    """The aux arguments an insert may carry at all in this config, checked even where the
    insert then does nothing (a disabled cache): ``swa_evicted_seqlen`` a whole number of
    pages and only with SWA, ``mamba_value`` only with Mamba.  Returns ``swa_evicted_seqlen``."""
    from .cache import check_count
    names = aux_names(state)
    swa_evicted_seqlen = check_count("swa_evicted_seqlen", swa_evicted_seqlen)
    if swa_evicted_seqlen and "swa" not in names:
        raise InvalidInput("insert: swa_evicted_seqlen needs the SWA component")
    if swa_evicted_seqlen % state.config.page_size:
        raise InvalidInput(f"insert: swa_evicted_seqlen={swa_evicted_seqlen} is not whole pages")
    if mamba_value is not None and "mamba" not in names:
        raise InvalidInput("insert: mamba_value needs the Mamba component")
    return swa_evicted_seqlen


def check_insert_aux(state: CacheState, plan: list, prev_prefix_len: int,
                     mamba_value, swa_evicted_seqlen) -> tuple:
    """Check the aux arguments of an insert (nothing changes on failure); returns them
    normalised: ``(mamba_value tuple or None, swa_evicted_seqlen int)``."""
    from .cache import check_int_list
    names = aux_names(state)
    swa_evicted_seqlen = check_aux_args(state, mamba_value, swa_evicted_seqlen)
    if "swa" in names:
        start = 0
        for node, shared in plan:
            inside = start < prev_prefix_len < start + shared
            if inside and node.value is not None and not has(node, "swa") \
                    and swa_evicted_seqlen < start + shared:
                raise InvalidInput("insert: prev_prefix_len falls inside an SWA tombstone that "
                                   "this insert would restore (its own slots would be freed)")
            start += shared
    if "mamba" not in names:
        if mamba_value is not None:
            raise InvalidInput("insert: mamba_value needs the Mamba component")
        return None, swa_evicted_seqlen
    if mamba_value is None:
        raise InvalidInput("insert: the Mamba component needs a mamba_value")
    mv = tuple(check_int_list("mamba_value", mamba_value))
    if len(mv) != 1:
        raise InvalidInput(f"insert: mamba_value must be one slot, got {list(mv)}")
    if not state.mamba.is_allocated(mv[0]):
        raise InvalidInput(f"insert: mamba slot {mv[0]} is not allocated")
    if any(has(n, "mamba") and n.aux["mamba"].value == mv for n in all_nodes(state)):
        raise InvalidInput(f"insert: mamba slot {mv[0]} is already the tree's")
    return mv, swa_evicted_seqlen


def insert_overlap(state: CacheState, node: Node, start: int, shared: int, fresh: tuple,
                   prev_prefix_len: int, swa_evicted_seqlen: int) -> int:
    """An insert walks through ``node`` (device data, ``shared`` units from ``start``), where
    ``fresh`` are the request's slots for those units.  Returns where in ``fresh`` a component
    took the slots over (``shared`` when none did); the caller frees the duplicates before it.

    SWA overlap ownership: an SWA tombstone whose units the request computed itself (past
    ``prev_prefix_len``) and that lie inside the request's window (from
    ``swa_evicted_seqlen`` on) takes the request's slots: its old full slots are freed and the
    fresh ones, with their SWA slots, become its data.  When the window starts inside the node,
    the node is split there first and only the part inside takes them.

    Except where a lock holds the tombstone (``swa_tombstone_held``): another request's matched
    prefix runs through it and reads its full slots, so they are never freed; the tombstone
    keeps them and stays a tombstone, and the request's slots are duplicates, freed as in Full.
    (The seed frees them: issue 18; docs/SPEC.md.)
    """
    if "swa" not in aux_names(state) or prev_prefix_len >= start + shared or has(node, "swa"):
        return shared
    if swa_tombstone_held(node):
        return shared
    from .cache import split_node
    if swa_evicted_seqlen <= start:
        state.kv.free(list(node.value))
        restore_swa(state, node, fresh)
        return 0
    if swa_evicted_seqlen < start + shared:
        cut = swa_evicted_seqlen - start
        state.kv.free(list(node.value[cut:]))
        split_node(state, node, cut)
        restore_swa(state, node, fresh[cut:])
        return cut
    return shared


def swa_tombstone_held(node: Node) -> bool:
    """An SWA tombstone (Full data, no SWA data) that a lock holds: some holder's matched
    prefix runs through it and reads its full slots."""
    return node.value is not None and not has(node, "swa") and node.lock_ref > 0


def restore_swa(state: CacheState, node: Node, full_value: tuple) -> None:
    """A node takes ``full_value`` as its Full data and the mapped SWA slots as its SWA data."""
    node.value = tuple(full_value)
    data(node, "swa").value = state.kv.translate(node.value)


def recover_after_unevict(state: CacheState, node: Node, start: int,
                          swa_evicted_seqlen: int) -> None:
    """An evicted node an insert gave device data back (``cache.unevict``) gets its SWA data
    back from the fresh slots too, for the part inside the request's window."""
    if "swa" not in aux_names(state) or has(node, "swa"):
        return
    from .cache import split_node
    if swa_evicted_seqlen <= start:
        restore_swa(state, node, node.value)
    elif swa_evicted_seqlen < start + len(node.key):
        split_node(state, node, swa_evicted_seqlen - start)
        restore_swa(state, node, node.value)


def skip_leaf(state: CacheState, start: int, rest_len: int, swa_evicted_seqlen: int) -> bool:
    """SWA: a new leaf wholly outside the request's window would be born a tombstone; the
    insert does not create it (and frees its slots)."""
    return "swa" in aux_names(state) and swa_evicted_seqlen >= start + rest_len


def commit_insert(state: CacheState, node: Node, is_new_leaf: bool, start: int,
                  swa_evicted_seqlen: int, mamba_value: Optional[tuple]) -> bool:
    """After the walk, the aux data of the insert's last node.  Returns ``mamba_exist``.

    SWA (new leaves only): the part inside the window (from ``swa_evicted_seqlen`` on; the
    leaf is split there when the window starts inside it) takes the mapped SWA slots.
    Mamba: a new leaf, or a node without a state, takes ``mamba_value`` and becomes the most
    recent; a node that has a state keeps it, becomes the most recent, and the insert answers
    ``mamba_exist`` (the caller keeps its slot).
    """
    from .cache import split_node
    exist = False
    for name in aux_names(state):
        if name == "swa":
            if not is_new_leaf:
                continue
            cut = swa_evicted_seqlen - start
            if cut < len(node.key):
                if cut > 0:
                    split_node(state, node, cut)
                data(node, "swa").value = state.kv.translate(node.value)
        else:
            d = data(node, "mamba")
            if is_new_leaf:
                d.value = mamba_value
            elif d.value is None:
                d.value = mamba_value
                refresh_mamba_only(state, node)
            else:
                refresh_mamba_only(state, node)
                exist = True
    return exist


def refresh_mamba_only(state: CacheState, node: Node) -> None:
    """A state committed to an existing node stamps it and moves it to the front of the Mamba
    list only: with SWA too, the node keeps its place in the SWA list (a split on the insert's
    way may have put another node in front of it there since its last stamp).  That place is
    pinned to the stamp it dates from, for as long as the node keeps the new stamp."""
    from .cache import touch
    swa = node.aux.get("swa")
    since = None
    if swa is not None and swa.value is not None:
        since = lru_key(node, "swa")
    touch(state, node)
    if swa is not None and since is not None:
        swa.lru_pin = (since, node.stamp)


# ----------------------------------------------------------------------------------------------
# Locks
# ----------------------------------------------------------------------------------------------


def lock_aux(state: CacheState, handle: LockHandle) -> None:
    """After the Full path lock: SWA locks one window of SWA data above the node (skipping
    tombstones) and marks the node where the window filled up; Mamba locks the node itself."""
    for name in aux_names(state):
        if name == "swa":
            handle.aux["swa"] = lock_swa_window(state, handle.node)
        else:
            handle.aux["mamba"] = lock_mamba_node(handle.node)


def lock_swa_window(state: CacheState, node: Node) -> tuple:
    """Returns ``(skipped nodes, boundary mark or None)`` for the unlock."""
    size, skipped, boundary = 0, [], None
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
        cur = cur.parent
    return tuple(skipped), boundary


def lock_mamba_node(node: Node) -> bool:
    """Returns whether the node was locked (it was skipped when it held no state)."""
    if node.is_root or not has(node, "mamba"):
        return False
    data(node, "mamba").lock_ref += 1
    return True


def unlock_aux(state: CacheState, handle: LockHandle) -> None:
    for name in aux_names(state):
        if name not in handle.aux:
            continue
        if name == "swa":
            unlock_swa_window(handle.node, *handle.aux["swa"])
        elif handle.aux["mamba"]:
            d = data(handle.node, "mamba")
            if d.lock_ref > 0:
                d.lock_ref -= 1


def unlock_swa_window(node: Node, skipped: tuple, boundary: Optional[int]) -> None:
    """Walk up from the node: skip the nodes the lock skipped and nodes without an SWA lock,
    take one lock off the others, and stop after the node carrying the lock's boundary mark
    (at the root when the window never filled up)."""
    cur = node
    while not cur.is_root:
        d = data(cur, "swa")
        if any(cur is s for s in skipped) or d.lock_ref == 0:
            cur = cur.parent
            continue
        d.lock_ref -= 1
        if boundary is not None and d.boundary == boundary:
            return
        cur = cur.parent


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


def drop_aux(state: CacheState, node: Node, name: str, tracker: dict) -> None:
    """Free one component's device data on a node (it becomes a tombstone for it)."""
    d = data(node, name)
    if d.value is None:
        return
    assert d.lock_ref == 0
    tracker[name] = tracker.get(name, 0) + len(d.value)
    if name == "swa":
        state.kv.free_swa(list(node.value))
    else:
        state.mamba.free(list(d.value))
    d.value = None


def drop_all_aux(state: CacheState, node: Node, tracker: dict) -> None:
    """A device leaf leaves the tree: every aux component's data goes with it."""
    for name in aux_names(state):
        drop_aux(state, node, name, tracker)


def cascade(state: CacheState, node: Node, trigger: str, is_leaf: bool, tracker: dict) -> None:
    """Evicting ``trigger`` on a node also evicts the other aux components of lower or equal
    priority there (Full is only ever evicted with its leaf)."""
    which = 0 if is_leaf else 1
    for name in aux_names(state):
        if name != trigger and PRIORITY[name][which] <= PRIORITY[trigger][which]:
            drop_aux(state, node, name, tracker)


def evict_aux(state: CacheState, name: str, request: int, tracker: dict) -> None:
    """Free at least ``request`` units of one component: walk its LRU list oldest first,
    skipping nodes it has locked; a device leaf is evicted whole (it leaves the tree), any
    other node becomes a tombstone for the component (cascading to lower priorities).  The
    order is the list's at the start: eviction changes no stamp and no lock."""
    from .cache import evict_device_leaf
    from .queries import is_device_leaf
    for node in [n for n in lru_order(state, name) if data(n, name).lock_ref == 0]:
        if tracker.get(name, 0) >= request:
            return
        if not has(node, name):
            continue
        if is_device_leaf(node):
            tracker["full"] = tracker.get("full", 0) + len(node.value)
            drop_all_aux(state, node, tracker)
            evict_device_leaf(state, node)
        else:
            drop_aux(state, node, name, tracker)
            cascade(state, node, name, False, tracker)


def evict(state: CacheState, num_tokens: int, swa_num_tokens: int = 0, mamba_num: int = 0
          ) -> dict:
    """The seed's ``evict``: Full drives first (oldest device leaves, whole), then each aux
    component drives its own request from its LRU list.  Each component stops as soon as the
    units freed of it, by any driver, reach its request.  Returns the units freed per
    component."""
    from .cache import check_count, evict_device_leaf
    from .queries import oldest_device_leaf
    check_count("num_tokens", num_tokens)
    requests = {"swa": check_count("swa_num_tokens", swa_num_tokens),
                "mamba": check_count("mamba_num", mamba_num)}
    tracker = {"full": 0, "swa": 0, "mamba": 0}
    if state.config.disable:
        return tracker
    while tracker["full"] < num_tokens:
        victim = oldest_device_leaf(state)
        if victim is None:
            break
        drop_all_aux(state, victim, tracker)
        tracker["full"] += evict_device_leaf(state, victim)
    for name in aux_names(state):
        evict_aux(state, name, requests[name], tracker)
    return tracker


# ----------------------------------------------------------------------------------------------
# Queries and invariants
# ----------------------------------------------------------------------------------------------


def aux_size(state: CacheState, name: str, locked: bool) -> int:
    """Units of the component's data in nodes it has locked (protected) or not (evictable)."""
    return sum(len(d.value) for n in all_nodes(state) if not n.is_root
               for d in [n.aux.get(name)] if d is not None and d.value is not None
               and (d.lock_ref > 0) == locked)


def sizes(state: CacheState) -> dict:
    out = {}
    for name in aux_names(state):
        out[f"{name}_evictable"] = aux_size(state, name, False)
        out[f"{name}_protected"] = aux_size(state, name, True)
    return out


def aux_invariants(state: CacheState) -> list[str]:
    """Aux data needs Full data; SWA data is the mapped SWA slots of the Full data; a Mamba
    state is one allocated slot held once; locks are never negative, sit on data only and
    never exceed the Full lock on the same node; the root holds no aux data."""
    errors = []
    names = aux_names(state)
    held: dict = {}
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
            if name == "swa":
                if d.value != state.kv.translate(node.value) or 0 in d.value:
                    errors.append(f"[aux] {node!r} SWA slots are not the mapped ones")
                elif any(not state.kv.swa.is_allocated(s) for s in d.value):
                    errors.append(f"[aux] {node!r} holds SWA slots the pool says are free")
            else:
                if len(d.value) != 1 or not state.mamba.is_allocated(d.value[0]):
                    errors.append(f"[aux] {node!r} Mamba state {d.value} is not one allocated slot")
                elif d.value[0] in held:
                    errors.append(f"[aux] Mamba slot {d.value[0]} held twice")
                else:
                    held[d.value[0]] = node
    return errors
