"""`smolctl mix`: achieved weights, determinism, repetition limits, stages and interpolation, bad inputs."""

from __future__ import annotations

import base64
import decimal
import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from smolctl.data.mix import MixResult, SourceReport, StageReport, prepare_mix
from smolctl.data.mix_schedule import MixSchedule, parse_source, schedule_from_flags, schedule_from_recipe
from smolctl.data.tokenizer import load_rust_tokenizer
from smolctl.errors import UserError
from smolctl.shards import open_documents, read_manifest


def mix(sources: list[str], output: Path, **options):
    return prepare_mix(schedule_from_flags(sources, **options), output).run()


def read_rows(folder: Path) -> pa.Table:
    source = open_documents(folder)
    return pa.Table.from_batches(list(source.iter_batches()), schema=source.schema)


def byte_shares(table: pa.Table) -> dict[str, float]:
    sizes = pc.binary_length(table["text"]).to_numpy(zero_copy_only=False)
    names = table["source"].to_numpy(zero_copy_only=False)
    return {name: sizes[names == name].sum() / sizes.sum() for name in set(names)}


def write_recipe(path: Path, sample: Path, body: str) -> Path:
    sources = "".join(f'[sources.{n}]\npath = "{sample / n}"\n\n' for n in ("web", "code", "math"))
    path.write_text(body.split("[[stages]]", 1)[0] + sources + "[[stages]]" + body.split("[[stages]]", 1)[1])
    return path


SOURCES = ["web={}/web:0.5", "code={}/code:0.3", "math={}/math:0.2"]


def test_achieved_byte_weights_are_within_one_percent(sample, tmp_path):
    result = mix([s.format(sample) for s in SOURCES], tmp_path / "out", bytes_="3MB", max_repeat=4, shuffle_buffer=500)
    shares = byte_shares(read_rows(tmp_path / "out"))
    for name, target in {"web": 0.5, "code": 0.3, "math": 0.2}.items():
        assert abs(shares[name] - target) < 0.01
    reported = {s.name: s for s in result.stages[0].sources}
    for name, share in shares.items():  # the manifest's numbers are the output's numbers
        assert reported[name].achieved_weight == pytest.approx(share, abs=1e-9)
    assert reported["math"].repeat > 3  # math (190 KB) is repeated to reach 600 KB
    assert sum(s.units for s in reported.values()) == pytest.approx(3_000_000, rel=0.01)
    assert read_manifest(tmp_path / "out")["mix"]["stages"][0]["sources"][2]["name"] == "math"


