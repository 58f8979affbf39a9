"""CPU time of each MinHash kernel, the C extension against its numpy fallback, on the sample corpus repeated.

    .venv/bin/python benchmarks/minhash_kernels_bench.py --copies 8 --repeat 5
    .venv/bin/python benchmarks/minhash_kernels_bench.py --kernels c     # one side only, e.g. to compare two builds
    .venv/bin/python benchmarks/minhash_kernels_bench.py --text 'corpus/part-*.parquet' --baseline old/_minhash.abi3.so

The kernels are called through smolctl.data.minhash as dedup calls them (tokenize, ngrams, signatures,
sorted_sets, jaccard_many, estimate_jaccard), on the web, code and math samples `--copies` times over, with 200,000 random
pairs for the two pair kernels. Each kernel's best process CPU time over `--repeat` rounds is reported; the
sides alternate round by round so that a loaded machine's drift reaches both alike.

--text times only the tokeniser kernel (_minhash.tokenize, without normalisation) on real documents: the
"text" column of the parquet files, in batches of dedup's BATCH_ROWS, as ns per word it returns and per
input byte, against --baseline (another build of the extension, e.g. main's) round by round.
"""

from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from smolctl.data import minhash_fallback
from smolctl.data.dedup_stages import BATCH_ROWS
from smolctl.data.minhash import kernels, params

REPO = Path(__file__).resolve().parent.parent
PAIRS = 200_000


def sample_texts(copies: int) -> pa.Array:
    texts = []
    for name in ("web", "code", "math"):
        for path in sorted((REPO / "data" / "sample" / name).glob("part-*.parquet")):
            texts += pq.read_table(path, columns=["text"]).column(0).to_pylist()
    return pa.array(texts * copies, pa.large_string())


def one_round(texts: pa.Array, best: dict[str, float]) -> None:
    """Every kernel once, through the module-level kernels minhash currently uses."""
    rng = np.random.default_rng(0)
    left, right = rng.integers(0, len(texts), PAIRS), rng.integers(0, len(texts), PAIRS)

    def timed(name: str, function, *args):
        started = time.process_time()
        result = function(*args)
        best[name] = min(best.get(name, float("inf")), time.process_time() - started)
        return result

    tokens = timed("tokenize", kernels.tokenize, texts)
    shingled = timed("shingles", kernels.ngrams, tokens.words, tokens.word_offsets, 5)
    signatures = timed("signatures", kernels.signatures, *shingled, params.MinHashParams().permutations())
    sets = timed("sorted_sets", kernels.sorted_sets, *shingled)
    timed("intersections", kernels.jaccard_many, *sets, left, right)
    timed("agreements", kernels.estimate_jaccard, signatures, left, right)


def load_build(path: str):
    """Another build of the extension, e.g. main's, as its own module (its init function is PyInit__minhash)."""
    spec = importlib.util.spec_from_file_location(
        "baseline._minhash", path, loader=importlib.machinery.ExtensionFileLoader("baseline._minhash", path)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordedCalls:
    """Stands in for the kernels module and keeps the arguments of each tokenize call (then runs the real one)."""

    def __init__(self, kernels_module):
        self.kernels_module, self.calls = kernels_module, []

    def tokenize(self, *args):
        self.calls.append(args)
        return self.kernels_module.tokenize(*args)

    def __getattr__(self, name: str):
        return getattr(self.kernels_module, name)  # the other kernels (changing_documents) run unrecorded


def tokenizer_on_text(pattern: str, sides: dict, repeat: int) -> None:
    """The tokenize kernel alone on the batches dedup would pass it: each side's best total over `repeat` rounds."""
    recorder = RecordedCalls(kernels._minhash)
    kernels._minhash = recorder
    for path in sorted(glob.glob(pattern)):
        for batch in pq.ParquetFile(path).iter_batches(BATCH_ROWS, columns=["text"]):
            kernels.tokenize(batch.column(0))
    kernels._minhash = recorder.kernels_module
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeat):
        for side, module in sides.items():
            words, started = 0, time.process_time()
            for args in recorder.calls:
                words += module.tokenize(*args)
            best[side] = min(best[side], time.process_time() - started)
    documents = sum(len(args[2]) for args in recorder.calls)
    size = sum(int((args[3] - args[2]).sum()) for args in recorder.calls)
    print(f"\ntokenize alone: {documents:,} documents of {pattern}, {size / 1e6:.1f} MB, {words:,} words")
    print("| build | ms | ns/word | ns/byte |" + (" baseline / this |" if len(sides) == 2 else ""))
    print("|---|---|---|---|" + ("---|" if len(sides) == 2 else ""))
    for side, seconds in best.items():
        ratio = [f" {best['baseline'] / seconds:.2f}x |"] if len(sides) == 2 else []
        cells = f"| {side} | {seconds * 1000:.0f} | {seconds * 1e9 / words:.1f} | {seconds * 1e9 / size:.2f} |"
        print(cells + "".join(ratio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8, help="How many times the sample corpus is repeated.")
    parser.add_argument("--repeat", type=int, default=5, help="Rounds; each kernel's fastest is reported.")
    parser.add_argument("--kernels", choices=["both", "c", "numpy"], default="both")
    parser.add_argument("--text", help="Parquet files (a glob) of real documents for the tokeniser alone.")
    parser.add_argument("--baseline", help="Another build of _minhash (.so) to time the tokeniser against.")
    args = parser.parse_args()
    if args.text:
        builds = {"baseline": load_build(args.baseline)} if args.baseline else {}
        tokenizer_on_text(args.text, {**builds, "this": kernels._minhash}, args.repeat)
        return
    texts = sample_texts(args.copies)
    sides = {"c": kernels._minhash, "numpy": minhash_fallback}
    if args.kernels != "both":
        sides = {args.kernels: sides[args.kernels]}
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    for _ in range(args.repeat):
        for side, implementation in sides.items():
            kernels._minhash = implementation
            one_round(texts, best[side])
    megabytes = sum(len(t.encode()) for t in texts.to_pylist()) / 1e6
    print(
        f"{len(texts):,} documents, {megabytes:.1f} MB; C kernels from {Path(sides.get('c', minhash_fallback).__file__).name}"
    )
    print("| kernel | " + " | ".join(f"{side} ms" for side in sides) + (" | numpy / c |" if len(sides) == 2 else " |"))
    print("|---" * (len(sides) + 1 + (len(sides) == 2)) + "|")
    for name in best[next(iter(sides))]:
        cells = [f"{best[side][name] * 1000:.1f}" for side in sides]
        ratio = [f"{best['numpy'][name] / best['c'][name]:.1f}x"] if len(sides) == 2 else []
        print(f"| {name} | " + " | ".join(cells + ratio) + " |")


if __name__ == "__main__":
    main()
