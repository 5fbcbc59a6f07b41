"""``uniradix check --exhaustive`` over the eviction policies, Mamba copy-on-write and streaming
sessions (conformance/explore/exhaustive.py; docs/CHECKS.md).

The named universes run in the default suite (tests/conformance/explore/test_exhaustive.py);
here: a policy order planted wrong in the fast path is found with a shortest counterexample,
the new transitions reach what they are for (a copy-on-write match that must evict a state, a
session turn restored from its slot), the dedup key keeps apart what decides a policy's or a
session's future, and bad universes are refused by name.  The depth-3 runs are behind ``slow``.
"""

from __future__ import annotations

import pytest

from exhaustive_steps import after, assert_nothing_found, assert_refused
from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore import exhaustive as ex
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.fast import policies

NEW = ("lfu-p1", "slru-p1", "fifo-p1", "priority-p1", "mamba-cow-p1", "sessions-p1", "mru-p1",
       "filo-p1")
INSERTS = tuple(k for k in ex.OP_KINDS if k.name == "insert")


def test_the_new_universes_are_named_and_small():
    for name in NEW:
        u = ex.UNIVERSES[name]
        assert ex.parse_universe(name) is u
        assert ex.Universe.from_dict(u.to_dict()) == u  # a trace header's universe reads back
        assert u.depth == 2


@pytest.mark.parametrize("policy,key", [("lfu", lambda n: (0, n.last_access_time)),
                                        ("priority", lambda n: (0, n.last_access_time)),
                                        ("fifo", lambda n: (0, n.last_access_time)),
                                        ("mru", lambda n: (0, n.last_access_time)),
                                        ("filo", lambda n: (0, n.last_access_time))])
def test_a_policy_order_planted_wrong_is_found(monkeypatch, tmp_path, policy, key):
    """fast's heap key of ``policy`` made LRU's: inserts alone show it in the leaf order."""
    monkeypatch.setitem(policies.KEYS, policy, key)
    u = ex.Universe("planted", kv_slots=3, tokens=(1, 2), max_len=1, extra_keys=(None,),
                    invalid=False, eviction_policy=policy,
                    priorities=(1, 0) if policy == "priority" else ())
    res = ex.explore(u, ["spec", "fast"], depth=3, progress=False, kinds=INSERTS)
    assert res.finding is not None and res.labels is not None
    assert res.finding.kind == "divergence" and 2 <= len(res.labels) <= 3, res.labels
    path = ex.write_counterexample(str(tmp_path), u, ["spec", "fast"], res)
    trace = load_trace(path)
    assert trace.header["config"]["eviction_policy"] == policy
    assert replay_trace(trace, "spec").divergence is None
    monkeypatch.undo()
    assert replay_trace(trace, "fast").divergence is None


def test_a_session_turn_is_restored_from_its_slot():
    u = ex.UNIVERSES["sessions-p1"]
    spec, steps = after(u, ["turn r0 [1] None session s", "turn r0 [1, 2] None session s"])
    admits = [s for s in steps if s["op"] == "req_admit"]
    assert len(admits) == 2
    assert spec.state.sessions["s"].tokens == [1, 2]
    w = ex.World.of(u, spec)
    assert w.parked == {"s": ([1, 2], None)} and not w.busy
    labels = [t.label for t in ex.transitions(u, w)]
    assert "release_session s" in labels and "turn r0 [1, 2, 1] None session s" in labels
    assert "invalid: req_arrive r0 not continuing session s" in labels


def test_a_cow_match_on_an_empty_state_pool_evicts_one_state():
    u = ex.UNIVERSES["mamba-cow-p1"]
    spec, steps = after(u, ["insert [1] None", "insert [2] None", "match_prefix cow [1] None"])
    cow = steps[-1]
    assert cow["op"] == "match_prefix" and cow["args"]["cow_mamba"] is True
    obs = SpecAdapter(u.config())
    for s in steps[:-1]:
        obs.apply(s)
    ret = obs.apply(cow)
    assert ret["mamba_pool_idx"] is not None and ret["mamba_freed"], ret
    w = ex.World.of(u, spec)
    assert w.mamba_held == [ret["mamba_pool_idx"]]
    labels = [t.label for t in ex.transitions(u, w)]
    assert f"mamba_free {w.mamba_held[0]}" in labels
    assert not any(lab.startswith("match_prefix cow") and "slot" not in lab for lab in labels)


