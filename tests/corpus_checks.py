"""Checks shared by the corpus replay tests (tests/conformance/traces/test_corpus_replay.py and the policy
corpus in tests/spec/test_spec_policies.py): what a replay of a committed trace must show."""

from uniradix.conformance.traces.replay import expected_divergence, held_swa_tombstone_takeover


def check_divergence(path, trace, result) -> None:
    """No divergence, except the known ones (docs/SPEC.md, issue 18): exactly at the listed
    step, an insert over an SWA tombstone a lock holds (upstream freed its slots there)."""
    step = expected_divergence(path)
    if step is None:
        assert result.divergence is None, str(result.divergence)
        return
    d = result.divergence
    assert d is not None and (d.step, d.op, d.field) == (step, "insert", "freed"), str(d)
    assert held_swa_tombstone_takeover(trace, step)


def diverged_as_lru(paths, impl: str) -> int:
    """How many of the traces at ``paths`` diverge on ``impl`` when replayed as if recorded
    under ``lru`` (a policy corpus pins the policy's order, and ``impl`` honours the setting)."""
    import dataclasses

    from uniradix.conformance.traces.replay import replay_trace
    from uniradix.conformance.traces.trace import load_trace

    diverged = 0
    for t in paths:
        trace = load_trace(t)
        as_lru = dataclasses.replace(trace, config=dataclasses.replace(trace.config,
                                                                       eviction_policy="lru"))
        diverged += replay_trace(as_lru, impl, check_invariants=False).divergence is not None
    return diverged
