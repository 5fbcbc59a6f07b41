"""The spec's storage tier (spec/storage.py): hand-worked stories, each step checked against the
invariants (spec/invariants.py, storage ones included)."""

from __future__ import annotations

import pytest

from uniradix.spec import cache as rules
from uniradix.spec import host
from uniradix.spec import storage as st
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError, InvalidInput
from uniradix.spec.invariants import sanity_check
from uniradix.spec.pagekeys import chain_keys, namespace_prior
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import new_state


def make(**kw):
    base = dict(page_size=2, kv_slots=32, host_slots=64, storage=True, prefetch_threshold=4)
    base.update(kw)
    return new_state(CacheConfig.from_dict(base))


def ok(state):
    errors = sanity_check(state)
    assert errors == []
    snapshot(state)  # renders


def cache_and_store(state, tokens, extra_key=None):
    """Insert ``tokens``, let the write-through write and the storage backup complete."""
    slots = state.kv.alloc(len(tokens))
    rules.insert(state, tokens, extra_key, slots)
    ok(state)
    host.io_complete(state, -1, -1)
    host.check_hicache_events(state)  # write acked -> backup to storage queued
    ok(state)
    assert st.storage_backup(state, -1) >= 1
    host.check_hicache_events(state)  # backup ack drained -> host lock released
    ok(state)


def test_backup_stores_every_page_under_its_key_and_releases_the_host_lock():
    s = make()
    cache_and_store(s, [1, 2, 3, 4, 5, 6])
    assert sorted(s.storage.store) == sorted(chain_keys([1, 2, 3, 4, 5, 6], 2))
    node = rules.find_node(s, [1, 2, 3, 4, 5, 6], None)
    assert node.page_keys == chain_keys([1, 2, 3, 4, 5, 6], 2)
    assert node.host_lock_ref == 0 and not s.storage.ongoing_backup


def test_a_split_cuts_the_key_list():
    s = make()
    cache_and_store(s, [1, 2, 3, 4, 5, 6])
    rules.match_prefix(s, [1, 2, 9, 9], None)  # splits after the first page
    upper = rules.find_node(s, [1, 2], None)
    lower = rules.find_node(s, [1, 2, 3, 4, 5, 6], None)
    keys = chain_keys([1, 2, 3, 4, 5, 6], 2)
    assert upper.page_keys == keys[:1] and lower.page_keys == keys[1:]
    ok(s)


def test_a_write_split_in_flight_backs_up_both_fragments():
    s = make()
    slots = s.kv.alloc(6)
    rules.insert(s, [1, 2, 3, 4, 5, 6], None, slots)
    rules.match_prefix(s, [1, 2, 3, 4, 9, 9], None)  # split while the host write is pending
    host.io_complete(s, -1, -1)
    host.check_hicache_events(s)
    assert [len(b.node.key) for b in s.storage.backups] == [4, 2]
    st.storage_backup(s, -1)
    assert sorted(s.storage.store) == sorted(chain_keys([1, 2, 3, 4, 5, 6], 2))
    host.check_hicache_events(s)
    ok(s)


def prefetch_story(policy, **kw):
    s = make(prefetch_stop_policy=policy, **kw)
    cache_and_store(s, [1, 2, 3, 4, 5, 6, 7, 8])
    rules.reset(s)  # the tree forgets, the store stays
    ok(s)
    n = st.prefetch_from_storage(s, "r", s.root, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], None)
    assert n == 10  # page-aligned
    ok(s)
    return s


def test_best_effort_inserts_only_completed_pages_and_releases_the_rest():
    s = prefetch_story("best_effort")
    assert st.storage_query(s, -1) == 1
    op = s.storage.ongoing["r"]
    assert len(op.keys) == 4 and [list(p) for p in s.storage.release_queue] == [list(op.slots[8:])]
    ok(s)
    assert st.storage_load(s, "r", 2) == 2
    ok(s)
    assert st.check_prefetch_progress(s, "r") is True  # best effort: stop now
    ok(s)
    node = rules.find_node(s, [1, 2, 3, 4], None)
    assert node.value is None and node.host_value == op.slots[:4]
    assert node.page_keys == chain_keys([1, 2, 3, 4], 2)
    assert st.pop_prefetch_loaded_tokens(s, "r") == 4 and st.pop_prefetch_loaded_tokens(s, "r") == 0
    assert st.storage_load(s, "r", -1) == 0  # terminated: reads nothing, releases slots 4..8
    ok(s)
    host.check_hicache_events(s)
    ok(s)
    assert s.host.pool.available_size() == 64 - 4
    m = rules.match_prefix(s, [1, 2, 3, 4, 5, 6], None)
    assert m.host_hit_length == 4


