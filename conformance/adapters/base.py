"""Adapters: one trace step in, one observation out (docs/DESIGN.md, ``CacheUnderTest``).

An observation is the full ``ret`` object TRACE.md defines for the op (effects included), or
``{"error": "<ExceptionType>"}`` when the implementation rejected the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from uniradix.conformance.adapters.capabilities import CAPABILITIES, SESSION_OPS, Capabilities
from uniradix.conformance.adapters.host_ops import SpecHostOps
from uniradix.conformance.adapters.storage_ops import STORAGE_HOST_EFFECT_OPS, STORAGE_OPS, SpecStorageOps
from uniradix.spec import cache as rules
from uniradix.spec import components, mamba_cow, queries, sessions
from uniradix.spec import requests as reqs
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import CacheError, HandleError, InvalidInput, UnknownOp, Unsupported
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import CacheState, Node, all_nodes, new_state

Step = dict
Observation = dict

# Ops of TRACE.md version 1 that belong to tiers not built yet.
HOST_TIER_OPS = ("evict_host", "load_back", "io_complete", "check_hicache_events", "host_lock",
                 "host_unlock")
# Ops whose observation carries the host pool's effects (host_freed) when there is a host tier.
HOST_EFFECT_OPS: tuple[str, ...] = ("insert", "evict", "load_back", "check_hicache_events",
                                     "evict_host")
HOST_EFFECT_OPS += STORAGE_HOST_EFFECT_OPS  # storage tier (conformance/adapters/storage_ops.py)
AUX_OPS = ("mamba_alloc", "mamba_free")


class CacheUnderTest(Protocol):
    config: CacheConfig

    def apply(self, step: Step) -> Observation: ...

    def snapshot(self) -> dict[str, Any]: ...

    def violations(self) -> list[str]: ...


def check_supported(config: CacheConfig, hybrid: bool = False, host_tier: bool = False,
                    storage: bool = False, host_mamba: bool = False, host_aux: bool = False
                    ) -> None:
    """What an implementation models: the Full component on the device tier always; with
    ``hybrid`` the SWA and Mamba components too; with ``host_tier`` the host tier (HiCache);
    with ``host_mamba`` the host tier together with Mamba; with ``host_aux`` together with any
    aux components (SWA, Mamba, both)."""
    if config.components != ("full",) and config.has_host_tier and not host_aux and not (
            host_mamba and config.components == ("full", "mamba")):
        raise Unsupported("a host tier with an aux component (SWA, Mamba) is not supported"
                          + ("" if host_mamba else " here") + " (the spec models it)")
    if config.components != ("full",) and not hybrid:
        raise Unsupported(f"components {list(config.components)}: only ['full'] is supported "
                          "so far (SWA and Mamba come with the hybrid-models work)")
    if config.has_host_tier and not host_tier:
        raise Unsupported("host_slots > 0: the host tier (HiCache) is not supported yet")
    if config.storage and not storage:
        raise Unsupported("storage: true: the storage tier is not supported here yet")


def check_load_back_slot(config: CacheConfig, mamba_slot: Any, rid: Any = None) -> int | None:
    """``load_back``'s ``mamba_slot`` (the requester's own state slot), checked as the spec
    checks it before the implementation's own checks: null, or an int with Mamba; not with
    ``rid`` (a waiting request as the requester: its own slot is the one it holds)."""
    if mamba_slot is None:
        return None
    if rid is not None:
        raise InvalidInput("load_back: mamba_slot and rid both name the requester; give one")
    if "mamba" not in config.components:
        raise InvalidInput("load_back: mamba_slot needs the Mamba component")
    if isinstance(mamba_slot, bool) or not isinstance(mamba_slot, int):
        raise InvalidInput(f"load_back: mamba_slot must be null or an int, got {mamba_slot!r}")
    return mamba_slot


def check_cow_args(config: CacheConfig, cow: Any, mamba_slot: Any, modelled: bool = False
                   ) -> bool:
    """``match_prefix``'s Mamba copy-on-write arguments, checked as the spec checks them:
    ``cow_mamba`` a bool (InvalidInput without Mamba), ``mamba_slot`` only with it (its own
    checks are the implementation's).  Returns ``cow_mamba``; on an implementation that does not
    model it (``modelled`` False) true is Unsupported."""
    if not isinstance(cow, bool):
        raise InvalidInput(f"cow_mamba must be true or false, got {cow!r}")
    if cow and "mamba" not in config.components:
        raise InvalidInput("match_prefix: cow_mamba needs the Mamba component")
    if cow and not modelled:
        raise Unsupported("cow_mamba: Mamba copy-on-write is modelled by the spec only so far")
    if not cow and mamba_slot is not None:
        raise InvalidInput("match_prefix: mamba_slot goes with cow_mamba")
    return cow


def args_of(step: Step, *names: str, **defaults: Any) -> list:
    """The named args of a step; a missing required arg is InvalidInput."""
    args = step.get("args", {})
    known = set(names) | set(defaults)
    extra = sorted(set(args) - known)
    if extra:
        raise InvalidInput(f"{step['op']}: unknown argument(s) {extra}")
    out = []
    for n in names:
        if n not in args:
            raise InvalidInput(f"{step['op']}: missing argument {n!r}")
        out.append(args[n])
    for n, d in defaults.items():
        out.append(args.get(n, d))
    return out


def path_arg(raw: Any) -> tuple:
    if not isinstance(raw, dict) or set(raw) - {"tokens", "extra_key"} or "tokens" not in raw:
        raise InvalidInput(f"a node path must be {{'tokens': [...], 'extra_key': ...}}, got {raw!r}")
    return raw["tokens"], raw.get("extra_key")


OPS: tuple[str, ...] = (
       "alloc", "free", "insert", "match_prefix", "lock", "unlock", "evict", "sizes", "reset",
       "req_arrive", "req_admit", "req_chunk", "req_decode", "req_finish", "req_abort",
       "mamba_alloc", "mamba_free") + HOST_TIER_OPS
# Streaming sessions (spec/sessions.py; docs/TRACE.md); SESSION_OPS and REQUEST_OPS come from
# conformance/adapters/capabilities.py, which declares who models them.
OPS += SESSION_OPS
OPS += STORAGE_OPS  # storage tier (conformance/adapters/storage_ops.py)


def aux_effects(config: CacheConfig, kv: Any, mamba: Any) -> dict:
    """The step effects of the aux pools (TRACE.md): ``swa_freed`` with SWA, ``mamba_freed``
    with Mamba; ``kv`` is a HybridKVPool with SWA, ``mamba`` the Mamba pool."""
    out = {}
    if "swa" in config.components:
        out["swa_freed"] = kv.swa.take_freed()
    if "mamba" in config.components:
        out["mamba_freed"] = mamba.take_freed()
    return out


class StepAdapter:
    """Dispatch of trace steps shared by the adapters: an op ``x`` is the method ``op_x``;
    an exception of ``rejections`` becomes the observation ``{"error": TypeName}``; the KV
    pool's freed-slot log is cleared around every step so effects belong to one step.  A step
    outside the adapter's declared ``capabilities`` (conformance/adapters/capabilities.py) is
    refused ``Unsupported`` before any handler runs."""

    rejections: tuple = (CacheError,)
    pool: Any  # the environment's PagedPool
    aux_pools: tuple = ()  # hybrid models: the SWA and Mamba pools, whose logs are effects too
    host_pool: Any = None  # the host PagedPool, with a host tier
    host_mamba_pool: Any = None  # the host state pool, with a host tier and Mamba
    host_swa_pool: Any = None  # the SWA host pool, with a host tier and SWA
    hybrid_requests: bool = False  # the request-level ops (req_*) run with SWA and Mamba too
    config: CacheConfig  # set by each adapter's constructor
    capabilities: Capabilities = CAPABILITIES["spec"]  # what this implementation models

    @property
    def tree_only(self) -> bool:
        """No request-level ops in this config (lockstep runs then leave them out): with an aux
        component unless the adapter's request model covers it (and EAGLE keys)."""
        if self.config.components == ("full",):
            return False
        return not self.hybrid_requests or self.config.eagle

    def _drain_pools(self) -> None:
        """Forget the frees every pool has recorded (device, aux, host and aux host pools)."""
        for p in (self.pool, *self.aux_pools, self.host_pool, self.host_mamba_pool,
                  self.host_swa_pool):
            if p is not None:
                p.take_freed()

    def apply(self, step: Step) -> Observation:
        op = step.get("op")
        self._drain_pools()
        try:
            self.capabilities.check_step(self.config, op, step.get("args"))
            handler = getattr(self, f"op_{op}", None) if op in OPS else None
            if handler is None:
                if op in HOST_TIER_OPS or op in AUX_OPS or op in SESSION_OPS or op in STORAGE_OPS:
                    raise Unsupported(f"op {op!r} needs a tier or component not supported yet")
                raise UnknownOp(f"unknown op {op!r}")
            obs = handler(step)
            if self.host_pool is not None and op in HOST_EFFECT_OPS:
                obs["host_freed"] = self.host_pool.take_freed()
                if self.host_swa_pool is not None:  # the host tier with SWA
                    obs["host_swa_freed"] = self.host_swa_pool.take_freed()
                if self.host_mamba_pool is not None:  # the host tier with Mamba
                    obs["host_mamba_freed"] = self.host_mamba_pool.take_freed()
            return obs
        except self.rejections as e:
            self._drain_pools()  # a rejected step's frees are not observed
            return {"error": type(e).__name__, "message": str(e)}


class SpecAdapter(SpecStorageOps, SpecHostOps, StepAdapter):
    """Runs trace steps on the executable specification."""

    hybrid_requests = True

    def __init__(self, config: CacheConfig) -> None:
        check_supported(config, hybrid=True, host_tier=True, storage=True, host_aux=True)
        self.config = config
        self.state: CacheState = new_state(config)
        self.pool = self.state.kv
        self.aux_pools = tuple(p for p in (getattr(self.pool, "swa", None), self.state.mamba)
                               if p is not None)
        self.host_pool = self.state.host.pool if self.state.host is not None else None
        self.host_mamba_pool = self.state.host.mamba_pool if self.state.host is not None else None
        self.host_swa_pool = self.state.host.swa_pool if self.state.host is not None else None
        self.handles: dict[int, Any] = {}  # trace handle (the lock step's i) -> LockHandle
        self.host_handles: dict[int, Any] = {}  # trace handle (the host_lock step's i)

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self.state)

    def violations(self) -> list[str]:
        return sanity_check(self.state)

    # -- ops -----------------------------------------------------------------------------------
    def _path_len(self, node: Node) -> int:
        return len(node.path_units())

    def op_alloc(self, step: Step) -> Observation:
        (n,) = args_of(step, "n")
        slots = self.state.kv.alloc(n)
        if "swa" in self.config.components:
            swa = components.swa_pool(self.state)
            return {"slots": slots, "swa_slots": list(swa.translate(slots))}
        return {"slots": slots}

    def swa_slots_of(self, slots: list[int]) -> list[int]:
        """The SWA slot each full slot maps to now (0: none), for the KV check
        (conformance/env/kvcheck.py)."""
        return list(components.swa_pool(self.state).translate(slots))

    def op_mamba_alloc(self, step: Step) -> Observation:
        pool = self._mamba_pool()
        (n,) = args_of(step, "n")
        return {"slots": pool.alloc(n)}

    def op_mamba_free(self, step: Step) -> Observation:
        self._mamba_pool()
        (slots,) = args_of(step, "slots")
        slots = rules.check_int_list("slots", slots)
        held = {s for n in all_nodes(self.state) if components.has(n, "mamba")
                for s in n.aux["mamba"].value}
        held |= {r.mamba_slot for r in self.state.requests.values() if r.mamba_slot is not None}
        if held.intersection(slots):
            raise InvalidInput(f"mamba_free: slots {sorted(held.intersection(slots))} are the "
                               "tree's or a request's")
        self._mamba_pool().free(slots)
        return {}

    def _mamba_pool(self):
        if self.state.mamba is None:
            raise Unsupported("Mamba pool ops need the Mamba component")
        return self.state.mamba

    def _effects(self) -> dict:
        return aux_effects(self.config, self.state.kv, self.state.mamba)

    def op_free(self, step: Step) -> Observation:
        (slots,) = args_of(step, "slots")
        self.state.kv.free(rules.check_int_list("slots", slots))
        return {}

    def op_insert(self, step: Step) -> Observation:
        tokens, value, extra_key, prev, chunked, mamba_value, swa_evicted_seqlen, priority = \
            args_of(step, "tokens", "value", extra_key=None, prev_prefix_len=0, chunked=False,
                    mamba_value=None, swa_evicted_seqlen=0, priority=0)
        out = rules.insert(self.state, tokens, extra_key, value, prev, chunked,
                           mamba_value=mamba_value, swa_evicted_seqlen=swa_evicted_seqlen,
                           priority=priority)
        ret = {"prefix_len": out.prefix_len, "freed": self.state.kv.take_freed()}
        if "mamba" in self.config.components:
            ret["mamba_exist"] = out.mamba_exist
        ret.update(self._effects())
        return ret

    def op_match_prefix(self, step: Step) -> Observation:
        tokens, extra_key, cow, mamba_slot = args_of(step, "tokens", extra_key=None,
                                                     cow_mamba=False, mamba_slot=None)
        if rules.check_flag("cow_mamba", cow):
            return self._match_prefix_cow(tokens, extra_key, mamba_slot)
        if mamba_slot is not None:
            raise InvalidInput("match_prefix: mamba_slot goes with cow_mamba")
        return self._match_obs(rules.match_prefix(self.state, tokens, extra_key))

    def _match_obs(self, m: Any) -> Observation:
        """A match result as the trace records it (``mamba_branching_seqlen`` with Mamba)."""
        obs = {
            "device_indices": list(m.device_indices),
            "host_hit_length": m.host_hit_length,
            "last_device_node": self._path_len(m.last_device_node),
            "last_host_node": self._path_len(m.last_host_node),
            "best_match_node": self._path_len(m.best_match_node),
        }
        if "swa" in self.config.components and self.config.has_host_tier:  # host tier with SWA
            obs["swa_host_hit_length"] = m.swa_host_hit_length
        if "mamba" in self.config.components:
            obs["mamba_branching_seqlen"] = m.mamba_branching_seqlen
            if self.config.has_host_tier:  # the host tier with Mamba
                obs["mamba_host_hit_length"] = m.mamba_host_hit_length
        return obs

    def _match_prefix_cow(self, tokens, extra_key, mamba_slot) -> Observation:
        """Mamba copy-on-write (spec/mamba_cow.py): the match, then the copy source and the
        request's state slot, with the effects of the eviction that may have made room."""
        out = mamba_cow.match_prefix_cow(self.state, tokens, extra_key, mamba_slot)
        obs = self._match_obs(out.match)
        obs.update({"mamba_cow_src": out.src, "mamba_pool_idx": out.dst,
                    "freed": self.state.kv.take_freed()})
        obs.update(self._effects())
        return obs

    def op_lock(self, step: Step) -> Observation:
        (path,) = args_of(step, "node")
        tokens, extra_key = path_arg(path)
        node = rules.find_node(self.state, tokens, extra_key)
        i = step.get("i")
        if isinstance(i, bool) or not isinstance(i, int):  # as the other adapters
            raise InvalidInput("a lock step needs an integer 'i' (the handle)")
        if i in self.handles:
            raise HandleError(f"lock: handle {i} is already in use")
        self.handles[i] = rules.inc_lock_ref(self.state, node)
        return {"handle": i}

    def op_unlock(self, step: Step) -> Observation:
        (h,) = args_of(step, "handle")
        handle = self.handles.get(h) if isinstance(h, int) and not isinstance(h, bool) else None
        if handle is None:
            raise HandleError(f"unlock: handle {h!r} was never issued")
        rules.dec_lock_ref(self.state, handle)  # raises HandleError when released already
        return {}

    def op_evict(self, step: Step) -> Observation:
        if self.config.components != ("full",):
            return self._evict_hybrid(step)
        (n,) = args_of(step, "num_tokens")
        evicted = rules.evict(self.state, n)
        return {"num_tokens_evicted": evicted, "freed": self.state.kv.take_freed()}

    def _evict_hybrid(self, step: Step) -> Observation:
        n, swa_n, mamba_n = args_of(step, "num_tokens", swa_num_tokens=0, mamba_num=0)
        freed = components.evict(self.state, n, swa_n, mamba_n)
        ret: dict[str, Any] = {"num_tokens_evicted": freed["full"]}
        if "swa" in self.config.components:
            ret["swa_num_tokens_evicted"] = freed["swa"]
        if "mamba" in self.config.components:
            ret["mamba_num_evicted"] = freed["mamba"]
        ret["freed"] = self.state.kv.take_freed()
        ret.update(self._effects())
        return ret

    def op_sizes(self, step: Step) -> Observation:
        args_of(step)
        out = {"full_evictable": queries.evictable_size(self.state),
               "full_protected": queries.protected_size(self.state)}
        out.update(components.sizes(self.state))
        return out

    def op_reset(self, step: Step) -> Observation:
        args_of(step)
        rules.reset(self.state)
        self.handles.clear()
        self.host_handles.clear()
        return {}

    # -- request-level ops (docs/TRACE.md, "Request-level ops") ------------------------------
    def op_req_arrive(self, step: Step) -> Observation:
        rid, tokens, extra_key, priority, session = args_of(
            step, "rid", "tokens", extra_key=None, priority=0, session=None)
        reqs.arrive(self.state, rid, tokens, extra_key, priority, session)
        return {}

    def op_release_session(self, step: Step) -> Observation:
        (session,) = args_of(step, "session")
        sessions.release_session(self.state, session)
        return self._req_effects({})

    def op_session_held(self, step: Step) -> Observation:
        args_of(step)
        obs: Observation = {"tokens": sessions.session_held_tokens(self.state),
                            "full_tokens": sessions.session_held_tokens(self.state),
                            "req_count": sessions.session_held_req_count(self.state)}
        if "swa" in self.config.components:
            obs["swa_tokens"] = sessions.session_held_swa_tokens(self.state)
        if "mamba" in self.config.components:
            obs["mamba_slots"] = sessions.session_held_mamba_slots(self.state)
        return obs

    def op_req_admit(self, step: Step) -> Observation:
        (rid,) = args_of(step, "rid")
        req = reqs.get_request(self.state, rid, admitted=False)
        obs: Observation = {"prefix_len": reqs.admit(self.state, req)}
        if "mamba" in self.config.components:  # null: no state slot, the request still waits
            obs["mamba_pool_idx"] = req.mamba_slot
        return self._req_effects(obs, always=False)

    def _req_effects(self, obs: Observation, always: bool = True) -> Observation:
        """A request-level step's pool effects: ``freed`` (always, or with an aux component),
        and with an aux component ``swa_freed`` / ``mamba_freed`` (TRACE.md)."""
        if always or self.config.components != ("full",):
            obs["freed"] = self.state.kv.take_freed()
        obs.update(self._effects())
        return obs

    def op_req_chunk(self, step: Step) -> Observation:
        rid, n, chunked = args_of(step, "rid", "n", chunked=True)
        rules.check_flag("chunked", chunked)
        req = reqs.get_request(self.state, rid, admitted=True)
        r = reqs.extend(self.state, req, n)
        if r.ok:
            reqs.cache_unfinished_req(self.state, req, chunked)
        return self._req_effects({"ok": r.ok, "evicted": r.evicted})

    def op_req_decode(self, step: Step) -> Observation:
        rid, n = args_of(step, "rid", "n")
        req = reqs.get_request(self.state, rid, admitted=True)
        r = reqs.decode(self.state, req, n)
        return self._req_effects({"ok": r.ok, "evicted": r.evicted})

    def op_req_finish(self, step: Step) -> Observation:
        (rid,) = args_of(step, "rid")
        req = reqs.get_request(self.state, rid, admitted=True)
        reqs.cache_finished_req(self.state, req)
        return self._req_effects({})

    def op_req_abort(self, step: Step) -> Observation:
        (rid,) = args_of(step, "rid")
        req = reqs.get_request(self.state, rid)
        if req.admitted:
            reqs.cache_finished_req(self.state, req, is_insert=False)
        else:
            reqs.release(self.state, req)
        return self._req_effects({})


