"""Bench results as versioned records, and the results folder that keeps their history.

Every producer of numbers writes its own JSON today:

* ``uniradix bench --json`` (``{"comparisons": [...], "memory": [...]}``, conformance/bench/loop.py);
* ``uniradix run --json`` (``{"corpus", "lockstep", "bench", "machine"}``, conformance/run.py);
* ``make bench``: pytest-benchmark's JSON, one entry per (implementation, case) with the cache's
  numbers in ``extra_info`` (tests/bench/test_bench_cache.py);
* ``scripts/gpu-bench.sh`` / ``python -m uniradix.kernels.bench --json``
  (``{"env", "ceilings_gbps", "rows", "skipped"}``).

:func:`normalize` turns any of them into one **record** of the schema ``uniradix-bench``,
version :data:`SCHEMA_VERSION` (docs/BENCH_JSON.md is its reference): the commit and date it
measured, the machine (cores, load), and its figures, each number with its noise (min / median /
max over the rounds).  :func:`store` keeps a record in a results folder under its commit and
date; :func:`load_history` reads the folder back as one :class:`CommitResults` per commit,
oldest first.  Reading is tolerant of records a newer writer extended (unknown keys are kept and
ignored) but refuses a different major version by name.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

SCHEMA = "uniradix-bench"
SCHEMA_VERSION = 1
# Implementations that are not peers of ``fast`` in a ratio (the spec is the reference model;
# its ratio is kept too, as ``fast/spec``).
FAST = "fast"
SOURCES = ("bench", "run", "pytest-benchmark", "kernels", "storage", "record")


class ResultsError(ValueError):
    """A results file or folder that cannot be read as bench results (the message says why)."""


# --------------------------------------------------------------------------------------------
# Noise: a number measured over rounds
# --------------------------------------------------------------------------------------------


def stat(values: Iterable[float], digits: int = 4) -> dict | None:
    """``{"median", "min", "max", "n"}`` of the rounds (None when there are none)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    r = lambda x: round(x, digits)  # noqa: E731
    return {"median": r(statistics.median(vals)), "min": r(min(vals)), "max": r(max(vals)),
            "n": len(vals)}


def ratio_stat(a: dict | None, b: dict | None) -> dict | None:
    """The ratio ``a / b`` of two measured numbers: the median is median(a) / median(b); the
    range is the worst and best pairing of the rounds, min(a) / max(b) .. max(a) / min(b)."""
    if not a or not b or not b["median"] or not b["min"] or not b["max"]:
        return None
    return {"median": round(a["median"] / b["median"], 4), "min": round(a["min"] / b["max"], 4),
            "max": round(a["max"] / b["min"], 4), "n": min(a["n"], b["n"])}


# --------------------------------------------------------------------------------------------
# Where and on what a result was measured
# --------------------------------------------------------------------------------------------


def machine_info() -> dict:
    """The machine as the dashboard shows it: cores (all, and usable by this process), the load
    averages now, CPU model, platform and Python."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        model = platform.processor() or None
    return {"cpus": os.cpu_count(), "cpus_usable": usable, "load": load, "load_source": "now",
            "cpu_model": model, "platform": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version()}


def _git(args: list[str], cwd: str | None) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit_info(cwd: str | None = None) -> dict:
    """The checkout's commit: sha, commit date (ISO 8601), subject and whether the working tree
    has uncommitted changes to tracked files; every field None outside a git checkout."""
    line = _git(["log", "-1", "--format=%H%x00%cI%x00%s"], cwd)
    if not line:
        return {"sha": None, "date": None, "subject": None, "dirty": None}
    sha, date, subject = (line.split("\x00") + [None, None])[:3]
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {"sha": sha, "date": date, "subject": subject,
            "dirty": None if status is None else bool(status)}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


# --------------------------------------------------------------------------------------------
# Converting each producer's JSON
# --------------------------------------------------------------------------------------------


def split_workload(name: str) -> tuple[str, str]:
    """``shared-prefix+write_through`` -> (``shared-prefix``, ``write_through``); a plain
    workload name is the ``full`` configuration (Full component, device tier)."""
    base, _, config = name.partition("+")
    return base, (config or "full")


def figure_id(workload: str, config: str, page_size: int, requests: int,
              allocator: str = "freelist") -> str:
    """A figure's identity across commits.  The bench's own free lists (``freelist``, and every
    figure from before ``allocator`` was recorded) keep the plain id; any other allocator is a
    different measurement and gets its own id (``.../<requests>req/<allocator>-alloc``), so the
    dashboard never merges a figure over sglang's allocators with one over the free lists."""
    base = f"{workload}/{config}/p{page_size}/{requests}req"
    return base if allocator == "freelist" else f"{base}/{allocator}-alloc"


