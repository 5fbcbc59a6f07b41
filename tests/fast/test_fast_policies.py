"""Eviction policies on the fast path (fast/policies.py; the orders: spec/policies.py).

Each story runs on the spec and on fast side by side (same observations, same canonical
snapshot, which holds the device-leaf order, no invariant violated) and checks the order
against what the policy says, worked out by hand.  Then: which tree a policy builds (any
other policy than lru moves a Full-only cache to the composed tree; lru in any case stays on
the C core), refusals by name, and the golden corpus recorded from upstream under each policy
(tests/corpus/upstream-policies) replayed on fast."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from conftest import CORPUS
from corpus_checks import check_divergence, diverged_as_lru
from stories import Pair
from uniradix import fast
from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.fast import policies
from uniradix.fast.hybrid import HybridRadixCache
from uniradix.fast.structures import LazyHeap
from uniradix.spec.config import POLICIES
from uniradix.spec.world import PagedPool

OTHER = [p for p in POLICIES if p != "lru"]
POLICY_CORPUS = os.path.join(CORPUS, "upstream-policies")


class Both(Pair):
    """Spec and fast stepped together, Full only or hybrid (tests/stories.py ``Pair``)."""

    def order(self) -> list[int]:
        """The device-leaf eviction order, as the first token of each leaf's path."""
        return [p["tokens"][0] for p in self.fast.snapshot()["device_leaf_order"]]


def three_leaves(c: Both, priorities=(0, 0, 0)) -> None:
    """Leaves [1], [2], [3] (slots 1, 2, 3), inserted in that order."""
    for t, p in zip((1, 2, 3), priorities, strict=True):
        (s,) = c("alloc", n=1)["slots"]
        c("insert", tokens=[t], value=[s], priority=p)


def test_lru_and_mru_are_opposite_orders_of_access():
    for policy, expect in (("lru", [2, 3, 1]), ("mru", [1, 3, 2])):
        c = Both(kv_slots=16, eviction_policy=policy)
        three_leaves(c)
        c("match_prefix", tokens=[1])  # 1 is now the most recently used
        assert c.order() == expect, policy
        assert c("evict", num_tokens=1)["freed"] == [expect[0]]


def test_lfu_counts_insert_hits_not_matches():
    c = Both(kv_slots=16, eviction_policy="lfu")
    three_leaves(c)
    s = c("alloc", n=1)["slots"]
    c("insert", tokens=[1], value=s)  # a second hit on [1]; the duplicate slot goes back
    for _ in range(3):
        c("match_prefix", tokens=[2])  # matches are not hits
    # [2] and [3] have one hit each: the least recently used of them ([3]) goes first
    assert c.order() == [3, 2, 1]


def test_fifo_and_filo_follow_creation_whatever_the_access():
    for policy, expect in (("fifo", [1, 2, 3]), ("filo", [3, 2, 1])):
        c = Both(kv_slots=16, eviction_policy=policy)
        three_leaves(c)
        c("match_prefix", tokens=[1])
        c("match_prefix", tokens=[3])
        assert c.order() == expect, policy


def test_fifo_a_split_keeps_the_creation_of_the_data():
    c = Both(kv_slots=16, eviction_policy="fifo")
    c("insert", tokens=[1, 2], value=c("alloc", n=2)["slots"])
    c("insert", tokens=[5], value=c("alloc", n=1)["slots"])
    # [1, 2] splits at [1]; the new leaf [1, 9] is newer than everything, [1]->[2] keeps its age
    c("insert", tokens=[1, 9], value=c("alloc", n=2)["slots"])
    assert [p["tokens"] for p in c.fast.snapshot()["device_leaf_order"]] == [[1, 2], [5], [1, 9]]


def test_priority_orders_by_priority_then_access_and_keeps_the_maximum():
    c = Both(kv_slots=16, eviction_policy="priority")
    three_leaves(c, priorities=(2, 0, 1))
    assert c.order() == [2, 3, 1]
    # an overlapping insert with a lower priority leaves [1] at 2; a higher one lifts [2]
    c("insert", tokens=[1], value=c("alloc", n=1)["slots"], priority=-5)
    c("insert", tokens=[2], value=c("alloc", n=1)["slots"], priority=7)
    assert c.order() == [3, 1, 2]
    # a split carries the priority to the upper node: [2] -> [2, 4] under priority 7
    c("insert", tokens=[2, 4], value=c("alloc", n=2)["slots"], prev_prefix_len=1, priority=0)
    prios = {tuple(n["path"]["tokens"]): n["priority"] for n in c.fast.snapshot()["nodes"]}
    assert prios[(2,)] == 7 and prios[(2, 4)] == 0


def test_slru_protects_leaves_with_two_hits():
    c = Both(kv_slots=16, eviction_policy="slru")
    three_leaves(c)
    c("insert", tokens=[1], value=c("alloc", n=1)["slots"])  # [1]: 2 hits, protected
    c("match_prefix", tokens=[2])
    assert c.order() == [3, 2, 1]


