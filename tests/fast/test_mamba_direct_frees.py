"""The Mamba fast paths' frees written by the C core directly (fast/one_aux.py: an insert's
duplicates at its end, an evict's KV slots then its states, through ``_core.native_release``
without fast/frees.py's ``release`` in front): over sglang's own ``TokenToKVPoolAllocator``
and ``MambaSlotAllocator`` a Mamba-only cache on the fast paths leaves both free lists, after
every call, exactly as a twin cache on the general paths whose allocators free through
sglang's own ``free`` (an instance ``free`` that is not an observer: no native write there),
with the same answers.  No slot is lost or freed twice: each list always holds what neither
the tree nor the test holds.  Over allocators the C core does not write (a plain list
allocator here, and without the C core) the same paths fall back to fast/frees.py's
``release``: the same ``free`` calls, with the same slots, as the general paths make."""

from __future__ import annotations

import random
import types

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.fast.hybrid import FAST_PATHS  # noqa: E402

KV_SLOTS, STATES = 96, 12


def _classes():
    """sglang's two allocator classes, or a skip where sglang does not import."""
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        load_upstream()
        from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return TokenToKVPoolAllocator, MambaSlotAllocator


class ListAllocator:
    """A plain allocator (no class the C core writes, no slot ledger): a free list that
    ``free`` appends to, and a log of every ``free`` call's slots."""

    def __init__(self, slots: int) -> None:
        self.free_slots = torch.arange(1, slots + 1, dtype=torch.int64)
        self.log: list = []

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n].clone(), self.free_slots[n:]
        return out

    def free(self, index) -> None:
        self.log.append(index.tolist())
        self.free_slots = torch.cat((self.free_slots, index))

    @property
    def free_pages(self):
        return self.free_slots


def _cache(general: bool, events: bool, kind: str):
    """A Full + Mamba cache over fresh allocators (``kind`` "sglang": sglang's, else
    :class:`ListAllocator`), no slot ledger; ``general``: its fast paths off, and over
    sglang's allocators sglang's ``free`` on each instance (every free is sglang's own)."""
    if kind == "sglang":
        token_cls, mamba_cls = _classes()
        kv = token_cls(KV_SLOTS, torch.float16, "cpu", None, False)
        states = mamba_cls(STATES, "cpu")
    else:
        kv, states = ListAllocator(KV_SLOTS), ListAllocator(STATES)
    if general and kind == "sglang":
        for alloc in (kv, states):
            own = type(alloc).free
            alloc.free = types.MethodType(lambda self, idx, own=own: own(self, idx), alloc)
    pool = types.SimpleNamespace(mamba_allocator=states, mamba_pool=None)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=kv, page_size=1,
        tree_components=("full", "mamba"), enable_kv_cache_events=events,
        validate_slots=False))
    if general:
        for name in FAST_PATHS:
            setattr(cache, name, None)
    else:
        assert all(getattr(cache, n) is not None for n in FAST_PATHS)
    return cache, kv, states


def _lists(kv, states):
    return kv.free_pages.tolist(), states.free_slots.tolist()


SGLANG = pytest.mark.upstream


@pytest.mark.parametrize("kind,seed,events", [
    pytest.param("sglang", 1, False, marks=SGLANG), pytest.param("sglang", 2, False, marks=SGLANG),
    pytest.param("sglang", 3, True, marks=SGLANG), ("list", 4, False), ("list", 5, True)])
