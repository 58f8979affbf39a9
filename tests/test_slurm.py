"""The sbatch recipes on a real single-node Slurm (`bash scripts/slurm-local.sh start`, as .ci/run does): job
arrays, afterok chains, a cancelled and re-submitted array, torchrun under srun. Skipped, saying why, where that
Slurm is not running."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE

pytestmark = pytest.mark.slurm
SLURM = REPO / "recipes" / "slurm"
# Sized for a CI machine: one CPU per data task; the training and network jobs take the node's two cores.
SMALL = "--cpus-per-task=1"
ONE_NODE = "--nodes=1 --gpus-per-node=0 --cpus-per-task=2 --export=ALL,SLURM_GPUS_ON_NODE=2,GPUS_PER_NODE=2"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """The environment for sbatch and for the jobs: SLURM_CONF of the local Slurm, smolctl on PATH."""
    env_file = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/smolctl-slurm")) / "env"
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch is not installed: `sudo bash scripts/slurm-local.sh start` installs and starts Slurm")
    if not env_file.is_file():
        pytest.skip(f"no local Slurm is running ({env_file} is missing): `sudo bash scripts/slurm-local.sh start`")
    conf = re.search(r"SLURM_CONF=(\S+)", env_file.read_text()).group(1)
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "smolctl").write_text(f'#!/bin/bash\nexec {sys.executable} -m smolctl "$@"\n')
    (bin_dir / "smolctl").chmod(0o755)
    env = {
        **os.environ,
        "SLURM_CONF": conf,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "COLUMNS": "120",
    }
    probe = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or not probe.stdout.strip():
        pytest.skip(f"the local Slurm does not answer (sinfo: {(probe.stderr or probe.stdout).strip()[:200]})")
    return env


def submit(command: list, env: dict, cwd: Path, **settings: str) -> str:
    done = subprocess.run(command, env={**env, **settings}, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def job_states(job: str | None, env: dict, workdir: Path | None = None) -> dict[str, str]:
    """The state of every task of a job (an array has one per task), or of every job submitted from `workdir`,
    from the controller's records."""
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", *([job] if job else [])], env=env, capture_output=True, text=True, timeout=30
    )
    states = {}
    for line in shown.stdout.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if workdir is not None and fields.get("WorkDir") != str(workdir):
            continue
        task = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"]
        states[task] = fields["JobState"]
    return states


def wait_for(jobs: list[str], env: dict, timeout: float = 900) -> dict[str, str]:
    """Wait until none of the jobs is pending or running; returns the state of every task."""
    deadline = time.monotonic() + timeout
    while True:
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%T %r", "-j", ",".join(jobs)], env=env, capture_output=True, text=True, timeout=30
        ).stdout
        if not queued.strip() or "DependencyNeverSatisfied" in queued:
            break
        assert time.monotonic() < deadline, f"jobs still queued after {timeout} s:\n{queued}"
        time.sleep(2)
    return {task: state for job in jobs for task, state in job_states(job, env).items()}


