"""PPO's math on [batch, tokens] tensors with a 0/1 mask of the completion tokens: GAE, whitening, the clipped
policy and value losses, the KL penalty, log-probabilities of sampled tokens. Shared by the PPO loop and its tests.

Statistics over a batch (whitening, explained variance) take `all_sum`, a function that sums a tensor over every
process (smolctl.train.distributed.Dist.sum under torchrun): each process holds its share of the completions, and
the mean and variance must be those of the whole batch, or the advantages of two ranks would be on different
scales (OpenRLHF and TRL whiten over the global batch the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

AllSum = Callable[[torch.Tensor], torch.Tensor]


def local_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`all_sum` of one process: the sum is already complete."""
    return tensor


def masked_mean(values, mask, count=None):
    """Mean of values where mask is 1; `count` replaces the mask's own token count, so micro batches of one
    minibatch each add their share of that minibatch's mean."""
    return (values * mask).sum() / (mask.sum().clamp(min=1) if count is None else count)


def global_mean(values, mask, all_sum: AllSum = local_sum):
    """Mean over the masked tokens of every process."""
    totals = all_sum(torch.stack([(values * mask).sum(), mask.sum()]).double())
    return (totals[0] / totals[1].clamp(min=1)).to(values.dtype)


def whiten(values, mask, all_sum: AllSum = local_sum):
    """(values - mean) / std over the masked tokens of the whole batch (every process), zero where mask is 0."""
    mean = global_mean(values, mask, all_sum)
    var = global_mean((values - mean) ** 2, mask, all_sum)
    return (values - mean) * (var + 1e-8).rsqrt() * mask


def explained_variance(values, returns, mask, all_sum: AllSum = local_sum) -> float:
    """1 - Var(returns - values) / Var(returns) over the completion tokens: 1 when the critic predicts the returns,
    0 when it predicts only their mean, negative when it is worse than that."""
    residual = returns - values
    var_returns = global_mean((returns - global_mean(returns, mask, all_sum)) ** 2, mask, all_sum)
    var_residual = global_mean((residual - global_mean(residual, mask, all_sum)) ** 2, mask, all_sum)
    return float(1 - var_residual / var_returns.clamp(min=1e-8))


def per_token_kl(logprobs, ref_logprobs, mask):
    """The KL penalty's per-token estimate log π(t) − log π_ref(t) at the sampled tokens (Schulman's k1): its
    expectation under the policy's samples is KL(π ‖ π_ref), and as a per-token reward it is the penalty of
    InstructGPT, TRL and OpenRLHF. Zero where mask is 0."""
    return (logprobs - ref_logprobs) * mask


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation. Tokens past the end (mask 0) are terminal: no bootstrap across them.
    Returns (advantages, returns), both zero where mask is 0."""
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
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return (
        masked_mean(torch.maximum(unclipped, clipped), mask, count),
        masked_mean((clipped > unclipped).float(), mask, count),
    )


def clipped_value_loss(values, old_values, returns, mask, clip: float, count=None):
    """0.5 · mean of max((V - R)², (V_clipped - R)²), V_clipped kept within ±clip of the rollout's values."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, count)


LOGIT_CHUNK_ELEMENTS = 1 << 26
"""Vocabulary logits computed at once when scoring (256 MB in fp32): 512 positions of a 128k vocabulary."""


def token_logprobs(
    hidden, head, tokens, temperature: float, entropy: bool = False, chunk_elements: int = LOGIT_CHUNK_ELEMENTS
):
    """log p(token) of the sampled tokens from the final hidden states, and with `entropy` each position's entropy.

    hidden [B, T, H], head the LM head (hidden → vocabulary logits), tokens [B, T]. The vocabulary logits exist for
    at most `chunk_elements / vocabulary` positions at a time, as gather − logsumexp in fp32, so no [B, T, V]
    tensor is ever built; under autograd each chunk is checkpointed, so backward recomputes its logits instead of
    keeping every chunk's alive. Returns ([B, T], [B, T] or None)."""
    vocabulary = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    positions = max(1, chunk_elements // vocabulary)
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    parts = []
    for chunk_hidden, chunk_tokens in zip(flat_hidden.split(positions), flat_tokens.split(positions)):
        if torch.is_grad_enabled() and chunk_hidden.requires_grad:
            parts.append(
                checkpoint(_chunk_logprobs, chunk_hidden, chunk_tokens, head, temperature, entropy, use_reentrant=False)
            )
        else:
            parts.append(_chunk_logprobs(chunk_hidden, chunk_tokens, head, temperature, entropy))
    logprobs = torch.cat([p[0] for p in parts]).view(tokens.shape)
    return logprobs, torch.cat([p[1] for p in parts]).view(tokens.shape) if entropy else None


def _chunk_logprobs(hidden, tokens, head, temperature: float, entropy: bool):
    logits = head(hidden).float() / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser
    if not entropy:
        return chosen, chosen
    probs = torch.softmax(logits, dim=-1)
    return chosen, normaliser - (probs * logits).sum(-1)


def completion_mask(completion, stop_ids):
    """1 for generated tokens up to and including the first stop token, 0 after it. completion: [B, T]."""
    is_stop = torch.isin(completion, torch.tensor(stop_ids, device=completion.device)).long()
    stopped_before = torch.cumsum(is_stop, dim=1) - is_stop
    return (stopped_before == 0).float()
