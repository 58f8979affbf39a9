"""`smolctl pack`: exactly-once packing, position ids, document masking in a real SmolLM3 forward, bad inputs."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from smolctl import arrow_arrays
from smolctl.data import pack_rows, pack_tokens
from smolctl.data.pack import PackConfig, pack
from smolctl.data.pack_rows import best_fit_decreasing
from smolctl.data.tokenizer import load_rust_tokenizer, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from smolctl.shards import lineage_chain, open_documents, open_packed, read_manifest, sha256_file, verify_checksums


def sample_texts(folder: Path) -> list[str]:
    return [t for batch in open_documents(folder).iter_batches(columns=["text"]) for t in batch.column(0).to_pylist()]


def packed_rows(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    source = open_packed(folder)
    shards = [source.load_shard(i) for i in range(len(source.files))]
    return np.concatenate([s["input_ids"] for s in shards]), np.concatenate([s["position_ids"] for s in shards])


def segments(ids: np.ndarray, positions: np.ndarray) -> list[tuple[int, ...]]:
    """Every run of real tokens that starts at position 0, across all rows (padding, position -1, dropped)."""
    out = []
    for row_ids, row_positions in zip(ids, positions):
        real = row_positions >= 0
        starts = np.flatnonzero((row_positions == 0) & real).tolist()
        ends = starts[1:] + [int(real.sum())]
        out += [tuple(row_ids[a:b].tolist()) for a, b in zip(starts, ends)]
    return out


def expected_pieces(tokenizer, texts: list[str], seq_len: int) -> list[tuple[int, ...]]:
    """Each document's ids + EOS, cut into seq_len pieces: what `bfd --long-docs split` must hold exactly once."""
    pieces = []
    for text in texts:
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pieces += [tuple(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    return pieces


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_bfd_split_holds_every_token_exactly_once(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "code")
    result = pack(
        str(sample / "code"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=300, buffer_tokens=40_000),
    )  # several buffers
    ids, positions = packed_rows(tmp_path / "packed")
    assert Counter(segments(ids, positions)) == Counter(expected_pieces(tokenizer, texts, 300))
    assert result.stats.split_documents > 0 and result.stats.documents == len(texts)
    # Documents that fit in a row decode back to the original text (byte-level BPE round-trips exactly).
    whole = {tokenizer.decode(list(seg[:-1])) for seg in segments(ids, positions) if len(seg) < 300}
    short = [t for t in texts if len(tokenizer(t, add_special_tokens=False)["input_ids"]) < 299]
    assert set(short) <= whole
    manifest = read_manifest(tmp_path / "packed")
    assert manifest["kind"] == "packed" and manifest["seq_len"] == 300 and manifest["strategy"] == "bfd"
    assert manifest["tokens"] == result.stats.tokens == int((positions >= 0).sum())
    assert manifest["padding_tokens"] == int((positions < 0).sum())
    assert manifest["tokenizer"]["eos_token_id"] == tokenizer.eos_token_id
    assert manifest["tokenizer"]["fingerprint"] and manifest["tokenizer"]["path"] == str(tokenizer_dir.resolve())


def test_concat_is_the_corpus_in_order(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "math")
    result = pack(
        str(sample / "math"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=128, strategy="concat", batch_documents=50),
    )
    ids, positions = packed_rows(tmp_path / "packed")
    stream = np.concatenate(
        [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts if t]
    )
    assert np.array_equal(ids[positions >= 0], stream)
    # Each input shard is a unit packed on its own: only the last row of each is padded.
    shard_ends = np.cumsum([s["rows"] for s in read_manifest(tmp_path / "packed")["shards"]]) - 1
    padded = np.flatnonzero((positions < 0).any(axis=1))
    assert len(open_documents(sample / "math").files) == 2 and set(padded) <= set(shard_ends) and len(padded) == 2
    assert result.stats.padding_tokens == int((positions < 0).sum()) < 2 * 128
    assert (positions[:, 0] == 0).all()  # a document continued from the previous row starts afresh


def test_position_ids_restart_at_documents_and_padding_is_marked(sample, tokenizer_dir, tokenizer, tmp_path):
    pack(str(sample / "web"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=200))
    ids, positions = packed_rows(tmp_path / "packed")
    assert ids.dtype == positions.dtype == np.int32 and ids.shape == positions.shape and ids.shape[1] == 200
    real = positions >= 0
    assert (positions[:, 0] == 0).all()
    steps = np.diff(positions, axis=1)
    inside = real[:, 1:] & (positions[:, 1:] != 0)
    assert (steps[inside] == 1).all()
    # every document ends with EOS: the token before each document start (and the last real token) is EOS
    before_start = positions[:, 1:] == 0
    assert (ids[:, :-1][before_start] == tokenizer.eos_token_id).all()
    assert (ids[~real] == tokenizer.pad_token_id).all()
    # padding only at row ends
    assert not (~real[:, :-1] & real[:, 1:]).any()


def test_truncate_keeps_the_first_seq_len_tokens(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "math")
    result = pack(
        str(sample / "math"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=64, long_docs="truncate"),
    )
    ids, positions = packed_rows(tmp_path / "packed")
    expected = [p for p in expected_pieces(tokenizer, texts, 64)]
    firsts = [
        tuple((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:64]) for t in texts if t
    ]
    assert Counter(segments(ids, positions)) == Counter(firsts)
    assert result.stats.truncated_tokens == sum(map(len, expected)) - sum(map(len, firsts)) > 0


def test_best_fit_decreasing_fills_the_tightest_row():
    lengths = np.array([6, 5, 4, 3, 2, 2, 1, 1])
    row_of, offset, rows = best_fit_decreasing(lengths, 8)
    fill = np.bincount(row_of, weights=lengths)
    assert rows == 3 and sorted(fill.tolist()) == [8, 8, 8]
    for r in range(rows):  # documents of a row do not overlap
        spans = sorted((offset[i], offset[i] + lengths[i]) for i in np.flatnonzero(row_of == r))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("mode", ["split", "truncate"])
def test_long_documents_are_cut_into_full_rows_that_are_views_of_the_batch(mode):
    # Documents of 3, 10, 8 and 2 tokens at seq_len 4: the 10 gives two full rows and a remainder of 2, the 8 two
    # full rows and nothing. A copy of the full rows would hold the same values, so the views are checked too:
    # the full rows are 16 of the 23 tokens, so copying them would double the batch.
    lengths = np.array([3, 10, 8, 2])
    batch = pack_rows.TokenBatch(np.arange(lengths.sum(), dtype=np.int32), lengths)
    stats = pack_rows.PackStats()
    kept, full_rows = pack_rows.split_long_documents(batch, 4, mode, stats)
    if mode == "truncate":
        assert full_rows == [] and kept.lengths.tolist() == [3, 4, 4, 2]
        assert kept.ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 13, 14, 15, 16, 21, 22]
        assert (stats.truncated_documents, stats.truncated_tokens) == (2, 10)
        return
    assert kept.lengths.tolist() == [3, 2, 2] and kept.ids.tolist() == [0, 1, 2, 11, 12, 21, 22]
    assert [rows.ids.tolist() for rows in full_rows] == [list(range(3, 11)), list(range(13, 21))]
    assert [rows.lengths.tolist() for rows in full_rows] == [[4, 4], [4, 4]]
    assert all(np.shares_memory(rows.ids, batch.ids) for rows in full_rows)
    assert stats.split_documents == 2


def test_full_rows_are_copied_where_a_view_would_keep_a_mostly_short_batch_alive():
    # One document of 9 tokens among ten of 3 at seq_len 4: 8 tokens of full rows beside 31 kept. A view of
    # them would hold all 39 tokens beside the copy of the 31 for as long as the rows wait in a bfd buffer.
    lengths = np.array([3] * 5 + [9] + [3] * 5)
    batch = pack_rows.TokenBatch(np.arange(lengths.sum(), dtype=np.int32), lengths)
    kept, full_rows = pack_rows.split_long_documents(batch, 4, "split", pack_rows.PackStats())
    assert [rows.ids.tolist() for rows in full_rows] == [list(range(15, 23))]
    assert kept.lengths.tolist() == [3] * 5 + [1] + [3] * 5 and len(kept.ids) == 31
    assert not np.shares_memory(full_rows[0].ids, batch.ids)


def random_length_arrays(rng: np.random.Generator):
    """(lengths, capacity) for BFD: the edge cases, then random ones; few distinct lengths make many ties of
    both item lengths and bins' free room, where the placement depends on the tie-breaking."""
    yield np.array([], dtype=np.int64), 8
    yield np.array([5]), 8
    yield np.array([8]), 8
    yield np.full(50, 8), 8
    yield np.full(50, 3), 8
    yield np.array([1, 1, 1]), 1
    yield np.array([0, 3, 0, 5, 0]), 8
    for capacity in (7, 64, 65, 300, 4096):
        for _ in range(40):
            distinct = rng.choice([2, 5, capacity])
            values = rng.integers(1, capacity + 1, size=distinct)
            yield rng.choice(values, size=rng.integers(1, 600)), capacity


@pytest.mark.skipif(pack_rows._pack is None, reason="the C packing kernels were not built")
def test_the_bfd_kernel_places_exactly_as_the_python_definition():
    for lengths, capacity in random_length_arrays(np.random.default_rng(0)):
        kernel = best_fit_decreasing(lengths, capacity)
        python = pack_rows.best_fit_decreasing_python(lengths, capacity)
        assert kernel[2] == python[2]
        np.testing.assert_array_equal(kernel[0], python[0])
        np.testing.assert_array_equal(kernel[1], python[1])
    with pytest.raises(ValueError, match=r"0\.\.capacity"):
        best_fit_decreasing(np.array([3, 9]), 8)
    with pytest.raises(ValueError, match=r"1\.\.2\^31-1"):  # sizes past this would overflow its allocations
        best_fit_decreasing(np.array([3, 9]), 2**62)


@pytest.mark.skipif(pack_rows._pack is None, reason="the C packing kernels were not built")
def test_rows_are_the_same_with_and_without_the_kernels(monkeypatch):
    rng = np.random.default_rng(1)
    for seq_len in (16, 300):
        lengths = rng.integers(1, seq_len + 1, size=500)
        ids = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
        cut = int(lengths[:200].sum())  # two batches of the buffer: documents 0..199 and 200..499
        batches = [pack_rows.TokenBatch(ids[:cut], lengths[:200]), pack_rows.TokenBatch(ids[cut:], lengths[200:])]
        # Full rows cut from long documents: documents of seq_len tokens, each alone at offset 0 of its row.
        whole = rng.integers(0, 50_000, size=(3, seq_len), dtype=np.int32)
        full_rows = pack_rows.TokenBatch(whole.reshape(-1), np.full(3, seq_len, dtype=np.int64))
        bin_of, offset, bins = best_fit_decreasing(lengths, seq_len)
        destination = rng.permutation(bins + len(whole))
        row_of = np.concatenate([destination[bin_of], destination[bins:]])
        offsets = np.concatenate([offset, np.zeros(len(whole), dtype=np.int64)])
        layout = ([*batches, full_rows], row_of, offsets, bins + len(whole), seq_len, 7)
        kernel = pack_rows.assemble_rows(*layout)
        with monkeypatch.context() as without:
            without.setattr(pack_rows, "_pack", None)
            numpy = pack_rows.assemble_rows(*layout)
        for field in ("input_ids", "position_ids", "row_tokens"):
            np.testing.assert_array_equal(getattr(kernel, field), getattr(numpy, field))
        assert (kernel.input_ids[kernel.position_ids < 0] == 7).all() and (kernel.position_ids >= 0).sum() == (
            lengths.sum() + whole.size
        )
        np.testing.assert_array_equal(kernel.input_ids[destination[bins:]], whole)
        assert (kernel.position_ids[destination[bins:]] == np.arange(seq_len)).all()
        assert (kernel.row_tokens[destination[bins:]] == seq_len).all()


class Encoded:
    """What the join kernel reads of a tokenizers Encoding: its length and its `ids` list."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)


@pytest.mark.skipif(pack_tokens._pack is None, reason="the C packing kernels were not built")
def test_the_join_kernel_gives_exactly_the_python_definitions_arrays(tokenizer_dir):
    rng = np.random.default_rng(2)
    for _ in range(200):
        lengths = rng.integers(0, 40, size=rng.integers(0, 30))
        lengths[rng.random(len(lengths)) < 0.3] = 0  # empty documents are dropped, the others get EOS
        documents = [rng.integers(0, 2**31 - 1, size=n).tolist() for n in lengths]
        eos_id = int(rng.integers(0, 2**31 - 1))
        kernel, kernel_empty = pack_tokens.join_encodings([Encoded(d) for d in documents], eos_id)
        python, python_empty = pack_tokens.join_documents_python(documents, lengths, eos_id)
        np.testing.assert_array_equal(kernel.ids, python.ids)
        np.testing.assert_array_equal(kernel.lengths, python.lengths)
        assert kernel_empty == python_empty == int((lengths == 0).sum())
    joined, _ = pack_tokens.join_encodings([Encoded([5, 6]), Encoded([]), Encoded([7])], 0)
    assert joined.ids.tolist() == [5, 6, 0, 7, 0] and joined.lengths.tolist() == [3, 2]
    # The tokenizer's own Encodings, as pack hands them over.
    backend = load_rust_tokenizer(str(tokenizer_dir)).backend
    texts = ["The cat sat.", "", "Ünïcödé and 数学 and emoji 🙂", "x" * 500]
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    joined, empty = pack_tokens.join_encodings(encodings, 3)
    expected = [i for e in encodings if len(e) for i in [*e.ids, 3]]
    assert joined.ids.tolist() == expected and empty == 1
    assert joined.lengths.tolist() == [len(e) + 1 for e in encodings if len(e)]
    for documents in ([[1, -1]], [[2**31]], [[2**70]], [(1, 2)], [[1.0]], [[np.int64(3)]]):
        with pytest.raises(ValueError):
            pack_tokens.join_encodings([Encoded(d) for d in documents], 0)
    with pytest.raises(AttributeError):
        pack_tokens.join_encodings([[1, 2]], 0)  # id lists, not encodings
    # The caller's array must be exactly the size: never a write past it (the sentinel after the view stays).
    for size in (2, 3, 4):  # [1, 2] and its EOS take exactly 3
        memory = np.full(size + 1, -7, dtype=np.int32)
        if size == 3:
            pack_tokens._pack.join_encodings([Encoded([1, 2])], 0, memory[:size])
            assert memory.tolist() == [1, 2, 0, -7]
        else:
            with pytest.raises(ValueError, match="exactly the tokens"):
                pack_tokens._pack.join_encodings([Encoded([1, 2])], 0, memory[:size])
            assert memory[size] == -7


def test_workers_give_the_same_rows(sample, tokenizer_dir, tmp_path):
    config = dict(seq_len=256, batch_documents=100)
    pack(str(sample / "math"), tmp_path / "one", tokenizer_spec=str(tokenizer_dir), config=PackConfig(**config))
    pack(
        str(sample / "math"),
        tmp_path / "two",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(**config, workers=2),
    )
    for a, b in zip(packed_rows(tmp_path / "one"), packed_rows(tmp_path / "two")):
        assert np.array_equal(a, b)


def test_datatrove_token_files(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "math")
    result = pack(
        str(sample / "math"),
        tmp_path / "tokens",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=64, format="datatrove", shard_size="40KB", batch_documents=50),
    )
    manifest = read_manifest(tmp_path / "tokens")
    assert manifest["kind"] == "tokens" and manifest["token_size"] == 2 and len(manifest["shards"]) > 1
    stream = [np.fromfile(tmp_path / "tokens" / s["name"], dtype="<u2") for s in manifest["shards"]]
    ends = [np.fromfile(tmp_path / "tokens" / s["index"], dtype="<u8") for s in manifest["shards"]]
    documents = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts if t]
    assert np.array_equal(np.concatenate(stream), np.concatenate(documents))
    for ids, file_ends in zip(stream, ends):  # each file's index: the cumulative end of each of its documents
        assert file_ends[-1] == len(ids) and (ids[file_ends - 1] == tokenizer.eos_token_id).all()
    assert sum(map(len, ends)) == len(documents) == result.stats.documents
    # Token files are not rows: no row count, padding or sequence length beside the top-level counts.
    assert manifest["stats"] == {"documents": len(documents), "tokens": manifest["tokens"], "skipped_empty": 0}
    assert "seq_len" not in result.to_dict() and result.to_dict()["stats"] == manifest["stats"]
    first_line = (tmp_path / "tokens" / manifest["shards"][0]["metadata"]).read_text().splitlines()[0]
    assert first_line == f"{tokenizer_dir.resolve()}|2"
    # A .ds file is unreadable without its index: verification checks the index and metadata files too.
    assert verify_checksums(tmp_path / "tokens") == []
    (tmp_path / "tokens" / manifest["shards"][0]["index"]).unlink()
    with open(tmp_path / "tokens" / manifest["shards"][1]["metadata"], "a") as metadata:
        metadata.write("x")
    problems = verify_checksums(tmp_path / "tokens")
    assert len(problems) == 2 and "part-00000.ds.index: missing" in problems[0] and "metadata: sha256" in problems[1]
    with pytest.raises(
        UserError, match=r"holds datatrove token files .* pack its documents again without --format datatrove"
    ):
        open_packed(tmp_path / "tokens")


@pytest.mark.parametrize("shard_size", ["6KB", "30rows"])
def test_token_files_roll_inside_a_batch(sample, tokenizer_dir, tmp_path, shard_size):
    """--shard-size smaller than a tokenizer batch (1,000 documents): files roll at the document that fills the
    size (or after that many documents), not once per batch, and together still hold every document once."""
    pq.write_table(pa.table({"text": sample_texts(sample / "math")}), tmp_path / "math.parquet")  # one unit
    pack(
        str(tmp_path / "math.parquet"),
        tmp_path / "tokens",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=64, format="datatrove", shard_size=shard_size),
    )
    manifest = read_manifest(tmp_path / "tokens")
    ends = [np.fromfile(tmp_path / "tokens" / s["index"], dtype="<u8") for s in manifest["shards"]]
    sizes = [(tmp_path / "tokens" / s["name"]).stat().st_size for s in manifest["shards"]]
    assert sum(map(len, ends)) == manifest["documents"] and len(sizes) > 5
    if shard_size == "30rows":
        assert [len(e) for e in ends[:-1]] == [30] * (len(ends) - 1) and 0 < len(ends[-1]) <= 30
    else:  # each file ends with the document that reached 6,000 bytes: without it, it was under
        for file_ends, size in zip(ends[:-1], sizes[:-1]):
            before_last = int(file_ends[-2]) * 2 if len(file_ends) > 1 else 0
            assert size >= 6000 > before_last


def _tokenizer_with_id(tokenizer_dir: Path, folder: Path, token: str, new_id: int) -> Path:
    """A copy of the tokenizer with `token` moved to `new_id`, far above the count of its vocabulary (ids with a
    gap, as some real vocabularies have)."""
    shutil.copytree(tokenizer_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"][token] = new_id
    for added in spec["added_tokens"]:
        if added["content"] == token:
            added["id"] = new_id
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_token_files_hold_ids_above_the_vocabularys_count(sample, tokenizer_dir, tmp_path):
    """The uint16/uint32 width of token files, and the manifest's vocab_size, follow the ids, not the count of the
    vocabulary's entries: an EOS at 70000 is written as 70000 (uint16 wrapped it to 4464), and so is an ordinary
    token at 70000 in a vocabulary with gaps (vocab_size said 2048)."""
    high_eos = _tokenizer_with_id(tokenizer_dir, tmp_path / "high-eos", "<|endoftext|>", 70_000)
    pack(
        str(sample / "math"),
        tmp_path / "tokens",
        tokenizer_spec=str(high_eos),
        config=PackConfig(seq_len=64, format="datatrove"),
    )
    manifest = read_manifest(tmp_path / "tokens")
    assert manifest["token_size"] == 4 and manifest["tokenizer"]["vocab_size"] == 70_001
    ids = np.fromfile(tmp_path / "tokens" / manifest["shards"][0]["name"], dtype="<u4")
    ends = np.fromfile(tmp_path / "tokens" / manifest["shards"][0]["index"], dtype="<u8")
    assert (ids[ends - 1] == 70_000).all() and (np.delete(ids, ends - 1) < 2048).all()
    gap = _tokenizer_with_id(tokenizer_dir, tmp_path / "gap", "e", 70_000)  # a letter every document holds
    for form in ("datatrove", "safetensors"):
        config = PackConfig(seq_len=64, format=form)
        pack(str(sample / "math"), tmp_path / form, tokenizer_spec=str(gap), config=config)
        assert read_manifest(tmp_path / form)["tokenizer"]["vocab_size"] == 70_001
    manifest = read_manifest(tmp_path / "datatrove")
    ids = np.fromfile(tmp_path / "datatrove" / manifest["shards"][0]["name"], dtype="<u4")
    assert manifest["token_size"] == 4 and (ids == 70_000).any()


@pytest.mark.parametrize("piece_bytes", [None, 10])
def test_empty_documents_are_skipped_and_counted(tokenizer_dir, tmp_path, monkeypatch, piece_bytes):
    """Also when a batch reaches the tokenizer in pieces (one document each here): the counts add up over them."""
    if piece_bytes:
        monkeypatch.setattr(arrow_arrays, "TEXT_BYTES_PER_CALL", piece_bytes)
    table = pa.table({"text": ["", "first document", None, "second one"]})
    pq.write_table(table, tmp_path / "docs.parquet")
    progress = []
    result = pack(
        str(tmp_path / "docs.parquet"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=32),
        on_progress=lambda read, tokens: progress.append(read),
    )
    assert result.stats.documents == 2 and result.stats.skipped_empty == 2
    # One batch; in pieces, progress moves as each piece is encoded: [""], ["first document"], [None, "second one"].
    assert progress == ([1, 1, 2] if piece_bytes else [4])
    assert read_manifest(tmp_path / "packed")["skipped_empty"] == 2


def test_the_collector_is_as_it_was_after_pack_succeeds_or_fails(sample, tokenizer_dir, tmp_path, monkeypatch):
    """Tokenising collects young objects less often; a library caller's collector settings come back after it,
    also when a batch fails."""
    import gc

    before = gc.get_threshold()
    pack(str(sample / "math"), tmp_path / "ok", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64))
    assert gc.get_threshold() == before

    def failing(*args):
        assert gc.get_threshold()[0] == pack_tokens.YOUNG_COLLECTION_THRESHOLD
        raise RuntimeError("a batch fails")

    monkeypatch.setattr(pack_tokens, "encode_documents", failing)
    with pytest.raises(RuntimeError, match="a batch fails"):
        pack(
            str(sample / "math"), tmp_path / "failed", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64)
        )
    assert gc.get_threshold() == before


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_documents_do_not_see_each_other(sample, tokenizer_dir, tokenizer, tmp_path, attention):
    """Each document's logits in a packed row equal the document run alone (SmolLM3, no mask, no cache)."""
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    pack(str(sample / "web"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=96))
    ids, positions = packed_rows(tmp_path / "packed")
    row = int(np.argmax((positions == 0).sum(axis=1)))
    assert (positions[row] == 0).sum() >= 3
    row_positions = positions[row].copy()
    padding = row_positions < 0
    row_positions[padding] = np.arange(padding.sum())  # what the trainer does: padding is its own pseudo-document

    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation=attention,
    )
    model = SmolLM3ForCausalLM(config).float().eval()
    input_ids = torch.tensor(ids[row : row + 1], dtype=torch.long)
    with torch.no_grad():
        packed = model(
            input_ids=input_ids, position_ids=torch.tensor(row_positions[None], dtype=torch.long), use_cache=False
        ).logits[0]
        leaked = model(
            input_ids=input_ids,
            position_ids=torch.tensor(row_positions[None], dtype=torch.long),
            attention_mask=torch.ones_like(input_ids),
            use_cache=False,
        ).logits[0]
        starts = np.flatnonzero(positions[row] == 0).tolist() + [int((~padding).sum())]
        for begin, end in itertools.pairwise(starts):
            alone = model(input_ids=input_ids[:, begin:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[begin:end], alone, atol=1e-5, rtol=1e-5)
    # An attention mask switches the packed-sequence masking off: the later documents see the earlier ones.
    assert not torch.allclose(leaked[starts[1] : starts[2]], packed[starts[1] : starts[2]], atol=1e-3)


def test_cli_pack_and_inspect(sample, tokenizer_dir, tmp_path):
    out = tmp_path / "packed"
    done = run_cli("pack", sample / "web", out, "--tokenizer", tokenizer_dir, "--seq-len", "256", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["documents"] == 1851
    shown = run_cli("inspect", out, "--samples", "12", "--json")
    rows = json.loads(shown.stdout)["samples"]
    assert any("⟂" in row["text"] for row in rows)  # document boundaries marked (the text is clipped)
    assert all(row["text"].count("⟂") <= row["documents"] - 1 for row in rows)

    # Decoded by another tokenizer the rows read as plausible nonsense: one given is refused, and the recorded
    # one retrained in place since the pack shows the rows as token ids, saying why.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tokenizer_dir, other)
    rules = json.loads((other / "tokenizer.json").read_text())
    rules["model"]["merges"] = rules["model"]["merges"][:-1]
    (other / "tokenizer.json").write_text(json.dumps(rules))
    refused = run_cli("inspect", out, "--samples", "1", "--tokenizer", other)
    assert (
        refused.returncode == 2 and f"--tokenizer: {other} is not the tokenizer {out} was packed with" in refused.stderr
    )
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = str(other)  # the recorded tokenizer, changed since
    (out / "manifest.json").write_text(json.dumps(manifest))
    shown = run_cli("inspect", out, "--samples", "1", "--json")
    assert shown.returncode == 0 and f"{other} changed since {out} was packed with it" in shown.stderr
    assert json.loads(shown.stdout)["samples"][0]["text"].split()[0].isdigit()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-len", "1"], "--seq-len: 1 is too short"),
        (["--strategy", "greedy"], "unknown strategy 'greedy'"),
        (["--long-docs", "drop"], "unknown choice 'drop'"),
        (["--text-column", "body"], "has no column 'body'"),
    ],
)
def test_bad_options_write_nothing(sample, tokenizer_dir, tmp_path, args, message):
    done = run_cli("pack", sample / "math", tmp_path / "out", "--tokenizer", tokenizer_dir, *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


def test_bad_inputs(sample, tokenizer_dir, tmp_path):
    config = PackConfig(seq_len=64)
    with pytest.raises(UserError, match="not a tokenizer folder"):
        pack(str(sample / "math"), tmp_path / "a", tokenizer_spec=str(sample / "math"), config=config)
    with pytest.raises(UserError, match="no such file"):
        pack(str(tmp_path / "missing"), tmp_path / "a", tokenizer_spec=str(tokenizer_dir), config=config)
    with pytest.raises(UserError, match="holds list"):
        pack(
            str(sample / "chat"),
            tmp_path / "a",
            tokenizer_spec=str(tokenizer_dir),
            config=PackConfig(seq_len=64, text_column="messages"),
        )
    pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    with pytest.raises(UserError, match="is a packed folder, not a dataset"):
        pack(str(tmp_path / "packed"), tmp_path / "b", tokenizer_spec=str(tokenizer_dir), config=config)
    with pytest.raises(UserError, match="already exists"):
        pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    pq.write_table(pa.table({"text": ["", None]}), tmp_path / "empty.parquet")
    with pytest.raises(UserError, match="holds no non-empty documents"):
        pack(str(tmp_path / "empty.parquet"), tmp_path / "c", tokenizer_spec=str(tokenizer_dir), config=config)
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.partial").exists()


def test_a_tokenizer_folder_holding_a_manifest_that_is_not_smolctls_is_named_without_a_kind(
    sample, tokenizer_dir, tmp_path
):
    """pack names its tokenizer in the output's lineage but reads nothing else of its manifest.json: one that is
    not JSON (a stray file, another tool's) stopped the run on "is not valid JSON". `inspect --lineage` shows it in
    the chain and goes on."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tokenizer)
    for stray in ("not json {", json.dumps({"smolctl_version": "0.1.0"})):
        (tokenizer / "manifest.json").write_text(stray)
        out = tmp_path / f"packed-{len(stray)}"
        pack(str(sample / "math"), out, tokenizer_spec=str(tokenizer), config=PackConfig(seq_len=64))
        named = [i for i in read_manifest(out)["inputs"] if i["path"] == str(tokenizer.resolve())]
        assert named == [
            {
                "path": str(tokenizer.resolve()),
                "kind": None,
                "manifest_sha256": sha256_file(tokenizer / "manifest.json"),
            }
        ]
        chain = {entry["path"]: entry for entry in lineage_chain(out)}
        assert chain[str(tokenizer.resolve())]["status"].startswith("its manifest.json is not")
        assert chain[str((sample / "math").resolve())]["status"] == "ok"  # the walk went on past it
        shown = run_cli("inspect", out, "--lineage")
        assert shown.returncode == 0 and "tokenizer" in shown.stdout, shown.stderr
    shutil.copy(tokenizer_dir / "manifest.json", tokenizer / "manifest.json")  # smolctl's own: its kind is named
    pack(str(sample / "math"), tmp_path / "named", tokenizer_spec=str(tokenizer), config=PackConfig(seq_len=64))
    kinds = [i["kind"] for i in read_manifest(tmp_path / "named")["inputs"] if i["path"] == str(tokenizer.resolve())]
    assert kinds == [read_manifest(tokenizer_dir)["kind"]] and kinds != [None]


# The bytes `pack` wrote before its pipeline was made concurrent (issue 23): sha256 of every file of the output,
# the manifest without the fields that name this machine's paths or the time. The tokenizer is conftest's
# (2,048-token BPE on the sample web text); its fingerprint is checked first, so a tokenizers release that trains
# differently fails as that, not as a packing change.
GOLDEN_TOKENIZER = "c478286c7deec5e3"
GOLDEN_CONFIGS = {
    "web-bfd-256": ("web", dict(seq_len=256)),
    "code-bfd-300-small-buffer-rows": ("code", dict(seq_len=300, buffer_tokens=40_000, shard_size="50rows")),
    "math-truncate-64": ("math", dict(seq_len=64, long_docs="truncate", batch_documents=70)),
    "math-concat-128": ("math", dict(seq_len=128, strategy="concat", batch_documents=50)),
    "web-concat-truncate-512": ("web", dict(seq_len=512, strategy="concat", long_docs="truncate", seed=3)),
    "web-bfd-2048-seed": ("web", dict(seq_len=2048, seed=7, shard_size="1MB")),
    "math-datatrove": ("math", dict(seq_len=64, format="datatrove", shard_size="40KB", batch_documents=50)),
}
ARRAY_CHECKED = ("code-bfd-300-small-buffer-rows", "math-datatrove")  # test_array_tasks covers any split
MACHINE_FIELDS = ("created_at", "command", "inputs", "work_fingerprint")


def output_digests(folder: Path) -> dict[str, str]:
    digests = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix != ".metadata" and p.name != "manifest.json"
    }
    for metadata in folder.glob("*.metadata"):  # its first line starts with the tokenizer's path
        digests[metadata.name] = hashlib.sha256(metadata.read_bytes().split(b"|", 1)[1]).hexdigest()
    manifest = {k: v for k, v in read_manifest(folder).items() if k not in MACHINE_FIELDS}
    manifest["tokenizer"] = {k: v for k, v in manifest["tokenizer"].items() if k not in ("path", "name")}
    # A .metadata file starts with the tokenizer's path, so its sha256 is the machine's too
    manifest["shards"] = [{k: v for k, v in s.items() if k != "metadata_sha256"} for s in manifest["shards"]]
    digests["manifest.json"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return digests


GOLDEN = {
    "web-bfd-256": {
        "manifest.json": "4e04e7452feaeb94f5e1ef2ebaae777a8c7041aeee324ae5e2742aa6d91d1097",
        "part-00000.safetensors": "99fe7c48aa9e5851605d9150f5400f8eabedafefa0c75bb451b56d685664aed7",
        "part-00001.safetensors": "6301ab6310bb2e91033b0aa875874423a68812afc95878a366868abe8adfbe7a",
    },
    "code-bfd-300-small-buffer-rows": {
        "manifest.json": "18f9c967372a6afd1f1c12317caf590933aef50cb95f9be1a45a52fba6d6fda7",
        "part-00000.safetensors": "9236647599ff055c6c3c045dbc237014153da7c1310d157c7c9e6e74dda5a671",
        "part-00001.safetensors": "e50ed7fc599de70e63708e4ab5145f73decd03ce63852438e0bc54ff15630c3a",
        "part-00002.safetensors": "0de46a1c02e69ec2255c163129be2e3850faff6aacaaee704233fb52f51b4621",
        "part-00003.safetensors": "df2dfac8a5ed9cac286a31ab32508aad1edea27b331467f8752f0ee048362f4d",
        "part-00004.safetensors": "baf9155464561a140acd527258b81213e63b1db285e54363a60c86d930cf722d",
        "part-00005.safetensors": "88361011637c7d768add0021b803ce2e259c0ed9f920ca6e93ddcd0457faa816",
        "part-00006.safetensors": "294bc11cc78f898ec1142b2a8b8ee63e6b605c9735bc78acd7c63bd2082f84f7",
        "part-00007.safetensors": "60b798b5e18dd5310344e7725f4a5f143895f8e84ad6c2a8b9e5e7c7c18b2aeb",
        "part-00008.safetensors": "f00ebb65d7fa4674321d08f667b28a64b0d598e45a7f31ccc047f8d330d5f275",
        "part-00009.safetensors": "85194c0d20484026cf70471a8fb2a66b819d370b42d7545b6756fdd184c17a7e",
        "part-00010.safetensors": "618cbc890a3e1bc7f034c06458f6dd1845b429a78365b840ebcdd2824b4c4e75",
        "part-00011.safetensors": "8a55186056fc33aaa768a9a7d41aa4da5a110ced5bef575735cc40a30b8b55c4",
        "part-00012.safetensors": "a83567a256ed81d074ebcfcd6b72ab4ab15051f22f962cb90bef911772aa12d1",
        "part-00013.safetensors": "7780db10457e62aacb8b2912f088182d0b6a8ffbd6cbd19182a09308152089d9",
        "part-00014.safetensors": "7e9c8756a25e1dd61cfeab40bf8254b41098f6080edb9f5897082882fea061d5",
        "part-00015.safetensors": "ff0a65cfc3ed7e8577c714000217b68dbdb64e92dd1c8c0b8a58fb698d9f56c9",
    },
    "math-truncate-64": {
        "manifest.json": "1932e9580faefe792888893a8a2653449119f505b09ae5168fbe6d89f0c594b1",
        "part-00000.safetensors": "09d151ec892eda9e561900b03bdb309754b63451c6beec41adde23cccdc95a6b",
        "part-00001.safetensors": "1346a23398874d9c03d44be4a8ee709fed32f93aa27ce79d1df310b7ff6a78bb",
    },
    "math-concat-128": {
        "manifest.json": "bf2171865062342099289c24d9e984ffcf124f722821820b771726cc15f62a10",
        "part-00000.safetensors": "fde46bb16efb08584c1aedc493ce2fcce9f84f112e6d1c04539c33d0a2e9ba2c",
        "part-00001.safetensors": "f3e31023c127227186880c882c0a3b505e8d40653a736d1ae5bd08a142a7cefb",
    },
    "web-concat-truncate-512": {
        "manifest.json": "9f7d4df71667923a82591e85aaf502758feb3faf6be386edf49cdaa85b223ed8",
        "part-00000.safetensors": "eccd5a8b6f49d4343cede0d178949f189a86c130927ab4c2904b81a2970f9c7c",
        "part-00001.safetensors": "a0d75ab06e59614547971abff63a85beeddfa780a96a1f472b3b90d6f9ad328c",
    },
    "web-bfd-2048-seed": {
        "manifest.json": "ba19cd15a86b6cdeea4a14cb8c53e15659d48749880169df0ca74cae23258a30",
        "part-00000.safetensors": "c7572cc9d5f3d45dd66d0ad49a02169d510e092e569afc1181892d53573e18e7",
        "part-00001.safetensors": "1b206eb4a4699dd914993a69e4f57b6d86f3780c7ab913c1a0e43108307d5151",
        "part-00002.safetensors": "fefa67ef20b9c0b79cd65bf0322735ce8253b2754be1219f0234657a0e534719",
        "part-00003.safetensors": "ec810ae34ec0a948bac45e1026eb739f92e05648da79136d94b1e96d922777b8",
    },
    # Re-recorded when token files began to roll inside a batch, at the document that fills --shard-size; its
    # manifest when its stats dropped the rows and padding that token files do not have, and when it began to
    # record the sha256 of each index and metadata file
    "math-datatrove": {
        "manifest.json": "bc023d9f9fb8aabcc8f7fe62c33b02dee9bdab659051a24ceab8987aa7239f80",
        "part-00000.ds": "a3f1103563428ceec0f7e97daeda693eb057aecd0755c3c25830ad1deee9273b",
        "part-00000.ds.index": "da0c3ba3dab194360da75e27834adefdef52041739bbca3151beb8643ccb447f",
        "part-00000.ds.metadata": "735ee4063ae3fcd96a046216817f6f5871bb7caf8d41c25da2497e5e749411df",
        "part-00001.ds": "c4ff3ab29cfc365502cd4a94e9d883e54ccefd47496ffcce772326432fb06c56",
        "part-00001.ds.index": "47044686e8556e3200c40c03fe6982d2c7bad776d47857aab607d41de6862088",
        "part-00001.ds.metadata": "815f34d580b97142ead5339b38f37567ffe361617869226c7ca224a1cd8c9a46",
        "part-00002.ds": "635fb7f09f3be8873025eaf929f9ce73b60d41c52cbe8d772921218d680b2755",
        "part-00002.ds.index": "dbc3bf0952ee60bf83764110a0197eb1681b8331dfd357dc38f37a21f52b8587",
        "part-00002.ds.metadata": "7c04c08f2519db489e20813a502cdabce65e2ec7002c62c58c0ce11684208e01",
        "part-00003.ds": "01b9aa3257dd0095b5582f3fbc512591d3550a0be6c3bb8f6d1dee42fc61234d",
        "part-00003.ds.index": "9ccd4178a9499a2123bff6a62785ea8ad0c55980044cc43c085f83098e7d017b",
        "part-00003.ds.metadata": "9d8e283aaeec0dd15f4188fb1ccca790bba64462079ff13b88b52e0fe25d0224",
    },
}


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_output_bytes_are_unchanged(sample, tokenizer_dir, tmp_path, name):
    folder, options = GOLDEN_CONFIGS[name]
    result = pack(
        str(sample / folder), tmp_path / "plain", tokenizer_spec=str(tokenizer_dir), config=PackConfig(**options)
    )
    assert result.tokenizer["fingerprint"] == GOLDEN_TOKENIZER
    assert output_digests(tmp_path / "plain") == GOLDEN[name]
    if name not in ARRAY_CHECKED:
        return
    for task_id in (1, 0):  # as a two-task array, in reverse order: the same bytes
        pack(
            str(sample / folder),
            tmp_path / "tasks",
            tokenizer_spec=str(tokenizer_dir),
            config=PackConfig(**options),
            tasks=2,
            task_id=task_id,
        )
    assert output_digests(tmp_path / "tasks") == GOLDEN[name]


@pytest.mark.parametrize("name", ["code-bfd-300-small-buffer-rows", "web-bfd-2048-seed"])
def test_output_bytes_are_unchanged_without_the_kernels(sample, tokenizer_dir, tmp_path, monkeypatch, name):
    """An install without a C compiler packs with the Python and numpy definitions: the same bytes."""
    monkeypatch.setattr(pack_rows, "_pack", None)
    monkeypatch.setattr(pack_tokens, "_pack", None)
    folder, options = GOLDEN_CONFIGS[name]
    pack(str(sample / folder), tmp_path / "out", tokenizer_spec=str(tokenizer_dir), config=PackConfig(**options))
    assert output_digests(tmp_path / "out") == GOLDEN[name]


@pytest.mark.parametrize(
    "name, workers",
    [
        ("web-bfd-256", 1),
        ("code-bfd-300-small-buffer-rows", 1),
        ("math-truncate-64", 1),
        ("math-concat-128", 1),
        ("math-datatrove", 2),
    ],
)
def test_batches_of_long_documents_are_encoded_in_pieces_and_pack_the_same_bytes(
    sample, tokenizer_dir, tmp_path, monkeypatch, name, workers
):
    """The tokenizer's Encodings take ~40 bytes per byte of text while a call runs, so a batch is given to it in
    pieces of at most TEXT_BYTES_PER_CALL bytes (a longer document alone). The pieces go to the packer as they
    are, and a bfd buffer closes only where a batch ends: the rows are those of whole batches, byte for byte."""
    limit = 3_000  # the sample's batches hold 60-400 KB: every batch is cut, and its longest documents go alone
    monkeypatch.setattr(arrow_arrays, "TEXT_BYTES_PER_CALL", limit)
    calls: list[list[int]] = []
    encode = pack_tokens.encode_documents

    def recording(backend, texts, eos_id):
        calls.append([len(text.encode()) for text in texts])
        return encode(backend, texts, eos_id)

    monkeypatch.setattr(pack_tokens, "encode_documents", recording)
    folder, options = GOLDEN_CONFIGS[name]
    result = pack(
        str(sample / folder),
        tmp_path / "out",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(**options, workers=workers),
    )
    assert output_digests(tmp_path / "out") == GOLDEN[name]
    if workers == 1:  # worker processes encode out of sight; their bytes above are the check
        assert sum(map(len, calls)) == result.stats.documents + result.stats.skipped_empty
        assert len(calls) > 5 * len(sample_texts(sample / folder)) // options.get("batch_documents", 1000)
        assert all(sum(call) <= limit or len(call) == 1 for call in calls)
        assert any(len(call) == 1 and call[0] > limit for call in calls)


def test_text_pieces_cut_at_the_byte_limit_for_every_kind_of_string_column(monkeypatch):
    monkeypatch.setattr(arrow_arrays, "TEXT_BYTES_PER_CALL", 10)
    texts = ["abc", None, "défg", "x" * 25, "", "hij", "kl", "mnopqrs", "t"]
    plain = pa.array(texts, pa.string())
    for column in (plain, plain.cast(pa.large_string()), plain.cast(pa.string_view()), plain.dictionary_encode()):
        for start in (0, 1, 3):  # a slice of a column starts at an offset into its buffers
            part = column.slice(start)
            pieces = list(arrow_arrays.text_pieces(part))
            assert [t for piece, _ in pieces for t in piece.to_pylist()] == texts[start:]
            assert [last for _, last in pieces] == [False] * (len(pieces) - 1) + [True]
            for piece, _ in pieces:
                sizes = [len((t or "").encode()) for t in piece.to_pylist()]
                assert sum(sizes) <= 10 or len(sizes) == 1
            # each piece takes as many documents as fit: with the next document added it would be over the limit
            for (piece, _), (following, _) in itertools.pairwise(pieces):
                assert sum(len((t or "").encode()) for t in piece.to_pylist() + following.to_pylist()[:1]) > 10
    assert [(len(piece), last) for piece, last in arrow_arrays.text_pieces(plain.slice(0, 0))] == [(0, True)]


def test_pack_starts_without_transformers(sample, tokenizer_dir, tmp_path):
    """A `train-tokenizer` folder is read straight from tokenizer.json: transformers and torch (seconds of start-up)
    are never imported by a pack, and the manifest names the tokenizer as transformers would."""
    from transformers import AutoTokenizer

    script = (
        f"import sys; from smolctl.data.pack import PackConfig, pack; "
        f"pack({str(sample / 'math')!r}, {str(tmp_path / 'packed')!r}, tokenizer_spec={str(tokenizer_dir)!r}, "
        f"config=PackConfig(seq_len=64)); print(sorted({{'transformers', 'torch', 'pandas'}} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    loaded = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    record = read_manifest(tmp_path / "packed")["tokenizer"]
    assert record["fingerprint"] == tokenizer_fingerprint(loaded) and record["vocab_size"] == len(loaded)
    assert (record["eos_token_id"], record["pad_token_id"]) == (loaded.eos_token_id, loaded.pad_token_id)


def test_a_tokenizer_folder_with_more_settings_goes_through_transformers(tokenizer_dir, tmp_path):
    """Settings transformers acts on (here: add a BOS token, a new special token) are not read by hand."""
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|bos|>", add_bos_token=True, extra_special_tokens=["<|im_start|>", "<|tool|>"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(folder)
    rust = load_rust_tokenizer(folder)
    assert rust.vocab_size == len(loaded) == len(load_tokenizer(tokenizer_dir)) + 2  # <|bos|> and <|tool|> added
    assert rust.fingerprint == tokenizer_fingerprint(loaded) != load_rust_tokenizer(tokenizer_dir).fingerprint


def test_a_shard_failing_mid_run_leaves_nothing_and_no_threads(sample, tokenizer_dir, tmp_path):
    """The second input file is corrupt inside a column chunk: the error surfaces while the first file's rows are
    being packed on the packing thread, the run leaves nothing behind and every thread it started has ended."""
    inputs = tmp_path / "docs"
    inputs.mkdir()
    table = pq.read_table(sample / "web" / "part-00000.parquet", columns=["text"])
    pq.write_table(table.slice(0, 400), inputs / "part-00000.parquet", row_group_size=100)
    pq.write_table(table.slice(400), inputs / "part-00001.parquet", row_group_size=100)
    broken = bytearray((inputs / "part-00001.parquet").read_bytes())
    broken[len(broken) // 2 : len(broken) // 2 + 4000] = bytes(4000)
    (inputs / "part-00001.parquet").write_bytes(bytes(broken))
    threads = threading.active_count()
    with pytest.raises(UserError, match=r"part-00001\.parquet"):
        pack(
            str(inputs),
            tmp_path / "packed",
            tokenizer_spec=str(tokenizer_dir),
            config=PackConfig(seq_len=128, batch_documents=20),
        )
    assert not (tmp_path / "packed").exists() and not (tmp_path / ".packed.partial").exists()
    assert threading.active_count() == threads


@pytest.mark.parametrize("stop", ["full disk", "ctrl-c"])
def test_a_unit_stopped_mid_write_leaves_no_staging_folder_and_the_rerun_resumes(
    stop, sample, tokenizer_dir, tmp_path, monkeypatch
):
    """The second unit stops while its rows are written (a refused write, or Ctrl-C): the first unit is kept for
    the re-run, and the second's staging folder goes. It is named by the process, so each failed run used to
    leave one more behind (half-written on Ctrl-C), that no later run would use or remove."""
    from smolctl.data import pack_sinks
    from smolctl.errors import WriteRefused

    inputs = tmp_path / "docs"
    inputs.mkdir()
    table = pq.read_table(sample / "web" / "part-00000.parquet", columns=["text"])
    for part in range(3):
        pq.write_table(table.slice(300 * part, 300), inputs / f"part-{part:05d}.parquet")
    config = PackConfig(seq_len=64, batch_documents=50, shard_size="40rows")
    written = []
    real_write = pack_sinks.RowSink._write

    def stopping_write(self, all_rows):
        written.append(self)
        if len({id(sink) for sink in written}) == 2 and written.count(self) == 2:  # the second unit, some rows in
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            raise WriteRefused(tmp_path / "packed", "cannot write a shard: No space left on device", "free space")
        return real_write(self, all_rows)

    monkeypatch.setattr(pack_sinks.RowSink, "_write", stopping_write)
    with pytest.raises(KeyboardInterrupt if stop == "ctrl-c" else WriteRefused):
        pack(str(inputs), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    work = tmp_path / "packed" / "_work"
    assert [p.name for p in work.glob("*/pack/*") if p.name.startswith(".")] == []
    assert sorted(p.name for p in work.glob("*/pack/*")) == ["00000", "00000.done"]
    monkeypatch.setattr(pack_sinks.RowSink, "_write", real_write)
    resumed = pack(str(inputs), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    pack(str(inputs), tmp_path / "fresh", tokenizer_spec=str(tokenizer_dir), config=config)
    assert resumed.units_skipped == 1 and resumed.finished
    assert read_manifest(tmp_path / "packed")["shards"] == read_manifest(tmp_path / "fresh")["shards"]


def tokenizer_variant(tokenizer_dir: Path, folder: Path, backend_edit=None, **config) -> Path:
    """A copy of the trained tokenizer folder with its tokenizer.json edited through the tokenizers API and
    keys added to its tokenizer_config.json, as hub folders come."""
    from tokenizers import Tokenizer

    shutil.copytree(tokenizer_dir, folder)
    if backend_edit is not None:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend_edit(backend)
        backend.save(str(folder / "tokenizer.json"))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | config))
    return folder


def test_truncation_and_padding_in_tokenizer_json_never_cut_or_pad_documents(sample, tokenizer_dir, tmp_path):
    """Some hub tokenizer.json files truncate (at 512, say) or pad to the batch's longest: pack (and mix, which loads
    tokenizers the same way) encodes whole documents regardless, with the same fingerprint (pretrain's check sees
    one tokenizer)."""

    def truncate_and_pad(backend):
        backend.enable_truncation(8)
        backend.enable_padding(pad_id=1, pad_token="<|pad|>")

    clipped = tokenizer_variant(tokenizer_dir, tmp_path / "clipped", truncate_and_pad)
    config = PackConfig(seq_len=64)
    pack(str(sample / "math"), tmp_path / "plain", tokenizer_spec=str(tokenizer_dir), config=config)
    pack(str(sample / "math"), tmp_path / "clipped-out", tokenizer_spec=str(clipped), config=config)
    assert output_digests(tmp_path / "clipped-out") == output_digests(tmp_path / "plain")
    assert tokenizer_fingerprint(load_tokenizer(str(clipped))) == tokenizer_fingerprint(
        load_tokenizer(str(tokenizer_dir))
    )
    loaded = load_rust_tokenizer(str(clipped)).backend
    assert loaded.truncation is None and loaded.padding is None


def test_split_special_tokens_holds_in_worker_processes_and_in_the_fingerprint(tokenizer_dir, tmp_path):
    """A folder with split_special_tokens encodes `<|endoftext|>` inside a document as text, in this process and in
    --workers processes alike (the serialised tokenizer does not carry the flag), and its fingerprint says so."""
    texts = [f"before <|endoftext|> after {i}" for i in range(50)] + ["plain text"] * 50
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    splitting = tokenizer_variant(tokenizer_dir, tmp_path / "splitting", split_special_tokens=True)
    runs = {}
    for name, spec, workers in (("plain", tokenizer_dir, 1), ("one", splitting, 1), ("two", splitting, 2)):
        config = PackConfig(seq_len=64, workers=workers, batch_documents=10)
        pack(str(tmp_path / "docs.parquet"), tmp_path / name, tokenizer_spec=str(spec), config=config)
        runs[name] = read_manifest(tmp_path / name)
    assert output_digests(tmp_path / "two") == output_digests(tmp_path / "one")
    assert runs["one"]["tokens"] > runs["plain"]["tokens"] + 50  # the marker as text takes several tokens
    assert runs["one"]["tokenizer"]["fingerprint"] != runs["plain"]["tokenizer"]["fingerprint"]
    assert runs["one"]["tokenizer"]["fingerprint"] == tokenizer_fingerprint(load_tokenizer(str(splitting)))


def test_a_tokenizer_json_without_post_processor_packs_under_the_fingerprint_pretrain_checks(
    sample, tokenizer_dir, tmp_path
):
    """tokenizers' own save() writes no post-processor; transformers (and so pretrain) adds one on loading."""

    def drop_post_processor(backend):
        backend.post_processor = None

    bare = tokenizer_variant(tokenizer_dir, tmp_path / "bare", drop_post_processor)
    pack(str(sample / "math"), tmp_path / "out", tokenizer_spec=str(bare), config=PackConfig(seq_len=64))
    recorded = read_manifest(tmp_path / "out")["tokenizer"]["fingerprint"]
    assert recorded == tokenizer_fingerprint(load_tokenizer(str(bare)))


