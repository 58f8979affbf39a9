"""One run at a time into one output folder: an flock on a hidden `.NAME.lock` beside it.

Two runs writing the same OUTPUT (a data stage) or RUN (a training run) each believe the folder is theirs: the
first to finish removes or replaces what the other is writing, and a training run restarted with --overwrite
while the first still trains has both write metrics and checkpoints into one folder. The kernel drops an flock
when its process dies, so a lock is never stale; where the file system has no flock (Lustre mounted without it)
runs go unguarded, and where flock is local to a node (`localflock`) it guards that node's runs."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from smolctl.errors import UserError

F = TypeVar("F", bound=Callable)


class FolderBusy(UserError):
    """Another smolctl run holds the folder's lock."""


@contextmanager
def held_alone(output: Path, doing: str, fix: str) -> Iterator[None]:
    """Hold OUTPUT's lock for the block, or refuse at once with a UserError naming the holder: `OUTPUT: is
    being {doing} by another smolctl run (pid N on HOST) — {fix}`. Folders made for the lock that are empty
    when the block ends are removed: a refused or failed run leaves none behind."""
    output = Path(output)
    # One lock whatever the spelling: a link and its target, `.` and the absolute path, `a/../b` and `b`.
    canonical = output.resolve()
    lock = canonical.parent / f".{canonical.name}.lock"
    made = [folder for folder in (lock.parent, *lock.parent.parents) if not folder.exists()]  # deepest first
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = _exclusive_lock(lock, output, doing, fix)
    except OSError:  # a folder this run cannot write to: the run's own first write says so in one line
        handle = None
    try:
        yield
    finally:
        if handle is not None:
            lock.unlink(missing_ok=True)  # while still held (see _exclusive_lock)
            handle.close()
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _exclusive_lock(lock: Path, output: Path, doing: str, fix: str):
    """The open `lock` file holding an exclusive flock, None where the file system has no flock, or a UserError
    naming the run that holds it. A holder removes the file as it lets go: a run that locked the removed file
    in that moment locks the one there now instead, or two runs made after it would both hold one."""
    while True:
        handle = open(lock, "a+")  # noqa: SIM115  (returned open: the lock lasts as long as it)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise FolderBusy(output, f"is being {doing} by another smolctl run ({holder})", fix) from None
        except OSError:  # no flock here
            handle.close()
            lock.unlink(missing_ok=True)
            return None
        opened = os.fstat(handle.fileno())
        try:
            current = os.stat(lock)
            same = (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
            handle.flush()
            return handle
        handle.close()


def holds_output(output_of: Callable[..., str | Path]) -> Callable[[F], F]:
    """A command function that writes one OUTPUT folder (`output_of(*args, **kwargs)` names it) and holds its lock
    while it runs: two generate, merge or export runs into one OUTPUT otherwise replaced or mixed each other's
    files, and exited 0."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def held(*args, **kwargs):
            output = Path(output_of(*args, **kwargs))
            with held_alone(output, "written", "wait for it to finish, or write to another folder"):
                return function(*args, **kwargs)

        return held  # type: ignore[return-value]

    return decorate
