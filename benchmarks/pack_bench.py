"""Pack speed and waste, side by side in one run: `smolctl pack` against the raw `tokenizer(batch)` speed, the
packing step alone against TRL's `pack_dataset` (bfd and bfd_split) on the same token ids, and padding at
seq_len 2048/4096/8192 against padding every document to a full row.

    .venv/bin/python benchmarks/pack_bench.py            # ~20 MB of text, a few minutes on 2 cores
    .venv/bin/python benchmarks/pack_bench.py --mb 8     # quicker

The corpus is real, mixed-length text found on any Linux machine: the sample corpus, the plain-text and
gzipped documentation under /usr/share/doc, and Python sources from the virtual environment, one document per
file, in a fixed order. Files over 100 KB are left out: web corpora have few documents that long, and a
multi-megabyte changelog would time byte-level BPE on pathological "words" rather than packing. Speed runs are
interleaved and the best wall and CPU time of each is kept (the machine may be shared).
"""

from __future__ import annotations

import argparse
import gzip
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from smolctl.data.pack import PackConfig, pack  # noqa: E402
from smolctl.data.packing import BfdPacker, PackStats, TokenBatch  # noqa: E402
from smolctl.shards import open_documents  # noqa: E402

MAX_DOCUMENT_CHARS = 100_000


def corpus_texts(megabytes: float) -> list[str]:
    texts = []
    for name in ("web", "code", "math"):
        for batch in open_documents(REPO / "data" / "sample" / name).iter_batches(columns=["text"]):
            texts += batch.column(0).to_pylist()
    budget = megabytes * 1e6 - sum(map(len, texts))
    files = sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and p.suffix in (".gz", ".txt", ".md", ".rst", ""))
    files += sorted((REPO / ".venv" / "lib").rglob("*.py"))
    for path in files:
        if budget <= 0:
            break
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.strip() and len(text) <= MAX_DOCUMENT_CHARS:
            texts.append(text)
            budget -= len(text)
    return texts


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the tokenizer's threads and --workers processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def best_of(repeats: int, run) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def padding_each_document(lengths: np.ndarray, seq_len: int) -> float:
    rows = np.ceil(lengths / seq_len).sum()
    return 1 - lengths.sum() / (rows * seq_len)


def smolctl_pack_arrays(batch: TokenBatch, seq_len: int, buffer_tokens: int) -> PackStats:
    """The packing step of `pack` alone: split, best-fit-decreasing, rows and position ids assembled."""
    stats = PackStats()
    packer = BfdPacker(seq_len=seq_len, long_docs="split", buffer_tokens=buffer_tokens, seed=0, pad_id=0, stats=stats)
    starts = batch.starts
    for i in range(0, len(batch.lengths), 1000):  # streamed in tokenizer-sized batches, as `pack` does
        lengths = batch.lengths[i:i + 1000]
        chunk = TokenBatch(batch.ids[starts[i]:starts[i] + lengths.sum()], lengths)
        for rows in packer.add(chunk):
            stats.rows += len(rows.row_tokens)
            stats.tokens += int(rows.row_tokens.sum())
    for rows in packer.finish():
        stats.rows += len(rows.row_tokens)
        stats.tokens += int(rows.row_tokens.sum())
    stats.padding_tokens = stats.rows * seq_len - stats.tokens
    return stats


def trl_packing(dataset, seq_len: int, strategy: str) -> tuple[int, int]:
    """TRL's packing; returns (rows, tokens kept)."""
    from trl.data_utils import pack_dataset

    packed = pack_dataset(dataset, seq_len, strategy=strategy)
    return len(packed), int(pc.sum(pc.list_value_length(packed.with_format("arrow")["input_ids"])).as_py())


