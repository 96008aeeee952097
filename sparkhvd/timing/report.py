"""``report.html``: one run at a glance, as one static file that works offline.

Written at the end of every run into its run folder, and again by ``sparkhvd report <run
folder>``, from the run folder alone: ``run.json`` (attempts, resizes, the time split and its
findings), ``timing.jsonl`` (each rank's split and system metrics over time) and ``metrics.csv``
(loss, metrics and throughput per epoch). Charts are inline SVG drawn here; the page loads
nothing and runs no script. Every number shown comes from those files (a bar's
``data-share`` is ``run.json``'s share, as the test checks in a browser).
"""
from __future__ import annotations

import csv
import datetime as _dt
import html
import json
import os
from typing import Any, Iterable, Optional, Sequence

from sparkhvd.common.fileio import atomic_write
from sparkhvd.timing.buckets import BUCKETS, LABELS, share

__side__ = "driver"

REPORT_FILE = "report.html"
COLORS = {"data": "#e4572e", "compute": "#4c9f70", "collective": "#3f88c5",
          "checkpoint": "#f2a541", "other": "#9e9e9e"}
_LINE_COLORS = ("#3f88c5", "#e4572e", "#4c9f70", "#f2a541", "#7b4fa0", "#2ab7ca", "#8d6e63",
                "#d81b60")
_STATE_COLORS = {"running": "#4c9f70", "placing": "#bdbdbd", "restarting": "#f2a541",
                 "resizing": "#7b4fa0"}

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;
padding-bottom:4px}table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;
border-bottom:1px solid #eee;text-align:left;vertical-align:top}th{background:#f6f6f6}
.muted{color:#777}.finding{background:#fff4e5;border-left:4px solid #f2a541;padding:6px 10px;
margin:6px 0}.ok{background:#edf7ee;border-left-color:#4c9f70}.charts{display:flex;
flex-wrap:wrap;gap:12px}.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;
width:11px;height:11px;margin-right:4px;vertical-align:-1px}svg text{font:11px system-ui,sans-serif}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_timing(path: str) -> list[dict]:
    """``timing.jsonl``'s reports (a torn last line, from a killed driver, is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _read_metrics(path: str) -> list[dict[str, float]]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            values = {}
            for k, v in row.items():
                try:
                    values[k] = float(v)
                except (TypeError, ValueError):
                    continue
            rows.append(values)
    return rows


# -- charts ------------------------------------------------------------------------------------
def _ticks(lo: float, hi: float) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / 4 for i in range(5)]


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str,
               width: int = 520, height: int = 220) -> str:
    """An SVG line chart of ``series`` (name -> points), with axes, ticks and a legend."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return ""
    left, right, top, bottom = 56, 12, 26, 36
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(0.0, min(ys)), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom)

    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="{_esc(title)}">',
             f'<text x="{left}" y="15" font-weight="bold">{_esc(title)}</text>',
             f'<line x1="{left}" y1="{sy(y0):.1f}" x2="{width - right}" y2="{sy(y0):.1f}" '
             'stroke="#999"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#999"/>']
    for y in _ticks(y0, y1):
        parts.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{_num(y)}'
                     f'</text><line x1="{left}" y1="{sy(y):.1f}" x2="{width - right}" '
                     f'y2="{sy(y):.1f}" stroke="#eee"/>')
    for x in _ticks(x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" text-anchor="middle">'
                     f'{_num(x)}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" '
                 f'text-anchor="middle" class="muted">{_esc(x_label)}</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        color = _LINE_COLORS[i % len(_LINE_COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" '
                     f'points="{path}"><title>{_esc(name)}</title></polyline>')
        if len(pts) == 1:
            x, y = pts[0]
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
        parts.append(f'<text x="{left + 8 + 110 * (i % 4)}" y="{top + 12 + 13 * (i // 4)}" '
                     f'fill="{color}">{_esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def split_bars(ranks: dict[str, dict]) -> str:
    """Each rank's time split as one stacked horizontal bar (shares from ``run.json``)."""
    width, bar_h, left = 760, 22, 150
    rows = sorted(ranks.items(), key=lambda kv: int(kv[0]))
    height = 10 + len(rows) * (bar_h + 8)
    parts = [f'<svg width="{width + left + 10}" height="{height}" role="img" '
             'aria-label="time split per rank">']
    for i, (rank, entry) in enumerate(rows):
        y = 5 + i * (bar_h + 8)
        host = entry.get("host") or ""
        parts.append(f'<text x="0" y="{y + 15}">rank {_esc(rank)}'
                     f'{f" ({_esc(host)})" if host else ""}</text>')
        x = float(left)
        for bucket in BUCKETS:
            share = float(entry.get("share", {}).get(bucket, 0.0))
            w = share * width
            where = (entry.get("where") or {}).get(bucket, "")
            tip = f"rank {rank}: {LABELS[bucket]} {100 * share:.1f} %" + \
                (f" ({where})" if where else "")
            parts.append(f'<rect class="split" data-rank="{_esc(rank)}" data-bucket="{bucket}" '
                         f'data-share="{share}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                         f'height="{bar_h}" fill="{COLORS[bucket]}"><title>{_esc(tip)}</title>'
                         '</rect>')
            if w > 34:
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 15}" text-anchor="middle" '
                             f'fill="#fff">{100 * share:.0f}%</text>')
            x += w
    parts.append("</svg>")
    return "".join(parts)


