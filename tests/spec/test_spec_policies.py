"""Eviction policies in the spec (spec/policies.py): one story per policy, the node facts the
policies read (creation, priority, hit counts), the config setting, and the golden corpus
recorded from upstream 0.5.13.post1 under each policy (tests/corpus/upstream-policies).

Stories run on page size 1 with no host tier.  Pool reminder: page 0 is reserved and allocation
is lowest-free-first, so the first insert of two tokens takes slots [1, 2].  Each story builds
a few leaves and reads the eviction order (``queries.device_eviction_order``), then evicts one
token and checks which leaf left: the order the policy states is the one evict follows.
"""

from __future__ import annotations

import glob
import itertools
import os

import pytest

from conftest import CORPUS
from corpus_checks import check_divergence, diverged_as_lru  # the known divergences (issue 18) expected
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec import cache as rules
from uniradix.spec import policies, queries
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError, InvalidInput, Unsupported
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import new_state

POLICY_CORPUS = os.path.join(CORPUS, "upstream-policies")
OTHER_POLICIES = ("lfu", "fifo", "mru", "filo", "priority", "slru")

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make(policy: str, **cfg):
    return new_state(CacheConfig(eviction_policy=policy, kv_slots=64, **cfg))


def put(state, tokens, priority=0, chunked=False):
    """Insert ``tokens`` with fresh slots (the duplicates are freed by the insert)."""
    slots = state.kv.alloc(len(tokens))
    rules.insert(state, tokens, None, slots, 0, chunked, priority=priority)
    assert sanity_check(state) == []


def hit(state, tokens):
    rules.match_prefix(state, tokens)
    assert sanity_check(state) == []


def order(state):
    return [list(n.path_units()) for n in queries.device_eviction_order(state)]


def evict_one(state):
    """Evict one token; the leaf that went (its path)."""
    before = {tuple(n.path_units()) for n in queries.device_leaves(state)}
    assert rules.evict(state, 1) > 0
    after = {tuple(n.path_units()) for n in queries.device_leaves(state)}
    (gone,) = [list(p) for p in before - after]
    assert sanity_check(state) == []
    return gone


def node(state, tokens):
    return rules.find_node(state, tokens, None)


# ----------------------------------------------------------------------------------------------
# One story per policy
# ----------------------------------------------------------------------------------------------


def test_lru_takes_the_least_recently_used_leaf():
    s = make("lru")
    put(s, [1, 2]), put(s, [3, 4]), put(s, [5, 6])
    hit(s, [1, 2])
    assert order(s) == [[3, 4], [5, 6], [1, 2]]
    assert evict_one(s) == [3, 4]


def test_lfu_takes_the_leaf_with_fewest_insert_hits_and_matches_do_not_count():
    s = make("lfu")
    put(s, [1, 2]), put(s, [1, 2])          # two hits, the older leaf
    put(s, [3, 4])                          # one hit, the newest
    for _ in range(3):
        hit(s, [3, 4])                      # matches are accesses, not hits
    assert (node(s, [1, 2]).hit_count, node(s, [3, 4]).hit_count) == (2, 1)
    assert order(s) == [[3, 4], [1, 2]]
    assert evict_one(s) == [3, 4]


def test_lfu_breaks_ties_by_last_access():
    s = make("lfu")
    put(s, [1, 2]), put(s, [3, 4])
    hit(s, [1, 2])
    assert order(s) == [[3, 4], [1, 2]]


def test_fifo_takes_the_oldest_creation_whatever_was_accessed_since():
    s = make("fifo")
    put(s, [1, 2]), put(s, [3, 4])
    hit(s, [1, 2])                          # LRU would now take [3, 4]
    assert order(s) == [[1, 2], [3, 4]]
    assert evict_one(s) == [1, 2]


def test_fifo_a_split_keeps_the_creation_of_the_data():
    s = make("fifo")
    put(s, [7, 8, 9, 10])
    put(s, [5])
    put(s, [7, 8, 11])                      # splits [7 8 | 9 10], new leaf [11]
    upper, lower = node(s, [7, 8]), node(s, [7, 8, 9, 10])
    assert upper.created == lower.created < node(s, [5]).created < node(s, [7, 8, 11]).created
    # the lower part was touched by the split, yet it is still the oldest data
    assert order(s) == [[7, 8, 9, 10], [5], [7, 8, 11]]


