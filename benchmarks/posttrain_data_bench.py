"""Loading chat data for sft: smolctl's checked load against datasets' own parquet load, whole process each.

  python benchmarks/posttrain_data_bench.py [--rows 200000]

smolctl reads every row through its checks (chat_data.py) into one in-memory Arrow table; the baseline is what
TRL's examples do, `datasets.load_dataset("parquet", ...)`, which converts to a memory-mapped cache file and checks
nothing. Prints wall seconds and peak RSS of each, side by side, and smolctl's ratio to the baseline.
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

REPO = Path(__file__).resolve().parent.parent

CHILD = {
    "smolctl": """
from smolctl.shards import open_documents
from smolctl.train.config import ChatDataSection
from smolctl.train.posttrain import load_sft_dataset
class Tokenizer: chat_template = "{{ messages }}"
dataset, _ = load_sft_dataset(open_documents(CORPUS), ChatDataSection(path=CORPUS), 0, Tokenizer())
""",
    "datasets.load_dataset": """
import datasets
dataset = datasets.load_dataset("parquet", data_files=CORPUS + "/*.parquet", split="train", cache_dir=CACHE)
""",
}


def write_corpus(folder: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def turn(role: str, i: int) -> dict:
        return {"role": role, "content": f"word{i} " * 50}

    folder.mkdir(parents=True)
    roles = ["system", "user", "assistant", "user", "assistant"]
    step = 50_000
    for start in range(0, rows, step):
        chunk = [[turn(r, i) for r in roles] for i in range(start, min(rows, start + step))]
        pq.write_table(pa.table({"messages": chunk}), folder / f"part-{start // step:05d}.parquet")


def measure(method: str, corpus: Path, cache: Path) -> dict:
    code = f"CORPUS = {str(corpus)!r}; CACHE = {str(cache)!r}\n" + CHILD[method]
    start = time.perf_counter()
    # smolctl from PYTHONPATH when it is set (an older tree, to compare), else this checkout
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", code], cwd=corpus.parent, env=env)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the largest child's so far
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{method} failed ({status})")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--write-corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_corpus:
        write_corpus(args.write_corpus, args.rows)
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "chat"
        # in a process of its own: a child's peak RSS starts from its parent's (Linux carries it over fork)
        subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--write-corpus", str(corpus)], check=True)
        results = {
            method: measure(method, corpus, Path(tmp) / "cache") for method in ("datasets.load_dataset", "smolctl")
        }
    base = results["datasets.load_dataset"]
    print(f"{args.rows:,} five-turn conversations (~300 characters a turn)\n")
    print("| method | wall s | peak RSS MB | wall vs load_dataset |")
    print("|---|---:|---:|---:|")
    for method, r in results.items():
        print(f"| {method} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['wall_s'] / base['wall_s']:.2f}x |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
