"""Everything a command shows. Results (summaries, tables, reports) go to stdout through `show`, so that
`smolctl inspect X > file` or `| less` captures them; progress, logs and warnings go to stderr through `console`
and `warn`; `--json` prints one JSON object on stdout instead of the results.

Text given to a table, `show` or `warn` is printed as it is: brackets in paths and recipe keys (`/tmp/run[old]`,
`[model]`) are not Rich markup. A renderer that wants colour passes `styled("[green]OK[/]")` (its own markup,
with any user text inside it escaped) or a rich renderable.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from smolctl.units import format_bytes as human_bytes  # noqa: F401  (one formatter: units.py)
from smolctl.units import format_count as human_count  # noqa: F401

console = Console(stderr=True, highlight=False)  # progress, logs, warnings, errors
results = Console(highlight=False)  # what a command found or made: stdout


def styled(markup: str) -> Text:
    """Text whose Rich markup is meant (colours, bold); interpolate user text through `escape`."""
    return Text.from_markup(markup)


def literal(value: Any) -> Text:
    """A value shown exactly as it is, whatever brackets it holds."""
    return value if isinstance(value, Text) else Text(str(value))


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def error_line(label: str, message: str) -> None:
    """The one line a command ends with when it fails: `error: ...` (label) in red, the message verbatim."""
    console.print(f"[red]{label}:[/] {escape(message)}", soft_wrap=True)


def emit_json(payload: Any) -> None:
    """Print the machine-readable result: exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(payload, default=_json_default, sort_keys=False) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


class _LazyProgress(Progress):
    """Shows nothing until a visible task exists, so an input error raised before any work prints one clean line."""

    def _start_if_visible(self) -> None:
        if not self.live.is_started and any(task.visible for task in self.tasks):
            self.start()

    def add_task(self, *args, **kwargs):
        task = super().add_task(*args, **kwargs)
        self._start_if_visible()
        return task

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._start_if_visible()


@contextmanager
def progress(enabled: bool = True) -> Iterator[Progress]:
    """A progress bar with rate and ETA on stderr; silent when disabled (e.g. under --json in a pipe)."""
    bar = _LazyProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    try:
        yield bar
    except BaseException:
        bar.live.transient = True  # a command that fails ends with its one error line, not a half-drawn bar
        raise
    finally:
        if bar.live.is_started:
            bar.stop()


def human_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m{sec:02d}s" if hours else f"{minutes}m{sec:02d}s"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _cell(value: Any) -> Any:
    return value if hasattr(value, "__rich_console__") or hasattr(value, "__rich__") else literal(value)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], justify: str = "right") -> Table:
    """A table whose first column is left-aligned and the rest `justify`-aligned (numbers read best right)."""
    out = Table(title=literal(title), title_justify="left", header_style="bold")
    for i, name in enumerate(columns):
        out.add_column(literal(name), justify="left" if i == 0 else justify)
    for row in rows:
        out.add_row(*(_cell(cell) for cell in row))
    return out


def key_values(title: str, pairs: Iterable[tuple[str, Any]]) -> Table:
    out = Table(title=literal(title), title_justify="left", show_header=False)
    out.add_column(style="bold")
    out.add_column()
    for key, value in pairs:
        out.add_row(_cell(key), _cell(value))
    return out


def show(renderable: Any, **options: Any) -> None:
    """Print a result on stdout: a table, a `styled` line, or plain text (printed verbatim, never as markup)."""
    results.print(literal(renderable) if isinstance(renderable, str) else renderable, **options)
