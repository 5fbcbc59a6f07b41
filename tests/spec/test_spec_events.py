"""The spec's KV events (spec/events.py): hand-worked streams for each rule that changes what is
cached where, and the router's invariant as a checked property over recorded workloads: folding
the stream from the start gives exactly the cached pages per medium after every step."""

import pytest

from tests.stories import Story
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import Driver, make_config
from uniradix.conformance.traces.events import RouterCheck, event_source, events_differ
from uniradix.spec.errors import InvalidInput
from uniradix.spec.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventEmitter,
    canonical,
    from_wire,
    to_wire,
)
from uniradix.spec.pagekeys import block_hash, path_keys


class EventStory(Story):
    """A story whose every step also returns the spec's events (wire arrays)."""

    def __init__(self, check_router: bool = True, **cfg) -> None:
        super().__init__(**cfg)
        self.src = event_source(self.a)
        self.router = RouterCheck()
        self.check_router = check_router

    def ev(self, op: str, **args) -> list:
        step = {"i": self.i, "op": op, "args": args}
        obs = super().step(op, **args)
        events = self.src.after_step(step, obs)
        if self.check_router:
            assert self.router.fold(events) == []
            assert self.router.compare(self.src.hashes()) == []
        return events

    def take(self, n: int) -> list:
        obs = super().step("alloc", n=n)
        assert self.src.after_step({"op": "alloc"}, obs) == []
        return obs["slots"]


def hashes(tokens, page, extra_key=None, mode="namespaced"):
    return [block_hash(k) for k in path_keys(tokens, page, extra_key, mode)]


def node(tokens, extra_key=None):
    return {"tokens": list(tokens), "extra_key": extra_key}


def test_insert_stores_one_event_per_page_chained_to_its_parent():
    s = EventStory(page_size=2, kv_slots=32)
    slots = s.take(6)
    events = s.ev("insert", tokens=[1, 2, 3, 4, 5, 6], extra_key=None, value=slots)
    h = hashes([1, 2, 3, 4, 5, 6], 2)
    assert events == [["BlockStored", [h[0]], None, [1, 2], 2, None, "GPU"],
                      ["BlockStored", [h[1]], h[0], [3, 4], 2, None, "GPU"],
                      ["BlockStored", [h[2]], h[1], [5, 6], 2, None, "GPU"]]
    # a second insert sharing two pages splits the node: the split itself emits nothing,
    # the new leaf's page follows the shared page
    more = s.take(6)
    events = s.ev("insert", tokens=[1, 2, 3, 4, 9, 9], extra_key=None, value=more)
    g = hashes([1, 2, 3, 4, 9, 9], 2)
    assert events == [["BlockStored", [g[2]], h[1], [9, 9], 2, None, "GPU"]]
    assert s.ev("match_prefix", tokens=[1, 2, 3], extra_key=None) == []


def test_eviction_removes_and_a_flush_clears_everything():
    s = EventStory(page_size=1, kv_slots=16)
    s.ev("insert", tokens=[1, 2], extra_key=None, value=s.take(2))
    s.ev("insert", tokens=[1, 3], extra_key=None, value=s.take(2))
    h12, h13 = hashes([1, 2], 1), hashes([1, 3], 1)
    events = s.ev("evict", num_tokens=1)
    assert events == [["BlockRemoved", [h12[1]], "GPU"]]
    events = s.ev("evict", num_tokens=2)
    assert canonical(events) == canonical([["BlockRemoved", [h13[1]], "GPU"],
                                           ["BlockRemoved", [h12[0]], "GPU"]])
    # a child's pages go before its parent's
    assert events[-1] == ["BlockRemoved", [h12[0]], "GPU"]
    s.ev("insert", tokens=[5], extra_key=None, value=s.take(1))
    assert s.ev("reset") == [["AllBlocksCleared"]]
    assert s.ev("reset") == [["AllBlocksCleared"]]  # a flush is announced even when empty


def test_a_rejected_step_emits_nothing():
    s = EventStory(page_size=1, kv_slots=16)
    assert s.ev("insert", tokens=[1, 2], extra_key=None, value=[1, 1]) == []
    assert s.ev("unlock", handle=99) == []


def test_extra_keys_namespace_the_hashes_unless_the_config_says_compat():
    for mode in ("namespaced", "compat"):
        s = EventStory(check_router=mode == "namespaced", page_size=1, kv_slots=16,
                       storage_key_mode=mode)
        a = s.ev("insert", tokens=[7, 8], extra_key=None, value=s.take(2))
        b = s.ev("insert", tokens=[7, 8], extra_key="tenant", value=s.take(2))
        assert [e[1] for e in a] == [[h] for h in hashes([7, 8], 1)]
        assert [e[1] for e in b] == [[h] for h in hashes([7, 8], 1, "tenant", mode)]
        assert (a == b) == (mode == "compat")


