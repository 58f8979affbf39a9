"""Everything a command shows. Results (summaries, tables, reports) go to stdout through `show`, so that
`smolctl inspect X > file` or `| less` captures them; progress, logs and warnings go to stderr through
`stderr_console()` and `warn`; `--json` prints one JSON object on stdout instead of the results.

Text given to a table, `show` or `warn` is printed as it is: brackets in paths and recipe keys (`/tmp/run[old]`,
`[model]`) are not Rich markup. A renderer that wants colour passes `styled("[green]OK[/]")` (its own markup,
with any user text inside it escaped) or a rich renderable.

Rich is imported when something is first drawn, not with the CLI: it is ~50 ms of start-up, and a command run
with `--json` in a pipe (a Slurm array task, a script) draws nothing unless it fails.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from smolctl.units import format_bytes as human_bytes  # noqa: F401  (one formatter: units.py)
from smolctl.units import format_count as human_count  # noqa: F401

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    from rich.text import Text


@functools.cache
def stderr_console() -> Console:
    """Progress, logs, warnings and errors."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@functools.cache
def stdout_console() -> Console:
    """What a command found or made."""
    from rich.console import Console

    return Console(highlight=False)


def escape(text: str) -> str:
    """`text` as Rich markup that shows it verbatim (rich.markup.escape)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def styled(markup: str) -> Text:
    """Text whose Rich markup is meant (colours, bold); interpolate user text through `escape`."""
    from rich.text import Text

    return Text.from_markup(markup)


def literal(value: Any) -> Text:
    """A value shown exactly as it is, whatever brackets it holds."""
    from rich.text import Text

    return value if isinstance(value, Text) else Text(str(value))


def warn(message: str) -> None:
    stderr_console().print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def error_line(label: str, message: str) -> None:
    """The one line a command ends with when it fails: `error: ...` (label) in red, the message verbatim."""
    stderr_console().print(f"[red]{label}:[/] {escape(message)}", soft_wrap=True)


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


@functools.cache
def _lazy_progress_type() -> type[Progress]:
    from rich.progress import Progress

    class LazyProgress(Progress):
        """Shows nothing until a visible task exists, so an input error raised before any work prints one clean
        line."""

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

    return LazyProgress


class SilentProgress:
    """The bar of a run that shows none (`progress(False)`): it takes the calls commands make on a rich Progress
    and draws nothing, without importing Rich. Lines printed through its `console` still go to stderr."""

    def add_task(self, description: str, **fields: Any) -> int:
        return 0

    def update(self, task: int, **fields: Any) -> None:
        pass

    def advance(self, task: int, advance: float = 1) -> None:
        pass

    @property
    def console(self) -> Console:
        return stderr_console()


@contextmanager
def progress(enabled: bool = True) -> Iterator[Progress | SilentProgress]:
    """A progress bar with rate and ETA on stderr; `SilentProgress` when disabled (e.g. under --json)."""
    if not enabled:
        yield SilentProgress()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = _lazy_progress_type()(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=False,
    )
    try:
        yield bar
    except BaseException:
        bar.live.transient = True  # a command that fails ends with its one error line, not a half-drawn bar
        if bar.live.is_started:
            bar.live.stop()  # not Progress.stop(): off a terminal that prints an empty line before the error
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
    from rich.table import Table

    out = Table(title=literal(title), title_justify="left", header_style="bold")
    for i, name in enumerate(columns):
        out.add_column(literal(name), justify="left" if i == 0 else justify)
    for row in rows:
        out.add_row(*(_cell(cell) for cell in row))
    return out


def key_values(title: str, pairs: Iterable[tuple[str, Any]]) -> Table:
    from rich.table import Table

    out = Table(title=literal(title), title_justify="left", show_header=False)
    out.add_column(style="bold")
    out.add_column()
    for key, value in pairs:
        out.add_row(_cell(key), _cell(value))
    return out


def show(renderable: Any, **options: Any) -> None:
    """Print a result on stdout: a table, a `styled` line, or plain text (printed verbatim, never as markup)."""
    stdout_console().print(literal(renderable) if isinstance(renderable, str) else renderable, **options)
