"""fast's host slot allocator (fast/tiers/host.py ``HostSlotAllocator``, a heap of free page
runs) hands out exactly the slots a heap of single pages, lowest first, would: the choice the
spec's pools make (spec/world.py), which the lockstep runs and the corpora compare.  And the SWA
host list's eviction (fast/components/swa.py ``evict_swa_host``) takes the records a walk over a
copy of the list would, and so does the Mamba host list's (fast/components/mamba.py
``evict_host_states``): both are ``AuxComponent.evict_host_oldest`` (fast/components/)."""

from __future__ import annotations

import heapq
import random
import types

import pytest
import torch

from uniradix.fast.components import AuxComponent
from uniradix.fast.components.mamba import MambaComponent
from uniradix.fast.components.swa import SwaComponent
from uniradix.fast.hicache import HostSlotAllocator


class PageHeap:
    """The reference: every free page on a heap, lowest first."""

    def __init__(self, slots: int, ps: int) -> None:
        self.ps = ps
        self.free = list(range(1, slots // ps + 1))

    def available_size(self) -> int:
        return len(self.free) * self.ps

    def alloc(self, n: int) -> list[int] | None:
        ps = self.ps
        if n % ps or n // ps > len(self.free):
            return None
        pages = [heapq.heappop(self.free) for _ in range(n // ps)]
        return [p * ps + j for p in pages for j in range(ps)]

    def free_slots(self, slots: list[int]) -> None:
        for s in slots[::self.ps]:
            heapq.heappush(self.free, s // self.ps)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_same_slots_as_a_page_heap(ps: int, seed: int) -> None:
    rng = random.Random(seed)
    slots = 4096 * ps
    fast, ref = HostSlotAllocator(slots, ps), PageHeap(slots, ps)
    held: list[list[int]] = []
    for step in range(600):
        if held and rng.random() < 0.45:
            # free one or several holdings at once, shuffled (long ones take the torch path)
            k = rng.randint(1, min(4, len(held)))
            out = [held.pop(rng.randrange(len(held))) for _ in range(k)]
            flat = [s for h in out for s in h]
            pages = [flat[i:i + ps] for i in range(0, len(flat), ps)]
            rng.shuffle(pages)
            flat = [s for p in pages for s in p]
            ref.free_slots(flat)
            if rng.random() < 0.5:
                fast.free(torch.tensor(flat, dtype=torch.int64))
            else:
                fast.free(flat)
        else:
            n = rng.choice([0, ps, 3 * ps, 17 * ps, 200 * ps, 5 * ps + (1 if ps > 1 else 0)])
            got, want = fast.alloc(n), ref.alloc(n)
            assert (got is None) == (want is None), (step, n)
            if got is not None:
                assert got.dtype == torch.int64
                assert got.tolist() == want, (step, n)
                if want:
                    held.append(want)
        assert fast.available_size() == ref.available_size(), step
    fast.clear()
    assert fast.available_size() == slots  # pages 1..slots // ps (page 0 never handed out)
    assert fast.alloc(2 * ps).tolist() == list(range(ps, 3 * ps))


def test_refuses_what_it_cannot_give() -> None:
    alloc = HostSlotAllocator(8 * 4, 4)
    assert alloc.alloc(3) is None  # not whole pages
    assert alloc.alloc(9 * 4) is None  # 8 pages: 1..8 (page 0 is never handed out)
    assert alloc.alloc(8 * 4).tolist() == list(range(4, 36))
    assert alloc.available_size() == 0 and alloc.alloc(4) is None
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 0
    with pytest.raises(Exception, match="multiple of page_size"):
        HostSlotAllocator(10, 4)


class _Rec:
    def __init__(self, name: str, units: int, stale: bool = False, detached: bool = False,
                 hostless: bool = False) -> None:
        self.name, self.units = name, units
        self.node = types.SimpleNamespace(parent=None if stale or detached else object())
        self.host_value = None if stale or hostless else units


def _fake(cls: type, recs: list, keep: frozenset = frozenset()) -> types.SimpleNamespace:
    """What ``cls.evict_host_oldest`` reads: the host list, the component's liveness rule
    (``cls._host_rec_live``) and how one record is freed (taken off the list unless its name
    is in ``keep``), logging the order."""
    taken: list[str] = []
    fake = types.SimpleNamespace(host_lru=dict.fromkeys(recs), taken=taken)

    def take(rec: _Rec) -> int:
        taken.append(rec.name)
        if rec.name not in keep:
            del fake.host_lru[rec]
        return rec.units
    fake._evict_host_rec = take
    fake._host_rec_live = lambda rec: cls._host_rec_live(fake, rec)
    fake._evict_host_walk = (
        lambda num, after: AuxComponent._evict_host_walk(fake, num, after))
    return fake


def _reference_order(cls: type, recs: list, num: int) -> list[str]:
    """The walk over a copy of the whole list that ``evict_host_oldest`` replaced: SWA's
    skipped records out of the tree or without host data, Mamba's those out of the tree or
    off the list (none leaves it here but the ones taken)."""
    out, freed = [], 0
    for rec in recs:
        if freed >= num:
            break
        if rec.node.parent is None or (cls is SwaComponent and rec.host_value is None):
            continue
        out.append(rec.name)
        freed += rec.units
    return out


@pytest.mark.parametrize("cls", [SwaComponent, MambaComponent])
@pytest.mark.parametrize("num", [0, 1, 4, 5, 9, 100])
def test_evict_host_oldest_takes_the_oldest_records_as_the_list_copy_did(cls: type,
                                                                        num: int) -> None:
    recs = [_Rec("a", 3), _Rec("b", 2), _Rec("c", 4), _Rec("d", 1)]
    fake = _fake(cls, recs)
    assert AuxComponent.evict_host_oldest(fake, num) == sum(
        r.units for r in recs if r.name in _reference_order(cls, recs, num))
    assert fake.taken == _reference_order(cls, recs, num)
    # a stale record first (never, by the list's invariant), or one left listed after it was
    # taken: the same records in the same order all the same
    for first in (_Rec("s", 5, stale=True), _Rec("x", 5, detached=True),
                  _Rec("h", 5, hostless=True)):
        recs = [first, _Rec("a", 3), _Rec("b", 2), _Rec("c", 4)]
        fake = _fake(cls, recs)
        AuxComponent.evict_host_oldest(fake, num)
        assert fake.taken == _reference_order(cls, recs, num)
    recs = [_Rec("a", 3), _Rec("b", 2), _Rec("c", 4)]
    fake = _fake(cls, recs, keep=frozenset({"a"}))
    AuxComponent.evict_host_oldest(fake, num)
    assert fake.taken == _reference_order(cls, recs, num)


def test_both_host_lists_are_evicted_through_evict_host_oldest() -> None:
    """``evict_swa_host`` and ``evict_host_states`` are the shared driver (no copy of the
    whole list of their own)."""
    for cls, name in ((SwaComponent, "evict_swa_host"), (MambaComponent, "evict_host_states")):
        seen: list = []
        fake = types.SimpleNamespace(evict_host_oldest=lambda num, seen=seen: seen.append(num) or 7)
        assert getattr(cls, name)(fake, 3) == 7 and seen == [3]
