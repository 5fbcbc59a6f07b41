"""The request path (``cache_unfinished_req`` / ``cache_finished_req``, spec/requests.py) with
SWA, Mamba and both: hand-worked stories through the request-level trace ops.

Pool reminder: page 0 is reserved and pools are lowest-first, so with page_size 1 the first
``alloc(n)`` returns ``[1 .. n]`` and takes SWA slots ``[1 .. n]`` too.  Output token ``k`` of
a prompt ``p`` is ``(p[k % len(p)] * 7 + k) % 50000``.
"""

from __future__ import annotations

import pytest

from stories import Story

SWA = dict(components=("full", "swa"), kv_slots=32, swa_slots=32, sliding_window=2)
MAMBA = dict(components=("full", "mamba"), kv_slots=32, mamba_cache_chunk_size=1)


def req(s: Story, rid: str) -> dict:
    (r,) = [r for r in s.a.snapshot()["requests"] if r["rid"] == rid]
    return r


def node(s: Story, tokens: list) -> dict:
    (n,) = [n for n in s.a.snapshot()["nodes"] if n["path"]["tokens"] == tokens]
    return n


def test_swa_decode_drops_the_window_tail_and_the_finish_caches_it_as_a_tombstone():
    s = Story(**SWA)
    s.step("req_arrive", rid="r", tokens=[1, 2, 3, 4, 5, 6])
    assert s.step("req_admit", rid="r") == {"prefix_len": 0, "freed": [], "swa_freed": []}
    # the prompt, cached unfinished: a leaf of slots 1..6, the request locks it
    r = s.step("req_chunk", rid="r", n=6, chunked=False)
    assert (r["ok"], r["freed"], r["swa_freed"]) == (True, [], [])
    assert req(s, "r")["protected"] == 6
    # decode 4: the window start moves up to the protected length (6); 6 - 2 - 1 < 6: no drop
    r = s.step("req_decode", rid="r", n=4)
    assert (r["ok"], r["swa_freed"]) == (True, [])
    assert (req(s, "r")["committed"], req(s, "r")["swa_evicted_seqlen"]) == (10, 6)
    # the next decode: 10 - 2 - 1 = 7 -> positions 6 of the request's own drop their SWA slot
    r = s.step("req_decode", rid="r", n=1)
    assert (r["ok"], r["freed"], r["swa_freed"]) == (True, [], [7])
    assert req(s, "r")["swa_evicted_seqlen"] == 7
    # finish: 11 tokens inserted with swa_evicted_seqlen 7: the new part [6, 11) is split at 7,
    # its first unit cached without SWA data (a tombstone), the rest with it
    r = s.step("req_finish", rid="r")
    assert (r["freed"], r["swa_freed"]) == ([], [])
    out = [(7 * p + k) % 50000 for k, p in enumerate([1, 2, 3, 4, 5])]
    assert node(s, [1, 2, 3, 4, 5, 6, out[0]])["swa"]["value"] is None
    # (the SWA slot the decode freed, 7, came back with the last decode's full slot 11)
    assert node(s, [1, 2, 3, 4, 5, 6] + out)["swa"]["value"] == [8, 9, 10, 7]
    assert s.a.snapshot()["requests"] == []


def test_swa_reservation_evicts_for_the_swa_pool_too():
    s = Story(**dict(SWA, kv_slots=8, swa_slots=4))
    s.step("req_arrive", rid="a", tokens=[1, 2, 3, 4])
    s.step("req_admit", rid="a")
    assert s.step("req_chunk", rid="a", n=4, chunked=False)["ok"]
    s.step("req_finish", rid="a")  # a leaf of 4 full + 4 SWA slots; the SWA pool is full
    s.step("req_arrive", rid="b", tokens=[9, 9])
    s.step("req_admit", rid="b")
    r = s.step("req_chunk", rid="b", n=2, chunked=False)
    # 4 full slots are free, no SWA slot: the leaf goes (a device leaf leaves whole)
    assert (r["ok"], r["evicted"], r["freed"], r["swa_freed"]) == (True, 4, [1, 2, 3, 4],
                                                                    [1, 2, 3, 4])


