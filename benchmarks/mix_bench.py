"""`smolctl mix --token-estimate sample` against `exact`: whole-process time, and the token shares `pack` counts.

    .venv/bin/python benchmarks/mix_bench.py                       # ~6 MB per source, a few minutes on 2 cores
    .venv/bin/python benchmarks/mix_bench.py --mb 2 --rounds 2     # quicker
    .venv/bin/python benchmarks/mix_bench.py --mb 20 --rounds 1 --blobs 20   # outliers a uniform sample misses

The corpus is real text found on any Debian-like machine, four sources that tokenize differently: English prose
(/usr/share/doc), Python code (the virtual environment's sources), English manual pages (roff) and manual pages
in a dozen other languages (German, French, Russian, Japanese, Chinese, Korean, ...). Files are cut at blank lines
into documents of a few hundred bytes to a few kilobytes, as web pages are. A byte-level BPE tokenizer is trained
on an equal slice of every source, so each has its own bytes per token.

Each round runs `python -m smolctl mix` (a new process, timed whole) once per mode, the order alternating between
rounds (the machine may be shared and drift); the same seed must give the same bytes in every round. The achieved
shares are counted by `pack`: each mode's output is split by its `source` column and every part packed, and a
share is that part's packed tokens (EOS included) over all parts'.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import os
import resource
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

from smolctl.data.pack import PackConfig, pack  # noqa: E402
from smolctl.data.tokenizer import train_tokenizer  # noqa: E402
from smolctl.shards import open_documents, read_manifest  # noqa: E402

WEIGHTS = {"prose": 40, "code": 30, "manual": 15, "intl": 15}


def read_text(path: Path) -> str | None:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def source_files(name: str) -> list[Path]:
    if name == "prose":
        return sorted(
            p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and p.suffix in (".gz", ".txt", ".md", "")
        )
    if name == "code":
        return sorted(Path(sys.prefix, "lib").rglob("*.py"))
    if name == "manual":
        return sorted(
            p
            for section in ("man1", "man3", "man5", "man7", "man8")
            for p in Path("/usr/share/man", section).rglob("*.gz")
        )
    languages = sorted(p for p in Path("/usr/share/man").iterdir() if not p.name.startswith("man"))
    return sorted(p for language in languages for p in language.rglob("*.gz"))


def documents(name: str, megabytes: float, rng: np.random.Generator) -> list[str]:
    """Files cut at line ends into documents of lognormal length (median ~400 bytes), up to `megabytes` of UTF-8."""
    out, budget = [], megabytes * 1e6
    for path in source_files(name):
        text = read_text(path)
        if not text or not text.strip():
            continue
        current, size, target = [], 0, rng.lognormal(6.0, 0.9)
        for line in text.splitlines(keepends=True):
            current.append(line)
            size += len(line)
            if size >= target:
                out.append("".join(current))
                budget -= len(out[-1].encode())
                current, size, target = [], 0, rng.lognormal(6.0, 0.9)
        if current:
            out.append("".join(current))
            budget -= len(out[-1].encode())
        if budget <= 0:
            break
    return out


def build_corpus(work: Path, megabytes: float, vocab_size: int, blobs: int = 0) -> dict[str, int]:
    rng = np.random.default_rng(0)
    counts, training = {}, []
    for name in WEIGHTS:
        texts = documents(name, megabytes, rng)
        if name == "code":  # base64 blobs of 1/400 of its bytes each, at seeded places (after the sample's draws)
            size = sum(len(t.encode()) for t in texts) // 400
            for blob in [base64.b64encode(rng.bytes(size)).decode() for _ in range(blobs)]:
                texts.insert(int(rng.integers(len(texts))), blob)
        folder = work / "sources" / name
        folder.mkdir(parents=True)
        half = len(texts) // 2
        for part, rows in enumerate((texts[:half], texts[half:])):
            pq.write_table(pa.table({"text": rows}), folder / f"part-{part:05d}.parquet", row_group_size=1000)
        counts[name] = len(texts)
        training += [texts[i] for i in rng.choice(len(texts), min(len(texts), 2000), replace=False)]
    pq.write_table(pa.table({"text": training}), work / "tokenizer-training.parquet")
    train_tokenizer(str(work / "tokenizer-training.parquet"), str(work / "tok"), vocab_size=vocab_size)
    return counts


def run_mix(work: Path, mode: str, tokens: int, token_sample: int | None) -> tuple[float, float, str]:
    """Wall and CPU seconds of the whole `smolctl mix` process (its tokenizer threads included), and a digest of
    its shards."""
    recipe = work / "mix.toml"
    weights = ", ".join(f"{name} = {weight}" for name, weight in WEIGHTS.items())
    recipe.write_text(
        "seed = 7\n"
        + "".join(f'[sources.{n}]\npath = "{work / "sources" / n}"\n' for n in WEIGHTS)
        + f'[[stages]]\nname = "main"\ntokens = {tokens}\nweights = {{ {weights} }}\n'
    )
    output = work / f"out-{mode}"
    command = [
        sys.executable,
        "-m",
        "smolctl",
        "mix",
        str(output),
        "--recipe",
        str(recipe),
        "--tokenizer",
        str(work / "tok"),
        "--token-estimate",
        mode.split()[0],
        "--overwrite",
        "--json",
    ]
    if token_sample:
        command += ["--set", f"token_sample={token_sample}"]
    cpu, started = children_cpu_seconds(), time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False
    )
    seconds, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu
    if done.returncode:
        sys.exit(f"mix failed:\n{done.stderr}")
    shards = [s["sha256"] for s in read_manifest(output)["shards"]]
    return seconds, cpu, hashlib.sha256("".join(shards).encode()).hexdigest()


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def packed_shares(work: Path, mode: str) -> dict[str, float]:
    """Each source's share of the tokens `pack` writes for its rows of the mix."""
    output = work / f"out-{mode}"
    source = open_documents(output)
    table = pa.Table.from_batches(list(source.iter_batches()), schema=source.schema)
    tokens = {}
    for name in WEIGHTS:
        part = work / f"part-{mode}-{name}"
        part.mkdir()
        pq.write_table(table.filter(pc.equal(table["source"], name)), part / "part-00000.parquet")
        result = pack(
            str(part),
            work / f"packed-{mode}-{name}",
            tokenizer_spec=str(work / "tok"),
            config=PackConfig(seq_len=2048, strategy="concat"),
        )
        tokens[name] = result.stats.tokens
    return {name: count / sum(tokens.values()) for name, count in tokens.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=6.0, help="Megabytes of text per source.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--token-sample",
        type=int,
        nargs="+",
        default=[2000, 10_000],
        help="Documents per source to calibrate on, one sample run per value (10,000 is the default).",
    )
    parser.add_argument(
        "--share-of-corpus",
        type=float,
        default=0.5,
        help="The mix's token budget, as a fraction of the corpus's tokens (guessed at 4 bytes per token).",
    )
    parser.add_argument(
        "--blobs",
        type=int,
        default=0,
        help="Base64 blobs to add to the code source (each 1/400 of its bytes): outliers a uniform sample misses.",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mix-bench-"))
    try:
        counts = build_corpus(work, args.mb, args.vocab_size, args.blobs)
        corpus_bytes = {
            n: sum(
                len(t.encode())
                for b in open_documents(work / "sources" / n).iter_batches()
                for t in b.column("text").to_pylist()
            )
            for n in WEIGHTS
        }
        budget = int(sum(corpus_bytes.values()) / 4 * args.share_of_corpus)
        modes = {"exact": None, **{f"sample {size:,}": size for size in args.token_sample}}
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        cpu: dict[str, list[float]] = {mode: [] for mode in modes}
        digests: dict[str, set[str]] = {mode: set() for mode in modes}
        for round_index in range(args.rounds):
            order = list(modes) if round_index % 2 == 0 else list(modes)[::-1]
            for mode in order:
                seconds, cpu_seconds, digest = run_mix(work, mode, budget, modes[mode])
                times[mode].append(seconds)
                cpu[mode].append(cpu_seconds)
                digests[mode].add(digest)
        assert all(len(d) == 1 for d in digests.values()), "the same seed gave different bytes"

        exact = {s["name"]: s for s in read_manifest(work / "out-exact")["mix"]["stages"][0]["sources"]}
        print(f"mix budget {budget / 1e6:.2f} M tokens, weights {WEIGHTS}, {args.rounds} interleaved rounds\n")
        print("| source | documents | MB | tokens (EOS incl., exact) | bytes/token |\n|---|---|---|---|---|")
        for name in WEIGHTS:
            tokens = exact[name]["source_units"]
            print(
                f"| {name} | {counts[name]:,} | {corpus_bytes[name] / 1e6:.1f} | {tokens / 1e6:.2f} M | "
                f"{corpus_bytes[name] / tokens:.2f} |"
            )

        shares = {mode: packed_shares(work, mode) for mode in modes}
        target = {name: weight / sum(WEIGHTS.values()) for name, weight in WEIGHTS.items()}
        print(
            "\n| mode | wall s, median (each round) | wall vs exact | CPU s, median (each round) | CPU vs exact | "
            "max share error (points) |\n|---|---|---|---|---|---|"
        )
        for mode, runs in times.items():
            error = max(abs(shares[mode][n] - target[n]) for n in WEIGHTS) * 100
            print(
                f"| {mode} | {statistics.median(runs):.2f} ({', '.join(f'{t:.1f}' for t in runs)}) | "
                f"{statistics.median(runs) / statistics.median(times['exact']):.2f} | "
                f"{statistics.median(cpu[mode]):.2f} ({', '.join(f'{t:.1f}' for t in cpu[mode])}) | "
                f"{statistics.median(cpu[mode]) / statistics.median(cpu['exact']):.2f} | {error:.3f} |"
            )
        print(
            "\n| source | target | mode | share as pack counts | sample's bytes/token (EOS excl.) | fit: tokens/byte, "
            "+ per extra byte | sampled documents | large documents (counted exactly) | relative standard error "
            "| split-half error |"
            "\n|---|---|---|---|---|---|---|---|---|---|"
        )
        for name in WEIGHTS:
            for mode in modes:
                e = read_manifest(work / f"out-{mode}")["mix"]["token_estimate"]["sources"][name]
                calibration = (
                    (
                        f"{e['bytes_per_token']:.3f} | {e['tokens_per_byte']:.4f}, {e['tokens_per_extra_byte']:+.4f} | "
                        f"{e['sample_documents']:,} | {e['large_documents']:,} ({e['large_bytes'] / 1e6:.2f} MB) | "
                        f"{e['relative_standard_error']:.2%} | {e['holdout_error']:.2%}"
                    )
                    if e["mode"] == "sample"
                    else "| | | | |"
                )
                print(f"| {name} | {target[name]:.4f} | {mode} | {shares[mode][name]:.4f} | {calibration} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
