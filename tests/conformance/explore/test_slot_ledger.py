"""``fast-noledger`` and ``conform --slot-ledger``: the fast path built without its slot ledger
(``validate_slots=False``, as over sglang's allocators) so that the paths which decline under
the ledger (the one-component and host+aux inserts, Mamba's direct frees and evict in C) run in
lockstep with the spec; the scenario leaves out the one misuse only the ledger refuses."""

import dataclasses
import glob
import os
import random

import pytest

from conftest import CORPUS
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.env.kvcheck import kv_checked
from uniradix.conformance.explore.conform import (
    LEDGER_SEGMENTS,
    NAMED_CONFIGS,
    ConformUnsupported,
    ledger_off,
    run_conform,
    segment_phase,
    without_ledger,
)
from uniradix.conformance.explore.lockstep import Lockstep, impl_name
from uniradix.conformance.explore.machine import RandomChooser, Scenario, runner_checks_slots
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec.config import CacheConfig

HOST_MAMBA = sorted(glob.glob(os.path.join(CORPUS, "upstream-host-mamba", "host-mamba-w*-p1-*.jsonl")))


def test_the_noledger_adapter_builds_fast_without_its_ledger():
    config = load_trace(HOST_MAMBA[0]).config
    with_ledger = make_adapter("fast", config)
    without = make_adapter("fast-noledger", config)
    assert with_ledger.cache.validate_slots is True and with_ledger.checks_slots
    assert without.cache.validate_slots is False and not without.checks_slots
    assert without.capabilities.name == "fast-noledger"
    full = make_adapter("fast-noledger", CacheConfig(kv_slots=32))
    assert full.cache.validate_slots is False and not full.checks_slots


class _Counting:
    """The C core module with every call of ``name`` counted."""

    def __init__(self, core, name):
        self.core, self.name, self.calls = core, name, 0

    def __getattr__(self, attr):
        fn = getattr(self.core, attr)
        if attr != self.name:
            return fn

        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)
        return counted


def test_the_host_aux_insert_in_c_runs_only_without_the_ledger(monkeypatch):
    """The reason for ``fast-noledger``: with the ledger the C insert of a host tier with one
    aux component is never called (so a plain ``fast`` replay or lockstep never checks it)."""
    from uniradix.fast import host_aux
    if host_aux._core is None:
        pytest.skip("the C core is not built (UNIRADIX_PURE_PYTHON or no compiler)")
    trace = load_trace(HOST_MAMBA[0])
    calls = {}
    for impl in ("fast", "fast-noledger"):
        counter = _Counting(host_aux._core, "host_aux_insert")
        monkeypatch.setattr(host_aux, "_core", counter)
        result = replay_trace(trace, impl)
        assert result.divergence is None and result.unsupported is None, result.divergence
        calls[impl] = counter.calls
        monkeypatch.undo()
    assert calls["fast"] == 0 and calls["fast-noledger"] > 10, calls


def test_a_scenario_leaves_out_slots_outside_the_pool_without_a_ledger():
    config = CacheConfig(kv_slots=32)
    sc = Scenario(config, RandomChooser(random.Random(1)))
    sc.pages = [[4, 5, 6, 7]]
    assert "insert_slot_outside" in sc.invalid_kinds()
    sc.checks_slots = False
    assert "insert_slot_outside" not in sc.invalid_kinds() and "free_twice" in sc.invalid_kinds()
    assert runner_checks_slots(Lockstep.from_impls(["spec", "fast"], config))
    assert not runner_checks_slots(Lockstep.from_impls(["spec", "fast-noledger"], config))
    # the KV check's wrapper passes the adapter's declaration through
    assert not runner_checks_slots(Lockstep.from_impls(["spec", kv_checked("fast-noledger")],
                                                       config))


def test_without_ledger_swaps_fast_only_and_rewraps_the_kv_check():
    assert without_ledger("fast") == "fast-noledger"
    assert without_ledger("spec") == "spec" and without_ledger("upstream") == "upstream"
    wrapped = without_ledger(kv_checked("fast"))
    assert impl_name(wrapped) == "fast-noledger" and wrapped.kv_wrapped == "fast-noledger"
    spec_checked = kv_checked("spec")
    assert without_ledger(spec_checked) is spec_checked


