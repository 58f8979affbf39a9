"""Supervised fine-tuning and preference optimisation through TRL, under the one recipe schema and run layout.

  smolctl sft recipes/sft-tiny.toml demo-out/sft --from demo-out/pretrain/final
  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft      (the model: demo-out/dpo/final)

Data comes from dataset folders (parquet). TRL needs an indexable `datasets.Dataset`, so the columns a stage uses
are read into one Arrow table (in memory, memory-mapped by nothing), batch by batch as each row is checked, so
no Python copy of the whole set is ever held: fine for post-training sets, which are millions of rows at most,
unlike pretraining corpora.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa

from smolctl.data.tokenizer import load_tokenizer
from smolctl.errors import UserError
from smolctl.shards import DocumentSource, open_documents
from smolctl.train.chat_data import (
    as_dataset,
    checked_table,
    is_list,
    plain_conversations,
    preference_row,
    renders_tool_calls,
    sft_row,
)
from smolctl.train.config import ChatDataSection, DpoRecipe, PreferenceDataSection, SftRecipe
from smolctl.train.posttrain_run import (
    PostTrainResult,
    StepHook,
    apply_peft,
    check_start,
    final_metrics,
    finish_trl,
    finished_result,
    load_start,
    open_run,
    parameter_counts,
    quiet_offline,
    removed_if_never_trained,
    require_chat_template,
    run_callback,
    scheduled,
    trainer_arguments,
    use_bf16,
)
from smolctl.train.run import holds_run_folder

# ---------------------------------------------------------------------------------------------------------------
# Data


def read_table(source: DocumentSource, columns: list[str]) -> pa.Table:
    return pa.Table.from_batches(
        list(source.iter_batches(columns=columns)), schema=pa.schema([source.schema.field(c) for c in columns])
    )


def require_columns(source: DocumentSource, columns: list[str], fix: str) -> None:
    """Every named column must exist; the error names all that are missing and what the dataset has."""
    missing = [c for c in columns if c not in source.columns]
    if missing:
        raise UserError(
            source.spec,
            f"has no column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            f"(columns: {', '.join(source.columns)})",
            fix,
        )


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_rows(source: DocumentSource, columns: list[str], non_empty: tuple[str, ...] = ()) -> None:
    """Every row of these columns usable, checked before the run folder is made: none null, the `non_empty` ones
    (what the model learns to write, or the prompts it answers) not empty, chat turns a non-empty list with known
    roles and, for `messages`, an assistant turn to learn from. TRL failed on such a row deep inside its data
    preparation, as an internal error, after the run had begun; the first is named here by file and row."""
    for index, path in enumerate(source.files):
        row = 0
        for batch in source.iter_file_batches(index, columns):
            for name in columns:
                bad = _first_bad_row(batch.column(name), name, name in non_empty)
                if bad is not None:
                    raise UserError(
                        path, f"row {row + bad[0]} (from 0): column '{name}' {bad[1]}", "fix or drop that row"
                    )
            row += batch.num_rows


def _first_bad_row(values: pa.Array, name: str, must_hold_text: bool) -> tuple[int, str] | None:
    import numpy as np
    import pyarrow.compute as pc

    def first(mask) -> int | None:
        rows = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        return int(rows[0]) if len(rows) else None

    if pa.types.is_dictionary(values.type):  # a pandas categorical: the strings it holds
        values = values.dictionary_decode()
    if (row := first(pc.is_null(values))) is not None:
        return row, "is null"
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        if must_hold_text and (row := first(pc.equal(pc.utf8_length(values), 0))) is not None:
            return row, "is empty"
        return None
    if not is_list(values.type):
        return None
    if (row := first(pc.equal(pc.list_value_length(values), 0))) is not None:
        return row, "holds no turns"
    turns, owner = pc.list_flatten(values), pc.list_parent_indices(values).to_numpy()
    if not pa.types.is_struct(turns.type) or turns.type.get_field_index("role") < 0:
        return None
    roles = pc.struct_field(turns, "role")
    if (turn := first(pc.invert(pc.fill_null(pc.is_in(roles, pa.array(CHAT_ROLES)), False)))) is not None:
        return int(owner[turn]), f"has a turn whose role is {roles[turn].as_py()!r} (use {', '.join(CHAT_ROLES)})"
    if name == "messages":
        answered = np.zeros(len(values), bool)
        answered[owner[roles.to_numpy(zero_copy_only=False) == "assistant"]] = True
        if not answered.all():
            return int(np.flatnonzero(~answered)[0]), "has no assistant turn to learn from"
    return None


def sft_columns(source: DocumentSource) -> list[str]:
    """The columns SFT trains on: `messages`, or `prompt` + `completion`; anything else names what exists."""
    if "messages" in source.columns:
        return ["messages"]
    if "prompt" in source.columns and "completion" in source.columns:
        return ["prompt", "completion"]
    raise UserError(
        source.spec,
        f"has no 'messages' column nor 'prompt'/'completion' columns (columns: {', '.join(source.columns)})",
        "pass a chat dataset (e.g. data/sample/chat)",
    )


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


def load_sft_dataset(source: DocumentSource, data: ChatDataSection, seed: int, tokenizer):
    """The SFT rows as chat_data.sft_row prepares them (plain prompt/completion text becomes a user and an
    assistant turn when the tokenizer has a chat template, so the model learns the format it will chat in),
    balanced and limited."""
    columns = sft_columns(source)
    as_chat = bool(getattr(tokenizer, "chat_template", None))
    tools = renders_tool_calls(tokenizer)
    group = data.balance_by

    # `generate` output: a completion cut off at max_new_tokens would teach the model to stop mid-answer.
    cut_off = "finish_reason" if columns == ["prompt", "completion"] and "finish_reason" in source.columns else None

    def prepare(row: dict) -> dict | None:
        if cut_off and row[cut_off] == "length":
            return None
        return sft_row(row, columns, as_chat, tools) | ({group: row[group]} if group else {})

    read_columns = columns + [c for c in (group, cut_off) if c and c not in columns]
    accept = (lambda batch: plain_conversations(batch, "messages")) if columns == ["messages"] else None
    table, read = checked_table(source, read_columns, prepare, accept)
    kept = table.num_rows if table is not None else 0
    stats: dict = {"rows": read, "format": "+".join(columns)}
    if cut_off:
        stats["cut_off_completions_dropped"] = read - kept
        if read and not kept:
            raise UserError(
                source.spec,
                "every completion was cut off at its max_new_tokens (finish_reason 'length')",
                "generate again with a larger --max-new-tokens",
            )
    if group and table is not None:
        groups = table.column(group).to_pylist()
        indices = balanced_indices(groups, data.balance, seed)
        stats["groups_before"] = dict(Counter(groups))
        stats["groups_after"] = dict(Counter(groups[i] for i in indices))
        table = table.drop_columns([group]).take(indices)
    if table is not None and data.limit is not None:
        table = table.slice(0, data.limit)
    stats["rows_used"] = table.num_rows if table is not None else 0
    if not stats["rows_used"]:
        raise UserError(source.spec, "holds no rows to train on", "pass a non-empty dataset")
    if columns == ["prompt", "completion"] and is_list(table.schema.field("prompt").type):
        stats["format"] = "prompt+completion as chat turns"
    return as_dataset(table), stats


def preference_columns(source: DocumentSource) -> list[str]:
    """chosen/rejected, with the prompt column where there is one (without, the prompt is what they share)."""
    require_columns(
        source,
        ["chosen", "rejected"],
        "pass a preference dataset: prompt/chosen/rejected, or chosen/rejected conversations sharing their prompt",
    )
    return (["prompt"] if "prompt" in source.columns else []) + ["chosen", "rejected"]


def load_preference_dataset(source: DocumentSource, data: PreferenceDataSection, tokenizer):
    """prompt/chosen/rejected rows as chat_data.preference_row prepares them (plain strings become one user
    turn and one assistant turn when the tokenizer has a chat template, so DPO trains the format SFT taught)."""
    as_chat = bool(getattr(tokenizer, "chat_template", None))
    tools = renders_tool_calls(tokenizer)
    identical: list[int] = []  # rows whose chosen equals rejected
    positions = itertools.count()

    def prepare(row: dict) -> dict:
        prepared, position = preference_row(row, as_chat, tools), next(positions)
        if prepared["chosen"] == prepared["rejected"]:
            identical.append(position)
        return prepared

    table, read = checked_table(source, preference_columns(source), prepare)
    stats = {"rows": read}
    if table is not None and data.limit is not None:
        table = table.slice(0, data.limit)
    if table is None or not table.num_rows:
        raise UserError(source.spec, "holds no rows to train on", "pass a non-empty dataset")
    stats["rows_used"] = table.num_rows
    if "prompt" not in source.columns:
        stats["prompt"] = "shared by chosen and rejected"
    # Such a pair has no preference to learn: its loss is constant and its gradient zero.
    stats["identical_pairs"] = sum(row < table.num_rows for row in identical)
    if stats["identical_pairs"] == table.num_rows:
        raise UserError(
            source.spec, "chosen equals rejected in every pair: there is no preference to learn", "check the columns"
        )
    stats["format"] = "chat" if is_list(table.schema.field("prompt").type) else "text"
    return as_dataset(table), stats


def untrained_examples(dataset) -> tuple[int, int]:
    """(examples, examples with no token left to learn from) in TRL's prepared SFT dataset: a conversation whose
    assistant turns fell past sft.max_length trains on nothing, yet would count as used. An example is a row, or
    each `seq_lengths` span of a packed row."""
    import numpy as np
    import pyarrow.compute as pc

    # through the dataset's indices: after a filter or select, dataset.data still holds the rows left out
    table = dataset.with_format("arrow")[:]
    names = table.column_names
    mask = next((name for name in ("labels", "assistant_masks", "completion_mask") if name in names), None)
    if mask is None:
        return len(table), 0  # every token is learned from
    values = pc.list_flatten(table.column(mask)).to_numpy(zero_copy_only=False)
    learned = (values != -100) if mask == "labels" else (values != 0)
    if "seq_lengths" in names:
        spans = pc.list_flatten(table.column("seq_lengths")).to_numpy(zero_copy_only=False)
    else:
        spans = pc.list_value_length(table.column(mask)).to_numpy(zero_copy_only=False)
    spans = np.asarray(spans, np.int64)
    ends = np.cumsum(spans)
    learned_before = np.concatenate([[0], np.cumsum(learned, dtype=np.int64)])
    per_example = learned_before[ends] - learned_before[ends - spans]
    return len(spans), int((per_example == 0).sum())


# ---------------------------------------------------------------------------------------------------------------
# Runs


@holds_run_folder
def run_sft(
    recipe: SftRecipe,
    run: str | Path,
    *,
    start: str | None = None,
    resume: str = "none",
    overwrite: bool = False,
    on_step: StepHook | None = None,
) -> PostTrainResult:
    """Fine-tune the starting checkpoint on chat data with TRL's SFTTrainer and write RUN/final."""
    run = Path(run)
    parent = check_start(start or recipe.model.from_, "--from" if start else "model.from")
    source = open_documents(recipe.data.path)
    columns = sft_columns(source)
    if recipe.data.balance_by:
        check_balance_column(source, recipe.data.balance_by)
    check_rows(source, columns, non_empty=("completion",))
    # Heavy imports only once the cheap checks have passed, so a mistake is reported in a second, not ten.
    quiet_offline()
    tokenizer = load_tokenizer(parent)
    check_sft_template(recipe, parent, tokenizer, source, columns)
    prepared = load_sft_dataset(source, recipe.data, recipe.training.seed, tokenizer)  # every row checked
    begun = open_run("sft", recipe, run, parent, resume, overwrite)
    if begun.finished:
        return finished_result("sft", run, begun)
    with removed_if_never_trained(run, begun):
        trainer, callback, data_stats, parameters = sft_trainer(recipe, run, parent, prepared, columns, on_step)
    return finish_trl(
        "sft",
        trainer,
        callback,
        run,
        parent,
        source.lineage(),
        data_stats,
        begun,
        parameters,
        lambda history: final_metrics(history, ("loss", "mean_token_accuracy", "entropy", "grad_norm", "lr")),
    )


