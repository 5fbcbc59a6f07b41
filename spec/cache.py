"""The rules of the device tier (Full component): one function per rule, named after it.

Read top to bottom like a state machine: input checks, the clock, the tree rules
(``split_node``, ``match_prefix``, ``insert``), locks, eviction, reset.  Every public rule checks
its whole input before it changes anything, so a rejected call leaves the state as it was.

Access stamps are a logical clock (docs/DESIGN.md): every touch takes the next tick; a match stamps
its path so that ancestors are older than descendants but newer than anything stamped before.
A stamp is the pair ``(tick, rank)``, compared lexicographically; ordinary touches have rank 0,
and a match at tick T gives the node k steps above the matched node ``(T, -k)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from . import policies
from .core import CacheState, InsertArgs, LockHandle, MatchOutcome, MatchWalk, Node, new_root, up
from .errors import AllocatorError, HandleError, InvalidInput, NodeNotFound
from .keys import common_prefix_len, namespaced_child_key, oldest, page_aligned_len, split_point_ok, to_units
from .queries import device_leaves, oldest_device_leaf, tree_slots

# ----------------------------------------------------------------------------------------------
# Input checks (all raise InvalidInput and touch nothing)
# ----------------------------------------------------------------------------------------------


def check_int_list(name: str, xs: Any) -> list[int]:
    if not isinstance(xs, (list, tuple)):
        raise InvalidInput(f"{name} must be a list of ints, got {type(xs).__name__}")
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int):
            raise InvalidInput(f"{name} must hold ints only, found {x!r}")
    return list(xs)


def check_extra_key(extra_key: Any) -> str | None:
    if extra_key is not None and not isinstance(extra_key, str):
        raise InvalidInput(f"extra_key must be null or a string, got {extra_key!r}")
    return extra_key


def check_count(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidInput(f"{name} must be a non-negative int, got {n!r}")
    return n


def check_flag(name: str, b: Any) -> bool:
    if not isinstance(b, bool):
        raise InvalidInput(f"{name} must be true or false, got {b!r}")
    return b


def aligned_units(state: CacheState, tokens: Sequence[int]) -> tuple[Any, ...]:
    """The key the tree sees for a token list: bigram view under EAGLE, cut to whole pages."""
    units = to_units(tokens, state.config.eagle)
    return units[: page_aligned_len(len(units), state.config.page_size)]


# ----------------------------------------------------------------------------------------------
# The clock
# ----------------------------------------------------------------------------------------------


def tick(state: CacheState) -> int:
    state.clock += 1
    return state.clock


def touch(state: CacheState, node: Node) -> None:
    """A node is used: it becomes the most recently accessed."""
    node.stamp = (tick(state), 0)


def stamp_match_path(state: CacheState, node: Node) -> None:
    """After a match, the matched node and all its ancestors become the most recent, the
    matched node newest, each ancestor a little older than its child."""
    t = tick(state)
    rank = 0
    cur: Node | None = node
    while cur is not None:
        cur.stamp = (t, rank)
        rank -= 1
        cur = cur.parent


# ----------------------------------------------------------------------------------------------
# Tree structure
# ----------------------------------------------------------------------------------------------


def child_key_of(state: CacheState, extra_key: str | None, units: Sequence[Any]
                 ) -> tuple[Any, ...]:
    return namespaced_child_key(extra_key, units, state.config.page_size)


def find_child(state: CacheState, node: Node, extra_key: str | None, units: Sequence[Any]
               ) -> Node | None:
    """The child of ``node`` whose first page equals the first page of ``units``, if any."""
    if len(units) < state.config.page_size:
        return None
    return node.children.get(child_key_of(state, extra_key, units))


def split_node(state: CacheState, child: Node, split_len: int) -> Node:
    """Cut ``child`` after ``split_len`` units: a new node takes the first part (and the child's
    place under its parent), the child keeps the rest below it.  The new node inherits the
    child's lock count (every lock through the child also runs through its prefix); values are
    cut at the same point.  Stamps: the new node takes a tick, then the child takes the next.
    """
    assert split_point_ok(len(child.key), split_len, state.config.page_size)
    parent = child.parent
    assert parent is not None
    upper = Node(
        key=child.key[:split_len],
        extra_key=child.extra_key,
        parent=parent,
        value=None if child.value is None else child.value[:split_len],
        stamp=(tick(state), 0),
        lock_ref=child.lock_ref,
    )
    policies.inherit_on_split(state, upper, child)  # creation, priority (hit count)
    parent.children[child_key_of(state, child.extra_key, child.key)] = upper
    child.key = child.key[split_len:]
    if child.value is not None:
        child.value = child.value[split_len:]
    child.parent = upper
    upper.children[child_key_of(state, child.extra_key, child.key)] = child
    for plugin in state.plugins:  # aux data, the host copy, the page keys follow the cut
        plugin.split(state, upper, child, split_len)
    touch(state, child)
    return upper


def add_leaf(state: CacheState, parent: Node, extra_key: str | None, units: tuple[Any, ...],
             value: tuple[int, ...], priority: int = 0) -> Node:
    """A new node for the unmatched remainder of an insert; it is the newest node, created
    now, with the insert's priority."""
    stamp = (tick(state), 0)
    leaf = Node(key=units, extra_key=extra_key, parent=parent, value=value,
                stamp=stamp, created=stamp, priority=priority)
    parent.children[child_key_of(state, extra_key, units)] = leaf
    for plugin in state.plugins:  # storage tier: the leaf's page keys
        plugin.new_leaf(state, leaf)
    return leaf


def find_node(state: CacheState, tokens: Sequence[int], extra_key: str | None) -> Node:
    """The node whose path is exactly ``tokens`` (the root for ``[]``), or NodeNotFound."""
    tokens = check_int_list("node tokens", tokens)
    extra_key = check_extra_key(extra_key)
    if state.config.eagle and len(tokens) == 1:
        raise NodeNotFound("under EAGLE a node path has no tokens (the root) or at least two")
    units = to_units(tokens, state.config.eagle)
    node = state.root
    rest = units
    while len(rest) > 0:
        child = find_child(state, node, extra_key, rest)
        if child is None or tuple(rest[: len(child.key)]) != child.key:
            raise NodeNotFound(
                f"no node ends at this path (extra_key={extra_key!r}, {len(tokens)} tokens)")
        node, rest = child, rest[len(child.key):]
    return node


# ----------------------------------------------------------------------------------------------
# match_prefix
# ----------------------------------------------------------------------------------------------


def empty_match(state: CacheState) -> MatchOutcome:
    return MatchOutcome((), state.root, state.root, state.root, 0)


def match_prefix(state: CacheState, tokens: Sequence[int], extra_key: str | None = None
                 ) -> MatchOutcome:
    """Find the longest cached prefix of ``tokens`` (whole pages, device data only).

    Walk down while a child shares the next page; stop at an evicted node.  A match that ends
    inside a node splits it there, so the match always ends at a node end.  The matched path is
    stamped most recent.  Disabled caches, and keys shorter than a page, match nothing and
    change nothing.  With a host tier the walk goes on through evicted nodes that have a host
    copy (only device data counts towards the indices; the host plug-in's ``finish_match``).
    """
    tokens = check_int_list("tokens", tokens)
    extra_key = check_extra_key(extra_key)
    units = aligned_units(state, tokens)
    if state.config.disable or len(units) == 0:
        return empty_match(state)

    node = state.root
    chunks: list[tuple[int, ...]] = []
    rest = units
    # Hybrid models: the match ends at the deepest node every aux validator accepts, its
    # device part at the deepest device node every validator accepts on the device alone.
    validators = [v for v in (p.match_validator(state, False) for p in state.plugins)
                  if v is not None]
    device_validators = [v for v in (p.match_validator(state, True) for p in state.plugins)
                         if v is not None]
    best, best_device, best_chunks = node, node, 0

    def consider(node: Node) -> None:
        nonlocal best, best_device, best_chunks
        if all([v(node) for v in validators]):
            best = node
        if all([v(node) for v in device_validators]) and node.value is not None:
            best_device, best_chunks = node, len(chunks)

    while len(rest) > 0:
        child = find_child(state, node, extra_key, rest)
        if child is None or (child.value is None and child.host_value is None):
            break
        shared = common_prefix_len(child.key, rest, state.config.page_size)
        if shared < len(child.key):
            node = split_node(state, child, shared)
            if node.value is not None:
                chunks.append(node.value)
            consider(node)
            break
        if child.value is not None:
            chunks.append(child.value)
        node = child
        rest = rest[shared:]
        consider(node)

    stamp_match_path(state, best)
    indices = tuple(s for chunk in chunks[:best_chunks] for s in chunk)
    outcome = MatchOutcome(indices, best_device, best, best, 0)
    walk = MatchWalk(sum(len(c) for c in chunks), len(chunks), best_chunks)
    for plugin in state.plugins:  # the host tier's hit length, Mamba's branching point
        outcome = plugin.finish_match(state, outcome, walk)
    return outcome


# ----------------------------------------------------------------------------------------------
# insert
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InsertOutcome:
    prefix_len: int
    mamba_exist: bool = False  # hybrid models: Mamba only


def insert_plan(state: CacheState, extra_key: str | None, units: tuple[Any, ...]
                ) -> list[tuple[Node, int]]:
    """The existing nodes an insert of ``units`` walks through, as ``(node, shared)`` pairs;
    only the last pair can share less than the whole node (the insert will split it there)."""
    plan = []
    node, rest = state.root, units
    while len(rest) > 0:
        child = find_child(state, node, extra_key, rest)
        if child is None:
            break
        shared = common_prefix_len(child.key, rest, state.config.page_size)
        plan.append((child, shared))
        if shared < len(child.key):
            break
        node, rest = child, rest[shared:]
    return plan


def duplicate_slots(plan: list[tuple[Node, int]], value: tuple[int, ...], prev_prefix_len: int
                    ) -> list[int]:
    """The request's own slots for units the tree already holds on the device: from
    ``prev_prefix_len`` on (before it, the request's slots *are* the tree's), the copy in
    ``value`` is a duplicate and goes back to the allocator.  Evicted nodes are not
    duplicates: they take the fresh slots."""
    dups: list[int] = []
    start = 0
    for node, shared in plan:
        if node.value is not None:
            dups.extend(value[max(start, prev_prefix_len): start + shared])
        start += shared
    return dups


def check_insert_slots(state: CacheState, plan: list[tuple[Node, int]], value: tuple[int, ...],
                       prev_prefix_len: int) -> None:
    """Reject an insert whose slots the tree could not own or the pool could not take back.

    From ``prev_prefix_len`` on, ``value`` holds the caller's own slots: none may be held by
    the tree already (the duplicates among them are freed, the rest become the tree's), the
    duplicates must be whole allocated pages, and the new leaf's slots allocated whole pages.
    """
    if len(set(value)) != len(value):
        raise InvalidInput("insert: value holds the same slot twice")
    held = set(tree_slots(state)).intersection(value[prev_prefix_len:])
    if held:
        raise InvalidInput(f"insert: slots {sorted(held)[:8]} from prev_prefix_len on are "
                           "already the tree's")
    try:
        state.kv.check_free(duplicate_slots(plan, value, prev_prefix_len))
    except AllocatorError as e:
        raise InvalidInput(f"insert: duplicate slots cannot be freed: {e}") from None
    taken = sum(shared for _, shared in plan)
    ps = state.config.page_size
    for k in range(taken, len(value), ps):
        page = value[k: k + ps]
        first = page[0]
        if first % ps or list(page) != list(range(first, first + ps)):
            raise InvalidInput(f"insert: slots {list(page)} of the new leaf are not one whole page")
        if not state.kv.is_allocated(first):
            raise InvalidInput(f"insert: slot {first} is not allocated")
    check_unevict_slots(state, plan, value)