def test_key_keeps_the_creation_order_apart_under_fifo_only():
    """An inner node's creation order decides fifo's future once its children are gone, and
    the snapshot shows only the leaves': the key holds every node's under fifo and filo."""
    steps = [("alloc", {"n": 2}), ("insert", {"tokens": [1, 2], "value": [1, 2]}),
             ("alloc", {"n": 1}), ("insert", {"tokens": [1, 1], "value": [1, 3],
                                             "prev_prefix_len": 1})]
    for name, extra in (("fifo-p1", 1), ("lfu-p1", 0)):
        u = ex.UNIVERSES[name]
        ls = Lockstep.from_impls(["spec", "fast"], u.config())
        for k, (op, args) in enumerate(steps):
            ls.apply({"i": k, "op": op, "args": args})
        plain = ex.spec_fingerprint(ls.adapters[0])
        assert len(plain) == 6 + extra, name
        if extra:
            assert sorted(plain[-1]) == sorted(ex._pkey(None, p) for p in ((1,), (1, 2), (1, 1)))
            assert plain[-1][-1] == ex._pkey(None, (1, 1))  # created last


def test_key_holds_the_parked_sessions():
    u = ex.UNIVERSES["sessions-p1"]
    spec, _ = after(u, ["turn r0 [1] None session s"])
    fp = ex.spec_fingerprint(spec)
    assert fp[6][0][:3] == ("s", (1,), None) and fp[6][0][3] is not None


def test_bad_feature_universes_are_refused_by_name():
    assert_refused(
        ('{"base": "full-p1", "cow": true}', "cow needs the Mamba"),
        ('{"base": "full-p1", "sessions": ["s"]}', "sessions need requests"),
        ('{"base": "mamba-cow-p1", "requests": 1}', "tree-level API only"),
        ('{"base": "priority-p1", "priorities": ["high"]}', "priorities"),
        ('{"base": "priority-p1", "priorities": 3}', "must be a list"))
    assert_refused(('{"base": "full-p1", "eviction_policy": "random"}', "eviction_policy"),
                   error=Exception)


def test_eagle_keys_with_mamba_insert_bigrams_with_a_state():
    """eagle-mamba-p1: EAGLE bigram keys on Full + Mamba at tree level, spec and fast in
    lockstep on every step: [1, 2, 1] is 2 bigrams with a state; serving [1, 2, 2] matches
    nothing (the shared bigram's node would be a split with no state), evicts the old leaf
    and caches [1, 2, 2] with a fresh state over a stateless inner node [1, 2]."""
    u = ex.UNIVERSES["eagle-mamba-p1"]
    assert ex.parse_universe("eagle-mamba-p1") is u and u.depth == 1
    assert ex.Universe.from_dict(u.to_dict()) == u
    spec, steps = after(u, ["insert [1, 2, 1] None", "serve [1, 2, 2] None"])
    assert [s["op"] for s in steps].count("evict") == 1
    states = {tuple(n["path"]["tokens"]): n["mamba"]["value"] for n in spec.snapshot()["nodes"]}
    assert states == {(1, 2): None, (1, 2, 2): [1]}, states
    assert_refused(('{"base": "eagle-mamba-p1", "cow": true}', "EAGLE with requests or cow"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eagle_mamba_finds_nothing_at_depth_2():
    assert_nothing_found(("eagle-mamba-p1",), 2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_feature_universes_find_nothing_at_depth_3():
    """One level deeper than the default suite (docs/CHECKS.md has the numbers)."""
    assert_nothing_found(NEW, 3)
