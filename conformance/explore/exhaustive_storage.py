"""A tiny storage universe for ``uniradix check --exhaustive`` (docs/CHECKS.md).

``storage-p1``: page 1, a KV pool of 2 slots, a host pool of 4, one key length-2 token space,
write-through, a storage backend with threshold 1 page.  Its transitions (:data:`STORAGE_KINDS`)
are the scheduler's and the environment's storage steps next to the host tier's:

* ``serve K``: match, allocate (evicting if short), insert, free the tail (a request's
  prefill);
* ``arrive K``: match K, then ``prefetch_from_storage`` below the match with a fresh request
  id (at most :data:`MAX_PREFETCHES` in flight);
* per request in flight: ``check_prefetch_progress`` (then ``pop_prefetch_loaded_tokens`` when
  done), ``terminate_prefetch``, ``release_aborted_request``, ``storage_load`` of one page;
* environment: ``io_complete`` of all acks, ``check_hicache_events``, ``storage_query`` of one,
  ``storage_backup`` of one, ``storage_tick``; and ``evict``, ``evict_host``,
  ``clear_storage_backend``.

States are deduplicated by the canonical snapshot (host and storage views included) plus
:meth:`StorageSpecAdapter.fingerprint`: the spec's fingerprint and everything of the storage
environment and the host acks that decides the future but is not in the snapshot (each
prefetch's stage, keys, loaded pages and slots it still holds; pending backups; request ids in
flight are names, so they are kept as they are, which only splits states, never merges them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore.exhaustive import (
    Driver,
    OpKind,
    Transition,
    Universe,
    World,
    _args_key,
    _node_path,
    run_serve,
    single,
    spec_fingerprint,
)
from uniradix.spec.config import CacheConfig
from uniradix.spec.host import HostTier
from uniradix.spec.storage import StorageTier

MAX_PREFETCHES = 2


@dataclasses.dataclass(frozen=True)
class StorageUniverse(Universe):
    """A :class:`Universe` with a host tier and a storage backend."""

    host_slots: int = 4
    write_policy: str = "write_through"
    prefetch_stop_policy: str = "best_effort"
    prefetch_threshold: int = 1

    def config(self) -> CacheConfig:
        return CacheConfig(page_size=self.page_size, kv_slots=self.kv_slots,
                           host_slots=self.host_slots, write_policy=self.write_policy,
                           storage=True, prefetch_stop_policy=self.prefetch_stop_policy,
                           prefetch_threshold=self.prefetch_threshold,
                           prefetch_timeout_base=1, prefetch_timeout_per_page=0)


STORAGE_UNIVERSES = {u.name: u for u in (
    StorageUniverse("storage-p1", page_size=1, kv_slots=2, host_slots=4, tokens=(1,),
                    max_len=2, extra_keys=(None,), max_locks=0, invalid=False, depth=4),
    StorageUniverse("storage-p1-wc", page_size=1, kv_slots=2, host_slots=4, tokens=(1,),
                    max_len=2, extra_keys=(None,), max_locks=0, invalid=False, depth=4,
                    prefetch_stop_policy="wait_complete"),
    StorageUniverse("storage-p1-wb", page_size=1, kv_slots=2, host_slots=4, tokens=(1, 2),
                    max_len=2, extra_keys=(None,), max_locks=0, invalid=False, depth=3,
                    write_policy="write_back"),
)}


class StorageSpecAdapter(SpecAdapter):
    """The spec's adapter with a fingerprint covering the storage environment."""

    def fingerprint(self) -> tuple:
        st = self.state
        tier, host = st.storage, st.host
        assert isinstance(tier, StorageTier) and isinstance(host, HostTier)  # a storage universe
        path = _node_path

        def op_view(op) -> tuple:
            end = len(op.slots) if op.released_from is None else op.released_from
            return (op.rid, path(op.anchor) if not op.anchor.is_root else "root", op.units,
                    op.slots, op.queried, op.keys, op.completed, op.terminated,
                    op.transfer_done, op.slots[op.taken:end], tuple(op.loaded), op.start)
        env = tuple(op_view(op) for op in tier.prefetches)
        backups = tuple((path(b.node), b.keys, b.done) for b in tier.backups)
        acks = tuple((path(a.node), a.done, a.lock is not None) for a in host.writes + host.loads)
        frags = tuple(sorted(tuple(path(n) for n in v) for v in tier.fragments.values()))
        return (spec_fingerprint(self), env, backups, acks, frags, tier.next_serial)