def test_achieved_token_weights_are_within_one_percent(sample, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    mix(
        [f"web={sample}/web:6", f"code={sample}/code:2.5", f"math={sample}/math:1.5"],
        tmp_path / "out",
        tokens="400K",
        tokenizer=str(tokenizer_dir),
        max_repeat=3,
    )
    rows = read_rows(tmp_path / "out")
    # auto counts these small sources exactly, and exact mode writes the rows it wrote before sample mode existed
    manifest = read_manifest(tmp_path / "out")
    estimate = manifest["mix"]["token_estimate"]
    assert estimate["requested"] == "auto" and {s["mode"] for s in estimate["sources"].values()} == {"exact"}
    # The tokenizer that set the token weights is named as pack names it, and is one of the mix's inputs.
    packed_name = {"path": str(tokenizer_dir.resolve()), "fingerprint": load_rust_tokenizer(tokenizer_dir).fingerprint}
    assert manifest["mix"]["tokenizer"] == packed_name
    assert str(tokenizer_dir.resolve()) in [ref["path"] for ref in manifest["inputs"]]
    order = "\n".join(f"{s} {i}" for s, i in zip(rows["source"].to_pylist(), rows["id"].to_pylist()))
    assert (
        hashlib.sha256(order.encode()).hexdigest() == "7180a375c9c4b325fd98c255090478ded84ee69a84a16b05bbf651afea85a2b6"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    counts = np.array(
        [
            len(ids) + 1 if ids else 0
            for ids in tokenizer(rows["text"].to_pylist(), add_special_tokens=False)["input_ids"]
        ]
    )
    names = rows["source"].to_numpy(zero_copy_only=False)
    assert counts.sum() == pytest.approx(400_000, rel=0.01)
    for name, target in {"web": 0.6, "code": 0.25, "math": 0.15}.items():
        assert abs(counts[names == name].sum() / counts.sum() - target) < 0.01


class CountingBackend:
    """The Rust tokenizer, counting the documents it is asked to encode."""

    def __init__(self, backend):
        self.backend, self.documents = backend, 0

    def encode_batch_fast(self, texts, **options):
        self.documents += len(texts)
        return self.backend.encode_batch_fast(texts, **options)


def test_sample_estimate_reaches_the_token_shares_pack_counts_within_half_a_point(sample, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from smolctl.data.pack import PackConfig, pack

    sources = [f"web={sample}/web:6", f"code={sample}/code:2.5", f"math={sample}/math:1.5"]
    options = {
        "tokens": "400K",
        "tokenizer": str(tokenizer_dir),
        "max_repeat": 3,
        "shuffle_buffer": 1000,
        "token_estimate": "sample",
        "token_sample": 600,
    }
    job = prepare_mix(schedule_from_flags(sources, **options), tmp_path / "out")
    job.backend = counting = CountingBackend(job.backend)
    result = job.run()
    estimates = read_manifest(tmp_path / "out")["mix"]["token_estimate"]
    assert estimates["requested"] == "sample" and result.token_estimates == estimates["sources"]
    calibration = estimates["sources"]
    # Only the sample and the large documents were tokenized: about 600 of web's 1,851 documents and those of
    # 1/600 of its bytes or more, all of code (545) and math (237).
    assert counting.documents == sum(c["sample_documents"] + c["large_documents"] for c in calibration.values())
    assert 450 < calibration["web"]["sample_documents"] < 750 and calibration["math"]["sample_documents"] == 237
    # The shares as `pack` counts them: its total is the sum of the per-source counts of the same tokenizer.
    packed = pack(
        str(tmp_path / "out"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=256, strategy="concat"),
    )
    rows = read_rows(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    counts = np.array(
        [
            len(ids) + 1 if ids else 0
            for ids in tokenizer(rows["text"].to_pylist(), add_special_tokens=False)["input_ids"]
        ]
    )
    assert counts.sum() == packed.stats.tokens
    names = rows["source"].to_numpy(zero_copy_only=False)
    for name, target in {"web": 0.6, "code": 0.25, "math": 0.15}.items():
        assert abs(counts[names == name].sum() / counts.sum() - target) < 0.005, name
    # The calibration is the sample's own ratio; math, sampled whole, has its true bytes per token and no error.
    math = read_rows(sample / "math")["text"].to_pylist()
    math_ids = sum(len(ids) for ids in tokenizer(math, add_special_tokens=False)["input_ids"])
    assert calibration["math"]["bytes_per_token"] == pytest.approx(sum(len(t.encode()) for t in math) / math_ids)
    assert calibration["math"]["relative_standard_error"] == 0.0
    web = calibration["web"]
    assert web["bytes_per_token"] == pytest.approx(web["sample_bytes"] / web["sample_tokens"])
    assert 0 < web["relative_standard_error"] < 0.05 and 0 <= web["holdout_error"] < 0.1
    # An array run (tasks in reverse order) writes the same bytes.
    for stage in ("measure", "write"):
        for task in reversed(range(3)):
            prepare_mix(schedule_from_flags(sources, **options), tmp_path / "array").run(
                stage=stage, tasks=3, task_id=task
            )
    shards = [[s["sha256"] for s in read_manifest(tmp_path / out)["shards"]] for out in ("out", "array")]
    assert len(shards[0]) > 1 and shards[0] == shards[1]


def paragraphs_with(sample: Path, folder: Path, count: int, make: Callable[[random.Random], str]) -> Path:
    """12,000 short English paragraphs of the sample corpus with `count` documents of another cost among them,
    each `make` of the same seeded random source."""

    web = [t for f in sorted((sample / "web").glob("part-*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    paragraphs = [p for t in web for p in t.split("\n\n") if len(p.strip()) > 40]
    rng = random.Random(0)
    texts = [f"{rng.choice(paragraphs)} #{i}" for i in range(12000)]
    for _ in range(count):
        where = rng.randrange(len(texts))
        texts.insert(where, make(rng))
    folder.mkdir()
    pq.write_table(pa.table({"text": texts}), folder / "part-00000.parquet")
    return folder


def cjk(characters: int) -> Callable[[random.Random], str]:
    """Under an English tokenizer a CJK byte costs about a token, an English one a third of that."""
    return lambda rng: "".join(rng.choice("这是一个测试文档用于检查中文处理") for _ in range(characters))


def mixed_share(sources: list[str], out: Path, tokenizer_dir: Path, seed: int, token_sample: int, tokens: str):
    """The mix's result and the share of source 'mixed' in the tokens `pack` would count (EOS included)."""
    from transformers import AutoTokenizer

    options = {"tokens": tokens, "tokenizer": str(tokenizer_dir), "seed": seed, "token_estimate": "sample"}
    result = mix(sources, out, token_sample=token_sample, max_repeat=100, **options)
    rows = read_rows(out)
    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir))(rows["text"].to_pylist(), add_special_tokens=False)
    counts = np.array([len(i) + 1 if i else 0 for i in ids["input_ids"]])
    names = rows["source"].to_numpy(zero_copy_only=False)
    return result, counts[names == "mixed"].sum() / counts.sum()


def test_sample_estimate_gives_text_beyond_ascii_its_own_cost(sample, tokenizer_dir, tmp_path):
    """Thirty CJK documents of 7.5 KB among the paragraphs, each under the large-document bound (1/250 of the
    source's bytes): priced by the fit or not at all, depending on what the sample holds. One ratio for the source
    misprices whichever script the mix picks more of than the sample held."""
    mixed = paragraphs_with(sample, tmp_path / "mixed", 30, cjk(2500))
    (tmp_path / "small").mkdir()  # a second source sampled whole (80 documents), so that it never warns
    pq.write_table(read_rows(sample / "web").select(["text"]).slice(0, 80), tmp_path / "small" / "p.parquet")
    sources = [f"mixed={mixed}:1", f"web={tmp_path / 'small'}:1"]

    def run(seed: int):
        result, share = mixed_share(sources, tmp_path / f"out-{seed}", tokenizer_dir, seed, 250, "100K")
        assert result.token_estimates["mixed"]["large_documents"] == 0
        return result, result.token_estimates["mixed"], share

    # Seed 6 samples two of the CJK documents, one in each half: the fit prices CJK bytes, nothing to warn of.
    result, calibration, share = run(6)
    assert calibration["sample_extra_bytes"] > 0 and calibration["tokens_per_extra_byte"] > 0.5
    assert abs(share - 0.5) < 0.005 and result.warnings() == []
    # Seed 0 samples one: the fit still prices it, but one half of the sample cannot price CJK text for the other.
    result, calibration, share = run(0)
    assert calibration["tokens_per_extra_byte"] > 0.5 and abs(share - 0.5) < 0.005
    assert len(result.warnings()) == 1 and "one half" in result.warnings()[0]
    # Seed 5 samples none: CJK is priced as English, 0.54 of the tokens, and the run says why.
    result, calibration, share = run(5)
    assert calibration["extra_bytes_unsampled"] and share > 0.53
    assert any("beyond ASCII" in warning for warning in result.warnings())


def test_sample_estimate_counts_documents_too_large_to_sample_exactly(sample, tokenizer_dir, tmp_path):
    """Eight base64 blobs of 8 KB among 2.2 MB of paragraphs: ASCII, so nothing marks them, at about three times an
    English byte's cost. A uniform sample of 1,000 documents (one in twelve) held one or none of them, and priced
    as English the ones a mix picked gave the source 0.524 and 0.523 of the tokens for a target of 0.5 (seeds 1
    and 7), with no warning. Each holds more than 1/1000 of the source's bytes, so each is now tokenized whatever
    the sample."""
    mixed = paragraphs_with(sample, tmp_path / "mixed", 8, lambda rng: base64.b64encode(rng.randbytes(6000)).decode())
    sources = [f"mixed={mixed}:1", f"web={sample}/web:1"]
    for seed in (1, 7):
        result, share = mixed_share(sources, tmp_path / f"out-{seed}", tokenizer_dir, seed, 1000, "300K")
        calibration = result.token_estimates["mixed"]
        assert calibration["large_document_bytes"] == pytest.approx(
            open_documents(mixed, sized_columns=["text"]).column_bytes("text") / 1000
        )
        assert calibration["large_documents"] >= 8 and calibration["large_bytes"] >= 8 * 8000
        assert abs(share - 0.5) < 0.005, seed
        assert result.warnings() == []


def test_large_documents_are_found_by_the_text_columns_bytes_alone(sample, tokenizer_dir, tmp_path):
    """The same blobs in a source that also keeps each document's HTML, four times its text: the footers' bytes
    of all columns put the bound at 14 KB, above every blob, and seed 1 gave the source 0.522 of the tokens for
    a target of 0.5, with no warning. The bound is the text column's bytes over `token_sample`."""
    mixed = paragraphs_with(sample, tmp_path / "mixed", 8, lambda rng: base64.b64encode(rng.randbytes(6000)).decode())
    table = pq.read_table(mixed / "part-00000.parquet")
    html = [f"<html><body><p>{text}</p></body></html>" * 4 for text in table["text"].to_pylist()]
    pq.write_table(table.append_column("html", pa.array(html)), mixed / "part-00000.parquet")
    source = open_documents(mixed, sized_columns=["text"])
    assert sum(source.file_bytes) > 4 * source.column_bytes("text") > 4 * 2_000_000
    # The footers' count of the text column: its UTF-8 bytes and four bytes of length for each document.
    text = sum(len(t.encode()) for t in table["text"].to_pylist())
    assert source.column_bytes("text") == pytest.approx(text + 4 * table.num_rows, rel=0.01)
    sources = [f"mixed={mixed}:1", f"web={sample}/web:1"]
    result, share = mixed_share(sources, tmp_path / "out", tokenizer_dir, 1, 1000, "300K")
    calibration = result.token_estimates["mixed"]
    assert calibration["large_document_bytes"] < 3000 and calibration["large_documents"] >= 8
    assert abs(share - 0.5) < 0.005 and result.warnings() == []


def test_a_source_of_repeated_documents_is_counted_exactly_where_its_footers_under_count_it(tokenizer_dir, tmp_path):
    """Parquet's dictionary encoding stores a repeated text once, and the footer's sizes count it once: 20 texts
    repeated over 20,000 rows read as 16 bytes each, so every document is large and none is left to estimate.
    That run stopped on an empty fit ("the token sample holds no tokens"); it counts every document instead."""
    paragraphs = [f"paragraph number {i} " * 8 for i in range(20)]
    (tmp_path / "dup").mkdir()
    pq.write_table(pa.table({"text": [paragraphs[i % 20] for i in range(20000)]}), tmp_path / "dup" / "p.parquet")
    assert sum(open_documents(tmp_path / "dup").file_bytes) < 20000 * 20  # the footer's count
    options = {"tokens": "50K", "tokenizer": str(tokenizer_dir), "token_estimate": "sample", "token_sample": 1000}
    result = mix([f"dup={tmp_path / 'dup'}:1"], tmp_path / "out", **options)
    calibration = result.token_estimates["dup"]
    assert calibration["large_documents"] == 20000 and calibration["estimated_documents"] == 0
    assert calibration["bytes_per_token"] is None  # no sample to take it from; null, not Infinity, in the manifest
    tokenizer = load_rust_tokenizer(str(tokenizer_dir)).backend
    rows = read_rows(tmp_path / "out")["text"].to_pylist()
    exact = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(rows, add_special_tokens=False))
    assert result.stages[0].sources[0].units == exact
    json.loads((tmp_path / "out" / "manifest.json").read_text(), parse_constant=pytest.fail)


def whitespace_word_tokenizer(folder: Path, words: list[str]) -> Path:
    """A word-level tokenizer folder (as BERT-like and SentencePiece folders behave): whitespace alone gives no ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1} | {word: i + 2 for i, word in enumerate(sorted(set(words)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<eos>"])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_sample_estimate_counts_no_end_for_documents_that_tokenize_to_nothing(tmp_path):
    """pack appends EOS only to documents with ids; under a word-level or SentencePiece tokenizer a whitespace-only
    document has none. The estimate measures that share on the sample instead of giving every such document an EOS."""
    from smolctl.data.mix_blocks import source_key
    from smolctl.data.mix_tokens import TokenSample, calibrate, document_sizes, measure_file, sample_key
    from smolctl.data.tokenizer import load_rust_tokenizer

    rng = np.random.default_rng(5)
    words = [f"w{i}" for i in range(300)]
    texts = [" \n " if i % 2 else " ".join(rng.choice(words, size=rng.integers(1, 12))) for i in range(6000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    backend = load_rust_tokenizer(str(whitespace_word_tokenizer(tmp_path / "tok", words))).backend
    source = open_documents(tmp_path / "docs.parquet")
    exact = int(document_sizes(pa.array(texts), backend).sum())
    for seed in range(3):
        measured = measure_file(
            source, 0, source_key(seed, "s"), "text", backend, TokenSample(sample_key(seed, "s"), 0.1, np.inf)
        )
        calibration = calibrate(
            "s",
            measured["sample_bytes"],
            measured["sample_extra"],
            measured["sample_tokens"],
            source_documents=len(texts),
            source_bytes=int(document_sizes(pa.array(texts), None).sum()),
            source_extra_bytes=0,
            estimated_documents=int(measured["nonempty"].sum()),
        )
        estimate = (
            calibration.estimate(measured["units"], measured["extra"], measured["nonempty"]).sum()
            + measured["sampled"].sum()
        )
        assert abs(estimate / exact - 1) < 0.02, (seed, estimate, exact)  # each whitespace EOS was +13%
        assert 0.4 < calibration.ends_per_document < 0.6


def test_the_token_fit_recovers_each_cost_and_falls_back_to_one_ratio():
    """Documents costing exactly 0.25 ids per byte and 0.4 more per extra byte, in varying mixes: the fit finds
    both, with no residual (standard error 0) and halves that predict each other (split-half error 0). Extra
    bytes under 1% of the sample's, or a fixed share of every document's, leave one ratio."""
    from smolctl.data.mix_tokens import calibrate, fit_tokens

    rng = np.random.default_rng(3)
    b = rng.integers(200, 5000, 400).astype(np.float64)
    m = np.floor(b * rng.choice([0.0, 0.0, 0.3, 0.6], 400))
    t = 0.25 * b + 0.4 * m
    sizes = {"source_documents": 4000, "source_bytes": 10**7, "source_extra_bytes": 0, "estimated_documents": 3600}
    calibration = calibrate("s", b.astype(np.int64), m.astype(np.int64), t.astype(np.int64), **sizes)
    assert calibration.tokens_per_byte == pytest.approx(0.25, abs=1e-3)
    assert calibration.tokens_per_extra_byte == pytest.approx(0.4, abs=1e-3)
    assert calibration.relative_standard_error < 1e-3 and calibration.holdout_error < 1e-3
    # With noise, weighting by 1/bytes makes the fit reproduce the sample's own total (a plain least-squares fit
    # through the origin would not): the estimate of the sample is the sample.
    noisy = t * rng.uniform(0.7, 1.3, 400)
    per_byte, per_extra = fit_tokens(b, m, noisy)
    assert (per_byte * b + per_extra * m).sum() == pytest.approx(noisy.sum(), rel=1e-9)
    # One ratio: the sample's ids over its bytes.
    sparse = np.where(np.arange(400) == 0, 10.0, 0.0)
    assert fit_tokens(b, sparse, 0.25 * b + 0.4 * sparse) == ((0.25 * b + 0.4 * sparse).sum() / b.sum(), 0.0)
    fixed = b / 2
    assert fit_tokens(b, fixed, 0.45 * b)[1] == 0.0


def test_the_estimate_at_write_time_is_the_measured_one_and_the_sample_is_left_out(tokenizer_dir, tmp_path):
    """`sizes` (what a written slice counts) prices each document as the measuring path priced its bin, extra
    bytes included; the measured bins hold only the documents outside the sample, whose extra bytes the sample
    holds instead."""
    from smolctl.data.mix_blocks import source_key
    from smolctl.data.mix_tokens import (
        TokenSample,
        calibrate,
        document_sizes,
        extra_bytes,
        measure_file,
        sample_key,
        text_bytes,
    )
    from smolctl.data.tokenizer import load_rust_tokenizer

    rng = np.random.default_rng(1)
    texts = [
        "".join(rng.choice(list("这是一个测试文档用于检查中文处理"), 40)) if i % 5 == 0 else f"plain english words {i}"
        for i in range(2000)
    ]
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    source = open_documents(tmp_path / "docs.parquet")
    backend = load_rust_tokenizer(str(tokenizer_dir)).backend
    measured = measure_file(
        source, 0, source_key(0, "s"), "text", backend, TokenSample(sample_key(0, "s"), 0.3, np.inf)
    )
    array = pa.array(texts)
    every_extra = int(extra_bytes(array, text_bytes(array)).sum())
    assert measured["sample_extra"].sum() > 0 and measured["extra"].sum() > 0
    assert measured["extra"].sum() + measured["sample_extra"].sum() == every_extra == 2 * 40 * 400
    calibration = calibrate(
        "s",
        measured["sample_bytes"],
        measured["sample_extra"],
        measured["sample_tokens"],
        source_documents=2000,
        source_bytes=int(text_bytes(array).sum()),
        source_extra_bytes=every_extra,
        estimated_documents=int(measured["nonempty"].sum()),
    )
    assert calibration.tokens_per_extra_byte != 0
    sizes = calibration.sizes(array, backend)
    per_document = calibration.estimate(text_bytes(array), extra_bytes(array, text_bytes(array)), np.ones(2000, int))
    assert np.array_equal(sizes, per_document)
    chinese = sizes[::5].sum() / 400
    expected = 120 * calibration.tokens_per_byte + 80 * calibration.tokens_per_extra_byte + 1
    assert abs(chinese - expected) < 0.01
    # A large document (TokenSample) is counted at write time as the measuring path counted it: exactly.
    calibration.large_document_bytes = 100  # the Chinese documents' 120 bytes, not the English ones' ~25
    counted = calibration.sizes(array, backend)
    assert np.array_equal(counted[::5], document_sizes(array.take(np.arange(0, 2000, 5)), backend))
    assert np.delete(counted, np.arange(0, 2000, 5)).tolist() == np.delete(sizes, np.arange(0, 2000, 5)).tolist()


def test_estimates_are_rounded_along_the_running_total():
    """Bins of one short document each: rounded one by one, every 1.75-token estimate became 2 (a bias of +3%)."""
    from smolctl.data.mix_tokens import TokenCalibration

    # 0.25 tokens per byte, half the documents end in EOS
    calibration = TokenCalibration(
        10_000, 10_000, 0, 9_900, np.inf, 0, 0, 0, 0, 100, 1000, 0, 250, 50, 0.25, 0.0, None, None
    )
    text_bytes = np.tile([5, 22], 500)
    estimate = calibration.estimate(text_bytes, np.zeros(1000, dtype=np.int64), np.ones(1000, dtype=np.int64))
    expected = (text_bytes * 0.25 + 0.5).sum()
    assert abs(estimate.sum() - expected) <= 1 and np.abs(estimate - (text_bytes * 0.25 + 0.5)).max() < 1
    assert estimate.dtype == np.int64


def test_max_repeat_is_a_ceiling_and_documents_that_fit_it_are_taken(tmp_path):
    """A slice ends at the bin boundary nearest its amount, which could lie past max_repeat (1.53 uses at 1.5);
    a documents budget that fits max_repeat exactly (4 + 6 of 10 documents) was judged by the average document
    size and refused whenever the first stage took the longer documents."""
    texts = [f"ten-{i} " + "w" * (10 + i) for i in range(10)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "ten.parquet")
    for max_repeat in (1.5, 2.5, 3.3):
        result = mix([f"ten={tmp_path / 'ten.parquet'}:1"], tmp_path / f"no-budget-{max_repeat}", max_repeat=max_repeat)
        assert result.stages[0].sources[0].repeat <= max_repeat
    recipe = tmp_path / "walk.toml"
    stages = "".join(
        f'[[stages]]\nname = "s{i}"\ndocuments = {n}\nweights = {{ t = 1 }}\n' for i, n in ((1, 4), (2, 6))
    )
    recipe.write_text(f'[sources.t]\npath = "{tmp_path / "ten.parquet"}"\n' + stages)
    for seed in range(8):
        prepare_mix(schedule_from_recipe(recipe, seed=seed), tmp_path / f"walk-{seed}").run()
        rows = read_rows(tmp_path / f"walk-{seed}")
        assert sorted(rows["text"].to_pylist()) == sorted(texts), seed  # every document once, across the stages


def test_auto_samples_only_large_sources():
    plan = MixSchedule({}, [], tokenizer="tok", token_sample=1000)
    assert plan.sample_fraction(10_000) is None and plan.sample_fraction(10_001) == pytest.approx(1000 / 10_001)
    plan.token_estimate = "sample"
    assert plan.sample_fraction(500) == 1.0 and plan.sample_fraction(4000) == 0.25
    plan.token_estimate = "exact"
    assert plan.sample_fraction(10**9) is None
    assert MixSchedule({}, [], token_sample=1000).sample_fraction(10**9) is None  # no tokenizer: bytes


def test_sample_mode_takes_its_bound_from_the_footers_read_when_the_sources_are_opened(
    sample, tokenizer_dir, tmp_path, monkeypatch
):
    """The large-document bound is the text column's bytes in every file's footer, which opening a source reads
    anyway. Read again per measuring unit (one file), a source of N files read N x N footers, and every array
    task as many."""
    from smolctl import shards

    table = read_rows(sample / "web").select(["text"])
    (tmp_path / "web").mkdir()
    for i in range(8):
        pq.write_table(table.slice(i * 20, 20), tmp_path / "web" / f"part-{i}.parquet")
    (tmp_path / "more").mkdir()
    pq.write_table(table.slice(160, 100), tmp_path / "more" / "part-0.parquet")
    sources = [f"web={tmp_path / 'web'}:1", f"more={tmp_path / 'more'}:1"]
    options = {"tokens": "5K", "tokenizer": str(tokenizer_dir), "token_estimate": "sample", "token_sample": 40}
    footers = []
    monkeypatch.setattr(shards, "read_footer", lambda path: footers.append(path) or pq.read_metadata(path))
    job = prepare_mix(schedule_from_flags(sources, **options), tmp_path / "out")
    assert len(footers) == 9  # opening the sources
    job.run()
    assert len(footers) == 9
    text_bytes = sum(pq.read_metadata(f).row_group(0).column(0).total_uncompressed_size for f in footers[:8])
    assert job.sources["web"].column_bytes("text") == text_bytes
    # 40 of 160 documents: ten mean documents is the bound
    assert job.token_sample("web").large_bytes == pytest.approx(text_bytes / 160 * 10)


def test_same_seed_same_bytes_and_sources_interleaved(sample, tmp_path):
    sources = [s.format(sample) for s in SOURCES]
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        mix(sources, tmp_path / name, bytes_="800KB", seed=seed, shuffle_buffer=200)
    shards = {n: [s["sha256"] for s in read_manifest(tmp_path / n)["shards"]] for n in "abc"}
    assert shards["a"] == shards["b"] != shards["c"]
    first_block = read_rows(tmp_path / "a").slice(0, 200)["source"].to_pylist()
    assert set(first_block) == {"web", "code", "math"}  # every block holds the sources in proportion


def test_max_repeat_error_names_the_weight_a_source_can_carry(sample, tmp_path):
    sources = [f"web={sample}/web:0.5", f"math={sample}/math:0.5"]
    with pytest.raises(UserError) as error:
        mix(sources, tmp_path / "out", bytes_="1MB")
    message = str(error.value)
    math_bytes = text_bytes(sample / "math")
    assert f"has {math_bytes:,} bytes in 237 documents" in message and "max_repeat 1" in message
    carry = float(message.split("at most ")[1].split(" ")[0])
    assert carry == pytest.approx(math_bytes / 1_000_000, rel=1e-3)
    assert not (tmp_path / "out").exists()
    # the weight it names is one the source can carry
    result = mix(
        [f"web={sample}/web:{1 - carry * 0.999}", f"math={sample}/math:{carry * 0.999}"], tmp_path / "ok", bytes_="1MB"
    )
    assert {s.name: s.repeat for s in result.stages[0].sources}["math"] <= 1.0


def text_bytes(folder: Path) -> int:
    return int(pc.sum(pc.binary_length(read_rows(folder)["text"])).as_py())


def test_stages_continue_through_sources_and_interpolate(sample, tmp_path):
    recipe = write_recipe(
        tmp_path / "mix.toml",
        sample,
        """
seed = 3
max_repeat = 1.0
shuffle_buffer = 100

[[stages]]
name = "stable"
bytes = 400_000
weights = { web = 60, code = 30, math = 10 }

[[stages]]
name = "decay"
bytes = 300_000
weights = { web = 80, code = 20, math = 0 }
end_weights = { web = 20, code = 40, math = 40 }
""",
    )
    result = prepare_mix(schedule_from_recipe(recipe), tmp_path / "out").run()
    stable, decay = (read_rows(tmp_path / "out" / name) for name in ("stable", "decay"))
    for name, target in byte_shares(stable).items():
        assert abs(target - {"web": 0.6, "code": 0.3, "math": 0.1}[name]) < 0.01
    # the schedule's mean over the stage, then its two halves: a + (b - a)/4 and a + 3(b - a)/4
    for name, target in {"web": 0.5, "code": 0.3, "math": 0.2}.items():
        assert abs(byte_shares(decay)[name] - target) < 0.01
    half = decay.num_rows // 2
    first, second = byte_shares(decay.slice(0, half)), byte_shares(decay.slice(half))
    assert first["web"] == pytest.approx(0.65, abs=0.05) and second["web"] == pytest.approx(0.35, abs=0.05)
    assert first["math"] == pytest.approx(0.10, abs=0.04) and second["math"] == pytest.approx(0.30, abs=0.05)
    # stage two reads documents stage one did not (max_repeat 1: no document twice in the whole mix)
    ids = stable["id"].to_pylist() + decay["id"].to_pylist()
    assert len(ids) == len(set(ids))
    decay_report = {s.name: s for s in result.stages[1].sources}
    assert decay_report["web"].start_weight == 0.8 and decay_report["web"].target_weight == pytest.approx(0.5)
    # the top-level folder is a dataset of every stage in order, with a manifest per stage
    top = read_manifest(tmp_path / "out")
    assert top["stages"] == ["stable", "decay"] and top["rows"] == stable.num_rows + decay.num_rows
    assert list(dict.fromkeys(s["name"].split("/")[0] for s in top["shards"])) == ["stable", "decay"]
    assert read_manifest(tmp_path / "out" / "decay")["kind"] == "documents"
    assert open_documents(tmp_path / "out").num_rows == top["rows"]


def test_pack_reads_a_whole_mix_stage_by_stage(sample, tokenizer_dir, tmp_path):
    from smolctl.data.pack import PackConfig, pack
    from smolctl.shards import open_packed

    recipe = write_recipe(
        tmp_path / "mix.toml",
        sample,
        """
[[stages]]
name = "first"
documents = 300
weights = { web = 1, code = 1 }

[[stages]]
name = "second"
documents = 200
weights = { math = 1 }
""",
    )
    prepare_mix(schedule_from_recipe(recipe), tmp_path / "mix").run()
    result = pack(
        str(tmp_path / "mix"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=128, strategy="concat"),
    )
    packed = open_packed(tmp_path / "packed")
    positions = np.concatenate([packed.load_shard(i)["position_ids"] for i in range(len(packed.files))])
    # concat pads only at the end of each unit (input shard): one shard per stage here, so no row holds two stages
    assert len(read_manifest(tmp_path / "mix")["shards"]) == 2 and int((positions[:, -1] < 0).sum()) == 2
    assert result.stats.documents == read_manifest(tmp_path / "mix")["rows"]


def test_interpolate_moves_to_the_next_stage_and_sources_may_differ_in_columns(sample, tmp_path):
    extra = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"text": ["an extra document"] * 50, "score": np.arange(50.0)}), extra)
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f"""
max_repeat = 100.0
[sources.web]
path = "{sample / "web"}"
[sources.extra]
path = "{extra}"
[[stages]]
name = "one"
documents = 400
weights = {{ web = 1, extra = 0 }}
interpolate = true
[[stages]]
name = "two"
documents = 100
weights = {{ web = 1, extra = 1 }}
""")
    result = prepare_mix(schedule_from_recipe(recipe), tmp_path / "out").run()
    one = result.stages[0].sources
    assert [s.end_weight for s in one] == [0.5, 0.5] and one[1].target_weight == pytest.approx(0.25)
    rows = read_rows(tmp_path / "out" / "two")
    assert rows.schema.names == ["id", "text", "origin", "score", "source"]
    from_web = pc.equal(rows["source"], "web")
    assert rows.filter(from_web)["score"].null_count == rows.filter(from_web).num_rows
    assert rows.filter(pc.invert(from_web))["id"].null_count == rows.filter(pc.invert(from_web)).num_rows


def test_weights_near_the_float_limit_normalise():
    """1e308 + 1e308 is inf: the weights are scaled by the largest before they are summed."""
    plan = schedule_from_flags(["web=data/sample/web:1e308", "code=data/sample/code:1e308"], documents="10")
    assert plan.stages[0].start == {"web": 0.5, "code": 0.5}


def _save_in_step(barrier, path):
    from smolctl.data import mix_blocks

    saving = np.savez_compressed

    def save_then_wait(file, **arrays):  # both copies have written their temporary file before either renames it
        saving(file, **arrays)
        barrier.wait(timeout=30)

    mix_blocks.np.savez_compressed = save_then_wait
    mix_blocks.save_arrays(path, documents=np.arange(5))


def test_two_copies_of_one_array_task_write_the_same_unit_at_once(tmp_path):
    """A requeued task can run while its first copy still does: each writes its own temporary file, so neither
    finds the other's renamed away (which failed the task, and an `afterok` array chain with it)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    copies = [context.Process(target=_save_in_step, args=(barrier, tmp_path / "00000.npz")) for _ in range(2)]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.join(timeout=60)
    assert [copy.exitcode for copy in copies] == [0, 0]
    assert np.load(tmp_path / "00000.npz")["documents"].tolist() == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.npz"]


def test_parse_source_splits_on_the_last_colon():
    assert parse_source("web=C:/data/web:0.5") == ("web", "C:/data/web", 0.5)
    assert parse_source("code=s3://bucket/code:12") == ("code", "s3://bucket/code", 12.0)


@pytest.mark.parametrize(
    "sources, options, message",
    [
        (["web=data/sample/web"], {}, "is not NAME=PATH:WEIGHT"),
        (["web=data/sample/web:lots"], {}, "weight 'lots' is not a number"),
        (["web=data/sample/web:0", "code=data/sample/code:0"], {}, "the weights sum to zero"),
        (["web=data/sample/web:-1", "code=data/sample/code:2"], {}, "weight of 'web' is -1"),
        (["web=data/sample/nowhere:1"], {}, "no such file or folder"),
        (["chat=data/sample/chat:1"], {}, "has no column 'text'"),
        (["web=data/sample/web:1"], {"tokens": "1M"}, "a budget in tokens needs a tokenizer"),
        (["web=data/sample/web:1"], {"bytes_": "lots"}, "cannot read 'lots' as an amount"),
        (["web=data/sample/web:1", "web=data/sample/code:1"], {}, "a source name is used twice"),
        (["web=data/sample/web:1"], {"max_repeat": 0}, "is not a positive number"),
        (
            ["web=data/sample/web:1"],
            {"tokenizer": "tok", "token_estimate": "fast"},
            "--token-estimate: unknown mode 'fast'",
        ),
        (["web=data/sample/web:1"], {"token_estimate": "sample"}, "sample counts tokens, and no tokenizer is given"),
        (["web=data/sample/web:1"], {"tokenizer": "tok", "token_sample": 0}, "token_sample: 0 documents"),
        ([], {}, "no sources given"),
    ],
)
def test_bad_flags(sources, options, message):
    with pytest.raises(UserError, match=message):
        prepare_mix(schedule_from_flags(sources, **options), "unused-output")


def test_bad_recipes(sample, tmp_path):
    base = """
[[stages]]
name = "one"
weights = { web = 1 }
"""
    cases = [
        (base.replace('name = "one"', 'name = "one"\ninterpolat = true'), "unknown key — did you mean 'interpolate'"),
        (base.replace("web = 1", "wbe = 1"), "weight for unknown source 'wbe'"),
        (base + '\n[[stages]]\nname = "one"\nweights = { web = 1 }\n', "a stage name is used twice"),
        (
            base.replace("weights = { web = 1 }", "weights = { web = 1 }\ninterpolate = true"),
            "interpolate = true on the last stage",
        ),
        (base.replace('"one"', '"../up"'), "is not a usable folder name"),
        (base.replace('"one"', '"manifest.json"'), "is the name of the mix's own manifest"),
        (
            base.replace("weights = { web = 1 }", "weights = { web = 1 }\nbytes = 10\ndocuments = 5"),
            "more than one budget",
        ),
    ]
    for body, message in cases:
        with pytest.raises(UserError, match=message):
            schedule_from_recipe(write_recipe(tmp_path / "r.toml", sample, body))


def test_schema_clash_is_an_error(sample, tmp_path):
    pq.write_table(pa.table({"text": ["x"], "origin": [1]}), tmp_path / "other.parquet")
    with pytest.raises(UserError, match="column 'origin' is int64 but string"):
        prepare_mix(schedule_from_flags([f"web={sample}/web:1", f"other={tmp_path}/other.parquet:1"]), tmp_path / "out")


@pytest.mark.parametrize(
    "left, right, widest",
    [
        (pa.int32(), pa.int64(), pa.int64()),
        (pa.uint8(), pa.uint32(), pa.uint32()),
        (pa.dictionary(pa.int32(), pa.int16()), pa.int16(), pa.int16()),
        (pa.null(), pa.string(), pa.string()),
        (pa.binary(), pa.large_binary(), pa.large_binary()),
        (pa.float32(), pa.float64(), pa.float64()),  # one writer's float32 scores, another's float64
        (pa.int64(), pa.float64(), None),  # a wide int would silently lose digits as a double
        (pa.uint64(), pa.int64(), None),
        (pa.int64(), pa.decimal128(10, 2), None),
        (pa.string(), pa.binary(), None),
    ],
)
def test_only_lossless_widening_combines_sources(tmp_path, left, right, widest):
    expected = {}
    for name, kind in (("a", left), ("b", right)):
        texts = [f"document {i} of source {name}" for i in range(30)]
        plain = kind.value_type if pa.types.is_dictionary(kind) else kind
        if pa.types.is_null(plain):
            values = [None] * 30
        elif pa.types.is_string(plain) or pa.types.is_binary(plain) or pa.types.is_large_binary(plain):
            values = [f"{name}{i}" if pa.types.is_string(plain) else f"{name}{i}".encode() for i in range(30)]
        else:  # numbers: each source its own, and for integers the largest its type holds
            largest = (
                2 ** (plain.bit_width - pa.types.is_signed_integer(plain)) - 1 if pa.types.is_integer(plain) else 0
            )
            values = [i + (50 if name == "b" else 0) for i in range(29)] + [largest]
        if pa.types.is_decimal(plain):
            values = [decimal.Decimal(v) for v in values]
        column = pa.array(values, plain)
        column = column.dictionary_encode() if pa.types.is_dictionary(kind) else column
        expected.update(zip(texts, values, strict=True))
        text = pa.array(texts, pa.large_string() if name == "b" else pa.string())  # widens: never the one blamed
        pq.write_table(pa.table({"text": text, "n": column}), tmp_path / f"{name}.parquet")
    flags = schedule_from_flags([f"a={tmp_path}/a.parquet:1", f"b={tmp_path}/b.parquet:1"], documents="20")
    if widest is None:
        with pytest.raises(UserError, match=r"column 'n' is .* in source"):
            prepare_mix(flags, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    prepare_mix(flags, tmp_path / "out").run()
    assert open_documents(tmp_path / "out").schema.field("n").type == widest
    rows = read_rows(tmp_path / "out")
    assert rows.num_rows == 20 and set(rows["source"].to_pylist()) == {"a", "b"}
    for text, value in zip(rows["text"].to_pylist(), rows["n"].to_pylist(), strict=True):
        assert value == expected[text]  # every value carried over, none turned null or truncated


@pytest.mark.parametrize("estimate", ["exact", "sample"])
def test_sources_written_by_different_tools_mix_as_one(sample, tokenizer_dir, tmp_path, estimate):
    """pandas writes string (and categoricals as dictionaries), Polars large_string or string_view: the same
    values mix into the same rows, in the widest of the types, whichever way tokens are estimated."""
    recast = {"web": lambda c: c, "code": lambda c: c.cast(pa.large_string()), "math": lambda c: c.dictionary_encode()}
    for name, as_type in recast.items():
        (tmp_path / name).mkdir()
        for shard in sorted((sample / name).glob("*.parquet")):
            table = pq.ParquetFile(shard).read()
            table = table.set_column(table.schema.get_field_index("text"), "text", as_type(table.column("text")))
            ids = table.column("id").cast(pa.string_view())
            table = table.set_column(table.schema.get_field_index("id"), "id", ids)
            if name == "code":  # Polars' List(String): views inside a list
                table = table.append_column("tags", pa.array([["py"]] * len(table), pa.large_list(pa.string_view())))
            pq.write_table(table, tmp_path / name / shard.name)
    options = dict(tokens="200K", tokenizer=str(tokenizer_dir), token_estimate=estimate, token_sample=300)
    mix([s.format(sample) for s in SOURCES], tmp_path / "plain", **options)
    mix([s.format(tmp_path) for s in SOURCES], tmp_path / "mixed", **options)
    plain, mixed = read_rows(tmp_path / "plain"), read_rows(tmp_path / "mixed")
    assert mixed.schema.field("text").type == pa.large_string() and mixed.schema.field("id").type == pa.large_string()
    assert set(mixed["source"].to_pylist()) == {"web", "code", "math"}
    for column in ("source", "id", "text"):
        assert mixed[column].to_pylist() == plain[column].to_pylist()
    tags = {(source, str(tags)) for source, tags in zip(mixed["source"].to_pylist(), mixed["tags"].to_pylist())}
    assert tags == {("code", "['py']"), ("web", "None"), ("math", "None")}


def test_cli_recipe_with_overrides_then_pack(sample, tokenizer_dir, tmp_path):
    out = tmp_path / "mix"
    done = run_cli(
        "mix",
        out,
        "--recipe",
        "recipes/demo-mix.toml",
        "--tokenizer",
        tokenizer_dir,
        "--set",
        f"sources.math.path={sample / 'math'}",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["unit"] == "tokens" and [s["name"] for s in result["stages"]] == ["stage-1", "stage-2", "stage-3"]
    assert result["token_estimates"] == {name: {"mode": "exact"} for name in ("web", "code", "math")}
    packed = run_cli("pack", out / "stage-1", tmp_path / "packed", "--tokenizer", tokenizer_dir, "--seq-len", "256")
    assert packed.returncode == 0, packed.stderr
    refused = run_cli("mix", tmp_path / "x", "--recipe", "recipes/demo-mix.toml", "--source", "web=a:1")
    assert refused.returncode == 2 and "cannot be combined with --recipe" in refused.stderr
    assert not (tmp_path / "x").exists()
    bad = run_cli(
        "mix",
        tmp_path / "x",
        "--source",
        f"web={sample / 'web'}:1",
        "--tokenizer",
        tokenizer_dir,
        "--token-estimate",
        "fast",
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --token-estimate: unknown mode 'fast' — use one of auto, sample, exact"
    ]
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------------------------
# Curriculum order


def scored_copy(sample: Path, name: str, tmp: Path) -> Path:
    """The sample source with a `difficulty` column unrelated to length or order on disk; code scores higher than
    web, so a plain sort by score would put web first and break the weights."""
    table = read_rows(sample / name)
    rng = np.random.default_rng(len(name))
    low = {"web": 0, "code": 25}[name]
    path = tmp / f"{name}.parquet"
    pq.write_table(table.append_column("difficulty", pa.array(rng.integers(low, low + 50, table.num_rows))), path)
    return path


CURRICULUM = """
seed = 5
max_repeat = 2.0
shuffle_buffer = 300
[sources.web]
path = "{web}"
[sources.code]
path = "{code}"
[[stages]]
name = "warmup"
documents = 300
weights = {{ web = 1 }}
order = "{order}"
[[stages]]
name = "main"
documents = 1500
weights = {{ web = 70, code = 30 }}
order = "{order}"
"""


def curriculum_mix(sample: Path, tmp: Path, order: str, name: str, seed: int = 5) -> Path:
    recipe = tmp / f"{name}.toml"
    recipe.write_text(
        CURRICULUM.format(
            web=scored_copy(sample, "web", tmp), code=scored_copy(sample, "code", tmp), order=order
        ).replace("seed = 5", f"seed = {seed}")
    )
    prepare_mix(schedule_from_recipe(recipe), tmp / name).run()
    return tmp / name


def block_byte_shares(table: pa.Table, block: int) -> list[dict[str, float]]:
    return [byte_shares(table.slice(start, block)) for start in range(0, table.num_rows - block + 1, block)]


def test_curriculum_rises_within_each_stage_and_keeps_the_weights_along_it(sample, tmp_path):
    ordered = curriculum_mix(sample, tmp_path, "ascending:difficulty", "ordered")
    shuffled = curriculum_mix(sample, tmp_path, "shuffle", "shuffled")
    warmup = read_rows(ordered / "warmup")["difficulty"].to_numpy()
    assert (np.diff(warmup) >= 0).all(), "one source: the whole stage from easy to hard"
    main, plain = read_rows(ordered / "main"), read_rows(shuffled / "main")
    assert sorted(main["id"].to_pylist()) == sorted(plain["id"].to_pylist()), "the same rows, reordered"
    scores, names = main["difficulty"].to_numpy(), main["source"].to_numpy(zero_copy_only=False)
    for name in ("web", "code"):
        assert (np.diff(scores[names == name]) >= 0).all(), f"{name} never gets easier along the stage"
    for start in range(0, main.num_rows, 300):
        assert (np.diff(scores[start : start + 300]) >= 0).all(), "every block is sorted"
    assert scores[:300].mean() < scores[-300:].mean()
    # Each block keeps the sources' byte shares as closely as the shuffled mix does.
    target = {"web": 0.7, "code": 0.3}
    worst = {
        label: max(abs(shares.get(n, 0.0) - t) for shares in block_byte_shares(rows, 300) for n, t in target.items())
        for label, rows in (("ordered", main), ("shuffled", plain))
    }
    assert worst["ordered"] <= worst["shuffled"] + 0.02, worst
    assert read_manifest(ordered / "main")["mix"]["stages"][0]["order"] == "ascending:difficulty"


def test_curriculum_same_seed_same_bytes_and_proxies(sample, tmp_path):
    first = curriculum_mix(sample, tmp_path, "ascending:compression", "a")
    again = curriculum_mix(sample, tmp_path, "ascending:compression", "b")
    other = curriculum_mix(sample, tmp_path, "ascending:compression", "c", seed=6)
    shas = {n: [s["sha256"] for s in read_manifest(p)["shards"]] for n, p in (("a", first), ("b", again), ("c", other))}
    assert shas["a"] == shas["b"] != shas["c"]
    import zlib

    texts = read_rows(first / "warmup")["text"].to_pylist()
    ratios = [len(zlib.compress(t.encode())) / len(t.encode()) for t in texts]
    assert ratios == sorted(ratios)
    lengths = curriculum_mix(sample, tmp_path, "ascending:length", "d")
    sizes = pc.binary_length(read_rows(lengths / "warmup")["text"]).to_numpy()
    assert (np.diff(sizes) >= 0).all()


@pytest.mark.parametrize(
    "order, message",
    [
        ("descending:length", "is not an order"),
        ("ascending:", "is not an order"),
        ("ascending:rank", "source 'web' has no column 'rank'"),
        ("ascending:id", "column 'id' of source 'web' holds string, not numbers"),
    ],
)
def test_bad_curriculum_orders(sample, tmp_path, order, message):
    recipe = tmp_path / "m.toml"
    recipe.write_text(
        CURRICULUM.format(
            web=scored_copy(sample, "web", tmp_path), code=scored_copy(sample, "code", tmp_path), order=order
        )
    )
    with pytest.raises(UserError, match=message):
        prepare_mix(schedule_from_recipe(recipe), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_budget_in_documents_gives_exactly_that_many(sample, tmp_path):
    """The slices that meet the weights hold about the budget in documents (1,029 for 1,000 on the sample); the
    mix scales them to hold exactly the budget, each source keeping its share of those documents."""
    for budget in (1, 7, 1000):
        result = mix([f"web={sample}/web:1"], tmp_path / f"one-{budget}", documents=str(budget))
        assert result.stages[0].documents == read_rows(tmp_path / f"one-{budget}").num_rows == budget
    result = mix([s.format(sample) for s in SOURCES], tmp_path / "three", documents="1000")
    rows = read_rows(tmp_path / "three")
    assert result.stages[0].documents == rows.num_rows == 1000
    shares = byte_shares(rows)
    for name, target in {"web": 0.5, "code": 0.3, "math": 0.2}.items():
        assert abs(shares[name] - target) < 0.01, shares


def test_recipe_budgets_are_written_as_the_flags_take_them(sample, tmp_path):
    """`bytes = "60KB"` and `documents = 1e2` in a recipe mean what --bytes 60KB and --documents 1e2 mean."""
    body = '[[stages]]\nname = "a"\nweights = {web = 1}\nbytes = "60KB"\n\n[[stages]]\nname = "b"\nweights = {code = 1}\ndocuments = 1e2\n'
    recipe = write_recipe(tmp_path / "mix.toml", sample, body)
    stages = schedule_from_recipe(recipe).stages
    assert [(s.budget, s.budget_kind) for s in stages] == [(60_000, "bytes"), (100, "documents")]
    with pytest.raises(UserError, match=r"stages\[0\] \(a\)\.bytes: -5 must be a positive count"):
        schedule_from_recipe(write_recipe(tmp_path / "bad.toml", sample, body.replace('"60KB"', "-5")))


def test_a_source_left_short_of_its_weight_is_warned_about(sample, tmp_path):
    """One 100 KB document against a 50-document source at 0.5/0.5 with no budget: the small source's size
    bounds the stage, so the big document cannot be taken and its weight ends at 0; the summary must say so."""
    pq.write_table(pa.table({"text": ["x" * 100_000]}), tmp_path / "big.parquet")
    pq.write_table(pa.table({"text": [f"small doc {i}" for i in range(50)]}), tmp_path / "small.parquet")
    done = run_cli(
        "mix",
        tmp_path / "out",
        "--source",
        f"big={tmp_path}/big.parquet:0.5",
        "--source",
        f"small={tmp_path}/small.parquet:0.5",
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "source 'big': achieved weight 0.000 against 0.500" in warnings[0], warnings
    assert "(100,000 bytes in 1 document) to come closer" in warnings[0]
    # With --json (scripts, Slurm) the warning is in the object and still on stderr.
    scripted = run_cli(
        "mix",
        tmp_path / "scripted",
        "--source",
        f"big={tmp_path}/big.parquet:0.5",
        "--source",
        f"small={tmp_path}/small.parquet:0.5",
        "--json",
    )
    (listed,) = json.loads(scripted.stdout)["warnings"]
    assert listed in warnings[0] and scripted.stderr.strip() == warnings[0]
    balanced = run_cli(
        "mix", tmp_path / "sample", "--source", f"web={sample}/web:0.5", "--source", f"code={sample}/code:0.5"
    )
    assert balanced.returncode == 0 and "warning:" not in balanced.stdout + balanced.stderr


def test_tokens_are_counted_in_pieces_of_text_the_same_as_whole(sample, tokenizer_dir, monkeypatch):
    """mix counts tokens in batches of 4,096 documents: a batch of long documents goes to the tokenizer in pieces
    of at most TEXT_BYTES_PER_CALL bytes (its Encodings take ~40 bytes per byte of text), with the same counts."""
    from smolctl import arrow_arrays
    from smolctl.data.mix_tokens import text_tokens
    from smolctl.data.tokenizer import load_rust_tokenizer

    texts = pa.concat_arrays(
        [
            pq.read_table(f, columns=["text"])["text"].combine_chunks()
            for f in sorted((sample / "code").glob("*.parquet"))
        ]
        + [pa.array([None, ""], pa.string())]
    )
    backend = load_rust_tokenizer(str(tokenizer_dir)).backend
    whole = [len(e) for e in backend.encode_batch_fast([t or "" for t in texts.to_pylist()], add_special_tokens=False)]
    monkeypatch.setattr(arrow_arrays, "TEXT_BYTES_PER_CALL", 5_000)
    calls = []

    class Recording:
        def encode_batch_fast(self, batch, **options):
            calls.append([len(text.encode()) for text in batch])
            return backend.encode_batch_fast(batch, **options)

    assert text_tokens(texts, Recording()).tolist() == whole
    assert len(calls) > 10 and all(sum(call) <= 5_000 or len(call) == 1 for call in calls)
    assert sum(map(len, calls)) == len(texts)


def test_a_hive_partitioned_source_keeps_each_documents_partition_values(sample, tmp_path):
    """Spark's `partitionBy("lang")` layout: the partition is in the folder names only, and a mixed document must
    carry its own folder's value (mix reads the rows it picks file by file, apart from the batch reader)."""
    web = read_rows(sample / "web").select(["id", "text"])
    for index, lang in enumerate(["en", "fr", "de"]):
        (tmp_path / "web" / f"lang={lang}").mkdir(parents=True)
        pq.write_table(web.slice(index * 200, 200), tmp_path / "web" / f"lang={lang}" / "part-0.parquet")
    mix([f"web={tmp_path / 'web'}:0.6", f"math={sample / 'math'}:0.4"], tmp_path / "out", bytes_="400KB")
    out = read_rows(tmp_path / "out")
    origin = {row: ["en", "fr", "de"][i // 200] for i, row in enumerate(web.column("id").to_pylist()[:600])}
    picked = out.filter(pc.equal(out["source"], "web"))
    assert picked.num_rows > 50 and out.schema.field("lang").type == pa.string()
    assert [origin[i] for i in picked["id"].to_pylist()] == picked["lang"].to_pylist()


def test_a_sample_too_small_for_half_a_point_is_a_warning_naming_its_share_error(sample, tokenizer_dir, tmp_path):
    """Two standard errors of a source's token estimate move its share w by 2 w (1 - w) e: above half a point,
    the run says so even where the split-half check passes (a sweep found a 0.6-point miss it did not flag)."""

    def run(token_sample: int, out: str):
        sources = [f"web={sample}/web:4", f"code={sample}/code:1"]  # shares 0.8 and 0.2: w (1 - w) = 0.16
        options = {"tokens": "200K", "tokenizer": str(tokenizer_dir), "token_estimate": "sample", "max_repeat": 3}
        return prepare_mix(schedule_from_flags(sources, token_sample=token_sample, **options), tmp_path / out).run()

    small = run(100, "small")
    points = {name: 100 * 2 * 0.16 * e["relative_standard_error"] for name, e in small.token_estimates.items()}
    warned = [name for name in ("web", "code") if points[name] > 0.5]
    assert warned and len(small.warnings()) == len(warned)
    for name, warning in zip(warned, small.warnings()):
        assert small.token_estimates[name]["holdout_error"] < 0.04  # not the split-half warning
        assert (
            warning.startswith(f"source '{name}': two standard errors") and f"by {points[name]:.2f} points" in warning
        )
    assert run(1500, "large").warnings() == []


def test_the_standard_error_warning_counts_only_the_tokens_the_fit_prices(sample, tokenizer_dir, tmp_path):
    """Eighty base64 blobs of 60 KB hold two thirds of the source's bytes, and more of its tokens, and are counted
    exactly; a fit of 150 sampled paragraphs prices the rest. Two of its standard errors, applied to the whole
    source, moved its share by about a point, a warning; applied to the share of its tokens the fit prices (an
    eighth: base64 costs more tokens a byte than English) they move it by an eighth of that, and the share `pack`
    counts is as close to the estimated one as that says."""
    mixed = paragraphs_with(sample, tmp_path / "mixed", 80, lambda rng: base64.b64encode(rng.randbytes(45000)).decode())
    (tmp_path / "small").mkdir()  # a second source sampled whole (80 documents), so that it never warns
    pq.write_table(read_rows(sample / "web").select(["text"]).slice(0, 80), tmp_path / "small" / "p.parquet")
    sources = [f"mixed={mixed}:1", f"web={tmp_path / 'small'}:1"]
    result, share = mixed_share(sources, tmp_path / "out", tokenizer_dir, 1, 150, "2M")
    calibration = result.token_estimates["mixed"]
    assert calibration["large_documents"] == 80
    # The share of the source's tokens outside the blobs, counted: a share of bytes (0.31) would overstate it.
    tokenizer = load_rust_tokenizer(str(tokenizer_dir)).backend
    texts = read_rows(mixed)["text"].to_pylist()
    tokens = np.array([len(e.ids) + 1 for e in tokenizer.encode_batch(texts, add_special_tokens=False)])
    large = np.array([len(t.encode()) >= calibration["large_document_bytes"] for t in texts])
    priced = tokens[~large].sum() / tokens.sum()
    assert calibration["priced_share"] == pytest.approx(priced, rel=0.01) and priced < 0.2  # EOS included: 1.7% more
    assert 1 - calibration["large_bytes"] / calibration["source_bytes"] > 0.3
    assert 2 * 0.25 * calibration["relative_standard_error"] > 0.005  # the whole source's bound: over half a point
    assert result.warnings() == []
    estimated = next(s.achieved_weight for s in result.stages[0].sources if s.name == "mixed")
    assert abs(share - estimated) < 0.005 * priced


def test_the_estimates_warnings_scale_the_fits_errors_by_the_tokens_it_prices():
    """Both warnings about a sampled source's estimate, with a quarter of its tokens priced by the fit and the
    rest counted exactly in large documents: the errors the fit makes bear on that quarter only."""
    stage = StageReport("mix", "out", "tokens", 1000, "tokens", 1000, 10, [SourceReport("s", 0.5, 0.5, 0.5, 0.5)])

    def warnings(**estimate) -> list[str]:
        fields = {"mode": "sample", "estimated_documents": 10, "sample_documents": 150, "large_documents": 3}
        fields |= {"priced_share": 0.25, "extra_bytes_unsampled": False} | estimate
        return MixResult("out", "tokens", 0, 1.0, [stage], 0.0, token_estimates={"s": fields}).warnings()

    # Two standard errors of 2%: a point over the whole source, a quarter of one over what the fit prices.
    assert warnings(relative_standard_error=0.02, holdout_error=0.0) == []
    (warning,) = warnings(relative_standard_error=0.06, holdout_error=0.0)
    assert "move its share by 0.75 points" in warning
    assert "on the 25% of its tokens outside the large documents counted exactly" in warning
    assert warnings(relative_standard_error=0.06, holdout_error=0.0, large_documents=0, priced_share=1.0) != []
    # A split-half error of 10% is 2.5% of the source's tokens, under the 4% that warns; 20% is 5%.
    assert warnings(relative_standard_error=0.0, holdout_error=0.10) == []
    (warning,) = warnings(relative_standard_error=0.0, holdout_error=0.20)
    assert "misses one half of its sample by 20.0%" in warning and "on the 25% of its tokens" in warning
