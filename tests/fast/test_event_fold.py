"""uniradix.fast.event_fold: what a router learns from a KV event stream."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from uniradix.fast.event_fold import Anomaly, FoldError, RouterView, StoredBlock
from uniradix.fast.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def stored(hashes, parent=None, tokens=None, size=2, medium="GPU"):
    hashes = list(hashes)
    tokens = list(range(size * len(hashes))) if tokens is None else list(tokens)
    return BlockStored(hashes, parent, tokens, size, None, medium)


def test_stores_and_removes_per_medium():
    v = RouterView(strict=True)
    v.apply(stored([1, 2, 3]))
    v.apply(stored([1], medium="CPU_PINNED"))
    v.apply(BlockRemoved([3], "GPU"))
    assert v.cached("GPU") == {1, 2}
    assert v.cached("CPU_PINNED") == {1}
    assert v.snapshot() == {"GPU": {1, 2}, "CPU_PINNED": {1}}
    assert len(v) == 3


def test_a_multi_block_store_chains_parents_and_splits_tokens():
    v = RouterView(strict=True)
    v.apply(stored([10], tokens=[1, 2]))
    v.apply(stored([11, 12], parent=10, tokens=[3, 4, 5, 6]))
    assert v.block("GPU", 11) == StoredBlock(10, (3, 4), None)
    assert v.block("GPU", 12) == StoredBlock(11, (5, 6), None)
    assert v.block("CPU_PINNED", 11) is None


def test_all_blocks_cleared_empties_every_medium():
    v = RouterView()
    v.apply(stored([1]))
    v.apply(stored([1], medium="CPU_PINNED"))
    v.apply(AllBlocksCleared())
    assert v.snapshot() == {} and len(v) == 0 and v.anomalies == []


def test_a_missing_medium_means_the_default_one():
    v = RouterView(default_medium="GPU")
    v.apply(BlockStored([5], None, [1], 1, None))
    assert v.cached("GPU") == {5}
    v.apply(BlockRemoved([5]))
    assert v.cached("GPU") == frozenset()


@pytest.mark.parametrize("events, kind", [
    ([stored([1]), stored([1])], "duplicate-store"),
    ([BlockRemoved([4], "GPU")], "unknown-remove"),
    ([stored([2], parent=1)], "orphan-store"),
    ([stored([1], medium="CPU_PINNED"), stored([2], parent=1)], "orphan-store"),
    ([BlockStored([1, 2], None, [1, 2, 3], 2, None, "GPU")], "bad-store"),
    ([object()], "unknown-event"),
])
def test_anomalies_are_recorded_and_strict_mode_refuses_them_unchanged(events, kind):
    v = RouterView()
    for e in events:
        v.apply(e)
    assert [a.kind for a in v.anomalies] == [kind]
    strict = RouterView(strict=True)
    for e in events[:-1]:
        strict.apply(e)
    before = strict.snapshot()
    with pytest.raises(FoldError, match=kind):
        strict.apply(events[-1])
    assert strict.snapshot() == before


def test_a_host_block_may_follow_a_device_only_block_but_not_the_reverse():
    # write-back backs a leaf up to the host while its parent stays on the device only
    v = RouterView(strict=True)
    v.apply(stored([1]))
    v.apply(stored([2], parent=1, medium="CPU_PINNED"))
    assert v.cached("CPU_PINNED") == {2} and not v.anomalies
    w = RouterView()
    w.apply(stored([1], medium="CPU_PINNED"))
    w.apply(stored([2], parent=1))
    assert [a.kind for a in w.anomalies] == ["orphan-store"]


def test_sequence_numbers_skip_replayed_batches_and_report_gaps():
    v = RouterView()
    assert v.apply_batch(0, [stored([1])])
    assert v.apply_batch(1, [stored([2], parent=1)])
    assert not v.apply_batch(1, [stored([2], parent=1)])  # replay overlap: applied once
    assert v.anomalies == []
    assert v.apply_batch(5, [BlockRemoved([2])])
    assert v.anomalies == [Anomaly("seq-gap", 5, None, None, "batches 2..4 missing")]
    assert v.next_seq == 6 and v.cached("GPU") == {1}
    strict = RouterView(strict=True)
    strict.apply_batch(0, [stored([1])])
    with pytest.raises(FoldError, match="seq-gap"):
        strict.apply_batch(2, [stored([2])])
    assert strict.next_seq == 1 and strict.cached("GPU") == {1}


def test_the_fold_reproduces_a_model_cache_at_every_step():
    """A toy cache stores and removes pages on two media at random and emits events as the cache
    will; after every step the fold equals the cache's own page sets."""
    rng = random.Random(17)
    truth: dict[str, set[int]] = {"GPU": set(), "CPU_PINNED": set()}
    v = RouterView(strict=True)
    next_hash = 1
    for seq in range(2_000):
        events = []
        for _ in range(rng.randint(1, 4)):
            medium = rng.choice(("GPU", "CPU_PINNED"))
            op = rng.random()
            if op < 0.5:
                parent = rng.choice(sorted(truth[medium])) if truth[medium] and rng.random() < .7 \
                    else None
                hashes = list(range(next_hash, next_hash + rng.randint(1, 3)))
                next_hash += len(hashes)
                events.append(stored(hashes, parent=parent, medium=medium))
                truth[medium].update(hashes)
            elif op < 0.97 and truth[medium]:
                gone = rng.sample(sorted(truth[medium]), min(len(truth[medium]),
                                                             rng.randint(1, 3)))
                events.append(BlockRemoved(gone, medium))
                truth[medium].difference_update(gone)
            elif op >= 0.97:
                events.append(AllBlocksCleared())
                for s in truth.values():
                    s.clear()
        v.apply_batch(seq, events)
        assert v.snapshot() == {m: frozenset(s) for m, s in truth.items() if s}, f"step {seq}"


@dataclass
class BlockStoredLike:  # another producer's class with the same name folds the same way
    block_hashes: list
    parent_block_hash: int | None
    token_ids: list
    block_size: int
    lora_id: int | None
    medium: str | None = None


def test_events_are_told_apart_by_class_name():
    BlockStoredLike.__name__ = "BlockStored"
    v = RouterView(strict=True)
    v.apply(BlockStoredLike([3], None, [1], 1, None, "GPU"))
    assert v.cached("GPU") == {3}