def _throughput_from_comparison(c: dict) -> dict:
    workload, config = split_workload(str(c["workload"]))
    impls: dict = {}
    for impl, d in c.get("impls", {}).items():
        runs = d.get("runs") or []
        rps = d.get("requests_per_s_runs") or [r.get("requests_per_s") for r in runs]
        ops: dict = {}
        for r in runs:
            for op, us in (r.get("op_median_us") or {}).items():
                ops.setdefault(op, []).append(us)
        if not ops:  # no per-round detail: the medians alone
            ops = {op: [us] for op, us in (d.get("op_median_us") or {}).items()}
        impls[impl] = {"version": d.get("version"),
                       "requests_per_s": stat(rps or [d.get("requests_per_s_median")], 1),
                       "op_us": {op: stat(v, 2) for op, v in ops.items()},
                       "hit_rate": d.get("hit_rate"), "evicted_tokens": d.get("evicted_tokens"),
                       "aborted": d.get("aborted"),
                       "pool_free_share": d.get("pool_free_share_median"),
                       "digest": d.get("digest")}
        if c.get("alloc_time"):  # bench --alloc-time: the time inside the pools' frees
            impls[impl].update(
                alloc_share=stat(r.get("alloc_share") for r in runs),
                requests_per_s_ex_alloc=stat((r.get("requests_per_s_ex_alloc") for r in runs), 1))
    allocator = str(c.get("allocator") or "freelist")
    fig = {"id": figure_id(workload, config, int(c["page_size"]), int(c["requests"]), allocator),
           "workload": workload, "config": config, "page_size": int(c["page_size"]),
           "requests": int(c["requests"]), "kv_slots": c.get("kv_slots"),
           "rounds": c.get("repeats"), "identical_outcomes": c.get("identical_outcomes"),
           "mismatches": list(c.get("mismatches") or []),
           "peer_differences": list(c.get("peer_differences") or []),
           "missing": dict(c.get("missing") or {}), "impls": impls, "noise_source": "rounds",
           "clock": str(c.get("clock") or "wall"),  # a bench from before --clock: wall
           "gc": str(c.get("gc") or "collect"),  # a bench from before --gc: collect
           # the KV allocator under fast and upstream (bench --allocator; before it: freelist)
           "allocator": allocator}
    fig["ratios"] = fast_ratios(impls, c.get("identical_outcomes"))
    if c.get("alloc_time"):
        fig["cap"] = c.get("cap")
    return fig


def fast_ratios(impls: dict, identical: bool | None = None) -> dict:
    """``fast/<peer>`` for every other implementation measured beside fast; when the conforming
    implementations' outcomes differ (``identical`` False) for the speed peers only (a ratio
    over different work means nothing; ``upstream-cpp`` is the speed peer, as in loop.py PEERS)."""
    if FAST not in impls:
        return {}
    out = {}
    for peer, d in impls.items():
        if peer == FAST or (identical is False and peer != "upstream-cpp"):
            continue
        r = ratio_stat(impls[FAST]["requests_per_s"], d["requests_per_s"])
        if r is not None:
            out[f"{FAST}/{peer}"] = r
    return out


