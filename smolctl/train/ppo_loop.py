"""smolctl's PPO loop (the math lives in smolctl.train.ppo): rollout, score, advantages, update, log, checkpoint.

Checkpoints go to RUN/checkpoints/checkpoint-N/ (policy as a Hugging Face folder, value head, optimizer, scheduler,
RNG states, counters), written under a temporary name and renamed, so `--resume auto` finds only complete ones.
The prompt order is a function of the seed and the step, so a resumed run sees the prompts it would have seen.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from smolctl.console import warn
from smolctl.train.ppo import (
    PpoRecipe, Setup, as_chat, clipped_policy_loss, clipped_value_loss, completion_mask, gae, masked_mean,
    reward_trend, token_logprobs_and_entropy, whiten,
)
from smolctl.train.stage import (
    FINAL, StageResult, StepHook, chat_stop_ids, complete_checkpoints, exponential_factor, final_metrics, load_start,
    use_bf16, write_model,
)
from smolctl.train.trackers import open_tracker


class PolicyWithValue(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.value_head.weight, std=1 / math.sqrt(hidden + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          output_hidden_states=True, use_cache=False)
        return out.logits, self.value_head(out.hidden_states[-1].float()).squeeze(-1)


def lr_factor(step: int, *, schedule: str, total: int, warmup: int, decay: float) -> float:
    """The lr multiplier of the recipe's schedule at an optimizer step (PPO steps once per rollout batch)."""
    if schedule == "exponential":
        return exponential_factor(step, warmup, decay)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[schedule]


