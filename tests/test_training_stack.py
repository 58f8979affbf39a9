"""One training stack: the six training commands share the recipe schema, the run layout, the options and the
resume rules; LoRA for post-training; SFT's assistant mask through TRL's template patching; DPO learns visibly.

Every command runs in-process through the real CLI (typer's runner), a few steps of a tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE
from test_posttrain import tiny_model  # noqa: F401  (fixture)
from test_pretrain import packed, recipe  # noqa: F401  (fixtures)
from typer.testing import CliRunner

from smolctl.cli import app

QUICK = {
    "pretrain": ["training.global_batch=2"],
    "midtrain": ["training.global_batch=2"],
    "sft": ["training.micro_batch=2", "sft.max_length=64"],
    "dpo": ["training.micro_batch=2", "dpo.max_length=64", "data.limit=16"],
    "ppo": [
        "training.micro_batch=4",
        "ppo.batch_size=4",
        "ppo.minibatch_size=4",
        "ppo.epochs=1",
        "ppo.max_new_tokens=4",
    ],
    "grpo": ["training.micro_batch=4", "training.global_batch=4", "grpo.num_generations=2", "grpo.max_new_tokens=4"],
}
TINY_RECIPES = {
    "sft": "recipes/sft-tiny.toml",
    "dpo": "recipes/dpo-tiny.toml",
    "ppo": "recipes/ppo-tiny.toml",
    "grpo": "recipes/grpo-tiny.toml",
}


def smolctl(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def pretrain_run(recipe, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("stack") / "pretrain"
    code, _, err = smolctl("pretrain", recipe, run, "--set", "training.steps=2", "--set", "training.global_batch=2")
    assert code == 0, err
    return run


def command_line(command: str, recipe: Path, start: Path, run: Path, *extra: str) -> list:
    recipe_path = recipe if command in ("pretrain", "midtrain") else REPO / TINY_RECIPES[command]
    sets = [*QUICK[command], "checkpoint.interval=1", "checkpoint.keep=2", "logging.interval=1", *extra]
    start_from = [] if command == "pretrain" else ["--from", start]
    return [command, recipe_path, run, *start_from, "--json", *(f"--set={s}" for s in sets)]


@pytest.mark.parametrize("command", ["pretrain", "midtrain", "sft", "dpo", "ppo", "grpo"])
def test_every_training_command_has_the_same_run_layout_and_resume(command, recipe, tiny_model, pretrain_run, tmp_path):
    from transformers import AutoModelForCausalLM

    start = pretrain_run if command == "midtrain" else tiny_model  # midtrain: --from a run folder
    run = tmp_path / "run"
    code, out, err = smolctl(*command_line(command, recipe, start, run, "training.steps=2"))
    assert code == 0, err
    result = json.loads(out)
    assert result["run"] == str(run) and result["final"] == str(run / "final") and result["steps"] == 2
    assert {p.name for p in run.iterdir()} >= {"run.json", "metrics.jsonl", "events.jsonl", "checkpoints", "final"}
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000001", "step-0000002"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "lr" in r] == [1, 2]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(metrics[-1]), metrics[-1]
    assert AutoModelForCausalLM.from_pretrained(run / "final").num_parameters() > 0

    code, out, err = smolctl(*command_line(command, recipe, start, run, "training.steps=3"), "--resume", "auto")
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["steps"] == 3 and resumed["resumed_from"].endswith("step-0000002")
    # run.json holds the recipe now in force, and the resume event what the resume changed
    assert json.loads((run / "run.json").read_text())["recipe"]["training"]["steps"] == 3
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    [resume] = [e for e in events if e["event"] == "resume"]
    assert resume["step"] == 2 and resume["changed"]["training.steps"] == [2, 3], resume
    if command in ("pretrain", "midtrain"):
        return  # their finished-run resume is the pretrain loop's (issue 14)
    before = {p.name: p.read_bytes() for p in (run / "final").iterdir()}
    code, out, err = smolctl(*command_line(command, recipe, start, run, "training.steps=3"), "--resume", "auto")
    finished = json.loads(out)
    assert code == 0 and finished["nothing_to_do"], err
    assert {p.name: p.read_bytes() for p in (run / "final").iterdir()} == before
    # the same shape as the run that trained: the data facts apart from the metrics
    assert finished["data"] == resumed["data"] and finished["metrics"] == resumed["metrics"], (finished, resumed)


@pytest.mark.parametrize("command", ["pretrain", "sft"])
def test_a_rewind_removes_what_the_abandoned_later_steps_left(command, recipe, tiny_model, tmp_path):
    """--resume RUN/checkpoints/step-1 abandons steps 2 and 3: left in place, the next --resume auto took the old
    step 3 and continued the abandoned run (or called it finished). pretrain and post-training resume apart."""
    run = tmp_path / "run"
    keep = ["checkpoint.keep=5"]
    code, _, err = smolctl(*command_line(command, recipe, tiny_model, run, "training.steps=3", *keep))
    assert code == 0, err
    rewind = ["--resume", run / "checkpoints" / "step-0000001"]
    code, _, err = smolctl(*command_line(command, recipe, tiny_model, run, "training.steps=2", *keep), *rewind)
    assert code == 0, err
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    [rewound] = [e for e in events if e["event"] == "resume"]
    assert [Path(p).relative_to(run).as_posix() for p in rewound["discarded"]] == [
        "checkpoints/step-0000002",
        "checkpoints/step-0000003",
        "final",
    ]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-0000001", "step-0000002"]
    code, out, err = smolctl(
        *command_line(command, recipe, tiny_model, run, "training.steps=3", *keep), "--resume", "auto"
    )
    assert code == 0, err
    assert json.loads(out)["resumed_from"].endswith("step-0000002")


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_lora_trains_adapters_and_final_holds_them_merged(command, tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    # GRPO learns only from rewards that differ within a group: the toy reward of test_ppo (share of real words).
    varied = ['rewards.0.match="callable"', 'rewards.0.function="test_ppo:spaced_words"', "grpo.max_new_tokens=6"]
    args = command_line(
        command,
        Path(),
        tiny_model,
        run,
        "training.steps=2",
        "checkpoint.interval=0",
        "peft.r=4",
        "optimizer.lr=0.05",
        *(varied if command == "grpo" else []),
    )
    code, out, err = smolctl(*[a for a in args if a != "--json"])
    assert code == 0, err
    summary = out + err  # the summary shows the LoRA share
    assert "trainable of" in summary and "(100.00%)" not in summary, summary
    assert (run / "adapter" / "adapter_config.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert trained.keys() == base.keys()  # merged: a plain model, no lora_ weights
    assert any(not torch.equal(trained[k], base[k]) for k in base)


def test_sft_assistant_mask_covers_exactly_the_assistant_turns_of_a_patched_template(tiny_model, tmp_path):
    """A Qwen 2.5 template has no {% generation %} markers; TRL patches it, and the loss mask must cover each
    assistant reply and its end-of-turn token, nothing of the system or user turns."""
    from trl.chat_template_utils import has_generation_markers, qwen2_5_chat_template

    from smolctl.data.tokenizer import load_tokenizer
    from smolctl.shards import open_documents
    from smolctl.train.config import load_command_recipe
    from smolctl.train.posttrain import load_sft_dataset, sft_columns, sft_trainer

    model = tmp_path / "qwen-template"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(qwen2_5_chat_template)
    assert not has_generation_markers(qwen2_5_chat_template)
    recipe = load_command_recipe(
        "sft",
        REPO / "recipes/sft-tiny.toml",
        ['sft.packing="none"', "sft.max_length=512", "data.limit=4", "training.steps=1"],
    )
    source = open_documents(SAMPLE / "chat")
    prepared = load_sft_dataset(source, recipe.data, 0, load_tokenizer(model))
    trainer, _, _, _ = sft_trainer(recipe, tmp_path / "run", model, prepared, sft_columns(source))
    tokenizer = trainer.processing_class
    row = trainer.train_dataset[0]
    text = tokenizer.decode(row["input_ids"])
    expected, position = [], 0
    for token in row["input_ids"]:
        piece = tokenizer.decode([token])
        expected.append((position, position + len(piece)))
        position += len(piece)
    # Each reply: after the role header, through <|im_end|> and the newline that closes the turn (the template's
    # own whitespace around the reply is generated by the model, so it is trained too); nothing else.
    replies = []
    start = text.find("<|im_start|>assistant")
    while start >= 0:
        begin = start + len("<|im_start|>assistant")
        end = text.index("<|im_end|>", begin) + len("<|im_end|>\n")
        replies.append((begin, end))
        start = text.find("<|im_start|>assistant", end)
    assert replies, text
    inside = [int(any(b <= lo and hi <= e for b, e in replies)) for lo, hi in expected]
    assert [int(label != -100) for label in row["labels"]] == inside


def test_dpo_preference_accuracy_and_margins_rise(tiny_model, tmp_path):
    code, _, err = smolctl(
        "dpo",
        REPO / "recipes/dpo-tiny.toml",
        tmp_path / "run",
        "--from",
        tiny_model,
        "--json",
        "--set",
        "training.steps=8",
        "--set",
        "data.limit=16",
        "--set",
        "dpo.max_length=64",
        "--set",
        "checkpoint.interval=0",
    )
    assert code == 0, err
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["rewards/accuracies"] for r in logged]
    margins = [r["rewards/margins"] for r in logged]
    first, last = slice(0, 3), slice(-3, None)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(accuracy[last]) > mean(accuracy[first]) + 0.25, accuracy
    assert mean(margins[last]) > mean(margins[first]) + 0.1 and mean(margins[last]) > 0, margins


@pytest.mark.slow
def test_two_process_post_training_saves_final_collectively_and_refuses_once(tiny_model, tmp_path):
    """Under torchrun every rank takes part in the final save (a sharded model is gathered before rank 0 writes):
    final/ holds the trained weights, equal to the Trainer's own last checkpoint. PPO, data-parallel without
    sharding, refuses training.shard once, not once per rank."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    def torchrun(*args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                "-m",
                "smolctl",
                *map(str, args),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )

    done = torchrun(*command_line("sft", Path(), tiny_model, tmp_path / "run", "training.steps=2"))
    assert done.returncode == 0, done.stderr[-2000:]
    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    last = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000002" / "model.safetensors"))
    base = load_file(str(tiny_model / "model.safetensors"))
    assert final.keys() == last.keys() == base.keys()
    assert all(final[k].equal(last[k]) for k in final) and not all(final[k].equal(base[k]) for k in final)

    refused = torchrun(
        *command_line("ppo", Path(), tiny_model, tmp_path / "ppo", "training.steps=1", "training.shard=true")
    )
    assert refused.returncode != 0  # torchrun reports the failed rank
    assert refused.stderr.count("ppo runs data-parallel (DDP) without FSDP sharding") == 1, refused.stderr[-2000:]


def test_a_damaged_run_json_is_replaced_by_overwrite_and_named_by_a_resume(tmp_path):
    """begin_run read run.json on every start: --overwrite of a run whose run.json was damaged crashed with a
    JSONDecodeError instead of starting over; a resume, which checks against it, names it."""
    from smolctl.errors import UserError
    from smolctl.train.run import RunStart, begin_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{bad")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    begin_run(run, "sft", {"training": {"steps": 2}}, tmp_path, RunStart(overwrite=True))
    assert json.loads((run / "run.json").read_text())["recipe"] == {"training": {"steps": 2}}
    (run / "run.json").write_text("[]")
    with pytest.raises(UserError, match=r"run\.json: is not a JSON object — restore it, or start the run over"):
        begin_run(run, "sft", {}, tmp_path, RunStart(resume_from=tmp_path / "step-1"))
