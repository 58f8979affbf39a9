"""GRPO through TRL's GRPOTrainer, on the same prompts and `[[rewards]]` as smolctl's PPO.

  smolctl grpo recipes/grpo-tiny.toml demo-out/grpo --from demo-out/dpo

Each step samples training.global_batch completions, grpo.num_generations per prompt, and normalises the rewards
within each prompt's group (no value model). The composite reward is one TRL reward function; its components
(task, length, diversity) are logged beside it as rewards/NAME.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa

from smolctl.errors import UserError
from smolctl.launcher import world_size_from_env
from smolctl.train.chat_data import as_dataset
from smolctl.train.config import GrpoRecipe, global_batch_and_accumulation
from smolctl.train.posttrain_run import (
    PostTrainResult,
    StepHook,
    apply_peft,
    chat_stop_ids,
    final_metrics,
    finish_trl,
    finished_result,
    load_start,
    parameter_counts,
    quiet_offline,
    run_callback,
    scheduled,
    trainer_arguments,
)
from smolctl.train.rewards import log_completions
from smolctl.train.rl_setup import as_chat, prepare, reward_trend
from smolctl.train.run import holds_run_folder


def check_grpo_batch(recipe: GrpoRecipe) -> tuple[int, int]:
    """(completions per step, micro batches per device per step); each step must hold whole groups."""
    batch, accumulation = global_batch_and_accumulation(recipe.training, world_size_from_env())
    if batch % recipe.grpo.num_generations:
        raise UserError(
            "training.global_batch",
            f"{batch} completions is not a multiple of grpo.num_generations ({recipe.grpo.num_generations})",
            "each step must hold whole groups of completions",
        )
    return batch, accumulation


def check_vllm() -> None:
    """grpo.use_vllm needs a GPU and the vllm package, checked before anything loads."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise UserError("grpo.use_vllm", "vLLM generation needs a GPU", "set grpo.use_vllm = false on CPU")
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "grpo.use_vllm", "the vllm package is not installed", "pip install vllm, or set grpo.use_vllm = false"
        )


@holds_run_folder
def run_grpo(
    recipe: GrpoRecipe,
    run: str | Path,
    *,
    start: str | None = None,
    resume: str = "none",
    overwrite: bool = False,
    on_step: StepHook | None = None,
) -> PostTrainResult:
    """Train the starting checkpoint on the recipe's rewards with TRL's GRPOTrainer and write RUN/final."""
    batch, accumulation = check_grpo_batch(recipe)
    if recipe.grpo.use_vllm:
        check_vllm()
    setup = prepare("grpo", recipe, run, start, resume, overwrite)
    if setup.start.finished:
        return finished_result("grpo", setup.run, setup.start)
    quiet_offline()
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_start(setup.parent, attention=recipe.training.attention)
    model.generation_config.eos_token_id = chat_stop_ids(tokenizer) or None
    chat = bool(getattr(tokenizer, "chat_template", None))
    # The row index travels with each prompt, so the reward sees the whole row and knows each completion's group.
    dataset = as_dataset(
        pa.Table.from_pylist(
            [
                {"prompt": as_chat(row["prompt"]) if chat else row["prompt"], "row": i}
                for i, row in enumerate(setup.rows)
            ]
        )
    )
    logged = {"nan": 0, "components": {}}
    stop_ids = set(chat_stop_ids(tokenizer))
    interval = recipe.logging.completions_interval

    def smolctl_reward(prompts, completions, completion_ids, row, trainer_state=None, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        truncated = [
            len(ids) >= recipe.grpo.max_new_tokens and (not ids or ids[-1] not in stop_ids) for ids in completion_ids
        ]
        scored = setup.reward.score(
            texts,
            [len(ids) for ids in completion_ids],
            rows=[setup.rows[i] for i in row],
            truncated=truncated,
            groups=row,
        )
        logged["nan"] += sum(1 for v in scored.totals if not math.isfinite(v))
        logged["components"] = {f"rewards/{name}": _finite_mean(values) for name, values in scored.components.items()}
        step = trainer_state.global_step + 1 if trainer_state is not None else 0
        if interval and step % interval == 0:
            log_completions(
                setup.run,
                step,
                [setup.rows[i]["prompt"] for i in row],
                texts,
                scored.components,
                scored.totals,
                group_advantages(scored.totals, row),
            )
        return [v if math.isfinite(v) else None for v in scored.totals]

    grpo = recipe.grpo
    model = apply_peft(model, recipe.peft)
    config = GRPOConfig(
        **trainer_arguments(setup.run, recipe),
        steps_per_generation=accumulation,
        num_generations=grpo.num_generations,
        num_iterations=grpo.epochs,
        epsilon=grpo.clip,
        beta=grpo.kl_coef,
        max_completion_length=grpo.max_new_tokens,
        temperature=grpo.temperature,
        entropy_coef=grpo.ent_coef,
        top_k=0,
        top_p=grpo.top_p,
        min_p=grpo.min_p,
        mask_truncated_completions=grpo.mask_truncated_completions,
        use_vllm=grpo.use_vllm,
        vllm_mode="colocate",
        log_completions=False,
        shuffle_dataset=True,
    )
    callback = run_callback(
        setup.run,
        on_step,
        recipe.checkpoint.keep,
        extra=lambda: {**logged["components"], "nan_rewards_skipped": logged["nan"]},
    )
    trainer = scheduled(GRPOTrainer, recipe)(
        model=model,
        reward_funcs=[smolctl_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    components = tuple(f"rewards/{name}" for name in setup.reward.names)

    def summary(history: list[dict]) -> dict:
        return {
            **reward_trend([r["reward"] for r in history if "reward" in r]),
            **final_metrics(history, (*components, "kl", "completions/mean_length", "entropy")),
            "nan_rewards_skipped": logged["nan"],
        }

    return finish_trl(
        "grpo",
        trainer,
        callback,
        setup.run,
        setup.parent,
        setup.source.lineage(),
        {"prompts": len(setup.rows), "completions_per_step": batch},
        setup.start,
        parameter_counts(model),
        summary,
    )


def group_advantages(totals: list[float], groups: list) -> list[float]:
    """GRPO's advantage of each completion: its reward minus its group's mean, over the group's standard deviation
    (TRL's default scaling; NaN rewards left out)."""
    advantages = []
    for total, key in zip(totals, groups):
        members = [t for t, k in zip(totals, groups) if k == key and math.isfinite(t)]
        mean = sum(members) / len(members) if members else math.nan
        std = math.sqrt(sum((t - mean) ** 2 for t in members) / max(len(members) - 1, 1)) if members else math.nan
        advantages.append((total - mean) / (std + 1e-4))
    return advantages


def _finite_mean(values: list[float]) -> float:
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan
