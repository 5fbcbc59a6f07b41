"""The canonical snapshot (docs/DESIGN.md, "what the same means"): the observable state of the cache
with private node identities replaced by paths.  Two implementations agree when their
snapshots are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import components, queries
from .core import Ack, read_only
from .host import host_eviction_order
from .keys import units_to_tokens
from .sessions import sessions_view
from .state import CacheState, Node, all_nodes


def path_of(state: CacheState, node: Node) -> dict[str, Any]:
    """A node named by its path: ``{"tokens": [...], "extra_key": ...}`` (raw tokens)."""
    return {"tokens": units_to_tokens(node.path_units(), state.config.eagle),
            "extra_key": node.extra_key}


def path_sort_key(path: dict[str, Any]) -> tuple[bool, str, Any]:
    ek = path["extra_key"]
    return (ek is not None, ek or "", path["tokens"])


def snapshot(state: CacheState) -> dict[str, Any]:
    with read_only(state):  # it only reads the state: one walk of the tree
        return _snapshot(state)


def _snapshot(state: CacheState) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    paths: dict[int, dict[str, Any]] = {}  # id(node) -> its path, each computed once

    def path(n: Node) -> dict[str, Any]:
        return paths.get(id(n)) or path_of(state, n)

    stack: list[tuple[Node, tuple[Any, ...]]] = [(c, ()) for c in state.root.children.values()]
    while stack:  # depth first, carrying each node's path units
        node, above = stack.pop()
        units = above + node.key
        paths[id(node)] = {"tokens": units_to_tokens(units, state.config.eagle),
                           "extra_key": node.extra_key}
        nodes.append({
            "path": paths[id(node)],
            "value": None if node.value is None else list(node.value),
            "lock_ref": node.lock_ref,
            "hit_count": node.hit_count,
        })
        if state.config.eviction_policy == "priority":  # the order reads it (spec/policies.py)
            nodes[-1]["priority"] = node.priority
        if state.config.components != ("full",):  # hybrid models: per-component data
            nodes[-1].update(aux_view(state, node))
        stack.extend((c, units) for c in node.children.values())
    nodes.sort(key=lambda n: path_sort_key(n["path"]))
    return {
        "nodes": nodes,
        "device_leaf_order": [path(n) for n in queries.device_eviction_order(state)],
        "sizes": {"full_evictable": queries.evictable_size(state),
                  "full_protected": queries.protected_size(state)},
        "pool": sorted(state.kv.allocated_pages()),
        "requests": [request_view(r, components.aux_names(state), state.config.mamba_extra_buffer,
                                     state.config.mamba_extra_buffer_lazy)
                     for _, r in sorted(state.requests.items())],
        **({"host": host_view(state, path)} if state.host is not None else {}),
        **({"sessions": sessions_view(state)} if state.sessions else {}),
        **({"storage": storage_view(state, path)} if state.storage is not None else {}),
    } if state.config.components == ("full",) else hybrid_snapshot(state, nodes, path)


PathOf = Callable[[Node], dict[str, Any]]  # a node's path (path_of, or a snapshot's memo of it)


def host_view(state: CacheState, path: PathOf | None = None) -> dict[str, Any]:
    """The host tier: host copies and host locks by path (with SWA or Mamba, each aux
    component's host copy and host locks on the node too), the host eviction order, the host
    pool, and the in-flight transfers in queue order; with SWA or Mamba, per aux component its
    host pool and host LRU order."""
    aux = components.aux_names(state)
    path = path or (lambda n: path_of(state, n))

    def entry(n: Node) -> dict[str, Any]:
        out: dict[str, Any] = {"path": path(n), "host_value": list(n.host_value)
                               if n.host_value is not None else None,
                               "host_lock_ref": n.host_lock_ref}
        for name in aux:
            d = n.aux.get(name)
            out[name] = {"host_value": None if d is None or d.host_value is None
                         else list(d.host_value), "host_lock_ref": 0 if d is None
                         else d.host_lock_ref}
        return out

    nodes: list[dict[str, Any]] = [
        entry(n) for n in all_nodes(state)
        if not n.is_root and (n.host_value is not None or n.host_lock_ref or any(
            d.host_value is not None or d.host_lock_ref for d in n.aux.values()))]
    nodes.sort(key=lambda n: path_sort_key(n["path"]))

    def acks(queue: list[Ack]) -> list[dict[str, Any]]:
        return [{"node": path(a.node), "done": a.done, "locked": a.lock is not None}
                for a in queue]
    view = {
        "nodes": nodes,
        "host_leaf_order": [path(n) for n in host_eviction_order(state)],
        "pool": sorted(state.host.pool.allocated_pages()),
        "writes": acks(state.host.writes),
        "loads": acks(state.host.loads),
    }
    for name, pool in (("swa", state.host.swa_pool), ("mamba", state.host.mamba_pool)):
        if pool is not None:
            view[f"{name}_pool"] = sorted(pool.allocated_pages())
            view[f"{name}_host_lru_order"] = [path(n) for n in
                                              components.host_lru_order(state, name)]
    return view


def request_view(req: Any, aux: tuple[str, ...] = (), xbuf: bool = False,
                 lazy: bool = False) -> dict[str, Any]:
    """A running request as the world sees it: its row and how much of it is computed and
    protected; with SWA where its own SWA data starts, with Mamba its state slot, and with the
    Mamba extra buffer its track slots, the next one to write, the last track length and the
    admission's branching length (lazy: and whether its last decode step's state went over
    its only track slot)."""
    out = {"rid": req.rid, "admitted": req.admitted, "row": list(req.row),
           "committed": req.committed, "protected": req.cache_protected_len}
    if "swa" in aux:
        out["swa_evicted_seqlen"] = req.swa_evicted_seqlen
    if "mamba" in aux:
        out["mamba_slot"] = req.mamba_slot
    if xbuf:
        out["mamba_track"] = None if req.mamba_track is None else list(req.mamba_track)
        out["mamba_next_track"] = req.mamba_next_track
        out["mamba_track_len"] = req.mamba_track_len
        out["mamba_branching"] = req.mamba_branching
    if lazy:  # its last decode step's state went over the only track slot
        out["mamba_track_overwritten"] = req.mamba_track_overwritten
    return out


def aux_view(state: CacheState, node: Node) -> dict[str, Any]:
    """A node's aux component data: value (None = tombstone) and lock count per component."""
    out = {}
    for name in components.aux_names(state):
        d = node.aux.get(name)
        out[name] = {"value": None if d is None or d.value is None else list(d.value),
                     "lock_ref": 0 if d is None else d.lock_ref}
    return out  # the host copies: host_view