def test_inspect_shows_a_rows_padding_as_padding_not_as_the_last_documents_tokens(tokenizer_dir):
    """With pad = EOS (every tokenizer without a pad token) decoded padding reads as a document ending in 20 EOS."""
    from smolctl.inspect import decode_packed_row

    tokenizer = load_tokenizer(str(tokenizer_dir))
    first, second = (tokenizer("Hello world")["input_ids"], tokenizer("second doc")["input_ids"])
    eos = tokenizer.eos_token_id
    ids = [*first, eos, *second, eos] + [eos] * 5
    positions = [*range(len(first) + 1), *range(len(second) + 1)] + [-1] * 5
    shown = decode_packed_row(tokenizer, np.array(ids), np.array(positions))
    assert shown == f"Hello world{tokenizer.eos_token} ⟂ second doc{tokenizer.eos_token} [padding ×5]"
    assert decode_packed_row(tokenizer, np.array(ids[:-5]), np.array(positions[:-5])).endswith(
        f"doc{tokenizer.eos_token}"
    )


def test_inspect_samples_come_from_as_many_shards_as_they_take(sample, tokenizer_dir, tmp_path):
    pack(
        str(sample / "math"),
        tmp_path / "packed",
        tokenizer_spec=str(tokenizer_dir),
        config=PackConfig(seq_len=256, shard_size="2rows"),
    )
    shown = run_cli("inspect", tmp_path / "packed", "--samples", "5", "--json")
    samples = json.loads(shown.stdout)["samples"]
    assert [row["row"] for row in samples] == [0, 1, 2, 3, 4]
    assert len({row["text"] for row in samples}) == 5  # each row its own, not the first shard's shown again


