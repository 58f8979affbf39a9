"""How long a checkpoint holds the training loop: `dcp.async_save` against `dcp.save`, for a ~300M-parameter SmolLM3
with its AdamW state, on CPU, through smolctl's own CheckpointManager and in the loop's order: save, the next
step's forward and backward (the async save copies the state meanwhile), wait for that copy, optimizer step. The
async save holds the loop for its call plus the wait before the optimizer step; the step's slowdown against a step
without a save (the copy contending with the compute for cores and memory bandwidth) is reported beside it. Sync
and async saves alternate, round by round. Then the SmolLM3 recipe's
checkpoint seconds per 1,000 steps as `smolctl estimate` sees it.

    PYTHONPATH=. python benchmarks/checkpoint_bench.py [--layers 16] [--repeats 3] [--tokens 256] [--dir /tmp/ckpt-bench]

Needs about 5× the model's fp32 size in memory (weights, gradients, two AdamW moments, the staging copy): ~6 GB
at 300M.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(layers: int):
    import torch

    from smolctl.train.config import ModelSection
    from smolctl.train.model import build_config, build_model

    section = ModelSection(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    model = build_model(build_config(section, vocab_size=49_152, seq_len=2048, eos_id=0, pad_id=1), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # allocates both AdamW moments, as in a real run
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def train_step(model, optimizer, manager, tokens: int) -> tuple[float, float]:
    """One step in the loop's order (forward, backward, wait for a staging copy, update); returns its seconds and
    those spent waiting for the copy."""
    import torch

    started = time.perf_counter()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    model(input_ids=ids, labels=ids).loss.backward()
    waited = manager.wait_for_staging() if manager is not None else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started, waited


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per training step (one sequence)")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()

    from smolctl.train.checkpoint import CheckpointManager
    from smolctl.train.distributed import Dist

    model, optimizer = build(args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    results: dict[str, list[float]] = {
        "sync_blocking_s": [],
        "async_blocking_s": [],
        "async_save_call_s": [],
        "async_staging_wait_s": [],
        "async_step_slowdown_s": [],
        "async_total_s": [],
        "step_s": [],
    }
    managers = {
        mode: CheckpointManager(
            root / mode,
            model=model,
            optimizer=optimizer,
            dist=Dist(),
            keep=1,
            async_save=mode == "async",
            export_interval=0,
            write_model_files=lambda folder: None,
            inputs=list,
        )
        for mode in ("sync", "async")
    }
    first_async: dict[str, float] = {}
    try:
        train_step(model, optimizer, None, args.tokens)  # warm-up
        for repeat in range(args.repeats + 1):  # round 0 allocates the async buffers: reported on its own
            results["step_s"].append(train_step(model, optimizer, None, args.tokens)[0])
            baseline = statistics.median(results["step_s"])
            sync_held = managers["sync"].save(repeat + 1, train_state={}, fields={}, blocking=False)
            train_step(model, optimizer, managers["sync"], args.tokens)
            manager = managers["async"]
            started = time.perf_counter()
            call = manager.save(repeat + 1, train_state={}, fields={}, blocking=False)
            step, waited = train_step(model, optimizer, manager, args.tokens)
            manager.wait()
            row = {
                "sync_blocking_s": sync_held,
                "async_blocking_s": call + waited,
                "async_save_call_s": call,
                "async_staging_wait_s": waited,
                "async_step_slowdown_s": step - waited - baseline,
                "async_total_s": time.perf_counter() - started,
            }
            print(f"round {repeat}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), file=sys.stderr, flush=True)
            if repeat == 0:
                first_async = row
                continue
            for key, value in row.items():
                results[key].append(value)
        size = sum(f.stat().st_size for f in (root / "sync" / "checkpoints").rglob("*") if f.is_file())
    finally:
        for manager in managers.values():
            manager.close()
        shutil.rmtree(root, ignore_errors=True)
    summary = {k: statistics.median(v) for k, v in results.items()}
    summary.update(
        parameters=parameters,
        checkpoint_bytes=size,
        rounds=args.repeats,
        async_share_of_sync=summary["async_blocking_s"] / summary["sync_blocking_s"],
        first_round=first_async,
        per_round={k: [round(x, 2) for x in v] for k, v in results.items()},
    )

    # The SmolLM3 recipe at its published scale: the estimate's checkpoint size and write time, every interval.
    estimate = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "smolctl",
                "estimate",
                "recipes/smollm3.toml",
                "--gpus",
                "384",
                "--tp",
                "2",
                "--tokens",
                "11.2T",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    from smolctl.recipe import load_toml

    interval = load_toml("recipes/smollm3.toml")["checkpoint"]["interval"]
    write_s = estimate["compute"]["checkpoint"]["write_seconds"]
    summary["smollm3"] = {
        "interval": interval,
        "checkpoint_bytes": estimate["compute"]["checkpoint"]["bytes"],
        "sync_s_per_checkpoint": write_s,
        "sync_s_per_1000_steps": write_s * 1000 / interval,
        "async_s_per_1000_steps": write_s * summary["async_share_of_sync"] * 1000 / interval,
        "yardstick_s_per_1000_steps": 300,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
