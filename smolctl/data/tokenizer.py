"""Train a byte-level BPE tokenizer on a dataset folder, and load any local (or hub) Hugging Face tokenizer.

    smolctl train-tokenizer data/sample/web tok/ --vocab-size 8192
    smolctl train-tokenizer 'crawl/*.parquet' tok/ --vocab-size 49152 --sample-bytes 2GB --seed 0

On a corpus of any size, `--sample-documents` / `--sample-bytes` train on a seeded uniform sample drawn while
streaming the corpus once: memory holds the sample, never the corpus, so it finishes on one node.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from smolctl.arrow_arrays import text_pieces
from smolctl.errors import UserError
from smolctl.results import Result
from smolctl.shards import KIND_TOKENIZER, OutputFolder, check_output_path, open_documents

DOCUMENT_END = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [DOCUMENT_END, PAD, IM_START, IM_END]

# ChatML, with {% generation %} markers around what the assistant says so TRL's assistant_only_loss can find it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TokenizerTrainResult(Result):
    output: str
    vocab_size: int
    documents: int
    characters: int
    seconds: float
    chars_per_token: float
    corpus_documents: int | None = None
    """Documents the sample was drawn from (None: trained on the whole corpus)."""
    warnings: list[str] = field(default_factory=list)


CHARS_PER_TOKEN_DOCUMENTS = 200
"""Documents chars_per_token is measured on, spread evenly over the training text (not the first batch's: a
corpus's first file may be a split of a few short documents, or empty)."""

TRAINING_PIECE_CHARS = 256 * 1024
"""The longest text the BPE trainer is given as one sequence. While it splits and counts a sequence it holds
~200 bytes per byte of it (a 30 MB document took 7 GB, a 179 MB one was killed at 24 GB), so a longer document
is given in pieces. Each cut is at a single space between two other characters, where the byte-level
pre-tokenizer splits anyway (no pre-token holds a space after its first character, and its pattern looks at
nothing before the cut): the words counted, and so the trained tokenizer, are the same. A run of that length
without such a space is cut where the piece is full."""
_WORD_START = re.compile(r"(?<=\S) (?=\S)")


def measured_chars_per_token(tokenizer: Tokenizer, documents: list[str]) -> float:
    """Characters per token over the sampled documents, each measured on at most its first TRAINING_PIECE_CHARS:
    an Encoding holds ~40 bytes per byte of its text, and one of a book's whole text took gigabytes."""
    heads = [text[:TRAINING_PIECE_CHARS] for text in documents]
    tokens = 0
    for piece, _ in text_pieces(pa.array(heads, pa.large_string())):  # a few MB at a time, as pack encodes
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(piece.to_pylist(), add_special_tokens=False))
    return sum(map(len, heads)) / max(1, tokens)


