"""Supervised fine-tuning and preference optimisation through TRL, driven by smolctl recipes.

  smolctl sft recipes/sft-tiny.toml demo-out/sft --from demo-out/pretrain/final
  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft      (the model: demo-out/dpo/final)

Data comes from dataset folders (parquet). TRL needs an indexable `datasets.Dataset`, so the columns a stage uses
are read into one Arrow table (in memory, memory-mapped by nothing): fine for post-training sets, which are
millions of rows at most, unlike pretraining corpora.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import Field

from smolctl.errors import UserError
from smolctl.recipe import Section, load_recipe
from smolctl.shards import DocumentSource, open_documents
from smolctl.train.config import LoggingSection
from smolctl.train.trackers import require_trackers
from smolctl.train.stage import (
    FINAL, CheckpointSection, ModelSection, StageResult, StepHook, TrainingSection, check_start, final_metrics,
    load_start, monitor_callback, prepare_run, quiet_offline, record_recipe, require_chat_template, train_quietly,
    trainer_arguments, use_bf16, with_schedule, write_model,
)

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")

# ---------------------------------------------------------------------------------------------------------------
# Recipes


class SftDataSection(Section):
    path: str
    """Dataset folder with a `messages` column (chat turns) or `prompt` and `completion` columns."""
    balance_by: str | None = None
    """Column naming each row's category (e.g. "task"): every category gets the same share of the rows."""
    balance: Literal["cap", "upsample"] = "cap"
    """cap: trim every category to the smallest one's size; upsample: repeat rows of the smaller ones up to the largest."""
    limit: int | None = Field(None, gt=0)
    """Use at most this many rows (after balancing)."""


class SftSection(Section):
    max_length: int = Field(1024, gt=0)
    """Tokens per packed row (bfd) or per example (none)."""
    packing: Literal["bfd", "padding_free", "none"] = "bfd"
    """bfd: best-fit-decreasing packing, attention kept inside each example through position ids (SmolLM3's
    choice); padding_free: examples concatenated per batch, no truncation; none: one padded example per row."""
    assistant_only_loss: bool = True
    """Train on the assistant turns only; needs {% generation %} markers in the chat template."""
    loss_type: Literal["nll", "dft"] = "nll"


class SftRecipe(Section):
    output: str | None = None
    """Run folder: checkpoints/, metrics.jsonl and the finished model in final/ (the RUN argument overrides)."""
    model: ModelSection = ModelSection()
    data: SftDataSection
    training: TrainingSection = TrainingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    sft: SftSection = SftSection()


class DpoDataSection(Section):
    path: str
    """Dataset folder with `prompt`, `chosen`, `rejected` columns (strings or chat turns)."""
    limit: int | None = Field(None, gt=0)


