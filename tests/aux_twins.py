"""What the tests of the composed tree's C twins (tests/fast/test_one_aux_c_cmatch.py,
test_pair_match.py, test_pair_insert.py) compare between a cache on a C path and its twin on
the Python path: a counting wrapper of the C function, and the tree's state with node ids
replaced by paths (two caches)."""

from __future__ import annotations

import gc


class Counting:
    """A C function counting its calls and those it took (did not decline: not None)."""

    def __init__(self, fn):
        self.fn, self.calls, self.taken = fn, 0, 0

    def __call__(self, *args):
        self.calls += 1
        r = self.fn(*args)
        self.taken += r is not None
        return r


def path_of(node) -> tuple:
    """A node as its path of (extra key, key) from the root."""
    out = []
    while node is not None and node.parent is not None:
        out.append((node.extra_key, tuple(node.key)))
        node = node.parent
    return tuple(reversed(out))


def listed(v):
    return None if v is None else v.tolist()


def tree_state(cache) -> dict:
    """Everything a match or an insert of the composed tree may write: each node's fields
    (stamps included) and records, every component's LRU order, the leaf heap entry by
    entry, the clock and the counters."""
    nodes = {}
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        recs = tuple((listed(r.value), r.lock, r.boundary) for r in node.aux)
        nodes[path_of(node)] = (node.ck, listed(node.value), node.lock_ref, node.aux_lock,
                                node.dev_children, node.last_access_time, node.hit_count,
                                node.created, node.priority, recs)
        stack.extend(node.children.values())
    return {
        "nodes": nodes,
        "lru": [[path_of(rec.node) for rec in comp.lru.oldest_first()]
                for comp in cache.components],
        "heap": [(stamp, path_of(node), node.parent is not None) for stamp, node in cache._heap],
        "counts": (cache._clock, cache._evictable, cache._protected,
                   [(c.evictable, c.protected) for c in cache.components]),
    }


def result_view(r) -> tuple:
    """A MatchResult with its nodes as paths."""
    return (r.device_indices.tolist(), r.device_indices.dtype, path_of(r.last_device_node),
            path_of(r.last_host_node), path_of(r.best_match_node), r.host_hit_length,
            r.swa_host_hit_length, r.mamba_host_hit_length, r.mamba_branching_seqlen,
            r.cache_protected_len)


def pages(ps: int, *ids: int) -> list:
    """Whole pages of distinct tokens, page ``i`` starting at ``i * 1000``."""
    return [i * 1000 + j for i in ids for j in range(ps)]


class Twins:
    """Two adapters driven alike: ``c`` on the C path, ``py`` on the Python path it stands
    for; each call goes to both (``run`` says how a side runs it), and their answers (or
    errors) and tree states must agree."""

    def __init__(self, c, py):
        self.c, self.py = c, py
        self.i = 0  # (a step's index: a lock's handle)

    def run(self, side, fn):
        return fn()

    def both(self, fn):
        """``fn(side)`` on each side; the common answer."""
        outs = []
        for side in (self.c, self.py):
            try:
                outs.append(self.run(side, lambda side=side: fn(side)))
            except Exception as e:  # noqa: BLE001 - the two must raise alike
                outs.append(("raised", type(e), str(e)))
        assert outs[0] == outs[1]
        assert tree_state(self.c.cache) == tree_state(self.py.cache)
        return outs[0]

    def __call__(self, op: str, **args):
        self.i += 1
        step = {"i": self.i, "op": op, "args": args}
        return self.both(lambda side: side.apply(step))


def replay_in_lockstep(c_side, py_side, steps: list, names: list) -> list[str]:
    """Recorded ``steps`` through the two adapters in lockstep (tests/stories.py
    ``replay_twins``), their tree states compared after every step.  The ops run."""
    from stories import replay_twins
    from uniradix.conformance.explore.lockstep import Lockstep

    ls = Lockstep([c_side, py_side], names, events=False)

    def same_states(step):
        assert tree_state(c_side.cache) == tree_state(py_side.cache), step

    return replay_twins(ls, steps, same_states)


