"""HostAuxUpstreamAdapter against upstream SGLang 0.5.13.post1 (needs sglang importable; skipped
otherwise): the host tier with SWA or Mamba.  The committed corpora replay on upstream and the
recorder reproduces them; the regression traces of upstream's two defects in this area still
make it hang / fail its assertion (each under a timeout, so the hang fails fast).

Run with the upstream venv's python: ``VENV/bin/python -m pytest
tests/conformance/adapters/test_upstream_host_aux.py``.
"""

from __future__ import annotations

import glob
import json
import os
import signal

import pytest

from stories import upstream_crash_is_documented
from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import HOST_AUX_NAMES, make_config, record
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import Unsupported

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

from uniradix.conformance.adapters.upstream_host_aux import (  # noqa: E402 - after the skip
    HOST_AUX_CONFIGS,
    HostAuxUpstreamAdapter,
    host_aux_slots,
)

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "corpus")
# they replay on the spec (its expected last `ret`), spec-only like the rest there
REGRESSIONS_HOST_AUX = os.path.join(CORPUS, "regressions-host-aux")
HANG_S = 5  # a step of these tiny traces takes milliseconds


class _Timeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _Timeout()


def _apply_checked(adapter, step: dict) -> None:
    obs = adapter.apply(step)
    for field, expected in step.get("ret", {}).items():
        assert obs.get(field) == expected, (
            f"step {step['i']} {step['op']}: {field} = {obs.get(field)!r}, trace says {expected!r}")
    assert adapter.violations() == [], f"step {step['i']} {step['op']}"


def test_config_table_is_the_driver_s():
    assert set(HOST_AUX_CONFIGS) == set(HOST_AUX_NAMES)
    for name in HOST_AUX_NAMES:
        config = make_config(name, 3)
        fixed = HOST_AUX_CONFIGS[name]
        assert config.has_host_tier
        for key, value in fixed.items():
            assert getattr(config, key) == value, (name, key)


def test_refuses_what_it_does_not_drive():
    for bad in (CacheConfig(page_size=1, components=("full", "swa"), kv_slots=16,
                            sliding_window=4, swa_slots=16),  # no host tier
                CacheConfig(page_size=1, kv_slots=16, host_slots=16),  # no aux component
                CacheConfig(page_size=1, components=("full", "mamba"), kv_slots=16,
                            mamba_slots=2, host_slots=16, disable=True)):
        with pytest.raises(Unsupported):
            HostAuxUpstreamAdapter(bad)


def test_aux_host_pool_sizes():
    swa = CacheConfig(page_size=4, components=("full", "swa"), kv_slots=16, sliding_window=4,
                      swa_slots=16, host_slots=32)
    assert host_aux_slots(swa) == 32
    assert host_aux_slots(CacheConfig(**{**swa.to_dict(), "components": ("full", "swa"),
                                         "host_swa_slots": 8})) == 8
    mamba = CacheConfig(page_size=1, components=("full", "mamba"), kv_slots=16, mamba_slots=3,
                        host_slots=16)
    assert host_aux_slots(mamba) == 6
    adapter = HostAuxUpstreamAdapter(mamba)
    assert adapter.host_aux_pool.num_pages == 6 and adapter.host_aux_pool.page_size == 1


@pytest.mark.parametrize("name", HOST_AUX_NAMES)
def test_committed_trace_replays_on_upstream_and_is_re_recorded(name):
    folder = "upstream-host-swa" if "-swa-" in name else "upstream-host-mamba"
    path = sorted(glob.glob(os.path.join(CORPUS, folder, f"{name}-s*.jsonl")))[0]
    trace = load_trace(path)
    result = replay_trace(trace, "upstream")
    assert result.divergence is None, str(result.divergence)
    seed = int(os.path.basename(path).split("-s")[-1].split(".")[0])
    config = make_config(name, seed)
    assert config == trace.config
    assert record(make_adapter("upstream", config), config, seed, len(trace.steps)) == trace.steps