class DpoSection(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the pull towards the reference model (SmolLM3 used APO-zero with beta 0.05)."""
    loss_type: Literal[DPO_LOSSES] = "sigmoid"  # type: ignore[valid-type]
    max_length: int = Field(1024, gt=0)
    """Tokens of prompt + answer; longer pairs are truncated."""
    precompute_ref_log_probs: bool = False
    """Score the whole dataset with the reference model once up front, then free it (saves memory per step)."""


class DpoRecipe(Section):
    output: str | None = None
    model: ModelSection = ModelSection()
    data: DpoDataSection
    training: TrainingSection = TrainingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    dpo: DpoSection = DpoSection()


def load_sft_recipe(path: str | Path, overrides: list[str]) -> SftRecipe:
    return load_recipe(SftRecipe, path, overrides)


def load_dpo_recipe(path: str | Path, overrides: list[str]) -> DpoRecipe:
    return load_recipe(DpoRecipe, path, overrides)


def resolve_output(recipe_output: str | None, output: str | None) -> Path:
    chosen = output or recipe_output
    if not chosen:
        raise UserError("output", "no run folder to write",
                        "pass the run folder after the recipe (RECIPE RUN), or set output = \"RUN\" in the recipe")
    return Path(chosen)


# ---------------------------------------------------------------------------------------------------------------
# Data


def read_table(source: DocumentSource, columns: list[str]) -> pa.Table:
    return pa.Table.from_batches(list(source.iter_batches(columns=columns)), schema=pa.schema(
        [source.schema.field(c) for c in columns]))


def require_columns(source: DocumentSource, columns: list[str], fix: str) -> None:
    """Every named column must exist; the error names all that are missing and what the dataset has."""
    missing = [c for c in columns if c not in source.columns]
    if missing:
        raise UserError(source.spec, f"has no column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                        f"(columns: {', '.join(source.columns)})", fix)


def sft_columns(source: DocumentSource) -> list[str]:
    """The columns SFT trains on: `messages`, or `prompt` + `completion`; anything else names what exists."""
    if "messages" in source.columns:
        return ["messages"]
    if "prompt" in source.columns and "completion" in source.columns:
        return ["prompt", "completion"]
    raise UserError(source.spec, f"has no 'messages' column nor 'prompt'/'completion' columns (columns: "
                    f"{', '.join(source.columns)})", "pass a chat dataset (e.g. data/sample/chat)")


def balanced_indices(groups: list, mode: str, seed: int) -> list[int]:
    """Row indices giving every group the same count: `cap` trims to the smallest group, `upsample` repeats
    rows (a full pass first, then a seeded sample) up to the largest. The result is shuffled."""
    by_group: dict = {}
    for index, group in enumerate(groups):
        by_group.setdefault(group, []).append(index)
    rng = random.Random(seed)
    sizes = [len(rows) for rows in by_group.values()]
    target = min(sizes) if mode == "cap" else max(sizes)
    chosen: list[int] = []
    for rows in by_group.values():
        rows = rows[:]
        rng.shuffle(rows)
        repeats, rest = divmod(target, len(rows))
        chosen += rows * repeats + rows[:rest]
    rng.shuffle(chosen)
    return chosen


def load_sft_dataset(source: DocumentSource, data: SftDataSection, seed: int, as_chat: bool):
    """The SFT rows, balanced and limited; plain-string prompt/completion pairs become a user and an assistant
    turn when the tokenizer has a chat template, so the model learns the format it will chat in."""
    import datasets

    columns = sft_columns(source)
    table = read_table(source, columns + ([data.balance_by] if data.balance_by else []))
    stats: dict = {"rows": table.num_rows, "format": "+".join(columns)}
    if data.balance_by:
        groups = table.column(data.balance_by).to_pylist()
        indices = balanced_indices(groups, data.balance, seed)
        stats["groups_before"] = dict(Counter(groups))
        stats["groups_after"] = dict(Counter(groups[i] for i in indices))
        table = table.take(pa.array(indices, pa.int64())).drop_columns([data.balance_by])
    if data.limit is not None:
        table = table.slice(0, data.limit)
    stats["rows_used"] = table.num_rows
    if table.num_rows == 0:
        raise UserError(source.spec, "holds no rows to train on", "pass a non-empty dataset")
    dataset = datasets.Dataset(datasets.table.InMemoryTable(table))
    if as_chat and columns == ["prompt", "completion"] and not is_chat_column(table.schema.field("prompt")):
        dataset = dataset.map(_as_turns)
        stats["format"] = "prompt+completion as chat turns"
    return dataset, stats


def is_chat_column(field: pa.Field) -> bool:
    return pa.types.is_list(field.type) or pa.types.is_large_list(field.type)


def load_preference_dataset(source: DocumentSource, data: DpoDataSection, as_chat: bool):
    """prompt/chosen/rejected rows; plain strings become one user turn and one assistant turn when the tokenizer
    has a chat template, so DPO trains the same format that SFT taught and chat uses."""
    import datasets

    table = read_table(source, ["prompt", "chosen", "rejected"])
    if data.limit is not None:
        table = table.slice(0, data.limit)
    if table.num_rows == 0:
        raise UserError(source.spec, "holds no rows to train on", "pass a non-empty dataset")
    dataset = datasets.Dataset(datasets.table.InMemoryTable(table))
    if as_chat and not is_chat_column(table.schema.field("prompt")):
        dataset = dataset.map(_as_turns)
    return dataset, {"rows": source.num_rows, "rows_used": table.num_rows}


def _as_turns(row: dict) -> dict:
    def turn(role: str, value):
        return value if isinstance(value, list) else [{"role": role, "content": value}]

    answers = {key: turn("assistant", row[key]) for key in ("completion", "chosen", "rejected") if key in row}
    return {"prompt": turn("user", row["prompt"]), **answers}


# ---------------------------------------------------------------------------------------------------------------
# Runs


def run_sft(recipe: SftRecipe, *, output: str | None = None, start: str | None = None, resume: str | None = None,
            overwrite: bool = False, on_step: StepHook | None = None) -> StageResult:
    """Fine-tune the starting checkpoint on chat data with TRL's SFTTrainer and write the output model folder."""
    out = resolve_output(recipe.output, output)
    parent = check_start(start or recipe.model.from_)
    source = open_documents(recipe.data.path)
    columns = sft_columns(source)
    if recipe.data.balance_by:
        require_columns(source, [recipe.data.balance_by], "set data.balance_by to a column of categories, or remove it")
    require_trackers(recipe.logging.report_to)
    resume_from = prepare_run(out, resume, overwrite)
    # Heavy imports only once the cheap checks have passed, so a mistake is reported in a second, not ten.
    quiet_offline()
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import has_generation_markers

    model, tokenizer = load_start(parent)
    conversational = columns == ["messages"] or is_chat_column(source.schema.field("prompt"))
    if conversational:
        require_chat_template(tokenizer, parent, "chat data needs")
    assistant_only = recipe.sft.assistant_only_loss and columns == ["messages"]
    if assistant_only and not has_generation_markers(tokenizer.chat_template):
        raise UserError(parent, "the chat template has no {% generation %} markers, so the assistant turns cannot "
                        "be found for assistant-only loss",
                        "add the markers around the assistant content, or set sft.assistant_only_loss = false")
    dataset, data_stats = load_sft_dataset(source, recipe.data, recipe.training.seed,
                                           as_chat=bool(getattr(tokenizer, "chat_template", None)))
    record_recipe(out, recipe.model_dump(by_alias=True), parent, resume_from)

    packing = recipe.sft.packing
    config = SFTConfig(
        **trainer_arguments(out, recipe.training, recipe.checkpoint, recipe.logging.report_to),
        # TRL does not truncate padding-free batches; SFTTrainer refuses a max_length there.
        max_length=None if packing == "padding_free" else recipe.sft.max_length,
        packing=packing == "bfd", packing_strategy="bfd", padding_free=packing == "padding_free",
        assistant_only_loss=assistant_only, loss_type=recipe.sft.loss_type, shuffle_dataset=True,
    )
    monitor = monitor_callback(out, on_step)
    trainer = with_schedule(SFTTrainer, recipe.training)(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[monitor])
    data_stats["train_rows"] = len(trainer.train_dataset)
    return _train_and_save("sft", trainer, monitor, out, parent, source, data_stats, resume_from,
                           keys=("loss", "mean_token_accuracy", "entropy", "grad_norm", "learning_rate"))


def run_dpo(recipe: DpoRecipe, *, output: str | None = None, start: str | None = None, resume: str | None = None,
            overwrite: bool = False, on_step: StepHook | None = None) -> StageResult:
    """Preference-optimise the starting checkpoint with TRL's DPOTrainer; the reference is the same checkpoint,
    loaded a second time and passed explicitly (TRL would otherwise re-load it by hub id, which fails offline)."""
    out = resolve_output(recipe.output, output)
    parent = check_start(start or recipe.model.from_)
    source = open_documents(recipe.data.path)
    require_columns(source, ["prompt", "chosen", "rejected"],
                    "pass a preference dataset (e.g. data/sample/preference)")
    require_trackers(recipe.logging.report_to)
    resume_from = prepare_run(out, resume, overwrite)
    quiet_offline()
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = load_start(parent)
    reference, _ = load_start(parent, use_bf16(recipe.training.precision))
    reference.eval().requires_grad_(False)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if any(is_chat_column(source.schema.field(c)) for c in ("prompt", "chosen", "rejected")):
        require_chat_template(tokenizer, parent, "preference pairs given as chat turns need")
    dataset, data_stats = load_preference_dataset(source, recipe.data, as_chat=has_template)
    data_stats["format"] = "chat" if has_template else "text"
    record_recipe(out, recipe.model_dump(by_alias=True), parent, resume_from)

    config = DPOConfig(
        **trainer_arguments(out, recipe.training, recipe.checkpoint, recipe.logging.report_to),
        beta=recipe.dpo.beta, loss_type=[recipe.dpo.loss_type], max_length=recipe.dpo.max_length,
        precompute_ref_log_probs=recipe.dpo.precompute_ref_log_probs,
    )
    monitor = monitor_callback(out, on_step)
    trainer = with_schedule(DPOTrainer, recipe.training)(
        model=model, ref_model=reference, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[monitor])
    return _train_and_save("dpo", trainer, monitor, out, parent, source, data_stats, resume_from,
                           keys=("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
                                 "grad_norm", "learning_rate"))


def _train_and_save(stage: str, trainer, monitor, run: Path, parent: Path, source: DocumentSource, data_stats: dict,
                    resume_from: str | None, keys: tuple[str, ...]) -> StageResult:
    started = time.perf_counter()
    train_quietly(trainer, resume_from)
    seconds = time.perf_counter() - started
    metrics = final_metrics(monitor.history, keys)
    if trainer.is_world_process_zero():
        write_model(run, trainer.model, trainer.processing_class, parent=parent, data_inputs=source.lineage(),
                    stage=stage, stats={**{k.replace("/", "_"): v for k, v in metrics.items()}, **data_stats,
                                        "steps": trainer.state.global_step, "seconds": round(seconds, 2)})
    return StageResult(stage, str(run), str(run / FINAL), str(parent), trainer.state.global_step, seconds, resume_from,
                       metrics, data_stats)
