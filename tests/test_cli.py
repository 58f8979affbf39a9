"""The CLI shell as a user meets it: help, version, one-line errors with exit 2, --json, completions in sync."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from smolctl.completions import completion_scripts


def test_version_and_bare_command_show_the_pipeline():
    assert run_cli("--version").stdout.strip().startswith("smolctl ")
    bare = run_cli()
    assert bare.returncode == 0
    assert "train-tokenizer → dedup → mix → pack" in bare.stderr and "inspect" in bare.stderr
    assert bare.stdout == "" and "Usage: smolctl" in bare.stderr, "the pipeline and the help, on one stream"
    assert all(text.endswith("\n") for text in completion_scripts().values())


def test_the_process_entry_collects_while_a_command_runs(monkeypatch):
    """`python -m smolctl` and the `smolctl` script pause the cyclic collector only while the CLI imports and
    freeze what that made: a command (a training loop among them) runs with the collector on."""
    import gc

    import smolctl.__main__ as entry
    import smolctl.cli

    seen = {}
    monkeypatch.setattr(smolctl.cli, "main", lambda: seen.update(on=gc.isenabled(), frozen=gc.get_freeze_count()))
    gc.disable()  # a broken entry that never turns the collector back on must not be hidden by this test's state
    try:
        entry.main()
    finally:
        gc.enable()
        gc.unfreeze()  # this test process keeps its own collector
    assert seen["on"] and seen["frozen"] > 10_000
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'smolctl = "smolctl.__main__:main"' in scripts


def test_every_command_is_listed_and_its_help_has_examples():
    from typer.testing import CliRunner

    from smolctl.cli import PIPELINE_ORDER, app

    names = [command.name for command in app.registered_commands]
    assert sorted(names) == sorted(n for group in PIPELINE_ORDER.values() for n in group)
    runner = CliRunner()
    for name in names:
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "Examples" in result.output, name
        assert "smolctl " + name in result.output, f"{name}: an example runs the command"


def test_a_command_run_builds_only_itself_and_leaves_every_command_registered(monkeypatch, tmp_path):
    """`smolctl inspect PATH` makes inspect's click command alone; `--version`, a mistyped name and a failing
    command still leave all of them registered for the next call in the same process."""
    import typer.main

    from smolctl.cli import app, main

    everything = [command.name for command in app.registered_commands]
    built = []
    make = typer.main.get_command_from_info

    def recording(*args, **kwargs):
        built.append((args[0] if args else kwargs["command_info"]).name)
        return make(*args, **kwargs)

    monkeypatch.setattr(typer.main, "get_command_from_info", recording)
    for argv, code, names in (
        (["inspect", str(tmp_path / "missing")], 2, ["inspect"]),
        (["--version"], 0, everything),
        (["pakc"], 2, everything),
    ):
        built.clear()
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == code and built == names, argv
        assert [command.name for command in app.registered_commands] == everything


def test_inspect_json_describes_a_dataset_folder(sample):
    result = run_cli("inspect", sample / "math", "--json", "--samples", "2", "--verify", "--lineage")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["kind"] == "documents" and info["rows"] == 237 and info["verified"] is True
    assert len(info["samples"]) == 2 and info["schema"]["text"] == "string"


def test_inspect_samples_keep_their_json_types(tmp_path):
    """Samples were reprs: a null text read "None" (the same as the text "None"), a number "1", a struct "{'k': 1}"."""
    import datetime

    pq.write_table(
        pa.table(
            {
                "text": ["None", None, "x" * 1000],
                "n": [1, 2, 3],
                "turns": [[{"role": "user", "content": "y" * 1000}]] * 3,
                "t": [datetime.datetime(2020, 1, 1)] * 3,
            }
        ),
        tmp_path / "rows.parquet",
    )
    result = run_cli("inspect", tmp_path / "rows.parquet", "--json", "--samples", "3")
    assert result.returncode == 0, result.stderr
    samples = json.loads(result.stdout)["samples"]
    assert [row["text"] for row in samples][:2] == ["None", None] and len(samples[2]["text"]) == 240
    assert [row["n"] for row in samples] == [1, 2, 3] and samples[0]["t"] == "2020-01-01T00:00:00"
    assert samples[0]["turns"][0]["role"] == "user" and len(samples[0]["turns"][0]["content"]) == 240
    shown = run_cli("inspect", tmp_path / "rows.parquet", "--samples", "3").stdout
    assert "│ null " in shown and "│ None " in shown


def _assert_one_line_error(result, needle):
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


def test_wrong_path_empty_folder_non_parquet_and_corrupt_files_are_one_line_errors(tmp_path):
    _assert_one_line_error(run_cli("inspect", tmp_path / "nope"), "no such file or folder")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(run_cli("inspect", tmp_path / "empty"), "holds no parquet files")
    (tmp_path / "notes.txt").write_text("plain text")
    _assert_one_line_error(run_cli("inspect", tmp_path / "notes.txt"), "not a parquet file")
    corrupt = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"text": ["a" * 100] * 100}), corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:-40])
    _assert_one_line_error(run_cli("inspect", corrupt), "corrupt.parquet")


def test_debug_env_shows_the_traceback(tmp_path):
    result = run_cli("inspect", tmp_path / "nope", env={"SMOLCTL_DEBUG": "1"})
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_usage_errors_are_one_line_naming_the_option_and_where_to_look():
    """Click prints a usage error as its usage, a hint, a blank line and the error; smolctl's bad input is one
    line. A missing or extra argument is answered with the usage; anything else points at the command's -h."""
    cases = [
        (["inspect"], "smolctl inspect: Missing argument 'path' — usage: smolctl inspect [OPTIONS] PATH"),
        (["dedup", "a", "b", "c"], "Got unexpected extra argument(s) (c) — usage: smolctl dedup [OPTIONS] INPUT"),
        (["dedup", "a", "b", "--workers", "0"], "'--workers': 0 is not in the range x>=1 — see 'smolctl dedup -h'"),
        (["dedup", "a", "b", "--bogus"], "smolctl dedup: No such option: --bogus"),
        (["no-such-command"], "smolctl: No such command 'no-such-command' — see 'smolctl -h'"),
        (["pack", "a", "b", "--seq-len"], "smolctl pack: Option '--seq-len' requires an argument — see"),
    ]
    for argv, needle in cases:
        result = run_cli(*argv, env={"COLUMNS": "30"})  # click wraps its usage to the terminal: still one line
        assert result.returncode == 2 and result.stderr.startswith("error: "), (argv, result.stderr)
        assert result.stderr.splitlines() == [result.stderr.strip()] and needle in result.stderr, result.stderr


