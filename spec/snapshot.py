"""The canonical snapshot (DESIGN.md, "what the same means"): the observable state of the cache
with private node identities replaced by paths.  Two implementations agree when their
snapshots are equal.
"""

from __future__ import annotations

from typing import Any

from . import queries
from .keys import units_to_tokens
from .state import CacheState, Node


def path_of(state: CacheState, node: Node) -> dict[str, Any]:
    """A node named by its path: ``{"tokens": [...], "extra_key": ...}`` (raw tokens)."""
    return {"tokens": units_to_tokens(node.path_units(), state.config.eagle),
            "extra_key": node.extra_key}


def path_sort_key(path: dict[str, Any]) -> tuple:
    ek = path["extra_key"]
    return (ek is not None, ek or "", path["tokens"])


def snapshot(state: CacheState) -> dict[str, Any]:
    nodes = []
    stack = [(child, ()) for child in state.root.children.values()]
    while stack:  # depth first, carrying each node's path units
        node, above = stack.pop()
        units = above + node.key
        nodes.append({
            "path": {"tokens": units_to_tokens(units, state.config.eagle),
                     "extra_key": node.extra_key},
            "value": None if node.value is None else list(node.value),
            "lock_ref": node.lock_ref,
            "hit_count": node.hit_count,
        })
        stack.extend((c, units) for c in node.children.values())
    nodes.sort(key=lambda n: path_sort_key(n["path"]))
    return {
        "nodes": nodes,
        "device_leaf_order": [path_of(state, n) for n in queries.device_eviction_order(state)],
        "sizes": {"full_evictable": queries.evictable_size(state),
                  "full_protected": queries.protected_size(state)},
        "pool": sorted(state.kv.allocated_pages()),
        "requests": [request_view(r) for _, r in sorted(state.requests.items())],
        **({"host": host_view(state)} if state.host is not None else {}),
    }


def host_view(state: CacheState) -> dict[str, Any]:
    """The host tier: host copies and host locks by path, the host eviction order, the host
    pool, and the in-flight transfers in queue order."""
    from .host import host_eviction_order
    nodes = [{"path": path_of(state, n), "host_value": list(n.host_value)
              if n.host_value is not None else None, "host_lock_ref": n.host_lock_ref}
             for n in queries.all_nodes(state)
             if not n.is_root and (n.host_value is not None or n.host_lock_ref)]
    nodes.sort(key=lambda n: path_sort_key(n["path"]))

    def acks(queue) -> list:
        return [{"node": path_of(state, a.node), "done": a.done, "locked": a.lock is not None}
                for a in queue]
    return {
        "nodes": nodes,
        "host_leaf_order": [path_of(state, n) for n in host_eviction_order(state)],
        "pool": sorted(state.host.pool.allocated_pages()),
        "writes": acks(state.host.writes),
        "loads": acks(state.host.loads),
    }


def request_view(req) -> dict[str, Any]:
    """A running request as the world sees it: its row and how much of it is computed and
    protected."""
    return {"rid": req.rid, "admitted": req.admitted, "row": list(req.row),
            "committed": req.committed, "protected": req.cache_protected_len}
