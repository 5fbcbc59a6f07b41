"""scripts/ab-speed.py (two trees' fast/ side by side in one process): its rows and arguments
(default suite), and whole runs of this checkout against itself on a tiny workload (``slow``:
loading two copies of fast/ and a dozen runs take 5 s or more on the shared machines)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ab-speed.py"


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_speed_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _core_built() -> bool:
    return bool(list((ROOT / "fast").glob("_core*.so")))


def test_rows_and_arguments(ab):
    assert [(c.name, ps) for c, ps in ab.parse_configs("full:16, write_back+swa,mamba:1")] == [
        ("full", 16), ("write_back+swa", 1), ("mamba", 1)]
    with pytest.raises(Exception, match="nonsense"):
        ab.parse_configs("nonsense:1")
    row = ab.Row("full", 1, "shared-prefix", 10)
    assert row.ratio is None and row.pair_ratio is None
    row.seconds = {"base": [1.0, 2.0, 4.0], "head": [0.5, 3.0, 2.0]}
    assert row.ratio == 1.0  # medians 2.0 / 2.0
    assert row.pair_ratio == 0.5  # pairs 0.5, 1.5, 0.5
    row.identical = True
    assert ab.format_row(row)[0].split()[-4:] == ["2000.0", "1.000", "0.500", "yes"]
    refused = ab.Row("write_back+swa", 1, "mooncake", 10, refused={"base": "Unsupported: x"})
    assert ab.format_row(refused)[0].endswith("refused: base: Unsupported: x")
    ref = {"digest": "a", "hit_tokens": 3, "hits": [1, 2, 0]}
    assert ab._difference(ref, {"digest": "b", "hit_tokens": 4, "hits": [1, 3, 0]}, "head", 3) \
        == "run 3 (head): digest, hit_tokens differ; request 1: hit tokens 2 (first run) vs 3"
    assert ab._difference(ref, {"digest": "a", "hit_tokens": 3, "hits": [1, 2]}, "base", 2) \
        == "run 2 (base): hits differ; request 2: hit tokens 0 (first run) vs -"


@pytest.mark.slow
def test_head_against_itself(ab, tmp_path, capsys):
    out = tmp_path / "ab.json"
    argv = ["--base", str(ROOT), "--head", str(ROOT), "--configs", "full:1,write_back+swa:1",
            "--workloads", "shared-prefix", "--requests", "40", "--rounds", "2",
            "--warmup", "0", "--quiet", "--json", str(out)]
    if not _core_built():
        argv.append("--allow-pure-python")
    assert ab.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["workload"], r["page_size"]) for r in rows] == [
        ("full", "shared-prefix", 1), ("write_back+swa", "shared-prefix", 1)]
    for r in rows:
        assert r["refused"] == {}
        assert r["identical_outcomes"] is True and r["differences"] == []
        assert [len(r["seconds"][s]) for s in ("base", "head")] == [2, 2]
        assert r["order"] == ["base", "head", "head", "base"]
        assert r["ratio_head_over_base"] > 0 and 0 < r["hit_rate"] < 1
    assert "c core" in rows[0]["kinds"]["head"] or not _core_built()
    assert "python" in rows[1]["kinds"]["head"]
    printed = capsys.readouterr().out
    assert "identical" in printed and "write_back+swa" in printed


@pytest.mark.slow
def test_differing_outcomes_are_reported(ab, monkeypatch):
    """A side whose hits differ is named with the first request that differs."""
    mods = {s: ab.load_fast(ROOT, f"_ab_test_{s}_fast", require_core=False) for s in ab.SIDES}
    real = ab.HitLog.admitted_fields

    def skewed(self, req):
        out = real(self, req)
        if self.sink is hits_of_head[0] and len(self.sink) == 3:
            self.sink[-1] += 1
        return out

    hits_of_head: list = [None]
    real_bundle = ab.bundle_for

    def bundle_for(mod, config, label, hits):
        if label == "head":
            hits_of_head[0] = hits
        return real_bundle(mod, config, label, hits)

    monkeypatch.setattr(ab.HitLog, "admitted_fields", skewed)
    monkeypatch.setattr(ab, "bundle_for", bundle_for)
    workload = ab.materialized(ab.B.make_workload("shared-prefix", 1, 20))
    row = ab.measure(mods, ab.C.BenchConfig(), 1, workload, rounds=1, warmup=0)
    assert row.identical is False
    [diff] = row.differences
    m = re.fullmatch(r"run 1 \(head\): hits differ; request 2: hit tokens (\d+) \(first run\) "
                     r"vs (\d+)", diff)
    assert m is not None, diff
    assert int(m[2]) == int(m[1]) + 1
    assert ab.format_row(row)[-1].startswith("    DIFFERENT OUTCOMES: run 1 (head)")


def test_opcode_clock_counts_the_calls_between_two_readings(ab):
    """The opcode clock reads the opcodes run since entry, callees included, the same count
    every time; outside it the loop's clock is back."""

    def inner(n):
        t = 0
        for i in range(n):
            t += i
        return t

    def outer(n):
        return inner(n) + inner(n)

    def between(n):
        clock = ab.B.time.perf_counter
        t0 = clock()
        outer(n)
        return clock() - t0

    saved = ab.B.time
    with ab.opcode_clock():
        counts = [between(n) for n in (0, 10, 20, 10)]
    assert ab.B.time is saved
    assert counts[1] == counts[3] and counts[0] > 0
    per_iteration = (counts[1] - counts[0]) / 20  # two inner calls of 10 iterations
    assert per_iteration >= 3 and counts[2] - counts[1] == counts[1] - counts[0]


def test_opcode_count_of_one_tree_against_itself(ab):
    """Both sides the same loaded fast/: every op's calls and opcodes are equal (the count is
    deterministic once first-call work is done: one warm-up run per side, count_opcodes'
    default; without it the first side counts the one-time setups of the frees' class checks
    and failed when this file ran first in its process), the swa run has all five ops, and
    the table prints 1.000."""
    import uniradix.fast as fast

    mods = {s: fast for s in ab.SIDES}
    workload = ab.materialized(ab.B.make_workload("shared-prefix", 1, 24))
    [(config, ps)] = ab.parse_configs("swa:1")
    row = ab.count_opcodes(mods, config, ps, workload, warmup=1)
    assert row.identical is True and not row.refused
    assert row.calls["base"] == row.calls["head"] and row.opcodes["base"] == row.opcodes["head"]
    assert {"match", "lock", "insert", "unlock"} <= set(row.opcodes["head"])
    assert all(v > 0 for v in row.opcodes["head"].values())
    assert row.ratio == 1.0 and row.summary()["total"]["head"] == row.total("head")
    lines = ab.format_opcode_row(row)
    assert lines[0].split()[-2:] == ["1.000", "yes"]
    assert any(line.split()[0] == "match" and line.endswith("h/b 1.000") for line in lines[1:])
