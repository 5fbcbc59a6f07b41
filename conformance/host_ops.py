"""The host-tier trace ops (TRACE.md "Host I/O"; docs/TRACE.md) on the executable spec.

:class:`SpecHostOps` is mixed into the spec's adapter: ``evict_host``, ``load_back``,
``io_complete``, ``check_hicache_events`` and the uniradix additions ``host_lock`` /
``host_unlock``.  Effects on the host pool (``host_freed``) are added by the shared step
dispatch (``StepAdapter.apply``) for the ops in ``HOST_EFFECT_OPS``.
"""

from __future__ import annotations

from typing import Any

from uniradix.conformance import adapters as A
from uniradix.spec import cache as rules
from uniradix.spec import host
from uniradix.spec.errors import HandleError, Unsupported

HOST_OPS = ("evict_host", "load_back", "io_complete", "check_hicache_events", "host_lock",
            "host_unlock")


class SpecHostOps:
    """Host-tier ops over ``self.state`` (a spec CacheState with a host tier)."""

    state: Any
    host_handles: dict

    def _host(self) -> None:
        if self.state.host is None:
            raise Unsupported("this op needs a host tier (host_slots > 0)")

    def op_evict_host(self, step: dict) -> dict:
        self._host()
        (n,) = A.args_of(step, "num_tokens")
        return {"num_evicted": host.evict_host(self.state, n)}

    def op_load_back(self, step: dict) -> dict:
        self._host()
        node_path, last_path, mem_quota = A.args_of(step, "node", "last_device_node",
                                                    mem_quota=None)
        node = rules.find_node(self.state, *A.path_arg(node_path))
        last = rules.find_node(self.state, *A.path_arg(last_path))
        indices, last_node = host.init_load_back(self.state, node, last, mem_quota)
        return {"device_indices": list(indices), "last_node": len(last_node.path_units()),
                "freed": self.state.kv.take_freed()}

    def op_io_complete(self, step: dict) -> dict:
        self._host()
        writes, loads = A.args_of(step, writes=0, loads=0)
        host.io_complete(self.state, writes, loads)
        return {}

    def op_check_hicache_events(self, step: dict) -> dict:
        self._host()
        A.args_of(step)
        host.check_hicache_events(self.state)
        return {"freed": self.state.kv.take_freed()}

    def op_host_lock(self, step: dict) -> dict:
        self._host()
        (path,) = A.args_of(step, "node")
        node = rules.find_node(self.state, *A.path_arg(path))
        i = step.get("i")
        if i in self.host_handles:
            raise HandleError(f"host_lock: handle {i} is already in use")
        self.host_handles[i] = host.inc_host_lock_ref(self.state, node)
        return {"handle": i}

    def op_host_unlock(self, step: dict) -> dict:
        self._host()
        (h,) = A.args_of(step, "handle")
        handle = self.host_handles.get(h) if isinstance(h, int) and not isinstance(h, bool) else None
        if handle is None:
            raise HandleError(f"host_unlock: handle {h!r} was never issued")
        host.dec_host_lock_ref(self.state, handle)
        return {}