@pytest.mark.parametrize("policy", OTHER)
def test_a_request_gives_its_priority_and_hits_to_the_tree(policy):
    c = Both(kv_slots=32, eviction_policy=policy)
    c("req_arrive", rid="a", tokens=[1, 2, 3, 4], priority=3)
    c("req_admit", rid="a")
    c("req_chunk", rid="a", n=4, chunked=False)
    c("req_finish", rid="a")
    c("req_arrive", rid="b", tokens=[7, 8], priority=-1)
    c("req_admit", rid="b")
    c("req_chunk", rid="b", n=2, chunked=False)
    c("req_finish", rid="b")
    assert c("evict", num_tokens=1)["num_tokens_evicted"] > 0


@pytest.mark.parametrize("policy", OTHER)
def test_the_policy_orders_full_eviction_in_front_of_the_aux_lru_lists(policy):
    """Hybrid models: the Full driver follows the policy, the SWA list stays LRU."""
    c = Both(components=("full", "swa"), kv_slots=32, swa_slots=32, sliding_window=4,
             eviction_policy=policy)
    for t, p in ((1, 1), (2, 0), (3, 2)):
        s = c("alloc", n=2)["slots"]
        c("insert", tokens=[t, t], value=s, priority=p)
    c("match_prefix", tokens=[1, 1])
    c("evict", num_tokens=2, swa_num_tokens=2)
    c("evict", num_tokens=0, swa_num_tokens=2)


@pytest.mark.parametrize("policy", OTHER)
def test_the_policy_orders_host_leaves_too(policy):
    c = Both(kv_slots=16, host_slots=32, write_policy="write_through", eviction_policy=policy)
    three_leaves(c, priorities=(1, 0, 2))
    c("match_prefix", tokens=[2])
    c("evict", num_tokens=3)  # every leaf to the host (written through on its first hit)
    c("evict_host", num_tokens=1)


def test_spec_vs_fast_machine_under_the_policies():
    """The Hypothesis machine on Full, hybrid and host-tier configs under a drawn policy."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from uniradix.conformance.explore.machine import draw_policy_config, make_machine
    run_state_machine_as_test(
        make_machine(["spec", "fast"], draw=draw_policy_config, name="PolicyMachine"),
        settings=settings(max_examples=12, stateful_step_count=50, deadline=None,
                          database=None, suppress_health_check=list(HealthCheck)))


def test_keyed_heap_entries_go_stale_when_the_key_moves():
    """A ``KeyedHeap`` entry is live while the node's key is the entry's: a hit (LFU) makes
    the old entry stale without a new stamp; ``ordered`` and ``compact`` keep the live ones."""

    class N:
        def __init__(self, i, stamp):
            self.id, self.last_access_time, self.hit_count = i, stamp, 0

        def __lt__(self, other):
            return self.id < other.id

    a, b = N(1, 10), N(2, 20)
    h = policies.heap_for("lfu")
    assert isinstance(h, policies.KeyedHeap) and h.key_of is policies.lfu_key
    h.push(a.last_access_time, a)
    h.push(b.last_access_time, b)
    members = {id(a), id(b)}.__contains__
    assert h.ordered(lambda n: members(id(n))) == [a, b]
    a.hit_count = 1  # a's entry (0, 10) is stale now; its fresh one sorts after b
    h.push(a.last_access_time, a)
    assert h.ordered(lambda n: members(id(n))) == [b, a] and len(h) == 3
    h.compact(lambda n: members(id(n)))
    assert sorted(h.entries) == [((0, 20), b), ((1, 10), a)]
    assert h.live_ids(lambda n: n is a) == {id(a)}


@pytest.mark.parametrize("name", POLICIES)
def test_each_fast_key_orders_as_the_spec_key(name):
    """Over a small universe of node facts, the fast key (integer stamps) sorts nodes exactly
    as spec/policies.py's key (stamp pairs) does."""
    import itertools

    from uniradix.spec import policies as spec_policies

    class N:
        pass

    facts = []
    for i, (stamp, created, hits, prio) in enumerate(itertools.product(
            (1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (-1, 0, 2))):
        if created > stamp:
            continue
        n = N()
        n.last_access_time, n.created, n.hit_count, n.priority = stamp * 10 + i % 3, created, \
            hits, prio
        facts.append(n)
    fast_key = policies.KEYS.get(name, lambda n: n.last_access_time)
    spec_key = spec_policies.KEYS[name]

    def as_spec(n):
        return spec_policies.NodeFacts((n.last_access_time, 0), (n.created, 0), n.hit_count,
                                       n.priority)
    for x, y in itertools.combinations(facts, 2):
        assert (fast_key(x) < fast_key(y)) == (spec_key(as_spec(x)) < spec_key(as_spec(y)))


# ----------------------------------------------------------------------------------------------
# Which tree, refusals
# ----------------------------------------------------------------------------------------------


def params(**kw):
    p = fast.CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(),
                             token_to_kv_pool_allocator=PoolAllocator(
                                 PagedPool(64, 1, "kv"), torch, whole_pages=True),
                             page_size=1)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize("name", ["lru", "LRU", "Lru"])
