"""The bench records (conformance/bench/results.py), the dashboard page and its compare mode
(conformance/bench/dashboard.py), on a small history of real bench numbers (tests/dashboard_fixture.py).
The page in a real browser: tests/conformance/bench/test_dashboard_browser.py."""

from __future__ import annotations

import json
import os
import re

import pytest

import dashboard_fixture as fx
from uniradix.conformance.bench import dashboard as D
from uniradix.conformance.bench import results as R
from uniradix.conformance.cli import main as cli_main

# ---- records from each producer -------------------------------------------------------------


def test_a_bench_result_becomes_a_record_with_noise_and_ratios():
    rec = R.normalize(fx.bench_json(), commit=fx.COMMIT_A, machine=fx.MACHINE)
    assert rec["schema"] == R.SCHEMA and rec["schema_version"] == R.SCHEMA_VERSION
    assert rec["source"]["kind"] == "bench"
    figs = {f["id"]: f for f in rec["figures"]["throughput"]}
    assert set(figs) == {"shared-prefix/full/p1/60req", "shared-prefix/full/p16/60req"}
    for f in figs.values():
        assert f["identical_outcomes"] is True
        fast = f["impls"]["fast"]["requests_per_s"]
        assert fast["n"] == 3 and fast["min"] <= fast["median"] <= fast["max"]
        assert f["impls"]["spec"]["requests_per_s"]["n"] == 1
        r = f["ratios"]["fast/spec"]
        assert r["min"] <= r["median"] <= r["max"]
        assert r["median"] == pytest.approx(fast["median"] / f["impls"]["spec"]["requests_per_s"]["median"],
                                            rel=1e-3)
        assert {"match", "insert"} <= set(f["impls"]["fast"]["op_us"])
        assert 0 < f["impls"]["fast"]["hit_rate"] < 1
    assert rec["figures"]["memory"][0]["impl"] == "fast"
    assert rec["figures"]["memory"][0]["bytes_per_token"] > 0


def test_a_pytest_benchmark_result_groups_cases_and_keeps_round_noise():
    entry = lambda impl, rps, runs=None: {  # noqa: E731
        "name": f"test_bench_cache[{impl}-case]",
        "stats": {"min": 0.9, "max": 1.2, "median": 1.0, "rounds": 3},
        "extra_info": dict({"impl": impl, "version": "v", "workload": "shared-prefix",
                            "page_size": 16, "kv_slots": 1000, "requests": 990, "aborted": 10,
                            "requests_per_s": rps, "hit_rate": 0.5, "evicted_tokens": 7,
                            "digest": "d", "op_median_us": {"match": 2.0}},
                           **({"requests_per_s_runs": runs} if runs else {}))}
    data = {"machine_info": {"cpu": {"count": 8}, "python_version": "3.11.7", "system": "Linux",
                             "machine": "x86_64"},
            "commit_info": {"id": "c" * 40, "time": "2026-11-21T00:00:00+00:00", "dirty": False},
            "benchmarks": [entry("fast", 1000.0, [900.0, 1000.0, 1100.0]), entry("upstream", 250.0)],
            "datetime": "2026-11-21T01:00:00+00:00"}
    rec = R.normalize(data)
    assert rec["source"]["kind"] == "pytest-benchmark"
    assert rec["commit"]["sha"] == "c" * 40 and rec["machine"]["cpus"] == 8
    (fig,) = rec["figures"]["throughput"]
    assert fig["id"] == "shared-prefix/full/p16/1000req"
    assert fig["impls"]["fast"]["requests_per_s"] == {"median": 1000.0, "min": 900.0, "max": 1100.0, "n": 3}
    # no rounds kept: the wall-time spread applied to the median
    assert fig["impls"]["upstream"]["requests_per_s"]["min"] == pytest.approx(250 / 1.2, abs=0.1)
    assert fig["noise_source"] == "rounds+wall"
    assert fig["ratios"]["fast/upstream"]["median"] == 4.0
    assert fig["identical_outcomes"] is True


def test_a_run_result_carries_conformance_totals_and_its_machine():
    rec = R.normalize(fx.run_json(divergences=2), commit=fx.COMMIT_A)
    conf = rec["figures"]["conformance"]
    assert conf["corpus"]["fast"]["divergences"] == 2 and conf["lockstep"]["steps"] == 5000
    assert rec["machine"]["cpus"] == 2 and rec["machine"]["load_source"] == "now"


def test_a_kernel_result_keeps_rows_and_ceilings():
    rec = R.normalize(fx.kernels_json(), commit=fx.COMMIT_A, machine=fx.MACHINE)
    k = rec["figures"]["kernels"]
    assert k["ceilings_gbps"]["h2d"] == 55.0 and len(k["rows"]) == 8 and not k["smoke"]
    assert rec["machine"]["gpu"] == "fixture GPU"


def test_unknown_json_and_other_schema_versions_are_refused_by_name(tmp_path):
    with pytest.raises(R.ResultsError, match="not a bench result"):
        R.normalize({"hello": 1})
    rec = R.normalize(fx.run_json(), commit=fx.COMMIT_A, machine=fx.MACHINE)
    with pytest.raises(R.ResultsError, match="schema_version 2"):
        R.check_record(dict(rec, schema_version=2))
    bad = fx.write(str(tmp_path / "bad.json"), {"comparisons": [{"workload": "x"}]})
    with pytest.raises(R.ResultsError, match="malformed bench result"):
        R.load_record(bad)


# ---- the results folder ---------------------------------------------------------------------


def test_the_results_folder_keeps_each_commit_by_date_and_sha(tmp_path):
    results_dir = fx.make_history(str(tmp_path))
    folders = sorted(os.listdir(results_dir))
    assert folders == ["20261120T090000Z_" + "a1" * 6, "20261127T090000Z_" + "b2" * 6]
    history = R.load_history(results_dir)
    assert [g.sha for g in history] == [fx.COMMIT_A["sha"], fx.COMMIT_B["sha"]]
    assert R.find_commit(history, "b2b2").sha == fx.COMMIT_B["sha"]
    assert R.find_commit(history, "previous").sha == fx.COMMIT_A["sha"]
    with pytest.raises(R.ResultsError, match="no commit 'ffff'"):
        R.find_commit(history, "ffff")
    # storing the same record again rewrites the same file
    rec = history[0].records[0]
    assert R.store(rec, results_dir) == R.store(rec, results_dir)


def test_figures_measured_by_two_records_of_one_commit_merge_per_implementation():
    a = R.normalize(fx.bench_json(), commit=fx.COMMIT_A, machine=fx.MACHINE,
                    recorded_at="2026-11-20T10:00:00+00:00")
    b = R.normalize(fx.scale_impl(fx.bench_json(), "spec", 2.0), commit=fx.COMMIT_A,
                    machine=fx.MACHINE, recorded_at="2026-11-20T11:00:00+00:00")
    for f in b["figures"]["throughput"]:  # the second run measured fast and an "upstream"
        f["impls"] = {"fast": f["impls"]["fast"], "upstream": f["impls"]["spec"]}
        f["ratios"] = R.fast_ratios(f["impls"])
    (g,) = R.group_by_commit([b, a])
    fig, _ = g.throughput()["shared-prefix/full/p1/60req"]
    assert set(fig["impls"]) == {"spec", "fast", "upstream"} and fig["records"] == 2
    assert set(fig["ratios"]) == {"fast/spec", "fast/upstream"}


# ---- compare mode ---------------------------------------------------------------------------


def _compare(tmp_path, base: dict, cur: dict, *extra: str, capsys=None) -> tuple[int, str]:
    b = fx.write(str(tmp_path / "base.json"), base)
    c = fx.write(str(tmp_path / "cur.json"), cur)
    rc = cli_main(["dashboard", "--results", str(tmp_path / "none"), "--compare", b,
                   "--current", c, *extra])
    return rc, capsys.readouterr().out if capsys else ""


def _thresholds(data: dict) -> list[float]:
    """Per figure, min/max of its fast/spec ratio: scaling fast's every round by a factor below
    it moves the whole current range below the base's (a drop beyond the measured noise); a
    factor above it keeps the drop within the noise (conformance/bench/dashboard.py's rule)."""
    rec = R.normalize(data, commit=fx.COMMIT_A, machine=fx.MACHINE)
    return [f["ratios"]["fast/spec"]["min"] / f["ratios"]["fast/spec"]["max"]
            for f in rec["figures"]["throughput"]]


