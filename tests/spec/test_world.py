"""The environment's PagedPool (TRACE.md, "Pools"): page 0 reserved, lowest-free-first,
page-granular, all-or-nothing frees, a sorted freed log."""

from __future__ import annotations

import pytest

from uniradix.spec.errors import AllocatorError, InvalidInput
from uniradix.spec.world import PagedPool


def test_page_zero_is_reserved():
    pool = PagedPool(32, 4)
    # usable pages are 1..8; page 1 is slots 4..7, page 2 is slots 8..11
    assert pool.available_size() == 32
    assert pool.alloc(8) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert pool.available_size() == 24
    assert not pool.is_allocated(0) and not pool.is_allocated(3)
    assert pool.is_allocated(4) and pool.is_allocated(11) and not pool.is_allocated(12)
    assert PagedPool(4, 1).alloc(4) == [1, 2, 3, 4]


def test_lowest_first_across_frees():
    pool = PagedPool(32, 4)
    assert pool.alloc(16) == list(range(4, 20))  # pages 1..4
    pool.free([12, 13, 14, 15])  # page 3
    # page 3 is the lowest free page now, then page 5 (slots 20..23)
    assert pool.alloc(8) == [12, 13, 14, 15, 20, 21, 22, 23]
    pool.free([8, 9, 10, 11, 4, 5, 6, 7])  # pages 2 and 1, given in any order
    assert pool.alloc(4) == [4, 5, 6, 7]
    assert pool.alloc(4) == [8, 9, 10, 11]
    assert pool.alloc(4) == [24, 25, 26, 27]


def test_lowest_first_page_size_1():
    pool = PagedPool(8)
    assert pool.alloc(5) == [1, 2, 3, 4, 5]
    pool.free([4])
    pool.free([2])
    assert pool.alloc(3) == [2, 4, 6]


def test_take_freed_is_sorted_and_clears():
    pool = PagedPool(16)
    assert pool.alloc(10) == list(range(1, 11))
    pool.free([9, 7])
    pool.free([3])
    pool.free([10, 1])
    assert pool.take_freed() == [1, 3, 7, 9, 10]
    assert pool.take_freed() == []


def test_free_is_all_or_nothing():
    pool = PagedPool(16, 4)
    assert pool.alloc(8) == [4, 5, 6, 7, 8, 9, 10, 11]
    cases = [
        [4, 5, 6, 7, 12, 13, 14, 15],  # page 3 is not allocated
        [4, 5, 6, 7, 8, 9],  # half of page 2
        [4, 5, 6, 7, 4],  # slot 4 twice
        [4, 5, 6, 7, 0, 1, 2, 3],  # page 0 is reserved, never allocated
        [4, 5, 6, 7, 100, 101, 102, 103],  # outside the pool
    ]
    for slots in cases:
        with pytest.raises(AllocatorError):
            pool.free(slots)
        assert pool.allocated_pages() == frozenset({1, 2})
        assert pool.available_size() == 8
        assert pool.take_freed() == []
    with pytest.raises(InvalidInput):
        pool.free([4, 5, 6, 7.0])
    assert pool.allocated_pages() == frozenset({1, 2})


def test_double_free():
    pool = PagedPool(8)
    assert pool.alloc(2) == [1, 2]
    pool.free([1])
    with pytest.raises(AllocatorError):
        pool.free([1])
    assert pool.take_freed() == [1]


def test_alloc_fails_when_too_few_free():
    pool = PagedPool(8, 4)
    with pytest.raises(AllocatorError):
        pool.alloc(12)
    assert pool.available_size() == 8  # nothing taken by the failed alloc
    assert pool.alloc(8) == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(AllocatorError):
        pool.alloc(4)
    assert pool.allocated_pages() == frozenset({1, 2})
    assert pool.alloc(0) == []


@pytest.mark.parametrize("n", [-4, 3, 2.0, True, None])
def test_alloc_bad_n(n):
    pool = PagedPool(16, 4)
    with pytest.raises(InvalidInput):
        pool.alloc(n)
    assert pool.available_size() == 16


@pytest.mark.parametrize("usable,page", [(6, 4), (-4, 1), (8, 0)])
def test_bad_pool_shape(usable, page):
    with pytest.raises(InvalidInput):
        PagedPool(usable, page)


def test_reset_frees_everything():
    pool = PagedPool(16, 4)
    pool.alloc(12)
    pool.free([8, 9, 10, 11])
    pool.reset()
    assert pool.available_size() == 16
    assert pool.allocated_pages() == frozenset()
    assert pool.take_freed() == []
    assert pool.alloc(4) == [4, 5, 6, 7]
