"""What sft, dpo, ppo and grpo share: the starting checkpoint, LoRA, the TRL trainer arguments built from the one
recipe schema, the one schedule, the run layout (smolctl.train.run) and the finished model folder.

RUN/final is written in a staging folder and swapped into place complete; every rank takes part in the save, so
a sharded (FSDP) model is gathered before rank 0 writes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smolctl.data.tokenizer import IM_END, load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from smolctl.launcher import world_size_from_env
from smolctl.results import Result
from smolctl.shards import (
    KIND_MODEL,
    OutputFolder,
    lineage_ref,
    read_manifest,
    refuse_output_over_inputs,
    refuse_working_folder,
)
from smolctl.train.checkpoint import KIND_CHECKPOINT, name_architecture, refuse_run_folder
from smolctl.train.config import PeftSection, PostTrainRecipe, global_batch_and_accumulation
from smolctl.train.run import (
    ADAPTER,
    CHECKPOINTS,
    EVENTS,
    FINAL,
    METRICS,
    RUN_FILE,
    RunStart,
    append_jsonl,
    begin_run,
    checkpoint_dir,
    decide_start,
    is_main_process,
    model_folder,
    prune_checkpoints,
)
from smolctl.train.schedule import lambda_scheduler
from smolctl.train.trackers import require_trackers, trainer_reporting

StepHook = Callable[[int, int, dict], None]
"""Called after every optimizer step with (step, total steps, latest logged metrics)."""


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
        raise UserError(where, "no starting checkpoint", 'set [model] from = "PATH" in the recipe or pass --from PATH')
    path = Path(spec)
    if not path.is_dir():
        raise UserError(
            path,
            "no such folder" if not path.exists() else "is a file, not a model folder",
            "pass a model folder (the output of pretrain, midtrain, sft or dpo)",
        )
    path = model_folder(path)
    refuse_run_folder(path, where, "start from a model: smolctl export {checkpoint} OUT, then pass OUT")
    manifest = read_manifest(path)
    if manifest is not None and manifest["kind"] == KIND_CHECKPOINT:
        raise UserError(
            path,
            "is a training checkpoint (model and optimizer state in DCP shards), not a model folder",
            f"export it first: smolctl export {path} OUT, then pass OUT",
        )
    if manifest is not None and manifest["kind"] != KIND_MODEL:
        raise UserError(
            path, f"is a {manifest['kind']} folder, not a model", "pass a checkpoint written by pretrain, sft or dpo"
        )
    if not (path / "config.json").is_file():
        raise UserError(
            path, "is not a model folder (no config.json)", "pass a Hugging Face model folder or a run folder"
        )
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(
            path, "holds a model but no tokenizer", "save the tokenizer beside the model (tokenizer.save_pretrained)"
        )
    return path


def load_start(path: Path, bf16: bool = False, attention: str = "sdpa"):
    """(model, tokenizer) from a checked model folder, float32 unless bf16 (for frozen models); the tokenizer gets
    a pad token."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            local_files_only=True,
            attn_implementation=attention,
            dtype=torch.bfloat16 if bf16 else torch.float32,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(
            path,
            f"cannot load the model: {str(exc).splitlines()[0][:200]}",
            "pass a complete Hugging Face model folder",
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise UserError(
            path,
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
            f"{model.get_input_embeddings().num_embeddings}",
            "pair the model with the tokenizer it was trained with",
        )
    return model, tokenizer


def chat_stop_ids(tokenizer) -> list[int]:
    """Tokens that end a reply: EOS, and the ChatML end-of-turn when the vocabulary has it (none for a tokenizer
    without either: its replies run to the length limit)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if IM_END in tokenizer.get_vocab() and tokenizer.convert_tokens_to_ids(IM_END) not in ids:
        ids.append(tokenizer.convert_tokens_to_ids(IM_END))
    return ids


def require_chat_template(tokenizer, path: Path, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            path,
            f"the tokenizer has no chat template, which {why}",
            "train the tokenizer with `smolctl train-tokenizer` (ChatML) or add a chat_template",
        )


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def check_sharding(recipe: PostTrainRecipe) -> None:
    """training.shard means FSDP through accelerate, which shards on GPUs only (on CPU it would quietly be DDP)."""
    import torch

    if recipe.training.shard and world_size_from_env() > 1 and not torch.cuda.is_available():
        raise UserError(
            "training.shard",
            "FSDP through accelerate needs GPUs; on CPU the processes would each hold the whole model",
            "set training.shard = false on CPU (the processes then run as DDP)",
        )
    if recipe.peft is not None and recipe.training.shard:
        raise UserError(
            "peft",
            "LoRA adapters are not sharded by smolctl (training.shard = true)",
            "LoRA fits a 3B model on one GPU: set training.shard = false, or remove [peft]",
        )


def apply_peft(model, peft: PeftSection | None):
    """The model with LoRA adapters on `peft.target_modules` (only they train), or the model as it is."""
    if peft is None:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=peft.r,
        lora_alpha=peft.alpha,
        lora_dropout=peft.dropout,
        task_type="CAUSAL_LM",
        target_modules=peft.target_modules,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(
            "peft.target_modules",
            str(exc).splitlines()[0][:200],
            'name modules of the model (e.g. ["q_proj", "v_proj"]) or use "all-linear"',
        ) from exc


def parameter_counts(model) -> dict[str, int]:
    """Trainable and total parameters (tied weights counted once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    return {"trainable": sum(p.numel() for p in unique if p.requires_grad), "total": sum(p.numel() for p in unique)}


# ---------------------------------------------------------------------------------------------------------------
# TRL trainers under the one schema


def trainer_arguments(run: Path, recipe: PostTrainRecipe) -> dict[str, Any]:
    """The TrainingArguments every TRL stage shares, from the shared tables; the schedule is ours (`scheduled`);
    the recipe's trackers (logging.report_to, offline)."""
    import torch

    training, optimizer = recipe.training, recipe.optimizer
    _, grad_accum = global_batch_and_accumulation(training, world_size_from_env())
    interval = recipe.checkpoint.interval
    sharding = dict(fsdp="full_shard auto_wrap", fsdp_config={"version": 2}) if training.shard else {}
    return dict(
        output_dir=str(run / CHECKPOINTS),
        max_steps=training.steps,
        per_device_train_batch_size=training.micro_batch,
        gradient_accumulation_steps=grad_accum,
        learning_rate=optimizer.lr,
        adam_beta1=optimizer.betas[0],
        adam_beta2=optimizer.betas[1],
        adam_epsilon=optimizer.eps,
        weight_decay=optimizer.weight_decay,
        max_grad_norm=optimizer.grad_clip,
        seed=training.seed,
        data_seed=training.seed,
        bf16=use_bf16(training.precision),
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=training.activation_checkpointing == "full",
        torch_compile=training.compile,
        logging_steps=recipe.logging.interval,
        save_strategy="steps" if interval else "no",
        save_steps=interval or 1,
        save_total_limit=None,  # RunCallback renames checkpoint-N to step-N and prunes, as pretrain does
        include_num_input_tokens_seen="all",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **trainer_reporting(run, recipe.logging.report_to),
        log_level="error",
        push_to_hub=False,
        ddp_find_unused_parameters=False,  # every parameter gets a gradient; the search costs a graph traversal
        **sharding,
    )


def scheduled(trainer_class: type, recipe: PostTrainRecipe) -> type:
    """The trainer class with smolctl's schedule (smolctl.train.schedule) as its lr scheduler."""

    class Scheduled(trainer_class):
        def create_model_card(self, *args, **kwargs):
            """No README.md model card in RUN/checkpoints: RUN/final/manifest.json is the model's record."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = lambda_scheduler(
                    optimizer or self.optimizer, recipe.schedule, recipe.training.steps
                )
            return self.lr_scheduler

    Scheduled.__name__ = trainer_class.__name__
    return Scheduled


# TRL's names for the columns every command's metrics.jsonl shares.
SHARED_NAMES = {"learning_rate": "lr"}


def run_callback(run: Path, on_step: StepHook | None, keep: int, extra: Callable[[], dict] | None = None):
    """A Trainer callback that keeps the run layout: metrics.jsonl in the shared schema, checkpoints renamed
    RUN/checkpoints/step-N (pruned to `keep`), an event per checkpoint, and the step hook (rank 0 only)."""
    from transformers import TrainerCallback

    class RunCallback(TrainerCallback):
        def __init__(self) -> None:
            self.history: list[dict] = []
            self.latest: dict = {}
            self.last = (time.perf_counter(), None)

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = (time.perf_counter(), state.num_input_tokens_seen)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_log = True  # the last step is always in metrics.jsonl, as in pretrain
            if state.is_world_process_zero and on_step is not None:
                on_step(state.global_step, state.max_steps, self.latest)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "train_loss" in logs:  # train_loss: the closing summary
                return
            now, tokens = time.perf_counter(), logs.get("num_input_tokens_seen")
            record = {"step": state.global_step}
            for key, value in logs.items():
                if (
                    isinstance(value, (int, float))
                    and key not in ("epoch", "num_input_tokens_seen")
                    and not key.startswith("train_")
                ):
                    record[SHARED_NAMES.get(key, key)] = value
            if tokens is not None and self.last[1] is not None:
                record["tokens_per_s"] = (tokens - self.last[1]) / max(1e-9, now - self.last[0])
            record.update(extra() if extra else {})
            self.last = (now, tokens)
            self.history.append(record)
            self.latest = record
            append_jsonl(run / METRICS, record)

        def on_save(self, args, state, control, **kwargs):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # every rank has written its part of checkpoint-N
            if state.is_world_process_zero:
                written, target = (
                    run / CHECKPOINTS / f"checkpoint-{state.global_step}",
                    checkpoint_dir(run, state.global_step),
                )
                shutil.rmtree(target, ignore_errors=True)
                written.rename(target)
                prune_checkpoints(run, keep)
                append_jsonl(
                    run / EVENTS,
                    {"event": "checkpoint", "step": state.global_step, "path": str(target), "time": time.time()},
                )

    return RunCallback()


def train_quietly(trainer, resume_from: Path | None) -> None:
    """Train, with our callback as the only reporter: the Trainer's printer would put log dicts on stdout,
    which belongs to --json (trackers that print, like trackio, are sent to stderr)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    # TRL writes a hub model card (README.md, about a "[None]" base model) beside the checkpoints at every save;
    # the run's model is final/, described by its manifest.
    trainer.create_model_card = lambda *args, **kwargs: None
    with redirect_stdout(sys.stderr):
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)


# ---------------------------------------------------------------------------------------------------------------
# The result and the output model folder


@dataclass
class PostTrainResult(Result):
    """What a post-training run did; the CLI renders it as a table or JSON."""

    stage: str
    run: str
    final: str
    """The finished model folder, RUN/final."""
    parent: str
    steps: int
    seconds: float
    resumed_from: str | None
    parameters: dict = field(default_factory=dict)
    """Trainable and total parameters (LoRA trains a small share)."""
    metrics: dict = field(default_factory=dict)
    """Final values of the logged metrics (loss, rewards/accuracies, ...)."""
    data: dict = field(default_factory=dict)
    """Rows read, per-group counts and other facts about the data."""
    adapter: str | None = None
    """LoRA runs: RUN/adapter, the adapter alone."""
    nothing_to_do: bool = False
    """--resume auto found the run finished: final/ is as it was."""


def finished_result(stage: str, run: Path, start: RunStart) -> PostTrainResult:
    """The result of a finished run, read back from its final/ manifest (nothing is trained or written)."""
    manifest = start.finished or {}
    stats = dict(manifest.get("stats", {}))
    steps, seconds = int(stats.pop("steps", 0)), float(stats.pop("seconds", 0.0))
    return PostTrainResult(
        stage,
        str(run),
        str(run / FINAL),
        manifest.get("parent", ""),
        steps,
        seconds,
        None,
        manifest.get("parameters", {}),
        manifest.get("metrics", stats),  # a final/ saved before metrics and data were kept apart: all in stats
        manifest.get("data", {}),
        str(run / ADAPTER) if (run / ADAPTER).is_dir() else None,
        nothing_to_do=True,
    )


def save_final(
    run: Path,
    model,
    tokenizer,
    *,
    parent: Path,
    data_inputs: list[dict],
    stage: str,
    metrics: dict,
    data: dict,
    steps: int,
    seconds: float,
    parameters: dict,
    accelerator=None,
) -> Path | None:
    """Save the trained model as RUN/final: an HF folder with its tokenizer and a kind "model" manifest (inputs:
    the data's lineage and the parent checkpoint). Every rank calls this: a sharded model is gathered first, then
    rank 0 writes. A LoRA model is saved merged, its adapter alone in RUN/adapter. Returns RUN/adapter or None.

    The generation config stops at the chat template's end-of-turn token as well as EOS, so the model chats
    with `generate` out of the box."""
    state_dict = None
    if accelerator is not None:
        if accelerator.num_processes > 1:
            state_dict = accelerator.get_state_dict(model)  # collective: the full weights on rank 0
        model = accelerator.unwrap_model(model)
    if accelerator is not None and not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return None
    adapter = None
    if hasattr(model, "merge_and_unload"):  # a peft model
        adapter = run / ADAPTER
        shutil.rmtree(adapter, ignore_errors=True)
        model.save_pretrained(str(adapter))
        model = model.merge_and_unload()
        state_dict = None
    model.generation_config.eos_token_id = chat_stop_ids(tokenizer) or None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # decide_start already refused an existing final/ unless --overwrite or --resume said to replace it.
    with OutputFolder(
        run / FINAL, kind=KIND_MODEL, overwrite=True, inputs=[*data_inputs, lineage_ref(parent)]
    ) as folder:
        model.save_pretrained(str(folder.staging), state_dict=state_dict)
        name_architecture(folder.staging / "config.json")
        tokenizer.save_pretrained(str(folder.staging))
        if (run / METRICS).is_file():
            shutil.copy2(run / METRICS, folder.file(METRICS))
        for weights in sorted(folder.staging.glob("*.safetensors")):
            folder.add_shard(weights.name, rows=0)
        folder.commit(
            # One flat table for `report` and `inspect`; metrics and data apart, as the run's result shows them.
            stats={
                **{k.replace("/", "_"): v for k, v in metrics.items()},
                **data,
                "steps": steps,
                "seconds": round(seconds, 2),
            },
            metrics=metrics,
            data=data,
            parent=str(parent.resolve()),
            stage=stage,
            parameters=parameters,
            tokenizer={
                "path": str((run / FINAL).resolve()),
                "name": tokenizer.name_or_path,
                "fingerprint": tokenizer_fingerprint(tokenizer),
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
        )
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return adapter


def final_metrics(history: list[dict], keys: tuple[str, ...], window: int = 5) -> dict:
    """Each key's mean over the last `window` logged steps (single steps are noisy at small batch sizes)."""
    out = {}
    for key in keys:
        values = [r[key] for r in history if key in r][-window:]
        if values:
            out[key] = sum(values) / len(values)
    return out


def finish_trl(
    stage: str,
    trainer,
    callback,
    run: Path,
    parent: Path,
    data_inputs: list[dict],
    data: dict,
    start: RunStart,
    parameters: dict,
    metrics: Callable[[list[dict]], dict],
) -> PostTrainResult:
    """Train a prepared TRL trainer, save RUN/final collectively and return the result."""
    started = time.perf_counter()
    train_quietly(trainer, start.resume_from)
    seconds = time.perf_counter() - started
    summary = metrics(callback.history)
    adapter = save_final(
        run,
        trainer.model,
        trainer.processing_class,
        parent=parent,
        data_inputs=data_inputs,
        stage=stage,
        parameters=parameters,
        accelerator=trainer.accelerator,
        metrics=summary,
        data=data,
        steps=trainer.state.global_step,
        seconds=seconds,
    )
    return PostTrainResult(
        stage,
        str(run),
        str(run / FINAL),
        str(parent),
        trainer.state.global_step,
        seconds,
        str(start.resume_from) if start.resume_from else None,
        parameters,
        summary,
        data,
        str(adapter) if adapter else None,
    )


@contextmanager
def removed_if_never_trained(run: Path, start: RunStart) -> Iterator[None]:
    """Around building a fresh run's trainer, where TRL's data preparation can still refuse the data (no pair fits
    max_length, ...): on failure, the run folder open_run began is taken away again, so the same command runs once
    the data is fixed instead of asking for --overwrite."""
    try:
        yield
    except BaseException:
        if start.resume_from is None and is_main_process():
            for name in (RUN_FILE, METRICS, EVENTS):
                (run / name).unlink(missing_ok=True)
            for folder in (run / CHECKPOINTS, run):  # only if nothing else is in them
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def open_run(stage: str, recipe: PostTrainRecipe, run: Path, parent: Path, resume: str, overwrite: bool) -> RunStart:
    """Decide fresh start, resume or nothing to do, and record the run; call it once the cheap checks passed."""
    check_sharding(recipe)
    require_trackers(recipe.logging.report_to)
    start = decide_start(run, resume, overwrite, int(recipe.training.steps))
    if start.overwrite:  # --overwrite must not delete the model the run starts from or the data it reads
        refuse_working_folder(run)
        refuse_output_over_inputs(run, [parent, recipe.data.path], "the run's input")
    begin_run(run, stage, recipe.model_dump(mode="json", by_alias=True), parent, start)
    return start
