"""`uniradix bench-storage` (conformance/bench/storage.py) on a tiny shape: the file backend is
measured and checked byte for byte, upstream's backends are skipped by name without sglang, the
JSON becomes a `uniradix-bench` record whose storage figures the dashboard shows, and bad
settings are refused by name.  The figures themselves: docs/PERFORMANCE.md."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from uniradix.conformance.bench import dashboard as D  # noqa: E402
from uniradix.conformance.bench import results as R  # noqa: E402
from uniradix.conformance.bench import storage as bs  # noqa: E402
from uniradix.conformance.cli import main  # noqa: E402

TINY = dict(pages=4, page_size=2, layers=1, heads=1, head_dim=8, rounds=2, warmup=0)


def test_the_file_backend_is_measured_and_upstreams_skipped_without_sglang(tmp_path):
    out = bs.run_storage_bench(["file", "upstream-file"], directory=str(tmp_path), **TINY)
    fig = out["storage"][0]
    assert fig["pages"] == 4 and fig["page_bytes"] == 2 * 1 * 2 * 8 * 2  # K,V x layer x page x dim x bf16
    row = fig["impls"]["file"]
    for d in bs.DIRECTIONS:
        assert row[d]["pages_per_s"]["n"] == 2 and row[d]["pages_per_s"]["median"] > 0
        assert row[d]["GB_per_s"]["median"] > 0
    if "upstream-file" in fig["impls"]:     # sglang importable here (the upstream venv)
        assert set(fig["ratios"]["file/upstream-file"]) == set(bs.DIRECTIONS)
    else:
        assert "sglang" in fig["skipped"]["upstream-file"] and fig["ratios"] == {}
    assert "file" in bs.format_table(out)


def test_the_json_is_a_record_the_dashboard_shows(tmp_path):
    path = tmp_path / "storage.json"
    rc = main(["bench-storage", "--storage", "file", "--pages", "2", "--page-size", "1",
               "--layers", "1", "--heads", "1", "--head-dim", "4", "--repeat", "1", "--warmup", "0",
               "--json", str(path)])
    assert rc == 0
    rec = R.normalize(json.loads(path.read_text()), commit={"sha": "a" * 40, "date": None,
                                                            "subject": None, "dirty": False})
    assert rec["source"]["kind"] == "storage" and rec["machine"]["cpus"] >= 1
    [fig] = rec["figures"]["storage"]
    assert set(fig["impls"]) == {"file"}
    group = R.group_by_commit([rec])[0]
    assert group.storage()[0] == [fig]
    html = "\n".join(D.storage_section(group))
    assert "Storage backends" in html and ">file<" in html


@pytest.mark.parametrize("args,match", [
    (["--storage", "nfs"], "unknown backend 'nfs'"),
    (["--pages", "0"], "at least 1"),
    (["--warmup", "-1"], "must be at least 0"),
])
def test_bad_settings_are_refused_by_name(capsys, args, match):
    with pytest.raises(SystemExit) as e:
        main(["bench-storage", *args])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_bad_settings_through_the_api_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown storage backend 'x'"):
        bs.run_storage_bench(["x"])
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        bs.run_storage_bench(["file"], rounds=0)
    with pytest.raises(ValueError, match="layout"):
        bs.run_storage_bench(["file"], layout="tokens_first")
