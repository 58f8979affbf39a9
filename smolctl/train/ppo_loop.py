"""smolctl's PPO loop (the math lives in smolctl.train.ppo_math): rollout, score, advantages, update, log,
checkpoint.

Under torchrun the processes run data-parallel: each generates, scores and trains on its share of every batch and
minibatch; the policy and critic gradients are averaged by DDP, and everything computed over a batch (advantage
whitening, the minibatch's token count that normalises the losses, the logged rewards, KL and losses) is reduced
over all processes, so N processes make the updates one process would make with the same batch.

Rank 0 writes the whole run folder (metrics, completions.jsonl with every rank's completions gathered, checkpoints,
final/): the weights and optimizer are replicated, so one copy is the whole state, a run folder reads the same
whatever the world size, and a run resumes on any number of processes. Checkpoints go to RUN/checkpoints/step-N/
(the trainable weights: the whole policy, or its LoRA adapters, and the value head; optimizer, scheduler,
counters), written under a temporary name and renamed, so `--resume auto` finds only complete ones.
The prompt order, each generate call's sampling and each minibatch order are functions of the seed and the step,
so a resumed run draws what it would have drawn.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import GenerationConfig

from smolctl.errors import UserError
from smolctl.train.config import PpoRecipe
from smolctl.train.distributed import Dist, gradient_sync, init_distributed
from smolctl.train.posttrain_run import (
    PostTrainResult,
    StepHook,
    apply_peft,
    chat_stop_ids,
    final_metrics,
    load_start,
    parameter_counts,
    save_final,
    use_bf16,
)
from smolctl.train.ppo_math import (
    clipped_policy_loss,
    clipped_value_loss,
    completion_mask,
    explained_variance,
    gae,
    masked_mean,
    per_token_kl,
    token_logprobs,
    whiten,
)
from smolctl.train.rewards import log_completions
from smolctl.train.rl_setup import Setup, as_chat, reward_trend
from smolctl.train.run import EVENTS, FINAL, METRICS, append_jsonl, checkpoint_dir, prune_checkpoints
from smolctl.train.schedule import lambda_scheduler
from smolctl.train.trackers import open_tracker


class PolicyWithValue(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state. The forward returns the final hidden states
    (not the logits: scoring turns them into log-probabilities a chunk of positions at a time) and the values."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1)
        # Zero: the fresh critic predicts 0 everywhere (explained variance 0) rather than noise that the clipped
        # value loss would take many steps to undo.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, critic_only: bool = False):
        """critic_only: the backbone runs without gradients, so only the value head learns (critic warmup)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not critic_only):
            hidden = final_hidden(self.policy, input_ids, attention_mask)
        return hidden, self.value_head(hidden.float()).squeeze(-1)


def final_hidden(model: nn.Module, input_ids, attention_mask):
    """The last layer's (normalised) hidden states [B, T, H]; the LM head runs on one position only."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,
    )
    return out.hidden_states[-1]


def train_without_dropout(model: nn.Module) -> None:
    """Training mode for the layers that checkpoint (gradient checkpointing acts only in training mode), evaluation
    mode everywhere else: dropout would make the update's log-probabilities differ from the rollout's, and the
    ratio of the two is PPO's signal."""
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.training = True


