"""Crash safety of every file-writing stage (dedup, mix, pack, pretrain, sft), through the real CLI.

Each test runs the stage once without interruption, then starts it again in its own process group, waits until it
has made visible progress (its work area, staging folder or metrics file appears), SIGKILLs the whole group after a
seeded random extra delay (retrying with a shorter delay when the run won the race), and checks that:
  - nothing looks complete that is not: every visible folder holding a manifest.json verifies against it;
  - running the same command again (with `--resume auto` for the training stages) finishes, and its output equals
    the uninterrupted run's: the same shard sha256s in every manifest (for models: the same model.safetensors)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import REPO, SAMPLE
from test_dedup import sample_table, write_shards
from test_posttrain import SFT_QUICK, tiny_model  # noqa: F401  (fixture)
from test_pretrain import packed, recipe  # noqa: F401  (fixtures)

from smolctl.shards import read_manifest, verify_checksums

SEED = int(os.environ.get("SMOLCTL_CRASH_SEED", "20261202"))
ENV = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "smolctl", *map(str, args)]


def run(command: list[str], log: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    log.write_text(done.stderr)
    return done


def run_watching(
    command: list[str], progressed: Callable[[], bool], finished: Callable[[], bool], log: Path
) -> tuple[dict | None, float]:
    """The uninterrupted run: its JSON result (if any) and the time from its first visible progress to its
    committed output, which is the window the kill must land in."""
    with log.open("w") as stderr, (log.parent / f"{log.stem}.out").open("w+") as stdout:
        process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=stdout, stderr=stderr)
        while process.poll() is None and not progressed():
            time.sleep(0.002)
        start = time.monotonic()
        while process.poll() is None and not finished():
            time.sleep(0.002)
        window = time.monotonic() - start
        assert process.wait(timeout=300) == 0, log.read_text()[-2000:]
        stdout.seek(0)
        lines = stdout.read().strip().splitlines()
    return (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), window


def kill_mid_run(
    command: list[str],
    progressed: Callable[[], bool],
    finished: Callable[[], bool],
    clean: Callable[[], None],
    rng: random.Random,
    window: float,
    log: Path,
) -> float:
    """SIGKILL the command's process group (workers included, as a node failure would) once `progressed()` holds
    plus a random delay within the measured working window. A run that got to `finished()` (its output
    committed) first is cleaned away and retried with half the window. Returns the delay that landed."""
    for _ in range(8):
        clean()
        with log.open("w") as stderr:
            victim = subprocess.Popen(
                command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
            )
        while victim.poll() is None and not progressed():
            time.sleep(0.002)
        delay = rng.uniform(0, window)
        deadline = time.monotonic() + delay
        while victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            # 0: it ended on its own between the last look and the kill (it finished first: retried below).
            assert victim.wait() in (-signal.SIGKILL, 0), log.read_text()[-2000:]
            if victim.returncode == -signal.SIGKILL and not finished():
                return delay
        else:
            assert victim.returncode == 0, log.read_text()[-2000:]
        window /= 2
    pytest.fail(f"{command[3]} always finished before the kill")


def visible_manifests(root: Path) -> list[Path]:
    """Folders under root that present themselves as finished outputs (staging `.X.partial` and work areas
    `_work` are hidden by name and not outputs)."""
    return sorted(
        p.parent
        for p in root.rglob("manifest.json")
        if not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)
    )


def assert_nothing_half_done(root: Path) -> None:
    for folder in visible_manifests(root):
        assert verify_checksums(folder) == [], f"{folder} has a manifest but its shards do not match it"


def shard_checksums(output: Path) -> dict[str, list[tuple[str, str]]]:
    """Every manifest's shards under `output` by relative folder: what must be equal between two runs."""
    return {
        str(folder.relative_to(output)): [(s["name"], s["sha256"]) for s in read_manifest(folder)["shards"]]
        for folder in visible_manifests(output)
    }