class PpoLoop:
    def __init__(self, recipe: PpoRecipe, setup: Setup, on_step: StepHook | None):
        self.recipe, self.setup, self.on_step = recipe, setup, on_step
        self.cfg, self.gen, self.training = recipe.ppo, recipe.generation, recipe.training
        bf16 = use_bf16(self.training.precision)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(self.training.seed)
        policy, self.tokenizer = load_start(setup.parent)
        self.reference, _ = load_start(setup.parent, bf16)
        # fp32 weights, bf16 compute: the same mixed precision the Trainer-based stages get from bf16=True.
        self.autocast = partial(torch.autocast, self.device.type, dtype=torch.bfloat16, enabled=bf16)
        self.reference.to(self.device).eval().requires_grad_(False)
        self.model = PolicyWithValue(policy).to(self.device)
        self.stop_ids = chat_stop_ids(self.tokenizer)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.training.lr,
                                           weight_decay=self.training.weight_decay)
        t = self.training
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(
            lr_factor, schedule=t.schedule, total=t.steps, warmup=t.warmup_steps, decay=t.decay))
        self.step, self.nan_skipped, self.history = 0, 0, []
        self._cached_order: tuple = (None, None)
        if setup.resume_from:
            self._load(Path(setup.resume_from))
        self.tracker = open_tracker(setup.run, recipe.logging.report_to, resuming=bool(setup.resume_from),
                                    config=recipe.model_dump(by_alias=True))

    # -- the loop -------------------------------------------------------------------------------------------

    def train(self) -> StageResult:
        started = time.perf_counter()
        while self.step < self.training.steps:
            batch = self.rollout(self.next_prompts())
            stats = self.update(batch) if batch is not None else {"skipped_batch": 1.0}
            self.step += 1
            self.scheduler.step()
            self.log({**stats, "lr": self.scheduler.get_last_lr()[0], "nan_rewards_skipped": self.nan_skipped})
            if self.step % self.recipe.checkpoint.every == 0 or self.step == self.training.steps:
                self.save_checkpoint()
        self.tracker.close()
        seconds = time.perf_counter() - started
        components = tuple(f"rewards/{name}" for name in self.setup.reward.names)
        metrics = {**reward_trend([r["reward"] for r in self.history if "reward" in r]),
                   **final_metrics(self.history, (*components, "kl", "policy_loss", "value_loss", "entropy",
                                                  "clipfrac", "completion_length")),
                   "nan_rewards_skipped": self.nan_skipped}
        data = {"prompts": len(self.setup.prompts), "algorithm": "ppo"}
        write_model(self.setup.run, self.model.policy, self.tokenizer, parent=self.setup.parent,
                    data_inputs=self.setup.source.lineage(), stage="ppo",
                    stats={**{k.replace("/", "_"): v for k, v in metrics.items()}, **data, "steps": self.step,
                           "seconds": round(seconds, 2)})
        return StageResult("ppo", str(self.setup.run), str(self.setup.run / FINAL), str(self.setup.parent), self.step,
                           seconds, self.setup.resume_from, metrics, data)

    def next_prompts(self) -> list[int]:
        """Indices of this step's prompts: a seeded permutation per pass over the data, cycled."""
        n, size = len(self.setup.prompts), self.cfg.batch_size
        return [int(self._order(position // n)[position % n])
                for position in range(self.step * size, (self.step + 1) * size)]

    def _order(self, epoch: int):
        if self._cached_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.training.seed + epoch)
            self._cached_order = (epoch, torch.randperm(len(self.setup.prompts), generator=generator))
        return self._cached_order[1]

    # -- rollout: generate, score, evaluate old/reference log-probs and values --------------------------------

    @torch.no_grad()
    def rollout(self, indices: list[int]) -> dict | None:
        prompts = [self.setup.prompts[i] for i in indices]
        texts = [self.tokenizer.apply_chat_template(as_chat(p), tokenize=False, add_generation_prompt=True)
                 if self.chat else p for p in prompts]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=False).to(self.device)
        self.model.eval()
        with self.autocast():
            sequences = self.model.policy.generate(
                **enc, max_new_tokens=self.gen.max_new_tokens, do_sample=True, temperature=self.gen.temperature,
                top_k=0, top_p=1.0, eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id)
        prompt_len = enc["input_ids"].shape[1]
        completion = sequences[:, prompt_len:]
        mask = completion_mask(completion, self.stop_ids)
        lengths = mask.sum(1).long().tolist()
        decoded = [self.tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(completion, lengths)]
        scored = self.setup.reward.score(decoded, lengths, [self.setup.references[i] for i in indices])
        scores = torch.tensor(scored.totals, dtype=torch.float32, device=self.device)
        keep = torch.isfinite(scores)
        self.nan_skipped += int((~keep).sum())
        if not keep.any():
            return None
        attention = torch.cat([enc["attention_mask"], mask.long()], dim=1)[keep]
        batch = {"sequences": sequences[keep], "attention": attention, "mask": mask[keep], "prompt_len": prompt_len,
                 "scores": scores[keep]}
        batch["old_logprobs"], _, batch["old_values"] = self.evaluate(self.model, batch)
        batch["ref_logprobs"], _, _ = self.evaluate(self.reference, batch)
        kl = (batch["old_logprobs"] - batch["ref_logprobs"]) * batch["mask"]
        rewards = -self.cfg.kl_coef * kl
        last = (batch["mask"].sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(last)), last] += batch["scores"]
        advantages, batch["returns"] = gae(rewards, batch["old_values"] * batch["mask"], batch["mask"],
                                           self.cfg.gamma, self.cfg.lam)
        batch["advantages"] = whiten(advantages, batch["mask"])
        batch["rollout_stats"] = {
            "reward": float(batch["scores"].mean()), "kl": float(kl.sum(1).mean()),
            "completion_length": float(batch["mask"].sum(1).mean()),
            **{f"rewards/{name}": _finite_mean(values, keep.tolist()) for name, values in scored.components.items()},
        }
        return batch

    def evaluate(self, model: nn.Module, batch: dict, rows=slice(None)):
        """Log-probs, entropies and values (None for the reference) of the completion tokens: each [B, T]."""
        sequences, attention, start = batch["sequences"][rows], batch["attention"][rows], batch["prompt_len"]
        with self.autocast():
            if isinstance(model, PolicyWithValue):
                logits, values = model(sequences, attention)
                values = values[:, start - 1:-1].float()
            else:
                positions = (attention.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions,
                               use_cache=False).logits
                values = None
        logits = logits[:, start - 1:-1] / self.gen.temperature
        logprobs, entropy = token_logprobs_and_entropy(logits, sequences[:, start:])
        return logprobs, entropy, values

    # -- update: epochs of minibatches, micro-batched -------------------------------------------------------

    def update(self, batch: dict) -> dict:
        self.model.train()
        size = len(batch["scores"])
        minibatch, micro = min(self.cfg.minibatch_size, size), self.training.micro_batch
        totals: dict[str, list[float]] = {}
        for _ in range(self.cfg.epochs):
            order = torch.randperm(size)
            for start in range(0, size, minibatch):
                rows = order[start:start + minibatch]
                self.optimizer.zero_grad(set_to_none=True)
                for chunk in rows.split(micro):
                    losses = self.losses(batch, chunk)
                    (losses["loss"] * len(chunk) / len(rows)).backward()
                    for key, value in losses.items():
                        totals.setdefault(key, []).append(float(value.detach()))
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.training.max_grad_norm)
                self.optimizer.step()
        return {**batch["rollout_stats"], **{k: sum(v) / len(v) for k, v in totals.items()}}

    def losses(self, batch: dict, rows) -> dict:
        mask = batch["mask"][rows]
        logprobs, entropy, values = self.evaluate(self.model, batch, rows)
        policy_loss, clipfrac = clipped_policy_loss(logprobs, batch["old_logprobs"][rows], batch["advantages"][rows],
                                                    mask, self.cfg.clip)
        value_loss = clipped_value_loss(values, batch["old_values"][rows], batch["returns"][rows], mask, self.cfg.vf_clip)
        mean_entropy = masked_mean(entropy, mask)
        loss = policy_loss + self.cfg.vf_coef * value_loss - self.cfg.ent_coef * mean_entropy
        return {"loss": loss, "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                "entropy": mean_entropy.detach(), "clipfrac": clipfrac.detach()}

    # -- logging and checkpoints ----------------------------------------------------------------------------

    def log(self, stats: dict) -> None:
        record = {"step": self.step, **{k: v for k, v in stats.items() if math.isfinite(v)}}
        self.history.append(record)
        self.setup.run.mkdir(parents=True, exist_ok=True)
        with open(self.setup.run / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.tracker.log({f"train/{k}": v for k, v in record.items() if k != "step"}, self.step)
        if self.on_step is not None:
            self.on_step(self.step, self.training.steps, record)

    def save_checkpoint(self) -> None:
        folder = self.setup.run / "checkpoints"
        final = folder / f"checkpoint-{self.step}"
        tmp = folder / f".checkpoint-{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.policy.save_pretrained(str(tmp / "policy"))
        torch.save({"value_head": self.model.value_head.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "nan_skipped": self.nan_skipped,
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp / "ppo_state.pt")
        # trainer_state.json last: its presence marks a complete checkpoint (the same rule as the Trainer's).
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": self.step, "history": self.history}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(folder)[:-self.recipe.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _load(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        policy_dir = folder / "policy"
        if not (folder / "ppo_state.pt").is_file() or not policy_dir.is_dir():
            warn(f"{folder} is not a PPO checkpoint; starting from the checkpoint weights only")
            return
        policy = AutoModelForCausalLM.from_pretrained(str(policy_dir), local_files_only=True,
                                                      dtype=self.model.policy.dtype)
        self.model.policy.load_state_dict(policy.state_dict())
        state = torch.load(folder / "ppo_state.pt", weights_only=False)
        self.model.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.nan_skipped = state["nan_skipped"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        saved = json.loads((folder / "trainer_state.json").read_text())
        self.step, self.history = saved["global_step"], saved["history"]


def _finite_mean(values: list[float], keep: list[bool]) -> float:
    kept = [v for v, k in zip(values, keep) if k and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan
