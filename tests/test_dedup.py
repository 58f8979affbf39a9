"""smolctl dedup: planted duplicates found, distinct documents kept, accounting, determinism across workers, tasks
and shard layouts, --against, --keep, the staged Slurm path with markers, and the bad-input catalogue."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, run_cli, work_area

from smolctl.data import dedup_stages
from smolctl.data.dedup import DedupConfig, run
from smolctl.data.dedup_plan import plan
from smolctl.data.minhash import arrays, kernels, lsh, normalization, params, shingles
from smolctl.data.minhash.params import MinHashParams
from smolctl.errors import UserError

PARAMS = MinHashParams.for_threshold(0.8)
ASCII_PUNCTUATION = "".join(chr(c) for c in range(33, 127) if not (chr(c).isalnum() or chr(c) == "_"))


def sample_table(name: str = "web") -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted((SAMPLE / name).glob("part-*.parquet")))


def reference_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word n-grams in plain Python: the definition the vectorised hashing must reproduce (words are
    whitespace-separated tokens of the NFKC case-folded text, stripped of leading and trailing ASCII punctuation)."""
    tokens = unicodedata.normalize("NFKC", text).casefold().split()
    words = [w for w in (t.strip(ASCII_PUNCTUATION) for t in tokens) if w]
    return {tuple(words[j : j + n]) for j in range(max(1, len(words) - n + 1))} if words else set()


def reference_jaccard(a: str, b: str) -> float:
    sa, sb = reference_shingles(a), reference_shingles(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def edit_words(text: str, fraction: float, rng: random.Random) -> str:
    words = text.split()
    for _ in range(max(1, int(len(words) * fraction))):
        words[rng.randrange(len(words))] = f"zq{rng.randrange(10**6)}"
    return " ".join(words)


def write_shards(folder: Path, table: pa.Table, shards: int) -> Path:
    folder.mkdir(parents=True)
    bounds = np.linspace(0, table.num_rows, shards + 1).astype(int)
    for i in range(shards):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), folder / f"part-{i:05d}.parquet")
    return folder


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """Sample web documents plus planted copies: exact (case/space changes), near (J >= 0.85), far (J < 0.6)."""
    base = sample_table().slice(0, 500)
    texts = [t for t in base.column("text").to_pylist()]
    ids = base.column("id").to_pylist()
    rng = random.Random(0)
    long_enough = [i for i, t in enumerate(texts) if len(t.split()) >= 80]
    originals = rng.sample(long_enough, 60)
    planted_rows, truth = [], {}
    for k, i in enumerate(originals):
        if k < 20:
            copy, kind = "  " + texts[i].upper().replace(" ", "   "), "exact"
        elif k < 45:
            copy, kind = edit_words(texts[i], 0.01, rng), "near"
        else:
            copy, kind = edit_words(texts[i], 0.35, rng), "far"
        copy_id = f"planted-{k:03d}"
        planted_rows.append((rng.randrange(len(texts) + len(planted_rows) + 1), copy_id, copy))
        truth[copy_id] = (ids[i], kind, reference_jaccard(texts[i], copy))
    for position, copy_id, copy in sorted(planted_rows, reverse=True):
        texts.insert(max(position, ids.index(truth[copy_id][0]) + 1), copy)
        ids.insert(max(position, ids.index(truth[copy_id][0]) + 1), copy_id)
    table = pa.table({"id": ids, "text": texts, "origin": ["web"] * len(ids)})
    root = tmp_path_factory.mktemp("planted")
    return {"root": root, "table": table, "truth": truth, "input": write_shards(root / "input", table, 3)}


def dedup(input: Path, output: Path, **options):
    options.setdefault("minhash", PARAMS)
    run_options = {k: options.pop(k) for k in ("workers", "stage", "tasks", "task_id") if k in options}
    return run(DedupConfig(input=str(input), output=str(output), **options), **run_options)


def read_output(output: Path) -> tuple[pa.Table, pa.Table]:
    manifest = json.loads((output / "manifest.json").read_text())
    kept = pa.concat_tables(pq.read_table(output / s["name"]) for s in manifest["shards"])
    return kept, pq.read_table(output / "duplicates" / "part-00000.parquet")


# ---------------------------------------------------------------------------------------------------------------
# The vectorised core against plain Python


def test_shingle_hashes_reproduce_python_shingles_and_jaccard():
    texts = sample_table().column("text").to_pylist()[:150] + [
        "",
        "   ",
        "one two",
        "Ünïcode café — naïve résumé, ok?",
        "a b c d e",
        "x " * 40,
        '==== Heading ==== (((nested))) words!!! -------- end... "quoted" don\'t e.g., ---x--- ~~~~~~~~~~~~',
    ]
    sets = shingles.shingle_sets([normalization.normalize(t) for t in texts], 5, "word")
    for text, hashed in zip(texts, sets):
        assert len(hashed) == len(reference_shingles(text))
    values, bounds = np.concatenate(sets), np.concatenate([[0], np.cumsum([len(x) for x in sets])])
    left, right = np.arange(len(sets)), np.roll(np.arange(len(sets)), 1)
    assert np.allclose(
        kernels.jaccard_many(values, bounds, left, right),
        [shingles.jaccard(sets[i], sets[j]) for i, j in zip(left, right)],
    )
    rng = random.Random(1)
    for _ in range(40):
        i, j = rng.randrange(150), rng.randrange(150)
        near = edit_words(texts[i], rng.choice([0.02, 0.1, 0.3]), rng)
        hashed = shingles.shingle_sets(
            [normalization.normalize(texts[i]), normalization.normalize(near), normalization.normalize(texts[j])]
        )
        assert shingles.jaccard(hashed[0], hashed[1]) == pytest.approx(reference_jaccard(texts[i], near))
        assert shingles.jaccard(hashed[0], hashed[2]) == pytest.approx(reference_jaccard(texts[i], texts[j]))


def test_bulk_normalisation_matches_the_per_text_one():
    # The last two are one text under NFKC: the capital I composes with the dot above past the lower-class marks
    # between them (İ, folded with its dot first); lower-casing it first would leave "i" and the dot apart.
    texts = [
        "Plain ASCII, Text!",
        None,
        "Straße ＡＢＣ ﬁne",
        "ÉCOLE\u2028next",
        "",
        "MiXeD ünïcödé",
        "\u0130\u064e\u0651 X",
        "I\u064e\u0651\u0307 X",
    ]
    expected = [normalization.normalize(t) if t is not None else "" for t in texts]
    assert normalization.normalize_array(pa.array(texts)).to_pylist() == expected
    assert expected[2] == "strasse abc fine" and expected[3] == "école next"
    assert expected[6] == expected[7] == "i\u0307\u064e\u0651 x"


def test_char_shingles_work_without_spaces():
    texts = [
        "机器学习是人工智能的一个分支领域研究",
        "机器学习是人工智能的一个分支领域研究。",
        "今天天气很好我们去公园散步吧",
    ]
    sets = shingles.shingle_sets([normalization.normalize(t) for t in texts], 3, "char")
    assert shingles.jaccard(sets[0], sets[1]) == 1.0 and shingles.jaccard(sets[0], sets[2]) == 0.0
    assert len(sets[0]) == len(texts[0]) - 2


