"""The schedule of a `smolctl mix`: sources, stages, weights and budgets, from command-line flags or a TOML recipe,
and the order of a stage's rows (a seeded shuffle, or a curriculum from easy to hard).

Everything here is checked before any data is read; `smolctl.data.mix` carries it out.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from smolctl.arrow_arrays import plain_strings
from smolctl.errors import UserError
from smolctl.recipe import RecipePath, Section, load_recipe
from smolctl.shards import MANIFEST_NAME
from smolctl.units import parse_bytes, parse_count

BUDGET_KINDS = ("tokens", "bytes", "documents")
TOKEN_ESTIMATES = ("auto", "sample", "exact")
"""How a source's tokens are counted (with a tokenizer): `exact` tokenizes every document; `sample` tokenizes a
seeded sample of about `token_sample` documents, calibrates the source's tokens per UTF-8 byte on it and estimates
every document from its byte length; `auto` samples a source of more than SAMPLE_ABOVE x token_sample documents
(the sample is under a tenth of it) and counts smaller sources exactly (their full pass costs little)."""
SAMPLE_ABOVE = 10
DEFAULT_TOKEN_SAMPLE = 10_000
STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ORDER_PROXIES = ("length", "compression")
"""Built-in difficulty scores: UTF-8 bytes of the text, and zlib-compressed bytes / raw bytes (repetitive,
predictable text compresses well and scores low)."""
ORDER_COLUMN = "__order_score"
"""Carries each row's difficulty score from the sorted source streams to the block that orders by it."""


class SourceSection(Section):
    path: RecipePath
    """A dataset folder, folder of parquet files, parquet file or glob; relative to the current folder."""


class StageSection(Section):
    name: str
    """Also the stage's folder name under OUTPUT."""
    weights: dict[str, float]
    """Source name → weight (normalised; sources left out get 0)."""
    end_weights: dict[str, float] | None = None
    """Weights at the end of the stage: they move linearly from `weights` across the stage."""
    interpolate: bool = False
    """Move linearly to the next stage's weights across this stage."""
    tokens: int | float | str | None = None
    bytes: int | float | str | None = None
    documents: int | float | str | None = None
    """One budget (or none: as much as max_repeat allows), written as the flags take it: 2.5M, 1e5, "100MB"."""
    order: str = "shuffle"
    """shuffle (seeded), or ascending:SCORE, easy to hard: SCORE is a numeric column of every source the stage
    uses, or a built-in proxy, `length` (UTF-8 bytes) or `compression` (zlib ratio)."""


class MixRecipe(Section):
    seed: int = Field(0, ge=0)
    """Seeds sampling and shuffling (numpy's seed sequences take 0 or more)."""
    max_repeat: float = 1.0
    """How many times each source may be used across all stages together."""
    tokenizer: RecipePath | None = None
    """Weigh by tokens with this tokenizer (folder or hub id); without one, weights are fractions of bytes."""
    token_estimate: str = "auto"
    """auto, sample or exact: how each source's tokens are counted (see TOKEN_ESTIMATES)."""
    token_sample: int = DEFAULT_TOKEN_SAMPLE
    """Documents per source tokenized to calibrate its bytes per token in `sample` mode."""
    text_column: str = "text"
    shuffle_buffer: int = 20_000
    """Rows per shuffled output block."""
    sources: dict[str, SourceSection]
    stages: list[StageSection]


@dataclass
class Stage:
    name: str
    start: dict[str, float]
    """Normalised weights at the start of the stage."""
    end: dict[str, float]
    """Normalised weights at the end (equal to `start` unless the weights move across the stage)."""
    budget: int | None = None
    budget_kind: str | None = None
    """tokens, bytes or documents; None takes as much as max_repeat allows."""
    order: str = "shuffle"

    @property
    def ascending_by(self) -> str | None:
        """The score a curriculum stage sorts by; None for a shuffled stage."""
        return self.order.partition(":")[2] if self.order != "shuffle" else None

    def share(self, name: str) -> float:
        """The source's fraction of the whole stage: the mean of a linear schedule."""
        return (self.start.get(name, 0.0) + self.end.get(name, 0.0)) / 2


