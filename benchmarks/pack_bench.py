"""`smolctl pack` end to end against the raw Rust tokenizer pass over the same parquet, whole process each, in
interleaved rounds with the same thread count; then the packing step alone against TRL's `pack_dataset`, and
padding at seq_len 2048/4096/8192.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/pack_bench.py                 # ~20 MB, ~24k documents
    PYTHONPATH=$PWD .venv/bin/python benchmarks/pack_bench.py --mb 8 --rounds 3 --end-to-end-only
    mkdir /tmp/before && git archive 4c26c8b | tar -x -C /tmp/before     # pack before issue 23, side by side:
    PYTHONPATH=$PWD .venv/bin/python benchmarks/pack_bench.py --end-to-end-only --rounds 3 --baseline /tmp/before
    PYTHONPATH=$PWD .venv/bin/python benchmarks/pack_bench.py --tail-only --rounds 10 --baseline /tmp/before
    PYTHONPATH=$PWD .venv/bin/python benchmarks/pack_bench.py --long-documents 400 --baseline /tmp/before

The raw pass is the floor `pack` is measured against: a fresh `python` that imports pyarrow and tokenizers,
loads tokenizer.json, reads the parquet in batches of 1,000 documents and calls `Tokenizer.encode_batch_fast` on
each, keeping only the token counts. `pack` is `python -m smolctl pack ... --seq-len 4096` (bfd, safetensors
shards, manifest). Both run with RAYON_NUM_THREADS = --threads and TOKENIZERS_PARALLELISM=true.

--tail-only times what `pack` does after the last token batch reached its packing thread (with the default
8M-token bfd buffer, all of a corpus this size is packed then: best-fit-decreasing, the rows, the shard, its
sha256, the manifests): `pack()` in a fresh process whose tokenising is replaced by replaying the token batches
of one real run, from the last batch's progress callback to the return. The replay patches
`smolctl.data.pack.tokenised_pieces` (`tokenised_batches` in trees up to 3897ee2).

--long-documents N measures pack and mix (tokens counted exactly) on N book-length documents (whole
/usr/share/doc files joined to at least 200,000 characters each): time and peak resident memory, of which the
tokenizer's Encodings are most.

The corpus is real, mixed-length text found on any Linux machine: the sample corpus, the plain-text and gzipped
documentation under /usr/share/doc and Python sources of the virtual environment, cut at blank lines into
documents of at most ~1,000 characters (~24k documents at 20 MB), in a fixed order.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import os
import shutil
import statistics
import subprocess
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

from smolctl.data.pack_rows import BfdPacker, PackStats, TokenBatch  # noqa: E402
from smolctl.shards import open_documents  # noqa: E402

MAX_FILE_CHARS = 100_000
DOCUMENT_CHARS = 1_000
RAW_PASS = """
import sys
import pyarrow.parquet as pq
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(sys.argv[2])
tokens = 0
for batch in pq.ParquetFile(sys.argv[1]).iter_batches(batch_size=1000, columns=["text"]):
    texts = [t or "" for t in batch.column(0).to_pylist()]
    tokens += sum(len(e) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
print(tokens)
"""

TAIL = """
import pickle, sys, time
from smolctl.data import pack as pack_module
from smolctl.data.pack_config import PackConfig
from smolctl.data.pack_rows import TokenBatch

corpus, tokenizer, output, batches_file, seq_len, mode = sys.argv[1:7]
# Trees up to 3897ee2 yield whole batches from `tokenised_batches`, later ones pieces from `tokenised_pieces`;
# on a corpus of short documents every batch is one piece, so one capture replays in either.
pieces = hasattr(pack_module, "tokenised_pieces")
name = "tokenised_pieces" if pieces else "tokenised_batches"
if mode == "capture":
    tokenised, kept = getattr(pack_module, name), []

    def capturing(*args):
        for item in tokenised(*args):
            unit, batch, read, empty, batch_ends = item if pieces else (*item, True)
            kept.append((unit, batch.ids, batch.lengths, read, empty, batch_ends))
            yield item

    setattr(pack_module, name, capturing)
else:
    with open(batches_file, "rb") as handle:
        kept = pickle.load(handle)
    if not pieces and not all(batch_ends for *_, batch_ends in kept):
        sys.exit("this capture has batches in pieces, which a tree without tokenised_pieces cannot replay")
    replayed = [(u, TokenBatch(i, n), r, e, b) if pieces else (u, TokenBatch(i, n), r, e) for u, i, n, r, e, b in kept]
    setattr(pack_module, name, lambda *args: (item for item in replayed))
last = [0.0, 0.0]
config = PackConfig(seq_len=int(seq_len))
progress = lambda read, tokens: last.__setitem__(slice(None), [time.perf_counter(), time.process_time()])
pack_module.pack(corpus, output, tokenizer_spec=tokenizer, config=config, overwrite=True, on_progress=progress)
if mode == "capture":
    with open(batches_file, "wb") as handle:
        pickle.dump(kept, handle)
print(time.perf_counter() - last[0], time.process_time() - last[1])
"""


def documents_of(text: str) -> list[str]:
    """A file's text cut at blank lines into documents of at most ~DOCUMENT_CHARS characters."""
    out, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > DOCUMENT_CHARS:
            out.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current.strip():
        out.append(current)
    return out


def corpus_texts(megabytes: float) -> list[str]:
    texts = []
    for name in ("web", "code", "math"):
        for batch in open_documents(REPO / "data" / "sample" / name).iter_batches(columns=["text"]):
            texts += batch.column(0).to_pylist()
    budget = megabytes * 1e6 - sum(map(len, texts))
    files = sorted(
        p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and p.suffix in (".gz", ".txt", ".md", ".rst", "")
    )
    files += sorted(Path(sys.prefix, "lib").rglob("*.py"))
    for path in files:
        if budget <= 0:
            break
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.strip() and len(text) <= MAX_FILE_CHARS:
            texts += documents_of(text)
            budget -= len(text)
    return texts


def build_corpus(work: Path, megabytes: float, vocab_size: int) -> list[str]:
    from smolctl.data.tokenizer import train_tokenizer

    texts = corpus_texts(megabytes)
    pq.write_table(pa.table({"text": texts}), work / "corpus.parquet", row_group_size=2000)
    train_tokenizer(str(REPO / "data" / "sample" / "web"), str(work / "tok"), vocab_size=vocab_size)
    return texts


def compile_sources(tree: Path) -> None:
    """Byte-compile a tree's smolctl before timing it. Python caches bytecode on the first import, but where
    PYTHONDONTWRITEBYTECODE is set (this sandbox sets it) every run would compile smolctl's modules again, a
    cost neither an installed smolctl nor the raw pass's installed libraries pay."""
    compileall.compile_dir(str(tree / "smolctl"), quiet=1)


def timed(command: list[str], env: dict) -> tuple[float, float, str]:
    """Wall and CPU seconds (the process and its threads) of one fresh process, and its stdout."""
    wall, cpu, out, _ = measured(command, env)
    return wall, cpu, out


def measured(command: list[str], env: dict) -> tuple[float, float, str, float]:
    """timed(), and the process's peak resident memory in GiB.

    It runs in the source tree of its PYTHONPATH: `python -m` and `python -c` put the working directory first on
    sys.path, so from this repository's root a --baseline run would import this tree's smolctl, not the
    baseline's."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, env=env, cwd=env["PYTHONPATH"], stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status):
            err.seek(0)
            raise SystemExit(f"{command[:4]} failed:\n{err.read()[-2000:]}")
        out.seek(0)
        return wall, usage.ru_utime + usage.ru_stime, out.read(), usage.ru_maxrss / 2**20


def end_to_end(work: Path, rounds: int, threads: int, seq_len: int, baseline: Path | None) -> list[list]:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": str(REPO)}
    raw = [sys.executable, "-c", RAW_PASS, str(work / "corpus.parquet"), str(work / "tok" / "tokenizer.json")]
    pack = [
        sys.executable,
        "-m",
        "smolctl",
        "pack",
        str(work / "corpus.parquet"),
        str(work / "packed"),
        "--tokenizer",
        str(work / "tok"),
        "--seq-len",
        str(seq_len),
        "--overwrite",
        "--json",
    ]
    commands = {"raw": (raw, env), "pack": (pack, env)}
    if baseline:  # the same command from another source tree (e.g. `git archive` of the commit before a change)
        commands["baseline"] = (pack, {**env, "PYTHONPATH": str(baseline)})
    for tree in {REPO, baseline} - {None}:
        compile_sources(tree)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    ratios: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(rounds):  # rotate which goes first: the load on a shared machine drifts
        names = list(commands)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            wall, cpu, out = timed(*commands[name])
            runs[name].append((wall, cpu))
            if name == "raw":
                raw_tokens = int(out)
        for name in commands:
            ratios[name].append(runs[name][-1][0] / runs["raw"][-1][0])
        print(
            f"round {round_ + 1}: "
            + ", ".join(
                f"{name} {runs[name][-1][0]:.2f} s wall {runs[name][-1][1]:.2f} s CPU ({ratios[name][-1]:.3f})"
                for name in commands
            ),
            flush=True,
        )
    print(f"raw pass: {raw_tokens / 1e6:.2f} M tokens (no EOS)")
    labels = {
        "raw": "raw `encode_batch_fast` pass (token counts only), baseline",
        "pack": f"`smolctl pack --seq-len {seq_len}` (bfd, safetensors + manifest)",
        "baseline": f"`smolctl pack --seq-len {seq_len}` from {baseline}",
    }
    rows = []
    for name in commands:
        cpu_ratio = statistics.median(c / r for (_, c), (_, r) in zip(runs[name], runs["raw"]))
        rows.append(
            [
                labels[name],
                f"{statistics.median(w for w, _ in runs[name]):.2f}",
                f"{statistics.median(c for _, c in runs[name]):.2f}",
                f"{statistics.median(ratios[name]):.3f}",
                f"{cpu_ratio:.3f}",
            ]
        )
    return rows


def tail(work: Path, rounds: int, threads: int, seq_len: int, baseline: Path | None) -> list[list]:
    """The tail of `pack` (see the module docstring), this tree and --baseline in interleaved rounds."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": str(REPO)}
    files = [str(work / "corpus.parquet"), str(work / "tok"), str(work / "packed"), str(work / "tail-batches.pkl")]
    timed([sys.executable, "-c", TAIL, *files, str(seq_len), "capture"], env)
    replay = [sys.executable, "-c", TAIL, *files, str(seq_len), "replay"]
    trees = {"pack": env} | ({"baseline": {**env, "PYTHONPATH": str(baseline)}} if baseline else {})
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for round_ in range(rounds):
        names = list(trees)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            wall, cpu = map(float, timed(replay, trees[name])[2].split())
            runs[name].append((wall, cpu))
    labels = {"pack": f"`pack --seq-len {seq_len}` tail, this tree", "baseline": f"the same from {baseline}"}
    return [
        [
            labels[name],
            f"{statistics.median(w for w, _ in runs[name]):.3f}",
            f"{statistics.median(c for _, c in runs[name]):.3f}",
            f"{min(c for _, c in runs[name]):.3f}",
        ]
        for name in trees
    ]


