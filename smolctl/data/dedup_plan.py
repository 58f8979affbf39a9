"""A dedup run's plan: its settings (DedupConfig), the validated inputs, the units of each stage and the work
area. The run (smolctl/data/dedup.py) and the stages' units (dedup_stages.py) both build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from smolctl.arrow_arrays import cast
from smolctl.data.array_tasks import WorkArea, file_identity
from smolctl.data.minhash.params import HASHING_VERSION, MinHashParams
from smolctl.errors import UserError
from smolctl.shards import DocumentSource, open_documents

STAGES = ("signatures", "buckets", "components", "filter")
KEEP_POLICIES = ("first", "longest")
# report(stage, advance, total=None): progress of a stage; a total is announced once it is known.
Report = Callable[..., None]


@dataclass(frozen=True)
class DedupConfig:
    """What to deduplicate and how; everything here is recorded in the work area and the output manifest."""

    input: str
    output: str
    exact: bool = True
    """Remove documents whose normalised text (NFKC, case-folded, whitespace collapsed) is identical."""
    minhash: MinHashParams | None = None
    """Near-duplicate removal parameters; None for exact dedup only."""
    verify: bool = True
    """Check candidate pairs by exact Jaccard of the shingle sets (estimate settles pairs far from the threshold)."""
    text_column: str = "text"
    id_column: str | None = None
    """Id column; None means 'id' when present, else ids are `shard:row`, as `shard:row` (POSITIONAL_IDS) means."""
    against: str | None = None
    """Reference dataset: remove INPUT documents that duplicate any of its documents; it is never changed."""
    keep: str = "first"
    """Which document of a cluster survives: the first in input order, or the longest (ties: first)."""
    overwrite: bool = False


@dataclass
class DedupPlan:
    config: DedupConfig
    source: DocumentSource
    reference: DocumentSource | None
    id_column: str | None
    area: WorkArea
    reference_id_column: str | None = None
    # A local run checks the input's ids before any work; the components stage then need not count them again.
    ids_checked: bool = False
    # Input shards the signatures stage read whole and kept decoded for the filter stage of the same process
    # (their batches by shard), and how many more bytes of them it may keep (dedup_stages.DECODED_INPUT_BYTES).
    decoded: dict[int, list[pa.RecordBatch]] = field(default_factory=dict)
    decoded_room: int = 0

    @property
    def work(self) -> Path:
        return self.area.root

    @property
    def units(self) -> list[tuple[DocumentSource, int]]:
        """Signature units: every input shard, then every reference shard."""
        units = [(self.source, i) for i in range(len(self.source.files))]
        if self.reference is not None:
            units += [(self.reference, i) for i in range(len(self.reference.files))]
        return units

    def unit_count(self, stage: str) -> int:
        if stage == "signatures":
            return len(self.units)
        if stage == "buckets":
            return -(-self.config.minhash.bands // self.bands_per_bucket_unit) if self.config.minhash else 0
        return 1 if stage == "components" else len(self.source.files)

    @property
    def bands_per_bucket_unit(self) -> int:
        """Bands a bucket unit sorts together: as many as keep it within BUCKET_UNIT_KEYS keys (documents x bands),
        at least one, spread evenly over the units (20 bands of at most 19 a unit are 2 units of 10, not 19 and 1).
        A small input's bands are one unit: one file and one marker instead of one of each per band."""
        bands = self.config.minhash.bands
        documents = self.source.num_rows + (self.reference.num_rows if self.reference else 0)
        most = max(1, min(bands, BUCKET_UNIT_KEYS // max(documents, 1)))
        units = -(-bands // most)
        return -(-bands // units)

    def bucket_bands(self, unit: int) -> range:
        per_unit = self.bands_per_bucket_unit
        return range(unit * per_unit, min((unit + 1) * per_unit, self.config.minhash.bands))

    def marker(self, stage: str, unit: int) -> Path:
        return self.area.marker(stage, unit)

    def done(self, stage: str) -> bool:
        return self.area.stage_done(stage, self.unit_count(stage))


BUCKET_UNIT_KEYS = 2**20
"""The most keys (documents x bands) a bucket unit of several bands sorts: up to this, one unit's file, marker and
reads cost less than one per band (below ~52k documents, all 20 default bands are one unit)."""

# Bumped whenever the layout or content of the files under OUTPUT/_work changes: a work area of another version is
# not resumed (6: a bucket unit holds several bands when the input is small). BUCKET_UNIT_KEYS sets how bands are
# grouped into units and is not in the fingerprint: changing it needs a new version too.
WORK_FILES_VERSION = 6


def fingerprint(config: DedupConfig, source: DocumentSource, reference: DocumentSource | None) -> dict:
    return {
        "config": {k: v for k, v in asdict(config).items() if k not in ("overwrite", "output")},
        "input_files": file_identity(source.files),
        "reference_files": file_identity(reference.files) if reference else [],
        "hashing": HASHING_VERSION,
        "work_files": WORK_FILES_VERSION,
    }


DEDUP_SHARDS = ("part-00000.parquet", "duplicates/part-00000.parquet")
"""Files of the kind dedup writes into OUTPUT: an input's glob must not find them."""


def plan(config: DedupConfig) -> DedupPlan:
    """Check the inputs and settings a run needs; UserError on the first problem. The output is checked by
    the caller (a task of a run already committed finds OUTPUT complete, which is not an error)."""
    if not (config.exact or config.minhash):
        raise UserError("dedup", "both exact and MinHash dedup are off", "drop --no-exact or add --minhash")
    if config.keep not in KEEP_POLICIES:
        raise UserError("--keep", f"unknown policy {config.keep!r}", "use first or longest")
    source = open_documents(config.input)
    source.check_output_spares(config.output, shards=DEDUP_SHARDS)
    if source.num_rows == 0:
        raise UserError(config.input, "holds no documents", "pass a non-empty dataset")
    id_column = _resolve_ids(source, config)
    reference, reference_ids = None, None
    if config.against is not None:
        reference = open_documents(config.against)
        reference.require(text=[config.text_column])
        reference.check_output_spares(config.output, "the reference (--against)", DEDUP_SHARDS)
        # Compared by the files read, not the arguments: a file of the input's reached through another spelling
        # (a folder holding it, a glob) would match itself, and every document would be removed.
        inputs, references = ({Path(f).resolve() for f in s.files} for s in (source, reference))
        if shared := inputs & references:
            what = "is the input itself" if inputs == references else f"also holds the input {min(shared)}"
            raise UserError("--against", what, "pass a different reference dataset")
        # shard:row names the reference's documents too: its ids may repeat as well as the input's.
        reference_ids = None if config.id_column == POSITIONAL_IDS else default_id_column(reference, config.text_column)
        if reference_ids:
            check_id_type(
                reference,
                reference_ids,
                config.against,
                "make its ids strings or integers (without an id column, reference rows are named against:shard:row)",
            )
    total = source.num_rows + (reference.num_rows if reference else 0)
    if total >= 2**32:
        raise UserError(
            config.input,
            f"{total:,} documents: candidate pairs index documents with 32 bits",
            "split the corpus and chain runs with --against",
        )
    area = WorkArea(Path(config.output), STAGES, fingerprint(config, source, reference))
    return DedupPlan(config, source, reference, id_column, area, reference_ids)


POSITIONAL_IDS = "shard:row"
"""--id-column's name for ids made up from each document's shard and row: the default without an `id` column,
and the way round an `id` column whose ids repeat (URLs seen twice, ids restarting in every file)."""


def _resolve_ids(source: DocumentSource, config: DedupConfig) -> str | None:
    if config.id_column == POSITIONAL_IDS:
        source.require(text=[config.text_column])
        return None
    if config.id_column is not None:
        if config.id_column == config.text_column:
            raise UserError(
                "--id-column",
                f"'{config.id_column}' is also the text column",
                f"pass a column of unique ids, or --id-column {POSITIONAL_IDS} to name documents by shard and row",
            )
        source.require(config.id_column, text=[config.text_column], flags={config.id_column: "--id-column"})
        check_id_type(source, config.id_column, config.input, ID_FIX)
        return config.id_column
    source.require(text=[config.text_column])
    id_column = default_id_column(source, config.text_column)
    if id_column:
        check_id_type(source, id_column, config.input, ID_FIX)
    return id_column


def default_id_column(source: DocumentSource, text_column: str) -> str | None:
    """`id` when the documents have one (and it is not the text), else None: ids are then made up as shard:row."""
    return "id" if "id" in source.columns and text_column != "id" else None


ID_FIX = "pass --id-column with a column of strings or integers"


def check_id_type(source: DocumentSource, column: str, where: str, fix: str) -> None:
    """The report writes ids as text: a column arrow cannot cast to string (lists, structs, ...) is refused
    before any work."""
    kind = source.schema.field(column).type
    try:
        cast(pa.nulls(0, kind), pa.string())  # not pa.array: it imports pandas
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        raise UserError(
            where,
            f"column '{column}' holds {kind}, which cannot be written as text ids",
            fix,
        ) from None
