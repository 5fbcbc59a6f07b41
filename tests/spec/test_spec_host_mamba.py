"""The host tier with the Mamba component (spec/host.py, spec/components.py), story by story,
with hand-computed expectations, and the two upstream defects of this area the spec must not
copy (docs/SPEC.md).

Pools (page_size 1): page 0 is reserved, so a fresh pool's first alloc(n) is ``[1 .. n]``; the
device KV, device Mamba, host KV and host Mamba pools all hand out the lowest free slots first.
Every step is followed by ``sanity_check`` (host and aux-host invariants included).
"""

from __future__ import annotations

import glob
import os

import pytest

from conftest import CORPUS
from tests.stories import acks_done, node_at, sound
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec import cache as rules
from uniradix.spec import components, host
from uniradix.spec.config import CacheConfig
from uniradix.spec.state import new_state


def make(**cfg):
    base = dict(components=("full", "mamba"), kv_slots=16, host_slots=32, mamba_slots=4)
    base.update(cfg)
    state = new_state(CacheConfig(**base))
    sound(state)
    return state


def put(state, tokens):
    """Insert ``tokens`` with fresh KV slots and a fresh state slot; returns the state slot."""
    slots = state.kv.alloc(len(tokens))
    (m,) = state.mamba.alloc(1)
    out = rules.insert(state, tokens, None, slots, 0, mamba_value=[m])
    assert not out.mamba_exist
    sound(state)
    return m


def mamba(node):
    return node.aux["mamba"]


def test_backup_copies_the_state_and_eviction_keeps_it_on_the_host():
    s = make(write_through_threshold=1)
    put(s, [1, 2, 3])                        # A: KV [1,2,3], state 1; hit 1 -> backed up
    a = node_at(s, [1, 2, 3])
    assert a.host_value == (1, 2, 3) and mamba(a).host_value == (1,)
    assert s.host.mamba_copies == [("backup", [1], [1])]
    acks_done(s)
    freed = components.evict(s, 3)           # A is evicted to the host with its state
    sound(s)
    assert freed == {"full": 3, "swa": 0, "mamba": 1}
    assert a.value is None and mamba(a).value is None and mamba(a).host_value == (1,)
    assert components.host_lru_order(s, "mamba") == [a]
    m = rules.match_prefix(s, [1, 2, 3])     # the host state counts: best is A
    assert (m.best_match_node, m.last_device_node) == (a, s.root)
    assert (m.host_hit_length, m.mamba_host_hit_length) == (3, 1)
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    # the requester's own state slot is taken first (1), the node's state comes back to 2
    assert last is a and len(indices) == 3 and mamba(a).value == (2,)
    assert s.host.request_state == 1 and s.mamba.is_allocated(1)
    assert s.host.mamba_copies[-2:] == [("load", [1], [2]), ("load", [1], [1])]
    assert components.host_lru_order(s, "mamba") == []


def test_a_device_node_whose_state_is_on_the_host_is_not_loaded_back():
    """The seed's guard: only an evicted node is loaded back (docs/SPEC.md)."""
    s = make(write_through_threshold=1)
    put(s, [1, 2, 3])
    a = node_at(s, [1, 2, 3])
    acks_done(s)
    components.evict(s, 0, mamba_num=1)      # A is a device leaf: evicted whole, to the host
    put(s, [1, 2, 3, 4, 5])                  # B under A: A takes fresh KV slots back, no state
    sound(s)
    assert a.value is not None and mamba(a).value is None and mamba(a).host_value == (1,)
    m = rules.match_prefix(s, [1, 2, 3])
    assert m.best_match_node is a and m.last_device_node is s.root
    assert (m.host_hit_length, m.mamba_host_hit_length) == (3, 1)  # A's host copy counts
    loads = len(s.host.loads)
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    assert (indices, last) == ((), s.root)   # nothing is loaded, no slot is taken
    assert mamba(a).value is None and s.host.request_state is None and len(s.host.loads) == loads


def test_a_full_host_state_pool_evicts_the_oldest_host_only_state():
    s = make(write_through_threshold=1, host_mamba_slots=1)
    put(s, [1, 2, 3])                        # A backed up with host state 1
    a = node_at(s, [1, 2, 3])
    acks_done(s)
    components.evict(s, 3)                   # A: host only
    put(s, [7, 8])                           # B's backup needs the one host state: A goes
    sound(s)
    b = node_at(s, [7, 8])
    assert not rules.is_in_tree(s, a)
    assert mamba(b).host_value == (1,) and b.host_value is not None


def test_a_host_lock_protects_the_host_state():
    s = make(write_through_threshold=1, host_mamba_slots=1)
    put(s, [1, 2, 3])
    a = node_at(s, [1, 2, 3])
    acks_done(s)
    components.evict(s, 3)
    handle = host.inc_host_lock_ref(s, a)
    assert mamba(a).host_lock_ref == 1 and components.host_lru_order(s, "mamba") == []
    put(s, [7, 8])                           # no host state for B: its backup fails
    b = node_at(s, [7, 8])
    assert b.host_value is None and rules.is_in_tree(s, a)
    host.dec_host_lock_ref(s, handle)
    sound(s)
    assert components.host_lru_order(s, "mamba") == [a]


