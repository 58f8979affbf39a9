"""How long a checkpoint holds the training loop: `dcp.async_save` (CPU staging copy, written in a background
thread) against `dcp.save`, for a ~300M-parameter SmolLM3 with its AdamW state, on CPU, through smolctl's own
CheckpointManager; then the SmolLM3 recipe's checkpoint seconds per 1,000 steps as `smolctl estimate` sees it.

    PYTHONPATH=. python benchmarks/checkpoint_bench.py [--layers 16] [--repeats 2] [--dir /tmp/ckpt-bench]

Needs about 4× the model's fp32 size in memory (weights, two AdamW moments, the staging copy): ~5 GB at 300M.
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

    section = ModelSection(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers, num_attention_heads=16,
                           num_key_value_heads=4)
    model = build_model(build_config(section, vocab_size=49_152, seq_len=2048, eos_id=0, pad_id=1), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # allocates both AdamW moments, as in a real run
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()

    from smolctl.train.checkpoint import CheckpointManager
    from smolctl.train.distributed import Dist

    model, optimizer = build(args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    results: dict[str, list[float]] = {"sync_blocking_s": [], "async_blocking_s": [], "async_total_s": []}
    try:
        for async_save in (False, True):
            manager = CheckpointManager(root, model=model, optimizer=optimizer, dist=Dist(), keep=1, async_save=async_save,
                                        export_interval=0, write_model_files=lambda folder: None, inputs=lambda: [])
            for repeat in range(args.repeats):
                started = time.perf_counter()
                held = manager.save(repeat + 1, train_state={}, fields={}, blocking=False)
                manager.wait()
                total = time.perf_counter() - started
                if async_save:
                    results["async_blocking_s"].append(held)
                    results["async_total_s"].append(total)
                else:
                    results["sync_blocking_s"].append(held)
            manager.close()
        size = sum(f.stat().st_size for f in (root / "checkpoints").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {k: statistics.median(v) for k, v in results.items()}
    summary.update(parameters=parameters, checkpoint_bytes=size,
                   async_share_of_sync=summary["async_blocking_s"] / summary["sync_blocking_s"])

    # The SmolLM3 recipe at its published scale: the estimate's checkpoint size and write time, every interval.
    estimate = json.loads(subprocess.run([sys.executable, "-m", "smolctl", "estimate", "recipes/smollm3.toml", "--gpus", "384",
                                          "--tp", "2", "--tokens", "11.2T", "--json"], capture_output=True, text=True,
                                         check=True).stdout)
    from smolctl.recipe import load_toml

    interval = load_toml("recipes/smollm3.toml")["checkpoint"]["interval"]
    write_s = estimate["compute"]["checkpoint"]["write_seconds"]
    summary["smollm3"] = {"interval": interval, "checkpoint_bytes": estimate["compute"]["checkpoint"]["bytes"],
                          "sync_s_per_checkpoint": write_s, "sync_s_per_1000_steps": write_s * 1000 / interval,
                          "async_s_per_1000_steps": write_s * summary["async_share_of_sync"] * 1000 / interval,
                          "yardstick_s_per_1000_steps": 300}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