def training_pieces(text: str) -> list[str]:
    """`text` in pieces of at most TRAINING_PIECE_CHARS characters, cut as above (the pieces join to `text`)."""
    pieces, start = [], 0
    while len(text) - start > TRAINING_PIECE_CHARS:
        cut = _WORD_START.search(text, start + TRAINING_PIECE_CHARS // 2, start + TRAINING_PIECE_CHARS)
        stop = cut.start() if cut else start + TRAINING_PIECE_CHARS
        pieces.append(text[start:stop])
        start = stop
    pieces.append(text[start:])
    return pieces


def _texts(batches: Iterator[list[str]], counter: dict, total: int) -> Iterator[list[str]]:
    """The non-empty texts of each batch, counted, every `stride`-th of them kept in counter["sample"] (`total`:
    the rows to come, empty ones included, so at least CHARS_PER_TOKEN_DOCUMENTS where few are empty)."""
    stride = max(1, total // CHARS_PER_TOKEN_DOCUMENTS)
    counter["sample"] = []
    for texts in batches:
        texts = [t for t in texts if t]
        counter["sample"] += texts[-counter["documents"] % stride :: stride]
        counter["documents"] += len(texts)
        counter["characters"] += sum(len(t) for t in texts)
        if any(len(t) > TRAINING_PIECE_CHARS for t in texts):
            texts = [piece for t in texts for piece in training_pieces(t)]
        yield texts


def sample_texts(
    source,
    text_column: str,
    *,
    documents: int | None = None,
    bytes_: int | None = None,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """A seeded uniform sample (without replacement) of the non-empty documents, within both budgets.

    Every document gets a random priority from a generator seeded with (seed, file); the sample is the documents
    of lowest priority, in priority order, as many as fit (bottom-k sampling). Streaming, a heap holds the
    current sample: a document that no longer fits is dropped, and so is every later one of higher priority
    (the cutoff), so the result does not depend on batch sizes and memory is the sample's.
    """
    heap: list[tuple[float, str, int]] = []  # (-priority, text, UTF-8 bytes): the largest priority on top
    kept_bytes, cutoff = 0, 1.0

    def over_budget() -> bool:
        return (documents is not None and len(heap) > documents) or (bytes_ is not None and kept_bytes > bytes_)

    for file_index in range(len(source.files)):
        rng = np.random.default_rng([seed, file_index])
        for batch in source.iter_file_batches(file_index, [text_column], batch_size=2048):
            texts = batch.column(0).to_pylist()
            priorities = rng.random(len(texts))
            for index in np.flatnonzero(priorities < cutoff).tolist():
                text = texts[index]
                if not text or priorities[index] >= cutoff:
                    continue
                size = len(text.encode())
                heapq.heappush(heap, (-float(priorities[index]), text, size))
                kept_bytes += size
                while over_budget():
                    priority, _, dropped = heapq.heappop(heap)
                    kept_bytes, cutoff = kept_bytes - dropped, min(cutoff, -priority)
            if on_batch:
                on_batch(len(texts))
    if not heap and cutoff < 1.0:  # documents were drawn, and every one was over the budget alone
        raise UserError(
            "--sample-bytes",
            f"{bytes_:,} bytes hold none of the documents drawn",
            "raise it: the sample is whole documents",
        )
    return [text for _, text, _ in sorted(heap, reverse=True)]


def train_tokenizer(
    input_path: str,
    output: str,
    *,
    vocab_size: int,
    text_column: str = "text",
    min_frequency: int = 2,
    overwrite: bool = False,
    sample_documents: int | None = None,
    sample_bytes: int | None = None,
    seed: int = 0,
    on_start=None,
    on_batch=None,
) -> TokenizerTrainResult:
    """Train on the text column, streaming, or on a seeded sample of it (`sample_documents` / `sample_bytes`).
    `on_start(total_documents)` is called once the inputs are checked, `on_batch(documents)` as they are read."""
    from transformers import PreTrainedTokenizerFast  # seconds to import; only training and loading need it

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise UserError(
            "--vocab-size",
            f"{vocab_size} is too small",
            f"use at least {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)",
        )
    for flag, value in (("--sample-documents", sample_documents), ("--sample-bytes", sample_bytes)):
        if value is not None and value < 1:
            raise UserError(flag, f"{value} is not a positive amount", "pass e.g. 1M documents or 2GB")
    source = open_documents(input_path, columns=[text_column])
    source.require(text=[text_column])
    source.check_output_spares(output)
    check_output_path(Path(output), overwrite)
    if on_start:
        on_start(source.num_rows)
    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counter = {"documents": 0, "characters": 0}
    sampled = sample_documents is not None or sample_bytes is not None
    if sampled:
        sample = sample_texts(
            source, text_column, documents=sample_documents, bytes_=sample_bytes, seed=seed, on_batch=on_batch
        )
        length = len(sample)
        texts = _texts((sample[i : i + 2048] for i in range(0, len(sample), 2048)), counter, length)
    else:

        def read() -> Iterator[list[str]]:
            for batch in source.iter_batches(columns=[text_column], batch_size=2048):
                # As Python strings a few MB at a time: a batch of books would be gigabytes at once.
                for piece, _ in text_pieces(batch.column(0)):
                    texts = piece.to_pylist()
                    if on_batch:
                        on_batch(len(texts))
                    yield texts

        texts, length = _texts(read(), counter, source.num_rows), source.num_rows
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if counter["documents"] == 0:
        raise UserError(input_path, f"column '{text_column}' holds no text", "pass a dataset with non-empty documents")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=DOCUMENT_END,
        pad_token=PAD,
        model_max_length=1_000_000,
        additional_special_tokens=[IM_START, IM_END],
    )
    wrapped.chat_template = CHATML_TEMPLATE
    chars_per_token = measured_chars_per_token(tokenizer, counter["sample"])

    with OutputFolder(output, kind=KIND_TOKENIZER, overwrite=overwrite, inputs=source.lineage()) as folder:
        wrapped.save_pretrained(str(folder.staging))
        folder.commit(
            stats={
                "vocab_size": len(wrapped),
                "documents": counter["documents"],
                "characters": counter["characters"],
                "chars_per_token": round(chars_per_token, 3),
                "fingerprint": tokenizer_fingerprint(wrapped),
            },
            sample={
                "documents": sample_documents,
                "bytes": sample_bytes,
                "seed": seed,
                "corpus_documents": source.num_rows,
            }
            if sampled
            else None,
        )
    short = (
        [
            f"the vocabulary has {len(wrapped):,} tokens, not the {vocab_size:,} asked: every pair of tokens seen "
            f"at least --min-frequency ({min_frequency}) times is already merged; more text (or a lower "
            "--min-frequency) gives more"
        ]
        if len(wrapped) < vocab_size
        else []
    )
    return TokenizerTrainResult(
        output,
        len(wrapped),
        counter["documents"],
        counter["characters"],
        time.perf_counter() - started,
        chars_per_token,
        source.num_rows if sampled else None,
        short,
    )


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be asked (HF_HUB_OFFLINE, or its host not answering within `timeout_s`), or None.

    Asked before a hub id is resolved: offline, huggingface_hub would otherwise retry for ~45 s before failing."""
    # huggingface_hub reads HF_HUB_OFFLINE once, when first imported: imported late, it sees quiet_offline()'s value
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows whether the Hub is reachable
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
    except OSError as exc:
        return f"{endpoint.hostname} does not answer: {exc.strerror or exc}"
    return None


def load_tokenizer(spec: str | Path):
    """A fast tokenizer from a local folder (ours, or any Hugging Face tokenizer folder) or a hub id."""
    path = Path(spec)
    looks_like_path = path.is_absolute() or str(spec).startswith((".", "~")) or str(spec).count("/") > 1
    if looks_like_path and not path.exists():
        raise UserError(spec, "no such tokenizer folder", "check the path (a hub id looks like org/name)")
    if path.exists():
        if not path.is_dir():
            raise UserError(path, "is a file, not a tokenizer folder", "pass the folder holding tokenizer.json")
        held = {name for name in ("tokenizer.json", "tokenizer_config.json", "config.json") if (path / name).is_file()}
        vocabulary = [name for name in ("vocab.json", "tokenizer.model") if (path / name).is_file()]
        if not held & {"tokenizer.json", "tokenizer_config.json"} and not (vocabulary and held):
            if vocabulary:
                raise UserError(
                    path,
                    f"holds {' and '.join(vocabulary)} but nothing naming the tokenizer's class (no tokenizer.json, "
                    "tokenizer_config.json or config.json)",
                    'add a tokenizer_config.json with its "tokenizer_class" (GPT2Tokenizer, LlamaTokenizer...), or '
                    "save the tokenizer with transformers' save_pretrained",
                )
            raise UserError(
                path,
                "is not a tokenizer folder (no tokenizer.json or tokenizer_config.json)",
                "pass a folder written by `smolctl train-tokenizer` or a Hugging Face tokenizer folder",
            )
    from transformers import AutoTokenizer  # after the checks above: a wrong path is refused without it

    offline = None if path.exists() else hub_unreachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(spec), local_files_only=path.exists() or offline is not None)
    except (OSError, ValueError, json.JSONDecodeError, Exception) as exc:  # transformers raises many kinds here
        if offline is not None:
            raise UserError(
                spec,
                f"is neither a local folder nor in the Hugging Face cache, and the Hub is offline ({offline})",
                f"pass a tokenizer folder, or fetch it first where the Hub is reachable (`hf download {spec}`)",
            ) from exc
        where = "a local folder" if path.exists() else "the Hugging Face Hub (is it reachable, and is the id right?)"
        raise UserError(
            spec,
            f"cannot load a tokenizer from {where}: {str(exc).splitlines()[0][:200]}",
            "pass a tokenizer folder (see `smolctl train-tokenizer`)",
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(spec, "is a slow (Python) tokenizer", "pass a folder with tokenizer.json (a fast tokenizer)")
    return tokenizer


# The tokenizer_config.json keys `train-tokenizer` writes. With only these, transformers loads tokenizer.json as it
# is (nothing added, nothing rewired), so the Rust tokenizer alone gives the same ids, length and fingerprint.
PLAIN_CONFIG_KEYS = {"backend", "eos_token", "pad_token", "extra_special_tokens", "model_max_length", "tokenizer_class"}
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@dataclass(frozen=True)
class RustTokenizer:
    """The Rust tokenizer with the special-token ids and length transformers would give it (`pack` needs no more)."""

    backend: object
    """A `tokenizers.Tokenizer`."""
    eos_token_id: int | None
    pad_token_id: int | None
    vocab_size: int
    """`len(tokenizer)` in transformers: the vocabulary with the added tokens."""

    @property
    def fingerprint(self) -> str:
        return backend_fingerprint(self.backend)

    @property
    def largest_id(self) -> int:
        """The highest id the tokenizer gives (its vocabulary and added tokens)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)


def load_rust_tokenizer(spec: str | Path) -> RustTokenizer:
    """A tokenizer folder written by `train-tokenizer` straight from tokenizer.json (transformers and torch take
    seconds to import); any other folder or hub id through transformers, exactly as `load_tokenizer`.

    Whole documents are what pack and mix encode: truncation or padding that a tokenizer.json carries (some hub
    folders do: truncation at 512, padding to the batch's longest) is switched off on the backend returned."""
    tokenizer = _plain_tokenizer(Path(spec))
    if tokenizer is None:
        loaded = load_tokenizer(spec)
        tokenizer = RustTokenizer(loaded.backend_tokenizer, loaded.eos_token_id, loaded.pad_token_id, len(loaded))
    tokenizer.backend.no_truncation()
    tokenizer.backend.no_padding()
    return tokenizer


def _plain_tokenizer(path: Path) -> RustTokenizer | None:
    """The folder's tokenizer when transformers would take tokenizer.json unchanged, else None."""
    from tokenizers import Tokenizer

    if (
        not (path.is_dir() and (path / "tokenizer.json").is_file())
        or (path / "special_tokens_map.json").exists()
        or (path / "added_tokens.json").exists()
    ):
        return None
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:
        return None
    if backend.post_processor is None:
        return None  # transformers adds one: its fingerprint (what pretrain checks) is of the rewired tokenizer
    extra = config.get("extra_special_tokens", [])
    if isinstance(extra, dict):  # {"image_token": "<|image|>"}, as multimodal configs name them
        extra = list(extra.values())
    if not isinstance(extra, list):
        return None
    named = [config.get("eos_token"), config.get("pad_token"), *extra]
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    if (
        set(config) - PLAIN_CONFIG_KEYS
        or config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES
        or not all(isinstance(token, str) and token in special for token in named if token is not None)
    ):
        return None
    eos, pad = (backend.token_to_id(config[key]) if config.get(key) else None for key in ("eos_token", "pad_token"))
    return RustTokenizer(backend, eos, pad, backend.get_vocab_size(with_added_tokens=True))


def fingerprint_problems(folder: Path, manifest: dict) -> list[str]:
    """A tokenizer folder lists no shards for `inspect --verify`: what it holds is checked by what it does, its
    fingerprint (the rules and vocabulary it tokenizes with) against the one train-tokenizer recorded."""
    recorded = (manifest.get("stats") or {}).get("fingerprint")
    if manifest.get("kind") != KIND_TOKENIZER or not recorded:
        return []
    try:
        found = load_rust_tokenizer(folder).fingerprint
    except Exception as exc:  # any way a damaged tokenizer.json fails to load is the finding
        return [f"{folder}: the tokenizer does not load ({type(exc).__name__}: {str(exc).splitlines()[0]})"]
    if found != recorded:
        return [f"{folder}: the tokenizer's fingerprint {found} differs from the manifest's {recorded}"]
    return []


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary and rules: equal fingerprints tokenise text identically."""
    return backend_fingerprint(tokenizer.backend_tokenizer)


def backend_fingerprint(backend) -> str:
    """`tokenizer_fingerprint` of a bare `tokenizers.Tokenizer`: its serialised rules, without the truncation and
    padding (call settings that pack and mix switch off, and transformers sets per call), plus whether special
    tokens' text is encoded as text (`split_special_tokens`, a flag the serialised form does not hold)."""
    split_special_tokens = bool(getattr(backend, "encode_special_tokens", False))
    if backend.truncation is not None or backend.padding is not None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    rules = backend.to_str() + ("\nsplit_special_tokens" if split_special_tokens else "")
    return hashlib.sha256(rules.encode()).hexdigest()[:16]


def document_end_id(spec: str | Path, tokenizer: RustTokenizer) -> int:
    """The token `pack` appends after every document (and `mix` counts): the tokenizer's EOS."""
    if tokenizer.eos_token_id is None:
        raise UserError(spec, "has no end-of-sequence token", "use a tokenizer that defines eos_token")
    return int(tokenizer.eos_token_id)
