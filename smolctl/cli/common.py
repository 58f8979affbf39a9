"""What several command families do the same way: the summary of an array task, and the rank-0 rules under
torchrun (every rank raises the same error; rank 0 says it once)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer

from smolctl.console import key_values, show
from smolctl.errors import COMMITTED_BEFORE_THE_INTERRUPT, Interrupted, UserError
from smolctl.launcher import rank_from_env


def render_array_task(command: str, result, tasks: int | None, task_id: int) -> bool:
    """The summary of an array task that did not commit OUTPUT (True when it printed one)."""
    if result.already_committed:
        show(f"{command}: {result.output} is already committed by this run; nothing to do")
        return True
    if result.finished:
        return False
    units = (
        f"{result.units_done} done, {result.units_skipped} already finished (skipped)"
        if result.units_done + result.units_skipped
        else "no units for this task: nothing to do"
    )
    show(
        key_values(
            command,
            [
                ("units", f"task {task_id} of {tasks}: {units}"),
                ("time", f"{result.seconds:.1f}s"),
                ("output", f"{result.output} (committed by the task that finishes the last unit)"),
            ],
        )
    )
    return True


@contextmanager
def resume_hint_on_interrupt(stage: str, recipe, run) -> Iterator[None]:
    """Ctrl-C in a training command: one line on what is kept and the command that continues (exit 130). After
    this run wrote RUN/final (its manifest is not the one there when it started: a resume to more steps keeps the
    old one until the new one replaces it), there is nothing to continue."""
    from smolctl.shards import MANIFEST_NAME  # here: pyarrow would otherwise load with every command's CLI

    final_manifest = Path(run) / "final" / MANIFEST_NAME
    at_start = _identity(final_manifest)
    try:
        yield
    except KeyboardInterrupt:
        if rank_from_env() != 0:  # under torchrun every rank gets the signal; rank 0 speaks
            raise typer.Exit(130) from None
        if _identity(final_manifest) not in (None, at_start):
            raise Interrupted(f"{Path(run) / 'final'}: {COMMITTED_BEFORE_THE_INTERRUPT}") from None
        raise Interrupted(
            f"{run}: continue with `smolctl {stage} {recipe} {run} --resume auto` and the same "
            "options (from the newest complete checkpoint, or afresh when there is none)"
        ) from None


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        state = path.stat()
    except OSError:
        return None
    return state.st_dev, state.st_ino, state.st_mtime_ns


QUIET_RANK_GRACE_S = 10.0
"""How long a rank other than 0 waits before leaving on an error every rank raises. torchrun stops all ranks as
soon as one exits with an error, so a quiet rank that left first could stop rank 0 before it said why; rank 0
normally leaves within this grace and torchrun then stops the waiting ranks."""


def quiet_on_other_ranks(exc: Exception) -> NoReturn:
    """Every rank raises the same error; only rank 0 says it, the others leave after it with the same exit code."""
    if rank_from_env() != 0:
        time.sleep(QUIET_RANK_GRACE_S)
        raise typer.Exit(exc.exit_code)
    raise exc


def require_run(run: Path | None, stage: str, recipe: Path) -> Path:
    if run is None:
        raise UserError("RUN", "is required to train", f"e.g. smolctl {stage} {recipe} runs/my-run")
    return run
