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


def test_upstream_sanity_check_fails_after_a_host_lock_of_host_only_aux_data():
    """docs/SPEC.md, "Host locks": after a host lock of a node whose Mamba state is on the host
    only (its device copy evicted), 0.5.13.post1's own sanity check fails (its Mamba host LRU
    list no longer holds the locked state); the spec and fast lock it soundly.  The conform run
    against upstream counts it as that documented difference, not a violation; a host lock of a
    node whose state is still on the device is no such difference, and upstream's check holds
    there."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    path = os.path.join(CORPUS, "regressions", "host-lock-host-only-mamba-state.jsonl")
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    lock_i = trace.steps[-1]["i"]
    assert trace.steps[-1]["op"] == "host_lock" and trace.steps[-2]["op"] == "evict"

    def upstream_violations(steps):
        up = make_adapter("upstream", trace.config)
        out = []
        for s in steps:
            up.apply({k: v for k, v in s.items() if k != "ret"})
            out.append(up.violations())
        return out

    found = upstream_violations(trace.steps)
    assert all(v == [] for v in found[:-1])
    assert any("mamba host LRU" in line for line in found[-1]), found[-1]
    finding = Finding(VIOLATION, lock_i, "host_lock", "violations", "", {"upstream": found[-1]},
                      ("upstream",))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             finding) is not None
    # without the evict the state is still on the device: upstream's check holds, no rule
    kept = [s for s in trace.steps if s["op"] != "evict"]
    assert upstream_violations(kept)[-1] == []
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, kept,
                                             finding) is None
    # a violation of the spec's own invariants is never excused
    spec_side = Finding(VIOLATION, lock_i, "host_lock", "violations", "", {"spec": ["x"]},
                        ("spec",))
    assert conform_mod.documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                             spec_side) is None