def _from_bench(data: dict) -> dict:
    return {"throughput": [_throughput_from_comparison(c) for c in data.get("comparisons", [])],
            "memory": [_memory_row(m) for m in data.get("memory", [])]}


def _memory_row(m: dict) -> dict:
    return {"impl": m["impl"], "config": m.get("config", "full"), "page_size": m["page_size"],
            "requests": m.get("requests"),
            "cached_tokens": m.get("cached_tokens"), "tree_bytes": m.get("tree_bytes"),
            "bytes_per_token": m.get("bytes_per_token")}


def _from_run(data: dict) -> dict:
    figures: dict[str, Any] = {
        "throughput": [_throughput_from_comparison(c) for c in data.get("bench", [])],
        "memory": [_memory_row(m) for m in data.get("memory", [])]}
    conf: dict = {}
    if data.get("corpus"):
        conf["corpus"] = {impl: {k: c.get(k) for k in ("traces", "steps", "divergences")}
                          for impl, c in data["corpus"].items()}
    if data.get("lockstep"):
        conf["lockstep"] = {k: data["lockstep"].get(k)
                            for k in ("steps", "divergences", "violations", "seconds")}
    if conf:
        figures["conformance"] = conf
    return figures


def _from_pytest_benchmark(data: dict) -> dict:
    """Group pytest-benchmark entries by case into throughput figures.  Noise: the rounds'
    requests/s where the test kept them (``extra_info["requests_per_s_runs"]``); otherwise the
    spread of the rounds' wall times applied to the median requests/s (``noise_source``
    ``wall``: workload generation included, so an estimate)."""
    groups: dict = {}
    for b in data.get("benchmarks", []):
        x = b.get("extra_info") or {}
        if "impl" not in x or "requests_per_s" not in x:
            continue
        requests = int(x.get("requests", 0)) + int(x.get("aborted", 0) or 0)
        workload, config = split_workload(str(x.get("workload", b.get("name", "?"))))
        key = (workload, config, int(x.get("page_size", 1)), requests, x.get("kv_slots"))
        groups.setdefault(key, []).append((x, b.get("stats") or {}))
    figs = []
    for (workload, config, ps, requests, kv_slots), entries in groups.items():
        impls, sources, rounds = {}, set(), 0
        for x, st in entries:
            med = float(x["requests_per_s"])
            if x.get("requests_per_s_runs"):
                rps = stat(x["requests_per_s_runs"], 1)
                sources.add("rounds")
            elif st.get("min") and st.get("max") and st.get("median"):
                rps = {"median": med, "min": round(med * st["median"] / st["max"], 1),
                       "max": round(med * st["median"] / st["min"], 1),
                       "n": int(st.get("rounds", 1))}
                sources.add("wall")
            else:
                rps = stat([med], 1)
                sources.add("none")
            if rps is not None:  # None: no round recorded a number
                rounds = max(rounds, rps["n"])
            impls[x["impl"]] = {
                "version": x.get("version"), "requests_per_s": rps,
                "op_us": {op: stat([us], 2) for op, us in (x.get("op_median_us") or {}).items()},
                "hit_rate": x.get("hit_rate"), "evicted_tokens": x.get("evicted_tokens"),
                "aborted": x.get("aborted"), "pool_free_share": None, "digest": x.get("digest")}
        conforming = [d for i, d in impls.items() if i != "upstream-cpp"]
        digests = {d["digest"] for d in conforming if d.get("digest")}
        fig = {"id": figure_id(workload, config, ps, requests), "workload": workload,
               "config": config, "page_size": ps, "requests": requests, "kv_slots": kv_slots,
               "rounds": rounds,
               "identical_outcomes": (len(digests) <= 1) if len(conforming) > 1 else None,
               "mismatches": [] if len(digests) <= 1 else
               [f"per-request digests differ across {', '.join(sorted(impls))}"],
               "peer_differences": [], "missing": {}, "impls": impls,
               "noise_source": "+".join(sorted(sources))}
        fig["ratios"] = fast_ratios(impls, fig["identical_outcomes"])
        figs.append(fig)
    return {"throughput": figs}