def test_wait_complete_waits_for_every_hit_page():
    s = prefetch_story("wait_complete")
    assert st.check_prefetch_progress(s, "r") is False  # not even queried
    st.storage_query(s, -1)
    st.storage_load(s, "r", 3)
    assert st.check_prefetch_progress(s, "r") is False
    st.storage_load(s, "r", 1)
    ok(s)
    assert st.check_prefetch_progress(s, "r") is True
    assert st.pop_prefetch_loaded_tokens(s, "r") == 8
    host.check_hicache_events(s)
    ok(s)


def test_timeout_on_the_logical_clock():
    s = prefetch_story("timeout", prefetch_timeout_base=3, prefetch_timeout_per_page=1)
    st.storage_query(s, -1)  # 4 hit pages: the limit is 3 + 4 ticks
    st.storage_load(s, "r", 1)
    st.storage_tick(s, 7)
    assert st.check_prefetch_progress(s, "r") is False
    st.storage_tick(s, 1)
    assert st.check_prefetch_progress(s, "r") is True
    assert st.pop_prefetch_loaded_tokens(s, "r") == 2
    st.storage_load(s, "r", -1)
    host.check_hicache_events(s)
    ok(s)


def test_a_miss_below_the_threshold_revokes_and_frees_every_slot():
    s = make()
    n = st.prefetch_from_storage(s, "r", s.root, list(range(1, 11)), None)
    assert n == 10
    st.storage_query(s, -1)
    assert s.storage.revoke_queue == ["r"]
    ok(s)
    assert st.check_prefetch_progress(s, "r") is False or True  # best effort ends it either way
    host.check_hicache_events(s)
    ok(s)
    assert s.host.pool.available_size() == 64 and not s.storage.ongoing


def test_revoke_drain_unlocks_the_anchor():
    s = make(prefetch_stop_policy="wait_complete")
    cache_and_store(s, [1, 2, 3, 4])
    anchor = rules.find_node(s, [1, 2, 3, 4], None)
    st.prefetch_from_storage(s, "r", anchor, [5, 6, 7, 8, 9, 10], None)
    assert anchor.host_lock_ref == 1
    st.storage_query(s, -1)  # nothing stored beyond: revoked
    host.check_hicache_events(s)
    assert anchor.host_lock_ref == 0 and "r" not in s.storage.ongoing
    ok(s)


def test_abort_leaks_no_host_slot():
    s = prefetch_story("wait_complete")
    st.storage_query(s, -1)
    st.storage_load(s, "r", 2)
    st.release_aborted_request(s, "r")
    ok(s)
    st.storage_load(s, "r", -1)
    host.check_hicache_events(s)
    ok(s)
    assert s.host.pool.available_size() == 64 and not s.storage.prefetches


def test_clear_makes_later_reads_miss_and_terminates_the_transfer():
    s = prefetch_story("wait_complete")
    st.storage_query(s, -1)
    st.storage_load(s, "r", 1)
    assert st.clear_storage(s) is True
    assert st.storage_load(s, "r", -1) == 0
    assert s.storage.ongoing["r"].terminated
    assert st.check_prefetch_progress(s, "r") is True  # ended itself
    assert st.pop_prefetch_loaded_tokens(s, "r") == 2
    host.check_hicache_events(s)
    ok(s)


def test_tenants_are_isolated_by_default_and_share_in_compat_mode():
    for mode, shared in (("namespaced", False), ("compat", True)):
        s = make(storage_key_mode=mode)
        cache_and_store(s, [1, 2, 3, 4, 5, 6], extra_key="tenant-a")
        rules.reset(s)
        st.prefetch_from_storage(s, "r", s.root, [1, 2, 3, 4, 5, 6], "tenant-b")
        st.storage_query(s, -1)
        assert (s.storage.revoke_queue == []) is shared, mode
        if shared:
            st.storage_load(s, "r", -1)
            st.check_prefetch_progress(s, "r")
            # the prefetched pages land in the requesting tenant's namespace
            assert rules.find_node(s, [1, 2, 3, 4, 5, 6], "tenant-b").host_value is not None
        host.check_hicache_events(s)
        ok(s)
    assert namespace_prior("tenant-a", "namespaced") is not None


