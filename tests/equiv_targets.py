"""Like-for-like pairs of the spec's and the fast path's pure helpers, for ``crosshair
diffbehavior`` and for the bounded exhaustive comparison (tests/fast/test_crosshair_equiv.py).

Each pair ``spec_<name>`` / ``fast_<name>`` has one signature and one guard: arguments outside
the bounds, or outside the helper's precondition, give ``None`` on both sides.  The fast side
maps its representation to the spec's where they differ (a fast child key is the bare unit at
page size 1, a tuple otherwise, ``(extra_key, page)`` only in a namespace; the spec's is always
``(extra_key, page)``), so a difference is a difference in meaning, not in representation.

Shapes are fixed and elements are scalar arguments (``u0, u1, ...``), cut by a length argument:
CrossHair searches symbolic ints well and symbolic list lengths and page sizes badly (a planted
off-by-one in ``shared_len`` went unseen for 30 s with symbolic lists, and is found in a few
seconds this way).  The page size is fixed per pair for the same reason (``_p1``, ``_p2``).
:data:`PAIRS` lists the pairs; :data:`DOMAINS` gives each one's small domain for the
exhaustive comparison.
"""

from __future__ import annotations

import heapq
import itertools

import uniradix.fast.keys as fk
import uniradix.spec.keys as sk

MAX_LEN = 5     # units in a key (fixed shapes below)


def _cut(xs: list, k: int) -> list | None:
    return xs[:k] if 0 <= k <= len(xs) else None


# ----------------------------------------------------------------------------------------------
# Page alignment
# ----------------------------------------------------------------------------------------------


def spec_aligned_len(n: int, page_size: int) -> int | None:
    if not (0 <= n and 1 <= page_size <= 4):
        return None
    return sk.page_aligned_len(n, page_size)


def fast_aligned_len(n: int, page_size: int) -> int | None:
    if not (0 <= n and 1 <= page_size <= 4):
        return None
    return fk.aligned_len(n, page_size)


def spec_aligned_units_len(n_tokens: int, page_size: int, bigram: bool) -> int | None:
    """The units of a key the tree keeps (spec/cache.py ``aligned_units``, its length)."""
    if not (0 <= n_tokens <= 8 and 1 <= page_size <= 4):
        return None
    tokens = [k for k in range(8) if k < n_tokens]
    return sk.page_aligned_len(len(sk.to_units(tokens, bigram)), page_size)


def fast_aligned_units_len(n_tokens: int, page_size: int, bigram: bool) -> int | None:
    if not (0 <= n_tokens <= 8 and 1 <= page_size <= 4):
        return None
    return fk.aligned_units_len(n_tokens, page_size, bigram)


# ----------------------------------------------------------------------------------------------
# The EAGLE bigram view
# ----------------------------------------------------------------------------------------------


def spec_units(t0: int, t1: int, t2: int, t3: int, n: int, bigram: bool) -> tuple | None:
    tokens = _cut([t0, t1, t2, t3], n)
    if tokens is None:
        return None
    return tuple(sk.to_units(tokens, bigram))


def fast_units(t0: int, t1: int, t2: int, t3: int, n: int, bigram: bool) -> tuple | None:
    tokens = _cut([t0, t1, t2, t3], n)
    if tokens is None:
        return None
    return tuple(fk.bigram_units(tokens, bigram))


# ----------------------------------------------------------------------------------------------
# Child keys
# ----------------------------------------------------------------------------------------------


def as_spec_child_key(ck, extra_key: str | None, page_size: int) -> tuple:
    """A fast child key in the spec's form ``(extra_key, page)``."""
    if extra_key is not None:
        ck = ck[1]
    return (extra_key, (ck,) if page_size == 1 else tuple(ck))


def _spec_child_key(extra_key, units, pos, ps):
    if not (0 <= pos and pos + ps <= len(units)):
        return None
    return sk.namespaced_child_key(extra_key, units[pos:], ps)


def _fast_child_key(extra_key, units, pos, ps):
    if not (0 <= pos and pos + ps <= len(units)):
        return None
    return as_spec_child_key(fk.child_key(extra_key, units, pos, ps), extra_key, ps)


def spec_child_key_p1(extra_key: str | None, u0: int, u1: int, u2: int,
                      pos: int) -> tuple | None:
    return _spec_child_key(extra_key, [u0, u1, u2], pos, 1)


def fast_child_key_p1(extra_key: str | None, u0: int, u1: int, u2: int,
                      pos: int) -> tuple | None:
    return _fast_child_key(extra_key, [u0, u1, u2], pos, 1)


def spec_child_key_p2(extra_key: str | None, u0: int, u1: int, u2: int, u3: int,
                      pos: int) -> tuple | None:
    return _spec_child_key(extra_key, [u0, u1, u2, u3], pos, 2)


def fast_child_key_p2(extra_key: str | None, u0: int, u1: int, u2: int, u3: int,
                      pos: int) -> tuple | None:
    return _fast_child_key(extra_key, [u0, u1, u2, u3], pos, 2)


