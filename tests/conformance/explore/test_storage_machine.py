"""Hypothesis explores interleavings of the storage tier's cache ops and environment
completions with the host tier's ops on the spec (spec/storage.py), checking every invariant
(spec/invariants.py, storage ones included) after every step.  With sglang importable, the
same machine runs the spec and 0.5.13.post1 in lockstep
(tests/conformance/explore/test_upstream_storage.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from uniradix.conformance.adapters.base import make_adapter
from uniradix.spec.config import CacheConfig

TOKENS = (1, 2, 3)
PROMPTS = [list(p) for p in ((1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 3, 3, 2, 2), (2, 2, 1, 1),
                             (1, 2, 3, 1), (3, 3, 3, 3, 3, 3), (1, 2))]


def make_machine(build: Callable[[CacheConfig], Any], configs: list[CacheConfig]) -> type:
    class StorageMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.adapter: Any | None = None
            self.i = 0
            self.rids: list[str] = []
            self.next_rid = 0

        def step(self, op: str, **args: Any) -> dict:
            obs = self.adapter.apply({"i": self.i, "op": op, "args": args})
            self.i += 1
            assert "error" not in obs or obs["error"] in ("InvalidInput", "NodeNotFound"), obs
            return obs

        @precondition(lambda self: self.adapter is None)
        @rule(k=st.integers(0, len(configs) - 1))
        def start(self, k: int) -> None:
            self.adapter = build(configs[k])
            self.config = configs[k]

        @precondition(lambda self: self.adapter is not None)
        @rule(p=st.sampled_from(PROMPTS), cut=st.integers(1, 8))
        def serve(self, p: list, cut: int) -> None:
            """match, lock, allocate (evicting if short), insert (the request's prompt), free
            the tail, unlock."""
            tokens = p[: max(1, min(cut, len(p)))]
            ps = self.config.page_size
            m = self.step("match_prefix", tokens=tokens)
            have = m["last_device_node"]
            need = -(-(len(tokens) - have) // ps) * ps
            if need == 0:
                return
            # the matched prefix is locked while room is made (the scheduler's way)
            handle = self.step("lock", node={"tokens": tokens[:have], "extra_key": None})["handle"]
            free = self.adapter.pool.available_size()
            if free < need:
                self.step("evict", num_tokens=need - free)
            if self.adapter.pool.available_size() >= need:
                slots = self.step("alloc", n=need)["slots"]
                self.step("insert", tokens=tokens,
                          value=m["device_indices"] + slots[: len(tokens) - have],
                          prev_prefix_len=have)
                aligned = len(tokens) - len(tokens) % ps
                tail = slots[aligned - have:]
                if tail:
                    self.step("free", slots=tail)
            self.step("unlock", handle=handle)

        @precondition(lambda self: self.adapter is not None)
        @rule(p=st.sampled_from(PROMPTS))
        def arrive(self, p: list) -> None:
            m = self.step("match_prefix", tokens=p)
            best = m["best_match_node"]
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            got = self.step("prefetch_from_storage", rid=rid,
                            node={"tokens": p[:best], "extra_key": None}, tokens=p[best:])
            if got.get("tokens", 0) > 0:
                self.rids.append(rid)

        @precondition(lambda self: self.adapter is not None and self.rids)
        @rule(data=st.data(), what=st.sampled_from(["progress", "terminate", "abort", "load"]),
              pages=st.sampled_from([-1, 1, 2]))
        def on_prefetch(self, data: Any, what: str, pages: int) -> None:
            rid = data.draw(st.sampled_from(self.rids))
            if what == "progress":
                if self.step("check_prefetch_progress", rid=rid)["done"]:
                    self.step("pop_prefetch_loaded_tokens", rid=rid)
                    self.rids.remove(rid)
            elif what == "terminate":
                self.step("terminate_prefetch", rid=rid)
            elif what == "abort":
                self.step("release_aborted_request", rid=rid)
                self.rids.remove(rid)
            else:
                self.step("storage_load", rid=rid, pages=pages)

        @precondition(lambda self: self.adapter is not None)
        @rule(what=st.sampled_from(["io", "events", "query", "backup", "tick", "evict",
                                    "evict_host", "clear", "reset"]),
              k=st.sampled_from([-1, 1, 2]))
        def environment(self, what: str, k: int) -> None:
            if what == "io":
                self.step("io_complete", writes=k, loads=k)
            elif what == "events":
                self.step("check_hicache_events")
            elif what == "query":
                self.step("storage_query", count=k)
            elif what == "backup":
                self.step("storage_backup", count=k)
            elif what == "tick":
                self.step("storage_tick", ticks=max(1, k))
            elif what == "evict":
                self.step("evict", num_tokens=4 * max(1, k))
            elif what == "evict_host":
                self.step("evict_host", num_tokens=4 * max(1, k))
            elif what == "clear":
                self.step("clear_storage_backend")
            else:
                self.step("reset")
                self.rids.clear()

        @invariant()
        def sound(self) -> None:
            if self.adapter is not None:
                assert self.adapter.violations() == []

    return StorageMachine


def storage_configs() -> list[CacheConfig]:
    out = []
    for ps in (1, 2):
        for wp in ("write_through", "write_back"):
            for policy in ("best_effort", "wait_complete", "timeout"):
                out.append(CacheConfig(page_size=ps, kv_slots=8, host_slots=16 * ps,
                                       write_policy=wp, storage=True, prefetch_threshold=ps,
                                       prefetch_stop_policy=policy, prefetch_timeout_base=1,
                                       prefetch_timeout_per_page=1))
    return out


def test_storage_machine_on_the_spec():
    run_state_machine_as_test(
        make_machine(lambda c: make_adapter("spec", c), storage_configs()),
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None,
                          database=None))


@pytest.mark.slow
def test_storage_machine_on_the_spec_long():
    run_state_machine_as_test(
        make_machine(lambda c: make_adapter("spec", c), storage_configs()),
        settings=settings(max_examples=2000, stateful_step_count=80, deadline=None,
                          database=None))