def _from_kernels(data: dict) -> dict:
    env = data.get("env") or {}
    keep = ("layout", "direction", "page_size", "page_kib", "bytes", "triton_gbps", "torch_gbps",
            "memcpy_gbps", "ceiling_gbps", "triton_of_ceiling", "triton_over_memcpy", "verified",
            "target_ceiling_90", "target_3x_memcpy")
    device = str(env.get("device", "?"))
    return {"kernels": {
        "device": device, "smoke": device.startswith("cpu"), "torch": env.get("torch"),
        "triton": env.get("triton"), "memcpy_engine": env.get("memcpy_engine"),
        "reps": env.get("reps"), "seconds": env.get("seconds"),
        "ceilings_gbps": {k: round(float(v), 3) for k, v in (data.get("ceilings_gbps") or {}).items()},
        "rows": [{k: r.get(k) for k in keep} for r in data.get("rows", [])],
        "skipped": list(data.get("skipped") or [])}}


def _from_storage(data: dict) -> dict:
    """``uniradix bench-storage --json`` (conformance/bench/storage.py): its figures as they are."""
    return {"storage": [dict(f) for f in data["storage"]]}


def detect_source(data: Any) -> str:
    """Which producer wrote ``data`` (one of :data:`SOURCES`); :class:`ResultsError` if none."""
    if not isinstance(data, dict):
        raise ResultsError("not a JSON object")
    if data.get("schema") == SCHEMA:
        return "record"
    if "benchmarks" in data and isinstance(data["benchmarks"], list):
        return "pytest-benchmark"
    if "rows" in data and "ceilings_gbps" in data:
        return "kernels"
    if "comparisons" in data:
        return "bench"
    if isinstance(data.get("storage"), list):
        return "storage"
    if "corpus" in data or "lockstep" in data or "bench" in data:
        return "run"
    raise ResultsError("not a bench result: expected the JSON of `uniradix bench`, `uniradix "
                       "run`, pytest-benchmark (`make bench`), the kernel bench, `uniradix "
                       f"bench-storage`, or a {SCHEMA} record; found keys {sorted(data)[:8]}")


def check_record(rec: dict, where: str = "record") -> dict:
    """A record as read back: the schema and major version checked, nothing else changed."""
    if rec.get("schema") != SCHEMA:
        raise ResultsError(f"{where}: not a {SCHEMA} record")
    version = rec.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{where}: {SCHEMA} schema_version {version!r}; this uniradix reads "
                           f"version {SCHEMA_VERSION}")
    if not isinstance(rec.get("figures"), dict):
        raise ResultsError(f"{where}: no figures")
    return rec


def normalize(data: Any, *, commit: dict | None = None, machine: dict | None = None,
              recorded_at: str | None = None, file: str | None = None) -> dict:
    """One ``uniradix-bench`` record from any producer's JSON.

    ``commit`` and ``machine`` fill what the file does not say itself (pytest-benchmark keeps
    its own commit and machine; ``uniradix run`` keeps its machine); by default they are taken
    from the current checkout and this machine now, and ``machine["load_source"]`` says so."""
    source = detect_source(data)
    if source == "record":
        return check_record(data, file or "record")
    figures = {"bench": _from_bench, "run": _from_run, "pytest-benchmark": _from_pytest_benchmark,
               "kernels": _from_kernels, "storage": _from_storage}[source](data)
    c = dict(commit) if commit is not None else None
    m = dict(machine) if machine is not None else None
    when = recorded_at
    if source == "pytest-benchmark":
        ci, mi = data.get("commit_info") or {}, data.get("machine_info") or {}
        if c is None and ci.get("id"):
            c = {"sha": ci.get("id"), "date": ci.get("time"), "subject": None,
                 "dirty": ci.get("dirty")}
        if m is None and mi:
            here = machine_info()
            cpu = mi.get("cpu") or {}
            m = {"cpus": cpu.get("count") or here["cpus"], "cpus_usable": here["cpus_usable"],
                 "load": here["load"], "load_source": "ingest",
                 "cpu_model": cpu.get("brand_raw") or here["cpu_model"],
                 "platform": f"{mi.get('system', '')} {mi.get('machine', '')}".strip(),
                 "python": mi.get("python_version") or here["python"]}
        when = when or data.get("datetime")
    if source in ("run", "bench", "storage") and m is None and isinstance(data.get("machine"), dict):
        m = dict(data["machine"])
        m.setdefault("load_source", "file")
    if m is None:
        m = machine_info()
        m["load_source"] = "ingest"
    if source == "kernels":
        m = dict(m, gpu=figures["kernels"]["device"])
    if c is None:
        c = commit_info()
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "source": {"kind": source, "file": os.path.basename(file) if file else None},
            "commit": c, "recorded_at": when or now_iso(), "machine": m, "figures": figures}


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None


