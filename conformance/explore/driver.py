"""A random scenario driver that records traces the way SGLang's scheduler uses the cache.

``record(adapter, config, seed, steps)`` plays a seeded workload against any adapter (spec,
fast, upstream) and returns the steps with each one's observation as ``ret``. The driver decides
every next op from its random generator and the observations it has seen, never from the
implementation's internals, so every conforming implementation records the same trace for the
same seed.

The workload: a few prompt templates over a tiny token alphabet (3 to 6 distinct values, so
partial matches and node splits are frequent) that share prefixes with each other; requests are a
template prefix plus a random suffix and random output tokens, in two or three ``extra_key``
namespaces. Up to a handful of requests are in flight at once. Each request goes through

    match_prefix -> lock(last device node) -> [evict] -> alloc(prompt) -> ...
        [insert(chunk, chunked) -> match_prefix -> unlock(old) -> lock(new)]   (chunked prefill)
        [evict] -> alloc(output)                                              (decode)
    -> insert -> free(unaligned tail pages) -> unlock                        (cache_finished_req)
    or -> free(all fresh slots) -> unlock                                    (finish without insert)

interleaved with extra locks held across other requests and evictions ("pins"), explicit
``evict`` of random sizes, ``sizes`` queries, bare ``match_prefix`` probes and a rare ``reset``.

The driver keeps its own count of free KV slots from the observations (alloc ``slots``, its own
``free`` steps and every ``freed`` effect), evicts when an alloc would not fit and skips a request
when eviction cannot make room, so it never asks the environment for more than it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Sequence
from typing import Any

from uniradix.spec.config import CacheConfig

# the host tier with SWA or Mamba: the names and fixed parts are HOST_AUX_CONFIGS of
# conformance/adapters/upstream_host_aux.py (host-{swa,mamba}-{wt,wb}-p{1,4})
HOST_AUX_NAMES = tuple(f"host-{aux}-{wp}-p{ps}" for aux in ("swa", "mamba")
                       for wp in ("wt", "wb") for ps in (1, 4))
CONFIG_NAMES = ("full-p1", "full-p4", "full-p16", "swa-w8-p1", "swa-w8-p4", "swa-w32-p1", "mamba-p1",
                "hicache-wt-p1", "hicache-wt-p4", "hicache-wb-p1", "hicache-wb-p4",
                "mamba-cow-p1") + HOST_AUX_NAMES + ("full-swa-mamba-p1", "full-swa-mamba-p4")
# Mamba copy-on-write (spec/mamba_cow.py): mamba-p1's world, but a request's state slot comes
# from its admission match (match_prefix {cow_mamba: true}) when the match has a state
COW_CONFIGS = ("mamba-cow-p1",)
# Hybrid models: (page_size, sliding_window) of the SWA configs; the Mamba config's chunk size.
SWA_CONFIGS = {"swa-w8-p1": (1, 8), "swa-w8-p4": (4, 8), "swa-w32-p1": (1, 32)}
MAMBA_SLOT_CHOICES = (6, 8, 12, 16, 24)
KV_SLOT_CHOICES = (128, 160, 192, 256, 320, 384, 448, 512)
# Eviction policies (spec/policies.py): a recording config takes one with --policy; requests
# then draw a priority from these (repeats make ties, a negative one sinks below the default)
POLICY_CHOICES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
PRIORITY_CHOICES = (0, 0, 1, 2, 3, -1)


# The scheduler's init_load_back after a match with a host hit (shared by this driver and the
# lockstep scenarios of conformance/explore/machine.py): a host hit is loaded back this often
# (else the request computes it again), with no memory quota 4 times in 5
LOAD_BACK_CHANCE = 0.75
LOAD_BACK_UNLIMITED = 0.8


def load_back_wanted(rng: random.Random, best: int, matched: int) -> bool:
    """Whether the scheduler loads back a match's host part: there is one (``best`` units on
    either tier past the ``matched`` device units) and the draw says so.  Draws nothing when
    there is none."""
    return best > matched and rng.random() < LOAD_BACK_CHANCE


def load_back_args(rng: random.Random, tokens: Sequence[int], extra_key: str | None,
                   best: int, matched: int) -> dict:
    """A ``load_back`` step's args for the host part of a match of ``tokens``: the node at
    ``best`` units, the last device node at ``matched``, and a memory quota (none, or 0 to
    ``2 * best`` tokens)."""
    quota = None if rng.random() < LOAD_BACK_UNLIMITED else rng.randint(0, 2 * best)
    return {"node": {"tokens": list(tokens[:best]), "extra_key": extra_key},
            "last_device_node": {"tokens": list(tokens[:matched]), "extra_key": extra_key},
            "mem_quota": quota}


class RecordingError(RuntimeError):
    """The implementation rejected a step the driver meant to be valid, or broke an invariant."""


def make_config(name: str, seed: int) -> CacheConfig:
    """A named recording config; the KV pool size varies with the seed (small: eviction is
    frequent)."""
    if name not in CONFIG_NAMES:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIG_NAMES)}")
    rng = random.Random(f"config:{name}:{seed}")
    kv_slots = rng.choice(KV_SLOT_CHOICES)
    if name in SWA_CONFIGS:  # hybrid models: an SWA pool of 50-100% of the KV pool
        page_size, window = SWA_CONFIGS[name]
        swa_slots = _round_down(int(kv_slots * rng.choice([0.5, 0.625, 0.75, 1.0])), page_size)
        return CacheConfig(page_size=page_size, components=("full", "swa"), kv_slots=kv_slots,
                           sliding_window=window, swa_slots=swa_slots)
    if name in ("mamba-p1",) + COW_CONFIGS:
        return CacheConfig(page_size=1, components=("full", "mamba"), kv_slots=kv_slots,
                           mamba_slots=rng.choice(MAMBA_SLOT_CHOICES), mamba_cache_chunk_size=4)
    page_size = int(name.rsplit("-p", 1)[1])
    if name.startswith("full-swa-mamba-"):  # one tree with all three components
        swa_slots = _round_down(int(kv_slots * rng.choice([0.5, 0.625, 0.75, 1.0])), page_size)
        return CacheConfig(page_size=page_size, components=("full", "swa", "mamba"),
                           kv_slots=kv_slots, sliding_window=8, swa_slots=swa_slots,
                           mamba_slots=rng.choice(MAMBA_SLOT_CHOICES), mamba_cache_chunk_size=4)
    if name in HOST_AUX_NAMES:
        return _host_aux_config(name, rng, kv_slots)
    if name.startswith("hicache-"):
        # host tier: a host pool of 1 to 2 device pools (host eviction is frequent), the
        # write policy of the name, sometimes a load-back threshold
        host_slots = _round_down(int(kv_slots * rng.choice((1.0, 1.5, 2.0))), page_size)
        policy = {"wt": "write_through", "wb": "write_back"}[name.split("-")[1]]
        return CacheConfig(page_size=page_size, components=("full",), kv_slots=kv_slots,
                           host_slots=host_slots, write_policy=policy,
                           write_through_threshold=1,
                           load_back_threshold=rng.choice((0, 0, 2 * page_size, 8)))
    return CacheConfig(page_size=page_size, components=("full",), kv_slots=kv_slots)


def _host_aux_config(name: str, rng: random.Random, kv_slots: int) -> CacheConfig:
    """A host tier with SWA or Mamba: HOST_AUX_CONFIGS' fixed part; a host pool of 1 to 2
    device pools; an SWA pool of 50-100% of the KV pool and an SWA host pool of the host
    pool or half of it; or a Mamba pool from MAMBA_SLOT_CHOICES and a Mamba host pool of the
    default (2 x) or 1 x that; sometimes a load-back threshold."""
    from uniradix.conformance.adapters.upstream_host_aux import HOST_AUX_CONFIGS
    fixed = dict(HOST_AUX_CONFIGS[name])
    page_size = fixed["page_size"]
    host_slots = _round_down(int(kv_slots * rng.choice((1.0, 1.5, 2.0))), page_size)
    extra: dict[str, Any] = {}
    if "swa" in fixed["components"]:
        extra["swa_slots"] = _round_down(int(kv_slots * rng.choice([0.5, 0.625, 0.75, 1.0])),
                                         page_size)
        extra["host_swa_slots"] = rng.choice((None, _round_down(host_slots // 2, page_size)))
    else:
        mamba_slots = rng.choice(MAMBA_SLOT_CHOICES)
        extra["mamba_slots"] = mamba_slots
        extra["host_mamba_slots"] = rng.choice((None, mamba_slots))
    return CacheConfig(**fixed, kv_slots=kv_slots, host_slots=host_slots,
                       load_back_threshold=rng.choice((0, 0, 2 * page_size, 8)), **extra)


def with_policy(config: CacheConfig, policy: str) -> CacheConfig:
    """A recording config under another eviction policy (lru: the config itself)."""
    if policy not in POLICY_CHOICES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_CHOICES)}")
    return dataclasses.replace(config, eviction_policy=policy)


def config_label(name: str, policy: str) -> str:
    """The name a recording goes by: the config's, with the policy unless it is lru."""
    return name if policy == "lru" else f"{name}-{policy}"


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def _round_down(n: int, page: int) -> int:
    return n // page * page


