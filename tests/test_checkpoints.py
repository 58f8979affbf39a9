"""Runs that survive a cluster: sharded checkpoints under torchrun (2 CPU processes, gloo), a killed rank, SIGUSR1,
resuming at another world size, and `smolctl export`.

One uninterrupted 2-process FSDP2 run (8 steps, checkpoints at 4 and 8) is the reference every other run is held
against: a run with one rank SIGKILLed resumes to bit-identical weights; its step-4 checkpoint continues on 1 and on
4 processes (4 oversubscribe a 2-core machine: gloo, one thread each, a tiny model) along the same loss curve, and so does a tensor-parallel (tp 2) run's on one process; a DDP run
stopped by SIGUSR1 saves the step it is on and its resume neither repeats nor skips a step; the export of its last
checkpoint equals the weights it gathered in memory for final/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from test_pretrain import packed, recipe  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
QUICK = ["--set", "training.steps=8", "--set", "checkpoint.interval=4", "--set", "checkpoint.keep=3"]


def torchrun(processes: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(port),
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "-m",
        "smolctl",
    ]


def pretrain(launcher: list[str], recipe: Path, run: Path, *extra: str) -> list[str]:
    return [*launcher, "pretrain", str(recipe), str(run), *QUICK, "--json", *extra]


def finish(command: list[str]) -> dict:
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert steps == sorted(set(steps)), f"a step was logged twice: {steps}"
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def wait_for_step(process: subprocess.Popen, run: Path, step: int) -> None:
    metrics = run / "metrics.jsonl"
    while process.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended (exit {process.returncode}) before step {step}")


def wait_for_checkpoint(process: subprocess.Popen, run: Path, step: int) -> None:
    """Until the step's checkpoint is committed: an async save finishes a step or more after it started, later
    still on a loaded machine."""
    from smolctl.train.checkpoint import checkpoint_path, complete_checkpoints

    while process.poll() is None:
        if checkpoint_path(run, step) in complete_checkpoints(run):
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended (exit {process.returncode}) before its step-{step} checkpoint was complete")


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The torchrun worker with RANK=rank among the launcher's children."""
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, recipe) -> tuple[Path, dict]:
    run = tmp_path_factory.mktemp("reference") / "run"
    result = finish(pretrain(torchrun(2, 29631), recipe, run, "--set", "training.shard=true"))
    assert [Path(p).name for p in result["checkpoints"]] == ["step-0000004", "step-0000008"]
    assert result["speed"]["checkpoints_saved"] == 2 and result["speed"]["checkpoint_seconds"] > 0
    return run, result


def test_a_killed_rank_then_resume_is_bit_identical(reference, recipe, tmp_path):
    run = tmp_path / "run"
    command = pretrain(torchrun(2, 29632), recipe, run, "--set", "training.shard=true")
    victim = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_step(victim, run, 5)  # past the step-4 checkpoint, before the step-8 one
    wait_for_checkpoint(victim, run, 4)
    assert max(losses(run)) < 8, "the step-4 checkpoint was committed only at the end of the run"
    os.kill(worker_pid(victim.pid, 1), signal.SIGKILL)  # one node of two dies
    assert victim.wait(timeout=300) != 0
    assert not (run / "final").exists() and not (run / "checkpoints" / "step-0000008").exists()

    result = finish([*command, "--resume", "auto"])
    assert result["resumed_from"].endswith("step-0000004") and result["steps"] == 8
    assert identical(weights(run / "final"), weights(reference[0] / "final"))
    assert sorted(losses(run)) == list(range(1, 9))


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory, recipe) -> tuple[Path, dict]:
    """The same run on 2 processes as one tensor-parallel group: its checkpoints hold DTensor shards split by tp."""
    run = tmp_path_factory.mktemp("tensor-parallel") / "run"
    return run, finish(pretrain(torchrun(2, 29635), recipe, run, "--set", "parallel.tp=2"))


@pytest.mark.parametrize(
    "source, processes",
    [("reference", 1), ("reference", 4), ("tensor_parallel", 1)],
    ids=["fsdp-to-1", "fsdp-to-4", "tp2-to-1"],
)
def test_a_two_process_checkpoint_continues_on_another_world_size(request, recipe, tmp_path, source, processes):
    saved = request.getfixturevalue(source)[0]
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-0000008")
    launcher = [sys.executable, "-m", "smolctl"] if processes == 1 else torchrun(processes, 29633)
    result = finish(pretrain(launcher, recipe, run, "--resume", "auto", "--set", "training.shard=true"))
    assert result["plan"]["world_size"] == processes and result["resumed_from"].endswith("step-0000004")
    expected, got = losses(saved), losses(run)
    assert sorted(got) == list(range(1, 9))
    assert all(abs(got[step] - expected[step]) < 1e-4 for step in range(5, 9)), (got, expected)


