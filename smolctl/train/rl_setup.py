"""What ppo and grpo share: the prompts, the composite reward, the checks that run before any model loads, and the
reward trend that says whether training worked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import DocumentSource, open_documents
from smolctl.train.chat_data import checked_rows, conversation, plain_text, reference_text
from smolctl.train.config import GrpoRecipe, PpoRecipe, PromptDataSection
from smolctl.train.posttrain import check_rows, require_columns
from smolctl.train.posttrain_run import check_start, open_run
from smolctl.train.rewards import CompositeReward
from smolctl.train.run import RunStart


def load_prompts(source: DocumentSource, data: PromptDataSection, needs_reference: bool) -> list[dict]:
    """The dataset's rows, each with its reference under "reference" (None when the column is absent and not
    needed): reward callables see every column."""
    require_columns(source, [data.prompt_column], "set data.prompt_column, or pass a dataset of prompts")
    if needs_reference and data.reference_column not in source.columns:
        raise UserError(
            source.spec,
            f"has no column '{data.reference_column}' for the task reward (columns: {', '.join(source.columns)})",
            "set data.reference_column, or use a regex/callable reward",
        )
    check_rows(source, [data.prompt_column], non_empty=(data.prompt_column,))

    def prepare(row: dict) -> dict:
        prompt = row[data.prompt_column]
        if isinstance(prompt, list):  # turns: each content one string, checked as chat_data checks them
            prompt = conversation(prompt, data.prompt_column, tool_calls_rendered=False)
        else:
            prompt = plain_text(prompt, data.prompt_column)
        reference = row.get(data.reference_column)
        if needs_reference:  # every row is scored against it: a null one would score 0 without a word
            reference = reference_text(reference, data.reference_column)
        return {**row, "prompt": prompt, "reference": reference}

    rows = checked_rows(source, source.columns, prepare)
    if data.limit is not None:
        rows = rows[: data.limit]
    if not rows:
        raise UserError(source.spec, "holds no prompts", "pass a non-empty dataset")
    return rows


def as_chat(prompt) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


@dataclass
class Setup:
    run: Path
    parent: Path
    source: DocumentSource
    rows: list[dict]
    """The dataset's rows, with "prompt" and "reference" whatever their columns are called."""
    reward: CompositeReward
    start: RunStart


def prepare(
    stage: str, recipe: PpoRecipe | GrpoRecipe, run: str | Path, start: str | None, resume: str, overwrite: bool
) -> Setup:
    """Every check that can fail, before any model loads: data, rewards (callables imported), run folder, resume."""
    run = Path(run)
    parent = check_start(start or recipe.model.from_, "--from" if start else "model.from")
    source = open_documents(recipe.data.path)
    reward = CompositeReward(recipe.rewards)
    rows = load_prompts(source, recipe.data, reward.needs_reference)
    begun = open_run(stage, recipe, run, parent, resume, overwrite)
    return Setup(run, parent, source, rows, reward, begun)


def reward_trend(rewards: list[float], window: int = 5) -> dict:
    """Mean reward over the first and the last `window` steps: the number that says whether training worked."""
    finite = [r for r in rewards if math.isfinite(r)]
    if not finite:
        return {}
    return {
        "reward_first": sum(finite[:window]) / len(finite[:window]),
        "reward_last": sum(finite[-window:]) / len(finite[-window:]),
    }