def _legend() -> str:
    return '<p class="legend">' + "".join(
        f'<span><i class="sw" style="background:{COLORS[b]}"></i>{_esc(LABELS[b])}</span>'
        for b in BUCKETS) + "</p>"


def _parse_time(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def timeline(record: dict) -> str:
    """The run's states on one time axis: placing, each attempt running (with its size),
    restarting and resizing."""
    states = [s for s in record.get("states") or [] if _parse_time(s.get("at")) is not None]
    if not states:
        return '<p class="muted">No states recorded.</p>'
    start = _parse_time(states[0]["at"]) or 0.0
    end = _parse_time(record.get("finished_at")) or _parse_time(states[-1]["at"]) or start
    span = max(end - start, 1.0)
    width, left = 900, 10
    parts = [f'<svg width="{width + 2 * left}" height="70" role="img" aria-label="timeline">']
    for i, state in enumerate(states):
        t0 = (_parse_time(state["at"]) or start) - start
        t1 = ((_parse_time(states[i + 1]["at"]) or end) if i + 1 < len(states) else end) - start
        label = state["state"]
        if label in ("finished", "failed"):
            continue
        x, w = left + t0 / span * width, max((t1 - t0) / span * width, 2.0)
        text = f"attempt {state.get('attempt', '')}: {state.get('size', '')} ranks" \
            if label == "running" else label
        parts.append(f'<rect x="{x:.1f}" y="10" width="{w:.1f}" height="26" '
                     f'fill="{_STATE_COLORS.get(label, "#ccc")}"><title>{_esc(label)} at '
                     f'{_esc(state["at"])}: {_esc(state.get("why", ""))}</title></rect>')
        if w > 70:
            parts.append(f'<text x="{x + 4:.1f}" y="27" fill="#fff">{_esc(text)}</text>')
    parts.append(f'<text x="{left}" y="54">0 s</text><text x="{left + width}" y="54" '
                 f'text-anchor="end">{span:,.0f} s</text></svg>')
    return "".join(parts)


# -- the page ------------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _attempts(record: dict) -> str:
    rows = []
    for a in record.get("attempts") or []:
        why = a.get("error") or (a.get("preempted") or {}).get("requested") or \
            ", ".join((a.get("preempted") or {}).get("reasons") or []) or ""
        rows.append([_esc(a.get("attempt")), _esc(a.get("status")), _esc(a.get("size", "")),
                     _esc(why), _esc(a.get("restored") or a.get("resumed_from") or "")])
    out = _table(["attempt", "status", "ranks", "why it ended", "resumed from"], rows) \
        if rows else ""
    resizes = record.get("resizes") or []
    if resizes:
        out += "<p><b>Resizes</b></p>" + _table(
            ["after attempt", "from", "to", "why", "checkpoint"],
            [[_esc(r.get("attempt")), _esc(r.get("from")), _esc(r.get("to")), _esc(r.get("why")),
              _esc(r.get("checkpoint") or "")] for r in resizes])
    return out


def _system_charts(reports: list[dict], t0: float) -> str:
    names: dict[str, str] = {"cpu_utilization_percentage": "CPU % (rank's processes)",
                             "rss_megabytes": "memory RSS (MB)",
                             "network_receive_megabytes": "network received (MB per interval)"}
    gpu = sorted({k for r in reports for k in r.get("system", {})
                  if k.startswith("gpu_") and k.endswith(("utilization_percentage",
                                                          "memory_usage_megabytes"))})
    charts = []
    for key in [*names, *gpu]:
        series: dict[str, list[tuple[float, float]]] = {}
        for r in reports:
            value = r.get("system", {}).get(key)
            if isinstance(value, (int, float)):
                series.setdefault(f"rank {r['rank']}", []).append((r["end"] - t0, float(value)))
        if series:
            charts.append(line_chart(names.get(key, key.replace("_", " ")), series,
                                     "seconds since the first report"))
    return '<div class="charts">' + "".join(charts) + "</div>" if charts else \
        '<p class="muted">No system metrics were reported.</p>'


def _split_over_time(reports: list[dict], t0: float) -> str:
    """Each rank's share of time waiting (data loading, collectives) per interval."""
    charts = []
    for bucket in ("data", "collective", "compute"):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in reports:
            total = sum(r.get("seconds", {}).values())
            if total > 0:
                series.setdefault(f"rank {r['rank']}", []).append(
                    (r["end"] - t0, 100 * r["seconds"].get(bucket, 0.0) / total))
        if any(y > 0 for pts in series.values() for _, y in pts):
            charts.append(line_chart(f"% of time {LABELS[bucket]}", series,
                                     "seconds since the first report"))
    per_step: dict[str, list[tuple[float, float]]] = {}
    for r in reports:  # where the wait was measured per step (DDP's comm hook)
        if r.get("steps"):
            per_step.setdefault(f"rank {r['rank']}", []).append(
                (r["end"] - t0, 1000 * r.get("seconds", {}).get("collective", 0.0) / r["steps"]))
    if per_step:
        charts.append(line_chart("ms waiting in collectives per step", per_step,
                                 "seconds since the first report"))
    unmeasured = sorted({u for r in reports for u in r.get("unmeasured") or []})
    note = "".join(f'<p class="muted">Not measured: {_esc(u)} (that wait counts as '
                   "computing).</p>" for u in unmeasured)
    return ('<div class="charts">' + "".join(charts) + "</div>" if charts else "") + note


def _steps_per_second(reports: list[dict], t0: float) -> str:
    """Throughput from the steps DDP's timing hook counted (a run with no epoch metrics):
    steps per second per rank, and samples per second where the batch is known."""
    steps: dict[str, list[tuple[float, float]]] = {}
    samples: dict[str, list[tuple[float, float]]] = {}
    batches = set()
    for r in reports:
        span = r.get("end", 0.0) - r.get("start", 0.0)
        if r.get("steps") and span > 0:
            rate = r["steps"] / span
            steps.setdefault(f"rank {r['rank']}", []).append((r["end"] - t0, rate))
            if r.get("batch"):
                batches.add(r["batch"])
                samples.setdefault(f"rank {r['rank']}", []).append(
                    (r["end"] - t0, rate * r["batch"]))
    if not steps:
        return ""
    charts = [line_chart("steps per second (counted by DDP's hook)", steps,
                         "seconds since the first report")]
    if samples:
        charts.append(line_chart("samples per second (the first step's batch: "
                                 f"{', '.join(map(str, sorted(batches)))})", samples,
                                 "seconds since the first report"))
    return '<div class="charts">' + "".join(charts) + "</div>"


def _curves(metrics: list[dict[str, float]], reports: list[dict],
            t0: float) -> tuple[str, str]:
    """(throughput chart, loss and metric charts) from ``metrics.csv`` -- or, without epoch
    metrics, throughput from the DDP steps in ``timing.jsonl``; a section left empty says why."""
    if not metrics:
        nothing = ('<p class="muted">No loss or metrics: the function reported none '
                   "(KerasDistributed and st.report send them each epoch).</p>")
        return (_steps_per_second(reports, t0) or
                '<p class="muted">No throughput: no epoch metrics (KerasDistributed and '
                "st.report send them) and no DDP steps were counted.</p>", nothing)
    through = ""
    for key, title in (("samples_per_s", "throughput (samples/s)"),
                       ("seconds", "seconds per epoch")):
        pts = [(m["epoch"], m[key]) for m in metrics if key in m and "epoch" in m]
        if pts:
            through = line_chart(title, {title.split(" (")[0]: pts}, "epoch")
            break
    keys = sorted({k for m in metrics for k in m} - {"epoch", "seconds", "samples_per_s"})
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key[4:] if key.startswith("val_") else key, []).append(key)
    charts = [line_chart(base, {k: [(m["epoch"], m[k]) for m in metrics if k in m and "epoch" in m]
                                for k in members}, "epoch")
              for base, members in sorted(groups.items())]
    return through, '<div class="charts">' + "".join(charts) + "</div>"


def _links(folder: str, record: dict) -> str:
    logs = sorted(os.listdir(os.path.join(folder, "logs"))) \
        if os.path.isdir(os.path.join(folder, "logs")) else []
    items = [f'<li><a href="logs/{_esc(name)}">logs/{_esc(name)}</a></li>' for name in logs]
    for name in ("run.json", "timing.jsonl", "metrics.csv", "curves.png", "timeline.json"):
        if os.path.exists(os.path.join(folder, name)):
            items.append(f'<li><a href="{name}">{name}</a></li>')
    return "<ul>" + "".join(items) + "</ul>"


def _ranks_from(reports: list[dict]) -> dict[str, dict]:
    """Each rank's totals from ``timing.jsonl`` (what ``run.json`` holds after a whole run)."""
    seconds: dict[str, dict[str, float]] = {}
    hosts: dict[str, str] = {}
    for r in reports:
        rank = str(r.get("rank"))
        hosts[rank] = r.get("host", "")
        for bucket, s in (r.get("seconds") or {}).items():
            seconds.setdefault(rank, {}).setdefault(bucket, 0.0)
            seconds[rank][bucket] += float(s)
    return {rank: {"host": hosts[rank], "seconds": s, "share": share(s)}
            for rank, s in seconds.items()}


def render(folder: str) -> str:
    """The report of the run folder ``folder`` (a local path), as HTML text."""
    record = _read_json(os.path.join(folder, "run.json"))
    reports = read_timing(os.path.join(folder, "timing.jsonl"))
    metrics = _read_metrics(os.path.join(folder, "metrics.csv"))
    split = dict(record.get("time_split") or {})
    if reports and not split.get("ranks"):  # a driver killed before its summary
        split["ranks"] = _ranks_from(reports)
    t0 = min((r["start"] for r in reports), default=0.0)
    through, curves = _curves(metrics, reports, t0)
    findings = split.get("findings") or []
    found = "".join(f'<div class="finding">{_esc(f.get("text", ""))}</div>' for f in findings) \
        or ('<div class="finding ok">No straggler: the ranks spent their time alike.</div>'
            if split.get("ranks") else '<p class="muted">The time split was off for this run '
            '(time_split=False).</p>')
    total = (record.get("timings") or {}).get("total")
    facts = [("status", record.get("status")), ("function", record.get("function")),
             ("backend", record.get("backend")), ("ranks", record.get("np")),
             ("launcher", record.get("launcher")), ("started", record.get("started_at")),
             ("total", f"{total:,.1f} s" if isinstance(total, (int, float)) else None),
             ("error", (record.get("error") or {}).get("message"))]
    head = _table(["", ""], [[_esc(k), _esc(v)] for k, v in facts if v not in (None, "")])
    bars = (_legend() + split_bars(split["ranks"])) if split.get("ranks") else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sparkhvd run {_esc(record.get("run_id", ""))}</title><style>{_STYLE}</style></head>
<body>
<h1>sparkhvd run {_esc(record.get("run_id", ""))}</h1>
<p class="muted">{_esc(record.get("output", ""))}</p>
{head}
<h2>Stragglers and bottlenecks</h2>
{found}
<h2>Where each rank's time went</h2>
{bars or '<p class="muted">No time split.</p>'}
{_split_over_time(reports, t0)}
<h2>Attempts</h2>
{timeline(record)}
{_attempts(record)}
<h2>Throughput</h2>
{through}
<h2>Loss and metrics</h2>
{curves}
<h2>System metrics</h2>
{_system_charts(reports, t0)}
<h2>Files</h2>
{_links(folder, record)}
<p class="muted">Made by sparkhvd from run.json, timing.jsonl and metrics.csv
(sparkhvd report &lt;run folder&gt; makes it again).</p>
</body></html>
"""


def write_report(folder: str) -> str:
    """Write ``report.html`` into the local run folder ``folder``; its path."""
    path = os.path.join(folder, REPORT_FILE)
    atomic_write(path, render(folder).encode("utf-8"))
    return path
