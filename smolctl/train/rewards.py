"""Composable rewards for ppo and grpo, declared in the recipe as `[[rewards]]` tables.

The total follows the smol training playbook's shaped reward (task completion in [0, 1], times a length penalty,
plus an n-gram diversity bonus):

    total = (Σ task_weight · task) · Π length_penalty^weight + Σ diversity_weight · diversity

with length_penalty = exp(-scale · completion_tokens) (scale 0.01 in the playbook). Without task rewards the
first term is the length penalty alone. A completion cut off at the token limit (no stop token) scores the
length table's `truncated_penalty` instead, when one is set. A reward that is NaN (a callable may return one, or
raise with on_error = "skip") makes the total NaN; the trainers count such completions and leave them out of the
update.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from smolctl.errors import UserError
from smolctl.recipe import RecipePath, Section, load_toml, validate
from smolctl.train.run import append_jsonl

COMPLETIONS = "completions.jsonl"


class RewardSection(Section):
    kind: Literal["task", "length", "diversity", "model"]
    weight: float = 1.0
    match: Literal["exact", "regex", "callable"] = "exact"
    """task: exact (normalised text equality), regex (search), or callable (`function`)."""
    pattern: str | None = None
    """task/regex: the pattern; `{reference}` inside it is replaced by the escaped reference. Default: the reference
    as the final answer, on word boundaries: "... is 4." matches 4, "14" and "4, no: 5" do not."""
    function: str | None = None
    """task/callable: "module:function", called as function(row) -> float with the row's columns (prompt,
    reference, ...) and its `completion`, or with batched = true as function(rows) -> list of floats."""
    batched: bool = False
    on_error: Literal["raise", "skip"] = "raise"
    """task/callable: an exception stops the run naming the reward and the row, or ("skip") scores that completion
    NaN, counted and left out of the update."""
    scale: float = Field(0.01, gt=0)
    """length: the penalty is exp(-scale * completion tokens)."""
    truncated_penalty: float | None = None
    """length: the total of a completion cut off at the token limit (default: scored like a finished one)."""
    path: RecipePath | None = None
    """model: a sequence-classification reward model folder; it scores (prompt, completion) as a chat when its
    tokenizer has a template, else as a text pair; one label: its logit, several: the last label's probability.
    Its score adds to the task term, weighted."""
    n: int = Field(2, gt=0)
    """diversity: n-gram size (words). Each completion scores the share of its n-grams that are distinct and not in
    the other completions of the same prompt; text shorter than n words scores 0."""

    @model_validator(mode="after")
    def _complete(self) -> RewardSection:
        if self.kind == "task" and self.match == "callable" and not self.function:
            raise ValueError('match = "callable" needs function = "module:function"')
        # A key that the chosen kind/match ignores is a typo waiting to cost a run: say so instead.
        if self.function and (self.kind, self.match) != ("task", "callable"):
            raise ValueError('function is only used with kind = "task" and match = "callable"')
        if self.pattern and (self.kind, self.match) != ("task", "regex"):
            raise ValueError('pattern is only used with kind = "task" and match = "regex"')
        if (self.batched or self.on_error != "raise") and (self.kind, self.match) != ("task", "callable"):
            raise ValueError('batched and on_error are only used with kind = "task" and match = "callable"')
        if (self.kind == "model") != (self.path is not None):
            raise ValueError('kind = "model" needs path = "reward-model-folder", and only it takes a path')
        if self.truncated_penalty is not None and self.kind != "length":
            raise ValueError('truncated_penalty is only used with kind = "length"')
        return self


def normalise(text: str) -> str:
    """Text compared by `exact`: trimmed, case-folded, without surrounding quotes, backticks or a final period."""
    return text.strip().strip("`'\".").strip().casefold()


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = text.split()
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def group_diversity(texts: Sequence[str], n: int) -> list[float]:
    """Per text: its distinct n-grams that no other text of the group holds, over all its n-grams; 0.0 for text
    shorter than n words (one word is not diverse), and for a text that repeats its siblings."""
    grams = [ngrams(t, n) for t in texts]
    scores = []
    for i, own in enumerate(grams):
        others = set().union(*(set(g) for j, g in enumerate(grams) if j != i))
        scores.append(len(set(own) - others) / len(own) if own else 0.0)
    return scores


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
        raise UserError(
            where,
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}",
            "check the module name, and run from its folder or add that to PYTHONPATH",
        ) from exc
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
        self.wheres = [f"{where}[{i}]" for i in range(len(self.sections))]
        self._tasks: list[Callable | None] = [
            self._task_scorer(s, w)
            if s.kind == "task"
            else RewardModel(s.path, f"{w}.path")
            if s.kind == "model"
            else None
            for s, w in zip(self.sections, self.wheres)
        ]
        self.errors: dict[str, int] = {}
        """Exceptions of on_error = "skip" callables, per reward name."""

    @property
    def needs_reference(self) -> bool:
        """Exact matches and reference patterns compare against a reference column; callables get it when present."""
        return any(
            s.kind == "task"
            and (s.match == "exact" or (s.match == "regex" and (not s.pattern or "{reference}" in s.pattern)))
            for s in self.sections
        )

    def _names(self) -> list[str]:
        names, seen = [], {}
        for s in self.sections:
            seen[s.kind] = seen.get(s.kind, 0) + 1
            names.append(s.kind if seen[s.kind] == 1 else f"{s.kind}#{seen[s.kind]}")
        return names

    @staticmethod
    def _task_scorer(section: RewardSection, where: str) -> Callable:
        """A callable scores rows; the built-in matches score (completion, reference), where a reference that is a
        list (a question's accepted answers) matches when any of its texts does."""
        if section.match == "callable":
            return load_callable(section.function, f"{where}.function")
        if section.match == "exact":
            return lambda completion, reference: float(
                any(normalise(completion) == normalise(text) for text in _texts(reference))
            )
        if section.pattern and "{reference}" not in section.pattern:
            try:
                fixed = re.compile(section.pattern)
            except re.error as exc:
                raise UserError(
                    f"{where}.pattern", f"is not a valid regular expression: {exc}", "fix the pattern"
                ) from exc
            return lambda completion, reference: float(fixed.search(completion) is not None)
        template = section.pattern or r"(?<![\w.]){reference}(?!\w)\W*$"
        return lambda completion, reference: float(
            any(
                re.search(template.replace("{reference}", re.escape(text)), completion) is not None
                for text in _texts(reference)
            )
        )

    def score(
        self,
        completions: Sequence[str],
        lengths: Sequence[int],
        references: Sequence[str | None] | None = None,
        *,
        rows: Sequence[dict] | None = None,
        truncated: Sequence[bool] | None = None,
        groups: Sequence[Any] | None = None,
    ) -> Scored:
        """Rewards for completions of `lengths` tokens. rows: each completion's dataset row, its reference under
        "reference" (default: rows holding only `references`); truncated: cut off at the token limit;
        groups: a key per completion, equal for completions of the same prompt (default: each its own group)."""
        count = len(completions)
        if rows is None:
            rows = [{"reference": r} for r in (references if references is not None else [None] * count)]
        references = [row.get("reference") for row in rows]
        full_rows = [{**row, "completion": c} for row, c in zip(rows, completions)]
        groups = list(groups) if groups is not None else list(range(count))
        components: dict[str, list[float]] = {}
        for name, section, task, where in zip(self.names, self.sections, self._tasks, self.wheres):
            if section.kind == "task" and section.match == "callable":
                values = self._call(name, section, task, where, full_rows)
            elif section.kind == "task":
                values = [_as_float(task(c, r)) for c, r in zip(completions, references)]
            elif section.kind == "model":
                values = task([row.get("prompt") for row in rows], list(completions))
            elif section.kind == "length":
                values = [math.exp(-section.scale * n) for n in lengths]
            else:
                values = [0.0] * count
                for key in dict.fromkeys(groups):
                    members = [i for i in range(count) if groups[i] == key]
                    for i, value in zip(members, group_diversity([completions[i] for i in members], section.n)):
                        values[i] = value
            components[name] = values
        cut = list(truncated) if truncated is not None else [False] * count
        penalties = [
            s.truncated_penalty for s in self.sections if s.kind == "length" and s.truncated_penalty is not None
        ]
        totals = [penalties[0] if cut[i] and penalties else self._combine(i, components) for i in range(count)]
        return Scored(totals, components)

    def _call(self, name: str, section: RewardSection, function: Callable, where: str, rows: list[dict]) -> list[float]:
        """The user's function on every row (or on all rows at once); its exceptions name the reward and the row."""

        def failed(exc: Exception, row: dict | None, index: int | None) -> float:
            if section.on_error == "skip":
                self.errors[name] = self.errors.get(name, 0) + 1
                return math.nan
            shown = "the batch" if row is None else f"row {index} ({_preview(row)})"
            raise UserError(
                f"{where}.function",
                f"{section.function} raised {type(exc).__name__}: {exc} on {shown}",
                'fix the function, or set on_error = "skip" to leave such completions out',
            ) from exc

        if section.batched:
            try:
                values = [_as_float(v) for v in function(rows)]
            except Exception as exc:  # user code
                return [failed(exc, None, None)] * len(rows) if section.on_error == "skip" else failed(exc, None, None)
            if len(values) != len(rows):
                raise UserError(
                    f"{where}.function",
                    f"{section.function} returned {len(values)} rewards for {len(rows)} rows",
                    "return one float per row",
                )
            return values
        values = []
        for index, row in enumerate(rows):
            try:
                values.append(_as_float(function(row)))
            except Exception as exc:  # user code
                values.append(failed(exc, row, index))
        return values

    def _combine(self, i: int, components: dict[str, list[float]]) -> float:
        task, penalty, bonus, has_task = 0.0, 1.0, 0.0, False
        for name, section in zip(self.names, self.sections):
            value = components[name][i]
            if section.kind in ("task", "model"):
                task += section.weight * value
                has_task = True
            elif section.kind == "length":
                penalty *= value**section.weight
            else:
                bonus += section.weight * value
        return (task if has_task else 1.0) * penalty + bonus


def load_reward_tables(path: str | Path) -> tuple[CompositeReward, str]:
    """The `[[rewards]]` tables of any recipe (a ppo/grpo recipe, or a file with just those tables), and the
    reference column its [data] table names (default "reference"), so ranking uses the rewards RL trains on."""
    data = load_toml(path)
    tables = data.get("rewards")
    if not isinstance(tables, list) or not tables:
        raise UserError(
            path,
            "has no rewards tables (an array of tables named rewards)",
            "copy the rewards tables of recipes/ppo-tiny.toml and adapt them",
        )
    sections = [validate(RewardSection, table, f"{path}: rewards[{i}]") for i, table in enumerate(tables)]
    reference = (
        data.get("data", {}).get("reference_column", "reference") if isinstance(data.get("data"), dict) else "reference"
    )
    return CompositeReward(sections, f"{path}: rewards"), str(reference)


def log_completions(
    run: Path,
    step: int,
    prompts: list,
    completions: list[str],
    components: dict[str, list[float]],
    totals: list[float],
    advantages: list[float] | None,
) -> None:
    """RUN/completions.jsonl: one line per completion, to read what the policy writes and what each reward made
    of it. advantage: of the completion's first token (PPO), or of the completion (GRPO)."""
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        append_jsonl(
            run / COMPLETIONS,
            {
                "step": step,
                "prompt": prompt,
                "completion": completion,
                "rewards": {name: values[i] for name, values in components.items()},
                "total": totals[i],
                "advantage": advantages[i] if advantages is not None else None,
            },
        )


class RewardModel:
    """A sequence-classification model folder that scores (prompt, completion) pairs, loaded once, frozen."""

    def __init__(self, path: str, where: str, batch_size: int = 8):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not Path(path).is_dir():
            raise UserError(
                where, f"{path} is not a folder", "pass a Hugging Face sequence-classification model folder"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(
                where,
                f"cannot load a reward model from {path}: {str(exc).splitlines()[0][:200]}",
                "pass a folder with a sequence-classification model and its tokenizer",
            ) from exc
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval().requires_grad_(False)
        self.batch_size = batch_size

    def __call__(self, prompts: list, completions: list[str]) -> list[float]:
        import torch

        scores: list[float] = []
        for start in range(0, len(completions), self.batch_size):
            pairs = list(zip(prompts[start : start + self.batch_size], completions[start : start + self.batch_size]))
            if getattr(self.tokenizer, "chat_template", None):
                texts = [
                    self.tokenizer.apply_chat_template(
                        [
                            *(p if isinstance(p, list) else [{"role": "user", "content": p or ""}]),
                            {"role": "assistant", "content": c},
                        ],
                        tokenize=False,
                    )
                    for p, c in pairs
                ]
                enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            else:
                enc = self.tokenizer(
                    [p or "" for p, _ in pairs], [c for _, c in pairs], return_tensors="pt", padding=True
                )
            with torch.no_grad():
                logits = self.model(**enc.to(self.device)).logits.float()
            scores += (logits[:, 0] if logits.shape[1] == 1 else logits.softmax(-1)[:, -1]).tolist()
        return scores


def _texts(reference) -> list[str]:
    """A reference's texts: none for a missing one, its items for a list of accepted answers."""
    if reference is None:
        return []
    return [str(text) for text in reference] if isinstance(reference, list) else [str(reference)]


def _preview(row: dict) -> str:
    return ", ".join(f"{key}={str(value)[:60]!r}" for key, value in row.items())


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