#: the pair's component orders the twins' tests run in
PAIR_ORDERS = [("full", "swa", "mamba"), ("full", "mamba", "swa")]


def recorded_run(name: str, seed: int, order: tuple, n: int = 400) -> tuple:
    """Config ``name`` (conformance/explore/driver.py ``make_config``) with its components in
    ``order``, and ``n`` steps recorded on fast with ``seed``: what the twins replay."""
    import dataclasses

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.explore.driver import make_config, record
    config = dataclasses.replace(make_config(name, seed), components=order)
    return config, record(make_adapter("fast", config), config, seed, n, check_violations=False)


def twins_on_recorded_run(name: str, seed: int, order: tuple, general, names: list,
                          prepare=None) -> list[str]:
    """:func:`recorded_run` replayed in lockstep (:func:`replay_in_lockstep`) on a fast adapter,
    set up by ``prepare(adapter)`` if given, and its twin with ``general(adapter)`` turning
    the C path off.  The ops run."""
    from uniradix.conformance.adapters.base import make_adapter
    config, steps = recorded_run(name, seed, order)
    c_side, py_side = make_adapter("fast", config), general(make_adapter("fast", config))
    if prepare is not None:
        prepare(c_side)
    return replay_in_lockstep(c_side, py_side, steps, names)


def insert_with_state(t, tokens, prev=0, **extra):
    """An insert step on twins ``t`` (:class:`Twins`) with fresh slots past ``prev`` and a
    fresh Mamba state."""
    slots = t("alloc", n=len(tokens) - prev)["slots"]
    value = list(range(1, prev + 1)) if prev else []  # (the first prev slots are the tree's)
    (state_,) = t("mamba_alloc", n=1)["slots"]
    return t("insert", tokens=tokens, value=value + slots, prev_prefix_len=prev,
             mamba_value=[state_], **extra)


def evict_or_unlock(r: float, rng, sides: list, helds: list, ps: int, outcome,
                    big: tuple = ()) -> list | None:
    """A step of the twins' random request runs (tests/fast/test_pair_evict.py,
    test_pair_insert_api.py) where ``r`` picks one, done on every side (``side[0]``: its
    cache): below 0.2 an evict of random amounts (Full also one of ``big``), below 0.3 with
    a lock held the same held lock of each side going.  The sides' answers (``outcome`` of
    each evict), or None: no such step."""
    import uniradix.fast as fast
    if r < 0.2:
        params = fast.EvictParams(num_tokens=rng.choice((0, ps, 3 * ps, 40 * ps, *big)),
                                  swa_num_tokens=rng.randrange(0, 12 * ps),
                                  mamba_num=rng.randrange(0, 4))
        return [outcome(lambda s=s: s[0].evict(params)) for s in sides]
    if r < 0.3 and helds[0]:
        i = rng.randrange(len(helds[0]))
        outs = []
        for s, held in zip(sides, helds, strict=True):
            node, lock = held.pop(i)
            outs.append(s[0].dec_lock_ref(node, lock.to_dec_params()).delta)
        return outs
    return None


def assert_no_leaks(run, marks, warm: int = 5, runs: int = 40, slack: int = 50) -> None:
    """``run()`` over and over leaves nothing behind (what the C twins' reference tests check):
    after ``warm`` runs, ``runs`` more grow the live objects by at most ``slack`` and leave
    ``marks()`` (the reference counts of what the C code touches) as they were."""
    for _ in range(warm):
        run()
    gc.collect()
    before, objects = marks(), len(gc.get_objects())
    for _ in range(runs):
        run()
    gc.collect()
    assert len(gc.get_objects()) <= objects + slack
    assert marks() == before


def hold_or_unlock(cache, node, lock, held: list | None) -> None:
    """The end of a twins' request (tests/fast/test_pair_evict.py, test_one_aux_c_cevict.py,
    test_pair_insert_api.py): its lock kept on ``held`` (released by a later step), or
    released now."""
    if held is not None:
        held.append((node, lock))
    else:
        cache.dec_lock_ref(node, lock.to_dec_params())
