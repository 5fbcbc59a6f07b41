"""Shared steps for the ``check --exhaustive`` tests (tests/conformance/explore/): walk a
universe's named transitions with spec and fast in lockstep, and check that bad universes are
refused by name."""

import pytest

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore import exhaustive as ex
from uniradix.conformance.explore.lockstep import impl_labels
from uniradix.spec.errors import ConfigError


def after(u: ex.Universe, labels: list[str]) -> tuple[SpecAdapter, list[dict]]:
    """Run the transitions named ``labels`` in turn, spec and fast in lockstep with every
    check (a finding raises); the spec's adapter after them, and every step."""
    path: list[dict] = []
    for label in labels:
        base = SpecAdapter(u.config())
        for s in path:
            base.apply(s)
        ts = {t.label: t for t in ex.transitions(u, ex.World.of(u, base))}
        assert label in ts, sorted(ts)
        ls = ex._fresh(["spec", "fast"], u.config(), impl_labels(["spec", "fast"]), path)
        d = ex.Driver(ls, u, len(path))
        ts[label].run(d)
        path += d.steps
    base = SpecAdapter(u.config())
    for s in path:
        base.apply(s)
    return base, path


def assert_refused(*cases: tuple[str, str], error: type[Exception] = ConfigError) -> None:
    """Each ``(universe JSON, match)`` is refused by ``ex.parse_universe`` with ``error``
    whose message matches ``match``."""
    for text, match in cases:
        with pytest.raises(error, match=match):
            ex.parse_universe(text)


def assert_nothing_found(names: tuple[str, ...], depth: int) -> None:
    """Each named universe explored to ``depth``, spec against fast: no finding, complete."""
    for name in names:
        res = ex.explore(ex.UNIVERSES[name], ["spec", "fast"], depth=depth, progress=False)
        assert res.finding is None, f"{name}: {res.finding}\n{res.labels}"
        assert res.complete and res.depth == depth
