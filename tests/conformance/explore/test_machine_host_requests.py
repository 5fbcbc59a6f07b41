"""The request path with a host tier in the lockstep scenarios (issue 12 item 5): with a host
tier the scheduler matches a request's prompt and loads a host hit back before admitting it
(conformance/explore/machine.py ``Scenario._p_req_admit``, by the recording driver's rules
in conformance/explore/driver.py), and the request-level ops run on Full, host+SWA and
host+Mamba configs, spec against fast."""

import os
import random

import pytest

from conftest import CORPUS
from machine_runs import run_machine
from uniradix.conformance.explore.driver import load_back_args, load_back_wanted
from uniradix.conformance.explore.machine import (
    ACTIONS,
    RandomChooser,
    Scenario,
    draw_host_aux_config,
)


def test_load_back_rules_draw_nothing_without_a_host_hit():
    rng = random.Random(1)
    state = rng.getstate()
    assert not load_back_wanted(rng, 4, 4) and not load_back_wanted(rng, 2, 4)
    assert rng.getstate() == state
    args = load_back_args(random.Random(3), [1, 2, 3, 4], "a", 3, 1)
    assert args["node"] == {"tokens": [1, 2, 3], "extra_key": "a"}
    assert args["last_device_node"] == {"tokens": [1], "extra_key": "a"}
    assert args["mem_quota"] is None or 0 <= args["mem_quota"] <= 6


def _run(name: str, seed: int, steps: int, snapshot_every: int = 1) -> list:
    """conform's random stepping (``random_segment``) on a named config, spec against fast,
    keeping each step's observation (the spec's)."""
    from uniradix.conformance.explore.conform import segment_config
    from uniradix.conformance.explore.lockstep import Lockstep
    _, cfg = segment_config(name, seed, 0)
    ls = Lockstep.from_impls(["spec", "fast"], cfg, snapshot_every=snapshot_every)
    rng = random.Random(f"host-req:{seed}")
    ch = RandomChooser(rng)
    sc = Scenario(cfg, ch, actions=ACTIONS)
    ls.prime()
    out: list = []
    while len(out) < steps:
        step = sc.propose(sc.next_action(rng), ch)
        if step is None:
            continue
        step = {"i": len(out), **step}
        obs, finding = ls.check(step)
        assert finding is None, str(finding)
        sc.observe(step, obs)
        out.append((step, obs))
    return out


@pytest.mark.parametrize("name", ["hicache-wt-p1", "host-swa-wb-p4", "host-mamba-wt-p1"])
def test_requests_are_admitted_after_loading_their_host_hit_back(name):
    """On host configs the request path runs, spec against fast, and a request whose prompt
    has a host hit is matched, loaded back and admitted in three steps: its admission's
    prefix covers what the load back put on the device."""
    loaded = 0
    ops: set = set()
    # (with Mamba a host hit at admission is rare: a match ends at a node with a state; the
    # seeds go on until one loads, up to a bound, so a change of the random stream does not
    # turn this test off)
    for seed in range(1, 41):
        if seed > 2 and loaded:
            break
        run = _run(name, seed, 300, snapshot_every=20)
        ops.update(step["op"] for step, _ in run)
        for (m, mo), (lb, lo), (ad, ao) in zip(run, run[1:], run[2:], strict=False):
            if not (m["op"] == "match_prefix" and lb["op"] == "load_back"
                    and ad["op"] == "req_admit"):
                continue
            assert lb["args"]["node"]["tokens"] == m["args"]["tokens"][:mo["best_match_node"]]
            if lo["device_indices"] and "error" not in ao:
                loaded += 1
                assert ao["prefix_len"] >= len(mo["device_indices"]) + len(lo["device_indices"])
    assert {"req_admit", "req_chunk", "req_decode", "req_finish", "load_back"} <= ops
    assert loaded > 0


def test_a_waiting_requests_load_back_gives_it_the_state_slot_its_admission_keeps():
    """The admission's load back names the request (``load_back {rid}``, SGLang's
    ``init_load_back(req=req)``): with Mamba a loaded host-only state goes into a fresh slot
    that becomes the request's; its admission keeps that slot rather than taking another, and
    an abort while it still waits frees it.  Spec against fast; the seeds go on until a load
    back gives a slot, up to a bound; the abort is that run's prefix with the abort in place
    of the admission."""
    from uniradix.conformance.explore.conform import segment_config
    from uniradix.conformance.explore.lockstep import Lockstep
    kept, prefix, cfg = 0, None, None
    for seed in range(1, 41):
        if kept > 1:
            break
        held: dict = {}  # rid -> the state slot its load back gave it
        run = _run("host-mamba-wt-p1", seed, 400, snapshot_every=25)
        for k, (step, obs) in enumerate(run):
            op, args = step["op"], step["args"]
            if "error" in obs:
                continue
            if op == "load_back" and args.get("rid") is not None:
                assert "mamba_slot" not in args
                if obs["mamba_pool_idx"] is not None:
                    assert held.get(args["rid"], obs["mamba_pool_idx"]) == obs["mamba_pool_idx"]
                    held[args["rid"]] = obs["mamba_pool_idx"]
            elif op == "req_admit" and args["rid"] in held:
                slot = held.pop(args["rid"])
                assert obs["mamba_pool_idx"] == slot and slot not in obs["mamba_freed"]
                kept += 1
                if prefix is None:  # the steps up to its load back, then the abort
                    prefix = [s for s, _ in run[:k]] + [
                        {"i": k, "op": "req_abort", "args": {"rid": args["rid"]}}]
                    cfg, abort_slot = segment_config("host-mamba-wt-p1", seed, 0)[1], slot
    assert kept > 0 and prefix is not None
    ls = Lockstep.from_impls(["spec", "fast"], cfg, snapshot_every=1)
    ls.prime()
    for step in prefix:
        obs, finding = ls.check(step)
        assert finding is None, str(finding)
    assert abort_slot in obs["mamba_freed"]


