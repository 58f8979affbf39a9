"""How `smolctl report` draws: braille line plots for a terminal on a login node, and one self-contained HTML file
(inline SVG and CSS, nothing fetched) for a laptop browser. Both take `RunReport`s and return text.

    smolctl report runs/a runs/b --html report.html
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from smolctl.console import escape
from smolctl.errors import UserError
from smolctl.train.report import PLOTTED, Finding, RunReport

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"]
TERMINAL_COLORS = ["cyan", "red", "green", "magenta", "yellow", "blue"]
TITLES = {
    "loss": "loss",
    "lr": "learning rate",
    "grad_norm": "grad norm",
    "tokens_per_s": "tokens/s",
    "val_loss": "validation loss",
}
_BRAILLE_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [dot row][dot column]


def plotted_metrics(reports: list[RunReport]) -> list[str]:
    return [m for m in (*PLOTTED, "val_loss") if any(len(r.series.get(m, [])) > 1 for r in reports)]


def _bounds(reports: list[RunReport], metric: str) -> tuple[float, float, float, float]:
    points = [p for r in reports for p in r.series.get(metric, [])]
    xs, ys = [s for s, _ in points], [v for _, v in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.05 - 1e-12, y1 + abs(y1) * 0.05 + 1e-12
    return x0, max(x1, x0 + 1), y0, y1


def _number(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.2e}" if abs(value) < 1e-2 or abs(value) >= 1e5 else f"{value:.4g}"


# ---------------------------------------------------------------------------------------------------------------
# Terminal


def text_plot(reports: list[RunReport], metric: str, width: int = 64, height: int = 6) -> str:
    """A braille line plot (2×4 dots per character) of one metric, every run in its own colour (rich markup)."""
    x0, x1, y0, y1 = _bounds(reports, metric)
    dots_w, dots_h = width * 2, height * 4
    cells: dict[tuple[int, int], list] = {}  # (row, col) -> [bits, run index]
    for index, report in enumerate(reports):
        previous = None
        for step, value in report.series.get(metric, []):
            x = round((step - x0) / (x1 - x0) * (dots_w - 1))
            y = round((value - y0) / (y1 - y0) * (dots_h - 1))
            # join consecutive points so a sparse series still reads as a line
            for dx, dy in _segment(previous, (x, y)):
                row, col = (dots_h - 1 - dy) // 4, dx // 2
                cell = cells.setdefault((row, col), [0, index])
                cell[0] |= _BRAILLE_BITS[(dots_h - 1 - dy) % 4][dx % 2]
            previous = (x, y)
    label_width = max(len(_number(y0)), len(_number(y1)))
    lines = [f"[bold]{TITLES[metric]}[/]"]
    for row in range(height):
        label = _number(y1) if row == 0 else _number(y0) if row == height - 1 else ""
        text = "".join(
            f"[{TERMINAL_COLORS[cells[(row, col)][1] % len(TERMINAL_COLORS)]}]{chr(0x2800 + cells[(row, col)][0])}[/]"
            if (row, col) in cells
            else " "
            for col in range(width)
        )
        lines.append(f"{label:>{label_width}} ┤{text}")
    start, end = f"step {int(x0)}", f"{int(x1)}"
    lines.append(" " * label_width + " └" + "─" * width)
    lines.append(" " * (label_width + 2) + start + " " * max(1, width - len(start) - len(end)) + end)
    return "\n".join(lines)


def _segment(a, b):
    if a is None:
        return [b]
    steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
    return [
        (round(a[0] + (b[0] - a[0]) * t / steps), round(a[1] + (b[1] - a[1]) * t / steps)) for t in range(1, steps + 1)
    ]


def legend(reports: list[RunReport]) -> str:
    return "   ".join(
        f"[{TERMINAL_COLORS[i % len(TERMINAL_COLORS)]}]━━[/] {escape(r.run)}" for i, r in enumerate(reports)
    )


def rows_text(rows: list[dict], limit: int = 8) -> str:
    """The data rows behind a guard event, per shard: `folder/shard rows 3, 17, ...`."""
    parts = []
    for entry in rows:
        shown = ", ".join(map(str, entry["rows"][:limit])) + (
            f", … ({len(entry['rows'])} rows)" if len(entry["rows"]) > limit else ""
        )
        parts.append(f"{entry['folder']}/{entry['shard']} rows {shown}")
    return "; ".join(parts)


def when(finding: Finding) -> str:
    return (
        f"step {finding.start_step}"
        if finding.start_step == finding.end_step
        else f"steps {finding.start_step}–{finding.end_step}"
    )


# ---------------------------------------------------------------------------------------------------------------
# HTML


def html_report(reports: list[RunReport]) -> str:
    """One HTML file with everything inline: summary, KPI table, findings and SVG plots of every run."""
    e = html.escape
    body = [f"<h1>smolctl report</h1><p class='legend'>{_html_legend(reports)}</p>"]
    body.append("<div class='plots'>" + "".join(svg_plot(reports, m) for m in plotted_metrics(reports)) + "</div>")
    for index, report in enumerate(reports):
        body.append(f"<h2 style='color:{COLORS[index % len(COLORS)]}'>{e(report.stage)} · {e(report.run)}</h2>")
        body.append(
            "<table>"
            + "".join(f"<tr><th>{e(k)}</th><td>{e(_value(v))}</td></tr>" for k, v in report.summary.items())
            + "</table>"
        )
        body.append(
            "<h3>KPIs</h3><table><tr><th>KPI</th><th>target</th><th>value</th><th>status</th><th>what to do</th></tr>"
        )
        body += [
            f"<tr><td>{e(k.name)}</td><td>{e(k.target)}</td><td>{e(k.shown)}</td>"
            f"<td class='{k.status.replace('/', '')}'>{e(k.status)}</td><td>{e(k.advice)}</td></tr>"
            for k in report.kpis
        ]
        body.append("</table><h3>Diagnosis</h3>")
        if not report.findings:
            body.append("<p>No spike, drift, plateau, slowdown or guard event.</p>")
        else:
            body.append(
                "<table><tr><th>what</th><th>when</th><th>detail</th><th>likely cause</th><th>what to do</th></tr>"
            )
            body += [
                f"<tr><td>{e(f.kind)}</td><td>{e(when(f))}</td><td>{e(f.detail)}"
                f"{'<br><small>' + e(rows_text(f.rows)) + '</small>' if f.rows else ''}</td><td>{e(f.cause)}</td>"
                f"<td>{e(f.remedy)}</td></tr>"
                for f in report.findings
            ]
            body.append("</table>")
    return _PAGE_HEAD + "\n".join(body) + "</body></html>\n"


def svg_plot(reports: list[RunReport], metric: str, width: int = 560, height: int = 220) -> str:
    x0, x1, y0, y1 = _bounds(reports, metric)
    left, right, top, bottom = 64, 12, 24, 28
    w, h = width - left - right, height - top - bottom

    def xy(step, value):
        return f"{left + (step - x0) / (x1 - x0) * w:.1f},{top + (1 - (value - y0) / (y1 - y0)) * h:.1f}"

    lines = "".join(
        f"<polyline fill='none' stroke='{COLORS[i % len(COLORS)]}' stroke-width='1.6' "
        f"points='{' '.join(xy(s, v) for s, v in r.series[metric] if math.isfinite(v))}'/>"
        for i, r in enumerate(reports)
        if len(r.series.get(metric, [])) > 1
    )
    grid = "".join(
        f"<line x1='{left}' x2='{left + w}' y1='{top + f * h:.1f}' y2='{top + f * h:.1f}' class='grid'/>"
        for f in (0, 0.25, 0.5, 0.75, 1)
    )
    labels = (
        f"<text x='{left - 6}' y='{top + 4}' text-anchor='end'>{_number(y1)}</text>"
        f"<text x='{left - 6}' y='{top + h + 4}' text-anchor='end'>{_number(y0)}</text>"
        f"<text x='{left}' y='{height - 8}'>step {int(x0)}</text>"
        f"<text x='{left + w}' y='{height - 8}' text-anchor='end'>{int(x1)}</text>"
        f"<text x='{left}' y='16' class='title'>{html.escape(TITLES[metric])}</text>"
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>"
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' class='frame'/>{grid}{lines}{labels}</svg>"
    )


def _html_legend(reports: list[RunReport]) -> str:
    return " ".join(
        f"<span style='color:{COLORS[i % len(COLORS)]}'>━━</span> {html.escape(r.run)}" for i, r in enumerate(reports)
    )


def _value(value) -> str:
    if isinstance(value, float):
        return _number(value)
    return "-" if value is None else str(value)


_PAGE_HEAD = """<!doctype html><html><head><meta charset="utf-8"><title>smolctl report</title><style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}h3{font-size:14px}
table{border-collapse:collapse;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
td.pass{background:#d9f2d9}td.warn{background:#ffe0b3}td.na{color:#888}
.plots{display:flex;flex-wrap:wrap;gap:8px}svg{background:#fafafa;border:1px solid #eee}
svg text{font:11px sans-serif;fill:#444}svg .title{font-weight:bold;fill:#222}
svg .frame{fill:none;stroke:#bbb}svg .grid{stroke:#e6e6e6}small{color:#666}.legend{font-size:13px}
</style></head><body>
"""


def write_html(path: str | Path, reports: list[RunReport], overwrite: bool = False) -> Path:
    """The reports as one self-contained HTML file at `path`. Only an .html file is written, and an existing one
    only with `overwrite`: a mistyped --html (a run's metrics.jsonl, a model's weights) was replaced silently."""
    from smolctl.shards import atomic_write_bytes  # pyarrow's import, for the --html runs alone

    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise UserError(
            "--html", f"{path} is not an .html file", f"name the report e.g. {path.with_suffix('.html').name}"
        )
    if path.is_dir():
        raise UserError("--html", f"{path} is a folder", "give a file name, e.g. report.html")
    if path.exists() and not overwrite:
        raise UserError("--html", f"{path} already exists", "pass --overwrite to replace it, or choose another name")
    # through a link: the file it points to is replaced, and the link stays (as output folders do)
    atomic_write_bytes(path.resolve() if path.is_symlink() else path, html_report(reports).encode())
    return path