def hybrid_snapshot(state: CacheState, nodes: list[dict[str, Any]],
                    path: PathOf | None = None) -> dict[str, Any]:
    """The snapshot of a hybrid model: the Full part plus, per aux component, its LRU order,
    sizes and pool."""
    path = path or (lambda n: path_of(state, n))
    sizes = {"full_evictable": queries.evictable_size(state),
             "full_protected": queries.protected_size(state)}
    sizes.update(components.sizes(state))
    out: dict[str, Any] = {
        "nodes": nodes,
        "device_leaf_order": [path(n) for n in queries.device_eviction_order(state)],
        "sizes": sizes,
        "pool": sorted(state.kv.allocated_pages()),
        "requests": [request_view(r, components.aux_names(state), state.config.mamba_extra_buffer,
                                     state.config.mamba_extra_buffer_lazy)
                     for _, r in sorted(state.requests.items())],
    }
    for name in components.aux_names(state):
        out[f"{name}_lru_order"] = [path(n) for n in components.lru_order(state, name)]
    if "swa" in state.config.components:
        out["swa_pool"] = sorted(components.swa_pool(state).swa.allocated_pages())
    if state.mamba is not None:
        out["mamba_pool"] = sorted(state.mamba.allocated_pages())
    if state.host is not None:  # the host tier with SWA or Mamba (the aux parts: host_view)
        out["host"] = host_view(state, path)
    if state.sessions:  # streaming sessions with SWA or Mamba (spec/sessions.py)
        out["sessions"] = sessions_view(state)
    return out


def storage_view(state: CacheState, path: PathOf | None = None) -> dict[str, Any]:
    """The storage tier (spec/storage.py) as the cache and the store show it: page keys by path,
    the stored keys, the cache's prefetches in flight, its backups in flight (how many), the
    revoke and release queues, the tokens loaded per request, the occupancy and the clock.
    (The environment's internal queues are not part of it.)"""
    tier = state.storage
    path = path or (lambda n: path_of(state, n))
    keys: list[dict[str, Any]] = [{"path": path(n), "page_keys": list(n.page_keys or ())}
                                  for n in queries_all_nodes(state) if not n.is_root]
    keys.sort(key=lambda e: path_sort_key(e["path"]))

    def prefetch(op: Any) -> dict[str, Any]:
        return {"rid": op.rid, "anchor": path(op.anchor), "tokens": len(op.units),
                "host_slots": list(op.slots), "hit_pages": len(op.keys),
                "completed": op.completed, "terminated": op.terminated}
    return {
        "page_keys": keys,
        "stored": sorted(tier.store),
        "ongoing": [prefetch(tier.ongoing[r]) for r in sorted(tier.ongoing)],
        "ongoing_backups": len(tier.ongoing_backup),
        "revoke_queue": list(tier.revoke_queue),
        "release_queue": [list(p) for p in tier.release_queue],
        "loaded_tokens": dict(sorted(tier.loaded_tokens.items())),
        "occupied": tier.occupied,
        "clock": tier.clock,
    }


def queries_all_nodes(state: CacheState) -> list[Node]:
    return all_nodes(state)
