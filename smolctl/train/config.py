"""The one recipe schema of every training command: one pydantic section per TOML table, each field with its unit
or reason.

    smolctl pretrain recipes/smollm3-tiny.toml --dry-run

The shared tables [model] [data] [optimizer] [schedule] [training] [checkpoint] [logging] [guards] [peft] mean
the same in pretrain, midtrain, sft, dpo, ppo and grpo; each command adds its own table ([sft] [dpo] [ppo] [grpo]).
[data] names what the command reads (packed folders, a chat set, preference pairs, prompts), so its keys follow
the data. Validation happens here, when the recipe is built, so every mistake is reported with its key path
before any model is built or any data is read: a key that moved names its new place, a key another command reads
names that command. `derive_batch` turns the batch keys into the numbers the loop uses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from smolctl.errors import UserError
from smolctl.recipe import RecipePath, Section, apply_overrides, load_toml, validate
from smolctl.train.rewards import RewardSection


class ModelSection(Section):
    """pretrain: the architecture to build (any causal LM transformers knows; SmolLM3 by default: GQA, NoPE every
    4th layer, tied embeddings). Every later stage: the checkpoint to start from, whose architecture it keeps."""

    model_config = ConfigDict(populate_by_name=True)
    from_: RecipePath | None = Field(None, alias="from")
    """Starting checkpoint of midtrain, sft, dpo, ppo, grpo: a model folder or a run folder (its final/);
    --from wins."""
    architecture: str = "smollm3"
    """A transformers `model_type` with a causal-LM head: smollm3, llama, qwen3, mistral, ..."""
    tokenizer: RecipePath | None = None
    """Tokenizer folder or hub id; default: the one recorded in the packed data's manifest."""
    vocab_size: int | None = Field(None, gt=0)
    """Embedding rows; default: the tokenizer's length. Set it to pad the vocabulary (e.g. to a multiple of 128)."""
    hidden_size: int | None = Field(None, gt=0)
    intermediate_size: int | None = Field(None, gt=0)
    num_hidden_layers: int | None = Field(None, gt=0)
    num_attention_heads: int | None = Field(None, gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    """GQA groups; default: as many as attention heads (plain multi-head attention)."""
    rope_theta: float = Field(50_000.0, gt=0)
    """RoPE base. Raise it with training.seq_len for long-context extension (SmolLM3: 50k → 2M → 5M)."""
    no_rope_layer_interval: int = Field(4, gt=0)
    """SmolLM3 only: every n-th layer has no rotary embedding (NoPE)."""
    tie_word_embeddings: bool = True
    initializer_range: float = Field(0.02, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    config: dict[str, Any] = {}
    """Any further keys of the architecture's transformers config (e.g. sliding_window)."""

    def architecture_keys(self) -> list[str]:
        """The keys that describe an architecture, as the recipe gave them (post-training keeps the checkpoint's)."""
        return sorted(self.model_fields_set - {"from_", "tokenizer"})

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.hidden_size is None or self.num_attention_heads is None:
            return self
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads} "
                f"— use a head count that divides {self.hidden_size}"
            )
        if self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads} — use a key/value head count that divides "
                f"{self.num_attention_heads}"
            )
        return self


class DataStage(Section):
    start_step: int = Field(0, ge=0)
    """The optimizer step from which this stage's mixture is sampled (nanotron-style stage switching)."""
    paths: list[RecipePath] = Field(min_length=1)
    """Packed folders written by `smolctl pack`."""
    weights: list[float] | None = None
    """Sampling weights over `paths` (normalised); default: proportional to each folder's rows."""

    @model_validator(mode="after")
    def _weights_match(self) -> DataStage:
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                raise ValueError(f"weights has {len(self.weights)} entries but paths has {len(self.paths)}")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be non-negative with a positive sum")
        return self


