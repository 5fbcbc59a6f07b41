"""The canonical snapshot (DESIGN.md, "what the same means"): the observable state of the cache
with private node identities replaced by paths.  Two implementations agree when their
snapshots are equal.
"""

from __future__ import annotations

from typing import Any

from . import queries
from .keys import units_to_tokens
from .state import CacheState, Node, all_nodes


def path_of(state: CacheState, node: Node) -> dict[str, Any]:
    """A node named by its path: ``{"tokens": [...], "extra_key": ...}`` (raw tokens)."""
    return {"tokens": units_to_tokens(node.path_units(), state.config.eagle),
            "extra_key": node.extra_key}


def path_sort_key(path: dict[str, Any]) -> tuple:
    ek = path["extra_key"]
    return (ek is not None, ek or "", path["tokens"])


def snapshot(state: CacheState) -> dict[str, Any]:
    nodes = []
    for node in all_nodes(state):
        if node.is_root:
            continue
        nodes.append({
            "path": path_of(state, node),
            "value": None if node.value is None else list(node.value),
            "lock_ref": node.lock_ref,
            "hit_count": node.hit_count,
        })
    nodes.sort(key=lambda n: path_sort_key(n["path"]))
    return {
        "nodes": nodes,
        "device_leaf_order": [path_of(state, n) for n in queries.device_eviction_order(state)],
        "sizes": {"full_evictable": queries.evictable_size(state),
                  "full_protected": queries.protected_size(state)},
    }