def check_unevict_slots(state: CacheState, plan: list[tuple[Node, int]], value: tuple[int, ...]
                        ) -> None:
    """An insert's slots for the evicted nodes on its path (they take them back; only a host
    tier leaves evicted nodes in the tree) must be whole allocated pages the tree does not
    hold, as a new leaf's."""
    ps = state.config.page_size
    held = None
    start = 0
    for node, shared in plan:
        if node.value is None:
            held = set(tree_slots(state)) if held is None else held
            for k in range(start, start + shared, ps):
                page = value[k: k + ps]
                first = page[0]
                if first % ps or list(page) != list(range(first, first + ps)):
                    raise InvalidInput(f"insert: slots {list(page)} for an evicted node are not "
                                       "one whole page")
                if not state.kv.is_allocated(first) or any(s in held for s in page):
                    raise InvalidInput(f"insert: slots {list(page)} for an evicted node are not "
                                       "the caller's allocated slots")
        start += shared


def check_insert_args(state: CacheState, prev_prefix_len: int, mamba_value: object,
                      swa_evicted_seqlen: object) -> InsertArgs:
    """The aux arguments an insert may carry at all in this config, checked even where the
    insert then does nothing (a disabled cache): each only when a plug-in reads it,
    ``swa_evicted_seqlen`` a whole number of pages.  The plug-ins check the rest
    (``Plugin.check_insert``)."""
    accepted = frozenset().union(*(p.insert_args for p in state.plugins))
    swa = check_count("swa_evicted_seqlen", swa_evicted_seqlen)
    if swa and "swa_evicted_seqlen" not in accepted:
        raise InvalidInput("insert: swa_evicted_seqlen needs the SWA component")
    if swa % state.config.page_size:
        raise InvalidInput(f"insert: swa_evicted_seqlen={swa} is not whole pages")
    if mamba_value is not None and "mamba_value" not in accepted:
        raise InvalidInput("insert: mamba_value needs the Mamba component")
    return InsertArgs(prev_prefix_len, swa, mamba_value)


def insert(state: CacheState, tokens: Sequence[int], extra_key: str | None,
           value: Sequence[int], prev_prefix_len: int = 0, chunked: bool = False,
           mamba_value: Sequence[int] | None = None, swa_evicted_seqlen: int = 0,
           priority: int = 0) -> InsertOutcome:
    """Cache ``tokens`` -> ``value`` (one KV slot per token).

    The key is the page-aligned (bigram, under EAGLE) view of ``tokens``; ``value`` is cut to
    the same length (the caller frees the unaligned tail).  Walk the tree: every node on the
    way is touched; a partial match splits the node; an evicted node on the way takes the fresh
    slots back (un-evict); elsewhere the request's duplicate slots from ``prev_prefix_len`` on
    are freed.  The remainder becomes a new leaf.  Returns the length already cached.

    Hybrid models (spec/components.py): ``mamba_value`` is the request's Mamba state slot and
    ``swa_evicted_seqlen`` where its sliding window starts; the aux hooks run on the way.

    ``priority`` (an int, any sign; upstream's ``InsertParams.priority``): every node on the
    way keeps the larger of its priority and this one, a new leaf takes it (spec/policies.py).
    """
    tokens = check_int_list("tokens", tokens)
    extra_key = check_extra_key(extra_key)
    value = check_int_list("value", value)
    check_count("prev_prefix_len", prev_prefix_len)
    check_flag("chunked", chunked)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"insert: priority must be an int, got {priority!r}")
    if len(value) != len(tokens):
        raise InvalidInput(f"insert: value has {len(value)} slots for {len(tokens)} tokens")
    args = check_insert_args(state, prev_prefix_len, mamba_value, swa_evicted_seqlen)
    if state.config.disable:
        return InsertOutcome(0)
    units = aligned_units(state, tokens)
    value_t = tuple(value[: len(units)])
    plan = insert_plan(state, extra_key, units)
    check_insert_slots(state, plan, value_t, prev_prefix_len)
    args = dataclasses.replace(args, units=units)
    for plugin in state.plugins:  # each plug-in's own checks; they normalise its arguments
        args = plugin.check_insert(state, plan, value_t, args)

    touch(state, state.root)
    if len(units) == 0:  # nothing to cache; a Mamba caller keeps its state slot
        return InsertOutcome(0, mamba_exist=True)
    node, start = state.root, 0
    for child, shared in plan:
        touch(state, child)
        if shared < len(child.key):
            child = split_node(state, child, shared)
        policies.raise_priority(child, priority)
        fresh = value_t[start: start + shared]
        if child.value is None:
            unevict(child, fresh)
            for plugin in state.plugins:
                plugin.recover_after_unevict(state, child, start, args)
        else:
            taken = shared
            for plugin in state.plugins:  # where a plug-in took the request's slots over
                taken = min(taken, plugin.insert_overlap(state, child, start, shared, fresh, args))
            state.kv.free(list(fresh[max(0, prev_prefix_len - start): taken]))
        count_hit(state, child, chunked)
        node, start = child, start + shared
    target, is_new_leaf = node, False
    if start < len(units):
        if any([p.skip_leaf(state, start, len(units) - start, args) for p in state.plugins]):
            state.kv.free(list(value_t[start:]))
            # the tree took no state: a Mamba caller keeps (frees) its slot (the seed: a TODO)
            return InsertOutcome(start, mamba_exist="mamba" in state.config.components)
        target = leaf = add_leaf(state, node, extra_key, units[start:], value_t[start:],
                                 priority)
        is_new_leaf = True
    exist = False
    for plugin in state.plugins:
        exist = plugin.commit_insert(state, target, is_new_leaf, start, args) or exist
    if is_new_leaf:
        count_hit(state, leaf, chunked)
    return InsertOutcome(start, mamba_exist=exist)


