"""A fresh cache state, composed once from its config: the primary state's types
(spec/core.py) and the plug-ins of the configured components and tiers.

The plug-ins run in this order in every rule: the aux components in the config's order
(spec/components.py), then the host tier (spec/host.py), then the storage tier
(spec/storage.py).
"""

from __future__ import annotations

from . import components, host, storage
from .config import CacheConfig
from .core import CacheState, LockHandle, Node, Plugin, Stamp, all_nodes, new_root, up
from .world import PagedPool, hybrid_pools

__all__ = ["CacheState", "LockHandle", "Node", "Stamp", "all_nodes", "compose", "new_root",
           "new_state", "up"]


def compose(config: CacheConfig) -> tuple[Plugin, ...]:
    """The plug-ins a config names, in hook order (only the host tier drives device
    eviction)."""
    plugins: list[Plugin] = list(components.plugins_for(config))
    if config.has_host_tier:
        plugins.append(host.HOST_PLUGIN)
    if config.storage:
        plugins.append(storage.STORAGE_PLUGIN)
    return tuple(plugins)


def new_state(config: CacheConfig) -> CacheState:
    """An empty cache over a fresh KV pool of ``config.kv_slots`` usable slots (hybrid models:
    the pools of spec/world.py), and a host tier over ``config.host_slots`` host slots when there
    are any."""
    plugins = compose(config)
    if config.components != ("full",):  # hybrid models: pools of spec/world.py
        kv, mamba = hybrid_pools(config)
        state = CacheState(config=config, kv=kv, root=new_root(), mamba=mamba, plugins=plugins)
    else:
        state = CacheState(config=config, kv=PagedPool(config.kv_slots, config.page_size, "kv"),
                           root=new_root(), plugins=plugins)
    if config.has_host_tier:
        host.attach_host_tier(state)
    if config.storage:
        storage.attach_storage_tier(state)
    return state
