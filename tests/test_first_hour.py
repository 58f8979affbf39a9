"""What a new user meets in the first hour (issue 22), through the real CLI: results on stdout and progress on
stderr, text printed as written (brackets included), usage lines that read as values, inspect on a folder of
dataset folders, hub ids that fail fast offline, Ctrl-C with a resume hint, and the run folder's files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE, run_cli


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_results_go_to_stdout_progress_and_errors_to_stderr(tmp_path):
    shown = run_cli("inspect", SAMPLE / "math", "--samples", "1")
    assert shown.returncode == 0 and shown.stderr == ""
    assert "documents" in shown.stdout and "schema" in shown.stdout and "samples" in shown.stdout
    as_json = run_cli("inspect", SAMPLE / "math", "--samples", "0", "--json")
    assert json.loads(as_json.stdout)["rows"] == 237 and as_json.stderr == ""
    made = run_cli("train-tokenizer", SAMPLE / "math", tmp_path / "tok", "--vocab-size", "512")
    assert made.returncode == 0 and "chars/token" in made.stdout and "chars/token" not in made.stderr


def test_brackets_in_paths_are_printed_as_they_are(tmp_path):
    odd = tmp_path / "run[old]"
    shutil.copytree(SAMPLE / "math", odd)
    shown = run_cli("inspect", odd, "--samples", "0")
    assert shown.returncode == 0 and f"{odd}" in shown.stdout.replace("\n", "")
    (tmp_path / "empty[v2]").mkdir()
    assert f"{tmp_path / 'empty[v2]'}: holds no parquet files" in _one_error_line(
        run_cli("inspect", tmp_path / "empty[v2]")
    )


def _help(*args: str) -> str:
    from typer.testing import CliRunner

    from smolctl.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"}, prog_name="smolctl")
    assert result.exit_code == 0, result.output
    return result.output


def test_help_shows_brackets_and_usage_reads_as_values():
    from smolctl.cli import app

    pretrain = _help("pretrain")
    assert "TOML recipe: [model] [data] [optimizer] [schedule] [training] ..." in pretrain
    assert "replacing the recipe's [data] paths/stages" in pretrain
    assert "Usage: smolctl pretrain [OPTIONS] RECIPE [RUN]" in pretrain
    assert "[[stages]]" in _help("mix") and "[rows, seq_len]" in _help("pack")
    for output in [_help(), *(_help(command.name) for command in app.registered_commands)]:
        usage = next(line for line in output.splitlines() if "Usage:" in line)
        assert "{" not in usage and "<bool>" not in output, usage


def _collection(root: Path) -> Path:
    """A folder of dataset folders, one with a nested duplicates/ dataset, as `dedup` per source leaves them."""
    for source in ("code", "math"):
        shutil.copytree(SAMPLE / source, root / source)
    shutil.copytree(SAMPLE / "prompts", root / "math" / "duplicates")
    return root


def test_inspect_a_folder_of_dataset_folders_and_verify_them_all(tmp_path):
    root = _collection(tmp_path / "dedup")
    listed = run_cli("inspect", root, "--json")
    assert listed.returncode == 0, listed.stderr
    folders = {f["path"]: f for f in json.loads(listed.stdout)["folders"]}
    assert set(folders) == {"code", "math", "math/duplicates"} and folders["math"]["rows"] == 237
    human = run_cli("inspect", root)
    assert human.returncode == 0 and "math/duplicates" in human.stdout
    verified = run_cli("inspect", root, "--verify")
    assert verified.returncode == 0 and "verified" in verified.stdout and "3 folders" in verified.stdout
    one = run_cli("inspect", root / "math", "--verify", "--samples", "0", "--json")
    assert json.loads(one.stdout)["folders"] == [{"path": "duplicates", "kind": "documents", "rows": 300, "shards": 2}]
    shard = next((root / "math" / "duplicates").glob("part-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    for target in (root, root / "math"):  # the nested folder is checked from either level
        broken = run_cli("inspect", target, "--verify", "--samples", "0")
        assert broken.returncode == 1 and f"{shard}: sha256 differs" in broken.stdout, broken.stdout


def test_inspect_shows_only_the_counts_a_kind_has(tokenizer_dir):
    info = json.loads(run_cli("inspect", tokenizer_dir, "--json").stdout)
    assert info["kind"] == "tokenizer" and not {"rows", "tokens", "shards"} & set(info)
    human = run_cli("inspect", tokenizer_dir).stdout
    assert "│ rows" not in human and "│ shards" not in human and "vocab_size" in human
    dataset = json.loads(run_cli("inspect", SAMPLE / "math", "--json", "--samples", "0").stdout)
    assert dataset["rows"] == 237 and dataset["shards"] == 2


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "127.0.0.1 does not answer"),  # nothing listens
    ],
)
def test_a_hub_tokenizer_id_fails_fast_when_the_hub_is_offline(tmp_path, env, reason):
    """The slow path is huggingface_hub retrying (~45 s of sleeps, a "Retrying in Ns" line each): the reason in the
    message shows the offline check decided, and no retry line was printed. (Wall time is not asserted: on a busy
    CI machine starting Python alone varies by tens of seconds.)"""
    result = run_cli(
        "pack",
        SAMPLE / "math",
        tmp_path / "out",
        "--tokenizer",
        "no-org/no-such-tokenizer",
        "--seq-len",
        "64",
        env={**env, "HF_HOME": str(tmp_path / "hf")},
    )
    line = _one_error_line(result)
    assert "no-org/no-such-tokenizer: is neither a local folder nor in the Hugging Face cache" in line
    assert reason in line and "Retrying" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_in_pretrain_says_how_to_resume_and_the_run_folder_has_events(tmp_path, tokenizer_dir):
    from test_pretrain import TEST_RECIPE

    from smolctl.data.pack import PackConfig, pack

    packed = tmp_path / "packed"
    pack(str(SAMPLE / "math"), packed, tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64))
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TEST_RECIPE.replace("{packed}", str(packed)))
    run = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smolctl",
            "pretrain",
            str(recipe),
            str(run),
            "--set",
            "training.steps=100000",
            "--set",
            "checkpoint.interval=100000",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        # As from a terminal: a suite started in the background (`make test &`) ignores SIGINT, and a child
        # inherits that, so Python would never raise KeyboardInterrupt in it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted: ") and f"smolctl pretrain {recipe} {run} --resume auto" in last, err[-2000:]
    assert "Traceback" not in err and out == ""
    assert (run / "events.jsonl").is_file() and (run / "events.jsonl").read_text() == ""  # no guard fired


@pytest.mark.slow
def test_post_training_leaves_no_model_card_beside_its_checkpoints(tmp_path, tokenizer_dir):
    from tiny_checkpoint import make_tiny_checkpoint

    model = make_tiny_checkpoint(tokenizer_dir, tmp_path / "model")
    done = run_cli(
        "sft",
        "recipes/sft-tiny.toml",
        tmp_path / "sft",
        "--from",
        model,
        "--set",
        "training.steps=1",
        "--set",
        "checkpoint.interval=1",
        "--set",
        "sft.max_length=64",
        "--set",
        "schedule.warmup_steps=0",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "sft" / "checkpoints").glob("step-*")), "a checkpoint was saved"
    assert not list((tmp_path / "sft").rglob("README.md"))
