"""`smolctl pack` as Slurm array tasks: tokens/s per task with 1 and with 2 tasks on this machine, and the wall
time that projects to for an 11T-token corpus at a given number of tasks.

    .venv/bin/python benchmarks/pack_array_bench.py                   # 8 MB of text in 8 shards, ~1 minute on 2 cores
    .venv/bin/python benchmarks/pack_array_bench.py --mb 20 --project-tasks 2048

Each task is a real `smolctl pack ... --tasks N --task-id I` process (as pack.sbatch runs it), all N started at
once; each gets cores / N Rust tokeniser threads, as a Slurm task gets its --cpus-per-task. A task's rate is its
own tokens over its own wall time (the JSON summary's tokens_per_second). The corpus is pack_bench.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from pack_bench import corpus_texts  # noqa: E402

from smolctl.data.tokenizer import train_tokenizer  # noqa: E402

SMOLLM3_TOKENS = 11.2e12


def run_array(corpus: Path, tokenizer: Path, output: Path, tasks: int, seq_len: int) -> tuple[float, list[dict]]:
    """Start every task of an array at once; returns (wall seconds of the array, each task's JSON summary)."""
    threads = max(1, (os.cpu_count() or 1) // tasks)
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "smolctl",
        "pack",
        str(corpus),
        str(output),
        "--tokenizer",
        str(tokenizer),
        "--seq-len",
        str(seq_len),
        "--tasks",
        str(tasks),
        "--json",
    ]
    started = time.perf_counter()
    running = [
        subprocess.Popen([*command, "--task-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(tasks)
    ]
    results = [json.loads(p.communicate()[0]) for p in running]
    wall = time.perf_counter() - started
    assert all(p.returncode == 0 for p in running) and sum(r["finished"] for r in results) == 1
    return wall, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8, help="megabytes of text")
    parser.add_argument("--shards", type=int, default=8, help="input shards (units)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--project-tasks", type=int, default=1024, help="tasks for the 11T-token projection")
    args = parser.parse_args()
    texts = corpus_texts(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus"
        corpus.mkdir()
        per_shard = -(-len(texts) // args.shards)
        for index in range(args.shards):
            pq.write_table(
                pa.table({"text": texts[index * per_shard : (index + 1) * per_shard]}),
                corpus / f"part-{index:05d}.parquet",
            )
        train_tokenizer(str(REPO / "data" / "sample" / "web"), str(tmp / "tok"), vocab_size=8192)
        rows = []
        for tasks in (1, 2):
            wall, results = run_array(corpus, tmp / "tok", tmp / f"packed-{tasks}", tasks, args.seq_len)
            tokens = max(r["stats"]["tokens"] for r in results if r["finished"])
            per_task = [r["tokens_per_second"] for r in results]
            rows.append((tasks, wall, tokens, per_task))
        identical = all(
            (tmp / "packed-1" / f.name).read_bytes() == f.read_bytes()
            for f in sorted((tmp / "packed-2").glob("*.safetensors"))
        )
    print(
        f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, {args.shards} shards; "
        f"{os.cpu_count()} cores; outputs of 1 and 2 tasks byte-identical: {identical}\n"
    )
    print("| tasks | array wall s | M tokens | M tokens/s per task | M tokens/s, whole array |")
    print("|---|---|---|---|---|")
    for tasks, wall, tokens, per_task in rows:
        print(
            f"| {tasks} | {wall:.1f} | {tokens / 1e6:.2f} | {' / '.join(f'{r / 1e6:.3f}' for r in per_task)} | "
            f"{tokens / wall / 1e6:.3f} |"
        )
    per_task_rate = min(min(r[3]) for r in rows if r[0] == 2)
    days = SMOLLM3_TOKENS / (per_task_rate * args.project_tasks) / 86400
    print(
        f"\nprojection: 11.2T tokens at the slowest 2-task rate ({per_task_rate / 1e6:.3f} M tokens/s per task, one "
        f"core each) over {args.project_tasks} tasks: {days:.1f} days ({days * 24:.0f} h)"
    )


if __name__ == "__main__":
    main()