def test_mamba_admission_takes_a_state_slot_or_waits():
    s = Story(**dict(MAMBA, mamba_slots=2))
    for rid, toks in (("a", [1, 2, 3, 4]), ("b", [5, 6]), ("c", [7])):
        s.step("req_arrive", rid=rid, tokens=toks)
    assert s.step("req_admit", rid="a")["mamba_pool_idx"] == 1
    assert s.step("req_admit", rid="b")["mamba_pool_idx"] == 2
    # no free state and none in the tree to evict: c waits, holding nothing
    r = s.step("req_admit", rid="c")
    assert (r["prefix_len"], r["mamba_pool_idx"], r["mamba_freed"]) == (0, None, [])
    assert req(s, "c")["admitted"] is False
    # a's chunk would cache a copy of its state: no slot for it, so the chunk is not cached
    assert s.step("req_chunk", rid="a", n=2, chunked=True)["ok"]
    assert req(s, "a")["protected"] == 0 and s.a.snapshot()["nodes"] == []
    assert s.step("req_chunk", rid="a", n=2, chunked=False)["ok"]
    # finish: the tree takes a's own state slot with the new leaf
    r = s.step("req_finish", rid="a")
    assert (r["freed"], r["mamba_freed"]) == ([], [])
    assert node(s, [1, 2, 3, 4])["mamba"]["value"] == [1]
    # now c's admission evicts that state (its leaf, unlocked, leaves whole) and takes slot 1
    r = s.step("req_admit", rid="c")
    assert (r["mamba_pool_idx"], r["freed"], r["mamba_freed"]) == (1, [1, 2, 3, 4], [1])
    r = s.step("req_abort", rid="c")  # an aborted request's state slot goes back
    assert (r["freed"], r["mamba_freed"]) == ([], [1])


def test_mamba_chunks_cache_copies_and_the_finish_frees_a_state_the_node_has():
    s = Story(**dict(MAMBA, mamba_slots=3))
    s.step("req_arrive", rid="r", tokens=[1, 2, 3, 4, 5, 6])
    assert s.step("req_admit", rid="r")["mamba_pool_idx"] == 1
    s.step("req_chunk", rid="r", n=4, chunked=True)  # the copy: slot 2, on a new leaf
    assert node(s, [1, 2, 3, 4])["mamba"]["value"] == [2]
    assert req(s, "r")["protected"] == 4 and req(s, "r")["mamba_slot"] == 1
    s.step("req_chunk", rid="r", n=2, chunked=False)  # the copy: slot 3
    assert node(s, [1, 2, 3, 4, 5, 6])["mamba"]["value"] == [3]
    # finish: the node already has a state (mamba_exist): the request's own slot is freed
    r = s.step("req_finish", rid="r")
    assert (r["freed"], r["mamba_freed"]) == ([], [1])
    assert s.a.snapshot()["mamba_pool"] == [2, 3]


def test_full_swa_mamba_request_holds_both():
    s = Story(components=("full", "swa", "mamba"), kv_slots=32, swa_slots=32, sliding_window=2,
              mamba_slots=4, mamba_cache_chunk_size=1)
    s.step("req_arrive", rid="r", tokens=[1, 2, 3, 4])
    assert s.step("req_admit", rid="r")["mamba_pool_idx"] == 1
    s.step("req_chunk", rid="r", n=4, chunked=False)
    # decodes of 2 from 4, 6, 8 computed: the window start goes to the protected length 4,
    # then to 8 - 2 - 1 = 5 (position 4, full slot 5, drops its SWA slot 5)
    swa_freed = [s.step("req_decode", rid="r", n=2)["swa_freed"] for _ in range(3)]
    assert swa_freed == [[], [], [5]]
    assert (req(s, "r")["swa_evicted_seqlen"], req(s, "r")["mamba_slot"]) == (5, 1)
    r = s.step("req_decode", rid="r", n=1)  # 10 - 2 - 1 = 7: positions 5, 6 (slots 6, 7)
    assert r["swa_freed"] == [6, 7]
    # finish: the new leaf takes r's own state slot 1; the chunk's copy (2) stays on [1..4]
    r = s.step("req_finish", rid="r")
    assert r["mamba_freed"] == []
    snap = s.a.snapshot()
    assert snap["requests"] == [] and snap["mamba_pool"] == [1, 2]