def test_hypothesis_machine_runs_requests_on_host_swa_and_mamba():
    """The Hypothesis machine on a host tier with SWA, Mamba or both, the request-level ops
    on (``actions``: the Scenario leaves them out for aux components by default).  (The
    Full host tier's machine, with request steps too: tests/fast/test_hicache.py.)"""
    run_machine(draw_host_aux_config, "HostAuxRequestMachine", examples=8, steps=50)


def test_host_aux_configs_drawn_are_valid_and_cover_each_component_set():
    seen = set()
    for seed in range(40):
        cfg = draw_host_aux_config(RandomChooser(random.Random(seed)))
        cfg.validate()
        assert cfg.has_host_tier
        seen.add(tuple(cfg.components))
    assert seen == {("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba")}


# findings of the request path with a host tier (tests/corpus/regressions-host-aux/README.md)
HOST_REQUEST_TRACES = [os.path.join(CORPUS, "regressions-host-aux", name) for name in (
    "conform-host-mamba-wt-p1-s1-request-chunk-backs-up-its-state-copy.jsonl",)]


@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("trace", HOST_REQUEST_TRACES, ids=os.path.basename)
def test_host_request_regressions_replay_with_the_kv_check(trace, impl, capsys):
    from uniradix.conformance.cli import main as cli_main
    assert cli_main(["replay", trace, "--impl", impl, "--check-kv"]) == 0


@pytest.mark.parametrize("name, aux", [("sessions-host-swa-p1", "swa"),
                                       ("sessions-host-mamba-p1", "mamba")])
def test_session_configs_with_a_host_tier_run_clean_spec_against_fast(name, aux):
    """Streaming sessions with a host tier and SWA or Mamba (conform's named configs): both
    write policies by segment, spec against fast clean."""
    from uniradix.conformance.explore.conform import SESSION_CONFIGS, run_conform, segment_config
    assert name in SESSION_CONFIGS
    policies = set()
    for seg in range(4):
        _, cfg = segment_config(name, 1, seg)
        assert cfg.has_host_tier and tuple(cfg.components) == ("full", aux)
        policies.add(cfg.write_policy)
    assert policies == {"write_through", "write_back"}
    res = run_conform(["spec", "fast"], steps=150, seed=2, config=name, out=None,
                      progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)


@pytest.mark.upstream
@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_upstream_still_fails_its_sanity_check_on_a_host_lock_of_an_evicted_leaf(aux):
    """Found by conform spec,upstream on host-swa-wt-p1 / host-mamba-wt-p1 (README in
    regressions-host-aux): 0.5.13.post1's own sanity check fails after the host lock (the
    aux host LRU lost the node); the spec and fast replay the traces clean
    (tests/conformance/traces/test_corpus_replay.py)."""
    from uniradix.conformance.adapters import upstream as upstream_mod
    from uniradix.conformance.traces.replay import replay_trace
    from uniradix.conformance.traces.trace import Trace, load_trace
    if not upstream_mod.upstream_available():
        pytest.skip("upstream sglang is not importable here (scripts/upstream-venv.sh)")
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        f"upstream-violation-host-{aux}-wt-p1-host-lock-of-an-evicted-leaf.jsonl"))
    div = replay_trace(trace, "upstream").divergence
    assert div is not None and div.step == trace.steps[-1]["i"]
    assert f"{aux} host LRU" in str(div)
    # conform against upstream ends a segment there (a documented difference), and only there:
    # without the evict the node's data is still on the device and upstream's check holds
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    finding = Finding(VIOLATION, div.step, "host_lock", "violations", "",
                      {"upstream": [str(div)]}, ("upstream",))
    assert documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                 finding) is not None
    kept = [s for s in trace.steps if s["op"] != "evict"]
    assert replay_trace(Trace(trace.header, trace.config, kept), "upstream").divergence is None
    assert documented_difference(["spec", "upstream"], trace.config, kept, finding) is None
    spec_side = Finding(VIOLATION, div.step, "host_lock", "violations", "", {"spec": ["x"]},
                        ("spec",))
    assert documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                 spec_side) is None