@dataclass
class MixSchedule:
    sources: dict[str, str]
    stages: list[Stage]
    tokenizer: str | None = None
    seed: int = 0
    max_repeat: float = 1.0
    text_column: str = "text"
    shuffle_buffer: int = 20_000
    staged: bool = True
    """True: each stage goes to OUTPUT/<stage>/ under a top-level manifest; False: OUTPUT is the one stage."""
    token_estimate: str = "auto"
    token_sample: int = DEFAULT_TOKEN_SAMPLE

    def sample_fraction(self, documents: int) -> float | None:
        """The fraction of a source of `documents` rows whose tokens calibrate its estimate; None: count every
        document's tokens (exact mode, or no tokenizer)."""
        if not self.tokenizer or self.token_estimate == "exact":
            return None
        if self.token_estimate == "auto" and documents <= SAMPLE_ABOVE * self.token_sample:
            return None
        return min(1.0, self.token_sample / max(1, documents))

    @property
    def unit(self) -> str:
        return "tokens" if self.tokenizer else "bytes"


def parse_source(text: str) -> tuple[str, str, float]:
    """'web=data/web:0.7' → ('web', 'data/web', 0.7). The weight follows the last ':' (paths may hold ':')."""
    name, sep, rest = text.partition("=")
    path, colon, weight = rest.rpartition(":")
    if not sep or not colon or not name.strip() or not path:
        raise UserError("--source", f"{text!r} is not NAME=PATH:WEIGHT", "write e.g. --source web=data/web:0.7")
    try:
        value = float(weight)
    except ValueError:
        raise UserError(
            "--source", f"{text!r}: weight {weight!r} is not a number", "write e.g. web=data/web:0.7"
        ) from None
    return name.strip(), path, value


def normalise(weights: dict[str, float], where: str, sources: dict[str, str]) -> dict[str, float]:
    for name, weight in weights.items():
        if name not in sources:
            raise UserError(where, f"weight for unknown source {name!r}", f"known sources: {', '.join(sources)}")
        if not math.isfinite(weight) or weight < 0:
            raise UserError(where, f"weight of {name!r} is {weight}", "weights are finite numbers >= 0")
    largest = max(weights.values(), default=0.0)
    if largest <= 0:
        raise UserError(where, "the weights sum to zero", "give at least one source a positive weight")
    # Scaled by the largest first: weights near the float limit (1e308) would sum to inf.
    total = sum(weight / largest for weight in weights.values())
    return {name: weights.get(name, 0.0) / largest / total for name in sources}


def schedule_from_flags(
    sources: list[str],
    *,
    tokens: str | None = None,
    bytes_: str | None = None,
    documents: str | None = None,
    tokenizer: str | None = None,
    seed: int | None = None,
    max_repeat: float | None = None,
    text_column: str | None = None,
    shuffle_buffer: int | None = None,
    token_estimate: str | None = None,
    token_sample: int | None = None,
) -> MixSchedule:
    """A one-stage schedule from --source NAME=PATH:WEIGHT flags; options left None take MixSchedule's defaults."""
    parsed = [parse_source(text) for text in sources]
    if not parsed:
        raise UserError("--source", "no sources given", "pass --source NAME=PATH:WEIGHT (repeat it) or --recipe")
    names = [name for name, _, _ in parsed]
    if len(set(names)) != len(names):
        raise UserError(
            "--source", f"a source name is used twice ({', '.join(names)})", "give each source its own name"
        )
    paths = {name: path for name, path, _ in parsed}
    budgets = {kind: value for kind, value in zip(BUDGET_KINDS, (tokens, bytes_, documents)) if value is not None}
    if len(budgets) > 1:
        raise UserError("--tokens/--bytes/--documents", "more than one budget given", "pass only one")
    kind, amount = next(iter(budgets.items()), (None, None))
    weights = normalise({name: weight for name, _, weight in parsed}, "--source", paths)
    parse = parse_bytes if kind == "bytes" else parse_count  # tokens and documents are counts
    stage = Stage("mix", weights, weights, parse(amount, f"--{kind}") if amount else None, kind)
    given = {
        "seed": seed,
        "max_repeat": max_repeat,
        "text_column": text_column,
        "shuffle_buffer": shuffle_buffer,
        "token_estimate": token_estimate,
        "token_sample": token_sample,
    }
    schedule = MixSchedule(
        paths, [stage], tokenizer, staged=False, **{key: value for key, value in given.items() if value is not None}
    )
    check_schedule(schedule)
    return schedule