def test_signature_estimates_have_the_spread_of_ideal_minhash():
    texts = sample_table().column("text").to_pylist()
    rng = random.Random(2)
    base = [t for t in texts if len(t.split()) > 100][:300]
    edited = [edit_words(t, rng.uniform(0.0, 0.3), rng) for t in base]
    normalized = [normalization.normalize(t) for t in base + edited]
    sigs = kernels.signatures(*shingles.shingle_hashes(normalized, 5), PARAMS.permutations())
    sets = shingles.shingle_sets(normalized)
    truth = np.array([shingles.jaccard(sets[i], sets[i + len(base)]) for i in range(len(base))])
    error = kernels.estimate_jaccard(sigs, np.arange(len(base)), np.arange(len(base), 2 * len(base))) - truth
    ideal = np.sqrt(np.mean(truth * (1 - truth) / PARAMS.num_perm))  # binomial spread of a perfect MinHash
    assert abs(error.mean()) < 0.01 and np.sqrt(np.mean(error**2)) < 1.25 * ideal


def test_bands_lean_to_recall_and_are_validated():
    assert (PARAMS.bands, PARAMS.rows) == (20, 5)
    assert params.band_collision_probability(0.8, 20, 5) > 0.999 > params.band_collision_probability(0.8, 9, 12) + 0.4
    with pytest.raises(UserError, match="not --num-perm"):
        MinHashParams.for_threshold(0.8, 100, 9, 12)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(UserError, match="outside"):
            MinHashParams.for_threshold(bad)


def test_union_find_is_order_free_and_labels_by_smallest_node():
    u, v = np.array([5, 9, 2, 7, 3]), np.array([9, 2, 20, 8, 4])
    nodes, root = arrays.connected_components(u, v)
    labels = dict(zip(nodes.tolist(), root.tolist()))
    assert labels == {2: 2, 5: 2, 9: 2, 20: 2, 7: 7, 8: 7, 3: 3, 4: 3}
    perm = np.random.default_rng(0).permutation(len(u))
    assert np.array_equal(arrays.connected_components(v[perm], u[perm])[1], root)


def test_exact_edges_join_equal_hashes_even_when_another_hash_shares_their_first_half():
    # Documents 0 and 2 are equal; document 1's hash shares their first 64 bits only. Sorting on the first half
    # alone would put 1 between them and leave 0 and 2 unjoined.
    exact = np.array([[7, 1], [7, 2], [7, 1], [3, 9], [3, 9], [5, 5]], dtype=np.uint64)
    null = np.zeros(len(exact), bool)
    assert dedup_stages.exact_edges(exact, null, len(exact)).tolist() == [[3, 4], [0, 2]]
    null[3] = True  # a null text joins nothing
    assert dedup_stages.exact_edges(exact, null, len(exact)).tolist() == [[0, 2]]


def test_bucket_pairs_pair_exactly_the_documents_that_share_a_key():
    rng = np.random.default_rng(0)
    keys = arrays.mix64(rng.integers(0, 2**63, 5000, dtype=np.uint64))
    planted = rng.choice(len(keys), 300, replace=False)
    keys[planted] = keys[rng.choice(len(keys), 300)]
    # Keys that agree with a shared key in all but the top bit (another bucket of the kernel's), and in all but
    # the lowest bit (the same bucket, neighbours once sorted).
    keys[:20] = keys[planted[:20]] ^ (np.uint64(1) << np.uint64(63))
    keys[20:40] = keys[planted[20:40]] ^ np.uint64(1)
    docs = np.arange(len(keys), dtype=np.int64)
    members: dict[int, list[int]] = {}
    for doc, key in enumerate(keys.tolist()):
        members.setdefault(key, []).append(doc)
    expected = sorted(i << 32 | j for group in members.values() for a, i in enumerate(group) for j in group[a + 1 :])
    assert expected and lsh.bucket_pairs(keys, docs).tolist() == expected


# ---------------------------------------------------------------------------------------------------------------
# End to end on planted duplicates


def test_planted_duplicates_removed_distinct_kept_and_accounted(planted, tmp_path):
    dedup(planted["input"], tmp_path / "out", workers=1)
    kept, report = read_output(tmp_path / "out")
    removed = dict(zip(report.column("id").to_pylist(), report.to_pylist()))
    for copy_id, (original, kind, similarity) in planted["truth"].items():
        if kind == "exact":
            assert removed[copy_id]["reason"] == "exact" and removed[copy_id]["duplicate_of"] == original
        elif similarity >= 0.8:
            assert removed[copy_id]["duplicate_of"] == original, (copy_id, similarity)
        else:
            assert copy_id not in removed and original not in removed, (copy_id, similarity)
    assert sum(kind == "far" for _, kind, _ in planted["truth"].values()) == 15
    texts = dict(zip(planted["table"].column("id").to_pylist(), planted["table"].column("text").to_pylist()))
    for row in report.to_pylist():
        if row["reason"] == "minhash":
            assert reference_jaccard(texts[row["id"]], texts[row["duplicate_of"]]) >= 0.8
    # Accounting, order and schema.
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    stats = manifest["stats"]
    assert (
        stats["documents"]
        == planted["table"].num_rows
        == stats["kept"] + stats["exact_removed"] + stats["near_removed"]
    )
    assert kept.num_rows == stats["kept"] and report.num_rows == stats["exact_removed"] + stats["near_removed"]
    expected = [i for i in planted["table"].column("id").to_pylist() if i not in removed]
    assert kept.column("id").to_pylist() == expected and kept.schema.names == ["id", "text", "origin"]
    assert set(report.column("duplicate_of").to_pylist()) <= set(expected)
    assert not list((tmp_path / "out").glob("_work")) and not list(tmp_path.glob(".out*"))


def test_same_output_whatever_workers_tasks_or_shard_layout(planted, tmp_path):
    local = dedup(planted["input"], tmp_path / "local", workers=1)  # a small corpus: its 20 bands are one bucket unit
    staged = tmp_path / "staged"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("smolctl.data.dedup.POOL_MIN_DOCUMENTS", 0)  # a real pool, on a small corpus
        # Bucket units of 3 bands, as a large corpus would have: 7 units, the last of 2 bands.
        patch.setattr("smolctl.data.dedup_plan.BUCKET_UNIT_KEYS", 3 * planted["table"].num_rows)
        dedup(planted["input"], tmp_path / "pool", workers=2)
        for stage, tasks in (("signatures", 2), ("buckets", 3), ("components", 1), ("filter", 2)):
            for task in range(tasks):
                result = dedup(planted["input"], staged, stage=stage, tasks=tasks, task_id=task)
                if stage == "buckets":
                    assert result.units_done == len(range(task, 7, tasks))
    assert result.finished and result.candidate_pairs == local.candidate_pairs > 0  # every band's pairs, once
    resharded = write_shards(tmp_path / "resharded", planted["table"], 5)
    dedup(resharded, tmp_path / "layout", workers=1)
    reference_kept, reference_report = read_output(tmp_path / "local")
    for name in ("pool", "staged", "layout"):
        kept, report = read_output(tmp_path / name)
        assert kept.equals(reference_kept) and report.equals(reference_report), name
    for name in ("pool", "staged"):
        for shard in ("part-00000.parquet", "part-00002.parquet", "duplicates/part-00000.parquet"):
            assert (tmp_path / name / shard).read_bytes() == (tmp_path / "local" / shard).read_bytes()