def test_write_back_mamba_eviction_passes_over_a_leaf_whose_backup_fails():
    """Upstream defect: under write-back, Mamba eviction loops for ever on the least recently
    used leaf when its backup fails because the host pool is full of backups whose nodes are
    on the device.  The spec passes that leaf over and ends."""
    s = make(write_policy="write_back", host_slots=4, kv_slots=16)
    put(s, [1, 2, 3, 4])                     # A
    a = node_at(s, [1, 2, 3, 4])
    components.evict(s, 4)                   # A backed up (host full), evicted to the host
    put(s, [9, 10])                          # B: the oldest state from now on
    b = node_at(s, [9, 10])
    rules.match_prefix(s, [1, 2, 3, 4])
    host.init_load_back(s, a, s.root, None)  # A back on the device, its host copy kept
    acks_done(s)
    assert s.host.pool.available_size() == 0 and a.value is not None
    freed = components.evict(s, 0, mamba_num=1)
    sound(s)
    assert freed["mamba"] == 1               # B passed over (no host room), A evicted instead
    assert b.value is not None and mamba(b).value is not None and b.host_value is None
    assert a.value is None and mamba(a).host_value is not None
    assert components.evict(s, 0, mamba_num=5)["mamba"] == 1  # ends: B fits on the host now


def test_mamba_load_back_fails_when_every_device_state_is_locked():
    """Upstream defect: a Mamba load back asserts when every device state slot is pinned (here
    by pending write-through acks).  The spec fails the load back: nothing changes."""
    s = make(write_through_threshold=1, mamba_slots=2, host_mamba_slots=4)
    put(s, [1, 2, 3])                        # A, backed up
    a = node_at(s, [1, 2, 3])
    acks_done(s)
    components.evict(s, 3)                   # A on the host only; its device state freed
    put(s, [5, 6])                           # B and C take both device states and stay
    put(s, [7, 8])                           # locked until their writes are acked
    assert s.mamba.available_size() == 0
    m = rules.match_prefix(s, [1, 2, 3])
    assert m.best_match_node is a and m.mamba_host_hit_length == 1
    kv_before = s.kv.available_size()
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    assert (indices, last) == ((), s.root)
    assert a.value is None and mamba(a).value is None and s.kv.available_size() == kv_before
    acks_done(s)                             # once the writes are acked, it loads
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    assert last is a and mamba(a).value is not None


REGRESSIONS = sorted(glob.glob(os.path.join(CORPUS, "regressions-host-aux", "*.jsonl")))


def test_the_host_aux_regressions_are_there():
    names = {os.path.basename(t) for t in REGRESSIONS}
    assert {"upstream-hang-host-mamba-wb-p1-evict-backup-fails.jsonl",
            "upstream-crash-host-mamba-wt-p1-load-back-all-slots-pinned.jsonl"} <= names


@pytest.mark.parametrize("path", REGRESSIONS, ids=[os.path.basename(t) for t in REGRESSIONS])
def test_host_aux_regressions_replay_on_the_spec(path):
    result = replay_trace(load_trace(path), "spec")
    assert result.unsupported is None, result.unsupported
    assert result.divergence is None, str(result.divergence)


UPSTREAM = sorted(glob.glob(os.path.join(CORPUS, "upstream-host-mamba", "*.jsonl")))


def test_the_upstream_host_mamba_corpus_is_there():
    """The golden corpus recorded from 0.5.13.post1; it replays on the spec and on fast in
    tests/conformance/traces/test_corpus_replay.py."""
    assert len(UPSTREAM) >= 80, len(UPSTREAM)


def test_the_load_back_regression_still_reaches_its_check(monkeypatch):
    """tests/corpus/regressions-host-aux/conform-host-mamba-wb-p4-load-back-loses-its-host-state.jsonl
    reaches the check it was found by: without it (the load back going on after its room-making
    took the host state), the spec breaks at the last step."""
    path = os.path.join(CORPUS, "regressions-host-aux",
                        "conform-host-mamba-wb-p4-load-back-loses-its-host-state.jsonl")
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None

    def unchecked(self, state, node):
        if state.mamba.available_size() < 1:
            components.evict(state, 0, mamba_num=1)
        if state.mamba.available_size() < 1:
            return False
        state.host.mamba_load = state.mamba.alloc(1)[0]
        return True

    monkeypatch.setattr(components.MambaComponent, "alloc_load_back", unchecked)
    result = replay_trace(trace, "spec")
    assert result.divergence is not None and result.divergence.step == trace.steps[-1]["i"]
    assert result.divergence.field == "crash", str(result.divergence)
