"""Near-duplicate removal, smolctl vs rensa and datasketch, each a whole process on one CPU, against exact ground truth.

    .venv/bin/python benchmarks/dedup_bench.py --docs 25000 --repeat 5 --cpu 0
    .venv/bin/python benchmarks/dedup_bench.py --scale 1000000 --scale-corpus /tmp/dedup-1m --repeat 2
    .venv/bin/python benchmarks/dedup_bench.py --startup --repeat 21
    mkdir /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before && (cd /tmp/before && python setup.py -q build_ext --inplace)
    .venv/bin/python benchmarks/dedup_bench.py --methods smolctl,rensa --baseline /tmp/before --repeat 16
    .venv/bin/python benchmarks/dedup_bench.py --methods smolctl,rensa --baseline /tmp/before --instructions --repeat 1

1. Corpus: the sample corpus plus /usr/share/doc texts (real prose, licences, changelogs: natural near
   duplicates included), cut into ~1.2 KB documents; 15% of them get a planted copy with random word edits
   (0-30% of the words, so similarities spread across the threshold) and 3% an exact copy with case and
   spacing changes, each inserted somewhere later. The corpus's digest is printed with it: another machine's, or
   this one after a package install, gives another corpus, and its figures do not compare.
2. Ground truth: the exact Jaccard of every pair of documents sharing a word 5-gram (a sparse product of the
   document x shingle matrix), pairs at or above the threshold joined into clusters; all but the first document
   of each cluster should go.
3. Each method runs as a fresh process pinned to the same CPU, end to end from the parquet shards (start-up and
   imports, reading, hashing, indexing, deciding, writing the kept documents), in interleaved rounds: wall and
   CPU seconds, ratios against rensa within each round, peak RSS, precision / recall / F1 of the removed set,
   documents removed without any true duplicate, and clusters of distinct documents emptied entirely.

With --baseline, smolctl from another source tree (its kernels built) runs in the same rounds, and the change's
effect is printed as the median of each round's CPU difference: at ~1% effects the machine's drift between
rounds is larger than the effect, and only runs side by side show it.

With --instructions, every run goes through valgrind's cachegrind and also counts the instructions its whole
process executed: the same from run to run within ~0.1%, whatever else the machine is doing, so a change of a
few milliseconds shows in one round. It is not time: SIMD kernels do more per instruction than the
interpreter, so the ratio against rensa in instructions is lower than in CPU seconds (and the wall and CPU
columns then time valgrind, ~40x slower).

smolctl runs as its CLI (`python -m smolctl dedup CORPUS OUT --minhash --workers 1`). rensa runs exactly as its
README shows (RMinHashDeduplicator(threshold, num_perm=128, use_lsh=True).add_pairs of (key, text.split())), and
once more fed the ground truth's word 5-gram shingles; datasketch as its README shows (MinHash.bulk + MinHashLSH,
query then insert) on those shingles. All write the kept documents as smolctl does (zstd parquet).
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
NGRAM = 5
ASCII_PUNCTUATION = "".join(chr(c) for c in range(33, 127) if not (chr(c).isalnum() or chr(c) == "_"))


def shingles(text: str) -> set[tuple[str, ...]]:
    """Word 5-grams, words being the whitespace-separated tokens of the NFKC case-folded text stripped of leading
    and trailing ASCII punctuation: smolctl's documented definition, computed here in plain Python (and fed to
    datasketch, so that both are scored on the same notion of similarity)."""
    import unicodedata

    tokens = unicodedata.normalize("NFKC", text).casefold().split()
    words = [w for w in (t.strip(ASCII_PUNCTUATION) for t in tokens) if w]
    return {tuple(words[j : j + NGRAM]) for j in range(max(1, len(words) - NGRAM + 1))} if words else set()


# ---------------------------------------------------------------------------------------------------------------
# Corpus and ground truth


def source_texts() -> list[str]:
    texts = []
    for name in ("web", "code", "math"):
        for path in sorted((REPO / "data" / "sample" / name).glob("part-*.parquet")):
            texts += [t for t in pq.read_table(path, columns=["text"]).column(0).to_pylist() if t]
    for path in sorted(Path("/usr/share/doc").rglob("*")):
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            texts.append(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
    return texts


def cut_documents(texts: list[str], target: int = 1200) -> list[str]:
    """Paragraph-aligned pieces of about `target` characters (at least 300)."""
    docs = []
    for text in texts:
        piece = ""
        for paragraph in re.split(r"\n\s*\n", text):
            piece = f"{piece}\n\n{paragraph}" if piece else paragraph
            if len(piece) >= target:
                docs.append(piece[: 2 * target])
                piece = ""
        if len(piece) >= 300:
            docs.append(piece)
    return docs


def edit(text: str, fraction: float, rng: random.Random) -> str:
    words = text.split(" ")
    for _ in range(int(len(words) * fraction)):
        i = rng.randrange(len(words))
        action = rng.random()
        if action < 0.5:
            words[i] = rng.choice(words)
        elif action < 0.75 and len(words) > 1:
            del words[i]
        else:
            words.insert(i, rng.choice(words))
    return " ".join(words)


def build_corpus(folder: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool = cut_documents(source_texts())
    rng.shuffle(pool)
    base = pool[: int(docs / 1.18)]
    planted: list[tuple[int, str]] = []
    for i, text in enumerate(base):
        roll = rng.random()
        if roll < 0.15:
            planted.append((rng.randrange(i + 1, len(base) + 1), edit(text, rng.uniform(0.0, 0.3), rng)))
        elif roll < 0.18:
            planted.append((rng.randrange(i + 1, len(base) + 1), "  " + text.upper().replace(" ", "  ") + "\n"))
    planted.sort(key=lambda p: p[0])
    corpus, k = [], 0
    for i in range(len(base) + 1):
        while k < len(planted) and planted[k][0] == i:
            corpus.append(planted[k][1])
            k += 1
        if i < len(base):
            corpus.append(base[i])
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [f"d{i}" for i in range(len(corpus))], "text": corpus})
    bounds = np.linspace(0, len(corpus), 5).astype(int)
    for k in range(4):
        pq.write_table(table.slice(bounds[k], bounds[k + 1] - bounds[k]), folder / f"part-{k:05d}.parquet")
    return corpus


def ground_truth(corpus: list[str], threshold: float) -> dict:
    """Exact Jaccard over every pair sharing a shingle; clusters of pairs >= threshold; who should be removed."""
    from scipy import sparse

    ids: dict[tuple, int] = {}
    rows, cols = [], []
    for doc, text in enumerate(corpus):
        for shingle in shingles(text):
            rows.append(doc)
            cols.append(ids.setdefault(shingle, len(ids)))
    matrix = sparse.csr_matrix((np.ones(len(rows), np.int32), (rows, cols)), shape=(len(corpus), len(ids)))
    sizes = np.asarray(matrix.sum(axis=1)).ravel()
    common = sparse.triu(matrix @ matrix.T, k=1).tocoo()
    similarity = common.data / (sizes[common.row] + sizes[common.col] - common.data)
    near = similarity >= threshold
    left, right = common.row[near], common.col[near]
    parent = list(range(len(corpus)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in zip(left.tolist(), right.tolist()):
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    roots = [find(i) for i in range(len(corpus))]
    has_duplicate = set(left.tolist()) | set(right.tolist())
    members: dict[int, list[int]] = {}
    for doc in has_duplicate:
        members.setdefault(roots[doc], []).append(doc)
    return {
        "remove": {d for d in has_duplicate if roots[d] != d},
        "has_duplicate": has_duplicate,
        "clusters": list(members.values()),
        "pairs": int(near.sum()),
    }


# ---------------------------------------------------------------------------------------------------------------
# Methods: each runs as a whole process of its own (start-up and imports included), pinned to one CPU


def smolctl_command(corpus: Path, work: Path, threshold: float) -> list[str]:
    """The CLI as a user types it."""
    return [
        sys.executable,
        "-m",
        "smolctl",
        "dedup",
        str(corpus),
        str(work / "out"),
        "--minhash",
        "--threshold",
        str(threshold),
        "--workers",
        "1",
        "--json",
    ]


def smolctl_removed(work: Path) -> list[int]:
    report = pq.read_table(work / "out" / "duplicates" / "part-00000.parquet", columns=["id"])
    return [int(i[1:]) for i in report.column(0).to_pylist()]


def run_rensa(corpus: Path, work: Path, threshold: float, tokens=str.split) -> list[int]:
    """rensa exactly as its README shows: RMinHashDeduplicator(threshold, num_perm=128, use_lsh=True) and add_pairs
    of (key, text.split()), the kept documents written out (zstd, as smolctl writes them)."""
    from rensa import RMinHashDeduplicator

    deduplicator, removed, doc = RMinHashDeduplicator(threshold=threshold, num_perm=128, use_lsh=True), [], 0
    (work / "kept").mkdir()
    for path in sorted(corpus.glob("part-*.parquet")):
        table = pq.read_table(path)
        texts, first = table.column("text").to_pylist(), doc
        keep = deduplicator.add_pairs((str(first + i), tokens(t)) for i, t in enumerate(texts))
        removed += [first + i for i, kept in enumerate(keep) if not kept]
        doc += len(texts)
        pq.write_table(table.filter(pa.array(keep)), work / "kept" / path.name, compression="zstd")
    return removed


def run_rensa_shingles(corpus: Path, work: Path, threshold: float) -> list[int]:
    """rensa as above, given the ground truth's word 5-gram shingles instead of single words, so that it is
    scored on the same similarity (the shingling is Python, as a user would write it)."""
    return run_rensa(corpus, work, threshold, tokens=lambda text: [" ".join(s) for s in shingles(text)])


def run_datasketch(corpus: Path, work: Path, threshold: float) -> list[int]:
    """datasketch as its README shows: MinHash.bulk over the shingles, MinHashLSH, query then insert."""
    from datasketch import MinHash, MinHashLSH

    lsh, removed, doc = MinHashLSH(threshold=threshold, num_perm=128), [], 0
    (work / "kept").mkdir()
    for path in sorted(corpus.glob("part-*.parquet")):
        table = pq.read_table(path)
        texts, first = table.column("text").to_pylist(), doc
        for start in range(0, len(texts), 1000):
            batch = [[" ".join(s).encode() for s in shingles(t)] for t in texts[start : start + 1000]]
            for signature in MinHash.bulk(batch, num_perm=128):
                if lsh.query(signature):
                    removed.append(doc)
                else:
                    lsh.insert(doc, signature)
                doc += 1
        keep = np.ones(len(texts), bool)
        keep[[d - first for d in removed if d >= first]] = False
        pq.write_table(table.filter(pa.array(keep)), work / "kept" / path.name, compression="zstd")
    return removed


METHODS = {"rensa": run_rensa, "rensa-shingles": run_rensa_shingles, "datasketch": run_datasketch}
LABELS = {
    "smolctl": "smolctl dedup --minhash (CLI, defaults: 20 x 5 bands, verified)",
    "rensa": "rensa RMinHashDeduplicator (128 perm, LSH), words as its README (text.split())",
    "rensa-shingles": "rensa RMinHashDeduplicator, fed the word 5-gram shingles",
    "datasketch": "datasketch MinHash.bulk + MinHashLSH (128 perm)",
}


def prepare(folder: Path, docs: int, threshold: float) -> None:
    """Write the corpus's shards and its ground truth (truth.json beside them)."""
    corpus = build_corpus(folder, docs)
    truth = ground_truth(corpus, threshold)
    facts = {
        "documents": len(corpus),
        "megabytes": sum(len(t.encode()) for t in corpus) / 1e6,
        # The corpus is what this machine's /usr/share/doc holds: installing a package changes it, and with it
        # every figure. Runs are comparable only where this digest is the same.
        "digest": hashlib.sha256("\0".join(corpus).encode()).hexdigest()[:12],
        "pairs": truth["pairs"],
        "remove": sorted(truth["remove"]),
        "has_duplicate": sorted(truth["has_duplicate"]),
        "clusters": [sorted(c) for c in truth["clusters"]],
    }
    (folder / "truth.json").write_text(json.dumps(facts, default=int))


