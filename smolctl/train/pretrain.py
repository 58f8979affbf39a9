"""The training loop for `smolctl pretrain` and `smolctl midtrain`: one process, torchrun (DDP / FSDP2) or
accelerate launch, the same code.

    smolctl pretrain recipes/smollm3-tiny.toml runs/tiny --data demo-out/packed
    torchrun --nproc_per_node 8 -m smolctl pretrain recipes/smollm3.toml runs/3b --resume auto

Setup validates everything (recipe, data folders, tokenizer, batch arithmetic, checkpoints) before the model is
built; `Trainer.run` then reads as a checklist: step, guard, log, checkpoint, evaluate.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from smolctl.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from smolctl.errors import CheckFailed, UserError
from smolctl.infra.flops import training_flops_per_token
from smolctl.launcher import world_size_from_env
from smolctl.recipe import apply_overrides, load_toml, validate
from smolctl.results import Result
from smolctl.shards import (
    atomic_write_json,
    lineage_ref,
    output_folder_path,
    read_manifest,
    refuse_output_over_inputs,
    refuse_working_folder,
)
from smolctl.train.checkpoint import (
    KIND_CHECKPOINT,
    CheckpointManager,
    check_model_folder,
    check_model_shapes,
    check_same_identity,
    check_saved_bytes,
    checkpoint_step,
    complete_checkpoints,
    name_architecture,
    run_identity,
    save_model_folder,
    saved_bytes_problem,
)
from smolctl.train.config import BatchPlan, TrainRecipe, check_keys, derive_batch, resolve_layout
from smolctl.train.distributed import (
    gradient_sync,
    init_distributed,
    load_full_state_dict,
    wrap_model,
)
from smolctl.train.guards import Guards, Verdict
from smolctl.train.loader import (
    IGNORE_INDEX,
    DataPosition,
    HostBatch,
    PackedStream,
    Prefetcher,
    check_rows_start_documents,
    fill_padding_positions,
    make_labels,
    validation_batches,
)
from smolctl.train.model import (
    build_config,
    build_model,
    check_attention,
    count_parameters,
    parameter_groups,
    read_weights,
)
from smolctl.train.monitor import Monitor, idle_totals, peak_flops
from smolctl.train.parallel import clip_grad_norm_, tp_plan
from smolctl.train.run import (
    EVENTS,
    FINAL,
    RUN_FILE,
    append_jsonl,
    check_steps_reach,
    discard_later,
    holds_run_files,
    holds_run_folder,
    model_folder,
    nothing_to_resume,
    recipe_changes,
    recorded_run,
    resume_event,
)
from smolctl.train.schedule import learning_rate
from smolctl.train.trackers import open_tracker, require_trackers

# torch (and smolctl.train.loss, which needs it) is imported by the methods that compute: it takes several times
# longer to load than everything above together (`python -X importtime`), and recipe validation, `--dry-run` and
# every bad-input error finish without it.

PREEMPTED_EXIT = 75  # sysexits' EX_TEMPFAIL: saved and stopped on request; recipes/slurm/pretrain.sbatch requeues
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def load_train_recipe(
    path: str | Path, overrides: Sequence[str] = (), data: Sequence[str] = (), stage: str = "pretrain"
) -> TrainRecipe:
    """The recipe with `--data` folders (replacing [data] paths/stages) and `--set` overrides applied."""
    raw = load_toml(path)
    if data:
        kept = {k: v for k, v in raw.get("data", {}).items() if k not in ("paths", "weights", "stages")}
        raw["data"] = {**kept, "paths": [str(p) for p in data]}
    raw = apply_overrides(raw, overrides)
    check_keys(raw, stage, path)
    return validate(TrainRecipe, raw, path)


@dataclass
class TrainResult(Result):
    run: str
    stage: str
    final: str
    steps: int
    tokens_seen: int
    parameters: int
    first_loss: float | None
    final_loss: float | None
    val_loss: float | None
    resumed_from: str | None
    parent: str | None
    skipped_steps: int
    spikes: int
    rollbacks: int
    checkpoints: list[str]
    plan: dict
    speed: dict
    events: list[dict] = field(default_factory=list)
    peak_memory: int | None = None
    """Bytes the CUDA caching allocator handed out at most on this rank (None on CPU)."""
    nothing_to_do: bool = False
    """`--resume auto` found the run finished: nothing trained, final/ left as it was."""
    preempted: str | None = None
    """The signal (SIGUSR1 / SIGTERM) that stopped the run after a checkpoint at its current step."""


@dataclass
class TrainedStep:
    """A step whose update is done but whose loss and gradient norm (`values`, on the device) the guards have not
    judged yet: they are read back together at the next logging point."""

    step: int
    batch: int
    drawn: list[tuple[int, int]]
    """The packed rows of the step's global batch, named in a guard's event."""
    values: object
    """tensor([loss, grad norm]) on the training device."""
    lr: float
    data_s: float
    compute_s: float


class Trainer:
    """Owns the model, optimizer, data stream, guards and monitor of one run; `run()` is the loop."""

    def __init__(
        self,
        recipe: TrainRecipe,
        run_dir: Path,
        *,
        stage: str = "pretrain",
        resume: str = "none",
        overwrite: bool = False,
        init_from: str | None = None,
        keep_optimizer: bool = False,
        show: bool = True,
    ):

        self.recipe, self.run_dir, self.stage, self.show = recipe, Path(run_dir), stage, show
        self._replace_run = False
        # The layout, the batch and the resume point need only the world size and the run folder: a recipe or
        # --resume they refuse fails here, before torch is imported and every rank waits to join the process group.
        world_size = world_size_from_env()
        self.layout = resolve_layout(recipe, world_size)
        self.plan: BatchPlan = derive_batch(recipe.training, recipe.schedule, world_size, self.layout)
        self.finished: dict | None = None  # the final/ manifest when --resume auto finds nothing left to do
        self.resume_from = self._resume_point(resume, overwrite)
        if self.resume_from is not None:
            check_steps_reach(self.resume_from, checkpoint_step(self.resume_from), self.plan.steps)
        if init_from and (self.resume_from is not None or self.finished):
            self._check_same_parent(init_from)
        self.init_from = (
            str(Path(init_from).resolve()) if init_from and self.resume_from is None and not self.finished else None
        )
        if self._replace_run:  # --overwrite must not delete the model the run starts from or the data it reads
            refuse_working_folder(self.run_dir)
            reads = [p for p in (init_from, *recipe.data.all_paths()) if p]
            refuse_output_over_inputs(self.run_dir, reads, "the run's input")
        self.init_kind: str | None = None
        self.keep_optimizer = keep_optimizer
        self.dist = init_distributed()
        # TP ranks of one group read the same rows: the data is split over data-parallel ranks only
        self.dp_rank = self.dist.rank // self.layout.tp
        self._validate_inputs()
        self.prefetch = Prefetcher(self._host_batch)

    # ---- setup: every check before any compute ----------------------------------------------------------------

    def _check_same_parent(self, init_from: str) -> None:
        """A resume continues from the model the run started from: another --from (a requeued job script edited
        since) would be ignored without a word."""
        parent = recorded_run(self.run_dir).get("parent")
        # a parent no longer where it was (the run was copied to another cluster) cannot be compared
        if (
            parent
            and Path(parent).exists()
            and model_folder(Path(init_from)).resolve() != model_folder(Path(parent)).resolve()
        ):
            raise UserError(
                "--from",
                f"{init_from} is not the model {self.run_dir} started from ({parent})",
                "pass that --from to continue the run, or train from the new model into another run folder",
            )

    def _resume_point(self, resume: str, overwrite: bool) -> Path | None:

        checkpoints = complete_checkpoints(self.run_dir)
        if resume == "auto":
            final = read_manifest(self.run_dir / FINAL) if (self.run_dir / FINAL).is_dir() else None
            if final and int(final.get("step", -1)) >= self.plan.steps:
                self.finished = final
                return None
            if checkpoints:
                return checkpoints[-1]
            if holds_run_files(self.run_dir) and not (self.run_dir / RUN_FILE).is_file():
                raise nothing_to_resume(self.run_dir)
            return None
        if resume != "none":
            path = Path(resume)
            if path.resolve() not in [c.resolve() for c in checkpoints]:
                raise UserError(
                    "--resume",
                    f"{path} is not a complete checkpoint of {self.run_dir}",
                    "pass auto, none, or one of RUN/checkpoints/step-NNNNNNN",
                )
            return path
        if holds_run_files(self.run_dir) and not overwrite:
            if checkpoints:
                raise UserError(
                    self.run_dir,
                    "already holds a run",
                    "pass --resume auto to continue it, or --overwrite to start again",
                )
            raise UserError(
                self.run_dir,
                "already holds a run with no complete checkpoint yet",
                "pass --resume auto to start it again from step 0 (same data order), or --overwrite",
            )
        self._replace_run = overwrite and self.run_dir.is_dir()  # deleted only once every check has passed
        return None

    def _validate_inputs(self) -> None:

        recipe = self.recipe
        if self.init_from:
            self.init_kind = check_model_folder(self.init_from, need_optimizer=self.keep_optimizer)
        self.stream = PackedStream(recipe.data.stage_list(), seed=recipe.training.seed, seq_len=recipe.training.seq_len)
        data_tokenizer = self.stream.tokenizer_info()
        spec = recipe.model.tokenizer or self.init_from or data_tokenizer.get("path")
        if spec is None:
            raise UserError(
                "model.tokenizer", "is not set and the packed manifest records no tokenizer", "set model.tokenizer"
            )
        self.tokenizer = load_tokenizer(spec)
        fingerprint = tokenizer_fingerprint(self.tokenizer)
        if data_tokenizer.get("fingerprint") and data_tokenizer["fingerprint"] != fingerprint:
            raise UserError(
                self.stream.paths[0],
                f"was packed with tokenizer {data_tokenizer.get('path')} (fingerprint "
                f"{data_tokenizer['fingerprint']}), not {spec} ({fingerprint})",
                "re-pack the data with this tokenizer or set model.tokenizer to the one it was packed with",
            )
        self.vocab_size = recipe.model.vocab_size or len(self.tokenizer)
        data_vocab = max(len(self.tokenizer), int(data_tokenizer.get("vocab_size") or 0))
        if self.vocab_size < data_vocab:
            raise UserError(
                "model.vocab_size",
                f"{self.vocab_size} is smaller than the tokenizer's {data_vocab} token ids",
                f"set model.vocab_size >= {data_vocab} or leave it unset",
            )
        self.config = build_config(
            recipe.model,
            vocab_size=self.vocab_size,
            seq_len=recipe.training.seq_len,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
        )
        tp_plan(self.config, self.layout.tp)
        check_attention(recipe.training.attention, self.dist.device)
        self.val_batches = []
        if recipe.data.validation:
            self.val_batches = validation_batches(
                recipe.data.validation,
                seq_len=recipe.training.seq_len,
                micro_batch=recipe.training.micro_batch,
                count=recipe.data.validation_batches,
            )
        if self.dist.is_main:
            require_trackers(recipe.logging.report_to)
        self.identity = run_identity(recipe, self.plan.global_batch)
        if self.resume_from is not None or self.finished is not None:
            where = self.resume_from or self.run_dir / FINAL
            check_same_identity((read_manifest(where) or {}).get("identity"), self.identity, where, recipe)

    def _build(self) -> None:
        import torch

        from smolctl.train.loss import CausalLMLoss

        recipe, dist, training = self.recipe, self.dist, self.recipe.training
        self.precision = training.precision
        if self.precision == "auto":
            self.precision = "bf16" if dist.device.startswith("cuda") else "fp32"
        self.model = build_model(self.config, device=dist.device, attention=training.attention, seed=training.seed)
        self.parameters = count_parameters(self.model)["total"]
        if self.init_from and self.init_kind != KIND_CHECKPOINT:
            load_full_state_dict(self.model, read_weights(Path(self.init_from), self.model), dist)
        dcp_source = self.resume_from or (self.init_from if self.init_kind == KIND_CHECKPOINT else None)
        if dcp_source:
            check_saved_bytes(Path(dcp_source), "--resume" if self.resume_from else "--from", dist)
            check_model_shapes(
                Path(dcp_source), self.model, "--resume" if self.resume_from else "--from"
            )  # DCP loads them after wrapping, at any world size
        loss_model = CausalLMLoss(
            self.model, chunk_tokens=training.loss_chunk_tokens, flatten_rows=training.attention == "flash_attention_2"
        )
        self.wrapped = wrap_model(
            loss_model,
            dist,
            self.layout,
            activation_checkpointing=training.activation_checkpointing,
            compile=training.compile,
            bf16=self.precision == "bf16",
        )
        opt = recipe.optimizer
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, opt), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, fused=True
        )  # the fused kernel skips a non-finite step on the device
        # FSDP's mixed-precision policy already computes in bf16; autocast is for the unsharded paths
        self.autocast = self.precision == "bf16" and not dist.fsdp
        self.flops_per_token = training_flops_per_token(self.config, training.seq_len)
        # Checkpoints hold the inner Hugging Face model (its parameters sharded in place by TP / FSDP2), not the
        # loss wrapper or DDP: their keys are the plain model's, so `smolctl export` and from_pretrained read them
        # and a checkpoint of one layout (tp, dp, world size) loads into any other.
        self.checkpoints = CheckpointManager(
            self.run_dir,
            model=self.model,
            optimizer=self.optimizer,
            dist=dist,
            keep=recipe.checkpoint.keep,
            async_save=recipe.checkpoint.async_save,
            export_interval=recipe.checkpoint.export_interval,
            write_model_files=self._write_model_files,
            inputs=self._inputs,
        )

    # ---- state -------------------------------------------------------------------------------------------------

    def _restore(self, checkpoint: Path, flag: str = "--resume") -> None:
        """Model, optimizer, RNG and loop state from a checkpoint saved at any world size (`flag`: what named it)."""

        self.prefetch.reset()  # the stream is about to rewind: no batch may be drawn from the old position
        state = self.checkpoints.load(checkpoint, flag=flag)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.stream.position = DataPosition.from_state(state["data"])
        self.data_position = self.stream.position.state_dict()
        self.guards.load_state_dict(state["guards"])
        self.parent = state["parent"]
        # the loss the checkpoint was saved at: a resume with no step left to run writes it into final/
        self.last_loss = ((read_manifest(checkpoint) or {}).get("stats") or {}).get("loss")

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.data_position,
            "guards": self.guards.state_dict(),
            "parent": self.parent,
        }

    def _inputs(self) -> list[dict]:
        refs = [lineage_ref(Path(p)) for p in self.stream.paths]
        return refs + ([lineage_ref(Path(self.parent))] if self.parent else [])

    def _manifest_fields(self) -> dict:
        return {
            "stage": self.stage,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "parameters": self.parameters,
            "tokenizer": self.stream.tokenizer_info(),
            "recipe": json.loads(self.recipe.model_dump_json()),
            "identity": self.identity,
            "stats": {"steps": self.step, "loss": self.last_loss},
        }

    def _write_model_files(self, folder: Path) -> None:
        """The small files `smolctl export` turns a checkpoint into a Hugging Face folder with."""
        self.model.config.save_pretrained(str(folder))
        name_architecture(folder / "config.json")
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))

    def _save_checkpoint(self, *, blocking: bool) -> float:
        """Checkpoint the current step; returns the seconds the loop was held (staging only, when async)."""
        return self.checkpoints.save(
            self.step, train_state=self._trainer_state(), fields=self._manifest_fields(), blocking=blocking
        )

    def _write_final(self) -> None:

        # the inner model gathers to the plain Hugging Face names (the loss wrapper would prefix them with `lm.`)
        save_model_folder(
            self.run_dir / FINAL,
            model=self.model,
            wrapped=self.model,
            tokenizer=self.tokenizer,
            dist=self.dist,
            inputs=self._inputs(),
            parent=self.parent,
            fields=self._manifest_fields(),
        )

    # ---- the loop ----------------------------------------------------------------------------------------------

    def _start(self) -> None:

        self.guards = Guards(self.recipe.guards)
        self.step, self.tokens_seen, self.parent = 0, 0, self.init_from
        self.last_loss: float | None = None
        self.data_position = self.stream.position.state_dict()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        elif self.init_kind == KIND_CHECKPOINT:
            self.checkpoints.load(
                Path(self.init_from), optimizer=self.keep_optimizer, flag="--from"
            )  # a new stage: its own step 0
        self.recipe_changes: dict[str, list] = {}
        self.discarded: list[str] = []
        if self.dist.is_main:
            recorded = {
                "stage": self.stage,
                "recipe": json.loads(self.recipe.model_dump_json()),
                "plan": asdict(self.plan),
                "parent": self.parent,
            }
            if self.resume_from is None:
                folder = output_folder_path(self.run_dir)  # a linked run folder is replaced where it points
                if self._replace_run:
                    shutil.rmtree(folder)
                folder.mkdir(parents=True, exist_ok=True)
            else:  # a rewind abandons what later steps left
                self.discarded = discard_later(self.run_dir, checkpoint_step(self.resume_from))
            if self.resume_from is not None and (before := recorded_run(self.run_dir)):
                # run.json holds the recipe now in force (a decay phase's schedule, another world size's plan);
                # the resume event says what changed.
                self.recipe_changes = recipe_changes(  # the batch plan's keys as plan.KEY
                    {**before.get("recipe", {}), "plan": before.get("plan", {})},
                    {**recorded["recipe"], "plan": recorded["plan"]},
                )
            atomic_write_json(self.run_dir / RUN_FILE, recorded)
            (self.run_dir / EVENTS).touch()  # the run layout has it even when nothing happened
        self.dist.barrier()

    def _host_batch(self, step: int) -> HostBatch:
        """This rank's rows of the step's global batch with labels, as (pinned) CPU tensors; runs on the prefetch
        thread, so everything here is host work."""
        import torch

        plan = self.plan
        number, ids, positions = self.stream.next_batch(
            step, global_batch=plan.global_batch, rank=self.dp_rank, world_size=plan.data_parallel
        )
        if int(ids.max()) >= self.vocab_size:
            raise UserError(
                self.stream.paths[0],
                f"holds token id {int(ids.max())} but the vocabulary has {self.vocab_size} rows",
                "re-pack with the recipe's tokenizer or raise model.vocab_size",
            )
        if self.recipe.training.attention == "flash_attention_2" and plan.micro_batch > 1:
            check_rows_start_documents(positions)
        tensors = [torch.from_numpy(a) for a in (ids, fill_padding_positions(positions), make_labels(ids, positions))]
        if self.dist.device.startswith("cuda"):
            tensors = [t.pin_memory() for t in tensors]
        return HostBatch(number, *tensors, position=self.stream.position.state_dict(), drawn=self.stream.last_drawn)

    def _forward_backward(self):
        """Forward and backward over the global batch, gradients clipped; the caller decides whether to apply them.
        Returns (loss, grad norm) as device tensors, the batch number and the seconds spent waiting for data."""
        import torch

        started = time.perf_counter()
        plan, device = self.plan, self.dist.device
        host = self.prefetch.get(self.step)
        self.data_position, self.batch_drawn = host.position, host.drawn
        ids, positions, labels = (
            t.to(device, non_blocking=True) for t in (host.input_ids, host.position_ids, host.labels)
        )
        data_done = time.perf_counter()

        lr = learning_rate(
            self.step, peak=self.recipe.optimizer.lr, schedule=self.recipe.schedule, total_steps=plan.steps
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Sum of token losses / tokens in the whole global batch: every token weighs the same whatever the layout or
        # accumulation. Sums run over the whole world: the tp ranks of a group count the same tokens and losses, so
        # both sums carry the same factor tp and their ratio is exact; DDP/FSDP average gradients over the
        # data-parallel ranks, hence the × world_size (= dp × tp, the tp cancelling the one in `targets`).
        targets = self.dist.sum((labels != IGNORE_INDEX).sum().to(torch.float64)).clamp(min=1)
        autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if self.autocast else nullcontext()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(plan.grad_accum):
            rows = slice(micro * plan.micro_batch, (micro + 1) * plan.micro_batch)
            with gradient_sync(self.wrapped, self.dist, micro == plan.grad_accum - 1), autocast:
                part = self.wrapped(ids[rows], positions[rows], labels[rows])
                if host.number in self.recipe.guards.inject_nan_batches:
                    part = part * float("nan")
                (part * self.dist.world_size / targets.float()).backward()
            loss_sum += part.detach().double()
        loss = self.dist.sum(loss_sum) / targets
        norm = clip_grad_norm_(self.model.parameters(), self.recipe.optimizer.grad_clip or float("inf")).to(device)
        self._last_lr = lr
        return loss, norm, host.number, data_done - started

    def _update(self, loss, norm) -> None:
        """The optimizer step, skipped on the device when the loss or gradient norm is not finite: AdamW's fused
        kernel reads `found_inf` (as under a GradScaler) and leaves weights, moments and step count as they were,
        so no host sync is needed to decide."""
        import torch

        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.optimizer.found_inf = nonfinite.float()
        self.optimizer.step()

    def _judge(self, unjudged: list[TrainedStep], losses: list[float]) -> Verdict | None:
        """The guards' verdicts on the steps trained since the last judgment, in order, from one host sync; logs
        them. Returns the verdict that asks for a rollback (later steps are dropped: the rollback undoes them)."""
        import torch

        if not unjudged:
            return None
        synced = time.perf_counter()
        values = torch.stack([trained.values for trained in unjudged]).tolist()
        # A GPU runs behind the host until this sync: the wait is compute of the steps judged (timed on the last one)
        unjudged[-1].compute_s += time.perf_counter() - synced
        for trained, (loss, norm) in zip(unjudged, values):
            verdict = self.guards.observe(trained.step, trained.batch, loss, norm)
            if verdict.event:
                self.monitor.event({**verdict.event, "rows": self.stream.rows_of(trained.drawn)})
            if verdict.level_shift:
                self.monitor.event(verdict.level_shift)
            if verdict.rollback:
                return verdict
            if math.isfinite(loss):
                losses.append(loss)
                self.last_loss = loss
            self.monitor.step(
                trained.step,
                loss=loss,
                lr=trained.lr,
                grad_norm=norm,
                tokens=self.plan.tokens_per_step,
                data_s=trained.data_s,
                compute_s=trained.compute_s,
                guards=self.guards.counts(),
            )
        return None

    def _rollback(self, bad_batches: list[int], first_bad_step: int) -> None:
        """Back to the last checkpoint saved before the incident's first bad step (a later one may hold its updates,
        and is deleted), skipping the incident's batches from then on."""

        self.checkpoints.wait()  # a save in flight is part of the choice, on every rank alike
        clean = [c for c in complete_checkpoints(self.run_dir) if checkpoint_step(c) < first_bad_step]
        if not clean:
            raise CheckFailed(
                f"{len(bad_batches)} consecutive bad steps (batches {bad_batches}) and no checkpoint from before "
                f"step {first_bad_step} to roll back to — lower the lr, raise guards.max_bad_steps or "
                "checkpoint.keep, or save checkpoints sooner"
            )
        if self.guards.rollbacks >= self.recipe.guards.max_rollbacks:
            raise CheckFailed(
                f"still unstable after {self.guards.rollbacks} incidents (guards.max_rollbacks) — see {self.run_dir}/events.jsonl"
            )
        counts = (self.guards.skipped, self.guards.spikes, self.guards.rollbacks + 1)
        # A checkpoint damaged on disk since its save is passed over for the one before it, rather than ending a
        # run that has a sound one to go back to.
        for target in reversed(clean):
            damaged = saved_bytes_problem(target, self.dist)
            if damaged is None:
                break
            self.monitor.event(
                {"event": "damaged_checkpoint_skipped", "step": self.step, "path": str(target), "problem": damaged}
            )
        else:
            raise CheckFailed(
                f"{len(bad_batches)} consecutive bad steps (batches {bad_batches}) and every checkpoint from before "
                f"step {first_bad_step} is damaged on disk (see {self.run_dir}/events.jsonl) — check the storage"
            )
        self.checkpoints.discard_after(checkpoint_step(target))
        self._restore(target, "rollback")
        self.guards.skipped, self.guards.spikes, self.guards.rollbacks = counts
        self.stream.position.skip = sorted(set(self.stream.position.skip) | set(bad_batches))
        self.monitor.rewind(self.step)
        self.monitor.event({"event": "rollback", "step": self.step, "to": str(target), "skipped_batches": bad_batches})

    def _evaluate(self) -> float | None:
        import torch

        if not self.val_batches:
            return None
        self.model.eval()
        device = self.dist.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if self.autocast else nullcontext()
        with torch.no_grad(), autocast:
            for ids, positions in self.val_batches:
                labels = make_labels(ids, positions)
                total += self.wrapped(
                    torch.from_numpy(ids).to(device),
                    torch.from_numpy(fill_padding_positions(positions)).to(device),
                    torch.from_numpy(labels).to(device),
                ).double()
                count += int((labels != IGNORE_INDEX).sum())
        self.model.train()
        loss = total.item() / max(1, count)
        self.monitor.validation(self.step, loss)
        return loss

    def _catch_preemption(self) -> dict:
        """SIGUSR1 / SIGTERM (Slurm's notice, torchrun forwarding it) only set a flag: the loop finishes its step,
        saves and stops. Returns the previous handlers (empty off the main thread, where Python cannot catch)."""

        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum, frame) -> None:
            self.stop_signal = self.stop_signal or signal.Signals(signum).name

        return {sig: signal.signal(sig, request_stop) for sig in PREEMPTION_SIGNALS}

    def _result(self, val_loss: float | None, losses: list[float], *, stopped: bool) -> TrainResult:
        import torch

        return TrainResult(
            run=str(self.run_dir),
            stage=self.stage,
            final=str(self.run_dir / FINAL),
            steps=self.step,
            tokens_seen=self.tokens_seen,
            parameters=self.parameters,
            first_loss=losses[0] if losses else None,
            final_loss=losses[-1] if losses else self.last_loss,
            val_loss=val_loss,
            resumed_from=str(self.resume_from) if self.resume_from else None,
            parent=self.parent,
            skipped_steps=self.guards.skipped,
            spikes=self.guards.spikes,
            rollbacks=self.guards.rollbacks,
            checkpoints=[str(p) for p in complete_checkpoints(self.run_dir)],
            plan={**asdict(self.plan), "tokens_per_step": self.plan.tokens_per_step},
            speed=self.monitor.totals(),
            events=self.monitor.events,
            preempted=self.stop_signal if stopped else None,
            peak_memory=torch.cuda.max_memory_allocated() if self.dist.device.startswith("cuda") else None,
        )

    def _nothing_to_do(self) -> TrainResult:
        """`--resume auto` on a finished run: report it from final/'s manifest, touch nothing."""

        final = self.finished
        return TrainResult(
            run=str(self.run_dir),
            stage=final.get("stage", self.stage),
            final=str(self.run_dir / FINAL),
            steps=int(final["step"]),
            tokens_seen=int(final.get("tokens_seen", 0)),
            parameters=int(final.get("parameters", 0)),
            first_loss=None,
            final_loss=(final.get("stats") or {}).get("loss"),
            val_loss=None,
            resumed_from=None,
            parent=final.get("parent"),
            skipped_steps=0,
            spikes=0,
            rollbacks=0,
            checkpoints=[str(p) for p in complete_checkpoints(self.run_dir)],
            plan={**asdict(self.plan), "tokens_per_step": self.plan.tokens_per_step},
            speed=idle_totals(),
            nothing_to_do=True,
        )

    def run(self) -> TrainResult:
        import torch

        if self.finished is not None:
            return self._nothing_to_do()
        self._build()
        self._start()
        recipe, plan = self.recipe, self.plan
        self.monitor = Monitor(
            self.run_dir,
            title=self.stage,
            enabled=self.dist.is_main,
            total_steps=plan.steps,
            start_step=self.step,
            flops_per_token=self.flops_per_token,
            peak=peak_flops(self.dist.device, self.precision),
            world_size=self.dist.world_size,
            interval=recipe.logging.interval,
            show=self.show,
            device=str(self.dist.device),
            profile_interval=recipe.logging.profile_interval,
            tracker=open_tracker(
                self.run_dir,
                recipe.logging.report_to,
                enabled=self.dist.is_main,
                resuming=self.resume_from is not None,
                config=json.loads(recipe.model_dump_json()),
            ),
        )
        losses: list[float] = []
        unjudged: list[TrainedStep] = []
        val_loss = None
        self.stop_signal: str | None = None
        stopped = False
        previous_handlers = self._catch_preemption()
        self.model.train()
        try:
            with self.monitor:
                if self.resume_from is not None:
                    self.monitor.note(
                        f"resuming from {self.resume_from} (step {self.step}, {self.tokens_seen:,} tokens)"
                    )
                    if self.dist.is_main:  # after the monitor dropped what the steps about to run again logged
                        append_jsonl(
                            self.run_dir / EVENTS,
                            resume_event(self.step, self.resume_from, self.recipe_changes, self.discarded),
                        )
                    if self.discarded:
                        self.monitor.note(f"removed what the abandoned later steps left: {', '.join(self.discarded)}")
                while self.step < plan.steps:
                    started = time.perf_counter()
                    with self.monitor.profiled(self.step + 1):
                        loss, norm, batch, data_s = self._forward_backward()
                        held = self.checkpoints.wait_for_staging()  # the save in flight has copied what step() changes
                        self._update(loss, norm)
                    self.optimizer.zero_grad(set_to_none=True)
                    self.step += 1
                    self.tokens_seen += plan.tokens_per_step
                    unjudged.append(
                        TrainedStep(
                            self.step,
                            batch,
                            self.batch_drawn,
                            torch.stack([loss.float(), norm.float()]),
                            self._last_lr,
                            data_s,
                            time.perf_counter() - started - data_s - held,
                        )
                    )
                    if held:
                        self.monitor.checkpoint_held(held)
                    stopping = self.dist.any(self.stop_signal is not None)
                    if stopping and self.stop_signal is None:
                        self.stop_signal = "a signal to another rank"
                    # The last step always gets a checkpoint: final/ can be rebuilt from it and the run extended.
                    due = self.step == plan.steps or (
                        recipe.checkpoint.interval and self.step % recipe.checkpoint.interval == 0
                    )
                    # The steps are judged (one host sync) at each logging point, and before a save so that the
                    # checkpoint's guards and loss include every step it holds.
                    if due or stopping or self.step % recipe.logging.interval == 0:
                        rollback = self._judge(unjudged, losses)
                        unjudged.clear()
                        if rollback is not None:
                            self._rollback(rollback.bad_batches, rollback.first_bad_step)
                            continue
                    if due or stopping:
                        with self.monitor.checkpointing():
                            self._save_checkpoint(blocking=stopping)
                    if stopping:
                        stopped = True
                        self.monitor.note(
                            f"{self.stop_signal}: saved step {self.step}; stopping — continue with --resume auto"
                        )
                        break
                    if recipe.data.validation_interval and self.step % recipe.data.validation_interval == 0:
                        val_loss = self._evaluate()
                if not stopped:
                    if self.val_batches and not (
                        recipe.data.validation_interval and self.step % recipe.data.validation_interval == 0
                    ):
                        val_loss = self._evaluate()
                    self.checkpoints.wait()  # final/ only after the last step's checkpoint is complete
                    self._write_final()
                self.checkpoints.close()
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        return self._result(val_loss, losses, stopped=stopped)


@holds_run_folder
def train(
    recipe_path: str | Path,
    run_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    data: Sequence[str] = (),
    stage: str = "pretrain",
    resume: str = "none",
    overwrite: bool = False,
    init_from: str | None = None,
    keep_optimizer: bool = False,
    show: bool = True,
) -> TrainResult:
    """Validate everything, then train; the process group (if any) is always closed."""
    recipe = load_train_recipe(recipe_path, overrides, data, stage)
    init_from = init_from or recipe.model.from_
    if stage == "midtrain" and not init_from:
        raise UserError("--from", "is required", "pass the model or run folder to continue from, e.g. RUN/final")
    if stage == "pretrain" and init_from:
        raise UserError(
            "model.from", "pretrain starts from fresh weights", "continue a checkpoint with smolctl midtrain"
        )
    init_from = str(model_folder(Path(init_from))) if init_from else None
    trainer = Trainer(
        recipe,
        Path(run_dir),
        stage=stage,
        resume=resume,
        overwrite=overwrite,
        init_from=init_from,
        keep_optimizer=keep_optimizer,
        show=show,
    )
    try:
        return trainer.run()
    finally:
        trainer.prefetch.close()
        trainer.dist.close()
