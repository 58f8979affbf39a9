"""`smolctl pack`: exactly-once packing, position ids, document masking in a real SmolLM3 forward, bad inputs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from smolctl.data.pack import PackConfig, pack
from smolctl.data.packing import best_fit_decreasing
from smolctl.errors import UserError
from smolctl.shards import open_documents, open_packed, read_manifest


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
        pieces += [tuple(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
    return pieces


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_bfd_split_holds_every_token_exactly_once(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "code")
    result = pack(str(sample / "code"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir),
                  config=PackConfig(seq_len=300, buffer_tokens=40_000))  # several buffers
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
    result = pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir),
                  config=PackConfig(seq_len=128, strategy="concat", batch_documents=50))
    ids, positions = packed_rows(tmp_path / "packed")
    stream = np.concatenate([tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                             for t in texts if t])
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
    before_start = (positions[:, 1:] == 0)
    assert (ids[:, :-1][before_start] == tokenizer.eos_token_id).all()
    assert (ids[~real] == tokenizer.pad_token_id).all()
    # padding only at row ends
    assert not (~real[:, :-1] & real[:, 1:]).any()


def test_truncate_keeps_the_first_seq_len_tokens(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "math")
    result = pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir),
                  config=PackConfig(seq_len=64, long_docs="truncate"))
    ids, positions = packed_rows(tmp_path / "packed")
    expected = [p for p in expected_pieces(tokenizer, texts, 64)]
    firsts = [tuple((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:64])
              for t in texts if t]
    assert Counter(segments(ids, positions)) == Counter(firsts)
    assert result.stats.truncated_tokens == sum(map(len, expected)) - sum(map(len, firsts)) > 0


def test_best_fit_decreasing_fills_the_tightest_row():
    lengths = np.array([6, 5, 4, 3, 2, 2, 1, 1])
    row_of, offset, rows = best_fit_decreasing(lengths, 8)
    fill = np.bincount(row_of, weights=lengths)
    assert rows == 3 and sorted(fill.tolist()) == [8, 8, 8]
    for r in range(rows):  # documents of a row do not overlap
        spans = sorted((offset[i], offset[i] + lengths[i]) for i in np.flatnonzero(row_of == r))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_workers_give_the_same_rows(sample, tokenizer_dir, tmp_path):
    config = dict(seq_len=256, batch_documents=100)
    pack(str(sample / "math"), tmp_path / "one", tokenizer_spec=str(tokenizer_dir), config=PackConfig(**config))
    pack(str(sample / "math"), tmp_path / "two", tokenizer_spec=str(tokenizer_dir), config=PackConfig(**config, workers=2))
    for a, b in zip(packed_rows(tmp_path / "one"), packed_rows(tmp_path / "two")):
        assert np.array_equal(a, b)


def test_datatrove_token_files(sample, tokenizer_dir, tokenizer, tmp_path):
    texts = sample_texts(sample / "math")
    result = pack(str(sample / "math"), tmp_path / "tokens", tokenizer_spec=str(tokenizer_dir),
                  config=PackConfig(seq_len=64, format="datatrove", shard_size="40KB", batch_documents=50))
    manifest = read_manifest(tmp_path / "tokens")
    assert manifest["kind"] == "tokens" and manifest["token_size"] == 2 and len(manifest["shards"]) > 1
    stream = [np.fromfile(tmp_path / "tokens" / s["name"], dtype="<u2") for s in manifest["shards"]]
    ends = [np.fromfile(tmp_path / "tokens" / s["index"], dtype="<u8") for s in manifest["shards"]]
    documents = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts if t]
    assert np.array_equal(np.concatenate(stream), np.concatenate(documents))
    for ids, file_ends in zip(stream, ends):  # each file's index: the cumulative end of each of its documents
        assert file_ends[-1] == len(ids) and (ids[file_ends - 1] == tokenizer.eos_token_id).all()
    assert sum(map(len, ends)) == len(documents) == result.stats.documents
    first_line = (tmp_path / "tokens" / manifest["shards"][0]["metadata"]).read_text().splitlines()[0]
    assert first_line == f"{tokenizer_dir.resolve()}|2"
    with pytest.raises(UserError, match="is a tokens folder, not a packed folder"):
        open_packed(tmp_path / "tokens")


def test_empty_documents_are_skipped_and_counted(tokenizer_dir, tmp_path):
    table = pa.table({"text": ["first document", "", None, "second one"]})
    pq.write_table(table, tmp_path / "docs.parquet")
    result = pack(str(tmp_path / "docs.parquet"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir),
                  config=PackConfig(seq_len=32))
    assert result.stats.documents == 2 and result.stats.skipped_empty == 2
    assert read_manifest(tmp_path / "packed")["skipped_empty"] == 2


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
    config = SmolLM3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                           eos_token_id=tokenizer.eos_token_id, attn_implementation=attention)
    model = SmolLM3ForCausalLM(config).float().eval()
    input_ids = torch.tensor(ids[row:row + 1], dtype=torch.long)
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=torch.tensor(row_positions[None], dtype=torch.long),
                       use_cache=False).logits[0]
        leaked = model(input_ids=input_ids, position_ids=torch.tensor(row_positions[None], dtype=torch.long),
                       attention_mask=torch.ones_like(input_ids), use_cache=False).logits[0]
        starts = np.flatnonzero(positions[row] == 0).tolist() + [int((~padding).sum())]
        for begin, end in zip(starts, starts[1:]):
            alone = model(input_ids=input_ids[:, begin:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[begin:end], alone, atol=1e-5, rtol=1e-5)
    # An attention mask switches the packed-sequence masking off: the later documents see the earlier ones.
    assert not torch.allclose(leaked[starts[1]:starts[2]], packed[starts[1]:starts[2]], atol=1e-3)


def test_cli_pack_and_inspect(sample, tokenizer_dir, tmp_path):
    out = tmp_path / "packed"
    done = run_cli("pack", sample / "web", out, "--tokenizer", tokenizer_dir, "--seq-len", "256", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["documents"] == 1851
    shown = run_cli("inspect", out, "--samples", "12", "--json")
    rows = json.loads(shown.stdout)["samples"]
    assert any("⟂" in row["text"] for row in rows)  # document boundaries marked (the text is clipped)
    assert all(row["text"].count("⟂") <= row["documents"] - 1 for row in rows)


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "1"], "--seq-len: 1 is too short"),
    (["--strategy", "greedy"], "unknown strategy 'greedy'"),
    (["--long-docs", "drop"], "unknown choice 'drop'"),
    (["--text-column", "body"], "has no column 'body'"),
])
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
        pack(str(sample / "chat"), tmp_path / "a", tokenizer_spec=str(tokenizer_dir),
             config=PackConfig(seq_len=64, text_column="messages"))
    pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    with pytest.raises(UserError, match="is a packed folder, not a dataset"):
        pack(str(tmp_path / "packed"), tmp_path / "b", tokenizer_spec=str(tokenizer_dir), config=config)
    with pytest.raises(UserError, match="already exists"):
        pack(str(sample / "math"), tmp_path / "packed", tokenizer_spec=str(tokenizer_dir), config=config)
    pq.write_table(pa.table({"text": ["", None]}), tmp_path / "empty.parquet")
    with pytest.raises(UserError, match="holds no non-empty documents"):
        pack(str(tmp_path / "empty.parquet"), tmp_path / "c", tokenizer_spec=str(tokenizer_dir), config=config)
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.partial").exists()