def unevict(node: Node, fresh: tuple[int, ...]) -> None:
    """An evicted node met by an insert holds device data again: the request's fresh slots."""
    assert len(fresh) == len(node.key)
    node.value = fresh


def count_hit(state: CacheState, node: Node, chunked: bool) -> None:
    """Hit counts drive write-through to the host tier; the seed counts them only when a host
    tier exists, and never for chunked (unfinished) inserts or evicted nodes.  Under an
    eviction policy other than lru they are counted without a host tier too (0.5.13.post1's
    rule, spec/policies.py)."""
    if chunked or node.evicted:
        return
    if not state.config.has_host_tier and not policies.follows_upstream_hit_counts(state):
        return
    if state.config.has_host_tier and state.config.write_policy == "write_back":
        return
    node.hit_count += 1
    for plugin in state.plugins:  # the host tier: write-through once the threshold is reached
        plugin.on_hit(state, node)


# ----------------------------------------------------------------------------------------------
# Locks
# ----------------------------------------------------------------------------------------------


def inc_lock_ref(state: CacheState, node: Node) -> LockHandle:
    """Protect ``node``'s path from eviction: every node from it up to (not including) the
    root gains one lock, except the evicted bottom segment, which is skipped and remembered."""
    if node is not state.root and not is_in_tree(state, node):
        raise NodeNotFound("inc_lock_ref: the node is not in the tree")
    if state.config.disable:
        return issue_handle(state, node, skipped=(), lock=False)
    skipped = []
    cur = node
    while not cur.is_root and cur.value is None:
        skipped.append(cur)
        cur = up(cur)
    return issue_handle(state, node, tuple(skipped), lock=True)


def issue_handle(state: CacheState, node: Node, skipped: tuple[Node, ...], lock: bool
                 ) -> LockHandle:
    handle = LockHandle(serial=state.next_serial, node=node, skipped=skipped)
    state.next_serial += 1
    state.handles[handle.serial] = handle
    if lock:
        for n in handle.locked_nodes():
            n.lock_ref += 1
        for plugin in state.plugins:  # hybrid models: SWA window, Mamba node
            plugin.lock(state, handle)
    return handle