def remover(*paths: Path) -> Callable[[], None]:
    def clean() -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(path.parent / f".{path.name}.partial", ignore_errors=True)

    return clean


def check_data_stage(
    tmp_path: Path, command: Callable[[Path], list[str]], progressed: Callable[[Path], bool], rng: random.Random
) -> dict:
    """Straight run, killed run, same command again; returns the killed-then-rerun output's checksums."""
    straight, crashed = tmp_path / "straight" / "out", tmp_path / "crashed" / "out"
    _, window = run_watching(
        command(straight),
        lambda: progressed(straight),
        lambda: (straight / "manifest.json").is_file(),
        tmp_path / "straight.log",
    )
    expected = shard_checksums(straight)
    assert expected and all(expected.values())

    kill_mid_run(
        command(crashed),
        lambda: progressed(crashed),
        lambda: (crashed / "manifest.json").is_file(),
        remover(crashed),
        rng,
        window,
        tmp_path / "killed.log",
    )
    assert_nothing_half_done(crashed.parent)
    again = run(command(crashed), tmp_path / "rerun.log")
    assert again.returncode == 0, again.stderr[-2000:]
    assert verify_checksums(crashed) == []
    assert shard_checksums(crashed) == expected
    assert not (crashed.parent / ".out.partial").exists()
    return expected


@pytest.fixture
def rng(request) -> random.Random:
    return random.Random(f"{SEED}-{request.node.name}")


def test_dedup_killed_then_rerun(tmp_path, rng):
    source = write_shards(tmp_path / "input", sample_table("web").slice(0, 900), 6)
    expected = check_data_stage(
        tmp_path,
        lambda out: cli("dedup", source, out, "--minhash", "--workers", "2"),
        lambda out: (out / "_work").is_dir(),
        rng=rng,
    )
    assert set(expected) == {".", "duplicates"} and len(expected["."]) == 6


def test_mix_killed_then_rerun(tmp_path, rng):
    sources = [f"--source={name}={SAMPLE / name}:{weight}" for name, weight in (("web", 6), ("code", 3), ("math", 1))]
    expected = check_data_stage(
        tmp_path,
        lambda out: cli("mix", out, *sources, "--documents", "900", "--shuffle-buffer", "100", "--seed", "3"),
        lambda out: (out / "_work").is_dir(),  # as pack: the staging folder lives for the last milliseconds only
        rng=rng,
    )
    assert expected["."] and all(len(shards) > 0 for shards in expected.values())


def test_pack_killed_then_rerun(tmp_path, tokenizer_dir, rng):
    expected = check_data_stage(
        tmp_path,
        lambda out: cli(
            "pack",
            SAMPLE / "web",
            out,
            "--tokenizer",
            tokenizer_dir,
            "--seq-len",
            "64",
            "--shard-size",
            "400rows",
            "--buffer-tokens",
            "20000",
        ),
        # Its units are packed into OUTPUT/_work first; the staging folder lives only for the last millisecond
        # (the assembly), too short a window for the kill to land in on a fast machine.
        lambda out: (out / "_work").is_dir(),
        rng=rng,
    )
    assert len(expected["."]) > 5


def model_checksum(folder: Path) -> str:
    (shard,) = [s for s in read_manifest(folder)["shards"] if s["name"] == "model.safetensors"]
    assert verify_checksums(folder) == []
    return shard["sha256"]