@pytest.mark.parametrize(("most", "units"), [(1, 20), (3, 7), (19, 2), (20, 1)])
@pytest.mark.parametrize("with_reference", [False, True])
def test_bucket_units_hold_every_band_once(planted, tmp_path, most, units, with_reference):
    """However the bands are grouped into units (at most `most` bands a unit, spread evenly), the bucket files in
    unit order are the pairs of every band, once each, band after band: what a unit per band wrote."""
    table = planted["table"]
    against = str(write_shards(tmp_path / "reference", table.slice(0, 60), 1)) if with_reference else None
    documents = table.num_rows + (60 if with_reference else 0)
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("smolctl.data.dedup_plan.BUCKET_UNIT_KEYS", most * documents)
        for stage in ("signatures", "buckets"):
            dedup(planted["input"], out, stage=stage, against=against)
        run_plan = plan(DedupConfig(input=str(planted["input"]), output=str(out), minhash=PARAMS, against=against))
        sizes = [len(run_plan.bucket_bands(unit)) for unit in range(run_plan.unit_count("buckets"))]
    assert sum(sizes) == 20 and max(sizes) - min(sizes) <= 1, sizes
    work = work_area(out)
    written = sorted((work / "buckets").glob("*.npy"))
    assert len(written) == units
    keys = np.concatenate([np.fromfile(f, "<u8").reshape(20, -1) for f in sorted(work.glob("signatures/*.bands"))], 1)
    assert keys.shape[1] == documents
    band_by_band = []
    for band in keys:
        docs = np.flatnonzero(band != dedup_stages.NO_BUCKET)
        pairs = lsh.bucket_pairs(band[docs], docs)
        band_by_band.append(pairs[(pairs >> np.uint64(32)) < np.uint64(table.num_rows)])  # none inside the reference
    assert np.concatenate([np.load(f) for f in written]).tobytes() == np.concatenate(band_by_band).tobytes()


@pytest.mark.parametrize("most", [1, 3, 20])
def test_progress_of_each_stage_reaches_its_total(planted, tmp_path, most):
    """Each stage's advances add up to the total it announced: documents for the shard stages, bands for the
    buckets however they are grouped into units (a bar of units would stop at 1 of 20, or run past it)."""
    totals, advanced = {}, {}

    def report(stage, advance, total=None):
        if total is not None:
            totals[stage] = total
        advanced[stage] = advanced.get(stage, 0) + advance

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("smolctl.data.dedup_plan.BUCKET_UNIT_KEYS", most * planted["table"].num_rows)
        run(DedupConfig(input=str(planted["input"]), output=str(tmp_path / "out"), minhash=PARAMS), report=report)
    rows = planted["table"].num_rows
    expected = {"signatures": rows, "buckets": 20, "filter": rows}
    assert {stage: totals[stage] for stage in expected} == expected
    assert {stage: advanced[stage] for stage in expected} == expected


def test_repeated_ids_are_found_once_locally_and_by_the_components_task(tmp_path, monkeypatch):
    """A local run checks the ids before any work and the components stage does not count them again; an array
    has no such first check, so its components task must find them."""
    table = sample_table()
    ids = table.column("id").to_pylist()
    ids[-1] = ids[3]
    write_shards(tmp_path / "input", table.set_column(0, "id", pa.array(ids)), 2)
    second_start = table.num_rows // 2  # write_shards' second shard
    checks = []
    counting = dedup_stages.check_unique_ids
    monkeypatch.setattr(dedup_stages, "check_unique_ids", lambda *a: checks.append(len(a[0])) or counting(*a))
    monkeypatch.setattr("smolctl.data.dedup.check_unique_ids", dedup_stages.check_unique_ids)
    where = f"at part-00000.parquet row 3 and part-00001.parquet row {table.num_rows - 1 - second_start}"
    with pytest.raises(UserError, match=f"holds 1 repeated id\\(s\\), e.g. '{ids[3]}' x2 \\({where}\\)"):
        dedup(tmp_path / "input", tmp_path / "local", workers=1)
    assert checks == [table.num_rows] and not (tmp_path / "local").exists()
    fine = write_shards(tmp_path / "fine", table, 2)
    checks.clear()
    dedup(fine, tmp_path / "fine-out", workers=1)
    assert checks == [table.num_rows]  # once, before the work
    staged = tmp_path / "staged"
    for stage, tasks in (("signatures", 2), ("buckets", 2)):
        for task in range(tasks):
            dedup(tmp_path / "input", staged, stage=stage, tasks=tasks, task_id=task)
    with pytest.raises(UserError, match="repeated id"):
        dedup(tmp_path / "input", staged, stage="components", tasks=1, task_id=0)


def test_a_null_id_is_named_by_its_file_and_row(tmp_path):
    table = sample_table().slice(0, 40)
    ids = table.column("id").to_pylist()
    ids[25] = ids[33] = None
    write_shards(tmp_path / "input", table.set_column(0, "id", pa.array(ids)), 2)
    with pytest.raises(UserError, match=re.escape("has 2 null id(s), the first at part-00001.parquet row 5")):
        dedup(tmp_path / "input", tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_staged_markers_skip_finished_tasks_and_a_rerun_resumes(planted, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="signatures stage has not finished"):
        dedup(planted["input"], out, stage="filter", tasks=2, task_id=0)
    assert not out.exists()
    first = dedup(planted["input"], out, stage="signatures", tasks=2, task_id=0)
    again = dedup(planted["input"], out, stage="signatures", tasks=2, task_id=0)
    assert (first.units_done, again.units_done, again.units_skipped) == (2, 0, 2)
    with pytest.raises(UserError, match=r"1 unit\(s\) of 3"):
        dedup(planted["input"], out, stage="buckets")
    # A run "killed" after the signatures of task 0: the plain local run finishes it, reusing the markers.
    result = dedup(planted["input"], out, workers=1)
    assert result.finished and result.units_skipped == 2
    dedup(planted["input"], tmp_path / "fresh", workers=1)
    for name in ("part-00000.parquet", "part-00001.parquet", "duplicates/part-00000.parquet"):
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    # Any task of the committed run, re-submitted or late, finds it done; other settings are refused.
    assert dedup(planted["input"], out, stage="signatures").already_committed
    assert dedup(planted["input"], out, stage="filter", tasks=64, task_id=63).already_committed
    with pytest.raises(UserError, match="already exists"):
        dedup(planted["input"], out, stage="signatures", keep="longest")
    with pytest.raises(UserError, match="already exists"):
        dedup(planted["input"], out, workers=1)


@pytest.mark.parametrize("damage", ["truncated", "removed", "another unit's", "another unit's, marker without size"])
def test_a_filter_piece_damaged_between_tasks_is_never_committed(planted, tmp_path, damage):
    """A unit's filtered piece lost or changed under OUTPUT/_work before the last filter task: the commit must
    refuse it. It used to skip a missing piece and commit an output short of those documents."""
    out = tmp_path / "out"
    for stage in ("signatures", "buckets", "components"):
        dedup(planted["input"], out, stage=stage)
    dedup(planted["input"], out, stage="filter", tasks=2, task_id=0)  # units 0 and 2
    pieces = work_area(out) / "filter"
    piece = pieces / "00000.parquet"
    if damage == "truncated":
        piece.write_bytes(piece.read_bytes()[:100])
    elif damage == "removed":
        piece.unlink()
    else:
        piece.write_bytes((pieces / "00002.parquet").read_bytes())
    if damage.endswith("without size"):  # as an earlier version wrote it: only the row count can tell
        marker = pieces / "00000.done"
        marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "bytes"}))
    message = {
        "truncated": "is 100 bytes, not the",
        "removed": "is missing from the work area",
        "another unit's": "bytes, not the",
        "another unit's, marker without size": "rows, not the",
    }[damage]
    with pytest.raises(UserError, match=message):
        dedup(planted["input"], out, stage="filter", tasks=2, task_id=1)
    assert not (out / "manifest.json").exists()


