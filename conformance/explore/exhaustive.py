"""``uniradix check --exhaustive``: bounded exhaustive exploration of the cache (docs/CHECKS.md).

Breadth first over every sequence of *transitions* up to a depth, in a tiny *universe* (a few
token values, short keys, two ``extra_key`` namespaces, a pool of a few pages, at most two
locks held).  A transition is one thing a user of the cache does: a single trace step
(``match_prefix``, ``lock``, ``unlock``, ``evict``, ``reset``, a request-level step, a step that
must be rejected) or a short scheduler-style macro of trace steps whose slots come from the
pool model (``insert``: evict if short, ``alloc``, ``insert``, ``free`` the unused tail;
``serve``: ``match_prefix``, ``lock``, evict if short, ``alloc``, ``insert`` with
``prev_prefix_len`` = the match, ``free`` the tail, ``unlock``).  Which transitions exist is a
table (:data:`OP_KINDS`): each entry enumerates its transitions from the universe and a view of
the current state (:class:`World`), so a host tier adds its ops (``evict_host``, ``load_back``,
``io_complete`` as an explicit ack step, ...) as new entries.

Every trace step of every explored transition runs in lockstep on all implementations (the
:class:`~uniradix.conformance.explore.lockstep.Lockstep` of ``uniradix conform``: the same rejection,
observation, "rejected => unchanged", snapshot and invariant checks, on every step), so every
reachable state has had the spec's invariants (``sanity_check``) and each implementation's own
checked.  States are deduplicated by :func:`state_key`: the spec's canonical snapshot plus
what else decides the future (see its docstring for the soundness argument), plus a
fingerprint of each implementation's own hidden state.  The first finding of the breadth-first
search is at the smallest depth (in transitions); it is written as a replayable trace (probe
steps appended when only the snapshots differ, as ``conform`` does) and the run exits 1.

Running a transition: fresh adapters replay the path to the state (no checks: it was checked
when the state was first reached), then the transition runs with every check.  Replaying costs
less than deep-copying the fast path's tensors.  ``jobs > 1`` expands each level's states in
worker processes (spawned; implementations must then be given by name).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore.conform import Progress
from uniradix.conformance.explore.lockstep import (
    VIOLATION,
    Finding,
    ImplSpec,
    Lockstep,
    adapter_trait,
    build_adapters,
    impl_labels,
    impl_name,
)
from uniradix.spec import components
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError
from uniradix.spec.state import Node, all_nodes

DEFAULT_OUT = os.path.join("tests", "corpus", "regressions")

# ----------------------------------------------------------------------------------------------
# The universe
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Universe:
    """What the exploration may use: the config and the values transitions draw from.

    ``tokens`` and ``max_len``: every token sequence of length 1..max_len over ``tokens`` is a
    key, in each namespace of ``extra_keys``.  ``max_locks``: locks the driver may hold at once
    (a ``serve`` takes one more for its duration).  ``requests``: requests in flight at once
    (0: no request-level ops).  ``chunked``: tree-level inserts also with ``chunked=True`` (it
    only changes hit counts, which only a host tier keeps).  ``invalid``: steps that every
    implementation must reject, leaving the state unchanged.  ``depth``: the default depth.
    ``host_slots`` > 0: a host tier (HiCache) with ``write_policy`` and
    ``write_through_threshold``, and the host rows of :data:`OP_KINDS`; ``max_host_locks``:
    host locks the driver may hold at once.  ``mamba_extra_buffer`` (with ``requests``):
    the Mamba extra buffer with ``mamba_track_slots``, ``mamba_track_interval`` and
    ``mamba_cache_chunk_size``, and the extra-buffer request rows of :data:`OP_KINDS`.
    ``tree_ops`` False: no tree-level rows (match, insert, serve, lock, unlock, reset,
    invalid): the cache is driven by requests (and ``evict``) alone.  ``ledger_misuse``: the
    invalid steps only a slot ledger refuses (an insert of the tree's own slots or of
    unallocated ones, a copy-on-write match into an unallocated state slot);
    :func:`explore` leaves them out where an implementation keeps no ledger (``fast-noledger``).
    """

    name: str
    page_size: int = 1
    kv_slots: int = 4
    eagle: bool = False
    disable: bool = False
    tokens: tuple = (1, 2)
    max_len: int = 3
    extra_keys: tuple = (None, "a")
    max_locks: int = 2
    requests: int = 0
    chunked: bool = False
    invalid: bool = True
    depth: int = 3
    host_slots: int = 0
    write_policy: str = "write_through"
    write_through_threshold: int = 1
    max_host_locks: int = 1
    eviction_policy: str = "lru"
    priorities: tuple = ()
    components: tuple = ("full",)
    mamba_slots: int = 0
    cow: bool = False
    sessions: tuple = ()
    mamba_extra_buffer: bool = False
    mamba_track_slots: int = 2
    mamba_track_interval: int = 256
    mamba_cache_chunk_size: int = 4
    tree_ops: bool = True
    ledger_misuse: bool = True

    def config(self) -> CacheConfig:
        return CacheConfig(page_size=self.page_size, kv_slots=self.kv_slots, eagle=self.eagle,
                           disable=self.disable, host_slots=self.host_slots,
                           write_policy=self.write_policy,
                           write_through_threshold=self.write_through_threshold,
                           eviction_policy=self.eviction_policy,
                           components=tuple(self.components), mamba_slots=self.mamba_slots,
                           mamba_extra_buffer=self.mamba_extra_buffer,
                           mamba_track_slots=self.mamba_track_slots,
                           mamba_track_interval=self.mamba_track_interval,
                           mamba_cache_chunk_size=self.mamba_cache_chunk_size)

    @property
    def mamba(self) -> bool:
        return "mamba" in self.components

    @property
    def host(self) -> bool:
        return self.host_slots > 0

    def keys(self) -> list[tuple[list, str | None]]:
        """Every key of the universe: (tokens, extra_key), shortest first."""
        out = []
        for ek in self.extra_keys:
            for n in range(1, self.max_len + 1):
                for toks in itertools.product(self.tokens, repeat=n):
                    out.append((list(toks), ek))
        return out

    @property
    def outside_token(self) -> int:
        """A token no key of the universe holds."""
        return max(self.tokens) + 1

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k in _TUPLE_FIELDS:
            d[k] = list(getattr(self, k))
        return d

    @classmethod
    def from_dict(cls, raw: dict, name: str = "custom") -> Universe:
        if not isinstance(raw, dict):
            raise ConfigError(f"a universe must be a JSON object, got {raw!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"universe: unknown key(s) {unknown}; known: {sorted(known)}")
        vals = dict(raw)
        vals.setdefault("name", name)
        for k in _TUPLE_FIELDS:
            if k in vals:
                if not isinstance(vals[k], (list, tuple)):
                    raise ConfigError(f"universe: {k} must be a list, got {vals[k]!r}")
                vals[k] = tuple(vals[k])
        u = cls(**vals)
        u.config().validate()
        if not u.tokens or u.max_len < 1 or u.max_locks < 0 or u.requests < 0 or u.depth < 0 \
                or u.max_host_locks < 0:
            raise ConfigError(f"universe {u.name}: tokens, max_len >= 1, max_locks, "
                              "max_host_locks, requests, depth >= 0 needed")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        host_keys = sorted(k for k in ("write_policy", "write_through_threshold",
                                       "max_host_locks") if getattr(u, k) != defaults[k])
        if not u.host and host_keys:
            raise ConfigError(f"universe {u.name}: {host_keys} need a host tier (host_slots > 0)")
        if u.host and (u.requests or u.eagle or u.disable):
            raise ConfigError(f"universe {u.name}: a host tier is explored through the "
                              "tree-level API only (no requests, EAGLE or disable with host_slots)")
        if u.cow and not u.mamba:
            raise ConfigError(f"universe {u.name}: cow needs the Mamba component")
        if u.mamba and (u.host or (u.eagle and (u.requests or u.cow))
                        or (u.requests and not u.mamba_extra_buffer)):
            raise ConfigError(f"universe {u.name}: Mamba is explored through the tree-level API "
                              "only (no host tier, requests, or EAGLE with requests or cow), "
                              "requests only with the extra buffer (mamba_extra_buffer)")
        if u.mamba_extra_buffer and (not u.requests or u.cow):
            raise ConfigError(f"universe {u.name}: mamba_extra_buffer is explored through "
                              "requests (requests > 0), without cow")
        if not u.tree_ops and not u.requests:
            raise ConfigError(f"universe {u.name}: tree_ops false needs requests > 0")
        if u.sessions and (not u.requests or u.components != ("full",) or u.disable):
            raise ConfigError(f"universe {u.name}: sessions need requests and the Full "
                              "component alone")
        if any(not isinstance(s, str) for s in u.sessions) or any(
                isinstance(p, bool) or not isinstance(p, int) for p in u.priorities):
            raise ConfigError(f"universe {u.name}: sessions are strings, priorities ints")
        return u


_TUPLE_FIELDS = ("tokens", "extra_keys", "priorities", "components", "sessions")


# The named universes, and the default suite (every one, at its default depth).  The default
# depths keep the whole suite under two minutes on two cores (docs/CHECKS.md has the numbers).
UNIVERSES: dict[str, Universe] = {u.name: u for u in (
    Universe("full-p1", page_size=1, kv_slots=4, tokens=(1, 2), max_len=2, depth=3),
    Universe("full-p1-long", page_size=1, kv_slots=4, tokens=(1, 2), max_len=3, depth=2),
    Universe("full-p1-t3", page_size=1, kv_slots=4, tokens=(1, 2, 3), max_len=2,
             extra_keys=(None,), depth=2),
    Universe("full-p2", page_size=2, kv_slots=6, tokens=(1, 2), max_len=4, depth=2),
    Universe("eagle-p1", page_size=1, kv_slots=4, eagle=True, tokens=(1, 2), max_len=3, depth=2),
    Universe("req-p1", page_size=1, kv_slots=4, tokens=(1, 2), max_len=2, extra_keys=(None,),
             requests=2, depth=3),
    Universe("disable", page_size=1, kv_slots=4, disable=True, tokens=(1, 2), max_len=2,
             extra_keys=(None,), requests=1, depth=4),
    # a host tier (HiCache): a device pool of 2 slots and a host pool of 3, so device
    # eviction, backups, host eviction and load backs that must make room are all near
    Universe("host-p1-wt", page_size=1, kv_slots=2, tokens=(1, 2), max_len=2,
             extra_keys=(None,), max_locks=1, invalid=False, depth=3, host_slots=3,
             write_policy="write_through"),
    Universe("host-p1-wb", page_size=1, kv_slots=2, tokens=(1, 2), max_len=2,
             extra_keys=(None,), max_locks=1, invalid=False, depth=4, host_slots=3,
             write_policy="write_back"),
    # eviction policies where the order is not LRU's: a pool of 3 slots, so the second or
    # third insert evicts; priority inserts and serves at priority 0 and 1
    Universe("lfu-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, invalid=False, depth=2, eviction_policy="lfu"),
    Universe("slru-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, invalid=False, depth=2, eviction_policy="slru"),
    Universe("fifo-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, invalid=False, depth=2, eviction_policy="fifo"),
    Universe("priority-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2,
             extra_keys=(None,), max_locks=1, invalid=False, depth=2,
             eviction_policy="priority", priorities=(0, 1)),
    # Mamba copy-on-write: 2 state slots, so a match that needs one finds the pool empty soon
    Universe("mamba-cow-p1", page_size=1, kv_slots=3, components=("full", "mamba"),
             mamba_slots=2, cow=True, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, depth=2),
    # streaming sessions: one session, one request at a time; a whole turn is one transition
    # (so a restore is two away), its steps one at a time too
    Universe("sessions-p1", page_size=1, kv_slots=4, tokens=(1, 2), max_len=1,
             extra_keys=(None,), max_locks=1, requests=1, sessions=("s",), depth=2),
    # the other two eviction policies of issue 18's seven (lru is every other universe's)
    Universe("mru-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, invalid=False, depth=2, eviction_policy="mru"),
    Universe("filo-p1", page_size=1, kv_slots=3, tokens=(1, 2), max_len=2, extra_keys=(None,),
             max_locks=1, invalid=False, depth=2, eviction_policy="filo"),
    # EAGLE bigram keys with an aux component (Mamba; tree-level, as fast runs them): keys of
    # 0-2 bigrams, 2 state slots; depth 1 here, 2 behind slow (docs/CHECKS.md)
    Universe("eagle-mamba-p1", page_size=1, kv_slots=4, eagle=True, components=("full", "mamba"),
             mamba_slots=2, tokens=(1, 2), max_len=3, extra_keys=(None,), max_locks=1,
             depth=1),
    # the Mamba extra buffer, driven by requests alone (the tree rules do not change with it:
    # mamba-cow-p1 explores them): a whole request (admit, prefill, decode across the next
    # track point, finish) is one transition, its steps one at a time too; state pools small enough
    # that admission evicts states and a request can find the pool empty, KV pools that a
    # second prompt evicts from
    Universe("mamba-xbuf-p1", page_size=1, kv_slots=5, components=("full", "mamba"),
             mamba_slots=3, mamba_extra_buffer=True, mamba_track_slots=1,
             mamba_track_interval=2, mamba_cache_chunk_size=1, tokens=(1, 2), max_len=2,
             extra_keys=(None,), requests=2, tree_ops=False, invalid=False, depth=2),
    Universe("mamba-xbuf-p2", page_size=2, kv_slots=8, components=("full", "mamba"),
             mamba_slots=4, mamba_extra_buffer=True, mamba_track_slots=2,
             mamba_track_interval=2, mamba_cache_chunk_size=2, tokens=(1,), max_len=4,
             extra_keys=(None,), requests=1, tree_ops=False, invalid=False, depth=2),
)}


def parse_universe(raw: str) -> Universe:
    """``--config``: a named universe, or a JSON object (``name`` optional; a ``base`` key
    names the universe it starts from)."""
    if raw in UNIVERSES:
        return UNIVERSES[raw]
    if raw.startswith("storage-"):  # the storage tier (conformance/explore/exhaustive_storage.py)
        from uniradix.conformance.explore.exhaustive_storage import STORAGE_UNIVERSES
        if raw in STORAGE_UNIVERSES:
            return STORAGE_UNIVERSES[raw]
    if raw.lstrip().startswith("{"):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ConfigError("--config: a JSON universe must be an object")
        base = obj.pop("base", None)
        if base is not None:
            if base not in UNIVERSES:
                raise ConfigError(f"--config: unknown base universe {base!r}")
            obj = {**UNIVERSES[base].to_dict(), "name": f"{base}+", **obj}
        return Universe.from_dict(obj)
    raise ConfigError(f"--config: unknown universe {raw!r}; named: {', '.join(UNIVERSES)}, "
                      "or a JSON object")


# ----------------------------------------------------------------------------------------------
# A view of the current state (what the transitions are enumerated from)
# ----------------------------------------------------------------------------------------------


def round_up(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


@dataclasses.dataclass
class World:
    """The state as the driver sees it, read from the reference (spec) adapter: the nodes (by
    path), the lock handles the driver holds (one per distinct locked path), the requests in
    flight, and the pool."""

    universe: Universe
    nodes: list           # [{"tokens": [...], "extra_key": ...}] of every non-root node, sorted
    node_slots: list      # the device slots of each node's whole path, same order
    held: list            # [(trace handle, path)]: driver-held live locks, one per meaning
    n_held: int           # driver-held live locks, all of them
    requests: list        # spec Request objects, by rid
    free_slots: int
    storage_rids: tuple = ()  # storage tier: request ids with a prefetch in flight
    # the host tier: nodes with a host copy; per evicted one, the path of its nearest ancestor
    # on the device (what a load back starts from); driver-held live host locks (one per
    # meaning) and all of them; write and load acks not done yet, and all queued acks
    backed_up: list = dataclasses.field(default_factory=list)
    loadable: list = dataclasses.field(default_factory=list)   # [(node path, last device path)]
    host_held: list = dataclasses.field(default_factory=list)  # [(trace handle, meaning)]
    n_host_held: int = 0
    writes_pending: int = 0
    loads_pending: int = 0
    acks: int = 0
    # Mamba: the state slots the driver holds (allocated, neither the tree's nor a request's)
    mamba_held: list = dataclasses.field(default_factory=list)
    mamba_free: int = 0
    # streaming sessions: per parked session, its committed tokens and extra_key; the
    # sessions with a request waiting or running
    parked: dict = dataclasses.field(default_factory=dict)
    busy: frozenset = frozenset()

    @classmethod
    def of(cls, universe: Universe, adapter: SpecAdapter) -> World:
        st = adapter.state
        eagle = st.config.eagle
        nodes, slots = [], []
        for node in all_nodes(st)[1:]:
            units = node.path_units()
            toks = [units[0][0]] + [u[1] for u in units] if eagle else list(units)
            nodes.append({"tokens": toks, "extra_key": node.extra_key})
            path_slots: list[int] = []
            cur: Node | None = node
            while cur is not None and not cur.is_root:
                path_slots[:0] = list(cur.value or ())
                cur = cur.parent
            slots.append(path_slots)
        order = sorted(range(len(nodes)), key=lambda k: _path_sort(nodes[k]))
        held, seen = [], set()
        n_held = 0
        for h_no, handle in sorted(adapter.handles.items()):
            if st.handles.get(handle.serial) is not handle:
                continue  # released
            n_held += 1
            meaning = _handle_meaning(st, handle)
            if meaning not in seen:
                seen.add(meaning)
                held.append((h_no, meaning))
        w = cls(universe, [nodes[k] for k in order], [slots[k] for k in order], held, n_held,
                [r for _, r in sorted(st.requests.items())], st.kv.available_size(),
                tuple(sorted(st.storage.ongoing)) if st.storage is not None else ())
        if st.host is not None:
            w.read_host(adapter)
        if st.mamba is not None:
            tree = {s for n in all_nodes(st) if components.has(n, "mamba")
                    for s in n.aux["mamba"].value}
            reqs = {s for r in st.requests.values()
                    for s in ([r.mamba_slot] if r.mamba_slot is not None else [])
                    + list(r.mamba_track or ())}
            w.mamba_held = sorted(set(st.mamba.allocated_pages()) - tree - reqs)
            w.mamba_free = st.mamba.available_size()
        w.parked = {name: (list(slot.tokens), slot.extra_key)
                    for name, slot in sorted(st.sessions.items())}
        w.busy = frozenset(r.session for r in st.requests.values() if r.session is not None)
        return w

    def read_host(self, adapter: SpecAdapter) -> None:
        st = adapter.state
        host = st.host
        assert host is not None

        def path(node: Node) -> dict:
            units = node.path_units()
            return {"tokens": list(units), "extra_key": node.extra_key}
        for node in all_nodes(st)[1:]:
            if node.host_value is None:
                continue
            self.backed_up.append(path(node))
            if node.value is None:
                last = node.parent
                while last is not None and not last.is_root and last.value is None:
                    last = last.parent
                last_path = ({"tokens": [], "extra_key": node.extra_key}
                             if last is None or last.is_root else path(last))
                self.loadable.append((path(node), last_path))
        self.backed_up.sort(key=_path_sort)
        self.loadable.sort(key=lambda pl: _path_sort(pl[0]))
        seen = set()
        for h_no, handle in sorted(adapter.host_handles.items()):
            if host.host_locks.get(handle.serial) is not handle:
                continue  # released
            self.n_host_held += 1
            meaning = (_node_path(handle.node), handle.locked)
            if meaning not in seen:
                seen.add(meaning)
                self.host_held.append((h_no, meaning))
        self.writes_pending = sum(not a.done for a in host.writes)
        self.loads_pending = sum(not a.done for a in host.loads)
        self.acks = len(host.writes) + len(host.loads)

    def request_names(self) -> list[str]:
        return [r.rid for r in self.requests]

    def next_rid(self) -> str:
        used = set(self.request_names())
        return next(f"r{k}" for k in itertools.count() if f"r{k}" not in used)


def _path_sort(p: dict) -> tuple:
    return (p["extra_key"] is not None, p["extra_key"] or "", p["tokens"])


def _pkey(extra_key: str | None, units: Sequence) -> tuple:
    """A node path as a sortable tuple (None sorts before the namespaces)."""
    return (extra_key is not None, extra_key or "", tuple(units))


def _node_path(node) -> tuple:
    return _pkey(node.extra_key, node.path_units())


def _handle_meaning(state, handle) -> tuple:
    return (_node_path(handle.node), tuple(sorted(_node_path(s) for s in handle.skipped)))


# ----------------------------------------------------------------------------------------------
# Running a transition: the driver
# ----------------------------------------------------------------------------------------------


class FoundIt(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(str(finding))
        self.finding = finding


class Driver:
    """Issues the trace steps of one transition on a :class:`Lockstep`, numbering them after
    the path, checking every step fully, and keeping them for the record."""

    def __init__(self, ls: Lockstep, universe: Universe, first_i: int) -> None:
        self.ls = ls
        self.universe = universe
        self.ps = universe.page_size
        self.next_i = first_i
        self.steps: list[dict] = []

    @property
    def pool(self):
        """The environment's KV pool (the reference adapter's; every adapter's is the same
        as long as the snapshots agree)."""
        return self.ls.adapters[0].pool

    def step(self, op: str, args: dict, must_reject: bool = False) -> dict:
        s: dict[str, Any] = {"i": self.next_i, "op": op, "args": args}
        self.next_i += 1
        self.steps.append(s)
        obs, finding = self.ls.check(s, full=True)
        if finding is None and must_reject and "error" not in obs:
            finding = Finding(VIOLATION, s["i"], op, "must_reject", "", {self.ls.labels[0]: obs},
                              (self.ls.labels[0],), args)
        if finding is not None:
            raise FoundIt(finding)
        return obs

    def make_room(self, need: int) -> bool:
        """Evict when the pool is short of ``need`` slots (the scheduler's way); True when
        ``need`` slots are free now."""
        short = need - self.pool.available_size()
        if short > 0:
            self.step("evict", {"num_tokens": short})
        return need <= self.pool.available_size()

    def aligned_units(self, n_tokens: int) -> int:
        units = max(0, n_tokens - 1) if self.universe.eagle else n_tokens
        return units - units % self.ps

    def consumed(self, obs: dict, n_tokens: int) -> int:
        """Value positions an insert took from the caller (to the tree, or freed as
        duplicates): the aligned length when it was accepted by an enabled cache."""
        if "error" in obs or self.universe.disable:
            return 0
        return self.aligned_units(n_tokens)


@dataclasses.dataclass(frozen=True)
class Transition:
    label: str
    run: Callable[[Driver], None]


# -- the transitions, one function per kind -----------------------------------------------------


def _args_key(tokens: list, ek: str | None) -> dict:
    return {"tokens": list(tokens), "extra_key": ek}


def _priority(priority: int | None) -> dict:
    return {} if priority is None else {"priority": priority}


def _mamba_slot(d: Driver) -> int | None:
    """A state slot for a Mamba insert: one state evicted first when the pool is empty (as the
    scheduler makes room), then ``mamba_alloc``; None when none could be had."""
    def full() -> bool:  # read from the last step's snapshot (every implementation's agree)
        return len(_snaps(d.ls)[0]["mamba_pool"]) >= d.universe.mamba_slots
    if full():
        d.step("evict", {"num_tokens": 0, "mamba_num": 1})
    if full():
        return None
    return int(d.step("mamba_alloc", {"n": 1})["slots"][0])


def _mamba_done(d: Driver, obs: dict | None, slot: int | None) -> None:
    """The insert's state slot goes back when the tree did not take it."""
    if slot is not None and (obs is None or "error" in obs or obs.get("mamba_exist")):
        d.step("mamba_free", {"slots": [slot]})


def run_insert_fresh(d: Driver, tokens: list, ek: str | None, chunked: bool,
                     priority: int | None = None) -> None:
    """Fresh pages for the whole key, ``prev_prefix_len`` 0: what the tree holds already comes
    back as duplicates; the pages past the aligned length are freed after.  With Mamba a
    fresh state slot goes with it (freed after unless the tree took it)."""
    n = len(tokens)
    need = round_up(n, d.ps)
    if not d.make_room(need):
        return
    slots = d.step("alloc", {"n": need})["slots"]
    extra = _priority(priority)
    mslot = None
    if d.universe.mamba:
        mslot = _mamba_slot(d)
        if mslot is None:
            d.step("free", {"slots": slots})
            return
        extra["mamba_value"] = [mslot]
    obs = d.step("insert", {**_args_key(tokens, ek), "value": slots[:n], "prev_prefix_len": 0,
                            "chunked": chunked, **extra})
    rest = slots[d.consumed(obs, n):]
    if rest:
        d.step("free", {"slots": rest})
    _mamba_done(d, obs, mslot)


def run_serve(d: Driver, tokens: list, ek: str | None, priority: int | None = None) -> None:
    """A prompt served the scheduler's way: match, lock the match, make room (evicting),
    allocate the rest, insert with ``prev_prefix_len`` = the match, free the tail, unlock.
    With copy-on-write the match is a request's (``cow_mamba``) and the state slot it hands
    out goes with the insert; otherwise, with Mamba, a fresh one."""
    cow = d.universe.cow
    m = d.step("match_prefix", {**_args_key(tokens, ek),
                                **({"cow_mamba": True, "mamba_slot": None} if cow else {})})
    length, idx = m["last_device_node"], list(m["device_indices"])
    mslot = m.get("mamba_pool_idx") if cow else None
    handle = None
    if length > 0:
        path = list(tokens[: length + (1 if d.universe.eagle else 0)])
        handle = d.step("lock", {"node": _args_key(path, ek)})["handle"]
    fresh_n = len(tokens) - len(idx)
    slots: list = []
    if fresh_n > 0:
        need = round_up(fresh_n, d.ps)
        if d.make_room(need):
            slots = d.step("alloc", {"n": need})["slots"]
    extra = _priority(priority)
    if d.universe.mamba and mslot is None and (fresh_n <= 0 or slots):
        mslot = _mamba_slot(d)
    obs = None
    if (fresh_n <= 0 or slots) and (mslot is not None or not d.universe.mamba):
        if mslot is not None:
            extra["mamba_value"] = [mslot]
        obs = d.step("insert", {**_args_key(tokens, ek), "value": idx + slots[:fresh_n],
                                "prev_prefix_len": length, "chunked": False, **extra})
        rest = slots[max(0, d.consumed(obs, len(tokens)) - length):]
    else:
        rest = slots
    if rest:
        d.step("free", {"slots": rest})
    _mamba_done(d, obs, mslot)
    if handle is not None:
        d.step("unlock", {"handle": handle})


def single(op: str, args: dict, must_reject: bool = False) -> Callable[[Driver], None]:
    """A transition of one trace step."""
    def run(d: Driver) -> None:
        d.step(op, args, must_reject=must_reject)
    return run


def t_match(u: Universe, w: World) -> Iterator[Transition]:
    for toks, ek in u.keys():
        yield Transition(f"match_prefix {toks} {ek}", single("match_prefix", _args_key(toks, ek)))


def _priorities(u: Universe) -> tuple:
    return u.priorities or (None,)


def _plabel(priority: int | None) -> str:
    return "" if priority is None else f" priority {priority}"


def t_insert(u: Universe, w: World) -> Iterator[Transition]:
    for toks, ek in u.keys():
        for chunked in ((False, True) if u.chunked else (False,)):
            for pr in _priorities(u):
                yield Transition(f"insert {toks} {ek}" + (" chunked" if chunked else "")
                                 + _plabel(pr), functools.partial(
                                     run_insert_fresh, tokens=toks, ek=ek, chunked=chunked,
                                     priority=pr))


def t_serve(u: Universe, w: World) -> Iterator[Transition]:
    for toks, ek in u.keys():
        for pr in _priorities(u):
            yield Transition(f"serve {toks} {ek}{_plabel(pr)}",
                             functools.partial(run_serve, tokens=toks, ek=ek, priority=pr))


def t_lock(u: Universe, w: World) -> Iterator[Transition]:
    if w.n_held >= u.max_locks:
        return
    for p in w.nodes:
        yield Transition(f"lock {p['tokens']} {p['extra_key']}", single("lock", {"node": dict(p)}))


def t_unlock(u: Universe, w: World) -> Iterator[Transition]:
    for h, meaning in w.held:
        yield Transition(f"unlock {h} ({list(meaning[0][2])} {meaning[0][1] or None})",
                         single("unlock", {"handle": h}))


def evict_sizes(u: Universe) -> list[int]:
    return sorted({1, u.page_size + 1, u.kv_slots})


def t_evict(u: Universe, w: World) -> Iterator[Transition]:
    for n in evict_sizes(u):
        yield Transition(f"evict {n}", single("evict", {"num_tokens": n}))
    if u.mamba:  # one state, the Mamba component's own LRU order
        yield Transition("evict mamba 1", single("evict", {"num_tokens": 0, "mamba_num": 1}))


def t_reset(u: Universe, w: World) -> Iterator[Transition]:
    yield Transition("reset", single("reset", {}))


def t_invalid(u: Universe, w: World) -> Iterator[Transition]:
    """Steps every implementation must reject alike, changing nothing."""
    if not u.invalid:
        return
    yield Transition("invalid: unlock unknown handle", single("unlock", {"handle": -1}, True))
    yield Transition("invalid: lock a non-node path",
                     single("lock", {"node": _args_key([u.outside_token], None)}, True))
    if u.disable or not u.ledger_misuse:
        return  # a disabled cache ignores insert values; without a ledger they are taken
    extra = 1 if u.eagle else 0
    if w.nodes:  # the tree's own slots handed over again, from prev_prefix_len 0
        p, slots = w.nodes[0], w.node_slots[0]
        value = slots + [-1] * extra
        yield Transition("invalid: insert the tree's own slots", single(
            "insert", {**_args_key(p["tokens"], p["extra_key"]), "value": value}, True))
    # a new page whose slots lie outside the pool (so not allocated)
    first = (u.kv_slots // u.page_size + 1) * u.page_size
    value = list(range(first, first + u.page_size + extra))
    toks = [u.outside_token] * (u.page_size + extra)
    yield Transition("invalid: insert unallocated slots",
                     single("insert", {**_args_key(toks, None), "value": value}, True))


# -- request-level transitions ----------------------------------------------------------------


def t_req_arrive(u: Universe, w: World) -> Iterator[Transition]:
    if len(w.requests) >= u.requests:
        return
    rid = w.next_rid()
    for toks, ek in u.keys():
        yield Transition(f"req_arrive {rid} {toks} {ek}",
                         single("req_arrive", {"rid": rid, **_args_key(toks, ek)}))


def t_req_step(u: Universe, w: World) -> Iterator[Transition]:
    for r in w.requests:
        rid = r.rid
        if not r.admitted:
            yield Transition(f"req_admit {rid}", single("req_admit", {"rid": rid}))
        elif r.committed < len(r.input_ids):
            left = len(r.input_ids) - r.committed
            sizes = {1, left}
            if u.mamba_extra_buffer and u.mamba_cache_chunk_size < left:  # tracks at its end
                sizes.add(u.mamba_cache_chunk_size)
            for n in sorted(sizes):
                yield Transition(f"req_chunk {rid} {n}", single(
                    "req_chunk", {"rid": rid, "n": n, "chunked": n < left}))
        else:
            yield Transition(f"req_decode {rid} 1", single("req_decode", {"rid": rid, "n": 1}))
            k = to_track_point(u, r.committed)
            if u.mamba_extra_buffer and k > 1:  # across the next track point in one step
                yield Transition(f"req_decode {rid} {k}", single(
                    "req_decode", {"rid": rid, "n": k}))
        if r.admitted:
            yield Transition(f"req_finish {rid}", single("req_finish", {"rid": rid}))
        yield Transition(f"req_abort {rid}", single("req_abort", {"rid": rid}))


# -- the Mamba extra buffer's request transitions (universes with mamba_extra_buffer) ----------


def to_track_point(u: Universe, committed: int) -> int:
    """Decode steps from ``committed`` computed tokens to the next decode track point."""
    return u.mamba_track_interval - committed % u.mamba_track_interval


def _start(d: Driver, rid: str, tokens: list, ek: str | None) -> int | None:
    """Arrive and admit (the admission takes the request's state and track slots, evicting
    states when the pool is short; without them the request waits, holding nothing); the
    prefix length when admitted, else None."""
    if "error" in d.step("req_arrive", {"rid": rid, **_args_key(tokens, ek)}):
        return None
    admit = d.step("req_admit", {"rid": rid})
    if "error" in admit or admit.get("mamba_pool_idx") is None:
        return None
    return int(admit["prefix_len"])


def run_start(d: Driver, rid: str, tokens: list, ek: str | None) -> None:
    _start(d, rid, tokens, ek)


def run_request(d: Driver, rid: str, tokens: list, ek: str | None) -> None:
    """A whole request: arrive, admit, prefill the rest in one chunk (tracked at its last whole
    chunk, the tracked state cached), decode across the next track point to one token past
    it, finish (cached up to that track point, the slots past it freed); it stops where a step
    is refused or finds no room, leaving the request where it is."""
    prefix = _start(d, rid, tokens, ek)
    if prefix is None:
        return
    left = len(tokens) - prefix
    if left > 0 and not d.step("req_chunk", {"rid": rid, "n": left, "chunked": False}).get("ok"):
        return
    n = to_track_point(d.universe, len(tokens)) + 1
    if not d.step("req_decode", {"rid": rid, "n": n}).get("ok"):
        return
    d.step("req_finish", {"rid": rid})


def t_req_start(u: Universe, w: World) -> Iterator[Transition]:
    """Extra buffer: a new request arrives and is admitted in one transition (``req_start``),
    or runs to its end in one (``req_run``, :func:`run_request`)."""
    if len(w.requests) >= u.requests:
        return
    rid = w.next_rid()
    for toks, ek in u.keys():
        yield Transition(f"req_start {rid} {toks} {ek}",
                         functools.partial(run_start, rid=rid, tokens=toks, ek=ek))
        yield Transition(f"req_run {rid} {toks} {ek}",
                         functools.partial(run_request, rid=rid, tokens=toks, ek=ek))


# -- host-tier transitions (universes with host_slots > 0) --------------------------------------


def evict_host_sizes(u: Universe) -> list[int]:
    return sorted({1, u.page_size + 1, u.host_slots})


def t_evict_host(u: Universe, w: World) -> Iterator[Transition]:
    for n in evict_host_sizes(u):
        yield Transition(f"evict_host {n}", single("evict_host", {"num_tokens": n}))


def t_load_back(u: Universe, w: World) -> Iterator[Transition]:
    """Every evicted node with a host copy, loaded back from its nearest device ancestor (the
    scheduler's ``init_load_back`` after a match that ended there)."""
    for node, last in w.loadable:
        yield Transition(f"load_back {node['tokens']} from {last['tokens']}", single(
            "load_back", {"node": dict(node), "last_device_node": dict(last), "mem_quota": None}))


def t_host_lock(u: Universe, w: World) -> Iterator[Transition]:
    if w.n_host_held >= u.max_host_locks:
        return
    for p in w.backed_up:
        yield Transition(f"host_lock {p['tokens']}", single("host_lock", {"node": dict(p)}))


def t_host_unlock(u: Universe, w: World) -> Iterator[Transition]:
    for h, meaning in w.host_held:
        yield Transition(f"host_unlock {h} ({list(meaning[0][2])})",
                         single("host_unlock", {"handle": h}))


def run_settle(d: Driver) -> None:
    """Every queued transfer completes and the cache processes the acks."""
    d.step("io_complete", {"writes": -1, "loads": -1})
    d.step("check_hicache_events", {})


def run_serve_settle(d: Driver, tokens: list, ek: str | None) -> None:
    run_serve(d, tokens, ek)
    run_settle(d)


def t_serve_settle(u: Universe, w: World) -> Iterator[Transition]:
    """Write-through: a prompt served, then its backups complete and are processed (so a
    backed-up, unlocked node is one transition away, and a load back three)."""
    for toks, ek in u.keys():
        yield Transition(f"serve+settle {toks} {ek}",
                         functools.partial(run_serve_settle, tokens=toks, ek=ek))


def t_acks(u: Universe, w: World) -> Iterator[Transition]:
    """The environment's acks, one transfer at a time (the oldest write or load completes),
    the cache's ``writing_check`` / ``loading_check``, and both together (``settle``)."""
    if w.writes_pending:
        yield Transition("io_complete write", single("io_complete", {"writes": 1, "loads": 0}))
    if w.loads_pending:
        yield Transition("io_complete load", single("io_complete", {"writes": 0, "loads": 1}))
    if w.acks:
        yield Transition("check_hicache_events", single("check_hicache_events", {}))
        if w.writes_pending or w.loads_pending:
            yield Transition("settle", run_settle)


# -- Mamba copy-on-write (universes with cow) -------------------------------------------------


def t_cow_match(u: Universe, w: World) -> Iterator[Transition]:
    """A request's match with copy-on-write: with no state slot (the match takes one, which the
    driver then holds; only while it holds none) or with the one the driver holds."""
    for toks, ek in u.keys():
        args = {**_args_key(toks, ek), "cow_mamba": True}
        if not w.mamba_held:
            yield Transition(f"match_prefix cow {toks} {ek}",
                             single("match_prefix", {**args, "mamba_slot": None}))
        for slot in w.mamba_held:
            yield Transition(f"match_prefix cow {toks} {ek} slot {slot}",
                             single("match_prefix", {**args, "mamba_slot": slot}))


def t_mamba_free(u: Universe, w: World) -> Iterator[Transition]:
    for slot in w.mamba_held:
        yield Transition(f"mamba_free {slot}", single("mamba_free", {"slots": [slot]}))


def t_cow_invalid(u: Universe, w: World) -> Iterator[Transition]:
    if not u.invalid or not u.ledger_misuse:  # (only a slot ledger knows the slot is free)
        return
    toks, ek = u.keys()[0]
    yield Transition("invalid: cow with an unallocated state slot", single(
        "match_prefix", {**_args_key(toks, ek), "cow_mamba": True,
                         "mamba_slot": u.mamba_slots + 1}, True))


# -- streaming sessions (universes with sessions) ----------------------------------------------


def t_session_arrive(u: Universe, w: World) -> Iterator[Transition]:
    """A request of each session with none waiting or running: a first turn with every key,
    or the parked tokens plus one more token (the next turn); a request of a busy session and
    one that does not continue the parked tokens must be rejected."""
    if len(w.requests) >= u.requests:
        return
    rid = w.next_rid()
    for name in u.sessions:
        if name in w.busy:
            if u.invalid:
                toks, ek = u.keys()[0]
                yield Transition(f"invalid: req_arrive {rid} busy session {name}", single(
                    "req_arrive", {"rid": rid, **_args_key(toks, ek), "session": name}, True))
            continue
        if name in w.parked:
            base, ek = w.parked[name]
            for t in u.tokens:
                yield Transition(f"req_arrive {rid} {base + [t]} {ek} session {name}", single(
                    "req_arrive", {"rid": rid, **_args_key(base + [t], ek), "session": name}))
            if u.invalid:
                other = [u.outside_token] * (len(base) + 1)
                yield Transition(f"invalid: req_arrive {rid} not continuing session {name}",
                                 single("req_arrive", {"rid": rid, **_args_key(other, ek),
                                                       "session": name}, True))
            continue
        for toks, ek in u.keys():
            yield Transition(f"req_arrive {rid} {toks} {ek} session {name}", single(
                "req_arrive", {"rid": rid, **_args_key(toks, ek), "session": name}))


def run_turn(d: Driver, rid: str, tokens: list, ek: str | None, session: str) -> None:
    """A whole turn of a session: arrive, admit (restored from the slot after the first
    turn), prefill the rest in one chunk, finish (parking the row); it stops at a rejected
    step, leaving the request where it is."""
    if "error" in d.step("req_arrive", {"rid": rid, **_args_key(tokens, ek), "session": session}):
        return
    admit = d.step("req_admit", {"rid": rid})
    if "error" in admit:
        return
    left = len(tokens) - admit["prefix_len"]
    if left > 0 and "error" in d.step("req_chunk", {"rid": rid, "n": left, "chunked": False}):
        return
    d.step("req_finish", {"rid": rid})


def t_session_turn(u: Universe, w: World) -> Iterator[Transition]:
    """:func:`run_turn` of each session with no request waiting or running: a first turn with
    every key, or the parked tokens plus one more token (so a restore is two transitions
    away)."""
    if len(w.requests) >= u.requests:
        return
    rid = w.next_rid()
    for name in u.sessions:
        if name in w.busy:
            continue
        if name in w.parked:
            base, ek = w.parked[name]
            keys = [(base + [t], ek) for t in u.tokens]
        else:
            keys = u.keys()
        for toks, ek in keys:
            yield Transition(f"turn {rid} {toks} {ek} session {name}", functools.partial(
                run_turn, rid=rid, tokens=toks, ek=ek, session=name))


def t_session_end(u: Universe, w: World) -> Iterator[Transition]:
    """``release_session`` of each parked session (rejected while a request of it runs), of an
    unknown one (frees nothing), and ``session_held``."""
    running = {r.session for r in w.requests if r.session is not None and r.admitted}
    for name in w.parked:
        yield Transition(f"release_session {name}", single(
            "release_session", {"session": name}, must_reject=name in running))
    yield Transition("release_session unknown",
                     single("release_session", {"session": "s-unknown"}))
    yield Transition("session_held", single("session_held", {}))


@dataclasses.dataclass(frozen=True)
class OpKind:
    """One row of the transition table: a name, when it applies, and its transitions."""

    name: str
    transitions: Callable[[Universe, World], Iterable[Transition]]
    applies: Callable[[Universe], bool] = lambda u: True


# The transition table; the host tier's rows apply to universes with a host tier.
OP_KINDS: tuple[OpKind, ...] = (
    OpKind("match_prefix", t_match, lambda u: u.tree_ops),
    OpKind("insert", t_insert, lambda u: u.tree_ops),
    OpKind("serve", t_serve, lambda u: u.tree_ops),
    OpKind("lock", t_lock, lambda u: u.tree_ops),
    OpKind("unlock", t_unlock, lambda u: u.tree_ops),
    OpKind("evict", t_evict),
    OpKind("reset", t_reset, lambda u: u.tree_ops),
    OpKind("invalid", t_invalid, lambda u: u.tree_ops),
    OpKind("req_arrive", t_req_arrive, lambda u: u.requests > 0 and not u.mamba_extra_buffer),
    OpKind("req_step", t_req_step, lambda u: u.requests > 0),
    OpKind("req_start", t_req_start, lambda u: u.requests > 0 and u.mamba_extra_buffer),
    OpKind("evict_host", t_evict_host, lambda u: u.host),
    OpKind("load_back", t_load_back, lambda u: u.host),
    OpKind("host_lock", t_host_lock, lambda u: u.host),
    OpKind("host_unlock", t_host_unlock, lambda u: u.host),
    OpKind("acks", t_acks, lambda u: u.host),
    OpKind("serve+settle", t_serve_settle,
           lambda u: u.host and u.write_policy != "write_back"),
    OpKind("cow_match", t_cow_match, lambda u: u.cow),
    OpKind("mamba_free", t_mamba_free, lambda u: u.cow),
    OpKind("cow_invalid", t_cow_invalid, lambda u: u.cow),
    OpKind("session_arrive", t_session_arrive, lambda u: bool(u.sessions)),
    OpKind("session_turn", t_session_turn, lambda u: bool(u.sessions)),
    OpKind("session_end", t_session_end, lambda u: bool(u.sessions)),
)


def transitions(u: Universe, w: World, kinds: Sequence[OpKind] = OP_KINDS) -> list[Transition]:
    return [t for k in kinds if k.applies(u) for t in k.transitions(u, w)]


# ----------------------------------------------------------------------------------------------
# State keys (deduplication)
# ----------------------------------------------------------------------------------------------


def spec_fingerprint(adapter: SpecAdapter) -> tuple:
    """What decides the spec's future beyond its canonical snapshot.

    * The access-stamp order of *every* node (the snapshot holds only the current leaves'
      order; an inner node's place matters once its children are gone).  Only the order
      matters: stamps are only ever compared with each other, and every new stamp (a touch,
      a split, a new leaf, a match path's ``(T, -k)``) takes a tick above every existing one.
      So the clock's value and the lock serials are names, not state.
    * The live lock handles, by meaning: the locked node's path and the skipped bottom
      segment (trace handle numbers are names; the explorer unlocks one handle per meaning).
    * The requests in flight: tokens, namespace, outputs and the path their lock holds (the
      snapshot has their rows and lengths).
    * Under ``fifo`` and ``filo``, the creation order of every node (hit counts and
      priorities are in the snapshot).
    * Streaming sessions: each parked slot's tokens, namespace and lock (by meaning), and the
      session each request names (the snapshot has the slots' rows and lengths).
    """
    st = adapter.state
    nodes = [n for n in all_nodes(st) if not n.is_root]
    order = tuple(_node_path(n) for n in sorted(nodes, key=lambda n: n.stamp))
    driver = []
    for handle in adapter.handles.values():
        if st.handles.get(handle.serial) is handle:
            driver.append(_handle_meaning(st, handle))
    reqs = tuple((r.rid, tuple(r.input_ids), r.extra_key, tuple(r.output_ids), r.admitted,
                  None if r.lock is None else _handle_meaning(st, r.lock))
                 for _, r in sorted(st.requests.items()))
    out: tuple = ("spec", order, tuple(sorted(driver)), reqs, len(st.handles),
                  _spec_host(adapter))
    if st.config.eviction_policy in ("fifo", "filo"):  # the creation order decides theirs
        out += (tuple(_node_path(n) for n in sorted(nodes, key=lambda n: n.created)),)
    if st.sessions or any(r.session is not None for r in st.requests.values()):
        # the parked slots beyond the snapshot's view: tokens, namespace, the lock's meaning;
        # and which session each request names
        out += (tuple((name, tuple(slot.tokens), slot.extra_key,
                       None if slot.lock is None else _handle_meaning(st, slot.lock))
                      for name, slot in sorted(st.sessions.items())),
                tuple((r.rid, r.session) for _, r in sorted(st.requests.items())))
    return out


def _spec_host(adapter: SpecAdapter) -> tuple:
    """The host tier beyond the snapshot (which has host copies, host lock counts, the host
    leaf order and the acks' nodes, done flags and whether they lock): the driver's live host
    locks by meaning (node, whether it counted), and each ack's lock by meaning (what its
    release unlocks)."""
    host = adapter.state.host
    if host is None:
        return ()
    held = sorted((_node_path(h.node), h.locked) for h in adapter.host_handles.values()
                  if host.host_locks.get(h.serial) is h)
    acks = tuple(tuple(None if a.lock is None else _handle_meaning(adapter.state, a.lock)
                       for a in q) for q in (host.writes, host.loads))
    return (tuple(held), acks)


def fast_fingerprint(adapter: Any) -> tuple:
    """The fast path's hidden state, as far as it can decide the future, up to renaming (node
    ids, the clock's value, tensor storage): per node (by path) its stamp rank, its count of
    children holding device data, whether a live heap entry (stamp == the node's stamp) exists;
    whether the clock is ahead of every stamp; whether the leaf heap's compactions are due
    (:func:`_heap_due`); the driver's handles and the requests' locks by path.  Stale heap
    entries are inert (stamps only grow, so an entry once stale stays stale; a detached node
    never comes back) and are left out.  Reads the cache's private fields: a renamed one raises
    AttributeError and stops the search, where it would otherwise leave the dedup to the
    snapshot alone (tests/conformance/explore/test_exhaustive.py builds every universe's)."""
    c = adapter.cache
    root = c.root_node
    nodes = [n for n in c.all_nodes() if n is not root]
    paths = {id(n): _pkey(n.extra_key, adapter._tokens_of(n)) for n in nodes}
    stamps = sorted({n.last_access_time for n in nodes})
    rank = {s: k for k, s in enumerate(stamps)}
    live = {id(n) for s, n in c._heap if n.last_access_time == s and id(n) in paths}
    per_node = tuple(sorted((paths[id(n)], rank[n.last_access_time], n.dev_children,
                             id(n) in live, n.lock_ref) for n in nodes))
    ids = {n.id: paths[id(n)] for n in nodes}

    def skip_paths(params: Any) -> tuple:
        if params is None:
            return ()
        return tuple(sorted(str(ids.get(i, "detached"))
                            for s in params.skip_lock_node_ids.values() for i in s))

    handles = tuple(sorted((paths.get(id(node), "detached"), skip_paths(p))
                           for node, p in adapter.handles.values()))
    reqs = tuple((rid, paths.get(id(r.last_node), "root" if r.last_node is root else None),
                  skip_paths(r.dec_lock_params), r.cache_protected_len, r.committed,
                  r.row_len, len(r.output_ids))
                 for rid, r in sorted(adapter.requests.items()))
    clock_ok = all(c._clock >= n.last_access_time for n in nodes)
    host = _fast_host(adapter, nodes, paths, ids) if adapter.config.has_host_tier else ()
    due = _heap_due(c._leaf_heap, c._evictable // max(c.page_size, 1))
    return ("fast", per_node, clock_ok, due, handles, reqs, host)


def _heap_due(heap: Any, live_bound: int) -> tuple[bool, bool]:
    """Which of a ``LazyHeap``'s two compactions (fast/structures.py) are due: ``upkeep``'s
    (more entries than its ``cap``, at the end of a public call that can push) and an
    eviction's (``needs_compaction``, given the owner's bound on its live entries).  A
    compaction changes no pop order; this keeps apart states whose next calls run different
    code."""
    return (len(heap.entries) > heap.cap, heap.needs_compaction(live_bound))


def _fast_host(adapter: Any, nodes: list, paths: dict, ids: dict) -> tuple:
    """The fast path's host tier beyond the snapshot, up to renaming: per node its host lock
    count, host-leaf membership and whether a live host-heap entry exists; the ack queues with
    the nodes each ack covers (one load ack can cover several nodes) and the lock each
    in-flight transfer holds (by its anchor and skipped paths); the driver's host locks by
    path and whether they counted."""
    c = adapter.cache
    heap = c.tier.host_leaf_heap
    live = {id(n) for s, n in heap.entries if n.last_access_time == s and id(n) in paths}
    per_node = tuple(sorted((paths[id(n)], n.host_lock_ref, n in c.host_leaves, id(n) in live)
                            for n in nodes))

    def lock(params: Any) -> tuple | None:
        if params is None:
            return None
        anchor = getattr(params, "anchor", None)
        return (paths.get(id(anchor), "root" if anchor is c.root_node else None),
                tuple(sorted(str(ids.get(i, "detached"))
                             for s in params.skip_lock_node_ids.values() for i in s)))

    cc = c.cache_controller
    queues = []
    for queue, ongoing in ((cc.ack_write_queue, c.ongoing_write_through),
                           (cc.ack_load_queue, c.ongoing_load_back)):
        acks = []
        for ack in queue:
            covered = []
            for i in ack.node_ids:
                entry = ongoing.get(i)
                covered.append(None if entry is None
                               else (paths.get(id(entry.node)), lock(entry.lock)))
            acks.append((ack.finish_event.query(), tuple(covered)))
        queues.append(tuple(acks))
    held = tuple(sorted((paths.get(id(node), "detached"), locked)
                        for node, locked, *_ in adapter.host_handles.values()))
    return (per_node, tuple(queues), held, len(cc._pending_loads),
            _heap_due(heap, len(c.host_leaves)))


def fingerprint(adapter: Any) -> tuple:
    """An implementation's hidden state beyond its snapshot (see the two functions above);
    other adapters can define ``fingerprint()``; without one only the snapshot counts."""
    own = getattr(adapter, "fingerprint", None)
    if callable(own):
        return own()
    if isinstance(adapter, SpecAdapter):
        return spec_fingerprint(adapter)
    try:
        from uniradix.conformance.adapters.fast_adapter import FastAdapter
    except ImportError:  # pragma: no cover - no torch
        return (type(adapter).__name__,)
    if isinstance(adapter, FastAdapter):
        return fast_fingerprint(adapter)
    return (type(adapter).__name__,)


def state_key(snapshots: Sequence[dict], adapters: Sequence[Any]) -> bytes:
    """The dedup key of a state: the reference's canonical snapshot (every implementation's
    equals it, or the lockstep check has failed already) and every adapter's fingerprint,
    hashed (BLAKE2b, 16 bytes, of the ``repr``: snapshots are built in a fixed key order, and
    the digest is the same in every process)."""
    body = (snapshots[0], tuple(fingerprint(a) for a in adapters))
    return hashlib.blake2b(repr(body).encode(), digest_size=16).digest()


# ----------------------------------------------------------------------------------------------
# Expanding states (in this process or in workers)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Child:
    label: str
    steps: str                 # the transition's steps, JSON
    key: bytes | None       # None at a finding
    finding: Finding | None = None


def _fresh(impls: Sequence[ImplSpec], config: CacheConfig, labels: Sequence[str],
           path: Sequence[dict]) -> Lockstep:
    adapters = build_adapters(impls, config)
    for s in path:
        for a in adapters:
            a.apply(s)
    # no KV events: the adapters have already run ``path`` (an implementation that rebuilds its
    # cache to emit them, fast, can only start on an empty one), and fast's Full universes
    # stay on its C core this way
    ls = Lockstep(adapters, labels, events=False)
    ls.prime()
    return ls


def expand(universe: Universe, impls: Sequence[ImplSpec], path: Sequence[dict],
           kinds: Sequence[OpKind] = OP_KINDS) -> list[Child]:
    """Run every transition from the state that ``path`` reaches; stop at the first finding."""
    config = universe.config()
    labels = impl_labels([impl_name(i) for i in impls])
    base = SpecAdapter(config)
    for s in path:
        base.apply(s)
    out = []
    for t in transitions(universe, World.of(universe, base), kinds):
        ls = _fresh(impls, config, labels, path)
        d = Driver(ls, universe, len(path))
        try:
            t.run(d)
        except FoundIt as e:
            out.append(Child(t.label, json.dumps(d.steps), None, e.finding))
            return out
        out.append(Child(t.label, json.dumps(d.steps), state_key(_snaps(ls), ls.adapters)))
    return out


def initial_key(universe: Universe, impls: Sequence[ImplSpec]) -> tuple[bytes, Finding | None]:
    """The key of the empty state, and a finding if it already breaks an invariant."""
    ls = _fresh(impls, universe.config(), impl_labels([impl_name(i) for i in impls]), [])
    bad = {lab: v for lab, a in zip(ls.labels, ls.adapters, strict=True) if (v := a.violations())}
    finding = None
    if bad:
        finding = Finding(VIOLATION, -1, "(initial state)", "violations", "", bad, tuple(bad))
    else:
        f = ls._compare_snapshots(_snaps(ls), -1, "(initial state)", None)
        finding = f
    return state_key(_snaps(ls), ls.adapters), finding


def _snaps(ls: Lockstep) -> list:
    """The snapshots of the last step (``prime`` and every full check take them)."""
    if ls._last_snaps is None:
        raise RuntimeError("the last lockstep step took no snapshots")
    return ls._last_snaps


def _worker_expand(universe: Universe, impls: Sequence[str], paths: list[str]) -> list[list[Child]]:
    out = []
    for p in paths:
        children = expand(universe, impls, json.loads(p))
        out.append(children)
        if children and children[-1].finding is not None:
            break
    return out


def worker_pool(jobs: int) -> concurrent.futures.ProcessPoolExecutor:
    """Spawned workers (the fast path's torch does not like being forked)."""
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"))


# ----------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckResult:
    universe: str
    states: int = 0
    transitions: int = 0
    steps: int = 0
    depth: int = 0                     # the deepest level fully explored
    levels: list = dataclasses.field(default_factory=list)  # new states per level
    seconds: float = 0.0
    complete: bool = True              # False: stopped by the time limit
    finding: Finding | None = None
    counterexample: list | None = None   # the steps, numbered from 0
    labels: list | None = None      # the transitions of the counterexample
    trace_path: str | None = None

    def summary(self, prefix: str = "check") -> str:
        head = (f"{prefix}: {self.states} states, {self.transitions} transitions, depth "
                f"{self.depth}, {self.seconds:.1f} s")
        if self.finding is not None:
            return f"{head}: FAILED: {self.finding}"
        return f"{head}: ok" + ("" if self.complete else " (time limit: search incomplete)")


class Bar(Progress):
    """The progress bar of ``uniradix conform`` (stderr; ``\\r`` on a terminal, a line every few
    seconds otherwise), counting depth levels and states instead of steps."""

    def __init__(self, label: str, depth: int, stream: TextIO | None, enabled: bool) -> None:
        super().__init__(label, None, None, stream, enabled)
        self.depth = depth

    def update(self, level: int, done: int, of: int, res: CheckResult,  # type: ignore[override]
               force: bool = False) -> None:
        if not self._due(force):
            return
        frac = ((level - 1) + (done / of if of else 1.0)) / max(1, self.depth)
        el = max(self.last - self.t0, 1e-9)
        self._emit(f"{self.label} [{self.bar(frac)}] depth {level}/{self.depth} "
                   f"({done}/{of} states), {res.states} states, {res.transitions} transitions, "
                   f"{res.transitions / el:.0f} tr/s")

    def close(self) -> None:  # type: ignore[override]
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def explore(universe: Universe, impls: Sequence[ImplSpec] = ("spec", "fast"), *,
            depth: int | None = None, seconds: float | None = None, jobs: int = 1,
            progress: bool = True, stream: TextIO | None = None,
            kinds: Sequence[OpKind] = OP_KINDS,
            pool: concurrent.futures.ProcessPoolExecutor | None = None) -> CheckResult:
    """Breadth-first search up to ``depth`` transitions (default: the universe's); stop at the
    first finding (its counterexample is a shortest one in transitions) or at ``seconds``.
    ``jobs > 1`` (or a ``pool`` of :func:`worker_pool`) expands each level in worker
    processes; implementations must then be given by name, and ``kinds`` is the default."""
    depth = universe.depth if depth is None else depth
    if universe.ledger_misuse and not all(
            adapter_trait(a, "checks_slots", True) for a in build_adapters(impls, universe.config())):
        universe = dataclasses.replace(universe, ledger_misuse=False)
    t0 = time.monotonic()
    res = CheckResult(universe.name)
    bar = Bar(f"check {universe.name}", depth, stream, progress)
    key0, f0 = initial_key(universe, impls)
    res.states = 1
    res.levels.append(1)
    if f0 is not None:
        res.finding, res.counterexample, res.labels = f0, [], []
        res.seconds = time.monotonic() - t0
        return res
    seen = {key0}
    # per state: (parent index, the transition's steps as JSON, its label); the root is 0
    parents: list[tuple[int, str, str]] = [(-1, "[]", "")]
    frontier = [0]

    def path_of(k: int) -> list:
        parts = []
        while k > 0:
            p, steps, _ = parents[k]
            parts.append(json.loads(steps))
            k = p
        return [s for part in reversed(parts) for s in part]

    def labels_of(k: int) -> list:
        out = []
        while k > 0:
            out.append(parents[k][2])
            k = parents[k][0]
        return out[::-1]

    own_pool = pool is None and jobs > 1
    if pool is not None or jobs > 1:
        if not all(isinstance(i, str) for i in impls) or kinds is not OP_KINDS:
            raise ValueError("worker processes need implementations given by name and the "
                             "default transition table")
        jobs = max(jobs, getattr(pool, "_max_workers", jobs))
    if own_pool:
        pool = worker_pool(jobs)
    try:
        for level in range(1, depth + 1):
            nxt: list[int] = []
            paths = [json.dumps(path_of(k)) for k in frontier]
            if pool is None:
                results: Iterable = ([expand(universe, impls, json.loads(p), kinds)] for p in paths)
                batch = 1
            else:
                batch = max(1, min(16, len(paths) // (8 * jobs) or 1))
                chunks = [paths[k: k + batch] for k in range(0, len(paths), batch)]
                results = pool.map(_worker_expand, itertools.repeat(universe),
                                   itertools.repeat(list(impls)), chunks)
            done = 0
            out_of_time = False
            for chunk in results:
                for children in chunk:
                    parent = frontier[done]
                    done += 1
                    for ch in children:
                        res.transitions += 1
                        res.steps += len(json.loads(ch.steps))
                        if ch.finding is not None:
                            steps = path_of(parent) + json.loads(ch.steps)
                            res.finding = ch.finding
                            res.counterexample = steps[: _upto(steps, ch.finding.step)]
                            res.labels = labels_of(parent) + [ch.label]
                            res.depth = level - 1
                            return _finish(res, t0, bar)
                        if ch.key not in seen:
                            seen.add(ch.key)
                            parents.append((parent, ch.steps, ch.label))
                            nxt.append(len(parents) - 1)
                            res.states += 1
                    bar.update(level, done, len(frontier), res)
                if seconds is not None and time.monotonic() - t0 >= seconds:
                    out_of_time = True
                    break
            if out_of_time:
                res.complete = False
                break
            res.levels.append(len(nxt))
            res.depth = level
            frontier = nxt
            if not frontier:
                break
    finally:
        if own_pool and pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    bar.update(res.depth, 1, 1, res, force=True)
    return _finish(res, t0, bar)


def _upto(steps: list, i: int) -> int:
    for k, s in enumerate(steps):
        if s["i"] == i:
            return k + 1
    return len(steps)


def _finish(res: CheckResult, t0: float, bar: Bar) -> CheckResult:
    res.seconds = time.monotonic() - t0
    bar.close()
    return res


# ----------------------------------------------------------------------------------------------
# Writing the counterexample
# ----------------------------------------------------------------------------------------------


def write_counterexample(out_dir: str, universe: Universe, impls: Sequence[ImplSpec],
                         res: CheckResult) -> str:
    """Write the counterexample as a trace with the reference's observations as ``ret``, probe
    steps appended when only the snapshots show the difference, as ``conform`` does."""
    from uniradix.conformance.explore.conform import write_finding_trace
    assert res.finding is not None and res.counterexample is not None
    f = res.finding
    stem = f"exhaustive-{universe.name}-d{len(res.labels or [])}-{f.op}-{f.where}"
    labels = ",".join(impl_labels([impl_name(i) for i in impls]))
    source = (f"uniradix check --exhaustive: shortest counterexample ({labels}; universe "
              f"{universe.name}, {len(res.labels or [])} transitions: "
              f"{' | '.join(res.labels or [])}): {f}")
    return write_finding_trace(out_dir, stem, impls, universe.config(), res.counterexample,
                               source, finding=f.to_dict(), universe=universe.to_dict(),
                               transitions=res.labels)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def run_check(universes: Sequence[Universe], impls: Sequence[ImplSpec], *,
              depth: int | None = None, seconds: float | None = None, jobs: int = 1,
              out: str | None = DEFAULT_OUT, progress: bool = True,
              stream: TextIO | None = None,
              log: Callable[[str], None] = lambda m: print(m, flush=True)) -> list[CheckResult]:
    """Explore each universe in turn (``seconds`` is the limit for all together); stop at the
    first finding, write its counterexample under ``out``."""
    t0 = time.monotonic()
    results = []
    pool = worker_pool(jobs) if jobs > 1 else None
    try:
        for u in universes:
            left = None if seconds is None else max(0.0, seconds - (time.monotonic() - t0))
            if u.name.startswith("storage-"):  # conformance/explore/exhaustive_storage.py
                from uniradix.conformance.explore.exhaustive_storage import StorageUniverse, explore_storage
                if not isinstance(u, StorageUniverse):
                    raise TypeError(f"universe {u.name} is not a storage universe")
                res = explore_storage(u, impls, depth=depth, seconds=left, progress=progress,
                                      stream=stream)
            else:
                res = explore(u, impls, depth=depth, seconds=left, progress=progress,
                              stream=stream, pool=pool)
            results.append(res)
            if not _report(res, u, impls, out, log):
                break
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def _report(res: CheckResult, u: Universe, impls: Sequence[ImplSpec], out: str | None,
            log: Callable[[str], None]) -> bool:
    """Log one universe's result (writing its counterexample); False: stop here."""
    log(res.summary(f"check {u.name}") + f" (new states per level {res.levels})")
    if res.finding is not None:
        log(f"check: counterexample, {len(res.labels or [])} transitions: "
            + " | ".join(res.labels or []))
        if out is not None:
            res.trace_path = write_counterexample(out, u, impls, res)
            log(f"check: wrote {res.trace_path}")
        return False
    return res.complete


def total_line(results: Sequence[CheckResult], seconds: float) -> str:
    failed = next((r for r in results if r.finding is not None), None)
    states = sum(r.states for r in results)
    trans = sum(r.transitions for r in results)
    lo = min((r.depth for r in results), default=0)
    hi = max((r.depth for r in results), default=0)
    depth = f"{lo}" if lo == hi else f"{lo}-{hi}"
    head = f"check: {states} states, {trans} transitions, depth {depth}, {seconds:.1f} s"
    if failed is not None:
        return f"{head}: FAILED ({failed.universe}): {failed.finding}"
    if not all(r.complete for r in results):
        return f"{head}: ok (time limit: search incomplete)"
    return f"{head}: ok"


def cmd_check(args: argparse.Namespace) -> int:
    if not args.exhaustive:
        print("uniradix check: say what to check: --exhaustive (the bounded exhaustive "
              "exploration; CrossHair runs in the test suite, docs/CHECKS.md)", file=sys.stderr)
        return 2
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if len(impls) < 2:
        print("uniradix check: --impls needs at least two implementations", file=sys.stderr)
        return 2
    universes = ([parse_universe(c) for c in args.config] if args.config
                 else list(UNIVERSES.values()))
    t0 = time.monotonic()
    try:
        results = run_check(universes, impls, depth=args.depth, seconds=args.seconds,
                            jobs=args.jobs, out=args.out, progress=not args.no_progress)
    except ImportError as e:
        print(f"uniradix check: {e}", file=sys.stderr)
        return 2
    failed = next((r for r in results if r.finding is not None), None)
    if failed is not None and failed.trace_path is not None:
        print(failed.trace_path)
    print(total_line(results, time.monotonic() - t0), flush=True)
    return 1 if failed is not None else 0


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check", help="formal checks: bounded exhaustive exploration (--exhaustive)",
        description="Explore every sequence of operations up to a depth over tiny universes, "
                    "every step in lockstep on the implementations, every invariant in every "
                    "reachable state; exit 1 with the shortest counterexample as a trace.")
    p.add_argument("--exhaustive", action="store_true",
                   help="run the bounded exhaustive exploration")
    p.add_argument("--depth", type=int, default=None,
                   help="transitions per sequence (default: each universe's own, see "
                        "docs/CHECKS.md)")
    p.add_argument("--config", action="append", default=None, metavar="NAME|JSON",
                   help=f"a universe: one of {', '.join(UNIVERSES)}, or a JSON object (keys of "
                        "the Universe dataclass; 'base' starts from a named one); repeatable; "
                        "default: every named universe")
    p.add_argument("--impls", default="spec,fast",
                   help="implementations in lockstep (default spec,fast; the first is the "
                        "reference a written trace records)")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop after this long (reported as an incomplete search)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes expanding each level (default 1)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for the counterexample trace (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_check)
    return p