def load_record(path: str, **kw: Any) -> dict:
    """Read any accepted file as a record (``kw``: as :func:`normalize`)."""
    data = read_json(path)
    try:
        return normalize(data, file=path, **kw)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ResultsError):
            raise ResultsError(f"{path}: {e}") from None
        raise ResultsError(f"{path}: malformed {detect_source(data)} result "
                           f"({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------
# The results folder
# --------------------------------------------------------------------------------------------


def _compact(iso: str | None) -> str:
    if not iso:
        return "undated"
    try:
        t = _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return re.sub(r"[^0-9A-Za-z]", "", iso)[:15] or "undated"
    if t.tzinfo is not None:
        t = t.astimezone(_dt.timezone.utc)
    return t.strftime("%Y%m%dT%H%M%SZ")


def commit_folder(rec: dict) -> str:
    """``<commit date, UTC>_<sha, 12 digits>``, e.g. ``20261201T093000Z_f4ffae5a1b2c``."""
    c = rec.get("commit") or {}
    sha = (c.get("sha") or "unknown")[:12]
    return f"{_compact(c.get('date'))}_{sha}" + ("-dirty" if c.get("dirty") else "")


def store(rec: dict, results_dir: str) -> str:
    """Write ``rec`` under ``results_dir/<commit folder>/<recorded>_<source>_<digest>.json``;
    returns the path.  Storing the same record again rewrites the same file."""
    check_record(rec)
    folder = os.path.join(results_dir, commit_folder(rec))
    os.makedirs(folder, exist_ok=True)
    digest = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:8]
    name = f"{_compact(rec.get('recorded_at'))}_{rec['source']['kind']}_{digest}.json"
    path = os.path.join(folder, name)
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