def shards(folder: Path) -> dict[str, bytes]:
    """Every file of an output folder but the manifests (which name their command and time)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def smolctl(*args, cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "smolctl", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_pipeline_runs_the_data_stages_as_arrays_to_the_single_process_bytes_then_pretrains(slurm, tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "tiny.toml"  # the tiny recipe for two ranks and four steps
    text = (REPO / "recipes" / "smollm3-tiny.toml").read_text()
    for old, new in (
        ("steps = 120", "steps = 4"),
        ("interval = 40", "interval = 2"),
        ("warmup_steps = 10", "warmup_steps = 1"),
        ('paths = ["demo-out/packed"]', f'paths = ["{out / "packed"}"]'),
    ):
        assert old in text
        text = text.replace(old, new)
    recipe.write_text(text)
    # TASKS=3 over sources of 2 shards: one task of each shard array has no unit and must succeed all the same.
    printed = submit(
        ["bash", SLURM / "pipeline.sh"],
        slurm,
        tmp_path,
        DATA=str(SAMPLE),
        OUT=str(out),
        TASKS="3",
        BANDS="2",
        SBATCH_ARGS=SMALL,
        PRETRAIN_RECIPE=str(recipe),
        PRETRAIN_SBATCH_ARGS=ONE_NODE,
    )
    jobs = dict(line.split() for line in printed.splitlines())
    assert list(jobs) == ["tokenizer", "dedup-web", "dedup-code", "dedup-math", "mix", "pack", "pretrain"]
    # The same stages, one process each, while Slurm works.
    local = tmp_path / "local"
    smolctl("train-tokenizer", SAMPLE / "web", local / "tokenizer", "--vocab-size", "4096", cwd=tmp_path)
    for source in ("web", "code", "math"):
        smolctl("dedup", SAMPLE / source, local / "dedup" / source, "--minhash", cwd=tmp_path)
    smolctl(
        "mix",
        local / "mix",
        "--recipe",
        REPO / "recipes" / "demo-mix.toml",
        "--tokenizer",
        local / "tokenizer",
        *[f"--set=sources.{s}.path={local / 'dedup' / s}" for s in ("web", "code", "math")],
        cwd=tmp_path,
    )
    smolctl(
        "pack",
        local / "mix" / "stage-1",
        local / "packed",
        "--tokenizer",
        local / "tokenizer",
        "--seq-len",
        "256",
        cwd=tmp_path,
    )
    wait_for(list(jobs.values()), slurm)
    states = job_states(None, slurm, workdir=tmp_path)  # every array of every stage
    failed = {task: state for task, state in states.items() if state != "COMPLETED"}
    logs = [
        p
        for p in [*(tmp_path / "logs").glob("*"), *tmp_path.glob("*.out")]
        if any(f"-{task}" in p.name for task in failed)
    ]
    assert not failed, f"{failed}\n" + "\n".join(p.read_text()[-1500:] for p in logs)
    assert len(states) == 1 + 3 * (3 + 2 + 1 + 3) + 3 + 3 + 3 + 1  # every array task ran, none failed
    for folder in ("tokenizer", "dedup/web", "dedup/code", "dedup/math", "mix", "packed"):
        assert shards(out / folder) == shards(local / folder), folder
    assert (out / "pretrain" / "final").is_dir()


def test_a_cancelled_task_and_a_resubmitted_array_give_the_same_bytes(slurm, tokenizer_dir, tmp_path):
    smolctl("pack", SAMPLE / "code", tmp_path / "local", "--tokenizer", tokenizer_dir, "--seq-len", "128", cwd=tmp_path)
    settings = dict(
        INPUT=str(SAMPLE / "code"),
        OUTPUT=str(tmp_path / "packed"),
        TOKENIZER=str(tokenizer_dir),
        TASKS="2",
        PACK_ARGS="--seq-len 128",
    )
    # Task 1 of the first array waits before packing, so that the cancel lands while it runs whatever the
    # machine's load (a shard this small is packed in about a second: a late scancel found it committed).
    started = tmp_path / "task-1-started"
    waiting = tmp_path / "smolctl-waiting"
    waiting.write_text(
        f'#!/bin/bash\nif [[ $SLURM_ARRAY_TASK_ID == 1 ]]; then touch {started}; sleep 600; fi\nexec smolctl "$@"\n'
    )
    waiting.chmod(0o755)
    job = submit(["bash", SLURM / "pack.sbatch"], slurm, tmp_path, SBATCH_ARGS=SMALL, SMOLCTL=str(waiting), **settings)
    job = job.strip()
    deadline = time.monotonic() + 300
    while not started.exists():  # cancel task 1 while it runs
        assert time.monotonic() < deadline, job_states(job, slurm)
        time.sleep(0.2)
    subprocess.run(["scancel", f"{job}_1"], env=slurm, check=True, timeout=30)
    states = wait_for([job], slurm)
    assert sorted(states.values()) == ["CANCELLED", "COMPLETED"], states
    assert not (tmp_path / "packed" / "manifest.json").exists()  # one shard is missing: nothing committed
    # The same array again: task 0 finds its shard done, task 1 packs its shard and commits.
    again = submit(["bash", SLURM / "pack.sbatch"], slurm, tmp_path, SBATCH_ARGS=SMALL, **settings).strip()
    assert set(wait_for([again], slurm).values()) == {"COMPLETED"}
    assert shards(tmp_path / "packed") == shards(tmp_path / "local")
    # And once more after the commit (a re-submitted array of a finished run): every task exits 0 saying so.
    late = submit(["bash", SLURM / "pack.sbatch"], slurm, tmp_path, SBATCH_ARGS=SMALL, **settings).strip()
    assert set(wait_for([late], slurm).values()) == {"COMPLETED"}
    assert "already committed" in (tmp_path / "logs" / f"smolctl-pack-{late}_1.out").read_text()
    assert shards(tmp_path / "packed") == shards(tmp_path / "local")


def test_benchmark_nccl_sbatch_passes_on_gloo(slurm, tmp_path):
    job = submit(
        [
            "sbatch",
            "--parsable",
            *ONE_NODE.split(),
            "--output",
            str(tmp_path / "nccl.out"),
            SLURM / "benchmark-nccl.sbatch",
            "--ops",
            "all_reduce,all_gather",
            "--min-bytes",
            "64K",
            "--max-bytes",
            "256K",
            "--iters",
            "3",
            "--warmup",
            "1",
        ],
        slurm,
        tmp_path,
    ).strip()
    states = wait_for([job], slurm, timeout=600)
    report = (tmp_path / "nccl.out").read_text()
    assert set(states.values()) == {"COMPLETED"}, report[-3000:]
    assert "all_reduce" in report and "all_gather" in report and "gloo" in report


PREEMPTED_RECIPE = """
[model]
architecture = "smollm3"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2

