"""The fast path under a process-wide default device (``torch.set_default_device`` or a ``with
torch.device(...)`` block, which SGLang's model loading uses): the cache's own tensors stay
on the CPU, as they are without one.  The C core writes through the data pointer of the
tensors it makes; when it made them with ``torch.empty`` they followed the default device,
and an evict under ``with torch.device("meta")`` crashed the process (a write through a
null pointer).  Here every public call of one twin runs inside ``torch.device("meta")`` (a
device with no memory at all: anything the cache makes there and reads fails or crashes);
the other twin runs plainly; their observations and states must agree step by step."""

from __future__ import annotations

import functools

import pytest

from stories import replay_twins

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import CONFIG_NAMES, make_config, record  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402

# what the adapters call on a cache (the scheduler's calls, and the host tier's)
_PUBLIC = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref",
           "cache_finished_req", "cache_unfinished_req", "init_load_back", "evict_host",
           "writing_check", "loading_check", "check_hicache_events", "ready_to_load_host_cache",
           "inc_host_lock_ref", "dec_host_lock_ref", "flush_write_through_acks",
           "evictable_size", "protected_size", "total_size", "sanity_check")


def _under_meta(cache) -> int:
    """Wrap ``cache``'s public methods (as instance attributes) so each call runs inside
    ``torch.device("meta")``; returns how many were wrapped."""
    wrapped = 0
    for name in _PUBLIC:
        method = getattr(cache, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def call(*args, _m=method, **kwargs):
            with torch.device("meta"):
                return _m(*args, **kwargs)
        setattr(cache, name, call)
        wrapped += 1
    return wrapped


def _state(cache) -> list:
    out = []
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        value = node.value
        out.append((tuple(node.key), None if value is None else
                    (str(value.device), value.tolist()), node.lock_ref))
        stack.extend(sorted(node.children.values(), key=lambda n: tuple(n.key)))
    return out


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_a_default_device_changes_nothing(name):
    seed = 41
    config = make_config(name, seed)
    steps = record(make_adapter("fast", config), config, seed, 800, check_violations=False)
    meta, plain = make_adapter("fast", config), make_adapter("fast", config)
    ls = Lockstep([meta, plain], ["under torch.device('meta')", "plain"], events=False)
    ls.prime()
    assert _under_meta(meta.cache) >= 8

    def same(step):
        assert _state(meta.cache) == _state(plain.cache), step

    ops = replay_twins(ls, steps, same)
    assert ops.count("insert") > 20, ops.count("insert")


def test_the_c_core_makes_cpu_tensors_under_a_default_device():
    """The direct case: a Full cache on the C core, the evict whose joined frees crashed."""
    from test_fast_api import key, make_cache
    cache, pool = make_cache(slots=64)
    values = [pool.alloc(3), pool.alloc(3), pool.alloc(2), pool.alloc(4)]
    cache.insert(fast.InsertParams(key=key([1, 2, 3]), value=values[0]))
    with torch.device("meta"):
        hit = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 4]))).device_indices
        cache.insert(fast.InsertParams(key=key([5, 6, 7]), value=values[1]))
        cache.insert(fast.InsertParams(key=key([8, 9]), value=values[2]))
        cache.insert(fast.InsertParams(key=key([1, 2, 3, 4]), value=values[3]))
        evicted = cache.evict(fast.EvictParams(num_tokens=8)).num_tokens_evicted
    assert hit.device.type == "cpu" and hit.tolist() == values[0].tolist()
    assert evicted >= 8
    cache.sanity_check()


def test_the_host_slot_allocator_hands_out_cpu_slots_under_a_default_device():
    from uniradix.fast.tiers.host import HostSlotAllocator
    a = HostSlotAllocator(64, 4)
    with torch.device("meta"):
        got = [a.alloc(0), a.alloc(8), a.alloc(12)]
        a.free(got[1])
        got.append(a.alloc(16))  # two runs joined: a cat of two ranges
    assert all(t.device.type == "cpu" for t in got)
    assert got[1].tolist() == list(range(4, 12)) and got[3].tolist()[:8] == list(range(4, 12))