def test_a_work_area_hashed_by_another_version_is_not_resumed(planted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    dedup(planted["input"], out, stage="signatures", tasks=2, task_id=0)
    import smolctl.data.dedup_plan as dedup_plan

    monkeypatch.setattr(dedup_plan, "HASHING_VERSION", dedup_plan.HASHING_VERSION + 1)
    with pytest.raises(UserError, match="other inputs or settings"):
        dedup(planted["input"], out, stage="signatures", tasks=2, task_id=1)


def test_against_reference_removes_what_it_holds_and_keeps_it(planted, tmp_path, monkeypatch):
    table, truth = planted["table"], planted["truth"]
    near = [c for c, (_, kind, s) in truth.items() if kind == "near" and s >= 0.8][:5]
    reference_ids = [truth[c][0] for c in near]
    ids = table.column("id").to_pylist()
    reference = write_shards(tmp_path / "reference", table.take([ids.index(i) for i in reference_ids]), 1)
    before = (reference / "part-00000.parquet").read_bytes()
    fresh = write_shards(tmp_path / "fresh", table.take([ids.index(c) for c in near] + list(range(40))), 2)
    dedup(fresh, tmp_path / "out", against=str(reference), workers=1)
    kept, report = read_output(tmp_path / "out")
    removed = dict(zip(report.column("id").to_pylist(), report.column("duplicate_of").to_pylist()))
    for copy_id in near:
        assert removed[copy_id] == f"against:{truth[copy_id][0]}"
    assert not set(reference_ids) & set(kept.column("id").to_pylist())
    assert (reference / "part-00000.parquet").read_bytes() == before
    # A quoted reference under ~ is read, and recorded, as the folder it names.
    monkeypatch.setenv("HOME", str(tmp_path))
    dedup(fresh, tmp_path / "home-out", against="~/reference", workers=1)
    assert read_output(tmp_path / "home-out")[1].equals(report)
    assert json.loads((tmp_path / "home-out" / "manifest.json").read_text())["dedup"]["against"] == str(reference)


def test_a_reference_document_is_named_apart_from_an_input_document_of_the_same_id(tmp_path):
    """Both datasets number their documents d0, d1...: the report must say that the input's d0 went as a copy of
    the reference's d0, not of itself."""
    text = " ".join(f"word{i}" for i in range(40))
    reference = write_shards(tmp_path / "reference", pa.table({"id": ["d0", "d1"], "text": [text, "other words"]}), 1)
    fresh = write_shards(tmp_path / "fresh", pa.table({"id": ["d0", "d1"], "text": ["something else", text]}), 1)
    dedup(fresh, tmp_path / "out", against=str(reference), workers=1)
    kept, report = read_output(tmp_path / "out")
    assert kept.column("id").to_pylist() == ["d0"]
    assert report.select(["id", "duplicate_of"]).to_pylist() == [{"id": "d1", "duplicate_of": "against:d0"}]


def test_a_reference_whose_ids_are_null_or_repeat_is_refused_unless_named_by_shard_and_row(tmp_path):
    """The reference's ids name the kept document of report rows: a null one left duplicate_of empty, and a
    repeated one named two documents as one. Refused as the input's are, locally before any work and by an
    array's components task; --id-column shard:row names the reference's documents too."""
    texts = [" ".join(f"w{i}x{k}" for k in range(30)) for i in range(4)]
    fresh = write_shards(tmp_path / "fresh", pa.table({"id": ["x", "y", "z", "kept"], "text": texts}), 1)
    texts = texts[:3]
    cases = {
        "null": (["r0", None, "r2"], "column 'id' has 1 null id\\(s\\), the first at part-00000.parquet row 1"),
        "repeated": (
            ["r0", "r1", "r1"],
            "column 'id' holds 1 repeated id\\(s\\), e.g. 'r1' x2 \\(at part-00000.parquet row 1 and",
        ),
    }
    for name, (ids, message) in cases.items():
        reference = write_shards(tmp_path / name, pa.table({"id": ids, "text": texts}), 1)
        with pytest.raises(UserError, match=f"^{reference}: {message}"):
            dedup(fresh, tmp_path / "out", against=str(reference), workers=1)
        assert not (tmp_path / "out").exists()
        staged = tmp_path / f"staged-{name}"
        for stage in ("signatures", "buckets"):
            dedup(fresh, staged, against=str(reference), stage=stage, tasks=1, task_id=0)
        with pytest.raises(UserError, match=message):
            dedup(fresh, staged, against=str(reference), stage="components", tasks=1, task_id=0)
    dedup(fresh, tmp_path / "out", against=str(tmp_path / "repeated"), id_column="shard:row", workers=1)
    kept, report = read_output(tmp_path / "out")
    assert kept.column("id").to_pylist() == ["kept"]
    assert report.column("duplicate_of").to_pylist() == [f"against:part-00000:{row}" for row in range(3)]


def test_short_documents_whose_32_bit_shingle_keys_collide_are_both_kept(tmp_path):
    """Each of the first two documents is one shingle, and the two shingles share their upper 32 bits (the key
    MinHash permutes): their signatures agree everywhere, an estimate of 1.0 past any margin, and only the whole
    hashes tell them apart. The third is the first with other punctuation: one shingle equal to the first's, a
    near duplicate that must still go."""
    texts = ["Alpha B\U0001f43ac Delta echo", "I\u4848\u0307 x\u4848\u4848 \u4848", "alpha, b\U0001f43ac delta echo!"]
    hashes, offsets = shingles.shingle_hashes(texts)
    assert list(np.diff(offsets)) == [1, 1, 1] and hashes[0] != hashes[1] and hashes[0] == hashes[2]
    assert hashes[0] >> np.uint64(32) == hashes[1] >> np.uint64(32)  # the collision itself
    source = write_shards(tmp_path / "in", pa.table({"id": ["a", "b", "c"], "text": texts}), 1)
    result = dedup(source, tmp_path / "out", workers=1)
    kept, report = read_output(tmp_path / "out")
    assert kept.column("id").to_pylist() == ["a", "b"]
    assert report.select(["id", "duplicate_of", "reason"]).to_pylist() == [
        {"id": "c", "duplicate_of": "a", "reason": "minhash"}
    ]
    assert result.verified_pairs >= 2  # the colliding pair and the true one, both of one-shingle documents


def test_an_estimate_within_one_collisions_rise_of_the_margin_is_verified_and_one_past_it_is_not(tmp_path):
    """At threshold 0.5 with 256 permutations the margin is 0.156: an estimate of 0.656 or more settles a pair
    unverified, unless one 32-bit key collision (a rise of 2 / (n - 1) for sets of n shingles, 0.1 here) could
    have lifted it there. Two pairs of 21-shingle documents, one word changed in each copy: the first's estimate
    lies inside that rise (verified), the second's past it (accepted as estimated). Verifying both, or neither
    (the margin alone, or a check that only looks at whether the rise exceeds the margin), fails here."""
    params_ = MinHashParams.for_threshold(0.5, num_perm=256)
    texts = []
    for prefix, changed in (("w", 21), ("v", 22)):
        words = [f"{prefix}{i}" for i in range(25)]
        texts += [" ".join(words), " ".join(words[:changed] + ["xx"] + words[changed + 1 :])]
    hashes, offsets = shingles.shingle_hashes(texts)
    sigs = kernels.signatures(hashes, offsets, params_.permutations())
    estimate = kernels.estimate_jaccard(sigs, np.array([0, 2]), np.array([1, 3]))
    margin, rise = params.settle_margin(0.5, 256), 2 / (21 - 1)
    assert list(np.diff(offsets)) == [21] * 4 and list(kernels.keys_behind(sigs, params_.permutations())) == [21] * 4
    assert 0.5 + margin <= estimate[0] < 0.5 + margin + rise <= estimate[1]  # what the test is about
    source = write_shards(tmp_path / "in", pa.table({"id": ["a", "a2", "b", "b2"], "text": texts}), 1)
    result = dedup(source, tmp_path / "out", minhash=params_, workers=1)
    kept, _ = read_output(tmp_path / "out")
    assert kept.column("id").to_pylist() == ["a", "b"]
    assert result.verified_pairs == 1


def test_keep_longest_and_null_texts_passed_through(tmp_path):
    text = " ".join(f"word{i}" for i in range(60))
    table = pa.table(
        {"id": ["a", "b", "c", "d", "e"], "text": [text, text + " extra", None, "Other text entirely, short.", None]}
    )
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    result = dedup(src, tmp_path / "out", keep="longest", workers=1)
    kept, report = read_output(tmp_path / "out")
    assert kept.column("id").to_pylist() == ["b", "c", "d", "e"]
    assert report.to_pylist()[0] | {"jaccard": None} == {
        "id": "a",
        "duplicate_of": "b",
        "cluster": 0,
        "reason": "minhash",
        "jaccard": None,
    }
    assert (result.null_text, result.documents, result.kept) == (2, 5, 4)


def test_ids_default_to_shard_and_row(tmp_path):
    src = tmp_path / "noid"
    write_shards(src, pa.table({"text": ["same text here", "other", "Same  TEXT here"]}), 1)
    dedup(src, tmp_path / "out", minhash=None, workers=1)
    _, report = read_output(tmp_path / "out")
    assert report.to_pylist() == [
        {"id": "part-00000:2", "duplicate_of": "part-00000:0", "cluster": 0, "reason": "exact", "jaccard": 1.0}
    ]


def test_shard_and_row_ids_stand_in_for_an_id_column_whose_ids_repeat(tmp_path):
    """Ids that restart in every file repeat across the input: `--id-column shard:row` names documents by shard
    and row instead, exactly as without an id column, and the kept documents keep their own ids."""
    texts = ["same text here", "other words entirely", "Same  TEXT here", "other words entirely", "alone"]
    restarting = pa.table({"id": ["0", "1", "2", "0", "1"], "text": texts})
    write_shards(tmp_path / "restarting", restarting, 2)
    write_shards(tmp_path / "without", restarting.drop_columns(["id"]), 2)
    with pytest.raises(UserError, match="--id-column shard:row"):
        dedup(tmp_path / "restarting", tmp_path / "refused", minhash=None, workers=1)
    dedup(tmp_path / "restarting", tmp_path / "out", minhash=None, workers=1, id_column="shard:row")
    dedup(tmp_path / "without", tmp_path / "reference", minhash=None, workers=1)
    kept, report = read_output(tmp_path / "out")
    assert report.equals(read_output(tmp_path / "reference")[1])
    assert report.column("id").to_pylist() == ["part-00001:0", "part-00001:1"]
    assert kept.column("id").to_pylist() == ["0", "1", "1"] and kept.column("text").to_pylist() == [
        texts[0],
        texts[1],
        texts[4],
    ]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["dedup"]["id_column"] == "shard:row"


@pytest.mark.parametrize("verify", [True, False])
def test_each_removed_documents_jaccard_is_its_own_estimate_even_for_exact_copies(tmp_path, verify):
    # A near duplicate of the first document, and an exact copy of that near duplicate in two spellings of
    # I-dot-above with a combining mark below (one text under NFKC: the capital composes with the dot past the
    # mark). Both are removed as near duplicates of the first document, each with its own estimate, which for
    # the exact copy is the near duplicate's: character shingles are made from the same normalised text as the
    # exact hash (they once lower-cased ASCII first, which kept the dot apart in one spelling).
    rng = random.Random(3)
    vocabulary = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(300)]
    words = [rng.choice(vocabulary) for _ in range(60)]
    near = " ".join("\u0130\u0316" + w if k % 8 == 0 else w for k, w in enumerate(words))
    others = [" ".join(rng.choice(vocabulary) for _ in range(60)) for _ in range(5)]
    texts = [" ".join(words), near, near.replace("\u0130\u0316", "I\u0316\u0307"), *others]
    params = MinHashParams(threshold=0.5, shingle="char")
    exact = kernels.tokenize(texts).exact
    assert (exact[1] == exact[2]).all() and (exact[0] != exact[1]).any()
    src = tmp_path / "in"
    write_shards(src, pa.table({"text": texts}), 1)
    dedup(src, tmp_path / "out", minhash=params, verify=verify, workers=1)
    _, report = read_output(tmp_path / "out")
    signature = kernels.signatures(*shingles.shingle_hashes(texts, params.ngram, "char"), params.permutations())
    own = kernels.estimate_jaccard(signature, np.array([1, 2]), np.array([0, 0]))
    assert own[0] == own[1] and 0.5 < own[0] < 1
    assert (signature[1] == signature[2]).all()
    assert report.column("id").to_pylist() == ["part-00000:1", "part-00000:2"]
    assert report.column("duplicate_of").to_pylist() == ["part-00000:0"] * 2
    assert report.column("reason").to_pylist() == ["minhash"] * 2
    assert report.column("jaccard").to_pylist() == pytest.approx(own.tolist())


