"""Streaming sessions with SWA and Mamba in the spec (spec/sessions.py): what a parked turn
holds per component (its SWA slots from its window start on, its Mamba state slot), the
restore, ``release_session``, ``session_held`` and the eviction interplay, through the trace
ops.  Every step goes through ``Story.step`` (invariants after each, a rejected step changes
nothing).

Pool reminder: page 0 is reserved and pools are lowest-first; with SWA each full slot takes
the SWA slot of the same number while both pools are fresh.
"""

from __future__ import annotations

from stories import Story
from uniradix.spec.requests import output_token_id

SWA = dict(components=("full", "swa"), kv_slots=32, swa_slots=32, sliding_window=2)
MAMBA = dict(components=("full", "mamba"), kv_slots=32, mamba_slots=3, mamba_cache_chunk_size=1)
PROMPT = [1, 2, 3, 4]


def sessions(s: Story) -> list:
    return s.a.snapshot()["sessions"]


def test_swa_a_parked_turn_keeps_its_window_and_the_restore_runs_on_in_it():
    s = Story(**SWA)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]  # slots 1..4, into the tree
    assert s.step("req_decode", rid="a1", n=3)["ok"]  # window start -> 4; slots 5..7 its own
    r = s.step("req_decode", rid="a1", n=1)  # 7 - 2 - 1 = 4: nothing drops yet
    assert r["swa_freed"] == []
    r = s.step("req_decode", rid="a1", n=1)  # 8 - 3 = 5: position 4 (slot 5) drops its SWA slot
    assert r["swa_freed"] == [5]
    r = s.step("req_finish", rid="a1")
    assert (r["freed"], r["swa_freed"]) == ([], [])  # parked: nothing inserted, nothing freed
    (slot,) = sessions(s)
    assert (slot["protected"], slot["swa_evicted_seqlen"], slot["row"]) == (
        4, 5, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # full: 5 own slots; SWA: 4 of them (position 4's went at the decode)
    assert s.step("session_held") == {"tokens": 5, "full_tokens": 5, "swa_tokens": 4,
                                      "req_count": 1}
    # the parked SWA slots are outside the tree: an SWA eviction cannot take them, and the
    # locked prompt keeps its window
    assert s.step("evict", num_tokens=0, swa_num_tokens=100)["swa_num_tokens_evicted"] == 0
    out = [output_token_id(PROMPT, k) for k in range(5)]
    s.step("req_arrive", rid="a2", tokens=PROMPT + out + [7], session="s")
    r = s.step("req_admit", rid="a2")
    assert (r["prefix_len"], r["freed"], r["swa_freed"]) == (9, [], [])
    assert s.step("session_held") == {"tokens": 0, "full_tokens": 0, "swa_tokens": 0,
                                      "req_count": 0}  # the running request holds it
    assert s.step("req_chunk", rid="a2", n=1)["ok"]
    r = s.step("req_decode", rid="a2", n=1)  # 10 - 3 = 7: positions 5, 6 drop theirs
    assert r["swa_freed"] == [6, 7]
    s.step("req_finish", rid="a2")
    assert sessions(s)[0]["swa_evicted_seqlen"] == 7
    assert s.step("session_held")["swa_tokens"] == 11 - 7
    # release: the lock goes, the row's own full slots and its remaining SWA slots go back
    r = s.step("release_session", session="s")
    assert r["freed"] == [5, 6, 7, 8, 9, 10, 11]
    assert len(r["swa_freed"]) == 4  # (the SWA slots the decodes freed were taken again)
    assert "sessions" not in s.a.snapshot()


def test_swa_a_restore_frees_the_rows_tail_with_its_swa_slot():
    s = Story(**dict(SWA, sliding_window=1))
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]
    for _ in range(4):
        assert s.step("req_decode", rid="a1", n=1)["ok"]
    s.step("req_finish", rid="a1")
    # each decode step drops what fell out of the window before it: 8 - 1 - 1 - 1 = 5
    assert sessions(s)[0]["swa_evicted_seqlen"] == 5
    # the next turn repeats the session's tokens exactly: its prefix is all of them but the
    # last (7): the last position's slot goes, its SWA slot with it
    out = [output_token_id(PROMPT, k) for k in range(4)]
    s.step("req_arrive", rid="a2", tokens=PROMPT + out, session="s")
    r = s.step("req_admit", rid="a2")
    # (full slot 8 took SWA slot 5, which position 4 had dropped before)
    assert (r["prefix_len"], r["freed"], r["swa_freed"]) == (7, [8], [5])
    s.step("req_abort", rid="a2")  # a running session request's abort ends the session
    assert "sessions" not in s.a.snapshot()
    assert s.step("session_held") == {"tokens": 0, "full_tokens": 0, "swa_tokens": 0,
                                      "req_count": 0}