BOOK_CHARS = 200_000


def book_texts(count: int) -> list[str]:
    """`count` book-length documents: whole /usr/share/doc files (decompressed) joined until each holds at least
    BOOK_CHARS characters, repeated when the files run out."""
    books, current = [], []
    for path in sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file()):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            current.append(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if sum(map(len, current)) >= BOOK_CHARS:
            books.append("\n".join(current))
            current = []
    if not books:
        raise SystemExit("no text under /usr/share/doc to build book-length documents from")
    return [books[i % len(books)] for i in range(count)]


def long_documents(work: Path, count: int, threads: int, seq_len: int, baseline: Path | None) -> list[list]:
    """pack and mix (tokens counted exactly) on `count` book-length documents, one file: time and peak memory,
    this tree and --baseline."""
    folder = work / f"books-{count}"
    if not (folder / "part-00000.parquet").exists():
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": book_texts(count)}), folder / "part-00000.parquet")
    characters = pc.sum(pc.utf8_length(pq.read_table(folder)["text"])).as_py()
    print(f"{count:,} book-length documents, {characters / 1e6:.0f} M characters\n", flush=True)
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": str(REPO)}
    tokenizer = ["--tokenizer", str(work / "tok")]
    commands = {
        f"pack --seq-len {seq_len}": ["pack", str(folder), str(work / "books-packed"), "--seq-len", str(seq_len)],
        "mix --token-estimate exact": ["mix", str(work / "books-mix"), "--source", f"books={folder}:1"]
        + ["--token-estimate", "exact"],
    }
    trees = {"this tree": REPO} | ({str(baseline): baseline} if baseline else {})
    rows = []
    for label, arguments in commands.items():
        for tree_label, tree in trees.items():
            compile_sources(tree)
            command = [sys.executable, "-m", "smolctl", *arguments, *tokenizer, "--overwrite", "--json"]
            wall, cpu, _, peak = measured(command, {**env, "PYTHONPATH": str(tree)})
            rows.append([f"`smolctl {label}`, {tree_label}", f"{wall:.1f}", f"{cpu:.1f}", f"{peak:.2f}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def smolctl_pack_arrays(batch: TokenBatch, seq_len: int, buffer_tokens: int) -> PackStats:
    """The packing step of `pack` alone: split, best-fit-decreasing, rows and position ids assembled."""
    stats = PackStats()
    packer = BfdPacker(seq_len=seq_len, long_docs="split", buffer_tokens=buffer_tokens, seed=0, pad_id=0, stats=stats)
    starts = batch.starts
    for i in range(0, len(batch.lengths), 1000):  # streamed in tokenizer-sized batches, as `pack` does
        lengths = batch.lengths[i : i + 1000]
        chunk = TokenBatch(batch.ids[starts[i] : starts[i] + lengths.sum()], lengths)
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


def best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def padding_each_document(lengths: np.ndarray, seq_len: int) -> float:
    rows = np.ceil(lengths / seq_len).sum()
    return 1 - lengths.sum() / (rows * seq_len)


def markdown(title: str, columns: list[str], rows: list[list]) -> str:
    out = [f"**{title}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def packing_step(work: Path, texts: list[str], repeats: int) -> None:
    from datasets import Dataset, disable_caching, disable_progress_bars
    from tokenizers import Tokenizer

    disable_caching()
    disable_progress_bars()
    tokenizer = Tokenizer.from_file(str(work / "tok" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = [e.ids + [eos] for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False) if len(e)]
    tokens = sum(map(len, ids))
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    batch = TokenBatch(np.fromiter((t for d in ids for t in d), dtype=np.int32, count=tokens), lengths)
    dataset = Dataset.from_dict({"input_ids": ids})
    ours = best_of(repeats, lambda: smolctl_pack_arrays(batch, 4096, 8_000_000))
    trl_bfd = best_of(repeats, lambda: trl_packing(dataset, 4096, "bfd"))
    trl_split = best_of(repeats, lambda: trl_packing(dataset, 4096, "bfd_split"))
    print(
        markdown(
            f"Packing step alone, same {tokens / 1e6:.2f} M token ids, seq_len 4096 (lower seconds is better)",
            ["what", "seconds", "M tokens/s", "speed vs TRL bfd"],
            [
                [
                    '`trl.data_utils.pack_dataset(strategy="bfd")` (truncates long documents)',
                    f"{trl_bfd:.2f}",
                    f"{tokens / trl_bfd / 1e6:.1f}",
                    "1.00",
                ],
                [
                    '`trl.data_utils.pack_dataset(strategy="bfd_split")`',
                    f"{trl_split:.2f}",
                    f"{tokens / trl_split / 1e6:.1f}",
                    f"{trl_bfd / trl_split:.2f}",
                ],
                [
                    "smolctl bfd (split, 8M-token buffer, [rows, seq_len] ids + position ids)",
                    f"{ours:.2f}",
                    f"{tokens / ours / 1e6:.1f}",
                    f"{trl_bfd / ours:.2f}",
                ],
            ],
        )
    )
    waste_rows = []
    for seq_len in (2048, 4096, 8192):
        small = smolctl_pack_arrays(batch, seq_len, 1_000_000)
        large = smolctl_pack_arrays(batch, seq_len, 8_000_000)
        rows_bfd, kept_bfd = trl_packing(dataset, seq_len, "bfd")
        rows_split, kept_split = trl_packing(dataset, seq_len, "bfd_split")
        waste_rows.append(
            [
                seq_len,
                f"{(-tokens % seq_len) / (tokens - tokens % seq_len + seq_len):.3%}",
                f"{padding_each_document(lengths, seq_len):.2%}",
                f"{1 - kept_bfd / (rows_bfd * seq_len):.3%} (+{1 - kept_bfd / tokens:.1%} tokens truncated)",
                f"{1 - kept_split / (rows_split * seq_len):.3%}",
                f"{small.padding_fraction:.3%}",
                f"{large.padding_fraction:.3%}",
            ]
        )
    print(
        markdown(
            "Padding fraction (padding / row slots, lower is better)",
            [
                "seq_len",
                "lower bound (last row)",
                "pad each document",
                "TRL bfd",
                "TRL bfd_split",
                "smolctl bfd, 1M-token buffer",
                "smolctl bfd, 8M-token buffer (default)",
            ],
            waste_rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20.0, help="Megabytes of text.")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds of raw pass and pack.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="Tokenizer threads of both.")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--end-to-end-only", action="store_true", help="Skip the packing-step and padding tables.")
    parser.add_argument("--tail-only", action="store_true", help="Only the tail of pack after its last batch.")
    parser.add_argument(
        "--baseline", type=Path, help="Also time pack from this source tree (its PYTHONPATH, run from there)."
    )
    parser.add_argument("--work", type=Path, help="Keep the corpus and tokenizer here (reused when present).")
    parser.add_argument(
        "--long-documents",
        type=int,
        metavar="N",
        help="Only pack and mix on N book-length documents: time and peak memory (the tokenizer's, mostly).",
    )
    args = parser.parse_args()

    baseline = args.baseline.resolve() if args.baseline else None
    work = (args.work or Path(tempfile.mkdtemp(prefix="pack-bench-"))).resolve()  # the runs start elsewhere
    work.mkdir(parents=True, exist_ok=True)
    if (work / "corpus.parquet").exists() and (work / "tok").exists():
        texts = pq.read_table(work / "corpus.parquet").column("text").to_pylist()
    else:
        texts = build_corpus(work, args.mb, args.vocab_size)
    print(
        f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, vocab "
        f"{args.vocab_size}, {args.threads} tokenizer threads, {args.rounds} interleaved rounds\n",
        flush=True,
    )
    if args.long_documents:
        title = f"{args.long_documents:,} book-length documents: one run each"
        columns = ["what", "wall s", "CPU s", "peak memory GiB"]
        rows = long_documents(work, args.long_documents, args.threads, args.seq_len, baseline)
    elif args.tail_only:
        title = f"The tail of pack after its last token batch, {args.rounds} rounds (medians; min CPU)"
        columns = ["what", "wall s", "CPU s", "min CPU s"]
        rows = tail(work, args.rounds, args.threads, args.seq_len, baseline)
    else:
        title = "Whole process, medians over the rounds (ratios: the median of each round's time / raw time)"
        columns = ["what", "wall s", "CPU s", "/ raw (wall)", "/ raw (CPU)"]
        rows = end_to_end(work, args.rounds, args.threads, args.seq_len, baseline)
    print(markdown(title, columns, rows))
    if not (args.end_to_end_only or args.tail_only or args.long_documents):
        packing_step(work, texts, 3)
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
