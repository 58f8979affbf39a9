"""The ways a command ends early: the user's input is wrong (exit 2), a check failed (exit 1), Ctrl-C (130), or the
file system refused a write (exit 2, named by `environment_error`)."""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """Bad input or usage. Rendered as one line, `error: <where>: <what> — <what to do>`, exit code 2."""

    exit_code = 2

    def __init__(self, where: str, what: str, fix: str | None = None):
        self.where, self.what, self.fix = str(where), what, fix
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        return f"{text} — {self.fix}" if self.fix else text


class WriteRefused(UserError):
    """The file system refused a write (full disk, quota, permissions): the environment, not the input, so a
    plain run keeps its finished units for the run after the fix to resume."""


class CheckFailed(Exception):
    """A check that ran and failed (a checksum, a bandwidth target, a faulty GPU): exit code 1."""

    exit_code = 1


class Interrupted(Exception):
    """Ctrl-C during a long command: one line saying what was kept and how to continue, exit code 130."""

    exit_code = 130


NOTHING_HALF_WRITTEN = "nothing half-written was left behind — run the command again"
"""What Ctrl-C leaves, for a command without more to say: outputs are written atomically, and the stages that
keep finished work (dedup, pack, mix) continue from it when run again."""


COMMITTED_BEFORE_THE_INTERRUPT = "was complete and in place before the interrupt — nothing to run again"


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C waits for the end of the block, then arrives as it would have: for steps that must not be cut in
    half (swapping a finished output into place). Only the main thread is ever interrupted (Python delivers
    signals there), so elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(frame))
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed from C, which Python cannot put back
            signal.signal(signal.SIGINT, previous)
        if arrived and callable(previous):
            previous(signal.SIGINT, arrived[0])
        elif arrived and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


_committed: set[Path] = set()


def committed(folder: Path) -> None:
    """Record that this process swapped `folder` into place, complete (OutputFolder's commit)."""
    _committed.add(Path(folder).resolve())


def committed_output() -> Path | None:
    """The command's OUTPUT (see `writing_to`) when this process committed it: a Ctrl-C that arrives after the
    commit left a complete output, not one to make again."""
    return _output if _output is not None and _output.resolve() in _committed else None


# The file system refusing a write is the user's environment, not a bug: name the file and what to do.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "free some space (or point the output elsewhere) and run again; earlier outputs are intact",
    errno.EDQUOT: "free some quota (or point the output elsewhere) and run again; earlier outputs are intact",
    errno.EACCES: "check the permissions of that path",
    errno.EROFS: "the file system is read-only; write the output elsewhere",
}


_output: Path | None = None


def writing_to(output: Path | None) -> None:
    """Name the folder this command writes: a refused write whose error carries no file name (a write() on an open
    file, arrow's and Rust's I/O errors) is reported against it. The first named is the command's OUTPUT (the
    folders it then makes inside it are not); None forgets it, for the next command of the process."""
    global _output
    if output is None:
        _committed.clear()
    if output is None or _output is None:
        _output = None if output is None else Path(output)


def environment_error(exc: BaseException) -> str | None:
    """`PATH: No space left on device — free some space ...` when `exc` is the file system refusing (full disk or
    quota, permissions, read-only), else None."""
    if isinstance(exc, FileNotFoundError) and exc.filename and "_work" in Path(str(exc.filename)).parts:
        # OUTPUT/_work (array_tasks.WORK) holds finished units: a file of one removed since cannot be redone in place
        return (
            f"{exc.filename}: is missing from the work area (removed after its unit finished) — re-run with "
            "--overwrite to start again"
        )
    # Rust-backed libraries (tokenizers, safetensors) report OS errors as plain exceptions: "(os error 28)".
    number = exc.errno if isinstance(exc, OSError) else None
    if number is None and (match := re.search(r"\(os error (\d+)\)", str(exc))):
        number = int(match.group(1))
    if number not in ENVIRONMENT_ERRNOS:
        return None
    where = getattr(exc, "filename", None) or _output or "output"
    return f"{where}: {os.strerror(number)} — {ENVIRONMENT_ERRNOS[number]}"