def test_which_segments_drop_the_ledger():
    # --events even: the events-off (odd) phases alternate, starting without the ledger
    assert [p for p in range(8) if ledger_off("even", "alternate", p)] == [1, 5]
    assert [p for p in range(6) if ledger_off("off", "alternate", p)] == [1, 3, 5]
    assert not any(ledger_off("every", "on", p) for p in range(8))
    assert all(ledger_off("even", "off", p) for p in range(8))
    assert LEDGER_SEGMENTS == ("alternate", "on", "off")


def test_over_the_named_cycle_a_config_alternates_from_cycle_to_cycle():
    """With an even number of named configs, the segment's parity alone would give each config
    the same choice (events or not) in every cycle; the phase flips it each cycle."""
    n = len(NAMED_CONFIGS)
    for i in (0, 1, n - 1):
        assert segment_phase(None, i) % 2 != segment_phase(None, i + n) % 2
    assert segment_phase("full-p1", 7) == 7  # one config: the segment itself


@pytest.mark.parametrize("ledger, noledger", [("alternate", 20), ("on", 0), ("off", 80)])
def test_conform_runs_fast_noledger_on_the_segments_it_names(ledger, noledger):
    res = run_conform(["spec", "fast"], config="host-mamba-wt-p1", steps=80, segment_steps=20,
                      out=None, progress=False, log=[].append, ledger=ledger)
    assert res.divergences == 0 and res.violations == 0 and res.segments == 4
    assert res.noledger_steps == noledger


def test_the_ledger_option_is_checked():
    from uniradix.conformance.cli import build_parser

    with pytest.raises(ValueError, match="ledger must be one of"):
        run_conform(["spec", "fast"], config="full-p1", steps=1, out=None, progress=False,
                    ledger="sometimes")
    with pytest.raises(ConformUnsupported, match="none of the implementations is fast"):
        run_conform(["spec", "spec"], config="full-p1", steps=1, out=None, progress=False,
                    ledger="off")
    assert build_parser().parse_args(["conform"]).slot_ledger == "alternate"
    assert build_parser().parse_args(["conform", "--slot-ledger", "off"]).slot_ledger == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["conform", "--slot-ledger", "never"])


def test_exhaustive_search_leaves_the_ledger_misuses_out_without_a_ledger():
    """``check --exhaustive --impls spec,fast-noledger``: the steps only a slot ledger refuses
    (the tree's own slots inserted again, unallocated ones, a copy-on-write match into an
    unallocated state slot) are left out, and the Mamba universes (where Mamba's direct frees
    and its evict in C run only without the ledger) find nothing at their default depths."""
    from uniradix.conformance.explore import exhaustive as ex

    u = ex.UNIVERSES["mamba-cow-p1"]
    w = ex.World(u, nodes=[], node_slots=[], held=[], n_held=0, requests=[], free_slots=4)
    assert [t.label for t in ex.t_cow_invalid(u, w)] == ["invalid: cow with an unallocated state slot"]
    assert list(ex.t_cow_invalid(dataclasses.replace(u, ledger_misuse=False), w)) == []
    full = ex.UNIVERSES["full-p1"]
    labels = [t.label for t in ex.t_invalid(full, w)]
    assert "invalid: insert unallocated slots" in labels
    labels = [t.label for t in ex.t_invalid(dataclasses.replace(full, ledger_misuse=False), w)]
    assert "invalid: insert unallocated slots" not in labels and labels
    for name in ("full-p1", "mamba-cow-p1", "eagle-mamba-p1", "mamba-xbuf-p1", "mamba-xbuf-p2"):
        res = ex.explore(ex.UNIVERSES[name], ["spec", "fast-noledger"], progress=False)
        assert res.finding is None, f"{name}: {res.finding}\n{res.labels}"
        assert res.complete and res.states > 1
