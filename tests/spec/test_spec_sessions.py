"""Streaming sessions in the spec (spec/sessions.py), told as stories through the trace ops
(``req_arrive {session}``, ``release_session``, ``session_held``; docs/TRACE.md).

Every step goes through ``Story.step``, which checks the spec's invariants afterwards (the
session invariants included) and, for a step meant to be rejected, that nothing changed.
Pool reminder: page 0 is reserved and allocation is lowest-free-first; ``output_token_id``
makes the generated tokens a fixed function of the prompt.
"""

from __future__ import annotations

import pytest

import stories
from uniradix.spec.config import CacheConfig
from uniradix.spec.requests import output_token_id


class Story(stories.Story):
    def __init__(self, **cfg) -> None:
        super().__init__("spec", **cfg)

    def held(self) -> dict:
        return self.step("session_held")

    def sizes(self) -> dict:
        return self.step("sizes")

    def tree(self) -> list:
        return [(n["path"]["tokens"], n["value"], n["lock_ref"])
                for n in self.a.snapshot()["nodes"]]


PROMPT = [1, 2, 3, 4]
OUT = [output_token_id(PROMPT, 0), output_token_id(PROMPT, 1)]


def first_turn(s: Story, session: str = "s", rid: str = "a1") -> None:
    """Turn 1: prefill the prompt through the tree (non-chunked), decode two tokens, finish."""
    s.step("req_arrive", rid=rid, tokens=PROMPT, session=session)
    assert s.step("req_admit", rid=rid) == {"prefix_len": 0}
    assert s.step("req_chunk", rid=rid, n=4, chunked=False)["ok"]   # slots 1..4, into the tree
    assert s.step("req_decode", rid=rid, n=2)["ok"]                  # slots 5, 6: the request's
    assert s.step("req_finish", rid=rid) == {"freed": []}            # parked, nothing freed


def test_a_finished_turn_is_parked_and_the_next_turn_restores_it():
    s = Story(kv_slots=32)
    first_turn(s)
    # Nothing of the outputs went into the tree; the prompt's node stays locked by the session.
    assert s.tree() == [([1, 2, 3, 4], [1, 2, 3, 4], 1)]
    assert s.held() == {"tokens": 2, "full_tokens": 2, "req_count": 1}
    assert s.sizes()["full_protected"] == 4
    assert s.step("evict", num_tokens=100)["num_tokens_evicted"] == 0  # locked, and off-tree

    # Turn 2 continues the session's six tokens with two new ones.
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT + [7, 8], session="s")
    assert s.step("req_admit", rid="a2") == {"prefix_len": 6}         # from the slot, no match
    assert s.held() == {"tokens": 0, "full_tokens": 0, "req_count": 0}  # the request holds it
    assert s.step("req_chunk", rid="a2", n=2, chunked=False)["ok"]    # skips the tree
    assert s.tree() == [([1, 2, 3, 4], [1, 2, 3, 4], 1)]
    assert s.step("req_finish", rid="a2") == {"freed": []}
    assert s.held() == {"tokens": 4, "full_tokens": 4, "req_count": 1}

    # The end of the session: its lock goes, the row's own slots go back to the pool.
    assert s.step("release_session", session="s") == {"freed": [5, 6, 7, 8]}
    assert s.tree() == [([1, 2, 3, 4], [1, 2, 3, 4], 0)]
    assert s.held() == {"tokens": 0, "full_tokens": 0, "req_count": 0}
    assert s.step("evict", num_tokens=4)["freed"] == [1, 2, 3, 4]


def test_a_restore_takes_at_most_the_prompt_minus_its_last_token_and_frees_the_rest():
    s = Story(kv_slots=32)
    first_turn(s)
    # The next prompt is exactly the session's six tokens: the prefix stops one short, and the
    # row's slot past it (6) goes back to the pool.
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT, session="s")
    assert s.step("req_admit", rid="a2") == {"prefix_len": 5}
    assert s.a.snapshot()["requests"][0]["row"] == [1, 2, 3, 4, 5]
    assert not s.a.state.kv.is_allocated(6)


