"""The host-tier trace ops (TRACE.md "Host I/O"; docs/TRACE.md) on the executable spec.

:class:`SpecHostOps` is mixed into the spec's adapter: ``evict_host``, ``load_back``,
``io_complete``, ``check_hicache_events`` and the uniradix additions ``host_lock`` /
``host_unlock``.  Effects on the host pool (``host_freed``) are added by the shared step
dispatch (``StepAdapter.apply``) for the ops in ``HOST_EFFECT_OPS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uniradix.conformance.adapters import base as A
from uniradix.spec import cache as rules
from uniradix.spec import host
from uniradix.spec import requests as reqs
from uniradix.spec.errors import HandleError, InvalidInput, Unsupported

HOST_OPS = ("evict_host", "load_back", "io_complete", "check_hicache_events", "host_lock",
            "host_unlock")


class SpecHostOps:
    """Host-tier ops over ``self.state`` (a spec CacheState with a host tier)."""

    state: Any
    config: Any
    host_handles: dict
    _effects: Any  # the aux pools' effects (conformance/adapters/base.py SpecAdapter)

    def _host(self) -> None:
        if self.state.host is None:
            raise Unsupported("this op needs a host tier (host_slots > 0)")

    def take_copies(self) -> list:
        """The KV copies of the last step, in order (for the KV-integrity check)."""
        if self.state.host is None:
            return []
        out = list(self.state.host.copies)
        self.state.host.copies.clear()
        return out

    def take_swa_copies(self) -> list:
        """The SWA data copies of the last step, in order (for the KV-integrity check)."""
        if self.state.host is None:
            return []
        out = list(self.state.host.swa_copies)
        self.state.host.swa_copies.clear()
        return out

    def take_state_copies(self) -> list:
        """The Mamba state copies of the last step, in order (for the KV-integrity check)."""
        if self.state.host is None:
            return []
        out = list(self.state.host.mamba_copies)
        self.state.host.mamba_copies.clear()
        return out

    def op_evict_host(self, step: dict) -> dict:
        self._host()
        (n,) = A.args_of(step, "num_tokens")
        return {"num_evicted": host.evict_host(self.state, n)}

    def op_load_back(self, step: dict) -> dict:
        self._host()
        node_path, last_path, mem_quota, slot, rid = A.args_of(
            step, "node", "last_device_node", mem_quota=None, mamba_slot=None, rid=None)
        slot = A.check_load_back_slot(self.config, slot, rid)
        req = None if rid is None else reqs.load_back_requester(self.state, rid)
        node = rules.find_node(self.state, *A.path_arg(node_path))
        last = rules.find_node(self.state, *A.path_arg(last_path))
        copies = len(self.state.host.mamba_copies)
        swa_copies = len(self.state.host.swa_copies)
        if req is not None:  # a waiting request's own load back (docs/TRACE.md)
            indices, last_node = reqs.load_back_for(self.state, req, node, last, mem_quota)
        else:
            indices, last_node = host.init_load_back(self.state, node, last, mem_quota, slot)
        obs = {"device_indices": list(indices), "last_node": len(last_node.path_units())}
        if self.state.host.swa_pool is not None:  # with SWA: the SWA slots it gave (TRACE.md)
            obs["swa_device_indices"] = [s for kind, _, dst in self.state.host.swa_copies[swa_copies:]
                                         if kind == "load" for s in dst]
        if self.state.mamba is not None:  # with Mamba: the state slots it took (TRACE.md)
            req_slot = self.state.host.request_state
            obs["mamba_device_indices"] = [s for kind, _, dst in self.state.host.mamba_copies[copies:]
                                           if kind == "load" and dst != [req_slot] for s in dst]
            obs["mamba_pool_idx"] = req_slot
        obs["freed"] = self.state.kv.take_freed()
        if self.config.components != ("full",):  # with SWA or Mamba: room-making frees them too
            obs.update(self._effects())
        return obs

    def op_io_complete(self, step: dict) -> dict:
        self._host()
        writes, loads = A.args_of(step, writes=0, loads=0)
        host.io_complete(self.state, writes, loads)
        return {}

    def op_check_hicache_events(self, step: dict) -> dict:
        self._host()
        A.args_of(step)
        host.check_hicache_events(self.state)
        obs = {"freed": self.state.kv.take_freed()}
        if self.config.components != ("full",):  # with SWA or Mamba: the aux device effects too
            obs.update(self._effects())
        return obs

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


class _LoadReq:
    """What ``init_load_back`` reads from a request."""

    def __init__(self, last_node: Any, mamba_pool_idx: int | None = None) -> None:
        self.last_node = last_node
        self.mamba_pool_idx = mamba_pool_idx  # the requester's own state slot (Mamba)


class FastHostOps:
    """Host-tier ops over ``self.cache`` (a ``uniradix.fast`` HiCacheRadixCache, io="manual").
    Host locks follow the spec's handles: an unlock undoes exactly what its lock did."""

    load_req: Any = None  # the last load_back's request (what init_load_back gave it)
    _get: Callable[..., Any]  # the request adapter's (conformance/adapters/fast_adapter.py)

    cache: Any
    config: Any
    host_handles: dict
    # provided by the fast adapter this mixes into (conformance/adapters/fast_adapter.py)
    pool: Any
    host_pool: Any
    _key: Callable[..., Any]
    _units_len: Callable[..., int]
    _path: Callable[..., Any]

    @staticmethod
    def hicache_config(config: Any, host_allocator: Any, log_copies: bool = False) -> Any:
        from uniradix.fast.hicache import HiCacheConfig
        return HiCacheConfig(host_allocator=host_allocator, write_policy=config.write_policy,
                             write_through_threshold=config.write_through_threshold,
                             load_back_threshold=config.load_back_threshold, io="manual",
                             log_copies=log_copies)

    def take_copies(self) -> list:
        """The KV copies of the last step, in order (for the KV-integrity check)."""
        if not self.config.has_host_tier:
            return []
        return self.cache.cache_controller.take_copies()

    def _host(self) -> None:
        if not self.config.has_host_tier:
            raise Unsupported("this op needs a host tier (host_slots > 0)")

    def _node(self, raw: Any) -> Any:
        tokens, extra_key = A.path_arg(raw)
        return self.cache.find_node(self._key(tokens, extra_key))

    def op_evict_host(self, step: dict) -> dict:
        self._host()
        (n,) = A.args_of(step, "num_tokens")
        return {"num_evicted": self.cache.evict_host(n)}

    def op_load_back(self, step: dict) -> dict:
        from uniradix.fast.hicache import InitLoadBackParams
        self._host()
        node_path, last_path, mem_quota, slot, rid = A.args_of(
            step, "node", "last_device_node", mem_quota=None, mamba_slot=None, rid=None)
        slot = A.check_load_back_slot(self.config, slot, rid)
        req = None if rid is None else self._waiting_requester(rid)
        node, last = self._node(node_path), self._node(last_path)
        if req is None:
            self.load_req = _LoadReq(last, slot)  # (Mamba: the slot it holds after, read back)
        else:  # a waiting request's own (SGLang: after its match in init_next_round_input)
            req.last_node = last
            self.load_req = req
        last_len = self._units_len(last)
        indices, last_node = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=node, host_hit_length=0, mem_quota=mem_quota, req=self.load_req))
        self.cache.ready_to_load_host_cache()
        # the node it was given, returned as is, by the path it was given at: a write-back
        # backup made while room was made may have evicted it from the host and out of the tree
        # (a given last node that was evicted itself), where fast's node keeps no parent and
        # the spec's keeps its path (tests/corpus/regressions/conform-sessions-host-swa-p1-*)
        units = last_len if last_node is last else self._units_len(last_node)
        return {"device_indices": indices.tolist(), "last_node": units,
                "freed": self.pool.take_freed()}

    def _waiting_requester(self, rid: Any) -> Any:
        """``load_back {rid}``'s request (spec/requests.py ``load_back_for``): waiting, and not
        one its session's slot restores (InvalidInput otherwise, nothing changed)."""
        req = self._get(rid, admitted=False)
        if req.session_id is not None and req.session_id in self.cache.sessions.slots:
            raise InvalidInput(f"load_back: request {rid!r} is restored from session "
                               f"{req.session_id!r}'s slot, not matched")
        return req

    def op_io_complete(self, step: dict) -> dict:
        self._host()
        writes, loads = A.args_of(step, writes=0, loads=0)
        for name, k in (("writes", writes), ("loads", loads)):
            if isinstance(k, bool) or not isinstance(k, int) or k < -1:
                raise InvalidInput(f"io_complete: {name} must be an int >= -1, got {k!r}")
        self.cache.cache_controller.complete(writes, loads)
        return {}

    def op_check_hicache_events(self, step: dict) -> dict:
        self._host()
        A.args_of(step)
        self.cache.check_hicache_events()
        return {"freed": self.pool.take_freed()}

    def op_host_lock(self, step: dict) -> dict:
        self._host()
        (path,) = A.args_of(step, "node")
        node = self._node(path)
        i = step.get("i")
        if i in self.host_handles:
            raise HandleError(f"host_lock: handle {i} is already in use")
        locked = node.host_value is not None and not self.config.disable
        res = self.cache.inc_host_lock_ref(node)
        # (node, whether the Full host copy was locked, what dec_host_lock_ref undoes: with
        # SWA a window of host copies, which may be locked when the node itself is not)
        self.host_handles[i] = (node, locked, res.to_dec_params())
        return {"handle": i}

    def op_host_unlock(self, step: dict) -> dict:
        self._host()
        (h,) = A.args_of(step, "handle")
        held = self.host_handles.get(h) if type(h) is int else None
        if held is None:
            raise HandleError(f"host_unlock: handle {h!r} was never issued")
        node, locked, params = self.host_handles.pop(h)
        if locked or getattr(params, "tokens", ()):
            self.cache.dec_host_lock_ref(node, params)
        return {}

    def host_snapshot(self) -> dict:
        """The host tier as the spec's snapshot shows it (spec/snapshot.py host_view)."""
        cache = self.cache
        nodes = [{"path": self._path(n), "host_value": None if n.host_value is None
                  else n.host_value.tolist(), "host_lock_ref": n.host_lock_ref}
                 for n in cache.all_nodes()
                 if n is not cache.root_node and (n.host_value is not None or n.host_lock_ref)]
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None,
                                  n["path"]["extra_key"] or "", n["path"]["tokens"]))

        def acks(queue: list, ongoing: dict) -> list:
            out = []
            for _, finish, ids in queue:
                for i in ids:
                    entry = ongoing.get(i)
                    if entry is not None:
                        out.append({"node": self._path(entry[0]), "done": finish.query(),
                                    "locked": entry[1] is not None})
            return out
        cc = cache.cache_controller
        return {
            "nodes": nodes,
            "host_leaf_order": [self._path(n) for n in cache.host_eviction_order()],
            "pool": sorted(self.host_pool.allocated_pages()),
            "writes": acks(cc.ack_write_queue, cache.ongoing_write_through),
            "loads": acks(cc.ack_load_queue, cache.ongoing_load_back),
        }