def test_a_negative_seed_is_a_usage_error_not_a_crash(tmp_path, sample, tokenizer_dir):
    """numpy's seed sequences take 0 or more: -5 crashed pack, mix and train-tokenizer with an internal error."""
    for argv in (
        ["pack", sample / "math", tmp_path / "p", "--tokenizer", tokenizer_dir, "--seq-len", "64", "--seed", "-5"],
        ["mix", tmp_path / "m", "--source", f"math={sample / 'math'}:1", "--seed", "-5"],
        ["train-tokenizer", sample / "math", tmp_path / "t", "--sample-documents", "5", "--seed", "-5"],
    ):
        result = run_cli(*argv)
        assert result.returncode == 2 and "--seed" in result.stderr and "internal error" not in result.stderr
    recipe = tmp_path / "mix.toml"
    recipe.write_text(
        f'seed = -5\n[sources.math]\npath = "{sample / "math"}"\n[[stages]]\nname = "a"\nweights = {{math = 1}}\n'
    )
    result = run_cli("mix", tmp_path / "r", "--recipe", recipe)
    assert result.returncode == 2 and "seed: must be >= 0, got -5 — set it to a value >= 0" in result.stderr


def test_verify_exits_1_on_a_flipped_byte(tmp_path, sample):
    import shutil

    copy = tmp_path / "math"
    shutil.copytree(sample / "math", copy)
    shard = sorted(copy.glob("part-*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    result = run_cli("inspect", copy, "--verify", "--samples", "0")
    assert result.returncode == 1 and "sha256 differs" in result.stdout


def test_verify_names_a_shard_the_manifest_does_not_list(tmp_path, sample):
    """Readers go by the manifest: a shard copied into a finished folder is never read, and --verify says so."""
    import shutil

    copy = tmp_path / "math"
    shutil.copytree(sample / "math", copy)
    assert run_cli("inspect", copy, "--verify", "--samples", "0").returncode == 0
    shutil.copy(copy / "part-00000.parquet", copy / "part-00099.parquet")
    (copy / "notes.txt").write_text("not a shard")
    result = run_cli("inspect", copy, "--verify", "--samples", "0")
    assert result.returncode == 1 and "part-00099.parquet: not listed in the manifest" in result.stdout
    assert "notes.txt" not in result.stdout


def test_verify_checks_a_model_folders_config_and_tokenizer_with_its_weights(tmp_path, tokenizer_dir):
    """A model's manifest lists its weights as shards; config.json and the tokenizer files decide what those
    weights mean (an edited layer count loads other weights, or fails), so --verify hashes them too."""
    from tiny_checkpoint import make_tiny_checkpoint

    model = make_tiny_checkpoint(tokenizer_dir, tmp_path / "model")
    listed = {f["name"] for f in json.loads((model / "manifest.json").read_text())["files"]}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= listed and "manifest.json" not in listed
    assert run_cli("inspect", model, "--verify", "--samples", "0").returncode == 0
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}, indent=2))
    result = run_cli("inspect", model, "--verify", "--samples", "0")
    assert result.returncode == 1 and "config.json: s" in result.stdout, result.stdout
    (model / "tokenizer.json").unlink()
    result = run_cli("inspect", model, "--verify", "--samples", "0")
    assert result.returncode == 1 and "tokenizer.json: missing" in result.stdout, result.stdout


