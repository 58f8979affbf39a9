"""`smolctl inspect`: what a folder holds, where it came from, and whether its shards match the manifest."""

from __future__ import annotations

from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import (
    KIND_DOCUMENTS,
    KIND_PACKED,
    MANIFEST_NAME,
    lineage_chain,
    open_documents,
    open_packed,
    read_manifest,
    schema_to_dict,
    verify_checksums,
)

SAMPLE_CHARS = 240
DOCUMENT_BOUNDARY = " ⟂ "


def _clip(value, limit: int = SAMPLE_CHARS):
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _document_samples(path: Path, count: int) -> list[dict]:
    source = open_documents(path)
    samples: list[dict] = []
    for batch in source.iter_batches(batch_size=max(1, count)):
        for row in batch.to_pylist()[: count - len(samples)]:
            samples.append({key: _clip(value) for key, value in row.items()})
        if len(samples) >= count:
            break
    return samples


def decode_packed_row(tokenizer, input_ids, position_ids) -> str:
    """Decode one packed row with a visible marker wherever a document starts (position id back to 0)."""
    starts = [i for i, p in enumerate(position_ids) if p == 0]
    pieces = []
    for begin, end in zip(starts, starts[1:] + [len(input_ids)]):
        pieces.append(tokenizer.decode([int(t) for t in input_ids[begin:end]]))
    return DOCUMENT_BOUNDARY.join(pieces)


def _packed_samples(path: Path, count: int, tokenizer_spec: str | None, manifest: dict) -> list[dict]:
    from smolctl.data.tokenizer import load_tokenizer

    source = open_packed(path)
    spec = tokenizer_spec or (manifest.get("tokenizer") or {}).get("path")
    tokenizer = load_tokenizer(spec) if spec else None
    shard = source.load_shard(0) if source.files else {}
    samples = []
    for row in range(min(count, len(shard.get("input_ids", [])))):
        ids, positions = shard["input_ids"][row], shard["position_ids"][row]
        documents = int((positions == 0).sum())
        text = decode_packed_row(tokenizer, ids, positions) if tokenizer else " ".join(map(str, ids[:64]))
        samples.append({"row": row, "documents": documents, "text": _clip(text, 600)})
    return samples


def inspect_path(path: str, *, samples: int = 3, verify: bool = False, lineage: bool = False,
                 tokenizer: str | None = None) -> dict:
    """Describe a dataset, packed, model or tokenizer folder, or a foreign parquet file/folder/glob."""
    target = Path(path)
    if target.is_dir() and not (target / MANIFEST_NAME).exists() and (target / "final" / MANIFEST_NAME).is_file():
        target = target / "final"  # a training run folder: what it produced is its final model
        path = str(target)
    manifest = read_manifest(target) if target.is_dir() else None
    result: dict = {"path": str(path), "kind": manifest["kind"] if manifest else None}
    if manifest is None:
        source = open_documents(path)
        result.update(kind="parquet (no manifest)", shards=len(source.files), rows=source.num_rows,
                      schema=schema_to_dict(source.schema),
                      files=[str(f) for f in source.files[:20]])
        if samples:
            result["samples"] = _document_samples(path, samples)
        if verify:
            raise UserError(path, "has no manifest.json to verify against", "only folders written by smolctl can be verified")
        return result

    result.update(
        rows=manifest.get("rows"),
        tokens=manifest.get("tokens"),
        shards=len(manifest.get("shards", [])),
        schema=manifest.get("schema", {}),
        command=" ".join(manifest.get("command", [])),
        smolctl_version=manifest.get("smolctl_version"),
        created_at=manifest.get("created_at"),
        inputs=[ref.get("path") for ref in manifest.get("inputs", [])],
        stats=manifest.get("stats", {}),
    )
    for key in ("seq_len", "tokenizer", "strategy", "parent"):
        if key in manifest:
            result[key] = manifest[key]
    if samples and manifest["kind"] == KIND_DOCUMENTS:
        result["samples"] = _document_samples(target, samples)
    elif samples and manifest["kind"] == KIND_PACKED:
        result["samples"] = _packed_samples(target, samples, tokenizer, manifest)
    if lineage:
        result["lineage"] = lineage_chain(target)
    if verify:
        result["problems"] = verify_checksums(target, manifest)
        result["verified"] = not result["problems"]
    return result