def test_mru_takes_the_most_recently_used_leaf():
    s = make("mru")
    put(s, [1, 2]), put(s, [3, 4]), put(s, [5, 6])
    hit(s, [1, 2])
    assert order(s) == [[1, 2], [5, 6], [3, 4]]
    assert evict_one(s) == [1, 2]


def test_filo_takes_the_newest_creation_whatever_was_accessed_since():
    s = make("filo")
    put(s, [1, 2]), put(s, [3, 4])
    hit(s, [1, 2])                          # MRU would now take [1, 2]
    assert order(s) == [[3, 4], [1, 2]]
    assert evict_one(s) == [3, 4]


def test_priority_takes_the_lowest_priority_then_the_least_recently_used():
    s = make("priority")
    put(s, [1, 2], priority=5), put(s, [3, 4], priority=1), put(s, [5, 6], priority=1)
    put(s, [7, 8], priority=-2)
    hit(s, [7, 8])
    assert order(s) == [[7, 8], [3, 4], [5, 6], [1, 2]]
    assert evict_one(s) == [7, 8]


def test_priority_an_overlapping_insert_keeps_the_maximum_and_a_split_carries_it_up():
    s = make("priority")
    put(s, [1, 2, 3, 4], priority=3)
    put(s, [1, 2, 5], priority=7)           # splits [1 2 | 3 4]: upper 3 -> max(3, 7)
    assert [node(s, p).priority for p in ([1, 2], [1, 2, 3, 4], [1, 2, 5])] == [7, 3, 7]
    put(s, [1, 2, 5], priority=2)           # a lower priority never lowers one
    assert node(s, [1, 2, 5]).priority == 7
    hit(s, [1, 2, 3])                       # a match splits [3 | 4]: the upper takes 3
    assert node(s, [1, 2, 3]).priority == 3
    prios = {tuple(n["path"]["tokens"]): n["priority"] for n in snapshot(s)["nodes"]}
    assert prios == {(1, 2): 7, (1, 2, 3): 3, (1, 2, 3, 4): 3, (1, 2, 5): 7}


def test_slru_protects_leaves_with_two_hits_and_is_lru_within_each_segment():
    s = make("slru")
    put(s, [1, 2]), put(s, [1, 2]), put(s, [1, 2])   # 3 hits: protected, oldest
    put(s, [3, 4]), put(s, [3, 4])                   # 2 hits: protected
    put(s, [5, 6])                                   # 1 hit: probationary, newest
    assert order(s) == [[5, 6], [1, 2], [3, 4]]
    assert evict_one(s) == [5, 6]
    # LFU would take [3, 4] (fewer hits) before [1, 2]; SLRU does not count past the threshold
    s2 = make("lfu")
    put(s2, [1, 2]), put(s2, [1, 2]), put(s2, [1, 2]), put(s2, [3, 4]), put(s2, [3, 4])
    assert order(s2) == [[3, 4], [1, 2]]


def test_policy_orders_full_eviction_in_hybrid_models_too():
    s = new_state(CacheConfig(eviction_policy="mru", kv_slots=64, components=["full", "mamba"],
                              mamba_slots=8))
    for toks in ([1, 2], [3, 4]):
        slots = s.kv.alloc(2)
        rules.insert(s, toks, None, slots, 0, False, mamba_value=s.mamba.alloc(1))
    assert order(s) == [[3, 4], [1, 2]]
    from uniradix.spec import components
    components.evict(s, 1)
    assert [list(n.path_units()) for n in queries.device_leaves(s)] == [[1, 2]]
    assert sanity_check(s) == []


# ----------------------------------------------------------------------------------------------
# Hit counts: the seed's rule under lru, 0.5.13.post1's under every other policy
# ----------------------------------------------------------------------------------------------


def test_lru_without_a_host_tier_counts_no_hits_as_the_seed():
    s = make("lru")
    put(s, [1, 2, 3, 4]), put(s, [1, 2, 3, 4]), put(s, [1, 2, 9])
    assert all(n["hit_count"] == 0 for n in snapshot(s)["nodes"])
    assert "priority" not in snapshot(s)["nodes"][0]