def dec_lock_ref(state: CacheState, handle: LockHandle) -> None:
    """Undo one ``inc_lock_ref``: exactly the nodes it locked lose one lock."""
    if not isinstance(handle, LockHandle) or state.handles.get(handle.serial) is not handle:
        raise HandleError("dec_lock_ref: this handle was never issued or is already released")
    locked = handle.locked_nodes() if not state.config.disable else []
    del state.handles[handle.serial]
    for n in locked:
        assert n.lock_ref > 0, "lock count would go negative"
        n.lock_ref -= 1
    for plugin in state.plugins:  # hybrid models
        plugin.unlock(state, handle)


def is_in_tree(state: CacheState, node: Node) -> bool:
    cur = node
    while cur.parent is not None:
        parent = cur.parent
        if parent.children.get(child_key_of(state, cur.extra_key, cur.key)) is not cur:
            return False
        cur = parent
    return cur is state.root


# ----------------------------------------------------------------------------------------------
# Eviction
# ----------------------------------------------------------------------------------------------


def evict(state: CacheState, num_tokens: int) -> int:
    """Free at least ``num_tokens`` device tokens if possible, whole nodes at a time: take the
    oldest evictable device leaf, again and again, until enough is freed or none is left.
    Returns the number of tokens freed."""
    check_count("num_tokens", num_tokens)
    if state.config.disable:
        return 0
    for plugin in state.plugins:  # the host tier drives: eviction to host, write-back
        if plugin.drives_eviction:
            return plugin.evict_device(state, num_tokens)
    freed = 0
    while freed < num_tokens:
        victim = oldest_device_leaf(state)
        if victim is None:
            break
        freed += evict_device_leaf(state, victim)
    return freed


def oldest_device_leaf_except(state: CacheState, passed_over: list[Node]) -> Node | None:
    """The oldest device leaf (in the eviction policy's order) not in ``passed_over``."""
    leaves = [n for n in device_leaves(state) if not any(n is p for p in passed_over)]
    if not leaves:
        return None
    return leaves[oldest([policies.eviction_key(state, n) for n in leaves])]


def evict_device_leaf(state: CacheState, leaf: Node) -> int:
    """Without a host tier, an evicted leaf is deleted: its slots go back to the pool, it
    leaves the tree, and ancestors left as childless tombstones are deleted too."""
    assert leaf.value is not None
    n = len(leaf.value)
    if leaf.aux:  # hybrid models: the leaf's aux data goes with it
        for plugin in state.plugins:
            plugin.drop_device_leaf(state, leaf, {})
    state.kv.free(list(leaf.value))
    leaf.value = None
    parent = up(leaf)
    remove_from_parent(state, leaf)
    delete_tombstone_ancestors(state, parent)
    return n


def remove_from_parent(state: CacheState, node: Node) -> None:
    del up(node).children[child_key_of(state, node.extra_key, node.key)]


def delete_tombstone_ancestors(state: CacheState, node: Node) -> None:
    """Walk up from ``node``: a childless, unlocked node with no device data (and, with a host
    tier, no host copy and no host lock) is deleted, and so on upwards; stop at the first node
    that must stay."""
    while (not node.is_root and not node.children and node.lock_ref == 0 and node.value is None
           and node.host_value is None and node.host_lock_ref == 0):
        parent = up(node)
        remove_from_parent(state, node)
        node = parent


# ----------------------------------------------------------------------------------------------
# Reset
# ----------------------------------------------------------------------------------------------


def reset(state: CacheState) -> None:
    """Flush (SGLang's flush_cache): the tree is emptied, every lock handle and running request
    is forgotten and the KV pool is cleared with it.  The clock keeps running."""
    state.root = new_root()
    state.handles.clear()
    state.requests.clear()
    state.sessions.clear()  # streaming sessions' slots go with the pool
    state.kv.reset()
    if state.mamba is not None:  # hybrid models: the Mamba pool is cleared too
        state.mamba.reset()
    for plugin in state.plugins:  # the host and storage tiers
        plugin.reset(state)