def markdown(title: str, columns: list[str], rows: list[list]) -> str:
    out = [f"**{title}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def speed(args, work: Path, texts: list[str], tokenizer_class) -> tuple[list[list[int]], list[list]]:
    """Interleaved runs of the raw tokenizer and of `pack` with 1 and 2 workers; best wall and CPU time of each."""

    def raw_tokenizer():
        fresh = tokenizer_class.from_pretrained(str(work / "tok"))  # a cold BPE cache, as `pack` starts with
        started = time.perf_counter(), cpu_seconds()
        out = []
        for i in range(0, len(texts), 1000):
            out += fresh(texts[i:i + 1000], add_special_tokens=False)["input_ids"]
        return (time.perf_counter() - started[0], cpu_seconds() - started[1]), out

    def smolctl_pack(workers: int):
        started = time.perf_counter(), cpu_seconds()
        pack(str(work / "corpus.parquet"), work / "packed", tokenizer_spec=str(work / "tok"), overwrite=True,
             config=PackConfig(seq_len=4096, workers=workers))
        return time.perf_counter() - started[0], cpu_seconds() - started[1]

    runs: dict = {"raw": [], 1: [], 2: []}
    for _ in range(args.repeats):
        seconds, ids = raw_tokenizer()
        runs["raw"].append(seconds)
        for workers in (1, 2):
            runs[workers].append(smolctl_pack(workers))
    best = {key: (min(w for w, _ in values), min(c for _, c in values)) for key, values in runs.items()}
    tokens = sum(len(doc) + 1 for doc in ids if doc)
    raw_wall, raw_cpu = best["raw"]
    rows = [["`tokenizer(batch)` (transformers, 1000 docs/call, ids only), baseline", f"{raw_wall:.2f}",
             f"{raw_cpu:.2f}", f"{tokens / raw_wall / 1e6:.2f}", "1.00", "1.00"]]
    for workers in (1, 2):
        wall, cpu = best[workers]
        rows.append([f"`smolctl pack` end to end (parquet → safetensors), bfd 4096, --workers {workers}",
                     f"{wall:.2f}", f"{cpu:.2f}", f"{tokens / wall / 1e6:.2f}", f"{raw_wall / wall:.2f}",
                     f"{raw_cpu / cpu:.2f}"])
    return ids, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20.0, help="Megabytes of text.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    from datasets import Dataset, disable_caching, disable_progress_bars
    from transformers import AutoTokenizer

    from smolctl.data.tokenizer import train_tokenizer

    disable_caching()
    disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="pack-bench-"))
    texts = corpus_texts(args.mb)
    pq.write_table(pa.table({"text": texts}), work / "corpus.parquet", row_group_size=2000)
    train_tokenizer(str(REPO / "data" / "sample" / "web"), str(work / "tok"), vocab_size=args.vocab_size)
    eos = AutoTokenizer.from_pretrained(str(work / "tok")).eos_token_id

    ids, speed_rows = speed(args, work, texts, AutoTokenizer)
    ids = [doc + [eos] for doc in ids if doc]
    tokens = sum(map(len, ids))
    print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, {tokens / 1e6:.2f} M "
          f"tokens (EOS included), vocab {args.vocab_size}; {args.repeats} interleaved repeats\n")
    print(markdown("Tokenise + pack, end to end (higher tokens/s and ratios are better)",
                   ["what", "wall s", "CPU s", "M tokens/s (wall)", "speed vs tokenizer (wall)",
                    "speed vs tokenizer (CPU)"], speed_rows))

    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    batch = TokenBatch(np.fromiter((t for d in ids for t in d), dtype=np.int32, count=tokens), lengths)
    dataset = Dataset.from_dict({"input_ids": ids})
    ours, _ = best_of(args.repeats, lambda: smolctl_pack_arrays(batch, 4096, 8_000_000))
    trl_bfd, _ = best_of(args.repeats, lambda: trl_packing(dataset, 4096, "bfd"))
    trl_split, _ = best_of(args.repeats, lambda: trl_packing(dataset, 4096, "bfd_split"))
    print(markdown(f"Packing step alone, same {tokens / 1e6:.2f} M token ids, seq_len 4096 (lower seconds is better)",
                   ["what", "seconds", "M tokens/s", "speed vs TRL bfd"],
                   [["`trl.data_utils.pack_dataset(strategy=\"bfd\")` (truncates long documents)", f"{trl_bfd:.2f}",
                     f"{tokens / trl_bfd / 1e6:.1f}", "1.00"],
                    ["`trl.data_utils.pack_dataset(strategy=\"bfd_split\")`", f"{trl_split:.2f}",
                     f"{tokens / trl_split / 1e6:.1f}", f"{trl_bfd / trl_split:.2f}"],
                    ["smolctl bfd (split, 8M-token buffer, [rows, seq_len] ids + position ids)", f"{ours:.2f}",
                     f"{tokens / ours / 1e6:.1f}", f"{trl_bfd / ours:.2f}"]]))

    waste_rows = []
    for seq_len in (2048, 4096, 8192):
        small = smolctl_pack_arrays(batch, seq_len, 1_000_000)
        large = smolctl_pack_arrays(batch, seq_len, 8_000_000)
        rows_bfd, kept_bfd = trl_packing(dataset, seq_len, "bfd")
        rows_split, kept_split = trl_packing(dataset, seq_len, "bfd_split")
        waste_rows.append([
            seq_len, f"{(-tokens % seq_len) / (tokens - tokens % seq_len + seq_len):.3%}",
            f"{padding_each_document(lengths, seq_len):.2%}",
            f"{1 - kept_bfd / (rows_bfd * seq_len):.3%} (+{1 - kept_bfd / tokens:.1%} tokens truncated)",
            f"{1 - kept_split / (rows_split * seq_len):.3%}",
            f"{small.padding_fraction:.3%}", f"{large.padding_fraction:.3%}",
        ])
    print(markdown("Padding fraction (padding / row slots, lower is better)",
                   ["seq_len", "lower bound (last row)", "pad each document", "TRL bfd", "TRL bfd_split",
                    "smolctl bfd, 1M-token buffer", "smolctl bfd, 8M-token buffer (default)"], waste_rows))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
