"""The whole pipeline on the sample corpus through the real CLI, as scripts/demo.sh runs it but with a few steps
per training stage: train-tokenizer → dedup --minhash → mix (staged recipe) → pack → pretrain → midtrain → sft →
dpo → ppo, each stage reading the previous stage's output folder. Then the lineage: every manifest names the
manifests it came from (path and sha256 of the manifest file), `smolctl inspect --lineage --json` walks from the
final model back to data/sample, and the final model loads with transformers and generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE, run_cli

from smolctl.shards import read_manifest, sha256_file, verify_checksums

SOURCES = ("web", "code", "math")
# A few steps each: the test is about the hand-over between stages, the stages' own tests cover their training.
PRETRAIN = [
    "training.steps=3",
    "training.micro_batch=4",
    "training.global_batch=4",
    "schedule.warmup_steps=1",
    "checkpoint.interval=100",
    "logging.interval=1",
]
MIDTRAIN = [
    "training.steps=2",
    "training.micro_batch=2",
    "training.global_batch=2",
    "schedule.warmup_steps=0",
    "checkpoint.interval=100",
    "logging.interval=1",
]
SFT = ["training.steps=2", "schedule.warmup_steps=0", "checkpoint.interval=100", "sft.max_length=128"]
DPO = ["training.steps=2", "checkpoint.interval=100", "dpo.max_length=64", "data.limit=8"]
PPO = [
    "training.steps=1",
    "ppo.batch_size=8",
    "ppo.minibatch_size=8",
    "training.micro_batch=8",
    "ppo.epochs=1",
    "checkpoint.interval=100",
    "ppo.max_new_tokens=4",
]


def sets(overrides: list[str]) -> list[str]:
    return [f"--set={o}" for o in overrides]


def stage(*args: object) -> dict:
    done = run_cli(*args, "--json", env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"smolctl {args[0]} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pipeline")
    folders = {
        "tokenizer": out / "tokenizer",
        "mix": out / "mix",
        "packed": out / "packed",
        "packed-long": out / "packed-long",
        "pretrain": out / "pretrain" / "final",
        "midtrain": out / "midtrain" / "final",
        "sft": out / "sft" / "final",
        "dpo": out / "dpo" / "final",
        "ppo": out / "ppo" / "final",
        **{f"dedup/{s}": out / "dedup" / s for s in SOURCES},
    }
    stage("train-tokenizer", SAMPLE / "web", folders["tokenizer"], "--vocab-size", "2048")
    for source in SOURCES:
        stage("dedup", SAMPLE / source, folders[f"dedup/{source}"], "--minhash", "--workers", "1")
    stage(
        "mix",
        folders["mix"],
        "--recipe",
        "recipes/demo-mix.toml",
        "--tokenizer",
        folders["tokenizer"],
        *sets([f"sources.{s}.path={folders[f'dedup/{s}']}" for s in SOURCES]),
    )
    stage(
        "pack", folders["mix"] / "stage-1", folders["packed"], "--tokenizer", folders["tokenizer"], "--seq-len", "256"
    )
    stage(
        "pack",
        folders["mix"] / "stage-3",
        folders["packed-long"],
        "--tokenizer",
        folders["tokenizer"],
        "--seq-len",
        "512",
    )
    stage("pretrain", "recipes/smollm3-tiny.toml", out / "pretrain", "--data", folders["packed"], *sets(PRETRAIN))
    stage(
        "midtrain",
        "recipes/smollm3-tiny-midtrain.toml",
        out / "midtrain",
        "--from",
        folders["pretrain"],
        "--data",
        folders["packed-long"],
        *sets(MIDTRAIN),
    )
    # The post-training stages take a run folder as --from (its final/), as the demo does.
    stage("sft", "recipes/sft-tiny.toml", out / "sft", "--from", out / "midtrain", *sets(SFT))
    stage("dpo", "recipes/dpo-tiny.toml", out / "dpo", "--from", out / "sft", *sets(DPO))
    stage("ppo", "recipes/ppo-tiny.toml", out / "ppo", "--from", out / "dpo", *sets(PPO))
    return folders


# (output, the inputs its manifest must name: folders of this pipeline or sample corpus folders)
EDGES = [
    ("tokenizer", [SAMPLE / "web"]),
    *[(f"dedup/{s}", [SAMPLE / s]) for s in SOURCES],
    ("mix", [f"dedup/{s}" for s in SOURCES]),
    ("packed", ["mix/stage-1", "tokenizer"]),
    ("packed-long", ["mix/stage-3", "tokenizer"]),
    ("pretrain", ["packed"]),
    ("midtrain", ["packed-long", "pretrain"]),
    ("sft", [SAMPLE / "chat", "midtrain"]),
    ("dpo", [SAMPLE / "preference", "sft"]),
    ("ppo", [SAMPLE / "prompts", "dpo"]),
]


def resolve(folders: dict[str, Path], name: str | Path) -> Path:
    if isinstance(name, Path):
        return name.resolve()
    head, _, tail = name.partition("/")
    return (folders[name] if name in folders else folders[head] / tail).resolve()


@pytest.mark.slow
@pytest.mark.parametrize("output, parents", EDGES, ids=[e[0] for e in EDGES])
def test_each_manifest_names_the_manifest_it_came_from(pipeline, output, parents):
    folder = resolve(pipeline, output)
    manifest = read_manifest(folder)
    assert manifest is not None and verify_checksums(folder) == []
    named = {ref["path"]: ref["manifest_sha256"] for ref in manifest["inputs"]}
    for parent in (resolve(pipeline, p) for p in parents):
        assert str(parent) in named, f"{output} does not name {parent}: {sorted(named)}"
        assert named[str(parent)] == sha256_file(parent / "manifest.json"), f"{output}: stale sha256 for {parent}"
    if manifest["kind"] == "model":
        models = [str(resolve(pipeline, p)) for p in parents if p in ("pretrain", "midtrain", "sft", "dpo")]
        assert manifest["parent"] == (models[0] if models else None)


@pytest.mark.slow
def test_inspect_lineage_walks_from_the_final_model_to_the_raw_corpus(pipeline):
    done = run_cli("inspect", pipeline["ppo"], "--lineage", "--json", "--samples", "0")
    assert done.returncode == 0, done.stderr
    chain = json.loads(done.stdout)["lineage"]
    paths = [entry["path"] for entry in chain]
    assert paths[0] == str(pipeline["ppo"].resolve())
    for name in (
        "dpo",
        "sft",
        "midtrain",
        "pretrain",
        "packed",
        "packed-long",
        "mix/stage-1",
        "mix/stage-3",
        "tokenizer",
        *(f"dedup/{s}" for s in SOURCES),
    ):
        assert str(resolve(pipeline, name)) in paths, f"{name} missing from the lineage"
    for raw in ("web", "code", "math", "chat", "preference", "prompts"):
        assert str((SAMPLE / raw).resolve()) in paths, f"data/sample/{raw} missing from the lineage"
    assert all(entry["status"] == "ok" for entry in chain), [e for e in chain if e["status"] != "ok"]
    depth = {entry["path"]: entry["depth"] for entry in chain}
    # the chain is ordered by descent: ppo → dpo → sft → midtrain → pretrain → packed → mix → dedup → sample
    walk = ["ppo", "dpo", "sft", "midtrain", "pretrain", "packed", "mix/stage-1", "dedup/web"]
    assert [depth[str(resolve(pipeline, n))] for n in walk] == list(range(len(walk)))
    human = run_cli("inspect", pipeline["ppo"], "--lineage", "--samples", "0")
    assert human.returncode == 0 and "data/sample/web" in human.stdout + human.stderr


@pytest.mark.slow
def test_final_model_loads_with_transformers_and_generates(pipeline):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(pipeline["ppo"]))
    tokenizer = AutoTokenizer.from_pretrained(str(pipeline["ppo"]))
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which module joins paths?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert output.shape[1] > inputs["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :]), str)
    assert model.config.max_position_embeddings == 512  # the long-context midtraining carried through post-training


@pytest.mark.slow
def test_the_demo_closes_with_a_table_of_every_stage_and_a_sample(pipeline):
    """scripts/demo_summary.py, which `make demo` ends with: one row per stage from OUT/stages.tsv, read from the
    outputs' manifests, then a completion of the final model."""
    out = pipeline["tokenizer"].parent
    stages = ["tokenizer", "dedup/web", "mix", "packed", "pretrain", "ppo"]
    (out / "stages.tsv").write_text("".join(f"{name}\t{pipeline[name]}\t1.5\n" for name in stages))
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_summary.py"), str(out), str(pipeline["ppo"])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 2}
    assert set(stages) | {"total"} <= set(rows), done.stdout
    assert "vocab size 2048" in rows["tokenizer"], rows["tokenizer"]  # read from the tokenizer's manifest
    assert "9.0s" in rows["total"], rows["total"]  # six stages of 1.5 s
    assert "sample from" in done.stderr and "assistant:" in done.stderr, done.stderr