@pytest.mark.parametrize("name", ["full-swa-mamba-p1", "full-swa-mamba-p4"])
def test_full_swa_mamba_trace_replays_on_upstream_and_is_re_recorded(name):
    """The stretch corpus: read without the config check (which refuses three components until
    the spec's Full+SWA+Mamba work is merged)."""
    path = sorted(glob.glob(os.path.join(CORPUS, "upstream-full-swa-mamba", f"{name}-s*.jsonl")))[0]
    with open(path, encoding="utf-8") as f:
        header, *steps = (json.loads(ln) for ln in f if ln.strip())
    raw = header["config"]
    seed = header["seed"]
    config = make_config(name, seed)
    assert config == CacheConfig(**{**raw, "components": tuple(raw["components"])})
    adapter = make_adapter("upstream", config)
    for step in steps:
        _apply_checked(adapter, step)
    assert record(make_adapter("upstream", config), config, seed, len(steps)) == steps


@pytest.mark.parametrize("folder, name", [
    (REGRESSIONS_HOST_AUX, "upstream-hang-host-swa-wb-p1-evict-backup-fails"),
    (REGRESSIONS_HOST_AUX, "upstream-hang-host-mamba-wb-p1-evict-backup-fails")])
def test_write_back_aux_eviction_never_ends_when_the_backup_fails(folder, name):
    """Defect 1 (issue 12 item 6): the last step, an evict that needs SWA/Mamba eviction, never
    returns on 0.5.13.post1.  If upstream fixes it, this fails: update the regressions README."""
    trace = load_trace(os.path.join(folder, name + ".jsonl"))
    adapter = make_adapter("upstream", trace.config)
    *prologue, last = trace.steps
    for step in prologue:
        _apply_checked(adapter, step)
    assert last["op"] == "evict"  # its `ret`, if any, is the spec's (the eviction ends)
    last = {k: v for k, v in last.items() if k != "ret"}
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(HANG_S)
    try:
        with pytest.raises(_Timeout):
            adapter.apply(last)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", [
    "upstream-crash-host-mamba-wt-p1-load-back-all-slots-pinned.jsonl",
    "upstream-crash-host-mamba-wb-p4-load-back-with-every-state-slot-the-callers.jsonl"])
def test_conform_counts_a_mamba_load_back_with_no_state_slot_as_documented(name):
    """docs/SPEC.md, "A Mamba load back with no device state to be had": every device state
    slot pinned by pending write-through acks (the hand-written trace), or held by the caller
    (found by conform spec,upstream on host-mamba-wb-p4, seed 2030): upstream asserts, the
    spec and fast load nothing.  conform counts the assertion as documented."""
    upstream_crash_is_documented(os.path.join(REGRESSIONS_HOST_AUX, name), "load_back",
                                 "Cannot alloc mamba for load_back")


def test_conform_counts_a_load_back_of_a_window_ending_at_a_tombstone_as_documented():
    """docs/SPEC.md, "A load back whose window ends at an SWA tombstone" (conform spec,upstream
    on sessions-host-swa-p1, seed 2033): upstream asserts in its SWA load-back transfer, the
    spec and fast load the window they have."""
    upstream_crash_is_documented(
        os.path.join(REGRESSIONS_HOST_AUX,
                     "upstream-crash-sessions-host-swa-p1-load-back-window-ends-at-a-tombstone.jsonl"),
        "load_back", "AssertionError")


def test_upstreams_split_of_a_host_locked_swa_copy_loses_the_lock():
    """docs/SPEC.md, "A split of a host-locked SWA copy": upstream 0.5.13.post1 replays the
    trace up to its last step, where its new upper part has SWA host lock count 0 (the spec's
    1); conform counts that as documented."""
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import replay_trace
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX, "conform-sessions-host-swa-p1-split-of-a-host-locked-swa-copy.jsonl"))
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    ad = make_adapter("upstream", trace.config)
    for step in trace.steps:
        assert "error" not in ad.apply(step)
    upper = ad._find_node([4, 4, 2, 3, 2], "a")
    assert upper.component_data[ad.up.ComponentType.SWA].host_lock_ref == 0
    last = trace.steps[-1]
    d = Finding(DIVERGENCE, last["i"], "insert", "snapshot",
                "host.nodes[extra_key='a' tokens=[4, 4, 2, 3, 2]].swa.host_lock_ref",
                {"spec": 1, "upstream": 0}, ("spec", "upstream"))
    assert documented_difference(["spec", "upstream"], trace.config, trace.steps, d)