def child(method: str, corpus: Path, work: Path, threshold: float) -> None:
    removed = METHODS[method](corpus, work, threshold)
    (work / "removed.json").write_text(json.dumps(removed))


def run_whole_process(
    method: str, corpus: Path, threshold: float, cpu: int, tree: Path = REPO, instructions: bool = False
) -> dict:
    """One run of a method as a fresh process pinned to `cpu`: wall and CPU seconds of the whole process (start-up
    and imports included), its peak RSS, and the documents it removed; with `instructions`, run under cachegrind,
    also the instructions it executed. smolctl runs from the source tree `tree`, as its working directory and
    PYTHONPATH (`python -m` puts the working directory first on sys.path)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        counter = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={work / 'counts'}"]
        command = (counter if instructions else []) + (
            smolctl_command(corpus, work, threshold)
            if method == "smolctl"
            else [
                sys.executable,
                __file__,
                "--child",
                method,
                "--corpus",
                str(corpus),
                "--work",
                str(work),
                "--threshold",
                str(threshold),
            ]
        )
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        stderr = process.stderr.read()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            sys.exit(f"{method} failed:\n{stderr.decode()[-3000:]}")
        removed = smolctl_removed(work) if method == "smolctl" else json.loads((work / "removed.json").read_text())
        # cachegrind's file ends with "summary: <instructions>" (Ir, the only event counted without --cache-sim).
        counted = re.search(r"^summary: (\d+)", (work / "counts").read_text(), re.M) if instructions else None
    return {
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "max_rss_mib": usage.ru_maxrss / 1024,
        "removed": removed,
        "instructions": int(counted.group(1)) if counted else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Scoring and the table


def score(removed: list[int], truth: dict) -> dict:
    removed_set = set(removed)
    hits = len(removed_set & truth["remove"])
    precision = hits / len(removed_set) if removed_set else 1.0
    recall = hits / len(truth["remove"]) if truth["remove"] else 1.0
    return {
        "removed": len(removed_set),
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "no_duplicate": len(removed_set - truth["has_duplicate"]),
        "emptied": sum(all(d in removed_set for d in c) for c in truth["clusters"]),
    }


def write_scaled_corpus(folder: Path, docs: int) -> None:
    """`docs` synthetic ~1 KB documents: the words of the real corpus drawn with their real frequencies, 5% planted
    near copies.

    The words are ranked by frequency, not by spelling: weights of 1/rank over an alphabetical vocabulary (this
    function's first version) put tokens that start with punctuation ("!", "#19948,") at the top, so 97% of its
    tokens carried punctuation and the tokeniser ran on its slow path for nearly every word."""
    rng = np.random.default_rng(0)
    counts = Counter(w for t in cut_documents(source_texts()[:3000]) for w in t.split())
    vocabulary = sorted(counts, key=lambda w: (-counts[w], w))
    weights = np.array([counts[w] for w in vocabulary], dtype=np.float64)
    weights /= weights.sum()
    folder.mkdir(parents=True)
    shard_docs = 100_000
    for shard in range(0, docs, shard_docs):
        count = min(shard_docs, docs - shard)
        words = rng.choice(len(vocabulary), size=(count, 160), p=weights)
        texts = [" ".join(vocabulary[w] for w in row) for row in words]
        for i in rng.choice(count - 1, size=count // 20, replace=False):
            edited = texts[i].split(" ")
            edited[rng.integers(len(edited))] = "zq"
            texts[i + 1] = " ".join(edited)
        pq.write_table(
            pa.table({"id": [f"d{shard + i}" for i in range(count)], "text": texts}),
            folder / f"part-{shard // shard_docs:05d}.parquet",
        )


def scaled_run(docs: int, threshold: float, cpu: int, repeat: int, corpus: Path | None) -> None:
    """smolctl alone on `docs` synthetic documents, whole process on one core: time and peak RSS. `corpus` keeps
    the generated documents between invocations (generating a million takes longer than deduplicating them)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = corpus or Path(tmp) / "corpus"
        if not folder.exists():
            write_scaled_corpus(folder, docs)
        megabytes = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        for _ in range(repeat):
            result = run_whole_process("smolctl", folder, threshold, cpu)
            print(
                f"scaled run: {docs:,} documents ({megabytes:.0f} MB of parquet), smolctl whole process on CPU {cpu}: "
                f"{result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU ({docs / result['seconds']:,.0f} docs/s), "
                f"peak RSS {result['max_rss_mib']:.0f} MiB, {len(result['removed']):,} removed",
                flush=True,
            )


STARTUP_LADDER = (
    "pass",
    "import numpy",
    "import pyarrow",
    "import pyarrow.parquet",
    "import pyarrow.parquet, typer",
    "import pyarrow.parquet, typer, numpy.random",
    "import smolctl.cli, smolctl.data.dedup",
)


def startup(cpu: int, repeat: int) -> None:
    """CPU time of fresh processes that only import, a ladder of what a dedup run imports, in interleaved rounds:
    the difference between two rungs is what the later imports cost a whole process (import-time tables count
    their own overhead and miss the loader's)."""
    times: dict[str, list[float]] = {code: [] for code in STARTUP_LADDER}
    for _ in range(repeat):
        for code in STARTUP_LADDER:
            process = subprocess.Popen(
                [sys.executable, "-c", code], cwd=REPO, preexec_fn=lambda: os.sched_setaffinity(0, {cpu})
            )
            _, status, usage = os.wait4(process.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"python -c {code!r} failed")
            times[code].append((usage.ru_utime + usage.ru_stime) * 1000)
    print(f"| python -c (one CPU, {repeat} interleaved rounds) | CPU ms, median | min |\n|---|---:|---:|")
    for code, values in times.items():
        print(f"| `{code}` | {float(np.median(values)):.1f} | {min(values):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=25000)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--methods", default="smolctl,rensa,rensa-shingles,datasketch")
    parser.add_argument("--repeat", type=int, default=5, help="Rounds (each runs every method once, interleaved).")
    parser.add_argument("--cpu", type=int, default=0, help="The one CPU every method is pinned to.")
    parser.add_argument(
        "--scale", type=int, help="Only measure smolctl's time and memory on this many synthetic documents."
    )
    parser.add_argument("--scale-corpus", type=Path, help="Folder to keep the --scale documents in (made if missing).")
    parser.add_argument("--startup", action="store_true", help="Only measure what a run's imports cost a process.")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="Also run smolctl from this source tree (its kernels built), in the same rounds, and print the change.",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="Run every process under valgrind's cachegrind and also count its instructions (deterministic).",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.corpus, args.work, args.threshold)
        return
    # Python caches bytecode on the first import, but where PYTHONDONTWRITEBYTECODE is set (this sandbox sets it)
    # every smolctl run would compile its modules again, which neither an installed smolctl nor rensa pays.
    compileall.compile_dir(str(REPO / "smolctl"), quiet=1)
    if args.startup:
        startup(args.cpu, args.repeat)
        return
    if args.scale:
        scaled_run(args.scale, args.threshold, args.cpu, args.repeat, args.scale_corpus)
        return
    if args.prepare:
        prepare(args.corpus, args.docs, args.threshold)
        return
    methods = args.methods.split(",")
    if args.instructions and shutil.which("valgrind") is None:
        sys.exit("--instructions counts with valgrind, which is not on PATH (apt install valgrind)")
    if args.baseline:
        if "smolctl" not in methods:
            sys.exit("--baseline is compared with this tree's smolctl: keep smolctl in --methods")
        baseline_tree = args.baseline.resolve()
        if not list((baseline_tree / "smolctl" / "data").glob("_minhash*.so")):
            sys.exit(f"{baseline_tree}: its kernels are not built; run `python setup.py -q build_ext --inplace` there")
        compileall.compile_dir(str(baseline_tree / "smolctl"), quiet=1)
        methods.append("baseline")
        LABELS["baseline"] = f"smolctl dedup --minhash from {baseline_tree}"
    with tempfile.TemporaryDirectory() as tmp:
        corpus_dir = Path(tmp) / "corpus"
        # In a process of its own: a child's peak RSS starts from its parent's (Linux carries it over fork and
        # exec), so this process stays small while the methods run.
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--prepare",
                "--corpus",
                str(corpus_dir),
                "--docs",
                str(args.docs),
                "--threshold",
                str(args.threshold),
            ],
            check=True,
        )
        facts = json.loads((corpus_dir / "truth.json").read_text())
        truth = {
            "remove": set(facts["remove"]),
            "has_duplicate": set(facts["has_duplicate"]),
            "clusters": facts["clusters"],
        }
        documents, megabytes = facts["documents"], facts["megabytes"]
        print(
            f"corpus: {documents} documents, {megabytes:.1f} MB, {megabytes * 1e6 / documents:.0f} B/doc; "
            f"ground truth: {facts['pairs']} pairs >= {args.threshold}, {len(truth['remove'])} documents to remove; "
            f"digest {facts['digest']}",
            flush=True,
        )
        # Rounds interleave the methods (A B C, B C A, C A B, not A A B B), so that a change in the machine's speed
        # during the run (shared machines drift by 10-30% within minutes) reaches every method alike, and no method
        # always runs after the same one.
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for round_ in range(args.repeat):
            shift = round_ % len(methods)
            for method in methods[shift:] + methods[:shift]:
                tree = baseline_tree if method == "baseline" else REPO
                program = "smolctl" if method == "baseline" else method
                run = run_whole_process(program, corpus_dir, args.threshold, args.cpu, tree, args.instructions)
                runs[method].append(run)
            print(
                f"  round {round_ + 1}: "
                + ", ".join(
                    f"{m} {runs[m][-1]['seconds']:.2f} s ({runs[m][-1]['cpu_seconds']:.2f} s CPU"
                    + (f", {runs[m][-1]['instructions'] / 1e9:.3f} G instructions)" if args.instructions else ")")
                    for m in methods
                ),
                flush=True,
            )
    baseline = "rensa" if "rensa" in methods else methods[0]
    print(f"\nload average after the runs: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs)")
    header = (
        "| method | wall s (median) | CPU s (median) | docs/s | vs rensa, wall (median of rounds) | vs rensa, CPU "
        + ("| G instructions (median) | vs rensa, instructions " if args.instructions else "")
        + "| peak RSS | removed | precision | recall | F1 | removed w/o duplicate | clusters emptied |"
    )
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for method in methods:
        wall = float(np.median([r["seconds"] for r in runs[method]]))
        cpu = float(np.median([r["cpu_seconds"] for r in runs[method]]))
        # Ratios within each round (the runs side by side), then their median.
        wall_ratio = np.median([b["seconds"] / r["seconds"] for r, b in zip(runs[method], runs[baseline])])
        cpu_ratio = np.median([b["cpu_seconds"] / r["cpu_seconds"] for r, b in zip(runs[method], runs[baseline])])
        quality = score(runs[method][0]["removed"], truth)
        same = all(sorted(r["removed"]) == sorted(runs[method][0]["removed"]) for r in runs[method])
        counted = ""
        if args.instructions:
            count = float(np.median([r["instructions"] for r in runs[method]]))
            ratio = np.median([b["instructions"] / r["instructions"] for r, b in zip(runs[method], runs[baseline])])
            counted = f"{count / 1e9:.3f} | {ratio:.2f}x | "
        print(
            f"| {LABELS[method]} | {wall:.2f} | {cpu:.2f} | {documents / wall:,.0f} | {wall_ratio:.2f}x | {cpu_ratio:.2f}x | "
            f"{counted}{max(r['max_rss_mib'] for r in runs[method]):.0f} MiB | {quality['removed']}{'' if same else ' (varies)'} | "
            f"{quality['precision']:.4f} | {quality['recall']:.4f} | {quality['f1']:.4f} | {quality['no_duplicate']} | "
            f"{quality['emptied']} |"
        )
    if args.baseline:
        # Each round's difference, then their median: the rounds run side by side, the machine drifts between them.
        change = np.median([n["cpu_seconds"] - b["cpu_seconds"] for n, b in zip(runs["smolctl"], runs["baseline"])])
        before = float(np.median([b["cpu_seconds"] for b in runs["baseline"]]))
        print(
            f"\nthis tree against {baseline_tree}: {change * 1000:+.0f} ms CPU, the median of {args.repeat} rounds' "
            f"differences ({change / before:+.1%} of the baseline's median {before:.3f} s)"
        )
        if args.instructions:
            counts = [(n["instructions"], b["instructions"]) for n, b in zip(runs["smolctl"], runs["baseline"])]
            change = np.median([n - b for n, b in counts])
            before = float(np.median([b for _, b in counts]))
            print(
                f"this tree against {baseline_tree}: {change / 1e6:+.1f} M instructions, the median of {args.repeat} "
                f"rounds' differences ({change / before:+.2%} of the baseline's median {before / 1e9:.3f} G)"
            )


if __name__ == "__main__":
    main()
