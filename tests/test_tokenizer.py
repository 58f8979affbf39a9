"""train-tokenizer: a real BPE on the sample corpus that transformers loads and that carries a working chat template."""

from __future__ import annotations

import json

import pytest

from smolctl.data.tokenizer import DOCUMENT_END, IM_END, PAD, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from conftest import run_cli


def test_trained_tokenizer_loads_with_transformers_and_round_trips(tokenizer_dir, sample):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tok) == 2048 and tok.eos_token == DOCUMENT_END and tok.pad_token == PAD
    text = "def dumps(obj, *, skipkeys=False):\n    Serialize ``obj`` to a JSON formatted ``str``. é ü 日本"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert json.loads((tokenizer_dir / "manifest.json").read_text())["inputs"][0]["path"] == str((sample / "web").resolve())


def test_chat_template_marks_assistant_tokens_for_assistant_only_loss(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    messages = [{"role": "user", "content": "What does json.dumps do?"},
                {"role": "assistant", "content": "It serialises an object to JSON."}]
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