ADAPTERS: dict[str, Callable[[CacheConfig], CacheUnderTest]] = {"spec": SpecAdapter}


def _fast_adapter(config: CacheConfig, slot_ledger: bool = True) -> CacheUnderTest:
    if config.components != ("full",):  # hybrid models: fast/hybrid.py
        from uniradix.conformance.adapters.fast_hybrid import HybridFastAdapter
        return HybridFastAdapter(config, slot_ledger=slot_ledger)
    from uniradix.conformance.adapters.fast_adapter import FastAdapter
    return FastAdapter(config, slot_ledger=slot_ledger)


def _fast_noledger_adapter(config: CacheConfig) -> CacheUnderTest:
    """``fast`` built with ``validate_slots=False``: no slot ledger, as over sglang's
    allocators, so the fast paths that decline under the ledger run (``fast-noledger``)."""
    return _fast_adapter(config, slot_ledger=False)


ADAPTERS["fast"] = _fast_adapter
ADAPTERS["fast-noledger"] = _fast_noledger_adapter


def make_adapter(impl: str, config: CacheConfig) -> CacheUnderTest:
    """An adapter by name: ``spec``, ``fast``, ``fast-noledger`` (fast without its slot
    ledger), ``upstream`` (the tree-level API) or
    ``upstream-requests`` (upstream's request path and streaming sessions: Full, with or
    without a host tier, and Full + Mamba on the device; both need sglang importable).  A
    config outside the implementation's declared capabilities is refused here, naming each
    missing capability (conformance/adapters/capabilities.py)."""
    if impl in CAPABILITIES:
        CAPABILITIES[impl].check(config)
    if impl == "upstream-requests":  # the request path and sessions (upstream_requests.py)
        from uniradix.conformance.adapters import upstream_requests as ur
        if config.components == ("full", "mamba") and config.has_host_tier:
            return ur.HostMambaUpstreamRequestAdapter(config)
        if config.components == ("full", "mamba"):  # with or without the extra buffer
            return ur.MambaUpstreamRequestAdapter(config)
        if config.has_host_tier:  # HiCache: the controller model of upstream_host.py
            return ur.HostUpstreamRequestAdapter(config)
        return ur.UpstreamRequestAdapter(config)
    if impl == "upstream":
        if config.components != ("full",) and config.has_host_tier:  # upstream_host_aux.py
            from uniradix.conformance.adapters.upstream_host_aux import HostAuxUpstreamAdapter
            return HostAuxUpstreamAdapter(config)
        if config.components != ("full",):  # hybrid models: SWA or Mamba
            from uniradix.conformance.adapters.upstream_hybrid import HybridUpstreamAdapter
            return HybridUpstreamAdapter(config)
        if config.storage:  # the storage tier (conformance/adapters/upstream_storage.py)
            from uniradix.conformance.adapters.upstream_storage import UpstreamStorageAdapter
            return UpstreamStorageAdapter(config)
        if config.has_host_tier:
            from uniradix.conformance.adapters.upstream_host import UpstreamHostAdapter
            return UpstreamHostAdapter(config)
        from uniradix.conformance.adapters.upstream import UpstreamAdapter
        return UpstreamAdapter(config)
    if impl not in ADAPTERS:
        raise Unsupported(f"unknown implementation {impl!r}; known: "
                          f"{sorted(ADAPTERS) + ['upstream', 'upstream-requests']}")
    return ADAPTERS[impl](config)