class DataSection(Section):
    paths: list[RecipePath] | None = None
    """One stage: packed folders sampled for the whole run. Use [[data.stages]] for a schedule of mixtures."""
    weights: list[float] | None = None
    stages: list[DataStage] | None = None
    validation: RecipePath | None = None
    """A packed folder held out for evaluation."""
    validation_interval: int = Field(0, ge=0)
    """Evaluate every n steps (0: only at the end when a validation folder is given)."""
    validation_batches: int = Field(8, gt=0)
    """Micro batches per evaluation (the first ones of the folder, so evaluations are comparable)."""

    @model_validator(mode="after")
    def _one_layout(self) -> DataSection:
        if (self.paths is None) == (self.stages is None):
            raise ValueError("give either paths (one stage) or [[data.stages]], not both or neither")
        if self.stages is not None:
            starts = [s.start_step for s in self.stages]
            if not starts or starts[0] != 0 or starts != sorted(set(starts)):
                raise ValueError(f"stage start_step values must begin at 0 and increase, got {starts}")
        return self

    def stage_list(self) -> list[DataStage]:
        if self.stages is not None:
            return self.stages
        return [DataStage(start_step=0, paths=list(self.paths or []), weights=self.weights)]

    def all_paths(self) -> list[str]:
        return list(dict.fromkeys(p for stage in self.stage_list() for p in stage.paths))


class OptimizerSection(Section):
    """AdamW; no weight decay on embeddings, norms and biases."""

    lr: float = Field(gt=0)
    """Peak learning rate (the schedule scales it)."""
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.95], min_length=2, max_length=2)
    """AdamW's moment decays, each in [0, 1): torch takes 1.0 or more and trains on moments that never decay."""
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0: no clipping, the norm is still measured)."""


class ScheduleSection(Section):
    """The learning rate over the run, the same function in every command (smolctl.train.schedule)."""

    kind: Literal["wsd", "cosine", "constant", "exponential"] = "wsd"
    """wsd: warmup, stable, decay at the end; cosine; constant; exponential: lr · decay_rate^step after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from lr/warmup_steps to the peak."""
    decay_steps: int | None = Field(None, ge=0)
    """wsd: length of the final decay in steps (exclusive with decay_fraction)."""
    decay_fraction: float | None = Field(None, ge=0, le=1)
    """wsd: length of the final decay as a fraction of all steps (1.0: decay from the end of warmup)."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"
    decay_rate: float = Field(0.9995, gt=0, le=1)
    """exponential: the lr multiplier per step (the smol training playbook's DPO schedule uses 0.9995)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The lowest lr, as a fraction of the peak (cosine, wsd and exponential)."""

    @model_validator(mode="after")
    def _one_decay_length(self) -> ScheduleSection:
        if self.decay_steps is not None and self.decay_fraction is not None:
            raise ValueError("give decay_steps or decay_fraction, not both")
        # A key the kind never reads would be ignored without a word (a cosine run "decaying" over decay_steps).
        unused = [
            key for key in sorted(self.model_fields_set) if self.kind not in _SCHEDULE_KEY_KINDS.get(key, (self.kind,))
        ]
        if unused:
            raise ValueError(
                f"{', '.join(unused)}: not used by kind = {self.kind!r} "
                f"(only by {' / '.join(repr(k) for k in _SCHEDULE_KEY_KINDS[unused[0]])}): remove it from the recipe or change the kind"
            )
        return self


# Which schedule kinds read each key that not all of them read.
_SCHEDULE_KEY_KINDS = {
    "decay_steps": ("wsd",),
    "decay_fraction": ("wsd",),
    "decay_shape": ("wsd",),
    "decay_rate": ("exponential",),
    "min_lr_ratio": ("wsd", "cosine", "exponential"),
}


