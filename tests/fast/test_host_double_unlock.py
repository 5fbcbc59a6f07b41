"""A caller's second unlock of one lock while a host transfer holds a lock on the same path
(fast/tiers/host.py ``HostTier.check_caller_unlock``).  Without a transfer in flight the lock
counts alone refuse it.  With a write-through backup or a load back in flight they do not: the
transfer's lock keeps the count above zero, so the second unlock used to take it.  The node was
then evictable while its copy was in flight, and the ack's own unlock failed later, far from
the caller's mistake.  Now the second unlock is refused (``HandleError``) with nothing changed,
the transfer's ack releases its own lock, and valid unlocks with transfers in flight go
through.  This holds on the C core's host paths and on the Python ones (``_core`` off)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_host_fast_paths import _cache  # noqa: E402
from test_host_lock_twins import core_as  # noqa: E402

from uniradix import fast  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.errors import HandleError  # noqa: E402

CORES = ["c", "python"] if _core is not None else ["python"]


def _state(cache) -> tuple:
    """What an unlock changes: every node's lock count, the counters, the heap's length."""
    locks = []  # (the root's own count is upstream's constant 1: left out)
    stack = list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        locks.append((n.id, n.lock_ref))
        stack.extend(n.children.values())
    return (sorted(locks), cache.evictable_size(), cache.protected_size(),
            len(cache._leaf_heap.entries))


def _insert(cache, alloc, tokens: list[int]) -> None:
    slots = alloc.alloc(len(tokens))
    cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=slots))


def _node(cache, tokens: list[int]):
    return cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens))).last_device_node


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("page", [1, 4])
def test_second_unlock_with_a_write_in_flight_is_refused(core, page):
    cache, alloc = _cache("write_through", "manual", page)
    with core_as(_core if core == "c" else None):
        toks = list(range(1, 2 * page + 1))
        _insert(cache, alloc, toks)
        node = _node(cache, toks)  # (a hit: write-through backs the node up, ack pending)
        assert cache.tier.ongoing_write_through, "no write in flight"
        params = cache.inc_lock_ref(node).to_dec_params()
        cache.dec_lock_ref(node, params)
        before = _state(cache)
        with pytest.raises(HandleError, match="in-flight host transfers"):
            cache.dec_lock_ref(node, params)
        assert _state(cache) == before  # nothing changed
        with pytest.raises(HandleError):  # without the params: the same
            cache.dec_lock_ref(node)
        assert _state(cache) == before
        assert node.lock_ref > 0  # the write still holds its lock: not evictable
        assert cache.evict(fast.EvictParams(num_tokens=len(toks))).num_tokens_evicted == 0
        cache.tier.controller.complete(writes=-1, loads=0)
        cache.check_hicache_events()  # the ack releases its own lock: no error
        assert all(lock == 0 for _, lock in _state(cache)[0])
        assert cache.evictable_size() == len(toks)


@pytest.mark.parametrize("core", CORES)
def test_valid_unlocks_with_writes_in_flight_go_through(core):
    """Two callers' locks on one path and a child's write in flight: each caller's unlock goes
    through (the count check walks the transfers only when the anchor's count is small)."""
    cache, alloc = _cache("write_through", "manual", 1)
    with core_as(_core if core == "c" else None):
        _insert(cache, alloc, [1, 2, 3])
        _insert(cache, alloc, [1, 2, 3, 4, 5])
        upper, lower = _node(cache, [1, 2, 3]), _node(cache, [1, 2, 3, 4, 5])
        assert cache.tier.ongoing_write_through
        locks = [(n, cache.inc_lock_ref(n).to_dec_params()) for n in (upper, upper, lower)]
        for n, p in locks:
            cache.dec_lock_ref(n, p)
        with pytest.raises(HandleError):  # one more on the upper node: none of the callers'
            cache.dec_lock_ref(upper, locks[0][1])
        cache.tier.controller.complete(writes=-1, loads=0)
        cache.check_hicache_events()
        assert all(lock == 0 for _, lock in _state(cache)[0])


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_second_unlock_with_a_write_in_flight_is_refused_with_an_aux_component(aux):
    """The same over a host tier with SWA or Mamba (the composed cache's host paths,
    fast/host_aux.py): refused with every lock count and the aux records unchanged, and the
    ack then releases the write's lock."""
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.explore.driver import make_config

    cache = make_adapter("fast", make_config(f"host-{aux}-wt-p1", 1)).cache
    alloc = cache.token_to_kv_pool_allocator
    params = fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4]), value=alloc.alloc(4))
    if aux == "mamba":
        params.mamba_value = cache.mamba_allocator.alloc(1)
    cache.insert(params)
    cache.writing_check(True)  # (the insert's own backup, if any, done)
    node = _node(cache, [1, 2, 3, 4])  # a hit: a write-through backup if none is there yet
    if not cache.tier.ongoing_write_through:  # (backed up already: a child to back up)
        params = fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4, 5, 6]),
                                   value=torch.cat([node.value, alloc.alloc(2)]),
                                   prev_prefix_len=4)
        if aux == "mamba":
            params.mamba_value = cache.mamba_allocator.alloc(1)
        cache.insert(params)
        node = _node(cache, [1, 2, 3, 4, 5, 6])
    assert cache.tier.ongoing_write_through, "no write in flight"
    lock = cache.inc_lock_ref(node).to_dec_params()
    cache.dec_lock_ref(node, lock)
    before = (_state(cache), cache.violations())
    with pytest.raises(HandleError, match="in-flight host transfers"):
        cache.dec_lock_ref(node, lock)
    assert (_state(cache), cache.violations()) == before
    cache.writing_check(True)
    assert all(count == 0 for _, count in _state(cache)[0]) and cache.violations() == []
