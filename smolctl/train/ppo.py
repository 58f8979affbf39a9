"""Reinforcement learning from rewards with smolctl's own compact PPO (GRPO, through TRL, is smolctl.train.grpo).

  smolctl ppo recipes/ppo-tiny.toml demo-out/ppo --from demo-out/dpo

TRL dropped its PPO trainer (gone from trl.experimental since 1.13), so PPO lives here: the policy with a scalar
value head, a frozen reference (the starting checkpoint) for a per-token KL penalty, rollouts by `generate`,
GAE, the clipped surrogate, a clipped value loss and an entropy bonus, several epochs of minibatches per batch
(the playbook's defaults: batch 64, 3 epochs, clip 0.2, value coefficient 0.1, entropy coefficient 0.01).
The math is the functions at the top; `PpoLoop` reads as a checklist (rollout, score, advantages, update, log,
checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import DocumentSource, open_documents
from smolctl.train.config import GrpoRecipe, PpoRecipe, PromptDataSection
from smolctl.train.rewards import CompositeReward
from smolctl.train.run import RunStart
from smolctl.train.posttrain_run import PostTrainResult, StepHook, check_start, finished_result, open_run, quiet_offline, world_size

# ---------------------------------------------------------------------------------------------------------------
# The math, on [batch, tokens] tensors with a 0/1 mask of the completion tokens


def masked_mean(values, mask, count=None):
    """Mean of values where mask is 1; `count` replaces the mask's own token count, so micro batches of one
    minibatch each add their share of that minibatch's mean."""
    return (values * mask).sum() / (mask.sum().clamp(min=1) if count is None else count)


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


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, clip: float, count=None):
    """PPO's clipped surrogate, to minimise: mean over tokens of max(-A·r, -A·clip(r, 1-ε, 1+ε)).
    Returns (loss, fraction of tokens where the clip was active)."""
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return (masked_mean(torch.maximum(unclipped, clipped), mask, count),
            masked_mean((clipped > unclipped).float(), mask, count))


def clipped_value_loss(values, old_values, returns, mask, clip: float, count=None):
    """0.5 · mean of max((V - R)², (V_clipped - R)²), V_clipped kept within ±clip of the rollout's values."""
    import torch

    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, count)


def explained_variance(values, returns, mask) -> float:
    """1 - Var(returns - values) / Var(returns) over the completion tokens: 1 when the critic predicts the returns,
    0 when it predicts only their mean, negative when it is worse than that."""
    residual = returns - values
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float(1 - var_residual / var_returns.clamp(min=1e-8))


LOGIT_CHUNK_ELEMENTS = 1 << 26
"""Vocabulary logits computed at once when scoring (256 MB in fp32): 512 positions of a 128k vocabulary."""