class TrainingSection(Section):
    steps: int | None = Field(None, gt=0)
    """Optimizer steps (ppo and grpo: rollout batches); pretrain may give `tokens` instead."""
    tokens: int | None = Field(None, gt=0)
    """pretrain / midtrain: the token budget, from which the steps are derived."""
    seq_len: int | None = Field(None, gt=0)
    """pretrain / midtrain: must equal the packed folders' seq_len (post-training: the command's max_length)."""
    micro_batch: int = Field(gt=0)
    """Sequences (rows, pairs, completions) per forward/backward on one device."""
    global_batch: int | None = Field(None, gt=0)
    """Sequences per optimizer step over all devices (default: micro_batch × world size, no accumulation)."""
    global_batch_tokens: int | None = Field(None, gt=0)
    """pretrain / midtrain: the global batch in tokens (exclusive with global_batch)."""
    seed: int = 42
    """Seeds the weights (pretrain) and the data order."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 autocast on GPU (fp32 master weights), fp32 on CPU."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute in backward instead of keeping activations. full: each decoder layer keeps only its input;
    selective: each layer keeps its matmul and attention outputs and recomputes norms, activations and RoPE
    (torchtitan's op-level policy)."""
    compile: bool = False
    """torch.compile each decoder layer (first steps are slower while it compiles)."""
    shard: bool = False
    """Under torchrun: FSDP2 fully_shard instead of DDP (parameters, gradients and optimizer state sharded)."""
    attention: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    loss_chunk_tokens: int = Field(4096, gt=0)
    """Tokens per chunk of the LM head + cross-entropy: only one chunk's fp32 logits exist at a time, and they
    are recomputed in backward (4096 tokens × 128k vocabulary = 2 GiB)."""

    @field_validator("tokens", "global_batch_tokens", mode="before")
    @classmethod
    def _token_count(cls, value):
        """Token counts as the playbook writes them: "11T", "2.36M", "100B" (= "100G"), beside plain integers."""
        if not isinstance(value, str):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGbBtT])\s*", value)
        if match is None:
            return value  # refused as not an int, with the hint
        count = Decimal(match[1]) * 10 ** (3 * "KMGT".index(match[2].upper().replace("B", "G")) + 3)
        if count != int(count):
            raise ValueError(f"{value!r} is not a whole number of tokens")
        return int(count)

    @model_validator(mode="after")
    def _budget_and_batch(self) -> TrainingSection:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("give either steps or tokens")
        if self.global_batch is not None and self.global_batch_tokens is not None:
            raise ValueError("give either global_batch (sequences) or global_batch_tokens, not both")
        return self


class ParallelSection(Section):
    """The device mesh (dp_replicate, dp_shard, tp), torchtitan style: world size = dp_replicate × dp_shard × tp."""

    tp: int = Field(1, gt=0)
    """Tensor-parallel degree: each decoder layer's matmuls split over tp ranks (the model's base_model_tp_plan).
    Keep it within a node; it must divide the attention and KV heads."""
    dp_shard: int | None = Field(None, gt=0)
    """FSDP2 degree: ranks that shard parameters, gradients and optimizer state. Default: all remaining ranks when
    training.shard is true or tp > 1, else 1."""
    dp_replicate: int | None = Field(None, gt=0)
    """Ranks that hold replicas (DDP, or HSDP across nodes with dp_shard within one). Default: the rest."""


class CheckpointSection(Section):
    interval: int = Field(1000, ge=0)
    """Save every n steps into RUN/checkpoints/step-NNNNNNN (0: only the final model)."""
    keep: int = Field(3, gt=0)
    """How many of the newest checkpoints to keep (the last step always gets one, so `final/` can be rebuilt)."""
    async_save: bool = True
    """Copy the state to CPU memory and write it in a background thread while training continues (one save in
    flight); false: the loop waits for every write."""
    export_interval: int = Field(0, ge=0)
    """Also write a Hugging Face folder RUN/exports/step-NNNNNNN every n steps, in the background (0: never;
    `smolctl export` makes one from any checkpoint on demand)."""


class LoggingSection(Section):
    interval: int = Field(10, gt=0)
    """Steps between lines in RUN/metrics.jsonl and on the console."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = []
    """Trackers beside metrics.jsonl (always written), offline: RUN/tensorboard, RUN/wandb, trackio's local store."""
    profile_interval: int = Field(100, ge=0)
    """With several processes, profile one step every n steps for the communication share (0: never)."""
    completions_interval: int = Field(0, ge=0)
    """ppo / grpo: every n steps, write the step's completions (prompt, completion, each reward, total, advantage)
    to RUN/completions.jsonl (0: never)."""