def test_made_up_ids_tell_files_of_one_name_apart_and_mark_the_reference(tmp_path):
    """Without an id column, ids are shard:row: in a per-language layout (en/000, fr/000) and against a reference
    written by the same tool (part-00000 in both), each id must point at one document only."""
    texts = [f"document {i} about {i * 7} things in several words" for i in range(6)]
    (tmp_path / "in" / "en").mkdir(parents=True)
    (tmp_path / "in" / "fr").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "in" / "en" / "000.parquet")
    pq.write_table(
        pa.table({"text": ["autre chose entierement", texts[2], texts[0]]}), tmp_path / "in" / "fr" / "000.parquet"
    )
    dedup(tmp_path / "in", tmp_path / "out", workers=1)
    _, report = read_output(tmp_path / "out")
    assert report.select(["id", "duplicate_of"]).to_pylist() == [
        {"id": "fr/000:1", "duplicate_of": "en/000:2"},
        {"id": "fr/000:2", "duplicate_of": "en/000:0"},
    ]
    reference = write_shards(tmp_path / "reference", pa.table({"text": texts[3:]}), 1)
    fresh = write_shards(tmp_path / "fresh", pa.table({"text": [texts[4], "something else entirely"]}), 1)
    dedup(fresh, tmp_path / "against", against=str(reference), workers=1)
    _, report = read_output(tmp_path / "against")
    assert report.select(["id", "duplicate_of"]).to_pylist() == [
        {"id": "part-00000:0", "duplicate_of": "against:part-00000:1"}
    ]