[data]
paths = ["{packed}"]

[optimizer]
lr = 1e-2

[schedule]
kind = "wsd"
warmup_steps = 2
decay_fraction = 0.2

[training]
steps = 30
seq_len = 64
micro_batch = 2
global_batch = 4

[checkpoint]
interval = 100                     # no checkpoint but the one the preemption asks for, and the last step's
keep = 2

[logging]
interval = 1
"""


def test_pretrain_sbatch_saves_on_usr1_requeues_and_continues_at_the_saved_step(slurm, tokenizer_dir, tmp_path):
    smolctl("pack", SAMPLE / "web", tmp_path / "packed", "--tokenizer", tokenizer_dir, "--seq-len", "64", cwd=tmp_path)
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(PREEMPTED_RECIPE.replace("{packed}", str(tmp_path / "packed")))
    run, log = tmp_path / "run", tmp_path / "pretrain.out"
    job = submit(
        [
            "sbatch",
            "--parsable",
            *ONE_NODE.split(),
            "--output",
            str(log),
            SLURM / "pretrain.sbatch",
            str(recipe),
            str(run),
        ],
        slurm,
        tmp_path,
    ).strip()
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):  # mid-run: a few steps done
        assert time.monotonic() < deadline and job_states(job, slurm)[job] in ("PENDING", "RUNNING"), log.read_text()[
            -3000:
        ]
        time.sleep(0.5)
    before = metrics.read_text().splitlines()[:3]
    # What Slurm does at --signal=B:USR1@180 before the time limit: USR1 to the batch shell, whose trap forwards it.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True, timeout=30)
    states = wait_for([job], slurm)
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job], env=slurm, capture_output=True, text=True, timeout=30
    )
    text = log.read_text()
    assert states == {job: "COMPLETED"} and "Restarts=1" in shown.stdout, text[-3000:]
    assert "requeueing" in text
    saved = int(re.search(r"saved step (\d+); stopping", text).group(1))
    assert 3 <= saved < 30 and sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        f"step-{saved:07d}",
        "step-0000030",
    ]
    # every step once, in order, across the two runs: none repeated, none skipped; the first steps' lines are the
    # first run's (a restart from scratch would have rewritten them)
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31)) and lines[:3] == before
    assert json.loads((run / "final" / "manifest.json").read_text())["step"] == 30