def test_page_size_four_parks_whole_pages_and_trims_the_overshoot():
    s = Story(kv_slots=32, page_size=4)
    s.step("req_arrive", rid="a1", tokens=PROMPT + [5, 6], session="s")
    s.step("req_admit", rid="a1")
    assert s.step("req_chunk", rid="a1", n=6, chunked=False)["ok"]  # slots 4..11; [4..7] cached
    assert s.tree() == [([1, 2, 3, 4], [4, 5, 6, 7], 1)]
    assert s.step("req_finish", rid="a1") == {"freed": []}
    assert s.held() == {"tokens": 4, "full_tokens": 4, "req_count": 1}  # page [8..11]
    assert s.step("release_session", session="s") == {"freed": [8, 9, 10, 11]}


def test_a_chunked_first_turn_leaves_the_tree_alone():
    s = Story(kv_slots=32)
    s.step("req_arrive", rid="w", tokens=[9, 9, 9], extra_key=None)
    s.step("req_admit", rid="w")
    s.step("req_chunk", rid="w", n=3, chunked=False)
    s.step("req_finish", rid="w")                                   # the tree holds [9 9 9]
    s.step("req_arrive", rid="a1", tokens=[9, 9, 9, 5, 6], session="s")
    assert s.step("req_admit", rid="a1") == {"prefix_len": 3}       # a tree match, locked
    assert s.step("req_chunk", rid="a1", n=2, chunked=True)["ok"]   # chunked: no insert
    assert s.tree() == [([9, 9, 9], [1, 2, 3], 1)]
    s.step("req_finish", rid="a1")
    assert s.held()["tokens"] == 2                                  # 4, 5: past the protected 3
    assert s.step("release_session", session="s") == {"freed": [4, 5]}
    assert s.tree() == [([9, 9, 9], [1, 2, 3], 0)]


def test_a_running_turn_aborted_ends_the_whole_session():
    s = Story(kv_slots=32)
    first_turn(s)
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT + [7, 8], session="s")
    s.step("req_admit", rid="a2")
    s.step("req_chunk", rid="a2", n=2, chunked=False)
    assert s.step("req_abort", rid="a2") == {"freed": [5, 6, 7, 8]}
    assert s.tree() == [([1, 2, 3, 4], [1, 2, 3, 4], 0)]
    assert "sessions" not in s.a.snapshot()
    # the session's next request starts from scratch: a tree match
    s.step("req_arrive", rid="a3", tokens=PROMPT + [0], session="s")
    assert s.step("req_admit", rid="a3") == {"prefix_len": 4}


def test_a_first_turn_aborted_releases_its_own_lock_and_row():
    s = Story(kv_slots=32)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    s.step("req_chunk", rid="a1", n=4, chunked=False)
    s.step("req_decode", rid="a1", n=2)
    assert s.step("req_abort", rid="a1") == {"freed": [5, 6]}
    assert s.tree() == [([1, 2, 3, 4], [1, 2, 3, 4], 0)]
    assert "sessions" not in s.a.snapshot()


def test_a_waiting_request_aborted_leaves_the_slot_as_it_was():
    s = Story(kv_slots=32)
    first_turn(s)
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT + [7], session="s")
    assert s.step("req_abort", rid="a2") == {"freed": []}
    assert s.held()["req_count"] == 1
    s.step("req_arrive", rid="a3", tokens=PROMPT + OUT + [7], session="s")
    assert s.step("req_admit", rid="a3") == {"prefix_len": 6}


@pytest.mark.parametrize("tokens, extra_key, why", [
    (PROMPT + [0, 0, 7], None, "does not continue"),     # differs from the session's outputs
    (PROMPT, None, "does not continue"),                 # shorter than the session
    (PROMPT + OUT + [7], "tenant", "extra_key"),         # another namespace
])
def test_a_request_that_does_not_continue_its_session_is_rejected(tokens, extra_key, why):
    s = Story(kv_slots=32)
    first_turn(s)
    obs = s.step("req_arrive", rid="a2", tokens=tokens, extra_key=extra_key, session="s")
    assert obs["error"] == "InvalidInput" and why in obs["message"]


def test_a_session_runs_one_request_at_a_time():
    s = Story(kv_slots=32)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    obs = s.step("req_arrive", rid="b1", tokens=PROMPT, session="s")
    assert obs["error"] == "InvalidInput"
    assert "error" not in s.step("req_arrive", rid="c1", tokens=PROMPT, session="t")