def check_training_stage(
    tmp_path: Path, command: Callable[[Path], list[str]], rng: random.Random, check_refusal: bool
) -> tuple[dict, dict]:
    """Straight run; killed run; (with check_refusal) the same command again, refused because the run folder holds
    a run; then `--resume auto`. Returns the two runs' JSON results."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    done, window = run_watching(
        command(straight),
        lambda: (straight / "metrics.jsonl").is_file(),
        lambda: (straight / "final" / "manifest.json").is_file(),
        tmp_path / "straight.log",
    )

    kill_mid_run(
        command(crashed),
        lambda: (crashed / "metrics.jsonl").is_file(),
        lambda: (crashed / "final" / "manifest.json").is_file(),
        remover(crashed),
        rng,
        window,
        tmp_path / "killed.log",
    )
    assert_nothing_half_done(crashed)

    if check_refusal:
        plain = run(command(crashed), tmp_path / "rerun.log")
        assert plain.returncode == 2 and plain.stderr.startswith("error: ") and "Traceback" not in plain.stderr
        assert "already holds a run" in plain.stderr and plain.stderr.count("\n") == 1
    resumed = run([*command(crashed), "--resume", "auto"], tmp_path / "resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert model_checksum(crashed / "final") == model_checksum(straight / "final")
    return done, json.loads(resumed.stdout)


def test_pretrain_killed_then_resumed(tmp_path, recipe, rng):
    straight, resumed = check_training_stage(
        tmp_path,
        lambda run_dir: cli(
            "pretrain",
            recipe,
            run_dir,
            "--json",
            "--set",
            "training.steps=16",
            "--set",
            "checkpoint.interval=3",
            "--set",
            "checkpoint.keep=2",
        ),
        rng=rng,
        check_refusal=True,
    )
    assert straight["steps"] == resumed["steps"] == 16


def test_sft_killed_then_resumed(tmp_path, tiny_model, rng):
    quick = [*SFT_QUICK, "training.steps=6", "checkpoint.interval=2"]
    straight, resumed = check_training_stage(
        tmp_path,
        lambda run_dir: cli(
            "sft", "recipes/sft-tiny.toml", run_dir, "--from", tiny_model, "--json", *(f"--set={o}" for o in quick)
        ),
        rng=rng,
        check_refusal=False,
    )
    assert straight["steps"] == resumed["steps"] == 6


def _children(parent: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.add(int(entry.name))
        except (OSError, IndexError):
            continue  # ended while we looked
    return children


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_pool_workers_end_when_the_command_is_killed(tmp_path, tokenizer_dir):
    """A command killed outright (kill -9, the OOM killer) takes its worker processes with it: nothing else closes
    their task queues, and they used to wait there for ever, holding their memory."""
    web = sample_table("web")
    rows = 20_500  # dedup uses its pool from 20,000 documents
    table = pa.table({"text": [f"{web['text'][i % len(web)].as_py()} {i}" for i in range(rows)]})
    source = write_shards(tmp_path / "input", table, 4)
    commands = {
        "dedup": cli("dedup", source, tmp_path / "deduped", "--minhash", "--workers", "2"),
        "pack": cli(
            "pack", source, tmp_path / "packed", "--tokenizer", tokenizer_dir, "--seq-len", "64", "--workers", "2"
        ),
    }
    for name, command in commands.items():
        process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(_children(process.pid)) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(process.pid)
        assert process.poll() is None and len(workers) >= 2, f"{name}: its workers were not seen running"
        process.kill()
        process.wait()
        deadline = time.monotonic() + 15
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(workers), f"{name}: workers {sorted(_alive(workers))} outlived the killed command"


def test_a_log_line_cut_short_by_a_crash_does_not_stop_every_resume(tmp_path):
    """A node that died mid-append left `{"step": 38, "loss": 6.4`: every resume, and so every Slurm requeue,
    failed on it as an internal error. It goes with the steps after the checkpoint; a damaged line elsewhere is
    named."""
    from smolctl.errors import UserError
    from smolctl.train.run import drop_lines_after

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 7.0}\n{"step": 2, "loss": 6.9}\n{"step": 3, "loss": 6.8}\n{"step": 4, "lo')
    drop_lines_after(metrics, 2)
    assert metrics.read_text() == '{"step": 1, "loss": 7.0}\n{"step": 2, "loss": 6.9}\n'
    metrics.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n')
    with pytest.raises(UserError, match="line 2 is not a JSON object"):
        drop_lines_after(metrics, 2)
