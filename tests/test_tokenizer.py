"""train-tokenizer: a real BPE on the sample corpus that transformers loads and that carries a working chat template."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from smolctl.data.tokenizer import DOCUMENT_END, IM_END, PAD, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError


def test_trained_tokenizer_loads_with_transformers_and_round_trips(tokenizer_dir, sample):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tok) == 2048 and tok.eos_token == DOCUMENT_END and tok.pad_token == PAD
    text = "def dumps(obj, *, skipkeys=False):\n    Serialize ``obj`` to a JSON formatted ``str``. é ü 日本"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert json.loads((tokenizer_dir / "manifest.json").read_text())["inputs"][0]["path"] == str(
        (sample / "web").resolve()
    )


def test_chat_template_marks_assistant_tokens_for_assistant_only_loss(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    messages = [
        {"role": "user", "content": "What does json.dumps do?"},
        {"role": "assistant", "content": "It serialises an object to JSON."},
    ]
    encoded = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assistant = tok.decode([t for t, m in zip(ids, mask) if m])
    assert assistant == "It serialises an object to JSON." + IM_END
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_fingerprint_tells_tokenizers_apart(tokenizer_dir, tmp_path, sample):
    from smolctl.data.tokenizer import train_tokenizer

    train_tokenizer(str(sample / "math"), str(tmp_path / "other"), vocab_size=1024)
    same = tokenizer_fingerprint(load_tokenizer(tokenizer_dir))
    assert same == tokenizer_fingerprint(load_tokenizer(tokenizer_dir))
    assert same != tokenizer_fingerprint(load_tokenizer(tmp_path / "other"))


def test_not_a_tokenizer_folder_is_a_user_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a tokenizer folder"):
        load_tokenizer(tmp_path / "model")


def test_cli_trains_with_json_and_rejects_tiny_vocab(tmp_path, sample):
    result = run_cli("train-tokenizer", sample / "math", tmp_path / "tok", "--vocab-size", "600", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["vocab_size"] == 600
    bad = run_cli("train-tokenizer", sample / "math", tmp_path / "tok2", "--vocab-size", "10")
    assert bad.returncode == 2 and "--vocab-size" in bad.stderr and not (tmp_path / "tok2").exists()
    wrong_column = run_cli("train-tokenizer", sample / "math", tmp_path / "tok3", "--text-column", "body")
    assert wrong_column.returncode == 2 and "columns: id, text, origin" in wrong_column.stderr


def test_chars_per_token_is_measured_across_the_corpus_and_a_short_vocabulary_is_warned_about(tmp_path, sample):
    """chars_per_token comes from documents spread over the whole corpus: a first file of one-letter documents
    (an HF test split sorted first), then an empty one, must not decide it. A vocabulary the corpus cannot fill is said,
    in the JSON and on stderr."""
    import pyarrow as pa

    from smolctl.data.tokenizer import CHARS_PER_TOKEN_DOCUMENTS, train_tokenizer

    texts = [t for f in sorted((sample / "web").glob("part-*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    plain, split = tmp_path / "plain", tmp_path / "split"
    plain.mkdir(), split.mkdir()
    pq.write_table(pa.table({"text": texts}), plain / "train.parquet")
    pq.write_table(pa.table({"text": ["x"] * 300}), split / "a-test.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), split / "b-empty.parquet")
    pq.write_table(pa.table({"text": texts}), split / "c-train.parquet")
    assert len(texts) > 2 * CHARS_PER_TOKEN_DOCUMENTS
    whole = train_tokenizer(str(plain), str(tmp_path / "tok-plain"), vocab_size=2048).chars_per_token
    sorted_first = train_tokenizer(str(split), str(tmp_path / "tok-split"), vocab_size=2048).chars_per_token
    assert whole > 2.5 and abs(sorted_first - whole) < 0.1 * whole, (sorted_first, whole)
    # Every other row empty: the measured documents are the non-empty ones, not the rows at a stride.
    gappy = tmp_path / "gappy"
    gappy.mkdir()
    pq.write_table(pa.table({"text": [t for text in texts for t in ("", text)]}), gappy / "train.parquet")
    alternating = train_tokenizer(str(gappy), str(tmp_path / "tok-gappy"), vocab_size=2048).chars_per_token
    assert abs(alternating - whole) < 0.1 * whole, (alternating, whole)

    result = run_cli("train-tokenizer", sample / "math", tmp_path / "tok-short", "--vocab-size", "1000000", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    (warning,) = out["warnings"]
    assert f"the vocabulary has {out['vocab_size']:,} tokens, not the 1,000,000 asked" in warning
    assert result.stderr.strip() == f"warning: {warning}"
    assert (
        json.loads(run_cli("train-tokenizer", sample / "math", tmp_path / "t", "--vocab-size", "600", "--json").stdout)[
            "warnings"
        ]
        == []
    )


def test_a_seeded_sample_is_the_lowest_priorities_within_the_budget(sample, tmp_path):
    from itertools import accumulate

    import numpy as np

    from smolctl.data.tokenizer import sample_texts, train_tokenizer
    from smolctl.shards import open_documents

    source = open_documents(sample / "web")
    # The reference: every document's priority drawn at once per file, sorted, the prefix that fits.
    ranked = []
    for index, path in enumerate(source.files):
        texts = pq.read_table(path, columns=["text"]).column(0).to_pylist()
        priorities = np.random.default_rng([7, index]).random(len(texts))
        ranked += [(p, t) for p, t in zip(priorities.tolist(), texts) if t]
    ranked = [t for _, t in sorted(ranked)]
    assert sample_texts(source, "text", documents=150, seed=7) == ranked[:150]
    fits = sum(1 for total in accumulate(len(t.encode()) for t in ranked) if total <= 60_000)
    by_bytes = sample_texts(source, "text", bytes_=60_000, seed=7)
    assert by_bytes == ranked[:fits] and 0 < fits < len(ranked)
    assert sample_texts(source, "text", documents=150, bytes_=60_000, seed=7) == ranked[: min(150, fits)]
    # The same seed trains the same tokenizer; the sample is recorded in the manifest.
    prints = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        result = train_tokenizer(
            str(sample / "web"), str(tmp_path / name), vocab_size=600, sample_documents=200, seed=seed
        )
        assert (result.documents, result.corpus_documents) == (200, source.num_rows)
        prints.append(json.loads((tmp_path / name / "manifest.json").read_text())["stats"]["fingerprint"])
    assert prints[0] == prints[1] != prints[2]


def test_a_book_length_document_is_trained_on_in_pieces_that_count_the_same_words(tmp_path, sample, monkeypatch):
    """The trainer holds ~200 bytes per byte of a sequence: documents are given in pieces of at most
    TRAINING_PIECE_CHARS (here made small), cut at a space before a word, which leaves the byte-level
    pre-tokens, and so the trained tokenizer, as they were. A run without such a space is cut where it is full."""
    import pyarrow as pa

    from smolctl.data import tokenizer
    from smolctl.shards import open_documents

    web = [t for batch in open_documents(sample / "web").iter_batches(["text"]) for t in batch.column(0).to_pylist()]
    book = "\n\n".join(web[:300])  # several pieces of 20,000 characters
    texts = [book, *web[300:500], "x" * 50_000]
    pq.write_table(pa.table({"text": texts}), tmp_path / "books.parquet")

    def train(out: str, piece_chars: int) -> list[list[str]]:
        fed, feed = [], tokenizer._texts
        with monkeypatch.context() as patch:
            patch.setattr(tokenizer, "TRAINING_PIECE_CHARS", piece_chars)
            patch.setattr(tokenizer, "_texts", lambda *a: (fed.append(b) or b for b in feed(*a)))
            result = tokenizer.train_tokenizer(str(tmp_path / "books.parquet"), str(tmp_path / out), vocab_size=1024)
        assert result.documents == len(texts)
        return fed

    fed = train("pieces", 20_000)
    assert len(book) > 100_000 and max(len(t) for batch in fed for t in batch) <= 20_000
    assert "".join(t for batch in fed for t in batch) == "".join(texts)
    texts[-1] = "x" * 10  # the one place pieces count differently: a run cut in two
    pq.write_table(pa.table({"text": texts}), tmp_path / "books.parquet")
    train("whole", 10**9)
    train("cut", 20_000)
    assert (tmp_path / "whole" / "tokenizer.json").read_text() == (tmp_path / "cut" / "tokenizer.json").read_text()


def test_chars_per_token_is_measured_a_few_megabytes_at_a_time(tokenizer_dir):
    """An Encoding holds ~40 bytes per byte of its text: measuring on a sample of books whole took gigabytes."""
    from smolctl.arrow_arrays import TEXT_BYTES_PER_CALL
    from smolctl.data import tokenizer

    backend = load_tokenizer(tokenizer_dir).backend_tokenizer
    calls = []

    class Recording:
        def encode_batch_fast(self, texts, **options):
            calls.append([len(t) for t in texts])
            return backend.encode_batch_fast(texts, **options)

    documents = ["a few words of text " * 20_000, *[f"short document number {i}" for i in range(50)]] * 40
    measured = tokenizer.measured_chars_per_token(Recording(), documents)
    heads = [d[: tokenizer.TRAINING_PIECE_CHARS] for d in documents]
    assert sum(len(call) for call in calls) == len(documents) and len(calls) > 1
    assert max(sum(call) for call in calls) <= TEXT_BYTES_PER_CALL and max(max(call) for call in calls) < 400_000
    expected = sum(map(len, heads)) / sum(len(backend.encode(h, add_special_tokens=False).ids) for h in heads)
    assert measured == pytest.approx(expected)


def test_verify_checks_a_tokenizer_by_its_fingerprint(tokenizer_dir, tmp_path):
    """A tokenizer folder's manifest lists no shards: --verify must still catch a changed vocabulary."""
    import shutil

    copy = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, copy)
    assert run_cli("inspect", copy, "--verify").returncode == 0
    config = json.loads((copy / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swap their ids
    (copy / "tokenizer.json").write_text(json.dumps(config))
    result = run_cli("inspect", copy, "--verify")
    assert result.returncode == 1 and f"{copy / 'tokenizer.json'}: size" in result.stdout + result.stderr
    # a manifest written before it listed the folder's files: the fingerprint still catches the change
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("inspect", copy, "--verify")
    assert result.returncode == 1 and "fingerprint" in result.stdout + result.stderr


def test_verify_checks_a_tokenizers_special_tokens_and_chat_template(tokenizer_dir, tmp_path):
    """The fingerprint covers tokenizer.json alone: an EOS renamed in tokenizer_config.json, or the chat template
    deleted, passed as verified; the manifest now lists every file of the folder with its sha256."""
    import shutil

    for damage in ("eos", "template"):
        copy = tmp_path / damage
        shutil.copytree(tokenizer_dir, copy)
        if damage == "eos":
            config = json.loads((copy / "tokenizer_config.json").read_text())
            config["eos_token"] = IM_END
            (copy / "tokenizer_config.json").write_text(json.dumps(config))
        else:
            next(copy.glob("chat_template*")).unlink()
        result = run_cli("inspect", copy, "--verify")
        assert result.returncode == 1, damage


def test_a_config_naming_special_tokens_in_a_dict_takes_transformers_path(tokenizer_dir, tmp_path):
    """Multimodal hub configs name extra special tokens in a dict ({"image_token": "<|image|>"}): the fast path
    took tokenizer.json alone, so pack wrote <|image|> as six text tokens where transformers gives one special
    token, and its fingerprint differed from the one pretrain and inspect compute, which then refused the data."""
    import shutil

    from smolctl.data.tokenizer import load_rust_tokenizer

    folder = tmp_path / "multimodal"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {"image_token": "<|image|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    rust, hf = load_rust_tokenizer(folder), load_tokenizer(folder)
    text = "Look at <|image|> here."
    assert rust.backend.encode(text, add_special_tokens=False).ids == hf(text, add_special_tokens=False)["input_ids"]
    assert rust.fingerprint == tokenizer_fingerprint(hf) and rust.vocab_size == len(hf)


def test_a_gpt2_style_folder_needs_a_file_naming_its_class(tmp_path, tokenizer_dir):
    """vocab.json and merges.txt alone, as old GPT-2 repos keep them: transformers cannot tell which class reads
    them, and its message was cut off at "one of:". With a tokenizer_config.json naming the class, the folder
    loads and tokenizes as the tokenizer it was saved from."""
    bare = tmp_path / "gpt2"
    bare.mkdir()
    original = load_tokenizer(tokenizer_dir)
    original.backend_tokenizer.model.save(str(bare))
    assert sorted(p.name for p in bare.iterdir()) == ["merges.txt", "vocab.json"]
    with pytest.raises(UserError, match=r"holds vocab\.json but nothing naming the tokenizer's class"):
        load_tokenizer(bare)
    (bare / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    text = "Which module provides sqrt? The math module."
    assert load_tokenizer(bare)(text)["input_ids"] == original(text, add_special_tokens=False)["input_ids"]