class GuardsSection(Section):
    spike_window: int = Field(100, ge=8)
    """Recent losses the spike detector compares against."""
    spike_zscore: float = Field(6.0, gt=0)
    """Robust z-score (median / MAD) above which a loss is a spike."""
    max_bad_steps: int = Field(5, gt=0)
    """After this many consecutive bad steps (non-finite or spike) roll back to the last checkpoint."""
    max_rollbacks: int = Field(3, ge=0)
    """Give up (exit 1) after this many incidents (each one rollback) in one run."""
    inject_nan_batches: list[int] = []
    """Fault drill: the loss of these batches (1-based) is made NaN, to rehearse the guards."""


class PeftSection(Section):
    """LoRA through peft: the table's presence trains low-rank adapters instead of all weights (sft, dpo, grpo, the
    PPO policy). RUN/final holds the merged model; RUN/adapter keeps the adapter alone."""

    r: int = Field(16, gt=0)
    """Rank of the update matrices."""
    alpha: float = Field(32, gt=0)
    """Scale of the update: alpha / r multiplies it."""
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (e.g. ["q_proj", "v_proj"]), or every linear layer but the output head."""


# ---------------------------------------------------------------------------------------------------------------
# What post-training reads: [data] per kind of data, and each command's own table


class ChatDataSection(Section):
    path: RecipePath
    """Dataset folder with a `messages` column (chat turns) or `prompt` and `completion` columns."""
    balance_by: str | None = None
    """Column naming each row's category (e.g. "task"): every category gets the same share of the rows."""
    balance: Literal["cap", "upsample"] = "cap"
    """cap: trim every category to the smallest one's size; upsample: repeat rows of the smaller ones up to the
    largest."""
    limit: int | None = Field(None, gt=0)
    """Use at most this many rows (after balancing)."""


class PreferenceDataSection(Section):
    path: RecipePath
    """Dataset folder with `prompt`, `chosen`, `rejected` columns (strings or chat turns)."""
    limit: int | None = Field(None, gt=0)


class PromptDataSection(Section):
    path: RecipePath
    """Dataset folder of prompts."""
    prompt_column: str = "prompt"
    reference_column: str = "reference"
    """What task rewards compare against (exact / regex with {reference}); optional for other rewards."""
    limit: int | None = Field(None, gt=0)


DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


class SftSection(Section):
    max_length: int = Field(1024, gt=0)
    """Tokens per packed row (bfd) or per example (none)."""
    packing: Literal["bfd", "padding_free", "none"] = "bfd"
    """bfd: best-fit-decreasing packing, attention kept inside each example through position ids (SmolLM3's
    choice); padding_free: examples concatenated per batch, no truncation; none: one padded example per row."""
    assistant_only_loss: bool = True
    """Train on the assistant turns only. A template without {% generation %} markers is patched by TRL when it
    knows it (ChatML, Llama 3, Qwen, Gemma, ...)."""
    loss_type: Literal["nll", "dft"] = "nll"