def test_compare_catches_a_planted_regression_and_names_it(tmp_path, capsys):
    data = fx.bench_json()
    planted = 0.5 * min(_thresholds(data))
    rc, out = _compare(tmp_path, data, fx.scale_impl(data, "fast", planted), capsys=capsys)
    assert rc == D.EXIT_REGRESSION, out
    assert re.search(r"REGRESSION shared-prefix/full/p1/60req fast/spec: .* beyond its noise", out)
    assert "REGRESSION shared-prefix/full/p16/60req fast/spec" in out
    assert "2 regressions" in out


def test_compare_passes_within_the_measured_noise(tmp_path, capsys):
    data = fx.bench_json()
    assert _compare(tmp_path, data, data, capsys=capsys)[0] == D.EXIT_OK
    # a drop smaller than the rounds' spread is noise
    within = (1 + max(_thresholds(data))) / 2
    rc, out = _compare(tmp_path, data, fx.scale_impl(data, "fast", within), capsys=capsys)
    assert rc == D.EXIT_OK, out
    # --min-noise widens the noise: with a 99% floor even a planted drop passes
    planted = 0.5 * min(_thresholds(data))
    rc, out = _compare(tmp_path, data, fx.scale_impl(data, "fast", max(planted, 0.02)),
                       "--min-noise", "0.99", capsys=capsys)
    assert rc == D.EXIT_OK, out


def test_compare_fails_on_lost_identical_outcomes_and_new_divergences(tmp_path, capsys):
    data = fx.bench_json()
    broken = json.loads(json.dumps(data))
    broken["comparisons"][0]["identical_outcomes"] = False
    broken["comparisons"][0]["mismatches"] = ["fast differs from spec"]
    rc, out = _compare(tmp_path, data, broken, capsys=capsys)
    assert rc == D.EXIT_REGRESSION and "outcomes no longer identical: fast differs" in out
    rc, out = _compare(tmp_path, fx.run_json(), fx.run_json(divergences=1), capsys=capsys)
    assert rc == D.EXIT_REGRESSION and "REGRESSION conformance: 1 divergences" in out


def test_compare_with_nothing_in_common_exits_3(tmp_path, capsys):
    a = fx.bench_json()
    b = json.loads(json.dumps(a))
    for c in b["comparisons"]:
        c["workload"] = "mooncake"
    rc, out = _compare(tmp_path, a, b, capsys=capsys)
    assert rc == D.EXIT_NOTHING_COMPARED and "nothing to compare" in out


def test_compare_against_commits_of_the_results_folder(tmp_path, capsys):
    results_dir = fx.make_history(str(tmp_path))
    rc = cli_main(["dashboard", "--results", results_dir, "--compare", "a1a1a1"])
    out = capsys.readouterr().out
    assert rc in (D.EXIT_OK, D.EXIT_REGRESSION)  # B is A's numbers x1.02: not a drop
    assert rc == D.EXIT_OK, out
    assert "base a1a1a1a1, current b2b2b2b2" in out
    assert not os.path.exists(os.path.join(str(tmp_path), "dashboard.html"))


# ---- the command line: bad input leaves the folder as it was --------------------------------


def test_bad_input_exits_2_and_stores_nothing(tmp_path, capsys):
    good = fx.write(str(tmp_path / "good.json"), fx.run_json())
    bad = fx.write(str(tmp_path / "bad.json"), {"hello": 1})
    results_dir = str(tmp_path / "history")
    rc = cli_main(["dashboard", "--results", results_dir, "--add", good, bad,
                   "--out", str(tmp_path / "p.html")])
    assert rc == D.EXIT_BAD_INPUT
    assert "bad.json: not a bench result" in capsys.readouterr().err
    assert not os.path.exists(results_dir)
    assert cli_main(["dashboard", "--results", results_dir, "--compare", "abc"]) == D.EXIT_BAD_INPUT
    assert "no such results folder" in capsys.readouterr().err
    assert cli_main(["dashboard", "--commit", "abc"]) == D.EXIT_BAD_INPUT
    assert cli_main(["dashboard", "--current", "abc"]) == D.EXIT_BAD_INPUT
    assert cli_main(["dashboard", "--compare", good, "--min-noise", "2"]) == D.EXIT_BAD_INPUT


