"""Scenario generation shared by the Hypothesis state machine and ``uniradix conform``, and the
Hypothesis ``RuleBasedStateMachine`` that drives the lockstep runner.

:class:`Scenario` is the driver's side of the world: the KV pages it holds (from ``alloc`` steps,
not yet handed to the tree or freed), the matches it has seen, the lock handles it holds, the
requests in flight.  It proposes the next step of an *action* (``alloc``, ``insert``,
``req_chunk``, ``invalid``, ...) from a chooser (:class:`RandomChooser` over a seeded
:class:`random.Random`; in the state machine each rule draws one integer that seeds it, and the
per-run config is drawn through :class:`HypothesisChooser`) and learns from the reference
implementation's observation (:meth:`Scenario.observe`).  It never looks inside an
implementation.

``serve`` is the scheduler's use of the tree-level API, one step at a time: match_prefix ->
lock(last device node) -> alloc(the rest) [-> evict -> alloc] -> insert(matched slots + fresh,
``prev_prefix_len`` = the match) -> unlock (sometimes the lock is kept, as a pin).  The other
actions are single steps; the request-level ops (``req_*``) are SGLang's
``cache_unfinished_req`` / ``cache_finished_req`` through the spec's request model.

Ownership is tracked exactly, so valid steps never misuse the environment (freeing a slot the
tree holds would break the spec's own invariants — a false finding):

* an ``insert`` value is either a previous match's device indices (the tree's slots, used only
  while they are certainly still the tree's: no eviction since that match, or its path is
  locked by a handle taken before any) plus fresh held pages, with ``prev_prefix_len`` = the
  match length; or fresh held pages only, ``prev_prefix_len`` 0 (the duplicates case: what the
  tree holds already is freed again);
* after an accepted insert the held pages inside ``[prev_prefix_len, aligned length)`` are the
  tree's or freed; pages past the aligned length stay held;
* ``free`` only frees whole held pages.

Deliberately invalid steps (bad types, unknown handles and ops, malformed or non-node paths,
impossible request transitions) come from the ``invalid`` action; both implementations must
reject them the same way and change nothing, which the lockstep runner checks.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

from uniradix.conformance.adapters.base import ADAPTERS
from uniradix.conformance.explore.driver import load_back_args, load_back_wanted
from uniradix.spec.config import CacheConfig
from uniradix.spec.requests import output_token_id

NAMESPACES = (None, "a", "b")
# the host tier's actions (configs with host_slots > 0 only)
HOST_ACTIONS = ("io_complete", "check_events", "evict_host", "load_back", "host_lock",
                "host_unlock")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
MAX_HANDLES = 4
MAX_REQUESTS = 4
MAX_MATCHES = 8
MAX_KNOWN = 16


def default_impls() -> list[str]:
    """``spec`` against ``fast`` once the fast path is registered; ``spec`` twice until then."""
    return ["spec", "fast"] if "fast" in ADAPTERS else ["spec", "spec"]


# ----------------------------------------------------------------------------------------------
# Choosers: where the randomness comes from
# ----------------------------------------------------------------------------------------------


class RandomChooser:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence) -> Any:
        return seq[self.rng.randrange(len(seq))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def subset(self, seq: Sequence, lo: int = 1) -> list:
        k = self.rng.randint(lo, len(seq))
        return self.rng.sample(list(seq), k)


class HypothesisChooser:
    """Draws through ``st.data()``; every choice shrinks towards the simplest (the first option,
    the low end of a range, "no" for a rare branch).  Only integer strategies are drawn, and
    they are cached: building a strategy per draw costs more than the cache step itself."""

    _cache: dict = {}

    def __init__(self, data: Any) -> None:
        self.data = data

    def _ints(self, lo: int, hi: int) -> Any:
        s = self._cache.get((lo, hi))
        if s is None:
            from hypothesis import strategies as st
            s = self._cache[(lo, hi)] = st.integers(lo, hi)
        return s

    def integer(self, lo: int, hi: int) -> int:
        if lo == hi:
            return lo
        return self.data.draw(self._ints(lo, hi))

    def choice(self, seq: Sequence) -> Any:
        return seq[self.integer(0, len(seq) - 1)]

    def chance(self, p: float) -> bool:
        return self.data.draw(self._ints(0, 999)) >= 1000 - int(round(1000 * p))

    def subset(self, seq: Sequence, lo: int = 1) -> list:
        if len(seq) > 20:
            seq = seq[:20]
        while True:  # a bit mask; shrinks towards taking the first element only
            mask = self.integer(0, (1 << len(seq)) - 1)
            picked = [x for j, x in enumerate(seq) if mask >> j & 1]
            if len(picked) >= lo:
                return picked
            if lo == 1:
                return [seq[0]]


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def draw_hybrid_config(ch: Any) -> CacheConfig:
    """Hybrid models: Full + SWA (page 1/2/4, a window of 1..12 units, an SWA pool of 50-100%
    of the KV pool) or Full + Mamba (page 1, 2..8 state slots, chunk size 1..4); small pools,
    a disabled cache rarely."""
    swa = ch.chance(0.5)
    ps = ch.choice([1, 2, 4]) if swa else 1
    pages = ch.integer(16 // ps, 96 // ps)
    kv = pages * ps
    if swa:
        swa_pages = ch.integer(max(1, pages // 2), pages)
        return CacheConfig(page_size=ps, kv_slots=kv, components=("full", "swa"),
                           sliding_window=ch.integer(1, 12), swa_slots=swa_pages * ps,
                           disable=ch.chance(0.03))
    return CacheConfig(page_size=1, kv_slots=kv, components=("full", "mamba"),
                       mamba_slots=ch.integer(2, 8), mamba_cache_chunk_size=ch.integer(1, 4),
                       disable=ch.chance(0.03))


def draw_swa_mamba_config(ch: Any) -> CacheConfig:
    """Full + SWA + Mamba in one tree: page 1 or 4, a window of 1..12 units, an SWA pool of
    50-100% of the KV pool, 2..8 state slots, chunk size 1..4; a disabled cache rarely."""
    ps = ch.choice([1, 4])
    pages = ch.integer(16 // ps, 96 // ps)
    swa_pages = ch.integer(max(1, pages // 2), pages)
    return CacheConfig(page_size=ps, kv_slots=pages * ps, components=("full", "swa", "mamba"),
                       sliding_window=ch.integer(1, 12), swa_slots=swa_pages * ps,
                       mamba_slots=ch.integer(2, 8), mamba_cache_chunk_size=ch.integer(1, 4),
                       disable=ch.chance(0.03))


def draw_mamba_xbuf_config(ch: Any) -> CacheConfig:
    """Full + Mamba with the extra buffer (spec/requests.py: track slots, the tracked state
    cached): page 1 or 4, 3..12 state slots (a request takes 1 + 1-2), one or two track slots,
    a chunk size and a track interval in whole pages; as ``conform``'s mamba-xbuf-* draw them;
    the lazy variant in about a third of the runs (two track slots: the overlap schedule)."""
    ps = ch.choice([1, 4])
    pages = ch.integer(16 // ps, 96 // ps)
    slots, lazy = ch.integer(3, 12), ch.chance(0.33)
    return CacheConfig(page_size=ps, kv_slots=pages * ps, components=("full", "mamba"),
                       mamba_slots=slots, mamba_extra_buffer=True, mamba_extra_buffer_lazy=lazy,
                       mamba_track_slots=2 if lazy else ch.choice([1, 2]),
                       mamba_cache_chunk_size=ps * ch.integer(1, 4 if ps == 1 else 2),
                       mamba_track_interval=ps * ch.integer(1, 12 if ps == 1 else 3))


def draw_config(ch: Any) -> CacheConfig:
    """page_size 1/2/4, kv_slots 16..96 in whole pages (eviction is frequent), EAGLE on or off,
    a disabled cache rarely; a host tier in about a third of the runs (host_config)."""
    ps = ch.choice([1, 2, 4])
    pages = ch.integer(16 // ps, 96 // ps)
    if ch.chance(0.35):
        return host_config(ch, ps, pages * ps, ch.choice(WRITE_POLICIES))
    return CacheConfig(page_size=ps, kv_slots=pages * ps, eagle=ch.chance(0.3),
                       disable=ch.chance(0.05))


def draw_device_config(ch: Any) -> CacheConfig:
    """The device tier only (Full component): what :func:`draw_config` draws without a host
    tier."""
    ps = ch.choice([1, 2, 4])
    pages = ch.integer(16 // ps, 96 // ps)
    return CacheConfig(page_size=ps, kv_slots=pages * ps, eagle=ch.chance(0.3),
                       disable=ch.chance(0.05))


def host_config(ch: Any, ps: int, kv_slots: int, policy: str) -> CacheConfig:
    """A host tier (HiCache): a host pool of 1/2 to 2 device pools (host eviction is frequent),
    write-through thresholds 1 or 2, load-back thresholds 0 to two pages."""
    host_pages = max(1, (kv_slots // ps) * ch.choice([1, 2, 3, 4]) // 2)
    return CacheConfig(page_size=ps, kv_slots=kv_slots, host_slots=host_pages * ps,
                       write_policy=policy,
                       write_through_threshold=1 if policy == "write_through" else ch.choice([1, 2]),
                       load_back_threshold=ch.choice([0, 0, ps, 2 * ps]))


# ----------------------------------------------------------------------------------------------
# The scenario model
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MatchSeen:
    tokens: list
    extra_key: str | None
    length: int            # last_device_node: matched units
    indices: list          # device_indices
    epoch: int             # the eviction epoch it was taken in
    best: int = 0          # best_match_node: matched units on either tier (host tier)

    def path_tokens(self, eagle: bool) -> list:
        """The raw tokens of the path to its last device node (units + 1 under EAGLE)."""
        if self.length == 0:
            return []
        return list(self.tokens[: self.length + (1 if eagle else 0)])


@dataclasses.dataclass
class HandleHeld:
    handle: int
    tokens: list
    extra_key: str | None
    pins: MatchSeen | None  # the match whose path this lock protects (taken in its epoch)


@dataclasses.dataclass
class ReqModel:
    rid: str
    tokens: list
    extra_key: str | None
    admitted: bool = False
    committed: int = 0
    session: str | None = None  # streaming sessions (spec/sessions.py)

    def all_ids(self) -> list:
        """The tokens whose KV is computed: the prompt, then the outputs decoded so far."""
        out = [output_token_id(self.tokens, k)
               for k in range(max(0, self.committed - len(self.tokens)))]
        return (self.tokens + out)[: self.committed]


ACTIONS = ("serve", "alloc", "free", "insert", "match_prefix", "lock", "unlock", "evict", "sizes",
           "reset", "req_arrive", "req_admit", "req_chunk", "req_decode", "req_finish",
           "req_abort", "invalid", "mamba_alloc", "mamba_free") + HOST_ACTIONS + (
           "release_session", "session_held")
SESSION_NAMES = ("s1", "s2", "s3")


class Scenario:
    """The driver's model of the world; proposes steps and learns from observations."""

    def __init__(self, config: CacheConfig, ch: Any, namespaces: Sequence = NAMESPACES,
                 actions: Sequence[str] | None = None) -> None:
        self.config = config
        self.actions = frozenset(ACTIONS if actions is None else actions)
        self.ps = config.page_size
        self.eagle = config.eagle
        self.namespaces = list(namespaces)
        k = ch.integer(2, 4)
        self.alphabet = list(range(1, k + 1))
        self.max_len = max(2, min(24, config.kv_slots // 2))
        self.pages: list[list[int]] = []          # held, each one whole page of slots
        self.matches: list[MatchSeen] = []
        self.handles: list[HandleHeld] = []
        self.released: list[int] = []
        self.reqs: dict[str, ReqModel] = {}
        self.next_rid = 0
        self.epoch = 0
        self.known: list[tuple] = []    # (tokens, extra_key) seen in steps
        self.cached: list[tuple] = []   # (tokens, extra_key) inserted, directly or by requests
        self.last_alloc_failed = False
        self.n_steps = 0
        self.ctx: dict = {}                         # what observe() needs about the pending step
        self.queue: list[str] = []                  # follow-up actions of a compound one
        self.serving: dict = {}                     # the prompt being served (``serve``)
        self.admitting: dict = {}                   # the request being admitted (host tier)
        # hybrid models: Mamba state slots held by the driver; request-level ops only when the
        # actions are given (runner_actions: every implementation's request model covers them)
        self.swa = "swa" in config.components
        self.mamba = "mamba" in config.components
        self.mamba_held: list[int] = []
        if (self.swa or self.mamba) and actions is None:
            self.actions = frozenset(a for a in self.actions if not a.startswith("req_"))
        self.host = config.has_host_tier
        self.host_handles: list[int] = []           # live host_lock handles
        # whether every implementation refuses an insert's slots outside the pool (a cache
        # without a slot ledger, ``fast-noledger``, does not): set by random_segment
        self.checks_slots = True
        # Mamba copy-on-write (spec/mamba_cow.py): matches made for a request (a serve's, and
        # half the plain ones) pass cow_mamba; set by the caller (random_segment's ``cow``)
        self.cow = False
        # streaming sessions: most arriving requests name a session, continuing its parked
        # tokens; set by the caller (random_segment's ``sessions``)
        self.sessions = False
        self.session_tokens: dict[str, tuple[list, str | None]] = {}  # parked: tokens, extra_key

    # -- helpers -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.config.kv_slots // self.ps

    def aligned_units(self, n_tokens: int) -> int:
        units = max(0, n_tokens - 1) if self.eagle else n_tokens
        return units - units % self.ps

    def _tokens(self, ch: Any, n: int) -> list:
        return [ch.choice(self.alphabet) for _ in range(n)]

    def query(self, ch: Any, min_len: int = 0) -> tuple[list, str | None]:
        """A token sequence over the small alphabet and its namespace: usually a cut of one
        seen before (mostly in the same namespace) plus a few new tokens, so that prefixes are
        shared and nodes split."""
        pool = self.cached if self.cached and ch.chance(0.5) else self.known
        if pool and ch.chance(0.8):
            base, ek = ch.choice(pool)
            t = base[: ch.integer(0, len(base))] + self._tokens(ch, ch.integer(0, 6))
            if ch.chance(0.2):
                ek = ch.choice(self.namespaces)
        else:
            t = self._tokens(ch, ch.integer(1, 12))
            ek = ch.choice(self.namespaces)
        t = t[: self.max_len]
        while len(t) < min_len:
            t.append(ch.choice(self.alphabet))
        return t, ek

    def _remember(self, tokens: list, extra_key: str | None, cached: bool = False) -> None:
        """Sequences seen (queries, prompts) and those handed to the cache, for later queries
        to share prefixes with."""
        entry = (list(tokens), extra_key)
        for seen in ((self.known, self.cached) if cached else (self.known,)):
            if tokens and entry not in seen:
                seen.append(entry)
                if len(seen) > MAX_KNOWN:
                    seen.pop(0)

    def usable(self, m: MatchSeen) -> bool:
        """Are the match's device indices certainly still the tree's own slots?"""
        if m.epoch == self.epoch:
            return True
        return any(h.pins is m for h in self.handles)

    def fresh_slots(self) -> int:
        return len(self.pages) * self.ps

    def _waiting(self) -> list:
        return [r for r in self.reqs.values() if not r.admitted]

    def _admitted(self) -> list:
        return [r for r in self.reqs.values() if r.admitted]

    def _prefilling(self) -> list:
        return [r for r in self._admitted() if r.committed < len(r.tokens)]

    def _decoding(self) -> list:
        return [r for r in self._admitted() if r.committed >= len(r.tokens)]

    # -- which actions make sense now ----------------------------------------------------------
    def can(self, action: str) -> bool:
        if action.startswith(("serve_", "admit_")):
            return True
        if action in ("release_session", "session_held"):  # with the request path only
            return (self.sessions and "req_arrive" in self.actions
                    and (action == "session_held" or bool(self.session_tokens)))
        if action not in self.actions:
            return False
        if action in HOST_ACTIONS:
            return host_can(self, action)
        if action == "alloc":
            return len(self.pages) < max(1, self.num_pages // 2)
        if action == "free":
            return bool(self.pages)
        if action == "insert":
            return bool(self.pages) or any(self.usable(m) for m in self.matches)
        if action == "lock":
            return bool(self.matches) and len(self.handles) < MAX_HANDLES
        if action == "unlock":
            return bool(self.handles)
        if action == "req_arrive":
            return len(self.reqs) < MAX_REQUESTS
        if action == "req_admit":
            return bool(self._waiting())
        if action == "req_chunk":
            return bool(self._prefilling())
        if action == "req_decode":
            return bool(self._decoding())
        if action in ("req_finish",):
            return bool(self._admitted())
        if action == "req_abort":
            return bool(self.reqs)
        if action == "mamba_alloc":
            return self.mamba and len(self.mamba_held) < 3
        if action == "mamba_free":
            return bool(self.mamba_held)
        return True

    WEIGHTS = {"serve": 3.0, "alloc": 3.0, "free": 1.2, "insert": 4.0, "match_prefix": 4.0,
               "lock": 2.0, "unlock": 1.8, "evict": 1.2, "sizes": 0.5, "reset": 0.04, "req_arrive": 1.5,
               "req_admit": 2.0, "req_chunk": 2.5, "req_decode": 2.0, "req_finish": 1.3,
               "req_abort": 0.3, "invalid": 0.4, "mamba_alloc": 2.0, "mamba_free": 0.4,
               "io_complete": 2.0, "check_events": 1.5, "evict_host": 0.5, "load_back": 2.0,
               "host_lock": 0.5, "host_unlock": 0.5, "release_session": 0.4,
               "session_held": 0.3}

    def pick_action(self, rng: random.Random) -> str:
        names = [a for a in ACTIONS if self.can(a)]
        weights = [self.WEIGHTS[a] * (3.0 if a == "evict" and self.last_alloc_failed else 1.0)
                   for a in names]
        return rng.choices(names, weights)[0]

    # -- proposing steps -----------------------------------------------------------------------
    def propose(self, action: str, ch: Any) -> dict | None:
        """The next step (``{"op", "args"}``, no ``i`` yet) for ``action``, or None when the
        action has nothing to do now.  Call :meth:`observe` with its observation next.  An
        action may queue follow-up actions (``serve``); run :attr:`queue` empty before picking
        a new one (:meth:`next_action` does)."""
        self.ctx = {}
        if not self.can(action):
            return None
        return getattr(self, "_p_" + action)(ch)

    def next_action(self, rng: random.Random) -> str:
        """A queued follow-up first, else a weighted random action that makes sense now."""
        if self.queue:
            return self.queue.pop(0)
        return self.pick_action(rng)

    def _p_alloc(self, ch: Any) -> dict:
        n = ch.integer(1, 4) * self.ps
        return {"op": "alloc", "args": {"n": n}}

    def _p_mamba_alloc(self, ch: Any) -> dict:
        return {"op": "mamba_alloc", "args": {"n": 1}}

    def _p_mamba_free(self, ch: Any) -> dict:
        slot = ch.choice(self.mamba_held)
        self.ctx = {"mamba_slot": slot}
        return {"op": "mamba_free", "args": {"slots": [slot]}}

    def _p_free(self, ch: Any) -> dict:
        pages = ch.subset(self.pages)
        self.ctx = {"pages": pages}
        return {"op": "free", "args": {"slots": [s for p in pages for s in p]}}

    def _take_pages(self, n_slots: int) -> list | None:
        k = -(-n_slots // self.ps)
        if k > len(self.pages):
            return None
        return self.pages[:k]

    def _p_insert(self, ch: Any) -> dict | None:
        usable = [m for m in self.matches if self.usable(m)]
        ek: str | None
        if usable and ch.chance(0.6):
            m = ch.choice(usable)
            lo = len(m.path_tokens(self.eagle))
            room = self.fresh_slots()
            cut = ch.integer(lo, max(lo, len(m.tokens)))
            extra = ch.integer(0, 6)
            tokens = list(m.tokens[:cut]) + self._tokens(ch, extra)
            tokens = tokens[: m.length + room]  # what the held pages can cover
            if len(tokens) < lo:
                return None
            ek, prev, prefix = m.extra_key, m.length, list(m.indices)
        else:
            if not self.pages:
                return None
            if self.known and ch.chance(0.5):
                tokens, ek = ch.choice(self.known)  # the same tokens again: duplicates
            else:
                tokens, ek = self.query(ch, min_len=1)
            tokens = list(tokens[: self.fresh_slots()])
            if not tokens:
                return None
            prev, prefix = 0, []
        return self._insert_step(tokens, ek, prev, prefix, ch.chance(0.3))

    def _insert_step(self, tokens: list, ek: str | None, prev: int, prefix: list,
                     chunked: bool) -> dict | None:
        """insert ``tokens``: ``prefix`` (the tree's slots, ``prev`` of them) then fresh held
        pages; the pages inside ``[prev, aligned length)`` stop being the driver's."""
        fresh_n = len(tokens) - len(prefix)
        pages = self._take_pages(fresh_n) if fresh_n > 0 else []
        if pages is None:
            return None
        fresh = [s for p in pages for s in p][:fresh_n]
        value = prefix + fresh
        aligned = self.aligned_units(len(tokens))
        consumed = [p for j, p in enumerate(pages) if prev + (j + 1) * self.ps <= aligned]
        self.ctx = {"consumed": consumed, "tokens": tokens, "extra_key": ek}
        args = {"tokens": tokens, "extra_key": ek, "value": value, "prev_prefix_len": prev,
                "chunked": chunked}
        if self.mamba:  # a held state slot goes with the insert (kept if the tree has one)
            if not self.mamba_held:
                return None
            slot = self.mamba_held[len(tokens) % len(self.mamba_held)]
            args["mamba_value"] = [slot]
            self.ctx["mamba_slot"] = slot
        if self.swa and len(tokens) % 3 == 0:  # where the caller's window starts, sometimes
            args["swa_evicted_seqlen"] = (len(tokens) * 2 // 3) // self.ps * self.ps
        if self.config.eviction_policy != "lru":  # eviction policies: a priority, -1..3
            args["priority"] = (sum(tokens) + len(tokens)) % 5 - 1
        return {"op": "insert", "args": args}

    # -- a prompt served through the tree-level API, the way SGLang's scheduler does it:
    #    match_prefix -> lock(last device node) -> alloc(the rest) [-> evict -> alloc]
    #    -> insert(matched slots + fresh) -> unlock (sometimes the lock is kept)
    def _p_serve(self, ch: Any) -> dict:
        tokens, ek = self.query(ch, min_len=1)
        self.serving = {"tokens": tokens}
        self.queue = ["serve_lock", "serve_alloc", "serve_insert", "serve_unlock"]
        self.ctx = {"serve": True}
        args: dict = {"tokens": tokens, "extra_key": ek}
        self._cow_args(args, ch, 1.0)
        return {"op": "match_prefix", "args": args}

    def _cow_args(self, args: dict, ch: Any, p: float) -> None:
        """With copy-on-write, a match for a request (chance ``p``): its state slot is one the
        driver holds (a request that has one), or none while the driver holds few (the match
        then takes one for it)."""
        if not (self.cow and self.mamba and ch.chance(p)):
            return
        args["cow_mamba"] = True
        held = len(self.mamba_held)
        args["mamba_slot"] = ch.choice(self.mamba_held) if held >= 3 or (
            held and ch.chance(0.3)) else None

    def _serve_need(self) -> int:
        m = self.serving["match"]
        need = len(m.tokens) - m.length - self.fresh_slots()
        return -(-need // self.ps) * self.ps if need > 0 else 0

    def _p_serve_lock(self, ch: Any) -> dict | None:
        m = self.serving.get("match")
        if m is None or len(self.handles) >= MAX_HANDLES:
            return None
        tokens = m.path_tokens(self.eagle)
        self.ctx = {"tokens": tokens, "extra_key": m.extra_key, "pins": m, "serve": True}
        return {"op": "lock", "args": {"node": {"tokens": tokens, "extra_key": m.extra_key}}}

    def _p_serve_alloc(self, ch: Any) -> dict | None:
        if "match" not in self.serving or self._serve_need() == 0:
            return None
        self.ctx = {"serve": True}
        return {"op": "alloc", "args": {"n": self._serve_need()}}

    def _p_serve_evict(self, ch: Any) -> dict | None:
        if "match" not in self.serving:
            return None
        if self.swa:  # the SWA slots of the alloc are short as well, perhaps
            return {"op": "evict", "args": {"num_tokens": self._serve_need(),
                                            "swa_num_tokens": self._serve_need()}}
        return {"op": "evict", "args": {"num_tokens": self._serve_need()}}

    def _p_serve_insert(self, ch: Any) -> dict | None:
        m = self.serving.get("match")
        if m is None or not self.usable(m):
            return None
        return self._insert_step(list(m.tokens), m.extra_key, m.length, list(m.indices),
                                 ch.chance(0.2))

    def _p_serve_unlock(self, ch: Any) -> dict | None:
        h = self.serving.get("handle")
        self.serving = {}
        if h is None or h not in self.handles or ch.chance(0.25):  # sometimes kept: a pin
            return None
        self.ctx = {"held": h}
        return {"op": "unlock", "args": {"handle": h.handle}}

    def _p_match_prefix(self, ch: Any) -> dict:
        tokens, ek = self.query(ch)
        if ch.chance(0.03):
            tokens = []
        args: dict = {"tokens": tokens, "extra_key": ek}
        self._cow_args(args, ch, 0.5)
        return {"op": "match_prefix", "args": args}

    def _p_lock(self, ch: Any) -> dict:
        if ch.chance(0.1):
            self.ctx = {"tokens": [], "extra_key": None, "pins": None}
            return {"op": "lock", "args": {"node": {"tokens": [], "extra_key": None}}}
        m = ch.choice(self.matches)
        tokens = m.path_tokens(self.eagle)
        if self.host and m.best > m.length and ch.chance(0.3):  # lock an evicted node
            tokens = list(m.tokens[: m.best])
        self.ctx = {"tokens": tokens, "extra_key": m.extra_key,
                    "pins": m if m.epoch == self.epoch else None}
        return {"op": "lock", "args": {"node": {"tokens": tokens, "extra_key": m.extra_key}}}

    def _p_unlock(self, ch: Any) -> dict:
        h = ch.choice(self.handles)
        self.ctx = {"held": h}
        return {"op": "unlock", "args": {"handle": h.handle}}

    def _p_evict(self, ch: Any) -> dict:
        r = ch.integer(0, 19)
        if r < 14:
            n = ch.integer(0, 3 * self.ps)
        elif r < 19:
            n = ch.integer(1, max(1, self.config.kv_slots // 3))
        else:
            n = self.config.kv_slots
        if self.swa and self.mamba and ch.chance(0.7):  # Full + SWA + Mamba: one or both
            return {"op": "evict", "args": {"num_tokens": n if ch.chance(0.5) else 0,
                                            "swa_num_tokens": ch.integer(0, 3 * self.ps + 8),
                                            "mamba_num": ch.integer(0, 3)}}
        if self.swa and ch.chance(0.6):  # hybrid models: a per-component request too
            return {"op": "evict", "args": {"num_tokens": n if ch.chance(0.5) else 0,
                                            "swa_num_tokens": ch.integer(0, 3 * self.ps + 8)}}
        if self.mamba and ch.chance(0.6):
            return {"op": "evict", "args": {"num_tokens": n if ch.chance(0.5) else 0,
                                            "mamba_num": ch.integer(0, 3)}}
        return {"op": "evict", "args": {"num_tokens": n}}

    def _p_sizes(self, ch: Any) -> dict:
        return {"op": "sizes", "args": {}}

    def _p_reset(self, ch: Any) -> dict:
        return {"op": "reset", "args": {}}

    def _p_req_arrive(self, ch: Any) -> dict:
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        tokens, ek = self.query(ch, min_len=1)
        hits = [m for m in self.matches if m.best > m.length] if self.host else []
        if hits and ch.chance(0.4):  # a prompt through a match's host hit, to be loaded back
            m = ch.choice(hits)
            tokens, ek = list(m.tokens[: m.best]) + self._tokens(ch, ch.integer(1, 4)), m.extra_key
        args: dict = {"rid": rid, "tokens": tokens, "extra_key": ek}
        if self.sessions and ch.chance(0.7):  # a session's turn: its parked tokens, then more
            busy = {r.session for r in self.reqs.values()}
            idle = [n for n in SESSION_NAMES if n not in busy]
            name = ch.choice(idle if idle and ch.chance(0.9) else list(SESSION_NAMES))
            if name in self.session_tokens:
                base, ek = self.session_tokens[name]
                if len(base) >= 2 * self.max_len:  # long enough: the session ends instead
                    return {"op": "release_session", "args": {"session": name}}
                args.update(tokens=base + self._tokens(ch, ch.integer(1, 4)), extra_key=ek)
            args["session"] = name
        return {"op": "req_arrive", "args": args}

    def _p_release_session(self, ch: Any) -> dict:
        name = ch.choice(list(self.session_tokens)) if ch.chance(0.9) else "s-unknown"
        return {"op": "release_session", "args": {"session": name}}

    def _p_session_held(self, ch: Any) -> dict:
        return {"op": "session_held", "args": {}}

    def _p_req_admit(self, ch: Any) -> dict:
        """Admit a waiting request.  With a host tier the scheduler first matches the prompt
        (without its last token, as ``req_admit`` does) and loads a host hit back by the
        recording driver's rules (conformance/explore/driver.py ``load_back_wanted``), so the
        request's match finds it on the device: match_prefix -> [load_back] -> req_admit."""
        r = ch.choice(self._waiting())
        if not self.host:
            return {"op": "req_admit", "args": {"rid": r.rid}}
        self.admitting = {"rid": r.rid}
        self.queue = ["admit_load_back", "admit_request"]
        self.ctx = {"admit": True}
        return {"op": "match_prefix", "args": {"tokens": list(r.tokens[:-1]),
                                               "extra_key": r.extra_key}}

    def _p_admit_load_back(self, ch: Any) -> dict | None:
        """The load back for the request being admitted, naming it (``rid``: with Mamba a
        host-only state goes into the request's own slot, which its admission keeps; SGLang's
        ``init_load_back(req=req)``).  A session request is not named: a next turn is restored
        from the session's slot, which the spec refuses a requester for."""
        m = self.admitting.get("match")
        if m is None or not load_back_wanted(ch.rng, m.best, m.length):
            return None
        self.ctx = {"match": m}
        args = load_back_args(ch.rng, m.tokens, m.extra_key, m.best, m.length)
        r = self.reqs.get(self.admitting.get("rid", ""))
        if r is not None and r.session is None:
            args["rid"] = r.rid
            self.admitting["named"] = True
        return {"op": "load_back", "args": args}

    def _p_admit_request(self, ch: Any) -> dict | None:
        rid, named, self.admitting = self.admitting.get("rid"), self.admitting.get("named"), {}
        r = self.reqs.get(rid) if rid is not None else None
        if r is None or r.admitted:
            return None
        if named and ch.chance(0.15):  # not admitted this round (the batch is full): it waits
            return None  # holding what its load back gave it, to be admitted or aborted later
        return {"op": "req_admit", "args": {"rid": rid}}

    def _p_req_chunk(self, ch: Any) -> dict:
        r = ch.choice(self._prefilling())
        left = len(r.tokens) - r.committed
        # n >= 1: a chunk of no tokens is not something a scheduler sends (and under EAGLE the
        # spec's cache_unfinished_req trips its own assertion on it; see the report)
        n = left if ch.chance(0.4) else ch.integer(1, left)
        chunked = n < left or ch.chance(0.3)
        return {"op": "req_chunk", "args": {"rid": r.rid, "n": n, "chunked": chunked}}

    def _p_req_decode(self, ch: Any) -> dict:
        r = ch.choice(self._decoding())
        return {"op": "req_decode", "args": {"rid": r.rid, "n": ch.integer(1, 8)}}

    def _p_req_finish(self, ch: Any) -> dict:
        return {"op": "req_finish", "args": {"rid": ch.choice(self._admitted()).rid}}

    def _p_req_abort(self, ch: Any) -> dict:
        return {"op": "req_abort", "args": {"rid": ch.choice(list(self.reqs))}}

    # -- deliberately invalid steps ------------------------------------------------------------
    def invalid_kinds(self) -> list[str]:
        kinds = ["alloc_type", "alloc_negative", "alloc_too_many", "free_outside", "match_types",
                 "insert_length", "insert_token_type", "lock_malformed", "lock_not_dict",
                 "lock_non_node", "unlock_unknown", "unlock_type", "evict_negative",
                 "sizes_extra_arg", "unknown_op", "host_op", "req_admit_unknown",
                 "req_arrive_empty", "req_arrive_rid_type"]
        if self.ps > 1:
            kinds.append("alloc_unaligned")
        if self.pages:
            kinds.append("free_twice")
            if self.checks_slots:  # (refused only by a cache that keeps a slot ledger)
                kinds.append("insert_slot_outside")
            if self.ps > 1:
                kinds.append("free_part_page")
        if self.released:
            kinds.append("unlock_released")
        if self.reqs:
            kinds += ["req_arrive_duplicate"]
        if self._prefilling():
            kinds += ["req_decode_early", "req_chunk_too_many"]
        if self._waiting():
            kinds += ["req_finish_waiting", "req_chunk_waiting"]
        if not any(a.startswith("req_") for a in self.actions):  # tree-level ops only
            kinds = [k for k in kinds if not k.startswith("req_")]
        if self.swa or self.mamba:  # hybrid models: no request model; their own misuses
            kinds += ["insert_swa_seqlen_unaligned" if self.ps > 1 and self.swa
                      else "evict_aux_negative"]
            if self.mamba:
                kinds += ["insert_no_mamba_value", "insert_mamba_value_pair", "mamba_free_outside"]
        elif self.pages:
            kinds.append("insert_mamba_value_no_mamba")
        return kinds

    def _p_invalid(self, ch: Any) -> dict:
        """A step every implementation must reject (``ctx['must_reject']``), or one that is
        rejected except in corner cases (a disabled cache ignores insert values; a cut of a
        match may happen to end at a node)."""
        kind = ch.choice(self.invalid_kinds())
        must = True
        big = self.config.kv_slots + 10 * self.ps
        step: dict[str, Any]
        if kind == "alloc_type":
            step = {"op": "alloc", "args": {"n": str(self.ps)}}
        elif kind == "alloc_negative":
            step = {"op": "alloc", "args": {"n": -self.ps}}
        elif kind == "alloc_unaligned":
            step = {"op": "alloc", "args": {"n": self.ps + 1}}
        elif kind == "alloc_too_many":
            step = {"op": "alloc", "args": {"n": self.config.kv_slots + self.ps}}
        elif kind == "free_outside":
            step = {"op": "free", "args": {"slots": ch.choice([[0], [big]])}}
        elif kind == "free_twice":
            p = ch.choice(self.pages)
            step = {"op": "free", "args": {"slots": p + p}}
        elif kind == "free_part_page":
            step = {"op": "free", "args": {"slots": ch.choice(self.pages)[:-1]}}
        elif kind == "match_types":
            step = {"op": "match_prefix", "args": ch.choice([
                {"tokens": [1, 2], "extra_key": 5}, {"tokens": "12", "extra_key": None},
                {"tokens": [1, "x"], "extra_key": None}, {"tokens": [1, True], "extra_key": None},
                {"tokens": [1], "extra_key": None, "bogus": 1}])}
        elif kind == "insert_length":
            t = self.query(ch, min_len=2)[0]
            step = {"op": "insert", "args": {"tokens": t, "extra_key": None,
                                             "value": list(range(len(t) - 1))}}
        elif kind == "insert_token_type":
            step = {"op": "insert", "args": {"tokens": [1, "x"], "extra_key": None,
                                             "value": [0, 0]}}
        elif kind == "insert_slot_outside":
            # a slot outside the pool where the insert would take or free one; accepted only
            # by a disabled cache or when no whole page of the key is new (nothing taken)
            t = self.query(ch, min_len=1)[0][: self.fresh_slots()]
            pages = self._take_pages(len(t)) or []
            value = [s for p in pages for s in p][: len(t)]
            value[0] = big
            step = {"op": "insert", "args": {"tokens": t, "extra_key": None, "value": value}}
            must = False
        elif kind == "lock_malformed":
            step = {"op": "lock", "args": {"node": {"tokens": [1], "extra_key": None, "x": 1}}}
        elif kind == "lock_not_dict":
            step = {"op": "lock", "args": {"node": ch.choice([[1, 2], None, "root"])}}
        elif kind == "lock_non_node":
            # a path one token past a matched node (or over a never-seen token) is rarely a node
            if self.matches and ch.chance(0.7):
                m = ch.choice(self.matches)
                t = m.path_tokens(self.eagle) + [max(self.alphabet) + 1]
                step = {"op": "lock", "args": {"node": {"tokens": t, "extra_key": m.extra_key}}}
            else:
                step = {"op": "lock", "args": {"node": {"tokens": [99, 98, 97, 96, 95],
                                                        "extra_key": None}}}
        elif kind == "unlock_unknown":
            step = {"op": "unlock", "args": {"handle": ch.choice([10**9, -5])}}
        elif kind == "unlock_type":
            step = {"op": "unlock", "args": {"handle": ch.choice(["1", None, True, 1.0])}}
        elif kind == "unlock_released":
            step = {"op": "unlock", "args": {"handle": ch.choice(self.released)}}
        elif kind == "evict_negative":
            step = {"op": "evict", "args": {"num_tokens": ch.choice([-1, "3", None])}}
        elif kind == "sizes_extra_arg":
            step = {"op": "sizes", "args": {"x": 1}}
        elif kind == "unknown_op":
            step = {"op": "frobnicate", "args": {}}
        elif kind == "host_op" and self.host:  # malformed host-tier steps
            step = ch.choice([{"op": "evict_host", "args": {"num_tokens": -1}},
                              {"op": "load_back", "args": {}},
                              {"op": "io_complete", "args": {"writes": -2, "loads": 0}},
                              {"op": "io_complete", "args": {"writes": 0, "loads": "1"}},
                              {"op": "check_hicache_events", "args": {"x": 1}},
                              {"op": "host_unlock", "args": {"handle": 10**9}}])
        elif kind == "host_op":
            step = {"op": ch.choice(["evict_host", "load_back", "io_complete",
                                     "check_hicache_events"]), "args": {}}
        elif kind == "req_admit_unknown":
            step = {"op": ch.choice(["req_admit", "req_finish", "req_abort"]),
                    "args": {"rid": ch.choice(["nobody", 7])}}
        elif kind == "req_arrive_empty":
            step = {"op": "req_arrive", "args": {"rid": "empty", "tokens": []}}
        elif kind == "req_arrive_rid_type":
            step = {"op": "req_arrive", "args": {"rid": 3, "tokens": [1, 2]}}
        elif kind == "req_arrive_duplicate":
            step = {"op": "req_arrive", "args": {"rid": ch.choice(list(self.reqs)),
                                                 "tokens": [1, 2]}}
        elif kind == "req_decode_early":
            step = {"op": "req_decode", "args": {"rid": ch.choice(self._prefilling()).rid,
                                                 "n": 1}}
        elif kind == "req_chunk_too_many":
            r = ch.choice(self._prefilling())
            step = {"op": "req_chunk", "args": {"rid": r.rid, "n": len(r.tokens) + 1}}
        elif kind == "req_finish_waiting":
            step = {"op": "req_finish", "args": {"rid": ch.choice(self._waiting()).rid}}
        elif kind == "req_chunk_waiting":
            step = {"op": "req_chunk", "args": {"rid": ch.choice(self._waiting()).rid, "n": 1}}
        elif kind == "insert_swa_seqlen_unaligned":
            step = {"op": "insert", "args": {"tokens": [1] * self.ps, "extra_key": None,
                                             "value": list(range(self.ps, 2 * self.ps)),
                                             "swa_evicted_seqlen": 1}}
        elif kind == "evict_aux_negative":
            name = "swa_num_tokens" if self.swa else "mamba_num"
            step = {"op": "evict", "args": {"num_tokens": 0, name: ch.choice([-1, "2"])}}
        elif kind in ("insert_no_mamba_value", "insert_mamba_value_pair",
                      "insert_mamba_value_no_mamba"):
            t = self.query(ch, min_len=1)[0][:1]
            step = {"op": "insert", "args": {"tokens": t, "extra_key": None,
                                             "value": [self.ps] * len(t)}}
            if kind == "insert_mamba_value_pair":
                step["args"]["mamba_value"] = [1, 2]
            elif kind == "insert_mamba_value_no_mamba":
                step["args"]["mamba_value"] = [1]
        elif kind == "mamba_free_outside":
            step = {"op": "mamba_free", "args": {"slots": [self.config.mamba_slots + 5]}}
        else:  # pragma: no cover
            raise AssertionError(kind)
        if kind == "lock_non_node":
            must = False
        if kind.startswith("insert_") and self.config.disable:  # a disabled cache takes all
            must = False
        self.ctx = {"invalid": kind, "must_reject": must}
        return step

    # -- learning from observations ------------------------------------------------------------
    def observe(self, step: dict, obs: dict) -> None:
        """Update the model from the reference implementation's observation of ``step``."""
        self.n_steps += 1
        op, args, ctx = step["op"], step.get("args", {}), self.ctx
        self.ctx = {}
        if op == "insert" and self.mamba and "error" not in obs and "mamba_slot" in ctx \
                and not obs.get("mamba_exist"):
            self.mamba_held.remove(ctx["mamba_slot"])  # the tree took the state slot
        if self.swa and op in ("insert", "req_chunk", "req_finish") and obs.get("freed"):
            # an SWA tombstone that took the caller's slots freed its own: unpinned matches
            # seen before may hold them
            self.epoch += 1
        if (self.swa or self.mamba) and op.startswith("req_") and obs.get("freed"):
            self.epoch += 1  # a state taken for a request may have evicted a leaf with it
        if "error" in obs:
            if op == "alloc":
                self.last_alloc_failed = True
                if ctx.get("serve") and not self.serving.get("retried"):
                    self.serving["retried"] = True
                    self.queue[:0] = ["serve_evict", "serve_alloc"]
            if op == "unlock" and "held" in ctx:  # cannot happen to a held handle; stay sane
                self.handles = [h for h in self.handles if h is not ctx["held"]]
            return
        if "invalid" in ctx:
            if op == "lock":  # a path that happened to be a node
                self.handles.append(HandleHeld(obs["handle"], args["node"]["tokens"],
                                               args["node"]["extra_key"], None))
            if op == "insert":
                self._after_invalid_insert(args)
            return
        if op == "alloc":
            self.last_alloc_failed = False
            slots = obs["slots"]
            self.pages += [slots[k: k + self.ps] for k in range(0, len(slots), self.ps)]
        elif op == "free":
            gone = {id(p) for p in ctx["pages"]}
            self.pages = [p for p in self.pages if id(p) not in gone]
        elif op == "mamba_alloc":
            self.mamba_held += obs["slots"]
        elif op == "mamba_free":
            self.mamba_held.remove(ctx["mamba_slot"])
        elif op == "insert":
            if not self.config.disable:
                gone = {id(p) for p in ctx["consumed"]}
                self.pages = [p for p in self.pages if id(p) not in gone]
            self._remember(ctx["tokens"], ctx["extra_key"], cached=True)
        elif op == "match_prefix":
            if args.get("cow_mamba"):  # the request's slot is the driver's; room made evicts
                if args.get("mamba_slot") is None and obs.get("mamba_pool_idx") is not None:
                    self.mamba_held.append(obs["mamba_pool_idx"])
                if obs.get("freed") or obs.get("mamba_freed"):
                    self.epoch += 1  # (the matched path was locked: this match stays usable)
            self.matches.append(MatchSeen(list(args["tokens"]), args["extra_key"],
                                          obs["last_device_node"], list(obs["device_indices"]),
                                          self.epoch, obs.get("best_match_node", 0)))
            if ctx.get("serve"):
                self.serving["match"] = self.matches[-1]
            if ctx.get("admit"):
                self.admitting["match"] = self.matches[-1]
            if len(self.matches) > MAX_MATCHES:
                self.matches.pop(0)
            self._remember(args["tokens"], args["extra_key"])
        elif op == "lock":
            self.handles.append(HandleHeld(obs["handle"], ctx["tokens"], ctx["extra_key"],
                                           ctx["pins"]))
            if ctx.get("serve"):
                self.serving["handle"] = self.handles[-1]
        elif op == "unlock":
            self.handles = [h for h in self.handles if h is not ctx["held"]]
            self.released.append(args["handle"])
            self.released = self.released[-4:]
        elif op == "evict":
            if obs.get("num_tokens_evicted", 0) > 0:
                self.epoch += 1
        elif op in HOST_OPS:
            host_observe(self, op, args, ctx, obs)
        elif op == "reset":
            self.mamba_held.clear()
            self.pages.clear()
            self.matches.clear()
            self.handles.clear()
            self.reqs.clear()
            self.cached.clear()
            self.queue.clear()
            self.serving = {}
            self.admitting = {}
            self.host_handles.clear()
            self.session_tokens.clear()
            self.epoch += 1
        elif op == "req_arrive":
            self.reqs[args["rid"]] = ReqModel(args["rid"], list(args["tokens"]),
                                              args.get("extra_key"), session=args.get("session"))
            self._remember(args["tokens"], args.get("extra_key"))
        elif op == "req_admit":  # with Mamba, no state slot (null) leaves it waiting
            r = self.reqs[args["rid"]]
            if obs.get("mamba_pool_idx", 0) is not None:
                r.admitted, r.committed = True, obs["prefix_len"]
        elif op in ("req_chunk", "req_decode"):
            if obs.get("evicted", 0) > 0:
                self.epoch += 1
            if obs.get("ok"):
                r = self.reqs[args["rid"]]
                r.committed += args["n"]
                if op == "req_chunk":
                    self._remember(r.tokens[: r.committed], r.extra_key, cached=True)
        elif op in ("req_finish", "req_abort"):
            done_req = self.reqs.pop(args["rid"], None)
            if done_req is not None and op == "req_finish":
                self._remember(done_req.tokens, done_req.extra_key, cached=True)
            if done_req is not None and done_req.session is not None:  # parked, or all gone
                if op == "req_finish":
                    self.session_tokens[done_req.session] = (done_req.all_ids(),
                                                             done_req.extra_key)
                elif done_req.admitted:
                    self.session_tokens.pop(done_req.session, None)
        elif op == "release_session":
            self.session_tokens.pop(args["session"], None)

    def _after_invalid_insert(self, args: dict) -> None:
        """An "invalid" insert that was accepted (disabled cache, or nothing of it new): the
        tree took nothing of the driver's pages that could matter; forget none."""


# ----------------------------------------------------------------------------------------------
# Random stepping (used by ``uniradix conform``; no Hypothesis)
# ----------------------------------------------------------------------------------------------


TREE_ACTIONS = tuple(a for a in ACTIONS if not a.startswith("req_"))


# ----------------------------------------------------------------------------------------------
# The host tier's actions (Scenario methods are looked up as ``_p_<action>``)
# ----------------------------------------------------------------------------------------------

HOST_OPS = ("load_back", "host_lock", "host_unlock")


def host_can(sc: Scenario, action: str) -> bool:
    """Host actions need a host tier."""
    if not sc.host:
        return False
    if action == "load_back":
        return any(m.best > m.length for m in sc.matches)
    if action == "host_lock":
        return len(sc.host_handles) < MAX_HANDLES and any(m.best > m.length for m in sc.matches)
    if action == "host_unlock":
        return bool(sc.host_handles)
    return True


def _p_io_complete(sc: Scenario, ch: Any) -> dict:
    pick = lambda: ch.choice([-1, 0, 0, 1, 1, 2, 3])  # noqa: E731
    return {"op": "io_complete", "args": {"writes": pick(), "loads": pick()}}


def _p_check_events(sc: Scenario, ch: Any) -> dict:
    return {"op": "check_hicache_events", "args": {}}


def _p_evict_host(sc: Scenario, ch: Any) -> dict:
    n = ch.choice([0, 1, sc.ps, ch.integer(1, max(1, sc.config.host_slots // 2))])
    return {"op": "evict_host", "args": {"num_tokens": n}}


def _p_load_back(sc: Scenario, ch: Any) -> dict:
    """init_load_back for the host part of a match (taken in any epoch: its paths may have
    stopped being nodes, which is then a rejected step on every implementation); the args
    as the recording driver draws them (``load_back_args``)."""
    m = ch.choice([m for m in sc.matches if m.best > m.length])
    sc.ctx = {"match": m}
    args = load_back_args(ch.rng, m.tokens, m.extra_key, m.best, m.length)
    if sc.mamba_held and ch.chance(0.3):  # a requester that holds a state slot already
        args["mamba_slot"] = ch.choice(sc.mamba_held)
    return {"op": "load_back", "args": args}


def _p_host_lock(sc: Scenario, ch: Any) -> dict:
    m = ch.choice([m for m in sc.matches if m.best > m.length])
    return {"op": "host_lock", "args": {"node": {"tokens": list(m.tokens[: m.best]),
                                                 "extra_key": m.extra_key}}}


def _p_host_unlock(sc: Scenario, ch: Any) -> dict:
    h = ch.choice(sc.host_handles)
    sc.ctx = {"host_handle": h}
    return {"op": "host_unlock", "args": {"handle": h}}


for _name, _fn in (("io_complete", _p_io_complete), ("check_events", _p_check_events),
                   ("evict_host", _p_evict_host), ("load_back", _p_load_back),
                   ("host_lock", _p_host_lock), ("host_unlock", _p_host_unlock)):
    setattr(Scenario, "_p_" + _name, _fn)


def host_observe(sc: Scenario, op: str, args: dict, ctx: dict, obs: dict) -> None:
    if op == "load_back":
        if obs.get("freed"):
            sc.epoch += 1
        if args.get("mamba_slot") is None and args.get("rid") is None \
                and obs.get("mamba_pool_idx") is not None:
            sc.mamba_held.append(obs["mamba_pool_idx"])  # the requester's new slot: the driver's
        m = ctx["match"]
        if obs["device_indices"] and sc.usable(m):  # the loaded path, as a fresh match
            sc.matches.append(MatchSeen(list(m.tokens), m.extra_key, obs["last_node"],
                                        list(m.indices) + list(obs["device_indices"]),
                                        sc.epoch, m.best))
            if len(sc.matches) > MAX_MATCHES:
                sc.matches.pop(0)
    elif op == "host_lock":
        sc.host_handles.append(obs["handle"])
    elif op == "host_unlock":
        sc.host_handles.remove(ctx["host_handle"])


def runner_actions(runner: Any, actions: Sequence[str] | None) -> Sequence[str]:
    """``actions``, or when None: :data:`TREE_ACTIONS` if an implementation of the runner has
    only the tree-level API in its config (``tree_only``), else all of them (request-level
    ops with SWA and Mamba too).  The Hypothesis machine leaves request-level ops out for
    SWA and Mamba (Scenario's default)."""
    from uniradix.conformance.explore.lockstep import tree_only
    if actions is not None:
        return actions
    if any(tree_only(a) for a in getattr(runner, "adapters", ())):
        return TREE_ACTIONS
    return ACTIONS


def runner_checks_slots(runner: Any) -> bool:
    """Whether every implementation of the runner refuses slots outside the pool in an insert
    (the adapters' ``checks_slots``, True where not declared)."""
    from uniradix.conformance.explore.lockstep import adapter_trait
    return all(adapter_trait(a, "checks_slots", True) for a in getattr(runner, "adapters", ()))


def random_segment(runner: Any, config: CacheConfig, seed: Any, steps: int,
                   on_step: Callable[[int], None] | None = None,
                   invalid_weight: float | None = None,
                   actions: Sequence[str] | None = None, cow: bool = False,
                   sessions: bool = False) -> tuple[list, Any]:
    """Drive ``runner`` (a :class:`~uniradix.conformance.explore.lockstep.Lockstep`) through ``steps``
    random steps from a fresh :class:`Scenario`; return (the steps taken, the first finding or
    None).  ``actions``: only these (default :data:`ACTIONS`; :data:`TREE_ACTIONS` leaves the
    request-level ops out, for implementations that have only the tree-level API).  ``cow``:
    Mamba copy-on-write matches (``Scenario.cow``); ``sessions``: streaming sessions
    (``Scenario.sessions``)."""
    rng = random.Random(f"conform:{seed}")
    ch = RandomChooser(rng)
    sc = Scenario(config, ch, actions=runner_actions(runner, actions))
    sc.checks_slots = runner_checks_slots(runner)
    sc.cow = cow
    sc.sessions = sessions
    if invalid_weight is not None:
        sc.WEIGHTS = dict(sc.WEIGHTS, invalid=invalid_weight)
    taken: list[dict] = []
    runner.prime()
    while len(taken) < steps:
        action = sc.next_action(rng)
        step = sc.propose(action, ch)
        if step is None:
            continue
        step = {"i": len(taken), **step}
        taken.append(step)
        obs, finding = runner.check(step)
        if finding is not None:
            return taken, finding
        sc.observe(step, obs)
        if on_step is not None:
            on_step(len(taken))
    return taken, None


# ----------------------------------------------------------------------------------------------
# The Hypothesis state machine
# ----------------------------------------------------------------------------------------------


def draw_host_config(ch: Any) -> CacheConfig:
    """A host-tier config only (pages 1, 2 or 4; every write policy)."""
    ps = ch.choice([1, 2, 4])
    return host_config(ch, ps, ch.integer(16 // ps, 64 // ps) * ps, ch.choice(WRITE_POLICIES))


def draw_host_aux_config(ch: Any) -> CacheConfig:
    """A host tier with SWA, Mamba or both (pages 1 or 4, every write policy): the host pools
    of :func:`host_config`, an SWA pool of 50-100% of the KV pool with a window of 1..12 and an
    SWA host pool of the host pool or half of it, 2..8 state slots (chunk size 1..4) with a
    host state pool of 1/2 to 2 device ones; as ``conform``'s host-swa-*/host-mamba-* draw
    them."""
    ps = ch.choice([1, 4])
    pages = ch.integer(16 // ps, 64 // ps)
    cfg = host_config(ch, ps, pages * ps, ch.choice(WRITE_POLICIES))
    comps = ch.choice([("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba")])
    extra: dict[str, Any] = {"components": comps}
    if "swa" in comps:
        extra.update(sliding_window=ch.integer(1, 12),
                     swa_slots=ch.integer(max(1, pages // 2), pages) * ps,
                     host_swa_slots=ch.choice([None, max(ps, cfg.host_slots // 2 // ps * ps)]))
    if "mamba" in comps:
        mamba = ch.integer(2, 8)
        extra.update(mamba_slots=mamba, mamba_cache_chunk_size=ch.integer(1, 4),
                     host_mamba_slots=max(1, mamba * ch.integer(1, 4) // 2))
    return dataclasses.replace(cfg, **extra)


def draw_policy_config(ch: Any) -> CacheConfig:
    """An eviction policy other than lru (spec/policies.py) on what :func:`draw_config` or
    :func:`draw_hybrid_config` draws (every insert then carries a priority)."""
    base = draw_hybrid_config(ch) if ch.chance(0.4) else draw_config(ch)
    return dataclasses.replace(base, eviction_policy=ch.choice(
        ["lfu", "fifo", "mru", "filo", "priority", "slru"]))


def make_machine(impls: Sequence[Any] | None = None, *, snapshot_every: int = 1,
                 trace_path: str | None = None, name: str = "CacheMachine",
                 draw: Callable[[Any], CacheConfig] = draw_config,
                 sessions: bool = False, actions: Sequence[str] | None = None) -> type:
    """A ``RuleBasedStateMachine`` class running ``impls`` (names for ``make_adapter`` or
    factories ``config -> adapter``; default :func:`default_impls`) in lockstep.

    Each run draws a config, then the rules (named after what a user of the cache does) propose
    steps through the shared :class:`Scenario`.  A finding fails the run with
    :class:`~uniradix.conformance.explore.lockstep.LockstepError`; the steps taken are in ``self.steps``
    and, with ``trace_path`` (or ``$UNIRADIX_MACHINE_TRACE``), the failing run is written there
    as a trace with the first implementation's observations as ``ret`` (Hypothesis replays the
    minimal example last, so the file ends up holding the shrunk one).  ``draw`` draws each
    run's config (default :func:`draw_config`; :func:`draw_hybrid_config` for the SWA and Mamba
    components, :func:`draw_host_config` for the host tier only).  ``sessions``: most arriving
    requests are a streaming session's turn (``Scenario.sessions``), with ``release_session``
    and ``session_held`` among the rules, and the request-level ops run with SWA and Mamba
    where every implementation's request model covers them (:func:`runner_actions`).
    ``actions``: only these (default: as the Scenario decides)."""
    from hypothesis import note
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    from uniradix.conformance.explore.lockstep import Lockstep, LockstepError, write_trace

    chosen = list(impls) if impls is not None else default_impls()
    # Each rule draws one integer that seeds its choices: a draw through st.data() costs about
    # as much as a whole lockstep step, and a rule makes several choices.  Hypothesis still
    # picks and orders the rules and shrinks the run (steps, then seeds towards 0).
    SEED = st.integers(0, 2**32 - 1)

    def ready(action: str) -> Callable[[Any], bool]:
        return lambda self: self.sc is not None and self.sc.can(action)

    class Machine(RuleBasedStateMachine):
        IMPLS = chosen

        def __init__(self) -> None:
            super().__init__()
            self.sc: Scenario | None = None
            self.ls: Lockstep | None = None
            self.config: CacheConfig | None = None
            self.steps: list[dict] = []

        @initialize(data=st.data())
        def configure(self, data: Any) -> None:
            ch = HypothesisChooser(data)
            self.config = draw(ch)
            self.ls = Lockstep.from_impls(self.IMPLS, self.config, snapshot_every=snapshot_every)
            self.sc = Scenario(self.config, ch, actions=runner_actions(
                self.ls, actions) if sessions or actions is not None else None)
            self.sc.sessions = sessions
            self.sc.checks_slots = runner_checks_slots(self.ls)
            self.ls.prime()
            note(f"config {self.config.to_dict()}, alphabet {self.sc.alphabet}")

        def _do(self, action: str, seed: int) -> None:
            assert self.sc is not None and self.ls is not None and self.config is not None
            step = self.sc.propose(action, RandomChooser(random.Random(seed)))
            if step is None:
                return
            step = {"i": len(self.steps), **step}
            ctx = self.sc.ctx
            self.steps.append(step)
            note(f"step {step['i']}: {step['op']} {step['args']}")
            obs, finding = self.ls.check(step)
            if finding is None and ctx.get("must_reject") and "error" not in obs:
                note(f"  -> {obs}: an invalid step ({ctx['invalid']}) was accepted")
                raise AssertionError(f"step {step['i']}: invalid step {ctx['invalid']} "
                                     f"was accepted: {obs}")
            if finding is not None:
                note(f"  => {finding}")
                path = trace_path or os.environ.get("UNIRADIX_MACHINE_TRACE")
                if path:
                    labels = ",".join(self.ls.labels)
                    write_trace(path, self.IMPLS, self.config, self.steps,
                                source=f"uniradix hypothesis machine finding ({labels}): {finding}",
                                finding=finding.to_dict())
                raise LockstepError(finding)
            note(f"  -> {_brief(obs)}")
            self.sc.observe(step, obs)

        def _do_all(self, action: str, seed: int) -> None:
            """An action and the follow-ups it queues (each one a lockstep step)."""
            assert self.sc is not None
            self._do(action, seed)
            k = 0
            while self.sc.queue:
                k += 1
                self._do(self.sc.queue.pop(0), seed + k)

        # the environment
        @precondition(ready("alloc"))
        @rule(seed=SEED)
        def take_kv_slots(self, seed: int) -> None:
            self._do("alloc", seed)

        @precondition(ready("free"))
        @rule(seed=SEED)
        def give_back_kv_slots(self, seed: int) -> None:
            self._do("free", seed)

        # the tree
        @precondition(ready("serve"))
        @rule(seed=SEED)
        def serve_prompt(self, seed: int) -> None:
            self._do_all("serve", seed)

        @precondition(ready("insert"))
        @rule(seed=SEED)
        def cache_computed_tokens(self, seed: int) -> None:
            self._do("insert", seed)

        @precondition(ready("match_prefix"))
        @rule(seed=SEED)
        def look_up_prefix(self, seed: int) -> None:
            self._do("match_prefix", seed)

        @precondition(ready("lock"))
        @rule(seed=SEED)
        def lock_matched_path(self, seed: int) -> None:
            self._do("lock", seed)

        @precondition(ready("unlock"))
        @rule(seed=SEED)
        def unlock_held_path(self, seed: int) -> None:
            self._do("unlock", seed)

        # (Hypothesis picks among enabled rules evenly: these two act on every other call
        # only, or eviction empties the small pool before anything can be matched again)
        @precondition(ready("evict"))
        @rule(seed=SEED)
        def evict_tokens(self, seed: int) -> None:
            if seed % 2 == 0:
                self._do("evict", seed)

        @precondition(ready("sizes"))
        @rule(seed=SEED)
        def ask_sizes(self, seed: int) -> None:
            if seed % 2 == 0:
                self._do("sizes", seed)

        @precondition(lambda self: self.sc is not None and len(self.steps) > 20)
        @rule(seed=SEED)
        def flush_cache(self, seed: int) -> None:
            if seed % 10 == 9:
                self._do("reset", seed)

        # requests, the way the scheduler drives the cache
        @precondition(ready("req_arrive"))
        @rule(seed=SEED)
        def request_arrives(self, seed: int) -> None:
            self._do("req_arrive", seed)

        @precondition(ready("req_admit"))
        @rule(seed=SEED)
        def admit_request(self, seed: int) -> None:
            self._do_all("req_admit", seed)  # with a host tier: match, load back, admit

        @precondition(ready("req_chunk"))
        @rule(seed=SEED)
        def prefill_chunk(self, seed: int) -> None:
            self._do("req_chunk", seed)

        @precondition(ready("req_decode"))
        @rule(seed=SEED)
        def decode_tokens(self, seed: int) -> None:
            self._do("req_decode", seed)

        @precondition(ready("req_finish"))
        @rule(seed=SEED)
        def finish_request(self, seed: int) -> None:
            self._do("req_finish", seed)

        @precondition(ready("req_abort"))
        @rule(seed=SEED)
        def abort_request(self, seed: int) -> None:
            self._do("req_abort", seed)

        # streaming sessions (only with ``sessions``)
        @precondition(ready("release_session"))
        @rule(seed=SEED)
        def end_session(self, seed: int) -> None:
            self._do("release_session", seed)

        @precondition(ready("session_held"))
        @rule(seed=SEED)
        def ask_session_held(self, seed: int) -> None:
            self._do("session_held", seed)

        # hybrid models: the Mamba state pool
        @precondition(ready("mamba_alloc"))
        @rule(seed=SEED)
        def take_mamba_state_slot(self, seed: int) -> None:
            self._do("mamba_alloc", seed)

        @precondition(ready("mamba_free"))
        @rule(seed=SEED)
        def give_back_mamba_state_slot(self, seed: int) -> None:
            self._do("mamba_free", seed)

        # the host tier (host configs): the environment finishes transfers in any amount and
        # order against everything else; the scheduler polls, loads host hits back, evicts the
        # host pool and host-locks what it prefetches
        @precondition(ready("io_complete"))
        @rule(seed=SEED)
        def finish_transfers(self, seed: int) -> None:
            self._do("io_complete", seed)

        @precondition(ready("check_events"))
        @rule(seed=SEED)
        def poll_transfer_acks(self, seed: int) -> None:
            self._do("check_events", seed)

        @precondition(ready("load_back"))
        @rule(seed=SEED)
        def load_host_hit_back(self, seed: int) -> None:
            self._do("load_back", seed)

        @precondition(ready("evict_host"))
        @rule(seed=SEED)
        def evict_host_pool(self, seed: int) -> None:
            if seed % 2 == 0:
                self._do("evict_host", seed)

        @precondition(ready("host_lock"))
        @rule(seed=SEED)
        def host_lock_host_part(self, seed: int) -> None:
            self._do("host_lock", seed)

        @precondition(ready("host_unlock"))
        @rule(seed=SEED)
        def host_unlock_held(self, seed: int) -> None:
            self._do("host_unlock", seed)

        # misuse
        @precondition(ready("invalid"))
        @rule(seed=SEED)
        def send_invalid_step(self, seed: int) -> None:
            self._do("invalid", seed)

    Machine.__name__ = Machine.__qualname__ = name
    return Machine


def _brief(obs: dict, limit: int = 160) -> str:
    s = repr(obs)
    return s if len(s) <= limit else s[:limit] + "..."


try:  # the default machine, for `pytest` collection or interactive use
    import hypothesis as _hypothesis  # noqa: F401
except ImportError:  # pragma: no cover - conform works without Hypothesis
    CacheMachine = None
else:
    CacheMachine = make_machine(name="CacheMachine")
    HybridCacheMachine = make_machine(name="HybridCacheMachine", draw=draw_hybrid_config)