def spec_same_child_p2(ek1: str | None, a0: int, a1: int, ek2: str | None, b0: int,
                       b1: int) -> bool:
    """Do two keys land on the same child (what a children dict decides)?"""
    return sk.namespaced_child_key(ek1, [a0, a1], 2) == sk.namespaced_child_key(ek2, [b0, b1], 2)


def fast_same_child_p2(ek1: str | None, a0: int, a1: int, ek2: str | None, b0: int,
                       b1: int) -> bool:
    return fk.child_key(ek1, [a0, a1], 0, 2) == fk.child_key(ek2, [b0, b1], 0, 2)


def spec_same_child_bigram_p1(ek1: str | None, a0: int, a1: int, ek2: str | None, b0: int,
                              b1: int) -> bool:
    """The same under EAGLE at page size 1, where the fast key of a unit is the bare pair,
    which must never equal a namespaced ``(extra_key, pair)``."""
    return (sk.namespaced_child_key(ek1, [(a0, a1)], 1)
            == sk.namespaced_child_key(ek2, [(b0, b1)], 1))


def fast_same_child_bigram_p1(ek1: str | None, a0: int, a1: int, ek2: str | None, b0: int,
                              b1: int) -> bool:
    return fk.child_key(ek1, [(a0, a1)], 0, 1) == fk.child_key(ek2, [(b0, b1)], 0, 1)


# ----------------------------------------------------------------------------------------------
# Common prefix length in pages, and the split point of a walk
# ----------------------------------------------------------------------------------------------


def _walk(c: list, clen: int, u: list, pos: int, n: int, ps: int) -> tuple | None:
    """A walk at ``pos`` over ``units[pos:n]`` meets a child ``ckey`` whose first page it
    shares (what finding the child by its child key guarantees)."""
    ckey = _cut(c, clen)
    if ckey is None or not (ps <= clen and 0 <= pos and pos + ps <= n <= len(u)):
        return None
    if any(ckey[j] != u[pos + j] for j in range(ps)):
        return None
    return ckey, u


def spec_shared_len_p1(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                       u3: int, u4: int, pos: int, n: int) -> int | None:
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 1)
    return None if w is None else sk.common_prefix_len(w[0], w[1][pos:n], 1)


def fast_shared_len_p1(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                       u3: int, u4: int, pos: int, n: int) -> int | None:
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 1)
    return None if w is None else fk.shared_len(w[0], w[1], pos, n, 1)


def spec_shared_len_p2(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                       u3: int, u4: int, pos: int, n: int) -> int | None:
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 2)
    return None if w is None else sk.common_prefix_len(w[0], w[1][pos:n], 2)


def fast_shared_len_p2(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                       u3: int, u4: int, pos: int, n: int) -> int | None:
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 2)
    return None if w is None else fk.shared_len(w[0], w[1], pos, n, 2)


def spec_walk_step_p2(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                      u3: int, u4: int, pos: int, n: int) -> tuple | None:
    """How far the walk goes into the child, and whether it splits it there (a node key is
    whole pages; a split must leave whole pages on both sides)."""
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 2)
    if w is None or clen % 2:
        return None
    shared = sk.common_prefix_len(w[0], w[1][pos:n], 2)
    split = shared < clen
    if split and not sk.split_point_ok(clen, shared, 2):
        raise AssertionError("the spec would split at a bad point")
    return shared, split


def fast_walk_step_p2(c0: int, c1: int, c2: int, c3: int, clen: int, u0: int, u1: int, u2: int,
                      u3: int, u4: int, pos: int, n: int) -> tuple | None:
    w = _walk([c0, c1, c2, c3], clen, [u0, u1, u2, u3, u4], pos, n, 2)
    if w is None or clen % 2:
        return None
    step = fk.step_len(w[0], w[1], pos, n, 2)
    return step, step < clen


# ----------------------------------------------------------------------------------------------
# Victim selection among leaves
# ----------------------------------------------------------------------------------------------


def _nodes(s0: int, s1: int, s2: int, l0: bool, l1: bool, l2: bool, x0: int, i0: int, x1: int,
           i1: int, n_stale: int) -> tuple | None:
    """Three nodes with distinct current stamps ``s*``, evictable leaves where ``l*``, and up
    to two stale heap entries ``(x, i)`` naming existing nodes."""
    stamps, leaf = [s0, s1, s2], [l0, l1, l2]
    stale = _cut([(x0, i0), (x1, i1)], n_stale)
    if stale is None or len({s0, s1, s2}) != 3 or any(not 0 <= i < 3 for _, i in stale):
        return None
    return stamps, leaf, stale


def _heap(stamps: list, leaf: list, stale: list) -> list:
    """The fast path's heap: a live entry for every evictable leaf, plus stale entries."""
    heap = [(stamps[i], i) for i in range(len(stamps)) if leaf[i]] + list(stale)
    heapq.heapify(heap)
    return heap


