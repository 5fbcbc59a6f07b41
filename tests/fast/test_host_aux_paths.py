"""fast/host_aux.py: the match and lock paths of a host tier with one aux component (SWA or
Mamba) against the general paths they stand for.

Two fast adapters over the same recorded workload in lockstep: one cache runs the paths
``HybridRadixCache`` picks at construction, the other has them switched off before every step.
Every step's observations, snapshots and invariants must agree, and the two Full eviction heaps
must hold the same entries.  The workload's matches, locks and unlocks (the requests'
and the write-through backups' until their acks) must have been answered by the specialised
paths often."""

from __future__ import annotations

import pytest
from test_one_aux import general_paths, heap_entries

from stories import replay_twins
from uniradix import fast
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import make_config, record
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.fast import host_aux
from uniradix.fast.errors import HandleError
from uniradix.fast.hicache import HostDecLockRefParams

_SWITCHED = ("_match_fast", "_inc_lock_fast", "_dec_lock_host", "_write_lock")


def _counted(monkeypatch) -> dict:
    """Count the specialised paths' answers and declines (set before the caches are built:
    ``_pick_fast_paths`` takes the functions then)."""
    seen = {"inc": 0, "inc_declined": 0, "dec": 0, "dec_declined": 0, "write": 0,
            "write_declined": 0, "match": 0, "match_declined": 0}

    def wrap(name, fn):
        def call(*args):
            out = fn(*args)
            seen[name if out is not None else name + "_declined"] += 1
            return out
        return call
    monkeypatch.setattr(host_aux, "inc_lock_host_aux", wrap("inc", host_aux.inc_lock_host_aux))
    monkeypatch.setattr(host_aux, "dec_lock_host_aux", wrap("dec", host_aux.dec_lock_host_aux))
    monkeypatch.setattr(host_aux, "write_lock", wrap("write", host_aux.write_lock))
    monkeypatch.setattr(host_aux, "match_host_aux", wrap("match", host_aux.match_host_aux))
    return seen


@pytest.mark.parametrize("name,seed", [("host-swa-wt-p1", 11), ("host-swa-wb-p1", 12),
                                       ("host-swa-wt-p4", 13), ("host-swa-wb-p4", 14),
                                       ("host-mamba-wt-p1", 15), ("host-mamba-wb-p1", 16),
                                       ("host-mamba-wt-p4", 17), ("host-mamba-wb-p4", 18)])
def test_host_aux_locks_equal_the_general_paths(name, seed, monkeypatch):
    config = make_config(name, seed)
    steps = record(make_adapter("fast", config), config, seed, 300, check_violations=False)
    seen = _counted(monkeypatch)
    special, general = make_adapter("fast", config), general_paths(make_adapter("fast", config), _SWITCHED)
    assert special.cache._inc_lock_fast is not None and special.cache._dec_lock_host is not None
    ls = Lockstep([special, general], ["host-aux paths", "general paths"], events=False)

    def same_heaps(step):
        assert heap_entries(special.cache) == heap_entries(general.cache), step

    ops = set(replay_twins(ls, steps, same_heaps))
    assert {"lock", "unlock", "insert", "evict"} <= ops, ops
    assert seen["inc"] > 20 and seen["dec"] > 20 and seen["match"] > 30, seen
    if "-wt-" in name:  # (write-back's backups at eviction take no lock)
        assert seen["write"] > 10, seen


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_host_aux_locks_decline_where_the_host_tier_counts(aux):
    """An evicted node's lock, an unlock with other params, a disabled cache: declined (None,
    nothing changed); a second unlock of a device lock is refused as the general path refuses
    it, nothing changed."""
    config = make_config(f"host-{aux}-wt-p1", 1)
    adapter = make_adapter("fast", config)
    cache = adapter.cache
    root = cache.root_node
    alloc = cache.token_to_kv_pool_allocator
    params = fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4]), value=alloc.alloc(4))
    if aux == "mamba":
        params.mamba_value = cache.mamba_allocator.alloc(1)
    cache.insert(params)
    cache.writing_check(True)
    node = cache.find_node(fast.RadixKey([1, 2, 3, 4]))
    assert node.value is not None and node.lock_ref == 0
    lock = host_aux.inc_lock_host_aux(cache, node)
    assert lock is not None and lock.anchor is node and lock.delta == 4
    dec = lock.to_dec_params()
    assert host_aux.dec_lock_host_aux(cache, node, fast.DecLockRefParams()) is None
    assert host_aux.dec_lock_host_aux(cache, node, HostDecLockRefParams(anchor=root)) is None
    # (the general path undoes an anchored lock from the anchor, skip sets or not)
    skipping = HostDecLockRefParams(anchor=node, skip_lock_node_ids={0: {node.id}})
    assert host_aux.dec_lock_host_aux(cache, node, skipping) is None
    assert host_aux.dec_lock_host_aux(cache, node, dec).delta == 4
    with pytest.raises(HandleError, match="not locked"):
        cache.dec_lock_ref(node, dec)
    assert node.lock_ref == 0 and cache.violations() == []
    cache.evict(fast.EvictParams(num_tokens=4))
    assert node.value is None and node.host_value is not None  # evicted to the host
    assert host_aux.inc_lock_host_aux(cache, node) is None
    general = cache.inc_lock_ref(node)  # (the general path: anchored at the root)
    assert general.anchor is root
    assert host_aux.dec_lock_host_aux(cache, node, general.to_dec_params()) is None
    cache.dec_lock_ref(node, general.to_dec_params())
    cache.disable = True
    assert host_aux.inc_lock_host_aux(cache, root) is None
