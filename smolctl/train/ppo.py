"""Reinforcement learning from rewards: smolctl's own compact PPO, and GRPO through TRL, with the same rewards.

  smolctl ppo recipes/ppo-tiny.toml demo-out/ppo --from demo-out/dpo
  smolctl ppo recipes/ppo-tiny.toml demo-out/grpo --from demo-out/dpo --set algorithm=grpo

TRL dropped its PPO trainer (gone from trl.experimental since 1.13), so PPO lives here: the policy with a scalar
value head, a frozen reference (the starting checkpoint) for a per-token KL penalty, rollouts by `generate`,
GAE, the clipped surrogate, a clipped value loss and an entropy bonus, several epochs of minibatches per batch
(the playbook's defaults: batch 64, 3 epochs, clip 0.2, value coefficient 0.1, entropy coefficient 0.01).
The math is the functions at the top; `PpoLoop` reads as a checklist (rollout, score, advantages, update, log,
checkpoint).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from smolctl.errors import UserError
from smolctl.recipe import Section, load_recipe
from smolctl.shards import DocumentSource, open_documents
from smolctl.train.config import LoggingSection
from smolctl.train.rewards import CompositeReward, RewardSection
from smolctl.train.trackers import require_trackers
from smolctl.train.stage import (
    FINAL, CheckpointSection, ModelSection, StageResult, StepHook, TrainingSection, check_start, chat_stop_ids,
    final_metrics, load_start, monitor_callback, prepare_run, quiet_offline, record_recipe, train_quietly,
    trainer_arguments, write_model,
)

# ---------------------------------------------------------------------------------------------------------------
# Recipe


class PromptDataSection(Section):
    path: str
    """Dataset folder of prompts."""
    prompt_column: str = "prompt"
    reference_column: str = "reference"
    """What task rewards compare against (exact / regex with {reference}); optional for other rewards."""
    limit: int | None = Field(None, gt=0)


class GenerationSection(Section):
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)


class PpoSection(Section):
    batch_size: int = Field(64, gt=0)
    """Completions per step (rollouts for ppo; prompt groups x num_generations for grpo)."""
    epochs: int = Field(3, gt=0)
    """Passes over each batch (grpo: num_iterations)."""
    minibatch_size: int = Field(16, gt=0)
    """Completions per optimizer update (ppo)."""
    clip: float = Field(0.2, gt=0)
    """Clip range of the probability ratio."""
    vf_coef: float = Field(0.1, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    ent_coef: float = Field(0.01, ge=0)
    kl_coef: float = Field(0.05, ge=0)
    """Per-token KL penalty against the reference (grpo: beta)."""
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""


class GrpoSection(Section):
    num_generations: int = Field(8, ge=2)
    """Completions per prompt; rewards are normalised within each group."""


class PpoRecipe(Section):
    output: str | None = None
    algorithm: Literal["ppo", "grpo"] = "ppo"
    model: ModelSection = ModelSection()
    data: PromptDataSection
    training: TrainingSection = TrainingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    generation: GenerationSection = GenerationSection()
    ppo: PpoSection = PpoSection()
    grpo: GrpoSection = GrpoSection()
    rewards: list[RewardSection] = Field(default_factory=list)


def load_ppo_recipe(path: str | Path, overrides: list[str]) -> PpoRecipe:
    return load_recipe(PpoRecipe, path, overrides)


# ---------------------------------------------------------------------------------------------------------------
# The math, on [batch, tokens] tensors with a 0/1 mask of the completion tokens


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum().clamp(min=1)


def whiten(values, mask):
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * (var + 1e-8).rsqrt() * mask


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation. Tokens past the end (mask 0) are terminal: no bootstrap across them.
    Returns (advantages, returns), both zero where mask is 0."""
    import torch

    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        alive_next = mask[:, t + 1] if t + 1 < steps else torch.zeros_like(running)
        next_value = values[:, t + 1] * alive_next if t + 1 < steps else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * alive_next * running
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, clip: float):
    """PPO's clipped surrogate, to minimise: mean over tokens of max(-A·r, -A·clip(r, 1-ε, 1+ε)).
    Returns (loss, fraction of tokens where the clip was active)."""
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return masked_mean(torch.maximum(unclipped, clipped), mask), masked_mean((clipped > unclipped).float(), mask)


def clipped_value_loss(values, old_values, returns, mask, clip: float):
    """0.5 · mean of max((V - R)², (V_clipped - R)²), V_clipped kept within ±clip of the rollout's values."""
    import torch

    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def token_logprobs_and_entropy(logits, tokens):
    """log p(token) and the entropy of each position's distribution; logits [B, T, V], tokens [B, T]."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


def completion_mask(completion, stop_ids):
    """1 for generated tokens up to and including the first stop token, 0 after it. completion: [B, T]."""
    import torch

    is_stop = torch.isin(completion, torch.tensor(stop_ids, device=completion.device)).long()
    stopped_before = torch.cumsum(is_stop, dim=1) - is_stop
    return (stopped_before == 0).float()


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def load_prompts(source: DocumentSource, data: PromptDataSection, needs_reference: bool) -> tuple[list, list]:
    """(prompts, references) from the dataset; references are None when the column is absent and not needed."""
    from smolctl.train.posttrain import require_columns

    require_columns(source, [data.prompt_column], "set data.prompt_column, or pass a dataset of prompts")
    if needs_reference:
        if data.reference_column not in source.columns:
            raise UserError(source.spec, f"has no column '{data.reference_column}' for the task reward (columns: "
                            f"{', '.join(source.columns)})", "set data.reference_column, or use a regex/callable reward")
    columns = [data.prompt_column] + ([data.reference_column] if data.reference_column in source.columns else [])
    prompts, references = [], []
    for batch in source.iter_batches(columns=columns):
        prompts += batch.column(0).to_pylist()
        references += batch.column(1).to_pylist() if len(columns) == 2 else [None] * batch.num_rows
    if data.limit is not None:
        prompts, references = prompts[:data.limit], references[:data.limit]
    if not prompts:
        raise UserError(source.spec, "holds no prompts", "pass a non-empty dataset")
    return prompts, references


def as_chat(prompt) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------------------------------------------------------
# Running either algorithm


@dataclass
class Setup:
    run: Path
    parent: Path
    source: DocumentSource
    prompts: list
    references: list
    reward: CompositeReward
    resume_from: str | None


def prepare(recipe: PpoRecipe, output: str | None, start: str | None, resume: str | None, overwrite: bool) -> Setup:
    """Every check that can fail, before any model loads: data, rewards (callables imported), output, resume."""
    from smolctl.train.posttrain import resolve_output

    out = resolve_output(recipe.output, output)
    parent = check_start(start or recipe.model.from_)
    source = open_documents(recipe.data.path)
    reward = CompositeReward(recipe.rewards)
    prompts, references = load_prompts(source, recipe.data, reward.needs_reference)
    if recipe.algorithm == "ppo" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("algorithm", "smolctl's own PPO runs in one process",
                        'launch it without torchrun, or set algorithm = "grpo" (TRL, multi-process)')
    if recipe.algorithm == "grpo":
        check_grpo_batch(recipe)
    require_trackers(recipe.logging.report_to)
    resume_from = prepare_run(out, resume, overwrite)
    record_recipe(out, recipe.model_dump(by_alias=True), parent, resume_from)
    return Setup(out, parent, source, prompts, references, reward, resume_from)


def check_grpo_batch(recipe: PpoRecipe) -> None:
    batch, micro, groups = recipe.ppo.batch_size, recipe.training.micro_batch, recipe.grpo.num_generations
    if batch % micro:
        raise UserError("ppo.batch_size", f"{batch} is not a multiple of training.micro_batch ({micro})",
                        "make the batch a whole number of micro batches")
    if batch % groups:
        raise UserError("ppo.batch_size", f"{batch} is not a multiple of grpo.num_generations ({groups})",
                        "each step must hold whole groups of completions")


def run_ppo(recipe: PpoRecipe, *, output: str | None = None, start: str | None = None, resume: str | None = None,
            overwrite: bool = False, on_step: StepHook | None = None) -> StageResult:
    """Train the starting checkpoint on the recipe's rewards with PPO (ours) or GRPO (TRL)."""
    quiet_offline()
    setup = prepare(recipe, output, start, resume, overwrite)
    if recipe.algorithm == "grpo":
        return _run_grpo(recipe, setup, on_step)
    from smolctl.train.ppo_loop import PpoLoop

    return PpoLoop(recipe, setup, on_step).train()


def _run_grpo(recipe: PpoRecipe, setup: Setup, on_step: StepHook | None) -> StageResult:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_start(setup.parent)
    model.generation_config.eos_token_id = chat_stop_ids(tokenizer)
    chat = bool(getattr(tokenizer, "chat_template", None))
    dataset = datasets.Dataset.from_dict({
        "prompt": [as_chat(p) if chat else p for p in setup.prompts], "reference": setup.references})
    skipped = {"nan": 0}

    def smolctl_reward(prompts, completions, completion_ids, reference=None, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scored = setup.reward.score(texts, [len(ids) for ids in completion_ids], reference)
        nan = sum(1 for v in scored.totals if not math.isfinite(v))
        skipped["nan"] += nan
        return [v if math.isfinite(v) else None for v in scored.totals]

    micro = recipe.training.micro_batch
    arguments = trainer_arguments(setup.run, recipe.training, recipe.checkpoint, recipe.logging.report_to)
    arguments["gradient_accumulation_steps"] = recipe.ppo.batch_size // micro
    config = GRPOConfig(
        **arguments, steps_per_generation=recipe.ppo.batch_size // micro, num_generations=recipe.grpo.num_generations,
        num_iterations=recipe.ppo.epochs, epsilon=recipe.ppo.clip, beta=recipe.ppo.kl_coef,
        max_completion_length=recipe.generation.max_new_tokens, temperature=recipe.generation.temperature,
        entropy_coef=recipe.ppo.ent_coef, top_k=0, log_completions=False, shuffle_dataset=True,
    )
    monitor = monitor_callback(setup.run, on_step)
    trainer = GRPOTrainer(model=model, reward_funcs=[smolctl_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[monitor])
    started = time.perf_counter()
    train_quietly(trainer, setup.resume_from)
    seconds = time.perf_counter() - started
    rewards = [r["reward"] for r in monitor.history if "reward" in r]
    metrics = {**reward_trend(rewards), **final_metrics(monitor.history, ("kl", "completions/mean_length", "entropy")),
               "nan_rewards_skipped": skipped["nan"]}
    data = {"prompts": len(setup.prompts), "algorithm": "grpo"}
    if trainer.is_world_process_zero():
        write_model(setup.run, trainer.model, tokenizer, parent=setup.parent, data_inputs=setup.source.lineage(),
                    stage="grpo", stats={**{k.replace("/", "_"): v for k, v in metrics.items()}, **data,
                                         "steps": trainer.state.global_step, "seconds": round(seconds, 2)})
    return StageResult("grpo", str(setup.run), str(setup.run / FINAL), str(setup.parent), trainer.state.global_step,
                       seconds, setup.resume_from, metrics, data)


def reward_trend(rewards: list[float], window: int = 5) -> dict:
    """Mean reward over the first and the last `window` steps: the number that says whether training worked."""
    finite = [r for r in rewards if math.isfinite(r)]
    if not finite:
        return {}
    return {"reward_first": sum(finite[:window]) / len(finite[:window]),
            "reward_last": sum(finite[-window:]) / len(finite[-window:])}