def test_mamba_load_back_asserts_when_every_state_slot_is_pinned():
    """Defect 2 (issue 12 item 6): with both device state slots held by nodes whose
    write-through acks are pending, the load back fails an assertion instead of failing."""
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX, "upstream-crash-host-mamba-wt-p1-load-back-all-slots-pinned.jsonl"))
    adapter = make_adapter("upstream", trace.config)
    *prologue, last = trace.steps
    for step in prologue:
        _apply_checked(adapter, step)
    assert last["op"] == "load_back"  # its `ret` is the spec's (the load back fails)
    last = {k: v for k, v in last.items() if k != "ret"}
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(HANG_S)
    try:
        with pytest.raises(AssertionError, match="Cannot alloc mamba for load_back"):
            adapter.apply(last)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("component,path,node", [
    ("mamba", os.path.join(CORPUS, "regressions", "host-locked-mamba-state-host-lru.jsonl"),
     {"tokens": [2, 1, 2, 3], "extra_key": "b"}),
    ("swa", os.path.join(REGRESSIONS_HOST_AUX, "host-locked-swa-copy-host-lru-host-swa-wb-p4.jsonl"),
     {"tokens": [4, 4, 2, 4], "extra_key": "a"})])
def test_upstream_lists_a_host_locked_state_an_evict_leaves_on_the_host(component, path, node):
    """docs/SPEC.md, "Host locks": a node's Mamba state (or SWA data) loaded back and
    host-locked, then evicted from the device again, is on the host only and host-locked.
    0.5.13.post1's evict puts it into its host LRU list of that component (its own host lock
    takes it out); the spec keeps host-locked data out of the list.  conform counts that as
    the documented difference; the same steps without the host lock list the node on both
    sides.  (The SWA trace: conform spec,upstream on host-swa-wb-p4, seed 2030.)"""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    assert trace.steps[-1]["op"] == "evict"
    field = f"{component}_host_lru_order"

    def host_lru(impl, steps):
        a = make_adapter(impl, trace.config)
        for s in steps:
            a.apply({k: v for k, v in s.items() if k != "ret"})
        return a.snapshot()["host"][field]

    assert node not in host_lru("spec", trace.steps)
    assert host_lru("spec", trace.steps) == host_lru("fast", trace.steps)
    assert node in host_lru("upstream", trace.steps)
    step = trace.steps[-1]["i"]
    finding = Finding(DIVERGENCE, step, "evict", "snapshot", f"host.{field}[0]",
                      {"spec": "<missing>", "upstream": node}, ("spec", "upstream"))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             finding) is not None
    unlocked = [s for s in trace.steps if s["op"] != "host_lock"]
    assert node in host_lru("spec", unlocked) and node in host_lru("upstream", unlocked)
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, unlocked,
                                             finding) is None


