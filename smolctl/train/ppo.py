"""Reinforcement learning from rewards with smolctl's own compact PPO (GRPO, through TRL, is smolctl.train.grpo).

  smolctl ppo recipes/ppo-tiny.toml demo-out/ppo --from demo-out/dpo
  torchrun --nproc_per_node 8 -m smolctl ppo recipes/smollm3-ppo.toml runs/ppo --from runs/apo

TRL dropped its PPO trainer (gone from trl.experimental since 1.13), so PPO lives here: the policy with a scalar
value head, a frozen reference (the starting checkpoint) for a per-token KL penalty, rollouts by `generate`,
GAE, the clipped surrogate, a clipped value loss and an entropy bonus, several epochs of minibatches per batch
(the playbook's defaults: batch 64, 3 epochs, clip 0.2, value coefficient 0.1, entropy coefficient 0.01).
The math is smolctl.train.ppo_math; the loop (rollout, score, advantages, update, log, checkpoint) is
smolctl.train.ppo_loop. Under torchrun the processes run data-parallel (DDP): each generates and scores its share
of ppo.batch_size, and the statistics and gradients are those of the whole batch.
"""

from __future__ import annotations

from pathlib import Path

from smolctl.errors import UserError
from smolctl.launcher import world_size_from_env
from smolctl.train.config import PpoRecipe
from smolctl.train.posttrain_run import PostTrainResult, StepHook, finished_result, quiet_offline
from smolctl.train.ppo_loop import PpoLoop
from smolctl.train.rl_setup import prepare
from smolctl.train.run import holds_run_folder


def check_ppo_batch(recipe: PpoRecipe, processes: int) -> None:
    """Each process takes an equal share of every batch and of every minibatch (DDP: the same number of backward
    passes everywhere)."""
    training, ppo = recipe.training, recipe.ppo
    if training.shard or training.compile or training.global_batch:
        raise UserError(
            "training",
            "ppo runs data-parallel (DDP) without FSDP sharding or compile, and counts its batch in ppo.batch_size",
            "remove training.shard, training.compile and training.global_batch",
        )
    if ppo.batch_size % processes:
        raise UserError(
            "ppo.batch_size",
            f"{ppo.batch_size} completions do not split evenly over {processes} processes",
            f"make ppo.batch_size a multiple of {processes}",
        )
    minibatch = min(ppo.minibatch_size, ppo.batch_size)
    if minibatch % processes:
        raise UserError(
            "ppo.minibatch_size",
            f"{minibatch} completions do not split evenly over {processes} processes",
            f"make ppo.minibatch_size a multiple of {processes}",
        )


@holds_run_folder
def run_ppo(
    recipe: PpoRecipe,
    run: str | Path,
    *,
    start: str | None = None,
    resume: str = "none",
    overwrite: bool = False,
    on_step: StepHook | None = None,
) -> PostTrainResult:
    """Train the starting checkpoint on the recipe's rewards with smolctl's PPO (one process, or DDP under
    torchrun / accelerate launch)."""
    check_ppo_batch(recipe, world_size_from_env())
    setup = prepare("ppo", recipe, run, start, resume, overwrite)
    if setup.start.finished:
        return finished_result("ppo", setup.run, setup.start)
    quiet_offline()
    return PpoLoop(recipe, setup, on_step).train()