def token_logprobs(hidden, head, tokens, temperature: float, entropy: bool = False,
                   chunk_elements: int = LOGIT_CHUNK_ELEMENTS):
    """log p(token) of the sampled tokens from the final hidden states, and with `entropy` each position's entropy.

    hidden [B, T, H], head the LM head (hidden → vocabulary logits), tokens [B, T]. The vocabulary logits exist for
    at most `chunk_elements / vocabulary` positions at a time, as gather − logsumexp in fp32, so no [B, T, V]
    tensor is ever built; under autograd each chunk is checkpointed, so backward recomputes its logits instead of
    keeping every chunk's alive. Returns ([B, T], [B, T] or None)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    vocabulary = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    positions = max(1, chunk_elements // vocabulary)
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    parts = []
    for chunk_hidden, chunk_tokens in zip(flat_hidden.split(positions), flat_tokens.split(positions)):
        if torch.is_grad_enabled() and chunk_hidden.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, chunk_hidden, chunk_tokens, head, temperature, entropy,
                                    use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(chunk_hidden, chunk_tokens, head, temperature, entropy))
    logprobs = torch.cat([p[0] for p in parts]).view(tokens.shape)
    return logprobs, torch.cat([p[1] for p in parts]).view(tokens.shape) if entropy else None


def _chunk_logprobs(hidden, tokens, head, temperature: float, entropy: bool):
    import torch

    logits = head(hidden).float() / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser
    if not entropy:
        return chosen, chosen
    probs = torch.softmax(logits, dim=-1)
    return chosen, normaliser - (probs * logits).sum(-1)


def completion_mask(completion, stop_ids):
    """1 for generated tokens up to and including the first stop token, 0 after it. completion: [B, T]."""
    import torch

    is_stop = torch.isin(completion, torch.tensor(stop_ids, device=completion.device)).long()
    stopped_before = torch.cumsum(is_stop, dim=1) - is_stop
    return (stopped_before == 0).float()


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def load_prompts(source: DocumentSource, data: PromptDataSection, needs_reference: bool) -> list[dict]:
    """The dataset's rows, each with its reference under "reference" (None when the column is absent and not
    needed): reward callables see every column."""
    from smolctl.train.posttrain import require_columns

    require_columns(source, [data.prompt_column], "set data.prompt_column, or pass a dataset of prompts")
    if needs_reference:
        if data.reference_column not in source.columns:
            raise UserError(source.spec, f"has no column '{data.reference_column}' for the task reward (columns: "
                            f"{', '.join(source.columns)})", "set data.reference_column, or use a regex/callable reward")
    rows = []
    for batch in source.iter_batches():
        rows += batch.to_pylist()
    if data.limit is not None:
        rows = rows[:data.limit]
    if not rows:
        raise UserError(source.spec, "holds no prompts", "pass a non-empty dataset")
    return [{**row, "prompt": row[data.prompt_column], "reference": row.get(data.reference_column)} for row in rows]


def as_chat(prompt) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------------------------------------------------------
# Running: the checks ppo and grpo share


@dataclass
class Setup:
    run: Path
    parent: Path
    source: DocumentSource
    rows: list[dict]
    """The dataset's rows, with "prompt" and "reference" whatever their columns are called."""
    reward: CompositeReward
    start: RunStart


def prepare(stage: str, recipe: PpoRecipe | GrpoRecipe, run: str | Path, start: str | None, resume: str,
            overwrite: bool) -> Setup:
    """Every check that can fail, before any model loads: data, rewards (callables imported), run folder, resume."""
    run = Path(run)
    parent = check_start(start or recipe.model.from_, "--from" if start else "model.from")
    source = open_documents(recipe.data.path)
    reward = CompositeReward(recipe.rewards)
    rows = load_prompts(source, recipe.data, reward.needs_reference)
    begun = open_run(stage, recipe, run, parent, resume, overwrite)
    return Setup(run, parent, source, rows, reward, begun)


def run_ppo(recipe: PpoRecipe, run: str | Path, *, start: str | None = None, resume: str = "none",
            overwrite: bool = False, on_step: StepHook | None = None) -> PostTrainResult:
    """Train the starting checkpoint on the recipe's rewards with smolctl's PPO (one process)."""
    if world_size() > 1:
        raise UserError("ppo", "smolctl's own PPO runs in one process",
                        "launch it without torchrun, or use smolctl grpo (TRL, multi-process)")
    if recipe.training.shard or recipe.training.compile or recipe.training.global_batch:
        raise UserError("training", "ppo runs one process without shard or compile, and counts its batch in "
                        "ppo.batch_size", "remove training.shard, training.compile and training.global_batch")
    setup = prepare("ppo", recipe, run, start, resume, overwrite)
    if setup.start.finished:
        return finished_result("ppo", setup.run, setup.start)
    quiet_offline()
    from smolctl.train.ppo_loop import PpoLoop

    return PpoLoop(recipe, setup, on_step).train()


def reward_trend(rewards: list[float], window: int = 5) -> dict:
    """Mean reward over the first and the last `window` steps: the number that says whether training worked."""
    finite = [r for r in rewards if math.isfinite(r)]
    if not finite:
        return {}
    return {"reward_first": sum(finite[:window]) / len(finite[:window]),
            "reward_last": sum(finite[-window:]) / len(finite[-window:])}