def test_upstream_loads_a_mamba_state_from_a_host_slot_its_room_making_gave_away():
    """docs/SPEC.md, "A Mamba load back with no device state to be had": the load back of
    node b (its KV and state on the host only) needs a device state slot, so it evicts node a's
    state; under write-back that evict backs a up, and the backup takes the oldest host state
    for room: b's own.  The spec (and fast) then fail the load back; 0.5.13.post1 loads b
    anyway, so b's device state comes from host slot 1, which a's backup holds by then.  conform
    counts it as that documented difference; a load back that keeps its host state is none."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    path = os.path.join(REGRESSIONS_HOST_AUX,
                        "upstream-load-back-from-a-taken-host-state-host-mamba-wb-p4.jsonl")
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    d = replay_trace(trace, "upstream").divergence
    last = trace.steps[-1]
    assert last["op"] == "load_back" and last["ret"]["device_indices"] == []
    assert d is not None and d.step == last["i"] and d.field == "device_indices"
    up = make_adapter("upstream", trace.config)
    for s in trace.steps:
        up.apply({k: v for k, v in s.items() if k != "ret"})
    host = {(n["path"]["extra_key"], tuple(n["path"]["tokens"])): n
            for n in up.snapshot()["host"]["nodes"]}
    dev = {(n["path"]["extra_key"], tuple(n["path"]["tokens"])): n
           for n in up.snapshot()["nodes"]}
    b, a = ("b", (2, 1, 2, 1)), ("a", (2, 1, 2, 1))
    assert dev[b]["mamba"]["value"] == [1] and host[b]["mamba"]["host_value"] is None
    assert host[a]["mamba"]["host_value"] == [1]  # the host slot b's state was loaded from
    finding = Finding(DIVERGENCE, last["i"], "load_back", "observation", "device_indices[0]",
                      {"spec": "<missing>", "upstream": 4}, ("spec", "upstream"))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             finding) is not None
    # the load backs of the older trace of this rule that keep their host state are none
    other = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX, "conform-host-mamba-wb-p4-load-back-loses-its-host-state.jsonl"))
    for s in other.steps:
        if s["op"] == "load_back" and s is not other.steps[-1]:
            f = Finding(DIVERGENCE, s["i"], "load_back", "observation", "device_indices[0]",
                        {}, ("spec", "upstream"))
            assert conform_mod.documented_difference(["spec", "upstream"], other.config,
                                                     other.steps, f) is None


def test_upstream_crashes_loading_a_node_its_room_making_took_from_the_host():
    """The same rule as above when the room-making takes the node itself: node [2, 1, 2, 2]
    is on the host only (one host state slot in all); its load back evicts a device state for
    room, under write-back that state's backup takes the host state slot, and the host leaf it
    evicts for it is the node being loaded (its KV host copy freed too).  The spec and fast load
    nothing; 0.5.13.post1 goes on to commit the transfer and fails on the node's missing host
    copy (a TypeError).  conform counts the crash as that documented difference."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    path = os.path.join(REGRESSIONS_HOST_AUX, "upstream-crash-host-mamba-wb-p4-load-back-of-a-"
                        "node-its-room-making-evicted.jsonl")
    trace, _ = upstream_crash_is_documented(path, "load_back", "TypeError")
    last = trace.steps[-1]
    assert last["ret"]["device_indices"] == []
    # a crash of the spec's, or upstream's at a step that is no such load back, is never one
    ours = Finding(VIOLATION, last["i"], "load_back", "crash", "TypeError", {}, ("spec",))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             ours) is None
    at_insert = Finding(VIOLATION, trace.steps[-2]["i"], "load_back", "crash", "TypeError", {},
                        ("upstream",))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             at_insert) is None


def test_upstream_leaves_a_device_leaf_out_of_its_set_after_an_unlock_through_an_evicted_node():
    """docs/SPEC.md, "HiCache", the shared defects (found by conform spec,upstream on
    sessions-host-swa-p1, seed 2030): after the unlock of a lock taken on an evicted node, the
    device node above it, now unlocked and with only evicted children, is a device leaf; the
    spec and fast list it, 0.5.13.post1 does not (its Full release re-checks the node while SWA
    still holds its lock).  A lock taken on that node itself leaves it listed on both sides."""
    trace = load_trace(os.path.join(REGRESSIONS_HOST_AUX,
                                    "upstream-leaf-left-out-after-unlock-host-swa-p1.jsonl"))
    leaf = {"tokens": [1], "extra_key": None}

    def leaves(impl, steps):
        a = make_adapter(impl, trace.config)
        for s in steps:
            a.apply({k: v for k, v in s.items() if k != "ret"})
        return a.snapshot()["device_leaf_order"]

    assert leaf in leaves("spec", trace.steps) and leaf in leaves("fast", trace.steps)
    assert leaf not in leaves("upstream", trace.steps)
    direct = [dict(s, args={"node": leaf}) if s["op"] == "lock" else s for s in trace.steps]
    assert leaf in leaves("upstream", direct) and leaf in leaves("spec", direct)