def test_add_then_page_from_the_command_line(tmp_path, capsys):
    results_dir = str(tmp_path / "history")
    page = str(tmp_path / "out" / "dashboard.html")
    f = fx.write(str(tmp_path / "bench.json"), fx.bench_json())
    assert cli_main(["dashboard", "--results", results_dir, "--add", f, "--commit", "abcdef1",
                     "--commit-date", "2026-11-25T00:00:00Z", "--out", page]) == 0
    out = capsys.readouterr().out
    assert "added" in out and f"wrote dashboard {page} (1 commit;" in out
    assert os.listdir(results_dir) == ["20261125T000000Z_abcdef1"]
    assert "abcdef1" in open(page, encoding="utf-8").read()


# ---- the page -------------------------------------------------------------------------------


def test_the_page_is_self_contained_and_shows_every_kind_of_figure(tmp_path):
    history = R.load_history(fx.make_history(str(tmp_path)))
    page = D.render(history)
    # no script, nothing fetched from anywhere
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page, re.I)
    assert "@import" not in page and "url(" not in page
    assert "default-src 'none'" in page
    # history of both commits, each figure and ratio, noise and machine
    assert "a1a1a1a1" in page and "b2b2b2b2" in page and "2 commits of history" in page
    for fid in ("shared-prefix/full/p1/60req", "shared-prefix/full/p16/60req"):
        assert f'data-figure="{fid}"' in page
        assert f'data-history="{fid}|fast/spec"' in page
    assert "identical outcomes" in page and "2 cores" in page and "load 0.50/0.40/0.30" in page
    assert "Per-operation latency medians" in page and "B/token" in page
    assert "conformance: 29,000 steps, 0 divergences" in page
    # the latest kernel run is commit A's: shown, and said to be older
    assert "kernels: fixture GPU" in page and "the latest commit has no kernel run" in page
    assert "No GPU run in the history" not in D.render(history[:1])
    assert "No GPU run in the history" in D.render([g for g in history if not g.kernels()[0]])


def test_the_page_shows_the_latest_gpu_run_against_its_ceilings(tmp_path):
    rec = R.normalize(fx.kernels_json(), commit=fx.COMMIT_B, machine=fx.MACHINE)
    page = D.render(R.group_by_commit([rec]))
    assert 'id=kernels-table' in page and "fixture GPU" in page
    assert "host→device 55," in page and "91%" in page  # 50 / 55 GB/s


def test_an_empty_history_is_an_error_not_an_empty_page(tmp_path):
    os.makedirs(tmp_path / "h")
    with pytest.raises(R.ResultsError, match="empty"):
        D.render(R.load_history(str(tmp_path / "h")))


def test_run_with_a_dashboard_records_the_run_beside_the_page(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git checkout: the commit is unknown
    page = str(tmp_path / "res" / "dashboard.html")
    D.record_run(fx.run_json(), page)
    out = capsys.readouterr().out
    assert f"wrote dashboard {page} (1 commit;" in out
    (folder,) = os.listdir(tmp_path / "res" / "history")
    assert folder == "undated_unknown"
    assert os.path.getsize(page) > 1000


def test_run_takes_a_dashboard_page():
    from uniradix.conformance.cli import build_parser
    args = build_parser().parse_args(["run", "--json", "r.json", "--dashboard", "d/page.html"])
    assert args.dashboard == "d/page.html"
    assert build_parser().parse_args(["run"]).dashboard is None


def test_figures_over_different_allocators_keep_apart():
    """A bench over sglang's allocators measures something else than one over the bench's free
    lists: the two records of one commit give two figures, never one merged figure."""
    free = R.normalize(fx.bench_json(), commit=fx.COMMIT_A, machine=fx.MACHINE)
    data = fx.bench_json()
    for c in data["comparisons"]:
        c["allocator"] = "sglang"
    sg = R.normalize(data, commit=fx.COMMIT_A, machine=fx.MACHINE)
    ids = {f["id"] for f in sg["figures"]["throughput"]}
    assert ids == {"shared-prefix/full/p1/60req/sglang-alloc",
                   "shared-prefix/full/p16/60req/sglang-alloc"}
    merged = R.CommitResults(sha="a" * 40, date=None, subject=None, dirty=False,
                             records=[free, sg]).throughput()
    assert set(merged) == ids | {f["id"] for f in free["figures"]["throughput"]}
    for fid, (fig, _machine) in merged.items():
        assert fig["records"] == 1
        assert fig["allocator"] == ("sglang" if fid.endswith("sglang-alloc") else "freelist")
        assert D._fig_title(fig).endswith(
            ", over sglang's allocators" if fid.endswith("sglang-alloc") else "60 req")