def test_sigusr1_saves_the_current_step_and_resume_neither_repeats_nor_skips(reference, recipe, tmp_path):
    run = tmp_path / "run"
    command = pretrain(torchrun(2, 29634), recipe, run, "--set", "checkpoint.interval=100")  # DDP; no scheduled saves
    launcher = subprocess.Popen(
        command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(launcher, run, 2)
    launcher.send_signal(signal.SIGUSR1)  # what the sbatch's trap forwards at the time limit
    stderr = launcher.communicate(timeout=300)[1]
    stopped_at = max(losses(run))
    assert stopped_at < 8, "the run finished before the signal"
    assert f"SIGUSR1: saved step {stopped_at}; stopping" in stderr
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == [f"step-{stopped_at:07d}"]
    assert not (run / "final").exists()

    result = finish([*command, "--resume", "auto"])
    assert result["resumed_from"].endswith(f"step-{stopped_at:07d}") and result["speed"]["steps_run"] == 8 - stopped_at
    expected, got = losses(reference[0]), losses(run)
    assert sorted(got) == list(range(1, 9))
    assert all(abs(got[step] - expected[step]) < 1e-4 for step in got), (got, expected)


def test_export_of_a_sharded_checkpoint_equals_the_gathered_weights(reference, tmp_path):
    from conftest import run_cli
    from transformers import AutoModelForCausalLM

    from smolctl.shards import lineage_chain, read_manifest

    run = reference[0]
    out = tmp_path / "export"
    done = run_cli("export", run / "checkpoints" / "step-0000008", out, "--json")
    assert done.returncode == 0, done.stderr
    assert identical(weights(out), weights(run / "final"))  # DCP shards streamed = FSDP2 full gather in memory
    # vLLM picks its implementation by config.json's architectures: FSDP2 renamed the sharded model's class
    # (final/ said FSDPSmolLM3ForCausalLM), and a checkpoint's config, saved alone, named none
    for folder in (out, run / "final", run / "checkpoints" / "step-0000008"):
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["SmolLM3ForCausalLM"], folder
    model = AutoModelForCausalLM.from_pretrained(out)
    assert np.array_equal(
        model.state_dict()["model.norm.weight"].numpy(), weights(run / "final")["model.norm.weight"].numpy()
    )
    manifest = read_manifest(out)
    assert manifest["kind"] == "model" and manifest["step"] == 8
    assert manifest["parent"] == str((run / "checkpoints" / "step-0000008").resolve())
    assert any(entry["kind"] == "packed" for entry in lineage_chain(out))


@pytest.mark.parametrize("raised", ["unpickling", "io-error", "ctrl-c", "out-of-memory"])
def test_a_damaged_checkpoint_is_named_but_ctrl_c_and_oom_stay_what_they_are(tmp_path, monkeypatch, raised):
    """DCP catches whatever a read raised, Ctrl-C and an OOM included, into one CheckpointException: a Ctrl-C
    during a resume's load read "cannot be read: KeyboardInterrupt — check its files" and exited 2."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from smolctl.errors import UserError
    from smolctl.train.checkpoint import damaged_checkpoint

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    error = {
        "unpickling": pickle.UnpicklingError("invalid load key, 'Y'."),
        "io-error": OSError(5, "Input/output error"),
        "ctrl-c": KeyboardInterrupt(),
        "out-of-memory": RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    }[raised]

    def failing_read(self, plan, planner):
        raise error

    monkeypatch.setattr(FileSystemReader, "read_data", failing_read)
    expected = {
        "unpickling": pytest.raises(UserError, match=rf"--from: {tmp_path} cannot be read: UnpicklingError"),
        "io-error": pytest.raises(UserError, match=rf"--from: {tmp_path} cannot be read: OSError"),
        "ctrl-c": pytest.raises(KeyboardInterrupt),
        "out-of-memory": pytest.raises(CheckpointException, match="CUDA out of memory"),
    }[raised]
    with expected, damaged_checkpoint(tmp_path, "--from"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=str(tmp_path), no_dist=True)


def test_every_rank_s_shard_is_listed_with_the_sha256_of_its_bytes(reference):
    """Each rank hashes the shard it wrote; rank 0 lists them all, so `inspect --verify` can catch a flipped block
    that keeps the file's size (a bad copy between file systems), which sizes alone never could."""
    from smolctl.shards import sha256_file

    for checkpoint in sorted((reference[0] / "checkpoints").glob("step-*")):
        listed = {entry["name"]: entry for entry in json.loads((checkpoint / "manifest.json").read_text())["files"]}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank00001.pt"} <= listed.keys()
        on_disk = sorted(p.name for p in checkpoint.iterdir() if p.name != "manifest.json")
        assert sorted(listed) == on_disk, "a rank's record of its digests was left in the checkpoint"
        for name, entry in listed.items():
            assert entry["sha256"] == sha256_file(checkpoint / name), name


def test_a_shard_flipped_at_its_size_stops_the_resume_on_every_world_size(reference, recipe, tmp_path):
    """Rank 1 hashes rank 0's shard (files are shared out by rank): the line still comes out whole, once. Without
    the check, the flipped weights load and train on."""
    from conftest import run_cli

    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-0000008")
    shard = run / "checkpoints" / "step-0000004" / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10  # inside a tensor's bytes: the file still unpickles
    shard.write_bytes(damaged)

    expected = "step-0000004: __0_0.distcp differs from the sha256 it was saved with"
    for launcher in (torchrun(2, 29636), [sys.executable, "-m", "smolctl"]):
        done = subprocess.run(
            pretrain(launcher, recipe, run, "--resume", "auto", "--set", "training.shard=true"),
            env=ENV,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode != 0 and done.stderr.count(expected) == 1, done.stderr[-3000:]
        # torchrun itself prints a traceback when a worker exits non-zero; smolctl's own frames never show
        assert done.stderr.startswith("error: --resume: ") and "smolctl/train" not in done.stderr, done.stderr[-3000:]
    assert sorted(losses(run)) == list(range(1, 9)), "the refused resumes logged steps"

    verify = run_cli("inspect", run, "--verify")
    assert verify.returncode == 1 and "step-0000004/__0_0.distcp: sha256 differs" in verify.stdout + verify.stderr
    # a run still training: its lineage so far is its newest checkpoint's
    lineage = json.loads(run_cli("inspect", run, "--lineage", "--json", "--samples", "0").stdout)
    assert lineage["path"].endswith("step-0000004") and lineage["lineage"][0]["kind"] == "checkpoint"
    assert any(entry["kind"] == "packed" for entry in lineage["lineage"])