def test_other_policies_count_hits_without_a_host_tier_and_copy_them_on_a_split():
    s = make("lfu")
    put(s, [1, 2, 3, 4]), put(s, [1, 2, 3, 4])      # 2 hits
    put(s, [1, 2, 9])                               # split: upper copies 2, then +1
    put(s, [1, 2, 9, 9], chunked=True)              # chunked inserts count nothing
    counts = {tuple(n["path"]["tokens"]): n["hit_count"] for n in snapshot(s)["nodes"]}
    assert counts == {(1, 2): 3, (1, 2, 3, 4): 2, (1, 2, 9): 1, (1, 2, 9, 9): 0}


# ----------------------------------------------------------------------------------------------
# The setting and the inputs
# ----------------------------------------------------------------------------------------------


def test_every_policy_is_a_config_setting_and_lru_is_the_default():
    assert CacheConfig().eviction_policy == "lru"
    assert "eviction_policy" not in CacheConfig().to_dict()      # old headers stay as they were
    for p in policies.POLICIES:
        cfg = CacheConfig.from_dict({"eviction_policy": p})
        assert CacheConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("bad", ["arc", "LRU", ""])
def test_an_unknown_policy_is_unsupported_by_name(bad):
    with pytest.raises(Unsupported, match="eviction_policy"):
        CacheConfig.from_dict({"eviction_policy": bad})


def test_a_policy_that_is_not_a_string_is_a_config_error():
    with pytest.raises(ConfigError, match="eviction_policy"):
        CacheConfig.from_dict({"eviction_policy": 3})


@pytest.mark.parametrize("bad", [True, 1.5, "3", None])
def test_a_bad_insert_priority_is_rejected_and_changes_nothing(bad):
    s = make("priority")
    put(s, [1, 2], priority=1)
    before = snapshot(s)
    slots = s.kv.alloc(2)
    with pytest.raises(InvalidInput, match="priority"):
        rules.insert(s, [1, 2, 3, 4], None, [*node(s, [1, 2]).value, *slots], 2,
                     priority=bad)
    s.kv.free(slots)
    assert snapshot(s) == before


def test_a_request_gives_its_priority_to_its_inserts():
    a = make_adapter("spec", CacheConfig(eviction_policy="priority", kv_slots=64))
    for step in ({"op": "req_arrive", "args": {"rid": "r", "tokens": [1, 2, 3, 4, 5],
                                                "priority": 4}},
                 {"op": "req_admit", "args": {"rid": "r"}},
                 {"op": "req_chunk", "args": {"rid": "r", "n": 5}},
                 {"op": "req_finish", "args": {"rid": "r"}},
                 {"op": "req_arrive", "args": {"rid": "q", "tokens": [1], "priority": "high"}}):
        obs = a.apply(step)
    assert obs["error"] == "InvalidInput"
    assert [n["priority"] for n in a.snapshot()["nodes"]] == [4]


# ----------------------------------------------------------------------------------------------
# The pure helpers' PEP 316 contracts, checked over a small universe of node facts
# ----------------------------------------------------------------------------------------------

STAMPS = [(1, 0), (2, -1), (2, 0), (5, 0)]
UNIVERSE = [policies.NodeFacts(st, cr, h, p)
            for st, cr, h, p in itertools.product(STAMPS, STAMPS, (0, 1, 2, 3), (-1, 0, 2))]


def contract(fn, kind):
    return [ln.strip()[len(kind) + 1:].strip() for ln in (fn.__doc__ or "").splitlines()
            if ln.strip().startswith(kind + ":")]


@pytest.mark.parametrize("name", sorted(policies.KEYS))
def test_key_contracts_hold(name):
    fn = policies.KEYS[name]
    posts = contract(fn, "post")
    assert posts, f"{name} states no contract"
    scope = dict(vars(policies))
    for f in UNIVERSE:
        ret = fn(f)
        for post in posts:
            assert eval(post, scope, {"f": f, "__return__": ret}), (name, f, post)  # noqa: S307


