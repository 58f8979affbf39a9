"""`smolctl pretrain` against its previous loop (another git ref's smolctl, main by default) and a Hugging Face
`Trainer` run of the same model, data, batch and optimizer on CPU.

    .venv/bin/python benchmarks/train_bench.py                 # ~6 minutes on 2 idle cores
    .venv/bin/python benchmarks/train_bench.py --steps 30 --hidden 384 --baseline main

Each variant runs in its own fresh process (two runs in one process skew each other by ~20%): smolctl, smolctl
with training.compile = true, the baseline ref's smolctl (its package exported with `git archive`), and
transformers' Trainer. Throughput is measured the same way for all three, as
the wall time between consecutive optimizer-step ends after the warmup steps; peak memory is the process's max
RSS. smolctl's overhead is the share of step wall time outside forward, backward and the optimizer step (data
loading, labels, guards, logging included).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = """
[model]
architecture = "smollm3"
hidden_size = {hidden}
intermediate_size = {ffn}
num_hidden_layers = {layers}
num_attention_heads = 4
num_key_value_heads = 2
[data]
paths = ["{packed}"]
[optimizer]
lr = 1e-3
betas = [0.9, 0.95]
weight_decay = 0.1
grad_clip = 1.0
[schedule]
kind = "constant"
[training]
steps = {steps}
seq_len = {seq_len}
micro_batch = {micro_batch}
global_batch = {global_batch}
seed = 0
compile = {compile}
[checkpoint]
interval = 0
[logging]
interval = 1
"""


def prepare(work: Path, args) -> Path:
    """A tokenizer and a packed folder of the sample web corpus, and the recipe that points at it."""
    from smolctl.data.pack import PackConfig, pack
    from smolctl.data.tokenizer import train_tokenizer

    train_tokenizer(str(REPO / "data/sample/web"), str(work / "tok"), vocab_size=args.vocab)
    pack(
        str(REPO / "data/sample/web"),
        work / "packed",
        tokenizer_spec=str(work / "tok"),
        config=PackConfig(seq_len=args.seq_len),
    )
    for compile_flag in ("false", "true"):
        (work / f"recipe-{compile_flag}.toml").write_text(
            RECIPE.format(
                hidden=args.hidden,
                ffn=4 * args.hidden,
                layers=args.layers,
                packed=work / "packed",
                steps=args.steps,
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
                global_batch=args.global_batch,
                compile=compile_flag,
            )
        )
    return work


def steady_rate(step_end_times: list[float], tokens_per_step: int, warmup: int) -> float:
    spans = [b - a for a, b in zip(step_end_times[warmup:], step_end_times[warmup + 1 :])]
    return tokens_per_step * len(spans) / sum(spans)


def worker_smolctl(work: Path, compile_flag: str, args) -> dict:
    from smolctl.train.pretrain import train

    run = work / f"run-smolctl-{compile_flag}"
    result = train(work / f"recipe-{compile_flag}.toml", run, overwrite=True, show=False)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = lines[args.warmup :]
    data = sum(line["data_wait"] * line["step_s"] for line in steady)
    step_s = sum(line["step_s"] for line in steady)
    wall = steady[-1]["time"] - lines[args.warmup - 1]["time"]
    # step_s covers data + forward/backward/optimizer; the rest of the wall time is the loop's own overhead
    return {
        "tokens_per_s": steady_rate([line["time"] for line in lines], result.plan["tokens_per_step"], args.warmup),
        "overhead": (wall - step_s + data) / wall,
        "data_share": data / wall,
        "final_loss": result.final_loss,
    }


def worker_trainer(work: Path, args) -> dict:
    """The same model (same init), rows, batch (micro × accumulation), AdamW and clipping, through HF Trainer."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from smolctl.data.tokenizer import load_tokenizer
    from smolctl.shards import open_packed
    from smolctl.train.loader import IGNORE_INDEX, fill_padding_positions
    from smolctl.train.model import build_config, build_model
    from smolctl.train.pretrain import load_train_recipe

    recipe = load_train_recipe(work / "recipe-false.toml")
    tokenizer = load_tokenizer(work / "tok")
    config = build_config(
        recipe.model,
        vocab_size=len(tokenizer),
        seq_len=args.seq_len,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    model = build_model(config, seed=0)
    shard = open_packed(work / "packed").load_shard(0)
    ids, positions = shard["input_ids"].astype(np.int64), shard["position_ids"].astype(np.int64)
    labels = np.where((positions == 0) | (positions < 0), IGNORE_INDEX, ids)  # HF shifts labels inside the model
    rows = [
        {
            "input_ids": torch.from_numpy(ids[i]),
            "position_ids": torch.from_numpy(fill_padding_positions(positions[i : i + 1])[0]),
            "labels": torch.from_numpy(labels[i]),
        }
        for i in range(len(ids))
    ]
    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

    training_args = TrainingArguments(
        output_dir=str(work / "run-trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // args.micro_batch,
        learning_rate=1e-3,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=rows, callbacks=[Clock()])
    trainer.train()
    return {"tokens_per_s": steady_rate(step_ends, args.global_batch * args.seq_len, args.warmup)}


def export_baseline(ref: str, work: Path) -> Path:
    """The smolctl package of git `ref`, unpacked under `work`: the baseline worker imports it first."""
    import io
    import tarfile

    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "smolctl"], capture_output=True, check=True
    ).stdout
    root = work / f"baseline-{ref.replace('/', '-')}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return root


def run_worker(variant: str, work: Path, args, pythonpath: Path | None = None) -> dict:
    """One variant in a fresh interpreter; returns its JSON line plus the child's peak RSS."""
    import os

    command = [sys.executable, __file__, "--worker", variant, "--work", str(work), *sys.argv[1:]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath or REPO), os.environ.get("PYTHONPATH")])),
    }
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the rate (compilation, caches).")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--baseline", default="main", help="Git ref whose smolctl is the previous loop.")
    parser.add_argument(
        "--variants",
        default="trainer,smolctl,smolctl-compile,baseline",
        help="Comma-separated subset to run (the first one is the reference column).",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work = Path(args.work)
        if args.worker == "trainer":
            result = worker_trainer(work, args)
        else:
            result = worker_smolctl(work, "true" if args.worker == "smolctl-compile" else "false", args)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result))
        return

    from smolctl.console import human_bytes, show, table

    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        work = prepare(Path(tmp), args)
        results = {}
        for variant in args.variants.split(","):
            if variant == "baseline":
                results[f"smolctl@{args.baseline}"] = run_worker(
                    "smolctl", work, args, export_baseline(args.baseline, work)
                )
            else:
                results[variant] = run_worker(variant, work, args)
    reference = next(iter(results))
    base = results[reference]["tokens_per_s"]
    rows = [
        (
            name,
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base:.3f}×",
            human_bytes(r["peak_rss_bytes"]),
            f"{r['overhead']:.2%}" if "overhead" in r else "-",
            f"{r['seconds']:.0f}s",
        )
        for name, r in results.items()
    ]
    show(
        table(
            f"pretrain on CPU: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq_len}, "
            f"batch {args.global_batch} (micro {args.micro_batch}), {args.steps} steps ({args.warmup} warmup)",
            ["variant", "tokens/s", f"vs {reference}", "peak RSS", "loop overhead", "wall"],
            rows,
        )
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
