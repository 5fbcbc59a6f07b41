"""fast/_core.c ``state_copy`` (an insert's Mamba state copied into a one-slot view of a slab
of the C core's own) against ``clone()``, which fast/components/mamba.py ``mamba_state`` runs
without the C core: the same value, dtype, shape and device, a tensor no write to the
caller's changes, and no two copies sharing a slot, across slabs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.components import mamba  # noqa: E402
from uniradix.fast.errors import InvalidInput  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


@needs_core
def test_copies_equal_clones_and_stay_their_own():
    states = [torch.tensor([i * 7 - 3], dtype=torch.int64) for i in range(700)]
    copies = [mamba.mamba_state(s) for s in states]  # (700: across three slabs)
    clones = [s.clone() for s in states]
    for s in states:  # later writes to the callers' tensors change no copy
        s.fill_(-1)
    for c, k in zip(copies, clones, strict=True):
        assert c.dtype == k.dtype == torch.int64 and c.shape == k.shape == (1,)
        assert c.device == k.device and c.is_contiguous()
        assert c.tolist() == k.tolist()
    assert len({c.data_ptr() for c in copies}) == len(copies)  # no slot shared
    copies[5].fill_(99)  # a write to one copy changes no other
    assert [c.item() for c in copies[4:7]] == [4 * 7 - 3, 99, 6 * 7 - 3]


@needs_core
def test_declines_what_it_does_not_copy():
    assert _core.state_copy(torch.tensor([1, 2])) is None  # two slots
    assert _core.state_copy(torch.tensor([1.5])) is None  # not int64
    assert _core.state_copy(torch.tensor([[3]])) is None  # not 1-D
    assert _core.state_copy([3]) is None  # not a tensor

    class Sub(torch.Tensor):
        pass

    sub = torch.tensor([4]).as_subclass(Sub)
    assert _core.state_copy(sub) is None
    got = mamba.mamba_state(sub)  # (the clone, as without the C core)
    assert got.tolist() == [4] and type(got) is Sub


def test_mamba_state_checks_stay_first():
    with pytest.raises(InvalidInput):
        mamba.mamba_state(None)
    with pytest.raises(InvalidInput):
        mamba.mamba_state(torch.tensor([1.0]))
    with pytest.raises(InvalidInput):
        mamba.mamba_state(torch.tensor([1, 2]))
    got = mamba.mamba_state(torch.tensor([8]))
    assert got.tolist() == [8]
    assert (mamba._state_copy is not None) == (_core is not None)
