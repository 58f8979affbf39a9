"""What sft, dpo, ppo and grpo share: recipe sections, the starting checkpoint, the run folder (checkpoints,
metrics.jsonl, resume) and the finished model folder. The layout is pretrain's:

  RUN/checkpoints/checkpoint-N/   resumable checkpoints (model, optimizer, scheduler, RNG, data position)
  RUN/metrics.jsonl               one JSON object per logged step, appended across resumes
  RUN/recipe.json                 the resolved recipe and starting checkpoint, checked on resume
  RUN/final/                      the finished Hugging Face model folder + tokenizer + manifest.json (kind "model")

RUN/final is written in a staging folder and swapped into place complete; a later stage takes `--from RUN` or
`--from RUN/final`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import ConfigDict, Field

from smolctl.data.tokenizer import IM_END, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from smolctl.recipe import Section
from smolctl.shards import (
    KIND_MODEL, OutputFolder, atomic_write_json, check_output_path, lineage_ref, read_manifest,
)

FINAL = "final"
StepHook = Callable[[int, int, dict], None]
"""Called after every optimizer step with (step, total steps, latest logged metrics)."""

# ---------------------------------------------------------------------------------------------------------------
# Recipe sections shared by the post-training stages


class ModelSection(Section):
    model_config = ConfigDict(populate_by_name=True)
    from_: str | None = Field(None, alias="from")
    """Starting checkpoint: a smolctl model folder or any local Hugging Face model folder (`--from` overrides)."""


class TrainingSection(Section):
    steps: int = Field(60, gt=0)
    """Optimizer steps."""
    micro_batch: int = Field(8, gt=0)
    """Rows per device per forward pass."""
    grad_accum: int = Field(1, gt=0)
    """Micro batches per optimizer step (global batch = micro_batch * grad_accum * world size)."""
    lr: float = Field(1e-5, gt=0)
    schedule: Literal["constant", "linear", "cosine", "exponential"] = "cosine"
    """`exponential` is lr = lr0 * decay**step after warmup (the smol training playbook's DPO schedule)."""
    decay: float = Field(0.9995, gt=0, le=1)
    """Per-step factor of the exponential schedule."""
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto = bf16 autocast on a GPU that supports it, fp32 on CPU. Trained weights stay fp32 (AdamW updates at
    post-training learning rates, ~1e-6 of a weight, vanish in bf16); frozen reference models are held in bf16."""
    gradient_checkpointing: bool = False


class CheckpointSection(Section):
    every: int = Field(50, gt=0)
    """Save a resumable checkpoint every N optimizer steps."""
    keep: int = Field(2, gt=0)
    """Keep only the newest K checkpoints."""


# ---------------------------------------------------------------------------------------------------------------
# Environment


def quiet_offline() -> None:
    """Never reach for the Hub, and keep library chatter (tqdm bars, advisory warnings) off the user's terminal."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Deprecation notices inside transformers/TRL (e.g. gradient_checkpointing → activation_checkpointing) are
    # not something a smolctl user can act on.
    warnings.filterwarnings("ignore", category=FutureWarning)
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def use_bf16(precision: str) -> bool:
    import torch

    if precision == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return precision == "bf16"


# ---------------------------------------------------------------------------------------------------------------
# The starting checkpoint


def check_start(spec: str | None, where: str = "model.from") -> Path:
    """The starting checkpoint: a model folder with a tokenizer, or a run folder holding one in final/.
    Checked before anything heavy loads."""
    if not spec:
        raise UserError(where, "no starting checkpoint", "set [model] from = \"PATH\" in the recipe or pass --from PATH")
    path = Path(spec)
    if not path.is_dir():
        raise UserError(path, "no such folder" if not path.exists() else "is a file, not a model folder",
                        "pass a model folder (the output of pretrain, midtrain, sft or dpo)")
    if not (path / "config.json").is_file() and (path / FINAL / "config.json").is_file():
        path = path / FINAL
    manifest = read_manifest(path)
    if manifest is not None and manifest["kind"] != KIND_MODEL:
        raise UserError(path, f"is a {manifest['kind']} folder, not a model",
                        "pass a checkpoint written by pretrain, sft or dpo")
    if not (path / "config.json").is_file():
        raise UserError(path, "is not a model folder (no config.json)", "pass a Hugging Face model folder or a run folder")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(path, "holds a model but no tokenizer",
                        "save the tokenizer beside the model (tokenizer.save_pretrained)")
    return path


def load_start(path: Path, bf16: bool = False):
    """(model, tokenizer) from a checked model folder, float32 unless bf16 (for frozen models); the tokenizer gets
    a pad token."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                     dtype=torch.bfloat16 if bf16 else torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(path, f"cannot load the model: {str(exc).splitlines()[0][:200]}",
                        "pass a complete Hugging Face model folder") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise UserError(path, f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                        f"{model.get_input_embeddings().num_embeddings}",
                        "pair the model with the tokenizer it was trained with")
    return model, tokenizer


def chat_stop_ids(tokenizer) -> list[int]:
    """Tokens that end a reply: EOS, and the ChatML end-of-turn when the vocabulary has it."""
    ids = [tokenizer.eos_token_id]
    if IM_END in tokenizer.get_vocab() and tokenizer.convert_tokens_to_ids(IM_END) not in ids:
        ids.append(tokenizer.convert_tokens_to_ids(IM_END))
    return ids


def require_chat_template(tokenizer, path: Path, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(path, f"the tokenizer has no chat template, which {why}",
                        "train the tokenizer with `smolctl train-tokenizer` (ChatML) or add a chat_template")


# ---------------------------------------------------------------------------------------------------------------
# The run folder: checkpoints, metrics, resume


def prepare_run(run: Path, resume: str | None, overwrite: bool) -> str | None:
    """Check the run folder before any compute; return the checkpoint to resume from (None: a fresh start)."""
    if run.exists() and not run.is_dir():
        raise UserError(run, "exists and is a file, not a folder", "choose a run folder path")
    checkpoints = run / "checkpoints"
    if resume is None:
        check_output_path(run / FINAL, overwrite)
        if complete_checkpoints(checkpoints) and not overwrite:
            raise UserError(run, "holds checkpoints of an earlier run",
                            "pass --resume auto to continue it, or --overwrite to start over")
        if overwrite and int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one rank clears the old run
            shutil.rmtree(checkpoints, ignore_errors=True)
            (run / "metrics.jsonl").unlink(missing_ok=True)
        return None
    check_output_path(run / FINAL, True)
    if resume == "auto":
        found = complete_checkpoints(checkpoints)
        return str(found[-1]) if found else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UserError("--resume", f"{resume} is not a complete checkpoint (no trainer_state.json)",
                        f"pass --resume auto or a folder under {checkpoints}")
    return str(path)


def record_recipe(run: Path, recipe: dict, start: Path, resume_from: str | None) -> None:
    """Keep the resolved recipe in RUN/recipe.json. A resume must use the same recipe and starting checkpoint:
    only `training.steps` and the [checkpoint] and [logging] tables may change (to train longer, save more often,
    or report elsewhere)."""
    resolved = {**_flatten(recipe), "model.from": str(start.resolve())}
    path = run / "recipe.json"
    if resume_from and path.is_file():
        before = json.loads(path.read_text())
        changed = sorted(key for key in set(before) | set(resolved) if before.get(key) != resolved.get(key)
                         and key != "output" and key != "training.steps"
                         and not key.startswith(("checkpoint.", "logging.")))  # where it saves and reports may change
        if changed:
            raise UserError("--resume", f"the recipe differs from the one the run started with in {', '.join(changed)}",
                            "resume with the same recipe and --from (only training.steps and [checkpoint] may "
                            "change), or start a new run folder")
    if int(os.environ.get("RANK", "0")) == 0:
        run.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, resolved)


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Checkpoint folders, oldest first; a checkpoint is complete once the Trainer wrote its trainer_state.json."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.glob("checkpoint-*") if (p / "trainer_state.json").is_file()
             and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def trainer_arguments(run: Path, training: TrainingSection, checkpoint: CheckpointSection,
                      report_to: Sequence[str] = ()) -> dict[str, Any]:
    """The TrainingArguments every stage shares: our schedule, checkpoints in RUN/checkpoints, the recipe's
    trackers (logging.report_to, offline), no hub, no tqdm."""
    import torch

    from smolctl.train.trackers import trainer_reporting

    bf16 = use_bf16(training.precision)
    schedules = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine",
                 "exponential": "constant"}  # exponential: replaced by ExponentialDecay.create_scheduler
    return dict(
        output_dir=str(run / "checkpoints"), max_steps=training.steps,
        per_device_train_batch_size=training.micro_batch, gradient_accumulation_steps=training.grad_accum,
        learning_rate=training.lr, lr_scheduler_type=schedules[training.schedule], warmup_steps=training.warmup_steps,
        weight_decay=training.weight_decay, max_grad_norm=training.max_grad_norm, seed=training.seed,
        data_seed=training.seed, bf16=bf16, fp16=False, use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=training.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=checkpoint.every, save_total_limit=checkpoint.keep, disable_tqdm=True, **trainer_reporting(run, report_to),
        dataloader_num_workers=0, log_level="error", push_to_hub=False,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; the search costs a graph traversal
    )


def exponential_factor(step: int, warmup_steps: int, decay: float) -> float:
    """lr multiplier: linear warmup, then decay**(steps after warmup)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return decay ** (step - warmup_steps)


def with_schedule(trainer_class: type, training: TrainingSection) -> type:
    """The trainer class, with our exponential decay when the recipe asks for it (transformers has none)."""
    if training.schedule != "exponential":
        return trainer_class
    from functools import partial

    from torch.optim.lr_scheduler import LambdaLR

    factor = partial(exponential_factor, warmup_steps=training.warmup_steps, decay=training.decay)

    class ExponentialDecay(trainer_class):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = LambdaLR(optimizer or self.optimizer, factor)
            return self.lr_scheduler

    ExponentialDecay.__name__ = f"{trainer_class.__name__}WithExponentialDecay"
    return ExponentialDecay


def monitor_callback(run: Path, on_step: StepHook | None):
    """A Trainer callback that appends every log to RUN/metrics.jsonl and reports each step (rank 0 only)."""
    from transformers import TrainerCallback

    class RunMonitor(TrainerCallback):
        def __init__(self) -> None:
            self.latest: dict = {}
            self.history: list[dict] = []
            self.started = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            # The Trainer logs after on_step_end, so the step hook is driven from here to report fresh numbers.
            if not state.is_world_process_zero or not logs:
                return
            record = {"step": state.global_step, "time": round(time.time() - self.started, 3),
                      **{k: v for k, v in logs.items() if isinstance(v, (int, float)) and math.isfinite(v)}}
            self.history.append(record)
            run.mkdir(parents=True, exist_ok=True)
            with open(run / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            if "train_runtime" not in logs:
                self.latest = record
                if on_step is not None:
                    on_step(state.global_step, state.max_steps, record)

    return RunMonitor()


def train_quietly(trainer, resume_from: str | None) -> None:
    """Train, with our monitor as the only reporter: the Trainer's printer would put log dicts on stdout,
    which belongs to --json (trackers that print, like trackio, are sent to stderr)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    with redirect_stdout(sys.stderr):
        trainer.train(resume_from_checkpoint=resume_from)


# ---------------------------------------------------------------------------------------------------------------
# The output model folder


@dataclass
class StageResult:
    """What a post-training run did; the CLI renders it as a table or JSON."""

    stage: str
    run: str
    output: str
    """The finished model folder, RUN/final."""
    parent: str
    steps: int
    seconds: float
    resumed_from: str | None
    metrics: dict = field(default_factory=dict)
    """Final values of the logged metrics (loss, rewards/accuracies, ...)."""
    data: dict = field(default_factory=dict)
    """Rows read, per-group counts and other facts about the data."""


def write_model(run: Path, model, tokenizer, *, parent: Path, data_inputs: list[dict], stage: str,
                stats: dict) -> dict:
    """Save the trained model as RUN/final, an HF folder with its tokenizer and a kind "model" manifest (inputs:
    the data's lineage and the parent checkpoint); returns the manifest.

    The generation config stops at the chat template's end-of-turn token as well as EOS, so the model chats
    with `generate` out of the box."""
    model.generation_config.eos_token_id = chat_stop_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    inputs = [*data_inputs, lineage_ref(parent)]
    output = run / FINAL
    # prepare_run already refused an existing final/ unless --overwrite or --resume said to replace it.
    with OutputFolder(output, kind=KIND_MODEL, overwrite=True, inputs=inputs) as folder:
        model.save_pretrained(str(folder.staging))
        tokenizer.save_pretrained(str(folder.staging))
        if (run / "metrics.jsonl").is_file():
            shutil.copy2(run / "metrics.jsonl", folder.file("metrics.jsonl"))
        for weights in sorted(folder.staging.glob("*.safetensors")):
            folder.add_shard(weights.name, rows=0)
        return folder.commit(stats=stats, parent=str(parent.resolve()), stage=stage,
                             tokenizer={"path": str(output.resolve()), "name": tokenizer.name_or_path,
                                        "fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer),
                                        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})


def final_metrics(history: list[dict], keys: tuple[str, ...], window: int = 5) -> dict:
    """Each key's mean over the last `window` logged steps (single steps are noisy at small batch sizes)."""
    out = {}
    for key in keys:
        values = [r[key] for r in history if key in r][-window:]
        if values:
            out[key] = sum(values) / len(values)
    return out
