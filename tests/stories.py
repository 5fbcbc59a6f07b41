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