def test_a_restore_below_the_protected_prefix_is_rejected():
    s = Story(kv_slots=32)
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    s.step("req_admit", rid="a1")
    s.step("req_chunk", rid="a1", n=4, chunked=False)                # protected 4, committed 4
    s.step("req_finish", rid="a1")
    s.step("req_arrive", rid="a2", tokens=PROMPT, session="s")       # prefix would be 3 < 4
    obs = s.step("req_admit", rid="a2")
    assert obs["error"] == "InvalidInput" and "protected" in obs["message"]


def test_release_session_checks_its_input():
    s = Story(kv_slots=32)
    assert s.step("release_session", session="nobody") == {"freed": []}  # the seed: a no-op
    for bad in (None, "", 3):
        assert s.step("release_session", session=bad)["error"] == "InvalidInput"
    first_turn(s)
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT + [7], session="s")
    s.step("req_admit", rid="a2")
    obs = s.step("release_session", session="s")                     # it would free a2's row
    assert obs["error"] == "InvalidInput" and "running" in obs["message"]
    assert s.step("req_arrive", rid="x", tokens=[1], session=5)["error"] == "InvalidInput"


def test_reset_forgets_every_session():
    s = Story(kv_slots=32)
    first_turn(s)
    s.step("reset")
    assert s.held() == {"tokens": 0, "full_tokens": 0, "req_count": 0}
    s.step("req_arrive", rid="a2", tokens=[5], session="s")          # a first turn again
    assert s.step("req_admit", rid="a2") == {"prefix_len": 0}


def test_the_parked_lock_keeps_the_session_path_under_pressure():
    """Other traffic fills the pool; eviction takes everything but the session's path."""
    s = Story(kv_slots=12)
    first_turn(s)                                                    # 6 slots used
    s.step("req_arrive", rid="o1", tokens=[8, 8, 8, 8])
    s.step("req_admit", rid="o1")
    s.step("req_chunk", rid="o1", n=4, chunked=False)
    s.step("req_finish", rid="o1")                                   # [8 8 8 8]: slots 7..10
    s.step("req_arrive", rid="o2", tokens=[6, 6, 6, 6, 6])
    s.step("req_admit", rid="o2")
    obs = s.step("req_chunk", rid="o2", n=5, chunked=False)           # needs 5, 2 free
    assert obs["ok"] and obs["evicted"] == 4
    paths = [t for t, _, _ in s.tree()]
    assert [1, 2, 3, 4] in paths and [8, 8, 8, 8] not in paths


def test_session_ops_with_an_aux_component_run_on_the_spec_and_fast_in_lockstep():
    """The spec models sessions with SWA and Mamba (tests/spec/test_spec_sessions_aux.py); fast's
    hybrid adapter drives them through fast's request calls, every observation and snapshot
    the spec's: two turns of a session (the second restored with its parked state slot), the
    counts while parked, a release that frees the row and the state slot."""
    cfg = CacheConfig(kv_slots=32, components=("full", "mamba"), mamba_slots=4)
    s = stories.SpecAndFast(cfg)
    assert s.step("session_held") == {"tokens": 0, "full_tokens": 0, "mamba_slots": 0,
                                      "req_count": 0}
    s.step("req_arrive", rid="a1", tokens=PROMPT, session="s")
    admit = s.step("req_admit", rid="a1")
    assert admit["prefix_len"] == 0 and admit["mamba_pool_idx"] is not None
    assert s.step("req_chunk", rid="a1", n=4, chunked=False)["ok"]
    assert s.step("req_decode", rid="a1", n=2)["ok"]
    s.step("req_finish", rid="a1")
    held = s.step("session_held")
    assert held["mamba_slots"] == 1 and held["req_count"] == 1
    s.step("req_arrive", rid="a2", tokens=PROMPT + OUT + [9], session="s")
    again = s.step("req_admit", rid="a2")
    assert again["prefix_len"] == 6 and again["mamba_pool_idx"] == admit["mamba_pool_idx"]
    assert s.step("req_chunk", rid="a2", n=1, chunked=False)["ok"]
    s.step("req_finish", rid="a2")
    released = s.step("release_session", session="s")
    assert released["mamba_freed"] == [admit["mamba_pool_idx"]]
    assert s.step("session_held")["mamba_slots"] == 0
