"""``read_only`` (spec/core.py): a pass that only reads the state walks the tree once."""

from uniradix.spec import cache as rules
from uniradix.spec.config import CacheConfig
from uniradix.spec.core import read_only
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import all_nodes, new_state


def _state():
    state = new_state(CacheConfig(page_size=1, kv_slots=16))
    slots = state.kv.alloc(4)
    rules.insert(state, [1, 2, 3, 4], None, slots)
    return state


def test_inside_a_read_only_pass_the_tree_is_walked_once():
    state = _state()
    walked = all_nodes(state)
    with read_only(state):
        first = all_nodes(state)
        assert first == walked
        first.clear()  # each call hands out its own list
        with read_only(state):  # nested: the outer pass's list
            assert all_nodes(state) == walked
        # (a node added inside the pass is not seen: such a pass must not change the state)
        slots = state.kv.alloc(1)
        rules.insert(state, [9], None, slots)
        assert all_nodes(state) == walked
    assert len(all_nodes(state)) == len(walked) + 1  # walked anew after it


def test_the_invariants_and_the_snapshot_still_see_every_change():
    state = _state()
    assert sanity_check(state) == []
    before = snapshot(state)
    node = all_nodes(state)[1]
    node.lock_ref = -1
    assert any(m.startswith("[lock]") for m in sanity_check(state))
    assert snapshot(state) != before
    node.lock_ref = 0
    assert sanity_check(state) == [] and snapshot(state) == before
