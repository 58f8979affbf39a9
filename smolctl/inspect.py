"""`smolctl inspect`: what a folder holds, where it came from, and whether its shards match the manifest."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smolctl.data.tokenizer import fingerprint_problems, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from smolctl.results import Result
from smolctl.shards import (
    KIND_DOCUMENTS,
    KIND_MODEL,
    KIND_PACKED,
    KIND_TOKENS,
    MANIFEST_NAME,
    home_expanded,
    lineage_chain,
    open_documents,
    open_packed,
    read_manifest,
    schema_to_dict,
    verify_checksums,
)
from smolctl.train.run import RUN_FILE, TRAINER_STATE, holds_trainer_checkpoints

SAMPLE_CHARS = 240
DOCUMENT_BOUNDARY = " ⟂ "


def _clip(value, limit: int = SAMPLE_CHARS):
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sample_value(value: Any) -> Any:
    """A cell of a sample row as JSON keeps it: text clipped (inside lists and structs too, chat turns), numbers,
    booleans and nulls as they are, times in ISO form; a null must not read as the text "None"."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return _clip(value)
    if isinstance(value, dict):
        return {str(key): sample_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [sample_value(item) for item in value]
    return _clip(value.isoformat() if hasattr(value, "isoformat") else str(value))


def _document_samples(path: Path, count: int) -> list[dict]:
    source = open_documents(path)
    samples: list[dict] = []
    for batch in source.iter_batches(batch_size=max(1, count)):
        for row in batch.to_pylist()[: count - len(samples)]:
            samples.append({key: sample_value(value) for key, value in row.items()})
        if len(samples) >= count:
            break
    return samples


def decode_packed_row(tokenizer, input_ids, position_ids) -> str:
    """Decode one packed row with a visible marker wherever a document starts (position id back to 0). The padding
    at the row's end (position -1) shows as one marker with its length: decoded, it would read as the last document
    ending in a run of EOS (the pad id of every tokenizer without a pad token)."""
    positions = [int(p) for p in position_ids]
    real = next((i for i, p in enumerate(positions) if p < 0), len(positions))
    starts = [i for i, p in enumerate(positions[:real]) if p == 0]
    pieces = []
    for begin, end in zip(starts, starts[1:] + [real]):
        pieces.append(tokenizer.decode([int(t) for t in input_ids[begin:end]]))
    padding = f" [padding ×{len(positions) - real}]" if real < len(positions) else ""
    return DOCUMENT_BOUNDARY.join(pieces) + padding


def _packed_samples(path: Path, count: int, tokenizer_spec: str | None, manifest: dict) -> tuple[list[dict], list[str]]:
    """The first rows decoded, and notes on how (rows shown as token ids, and why)."""
    source = open_packed(path)
    recorded = (manifest.get("tokenizer") or {}).get("path")
    packed_with = (manifest.get("tokenizer") or {}).get("fingerprint")
    notes: list[str] = []

    def other_than_packed_with(tokenizer) -> str | None:
        """Its fingerprint where it is not the packing tokenizer's: decoded by another tokenizer, the rows read as
        fluent-looking nonsense."""
        found = tokenizer_fingerprint(tokenizer)
        return found if packed_with and found != packed_with else None

    tokenizer = load_tokenizer(tokenizer_spec) if tokenizer_spec else None
    if tokenizer is not None and (found := other_than_packed_with(tokenizer)):
        raise UserError(
            "--tokenizer",
            f"{tokenizer_spec} is not the tokenizer {path} was packed with (fingerprint {found}, packed with "
            f"{packed_with})",
            f"pass that tokenizer ({recorded}), or leave --tokenizer out",
        )
    if tokenizer is None and recorded:
        try:
            tokenizer = load_tokenizer(recorded)
        except UserError:  # moved or deleted since the pack: the rows show as token ids (--tokenizer decodes)
            tokenizer = None
        if tokenizer is not None and other_than_packed_with(tokenizer):
            notes.append(f"{recorded} changed since {path} was packed with it: the rows are shown as token ids")
            tokenizer = None
    samples = []
    first_row = 0
    for index in range(len(source.files)):  # the first rows, from as many shards as they take (a shard may be small)
        if len(samples) == count:
            break
        shard = source.load_shard(index)
        for row in range(min(count - len(samples), len(shard["input_ids"]))):
            ids, positions = shard["input_ids"][row], shard["position_ids"][row]
            documents = int((positions == 0).sum())
            text = decode_packed_row(tokenizer, ids, positions) if tokenizer else " ".join(map(str, ids[:64]))
            samples.append({"row": first_row + row, "documents": documents, "text": _clip(text, 600)})
        first_row += len(shard["input_ids"])
    return samples, notes


# The counts a folder kind has: a dataset counts rows (documents), a packed folder rows and tokens, datatrove token
# files tokens; a model's shards are its weight files, a tokenizer and a checkpoint have none, and none has rows.
COUNTS_BY_KIND = {
    KIND_DOCUMENTS: ("rows", "tokens", "shards"),
    KIND_PACKED: ("rows", "tokens", "shards"),
    KIND_TOKENS: ("rows", "tokens", "shards"),
    KIND_MODEL: ("shards",),
    "tokenizer": (),
    "checkpoint": (),
}
KIND_COLLECTION = "folders"  # a plain folder holding smolctl folders (e.g. dedup outputs per source)


def smolctl_folders_under(root: Path, max_depth: int = 3) -> list[Path]:
    """Every folder with a manifest below `root` (not `root` itself), in path order; hidden folders (staging, work
    areas) are skipped. A dataset's `duplicates/`, a mix's stages and a run's `final/` are found this way."""
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        for child in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            if read_manifest(child) is not None:  # another tool's manifest.json makes no smolctl folder
                found.append(child)
            if depth < max_depth:
                walk(child, depth + 1)

    walk(root, 1)
    return found


def _counts(manifest: dict) -> dict:
    counts = {"rows": manifest.get("rows"), "tokens": manifest.get("tokens"), "shards": len(manifest.get("shards", []))}
    return {key: counts[key] for key in COUNTS_BY_KIND.get(manifest["kind"], counts) if counts[key] is not None}


def _summary(folder: Path, root: Path) -> dict:
    manifest = read_manifest(folder)
    return {"path": str(folder.relative_to(root)), "kind": manifest["kind"], **_counts(manifest)}


def _verify_all(folders: list[Path]) -> list[str]:
    problems: list[str] = []
    for folder in folders:
        problems += verify_checksums(folder) or fingerprint_problems(folder, read_manifest(folder) or {})
    return problems


@dataclass
class Inspection(Result):
    """What `smolctl inspect` found. A field is None where it does not apply to this kind of folder, and
    `to_dict()` (what `--json` prints) leaves those keys out."""

    path: str
    kind: str | None
    rows: int | None = None
    tokens: int | None = None
    shards: int | None = None
    schema: dict | None = None
    files: list[str] | None = None
    """The first parquet files of a folder without a manifest."""
    command: str | None = None
    smolctl_version: str | None = None
    created_at: str | None = None
    inputs: list[str] | None = None
    stats: dict | None = None
    folders: list[dict] | None = None
    """smolctl folders inside this one (a collection's whole content): path, kind and counts."""
    seq_len: int | None = None
    tokenizer: dict | str | None = None
    strategy: str | None = None
    parent: dict | str | None = None
    samples: list[dict] | None = None
    notes: list[str] | None = None
    """How the samples are shown, where not as asked (a packed folder's tokenizer changed since the pack)."""
    lineage: list[dict] | None = None
    verified_folders: list[str] | None = None
    problems: list[str] | None = None
    verified: bool | None = None

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None or key == "kind"}

    def verify(self, folders: list[Path], run: Path | None = None) -> None:
        if not folders:
            raise UserError(self.path, "holds no smolctl folder to verify", "pass a folder a smolctl stage wrote")
        self.verified_folders = [str(f) for f in folders]
        self.problems = _verify_all(folders) + (_checkpoints_without_manifest(run) if run else [])
        self.verified = not self.problems
        by_size = sum(
            entry.get("sha256") is None
            for folder in folders
            for entry in (read_manifest(folder) or {}).get("files", [])
        )
        if by_size:  # checkpoints saved before their manifests held digests
            self.notes = [
                *(self.notes or []),
                f"{by_size} file(s) are listed by size only (saved by an older smolctl): a flipped byte in them "
                "goes unseen",
            ]