def test_options_follow_what_the_format_and_strategy_use(sample, tokenizer_dir, tmp_path):
    """--buffer-tokens is best-fit-decreasing's (concat and token files never buffer: a small one was refused
    against the default seq_len); token files hold whole documents, so a truncation asked of them is refused,
    not silently ignored."""
    for name, options in {"concat": dict(strategy="concat"), "tokens": dict(format="datatrove")}.items():
        config = PackConfig(seq_len=4096, buffer_tokens=1000, **options)
        pack(str(sample / "math"), tmp_path / name, tokenizer_spec=str(tokenizer_dir), config=config)
    for options, flag in ((dict(long_docs="truncate"), "--long-docs"), (dict(strategy="concat"), "--strategy")):
        with pytest.raises(UserError, match=f"{flag}.*does not apply to --format datatrove"):
            PackConfig(seq_len=64, format="datatrove", **options).validate()


def test_a_manifest_whose_rows_or_seq_len_disagree_with_its_shards_is_refused(sample, tokenizer_dir, tmp_path):
    """Edited by hand (or by a tool), a shard's row count or seq_len that its tensors do not have made pretrain
    read past the shard's end (an internal error) or quietly train on other rows; verify passed it."""
    config = PackConfig(seq_len=256, shard_size="100rows")
    pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    assert verify_checksums(tmp_path / "packed") == []
    manifest_path = tmp_path / "packed" / "manifest.json"
    original = json.loads(manifest_path.read_text())
    for field, edit in (("rows", lambda m: m["shards"][1].update(rows=m["shards"][1]["rows"] - 3)), ("seq_len", None)):
        manifest = json.loads(json.dumps(original))
        if edit:
            edit(manifest)
        else:
            manifest["seq_len"] = 128
        manifest_path.write_text(json.dumps(manifest))
        problems = verify_checksums(tmp_path / "packed")
        assert problems and "the manifest says" in problems[0], field
        with pytest.raises(UserError, match=r"the manifest says .* re-run pack"):
            open_packed(tmp_path / "packed")