@dataclasses.dataclass
class _Request:
    tokens: list[int]          # prompt + all output tokens it may produce
    extra_key: str | None
    prompt_len: int
    matched: int = 0           # tokens covered by the tree (locked), page-aligned
    prefix: list[int] = dataclasses.field(default_factory=list)  # tree slots for [0, matched)
    fresh: list[int] = dataclasses.field(default_factory=list)   # own slots for [matched, ...)
    handle: int | None = None
    decoded: bool = False      # output slots allocated
    produced: int = 0          # output tokens that have KV (0 until decode)
    chunked_once: bool = False
    mamba_slot: int | None = None  # Mamba: the request's own state slot
    priority: int | None = None  # eviction policies: the request's priority, on its inserts


@dataclasses.dataclass
class RecordStats:
    """What a recording exercised (for checking a corpus covers what it should)."""
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    splits: int = 0              # steps that added a node without adding tokens (a split)
    match_splits: int = 0        # match_prefix steps that split a node
    evictions_with_freed: int = 0
    insert_dup_frees: int = 0    # inserts that freed duplicate slots
    errors: int = 0
    requests: int = 0
    skipped_requests: int = 0
    resets: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Driver:
    """One recording run. ``run()`` returns the list of steps (each with ``ret``)."""

    def __init__(self, adapter: Any, config: CacheConfig, seed: int, steps: int,
                 check_violations: bool = True, collect_stats: bool = False,
                 cow: bool = False, events: bool = False) -> None:
        self.adapter = adapter
        # KV events (conformance/traces/events.py): each step records the adapter's events
        self.event_source = None
        if events:
            from uniradix.conformance.traces.events import event_source
            self.event_source = event_source(adapter)
            if self.event_source is None:
                raise RecordingError("events requested, but this implementation does not emit them")
        self.config = config
        self.page = config.page_size
        self.seed = seed
        self.target = steps
        self.check_violations = check_violations
        self.collect_stats = collect_stats
        self.stats = RecordStats()
        self.rng = random.Random(f"driver:{seed}")
        self.steps: list[dict] = []
        self.free_slots = config.kv_slots   # the driver's model of the env pool
        self.inflight: list[_Request] = []
        self.pins: list[int] = []           # handles of extra locks
        # hybrid models: the driver's model of the SWA and Mamba pools
        self.swa = "swa" in config.components
        self.mamba = "mamba" in config.components
        self.free_swa = config.swa_slots
        self.free_mamba = config.mamba_slots
        self.host_pins: list[int] = []      # handles of host locks (host tier)
        self.host_tier = config.has_host_tier
        # eviction policies: requests carry priorities (drawn only then, so that lru
        # recordings stay what they were)
        self.priorities = config.eviction_policy != "lru"
        self.cow = cow and self.mamba  # Mamba copy-on-write at admission
        self._setup_world()

    # -- the token world ---------------------------------------------------------------------
    def _setup_world(self) -> None:
        rng = self.rng
        self.alphabet = rng.sample(range(2, 200), rng.randint(3, 6))
        self.namespaces: list[str | None] = [None, "tenant-b"]
        if rng.random() < 0.5:
            self.namespaces.append("tenant-c")
        self.ns_weights = [6, 3, 1][: len(self.namespaces)]
        templates: list[list[int]] = []
        for _ in range(rng.randint(4, 9)):
            if templates and rng.random() < 0.6:
                base = rng.choice(templates)
                cut = rng.randint(1, len(base))
                t = base[:cut] + self._random_tokens(rng.randint(2, 40))
            else:
                t = self._random_tokens(rng.randint(6, 60))
            templates.append(t)
        self.templates = templates
        self.max_inflight = rng.randint(2, 5)

    def _random_tokens(self, n: int) -> list[int]:
        return [self.rng.choice(self.alphabet) for _ in range(n)]

    def _new_prompt(self) -> list[int]:
        rng = self.rng
        r = rng.random()
        if r < 0.05:  # shorter than a page with page_size 4, a single token with page_size 1
            return self._random_tokens(rng.randint(1, 3))
        if r < 0.12:  # no template at all
            return self._random_tokens(rng.randint(4, 40))
        t = rng.choice(self.templates)
        if rng.random() < 0.55:
            prefix = list(t)
        else:
            prefix = t[: rng.randint(1, len(t))]
        suffix_len = 0 if rng.random() < 0.2 else rng.randint(1, 30)
        prompt = prefix + self._random_tokens(suffix_len)
        return prompt[: max(4, self.config.kv_slots // 2)]  # most requests must fit the pool

    def _namespace(self) -> str | None:
        return self.rng.choices(self.namespaces, weights=self.ns_weights)[0]

    # -- emitting steps ----------------------------------------------------------------------
    def done(self) -> bool:
        return len(self.steps) >= self.target

    def emit(self, op: str, args: dict) -> dict:
        step = {"i": len(self.steps), "op": op, "args": args}
        nodes_before = self._node_count() if self.collect_stats else 0
        ret = self.adapter.apply(step)
        if "error" in ret:
            raise RecordingError(f"step {step['i']} {op}: the implementation answered {ret}")
        if self.event_source is not None:
            step["events"] = self.event_source.after_step(step, ret)
        if self.check_violations:
            bad = self.adapter.violations()
            if bad:
                raise RecordingError(f"step {step['i']} {op}: invariant violations: {bad}")
        step["ret"] = ret
        self.steps.append(step)
        self._observe(op, args, ret)
        if self.collect_stats:
            self._count(op, ret, nodes_before)
        return ret

    def _observe(self, op: str, args: dict, ret: dict) -> None:
        if op == "alloc":
            self.free_slots -= len(ret["slots"])
        elif op == "free":
            self.free_slots += len(args["slots"])
        elif op == "reset":
            self.free_slots = self.config.kv_slots
        elif op == "load_back":  # the cache took the loaded slots from the pool
            self.free_slots -= len(ret["device_indices"])
            # with an aux component: the aux slots of the loaded nodes, the request's state
            self.free_swa -= len(ret.get("swa_device_indices", ()))
            self.free_mamba -= len(ret.get("mamba_device_indices", ()))
            self.free_mamba -= ret.get("mamba_pool_idx") is not None
        elif op == "match_prefix" and args.get("cow_mamba") and args.get("mamba_slot") is None \
                and ret.get("mamba_pool_idx") is not None:  # a fresh state for the request
            self.free_mamba -= 1
        self.free_slots += len(ret.get("freed", ()))
        # hybrid models: SWA slots come and go with the KV slots the driver holds
        self.free_swa += len(ret.get("swa_freed", ())) - len(ret.get("swa_slots", ()))
        self.free_mamba += len(ret.get("mamba_freed", ()))
        if op == "free":
            self.free_swa += len(args["slots"])
        elif op == "mamba_alloc":
            self.free_mamba -= len(ret["slots"])
        elif op == "mamba_free":
            self.free_mamba += len(args["slots"])
        elif op == "reset":
            self.free_swa, self.free_mamba = self.config.swa_slots, self.config.mamba_slots

    def _node_count(self) -> int:
        return len(self.adapter.snapshot()["nodes"])

    def _count(self, op: str, ret: dict, nodes_before: int) -> None:
        s = self.stats
        s.ops[op] = s.ops.get(op, 0) + 1
        grew = self._node_count() - nodes_before
        if op == "match_prefix" and grew > 0:
            s.splits += grew
            s.match_splits += 1
        elif op == "insert" and grew > 1:  # a new leaf plus a split parent
            s.splits += grew - 1
        if op == "evict" and ret.get("freed"):
            s.evictions_with_freed += 1
        if op == "insert" and ret.get("freed"):
            s.insert_dup_frees += 1
        if op == "reset":
            s.resets += 1

    # -- building blocks ---------------------------------------------------------------------
    def _match(self, tokens: list[int], extra_key: str | None) -> dict:
        return self.emit("match_prefix", {"tokens": list(tokens), "extra_key": extra_key})

    def _lock(self, tokens: list[int], extra_key: str | None) -> int:
        ret = self.emit("lock", {"node": {"tokens": list(tokens), "extra_key": extra_key}})
        return ret["handle"]

    def _unlock(self, handle: int | None) -> None:
        if handle is None:  # a request holds its lock from admission to finish
            raise RecordingError("unlock of a request that holds no lock")
        self.emit("unlock", {"handle": handle})

    def _make_room(self, need: int) -> bool:
        """Evict (once) if ``need`` slots are not free; True when they are free afterwards."""
        if self.swa:
            return self._make_room_swa(need)
        if need <= self.free_slots:
            return True
        shortfall = need - self.free_slots
        jitter = self.rng.choice([0, 0, self.page, 3 * self.page, 17])
        self.emit("evict", {"num_tokens": shortfall + jitter})
        return need <= self.free_slots

    def _make_room_swa(self, need: int) -> bool:
        """SWA: ``need`` full slots and ``need`` SWA slots; evict what is short of each."""
        if need <= self.free_slots and need <= self.free_swa:
            return True
        jitter = self.rng.choice([0, 0, self.page, 3 * self.page, 17])
        short_full = max(0, need - self.free_slots)
        short_swa = max(0, need - self.free_swa)
        self.emit("evict", {"num_tokens": short_full + (jitter if short_full else 0),
                            "swa_num_tokens": short_swa + (jitter if short_swa else 0)})
        return need <= self.free_slots and need <= self.free_swa

    def _mamba_slot(self) -> int | None:
        """Mamba: one state slot, evicting one state first when none is free."""
        if self.free_mamba == 0:
            self.emit("evict", {"num_tokens": 0, "mamba_num": 1})
            if self.free_mamba == 0 or self.done():
                return None
        return self.emit("mamba_alloc", {"n": 1})["slots"][0]

    def _insert(self, args: dict, mamba_slot: int | None,
                priority: int | None = None) -> dict:
        """An insert; with Mamba it carries a state slot, freed by the caller when the tree
        already had a state there (``mamba_exist``); with a priority, the request's."""
        if priority is not None:
            args = dict(args, priority=priority)
        if not self.mamba:
            return self.emit("insert", args)
        ret = self.emit("insert", dict(args, mamba_value=[mamba_slot]))
        if ret["mamba_exist"] and not self.done():
            self.emit("mamba_free", {"slots": [mamba_slot]})
        return ret

    def _alloc(self, n: int) -> list[int]:
        if n == 0:
            return []
        return list(self.emit("alloc", {"n": n})["slots"])

    # -- request lifecycle -------------------------------------------------------------------
    def admit(self) -> None:
        prompt = self._new_prompt()
        output = self._random_tokens(self.rng.choice([0, 1, 2, 5, 9, 16, 24]))
        req = _Request(tokens=prompt + output, extra_key=self._namespace(), prompt_len=len(prompt))
        if self.priorities:
            req.priority = self.rng.choice(PRIORITY_CHOICES)
        self.stats.requests += 1
        if self.cow:  # the request's state slot from its match, when there is one to copy
            ret = self.emit("match_prefix", {"tokens": list(prompt), "extra_key": req.extra_key,
                                             "cow_mamba": True, "mamba_slot": None})
            req.mamba_slot = ret["mamba_pool_idx"]
        else:
            ret = self._match(prompt, req.extra_key)
        req.matched = ret["last_device_node"]
        req.prefix = list(ret["device_indices"])
        if self.done():
            return
        if self.host_tier and load_back_wanted(self.rng, ret["best_match_node"], req.matched):
            self._load_back(req, prompt, ret["best_match_node"])
            if self.done():
                return
        req.handle = self._lock(prompt[: req.matched], req.extra_key)
        need = _round_up(len(prompt) - req.matched, self.page)
        if self.done():
            return
        if not self._make_room(need):
            self.stats.skipped_requests += 1
            if not self.done():
                self._unlock(req.handle)
            if req.mamba_slot is not None and not self.done():
                self.emit("mamba_free", {"slots": [req.mamba_slot]})
            return
        if self.done():
            return
        req.fresh = self._alloc(need)
        if self.mamba and req.mamba_slot is None and not self.done():  # its own state
            req.mamba_slot = self._mamba_slot()
            if req.mamba_slot is None:
                self.stats.skipped_requests += 1
                if not self.done() and req.fresh:
                    self.emit("free", {"slots": req.fresh})
                if not self.done():
                    self._unlock(req.handle)
                return
        if self.done():
            return
        self.inflight.append(req)

    def _load_back(self, req: _Request, prompt: list[int], best: int) -> None:
        """The scheduler's init_load_back for the host part of a match.  With Mamba the load
        back takes the request's state slot when the node has a host state, so one must be
        free (evict one state first; no load back when none can be freed)."""
        if self.mamba and self.free_mamba == 0:
            self.emit("evict", {"num_tokens": 0, "mamba_num": 1})
            if self.free_mamba == 0 or self.done():
                return
        ret = self.emit("load_back", load_back_args(self.rng, prompt, req.extra_key, best,
                                                     req.matched))
        req.prefix += list(ret["device_indices"])
        req.matched = ret["last_node"]
        if ret.get("mamba_pool_idx") is not None:
            req.mamba_slot = ret["mamba_pool_idx"]

    def _produced_capacity(self, req: _Request) -> int:
        """Output tokens that fit in the slots already held (the last prompt page's slack)."""
        have = req.matched + len(req.fresh)
        return max(0, min(len(req.tokens), have) - req.prompt_len)

    def decode(self, req: _Request) -> None:
        req.decoded = True
        total = len(req.tokens)
        need = _round_up(total - req.matched, self.page) - len(req.fresh)
        if need > 0 and self._make_room(need) and not self.done():
            req.fresh += self._alloc(need)
        req.produced = self._produced_capacity(req)

    def chunk(self, req: _Request) -> None:
        """Chunked prefill: cache the first ``c`` prompt tokens (cache_unfinished_req)."""
        lo = req.matched + self.page
        hi = _round_down(req.prompt_len, self.page) - self.page
        req.chunked_once = True
        if hi < lo:
            return
        c = _round_down(self.rng.randint(lo, hi), self.page)
        values = req.prefix + req.fresh[: c - req.matched]
        slot = None
        if self.mamba:  # a copy of the request's state for the tree
            slot = self._mamba_slot()
            if slot is None or self.done():
                return
        ret = self._insert({"tokens": req.tokens[:c], "extra_key": req.extra_key,
                            "value": values, "prev_prefix_len": req.matched,
                            "chunked": True}, slot, req.priority)
        del ret
        if self.done():
            return
        m = self._match(req.tokens[:c], req.extra_key)
        if m["last_device_node"] != c:
            raise RecordingError(f"chunk of {c} tokens re-matched only {m['last_device_node']}")
        if self.done():
            return
        self._unlock(req.handle)
        req.handle = None
        if self.done():
            return
        req.handle = self._lock(req.tokens[:c], req.extra_key)
        req.fresh = req.fresh[c - req.matched:]
        req.matched = c
        req.prefix = list(m["device_indices"])

    def finish(self, req: _Request, insert: bool = True) -> None:
        self.inflight.remove(req)
        total = req.prompt_len + req.produced
        if insert:
            aligned = _round_down(total, self.page)
            whole = self.rng.random() < 0.35  # hand insert the unaligned key; it aligns itself
            upto = total if whole else aligned
            values = req.prefix + req.fresh[: upto - req.matched]
            self._insert({"tokens": req.tokens[:upto], "extra_key": req.extra_key,
                          "value": values, "prev_prefix_len": req.matched,
                          "chunked": False}, req.mamba_slot, req.priority)
            leftover = req.fresh[aligned - req.matched:]
        else:
            leftover = req.fresh
            if self.mamba and not self.done():
                self.emit("mamba_free", {"slots": [req.mamba_slot]})
        if leftover and not self.done():
            self.emit("free", {"slots": leftover})
        if not self.done():
            self._unlock(req.handle)

    def advance(self) -> None:
        req = self.rng.choice(self.inflight)
        r = self.rng.random()
        # SWA: no chunked prefill (a re-match may stop short of the chunk at a tombstone, and
        # the driver's request model would then hold slots the tree owns)
        if not req.decoded and not req.chunked_once and r < 0.25 and \
                req.prompt_len >= 3 * self.page and not self.swa:
            self.chunk(req)
        elif not req.decoded and r < 0.75:
            self.decode(req)
        else:
            if not req.decoded:
                req.produced = self._produced_capacity(req)
            self.finish(req, insert=self.rng.random() > 0.08)

    # -- other actions -----------------------------------------------------------------------
    def pin(self) -> None:
        """Lock a node and keep the lock across other requests and evictions."""
        if self.rng.random() < 0.15:
            tokens: list[int] = []
            ns = self._namespace()
        else:
            t = self.rng.choice(self.templates)
            tokens = t[: self.rng.randint(1, len(t))]
            ns = self._namespace()
        ret = self._match(tokens, ns) if tokens else {"last_device_node": 0}
        if self.done():
            return
        self.pins.append(self._lock(tokens[: ret["last_device_node"]], ns))

    def unpin(self) -> None:
        h = self.pins.pop(self.rng.randrange(len(self.pins)))
        self._unlock(h)

    def explicit_evict(self) -> None:
        r = self.rng.random()
        if r < 0.45:
            n = self.rng.randint(1, 3 * self.page)
        elif r < 0.9:
            n = self.rng.randint(1, max(1, self.config.kv_slots // 3))
        else:
            n = self.config.kv_slots
        if self.swa:  # hybrid models: a per-component request, sometimes alone
            w = self.rng.choice([0, 0, 1, self.config.sliding_window, self.config.swa_slots // 3])
            args = {"num_tokens": n if self.rng.random() < 0.6 else 0, "swa_num_tokens": w}
            if self.mamba:  # Full + SWA + Mamba: a state count too
                args["mamba_num"] = self.rng.choice([0, 0, 1, 2, self.config.mamba_slots])
            self.emit("evict", args)
            return
        if self.mamba:
            k = self.rng.choice([0, 0, 1, 2, self.config.mamba_slots])
            self.emit("evict", {"num_tokens": n if self.rng.random() < 0.6 else 0,
                                "mamba_num": k})
            return
        self.emit("evict", {"num_tokens": n})

    def probe(self) -> None:
        self._match(self._new_prompt(), self._namespace())

    def reset(self) -> None:
        self.emit("reset", {})
        self.inflight.clear()
        self.pins.clear()
        self.host_pins.clear()

    # -- host tier actions ---------------------------------------------------------------------
    def host_actions(self) -> tuple[list[str], list[float]]:
        if not self.host_tier:
            return [], []
        # no host locks with an aux component: 0.5.13.post1's own sanity check fails on any
        # host lock of a node with host-only SWA or Mamba data (its lock takes the node off
        # the aux host LRU list, which the check says must hold every such node)
        pins = not (self.swa or self.mamba)
        return (["io_complete", "events", "evict_host", "host_pin", "host_unpin"],
                [2.5, 2.0, 0.6, 0.5 if pins and len(self.host_pins) < 2 else 0,
                 0.5 if self.host_pins else 0])

    def act_io_complete(self) -> None:
        pick = lambda: self.rng.choice((-1, 0, 1, 1, 2, 3))  # noqa: E731
        self.emit("io_complete", {"writes": pick(), "loads": pick()})

    def act_events(self) -> None:
        self.emit("check_hicache_events", {})

    def act_evict_host(self) -> None:
        n = self.rng.choice((1, self.page, self.rng.randint(1, max(1, self.config.host_slots // 3))))
        self.emit("evict_host", {"num_tokens": n})

    def act_host_pin(self) -> None:
        """Host-lock the host part of a match (what a storage prefetch protects)."""
        t = self.rng.choice(self.templates)
        ns = self._namespace()
        ret = self._match(t, ns)
        if self.done() or ret["best_match_node"] <= ret["last_device_node"]:
            return
        h = self.emit("host_lock", {"node": {"tokens": t[: ret["best_match_node"]],
                                             "extra_key": ns}})["handle"]
        self.host_pins.append(h)

    def act_host_unpin(self) -> None:
        h = self.host_pins.pop(self.rng.randrange(len(self.host_pins)))
        self.emit("host_unlock", {"handle": h})

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict]:
        rng = self.rng
        resets_left = 1 if rng.random() < 0.5 else 0
        while not self.done():
            actions = ["admit", "evict", "sizes", "probe", "pin", "unpin", "advance", "reset"]
            weights = [
                10 if len(self.inflight) < self.max_inflight else 0,
                2.0,
                0.7,
                1.0,
                1.2 if len(self.pins) < 3 else 0,
                1.0 if self.pins else 0,
                6.0 * len(self.inflight),
                0.25 if resets_left and len(self.steps) > 60 else 0,
            ]
            more, more_weights = self.host_actions()
            action = rng.choices(actions + more, weights=weights + more_weights)[0]
            if action in more:
                getattr(self, "act_" + action)()
            elif action == "admit":
                self.admit()
            elif action == "evict":
                self.explicit_evict()
            elif action == "sizes":
                self.emit("sizes", {})
            elif action == "probe":
                self.probe()
            elif action == "pin":
                self.pin()
            elif action == "unpin":
                self.unpin()
            elif action == "advance":
                self.advance()
            elif action == "reset":
                resets_left -= 1
                self.reset()
        return self.steps[: self.target]


def record(adapter: Any, config: CacheConfig, seed: int, steps: int,
           check_violations: bool = True, stats: RecordStats | None = None,
           cow: bool = False, events: bool = False) -> list[dict]:
    """Record ``steps`` steps of the seeded workload against ``adapter``.

    Raises :class:`RecordingError` if the implementation rejects a step or, with
    ``check_violations``, reports an invariant violation after any step. Pass a
    :class:`RecordStats` to have it filled in (costs a snapshot per step). ``events``: each
    step also carries the adapter's KV events (``"events"``, docs/TRACE.md)."""
    driver = Driver(adapter, config, seed, steps, check_violations=check_violations,
                    collect_stats=stats is not None, cow=cow, events=events)
    out = driver.run()
    if stats is not None:
        for k, v in dataclasses.asdict(driver.stats).items():
            setattr(stats, k, v)
    return out


def verify_recording(adapter: Any, steps: list[dict]) -> RecordStats:
    """Replay recorded steps on ``adapter``: every ret field must match and ``violations()`` stay
    empty; returns what the trace exercised. Raises :class:`RecordingError` otherwise."""
    stats = RecordStats()
    for step in steps:
        before = len(adapter.snapshot()["nodes"])
        obs = adapter.apply(step)
        for field, expected in step.get("ret", {}).items():
            if obs.get(field) != expected:
                raise RecordingError(f"step {step['i']} {step['op']}: {field} = {obs.get(field)!r}, "
                                     f"recorded {expected!r}")
        bad = adapter.violations()
        if bad:
            raise RecordingError(f"step {step['i']} {step['op']}: invariant violations: {bad}")
        op, ret = step["op"], step.get("ret", {})
        stats.ops[op] = stats.ops.get(op, 0) + 1
        grew = len(adapter.snapshot()["nodes"]) - before
        if op == "match_prefix" and grew > 0:
            stats.splits += grew
            stats.match_splits += 1
        elif op == "insert" and grew > 1:
            stats.splits += grew - 1
        if op == "evict" and ret.get("freed"):
            stats.evictions_with_freed += 1
        if op == "insert" and ret.get("freed"):
            stats.insert_dup_frees += 1
        if "error" in ret:
            stats.errors += 1
        if op == "reset":
            stats.resets += 1
    return stats


# --------------------------------------------------------------------------------------------
# Command line: python -m uniradix.conformance.explore.driver --impl upstream --config full-p1 ...
# --------------------------------------------------------------------------------------------

def _source(impl: str, adapter: Any, config_name: str, seed: int) -> str:
    where = f"uniradix.conformance.explore.driver, config {config_name}, seed {seed}"
    if impl == "upstream":
        version = getattr(getattr(adapter, "up", None), "version", None) or "0.5.13.post1"
        return f"sglang {version} UnifiedRadixCache on CPU ({where})"
    return f"uniradix {impl} ({where})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m uniradix.conformance.explore.driver",
                                description="Record a random scheduler-like trace.")
    p.add_argument("--impl", default="upstream", help="implementation: upstream or spec")
    p.add_argument("--config", default="full-p1", choices=CONFIG_NAMES)
    p.add_argument("--policy", default="lru", choices=POLICY_CHOICES,
                   help="eviction policy of the recording (default lru)")
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", help="trace file to write (.jsonl)")
    p.add_argument("--verify", nargs="+", metavar="TRACE",
                   help="instead of recording: replay these traces on --impl, check every ret "
                        "and invariant, and print what they exercise")
    p.add_argument("--no-check", action="store_true", help="skip violations() after each step")
    p.add_argument("--stats", action="store_true", help="print what the trace exercised")
    p.add_argument("--events", action="store_true",
                   help="record each step's KV events too (docs/TRACE.md)")
    args = p.parse_args(argv)

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.traces.trace import dump_trace, make_header

    if args.verify:
        return _verify_main(args.impl, args.verify)
    if args.seed is None or not args.out:
        p.error("--seed and --out are required to record")
    config = with_policy(make_config(args.config, args.seed), args.policy)
    adapter = make_adapter(args.impl, config)
    stats = RecordStats() if args.stats else None
    try:
        steps = record(adapter, config, args.seed, args.steps,
                       check_violations=not args.no_check, stats=stats,
                       cow=args.config in COW_CONFIGS, events=args.events)
    except RecordingError as e:
        print(f"recording failed: {e}", file=sys.stderr)
        return 1
    extra = {}
    if args.events:  # the block-hash chain of the recorded events
        from uniradix.conformance.traces.events import event_source
        src = event_source(make_adapter(args.impl, config))
        if src is None:
            print(f"recording failed: --events: {args.impl} emits no KV events", file=sys.stderr)
            return 1
        extra["event_key_mode"] = src.key_mode
    header = make_header(config, _source(args.impl, adapter, config_label(args.config, args.policy),
                                         args.seed), seed=args.seed, **extra)
    dump_trace(args.out, header, steps)
    msg = f"{args.out}: {len(steps)} steps, kv_slots={config.kv_slots}"
    if stats is not None:
        msg += f" {stats.to_dict()}"
    print(msg)
    return 0


def _verify_main(impl: str, paths: Sequence[str]) -> int:
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.traces.trace import load_trace

    total = RecordStats()
    steps_total = 0
    failed = 0
    for path in paths:
        trace = load_trace(path)
        try:
            st = verify_recording(make_adapter(impl, trace.config), trace.steps)
        except RecordingError as e:
            print(f"FAIL {path}: {e}")
            failed += 1
            continue
        steps_total += len(trace.steps)
        for k, v in st.ops.items():
            total.ops[k] = total.ops.get(k, 0) + v
        for k in ("splits", "match_splits", "evictions_with_freed", "insert_dup_frees",
                  "errors", "resets"):
            setattr(total, k, getattr(total, k) + getattr(st, k))
        if st.errors or not st.splits or not st.evictions_with_freed:
            print(f"WEAK {path}: {st.to_dict()}")
    summary = {k: v for k, v in total.to_dict().items() if k not in ("requests", "skipped_requests")}
    print(f"{len(paths) - failed}/{len(paths)} traces ok, {steps_total} steps: {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
