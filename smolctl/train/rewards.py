"""Composable rewards for ppo and grpo, declared in the recipe as `[[rewards]]` tables.

The total follows the smol training playbook's shaped reward (task completion in [0, 1], times a length penalty,
plus an n-gram diversity bonus):

    total = (Σ task_weight · task) · Π length_penalty^weight + Σ diversity_weight · diversity

with length_penalty = exp(-scale · completion_tokens) (scale 0.01 in the playbook). Without task rewards the
first term is the length penalty alone. A reward that is NaN (a callable may return one) makes the total NaN;
the trainers count such completions and leave them out of the update.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from pydantic import Field, model_validator

from smolctl.errors import UserError
from smolctl.recipe import Section, load_toml, validate


class RewardSection(Section):
    kind: Literal["task", "length", "diversity"]
    weight: float = 1.0
    match: Literal["exact", "regex", "callable"] = "exact"
    """task: exact (normalised text equality), regex (search), or callable (`function`)."""
    pattern: str | None = None
    """task/regex: the pattern; `{reference}` inside it is replaced by the escaped reference. Default: the reference."""
    function: str | None = None
    """task/callable: "module:function", called as function(completion: str, reference: str | None) -> float."""
    scale: float = Field(0.01, gt=0)
    """length: the penalty is exp(-scale * completion tokens)."""
    n: int = Field(2, gt=0)
    """diversity: n-gram size (words) of the distinct-n ratio."""

    @model_validator(mode="after")
    def _complete(self) -> "RewardSection":
        if self.kind == "task" and self.match == "callable" and not self.function:
            raise ValueError('match = "callable" needs function = "module:function"')
        # A key that the chosen kind/match ignores is a typo waiting to cost a run: say so instead.
        if self.function and (self.kind, self.match) != ("task", "callable"):
            raise ValueError('function is only used with kind = "task" and match = "callable"')
        if self.pattern and (self.kind, self.match) != ("task", "regex"):
            raise ValueError('pattern is only used with kind = "task" and match = "regex"')
        return self


def normalise(text: str) -> str:
    """Text compared by `exact`: trimmed, case-folded, without surrounding quotes, backticks or a final period."""
    return text.strip().strip("`'\".").strip().casefold()


def distinct_ngram_ratio(text: str, n: int) -> float:
    """Distinct n-grams over all n-grams of the words; 1.0 for text shorter than n words, 0.0 for empty text."""
    words = text.split()
    if not words:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def load_callable(spec: str, where: str) -> Callable:
    """Import "module:function" (from the working directory or PYTHONPATH); a spec that does not import is the
    user's error, raised before training."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UserError(where, f"{spec!r} is not module:function", 'write e.g. function = "my_rewards:exact_module"')
    if os.getcwd() not in sys.path:  # the console script's sys.path lacks the working directory, python -m has it
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code
        raise UserError(where, f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}",
                        "check the module name, and run from its folder or add that to PYTHONPATH") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(where, f"module {module_name!r} has no function {name!r}", "check the function name")
    return function


@dataclass
class Scored:
    totals: list[float]
    components: dict[str, list[float]]
    """Per reward entry ("task", "length", "diversity#2", ...), each value per completion."""


class CompositeReward:
    """The recipe's reward entries, built once (callables imported, patterns compiled), scoring batches."""

    def __init__(self, sections: Sequence[RewardSection], where: str = "rewards"):
        if not sections:
            raise UserError(where, "no rewards", 'add at least one [[rewards]] table, e.g. kind = "task"')
        self.sections = list(sections)
        self.names = self._names()
        self._tasks: list[Callable[[str, str | None], float]] = [
            self._task_scorer(s, f"{where}[{i}]") if s.kind == "task" else None for i, s in enumerate(self.sections)]

    @property
    def needs_reference(self) -> bool:
        """Exact matches and reference patterns compare against a reference column; callables get it when present."""
        return any(s.kind == "task" and (s.match == "exact" or (s.match == "regex" and (
            not s.pattern or "{reference}" in s.pattern))) for s in self.sections)

    def _names(self) -> list[str]:
        names, seen = [], {}
        for s in self.sections:
            seen[s.kind] = seen.get(s.kind, 0) + 1
            names.append(s.kind if seen[s.kind] == 1 else f"{s.kind}#{seen[s.kind]}")
        return names

    @staticmethod
    def _task_scorer(section: RewardSection, where: str) -> Callable[[str, str | None], float]:
        if section.match == "callable":
            return load_callable(section.function, f"{where}.function")
        if section.match == "exact":
            return lambda completion, reference: float(
                reference is not None and normalise(completion) == normalise(reference))
        if section.pattern and "{reference}" not in section.pattern:
            try:
                fixed = re.compile(section.pattern)
            except re.error as exc:
                raise UserError(f"{where}.pattern", f"is not a valid regular expression: {exc}", "fix the pattern") from exc
            return lambda completion, reference: float(fixed.search(completion) is not None)
        template = section.pattern or "{reference}"
        return lambda completion, reference: float(reference is not None and re.search(
            template.replace("{reference}", re.escape(reference)), completion) is not None)

    def score(self, completions: Sequence[str], lengths: Sequence[int],
              references: Sequence[str | None] | None = None) -> Scored:
        """Rewards for completions of `lengths` tokens against their references (None where there is none)."""
        references = list(references) if references is not None else [None] * len(completions)
        components: dict[str, list[float]] = {}
        for name, section, task in zip(self.names, self.sections, self._tasks):
            if section.kind == "task":
                values = [_as_float(task(c, r)) for c, r in zip(completions, references)]
            elif section.kind == "length":
                values = [math.exp(-section.scale * n) for n in lengths]
            else:
                values = [distinct_ngram_ratio(c, section.n) for c in completions]
            components[name] = values
        totals = [self._combine(i, components) for i in range(len(completions))]
        return Scored(totals, components)

    def _combine(self, i: int, components: dict[str, list[float]]) -> float:
        task, penalty, bonus, has_task = 0.0, 1.0, 0.0, False
        for name, section in zip(self.names, self.sections):
            value = components[name][i]
            if section.kind == "task":
                task += section.weight * value
                has_task = True
            elif section.kind == "length":
                penalty *= value ** section.weight
            else:
                bonus += section.weight * value
        return (task if has_task else 1.0) * penalty + bonus


def load_reward_tables(path: str | Path) -> tuple[CompositeReward, str]:
    """The `[[rewards]]` tables of any recipe (a ppo/grpo recipe, or a file with just those tables), and the
    reference column its [data] table names (default "reference"), so ranking uses the rewards RL trains on."""
    data = load_toml(path)
    tables = data.get("rewards")
    if not isinstance(tables, list) or not tables:
        raise UserError(path, "has no rewards tables (an array of tables named rewards)",
                        "copy the rewards tables of recipes/ppo-tiny.toml and adapt them")
    sections = [validate(RewardSection, table, f"{path}: rewards[{i}]") for i, table in enumerate(tables)]
    reference = data.get("data", {}).get("reference_column", "reference") if isinstance(data.get("data"), dict) else "reference"
    return CompositeReward(sections, f"{path}: rewards"), str(reference)


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
