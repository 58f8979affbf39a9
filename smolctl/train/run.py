"""One run layout for every training command (pretrain, midtrain, sft, dpo, ppo, grpo):

  RUN/run.json                    the command, the resolved recipe now in force and the starting checkpoint
  RUN/metrics.jsonl               one JSON object per logged step: step, loss, lr, grad_norm, tokens_per_s, and the
                                  stage's own metrics (rewards/accuracies, kl, ...); appended across resumes
  RUN/events.jsonl                what happened besides steps: resumes (with what each changed of the recipe),
                                  checkpoints, guard events (always present)
  RUN/checkpoints/step-NNNNNNN/   resumable checkpoints, written under another name and renamed when complete
  RUN/final/                      the finished Hugging Face model folder + tokenizer + manifest.json (kind "model")
  RUN/adapter/                    LoRA runs only: the adapter alone (final/ holds it merged)

A later stage takes `--from RUN` or `--from RUN/final`. `--resume auto` on a finished run is a no-op.
One run at a time trains into a RUN: a second is refused while the first holds `.RUN.lock` beside it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from smolctl.errors import UserError
from smolctl.folder_lock import held_alone
from smolctl.launcher import rank_from_env
from smolctl.shards import (
    MANIFEST_NAME,
    atomic_write_bytes,
    atomic_write_json,
    check_output_path,
    output_folder_path,
    read_manifest,
    remove_finished,
)

# What recipes/slurm/pretrain.sbatch creates in RUN before the trainer starts (NCCL's flight-recorder dumps):
# a run folder holding only these is still a new run folder.
LAUNCHER_ENTRIES = frozenset({"nccl-trace"})


def holds_run_files(run: Path) -> bool:
    """Whether the folder holds anything besides what the launcher put there."""
    return run.is_dir() and any(entry.name not in LAUNCHER_ENTRIES for entry in run.iterdir())


RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
FINAL = "final"
ADAPTER = "adapter"


def checkpoint_dir(run: Path, step: int) -> Path:
    return Path(run) / CHECKPOINTS / f"step-{step:07d}"


def step_of(checkpoint: Path) -> int:
    return int(Path(checkpoint).name.split("-")[1])


def step_checkpoints(run: Path) -> list[Path]:
    """RUN/checkpoints/step-N folders, oldest first. Every writer stages a checkpoint under another name and
    renames it into place, so a folder with this name is complete."""
    folder = Path(run) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if p.is_dir() and p.name.split("-")[1].isdigit()]
    return sorted(found, key=step_of)


def check_steps_reach(checkpoint: Path, step: int, steps: int) -> None:
    """A resume may train longer, never stop before the checkpoint it continues (saved at `step`): refused, rather
    than writing a final model of more steps than the recipe asks for."""
    if steps < step:
        raise UserError(
            "training.steps",
            f"is {steps}, but the checkpoint to resume ({checkpoint}) is at step {step}",
            f"set training.steps to {step} or more, or go back with --resume {checkpoint.parent}/step-N (N <= {steps})",
        )


def discard_later(run: Path, step: int) -> list[str]:
    """Rank 0, resuming at `step`: remove the checkpoints, exports and final/ of later steps, and return their
    paths. They belong to the run a rewind (--resume RUN/checkpoints/step-N) abandons: left in place, a later
    --resume auto would take the newest of them and continue the abandoned run, or call it finished."""
    run = Path(run)
    exports = run / "exports"
    later = [p for p in step_checkpoints(run) if step_of(p) > step]
    if exports.is_dir():
        later += [p for p in sorted(exports.glob("step-*")) if p.is_dir() and step_of(p) > step]
    final = read_manifest(run / FINAL) if (run / FINAL / MANIFEST_NAME).is_file() else None
    if final is not None and int(final.get("step", final.get("stats", {}).get("steps", 0))) > step:
        later.append(run / FINAL)
    for path in later:
        remove_finished(path)
    return [str(path) for path in later]


def prune_checkpoints(run: Path, keep: int) -> None:
    for old in step_checkpoints(run)[:-keep]:
        remove_finished(old)


def model_folder(path: Path) -> Path:
    """A model folder given as itself or as the run folder holding it in final/."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / FINAL / "config.json").is_file():
        return path / FINAL
    return path