def schedule_from_recipe(
    path: str | Path,
    overrides: list[str] = (),
    *,
    tokenizer: str | None = None,
    seed: int | None = None,
    max_repeat: float | None = None,
    text_column: str | None = None,
    shuffle_buffer: int | None = None,
    token_estimate: str | None = None,
    token_sample: int | None = None,
) -> MixSchedule:
    """A schedule from a recipe; an option given (not None) overrides the recipe's key, even when it equals the
    default (`--shuffle-buffer 20000` against a recipe's 5000 is 20000)."""
    given = {
        "tokenizer": tokenizer,
        "seed": seed,
        "max_repeat": max_repeat,
        "text_column": text_column,
        "shuffle_buffer": shuffle_buffer,
        "token_estimate": token_estimate,
        "token_sample": token_sample,
    }
    # json.dumps writes a valid TOML string or number, read back as any --set value is
    options = [f"{key}={json.dumps(value)}" for key, value in given.items() if value is not None]
    recipe = load_recipe(MixRecipe, path, [*overrides, *options])
    sources = {name: section.path for name, section in recipe.sources.items()}
    if not sources:
        raise UserError(path, "sources: no sources", "add [sources.NAME] tables with a path")
    if not recipe.stages:
        raise UserError(path, "stages: no stages", "add [[stages]] tables with a name and weights")
    stages = []
    for i, section in enumerate(recipe.stages):
        where = f"{path}: stages[{i}] ({section.name})"
        start = normalise(section.weights, f"{where}.weights", sources)
        if section.interpolate and section.end_weights is not None:
            raise UserError(
                where, "has both interpolate and end_weights", "use one: interpolate moves to the next stage's weights"
            )
        if section.interpolate and i + 1 == len(recipe.stages):
            raise UserError(where, "interpolate = true on the last stage", "give it end_weights instead")
        target = recipe.stages[i + 1].weights if section.interpolate else section.end_weights
        end = normalise(target, f"{where}.end_weights", sources) if target is not None else start
        budgets = [(kind, getattr(section, kind)) for kind in BUDGET_KINDS if getattr(section, kind) is not None]
        if len(budgets) > 1:
            raise UserError(
                where,
                f"more than one budget ({', '.join(k for k, _ in budgets)})",
                "give one of tokens, bytes, documents",
            )
        kind, amount = budgets[0] if budgets else (None, None)
        if amount is not None:
            amount = (parse_bytes if kind == "bytes" else parse_count)(amount, f"{where}.{kind}")
        stages.append(Stage(section.name, start, end, amount, kind, section.order))
    plan = MixSchedule(
        sources,
        stages,
        recipe.tokenizer,
        recipe.seed,
        recipe.max_repeat,
        recipe.text_column,
        recipe.shuffle_buffer,
        staged=True,
        token_estimate=recipe.token_estimate,
        token_sample=recipe.token_sample,
    )
    check_schedule(plan)
    return plan


def check_schedule(plan: MixSchedule) -> None:
    if not (plan.max_repeat > 0 and math.isfinite(plan.max_repeat)):
        raise UserError(
            "--max-repeat",
            f"{plan.max_repeat} is not a positive number",
            "use e.g. 1 (each document at most once) or 4",
        )
    if plan.shuffle_buffer < 1:
        raise UserError("shuffle_buffer", f"{plan.shuffle_buffer} rows", "use a positive row count")
    if plan.token_estimate not in TOKEN_ESTIMATES:
        raise UserError(
            "--token-estimate", f"unknown mode {plan.token_estimate!r}", f"use one of {', '.join(TOKEN_ESTIMATES)}"
        )
    if plan.token_estimate != "auto" and not plan.tokenizer:
        raise UserError(
            "--token-estimate",
            f"{plan.token_estimate} counts tokens, and no tokenizer is given",
            "pass --tokenizer (or set tokenizer in the recipe), or leave --token-estimate out to weigh by bytes",
        )
    if plan.token_sample < 1:
        raise UserError(
            "token_sample", f"{plan.token_sample} documents", "sample a positive number of documents per source"
        )
    names = [stage.name for stage in plan.stages]
    for name in names:
        if not STAGE_NAME.fullmatch(name):
            raise UserError(f"stage {name!r}", "is not a usable folder name", "use letters, digits, '.', '_' and '-'")
        if name == MANIFEST_NAME:
            raise UserError(f"stage {name!r}", "is the name of the mix's own manifest", "give the stage another name")
    if len(set(names)) != len(names):
        raise UserError("stages", f"a stage name is used twice ({', '.join(names)})", "give each stage its own name")
    for stage in plan.stages:
        kind, colon, key = stage.order.partition(":")
        if stage.order != "shuffle" and (kind != "ascending" or not colon or not key):
            raise UserError(
                f"stage {stage.name!r}: order",
                f"{stage.order!r} is not an order",
                'use "shuffle", "ascending:length", "ascending:compression" or "ascending:COLUMN"',
            )
        if stage.budget_kind == "tokens" and not plan.tokenizer:
            raise UserError(
                f"stage {stage.name!r}",
                "a budget in tokens needs a tokenizer",
                "pass --tokenizer (or set tokenizer in the recipe), or give the budget in bytes",
            )
        if stage.budget_kind == "bytes" and plan.tokenizer:
            raise UserError(
                f"stage {stage.name!r}",
                "with a tokenizer, weights are fractions of tokens, so a budget in bytes is ambiguous",
                "give the budget in tokens or documents",
            )