def test_a_chunk_stops_before_an_swa_tombstone_another_request_holds():
    """r1 holds [1,2,3,4] -> [5,6,7,8], whose upper node became an SWA tombstone; r2 computes
    [1,2,3,4] itself (its match stops at the tombstone).  Its chunk caches nothing (the
    tombstone starts at its protected length 0) and keeps its own slots; its finish frees them
    as duplicates: r1's slots 1..4 stay (issue 18; the seed frees them)."""
    s = Story(**SWA)
    s.step("alloc", n=8)
    s.step("insert", tokens=[1, 2, 3, 4], value=[1, 2, 3, 4])
    s.step("insert", tokens=[1, 2, 3, 4, 5, 6, 7, 8], value=[1, 2, 3, 4, 5, 6, 7, 8],
           prev_prefix_len=4)
    assert s.step("evict", num_tokens=0, swa_num_tokens=1)["swa_freed"] == [1, 2, 3, 4]
    s.step("req_arrive", rid="r1", tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert s.step("req_admit", rid="r1")["prefix_len"] == 8
    s.step("req_arrive", rid="r2", tokens=[1, 2, 3, 4, 7, 7])
    assert s.step("req_admit", rid="r2")["prefix_len"] == 0
    r = s.step("req_chunk", rid="r2", n=6, chunked=True)
    assert (r["ok"], r["freed"]) == (True, [])
    assert req(s, "r2")["protected"] == 0 and req(s, "r2")["row"] == [9, 10, 11, 12, 13, 14]
    r = s.step("req_finish", rid="r2")
    assert r["freed"] == [9, 10, 11, 12]
    assert node(s, [1, 2, 3, 4])["value"] == [1, 2, 3, 4]
    assert node(s, [1, 2, 3, 4])["swa"]["value"] is None
    # (r2's full slots 9..14 took the SWA slots 1..4, 9, 10: lowest first)
    assert node(s, [1, 2, 3, 4, 7, 7])["swa"]["value"] == [9, 10]


@pytest.mark.parametrize("components", [("full", "swa"), ("full", "mamba"),
                                        ("full", "swa", "mamba")])
def test_the_shared_prefix_workload_runs_the_hybrid_request_path(components):
    """conformance/env/workload.py drives SWA and Mamba requests through the request-level ops;
    every step accepted, the spec's invariants hold at the end, and the pools are used.
    (Mamba matches only end at a node with a state, so shared prompts hit with SWA only.)"""
    from uniradix.conformance.adapters.base import SpecAdapter
    from uniradix.conformance.env.workload import SharedPrefix, run_shared_prefix
    w = SharedPrefix(requests=40, prompts=5, prompt_min=10, prompt_max=40, question_min=2,
                     question_max=8, decode_min=1, decode_max=24, kv_slots=400, inflight=4,
                     components=components, sliding_window=4, mamba_slots=6)
    a = SpecAdapter(w.config())
    record: list = []
    stats = run_shared_prefix(a, w, record=record)
    assert stats.requests == 40 and stats.aborted == 0
    assert a.violations() == []
    if "mamba" not in components:
        assert stats.hit_tokens > 0
    if "swa" in components:
        assert any(s["ret"].get("swa_freed") for s in record if s["op"] == "req_decode")
    if "mamba" in components:
        assert any(s["ret"].get("mamba_freed") for s in record)
        assert any(s["ret"]["mamba_pool_idx"] is None for s in record if s["op"] == "req_admit")