def test_lru_in_any_case_stays_on_the_c_core(name):
    cache = fast.UnifiedRadixCache(params(eviction_policy=name))
    assert type(cache) is fast.UnifiedRadixCache


@pytest.mark.parametrize("name", OTHER + ["LFU", "Priority"])
def test_another_policy_moves_a_full_cache_to_the_composed_tree(name):
    cache = fast.UnifiedRadixCache(params(eviction_policy=name))
    assert isinstance(cache, HybridRadixCache) and cache.core == "python"
    assert cache.eviction_policy == name.lower()
    assert "eviction_policy" in cache.core_reason and name in cache.core_reason
    assert isinstance(cache._leaf_heap, policies.KeyedHeap)


def test_lru_hybrid_keeps_the_plain_stamp_heap_and_push():
    c = Both(components=("full", "swa"), kv_slots=16, swa_slots=16, sliding_window=4)
    cache = c.fast.cache
    assert type(cache._leaf_heap) is LazyHeap and "_push_if_leaf" not in vars(cache)


@pytest.mark.parametrize("bad", ["lfuu", "", "random", 3, None])
def test_an_unknown_policy_is_refused_by_name(bad):
    with pytest.raises(fast.Unsupported, match="eviction_policy"):
        fast.UnifiedRadixCache(params(eviction_policy=bad))


@pytest.mark.parametrize("policy", ["lfu", "priority"])
@pytest.mark.parametrize("bad", [True, 1.5, "2"])
def test_a_bad_insert_priority_is_refused_and_changes_nothing(policy, bad):
    cache = fast.UnifiedRadixCache(params(eviction_policy=policy))
    slots = cache.token_to_kv_pool_allocator.alloc(2)
    with pytest.raises(fast.InvalidInput, match="priority"):
        cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2]), value=slots, priority=bad))
    assert not cache.root_node.children and cache.violations() == []


def test_a_none_priority_reads_as_zero_as_upstream():
    cache = fast.UnifiedRadixCache(params(eviction_policy="priority"))
    slots = cache.token_to_kv_pool_allocator.alloc(2)
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2]), value=slots, priority=None))
    (leaf,) = cache.root_node.children.values()
    assert leaf.priority == 0


# ----------------------------------------------------------------------------------------------
# The golden corpus recorded from upstream under each policy
# ----------------------------------------------------------------------------------------------

POLICY_TRACES = sorted(glob.glob(os.path.join(POLICY_CORPUS, "*.jsonl")))
# by default: the first seed of full-p1 under every policy, and of each other config under two
# policies (a different two per config); every trace behind `slow`
_OTHER_CONFIGS = ("swa-w8-p1", "mamba-p1", "hicache-wt-p1", "hicache-wb-p1")
DEFAULT_NAMES = [f"full-p1-{p}-s001.jsonl" for p in OTHER] + [
    f"{cfg}-{OTHER[(2 * i + j) % len(OTHER)]}-s001.jsonl"
    for i, cfg in enumerate(_OTHER_CONFIGS) for j in (0, 1)]
DEFAULT_TRACES = [t for t in POLICY_TRACES if os.path.basename(t) in DEFAULT_NAMES]
SLOW_TRACES = [t for t in POLICY_TRACES if t not in DEFAULT_TRACES]


def test_the_policy_corpus_is_there():
    assert len(POLICY_TRACES) >= 200 and len(DEFAULT_TRACES) == len(DEFAULT_NAMES) == 14


@pytest.mark.parametrize("path", DEFAULT_TRACES, ids=os.path.basename)
def test_policy_corpus_replays_on_fast(path):
    trace = load_trace(path)
    result = replay_trace(trace, "fast")
    assert result.unsupported is None, result.unsupported
    check_divergence(path, trace, result)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW_TRACES, ids=os.path.basename)
def test_policy_corpus_replays_on_fast_slow(path):
    test_policy_corpus_replays_on_fast(path)


@pytest.mark.parametrize("policy", OTHER)
def test_fast_tells_the_policy_apart_from_lru(policy):
    """Replayed on fast as if recorded under lru, the policy's traces diverge: fast honours the
    setting (it does not order by LRU whatever it is told)."""
    mine = [t for t in POLICY_TRACES if os.path.basename(t).startswith(f"full-p1-{policy}-s")][:3]
    diverged = diverged_as_lru(mine, "fast")
    assert diverged >= 2, f"{policy}: only {diverged} of {len(mine)} traces diverge under lru"
