"""Mamba copy-on-write in the spec (spec/mamba_cow.py): ``match_prefix {cow_mamba: true}`` for a
request, as stories through the trace ops.

Every step checks the spec's invariants afterwards and, for a rejected step, that nothing
changed.  Pools: page 0 is reserved, lowest-free-first; the Mamba pool holds ``mamba_slots``
states numbered from 1.
"""

from __future__ import annotations

import glob
import os

import pytest

import stories
from conftest import CORPUS
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace


class Story(stories.Story):
    def __init__(self, impl: str = "spec", **cfg) -> None:
        base = dict(components=["full", "mamba"], kv_slots=64, mamba_slots=3,
                    mamba_cache_chunk_size=4)
        base.update(cfg)
        super().__init__(impl, **base)

    def cache(self, tokens: list) -> int:
        """Insert ``tokens`` with fresh KV slots and a fresh state; the state slot."""
        slots = self.step("alloc", n=len(tokens))["slots"]
        state = self.step("mamba_alloc", n=1)["slots"][0]
        ret = self.step("insert", tokens=tokens, value=slots, mamba_value=[state])
        assert ret["mamba_exist"] is False
        return state

    def cow(self, tokens: list, mamba_slot=None) -> dict:
        return self.step("match_prefix", tokens=tokens, cow_mamba=True, mamba_slot=mamba_slot)


class BothStory(stories.SpecAndFast):
    """:class:`Story`'s steps on the spec and fast in lockstep (observations and snapshots
    must agree after every step); ``a`` is the spec's adapter, as in :class:`Story`."""

    cache = Story.cache
    cow = Story.cow

    def __init__(self, **cfg) -> None:
        from uniradix.spec.config import CacheConfig
        base = dict(components=("full", "mamba"), kv_slots=64, mamba_slots=3,
                    mamba_cache_chunk_size=4)
        base.update(cfg)
        if isinstance(base["components"], list):
            base["components"] = tuple(base["components"])
        super().__init__(CacheConfig(**base))


@pytest.fixture(params=["spec", "spec+fast"])
def make(request):
    """The stories below on the spec alone, and on the spec and fast in lockstep."""
    if request.param == "spec":
        return Story
    pytest.importorskip("torch")
    return BothStory


def pick(obs: dict, *names: str) -> tuple:
    return tuple(obs[n] for n in names)


def test_a_match_for_a_request_gives_it_a_fresh_slot_and_the_state_to_copy(make):
    s = make()
    assert s.cache([1, 2, 3, 4]) == 1
    obs = s.cow([1, 2, 3, 4, 5])
    assert pick(obs, "last_device_node", "mamba_cow_src", "mamba_pool_idx") == (4, 1, 2)
    assert pick(obs, "freed", "mamba_freed") == ([], [])
    # the request owns state 2 now: the pool says so, the tree does not hold it
    assert s.step("mamba_free", slots=[2]) == {}


def test_a_request_that_has_a_slot_keeps_it(make):
    s = make()
    s.cache([1, 2, 3, 4])
    mine = s.step("mamba_alloc", n=1)["slots"][0]
    obs = s.cow([1, 2, 3, 4], mamba_slot=mine)
    assert pick(obs, "mamba_cow_src", "mamba_pool_idx") == (1, mine)
    assert s.step("mamba_alloc", n=1)["slots"] == [3]   # nothing else was taken


def test_an_empty_pool_evicts_one_state_but_never_the_one_to_copy(make):
    s = make()
    s.cache([1, 2]), s.cache([5, 6]), s.cache([7, 8])     # states 1, 2, 3: the pool is full
    obs = s.cow([1, 2, 9])                                # [1 2] is matched, newest now
    # the oldest unlocked state is [5 6]'s: a device leaf, evicted whole (KV slots 3, 4)
    assert pick(obs, "mamba_cow_src", "mamba_pool_idx", "freed", "mamba_freed") == \
        (1, 2, [3, 4], [2])
    paths = [n["path"]["tokens"] for n in s.a.snapshot()["nodes"]]
    assert paths == [[1, 2], [7, 8]]
    assert all(n["lock_ref"] == 0 for n in s.a.snapshot()["nodes"])  # the lock was temporary


