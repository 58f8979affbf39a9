"""Near-duplicate removal, smolctl vs datasketch (vs datatrove), one core each, against exact ground truth.

    .venv/bin/python benchmarks/dedup_bench.py --docs 20000

1. Corpus: the sample corpus plus /usr/share/doc texts (real prose, licences, changelogs: natural near
   duplicates included), cut into ~1.2 KB documents; 15% of them get a planted copy with random word edits
   (0-30% of the words, so similarities spread across the threshold) and 3% an exact copy with case and
   spacing changes, each inserted somewhere later.
2. Ground truth: the exact Jaccard of every pair of documents sharing a word 5-gram (a sparse product of the
   document x shingle matrix), pairs at or above the threshold joined into clusters; all but the first document
   of each cluster should go.
3. Each method runs in its own process pinned to one CPU, end to end from the parquet shards (reading, hashing,
   indexing, deciding, writing the kept documents): docs/s, MB/s, peak RSS,
   precision / recall / F1 of the removed set, documents removed without any true duplicate, and clusters of
   distinct documents emptied entirely.

datasketch is used the documented way: MinHash.bulk over the 5-gram shingles, MinHashLSH(threshold, 128
permutations), query then insert. datatrove (optional: pip install datatrove) runs its 4-stage MinHash pipeline
with default settings and a whitespace word tokenizer (its English tokenizer needs spaCy).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
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
    return {tuple(words[j:j + NGRAM]) for j in range(max(1, len(words) - NGRAM + 1))} if words else set()


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
                docs.append(piece[:2 * target])
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
    base = pool[:int(docs / 1.18)]
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
    return {"remove": {d for d in has_duplicate if roots[d] != d}, "has_duplicate": has_duplicate,
            "clusters": list(members.values()), "pairs": int(near.sum())}


# ---------------------------------------------------------------------------------------------------------------
# Methods (each runs in its own pinned process)


def run_smolctl(corpus: Path, work: Path, threshold: float) -> list[int]:
    from smolctl.data.dedup import DedupConfig, run
    from smolctl.data.minhash.params import MinHashParams

    run(DedupConfig(input=str(corpus), output=str(work / "out"), minhash=MinHashParams.for_threshold(threshold)), workers=1)
    report = pq.read_table(work / "out" / "duplicates" / "part-00000.parquet", columns=["id"])
    return [int(i[1:]) for i in report.column(0).to_pylist()]


def run_datasketch(corpus: Path, work: Path, threshold: float) -> list[int]:
    from datasketch import MinHash, MinHashLSH

    lsh, removed, doc = MinHashLSH(threshold=threshold, num_perm=128), [], 0
    (work / "kept").mkdir()
    for path in sorted(corpus.glob("part-*.parquet")):
        table = pq.read_table(path)
        texts, first = table.column("text").to_pylist(), doc
        for start in range(0, len(texts), 1000):
            batch = [[" ".join(s).encode() for s in shingles(t)] for t in texts[start:start + 1000]]
            for signature in MinHash.bulk(batch, num_perm=128):
                if lsh.query(signature):
                    removed.append(doc)
                else:
                    lsh.insert(doc, signature)
                doc += 1
        # End to end like the others: the kept documents are written out (zstd, as smolctl writes them).
        keep = np.ones(len(texts), bool)
        keep[[d - first for d in removed if d >= first]] = False
        pq.write_table(table.filter(pa.array(keep)), work / "kept" / path.name, compression="zstd")
    return removed


def run_datatrove(corpus: Path, work: Path, threshold: float) -> list[int]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        def word_tokenize(self, text):
            return text.split()

        def sent_tokenize(self, text):
            return [text]

        def span_tokenize(self, text):
            return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]

    import xxhash
    from datatrove.utils.hashes import xxhash as datatrove_xxhash

    # datatrove 0.10.1 hashes str with xxhash, which xxhash 4 refuses; encoding first keeps its default hash.
    datatrove_xxhash.xxhash64 = lambda data: xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data)
    config = MinhashConfig()
    reader = lambda: ParquetReader(str(corpus), text_key="text", id_key="id", glob_pattern="part-*.parquet")  # noqa: E731
    stages = [
        ([reader(), MinhashDedupSignature(str(work / "sigs"), config=config, language=Whitespace())], 1),
        ([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)], config.num_buckets),
        ([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config)], 1),
        ([reader(), MinhashDedupFilter(str(work / "remove"), exclusion_writer=JsonlWriter(str(work / "removed"), compression=None)),
          JsonlWriter(str(work / "kept"), compression=None)], 1),
    ]
    for index, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(work / f"logs{index}")).run()
    removed = []
    for path in (work / "removed").glob("*.jsonl"):
        removed += [int(json.loads(line)["id"][1:]) for line in path.read_text().splitlines()]
    return sorted(removed)


METHODS = {"smolctl": run_smolctl, "datasketch": run_datasketch, "datatrove": run_datatrove}


def child(method: str, corpus: Path, threshold: float) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    # Imports are not throughput: load each method's modules (and pandas, which pyarrow.compute pulls in on first
    # use) before the clock starts.
    import pandas  # noqa: F401

    {"smolctl": lambda: __import__("smolctl.data.dedup"), "datasketch": lambda: __import__("datasketch"),
     "datatrove": lambda: __import__("datatrove.pipeline.dedup")}[method]()
    with tempfile.TemporaryDirectory() as tmp:
        started, cpu_started = time.perf_counter(), time.process_time()
        removed = METHODS[method](corpus, Path(tmp), threshold)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would report the parent's peak.
    peak_kib = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "removed": removed, "max_rss_mib": peak_kib / 1024}))


# ---------------------------------------------------------------------------------------------------------------
# Scoring and the table


def score(removed: list[int], truth: dict) -> dict:
    removed_set = set(removed)
    hits = len(removed_set & truth["remove"])
    precision = hits / len(removed_set) if removed_set else 1.0
    recall = hits / len(truth["remove"]) if truth["remove"] else 1.0
    return {"removed": len(removed_set), "precision": precision, "recall": recall,
            "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
            "no_duplicate": len(removed_set - truth["has_duplicate"]),
            "emptied": sum(all(d in removed_set for d in c) for c in truth["clusters"])}


def scaled_run(docs: int, threshold: float) -> None:
    """Memory at scale: `docs` synthetic ~1 KB documents (Zipf-distributed words of the real corpus, 5% planted
    near copies), deduplicated by smolctl on one core; prints time and peak RSS (VmHWM)."""
    rng = np.random.default_rng(0)
    vocabulary = sorted({w for t in cut_documents(source_texts()[:3000]) for w in t.split()})
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        folder.mkdir()
        shard_docs = 100_000
        for shard in range(0, docs, shard_docs):
            count = min(shard_docs, docs - shard)
            words = rng.choice(len(vocabulary), size=(count, 160), p=weights)
            texts = [" ".join(vocabulary[w] for w in row) for row in words]
            for i in rng.choice(count - 1, size=count // 20, replace=False):
                edited = texts[i].split(" ")
                edited[rng.integers(len(edited))] = "zq"
                texts[i + 1] = " ".join(edited)
            pq.write_table(pa.table({"id": [f"d{shard + i}" for i in range(count)], "text": texts}),
                           folder / f"part-{shard // shard_docs:05d}.parquet")
        megabytes = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        done = subprocess.run([sys.executable, __file__, "--child", "smolctl", "--corpus", str(folder),
                               "--threshold", str(threshold)], capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"scaled run: {docs:,} documents ({megabytes:.0f} MB of parquet), smolctl on one core: "
          f"{result['seconds']:.0f}s ({docs / result['seconds']:,.0f} docs/s), peak RSS {result['max_rss_mib']:.0f} MiB, "
          f"{len(result['removed']):,} removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--methods", default="smolctl,datasketch,datatrove")
    parser.add_argument("--repeat", type=int, default=3, help="Rounds (each runs every method once); the fastest run of each method is reported.")
    parser.add_argument("--scale", type=int, help="Only measure smolctl's time and memory on this many synthetic documents.")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.corpus, args.threshold)
        return
    if args.scale:
        scaled_run(args.scale, args.threshold)
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus_dir = Path(tmp) / "corpus"
        corpus = build_corpus(corpus_dir, args.docs)
        megabytes = sum(len(t.encode()) for t in corpus) / 1e6
        truth = ground_truth(corpus, args.threshold)
        print(f"corpus: {len(corpus)} documents, {megabytes:.1f} MB, {megabytes * 1e6 / len(corpus):.0f} B/doc; "
              f"ground truth: {truth['pairs']} pairs >= {args.threshold}, {len(truth['remove'])} documents to remove",
              flush=True)
        methods = []
        for method in args.methods.split(","):
            if method == "datatrove":
                try:
                    import datatrove  # noqa: F401
                except ImportError:
                    print("datatrove: not installed (pip install datatrove), skipped")
                    continue
            methods.append(method)
        # Rounds interleave the methods (A B A B, not A A B B), so that a change in the machine's speed during
        # the run (shared machines drift by 10-30% within minutes) reaches every method alike.
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.repeat):
            for method in methods:
                done = subprocess.run([sys.executable, __file__, "--child", method, "--corpus", str(corpus_dir),
                                       "--threshold", str(args.threshold)], capture_output=True, text=True, cwd=REPO)
                if done.returncode != 0:
                    sys.exit(f"{method} failed:\n{done.stderr[-3000:]}")
                runs[method].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"  {method}: {runs[method][-1]['seconds']:.2f}s", flush=True)
        rows = []
        for method in methods:
            best = min(runs[method], key=lambda r: r["seconds"])
            rows.append({"method": method, "seconds": best["seconds"], "cpu_seconds": min(r["cpu_seconds"] for r in runs[method]),
                         "docs_per_s": len(corpus) / best["seconds"],
                         "mb_per_s": megabytes / best["seconds"], "max_rss_mib": max(r["max_rss_mib"] for r in runs[method]),
                         **score(best["removed"], truth)})
    baseline = next((r for r in rows if r["method"] == "datasketch"), rows[0])
    print(f"\nload average during the runs: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs)")
    header = ("| method | wall s | CPU s | docs/s | MB/s | vs datasketch (wall) | vs datasketch (CPU) | peak RSS | removed "
              "| precision | recall | F1 | removed w/o duplicate | clusters emptied |")
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['docs_per_s']:,.0f} | {r['mb_per_s']:.2f} | "
              f"{r['docs_per_s'] / baseline['docs_per_s']:.1f}x | {baseline['cpu_seconds'] / r['cpu_seconds']:.1f}x | "
              f"{r['max_rss_mib']:.0f} MiB | {r['removed']} | "
              f"{r['precision']:.4f} | {r['recall']:.4f} | {r['f1']:.4f} | {r['no_duplicate']} | {r['emptied']} |")


if __name__ == "__main__":
    main()