def test_verify_reports_a_truncated_shard_and_a_moved_tokenizer_does_not_stop_inspect(tmp_path, sample, tokenizer_dir):
    """--verify on a shard cut short reports it (exit 1), as for a flipped byte, instead of failing to read samples
    from it; once the tokenizer a packed folder records has moved, inspect still shows it (rows as token ids)."""
    import shutil

    copy = tmp_path / "math"
    shutil.copytree(sample / "math", copy)
    shard = sorted(copy.glob("part-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])
    result = run_cli("inspect", copy, "--verify")
    assert result.returncode == 1 and f"{shard.name}: size" in result.stdout, result.stderr
    moved = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, moved)
    assert (
        run_cli("pack", sample / "math", tmp_path / "packed", "--tokenizer", moved, "--seq-len", "64").returncode == 0
    )
    shutil.rmtree(moved)
    result = run_cli("inspect", tmp_path / "packed", "--verify", "--lineage", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["verified"] and info["samples"][0]["text"].split()[0].isdigit()


def test_inspect_shows_an_empty_output_and_names_a_missing_path(tmp_path, sample):
    """dedup against a copy of its input keeps nothing and writes a folder with no shards: inspect shows it (0
    rows) and --verify passes, where both said the folder held no shards; --verify on a typo says no such path."""
    import shutil

    shutil.copytree(sample / "math", tmp_path / "copy")
    assert run_cli("dedup", sample / "math", tmp_path / "none", "--against", tmp_path / "copy").returncode == 0
    result = run_cli("inspect", tmp_path / "none", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["rows"] == 0 and info["verified"]
    _assert_one_line_error(run_cli("inspect", tmp_path / "typo", "--verify"), "typo: no such file or folder")


def test_completions_are_in_sync_with_the_cli():
    for name, text in completion_scripts().items():
        assert (REPO / "completions" / name).read_text() == text, f"regenerate with `make completions` ({name})"


@pytest.mark.parametrize(
    "shell, env",
    [
        ("bash", {"COMP_WORDS": "smolctl ded", "COMP_CWORD": "1"}),
        ("zsh", {"_TYPER_COMPLETE_ARGS": "smolctl ded"}),
        ("fish", {"_TYPER_COMPLETE_ARGS": "smolctl ded", "_TYPER_COMPLETE_FISH_ACTION": "get-args"}),
    ],
)
def test_each_completion_script_is_answered_by_the_cli(shell, env):
    """The scripts call smolctl back with these variables (see completions/): Typer must still answer them."""
    assert f"_SMOLCTL_COMPLETE=complete_{shell}" in "".join(completion_scripts().values())
    result = run_cli(env={"_SMOLCTL_COMPLETE": f"complete_{shell}", **env})
    assert result.returncode == 0 and "dedup" in result.stdout and "mix" not in result.stdout, result


@pytest.mark.parametrize(
    "words, shown",
    [
        ("smolctl mix --", "TOML recipe with [sources.NAME] and [[stages]]."),  # an option's help
        ("smolctl pretrain --", "replacing the recipe''s [data] paths"),  # an option shared by commands
    ],
)
def test_completion_descriptions_read_as_written(words, shown):
    """Typer passes completion descriptions through Rich markup to strip it: help with brackets must come out as
    written, as it does in --help."""
    result = run_cli(env={"_SMOLCTL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": words})
    assert result.returncode == 0 and shown in result.stdout, result.stdout


def test_mix_options_given_override_the_recipe_even_at_their_default(tmp_path):
    """--shuffle-buffer 20000 is 20000 with a recipe of 5000, although 20000 is also MixSchedule's default."""
    from smolctl.data.mix_schedule import MixSchedule, schedule_from_recipe

    recipe = tmp_path / "mix.toml"
    recipe.write_text(
        (REPO / "recipes" / "demo-mix.toml")
        .read_text()
        .replace("seed = 1234\n", 'seed = 1234\nshuffle_buffer = 5000\ntext_column = "body"\n')
    )
    assert MixSchedule.__dataclass_fields__["shuffle_buffer"].default == 20_000
    from_recipe = schedule_from_recipe(recipe)
    assert (from_recipe.shuffle_buffer, from_recipe.text_column, from_recipe.seed) == (5000, "body", 1234)
    given = schedule_from_recipe(recipe, shuffle_buffer=20_000, text_column="text", seed=0, max_repeat=1.0)
    assert (given.shuffle_buffer, given.text_column, given.seed, given.max_repeat) == (20_000, "text", 0, 1.0)


INTERRUPTED_LINE = "interrupted: nothing half-written was left behind — run the command again"


def _interrupted(script: str, sigint=signal.SIG_DFL) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        start_new_session=True,  # the script signals its own process group, as a terminal's Ctrl-C does
        # A suite started in the background ignores SIGINT, and a child inherits that: set it either way.
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


def test_ctrl_c_in_a_data_command_ends_with_one_line_and_exit_130(tmp_path, sample):
    """Typer turns Ctrl-C into a silent exit 130; the user must still read what happened. The signal arrives
    while dedup runs (the real handler raising KeyboardInterrupt inside the command), through the real entry."""
    process = _interrupted(f"""
import os, signal, sys, time
import smolctl.data.dedup as dedup
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
dedup.run = interrupted
sys.argv = ["smolctl", "dedup", {str(sample / "web")!r}, {str(tmp_path / "out")!r}, "--workers", "1"]
from smolctl.__main__ import main
main()
""")
    assert process.returncode == 130, process.stderr
    assert process.stderr.strip().splitlines() == [INTERRUPTED_LINE]


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_under_torchrun_is_said_once_by_rank_0(rank):
    """A terminal's Ctrl-C reaches every rank of a torchrun launch: benchmark-nccl printed the interrupted line
    once per rank (8 per node)."""
    process = _interrupted(f"""
import os, signal, sys, time
import smolctl.infra.collective_runner as runner
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
runner.run_benchmark = interrupted
os.environ.update(RANK="{rank}", WORLD_SIZE="2", LOCAL_RANK="{rank}")
sys.argv = ["smolctl", "benchmark-nccl"]
from smolctl.__main__ import main
main()
""")
    assert process.returncode == 130, process.stderr
    assert process.stderr.strip().splitlines() == ([INTERRUPTED_LINE] if rank == 0 else [])


@pytest.mark.parametrize("overwrite", [False, True], ids=["new output", "over an earlier output"])
def test_ctrl_c_while_the_output_is_swapped_into_place_waits_for_the_swap_and_says_it_is_done(
    tmp_path, sample, overwrite
):
    """Ctrl-C between the moves of the final swap left the earlier output aside as a hidden .out.old for good (or
    no OUTPUT), and said to run the command again, which then refused the full OUTPUT. The swap finishes first,
    and the line says the output is complete."""
    out = tmp_path / "out"
    if overwrite:
        assert run_cli("dedup", sample / "math", out).returncode == 0
    process = _interrupted(f"""
import os, signal, sys
from pathlib import Path
from smolctl import shards
record = shards.committed
def interrupted_between_the_moves(folder):  # called once both moves are done, Ctrl-C still held back
    if folder == Path({str(out)!r}):  # the final one, not the duplicates report's
        os.kill(os.getpid(), signal.SIGINT)
    record(folder)
shards.committed = interrupted_between_the_moves
sys.argv = ["smolctl", "dedup", {str(sample / "web")!r}, {str(out)!r}, "--workers", "1", "--overwrite"]
from smolctl.__main__ import main
main()
""")
    assert process.returncode == 130, process.stderr
    assert process.stderr.strip().splitlines() == [
        f"interrupted: {out}: was complete and in place before the interrupt — nothing to run again"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / "manifest.json").read_text())["inputs"][0]["path"] == str(sample / "web")


def test_ctrl_c_reaching_idle_pool_workers_is_still_one_line(tmp_path, sample):
    """A terminal's Ctrl-C reaches every process of its group: each idle worker printed a KeyboardInterrupt
    traceback around the parent's line."""
    process = _interrupted(f"""
import os, signal, sys, time
import smolctl.data.dedup as dedup
def run_then_ctrl_c(self, plan_, stage, units, report):
    pool = self._pool(plan_)
    # Tasks that take a while: each worker is started (one per submission while none is idle) and done starting.
    [future.result() for future in [pool.submit(time.sleep, 0.3) for _ in range(4)]]
    os.killpg(0, signal.SIGINT)
    time.sleep(5)
dedup._Workers.run = run_then_ctrl_c
sys.argv = ["smolctl", "dedup", {str(sample / "web")!r}, {str(tmp_path / "out")!r}, "--workers", "2"]
from smolctl.__main__ import main
main()
""")
    assert process.returncode == 130, process.stderr
    assert process.stderr.strip().splitlines() == [INTERRUPTED_LINE]


def test_a_command_started_ignoring_sigint_keeps_its_workers_ignoring_it(tmp_path, sample):
    """`smolctl dedup ... &` in a script starts with SIGINT ignored: a SIGINT to the group must not end the pool
    workers under the parent (a broken pool, reported as an internal error) but leave the run to finish."""
    process = _interrupted(
        f"""
import os, signal, sys, time
import smolctl.data.dedup as dedup
real_run = dedup._Workers.run
def ctrl_c_then_run(self, plan_, stage, units, report):
    pool = self._pool(plan_)
    [future.result() for future in [pool.submit(time.sleep, 0.3) for _ in range(4)]]  # the workers are up
    os.killpg(0, signal.SIGINT)
    time.sleep(0.5)
    real_run(self, plan_, stage, units, report)
dedup._Workers.run = ctrl_c_then_run
sys.argv = ["smolctl", "dedup", {str(sample / "web")!r}, {str(tmp_path / "out")!r}, "--workers", "2", "--json"]
from smolctl.__main__ import main
main()
""",
        sigint=signal.SIG_IGN,
    )
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout)["finished"] and (tmp_path / "out" / "manifest.json").is_file()


def test_ctrl_c_after_a_training_run_wrote_final_says_there_is_nothing_to_continue(tmp_path):
    """sft interrupted after it had written RUN/final told the user to run again; a resume to more steps keeps the
    old final/ until the new one replaces it, and that one still has more to train."""
    import os

    from smolctl.cli.common import resume_hint_on_interrupt
    from smolctl.errors import COMMITTED_BEFORE_THE_INTERRUPT, Interrupted

    run = tmp_path / "run"

    def interrupted(write_final: bool) -> str:
        with pytest.raises(Interrupted) as info, resume_hint_on_interrupt("sft", "r.toml", run):
            if write_final:
                (run / "final").mkdir(parents=True, exist_ok=True)
                tmp = run / "final" / ".manifest.tmp"
                tmp.write_text("{}")
                os.replace(tmp, run / "final" / "manifest.json")  # a new file, as an atomic write makes
            raise KeyboardInterrupt
        return str(info.value)

    assert "--resume auto" in interrupted(write_final=False)
    assert interrupted(write_final=True) == f"{run / 'final'}: {COMMITTED_BEFORE_THE_INTERRUPT}"
    assert "--resume auto" in interrupted(write_final=False), "the final/ of an earlier run still has more to train"


@pytest.mark.parametrize("command", ["pretrain", "midtrain", "sft", "dpo", "ppo", "grpo"])
def test_a_training_command_without_run_says_run_is_required(command):
    recipe = "recipes/smollm3-tiny.toml" if command in ("pretrain", "midtrain") else f"recipes/{command}-tiny.toml"
    result = run_cli(command, recipe)
    assert result.returncode == 2 and result.stderr.startswith("error: RUN: is required"), result.stderr


def test_an_option_whose_value_ends_in_equals_is_not_taken_for_an_empty_one():
    """`--set=training.seed=` gives --set the value `training.seed=`: only `--opt=` alone is empty."""
    result = run_cli("estimate", "recipes/smollm3.toml", "--set=training.seed=")
    assert result.returncode == 2 and "unset shell variable" not in result.stderr, result.stderr
    assert "training.seed" in result.stderr