# ---- documents of book-dump size: encoded in pieces, with the ids of the whole ----------------------------------

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def tokenizer_family(family: str, texts: list[str], byte_level_dir: Path):
    """A Rust tokenizer of each kind the hub holds, trained on the sample in a second (or ours, byte-level BPE)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if family in ("byte-level", "added-token-with-a-space"):
        backend = load_rust_tokenizer(str(byte_level_dir)).backend
        if family == "added-token-with-a-space":
            backend.add_special_tokens(["<start of turn>"])
        return backend
    if family == "llama3-split":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif family == "metaspace-unigram":  # T5 / Llama-2-converted style
        backend = Tokenizer(models.Unigram())
        backend.normalizer = normalizers.NFKC()
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=800, unk_token="<unk>", special_tokens=["<unk>"])
    elif family == "bert-wordpiece":
        backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(lowercase=True)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=1000, special_tokens=["[UNK]"])
    elif family == "gemma":  # spaces made "▁" first, then a Split on " " that finds none: one pre-token in all
        backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    else:  # "llama2-legacy": "▁" prepended to every input by the normalizer, no pre-tokenizer at all
        backend = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    backend.train_from_iterator(texts[:300], trainer=trainer)
    return backend


# Per family: does its structure allow cuts at spaces (a pre-tokenizer that splits there, no normalizer acting on
# each input's edges), and do the cuts keep the ids around them (an added token may hold the space a cut takes)?
# Only where both hold are its long documents cut; the rest are encoded whole.
CUT = {
    "byte-level": (True, True),
    "llama3-split": (True, True),
    "metaspace-unigram": (True, True),
    "bert-wordpiece": (True, True),
    "llama2-legacy": (False, None),
    "gemma": (False, None),
    "added-token-with-a-space": (True, False),
}


@pytest.mark.parametrize("family", list(CUT))
def test_a_long_document_has_the_ids_of_encoding_it_whole(sample, tokenizer_dir, monkeypatch, family):
    from smolctl.data import long_documents

    texts = sample_texts(sample / "web")
    backend = tokenizer_family(family, texts, tokenizer_dir)
    text = " ".join(texts)[:60_000]
    if family == "added-token-with-a-space":  # its first space is where the first cut falls, at PIECE_CHARS + 1
        text = text[:1980] + "<start of turn>" + text[1980:]
    monkeypatch.setattr(long_documents, "LONG_DOCUMENT_CHARS", 5_000)
    monkeypatch.setattr(long_documents, "PIECE_CHARS", 1_985)
    monkeypatch.setattr(long_documents, "TEXT_BYTES_PER_CALL", 9_000)  # several calls per document
    pieces = long_documents._pieces(text)
    assert len(pieces) > 20 and "".join(pieces) == text
    splits, keeps = CUT[family]
    assert long_documents.splits_at_spaces(backend) == splits
    if splits:
        assert long_documents._cuts_keep_ids(backend, pieces) == keeps
    whole = backend.encode(text, add_special_tokens=False).ids
    assert long_documents.document_ids(backend, text).tolist() == whole
    if splits and keeps:  # the cuts are real ones: the pieces' ids alone join to the whole's
        assert (
            list(itertools.chain.from_iterable(backend.encode(p, add_special_tokens=False).ids for p in pieces))
            == whole
        )


def test_pack_and_mix_give_a_long_document_the_ids_and_count_of_it_whole(sample, tokenizer_dir, monkeypatch, tmp_path):
    """Byte-identical shards with and without the cutting, and mix's exact count of the document is pack's."""
    from smolctl.data import long_documents, mix_tokens

    texts = sample_texts(sample / "web")
    long = " ".join(texts)[:80_000]
    pq.write_table(pa.table({"text": texts[:30] + [long] + texts[30:60]}), tmp_path / "docs.parquet")
    config = PackConfig(seq_len=128)
    pack(str(tmp_path / "docs.parquet"), tmp_path / "whole", tokenizer_spec=str(tokenizer_dir), config=config)
    for module in (long_documents, pack_tokens, mix_tokens):
        monkeypatch.setattr(module, "LONG_DOCUMENT_CHARS", 10_000)
    monkeypatch.setattr(long_documents, "PIECE_CHARS", 3_000)
    calls = []
    monkeypatch.setattr(
        long_documents, "_pieces", lambda text, cut=long_documents._pieces: calls.append(1) or cut(text)
    )
    pack(str(tmp_path / "docs.parquet"), tmp_path / "pieces", tokenizer_spec=str(tokenizer_dir), config=config)
    assert calls, "the long document was not encoded in pieces"
    whole, pieces = read_manifest(tmp_path / "whole"), read_manifest(tmp_path / "pieces")
    assert [s["sha256"] for s in pieces["shards"]] == [s["sha256"] for s in whole["shards"]]
    backend = load_rust_tokenizer(str(tokenizer_dir)).backend
    counted = mix_tokens.piece_tokens(backend, pa.array([texts[0], long]))
    assert counted.tolist() == [len(backend.encode(t, add_special_tokens=False).ids) for t in (texts[0], long)]


def test_a_task_or_a_resume_with_a_folder_naming_another_eos_is_refused_and_so_is_training_on_both(
    sample, tokenizer_dir, tmp_path
):
    """Two folders of one tokenizer.json may end documents with different ids (Llama 3.1's base and Instruct
    name <|end_of_text|> and <|eot_id|>). A task packing with the other one joined the same output, which then
    held both ids; pretrain mixed folders packed with each."""
    from smolctl.train.config import DataStage
    from smolctl.train.loader import PackedStream

    instruct = tmp_path / "instruct"
    shutil.copytree(tokenizer_dir, instruct)
    config = json.loads((instruct / "tokenizer_config.json").read_text())
    (instruct / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    options = {"config": PackConfig(seq_len=128), "tasks": 2}
    pack(str(sample / "math"), tmp_path / "out", tokenizer_spec=str(tokenizer_dir), task_id=0, **options)
    with pytest.raises(UserError, match="holds an unfinished run with other inputs or settings"):
        pack(str(sample / "math"), tmp_path / "out", tokenizer_spec=str(instruct), task_id=1, **options)

    base = pack(
        str(sample / "math"), tmp_path / "base", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=128)
    )
    chat = pack(str(sample / "math"), tmp_path / "chat", tokenizer_spec=str(instruct), config=PackConfig(seq_len=128))
    assert base.tokenizer["fingerprint"] == chat.tokenizer["fingerprint"]  # the rules alone cannot tell them apart
    assert base.tokenizer["eos_token_id"] != chat.tokenizer["eos_token_id"]
    stage = DataStage(paths=[str(tmp_path / "base"), str(tmp_path / "chat")])
    with pytest.raises(UserError, match=f"was packed with eos_token_id {chat.tokenizer['eos_token_id']}"):
        PackedStream([stage], seed=0, seq_len=128).tokenizer_info()


def test_shards_that_differ_in_a_column_pack_never_reads_are_packed(sample, tokenizer_dir, tmp_path):
    """pandas writes an integer column holding a null as float64, in that shard only (FineWeb's token_count, say):
    pack and train-tokenizer read the text alone, so they pack what they would without the column. mix and dedup
    write every column, so they still refuse the files, naming the column."""
    from smolctl.data.tokenizer import train_tokenizer
    from smolctl.shards import open_documents

    texts = pq.read_table(next((sample / "math").glob("*.parquet")), columns=["text"]).column("text").to_pylist()
    half = len(texts) // 2
    for name, with_counts in (("mixed", True), ("text-only", False)):
        (tmp_path / name).mkdir()
        for i, (part, kind) in enumerate(((texts[:half], pa.int64()), (texts[half:], pa.float64()))):
            columns = {"text": part} | ({"token_count": pa.array(range(len(part)), kind)} if with_counts else {})
            pq.write_table(pa.table(columns), tmp_path / name / f"part-{i}.parquet")
    config = PackConfig(seq_len=64)
    packed = pack(str(tmp_path / "mixed"), tmp_path / "a", tokenizer_spec=str(tokenizer_dir), config=config)
    alone = pack(str(tmp_path / "text-only"), tmp_path / "b", tokenizer_spec=str(tokenizer_dir), config=config)
    assert packed.stats.tokens == alone.stats.tokens > 0
    assert output_digests(tmp_path / "a") == output_digests(tmp_path / "b")
    train_tokenizer(str(tmp_path / "mixed"), str(tmp_path / "tok"), vocab_size=300)
    with pytest.raises(UserError, match=r"holds token_count as double where part-0\.parquet has int64"):
        open_documents(tmp_path / "mixed")