def sft_trainer(
    recipe: SftRecipe,
    run: Path,
    parent: Path,
    prepared: tuple,
    columns: list[str],
    on_step: StepHook | None = None,
):
    """The SFTTrainer of a recipe over `prepared` (load_sft_dataset's dataset and data facts), its RunCallback, the
    data facts and the parameter counts (nothing trained yet)."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = load_start(parent, attention=recipe.training.attention)
    assistant_only = recipe.sft.assistant_only_loss and columns == ["messages"]
    dataset, data_stats = prepared
    model = apply_peft(model, recipe.peft)
    packing = recipe.sft.packing
    config = SFTConfig(
        **trainer_arguments(run, recipe),
        # TRL does not truncate padding-free batches; SFTTrainer refuses a max_length there.
        max_length=None if packing == "padding_free" else recipe.sft.max_length,
        packing=packing == "bfd",
        packing_strategy="bfd",
        padding_free=packing == "padding_free",
        assistant_only_loss=assistant_only,
        loss_type=recipe.sft.loss_type,
        shuffle_dataset=True,
    )
    callback = run_callback(run, on_step, recipe.checkpoint.keep)
    trainer = scheduled(SFTTrainer, recipe)(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback]
    )
    data_stats["train_rows"] = len(trainer.train_dataset)
    examples, untrained = untrained_examples(trainer.train_dataset)
    data_stats["rows_with_nothing_to_learn"] = untrained
    if untrained == examples:
        raise UserError(
            recipe.data.path,
            f"no row keeps a token to learn from within sft.max_length {recipe.sft.max_length} (the assistant "
            "turns, or completions, all start past it)",
            "raise sft.max_length, or shorten the prompts",
        )
    return trainer, callback, data_stats, parameter_counts(model)


def check_balance_column(source: DocumentSource, column: str) -> None:
    require_columns(source, [column], "set data.balance_by to a column of categories, or remove it")
    kind = source.schema.field(column).type
    if pa.types.is_nested(kind) or pa.types.is_floating(kind):
        raise UserError(
            "data.balance_by",
            f"column '{column}' holds {kind}, not categories to balance",
            "balance by a column of strings or integers",
        )


def check_sft_template(recipe: SftRecipe, parent: Path, tokenizer, source: DocumentSource, columns: list[str]) -> None:
    """Chat data needs a chat template; assistant-only loss needs {% generation %} markers in it, which TRL patches
    into the templates it knows (ChatML, Llama 3, Qwen, Gemma, ...): refuse only the ones it cannot."""
    from trl.chat_template_utils import get_training_chat_template

    if any(is_list(source.schema.field(c).type) for c in columns):  # a completion given as turns too
        require_chat_template(tokenizer, parent, "chat data needs")
    if not (recipe.sft.assistant_only_loss and columns == ["messages"]):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError as exc:
        raise UserError(
            parent,
            f"the chat template of tokenizer {tokenizer.name_or_path} has no {{% generation %}} markers "
            "and TRL cannot patch it, so the assistant turns cannot be found for assistant-only loss",
            "add the markers around the assistant content, or set sft.assistant_only_loss = false",
        ) from exc


@holds_run_folder
def run_dpo(
    recipe: DpoRecipe,
    run: str | Path,
    *,
    start: str | None = None,
    resume: str = "none",
    overwrite: bool = False,
    on_step: StepHook | None = None,
) -> PostTrainResult:
    """Preference-optimise the starting checkpoint with TRL's DPOTrainer. The reference is the starting checkpoint:
    loaded a second time and passed explicitly (TRL would otherwise re-load it by hub id, which fails offline),
    or, with LoRA, the model with its adapter switched off (no second copy)."""
    run = Path(run)
    parent = check_start(start or recipe.model.from_, "--from" if start else "model.from")
    source = open_documents(recipe.data.path)
    columns = preference_columns(source)
    check_rows(source, columns, non_empty=("chosen", "rejected"))
    quiet_offline()
    tokenizer = load_tokenizer(parent)
    if any(is_list(source.schema.field(c).type) for c in columns):
        require_chat_template(tokenizer, parent, "preference pairs given as chat turns need")
    dataset, data_stats = load_preference_dataset(source, recipe.data, tokenizer)  # every row checked
    begun = open_run("dpo", recipe, run, parent, resume, overwrite)
    if begun.finished:
        return finished_result("dpo", run, begun)
    with removed_if_never_trained(run, begun):
        trainer, callback, data_stats, parameters = dpo_trainer(recipe, run, parent, (dataset, data_stats), on_step)
    return finish_trl(
        "dpo",
        trainer,
        callback,
        run,
        parent,
        source.lineage(),
        data_stats,
        begun,
        parameters,
        lambda history: final_metrics(
            history,
            ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "grad_norm", "lr"),
        ),
    )


def dpo_trainer(recipe: DpoRecipe, run: Path, parent: Path, prepared: tuple, on_step: StepHook | None = None):
    """The DPOTrainer of a recipe over `prepared` (load_preference_dataset's dataset and data facts), its
    RunCallback, the data facts and the parameter counts (nothing trained yet)."""
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = load_start(parent, attention=recipe.training.attention)
    reference = None
    if recipe.peft is None:
        reference, _ = load_start(parent, use_bf16(recipe.training.precision), attention=recipe.training.attention)
        reference.eval().requires_grad_(False)
    dataset, data_stats = prepared
    model = apply_peft(model, recipe.peft)
    config = DPOConfig(
        **trainer_arguments(run, recipe),
        beta=recipe.dpo.beta,
        loss_type=[recipe.dpo.loss_type],
        max_length=recipe.dpo.max_length,
        precompute_ref_log_probs=recipe.dpo.precompute_ref_log_probs,
    )
    callback = run_callback(run, on_step, recipe.checkpoint.keep)
    trainer = scheduled(DPOTrainer, recipe)(
        model=model,
        ref_model=reference,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    # TRL drops the pairs whose prompt alone fills dpo.max_length: say how many, and refuse when none is left.
    data_stats["train_rows"] = len(trainer.train_dataset)
    if data_stats["train_rows"] == 0:
        raise UserError(
            recipe.data.path,
            f"no pair fits dpo.max_length {recipe.dpo.max_length} (TRL drops the pairs it cannot fit)",
            "raise dpo.max_length, or shorten the prompts",
        )
    return trainer, callback, data_stats, parameter_counts(model)