def is_main_process() -> bool:
    return rank_from_env() == 0


TrainFunction = TypeVar("TrainFunction", bound=Callable)


def holds_run_folder(train_function: TrainFunction) -> TrainFunction:
    """A training command's function (taking the run folder as its second argument) that holds the run folder's
    lock while it runs. A second run into the same RUN (a --overwrite or --resume typed while the first still
    trains) is refused at once: it would otherwise delete the folder under the first, or both would append
    metrics and write checkpoints into one run. Under torchrun, rank 0 holds it for every rank of its launch; a
    refused rank 0 ends the launch before the process group forms."""

    @functools.wraps(train_function)
    def held(recipe, run, *args, **options):
        if Path(run).exists() and not Path(run).is_dir():
            raise UserError(run, "exists and is a file, not a folder", "choose a run folder path")
        if options.get("overwrite") and options.get("resume", "none") != "none":
            raise UserError(
                "--overwrite",
                "--resume continues the run and --overwrite deletes it: they cannot be given together",
                "drop one of them",
            )
        lock = (
            held_alone(Path(run), "trained", "wait for it to finish (or stop it), or train into another run folder")
            if is_main_process()
            else contextlib.nullcontext()
        )
        with lock:
            return train_function(recipe, run, *args, **options)

    return held  # type: ignore[return-value]


def append_jsonl(path: Path, record: dict) -> None:
    # NaN / inf are not JSON (jq and most readers reject them): written as strings
    clean = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a") as handle:
        handle.write(json.dumps(clean) + "\n")