@dataclasses.dataclass
class CommitResults:
    """Everything the results folder holds for one commit (all its records, oldest first),
    merged: for each figure the latest record's."""
    sha: str | None
    date: str | None
    subject: str | None
    dirty: bool | None
    records: list

    @property
    def label(self) -> str:
        return (self.sha or "unknown")[:8] + ("+" if self.dirty else "")

    def throughput(self) -> dict:
        """figure id -> (throughput figure, the machine of its latest record).  Where several
        records measured the same figure (say ``uniradix bench`` in the project's venv for spec
        and fast, and again in upstream's venv for fast and upstream), each implementation and
        each ratio is taken from the latest record that has it; a ratio is never formed across
        two records.  ``records`` counts the records merged."""
        out: dict = {}
        for rec in self.records:
            for fig in rec["figures"].get("throughput", []):
                machine = rec.get("machine") or {}
                if fig["id"] not in out:
                    out[fig["id"]] = (dict(fig, records=1), machine)
                    continue
                old = out[fig["id"]][0]
                merged = dict(fig, impls={**old["impls"], **fig["impls"]},
                              ratios={**old.get("ratios", {}), **fig.get("ratios", {})},
                              missing={k: v for k, v in {**old.get("missing", {}),
                                                         **fig.get("missing", {})}.items()
                                       if k not in old["impls"] and k not in fig["impls"]},
                              mismatches=old.get("mismatches", []) + fig.get("mismatches", []),
                              records=old.get("records", 1) + 1)
                flags = [f.get("identical_outcomes") for f in (old, fig)]
                merged["identical_outcomes"] = (None if None in flags else all(flags))
                out[fig["id"]] = (merged, machine)
        return out

    def memory(self) -> tuple[list, dict]:
        for rec in reversed(self.records):
            if rec["figures"].get("memory"):
                return rec["figures"]["memory"], rec.get("machine") or {}
        return [], {}

    def conformance(self) -> tuple[dict | None, dict]:
        for rec in reversed(self.records):
            if rec["figures"].get("conformance"):
                return rec["figures"]["conformance"], rec.get("machine") or {}
        return None, {}

    def storage(self) -> tuple[list, dict]:
        """The storage-backend figures of the latest record that has them, and its machine."""
        found: tuple = ([], {})
        for rec in self.records:
            figs = rec["figures"].get("storage")
            if figs:
                found = (figs, rec.get("machine") or {})
        return found

    def kernels(self) -> tuple[dict | None, dict]:
        """The latest GPU kernel run (a CPU smoke run only where there is no GPU run)."""
        found: tuple = (None, {})
        for rec in self.records:
            k = rec["figures"].get("kernels")
            if k and (not k.get("smoke") or found[0] is None or found[0].get("smoke")):
                found = (k, rec.get("machine") or {})
        return found


def _sort_key(rec_or_commit_date: str | None) -> str:
    return _compact(rec_or_commit_date)


def group_by_commit(records: Iterable[dict]) -> list[CommitResults]:
    """One :class:`CommitResults` per commit (records without a sha are one group per dirty
    flag), oldest commit first, each commit's records in recording order."""
    by: dict = {}
    for rec in records:
        c = rec.get("commit") or {}
        key = (c.get("sha"), bool(c.get("dirty")))
        if key not in by:
            by[key] = CommitResults(c.get("sha"), c.get("date"), c.get("subject"),
                                    c.get("dirty"), [])
        g = by[key]
        g.records.append(rec)
        if c.get("subject") and not g.subject:
            g.subject = c["subject"]
    for g in by.values():
        g.records.sort(key=lambda r: _compact(r.get("recorded_at")))
    return sorted(by.values(), key=lambda g: (_sort_key(g.date),
                                              _compact(g.records[0].get("recorded_at"))))


def load_history(results_dir: str) -> list[CommitResults]:
    """Every record under ``results_dir`` grouped by commit, oldest first.  A file that is not a
    record is an error naming it (the folder holds only what :func:`store` wrote)."""
    if not os.path.isdir(results_dir):
        raise ResultsError(f"{results_dir}: no such results folder")
    records = []
    for root, _dirs, files in os.walk(results_dir):
        for name in sorted(files):
            if name.endswith(".json"):
                path = os.path.join(root, name)
                records.append(check_record(read_json(path), path))
    return group_by_commit(records)


def find_commit(history: list[CommitResults], ref: str) -> CommitResults:
    """The commit whose sha starts with ``ref`` (or ``latest`` / ``previous``)."""
    if not history:
        raise ResultsError("the results folder is empty")
    if ref == "latest":
        return history[-1]
    if ref == "previous":
        if len(history) < 2:
            raise ResultsError("the results folder holds one commit; there is no previous one")
        return history[-2]
    hits = [g for g in history if g.sha and g.sha.startswith(ref.lower())]
    if not hits:
        raise ResultsError(f"no commit {ref!r} in the results folder (it holds "
                           + ", ".join(g.label for g in history) + ")")
    if len({g.sha for g in hits}) > 1:
        raise ResultsError(f"{ref!r} names more than one commit: "
                           + ", ".join(g.label for g in hits))
    return hits[-1]


if __name__ == "__main__":  # pragma: no cover - a quick look at one file
    print(json.dumps(load_record(sys.argv[1]), indent=1))