def test_helper_contracts_hold():
    scope = dict(vars(policies))
    for st in STAMPS:
        for post in contract(policies.newest_first, "post"):
            assert eval(post, scope, {"stamp": st, "__return__": policies.newest_first(st)})
    for h in range(5):
        for post in contract(policies.slru_segment, "post"):
            assert eval(post, scope, {"hit_count": h, "__return__": policies.slru_segment(h)})
    for a, b in itertools.product(range(-2, 3), repeat=2):
        for post in contract(policies.higher_priority, "post"):
            assert eval(post, scope, {"a": a, "b": b, "__return__": policies.higher_priority(a, b)})


def test_every_key_orders_distinct_stamps_without_ties():
    """Keys end with the stamp, so no two nodes with different stamps ever tie."""
    for fn in policies.KEYS.values():
        for f, g in itertools.combinations(UNIVERSE, 2):
            if f.stamp != g.stamp:
                assert fn(f) != fn(g)


# ----------------------------------------------------------------------------------------------
# The golden corpus recorded from upstream under each policy
# ----------------------------------------------------------------------------------------------

POLICY_TRACES = sorted(glob.glob(os.path.join(POLICY_CORPUS, "*.jsonl")))


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_policy_corpus_is_there(policy):
    mine = [t for t in POLICY_TRACES if os.path.basename(t).startswith(f"full-p1-{policy}-s")]
    assert len(mine) >= 20, f"{policy}: {len(mine)} full-p1 traces"
    for t in mine:
        trace = load_trace(t)
        assert trace.config.eviction_policy == policy and len(trace.steps) >= 300, t


@pytest.mark.parametrize("path", POLICY_TRACES,
                         ids=[os.path.basename(t) for t in POLICY_TRACES])
def test_policy_corpus_replays_on_the_spec(path):
    trace = load_trace(path)
    result = replay_trace(trace, "spec")
    assert result.unsupported is None, result.unsupported
    check_divergence(path, trace, result)


@pytest.mark.parametrize("policy", OTHER_POLICIES)
def test_the_corpus_tells_the_policy_apart_from_lru(policy):
    """Replayed as if it were recorded under lru, most traces of a policy diverge: the
    corpus pins the order, not just the tree rules."""
    mine = [t for t in POLICY_TRACES if os.path.basename(t).startswith(f"full-p1-{policy}-s")][:5]
    diverged = diverged_as_lru(mine, "spec")
    assert diverged >= 4, f"{policy}: only {diverged} of {len(mine)} traces diverge under lru"


# ----------------------------------------------------------------------------------------------
# The random scenario machine and conform under a policy
# ----------------------------------------------------------------------------------------------


def test_the_machine_gives_inserts_priorities_under_a_policy_and_stays_sound():
    from uniradix.conformance.explore.lockstep import Lockstep
    from uniradix.conformance.explore.machine import random_segment
    cfg = CacheConfig(kv_slots=48, eviction_policy="priority")
    steps, finding = random_segment(Lockstep.from_impls(["spec", "spec"], cfg), cfg, 3, 800)
    assert finding is None
    prios = {s["args"]["priority"] for s in steps
             if s["op"] == "insert" and "priority" in s["args"]}
    assert len(prios) >= 3 and prios <= {-1, 0, 1, 2, 3}
    lru = CacheConfig(kv_slots=48)
    steps, _ = random_segment(Lockstep.from_impls(["spec", "spec"], lru), lru, 3, 300)
    assert not any("priority" in s["args"] for s in steps if s["op"] == "insert")


def test_conform_takes_a_policy_for_every_segment(capsys):
    from uniradix.conformance.cli import main
    assert main(["conform", "--impls", "spec,spec", "--policy", "mru", "--steps", "600",
                 "--config", "full-p2", "--no-progress"]) == 0
    assert "600 steps, 0 divergences" in capsys.readouterr().out
    # fast honours the policies (fast/policies.py; its corpus replay: tests/fast/test_fast_policies.py)
    assert main(["conform", "--impls", "spec,fast", "--policy", "lfu", "--steps", "300",
                 "--config", "full-p1", "--no-progress"]) == 0
    assert "300 steps, 0 divergences" in capsys.readouterr().out