def drop_lines_after(path: Path, step: int) -> None:
    """On resume, forget what was logged after the checkpoint: those steps are about to be run again (a fresh
    start is step 0, so a run killed before its first checkpoint leaves nothing behind). A last line cut short (a
    node that died, or a disk that filled, mid-append) goes with them; any other line that is not a JSON object
    is one line naming it, not a resume that fails the same way on every requeue."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            if number == len(lines):
                break
            raise UserError(path, f"line {number} is not a JSON object", "fix or delete that line, then resume")
        if record.get("step", 0) <= step:
            kept.append(line)
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


# ---------------------------------------------------------------------------------------------------------------
# Starting, resuming or skipping a post-training run


@dataclass
class RunStart:
    """Where a run starts: a fresh start, a checkpoint to resume, or nothing to do (the finished model's manifest)."""

    resume_from: Path | None = None
    finished: dict | None = None
    overwrite: bool = False


def decide_start(run: Path, resume: str, overwrite: bool, steps: int) -> RunStart:
    """Check the run folder before any compute. `resume` is none, auto or a checkpoint folder."""
    run = Path(run)  # a file there is refused by holds_run_folder
    # Under torchrun rank 0 judges what the folder held before it started writing the run into it.
    holds_files = is_main_process() and holds_run_files(run)
    if resume == "none":
        if holds_files and not overwrite:
            raise UserError(
                run, "already holds a run", "pass --resume auto to continue it, or --overwrite to start over"
            )
        check_output_path(run, True)
        return RunStart(overwrite=holds_files)
    if holds_files and not (run / RUN_FILE).is_file():
        raise nothing_to_resume(run)
    if resume == "auto":
        manifest = read_manifest(run / FINAL) if (run / FINAL / MANIFEST_NAME).is_file() else None
        if manifest is not None and int(manifest.get("stats", {}).get("steps", 0)) >= steps:
            return RunStart(finished=manifest)
        found = step_checkpoints(run)
        if found:
            check_steps_reach(found[-1], trainer_step(found[-1]), steps)
        return RunStart(resume_from=found[-1] if found else None)
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(
            "--resume",
            f"{resume} is not a complete checkpoint (no trainer_state.json)",
            f"pass --resume auto or a folder under {run / CHECKPOINTS}",
        )
    check_steps_reach(path, trainer_step(path), steps)
    return RunStart(resume_from=path)


def nothing_to_resume(run: Path) -> UserError:
    """The error for --resume on a folder of files that are not a smolctl run."""
    return UserError(
        run,
        "holds files that are not a smolctl run, so there is nothing to resume",
        "choose another run folder, or start it over without --resume (--overwrite replaces the files)",
    )


def trainer_step(checkpoint: Path) -> int:
    """The step a post-training checkpoint (TRL's, or smolctl's PPO loop's) was saved at."""
    return int(json.loads((Path(checkpoint) / TRAINER_STATE).read_text())["global_step"])


def holds_trainer_checkpoints(run: Path) -> bool:
    """Whether the run's checkpoints are post-training ones (TRL's or the PPO loop's trainer_state.json), which
    carry no manifest: no checksums or lineage of their own, and `smolctl export` does not take them."""
    return any((folder / TRAINER_STATE).is_file() for folder in step_checkpoints(run))


def flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# A resume may train longer, save and log differently; anything else would make a different run.
RESUMABLE_CHANGES = ("training.steps", "checkpoint.", "logging.")


def recorded_run(run: Path) -> dict:
    """RUN/run.json ({} when there is none), or one line saying it cannot be read: a resume checks against it."""
    path = Path(run) / RUN_FILE
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(path, f"is not JSON ({exc})", "restore it, or start the run over with --overwrite") from None
    if not isinstance(recorded, dict):
        raise UserError(path, "is not a JSON object", "restore it, or start the run over with --overwrite")
    return recorded


def recipe_changes(before: dict, now: dict) -> dict[str, list]:
    """What a resume changes of the recipe recorded in run.json, as {key path: [before, now]}: run.json records
    the recipe now in force, and each resume event in events.jsonl what it changed."""
    old, new = flatten(before), flatten(now)
    return {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def resume_event(step: int, source: Path, changes: dict[str, list], discarded: list[str] = ()) -> dict:
    """The events.jsonl line of a resume: where it continued from, what it changed of the recipe, and what of
    later steps it removed (discard_later)."""
    event = {"event": "resume", "step": step, "from": str(source)}
    extra = {"changed": changes} if changes else {}
    return {**event, **extra, **({"discarded": list(discarded)} if discarded else {}), "time": time.time()}


def begin_run(run: Path, stage: str, recipe: dict, parent: Path, start: RunStart) -> None:
    """Record the run in RUN/run.json (a resume or a no-op must use the same recipe and starting checkpoint), and
    set metrics.jsonl and events.jsonl to the resume point. Rank 0 writes; every rank checks."""
    run = Path(run)
    current = {"stage": stage, "recipe": recipe, "parent": str(parent.resolve())}
    before = recorded_run(run) if start.resume_from or start.finished else {}
    if before:
        old, new = (
            flatten({"recipe": before.get("recipe", {}), "parent": before.get("parent")}),
            flatten({"recipe": current["recipe"], "parent": current["parent"]}),
        )
        changed = sorted(
            key.removeprefix("recipe.")
            for key in set(old) | set(new)
            if old.get(key) != new.get(key) and not key.removeprefix("recipe.").startswith(RESUMABLE_CHANGES)
        )
        if changed:
            raise UserError(
                "--resume",
                f"the recipe differs from the one the run started with in {', '.join(changed)}",
                "resume with the same recipe and --from (only training.steps, [checkpoint] and [logging] "
                "may change), or start a new run folder",
            )
    if start.finished or not is_main_process():
        return
    changes = recipe_changes(before.get("recipe", {}), recipe) if start.resume_from and before else {}
    folder = output_folder_path(run)  # a linked run folder is replaced where it points
    if start.overwrite:
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run / RUN_FILE, current)
    resumed_at = trainer_step(start.resume_from) if start.resume_from else 0
    for name in (METRICS, EVENTS):
        drop_lines_after(run / name, resumed_at)
        (run / name).touch()
    if start.resume_from:
        discarded = discard_later(run, resumed_at)
        append_jsonl(run / EVENTS, resume_event(resumed_at, start.resume_from, changes, discarded))