def test_a_shard_without_rows_changes_nothing(planted, tmp_path):
    # Filters upstream can leave empty shards; they hold no documents, so the output is that of the others.
    with_empty = tmp_path / "with-empty"
    with_empty.mkdir()
    shards = sorted(planted["input"].glob("*.parquet"))
    for shard in shards:
        (with_empty / shard.name).write_bytes(shard.read_bytes())
    pq.write_table(pq.read_table(shards[0]).slice(0, 0), with_empty / "part-00001a.parquet")
    dedup(planted["input"], tmp_path / "plain", workers=1)
    dedup(with_empty, tmp_path / "out", workers=1)
    assert [t.to_pylist() for t in read_output(tmp_path / "out")] == [
        t.to_pylist() for t in read_output(tmp_path / "plain")
    ]


@pytest.mark.parametrize("kind", ["string_view", "dictionary"])
def test_text_and_ids_written_as_views_or_dictionaries_dedup_alike(planted, tmp_path, kind):
    """Polars writes string_view columns and pandas categoricals come back dictionary-encoded: the same values
    give the same documents kept and the same duplicates (arrow's string, filter and take kernels refuse views,
    so they are read as large_string)."""
    recast = tmp_path / kind
    recast.mkdir()
    for shard in sorted(planted["input"].glob("*.parquet")):
        table = pq.read_table(shard)
        for name in ("id", "text"):
            column = table.column(name)
            column = column.cast(pa.string_view()) if kind == "string_view" else column.dictionary_encode()
            table = table.set_column(table.schema.get_field_index(name), name, column)
        pq.write_table(table, recast / shard.name)
    assert pq.read_schema(next(recast.glob("*.parquet"))).field("text").type != pa.string()
    dedup(planted["input"], tmp_path / "plain", workers=1)
    dedup(recast, tmp_path / "out", workers=1)
    for got, want in zip(read_output(tmp_path / "out"), read_output(tmp_path / "plain"), strict=True):
        assert got.to_pylist() == want.to_pylist()
    assert len(read_output(tmp_path / "out")[1]) > 0