def _checkpoints_without_manifest(run: Path) -> list[str]:
    """A run's step-N folders with no manifest, which listing smolctl folders passes over: a resume does too, so
    the run is not what it looks like (saves in progress are hidden .partial folders, never named step-N)."""
    return [
        f"{folder}: no manifest.json (a damaged copy, or a save cut off): a resume passes this checkpoint over"
        for folder in sorted((run / "checkpoints").glob("step-*"))
        if folder.is_dir() and not (folder / MANIFEST_NAME).is_file() and not (folder / TRAINER_STATE).is_file()
    ]


def inspect_collection(root: Path, *, verify: bool, run: bool = False) -> Inspection:
    """A plain folder of smolctl folders (`demo-out/dedup` holds web/, code/, math/ and their duplicates/), or a
    run folder without its final model (`run`)."""
    folders = smolctl_folders_under(root)
    result = Inspection(path=str(root), kind=KIND_COLLECTION, folders=[_summary(f, root) for f in folders])
    if verify:
        result.verify(folders, root if run else None)
    return result


def _model_without_manifest(folder: Path, path: str) -> Inspection:
    """A Hugging Face model folder another tool wrote (save_pretrained, a hub download, a TRL checkpoint): what
    its config says, and its files."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(folder / "config.json", f"is not valid JSON ({exc})", "restore the model's config") from None
    keys = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    weights = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    return Inspection(
        path=path,
        kind="model (no manifest)",
        shards=len(weights),
        files=sorted(p.name for p in folder.iterdir() if p.is_file()),
        stats={key: config[key] for key in keys if key in config}
        | {"tokenizer": any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))},
        notes=None if weights else ["no weight files (*.safetensors, *.bin): a config alone"],
    )


def _tokenizer_without_manifest(folder: Path, path: str) -> Inspection:
    """A Hugging Face tokenizer folder another tool wrote (save_pretrained, a hub download): what `pack` and the
    training commands would take from it."""
    tokenizer = load_tokenizer(folder)
    stats = {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        **{
            f"{role}_token": f"{token} ({tokenizer.convert_tokens_to_ids(token)})"
            for role, token in (
                ("eos", tokenizer.eos_token),
                ("bos", tokenizer.bos_token),
                ("pad", tokenizer.pad_token),
            )
            if token is not None
        },
        "chat_template": bool(tokenizer.chat_template),
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }
    return Inspection(
        path=path,
        kind="tokenizer (no manifest)",
        files=sorted(p.name for p in folder.iterdir() if p.is_file()),
        stats=stats,
        notes=None if tokenizer.eos_token is not None else ["no EOS token: pack cannot end documents with it"],
    )


def inspect_path(
    path: str, *, samples: int = 3, verify: bool = False, lineage: bool = False, tokenizer: str | None = None
) -> Inspection:
    """Describe a dataset, packed, model or tokenizer folder, a folder of such folders, or a foreign parquet
    file/folder/glob."""
    path = str(home_expanded(path))
    target = Path(path)
    # A training run folder: what it produced is its final model; until it has one, its checkpoints. Its
    # checkpoints and exports are verified with it, since a run is copied and resumed whole.
    run = (
        target if target.is_dir() and (target / RUN_FILE).is_file() and not (target / MANIFEST_NAME).exists() else None
    )
    if run is not None and (target / "final" / MANIFEST_NAME).is_file():
        target = target / "final"
        path = str(target)
    elif run is not None and (lineage or verify) and holds_trainer_checkpoints(target):
        raise UserError(
            "--lineage" if lineage else "--verify",
            f"{path} is a post-training run without a final model yet: its checkpoints (TRL's) carry no "
            f"{'lineage' if lineage else 'checksums'} of their own",
            f"inspect {path} once it has finished (RUN/final)",
        )
    elif run is not None and lineage:  # a run still training: its lineage so far is its newest checkpoint's
        checkpoints = (
            smolctl_folders_under(target / "checkpoints", max_depth=1) if (target / "checkpoints").is_dir() else []
        )
        if not checkpoints:
            raise UserError(
                "--lineage", f"{path} is a run with no checkpoint or final model yet", "inspect it once it has saved"
            )
        target = checkpoints[-1]
        path = str(target)
    manifest = read_manifest(target) if target.is_dir() else None
    if manifest is None and target.is_dir() and (run is not None or smolctl_folders_under(target, max_depth=1)):
        if lineage:
            raise UserError(
                "--lineage",
                f"{path} holds several smolctl folders, each with its own lineage",
                f"inspect one of them, e.g. {smolctl_folders_under(target, max_depth=1)[0]} --lineage",
            )
        return inspect_collection(target, verify=verify, run=run is not None)
    if manifest is None:
        if not target.exists() and not any(ch in str(path) for ch in "*?["):
            raise UserError(path, "no such file or folder", "check the path")
        if target.is_dir() and any(target.glob("*.distcp")):
            raise UserError(
                path,
                "is a training checkpoint whose save never finished (no manifest.json)",
                "use a complete one, RUN/checkpoints/step-NNNNNNN",
            )
        if verify:
            raise UserError(
                path, "has no manifest.json to verify against", "only folders written by smolctl can be verified"
            )
        if lineage:
            raise UserError(
                "--lineage",
                f"{path} has no manifest.json, which is where lineage is recorded",
                "inspect it without --lineage (only folders smolctl wrote have one)",
            )
        if target.is_dir() and (target / "config.json").is_file():
            return _model_without_manifest(target, str(path))
        if target.is_dir() and any((target / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return _tokenizer_without_manifest(target, str(path))
        source = open_documents(path)
        return Inspection(
            path=str(path),
            kind="parquet (no manifest)",
            shards=len(source.files),
            rows=source.num_rows,
            schema=schema_to_dict(source.schema),
            files=[str(f) for f in source.files[:20]],
            samples=_document_samples(path, samples) if samples else None,
        )

    nested = smolctl_folders_under(target)
    result = Inspection(
        path=str(path),
        kind=manifest["kind"],
        **_counts(manifest),
        schema=manifest.get("schema", {}),
        command=" ".join(manifest.get("command", [])),
        smolctl_version=manifest.get("smolctl_version"),
        created_at=manifest.get("created_at"),
        inputs=[ref.get("path") for ref in manifest.get("inputs", [])],
        stats=manifest.get("stats", {}),
        folders=[_summary(folder, target) for folder in nested],
        **{key: manifest[key] for key in ("seq_len", "tokenizer", "strategy", "parent") if key in manifest},
    )
    if verify:  # first: a damaged shard is what --verify reports, not an error reading samples from it
        # a mix's stages are its own shards: hash each file once
        listed = {shard["name"] for shard in manifest.get("shards", [])}
        separate = [f for f in nested if not any(name.startswith(f"{f.relative_to(target)}/") for name in listed)]
        rest_of_run = [f for f in smolctl_folders_under(run) if target not in (f, *f.parents)] if run else []
        result.verify([target, *separate, *rest_of_run], run)
    samples = samples if manifest.get("shards") else 0  # a folder written empty (every document removed, say)
    if samples and not result.problems and manifest["kind"] == KIND_DOCUMENTS:
        result.samples = _document_samples(target, samples)
    elif samples and not result.problems and manifest["kind"] == KIND_PACKED:
        result.samples, notes = _packed_samples(target, samples, tokenizer, manifest)
        result.notes = notes or None
    if lineage:
        result.lineage = lineage_chain(target)
    return result