def storage_spec(config: CacheConfig) -> StorageSpecAdapter:
    return StorageSpecAdapter(config)


def run_serve_settle(d: Driver, tokens: list) -> None:
    """A request's prefill, then every host write and storage backup completes and is
    processed (what makes its pages reach storage)."""
    run_serve(d, tokens, None)
    for op, args in (("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
                     ("storage_backup", {"count": -1}), ("check_hicache_events", {})):
        d.step(op, args)


def run_flush(d: Driver, u: StorageUniverse) -> None:
    """Device and host eviction of everything unlocked (the store keeps its pages)."""
    d.step("evict", {"num_tokens": u.kv_slots})
    d.step("evict_host", {"num_tokens": u.host_slots})


def t_serve(u: Universe, w: World) -> Iterator[Transition]:
    assert isinstance(u, StorageUniverse)  # this family runs over storage universes only
    for toks, ek in u.keys():
        yield Transition(f"serve {toks}", partial(run_serve, tokens=toks, ek=ek))
        yield Transition(f"serve+settle {toks}", partial(run_serve_settle, tokens=toks))
    yield Transition("flush", partial(run_flush, u=u))


def run_arrive(d: Driver, tokens: list, rid: str) -> None:
    m = d.step("match_prefix", _args_key(tokens, None))
    best = m["best_match_node"]
    d.step("prefetch_from_storage", {"rid": rid, "node": {"tokens": tokens[:best],
                                                          "extra_key": None},
                                     "tokens": tokens[best:]})


def t_arrive(u: Universe, w: World) -> Iterator[Transition]:
    if len(w.storage_rids) >= MAX_PREFETCHES:
        return
    rid = next(f"p{k}" for k in range(10) if f"p{k}" not in w.storage_rids)
    for toks, _ in u.keys():
        yield Transition(f"arrive {toks} {rid}", partial(run_arrive, tokens=toks, rid=rid))


def run_progress(d: Driver, rid: str) -> None:
    if d.step("check_prefetch_progress", {"rid": rid})["done"]:
        d.step("pop_prefetch_loaded_tokens", {"rid": rid})


def t_prefetch_steps(u: Universe, w: World) -> Iterator[Transition]:
    for rid in w.storage_rids:
        yield Transition(f"progress {rid}", partial(run_progress, rid=rid))
        yield Transition(f"terminate {rid}", single("terminate_prefetch", {"rid": rid}))
        yield Transition(f"abort {rid}", single("release_aborted_request", {"rid": rid}))
        yield Transition(f"load {rid} 1", single("storage_load", {"rid": rid, "pages": 1}))


def t_environment(u: Universe, w: World) -> Iterator[Transition]:
    yield Transition("io_complete all", single("io_complete", {"writes": -1, "loads": -1}))
    yield Transition("check_hicache_events", single("check_hicache_events", {}))
    yield Transition("storage_query 1", single("storage_query", {"count": 1}))
    yield Transition("storage_backup 1", single("storage_backup", {"count": 1}))
    yield Transition("storage_tick", single("storage_tick", {"ticks": 1}))
    yield Transition(f"evict {u.kv_slots}", single("evict", {"num_tokens": u.kv_slots}))
    yield Transition("evict_host 1", single("evict_host", {"num_tokens": 1}))
    yield Transition("clear_storage_backend", single("clear_storage_backend", {}))


STORAGE_KINDS: tuple[OpKind, ...] = (
    OpKind("serve", t_serve),
    OpKind("arrive", t_arrive),
    OpKind("prefetch", t_prefetch_steps),
    OpKind("environment", t_environment),
)


def explore_storage(universe: StorageUniverse, impls: Sequence = ("spec",), **kw: Any) -> Any:
    """``exhaustive.explore`` over a storage universe: the spec by :class:`StorageSpecAdapter`
    (its fingerprint covers the storage environment), other implementations by name."""
    from uniradix.conformance.explore.exhaustive import explore
    built = [storage_spec if i == "spec" else i for i in impls]
    return explore(universe, built, kinds=STORAGE_KINDS, **kw)