def test_threshold_capacity_and_bad_inputs():
    s = make(prefetch_threshold=8)
    assert st.prefetch_from_storage(s, "r", s.root, [1, 2, 3, 4, 5, 6], None) == 0
    with pytest.raises(InvalidInput):
        st.prefetch_from_storage(s, 7, s.root, [1] * 8, None)
    assert st.prefetch_from_storage(s, "r", s.root, list(range(1, 9)), None) == 8
    with pytest.raises(InvalidInput):
        st.prefetch_from_storage(s, "r", s.root, list(range(1, 9)), None)
    assert st.storage_load(s, "r", 1) == 0  # not queried yet: nothing to read
    with pytest.raises(InvalidInput):
        st.storage_backup(s, -2)
    with pytest.raises(InvalidInput):
        st.storage_tick(s, -1)
    ok(s)
    small = make(host_slots=32, kv_slots=32)  # no capacity beyond the device pool
    assert st.capacity_limit(small) == 0
    assert st.prefetch_from_storage(small, "r", small.root, list(range(1, 9)), None) == 0


def test_prefetch_below_an_anchor_chains_from_its_last_key():
    s = make(prefetch_stop_policy="wait_complete")
    cache_and_store(s, [1, 2, 3, 4, 5, 6, 7, 8])
    # evict everything to the host, then drop the deeper part from the host
    host.evict(s, 8)
    rules.match_prefix(s, [1, 2, 3, 4, 9, 9], None)  # split [1..4] | [5..8]
    host.evict_host(s, 4)
    ok(s)
    anchor = rules.find_node(s, [1, 2, 3, 4], None)
    st.prefetch_from_storage(s, "r", anchor, [5, 6, 7, 8], None)
    assert s.storage.ongoing["r"].last_key == anchor.page_keys[-1]
    st.storage_query(s, -1)
    st.storage_load(s, "r", -1)
    assert st.check_prefetch_progress(s, "r") is True
    assert rules.find_node(s, [1, 2, 3, 4, 5, 6, 7, 8], None).host_value is not None
    host.check_hicache_events(s)
    ok(s)


def test_config_checks():
    with pytest.raises(ConfigError):
        CacheConfig.from_dict({"storage": True})  # no host tier
    with pytest.raises(ConfigError):
        CacheConfig.from_dict({"host_slots": 8, "storage": True, "prefetch_stop_policy": "x"})
    with pytest.raises(ConfigError):
        CacheConfig.from_dict({"host_slots": 8, "storage": True, "storage_key_mode": "legacy"})
    assert "storage" not in CacheConfig().to_dict()
    assert CacheConfig.from_dict({"host_slots": 8, "storage": True}).to_dict()["storage"] is True


def test_the_invariants_catch_wrong_keys_leaked_slots_and_foreign_loads():
    s = prefetch_story("wait_complete")
    st.storage_query(s, -1)
    st.storage_load(s, "r", 1)
    op = s.storage.ongoing["r"]
    op.loaded[0] = (op.loaded[0][0], (9, 9))  # data not stored under that key
    assert any("[storage-load]" in e for e in sanity_check(s))
    op.loaded[0] = (op.loaded[0][0], (1, 2))
    ok(s)
    op.taken = 2  # two slots fall out of every owner's hands
    assert any("[host-size]" in e for e in sanity_check(s))
    op.taken = 0
    cache_and_store(s, [7, 7, 7, 7])
    node = rules.find_node(s, [7, 7, 7, 7], None)
    node.page_keys = node.page_keys[::-1]
    assert any("[storage-keys]" in e for e in sanity_check(s))


def test_attach_and_detach_are_refused_and_change_nothing():
    s = make()
    cache_and_store(s, [1, 2, 3, 4])
    before = snapshot(s)
    assert st.attach_storage_backend(s)[0] is False
    assert st.detach_storage_backend(s)[0] is False
    assert snapshot(s) == before
