"""Upstream SGLang's request path and the spec step by step, for the upstream request adapter
tests under tests/conformance/adapters/ (run with the upstream venv's python)."""

from typing import Any


def plain(snap: dict) -> dict:
    """A snapshot without hit counts (0.5.13.post1 counts them differently, docs/SPEC.md; the
    upstream adapters leave them uncompared)."""
    return {**snap, "nodes": [{k: v for k, v in n.items() if k != "hit_count"}
                              for n in snap["nodes"]]}


def lockstep_steps(up: Any, spec: Any, steps: list) -> list:
    """Each ``(op, args)`` of ``steps`` through ``up`` and ``spec``: the same observation (but
    a rejection's wording, the spec's own), the same snapshot but hit counts, and no upstream
    violation after every step; upstream's observations."""
    out = []
    for k, (op, args) in enumerate(steps):
        s = {"i": k, "op": op, "args": args}
        a, b = up.apply(s), spec.apply(s)
        b.pop("message", None)  # (a rejection's wording is the spec's own)
        assert a == b, (s, a, b)
        assert plain(up.snapshot()) == plain(spec.snapshot()), s
        assert up.violations() == []
        out.append(a)
    return out
