"""What each implementation models, declared as data, and the one place its refusals come from.

Every adapter behind ``make_adapter`` (conformance/adapters/base.py) runs a subset of what the
trace format can say.  :class:`Capabilities` is that subset for one implementation: the component
sets, the host tier (and whether it combines with SWA or Mamba), the write policies, the storage
tier, the eviction policies, streaming sessions, Mamba copy-on-write, EAGLE keys, the disabled
cache, and the request-level ops.  :meth:`Capabilities.missing` names what a config needs that
the implementation lacks, :meth:`Capabilities.check` turns that into one ``Unsupported`` naming
all of it, and :meth:`Capabilities.check_step` does the same for one step (the ops and
arguments that are refused whatever the config).  :data:`CAPABILITIES` holds the declaration of
each implementation by name; tests/conformance/adapters/test_capabilities.py checks each one
against what its adapters really accept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from uniradix.spec.config import COMPONENT_SETS, POLICIES, WRITE_POLICIES, CacheConfig
from uniradix.spec.errors import Unsupported

# The request-level ops of the trace format (docs/TRACE.md), streaming sessions' included.
SESSION_OPS = ("release_session", "session_held")
REQUEST_OPS = ("req_arrive", "req_admit", "req_chunk", "req_decode", "req_finish", "req_abort"
               ) + SESSION_OPS


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one implementation models.  Every field is a fact about the implementation; a
    config or step outside them is refused by :meth:`check` / :meth:`check_step` with
    ``Unsupported`` naming each missing capability."""

    name: str
    components: frozenset[tuple[str, ...]] = frozenset({("full",)})
    host_tier: bool = False
    host_aux: frozenset[str] = frozenset()  # the aux components it models under a host tier
    host_all_aux: bool = False  # a host tier with SWA and Mamba together (in one tree)
    write_policies: frozenset[str] = frozenset(WRITE_POLICIES)  # with a host tier
    storage: bool = False
    eviction_policies: frozenset[str] = frozenset(POLICIES)
    sessions: bool = False  # streaming sessions with the Full component alone
    sessions_with_aux: bool = False  # streaming sessions with SWA or Mamba
    cow_mamba: bool = False
    eagle: bool = True  # EAGLE bigram keys with the Full component alone
    eagle_with_aux: bool = False  # EAGLE keys with SWA or Mamba
    disable: bool = True  # a disabled cache
    request_ops: bool = True  # the request path with the Full component alone
    request_ops_with_aux: bool = False  # the request path with SWA or Mamba
    # Full + Mamba on the device alone at these page sizes (None: any); upstream needs its Mamba
    # extra buffer past page 1, which its adapters turn on only with SWA or a host tier
    mamba_page_sizes: frozenset[int] | None = None
    # a host tier with an aux component at these page sizes (None: any)
    host_aux_page_sizes: frozenset[int] | None = None

    def missing(self, config: CacheConfig) -> list[str]:
        """What ``config`` needs that this implementation does not model, each by name
        (empty: the implementation runs it)."""
        out = []
        comps = tuple(config.components)
        aux = comps != ("full",)
        if comps not in self.components:
            out.append(f"components {list(comps)}")
        if config.has_host_tier:
            if not self.host_tier:
                out.append("a host tier (host_slots > 0)")
            else:
                out.extend(f"a host tier with the aux component {c}" for c in comps[1:]
                           if c not in self.host_aux)
                if len(comps) > 2 and not self.host_all_aux:
                    out.append("a host tier with SWA and Mamba together")
            if self.host_tier and config.write_policy not in self.write_policies:
                out.append(f"write_policy {config.write_policy!r}")
        if config.storage and not self.storage:
            out.append("a storage tier (storage: true)")
        if config.eviction_policy not in self.eviction_policies:
            out.append(f"eviction_policy {config.eviction_policy!r}")
        if config.eagle and not (self.eagle_with_aux if aux else self.eagle):
            out.append("EAGLE keys with SWA or Mamba" if aux else "EAGLE keys")
        if config.disable and not self.disable:
            out.append("a disabled cache")
        if (comps == ("full", "mamba") and not config.has_host_tier
                and not config.mamba_extra_buffer and self.mamba_page_sizes is not None
                and config.page_size not in self.mamba_page_sizes):
            out.append(f"Mamba with page_size {config.page_size}")
        if (aux and config.has_host_tier and self.host_aux_page_sizes is not None
                and config.page_size not in self.host_aux_page_sizes):
            out.append(f"a host tier with an aux component at page_size {config.page_size}")
        return out

    def check(self, config: CacheConfig) -> None:
        """``Unsupported`` naming everything :meth:`missing` finds; nothing when it is empty."""
        gaps = self.missing(config)
        if gaps:
            raise Unsupported(f"{self.name} does not model " + ", ".join(gaps))

    def step_gap(self, config: CacheConfig, op: Any, args: Any) -> str | None:
        """What one step needs that this implementation does not model (None: nothing)."""
        aux = tuple(config.components) != ("full",)
        if op in REQUEST_OPS:
            if not (self.request_ops_with_aux if aux else self.request_ops):
                return f"op {op!r}: the request path" + (" with SWA or Mamba" if aux else "")
        if not (self.sessions_with_aux if aux else self.sessions) and (op in SESSION_OPS or (
                op == "req_arrive" and isinstance(args, dict) and args.get("session") is not None)):
            return f"op {op!r}: streaming sessions" + (" with SWA or Mamba" if aux else "")
        if (not self.cow_mamba and op == "match_prefix" and isinstance(args, dict)
                and args.get("cow_mamba") is True and "mamba" in config.components):
            return "match_prefix: Mamba copy-on-write (cow_mamba)"
        return None

    def check_step(self, config: CacheConfig, op: Any, args: Any) -> None:
        """``Unsupported`` for a step :meth:`step_gap` finds a gap in."""
        gap = self.step_gap(config, op, args)
        if gap is not None:
            raise Unsupported(f"{self.name} does not model {gap}")

    def summary(self) -> dict[str, Any]:
        """The declaration as plain data (sorted lists), for docs and reports."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, frozenset):
                v = sorted(list(c) if isinstance(c, tuple) else c for c in v)
            out[f.name] = v
        return out


CAPABILITIES: dict[str, Capabilities] = {
    # the executable spec: everything the trace format says
    "spec": Capabilities(
        name="spec", components=frozenset(COMPONENT_SETS), host_tier=True,
        host_aux=frozenset({"swa", "mamba"}), host_all_aux=True, storage=True, sessions=True,
        sessions_with_aux=True, cow_mamba=True,
        eagle_with_aux=True, request_ops_with_aux=True),
    # uniradix.fast (FastAdapter, HybridFastAdapter): Full, SWA and Mamba in any combination;
    # a host tier with SWA and/or Mamba, a storage tier (Full only), every eviction policy (the
    # ones other than lru on the composed tree, fast/policies.py), Mamba copy-on-write,
    # streaming sessions (with SWA and Mamba too), EAGLE keys with aux; its adapter drives the
    # request path, sessions included, with every component set (conformance/adapters/
    # fast_hybrid.py)
    "fast": Capabilities(
        name="fast", components=frozenset(COMPONENT_SETS), host_tier=True,
        host_aux=frozenset({"swa", "mamba"}), host_all_aux=True, storage=True, cow_mamba=True,
        sessions=True, sessions_with_aux=True, eagle_with_aux=True, request_ops_with_aux=True),
    # uniradix.fast without its slot ledger (``validate_slots=False``, what a cache over
    # sglang's allocators runs): the same models; the paths that decline under the ledger (the
    # one-component and host+aux inserts, Mamba's direct frees and evict in C) run.  Slots
    # outside the pool given to an insert are then not refused (the adapter's ``checks_slots``)
    "fast-noledger": Capabilities(
        name="fast-noledger", components=frozenset(COMPONENT_SETS), host_tier=True,
        host_aux=frozenset({"swa", "mamba"}), host_all_aux=True, storage=True, cow_mamba=True,
        sessions=True, sessions_with_aux=True, eagle_with_aux=True, request_ops_with_aux=True),
    # upstream SGLang 0.5.13.post1 (UpstreamAdapter and its host, host+aux, storage and hybrid
    # subclasses): the tree-level API only (no request path), no EAGLE keys and no disabled
    # cache driven
    "upstream": Capabilities(
        name="upstream", components=frozenset(COMPONENT_SETS), host_tier=True,
        host_aux=frozenset({"swa", "mamba"}), storage=True, cow_mamba=True,
        eagle=False, disable=False, request_ops=False, mamba_page_sizes=frozenset({1})),
    # upstream SGLang 0.5.13.post1 through its request path with sglang's own Req and the
    # embedded StreamingSession (UpstreamRequestAdapter): Full, on the device alone or with a
    # host tier (HostUpstreamRequestAdapter), the tree-level API too; Full + Mamba on the
    # device, with or without the extra buffer, over sglang's HybridReqToTokenPool
    # (MambaUpstreamRequestAdapter), or with a host tier at page 1
    # (HostMambaUpstreamRequestAdapter), without sessions
    "upstream-requests": Capabilities(
        name="upstream-requests", components=frozenset({("full",), ("full", "mamba")}),
        host_tier=True, host_aux=frozenset({"mamba"}), host_aux_page_sizes=frozenset({1}),
        sessions=True, cow_mamba=True, eagle=False, disable=False, request_ops_with_aux=True,
        mamba_page_sizes=frozenset({1})),
}


def capabilities(impl: str) -> Capabilities:
    """The declaration of an implementation by name; ``Unsupported`` for an unknown name."""
    if impl not in CAPABILITIES:
        raise Unsupported(f"unknown implementation {impl!r}; known: {sorted(CAPABILITIES)}")
    return CAPABILITIES[impl]