def test_shards_of_one_input_written_in_different_widths_dedup_as_one(planted, tmp_path):
    """Shards of one dataset appended by different tools: string beside large_string text, int32 beside int64
    counts, the columns in another order. Read in the widest of each and the first shard's order, they dedup as
    the plain input does, and the output keeps the widest."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for index, shard in enumerate(sorted(planted["input"].glob("*.parquet"))):
        table = pq.read_table(shard)
        count = pa.array(range(table.num_rows), pa.int32() if index % 2 else pa.int64())
        if index % 2:
            table = table.set_column(
                table.schema.get_field_index("text"), "text", table["text"].cast(pa.large_string())
            )
        table = table.append_column("n", count)
        pq.write_table(table.select(table.column_names[::-1]) if index % 2 else table, mixed / shard.name)
    dedup(planted["input"], tmp_path / "plain", workers=1)
    dedup(mixed, tmp_path / "out", workers=1)
    kept, report = read_output(tmp_path / "out")
    want_kept, want_report = read_output(tmp_path / "plain")
    assert kept.drop_columns(["n"]).cast(want_kept.schema).to_pylist() == want_kept.to_pylist()
    assert report.to_pylist() == want_report.to_pylist() and len(report) > 0
    assert kept.schema.field("text").type == pa.large_string() and kept.schema.field("n").type == pa.int64()
    assert kept.column_names == ["id", "text", "origin", "n"]


# ---------------------------------------------------------------------------------------------------------------
# The CLI: demo path and bad input


def test_cli_json_and_summary(tmp_path):
    done = run_cli("dedup", SAMPLE / "math", tmp_path / "math", "--minhash", "--workers", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (
        result["finished"] and result["documents"] == result["kept"] + result["exact_removed"] + result["near_removed"]
    )
    done = run_cli("dedup", SAMPLE / "math", tmp_path / "math2", "--minhash", "--workers", "1")
    assert done.returncode == 0 and "near removed" in done.stdout and "docs/s" in done.stdout


def _bad_inputs(tmp: Path) -> list[tuple[list, str]]:
    pq.write_table(
        pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), tmp / "empty.parquet"
    )
    pq.write_table(pa.table({"id": ["a", "a"], "text": ["x", "y"]}), tmp / "dupids.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1, 2]}), tmp / "ints.parquet")
    web = str(SAMPLE / "web")
    return [
        ([tmp / "nowhere", "OUT"], "no such file"),
        ([tmp / "empty.parquet", "OUT"], "holds no documents"),
        ([web, "OUT", "--text-column", "body"], "columns: id, text, origin"),
        ([web, "OUT", "--id-column", "uid"], "has no column 'uid'"),
        ([tmp / "dupids.parquet", "OUT"], "repeated id"),
        ([tmp / "ints.parquet", "OUT"], "not text"),
        ([web, "OUT", "--minhash", "--threshold", "1.2"], "outside (0, 1)"),
        ([web, "OUT", "--minhash", "--bands", "9", "--rows", "12"], "not --num-perm 100"),
        ([web, "OUT", "--threshold", "0.7"], "add --minhash"),
        ([web, "OUT", "--minhash", "--stage", "signatures", "--tasks", "4", "--task-id", "4"], "out of range"),
        ([web, "OUT", "--minhash", "--stage", "filter"], "has not finished"),
        ([web, "OUT", "--minhash", "--tasks", "2", "--task-id", "0"], "add --stage signatures"),
        ([web, "OUT", "--no-exact"], "both exact and MinHash"),
    ]


def test_bad_inputs_are_one_line_errors_and_write_nothing(tmp_path):
    for argv, message in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        done = run_cli("dedup", *[out if a == "OUT" else a for a in argv])
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*")), argv


# ---------------------------------------------------------------------------------------------------------------
# Outputs pinned byte for byte: speed work must not change a single byte of what dedup writes


def _output_digests(output: Path) -> dict:
    """sha256 of every kept shard, of the duplicates report and of the removed ids (one per line, in report order)."""
    import hashlib

    manifest = json.loads((output / "manifest.json").read_text())
    files = [s["name"] for s in manifest["shards"]] + ["duplicates/part-00000.parquet"]
    digests = {name: hashlib.sha256((output / name).read_bytes()).hexdigest() for name in files}
    removed = pq.read_table(output / "duplicates" / "part-00000.parquet", columns=["id"]).column(0).to_pylist()
    digests["removed ids"] = hashlib.sha256("\n".join(removed).encode()).hexdigest()
    return digests


def _pinned_runs(planted: dict) -> dict:
    """name -> (input, options) of the configurations whose outputs are pinned."""
    web = SAMPLE / "web"
    return {
        "web exact": (web, {"minhash": None}),
        "web minhash": (web, {}),
        "code char shingles": (SAMPLE / "code", {"minhash": MinHashParams.for_threshold(0.7, ngram=7, shingle="char")}),
        "planted minhash": (planted["input"], {}),
        "planted longest unverified 0.7": (
            planted["input"],
            {"keep": "longest", "verify": False, "minhash": MinHashParams.for_threshold(0.7)},
        ),
        "web against planted": (web, {"against": str(planted["input"])}),
    }


# Recorded before the speed work of issue 23: any change to dedup that alters a byte of its output must say why and
# re-record these. Parquet bytes also carry the writer's version, so a different pyarrow checks the removed ids only.
PINNED_PYARROW = "26.0.1"
PINNED_OUTPUTS = {
    "web exact": {
        "part-00000.parquet": "ba728f122d2c190b80be317dd11bff17203e6facdae99fbef4dd681d98d68f37",
        "part-00001.parquet": "1b68562197bcd8a1551e967d4a4eca8d732ce34352a52c3e7ff3bbfd049f8b17",
        "duplicates/part-00000.parquet": "9324d4d5351f4608b6d2c2cd79c4dd5d34c5a6c847dda6c71a833f82ced76c9a",
        "removed ids": "8ed548799714ef9fce8fa1520a50a9580fbb72ee44173debc65889858687f693",
    },
    "web minhash": {
        "part-00000.parquet": "bc1a7451f9ed64bc3e17dc4032e321ca65f196d632e8df2f9b451e07eb367346",
        "part-00001.parquet": "54ccd496c52a8db705f1b7e54c6739e910d90189e66e58c8b21a3eb487fc089a",
        "duplicates/part-00000.parquet": "08dd3ddd287648e1c7e5194d81871f1b465098e9a181110260fad3759febe29f",
        "removed ids": "4f55d1a555585e466032d7235e45a51c27af327c4dfd491e97ad0e1f12c8388a",
    },
    "code char shingles": {
        "part-00000.parquet": "8c7b7ea50a1b2a5c1c871f8e788e7d68595f13cc27349adb53dcbf074619b55e",
        "part-00001.parquet": "7d42ff490285040eb51b51abd4a146ab9f35ee5aa4d9fa43a411173d6d2c0a42",
        "duplicates/part-00000.parquet": "b32171d80cb98148ec1c1bfabacb9a8084422ab9bd88b655956f6190ce01489c",
        "removed ids": "3589ed3d7764b60999bb916f07bb929fb7d2fc92cf3e737a646aab45417b9997",
    },
    "planted minhash": {
        "part-00000.parquet": "7b9c61ed915c3c48c94f0e459df38cf5a635921044528371cda04174da1c3c11",
        "part-00001.parquet": "7be6e6ced5b78253754d789a7a24ee62ad8a137fc81c07256f67602eb24bbf84",
        "part-00002.parquet": "0d709541ca7cc15845375ed2c8fc48e9943edfacd5298f0be610d435c0fa4fa9",
        "duplicates/part-00000.parquet": "5696fdc375d6fb6c27b61d9b04fb95630415d82d98522dff083edf8886e41e4c",
        "removed ids": "106da46c87c69660cb0da1f5a3ee367cce2c0b3c6a18fcc6cc15663d7332f0d7",
    },
    "planted longest unverified 0.7": {
        "part-00000.parquet": "3d9815eae9796506d7945cd0b6f1feaa5a03c5bd9678736fc0a4c18ad65076c4",
        "part-00001.parquet": "ec075d42e81ad40151e14718a68aabb2e792a4817ef3bf66637495dcb6a48b1f",
        "part-00002.parquet": "2b2f90319b585dabf924ca1736b91220a9e31e708e3ae03db7d339907261efbd",
        "duplicates/part-00000.parquet": "09021c7b136c3c5c86c1e048bdea9185d9f2cdc1594d49684ab3651af10c8088",
        "removed ids": "b8d6f9fc12e6899ca1901337d40f9c821a9066ada411d73a3740e5220252c9eb",
    },
    "web against planted": {
        "part-00000.parquet": "5a7fee9923055ff36f78120f887407170fa7d1fba13772ec9cc367b928baa65b",
        "part-00001.parquet": "54ccd496c52a8db705f1b7e54c6739e910d90189e66e58c8b21a3eb487fc089a",
        # Re-recorded (session 41): the reference's own ids are marked against:ID in duplicate_of, as its made-up
        # ones always were (an input and a reference may both hold an id "d0"); the kept shards are unchanged.
        "duplicates/part-00000.parquet": "002ae6373bc9c1d4bcace643847bc32a802fc0ffd872ff0d054d1080636d65bf",
        "removed ids": "6d835a0689a15e25e861375be985a31d792654973e0152ace1a6995446bda0d3",
    },
}


def test_outputs_are_byte_identical_to_the_recorded_ones(planted, tmp_path):
    for name, (source, options) in _pinned_runs(planted).items():
        output = tmp_path / name.replace(" ", "-")
        dedup(source, output, workers=1, **options)
        digests, expected = _output_digests(output), PINNED_OUTPUTS[name]
        if pa.__version__ != PINNED_PYARROW:
            digests, expected = digests["removed ids"], expected["removed ids"]
        assert digests == expected, name


@pytest.mark.parametrize("budget", ["whole input", "less than the input", "first shard, footers understating"])
def test_shards_kept_decoded_for_the_filter_stage_give_the_recorded_outputs(planted, tmp_path, monkeypatch, budget):
    """A run in one process keeps its input decoded from the signatures stage for the filter stage where the
    footers say it fits the budget, else reads it twice. Footers that understate are caught shard by shard: here
    the first shard fits, the second does not, and from there on shards are read again. The output is the
    recorded bytes every way."""
    from smolctl.data import dedup_plan
    from smolctl.shards import DocumentSource, open_documents

    source, options = _pinned_runs(planted)["planted minhash"]
    first_shard = sum(b.nbytes for b in open_documents(source).iter_file_batches(0, batch_size=dedup_stages.BATCH_ROWS))
    if budget == "less than the input":
        monkeypatch.setattr("smolctl.data.dedup.DECODED_INPUT_BYTES", sum(open_documents(source).file_bytes) - 1)
    elif budget == "first shard, footers understating":
        monkeypatch.setattr("smolctl.data.dedup.DECODED_INPUT_BYTES", first_shard + 1)
        opened = dedup_plan.open_documents

        def understating(spec):
            documents = opened(spec)
            documents.file_bytes = [0] * len(documents.files)
            return documents

        monkeypatch.setattr(dedup_plan, "open_documents", understating)
    read = []
    iter_file_batches = DocumentSource.iter_file_batches

    def reading(self, index, columns=None, *args, **kwargs):
        read.append((index, columns))
        return iter_file_batches(self, index, columns, *args, **kwargs)

    monkeypatch.setattr(DocumentSource, "iter_file_batches", reading)
    output = tmp_path / "out"
    dedup(source, output, workers=1, **options)
    text = ["text", "id"]
    expected = {  # after the ids are checked (three reads of ['id'])
        "whole input": [(0, None), (1, None), (2, None)],
        "less than the input": [(0, text), (1, text), (2, text), (0, None), (1, None), (2, None)],
        # shard 1 was read whole too, but did not fit
        "first shard, footers understating": [(0, None), (1, None), (2, text), (1, None), (2, None)],
    }[budget]
    assert read[:3] == [(0, ["id"]), (1, ["id"]), (2, ["id"])] and read[3:] == expected
    digests, pinned = _output_digests(output), PINNED_OUTPUTS["planted minhash"]
    if pa.__version__ != PINNED_PYARROW:
        digests, pinned = digests["removed ids"], pinned["removed ids"]
    assert digests == pinned


@pytest.mark.parametrize("kept_decoded", [True, False])
def test_bytes_that_are_not_utf8_in_a_column_only_the_filter_stage_reads_are_refused(
    tmp_path, monkeypatch, kept_decoded
):
    """The signatures stage reads the text and ids; the filter stage, reading the whole file again where the
    input is not kept decoded, checks the columns the first read did not, and refuses the bad one by name."""
    if not kept_decoded:
        monkeypatch.setattr("smolctl.data.dedup.DECODED_INPUT_BYTES", 0)
    table = sample_table().slice(0, 40)
    origin = [o.encode() for o in table.column("origin").to_pylist()]
    origin[17] = b"\xff\xfe"
    bad = table.set_column(2, "origin", pa.array(origin, pa.binary()).view(pa.string()))
    write_shards(tmp_path / "input", bad, 2)
    with pytest.raises(UserError, match=r"part-00000\.parquet: row 17 \(from 0\): column 'origin' holds bytes that"):
        dedup(tmp_path / "input", tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_the_dedup_command_imports_only_what_it_needs(tmp_path):
    """Start-up is most of a small run's time: no pandas (pyarrow imports it on its first pa.array or Python
    scalar, which dedup avoids), no pyarrow.dataset, no pyarrow.compute (its wrappers: the functions are called
    through arrow_arrays.compute), no training stack, no safetensors or thread pool; and once the multipliers are in smolctl's cache, no
    numpy.random. The multipliers read back are the ones drawn."""
    import os
    import subprocess
    import sys

    from smolctl.data.minhash.params import derive_multipliers

    def imported_by_a_run(name: str) -> set[str]:
        done = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-m",
                "smolctl",
                "dedup",
                str(SAMPLE / "math"),
                str(tmp_path / name),
                "--minhash",
                "--workers",
                "1",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "SMOLCTL_CACHE": str(tmp_path / "cache")},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}

    first, second = imported_by_a_run("first"), imported_by_a_run("second")
    assert "smolctl.data.dedup" in first and "numpy.random" in first
    unwanted = {"pandas", "pyarrow.dataset", "pyarrow.compute", "torch", "transformers", "trl", "datasets"}
    unwanted |= {"safetensors", "concurrent.futures"}  # packed shards' reader and writer; one worker needs no pool
    assert not first & unwanted and not second & (unwanted | {"numpy.random"})
    (entry,) = (tmp_path / "cache" / "minhash-multipliers").iterdir()
    assert entry.read_bytes()[:-32] == derive_multipliers(1, 100).astype("<u4").tobytes()
    outputs = [sorted(p.name for p in (tmp_path / name).rglob("*")) for name in ("first", "second")]
    assert outputs[0] == outputs[1]
    for shard in (tmp_path / "first").rglob("*.parquet"):
        assert shard.read_bytes() == (tmp_path / "second" / shard.relative_to(tmp_path / "first")).read_bytes()


def test_an_input_shard_rewritten_while_dedup_runs_is_refused(tmp_path, monkeypatch):
    """A shard rewritten between the signatures and the filter would be filtered with the other documents' marks:
    its new text kept, the originals' copies elsewhere removed as duplicates of rows that no longer hold them."""
    from smolctl.data import dedup as dedup_module

    texts = [f"document {i} with its own words {i * 13}" for i in range(20)]
    source = write_shards(tmp_path / "in", pa.table({"text": texts + texts}), 2)
    filter_unit = dedup_module.UNIT_RUNNERS["filter"]

    def rewritten_first(plan_, unit, report):
        if unit == 0:
            pq.write_table(pa.table({"text": [f"new {i}" for i in range(25)]}), source / "part-00000.parquet")
        return filter_unit(plan_, unit, report)

    monkeypatch.setitem(dedup_module.UNIT_RUNNERS, "filter", rewritten_first)
    with pytest.raises(UserError, match=r"part-00000\.parquet: changed while dedup was running"):
        dedup(source, tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_heap_settings_let_a_freed_array_be_made_again_without_page_faults():
    """With glibc's defaults a freed 24 MB array is unmapped, and the next one is faulted in page by page again;
    with reuse_freed_memory() the second comes from the heap as it is. A fresh process: the test runner's own
    heap history would decide otherwise."""
    import os
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt only")
    probe = """
import resource, sys
import numpy as np
from smolctl import heap
applied = heap.reuse_freed_memory() if sys.argv[1] == "tuned" else True
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del_me = np.ones(3 * 2**20)  # 24 MB, every page written
    del del_me
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
"""
    env = {**os.environ, "NUMPY_MADVISE_HUGEPAGE": "0"}
    runs = {}
    for mode in ("default", "tuned"):
        done = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        applied, first, second = done.stdout.split()
        runs[mode] = (applied == "True", int(first), int(second))
    pages = 3 * 2**20 * 8 // 4096
    assert runs["default"][2] > pages // 2  # the probe sees the faults it is meant to remove
    assert runs["tuned"][0] and runs["tuned"][2] < pages // 10


def test_a_work_table_the_disk_refuses_is_a_refused_write(tmp_path, monkeypatch):
    """arrow's write error (errno 28 under its own longer message) must reach the worker pool as the WriteRefused
    that keeps the finished units, not as an OSError it takes for bad input: a full disk under a pool run failed
    so whenever the signatures table, not a raw work file, was the write that found the disk full."""
    import errno

    from smolctl.errors import WriteRefused

    def full(table, where, **options):
        Path(where).write_bytes(b"PAR1")  # a temporary begun, then the disk is full
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(dedup_stages.pq, "write_table", full)
    target = tmp_path / "00000.parquet"
    with pytest.raises(WriteRefused, match=r"00000\.parquet: cannot write: No space left on device"):
        dedup_stages._write_table(target, pa.table({"id": ["a"]}))
    assert list(tmp_path.iterdir()) == []