def test_when_every_state_is_locked_the_request_gets_no_slot(make):
    s = make(mamba_slots=1)
    s.cache([1, 2])
    s.step("lock", node={"tokens": [1, 2], "extra_key": None})
    obs = s.cow([1, 2])
    assert pick(obs, "mamba_cow_src", "mamba_pool_idx", "freed", "mamba_freed") == \
        (1, None, [], [])


def test_a_match_without_a_state_copies_nothing_and_takes_no_slot(make):
    s = make()
    s.cache([1, 2, 3, 4])
    obs = s.cow([9, 9])
    assert pick(obs, "best_match_node", "mamba_cow_src", "mamba_pool_idx") == (0, None, None)
    s.step("match_prefix", tokens=[1, 2])                 # splits [1 2 | 3 4]: no state above
    assert pick(s.cow([1, 2]), "mamba_cow_src", "mamba_pool_idx") == (None, None)


@pytest.mark.parametrize("args, why", [
    ({"cow_mamba": True, "mamba_slot": 1}, "the tree's"),
    ({"cow_mamba": True, "mamba_slot": 3}, "not allocated"),
    ({"cow_mamba": True, "mamba_slot": True}, "int"),
    ({"cow_mamba": False, "mamba_slot": 2}, "goes with cow_mamba"),
    ({"cow_mamba": 1}, "true or false"),
])
def test_bad_copy_on_write_arguments_are_rejected(make, args, why):
    s = make()
    s.cache([1, 2])
    s.step("mamba_alloc", n=1)                            # state 2: the caller's
    obs = s.step("match_prefix", tokens=[1, 2], **args)
    assert obs["error"] == "InvalidInput" and why in obs["message"]


def test_copy_on_write_needs_the_mamba_component():
    s = Story(components=["full"], mamba_slots=0)
    obs = s.step("match_prefix", tokens=[1], cow_mamba=True)
    assert obs["error"] == "InvalidInput" and "Mamba" in obs["message"]


def test_the_state_to_copy_is_locked_while_room_is_made():
    """Without the temporary lock the only unlocked state, the one to copy, would go."""
    s = Story(mamba_slots=2)
    s.cache([1, 2]), s.cache([5, 6])
    s.step("lock", node={"tokens": [5, 6], "extra_key": None})
    obs = s.cow([1, 2])
    assert pick(obs, "mamba_cow_src", "mamba_pool_idx", "mamba_freed") == (1, None, [])
    node = [n for n in s.a.snapshot()["nodes"] if n["path"]["tokens"] == [1, 2]][0]
    assert node["mamba"]["value"] == [1] and node["lock_ref"] == 0


# ----------------------------------------------------------------------------------------------
# The golden corpus recorded from upstream (tests/corpus/upstream-mamba-cow)
# ----------------------------------------------------------------------------------------------

COW_TRACES = sorted(glob.glob(os.path.join(CORPUS, "upstream-mamba-cow", "*.jsonl")))


def test_cow_corpus_is_there_and_makes_room():
    assert len(COW_TRACES) >= 20
    evicting = 0
    for path in COW_TRACES:
        trace = load_trace(path)
        assert len(trace.steps) >= 300, path
        evicting += sum(1 for s in trace.steps if s["args"].get("cow_mamba")
                        and s["ret"]["mamba_pool_idx"] is not None and s["ret"]["mamba_freed"])
    assert evicting >= 10


@pytest.mark.parametrize("path", COW_TRACES, ids=[os.path.basename(t) for t in COW_TRACES])
def test_cow_corpus_replays_on_the_spec(path):
    result = replay_trace(load_trace(path), "spec")
    assert result.unsupported is None and result.divergence is None, str(result.divergence)