def test_mamba_the_parked_state_slot_is_held_outside_the_tree_until_release():
    s = Story(**MAMBA)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    assert s.step("req_admit", rid="a1")["mamba_pool_idx"] == 1
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]  # the tree takes a copy: 2
    assert s.step("req_decode", rid="a1", n=2)["ok"]
    r = s.step("req_finish", rid="a1")
    assert r["mamba_freed"] == []  # the request's state slot 1 is parked, not freed
    assert sessions(s)[0]["mamba_slot"] == 1
    assert s.step("session_held") == {"tokens": 2, "full_tokens": 2, "mamba_slots": 1,
                                      "req_count": 1}
    # the state eviction cannot take the parked slot (it is not the tree's), nor the prompt's
    # state (the session's lock holds it)
    assert s.step("evict", num_tokens=0, mamba_num=3)["mamba_num_evicted"] == 0
    # another request takes the last free state; a third finds none
    s.step("req_arrive", rid="b", tokens=[9, 9])
    assert s.step("req_admit", rid="b")["mamba_pool_idx"] == 3
    s.step("req_arrive", rid="c", tokens=[8, 8])
    assert s.step("req_admit", rid="c")["mamba_pool_idx"] is None
    # the session's next turn computes on in its parked state slot: no new one
    out = [output_token_id(PROMPT, k) for k in range(2)]
    s.step("req_arrive", rid="a2", tokens=PROMPT + out + [5], session="s")
    r = s.step("req_admit", rid="a2")
    assert (r["prefix_len"], r["mamba_pool_idx"]) == (6, 1)
    assert s.step("session_held")["mamba_slots"] == 0
    assert s.step("req_chunk", rid="a2", n=1)["ok"]  # a session with a slot skips the tree
    s.step("req_finish", rid="a2")
    assert sessions(s)[0]["mamba_slot"] == 1
    r = s.step("release_session", session="s")
    assert r["mamba_freed"] == [1]
    assert s.step("req_admit", rid="c")["mamba_pool_idx"] == 1


def test_mamba_a_first_turns_abort_frees_its_state_with_the_session():
    s = Story(**MAMBA)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]
    r = s.step("req_abort", rid="a1")
    assert r["mamba_freed"] == [1]
    assert "sessions" not in s.a.snapshot()
    assert s.step("session_held") == {"tokens": 0, "full_tokens": 0, "mamba_slots": 0,
                                      "req_count": 0}


def test_hypothesis_machine_with_sessions_on_swa_and_mamba():
    """The Hypothesis machine with streaming sessions, the spec and fast in lockstep (fast's
    hybrid adapter drives sessions with aux), over Full + SWA, Full + Mamba and Full + SWA +
    Mamba configs: every step's observations and snapshots agree, every step's invariants hold
    (the parked SWA slots and state slot included), rejections change nothing."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from uniradix.conformance.explore.machine import draw_hybrid_config, draw_swa_mamba_config, make_machine

    def draw(ch):
        return draw_swa_mamba_config(ch) if ch.chance(0.3) else draw_hybrid_config(ch)

    # the request path and what meets it (eviction, matches): sessions' turns come often
    actions = ("req_arrive", "req_admit", "req_chunk", "req_decode", "req_finish", "req_abort",
               "evict", "match_prefix", "release_session", "session_held")
    Machine = make_machine(["spec", "fast"], name="AuxSessionMachine", draw=draw, sessions=True,
                           actions=actions)
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=10, stateful_step_count=80, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_the_session_invariants_see_a_wrong_window_start_and_a_shared_state_slot():
    """Planted faults on a parked slot: a window start that does not match the row's SWA
    slots, and a parked state slot the tree holds, are each reported."""
    from uniradix.spec.sessions import aux_invariants
    s = Story(**dict(SWA, components=("full", "swa", "mamba"), mamba_slots=4))
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]
    s.step("req_decode", rid="a1", n=2)
    s.step("req_finish", rid="a1")
    state = s.a.state
    slot = state.sessions["s"]
    assert aux_invariants(state) == []
    slot.swa_evicted_seqlen = 5
    assert any("window start" in e for e in aux_invariants(state))
    slot.swa_evicted_seqlen = 0
    (tree_state,) = [n.aux["mamba"].value[0] for n in state.root.children.values()]
    parked, slot.mamba_slot = slot.mamba_slot, tree_state
    assert any("parked state slot" in e for e in aux_invariants(state))
    slot.mamba_slot = parked
    assert aux_invariants(state) == []
