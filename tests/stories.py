"""One story driver for the spec's hand-worked tests: each step goes through an adapter, the
adapter's own invariants must hold after it, and a rejected step must leave the state as it was."""

from uniradix.conformance.adapters.base import make_adapter
from uniradix.spec.config import CacheConfig


class Story:
    def __init__(self, impl: str = "spec", **cfg) -> None:
        self.a = make_adapter(impl, CacheConfig(**cfg))
        self.i = 0

    def step(self, op: str, **args) -> dict:
        before = self.a.snapshot()
        obs = self.a.apply({"i": self.i, "op": op, "args": args})
        self.i += 1
        assert self.a.violations() == []
        if "error" in obs:
            assert self.a.snapshot() == before, f"{op} was rejected but changed the state"
        return obs


# Direct-state helpers for the spec's host-tier stories with aux components
# (tests/spec/test_spec_host_swa.py, tests/spec/test_spec_host_mamba.py): they call the spec's
# rules on a state, checking the invariants after each step.

def sound(state) -> None:
    from uniradix.spec.invariants import sanity_check
    assert sanity_check(state) == []


def node_at(state, tokens):
    from uniradix.spec import cache as rules
    return rules.find_node(state, tokens, None)


def acks_done(state) -> None:
    """Every queued transfer completes and the cache processes the acks."""
    from uniradix.spec import host
    host.io_complete(state, -1, -1)
    host.check_hicache_events(state)
    sound(state)


class SpecAndFast:
    """The spec and fast in lockstep over ``config``: every step's observations and snapshots
    must agree (``step`` asserts it). ``a`` is the spec's adapter, ``fast`` fast's."""

    def __init__(self, config: CacheConfig) -> None:
        from uniradix.conformance.explore.lockstep import Lockstep
        self.a = make_adapter("spec", config)
        self.fast = make_adapter("fast", config)
        self.ls = Lockstep([self.a, self.fast], ["spec", "fast"])
        self.i = 0

    def step(self, op: str, **args) -> dict:
        obs, finding = self.ls.check({"i": self.i, "op": op, "args": args}, full=True)
        self.i += 1
        assert finding is None, str(finding)
        return obs


class Pair:
    """A spec adapter and a fast adapter stepped together by calls (``pair(op, **args)``):
    observations (messages aside), snapshots and invariants must agree after every step."""

    def __init__(self, **cfg) -> None:
        config = CacheConfig(**cfg)
        self.spec, self.fast = make_adapter("spec", config), make_adapter("fast", config)
        self.i = 0

    def __call__(self, op: str, **args) -> dict:
        step = {"i": self.i, "op": op, "args": args}
        self.i += 1
        a, b = self.spec.apply(step), self.fast.apply(step)
        a.pop("message", None), b.pop("message", None)
        assert a == b, (step, a, b)
        assert self.spec.snapshot() == self.fast.snapshot(), step
        assert self.spec.violations() == [] and self.fast.violations() == [], step
        return a


class LockstepFace:
    """The spec and ``peer`` behind one adapter face (``apply``, ``violations``, ``pool``), every
    step in lockstep (observations, snapshots and invariants compared; a finding fails)."""

    def __init__(self, config: CacheConfig, peer: str) -> None:
        from uniradix.conformance.explore.lockstep import Lockstep
        self.ls = Lockstep([make_adapter("spec", config), make_adapter(peer, config)],
                           ["spec", peer])
        self.ls.prime()
        self.pool = self.ls.adapters[0].pool

    def apply(self, step):
        obs, finding = self.ls.check(step)
        assert finding is None, str(finding)
        return obs

    def violations(self) -> list:
        return []


def run_steps(impl: str, config: CacheConfig, steps: list) -> tuple[list, object]:
    """``steps`` as ``(op, args)`` pairs through a fresh ``impl`` adapter of ``config``: every
    observation, and the adapter (its invariants hold after them)."""
    a = make_adapter(impl, config)
    out = [a.apply({"i": i, "op": op, "args": args}) for i, (op, args) in enumerate(steps)]
    assert a.violations() == []
    return out, a


# One request through the Mamba extra buffer: an 11-token prompt in two chunks (6 then 5),
# seven decoded tokens, the finish (tests/spec/test_spec_mamba_xbuf*.py).
XBUF_STORY = [("req_arrive", {"rid": "a", "tokens": list(range(1, 12))}),
              ("req_admit", {"rid": "a"}),
              ("req_chunk", {"rid": "a", "n": 6, "chunked": True}),
              ("req_chunk", {"rid": "a", "n": 5, "chunked": False}),
              ("req_decode", {"rid": "a", "n": 7}), ("req_finish", {"rid": "a"})]


def replay_twins(ls, steps: list, same=None) -> list[str]:
    """Recorded ``steps`` (their recorded answers dropped) through ``ls``, a lockstep of two
    twins (one cache on a path, the other on the path it stands for), primed here: each step's
    observations must agree, and ``same(step)``, when given, asserts what else the two must
    share after it (trees, heaps, logs).  Returns the ops run, in order."""
    ls.prime()
    ops = []
    for step in steps:
        step = {k: v for k, v in step.items() if k != "ret"}
        _, finding = ls.check(step, full=True)
        assert finding is None, str(finding)
        if same is not None:
            same(step)
        ops.append(step["op"])
    return ops


def upstream_crash_is_documented(path: str, op: str, message: str):
    """A regression trace of an upstream crash that conform counts as a documented difference:
    spec and fast replay it clean, upstream 0.5.13.post1 crashes at its last step (an ``op``)
    with ``message`` in the error, and ``documented_difference`` takes that crash.  Returns the
    trace and the crash's Finding for the test's own further checks."""
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import replay_trace
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is None
    last = trace.steps[-1]
    assert last["op"] == op
    d = replay_trace(trace, "upstream").divergence
    assert d is not None and d.step == last["i"] and d.field == "crash"
    assert message in str(d.actual)
    crash = Finding(VIOLATION, last["i"], op, "crash", message, {"upstream": d.actual},
                    ("upstream",))
    assert documented_difference(["spec", "upstream"], trace.config, trace.steps,
                                 crash) is not None
    return trace, crash
