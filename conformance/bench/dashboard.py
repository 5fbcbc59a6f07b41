"""``uniradix dashboard``: the bench results as one static page, and a regression check for CI.

    uniradix dashboard [--results DIR] [--add FILE...] [--out PAGE.html]
    uniradix dashboard --compare BASE [--current CUR] [--min-noise F] [--results DIR]

The page is one self-contained HTML file: inline CSS, inline SVG plots, no script, no fonts or
images from anywhere (its Content-Security-Policy forbids every fetch), so it opens from a file
on a machine with no network.  It is built from the results folder (conformance/bench/results.py):
the history of fast's ratio against each peer per workload, configuration and page size, the
latest commit's requests/s, per-operation latency medians, hit rates and identical-outcome
flags, bytes per cached token, kernel GB/s against the copy ceilings (where a GPU run was
added), and conformance totals; every figure states its noise (min / median / max of the
rounds) and the machine it ran on (cores, load).

``--compare BASE`` checks every ratio both sides measured: a ratio *falls beyond its noise*
when ``base.median - current.median`` exceeds ``(base.median - base.min) + (current.max -
current.median)`` (the two sides' measured spreads toward each other) and ``--min-noise`` times
the base median.  Exit status (docs/CLI.md): 0 nothing fell; 1 a ratio fell beyond its noise,
an identical-outcome flag turned false, or conformance found divergences it did not before
(each named on a ``REGRESSION`` line); 2 bad input; 3 BASE and current share no figure.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from uniradix.conformance.bench import results as R
from uniradix.conformance.bench import subcommand_main

DEFAULT_RESULTS = os.path.join("bench-results", "history")
DEFAULT_PAGE = os.path.join("bench-results", "dashboard.html")

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_NOTHING_COMPARED = 0, 1, 2, 3

# One colour per implementation, the same in every plot.
COLORS = {"fast": "#0f766e", "upstream": "#d97706", "upstream-cpp": "#7c3aed",
          "upstream-rust": "#b91c1c", "spec": "#64748b"}
EXTRA_COLORS = ("#2563eb", "#db2777", "#65a30d", "#0891b2")
ENGINE_COLORS = {"triton": "#0f766e", "torch": "#d97706", "memcpy": "#7c3aed"}


def color(impl: str) -> str:
    if impl in COLORS:
        return COLORS[impl]
    return EXTRA_COLORS[sum(map(ord, impl)) % len(EXTRA_COLORS)]


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


# --------------------------------------------------------------------------------------------
# Number formatting
# --------------------------------------------------------------------------------------------


def fnum(x: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits and thousands separators; '-' for None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    if x.is_integer():
        return f"{x:,.0f}"
    mag = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - mag)
    return f"{x:,.{decimals}f}"


def fstat(s: dict | None, unit: str = "", digits: int = 3) -> str:
    """``median unit (min–max, n rounds)``."""
    if not s:
        return "-"
    text = f"{fnum(s['median'], digits)}{unit}"
    if s.get("n", 1) > 1:
        text += f" <span class=noise>({fnum(s['min'], digits)}–{fnum(s['max'], digits)})</span>"
    return text


def spread(s: dict | None) -> str:
    if not s or not s.get("median"):
        return "-"
    if s.get("n", 1) < 2:
        return "1 round"
    return f"±{100 * (s['max'] - s['min']) / 2 / s['median']:.1f}%"


def fmachine(m: dict) -> str:
    if not m:
        return "machine unknown"
    parts = []
    if m.get("cpus"):
        usable = m.get("cpus_usable")
        parts.append(f"{m['cpus']} cores" + (f" ({usable} usable)" if usable and usable != m["cpus"]
                                              else ""))
    if m.get("load"):
        where = {"ingest": " when added", "now": "", "file": ""}.get(m.get("load_source", ""), "")
        parts.append("load " + "/".join(f"{x:.2f}" for x in m["load"]) + where)
    if m.get("gpu"):
        parts.append(str(m["gpu"]))
    if m.get("cpu_model"):
        parts.append(str(m["cpu_model"]))
    return ", ".join(parts) or "machine unknown"


# --------------------------------------------------------------------------------------------
# SVG plots
# --------------------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    return ticks


def history_chart(title: str, points: list[tuple[str, dict | None]], unit: str = "×",
                  stroke: str = "#0f766e", width: int = 380, height: int = 170) -> str:
    """A line over commits (oldest left) with each point's min–max whisker; a dashed line at 1
    when the range includes it (parity)."""
    left, right, top, bottom = 46, 16, 26, 34
    pw, ph = width - left - right, height - top - bottom
    vals = [(i, s) for i, (_, s) in enumerate(points) if s]
    lo = min(s["min"] for _, s in vals)
    hi = max(s["max"] for _, s in vals)
    pad = (hi - lo) * 0.15 or abs(hi) * 0.1 or 1.0
    floor = 0.0 if lo >= 0 else None  # speeds and ratios are never negative
    lo, hi = lo - pad, hi + pad
    if floor is not None:
        lo = max(lo, floor)
    ticks = [t for t in nice_ticks(lo, hi) if floor is None or t >= floor]
    lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    n = len(points)
    x = lambda i: left + (pw / 2 if n == 1 else pw * i / (n - 1))  # noqa: E731
    y = lambda v: top + ph * (1 - (v - lo) / (hi - lo))  # noqa: E731
    out = [f'<svg class=chart viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="{esc(title)}">',
           f'<text x="{left}" y="15" class=ct>{esc(title)}</text>']
    for t in ticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" class=grid />'
                   f'<text x="{left - 6}" y="{y(t) + 4:.1f}" class=yt>{fnum(t, 3)}</text>')
    if unit == "×" and lo < 1 < hi:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(1):.1f}" y2="{y(1):.1f}" class=parity />')
    step = max(1, math.ceil(n / 6))
    for i, (label, _) in enumerate(points):
        if i % step == 0 or i == n - 1:
            anchor = "middle" if n == 1 else "start" if i == 0 else "end" if i == n - 1 else "middle"
            out.append(f'<text x="{x(i):.1f}" y="{height - 12}" class=xt '
                       f'text-anchor="{anchor}">{esc(label)}</text>')
    path = " ".join(f"{'M' if k == 0 else 'L'}{x(i):.1f},{y(s['median']):.1f}"
                    for k, (i, s) in enumerate(vals))
    out.append(f'<path d="{path}" fill="none" stroke="{stroke}" stroke-width="2" />')
    for i, s in vals:
        out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{y(s["min"]):.1f}" '
                   f'y2="{y(s["max"]):.1f}" stroke="{stroke}" stroke-width="1.5" opacity=".55" />'
                   f'<circle cx="{x(i):.1f}" cy="{y(s["median"]):.1f}" r="3.5" fill="{stroke}">'
                   f'<title>{esc(points[i][0])}: {fnum(s["median"])}{unit} '
                   f'(min {fnum(s["min"])}, max {fnum(s["max"])}, {s.get("n", 1)} rounds)</title>'
                   f'</circle>')
    i, s = vals[-1]
    out.append(f'<text x="{min(x(i), left + pw - 4):.1f}" y="{y(s["median"]) - 8:.1f}" '
               f'class=last text-anchor="end">{fnum(s["median"])}{unit}</text>')
    out.append("</svg>")
    return "".join(out)


def hbar_chart(rows: list[tuple[str, dict | None, str]], unit: str, log: bool = False,
               width: int = 420, bar_h: int = 18) -> str:
    """Horizontal bars (median) with min–max whiskers; a log axis when the values span orders of
    magnitude."""
    bars = [(label, s, col) for label, s, col in rows if s]
    if not bars:
        return ""
    label_w, right = 104, 84
    pw = width - label_w - right
    height = 8 + len(bars) * (bar_h + 8)
    hi = max(s["max"] for _, s, _ in bars) or 1.0
    lo_pos = min((s["min"] for _, s, _ in bars if s["min"] > 0), default=hi) if log else 0.0
    if log:
        a, b = math.log10(lo_pos) - 0.3, math.log10(hi)
        sx = lambda v: label_w + pw * (math.log10(max(v, 1e-12)) - a) / (b - a)  # noqa: E731
    else:
        sx = lambda v: label_w + pw * v / hi  # noqa: E731
    out = [f'<svg class=bars viewBox="0 0 {width} {height}" width="{width}" height="{height}">']
    for k, (label, s, col) in enumerate(bars):
        y0 = 6 + k * (bar_h + 8)
        xm = sx(s["median"])
        out.append(f'<text x="{label_w - 8}" y="{y0 + bar_h - 5}" class=bl>{esc(label)}</text>'
                   f'<rect x="{label_w}" y="{y0}" width="{max(1.0, xm - label_w):.1f}" height="{bar_h}" '
                   f'rx="3" fill="{col}"><title>{esc(label)}: {fnum(s["median"])} {esc(unit)}</title></rect>')
        if s.get("n", 1) > 1:
            ym = y0 + bar_h / 2
            out.append(f'<line x1="{sx(s["min"]):.1f}" x2="{sx(s["max"]):.1f}" y1="{ym}" y2="{ym}" '
                       f'class=whisker /><line x1="{sx(s["min"]):.1f}" x2="{sx(s["min"]):.1f}" '
                       f'y1="{y0 + 4}" y2="{y0 + bar_h - 4}" class=whisker /><line x1="{sx(s["max"]):.1f}" '
                       f'x2="{sx(s["max"]):.1f}" y1="{y0 + 4}" y2="{y0 + bar_h - 4}" class=whisker />')
        out.append(f'<text x="{width - right + 6}" y="{y0 + bar_h - 5}" class=bv>{fnum(s["median"])} '
                   f'{esc(unit)}</text>')
    out.append("</svg>")
    return "".join(out)


def kernel_bullet(row: dict, width: int = 260) -> str:
    """One kernel configuration: the engines' GB/s as bars against the direction's copy ceiling
    (the dark tick)."""
    ceil = row.get("ceiling_gbps") or 0.0
    vals = {e: row.get(f"{e}_gbps") for e in ENGINE_COLORS}
    top = max([ceil] + [v for v in vals.values() if v]) or 1.0
    out = [f'<svg class=bullet viewBox="0 0 {width} 30" width="{width}" height="30">']
    for k, (e, v) in enumerate(vals.items()):
        if v:
            out.append(f'<rect x="0" y="{2 + 9 * k}" width="{max(1.0, width * v / top):.1f}" height="7" '
                       f'fill="{ENGINE_COLORS[e]}"><title>{e}: {fnum(v)} GB/s</title></rect>')
    if ceil:
        cx = width * ceil / top - 1
        out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="0" y2="30" class=ceil>'
                   f'<title>copy ceiling {fnum(ceil)} GB/s</title></line>')
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------

CSS = """
:root{--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--card:#fff;--ok:#15803d;--bad:#b91c1c}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
  font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
header{background:linear-gradient(120deg,#0f172a,#134e4a);color:#fff;padding:28px 40px 22px}
header h1{margin:0 0 4px;font-size:26px;letter-spacing:-.01em}
header .sub{color:#cbd5e1}
header code{color:#99f6e4}
main{padding:8px 40px 40px;max-width:1500px}
h2{font-size:18px;margin:30px 0 4px}
h2+.lead{margin-top:0}
.lead{color:var(--muted);margin:0 0 12px;max-width:980px}
.pills{display:flex;flex-wrap:wrap;gap:8px;margin-top:14px}
.pill{border-radius:999px;padding:3px 12px;font-size:13px;background:rgba(255,255,255,.12);
  border:1px solid rgba(255,255,255,.25)}
.pill.ok{background:#14532d;border-color:#22c55e}
.pill.bad{background:#7f1d1d;border-color:#f87171}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:14px}
.grid.wide{grid-template-columns:repeat(auto-fill,minmax(560px,1fr))}
.grid.wide .noise{display:block;line-height:1.1}
#memory-card{max-width:560px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px 16px;
  box-shadow:0 1px 2px rgba(15,23,42,.05)}
.card h3{margin:0 0 2px;font-size:15px}
.meta{color:var(--muted);font-size:12px;margin:4px 0 0}
.big{font-size:30px;font-weight:650;letter-spacing:-.02em}
.ratios{display:flex;flex-wrap:wrap;gap:6px 22px;margin:8px 0 4px}
.ratio .name{color:var(--muted);font-size:12px}
.noise{color:var(--muted);font-size:12px;font-weight:400}
table{border-collapse:collapse;background:var(--card);border:1px solid var(--line);border-radius:8px;
  font-variant-numeric:tabular-nums}
th,td{padding:5px 10px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{background:#f1f5f9;font-weight:600;font-size:12px;color:#334155}
td.l,th.l{text-align:left}
td.w{white-space:normal;min-width:240px}
.yes{color:var(--ok);font-weight:600}.no{color:var(--bad);font-weight:700}
.dot{display:inline-block;width:10px;height:10px;border-radius:3px;margin-right:6px;vertical-align:-1px}
svg.chart,svg.bars{max-width:100%;height:auto}
svg text{font:11px system-ui,-apple-system,"DejaVu Sans",sans-serif;fill:#475569}
svg .ct{font-size:12.5px;font-weight:600;fill:var(--ink)}
svg .yt{text-anchor:end}
svg .grid{stroke:#e2e8f0}svg .parity{stroke:#94a3b8;stroke-dasharray:4 3}
svg .last{font-weight:650;fill:var(--ink)}
svg .bl{text-anchor:end;fill:var(--ink)}svg .bv{fill:var(--ink)}
svg .whisker{stroke:#0f172a;stroke-width:1.2;opacity:.6}
svg .ceil{stroke:#0f172a;stroke-width:2}
.legend{display:flex;gap:14px;flex-wrap:wrap;color:var(--muted);font-size:12px;margin:4px 0 10px}
.empty{color:var(--muted);font-style:italic}
footer{color:var(--muted);font-size:12px;padding:0 40px 30px}
.wrap{overflow-x:auto}
"""


def _legend(names: Iterable[str], colors: dict | None = None) -> str:
    return "<div class=legend>" + "".join(
        f'<span><span class=dot style="background:{(colors or {}).get(n) or color(n)}"></span>{esc(n)}</span>'
        for n in names) + "</div>"


def _fig_title(fig: dict) -> str:
    cfg = "" if fig["config"] == "full" else f" + {fig['config']}"
    alloc = fig.get("allocator") or "freelist"  # (a figure from before the key: freelist)
    over = "" if alloc == "freelist" else f", over {alloc}'s allocators"
    return f"{fig['workload']}{cfg}, page {fig['page_size']}, {fig['requests']:,} req{over}"


def _fig_meta(fig: dict, machine: dict) -> str:
    return (f"{fig['requests']:,} requests, {fnum(fig.get('kv_slots'))}-token pool, "
            f"{fig.get('rounds') or 1} rounds (noise from {fig.get('noise_source', 'rounds')}); "
            f"{fmachine(machine)}")


def _ratio_order(key: str) -> tuple:
    order = ["fast/upstream", "fast/upstream-rust", "fast/upstream-cpp", "fast/spec"]
    return (order.index(key) if key in order else len(order), key)


def render(history: list[R.CommitResults], title: str = "uniradix benchmarks",
           generated_at: str | None = None) -> str:
    """The whole page for a results history (oldest commit first)."""
    if not history:
        raise R.ResultsError("no results to show: the results folder is empty (add some with "
                             "`uniradix dashboard --add FILE`)")
    latest = history[-1]
    labels = [g.label for g in history]
    body: list[str] = []

    # ---- header
    conf, conf_m = latest.conformance()
    figs = latest.throughput()
    pills = []
    if conf:
        steps = sum((c.get("steps") or 0) for c in conf.get("corpus", {}).values()) + \
            (conf.get("lockstep", {}).get("steps") or 0)
        bad = sum((c.get("divergences") or 0) for c in conf.get("corpus", {}).values()) + \
            (conf.get("lockstep", {}).get("divergences") or 0) + \
            (conf.get("lockstep", {}).get("violations") or 0)
        pills.append(f'<span class="pill {"bad" if bad else "ok"}" id=conformance-status>'
                     f'conformance: {steps:,} steps, {bad} divergences</span>')
    flags = [f.get("identical_outcomes") for f, _ in figs.values()
             if f.get("identical_outcomes") is not None]
    if flags:
        pills.append(f'<span class="pill {"ok" if all(flags) else "bad"}" id=outcomes-status>'
                     f'outcomes identical: {sum(flags)}/{len(flags)} figures</span>')
    kern, kern_m, kern_commit = None, {}, None
    for g in reversed(history):  # the latest commit with a kernel run (GPU runs are rare)
        kr, km = g.kernels()
        if kr and (kern is None or (kern.get("smoke") and not kr.get("smoke"))):
            kern, kern_m, kern_commit = kr, km, g
            if not kr.get("smoke"):
                break
    pills.append('<span class=pill>' + (f"kernels: {esc(kern['device'])}" if kern else
                                         "kernels: no GPU run") + '</span>')
    pills.append(f'<span class=pill>{len(history)} commit{"s" if len(history) != 1 else ""} '
                 'of history</span>')
    subject = f" — {esc(latest.subject)}" if latest.subject else ""
    body.append(f'<header><h1>{esc(title)}</h1><div class=sub>latest commit '
                f'<code>{esc(latest.label)}</code> ({esc((latest.date or "undated")[:19].replace("T", " "))})'
                f'{subject}</div><div class=pills>{"".join(pills)}</div></header><main>')

    # ---- fast against its peers, latest commit
    body.append('<h2 id=ratios>fast against its peers</h2><p class=lead>Requests/s of cache work, '
                'fast divided by each peer, latest commit. A ratio\'s range pairs the rounds\' '
                'worst and best (min(fast)/max(peer) – max(fast)/min(peer)).</p><div class=grid>')
    if not figs:
        body.append('<p class=empty>No throughput figures in the latest commit.</p>')
    for fid, (fig, m) in sorted(figs.items()):
        ratios = sorted(fig.get("ratios", {}).items(), key=lambda kv: _ratio_order(kv[0]))
        rhtml = "".join(f'<div class=ratio><div class=name>{esc(k)}</div><div class=big>'
                        f'{fnum(v["median"])}×</div><div class=noise>{fnum(v["min"])}–{fnum(v["max"])}'
                        f'</div></div>' for k, v in ratios) or \
            '<p class=empty>fast was measured alone: no ratio</p>'
        ident = fig.get("identical_outcomes")
        flag = ('outcomes not compared (one implementation)' if len(fig["impls"]) < 2 else
                '<span class=yes>identical outcomes</span>' if ident else
                '<span class=no>OUTCOMES DIFFER</span>' if ident is False else 'outcomes not checked')
        rows = [(impl, d["requests_per_s"], color(impl)) for impl, d in fig["impls"].items()]
        rps = [d["requests_per_s"]["median"] for d in fig["impls"].values() if d["requests_per_s"]]
        use_log = len(rps) > 1 and min(rps) > 0 and max(rps) / min(rps) > 20
        missing = "".join(f'<p class=meta>{esc(i)}: not measured ({esc(w[:140])})</p>'
                          for i, w in fig.get("missing", {}).items())
        body.append(f'<section class=card data-figure="{esc(fid)}"><h3>{esc(_fig_title(fig))}</h3>'
                    f'<div class=ratios>{rhtml}</div>'
                    f'{hbar_chart(rows, "req/s", log=use_log)}'
                    f'<p class=meta>{flag}; {_fig_meta(fig, m)}'
                    f'{"; log scale" if use_log else ""}</p>{missing}</section>')
    body.append('</div>')

    # ---- history of each ratio
    body.append('<h2 id=history>History</h2><p class=lead>Each ratio across the commits in the '
                'results folder (oldest left); whiskers are the min–max over the rounds, the dashed '
                'line is parity.</p><div class=grid>')
    series = _series(history, lambda fid, fig: (((fid, key), s)
                                                for key, s in fig.get("ratios", {}).items()))
    if not series:
        body.append('<p class=empty>No ratios recorded yet.</p>')
    for (fid, key), d in sorted(series.items(), key=lambda kv: (kv[0][0], _ratio_order(kv[0][1]))):
        peer = key.split("/", 1)[1]
        pts = list(zip(labels, d["points"], strict=True))
        chart = history_chart(key + " · " + _fig_title(d["fig"]), pts, "×", color(peer))
        seen = sum(1 for p in d["points"] if p)
        body.append(f'<section class=card data-history="{esc(fid)}|{esc(key)}">{chart}'
                    f'<p class=meta>{seen} of {len(history)} commits; '
                    f'{d["fig"]["requests"]:,} requests</p></section>')
    body.append('</div>')

    # requests/s history per implementation
    body.append('<h2 id=throughput-history>Requests/s over commits</h2><p class=lead>fast\'s own '
                'requests/s per figure (the machine differs between runs: see each point\'s '
                'record).</p><div class=grid>')
    rps_series = _series(history, lambda fid, fig: (
        [(fid, fig["impls"]["fast"]["requests_per_s"])] if "fast" in fig["impls"] else []))
    for _fid, d in sorted(rps_series.items()):
        chart = history_chart("fast req/s · " + _fig_title(d["fig"]),
                              list(zip(labels, d["points"], strict=True)),
                              "", color("fast"))
        body.append(f'<section class=card>{chart}'
                    f'<p class=meta>{d["fig"]["requests"]:,} requests</p></section>')
    body.append('</div>')

    # ---- per-op latency
    body.append('<h2 id=latency>Per-operation latency medians (µs)</h2><p class=lead>Median time '
                'of each cache call in a round; the value is the median over rounds, in brackets '
                'the rounds\' min–max. Latest commit.</p><div class="grid wide">')
    for _fid, (fig, m) in sorted(figs.items()):
        ops = list(dict.fromkeys(op for d in fig["impls"].values() for op in d.get("op_us", {})))
        head = "".join(f"<th>{esc(op)}</th>" for op in ops)
        trs = "".join(
            f'<tr><td class=l><span class=dot style="background:{color(impl)}"></span>{esc(impl)}</td>'
            + "".join(f"<td>{fstat(d.get('op_us', {}).get(op))}</td>" for op in ops) + "</tr>"
            for impl, d in fig["impls"].items())
        body.append(f'<section class=card><h3>{esc(_fig_title(fig))}</h3><div class=wrap><table>'
                    f'<tr><th class=l>impl</th>{head}</tr>{trs}</table></div>'
                    f'<p class=meta>{_fig_meta(fig, m)}</p></section>')
    body.append('</div>')

    # ---- hit rate and outcomes
    body.append('<h2 id=outcomes>Hit rate and outcomes</h2><p class=lead>Hit rate (matched prompt '
                'tokens / prompt tokens), evicted tokens and aborts, which every conforming '
                'implementation must reproduce exactly; speed peers (upstream-cpp) keep their own '
                'LRU order and may differ.</p><div class=wrap><table id=outcomes-table><tr>'
                '<th class=l>figure</th><th class=l>impl</th><th>hit rate</th><th>evicted tokens</th>'
                '<th>aborted</th><th>req/s</th><th>noise</th><th class=l>identical outcomes</th></tr>')
    for _fid, (fig, _m) in sorted(figs.items()):
        ident = fig.get("identical_outcomes")
        cell = ('<span class=yes>yes</span>' if ident else
                f'<span class=no>NO</span> {esc("; ".join(fig.get("mismatches", []))[:200])}'
                if ident is False else "-")
        for k, (impl, d) in enumerate(fig["impls"].items()):
            body.append(f'<tr><td class=l>{esc(_fig_title(fig)) if k == 0 else ""}</td>'
                        f'<td class=l><span class=dot style="background:{color(impl)}"></span>'
                        f'{esc(impl)}</td>'
                        f'<td>{fnum(d.get("hit_rate"), 4)}</td><td>{fnum(d.get("evicted_tokens"), 9)}</td>'
                        f'<td>{fnum(d.get("aborted"), 9)}</td>'
                        f'<td>{fnum((d.get("requests_per_s") or {}).get("median"))}</td>'
                        f'<td>{spread(d.get("requests_per_s"))}</td>'
                        f'<td class=l>{cell if k == 0 else ""}</td></tr>')
    body.append('</table></div>')

    # ---- memory
    mem, mem_m = latest.memory()
    body.append('<h2 id=memory>Bytes per cached token</h2><p class=lead>The tree\'s own structures '
                '(a deep getsizeof walk over the cache after Mooncake requests with no eviction), '
                'divided by the tokens it holds.</p>')
    if mem:
        rows = [(f"{r['impl']}{_config_tag(r)} p{r['page_size']}", R.stat([r["bytes_per_token"]], 2),
                 color(r["impl"]))
                for r in mem if r.get("bytes_per_token") is not None]
        body.append(f'<section class=card id=memory-card>{hbar_chart(rows, "B/token")}<p class=meta>'
                    f'{mem[0].get("requests")} Mooncake requests; one measurement each (deterministic); '
                    f'{fmachine(mem_m)}</p></section>')
    else:
        body.append('<p class=empty>No memory figures (run <code>uniradix bench --memory --json FILE</code> '
                    'and add the file).</p>')

    # ---- kernels
    body.append('<h2 id=kernels>HiCache copy kernels</h2>')
    if kern and kern_commit is not None:  # found together
        c = kern.get("ceilings_gbps", {})
        smoke = (' <span class=no>CPU smoke run: the numbers mean nothing</span>' if kern.get("smoke")
                 else "")
        body.append(f'<p class=lead>GB/s of payload moved one way per layout, direction and page '
                    f'size: Triton, torch index copies and one memcpy per page, against the measured '
                    f'copy ceiling of the direction (dark tick). Ceilings: device→device '
                    f'{fnum(c.get("d2d"))}, host→device {fnum(c.get("h2d"))}, device→host '
                    f'{fnum(c.get("d2h"))} GB/s. {esc(kern["device"])}, torch {esc(kern.get("torch"))}, '
                    f'triton {esc(kern.get("triton"))}; each number the median of {esc(kern.get("reps"))} '
                    f'timed runs (the kernel bench keeps no min/max). From commit '
                    f'<code>{esc(kern_commit.label)}</code>'
                    f'{"" if kern_commit is latest else " (the latest commit has no kernel run)"}; '
                    f'{esc(fmachine(kern_m))}.{smoke}</p>')
        body.append(_legend(ENGINE_COLORS, ENGINE_COLORS))
        body.append('<div class=wrap><table id=kernels-table><tr><th class=l>layout</th>'
                    '<th class=l>direction</th>'
                    '<th>page</th><th>KiB</th><th>triton</th><th>torch</th><th>memcpy</th><th>ceiling</th>'
                    '<th>% ceiling</th><th class=l>against the ceiling</th><th class=l>verified</th></tr>')
        for r in kern.get("rows", []):
            pct = r.get("triton_of_ceiling")
            verified = "<span class=yes>yes</span>" if r.get("verified") else "<span class=no>NO</span>"
            body.append(f'<tr><td class=l>{esc(r.get("layout"))}</td>'
                        f'<td class=l>{esc(r.get("direction"))}</td>'
                        f'<td>{r.get("page_size")}</td><td>{r.get("page_kib")}</td>'
                        f'<td>{fnum(r.get("triton_gbps"))}</td><td>{fnum(r.get("torch_gbps"))}</td>'
                        f'<td>{fnum(r.get("memcpy_gbps"))}</td><td>{fnum(r.get("ceiling_gbps"))}</td>'
                        f'<td>{"-" if pct is None else f"{100 * pct:.0f}%"}</td>'
                        f'<td class=l>{kernel_bullet(r)}</td>'
                        f'<td class=l>{verified}</td></tr>')
        body.append('</table></div>')
        if kern.get("skipped"):
            body.append('<p class=meta>over the time budget, not measured: '
                        f'{esc(", ".join(kern["skipped"]))}</p>')
    else:
        body.append('<p class=empty>No GPU run in the history: run <code>make gpu-bench</code> on a GPU '
                    'machine, then <code>uniradix dashboard --add bench-results/kernels-gpu.json</code>.</p>')

    # ---- storage backends (uniradix bench-storage)
    body.extend(storage_section(latest))

    # ---- conformance across commits
    body.append('<h2 id=conformance>Conformance</h2><p class=lead>Golden-corpus replay on each '
                'implementation and the randomized lockstep run of <code>uniradix run</code>, per '
                'commit.</p>')
    rows_html = []
    for g in history:
        cf, cm = g.conformance()
        if not cf:
            continue
        corpus = cf.get("corpus", {})
        lk = cf.get("lockstep", {})
        cells = "; ".join(f"{esc(i)} {c.get('traces')} traces, {fnum(c.get('steps'), 9)} steps, "
                          f"{_bad(c.get('divergences'))} div." for i, c in corpus.items())
        rows_html.append(f'<tr><td class=l><code>{esc(g.label)}</code></td>'
                         f'<td class=l>{esc((g.date or "")[:10])}</td>'
                         f'<td class="l w">{cells}</td><td>{fnum(lk.get("steps"), 9)}</td>'
                         f'<td>{_bad(lk.get("divergences"))}</td><td>{_bad(lk.get("violations"))}</td>'
                         f'<td class="l w">{esc(fmachine(cm))}</td></tr>')
    if rows_html:
        body.append('<div class=wrap><table id=conformance-table><tr><th class=l>commit</th>'
                    '<th class=l>date</th>'
                    '<th class=l>corpus replay</th><th>lockstep steps</th><th>divergences</th>'
                    '<th>violations</th><th class=l>machine</th></tr>' + "".join(rows_html)
                    + '</table></div>')
    else:
        body.append('<p class=empty>No conformance totals (they come from <code>uniradix run</code>).</p>')

    # ---- commits
    body.append('<h2 id=commits>Commits in the results folder</h2><div class=wrap><table><tr>'
                '<th class=l>commit</th><th class=l>date</th><th class=l>subject</th>'
                '<th class=l>records</th></tr>')
    for g in reversed(history):
        kinds = ", ".join(r["source"]["kind"] for r in g.records)
        body.append(f'<tr><td class=l><code>{esc(g.label)}</code></td><td class=l>'
                    f'{esc((g.date or "undated")[:19].replace("T", " "))}</td>'
                    f'<td class=l>{esc((g.subject or "")[:90])}</td>'
                    f'<td class=l>{esc(kinds)}</td></tr>')
    body.append('</table></div></main>')
    body.append(f'<footer>Generated by <code>uniradix dashboard</code>'
                f'{" at " + esc(generated_at) if generated_at else ""} '
                f'from {sum(len(g.records) for g in history)} records (schema {R.SCHEMA} version '
                f'{R.SCHEMA_VERSION}, docs/BENCH_JSON.md). Static page: no script, no network.</footer>')
    csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name=viewport content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def storage_section(commit: R.CommitResults) -> list[str]:
    """Prefetch and backup throughput of the storage backends at ``commit`` (bench-storage)."""
    figs, m = commit.storage()
    out = ['<h2 id=storage>Storage backends</h2>']
    if not figs:
        out.append('<p class=empty>No storage figures (run <code>uniradix bench-storage --json FILE'
                   '</code> in the upstream venv and add the file).</p>')
        return out
    for fig in figs:
        out.append(f'<p class=lead>{esc(fig.get("pages"))} pages of {esc(fig.get("page_bytes"))} '
                   f'bytes ({esc(fig.get("layout"))}, page {esc(fig.get("page_size"))}), batches of '
                   f'{esc(fig.get("batch_pages"))}; median (min..max) of {esc(fig.get("rounds"))} '
                   f'alternating rounds; pool {esc(fig.get("pool"))}; {esc(fmachine(m))}.</p>')
        out.append('<div class=wrap><table class=storage-table><tr><th class=l>backend</th>'
                   '<th class=l>version</th><th>backup pages/s</th><th>backup GB/s</th>'
                   '<th>prefetch pages/s</th><th>prefetch GB/s</th></tr>')
        for name, row in (fig.get("impls") or {}).items():
            b, p = row.get("backup") or {}, row.get("prefetch") or {}
            out.append(f'<tr><td class=l>{esc(name)}</td><td class=l>{esc(row.get("version"))}</td>'
                       f'<td>{fstat(b.get("pages_per_s"), "", 0)}</td><td>{fstat(b.get("GB_per_s"))}</td>'
                       f'<td>{fstat(p.get("pages_per_s"), "", 0)}</td>'
                       f'<td>{fstat(p.get("GB_per_s"))}</td></tr>')
        out.append('</table></div>')
        for pair, r in (fig.get("ratios") or {}).items():
            out.append(f'<p class=meta>{esc(pair)}: backup {fstat(r.get("backup"), "×", 2)}, '
                       f'prefetch {fstat(r.get("prefetch"), "×", 2)}</p>')
        if fig.get("skipped"):
            out.append('<p class=meta>skipped: ' + esc("; ".join(
                f"{k}: {v}" for k, v in fig["skipped"].items())) + '</p>')
    return out


def _bad(n: int | None) -> str:
    if n is None:
        return "-"
    return f'<span class={"no" if n else "yes"}>{n}</span>'


def write_page(history: list[R.CommitResults], path: str, title: str = "uniradix benchmarks") -> str:
    page = render(history, title=title, generated_at=R.now_iso())
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# Compare mode
# --------------------------------------------------------------------------------------------


def compare(base: R.CommitResults, cur: R.CommitResults, min_noise: float = 0.0
            ) -> tuple[list[str], list[str], int]:
    """(regressions, other lines, ratios compared) between two commits' results."""
    regressions, lines, compared = [], [], 0
    bt, ct = base.throughput(), cur.throughput()
    for fid in sorted(set(bt) & set(ct)):
        bf, cf = bt[fid][0], ct[fid][0]
        for key in sorted(set(bf.get("ratios", {})) & set(cf.get("ratios", {})), key=_ratio_order):
            b, c = bf["ratios"][key], cf["ratios"][key]
            compared += 1
            drop = b["median"] - c["median"]
            noise = max((b["median"] - b["min"]) + (c["max"] - c["median"]), min_noise * b["median"])
            change = f"{fnum(b['median'])}x -> {fnum(c['median'])}x ({100 * -drop / b['median']:+.1f}%)"
            detail = (f"noise {fnum(noise)} (base {fnum(b['min'])}..{fnum(b['max'])}, current "
                      f"{fnum(c['min'])}..{fnum(c['max'])})")
            if drop > noise:
                regressions.append(f"REGRESSION {fid} {key}: {change}, beyond its {detail}")
            else:
                lines.append(f"ok {fid} {key}: {change}, within {detail}")
        if bf.get("identical_outcomes") and cf.get("identical_outcomes") is False:
            regressions.append(f"REGRESSION {fid}: outcomes no longer identical: "
                               + "; ".join(cf.get("mismatches", [])))
    bc, cc = base.conformance()[0], cur.conformance()[0]
    if bc and cc:
        def bad(c: dict) -> int:
            return sum((x.get("divergences") or 0) for x in c.get("corpus", {}).values()) + \
                (c.get("lockstep", {}).get("divergences") or 0) + \
                (c.get("lockstep", {}).get("violations") or 0)
        compared += 1
        if bad(cc) > bad(bc):
            regressions.append(f"REGRESSION conformance: {bad(cc)} divergences/violations, "
                               f"{bad(bc)} in base")
        else:
            lines.append(f"ok conformance: {bad(cc)} divergences/violations ({bad(bc)} in base)")
    return regressions, lines, compared


def resolve(ref: str, results_dir: str) -> R.CommitResults:
    """BASE or CURRENT: a results file of any accepted kind, a folder of records (one commit's
    folder or a whole results folder: its latest commit), or a commit in ``results_dir``."""
    if os.path.isfile(ref):
        return R.group_by_commit([R.load_record(ref)])[0]
    if os.path.isdir(ref):
        return R.find_commit(R.load_history(ref), "latest")
    return R.find_commit(R.load_history(results_dir), ref)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_dashboard_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser(
        "dashboard", help="the bench results as one static HTML page; --compare for CI",
        description="Add bench results to the results folder (keyed by commit and date), write "
                    "the static dashboard page, or compare against a base (docs/CLI.md).")
    d.add_argument("--results", default=DEFAULT_RESULTS, metavar="DIR",
                   help=f"the results folder (default {DEFAULT_RESULTS})")
    d.add_argument("--add", nargs="+", default=[], metavar="FILE",
                   help="store these results first: JSON of `uniradix bench`, `uniradix run`, "
                        "pytest-benchmark (`make bench`), the kernel bench, bench-storage, or records")
    d.add_argument("--commit", default=None, metavar="SHA",
                   help="with --add: the commit the files measured (default: the checkout's, "
                        "or the file's own where it names one)")
    d.add_argument("--commit-date", default=None, metavar="ISO",
                   help="with --commit: its date (ISO 8601)")
    d.add_argument("--out", default=None, metavar="PAGE",
                   help=f"write the page here (default {DEFAULT_PAGE}; not written with --compare "
                        "unless --out is given)")
    d.add_argument("--title", default="uniradix benchmarks", help="the page's title")
    d.add_argument("--compare", default=None, metavar="BASE",
                   help="exit 1 when a ratio of CURRENT fell below BASE's by more than its "
                        "measured noise; BASE: a results file, a folder of records, a commit sha "
                        "(prefix) in the results folder, or latest / previous")
    d.add_argument("--current", default="latest", metavar="CUR",
                   help="with --compare: what to check (same forms as BASE; default latest)")
    d.add_argument("--min-noise", type=float, default=0.0, metavar="FRACTION",
                   help="with --compare: treat a ratio's noise as at least this fraction of the "
                        "base ratio (default 0: the measured noise alone)")
    d.set_defaults(func=cmd_dashboard)
    return d


def cmd_dashboard(args: argparse.Namespace) -> int:
    err = lambda m: print(f"uniradix dashboard: {m}", file=sys.stderr)  # noqa: E731
    if args.commit_date and not args.commit:
        err("--commit-date needs --commit")
        return EXIT_BAD_INPUT
    if not 0 <= args.min_noise < 1:
        err(f"--min-noise must be in [0, 1), got {args.min_noise}")
        return EXIT_BAD_INPUT
    if args.commit and not args.add:
        err("--commit needs --add")
        return EXIT_BAD_INPUT
    if args.current != "latest" and args.compare is None:
        err("--current needs --compare")
        return EXIT_BAD_INPUT
    try:
        commit = None
        if args.commit:
            commit = {"sha": args.commit.lower(), "date": args.commit_date, "subject": None,
                      "dirty": False}
        records = [R.load_record(p, commit=commit) for p in args.add]  # all read before any write
        for p, rec in zip(args.add, records, strict=True):
            print(f"added {p} as {R.store(rec, args.results)}")
        status = EXIT_OK
        if args.compare is not None:
            base = resolve(args.compare, args.results)
            cur = resolve(args.current, args.results)
            regressions, lines, compared = compare(base, cur, args.min_noise)
            print(f"compare: base {base.label}, current {cur.label}")
            for line in lines + regressions:
                print("  " + line)
            if not compared:
                print("compare: nothing to compare: base and current share no figure")
                status = EXIT_NOTHING_COMPARED
            else:
                print(f"compare: {compared} figures compared, {len(regressions)} regressions")
                status = EXIT_REGRESSION if regressions else EXIT_OK
        if args.compare is None or args.out:
            history = R.load_history(args.results)
            path = write_page(history, args.out or DEFAULT_PAGE, args.title)
            print(f"wrote dashboard {path} ({len(history)} commit{'s' if len(history) != 1 else ''}; "
                  "open it in a browser)")
        return status
    except R.ResultsError as e:
        err(str(e))
        return EXIT_BAD_INPUT


def record_run(results: dict, page: str) -> str:
    """``uniradix run --dashboard PAGE``: keep this run's results under ``<PAGE's folder>/history``
    and rewrite the page from that whole history; prints where."""
    results_dir = os.path.join(os.path.dirname(page) or ".", "history")
    rec = R.normalize(results, file="run.json")
    stored = R.store(rec, results_dir)
    history = R.load_history(results_dir)
    write_page(history, page)
    print(f"stored {stored}")
    print(f"wrote dashboard {page} ({len(history)} commit{'s' if len(history) != 1 else ''}; "
          "open it in a browser)")
    return page


def _series(history: Sequence[Any], pick: Callable[[str, dict], Iterable[tuple]]) -> dict:
    """Per key, a figure and one point per commit of ``history`` (None where a commit has
    none): ``pick(figure id, figure)`` gives the (key, point) pairs of one figure."""
    out: dict = {}
    for gi, g in enumerate(history):
        for fid, (fig, _m) in g.throughput().items():
            for key, point in pick(fid, fig):
                out.setdefault(key, {"fig": fig, "points": [None] * len(history)})
                out[key]["points"][gi] = point
    return out


def _config_tag(row: dict) -> str:
    """`` swa`` for a memory row of a configuration other than Full (older rows have none)."""
    config = row.get("config") or "full"
    return "" if config == "full" else f" {config}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m uniradix.conformance.bench.dashboard ...``: ``uniradix dashboard ...``."""
    return subcommand_main("dashboard", add_dashboard_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
