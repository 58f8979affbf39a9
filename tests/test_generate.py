"""smolctl generate on tiny checkpoints: preference pairs that dpo trains on as they are, a killed run that resumes
without losing or repeating a prompt, and K completions ranked by the reward tables ppo uses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE, run_cli
from test_cli import _interrupted
from tiny_checkpoint import make_tiny_checkpoint

from smolctl.data.tokenizer import load_tokenizer
from smolctl.errors import UserError
from smolctl.shards import open_documents, read_manifest
from smolctl.train.generate import GenerateJob, Sampling, run_generate
from smolctl.train.rewards import load_reward_tables


@pytest.fixture(scope="module")
def models(tokenizer_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("generate")
    return make_tiny_checkpoint(tokenizer_dir, root / "strong", seed=0), make_tiny_checkpoint(
        tokenizer_dir, root / "weak", seed=1
    )


def sample_prompts(n: int) -> list[str]:
    return [row["prompt"] for row in pq.read_table(sorted((SAMPLE / "prompts").glob("*.parquet"))[0]).to_pylist()[:n]]


def rows(folder: Path) -> list[dict]:
    source = open_documents(folder)
    return [row for batch in source.iter_batches() for row in batch.to_pylist()]


def test_pairs_from_a_strong_and_a_weak_model_train_dpo_as_they_are(models, tmp_path):
    from smolctl.train.config import load_command_recipe
    from smolctl.train.posttrain import run_dpo

    strong, weak = models
    result = run_cli(
        "generate",
        SAMPLE / "prompts",
        tmp_path / "pairs",
        "--pairs",
        "--chosen",
        strong,
        "--rejected",
        weak,
        "--limit",
        "8",
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["mode"] == "pairs" and report["rows"] == 8 and report["completion_tokens"] > 0
    pairs = rows(tmp_path / "pairs")
    assert [r["prompt"] for r in pairs] == sample_prompts(8)
    assert all(r["chosen_model"] == str(strong) and r["rejected_model"] == str(weak) for r in pairs)
    assert any(r["chosen"] != r["rejected"] for r in pairs), "two different models answer differently"
    manifest = json.loads((tmp_path / "pairs" / "manifest.json").read_text())
    assert [ref["path"] for ref in manifest["inputs"]] == [
        str(SAMPLE / "prompts"),
        str(strong.resolve()),
        str(weak.resolve()),
    ]
    assert manifest["generate"]["sampling"]["max_new_tokens"] == 6

    recipe = load_command_recipe(
        "dpo",
        "recipes/dpo-tiny.toml",
        [f'data.path="{tmp_path / "pairs"}"', "training.steps=2", "training.micro_batch=4", "dpo.max_length=64"],
    )
    trained = run_dpo(recipe, tmp_path / "dpo", start=str(strong))
    assert trained.steps == 2 and trained.data["rows_used"] == 8


def test_a_killed_generate_resumes_without_losing_or_repeating_a_prompt(models, tmp_path):
    args = dict(limit=24, shard_prompts=2, batch_size=2, sampling=Sampling(num_completions=2, max_new_tokens=5))
    staging = tmp_path / ".out.partial"
    command = [
        sys.executable,
        "-m",
        "smolctl",
        "generate",
        str(SAMPLE / "prompts"),
        str(tmp_path / "out"),
        "--model",
        str(models[0]),
        "--limit",
        "24",
        "--shard-prompts",
        "2",
        "--batch-size",
        "2",
        "-k",
        "2",
        "--max-new-tokens",
        "5",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (staging / "part-00000.parquet").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)  # no handler runs: whatever was on disk stays as it was
    finally:
        process.wait(timeout=60)
    done = sorted(p.name for p in staging.glob("part-*"))
    assert not (tmp_path / "out").exists() and 1 <= len(done) < 12, done
    (staging / f".part-{len(done):05d}.parquet.tmp").write_bytes(b"half a shard")  # as a kill mid-write leaves

    resumed = run_generate(
        GenerateJob(prompts=str(SAMPLE / "prompts"), output=tmp_path / "out", models=[models[0]], **args)
    )
    assert resumed.resumed_shards == len(done) and resumed.shards == 12 and not staging.exists()
    written = rows(tmp_path / "out")
    assert [r["prompt"] for r in written] == [p for p in sample_prompts(24) for _ in range(2)]
    assert [r["completion_index"] for r in written] == [0, 1] * 24

    fresh = run_generate(
        GenerateJob(prompts=str(SAMPLE / "prompts"), output=tmp_path / "fresh", models=[models[0]], **args)
    )
    assert fresh.resumed_shards == 0
    assert written == rows(tmp_path / "fresh"), "a resumed run writes what an uninterrupted one does"
    # the manifest counts the tokens of every shard, the kept ones too (it counted this run's only)
    totals = [read_manifest(tmp_path / name)["stats"]["completion_tokens"] for name in ("out", "fresh")]
    assert (
        totals[0] == totals[1] == sum(r["completion_tokens"] for r in written) and resumed.completion_tokens < totals[0]
    )


def test_a_resume_keeps_no_shard_of_plain_prompts_changed_since(models, tmp_path):
    """Plain parquet prompts carry no manifest digest: their files' sizes and times stand for it, so shards of the
    prompts before an edit are not kept as completions of the new ones."""
    import pyarrow as pa

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    pq.write_table(pa.table({"prompt": sample_prompts(8)}), prompts / "p.parquet")
    job = dict(prompts=str(prompts), output=tmp_path / "out", models=[models[0]], shard_prompts=2, batch_size=2)
    job["sampling"] = Sampling(max_new_tokens=3)

    def stop_after_the_first(index: int) -> None:
        raise KeyboardInterrupt

    for _ in range(2):
        with pytest.raises(BaseException, match="finished shard"):
            run_generate(GenerateJob(**job), on_shard=stop_after_the_first)
        assert (tmp_path / ".out.partial" / "part-00000.parquet").is_file()
    # the same prompts: the first run's shard was kept by the second, which stopped after its own next one
    assert (tmp_path / ".out.partial" / "part-00001.parquet").is_file()
    pq.write_table(pa.table({"prompt": [f"new {p}" for p in sample_prompts(8)]}), prompts / "p.parquet")
    changed = run_generate(GenerateJob(**job))
    assert changed.resumed_shards == 0 and all(r["prompt"].startswith("new ") for r in rows(tmp_path / "out"))


def test_rank_by_keeps_the_best_and_worst_of_k_by_the_reward_tables(models, tmp_path, monkeypatch):
    (tmp_path / "rank_reward_module.py").write_text('def longest(row):\n    return len(row["completion"])\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "rewards.toml"
    recipe.write_text('[[rewards]]\nkind = "task"\nmatch = "callable"\nfunction = "rank_reward_module:longest"\n')
    reward, reference_column = load_reward_tables(recipe)
    sampling = Sampling(num_completions=4, max_new_tokens=8, seed=3)
    common = dict(prompts=str(SAMPLE / "prompts"), models=[models[0]], limit=6, sampling=sampling)
    ranked = run_generate(
        GenerateJob(
            output=tmp_path / "ranked",
            mode="ranked",
            reward=reward,
            reward_recipe=str(recipe),
            reference_column=reference_column,
            **common,
        )
    )
    every = run_generate(GenerateJob(output=tmp_path / "all", **common))  # the same K samples, unranked
    groups: dict[str, list[str]] = {}
    for row in rows(tmp_path / "all"):
        groups.setdefault(row["prompt"], []).append(row["completion"])
    kept = rows(tmp_path / "ranked")
    assert len(kept) + ranked.dropped_tied == 6 and kept
    for row in kept:
        lengths = [len(c) for c in groups[row["prompt"]]]
        assert row["chosen_reward"] == max(lengths) == len(row["chosen"])
        assert row["rejected_reward"] == min(lengths) == len(row["rejected"])
    assert every.rows == 24
    # a reward that ties every completion leaves no pair: refused, with nothing written
    (tmp_path / "rank_reward_module.py").write_text("def longest(row):\n    return 1.0\n")
    sys.modules.pop("rank_reward_module", None)
    reward, reference_column = load_reward_tables(recipe)
    job = GenerateJob(output=tmp_path / "tied", mode="ranked", reward=reward, reward_recipe=str(recipe), **common)
    with pytest.raises(UserError, match="--rank-by: the completions of every one of the 6 prompts tied"):
        run_generate(job)
    assert not (tmp_path / "tied").exists() and not (tmp_path / ".tied.partial").exists()
    sys.modules.pop("rank_reward_module", None)


def test_a_missing_prompt_column_names_the_option_that_chooses_it(models, tmp_path):
    """The error pointed at --text-column, which generate does not have."""
    result = run_cli("generate", SAMPLE / "chat", tmp_path / "out", "--model", models[0], "--max-new-tokens", "4")
    assert result.returncode == 2 and "has no column 'prompt'" in result.stderr
    assert result.stderr.strip().endswith("pass one of them with --prompt-column"), result.stderr


def test_a_model_without_eos_or_pad_generates_to_the_length_limit(models, tmp_path):
    """Third-party tokenizers often name no EOS (or pad): the stop ids were [None], an internal error."""
    import shutil

    model = tmp_path / "no-eos"
    shutil.copytree(models[0], model)
    (model / "manifest.json").unlink()  # edited by hand, as a downloaded model would be: no smolctl manifest
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config.update(eos_token_id=None, pad_token_id=None)
        (model / name).write_text(json.dumps(config))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token"):
        tokenizer_config.pop(key, None)
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    result = run_cli(
        "generate", SAMPLE / "prompts", tmp_path / "out", "--model", model, "--limit", "2", "--max-new-tokens", "3"
    )
    assert result.returncode == 0, result.stderr
    assert [row["completion_tokens"] for row in rows(tmp_path / "out")] == [3, 3]
    # a base model without a chat template is given the text as it is, and the result says so
    for template in model.glob("chat_template*"):
        template.unlink()
    tokenizer_config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    result = run_cli("generate", SAMPLE / "prompts", tmp_path / "raw", "--model", model, "--limit", "1", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["without_chat_template"] == [str(model)]


def test_a_model_that_does_not_load_leaves_no_staging_and_ctrl_c_says_how_to_continue(models, tmp_path):
    """A failed model load left .OUT.partial holding only the settings file; Ctrl-C said nothing half-written was
    left and to run again, while the finished shards wait in .OUT.partial for exactly that run."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(models[0], broken)
    (broken / "model.safetensors").unlink()
    (broken / "manifest.json").unlink()
    failed = run_cli("generate", SAMPLE / "prompts", tmp_path / "out", "--model", broken, "--limit", "2")
    assert failed.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["broken"], failed.stderr

    def interrupted_at(call: int) -> subprocess.CompletedProcess:
        script = f"""
import os, signal, sys
import smolctl.train.generate as generate
real, calls = generate.shard_rows, []
def interrupted(*args, **kwargs):
    calls.append(1)
    if len(calls) == {call}:
        os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
generate.shard_rows = interrupted
sys.argv = ["smolctl", "generate", {str(SAMPLE / "prompts")!r}, {str(tmp_path / "out")!r}, "--model",
            {str(models[0])!r}, "--limit", "4", "--shard-prompts", "2", "--max-new-tokens", "2"]
from smolctl.__main__ import main
main()
"""
        return _interrupted(script)

    first = interrupted_at(1)  # in the first shard: nothing to continue from, and nothing left behind
    assert first.returncode == 130 and first.stderr.strip().splitlines()[-1].endswith("run the command again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]
    second = interrupted_at(2)
    assert second.returncode == 130, second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"interrupted: {tmp_path / 'out'}: 1 finished shard(s) kept in .out.partial — run the same command again "
        "to continue from them"
    )


def test_prompts_past_the_model_s_positions_are_counted(models):
    """Sampled past max_position_embeddings, a model writes what it was never trained on: the summary says so."""
    from smolctl.train.generate import prompts_past_context, render

    model = models[0]
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    tokenizer = load_tokenizer(model)
    long = "hello " * limit
    short = "what is 2+2?"
    assert len(render(tokenizer, long)) > limit - 8 and len(render(tokenizer, short)) < limit - 8
    assert prompts_past_context(model, [short, long, short, long], max_new_tokens=8) == 2
    assert prompts_past_context(model, [short], max_new_tokens=8) == 0