def test_compat_hashes_break_the_router_invariant_across_tenants():
    """0.5.13.post1 hashes without extra_key: two tenants' identical pages are one block to a
    router, and evicting one tenant's copy removes the block the other still has (docs/SPEC.md)."""
    s = Story(page_size=1, kv_slots=16)
    state = s.a.state
    em = EventEmitter(state, key_mode="compat")
    router = RouterCheck()
    problems = []
    for op, args in (("alloc", {"n": 2}), ("insert", {"tokens": [7, 8], "extra_key": None,
                                                      "value": [1, 2]}),
                     ("alloc", {"n": 2}), ("insert", {"tokens": [7, 8], "extra_key": "t",
                                                      "value": [3, 4]}),
                     ("lock", {"node": node([7, 8], "t")}), ("evict", {"num_tokens": 2})):
        s.step(op, **args)
        problems += router.fold([to_wire(e) for e in em.step(state)])
    assert [p.split()[0] for p in problems] == ["duplicate-store", "duplicate-store"]
    # the tenant's pages are still cached, but the router no longer knows them
    assert router.compare(em.hashes()) != []


def test_host_tier_stores_on_cpu_when_the_write_is_acknowledged():
    s = EventStory(page_size=1, kv_slots=8, host_slots=16, write_through_threshold=1)
    h = hashes([1, 2], 1)
    gpu = [["BlockStored", [h[0]], None, [1], 1, None, "GPU"],
           ["BlockStored", [h[1]], h[0], [2], 1, None, "GPU"]]
    assert s.ev("insert", tokens=[1, 2], extra_key=None, value=s.take(2)) == gpu
    # the backup is in flight: nothing on the host yet, and a match that splits the node
    # while the write is in flight does not make its upper part cached on the host either
    assert s.ev("match_prefix", tokens=[1], extra_key=None) == []
    assert s.ev("io_complete", writes=-1, loads=-1) == []
    cpu = [["BlockStored", [h[0]], None, [1], 1, None, "CPU_PINNED"],
           ["BlockStored", [h[1]], h[0], [2], 1, None, "CPU_PINNED"]]
    assert s.ev("check_hicache_events") == cpu
    # evicting to the host removes the device copies only
    events = s.ev("evict", num_tokens=2)
    assert canonical(events) == canonical([["BlockRemoved", [h[1]], "GPU"],
                                           ["BlockRemoved", [h[0]], "GPU"]])
    # loading back stores them on the device again
    obs = s.step("match_prefix", tokens=[1, 2], extra_key=None)
    assert obs["host_hit_length"] == 2
    s.src.after_step({"op": "match_prefix"}, obs)
    events = s.ev("load_back", node=node([1, 2]), last_device_node=node([]), mem_quota=None)
    assert events == gpu
    s.ev("io_complete", writes=-1, loads=-1)
    s.ev("check_hicache_events")
    s.ev("evict", num_tokens=2)
    events = s.ev("evict_host", num_tokens=2)
    assert canonical(events) == canonical([["BlockRemoved", [h[1]], "CPU_PINNED"],
                                           ["BlockRemoved", [h[0]], "CPU_PINNED"]])


@pytest.mark.parametrize("config_name", ["full-p1", "full-p4", "hicache-wt-p1", "hicache-wt-p4",
                                         "hicache-wb-p1", "hicache-wb-p4", "swa-w8-p4", "mamba-p1"])
def test_folding_the_spec_stream_gives_the_cached_pages_after_every_step(config_name):
    for seed in (1, 2):
        config = make_config(config_name, seed)
        steps = Driver(make_adapter("spec", config), config, seed, 150,
                       check_violations=False).run()
        adapter = make_adapter("spec", config)
        src = event_source(adapter)
        router = RouterCheck()
        router.view.strict = True  # any anomaly fails at once
        stored = 0
        for step in steps:
            events = src.after_step(step, adapter.apply(step))
            stored += sum(e[0] == "BlockStored" for e in events)
            router.fold(events)
            assert router.compare(src.hashes()) == [], (config_name, seed, step["i"])
        assert stored > 0


def test_wire_arrays_round_trip_and_bad_ones_are_refused():
    events = [BlockStored((1, -2), None, (3, 4), 1, None, "GPU"),
              BlockStored((5,), 1, ((1, 2), (2, 3)), 2, 7, "CPU_PINNED"),
              BlockRemoved((1,), "GPU"), AllBlocksCleared()]
    for e in events:
        assert from_wire(to_wire(e)) == e
    assert from_wire(["BlockRemoved", [1], None]) == BlockRemoved((1,), "GPU")
    for bad in ([], ["Nope"], ["BlockRemoved", [1.5], "GPU"], ["BlockStored", [1]], "x",
                ["BlockRemoved", [True], "GPU"]):
        with pytest.raises(InvalidInput):
            from_wire(bad)
    with pytest.raises(InvalidInput):
        to_wire(object())


def test_a_steps_events_compare_as_a_multiset():
    a = [["BlockRemoved", [1], "GPU"], ["BlockStored", [2], None, [1], 1, None, "GPU"]]
    assert events_differ(a, list(reversed(a))) is None
    assert events_differ(a, [["BlockRemoved", [1], None], a[1]]) is None  # nil medium = GPU
    assert events_differ(a, a[:1]) == ([repr(a[1])], [])
