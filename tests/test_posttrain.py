"""sft and dpo (TRL behind smolctl recipes) end to end on a tiny model, chained into ppo through the CLI, plus
task balancing, padding-free SFT, resume, and the bad inputs that must fail before training."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE, run_cli
from tiny_checkpoint import make_tiny_checkpoint

from smolctl.errors import UserError
from smolctl.train.config import load_command_recipe
from smolctl.train.posttrain import balanced_indices, run_dpo, run_sft

SFT_QUICK = ["training.steps=3", "training.micro_batch=4", "sft.max_length=128", "checkpoint.interval=100"]


def load_sft_recipe(path, overrides):
    return load_command_recipe("sft", path, overrides)


def load_dpo_recipe(path, overrides):
    return load_command_recipe("dpo", path, overrides)


@pytest.fixture(scope="module")
def tiny_model(tokenizer_dir, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("posttrain") / "pre")


def chat_reply(model_dir: Path) -> str:
    """Load a model folder as any transformers user would, and answer one chat turn with its template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is `os.path.join` a function or a class?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])


def test_balanced_indices_give_every_group_the_same_share():
    groups = ["a"] * 6 + ["b"] * 3 + ["c"] * 1
    capped = balanced_indices(groups, "cap", seed=0)
    assert Counter(groups[i] for i in capped) == {"a": 1, "b": 1, "c": 1}
    upsampled = balanced_indices(groups, "upsample", seed=0)
    assert Counter(groups[i] for i in upsampled) == {"a": 6, "b": 6, "c": 6}
    assert sorted(set(i for i in upsampled if groups[i] == "b")) == [6, 7, 8]  # every row used before repeats
    assert balanced_indices(groups, "cap", seed=0) == capped