def test_direct_frees_equal_the_general_paths(kind, seed, events):
    rng = random.Random(seed)
    one, kv1, st1 = _cache(False, events, kind)
    two, kv2, st2 = _cache(True, events, kind)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
    dups = evicts = 0
    for _ in range(400):
        if rng.random() < 0.25:  # an evict of Full units and states
            want, states_want = rng.randrange(0, 24), rng.randrange(0, 4)
            r1 = one.evict(fast.EvictParams(num_tokens=want, mamba_num=states_want))
            r2 = two.evict(fast.EvictParams(num_tokens=want, mamba_num=states_want))
            assert (r1.num_tokens_evicted, r1.mamba_num_evicted) == \
                (r2.num_tokens_evicted, r2.mamba_num_evicted)
            evicts += r1.num_tokens_evicted > 0 and r1.mamba_num_evicted > 0
        else:  # an insert of fresh slots over a shared prefix (the shared part: duplicates)
            toks = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
            n = len(toks)
            if kv1.available_size() < n or st1.available_size() < 1:
                one.evict(fast.EvictParams(num_tokens=n, mamba_num=1))
                two.evict(fast.EvictParams(num_tokens=n, mamba_num=1))
                if kv1.available_size() < n or st1.available_size() < 1:
                    continue
            outs = []
            for cache, kv, st in ((one, kv1, st1), (two, kv2, st2)):
                value, state = kv.alloc(n), st.alloc(1)
                res = cache.insert(fast.InsertParams(
                    key=fast.RadixKey(toks), value=value, mamba_value=state.reshape(1).clone(),
                    prev_prefix_len=0))
                if res.mamba_exist:  # the tree kept its own state: the caller frees this one
                    st.free(state.reshape(1))
                outs.append((res.prefix_len, res.mamba_exist, value.tolist()))
            assert outs[0] == outs[1]
            dups += outs[0][0] > 0
        assert _lists(kv1, st1) == _lists(kv2, st2)
        assert (one._evictable, one._protected, one.mamba.evictable, one.mamba.protected) == \
            (two._evictable, two._protected, two.mamba.evictable, two.mamba.protected)
        assert _shape(one) == _shape(two)
        held = sum(len(x.value) for x in _nodes(one))
        assert held + kv1.available_size() == KV_SLOTS  # nothing lost, nothing twice
        assert len(set(kv1.free_pages.tolist())) == kv1.available_size()
        assert len(set(st1.free_slots.tolist())) == st1.available_size()
        assert sum(x.aux[0].value is not None for x in _nodes(one)) + st1.available_size() \
            == STATES
        if events:
            assert one.take_events() == two.take_events()
        if kind == "list":  # the same free calls with the same slots
            assert (kv1.log, st1.log) == (kv2.log, st2.log)
    assert dups > 20 and evicts > 5, (dups, evicts)


def _nodes(cache):
    """Every node of the tree but the root."""
    out, todo = [], list(cache.root_node.children.values())
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children.values())
    return out


def _shape(cache):
    """The tree as (the node's keys from the top, its slots, its state), sorted."""
    def path(node):
        out = []
        while node.parent is not None:
            out.append(tuple(node.key))
            node = node.parent
        return tuple(reversed(out))
    return sorted(((path(x), x.value.tolist(), None if x.aux[0].value is None
                   else x.aux[0].value.tolist()) for x in _nodes(cache)), key=repr)


KEYS = [  # objects of sglang's RadixKey shape: (token_ids, extra_key, is_bigram)
    ([1, 2, 3, 4], None, False), ([1, 2, 3, 4], "ns", False), ([3, 1], None, False),
    ([1, True, 3], None, False), ([1, "a", 3], None, False), ([1, 2 ** 70], None, False),
    ([1, 2.0], None, False), ([1, 2, 3], 5, False), ([1, 2, 3], None, 1),
    ((1, 2, 3), None, False), ([], None, False), ([1, 2, 3], None, True)]


def _outcome(fn):
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return type(e).__name__, str(e)
    return _plain(r)


def _plain(r):
    """A result's fields that compare across two caches (no node objects)."""
    out = {}
    for name in ("prefix_len", "total_len", "mamba_exist", "mamba_branching_seqlen"):
        if hasattr(r, name):
            out[name] = getattr(r, name)
    idx = getattr(r, "device_indices", None)
    if idx is not None:
        out["device_indices"] = idx.tolist()
    return out


@pytest.mark.parametrize("toks,ek,bigram", KEYS)
def test_sglang_shaped_keys_as_the_general_paths(toks, ek, bigram):
    """The fast paths read a key of sglang's shape without building uniradix's ``RadixKey``
    (fast/one_aux.py ``_key_parts``): the same answers and the same errors as the general
    paths, which convert it (fast/compat.py ``as_radix_key``)."""
    one, kv1, st1 = _cache(False, False, "list")
    two, kv2, st2 = _cache(True, False, "list")
    seed = fast.RadixKey([1, 2, 3])
    for cache, kv, st in ((one, kv1, st1), (two, kv2, st2)):  # something to match against
        cache.insert(fast.InsertParams(key=seed, value=kv.alloc(3), mamba_value=st.alloc(1)))
    key = types.SimpleNamespace(token_ids=toks, extra_key=ek, is_bigram=bigram)
    n = len(toks)
    got = []
    for cache, kv, st in ((one, kv1, st1), (two, kv2, st2)):
        m = _outcome(lambda c=cache: c.match_prefix(fast.MatchPrefixParams(key=key)))
        i = _outcome(lambda c=cache, kv=kv, st=st: c.insert(fast.InsertParams(
            key=key, value=kv.alloc(n) if n else torch.empty(0, dtype=torch.int64),
            mamba_value=st.alloc(1))))
        got.append((m, i, _lists(kv, st), _shape(cache)))
    assert got[0] == got[1]