def test_upstream_leaves_a_device_leaf_out_of_its_set_after_a_load_back_that_gave_up():
    """The same shared defect through a load back (found by conform spec,upstream on
    host-swa-wt-p1, seed 2035): the load back of ``[3, 2, 3]`` locks ``[3, 2]`` above the
    evicted node, finds no SWA slots for its window and releases the lock.  Before it, both
    sides list ``[3, 2]`` as a device leaf; after it the spec and fast still do, 0.5.13.post1
    does not, and its own sanity check then fails, a violation conform counts as documented."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import Lockstep
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX,
        "upstream-violation-host-swa-wt-p1-load-back-leaves-a-device-leaf-out.jsonl"))
    leaf = {"tokens": [3, 2], "extra_key": None}

    def leaves(impl, steps):
        a = make_adapter(impl, trace.config)
        for s in steps:
            a.apply({k: v for k, v in s.items() if k != "ret"})
        return a.snapshot()["device_leaf_order"]

    assert leaf in leaves("upstream", trace.steps[:-1]) and leaf in leaves("spec",
                                                                          trace.steps[:-1])
    assert leaf in leaves("spec", trace.steps) and leaf in leaves("fast", trace.steps)
    assert leaf not in leaves("upstream", trace.steps)
    ls = Lockstep([make_adapter("spec", trace.config), make_adapter("upstream", trace.config)],
                  ["spec", "upstream"], events=False)
    finding = None
    for step in trace.steps:
        _, finding = ls.check({k: v for k, v in step.items() if k != "ret"})
        if finding is not None:
            break
    assert finding is not None and finding.step == trace.steps[-1]["i"]
    said = conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             finding)
    assert said is not None and "load back that gave up" in said


def test_upstream_write_acks_release_takes_a_load_backs_swa_lock_after_a_split():
    """docs/SPEC.md, "SWA unlock skips the tombstones the lock skipped by node identity"
    (found by conform spec,upstream on host-swa-wt-p1, seed 2035): a write-through's lock
    skipped the SWA tombstone ``[1, 2, 2]``; a load back gives it SWA data and locks it, a match
    splits it at ``[1, 2]``, and the write's ack releases its lock.  The spec and fast keep the
    load's SWA lock on ``[1, 2]``; 0.5.13.post1 takes it off, so that SWA data is evictable
    while the load holds it.  Without the match that splits, upstream keeps it too."""
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX,
        "upstream-host-swa-wt-p1-write-ack-after-split-of-a-skipped-tombstone.jsonl"))
    steps = [s for s in trace.steps if s["op"] != "sizes"]
    upper = {"tokens": [1, 2], "extra_key": "a"}

    def swa_lock(impl, steps, path):
        a = make_adapter(impl, trace.config)
        for s in steps:
            a.apply({k: v for k, v in s.items() if k != "ret"})
        (node,) = [n for n in a.snapshot()["nodes"] if n["path"] == path]
        return node["swa"]["lock_ref"]

    assert swa_lock("spec", steps, upper) == 1 and swa_lock("fast", steps, upper) == 1
    assert swa_lock("upstream", steps, upper) == 0
    split = [k for k, s in enumerate(steps) if s["op"] == "match_prefix"][-1]
    unsplit = steps[:split] + steps[split + 1:]
    whole = {"tokens": [1, 2, 2], "extra_key": "a"}  # (not split: the loaded node is whole)
    assert swa_lock("upstream", unsplit, whole) == 1 and swa_lock("spec", unsplit, whole) == 1


def test_conform_stops_upstreams_hang_and_counts_it_as_documented():
    """With conform's step timeout, upstream's endless write-back SWA eviction (defect 1) is
    stopped and reported as a StepTimeout crash of upstream's at the evict, which conform
    counts as the documented difference; the run goes on instead of hanging."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import Lockstep, step_timeout
    trace = load_trace(os.path.join(REGRESSIONS_HOST_AUX,
                                    "upstream-hang-host-swa-wb-p1-evict-backup-fails.jsonl"))
    ls = Lockstep([make_adapter("spec", trace.config), make_adapter("upstream", trace.config)],
                  ["spec", "upstream"], events=False)
    finding = None
    with step_timeout(3):
        for step in trace.steps:
            _, finding = ls.check({k: v for k, v in step.items() if k != "ret"})
            if finding is not None:
                break
    assert finding is not None and finding.step == trace.steps[-1]["i"]
    assert finding.impls == ("upstream",) and finding.values["upstream"].startswith("StepTimeout")
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             finding) is not None