@pytest.mark.slow
def test_sft_dpo_ppo_chain_through_the_cli(tiny_model, tmp_path):
    bad = run_cli(
        "sft",
        "recipes/sft-tiny.toml",
        tmp_path / "bad",
        "--from",
        tiny_model,
        "--set",
        f"data.path={SAMPLE / 'preference'}",
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert (
        "has no 'messages' column nor 'prompt'/'completion' columns (columns: id, prompt, chosen, rejected)"
        in bad.stderr
    )
    assert not (tmp_path / "bad").exists()

    sft = run_cli(
        "sft",
        "recipes/sft-tiny.toml",
        tmp_path / "sft",
        "--from",
        tiny_model,
        "--json",
        *(f"--set={o}" for o in SFT_QUICK),
    )
    assert sft.returncode == 0, sft.stderr
    result = json.loads(sft.stdout)
    assert result["steps"] == 3 and result["final"] == str(tmp_path / "sft" / "final")
    assert result["data"]["groups_after"] == {"kind": 188, "where": 188, "explain": 188}
    manifest = json.loads((tmp_path / "sft" / "final" / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["parent"] == str(tiny_model.resolve())
    assert [ref["path"] for ref in manifest["inputs"]] == [str(SAMPLE / "chat"), str(tiny_model.resolve())]
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) >= 3

    dpo = run_cli(
        "dpo",
        "recipes/dpo-tiny.toml",
        tmp_path / "dpo",
        "--from",
        tmp_path / "sft",
        "--json",
        "--set",
        "training.steps=3",
        "--set",
        "training.micro_batch=4",
        "--set",
        "schedule.decay_rate=0.5",
        "--set",
        "dpo.max_length=64",
    )
    assert dpo.returncode == 0, dpo.stderr
    result = json.loads(dpo.stdout)
    assert {"rewards/accuracies", "rewards/margins", "loss"} <= set(result["metrics"])
    rates = [
        r["lr"] for r in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()) if "lr" in r
    ]
    assert rates == pytest.approx([1e-3 * 0.5**step for step in range(3)])  # lr0 · decay^step
    assert json.loads((tmp_path / "dpo" / "final" / "manifest.json").read_text())["parent"] == str(
        tmp_path / "sft" / "final"
    )

    ppo = run_cli(
        "ppo",
        "recipes/ppo-tiny.toml",
        tmp_path / "ppo",
        "--from",
        tmp_path / "dpo",
        "--set",
        "training.steps=2",
        "--set",
        "ppo.batch_size=8",
        "--set",
        "training.micro_batch=8",
        "--set",
        "ppo.max_new_tokens=4",
    )
    assert ppo.returncode == 0, ppo.stderr
    assert "reward_last" in ppo.stdout and "ppo/final" in ppo.stdout
    for stage in ("sft", "dpo", "ppo"):
        assert isinstance(chat_reply(tmp_path / stage / "final"), str)
    lineage = run_cli("inspect", tmp_path / "ppo" / "final", "--lineage", "--json", "--samples", "0")
    kinds = [entry["kind"] for entry in json.loads(lineage.stdout)["lineage"]]
    assert kinds[:3] == ["model", "documents", "model"] and kinds.count("model") >= 4


def test_padding_free_sft_resumes_from_the_newest_checkpoint(tiny_model, tmp_path):
    recipe = REPO / "recipes" / "sft-tiny.toml"
    quick = [*SFT_QUICK, "training.steps=2", "checkpoint.interval=1", 'sft.packing="padding_free"']
    first = run_sft(load_sft_recipe(recipe, quick), tmp_path / "run", start=str(tiny_model))
    assert first.steps == 2 and (tmp_path / "run" / "checkpoints" / "step-0000002" / "trainer_state.json").is_file()
    # TRL's checkpoints carry no manifest: a finished run verifies all the same, and they need no export
    assert run_cli("inspect", tmp_path / "run", "--verify", "--samples", "0").returncode == 0
    export = run_cli("export", tmp_path / "run" / "checkpoints" / "step-0000002", tmp_path / "exported")
    assert export.returncode == 2 and "already a Hugging Face model folder" in export.stderr
    with pytest.raises(UserError, match=r"differs from the one the run started with in optimizer.lr"):
        run_sft(
            load_sft_recipe(recipe, [*quick, "optimizer.lr=0.5"]),
            tmp_path / "run",
            start=str(tiny_model),
            resume="auto",
        )
    longer = run_sft(
        load_sft_recipe(recipe, [*quick, "training.steps=3"]), tmp_path / "run", start=str(tiny_model), resume="auto"
    )
    assert longer.resumed_from.endswith("step-0000002") and longer.steps == 3
    shutil.rmtree(tmp_path / "run" / "final")  # as if stopped before its end
    unfinished = run_cli("inspect", tmp_path / "run", "--verify")
    assert unfinished.returncode == 2 and "is a post-training run without a final model yet" in unfinished.stderr
    with pytest.raises(UserError, match=r"training.steps: is 2, but the checkpoint to resume \(.*step-0000003\)"):
        run_sft(load_sft_recipe(recipe, quick), tmp_path / "run", start=str(tiny_model), resume="auto")
    steps = [
        r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert steps == [1, 2, 3]


def without_chat_template(model: Path, target: Path, template: str | None) -> Path:
    shutil.copytree(model, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_bad_inputs_fail_before_training(tiny_model, tmp_path):
    sft = load_sft_recipe(REPO / "recipes" / "sft-tiny.toml", SFT_QUICK)
    dpo = load_dpo_recipe(REPO / "recipes" / "dpo-tiny.toml", ["training.steps=1"])
    out = tmp_path / "out"
    with pytest.raises(
        UserError,
        match=r"has no columns 'chosen', 'rejected' \(columns: id, task, messages\) — pass a preference dataset: ",
    ):
        run_dpo(
            load_dpo_recipe(REPO / "recipes" / "dpo-tiny.toml", [f"data.path={SAMPLE / 'chat'}"]),
            out,
            start=str(tiny_model),
        )
    with pytest.raises(UserError, match="is a documents folder, not a model"):
        run_sft(sft, out, start=str(SAMPLE / "chat"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"is not a model folder \(no config.json\)"):
        run_dpo(dpo, out, start=str(tmp_path / "empty"))
    with pytest.raises(UserError, match="no starting checkpoint"):
        run_sft(sft, out)
    plain = without_chat_template(tiny_model, tmp_path / "plain", None)
    with pytest.raises(UserError, match="the tokenizer has no chat template, which chat data needs"):
        run_sft(sft, out, start=str(plain))
    # a plain prompt with the completion as assistant turns is chat data too
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "mixed").mkdir()
    rows = {"prompt": ["2+2?"], "completion": [[{"role": "assistant", "content": "4"}]], "task": ["math"]}
    pq.write_table(pa.table(rows), tmp_path / "mixed" / "part-0.parquet")
    mixed = load_sft_recipe(REPO / "recipes" / "sft-tiny.toml", [*SFT_QUICK, f"data.path={tmp_path / 'mixed'}"])
    with pytest.raises(UserError, match="the tokenizer has no chat template, which chat data needs"):
        run_sft(mixed, out, start=str(plain))
    unmarked = without_chat_template(
        tiny_model, tmp_path / "unmarked", "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(UserError, match=r"no \{% generation %\} markers.* set sft.assistant_only_loss = false"):
        run_sft(sft, out, start=str(unmarked))
    with pytest.raises(UserError, match=r"sft.packing: must be 'bfd', 'padding_free' or 'none'"):
        load_sft_recipe(REPO / "recipes" / "sft-tiny.toml", ['sft.packing="wrapped"'])
    with pytest.raises(UserError, match="did you mean 'beta'"):
        load_dpo_recipe(REPO / "recipes" / "dpo-tiny.toml", ["dpo.betta=0.2"])
    assert not (tmp_path / "out").exists()


def _edited_rows(tmp_path: Path, name: str, dataset: str, column: str, row: int, value) -> Path:
    """A copy of a sample dataset whose `column` at `row` holds `value` (the rest as they are)."""
    table = pq.read_table(sorted((SAMPLE / dataset).glob("part-*.parquet"))[0])
    values = table.column(column).to_pylist()
    values[row] = value
    folder = tmp_path / name
    folder.mkdir()
    field = table.schema.field(column)
    pq.write_table(
        table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type)),
        folder / "p.parquet",
    )
    return folder


@pytest.mark.parametrize(
    "stage, dataset, column, value, message",
    [
        ("sft", "chat", "messages", None, "column 'messages' is null"),
        ("sft", "chat", "messages", [], "column 'messages' holds no turns"),
        (
            "sft",
            "chat",
            "messages",
            [{"role": "user", "content": "hi"}],
            "column 'messages' has no assistant turn to learn from",
        ),
        (
            "sft",
            "chat",
            "messages",
            [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "a"}],
            "column 'messages' has a turn whose role is 'usr'",
        ),
        ("dpo", "preference", "rejected", None, "column 'rejected' is null"),
        ("dpo", "preference", "chosen", "", "column 'chosen' is empty"),
        ("grpo", "prompts", "prompt", None, "column 'prompt' is null"),
        ("ppo", "prompts", "prompt", "", "column 'prompt' is empty"),
    ],
)
def test_a_bad_row_is_named_before_the_run_begins(tiny_model, tmp_path, stage, dataset, column, value, message):
    """TRL failed on such rows deep in its data preparation: an internal error (KeyError, IndexError, a Jinja
    UndefinedError) after RUN held run.json, so the same command was then refused for a full RUN."""
    bad = _edited_rows(tmp_path, "bad", dataset, column, 3, value)
    result = run_cli(
        stage,
        REPO / "recipes" / f"{stage}-tiny.toml",
        tmp_path / "run",
        "--from",
        tiny_model,
        "--set",
        f"data.path={bad}",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert f"{bad / 'p.parquet'}: row 3 (from 0): {message}" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stage", ["pretrain", "midtrain", "sft", "dpo", "ppo", "grpo"])
def test_a_second_run_into_a_run_folder_in_use_is_refused_and_touches_nothing(tiny_model, tmp_path, stage):
    """`--overwrite` typed while the first run still trained deleted the folder under it, and a second
    `--resume auto` had both runs append metrics and write checkpoints into one folder."""
    import os

    from smolctl.folder_lock import held_alone

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    recipe = REPO / "recipes" / ("smollm3-tiny.toml" if stage in ("pretrain", "midtrain") else f"{stage}-tiny.toml")
    start = [] if stage == "pretrain" else ["--from", tiny_model]
    with held_alone(run, "trained", "wait"):  # the first run, still training
        before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
        for how in ("--overwrite", "--resume=auto"):
            result = run_cli(stage, recipe, run, *start, how)
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip().splitlines() == [result.stderr.strip()]
            assert f"{run}: is being trained by another smolctl run (pid {os.getpid()} on " in result.stderr
            assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / ".run.lock").exists(), "the lock file goes with its run"


@pytest.mark.slow
def test_sft_runs_under_torchrun_with_two_processes(tiny_model, tmp_path):
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port: another test file's torchrun may run beside it (make test: -n 2)
        "--nproc_per_node",
        "2",
        "-m",
        "smolctl",
        "sft",
        "recipes/sft-tiny.toml",
        str(tmp_path / "run"),
        "--from",
        str(tiny_model),
        "--json",
        *(f"--set={o}" for o in [*SFT_QUICK, "training.steps=2", "training.micro_batch=2"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["steps"] == 2  # rank 0 reports, once
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_prompt_completion_sft_and_chat_turn_dpo_with_precomputed_reference(tiny_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = pq.read_table(sorted((SAMPLE / "chat").glob("*.parquet"))[0]).to_pylist()[:24]
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": c["messages"][-2]["content"], "completion": c["messages"][-1]["content"]} for c in chats]
        ),
        tmp_path / "pairs.parquet",
    )
    sft = load_sft_recipe(
        REPO / "recipes" / "sft-tiny.toml",
        [*SFT_QUICK, "training.steps=1", f'data.path="{tmp_path / "pairs.parquet"}"'],
    )
    sft = sft.model_copy(update={"data": sft.data.model_copy(update={"balance_by": None})})
    result = run_sft(sft, tmp_path / "sft", start=str(tiny_model))
    assert result.data["format"] == "prompt+completion as chat turns" and result.steps == 1

    pairs = pq.read_table(sorted((SAMPLE / "preference").glob("*.parquet"))[0]).to_pylist()[:8]
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "prompt": [{"role": "user", "content": p["prompt"]}],
                    "chosen": [{"role": "assistant", "content": p["chosen"]}],
                    "rejected": [{"role": "assistant", "content": p["rejected"]}],
                }
                for p in pairs
            ]
        ),
        tmp_path / "turns.parquet",
    )
    dpo = load_dpo_recipe(
        REPO / "recipes" / "dpo-tiny.toml",
        [
            "training.steps=1",
            "dpo.loss_type=apo_zero",
            "dpo.beta=0.05",
            "dpo.precompute_ref_log_probs=true",
            "dpo.max_length=64",
            f'data.path="{tmp_path / "turns.parquet"}"',
        ],
    )
    result = run_dpo(dpo, tmp_path / "dpo", start=str(tmp_path / "sft"))
    assert result.steps == 1 and math.isfinite(result.metrics["loss"])


def test_a_run_folder_that_is_a_link_is_made_and_replaced_where_it_points(tmp_path):
    """`RUN -> /scratch/...`: --overwrite failed on rmtree of the link (an internal error), and a link to a folder
    not made yet on mkdir (File exists)."""
    from smolctl.train.run import RunStart, begin_run

    parent = tmp_path / "model"
    parent.mkdir()
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "scratch" / "run")
    begin_run(link, "sft", {"training": {"steps": 1}}, parent, RunStart())
    assert (tmp_path / "scratch" / "run" / "run.json").is_file() and link.is_symlink()
    (link / "stale.txt").write_text("from the run replaced")
    begin_run(link, "sft", {"training": {"steps": 2}}, parent, RunStart(overwrite=True))
    assert link.is_symlink() and sorted(p.name for p in link.iterdir()) == ["events.jsonl", "metrics.jsonl", "run.json"]
