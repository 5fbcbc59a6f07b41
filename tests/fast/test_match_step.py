"""fast/keys.py ``match_step``: the walks' one step per node.  ``match_step_py`` is the
definition; the C core's ``match_step`` (fast/_core.c) must give the same answer on every
input: array('q') units and keys at page 1 and above, with and without an extra key, whole
children, partial matches (the split length), missing children, and the inputs it hands to the
definition (EAGLE's bigram lists, a key that is not an int64 buffer)."""

from __future__ import annotations

import random
from array import array

import pytest

from uniradix.fast import cache as cache_mod
from uniradix.fast import keys

native = pytest.mark.skipif(not cache_mod.NATIVE, reason="the C core is not in use")


class Child:
    __slots__ = ("key",)

    def __init__(self, key) -> None:
        self.key = key


def random_children(rng: random.Random, ps: int, ek, pages: int, as_list: bool = False) -> dict:
    """A node's children: each key whole pages from a small alphabet, unique first pages."""
    children: dict = {}
    for _ in range(rng.randint(0, 6)):
        toks = [rng.randint(0, 3) for _ in range(ps * rng.randint(1, pages))]
        key = [(t, t + 1) for t in toks] if as_list else array("q", toks)
        first = key[0] if ps == 1 else tuple(key[:ps])
        children.setdefault(first if ek is None else (ek, first), Child(key))
    return children


def cases(rng: random.Random, n_cases: int, as_list: bool = False):
    for _ in range(n_cases):
        ps = rng.choice([1, 1, 2, 4])
        ek = rng.choice([None, None, "ns", 7])
        children = random_children(rng, ps, ek, 4, as_list)
        n = ps * rng.randint(1, 6)
        if children and rng.random() < 0.7:  # start with a child's key: a whole or partial match
            key = list(rng.choice(list(children.values())).key)
            toks = (key + [rng.randint(0, 3) for _ in range(n)])[:n]
            if rng.random() < 0.5:
                i = rng.randrange(len(toks))
                toks[i] = toks[i] if as_list else rng.randint(0, 3)
        else:
            toks = [(t, t + 1) for t in range(n)] if as_list else [rng.randint(0, 3) for _ in range(n)]
        lead = rng.randint(0, 2) * ps  # the step starts at a page boundary further on
        pad = [(9, 9)] * lead if as_list else [9] * lead
        units = pad + toks if as_list else array("q", pad + toks)
        yield children, units, lead, lead + n, ps, ek


def expected(children, units, pos, n, ps, ek):
    """The step by its plain meaning: the child of the page, its whole length or the common
    whole-page length."""
    ck = units[pos] if ps == 1 else tuple(units[pos:pos + ps])
    child = children.get(ck if ek is None else (ek, ck))
    if child is None:
        return keys.NO_STEP
    common = 0
    while common < min(len(child.key), n - pos) and child.key[common] == units[pos + common]:
        common += 1
    if common == len(child.key):
        return child, common, False
    return child, common - common % ps, True


def test_the_definition_on_random_trees():
    rng = random.Random(1)
    seen = set()
    for args in cases(rng, 3000):
        got = keys.match_step_py(*args)
        assert got == expected(*args), args
        seen.add((args[4] > 1, args[5] is not None, got[0] is None, got[2]))
    assert len(seen) == 12  # each page size kind x extra key x (miss, whole, split) was met


@native
def test_the_c_step_equals_the_definition():
    from uniradix.fast import _core  # type: ignore[attr-defined]
    assert keys.match_step is _core.match_step
    rng = random.Random(2)
    splits = whole = misses = 0
    for args in cases(rng, 5000):
        got, want = _core.match_step(*args), keys.match_step_py(*args)
        assert got == want and got[0] is want[0], args
        if got is keys.NO_STEP:
            misses += 1
        elif got[2]:
            splits += 1
        else:
            whole += 1
    assert splits > 100 and whole > 100 and misses > 100


@native
def test_the_c_step_hands_other_inputs_to_the_definition():
    from uniradix.fast import _core  # type: ignore[attr-defined]
    rng = random.Random(3)
    for args in cases(rng, 500, as_list=True):  # EAGLE bigram units and keys: lists
        assert _core.match_step(*args) == keys.match_step_py(*args), args
    # an array('q') walk into a child whose key is not an int64 buffer
    children = {5: Child([5, 6])}
    units = array("q", [5, 6])
    assert _core.match_step(children, units, 0, 2, 1, None) == \
        keys.match_step_py(children, units, 0, 2, 1, None)
    # a child without a key: the definition's error
    with pytest.raises(AttributeError):
        _core.match_step({5: object()}, units, 0, 2, 1, None)
    with pytest.raises(TypeError):
        _core.match_step({}, units, 0, 2)