def test_upstream_fails_its_check_when_a_host_locks_window_takes_a_host_only_copy():
    """docs/SPEC.md, "Host locks": the host lock of a node whose own SWA data is on the device,
    with the node above it an SWA tombstone with a host copy inside the lock's window: upstream
    takes that copy out of its SWA host LRU list and its own sanity check fails; without the
    evict that made the tombstone it holds.  The spec and fast replay it clean."""
    from uniradix.conformance.traces.trace import Trace
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX,
        "upstream-violation-host-swa-wt-p1-host-lock-window-takes-a-host-only-copy.jsonl"))
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    div = replay_trace(trace, "upstream").divergence
    assert div is not None and div.step == trace.steps[-1]["i"] and "swa host LRU" in str(div)
    kept = [s for s in trace.steps if s["op"] != "evict"]
    assert replay_trace(Trace(trace.header, trace.config, kept), "upstream").divergence is None


def test_upstream_frees_a_host_locked_swa_copy_an_evict_left_host_only():
    """docs/SPEC.md, "Host locks" (conform spec,upstream, seed 2031): after the last evict
    0.5.13.post1's node below `[3, 3]` still counts its SWA host lock but has lost its SWA host
    copy (its slots went in the same evict's host SWA eviction); the spec and fast keep the
    copy.  Without the host lock upstream replays the steps as the spec does."""
    trace = load_trace(os.path.join(
        REGRESSIONS_HOST_AUX, "upstream-frees-a-host-locked-swa-copy-sessions-host-swa-p1.jsonl"))
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    div = replay_trace(trace, "upstream").divergence
    assert div is not None and div.step == trace.steps[-1]["i"] and div.field == "host_swa_freed"
    assert div.expected == [5, 6, 7, 8, 9, 10]  # the spec's: other host SWA copies
    assert div.actual == [1, 2, 3, 4, 5, 6, 7, 8]  # upstream's: 1-4 are the host-locked copy
    # the node it belonged to: host-locked with its SWA copy kept (spec), host-locked with the
    # copy gone (upstream)
    locked = {"tokens": [3, 3, 1, 1, 1, 2], "extra_key": "b"}
    spec_side, up = make_adapter("spec", trace.config), make_adapter("upstream", trace.config)
    for s in trace.steps:
        step = {k: v for k, v in s.items() if k != "ret"}
        spec_side.apply(step)
        up.apply(step)
    from uniradix.spec import cache as rules
    d = rules.find_node(spec_side.state, locked["tokens"], locked["extra_key"]).aux["swa"]
    assert d.value is None and d.host_value == (1, 2, 3, 4) and d.host_lock_ref == 1
    from sglang.srt.mem_cache.unified_cache_components.tree_component import ComponentType
    uswa = _upstream_node(up.cache, locked["tokens"]).component_data[ComponentType.SWA]
    assert uswa.host_value is None and uswa.host_lock_ref == 1
    unlocked = [s for s in trace.steps if s["op"] != "host_lock"]
    a, b = make_adapter("spec", trace.config), make_adapter("upstream", trace.config)
    for s in unlocked:
        step = {k: v for k, v in s.items() if k != "ret"}
        assert a.apply(step) == b.apply(step)


def _upstream_node(cache, tokens):
    """Upstream's node whose path is exactly ``tokens`` (one extra key per trace here)."""
    node, rest = cache.root_node, list(tokens)
    while rest:
        node = next(c for c in node.children.values()
                    if list(c.key.token_ids) == rest[:len(c.key.token_ids)])
        rest = rest[len(node.key.token_ids):]
    return node