def spec_victim(s0: int, s1: int, s2: int, l0: bool, l1: bool, l2: bool, x0: int, i0: int,
                x1: int, i1: int, n_stale: int) -> int | None:
    nodes = _nodes(s0, s1, s2, l0, l1, l2, x0, i0, x1, i1, n_stale)
    if nodes is None:
        return None
    stamps, leaf, _ = nodes
    leaves = [i for i in range(3) if leaf[i]]
    if not leaves:
        return None
    return leaves[sk.oldest([(stamps[i], 0) for i in leaves])]


def fast_victim(s0: int, s1: int, s2: int, l0: bool, l1: bool, l2: bool, x0: int, i0: int,
                x1: int, i1: int, n_stale: int) -> int | None:
    nodes = _nodes(s0, s1, s2, l0, l1, l2, x0, i0, x1, i1, n_stale)
    if nodes is None:
        return None
    stamps, leaf, stale = nodes
    return fk.heap_victim(_heap(stamps, leaf, stale), lambda s, i: s == stamps[i] and leaf[i])


def spec_leaf_order(s0: int, s1: int, s2: int, l0: bool, l1: bool, l2: bool, x0: int, i0: int,
                    x1: int, i1: int, n_stale: int) -> list | None:
    """The eviction order of the current leaves (spec/queries.py device_eviction_order)."""
    nodes = _nodes(s0, s1, s2, l0, l1, l2, x0, i0, x1, i1, n_stale)
    if nodes is None:
        return None
    stamps, leaf, _ = nodes
    return sorted((i for i in range(3) if leaf[i]), key=lambda i: stamps[i])


def fast_leaf_order(s0: int, s1: int, s2: int, l0: bool, l1: bool, l2: bool, x0: int, i0: int,
                    x1: int, i1: int, n_stale: int) -> list | None:
    nodes = _nodes(s0, s1, s2, l0, l1, l2, x0, i0, x1, i1, n_stale)
    if nodes is None:
        return None
    stamps, leaf, stale = nodes
    return fk.live_order(_heap(stamps, leaf, stale), lambda s, i: s == stamps[i] and leaf[i])


# ----------------------------------------------------------------------------------------------
# The pairs, and small domains for the exhaustive comparison
# ----------------------------------------------------------------------------------------------

PAIRS = ("aligned_len", "aligned_units_len", "units", "child_key_p1", "child_key_p2",
         "same_child_p2", "same_child_bigram_p1", "shared_len_p1", "shared_len_p2",
         "walk_step_p2", "victim", "leaf_order")

_T = (0, 1)                 # token values (two suffice: only equality matters)
_EK = (None, "a", "b")
_B = (False, True)


def _walk_domain() -> list:
    out = []
    for clen in range(0, 5):
        for c in itertools.product(_T, repeat=clen):
            cs = list(c) + [0] * (4 - clen)
            for u in itertools.product(_T, repeat=5):
                for pos in range(0, 4):
                    for n in range(1, 6):
                        out.append((*cs, clen, *u, pos, n))
    return out


def _victim_domain() -> list:
    out = []
    for s in itertools.permutations((0, 1, 2)):
        for leaf in itertools.product(_B, repeat=3):
            for n_stale in range(3):
                stale = itertools.product((-1, 0, 1, 2, 3), (0, 1, 2), (0, 2), (0, 1))
                for x0, i0, x1, i1 in stale:
                    out.append((*s, *leaf, x0, i0, x1, i1, n_stale))
    return out


DOMAINS = {
    "aligned_len": lambda: list(itertools.product(range(-1, 20), range(0, 6))),
    "aligned_units_len": lambda: list(itertools.product(range(-1, 10), range(0, 6), _B)),
    "units": lambda: [(*t, n, b) for t in itertools.product(_T, repeat=4)
                      for n in range(-1, 6) for b in _B],
    "child_key_p1": lambda: [(ek, *u, pos) for ek in _EK for u in itertools.product(_T, repeat=3)
                             for pos in range(-1, 5)],
    "child_key_p2": lambda: [(ek, *u, pos) for ek in _EK for u in itertools.product(_T, repeat=4)
                             for pos in range(-1, 5)],
    "same_child_p2": lambda: [(e1, *a, e2, *b) for e1 in _EK for e2 in _EK
                              for a in itertools.product(_T, repeat=2)
                              for b in itertools.product(_T, repeat=2)],
    "same_child_bigram_p1": lambda: [(e1, *a, e2, *b) for e1 in _EK for e2 in _EK
                                     for a in itertools.product(_T, repeat=2)
                                     for b in itertools.product(_T, repeat=2)],
    "shared_len_p1": _walk_domain,
    "shared_len_p2": _walk_domain,
    "walk_step_p2": _walk_domain,
    "victim": _victim_domain,
    "leaf_order": _victim_domain,
}
