"""Work cut into units and spread over Slurm array tasks: the machinery dedup, mix and pack share.

    smolctl pack mix/ packed/ --tokenizer tok/ --seq-len 4096 --tasks 64 --task-id $SLURM_ARRAY_TASK_ID

A command's work is a fixed sequence of stages, each cut into units that depend only on the input. Task I of N
runs units I, I+N, ... of a stage; each finished unit leaves an atomic `.done` marker under
OUTPUT/_work/<run>/<stage>/, so a re-run (after a kill, a pre-emption, a re-submitted array) skips it. <run> is
named by a fingerprint of the inputs and settings: a task with other arguments is refused (without --overwrite)
and never mixes its work with another run's. The task that
completes the last stage assembles OUTPUT (under a lock, so exactly one does) and swaps it into place, which
also removes the work area; the committed manifest keeps the fingerprint, so any task of that run started
afterwards (a re-submitted array, a task with no units left) sees the run is done and exits cleanly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from smolctl.errors import UserError, WriteRefused, writing_to
from smolctl.folder_lock import held_alone
from smolctl.shards import atomic_write_json, check_output_path, output_folder_path, read_manifest

WORK = "_work"
FINGERPRINT_KEY = "work_fingerprint"
START_AGAIN = "it changed after its unit finished; re-run with --overwrite to start again"
LOCK_REFRESH_S = 10.0
"""How often the task assembling OUTPUT touches its lock."""
LOCK_STALE_S = 300.0
"""A lock unchanged this long is its dead holder's (generous: a shared file system may cache a file's time for
up to a minute)."""
LOCK_POLL_S = 2.0
RUN_ID_DIGITS = 16
RUN_FOLDER = re.compile(rf"[0-9a-f]{{{RUN_ID_DIGITS}}}")
T = TypeVar("T")


def check_task(tasks: int | None, task_id: int) -> None:
    """`tasks` None is a plain run (one task); 0 is refused, not taken for None."""
    tasks = 1 if tasks is None else tasks
    if tasks < 1:
        raise UserError("--tasks", f"{tasks} is not a task count", "use 1 or more (the size of the Slurm array)")
    if not 0 <= task_id < tasks:
        raise UserError(
            "--task-id",
            f"{task_id} is out of range for --tasks {tasks}",
            f"use 0 to {tasks - 1} (e.g. $SLURM_ARRAY_TASK_ID with --array=0-{tasks - 1})",
        )


def task_units(count: int, tasks: int, task_id: int) -> list[int]:
    """Units I, I+N, ... : round-robin, so neighbouring units (similar sizes) land on different tasks."""
    return list(range(task_id, count, tasks))


def digest(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(files) -> list:
    """How a fingerprint names input files: resolved path, size and modification time."""
    return [[str(Path(f).resolve()), Path(f).stat().st_size, int(Path(f).stat().st_mtime)] for f in files]


@dataclass
class WorkArea:
    """OUTPUT/_work/<run>/ of one run: its fingerprint, stages and markers.

    Each run (fingerprint) has its own folder. A command re-run with other settings and --overwrite while tasks
    of the first run still go on (an array re-submitted without cancelling the first, or its throttled tasks
    starting late) would otherwise have those tasks write units and markers into the new run's work, or clear
    it. Other runs' folders are left alone and go with OUTPUT's commit."""

    output: Path
    stages: tuple[str, ...]
    fingerprint: dict

    def __post_init__(self):
        self.output = output_folder_path(self.output)  # OutputFolder's: absolute, a symlink's target
        writing_to(self.output)
        self.digest = digest(self.fingerprint)
        self.run_id = self.digest[:RUN_ID_DIGITS]

    @property
    def root(self) -> Path:
        return self.output / WORK / self.run_id

    def other_runs(self) -> list[Path]:
        """The work of runs with other inputs or settings under OUTPUT/_work: their folders, or the whole work
        area of a version before runs had folders (its config.json at the top)."""
        base = self.output / WORK
        if not base.is_dir():
            return []
        if (base / "config.json").is_file():
            return [base]
        return sorted(p for p in base.iterdir() if p.is_dir() and p.name != self.run_id)

    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def marker(self, stage: str, unit: int) -> Path:
        return self.root / stage / f"{unit:05d}.done"

    def is_done(self, stage: str, unit: int) -> bool:
        return self.marker(stage, unit).is_file()

    def pending(self, stage: str, units: list[int]) -> list[int]:
        """The units still to do: those without a marker, or all of them when the work area is another run's
        (`prepare` clears it, markers and all)."""
        current = self._records_this_run()
        return [unit for unit in units if not (current and self.is_done(stage, unit))]

    def stage_done(self, stage: str, count: int) -> bool:
        return all(self.is_done(stage, unit) for unit in range(count))

    def read_marker(self, stage: str, unit: int) -> dict:
        return read_work_file(self.marker(stage, unit), lambda path: json.loads(path.read_text()))

    # -- the run's identity ---------------------------------------------------------------------------------

    def committed(self) -> dict | None:
        """The manifest of OUTPUT when this very run (same fingerprint) already committed it, else None."""
        manifest = read_manifest(self.output) if (self.output / "manifest.json").is_file() else None
        if manifest is not None and manifest.get(FINGERPRINT_KEY) == self.digest:
            return manifest
        return None

    def check(self, overwrite: bool) -> None:
        """OUTPUT may hold only this run's work area (or nothing); another run's needs --overwrite."""
        only_work = self.output.is_dir() and {p.name for p in self.output.iterdir()} <= {WORK}
        if not only_work:
            check_output_path(self.output, overwrite)
        others = self.other_runs()
        if others == [self.output / WORK] and not overwrite:
            raise UserError(
                others[0],
                "holds an unfinished run of an earlier smolctl version, which this one cannot resume",
                "finish it with that version, or pass --overwrite to start again",
            )
        if others and not overwrite:
            raise UserError(
                others[0],
                "holds an unfinished run with other inputs or settings, or of an earlier smolctl version",
                "re-run with the original arguments (and version), or pass --overwrite to start again",
            )

    def prepare(self) -> None:
        """Create this run's work area and record its fingerprint (other runs' areas are left alone)."""
        recorded = self.root / "config.json"
        if recorded.is_file():
            if self._records_this_run():
                return
            shutil.rmtree(self.root)  # another fingerprint under the same RUN_ID_DIGITS, or edited by hand
        base = self.output / WORK
        if (base / "config.json").is_file():  # an earlier version's work area (--overwrite): its files only
            for entry in base.iterdir():
                if not entry.is_dir():
                    entry.unlink()
                elif not RUN_FOLDER.fullmatch(entry.name):
                    shutil.rmtree(entry)
        try:
            for stage in self.stages:
                self.stage_dir(stage).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WriteRefused(
                self.output, f"cannot create the work area: {exc.strerror or exc}", "check the path and its permissions"
            ) from exc
        atomic_write_json(recorded, {"fingerprint": self._canonical(), "started": time.time()})

    def alone(self):
        """Held by a plain run (not an array task) from its first write to its commit. Two plain runs into one
        OUTPUT would each do every unit, and the first to commit removes the work area under the other, whose
        error then either crashed or, cleaning up after it, took the first run's work area with it; the second
        is refused at once instead. Array tasks share the work area by design and never take it."""
        return held_alone(self.output, "written", "wait for it to finish, or write to another folder")

    def clean_up_after(self, error: UserError) -> None:
        """After a plain run's failure: on its input, nothing is left behind (the run on the mended input starts
        afresh); a refused write (a full disk) keeps the finished units for the run after the fix to resume."""
        if not isinstance(error, WriteRefused):
            self.discard()

    def discard(self) -> None:
        """Remove the work area, and OUTPUT when nothing else is in it (a plain run that failed on bad input);
        never while another task holds the assembly lock, linking from it into OUTPUT."""
        if (self.root / "assemble.lock").exists():
            return
        shutil.rmtree(self.root, ignore_errors=True)
        for folder in (self.output / WORK, self.output):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()

    def _records_this_run(self) -> bool:
        """Whether the work area's config.json is this run's fingerprint (False when there is none)."""
        recorded = self.root / "config.json"
        return recorded.is_file() and json.loads(recorded.read_text()).get("fingerprint") == self._canonical()

    def _canonical(self) -> dict:
        return json.loads(json.dumps(self.fingerprint, default=str))

    def check_ready(self, stage: str, counts: Callable[[str], int]) -> None:
        """A stage may start only when every unit of the stages before it has its marker."""
        for earlier in self.stages[: self.stages.index(stage)]:
            count = counts(earlier)
            missing = sum(not self.is_done(earlier, unit) for unit in range(count))
            if missing:
                raise UserError(
                    f"--stage {stage}",
                    f"the {earlier} stage has not finished ({missing} unit(s) of "
                    f"{count} missing under {self.stage_dir(earlier)})",
                    f"run --stage {earlier} for every task first (or run without --stage)",
                )

    # -- units ---------------------------------------------------------------------------------------------

    def mark_done(self, stage: str, unit: int, stats: dict) -> None:
        """Write a unit's marker under a temporary name and rename it: a killed task leaves a marker or none.

        No fsync (unlike the output's manifest): a marker only saves recomputing its unit, and on the shared
        filesystems of clusters rename and close already reach the server.
        """
        path = self.marker(stage, unit)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({**stats, "host": socket.gethostname(), "finished_at": time.time()}))
            os.replace(tmp, path)
        except BaseException:  # a full disk: the unit is done again by the next run, with no stray half-marker
            tmp.unlink(missing_ok=True)
            raise

    # -- the one commit ------------------------------------------------------------------------------------

    def commit_once(self, assemble: Callable[[], T], *, wait: bool = False) -> T | None:
        """Run `assemble` unless another task holds the assembly lock. Returns what `assemble` returned, or None
        when another task holds the lock (a plain run then refuses) or, with `wait`, once it has committed.

        An array task waits (`wait`): it exits 0 whether it committed or another did, so returning while the
        holder may be dead would let an `afterok` job start on no output. The holder refreshes its lock while it
        assembles; a lock left by a dead process on this host, or left unchanged for LOCK_STALE_S wherever its
        holder ran (a node that died mid-assembly, a kill before the lock was written), is taken over.

        A run started after this one (the command again, with other settings and --overwrite) is the one wanted:
        this run does not commit over it."""
        lock = self.root / "assemble.lock"
        owner = {"host": socket.gethostname(), "pid": os.getpid()}
        try:
            handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return self._wait_for_holder(lock, assemble, wait)
        except FileNotFoundError:  # the work area is gone: another task has just committed
            return None
        os.write(handle, json.dumps(owner).encode())
        refreshing = threading.Event()
        heartbeat = threading.Thread(target=_refresh, args=(handle, refreshing), daemon=True, name="assemble-lock")
        heartbeat.start()
        try:
            self._refuse_if_replaced()
            return assemble()
        except BaseException:
            # Only this task's own lock: a holder taken over while it was paused must not free its successor's.
            with contextlib.suppress(OSError):
                if os.fstat(handle).st_ino == lock.stat().st_ino:
                    lock.unlink()
            raise
        finally:
            refreshing.set()
            heartbeat.join()
            os.close(handle)

    def _wait_for_holder(self, lock: Path, assemble: Callable[[], T], wait: bool) -> T | None:
        seen, unchanged_since = None, time.monotonic()
        while True:
            try:
                state = lock.stat()
                holder = json.loads(lock.read_text() or "{}")
            except FileNotFoundError:  # released: committed, or the holder failed and this task tries
                return None if self.committed() or not self.root.is_dir() else self.commit_once(assemble, wait=wait)
            except ValueError:  # caught mid-write
                holder = {}
            if _identity(state) != seen:
                seen, unchanged_since = _identity(state), time.monotonic()
            dead_here = holder.get("host") == socket.gethostname() and not _alive(holder.get("pid", -1))
            if dead_here or (wait and time.monotonic() - unchanged_since > LOCK_STALE_S):
                _remove_if_unchanged(lock, seen)
                return self.commit_once(assemble, wait=wait)
            if not wait:
                return None
            time.sleep(LOCK_POLL_S)
            if self.committed():
                return None

    def _refuse_if_replaced(self) -> None:
        started = self._started(self.root)
        newer = [run for run in self.other_runs() if self._started(run) > started]
        if newer:
            raise UserError(
                newer[0],
                "holds a run of this command started after this one (other settings, --overwrite): this run does "
                "not commit over it",
                "cancel this run's tasks; if that later run was abandoned instead, delete its folder and re-run",
            )

    @staticmethod
    def _started(run: Path) -> float:
        try:
            return float(json.loads((run / "config.json").read_text()).get("started", 0.0))
        except (OSError, ValueError, AttributeError):
            return 0.0

    def busy_error(self) -> UserError:
        lock = self.root / "assemble.lock"
        holder = lock.read_text() if lock.exists() else "gone"
        return UserError(
            lock,
            f"another process ({holder}) is writing OUTPUT",
            "wait for it to finish; if that process is dead, delete the lock and re-run",
        )


class AlreadyCommitted(Exception):
    """This run's OUTPUT is committed: the task has nothing to do."""


@contextmanager
def unless_committed(area: WorkArea):
    """A task that finds its work area gone or OUTPUT full because another task of the same run committed
    it a moment ago (array tasks start together, a requeued copy may still run) has nothing to do:
    AlreadyCommitted, not an error. Whatever failed (a work file, a shard being written, a read) is moot then."""
    try:
        yield
    except Exception:
        if area.committed():
            raise AlreadyCommitted from None
        raise


def _refresh(handle: int, stop: threading.Event) -> None:
    """Touch the lock every LOCK_REFRESH_S until `stop`: waiting tasks see its holder is alive. Through the open
    file, not the path: a holder taken over while it was paused touches only its own, removed, lock."""
    while not stop.wait(LOCK_REFRESH_S):
        with contextlib.suppress(OSError):
            os.utime(handle)


def _identity(state: os.stat_result) -> tuple[int, int, int]:
    return state.st_ino, state.st_mtime_ns, state.st_size


def _remove_if_unchanged(lock: Path, seen: tuple[int, int, int]) -> None:
    """Remove a dead holder's lock, unless it changed since it was judged dead. The check and the removal run
    under a guard file, one task at a time: the many tasks of a re-submitted array all judge the same lock dead
    at once, and one must not remove the lock another has just taken."""
    guard = lock.with_name(lock.name + ".takeover")
    try:
        handle = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        # Held for two system calls; one much older was left by a task killed between them.
        with contextlib.suppress(FileNotFoundError):
            if time.time() - guard.stat().st_mtime > LOCK_STALE_S:
                guard.unlink()
        return
    except FileNotFoundError:  # the work area is gone
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            if _identity(lock.stat()) == seen:
                lock.unlink()
    finally:
        os.close(handle)
        guard.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def read_work_file(path: Path, read: Callable[[Path], T]) -> T:
    """`read(path)` for a file of the work area. One that no longer reads as its unit wrote it (truncated,
    garbled) is a one-line error; one that is gone is reported by the CLI (errors.environment_error)."""
    try:
        return read(path)
    except Exception as exc:
        # zipfile's BadZipFile (a truncated .npz) is matched by module: importing zipfile costs every start-up
        if not isinstance(exc, (ValueError, EOFError, KeyError)) and type(exc).__module__ != "zipfile":
            raise
        raise UserError(
            path,
            f"cannot be read as its unit wrote it ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
            START_AGAIN,
        ) from exc


def link_or_copy(src: Path, dst: Path, size: int | None = None) -> None:
    """A hard link keeps the work area intact until the commit: a crash while assembling loses nothing. A work
    file that is gone, or not the `size` its unit wrote, is refused: OUTPUT would look complete and not be."""
    actual = src.stat().st_size if src.is_file() else None
    if actual is None or (size is not None and actual != size):
        raise UserError(
            src,
            "is missing from the work area" if actual is None else f"is {actual} bytes, not the {size} its unit wrote",
            START_AGAIN,
        )
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