class DpoSection(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the pull towards the reference model (SmolLM3 used APO-zero with beta 0.05)."""
    loss_type: Literal[DPO_LOSSES] = "sigmoid"  # type: ignore[valid-type]
    max_length: int = Field(1024, gt=0)
    """Tokens of prompt + answer; longer pairs are truncated."""
    precompute_ref_log_probs: bool = False
    """Score the whole dataset with the reference model once up front, then free it (saves memory per step)."""


class PpoSection(Section):
    batch_size: int = Field(64, gt=0)
    """Completions (rollouts) per step."""
    epochs: int = Field(3, gt=0)
    """Passes over each batch."""
    minibatch_size: int = Field(16, gt=0)
    """Completions per optimizer update."""
    clip: float = Field(0.2, gt=0)
    """Clip range of the probability ratio."""
    vf_coef: float = Field(0.1, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    ent_coef: float = Field(0.01, ge=0)
    kl_coef: float = Field(0.05, ge=0)
    """Per-token KL penalty against the reference."""
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; the rollout samples with temperature and top_p only, whatever the checkpoint's
    generation_config says."""
    critic_lr: float | None = Field(None, gt=0)
    """Learning rate of the value head (its own parameter group). Default: 10 × optimizer.lr, at least 1e-4, since
    a freshly initialised head learns nothing at a policy's 1e-6."""
    critic_warmup_steps: int = Field(0, ge=0)
    """First steps that train only the value head (the policy and its backbone stay as they are)."""
    scoring_micro_batch: int | None = Field(None, gt=0)
    """Completions per forward when scoring a rollout (old and reference log-probabilities, values).
    Default: training.micro_batch."""
    generation_micro_batch: int | None = Field(None, gt=0)
    """Prompts per `generate` call (bounds the KV cache). Each call samples from its own seed (training.seed, the
    step, the call's first prompt in the step's batch), so when it divides batch_size / processes a rollout is the
    same whatever the number of processes sharing it. Default: the process's whole share of batch_size."""

    def critic_learning_rate(self, policy_lr: float) -> float:
        return self.critic_lr if self.critic_lr is not None else max(10 * policy_lr, 1e-4)


class GrpoSection(Section):
    """TRL's GRPOTrainer: training.global_batch completions per step, in groups of num_generations per prompt."""

    num_generations: int = Field(8, ge=2)
    """Completions per prompt; rewards are normalised within each group."""
    epochs: int = Field(1, gt=0)
    """Passes over each generation batch (TRL's num_iterations)."""
    clip: float = Field(0.2, gt=0)
    """Clip range of the probability ratio (TRL's epsilon)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty against the reference (TRL's beta; 0 loads no reference model)."""
    ent_coef: float = Field(0.0, ge=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    mask_truncated_completions: bool = False
    """Leave completions cut off at max_new_tokens out of the loss (TRL's option of the same name)."""
    use_vllm: bool = False
    """Generate with vLLM inside the training processes (TRL's colocate mode): GPU only, needs the vllm package."""


# ---------------------------------------------------------------------------------------------------------------
# The recipes


class _Recipe(Section):
    """The tables every training command shares."""

    model: ModelSection = ModelSection()
    optimizer: OptimizerSection
    schedule: ScheduleSection = ScheduleSection()
    training: TrainingSection
    parallel: ParallelSection = ParallelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()


class TrainRecipe(_Recipe):
    """pretrain and midtrain."""

    data: DataSection
    guards: GuardsSection = GuardsSection()

    @model_validator(mode="after")
    def _architecture_and_length(self) -> TrainRecipe:
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if getattr(self.model, k) is None
        ]
        if missing:
            raise ValueError(f"[model] needs {', '.join(missing)} (pretrain builds the model from them)")
        if self.training.seq_len is None:
            raise ValueError("training.seq_len is required (the packed folders' sequence length)")
        return self


class PostTrainRecipe(_Recipe):
    """sft, dpo, ppo, grpo: the architecture and tokenizer come from the starting checkpoint."""

    peft: PeftSection | None = None

    @model_validator(mode="after")
    def _from_checkpoint(self) -> PostTrainRecipe:
        given = self.model.architecture_keys()
        if given:
            raise ValueError(
                f"[model] {', '.join(given)}: post-training keeps the starting checkpoint's architecture "
                "and tokenizer — keep only model.from"
            )
        if self.training.tokens is not None or self.training.seq_len is not None or self.training.global_batch_tokens:
            raise ValueError(
                "post-training counts training.steps and sequences: tokens, seq_len and "
                "global_batch_tokens are pretrain keys"
            )
        if self.training.activation_checkpointing == "selective":
            raise ValueError(
                'training.activation_checkpointing = "selective" is pretrain\'s op-level policy; '
                'post-training recomputes whole layers: use "full" or "none"'
            )
        return self


class SftRecipe(PostTrainRecipe):
    data: ChatDataSection
    sft: SftSection = SftSection()


class DpoRecipe(PostTrainRecipe):
    data: PreferenceDataSection
    dpo: DpoSection = DpoSection()


class PpoRecipe(PostTrainRecipe):
    data: PromptDataSection
    ppo: PpoSection = PpoSection()
    rewards: list[RewardSection] = Field(default_factory=list)


class GrpoRecipe(PostTrainRecipe):
    data: PromptDataSection
    grpo: GrpoSection = GrpoSection()
    rewards: list[RewardSection] = Field(default_factory=list)


RECIPES: dict[str, type[_Recipe]] = {
    "pretrain": TrainRecipe,
    "midtrain": TrainRecipe,
    "sft": SftRecipe,
    "dpo": DpoRecipe,
    "ppo": PpoRecipe,
    "grpo": GrpoRecipe,
}

# Keys of the two stacks before they became one: each names where it lives now.
MOVED_KEYS = {
    "checkpoint.every": "checkpoint.interval",
    "training.lr": "optimizer.lr",
    "training.weight_decay": "optimizer.weight_decay",
    "training.max_grad_norm": "optimizer.grad_clip",
    "training.schedule": "schedule.kind",
    "training.warmup_steps": "schedule.warmup_steps",
    "training.decay": "schedule.decay_rate",
    "training.gradient_checkpointing": 'training.activation_checkpointing ("full", "selective" or "none")',
    "training.grad_accum": "training.global_batch (sequences per step; accumulation is derived)",
    "generation.max_new_tokens": "ppo.max_new_tokens or grpo.max_new_tokens",
    "generation.temperature": "ppo.temperature or grpo.temperature",
    "algorithm": "its own command: smolctl grpo RECIPE RUN with a [grpo] table",
    "output": "the RUN argument: smolctl COMMAND RECIPE RUN",
}
# Tables only some commands read: a recipe of another command that has them would be silently half-obeyed.
READ_BY = {
    "guards": ("pretrain", "midtrain"),
    "peft": ("sft", "dpo", "ppo", "grpo"),
    "sft": ("sft",),
    "dpo": ("dpo",),
    "ppo": ("ppo",),
    "grpo": ("grpo",),
    "rewards": ("ppo", "grpo"),
}


def check_keys(raw: dict, command: str, source: str | Path) -> None:
    """Refuse a key that moved (naming its new place) or a table this command does not read (naming who does)."""
    for old, new in MOVED_KEYS.items():
        table, _, key = old.rpartition(".")
        node = raw.get(table) if table else raw
        if isinstance(node, dict) and key in node:
            raise UserError(source, f"{old} moved to {new}", "rename it in the recipe (README: one recipe schema)")
    if command == "grpo" and "ppo" in raw:
        raise UserError(
            source,
            "[ppo] is read by smolctl ppo; grpo reads [grpo] (num_generations, epochs, clip, "
            "kl_coef, max_new_tokens, temperature) and training.global_batch",
            "move the keys to [grpo]",
        )
    for table, readers in READ_BY.items():
        if table in raw and command not in readers:
            raise UserError(
                source,
                f"[{table}] is read by {' and '.join(readers)}, not by {command}",
                f"remove the table, or run smolctl {readers[0]}",
            )


def load_command_recipe(command: str, path: str | Path, overrides: Sequence[str] = ()) -> _Recipe:
    """The recipe of a training command, with --set overrides applied, its keys checked and validated."""
    raw = apply_overrides(load_toml(path), overrides)
    check_keys(raw, command, path)
    return validate(RECIPES[command], raw, path)


@dataclass(frozen=True)
class Layout:
    """How the world is cut: rank = (replica · dp_shard + shard) · tp + tp_rank, so TP groups are neighbours."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data; the tp ranks of one group read the same micro batch."""
        return self.dp_replicate * self.dp_shard


def split_world(world_size: int, parallel: ParallelSection, sharded: bool) -> Layout:
    """The [parallel] mesh of `world_size` processes: dp_replicate × dp_shard × tp (unset degrees take the rest)."""
    tp = parallel.tp
    if world_size % tp:
        raise UserError(
            "parallel.tp",
            f"{tp} does not divide the world size {world_size}",
            f"use a tp that divides {world_size}, or launch a multiple of {tp} processes",
        )
    rest = world_size // tp
    replicate, shard = parallel.dp_replicate, parallel.dp_shard
    if replicate is None and shard is None:
        return Layout(1, rest, tp) if sharded or tp > 1 else Layout(rest, 1, tp)
    given_key, given = ("parallel.dp_shard", shard) if shard is not None else ("parallel.dp_replicate", replicate)
    if replicate is not None and shard is not None:
        if replicate * shard != rest:
            raise UserError(
                "parallel",
                f"dp_replicate {replicate} × dp_shard {shard} × tp {tp} = {replicate * shard * tp} "
                f"processes, but the world size is {world_size}",
                f"make dp_replicate × dp_shard = {rest}, or leave one of them unset",
            )
        return Layout(replicate, shard, tp)
    if rest % given:
        raise UserError(
            given_key,
            f"{given} does not divide the {rest} ranks left by tp {tp} in a world of {world_size}",
            f"use a divisor of {rest}, or leave it unset",
        )
    return Layout(rest // given, given, tp) if shard is not None else Layout(given, rest // given, tp)


def resolve_layout(recipe: TrainRecipe, world_size: int) -> Layout:
    """The mesh for `world_size` processes, checked against the model: TP splits heads, so tp must divide both
    the attention heads and the KV heads."""
    model, tp = recipe.model, recipe.parallel.tp
    for key, heads in (
        ("num_attention_heads", model.num_attention_heads),
        ("num_key_value_heads", model.num_key_value_heads or model.num_attention_heads),
    ):
        if heads % tp:
            raise UserError(
                "parallel.tp",
                f"{tp} does not divide model.{key} = {heads}",
                f"use a tp that divides {heads} (e.g. {max(d for d in range(1, tp + 1) if heads % d == 0)})",
            )
    return split_world(world_size, recipe.parallel, recipe.training.shard)


@dataclass(frozen=True)
class BatchPlan:
    """The numbers the loop runs on, derived once and printed: nothing is re-derived later."""

    world_size: int
    micro_batch: int
    global_batch: int  # sequences per optimizer step
    grad_accum: int  # micro batches per data-parallel rank per step
    seq_len: int
    steps: int
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.data_parallel


def global_batch_and_accumulation(
    training: TrainingSection, world_size: int, seq_len: int | None = None, layout: Layout | None = None
) -> tuple[int, int]:
    """(sequences per optimizer step, micro batches per data-parallel rank per step) for this layout: only
    data-parallel ranks split the batch, TP ranks share theirs. UserError when they do not divide, naming the keys."""
    layout = layout or Layout(world_size, 1, 1)
    if training.global_batch_tokens is not None and seq_len:
        if training.global_batch_tokens % seq_len:
            raise UserError(
                "training.global_batch_tokens",
                f"{training.global_batch_tokens} is not a multiple of seq_len {seq_len}",
                "use a multiple of training.seq_len, or give training.global_batch in sequences",
            )
        global_batch = training.global_batch_tokens // seq_len
    else:
        global_batch = training.global_batch or training.micro_batch * layout.data_parallel
    dp = layout.data_parallel
    per_pass = training.micro_batch * dp
    if global_batch % per_pass:
        ranks = f"data-parallel size {dp}" + (f" (world {world_size} / tp {layout.tp})" if layout.tp > 1 else "")
        raise UserError(
            "training.global_batch",
            f"{global_batch} sequences is not divisible by micro_batch {training.micro_batch} × {ranks} = {per_pass}",
            f"use a multiple of {per_pass}, or change training.micro_batch or parallel.tp",
        )
    return global_batch, global_batch // per_pass


def derive_batch(
    training: TrainingSection, schedule: ScheduleSection, world_size: int, layout: Layout | None = None
) -> BatchPlan:
    """Global batch → gradient accumulation for this layout; token budget → steps. UserError when they do not
    divide, naming the keys to change."""
    layout = layout or Layout(world_size, 1, 1)
    global_batch, grad_accum = global_batch_and_accumulation(training, world_size, training.seq_len, layout)
    steps = (
        training.steps if training.steps is not None else -(-int(training.tokens) // (global_batch * training.seq_len))
    )
    decay = schedule.decay_steps or 0
    if schedule.warmup_steps + decay > steps:
        raise UserError(
            "schedule",
            f"warmup_steps {schedule.warmup_steps} + decay_steps {decay} exceed the {steps} training steps",
            "shorten the warmup/decay or train longer",
        )
    return BatchPlan(
        world_size,
        training.micro_batch,
        global_batch,
        grad_accum,
        int(training.seq_len),
        steps,
        layout.tp,
        layout.dp_replicate,
        layout.dp_shard,
    )