def replicate(model: nn.Module, dist: Dist) -> nn.Module:
    """The model under DDP (gradients averaged over the processes in buckets, during backward), or itself alone."""
    if not dist.active:
        return model
    device_ids = [dist.local_rank] if dist.device.startswith("cuda") else None
    # The buffers (rotary frequencies) are equal on every rank: no broadcast before each forward.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def derived_seed(*parts: int) -> int:
    """A seed from the run's seed and counters (stream, step, position): equal on every process, after a resume,
    and whatever the world size."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) % (2**61 - 1)
    return value


def join_chunks(prompts: list[dict], completions: list, pad_id: int):
    """One batch from the generate calls' outputs: prompts left-padded (and their attention masks) to the longest,
    completions right-padded with pad tokens (past every row's stop token, so completion_mask leaves them out).
    Returns (prompt ids, prompt attention, completions)."""
    width = max(p["input_ids"].shape[1] for p in prompts)
    length = max(c.shape[1] for c in completions)
    ids = torch.cat([F.pad(p["input_ids"], (width - p["input_ids"].shape[1], 0), value=pad_id) for p in prompts])
    attention = torch.cat([F.pad(p["attention_mask"], (width - p["attention_mask"].shape[1], 0)) for p in prompts])
    return ids, attention, torch.cat([F.pad(c, (0, length - c.shape[1]), value=pad_id) for c in completions])


class PpoLoop:
    def __init__(self, recipe: PpoRecipe, setup: Setup, on_step: StepHook | None):
        self.recipe, self.setup, self.on_step = recipe, setup, on_step
        self.cfg, self.training = recipe.ppo, recipe.training
        bf16 = use_bf16(self.training.precision)
        self.dist = init_distributed()
        self.device = torch.device(self.dist.device)
        self.share = self.cfg.batch_size // self.dist.world_size
        """Completions this process generates and trains on per step."""
        torch.manual_seed(self.training.seed)
        policy, self.tokenizer = load_start(setup.parent, attention=self.training.attention)
        # The reference is the policy's twin in weights and compute (fp32 weights under the same autocast), so the
        # KL penalty is exactly 0 at step 0 and measures only what training changed.
        self.reference, _ = load_start(setup.parent, attention=self.training.attention)
        policy = apply_peft(policy, recipe.peft)
        if self.training.activation_checkpointing == "full":
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # fp32 weights, bf16 compute: the same mixed precision the Trainer-based stages get from bf16=True.
        self.autocast = partial(torch.autocast, self.device.type, dtype=torch.bfloat16, enabled=bf16)
        self.reference.to(self.device).eval().requires_grad_(False)
        self.model = PolicyWithValue(policy).to(self.device)
        self.parameters = parameter_counts(self.model)
        self.stop_ids = chat_stop_ids(self.tokenizer)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.generation = self.generation_config()
        opt = recipe.optimizer
        critic = list(self.model.value_head.parameters())
        policy_params = [
            p for n, p in self.model.named_parameters() if p.requires_grad and not n.startswith("value_head.")
        ]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": policy_params, "lr": opt.lr},
                {"params": critic, "lr": self.cfg.critic_learning_rate(opt.lr), "weight_decay": 0.0},
            ],
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.scheduler = lambda_scheduler(self.optimizer, recipe.schedule, int(self.training.steps))
        self.step, self.nan_skipped, self.history = 0, 0, []
        self._cached_order: tuple = (None, None)
        if setup.start.resume_from:
            self._load(Path(setup.start.resume_from))
        self.replicated = replicate(self.model, self.dist)
        self.tracker = open_tracker(
            setup.run,
            recipe.logging.report_to,
            enabled=self.dist.is_main,
            resuming=bool(setup.start.resume_from),
            config=recipe.model_dump(mode="json", by_alias=True),
        )

    # -- the loop -------------------------------------------------------------------------------------------

    def train(self) -> PostTrainResult:
        started = time.perf_counter()
        interval = self.recipe.checkpoint.interval
        while self.step < self.training.steps:
            step_started = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            first = self.dist.rank * self.share
            batch = self.rollout(self.next_prompts()[first : first + self.share], first)
            update_started = time.perf_counter()
            stats = self.update(batch) if batch is not None else {"skipped_batch": 1.0}
            stats["seconds/update"] = time.perf_counter() - update_started
            if self.device.type == "cuda":
                stats["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.step += 1
            self.scheduler.step()
            tokens = float(self.dist.sum(batch["attention"].sum().double())) if batch is not None else 0.0
            self.log(
                {
                    **stats,
                    "lr": lr,
                    "tokens_per_s": tokens / (time.perf_counter() - step_started),
                    "nan_rewards_skipped": self.nan_skipped,
                }
            )
            if interval and (self.step % interval == 0 or self.step == self.training.steps):
                self.save_checkpoint()
        self.tracker.close()
        seconds = time.perf_counter() - started
        components = tuple(f"rewards/{name}" for name in self.setup.reward.names)
        metrics = {
            **reward_trend([r["reward"] for r in self.history if "reward" in r]),
            **final_metrics(
                self.history,
                (*components, "kl", "policy_loss", "value_loss", "entropy", "clipfrac", "completion_length"),
            ),
            "nan_rewards_skipped": self.nan_skipped,
        }
        errors = self.dist.sum(torch.tensor(float(sum(self.setup.reward.errors.values())), device=self.device))
        data = {"prompts": len(self.setup.rows), "reward_errors_skipped": int(errors)}
        adapter = None
        if self.dist.is_main:
            adapter = save_final(
                self.setup.run,
                self.model.policy,
                self.tokenizer,
                parent=self.setup.parent,
                data_inputs=self.setup.source.lineage(),
                stage="ppo",
                parameters=self.parameters,
                metrics=metrics,
                data=data,
                steps=self.step,
                seconds=seconds,
            )
        self.dist.barrier()  # final/ is complete before any process reports success
        self.dist.close()
        resumed = self.setup.start.resume_from
        return PostTrainResult(
            "ppo",
            str(self.setup.run),
            str(self.setup.run / FINAL),
            str(self.setup.parent),
            self.step,
            seconds,
            str(resumed) if resumed else None,
            self.parameters,
            metrics,
            data,
            str(adapter) if adapter else None,
        )

    def next_prompts(self) -> list[int]:
        """Indices of this step's prompts (the whole batch; each process takes its share): a seeded permutation
        per pass over the data, cycled."""
        n, size = len(self.setup.rows), self.cfg.batch_size
        return [
            int(self._order(position // n)[position % n])
            for position in range(self.step * size, (self.step + 1) * size)
        ]

    def _order(self, epoch: int):
        if self._cached_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.training.seed + epoch)
            self._cached_order = (epoch, torch.randperm(len(self.setup.rows), generator=generator))
        return self._cached_order[1]

    # -- rollout: generate, score, evaluate old/reference log-probs and values --------------------------------

    def generation_config(self):
        """Sampling exactly as the recipe says: whatever the checkpoint's generation_config carries (top_k, a low
        temperature, greedy decoding) would otherwise fill every field left unset, and the rollout's
        log-probabilities would no longer be those of the distribution that sampled."""
        config = GenerationConfig(
            do_sample=True,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=0,
            min_p=None,
            max_new_tokens=self.cfg.max_new_tokens,
            eos_token_id=self.stop_ids or None,
            pad_token_id=self.tokenizer.pad_token_id,
            repetition_penalty=1.0,
            num_beams=1,
        )
        self.model.policy.generation_config = config
        return config

    def encode(self, prompts: list) -> dict:
        texts = [
            self.tokenizer.apply_chat_template(as_chat(p), tokenize=False, add_generation_prompt=True)
            if self.chat
            else p
            for p in prompts
        ]
        return self.tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        ).to(self.device)

    @torch.no_grad()
    def generate(self, rows: list[dict], first: int):
        """Completions of `rows`, the prompts at positions first, first + 1, ... of the step's batch, in generate
        calls of ppo.generation_micro_batch prompts, each sampling from its own seed. Returns (prompt ids, prompt
        attention, completions)."""
        self.model.eval()
        size = self.cfg.generation_micro_batch or len(rows)
        prompts, completions = [], []
        for start in range(0, len(rows), size):
            enc = self.encode([row["prompt"] for row in rows[start : start + size]])
            torch.manual_seed(derived_seed(self.training.seed, 0, self.step, first + start))
            with self.autocast():
                sequences = self.model.policy.generate(**enc, generation_config=self.generation)
            prompts.append(enc)
            completions.append(sequences[:, enc["input_ids"].shape[1] :])
        return join_chunks(prompts, completions, self.tokenizer.pad_token_id)

    @torch.no_grad()
    def rollout(self, indices: list[int], first: int) -> dict | None:
        """This process's share of the step's batch (`indices`, from position `first`): generated, rewarded,
        scored, with advantages whitened over the whole batch. None when no completion of any process has a
        finite reward."""
        rows = [self.setup.rows[i] for i in indices]
        started = time.perf_counter()
        prompt_ids, prompt_attention, completion = self.generate(rows, first)
        generate_seconds = time.perf_counter() - started
        mask = completion_mask(completion, self.stop_ids)
        lengths = mask.sum(1).long().tolist()
        decoded = [self.tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(completion, lengths)]
        # cut off: no stop token within max_new_tokens
        truncated = [
            n == self.cfg.max_new_tokens and int(row[n - 1]) not in self.stop_ids for row, n in zip(completion, lengths)
        ]
        scored = self.setup.reward.score(decoded, lengths, rows=rows, truncated=truncated, groups=indices)
        scores = torch.tensor(scored.totals, dtype=torch.float32, device=self.device)
        # A completion without a finite reward stays in the batch with an all-zero mask (it adds nothing to any
        # loss or statistic): every process keeps the same number of rows, hence of backward passes.
        keep = torch.isfinite(scores)
        kept, skipped = self.dist.sum(torch.stack([keep.sum(), (~keep).sum()]).double()).tolist()
        self.nan_skipped += int(skipped)
        if not kept:
            return None
        mask = mask * keep.unsqueeze(1)
        scores = torch.where(keep, scores, 0.0)
        batch = {
            "sequences": torch.cat([prompt_ids, completion], dim=1),
            "attention": torch.cat([prompt_attention, mask.long()], dim=1),
            "mask": mask,
            "prompt_len": prompt_ids.shape[1],
            "scores": scores,
        }
        started = time.perf_counter()
        batch["old_logprobs"], batch["old_values"] = self.score(self.model, batch)
        batch["ref_logprobs"], _ = self.score(self.reference, batch)
        score_seconds = time.perf_counter() - started
        kl = per_token_kl(batch["old_logprobs"], batch["ref_logprobs"], mask)
        rewards = -self.cfg.kl_coef * kl
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] += scores
        advantages, batch["returns"] = gae(rewards, batch["old_values"] * mask, mask, self.cfg.gamma, self.cfg.lam)
        batch["advantages"] = whiten(advantages, mask, self.dist.sum)
        interval = self.recipe.logging.completions_interval
        if interval and (self.step + 1) % interval == 0:
            self.log_completions(rows, decoded, scored.components, keep, batch)
        batch["rollout_stats"] = {
            **self.batch_means(keep, kl, mask, scores, scored.components),
            "explained_variance": explained_variance(batch["old_values"], batch["returns"], mask, self.dist.sum),
            "seconds/generate": generate_seconds,
            "seconds/score": score_seconds,
        }
        return batch

    def batch_means(self, keep, kl, mask, scores, components: dict[str, list[float]]) -> dict:
        """Per-completion means over the whole batch (every process's kept completions), in one reduction."""
        kept = keep.double()
        sums = [(scores * kept).sum(), kl.sum(1).sum(), mask.sum(), kept.sum()]
        for values in components.values():  # a component's mean over the kept completions where it is finite
            component = torch.tensor(values, dtype=torch.float64, device=self.device)
            counted = kept * torch.isfinite(component)
            sums += [torch.where(counted > 0, component, 0.0).sum(), counted.sum()]
        totals = self.dist.sum(torch.stack([s.double() for s in sums])).tolist()
        count = totals[3]
        means = {"reward": totals[0] / count, "kl": totals[1] / count, "completion_length": totals[2] / count}
        for index, name in enumerate(components):
            total, counted = totals[4 + 2 * index], totals[5 + 2 * index]
            means[f"rewards/{name}"] = total / counted if counted else math.nan
        return means

    def log_completions(
        self, rows: list[dict], decoded: list[str], components: dict[str, list[float]], keep, batch: dict
    ) -> None:
        """RUN/completions.jsonl, written by rank 0 with every process's kept completions, in batch order."""
        kept = [i for i, k in enumerate(keep.tolist()) if k]
        share = {
            "prompts": [rows[i]["prompt"] for i in kept],
            "completions": [decoded[i] for i in kept],
            "components": {n: [v[i] for i in kept] for n, v in components.items()},
            "totals": batch["scores"][kept].tolist(),
            "advantages": batch["advantages"][kept, 0].tolist(),
        }
        shares = [share]
        if self.dist.active:
            shares = [None] * self.dist.world_size
            torch.distributed.all_gather_object(shares, share)
        if not self.dist.is_main:
            return
        log_completions(
            self.setup.run,
            self.step + 1,
            [p for s in shares for p in s["prompts"]],
            [c for s in shares for c in s["completions"]],
            {n: [v for s in shares for v in s["components"][n]] for n in components},
            [t for s in shares for t in s["totals"]],
            [a for s in shares for a in s["advantages"]],
        )

    @torch.no_grad()
    def score(self, model: nn.Module, batch: dict):
        """Log-probabilities of the sampled tokens and values (None for the reference), each [B, T], computed
        ppo.scoring_micro_batch completions at a time."""
        micro = self.cfg.scoring_micro_batch or self.training.micro_batch
        parts = [
            self.evaluate(model, batch, rows)
            for rows in torch.arange(len(batch["sequences"]), device=self.device).split(micro)
        ]
        values = torch.cat([p[2] for p in parts]) if parts[0][2] is not None else None
        return torch.cat([p[0] for p in parts]), values

    def evaluate(self, model: nn.Module, batch: dict, rows, entropy: bool = False, critic_only: bool = False):
        """Log-probs, entropies (with `entropy`) and values (None for the reference) of the completion tokens of
        `rows`: each [rows, T]. The policy's forward runs through DDP when it trains the whole model (DDP then
        expects every trainable parameter's gradient); the critic warmup and scoring bypass it."""
        sequences, attention, start = batch["sequences"][rows], batch["attention"][rows], batch["prompt_len"]
        with self.autocast():
            if isinstance(model, PolicyWithValue):
                forward = self.replicated if torch.is_grad_enabled() and not critic_only else model
                hidden, values = forward(sequences, attention, critic_only)
                values = values[:, start - 1 : -1].float()
                head = model.policy.get_output_embeddings()
            else:
                hidden, values, head = final_hidden(model, sequences, attention), None, model.get_output_embeddings()
            if critic_only:
                return None, None, values
            logprobs, entropies = token_logprobs(
                hidden[:, start - 1 : -1], head, sequences[:, start:], self.cfg.temperature, entropy
            )
        return logprobs, entropies, values

    # -- update: epochs of minibatches, micro-batched -------------------------------------------------------

    def update(self, batch: dict) -> dict:
        """Epochs of minibatches; each minibatch's losses are means over its completion tokens on every process
        (its micro batches each add their tokens' share), so neither micro batching nor the number of processes
        changes the update. The logged losses are each minibatch's, averaged over the minibatches."""
        train_without_dropout(self.model)
        critic_only = self.step < self.cfg.critic_warmup_steps
        size = len(batch["scores"])
        minibatch = min(self.cfg.minibatch_size, self.cfg.batch_size) // self.dist.world_size
        micro = self.training.micro_batch
        # DDP averages gradients over the processes; each process's loss is its tokens' share of the minibatch's
        # mean, so × world_size makes the average the minibatch's gradient. The critic warmup sums its few
        # gradients itself (see critic_gradients_summed).
        scale = 1 if critic_only else self.dist.world_size
        totals: dict[str, torch.Tensor] = {}
        norms = []
        for epoch in range(self.cfg.epochs):
            generator = torch.Generator().manual_seed(
                derived_seed(self.training.seed, 1, self.step, epoch, self.dist.rank)
            )
            order = torch.randperm(size, generator=generator).to(self.device)
            for start in range(0, size, minibatch):
                rows = order[start : start + minibatch]
                tokens = self.dist.sum(batch["mask"][rows].sum()).clamp(min=1)
                self.optimizer.zero_grad(set_to_none=True)
                chunks = rows.split(micro)
                for index, chunk in enumerate(chunks):
                    with gradient_sync(self.replicated, self.dist, index == len(chunks) - 1):
                        losses = self.losses(batch, chunk, tokens, critic_only)
                        loss = losses.pop("loss")
                        (loss * scale).backward()
                        losses["loss"] = loss.detach()  # logged like every training command's loss
                    for key, value in losses.items():
                        totals[key] = totals.get(key, 0.0) + value
                if critic_only:
                    self.critic_gradients_summed()
                norms.append(
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip or math.inf)
                )
                self.optimizer.step()
        updates = self.cfg.epochs * len(range(0, size, minibatch))
        keys = list(totals)
        means = (self.dist.sum(torch.stack([totals[k] for k in keys]).double()) / updates).tolist()
        return {
            **batch["rollout_stats"],
            **dict(zip(keys, means)),
            "grad_norm": float(torch.stack(norms).mean()),
            "critic_warmup": float(critic_only),
        }

    def critic_gradients_summed(self) -> None:
        """The value head's gradients summed over the processes (the critic warmup runs without DDP, whose
        forward would wait for the frozen backbone's gradients)."""
        for param in self.model.value_head.parameters():
            if param.grad is not None:
                self.dist.sum(param.grad)

    def losses(self, batch: dict, rows, tokens, critic_only: bool) -> dict:
        """This micro batch's share of the minibatch's losses (sums over its tokens / the minibatch's tokens on
        every process); all but "loss" detached."""
        mask = batch["mask"][rows]
        logprobs, entropy, values = self.evaluate(
            self.model, batch, rows, entropy=not critic_only, critic_only=critic_only
        )
        value_loss = clipped_value_loss(
            values, batch["old_values"][rows], batch["returns"][rows], mask, self.cfg.vf_clip, tokens
        )
        if critic_only:
            return {"loss": value_loss, "value_loss": value_loss.detach()}
        policy_loss, clipfrac = clipped_policy_loss(
            logprobs, batch["old_logprobs"][rows], batch["advantages"][rows], mask, self.cfg.clip, tokens
        )
        mean_entropy = masked_mean(entropy, mask, tokens)
        loss = policy_loss + self.cfg.vf_coef * value_loss - self.cfg.ent_coef * mean_entropy
        return {
            "loss": loss,
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": mean_entropy.detach(),
            "clipfrac": clipfrac.detach(),
        }

    # -- logging and checkpoints (rank 0 writes; every process keeps the same history) -------------------

    def log(self, stats: dict) -> None:
        record = {"step": self.step, **{k: v for k, v in stats.items() if math.isfinite(v)}}
        if self.step % self.recipe.logging.interval == 0 or self.step == self.training.steps:
            self.history.append(record)
            if self.dist.is_main:
                append_jsonl(self.setup.run / METRICS, record)
            self.tracker.log({f"train/{k}": v for k, v in record.items() if k != "step"}, self.step)
        if self.on_step is not None and self.dist.is_main:
            self.on_step(self.step, self.training.steps, record)

    def trainable_state(self) -> dict:
        """The weights that train: the whole policy, or only its LoRA adapters, and the value head."""
        names = {name for name, param in self.model.named_parameters() if param.requires_grad}
        return {name: tensor for name, tensor in self.model.state_dict().items() if name in names}

    def save_checkpoint(self) -> None:
        """Rank 0 saves the replicated state; the others wait, so no process runs ahead of a checkpoint."""
        if self.dist.is_main:
            final = checkpoint_dir(self.setup.run, self.step)
            tmp = final.parent / f".{final.name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            torch.save(
                {
                    "trainable": self.trainable_state(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "nan_skipped": self.nan_skipped,
                },
                tmp / "ppo_state.pt",
            )
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": self.step, "history": self.history}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            prune_checkpoints(self.setup.run, self.recipe.checkpoint.keep)
            append_jsonl(
                self.setup.run / EVENTS,
                {"event": "checkpoint", "step": self.step, "path": str(final), "time": time.time()},
            )
        self.dist.barrier()

    def _load(self, folder: Path) -> None:
        """Every process loads the same checkpoint (the state is replicated), whatever the world size that saved it."""
        if not (folder / "ppo_state.pt").is_file():
            raise UserError(
                "--resume",
                f"{folder} is not a smolctl ppo checkpoint (no ppo_state.pt)",
                "pass --resume auto or a folder under RUN/checkpoints of a ppo run",
            )
        state = torch.load(folder / "ppo_state.pt", map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["trainable"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.nan_skipped = state["nan_skipped"]
        saved = json.loads((folder / "trainer_state.json").read_text())
        self.step, self.history = saved["global_step"], saved["history"]
