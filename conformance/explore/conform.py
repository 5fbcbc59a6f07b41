"""``uniradix conform`` and ``uniradix record``.

``conform`` runs long randomized lockstep runs (no Hypothesis): the scenario generator of
:mod:`uniradix.conformance.explore.machine` drives two or more implementations through segments of
random steps, each segment from fresh adapters with its own config (cycling through the named
configs unless ``--config`` is given) and seed.  At the first finding it shrinks the failing
segment (delta debugging, :func:`uniradix.conformance.explore.lockstep.shrink`), writes it as a
replayable trace (``ret`` from the first implementation) and exits 1.  The last line is always
``conform: S steps, D divergences, V violations``.

``record`` writes a trace of a built-in workload run on one implementation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from uniradix.conformance.explore.lockstep import (
    DIVERGENCE,
    VIOLATION,
    Finding,
    ImplSpec,
    Lockstep,
    build_adapters,
    comparable,
    impl_labels,
    impl_name,
    shrink,
    step_timeout,
    uncompared_node_fields,
    write_trace,
)
from uniradix.conformance.explore.lockstep import tree_only as adapter_tree_only
from uniradix.conformance.explore.machine import TREE_ACTIONS, RandomChooser, host_config, random_segment
from uniradix.conformance.traces.replay import (
    aux_evict_passes_over_a_leaf,
    cow_match_without_a_state_slot,
    held_swa_tombstone_takeover,
    host_lock_on_host_only_aux,
    host_locked_copy_freed,
    host_locked_state_listed,
    load_back_lost_its_host_state,
    load_back_window_ends_at_a_tombstone,
    load_back_without_a_state_slot,
    releases_after_split_of_skipped_node,
    split_hit_count_reaches_threshold,
    split_of_a_host_locked_swa_copy,
    swa_skipped_leaf_keeps_state,
    unlock_left_a_device_leaf_out,
)
from uniradix.conformance.traces.trace import Trace
from uniradix.spec.config import POLICIES, CacheConfig
from uniradix.spec.errors import ConfigError, Unsupported

# name -> the fixed part of the config; kv_slots is drawn per segment (16..96, whole pages)
NAMED_CONFIGS: dict[str, dict] = {
    "full-p1": {"page_size": 1},
    "full-p2": {"page_size": 2},
    "full-p4": {"page_size": 4},
    "eagle-p1": {"page_size": 1, "eagle": True},
    "eagle-p4": {"page_size": 4, "eagle": True},
    "disable": {"page_size": 1, "disable": True},
    # hybrid models: the window / SWA pool / Mamba pool are drawn per segment too
    "swa": {"components": ("full", "swa")},
    "mamba": {"page_size": 1, "components": ("full", "mamba")},
    # "mamba" with Mamba copy-on-write: a serve's match and half the plain ones are a
    # request's (match_prefix cow_mamba; spec/mamba_cow.py)
    "mamba-cow": {"page_size": 1, "components": ("full", "mamba")},
    # Full with streaming sessions: most arriving requests are a session's turn
    # (spec/sessions.py), with release_session and session_held among the steps
    "sessions-p1": {"page_size": 1},
    "sessions-p4": {"page_size": 4},
    # EAGLE bigram keys with the aux components (the window and the pools drawn as above)
    "eagle-swa-p2": {"page_size": 2, "eagle": True, "components": ("full", "swa")},
    "eagle-mamba-p1": {"page_size": 1, "eagle": True, "components": ("full", "mamba")},
    # Full + SWA + Mamba in one tree: both aux components' draws
    "full-swa-mamba-p1": {"page_size": 1, "components": ("full", "swa", "mamba")},
    "full-swa-mamba-p4": {"page_size": 4, "components": ("full", "swa", "mamba")},
    # the same two components in the other order (the hooks run in component order)
    "full-mamba-swa-p1": {"page_size": 1, "components": ("full", "mamba", "swa")},
    "full-mamba-swa-p4": {"page_size": 4, "components": ("full", "mamba", "swa")},
    # host tier (HiCache); host_slots and thresholds are drawn per segment too (host_config)
    "hicache-wt-p1": {"page_size": 1, "write_policy": "write_through"},
    "hicache-wt-p4": {"page_size": 4, "write_policy": "write_through"},
    "hicache-wb-p1": {"page_size": 1, "write_policy": "write_back"},
    "hicache-wb-p4": {"page_size": 4, "write_policy": "write_back"},
    # pages 1 and 4 alternating by segment; write_through or write_through_selective
    "hicache-wt": {"page_size": (1, 4), "write_policy": ("write_through",
                                                         "write_through_selective")},
    "hicache-wb": {"page_size": (1, 4), "write_policy": "write_back"},
    # the host tier with Mamba (spec and fast): a host state pool of 1/2 to 2 device
    # state pools, drawn per segment with the Mamba pool (host_config)
    "host-mamba-wt-p1": {"page_size": 1, "write_policy": "write_through",
                         "components": ("full", "mamba")},
    "host-mamba-wb-p4": {"page_size": 4, "write_policy": "write_back",
                         "components": ("full", "mamba")},
    # the host tier with SWA (spec and fast): the window and the SWA pool drawn as for "swa",
    # an SWA host pool of host_slots or half of it
    "host-swa-wt-p1": {"page_size": 1, "write_policy": "write_through",
                       "components": ("full", "swa")},
    "host-swa-wb-p4": {"page_size": 4, "write_policy": "write_back",
                       "components": ("full", "swa")},
    # the host tier with SWA and Mamba in one tree: both aux components' host draws
    "host-swa-mamba-wt-p1": {"page_size": 1, "write_policy": "write_through",
                             "components": ("full", "swa", "mamba")},
    "host-swa-mamba-wb-p4": {"page_size": 4, "write_policy": "write_back",
                             "components": ("full", "swa", "mamba")},
    "host-mamba-swa-wt-p4": {"page_size": 4, "write_policy": "write_through",
                             "components": ("full", "mamba", "swa")},
    # streaming sessions with SWA and Mamba (a parked turn's SWA window and state slot)
    "sessions-swa-p1": {"page_size": 1, "components": ("full", "swa")},
    "sessions-mamba-p1": {"page_size": 1, "components": ("full", "mamba")},
    "sessions-swa-mamba-p4": {"page_size": 4, "components": ("full", "swa", "mamba")},
    # EAGLE bigram keys under a host tier (Full only, page 2): host pools drawn as for "hicache-"
    "eagle-host-p2": {"page_size": 2, "eagle": True, "write_policy": "write_through"},
    # the Mamba extra buffer (track slots; the tracked state cached): its track slots (1 or 2),
    # track interval and chunk size drawn per segment (whole pages at page 4)
    "mamba-xbuf-p1": {"page_size": 1, "components": ("full", "mamba"), "mamba_extra_buffer": True},
    "mamba-xbuf-p4": {"page_size": 4, "components": ("full", "mamba"), "mamba_extra_buffer": True},
    # its lazy variant (one track slot a request; a decode track point takes a fresh one): the
    # same draws, two track slots (the overlap schedule, which the lazy mode needs)
    "mamba-xbuf-lazy-p1": {"page_size": 1, "components": ("full", "mamba"),
                           "mamba_extra_buffer": True, "mamba_extra_buffer_lazy": True},
    "mamba-xbuf-lazy-p4": {"page_size": 4, "components": ("full", "mamba"),
                           "mamba_extra_buffer": True, "mamba_extra_buffer_lazy": True},
    # streaming sessions with a host tier and SWA or Mamba (host pools drawn as for "host-");
    # write-through and write-back alternating every two segments
    "sessions-host-swa-p1": {"page_size": 1, "write_policy": ("write_through", "write_back"),
                             "components": ("full", "swa")},
    "sessions-host-mamba-p1": {"page_size": 1, "write_policy": ("write_through", "write_back"),
                               "components": ("full", "mamba")},
}
# the storage tier (conformance/explore/storage_driver.py): its own workload; not in the default cycle
STORAGE_CONFIGS = ("storage",) + tuple(f"storage-{w}-p{p}-{s}" for w in ("wt", "wb")
                                       for p in (1, 4) for s in ("be", "wc", "to"))
COW_CONFIGS = ("mamba-cow",)  # the named configs whose matches copy the Mamba state
SESSION_CONFIGS = ("sessions-p1", "sessions-p4", "sessions-swa-p1", "sessions-mamba-p1",
                   "sessions-swa-mamba-p4", "sessions-host-swa-p1",
                   "sessions-host-mamba-p1")  # the named configs with streaming sessions
SEGMENT_STEPS = 1500
DEFAULT_STEPS = 20_000
DEFAULT_OUT = os.path.join("tests", "corpus", "regressions")


# ----------------------------------------------------------------------------------------------
# Configs and segments
# ----------------------------------------------------------------------------------------------


def parse_config_arg(raw: str | None) -> Any | None:
    """``--config``: a name of :data:`NAMED_CONFIGS` or a JSON config object (fixed)."""
    if raw is None:
        return None
    if raw in NAMED_CONFIGS or raw in STORAGE_CONFIGS:
        return raw
    if raw.lstrip().startswith("{"):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config: not JSON: {e}") from None
        return CacheConfig.from_dict(obj)
    raise ConfigError(f"--config: unknown config {raw!r}; named configs: "
                      f"{', '.join(NAMED_CONFIGS)}, or a JSON object")


def segment_config(which: Any, seed: int, segment: int) -> tuple[str, CacheConfig]:
    """The config of one segment: a fixed CacheConfig, or a named one with kv_slots drawn from
    the seed (small pools, so eviction is frequent)."""
    if isinstance(which, CacheConfig):
        return "custom", which
    if which in STORAGE_CONFIGS:  # the storage tier (conformance/explore/storage_driver.py)
        from uniradix.conformance.explore.storage_driver import conform_config
        return conform_config(which, seed, segment)
    names = list(NAMED_CONFIGS)
    name = which if which is not None else names[segment % len(names)]
    base = NAMED_CONFIGS[name]
    rng = random.Random(f"conform-config:{seed}:{segment}")
    if name == "swa":  # page 1/2/4, window 1..12, an SWA pool of 50-100% of the KV pool
        base = dict(base, page_size=rng.choice([1, 2, 4]), sliding_window=rng.randint(1, 12))
    elif "swa" in base.get("components", ()):  # Full + SWA + Mamba: its own page size
        base = dict(base, sliding_window=rng.randint(1, 12))
    ps = base.get("page_size", 1)
    if isinstance(ps, tuple):  # the host-tier configs alternate page sizes by segment
        ps = ps[segment % len(ps)]
    pages = rng.randint(16 // ps, 96 // ps)
    if "swa" in base.get("components", ()):
        base["swa_slots"] = rng.randint(max(1, pages // 2), pages) * ps
    if "mamba" in base.get("components", ()):
        base = dict(base, mamba_slots=rng.randint(2, 8),
                    mamba_cache_chunk_size=rng.randint(1, 4))
    if base.get("mamba_extra_buffer"):  # 1 + 1-2 state slots a request: a bigger pool
        base = dict(base, mamba_slots=rng.randint(3, 12), mamba_track_slots=rng.choice([1, 2]),
                    mamba_cache_chunk_size=ps * rng.randint(1, 4 if ps == 1 else 2),
                    mamba_track_interval=ps * rng.randint(1, 12 if ps == 1 else 3))
        if base.get("mamba_extra_buffer_lazy"):
            base["mamba_track_slots"] = 2
    if name.startswith("hicache-") or name.startswith("host-") or "write_policy" in base:
        policy = base["write_policy"]
        if isinstance(policy, tuple):
            policy = policy[(segment // 2) % len(policy)]
        cfg = host_config(RandomChooser(rng), ps, pages * ps, policy)
        if base.get("eagle"):
            cfg = dataclasses.replace(cfg, eagle=True)
        comps = base.get("components", ("full",))
        if "mamba" in comps:
            mamba_slots = rng.randint(2, 8)
            cfg = dataclasses.replace(cfg, components=comps, mamba_slots=mamba_slots,
                                      host_mamba_slots=max(1, mamba_slots * rng.randint(1, 4) // 2),
                                      mamba_cache_chunk_size=rng.randint(1, 4))
        if "swa" in comps:
            half = cfg.host_slots // 2 // ps * ps
            cfg = dataclasses.replace(cfg, components=comps,
                                      sliding_window=base["sliding_window"],
                                      swa_slots=base["swa_slots"],
                                      host_swa_slots=rng.choice([None, max(ps, half)]))
        cfg.validate()
        return name, cfg
    return name, CacheConfig(**base, kv_slots=pages * ps)


@dataclasses.dataclass
class ConformResult:
    steps: int = 0
    divergences: int = 0
    violations: int = 0
    segments: int = 0
    seconds: float = 0.0
    finding: Finding | None = None
    trace_path: str | None = None
    shrunk_steps: int | None = None
    config_name: str | None = None
    skipped_configs: dict = dataclasses.field(default_factory=dict)  # name -> why
    notes: list = dataclasses.field(default_factory=list)  # what was not compared, and why
    event_steps: int = 0  # steps whose KV events were compared (conformance/traces/events.py)
    noledger_steps: int = 0  # steps run with fast-noledger in place of fast (``ledger``)
    # divergences from upstream that are a documented difference (documented_difference): each
    # ends its segment, is counted here and the run goes on with the next segment
    documented: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        doc = (f", {self.documented} documented differences from upstream (docs/SPEC.md)"
               if self.documented else "")
        return (f"conform: {self.steps} steps, {self.divergences} divergences, "
                f"{self.violations} violations{doc}")


#: ``conform --events``: which segments compare KV events (``run_conform(events=...)``)
EVENT_SEGMENTS = ("every", "even", "off")
#: ``conform --slot-ledger``: which segments run fast with its slot ledger (``run_conform(
#: ledger=...)``): "alternate" (every other segment that compares no KV events runs
#: ``fast-noledger``, where the paths that decline under the ledger run), "on" or "off"
LEDGER_SEGMENTS = ("alternate", "on", "off")


def segment_phase(config: Any, segment: int) -> int:
    """The number that decides a segment's events and ledger: the segment itself for one
    config; over the named cycle, the segment plus its cycle, so each config alternates from
    one cycle to the next (with an even number of configs the segment's parity alone would
    give a config the same choice in every cycle)."""
    if config is not None:
        return segment
    return segment + segment // len(NAMED_CONFIGS)


def ledger_off(events: str, ledger: str, phase: int) -> bool:
    """Whether a segment runs fast without its slot ledger: always (``off``), never (``on``),
    or (``alternate``) every other segment of those that compare no KV events under
    ``--events even`` (KV events move Full to the composed tree and decline the same fast
    paths), every other segment under the other two."""
    if ledger != "alternate":
        return ledger == "off"
    return phase % 4 == 1 if events == "even" else phase % 2 == 1


def without_ledger(impl: ImplSpec) -> ImplSpec:
    """``impl`` with ``fast`` replaced by ``fast-noledger`` (inside the KV check's wrapper
    too); any other implementation as it is."""
    if impl == "fast":
        return "fast-noledger"
    if getattr(impl, "kv_wrapped", None) == "fast":
        from uniradix.conformance.env.kvcheck import kv_checked
        return kv_checked("fast-noledger")
    return impl


def _rebuilds_for_events(adapter: Any) -> bool:
    """Whether ``adapter`` (or one it wraps, ``inner``) turns KV events on by rebuilding its
    cache (``start_kv_events``, conformance/traces/events.py)."""
    for _ in range(8):
        if adapter is None:
            return False
        if callable(getattr(type(adapter), "start_kv_events", None)):
            return True
        adapter = getattr(adapter, "inner", None)
    return False


def _aux_field(finding: Finding, pattern: str) -> str | None:
    """The aux component (``"mamba"`` or ``"swa"``) whose field ``pattern`` (``{}`` for the
    component) the finding is at, or None."""
    return next((c for c in ("mamba", "swa") if finding.field.startswith(pattern.format(c))),
                None)


def documented_difference(labels: Sequence[str], config: CacheConfig, taken: Sequence[dict],
                          finding: Finding) -> str | None:
    """The documented rule (docs/SPEC.md, "differences") a finding against upstream is an instance
    of, or None.  Only findings with upstream qualify: the spec and fast never differ by a rule,
    and a violation qualifies only where upstream's own check or code alone failed. Divergences:
    an insert over an SWA tombstone a lock holds, inside the caller's window (issue 18; the seed
    frees the tombstone's full slots, the spec keeps them); with SWA and Mamba, ``mamba_exist``
    of an insert whose new leaf SWA does not create (the seed answers false and leaks the state
    slot, the spec true); a host-locked Mamba state (or SWA host copy) left on the host only
    (upstream lists it in its host LRU list, the spec keeps it out), and its host frees that
    then take such data, lock and all; a Mamba load back whose room-making took the host state
    it was to load (upstream loads it anyway); with SWA and a host tier, a device leaf that an
    unlock through an evicted node left out of upstream's evictable leaf set; an unlock after a
    split cut a node its lock skipped (upstream takes a lock from the upper part, which a later
    lock may hold); a split of a node whose SWA host copy a host lock holds (upstream's upper
    part loses the host lock); under ``lru`` with a write-through threshold of 2 or more, a
    hit on a node a split made that upstream's copied hit count takes to the threshold sooner.
    Violations: upstream's sanity check after a host lock of a node with host-only aux data;
    upstream's assertion in a copy-on-write match with no state slot to be had; its crash in a
    load back whose room-making took the node itself from the host; its assertion in a Mamba
    load back with no device state slot to be had; its assertion in the unlock of a lock that
    skipped an evicted node a later split cut (the new upper part, never locked, loses a lock);
    its hang (no answer within ``--step-timeout``) in a write-back SWA or Mamba eviction whose
    victim cannot be backed up; its assertion in a load back whose SWA window ends at a
    tombstone (a best node from an earlier match)."""
    if finding.kind == VIOLATION and finding.op == "host_lock" and finding.impls \
            and all(lab.startswith("upstream") for lab in finding.impls) \
            and host_lock_on_host_only_aux(Trace({}, config, list(taken)), finding.step):
        return ("upstream's sanity check fails after a host lock of a node with host-only aux "
                "data (docs/SPEC.md)")
    upstream_crash = finding.kind == VIOLATION and finding.where == "crash" and finding.impls \
        and all(lab.startswith("upstream") for lab in finding.impls)
    if upstream_crash and finding.op == "match_prefix" \
            and cow_match_without_a_state_slot(Trace({}, config, list(taken)), finding.step):
        return ("a copy-on-write match with no state slot to be had: upstream asserts, the "
                "spec answers no slot (docs/SPEC.md)")
    if upstream_crash and finding.op in ("unlock", "check_hicache_events") \
            and releases_after_split_of_skipped_node(Trace({}, config, list(taken)),
                                                     finding.step):
        return ("an unlock after a split cut a node its lock skipped: upstream takes a lock "
                "from the new upper part it never locked, here or at a later release "
                "(docs/SPEC.md)")
    if upstream_crash and finding.op == "load_back" \
            and load_back_lost_its_host_state(Trace({}, config, list(taken)), finding.step):
        return ("a load back whose room-making took the node from the host: upstream reads "
                "its missing host copy, the spec loads nothing (docs/SPEC.md)")
    if upstream_crash and any(str(v).startswith("StepTimeout") for v in finding.values.values()) \
            and aux_evict_passes_over_a_leaf(Trace({}, config, list(taken)), finding.step):
        return ("a write-back SWA or Mamba eviction whose victim cannot be backed up: upstream "
                "takes the same leaf forever (a hang), the spec passes it over (docs/SPEC.md)")
    if upstream_crash and finding.op == "load_back" \
            and load_back_window_ends_at_a_tombstone(Trace({}, config, list(taken)),
                                                     finding.step):
        return ("a load back whose SWA window ends at a tombstone: upstream asserts every "
                "node of the window has SWA data, the spec loads the window it has "
                "(docs/SPEC.md)")
    if upstream_crash and finding.op == "load_back" and any(
            "Cannot alloc mamba for load_back" in str(v) for v in finding.values.values()) \
            and load_back_without_a_state_slot(Trace({}, config, list(taken)), finding.step):
        return ("a Mamba load back with no device state slot to be had: upstream asserts, the "
                "spec loads nothing (docs/SPEC.md)")
    if finding.kind != DIVERGENCE or not any(lab.startswith("upstream") for lab in labels):
        return None
    if "host" in finding.path \
            and split_of_a_host_locked_swa_copy(Trace({}, config, list(taken)), finding.step):
        return ("a split of a node whose SWA host copy a host lock holds: upstream's upper "
                "part loses the host lock, the spec's keeps it (docs/SPEC.md)")
    if finding.op == "load_back" and load_back_lost_its_host_state(
            Trace({}, config, list(taken)), finding.step):
        return ("a Mamba load back whose room-making took the host state it was to load: "
                "upstream loads it from a host slot another node holds (docs/SPEC.md)")
    trace = Trace({}, config, list(taken))
    ups = [v for lab, v in finding.values.items() if lab.startswith("upstream")]
    listed = _aux_field(finding, "snapshot.host.{}_host_lru_order")
    if listed is not None and any(host_locked_state_listed(trace, finding.step, v, listed)
                                  for v in ups):
        what = "Mamba state" if listed == "mamba" else "SWA host copy"
        return (f"a host-locked {what} that an evict leaves on the host only: upstream "
                "lists it in its host LRU list, the spec keeps host-locked data out (docs/SPEC.md)")
    if finding.step in releases_after_split_of_skipped_node(Trace({}, config, list(taken)),
                                                            finding.step):
        return ("the release of a lock after a split cut a node it skipped (an evicted node, "
                "or with SWA a tombstone of its window): upstream takes a lock from the new "
                "upper part it never locked (docs/SPEC.md)")
    if finding.op in ("unlock", "load_back") \
            and finding.field.startswith("snapshot.device_leaf_order") \
            and any(unlock_left_a_device_leaf_out(Trace({}, config, list(taken)), finding.step, v)
                    for lab, v in finding.values.items() if not lab.startswith("upstream")):
        what = "an unlock" if finding.op == "unlock" else "a load back that gave up"
        return (f"{what} through an evicted node with SWA: upstream leaves the device leaf "
                "above it out of its evictable leaf set, the spec lists it (docs/SPEC.md)")
    freed = _aux_field(finding, "observation.host_{}_freed")
    if freed is not None and any(host_locked_copy_freed(trace, finding.step, v, freed)
                                 for v in ups):
        return ("upstream frees the host copy of host-locked data an evict left on the host "
                "only (it had listed it in its host LRU list); the spec keeps it (docs/SPEC.md)")
    if split_hit_count_reaches_threshold(trace, finding.step):
        return ("a write-through hit on a node a split made: 0.5.13.post1 copies the lower "
                "part's hit count to it and backs it up sooner, the seed (and the spec under "
                "lru) starts it at 0 (docs/SPEC.md)")
    if finding.op == "insert" and held_swa_tombstone_takeover(
            Trace({}, config, list(taken)), finding.step):
        return "issue 18: an insert over an SWA tombstone a lock holds (docs/SPEC.md)"
    if finding.op == "insert" and finding.field.endswith("mamba_exist") \
            and swa_skipped_leaf_keeps_state(Trace({}, config, list(taken)), finding.step):
        return ("mamba_exist of an insert whose new leaf SWA does not create: the seed leaks "
                "the state slot (docs/SPEC.md)")
    return None


class ConformUnsupported(Unsupported):
    """An implementation cannot run the config asked for (``--config``), or any named one."""


def _build_segment_adapters(impls: Sequence[ImplSpec], labels: Sequence[str],
                            cfg: CacheConfig) -> list:
    """The adapters of one segment; Unsupported names the implementation that refused."""
    out = []
    for label, impl in zip(labels, impls, strict=True):
        try:
            out.extend(build_adapters([impl], cfg))
        except Unsupported as e:
            raise Unsupported(f"{label}: {e}") from None
    return out


def comparison_notes(labels: Sequence[str], adapters: Sequence[Any],
                     tree_only_asked: bool) -> list[str]:
    """What a segment with these adapters does not generate or compare, one line each (the
    rules are declared by the adapters: ``tree_only``, ``uncompared_node_fields``)."""
    notes = []
    narrow = [lab for lab, a in zip(labels, adapters, strict=True) if adapter_tree_only(a)]
    if narrow and not tree_only_asked:
        notes.append(f"{', '.join(narrow)}: tree-level API only; request-level ops (req_*) "
                     "are not generated")
    for lab, a in zip(labels, adapters, strict=True):
        fields = sorted(uncompared_node_fields(a))
        if fields:
            notes.append(f"{lab}: snapshot node field(s) {', '.join(fields)} not compared "
                         "(a documented difference of this peer, docs/SPEC.md)")
    return notes


class Progress:
    """A one-line progress bar on stderr (``\\r`` updates on a terminal, a line every few
    seconds otherwise)."""

    def __init__(self, label: str, total: int | None, seconds: float | None,
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label, self.total, self.seconds = label, total, seconds
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0
        self.extra = ""

    def _due(self, force: bool) -> bool:
        """Time for another line: every 0.25 s on a terminal, every 5 s otherwise."""
        if not self.enabled:
            return False
        now = time.monotonic()
        if not force and now - self.last < (0.25 if self.tty else 5.0):
            return False
        self.last = now
        return True

    def _emit(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r" + line.ljust(110)[:170])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    @staticmethod
    def bar(frac: float, width: int = 24) -> str:
        fill = int(width * min(max(frac, 0.0), 1.0))
        return "#" * fill + "." * (width - fill)

    def update(self, done: int, force: bool = False) -> None:
        if not self._due(force):
            return
        el = max(self.last - self.t0, 1e-9)
        if self.total:
            frac = min(done / self.total, 1.0)
        elif self.seconds:
            frac = min(el / self.seconds, 1.0)
        else:
            frac = 0.0
        of = f"/{self.total}" if self.total else ""
        self._emit(f"{self.label} [{self.bar(frac)}] {done}{of} steps, {done / el:.0f} steps/s "
                   f"{self.extra}")

    def close(self, done: int) -> None:
        if self.enabled:
            self.update(done, force=True)
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()


def run_conform(impls: Sequence[ImplSpec], *, config: Any = None, steps: int | None = None,
                seconds: float | None = None, seed: int = 0, out: str | None = DEFAULT_OUT,
                segment_steps: int = SEGMENT_STEPS, shrink_seconds: float = 120.0,
                progress: bool = True, stream: TextIO | None = None,
                log: Callable[[str], None] = lambda m: print(m, flush=True),
                snapshot_every: int = 1, tree_only: bool = False,
                policy: str | None = None, events: str = "even",
                ledger: str = "alternate") -> ConformResult:
    """The ``conform`` loop; returns counts and, at a finding, the written trace's path.
    ``config``: None (cycle through :data:`NAMED_CONFIGS`), a name, or a CacheConfig;
    ``policy``: an eviction policy every segment's config takes (None: the config's own);
    ``events``: which segments compare KV events (:data:`EVENT_SEGMENTS`); ``ledger``: which
    run fast without its slot ledger (:data:`LEDGER_SEGMENTS`)."""
    if events not in EVENT_SEGMENTS:
        raise ValueError(f"events must be one of {EVENT_SEGMENTS}, got {events!r}")
    if ledger not in LEDGER_SEGMENTS:
        raise ValueError(f"ledger must be one of {LEDGER_SEGMENTS}, got {ledger!r}")
    if ledger == "off" and all(without_ledger(i) is i for i in impls):
        raise ConformUnsupported("--slot-ledger off: none of the implementations is fast (only "
                                 "fast keeps a slot ledger), so it would change nothing")
    if steps is None and seconds is None:
        steps = DEFAULT_STEPS
    all_impls = list(impls)
    labels = impl_labels([impl_name(i) for i in impls])
    res = ConformResult()
    bar = Progress(f"conform {','.join(labels)}", steps, seconds, stream, progress)
    t0 = time.monotonic()
    segment = 0

    def budget_left() -> int | None:
        if steps is not None:
            return steps - res.steps
        return None

    while True:
        left = budget_left()
        if left is not None and left <= 0:
            break
        if seconds is not None and time.monotonic() - t0 >= seconds:
            break
        name, cfg = segment_config(config, seed, segment)
        if policy is not None:  # eviction policies (spec/policies.py)
            cfg = dataclasses.replace(cfg, eviction_policy=policy)
            cfg.validate()
        phase = segment_phase(config, segment)
        impls = all_impls
        if ledger_off(events, ledger, phase):
            impls = [without_ledger(i) for i in all_impls]
        labels = impl_labels([impl_name(i) for i in impls])
        try:
            adapters = _build_segment_adapters(impls, labels, cfg)
        except Unsupported as e:
            if config is not None:  # the config asked for: nothing to run
                raise ConformUnsupported(f"config {name if isinstance(config, str) else cfg}: "
                                         f"{e}") from None
            if name not in res.skipped_configs:
                res.skipped_configs[name] = str(e)
                log(f"conform: skipping config {name}: {e}")
            if len(res.skipped_configs) == len(NAMED_CONFIGS):
                raise ConformUnsupported("no named config is supported by every implementation: "
                                         + "; ".join(f"{k}: {v}" for k, v
                                                     in res.skipped_configs.items())) from None
            segment += 1
            continue
        seg_tree_only = tree_only or any(adapter_tree_only(a) for a in adapters)
        for note in comparison_notes(labels, adapters, tree_only):
            if note not in res.notes:
                res.notes.append(note)
                log(f"conform: {note}")
        n = segment_steps if left is None else min(segment_steps, left)
        bar.extra = f"[{name} p{cfg.page_size} kv={cfg.kv_slots}]"
        # "even": an implementation that rebuilds its cache to emit events (fast: a Full-only
        # cache then leaves its C core for the composed tree) compares events on every other
        # segment only, so the C core is compared with the spec in the segments between
        compare_events = events == "every" or (events == "even" and (
            phase % 2 == 0 or not any(_rebuilds_for_events(a) for a in adapters)))
        ls = Lockstep(adapters, labels, snapshot_every=snapshot_every, events=compare_events)
        events_note = f"config {name}: {ls.events_note}" if ls.events_note else ""
        if events_note and events_note not in res.notes:  # KV events (conformance/traces/events.py)
            res.notes.append(events_note)
            log(f"conform: {events_note}")
        base = res.steps

        def on_step(k: int, base: int = base) -> None:
            bar.update(base + k)
            if seconds is not None and k % 64 == 0 and time.monotonic() - t0 >= seconds:
                raise _OutOfTime(k)

        try:
            if cfg.storage:  # the storage workload (conformance/explore/storage_driver.py)
                from uniradix.conformance.explore.storage_driver import storage_segment
                taken, finding = storage_segment(ls, cfg, f"{seed}:{segment}", n, on_step=on_step)
            else:
                taken, finding = random_segment(ls, cfg, f"{seed}:{segment}", n, on_step=on_step,
                                                actions=TREE_ACTIONS if seg_tree_only else None,
                                                cow=name in COW_CONFIGS,
                                                sessions=name in SESSION_CONFIGS)
        except _OutOfTime as e:
            res.steps += e.steps
            break
        res.steps += len(taken)
        res.segments += 1
        res.event_steps += ls.stats["event_steps"]
        if impls != all_impls:
            res.noledger_steps += len(taken)
        doc = None if finding is None else documented_difference(labels, cfg, taken, finding)
        if doc is not None:
            res.documented += 1
            log(f"conform: segment {segment} (config {name}) ends at a documented difference "
                f"from upstream at step {finding.step} ({finding.op}): {doc}")
            segment += 1
            continue
        if finding is not None:
            bar.close(res.steps)
            res.seconds = time.monotonic() - t0
            if finding.kind == VIOLATION:
                res.violations += 1
            else:
                res.divergences += 1
            res.finding, res.config_name = finding, name
            log(f"conform: {finding}")
            log(f"conform: found in segment {segment} (config {name}, kv_slots {cfg.kv_slots}, "
                f"seed {seed}) after {len(taken)} steps of it; shrinking...")
            sr = shrink(impls, cfg, taken, finding, max_seconds=shrink_seconds,
                        events=compare_events)
            res.shrunk_steps = len(sr.steps)
            log(f"conform: shrunk to {len(sr.steps)} steps ({sr.trials} trials, "
                f"{sr.seconds:.1f}s): {sr.finding}")
            if out is not None:
                res.trace_path = write_finding(out, impls, labels, cfg, name, seed, segment,
                                               sr.steps, sr.finding)
                log(f"conform: wrote {res.trace_path}")
            return res
        segment += 1
    bar.close(res.steps)
    res.seconds = time.monotonic() - t0
    return res


class _OutOfTime(Exception):
    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.steps = steps


# ----------------------------------------------------------------------------------------------
# Writing a finding
# ----------------------------------------------------------------------------------------------


def probe_steps(first_i: int, config: CacheConfig, n_evicts: int) -> list[dict]:
    """Steps that make a difference in state visible in observations: the sizes, then one
    eviction at a time (the freed slots show the victims and their order)."""
    out = [{"op": "sizes", "args": {}}]
    out += [{"op": "evict", "args": {"num_tokens": 1}} for _ in range(n_evicts)]
    out.append({"op": "sizes", "args": {}})
    return [dict(s, i=first_i + k) for k, s in enumerate(out)]


def replay_divergence_at(impls: Sequence[ImplSpec], config: CacheConfig,
                         recorded: Sequence[dict]) -> int | None:
    """Where would ``uniradix replay`` of these recorded steps (``ret`` from impls[0]) first
    flag one of the other implementations (the largest such index over them), or None?
    The same checks as replay: every ret field, rejections leave the state unchanged,
    invariants."""
    from uniradix.conformance.traces.replay import compare
    worst: int | None = None
    for impl in impls[1:]:
        a = build_adapters([impl], config)[0]
        for k, s in enumerate(recorded):
            before = a.snapshot() if "error" in s["ret"] else None
            try:
                obs = a.apply(s)
            except Exception:  # noqa: BLE001 - a crash (upstream's assertions) is a finding
                worst = k if worst is None else max(worst, k)
                break
            if (compare(s["ret"], obs) is not None
                    or (before is not None and a.snapshot() != before) or a.violations()):
                worst = k if worst is None else max(worst, k)
                break
        else:
            return None
    return worst


def write_finding_trace(out_dir: str, stem: str, impls: Sequence[ImplSpec], config: CacheConfig,
                        steps: list, source: str, **header: Any) -> str:
    """Write ``steps`` as a trace under ``out_dir`` (``stem``.jsonl, numbered when taken) with
    the reference's observations as ``ret``; a difference seen only in the snapshots gets
    probe steps (sizes, one-token evictions) appended so that a plain replay shows it too.
    Used by ``conform`` for a shrunk finding and ``check --exhaustive`` for a counterexample."""
    os.makedirs(out_dir, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)
    path = os.path.join(out_dir, stem + ".jsonl")
    k = 2
    while os.path.exists(path):
        path = os.path.join(out_dir, f"{stem}-{k}.jsonl")
        k += 1
    steps = list(steps)
    ref = build_adapters([impls[0]], config)[0]
    recorded = [dict(s, ret=comparable(ref.apply(s))) for s in steps]
    if len(impls) > 1 and replay_divergence_at(impls, config, recorded) is None:
        probes = probe_steps(len(steps), config, n_evicts=config.kv_slots // config.page_size)
        recorded += [dict(s, ret=comparable(ref.apply(s))) for s in probes]
        at = replay_divergence_at(impls, config, recorded)
        if at is not None:
            steps = [{k: v for k, v in s.items() if k != "ret"} for s in recorded[: at + 1]]
        header["probes_appended"] = at is not None
    write_trace(path, impls, config, steps, source=source, **header)
    return path


def write_finding(out_dir: str, impls: Sequence[ImplSpec], labels: Sequence[str],
                  config: CacheConfig, config_name: str, seed: int, segment: int,
                  steps: list, finding: Finding) -> str:
    """Write the shrunk steps of a ``conform`` finding as a trace (:func:`write_finding_trace`)."""
    stem = f"conform-{config_name}-s{seed}-g{segment}-{finding.op}-{finding.where}"
    source = (f"uniradix conform: shrunk finding ({','.join(labels)}; config {config_name}, "
              f"seed {seed}, segment {segment}): {finding}")
    return write_finding_trace(out_dir, stem, impls, config, steps, source, seed=seed,
                               finding=finding.to_dict(), implementations=list(labels))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def cmd_conform(args: argparse.Namespace) -> int:
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if len(impls) < 2:
        print("uniradix conform: --impls needs at least two implementations", file=sys.stderr)
        return 2
    config = parse_config_arg(args.config)
    if args.check_kv:
        from uniradix.conformance.env.kvcheck import kv_checked
        impls = [kv_checked(i) for i in impls]
    try:
        with step_timeout(args.step_timeout if args.step_timeout > 0 else None):
            res = run_conform(impls, config=config, steps=args.steps, seconds=args.seconds,
                              seed=args.seed, out=args.out, shrink_seconds=args.shrink_seconds,
                              progress=not args.no_progress,
                              snapshot_every=args.snapshot_every, tree_only=args.tree_only,
                              policy=args.policy, events=args.events, ledger=args.slot_ledger)
    except ImportError as e:  # upstream not importable, or torch missing for fast
        print(f"uniradix conform: {e}", file=sys.stderr)
        return 2
    except ConformUnsupported as e:  # e.g. --config eagle-p1 with upstream
        print(f"uniradix conform: not run: {e}", file=sys.stderr)
        return 2
    if res.event_steps:
        print(f"conform: KV events compared on {res.event_steps} steps")
    if res.noledger_steps:
        print(f"conform: fast without its slot ledger (fast-noledger) on {res.noledger_steps} "
              "steps")
    if res.trace_path is not None:
        print(res.trace_path)
    print(res.summary(), flush=True)
    return 0 if res.finding is None else 1


def add_conform_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "conform", help="long randomized lockstep runs of two or more implementations",
        description="Run implementations in lockstep on random scenarios; at the first "
                    "divergence or invariant violation, shrink it and write it as a trace.")
    p.add_argument("--impls", default="spec,fast",
                   help="comma-separated implementations (default spec,fast); the first is "
                        "the reference whose observations a written trace records")
    p.add_argument("--config", default=None,
                   help=f"one of {', '.join(NAMED_CONFIGS)} (kv_slots drawn per segment), "
                        "storage (cycles through the storage configs) or one of them "
                        "(storage-{wt,wb}-p{1,4}-{be,wc,to}), or a JSON config object; default: "
                        "cycle through the named configs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None,
                   help=f"total steps (default {DEFAULT_STEPS} when --seconds is not given)")
    g.add_argument("--seconds", type=float, default=None, help="run for this long instead")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for the shrunk trace of a finding (default {DEFAULT_OUT})")
    p.add_argument("--shrink-seconds", type=float, default=120.0,
                   help="time limit for shrinking a finding (default 120)")
    p.add_argument("--step-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="an implementation that takes longer than this for one step is "
                        "stopped and reported as hung (a crash finding, StepTimeout; default "
                        "20; 0: no limit)")
    p.add_argument("--snapshot-every", type=int, default=1, metavar="N",
                   help="compare snapshots and run invariants every N steps only (default 1: "
                        "every step; a rejected step is always followed by a comparison)")
    p.add_argument("--tree-only", action="store_true",
                   help="no request-level ops (req_*); automatic when an implementation has "
                        "only the tree-level API (upstream)")
    p.add_argument("--check-kv", action="store_true",
                   help="each implementation keeps a fingerprinted KV pool; every slot a cache "
                        "hands out must hold its token's KV (conformance/env/kvcheck.py)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--policy", default=None, choices=list(POLICIES),
                   help="eviction policy for every segment's config (default: the config's, lru)")
    p.add_argument("--events", default="even", choices=list(EVENT_SEGMENTS),
                   help="which segments compare KV events: every (all; fast's Full configs then "
                        "always run on the composed tree), even (default: every segment of an "
                        "implementation that does not rebuild its cache for events, every other "
                        "one of one that does, so fast's C core runs on the odd ones) or off")
    p.add_argument("--slot-ledger", default="alternate", choices=list(LEDGER_SEGMENTS),
                   help="which segments build fast with its slot ledger (validate_slots, on "
                        "over the conformance pools; sglang's allocators have none): alternate "
                        "(default: every other segment that compares no KV events runs "
                        "fast-noledger, where the fast paths that decline under the ledger "
                        "run), on or off")
    p.set_defaults(func=cmd_conform)
    return p


WORKLOADS = ("shared-prefix", "random")


def cmd_record(args: argparse.Namespace) -> int:
    try:
        return _record(args)
    except ImportError as e:  # upstream not importable, or torch missing for fast
        print(f"uniradix record: {e}", file=sys.stderr)
        return 2


def _record(args: argparse.Namespace) -> int:
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.traces.trace import dump_trace, make_header

    seed = args.seed
    events = getattr(args, "events", False)
    extra: dict[str, Any] = {}
    if args.workload == "shared-prefix":
        if getattr(args, "policy", "lru") != "lru":
            raise ConfigError("--policy applies to --workload random only")
        if events:
            raise ConfigError("--events applies to --workload random only")
        from uniradix.conformance.env.workload import SharedPrefix, run_shared_prefix
        requests = args.steps if args.steps is not None else 100
        w = SharedPrefix(seed=seed).scaled(requests)
        config = w.config()
        adapter = make_adapter(args.impl, config)
        steps: list = []
        try:
            run_shared_prefix(adapter, w, record=steps)
        except RuntimeError as e:  # a rejected step: the implementation cannot run it
            print(f"uniradix record: {e}", file=sys.stderr)
            return 1
        what = f"shared-prefix, {requests} requests"
    else:
        from uniradix.conformance.explore import driver
        n = args.steps if args.steps is not None else 400
        config = driver.with_policy(driver.make_config(args.config, seed), args.policy)
        adapter = make_adapter(args.impl, config)
        if events:  # each step's KV events, and the header's hash mode (docs/TRACE.md)
            from uniradix.conformance.traces.events import event_source
            src = event_source(adapter)
            if src is None:
                print(f"uniradix record: --events: {args.impl} emits no KV events",
                      file=sys.stderr)
                return 2
            extra["event_key_mode"] = src.key_mode
        try:
            steps = driver.record(adapter, config, seed, n, cow=args.config in driver.COW_CONFIGS,
                                  events=events)
        except driver.RecordingError as e:
            print(f"uniradix record: {e}", file=sys.stderr)
            return 1
        what = f"random ({driver.config_label(args.config, args.policy)}), {n} steps"
    who = f"uniradix {args.impl}"
    if args.impl == "upstream":
        version = getattr(getattr(adapter, "up", None), "version", None) or "0.5.13.post1"
        who = f"sglang {version} UnifiedRadixCache"
    source = (f"{who}, recorded by uniradix record --workload {args.workload} "
              f"({what}, seed {seed})")
    dump_trace(args.out, make_header(config, source, seed=seed, **extra), steps)
    if events:
        print(f"{args.out}: {len(steps)} steps, {sum(len(s['events']) for s in steps)} events")
    else:
        print(f"{args.out}: {len(steps)} steps")
    return 0


def add_record_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "record", help="record a trace of a built-in workload on one implementation",
        description="Run a workload on one implementation and write every step with its "
                    "observation as ret (a golden trace for replay).")
    p.add_argument("--impl", default="spec", choices=["spec", "fast", "upstream"],
                   help="implementation to record (default spec)")
    p.add_argument("--workload", required=True, choices=WORKLOADS,
                   help="shared-prefix (conformance/env/workload.py, request-level ops) or random "
                        "(the scheduler-like driver, tree-level ops)")
    p.add_argument("--out", required=True, metavar="T.jsonl", help="trace file to write")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="random: steps (default 400); shared-prefix: requests, i.e. "
                        "SharedPrefix().scaled(N) (default 100)")
    from uniradix.conformance.explore.driver import CONFIG_NAMES as driver_configs
    from uniradix.conformance.explore.driver import POLICY_CHOICES as driver_policies
    p.add_argument("--config", default="full-p1", choices=list(driver_configs),
                   help="random workload only: the driver's config (default full-p1; "
                        "swa-*/mamba-p1 are hybrid models, hicache-{wt,wb}-p{1,4} have a host "
                        "tier)")
    p.add_argument("--policy", default="lru", choices=list(driver_policies),
                   help="random workload only: the eviction policy (default lru; the others "
                        "give each request a priority for its inserts)")
    p.add_argument("--events", action="store_true",
                   help="random workload only: record each step's KV events too (docs/TRACE.md, "
                        "'KV events'); the implementation must emit them (spec, upstream)")
    p.set_defaults(func=cmd_record)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (until cli.py registers the subcommands)."""
    from uniradix.spec.errors import CacheError
    p = argparse.ArgumentParser(prog="uniradix")
    sub = p.add_subparsers(dest="command", required=True)
    add_conform_parser(sub)
    add_record_parser(sub)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except CacheError as e:
        print(f"uniradix: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