# ---------------------------------------------------------------------------------------------------------------
# Curriculum order: rows easy to hard within a stage, the source weights holding along it
#
# Each source's slice is sorted by score (ties keep the seeded stream order), and its k-th easiest row takes the
# stage point where the weight schedule wants the source's cumulative units (tokens or bytes) to reach that row:
# at every point of the stage every source has given its share of units, from its easy end. The merge by stage
# point then cuts blocks of `shuffle_buffer` rows as for a shuffled stage, and each block is sorted by score
# instead of shuffled. So the score never decreases within a source along the whole stage, nor within a block;
# across sources it rises from block to block by quantile (one block of the whole stage gives a global sort, and
# gives up the weights along it). Sorting holds one source's slice of the stage in memory.


def check_order_columns(plan: MixSchedule, schemas: dict[str, pa.Schema]) -> None:
    """Every source a curriculum stage uses has its score column, as numbers."""
    for stage in plan.stages:
        key = stage.ascending_by
        if key is None or key in ORDER_PROXIES:
            continue
        for name, schema in schemas.items():
            if stage.share(name) <= 0:
                continue
            if key not in schema.names:
                raise UserError(
                    f"stage {stage.name!r}: order",
                    f"source {name!r} has no column {key!r} (columns: {', '.join(schema.names)})",
                    f"add the score to every source, or use ascending:{ORDER_PROXIES[0]}",
                )
            kind = schema.field(key).type
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
                raise UserError(
                    f"stage {stage.name!r}: order",
                    f"column {key!r} of source {name!r} holds {kind}, not numbers",
                    "score rows with a numeric column",
                )


def order_scores(table: pa.Table, key: str, text_column: str, where: str) -> np.ndarray:
    """Each row's difficulty: a proxy computed from the text, or the score column (nulls are an error)."""
    if key == "length":
        return pc.fill_null(pc.binary_length(plain_strings(table.column(text_column))), 0).to_numpy().astype(np.float64)
    if key == "compression":
        raw = [(text or "").encode() for text in table.column(text_column).to_pylist()]
        return np.array([len(zlib.compress(b)) / len(b) if b else 0.0 for b in raw], dtype=np.float64)
    column = table.column(key)
    if column.null_count:
        raise UserError(where, f"column {key!r} has {column.null_count} empty (null) scores", "score every row")
    return column.to_numpy().astype(np.float64)


def ascending_stream(
    stream: Iterator[tuple[pa.Table, np.ndarray]],
    stage: Stage,
    text_column: str,
    sizes: Callable[[pa.Array], np.ndarray],
    due: Callable[[np.ndarray], np.ndarray],
    batch_rows: int = 1024,
) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """One source's (rows, due points) sorted by score, each row due where its cumulative units fall; the rows
    carry their score in ORDER_COLUMN."""
    tables = [rows for rows, _ in stream]
    if not tables:
        return
    table = pa.concat_tables(tables)
    scores = order_scores(table, stage.ascending_by, text_column, f"stage {stage.name!r}")
    order = np.argsort(scores, kind="stable")
    table = table.take(pa.array(order)).append_column(ORDER_COLUMN, pa.array(scores[order]))
    units = sizes(table.column(text_column).combine_chunks()).astype(np.float64)
    if units.sum() <= 0:
        units = np.ones(table.num_rows)
    progress = (np.cumsum(units) - units / 2) / units.sum()
    points = due(progress)
    for start in range(0, table.num_rows, batch_rows):
        yield table.slice(start, batch_rows), points[start : start + batch_rows]


def block_order(rows: pa.Table, index: np.ndarray, seed: int, stage_index: int, block: int) -> np.ndarray:
    """The rows `index` of one block, in order: a seeded shuffle, or by score when the rows carry one."""
    if ORDER_COLUMN in rows.column_names:
        scores = rows.column(ORDER_COLUMN).take(pa.array(index)).to_numpy()
        return index[np.argsort(scores, kind="stable")]
    return index[np.random.default_rng([seed, stage_index, block]).permutation(len(index))]
