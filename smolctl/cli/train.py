"""Pretraining commands: pretrain, midtrain, export (a checkpoint to a Hugging Face folder) and report (any run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from smolctl.cli.app import app
from smolctl.cli.common import (
    quiet_on_other_ranks,
    require_run,
    resume_hint_on_interrupt,
)
from smolctl.cli.options import (
    DataOpt,
    DryRunOpt,
    FromOpt,
    GpuOpt,
    JsonOpt,
    OverwriteOpt,
    OverwriteRunOpt,
    RecipeArg,
    ResumeOpt,
    RunArg,
    SetOpt,
    WorldSizeOpt,
)
from smolctl.console import (
    emit_json,
    escape,
    human_bytes,
    human_count,
    key_values,
    show,
    stderr_console,
    styled,
    table,
)
from smolctl.errors import CheckFailed, Interrupted, UserError
from smolctl.launcher import rank_from_env
from smolctl.results import Result

if TYPE_CHECKING:  # loads with the command that needs it, not with `smolctl --help`
    from smolctl.train.dryrun import DryRun


@app.command(
    "pretrain",
    epilog="""[bold]Examples[/]

  smolctl pretrain recipes/smollm3-tiny.toml demo-out/pretrain --data demo-out/packed

  smolctl pretrain recipes/smollm3.toml --dry-run --world-size 384

  torchrun --nproc_per_node 8 -m smolctl pretrain recipes/smollm3.toml runs/3b --resume auto

  smolctl pretrain recipes/smollm3-tiny.toml runs/t --data demo-out/packed --set training.steps=50 --set optimizer.lr=1e-3 --json
""",
)
def pretrain_command(
    recipe: RecipeArg,
    run: RunArg = None,
    data: DataOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    dry_run: DryRunOpt = False,
    world_size: WorldSizeOpt = None,
    gpu: GpuOpt = None,
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Pretrain a causal LM from a recipe on packed folders: resumable bit for bit, guarded, single process or torchrun."""
    _train_command(
        "pretrain",
        recipe,
        run,
        data=data or [],
        overrides=set_ or [],
        resume=resume,
        dry_run=dry_run,
        world_size=world_size,
        gpu=gpu,
        overwrite=overwrite,
        json_out=json_out,
    )


@app.command(
    "midtrain",
    epilog="""[bold]Examples[/]

  smolctl midtrain recipes/smollm3-tiny-midtrain.toml demo-out/midtrain --from demo-out/pretrain/final --data demo-out/packed-long

  smolctl midtrain recipes/smollm3-tiny-midtrain.toml runs/m --from runs/t/checkpoints/step-0000200 --keep-optimizer
""",
)
def midtrain_command(
    recipe: RecipeArg,
    run: RunArg = None,
    from_: FromOpt = None,
    keep_optimizer: bool = typer.Option(
        False, "--keep-optimizer", help="Carry the AdamW state over (needs a checkpoints/step-N folder)."
    ),
    data: DataOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    dry_run: DryRunOpt = False,
    world_size: WorldSizeOpt = None,
    gpu: GpuOpt = None,
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Continue pretraining from a checkpoint: annealing or long-context extension, recorded as the parent in the manifest."""
    _train_command(
        "midtrain",
        recipe,
        run,
        data=data or [],
        overrides=set_ or [],
        resume=resume,
        dry_run=dry_run,
        world_size=world_size,
        gpu=gpu,
        overwrite=overwrite,
        json_out=json_out,
        init_from=from_,
        keep_optimizer=keep_optimizer,
    )


@app.command(
    "export",
    epilog="""[bold]Examples[/]

  smolctl export runs/3b/checkpoints/step-0020000 runs/3b-step20k

  smolctl export runs/t/checkpoints/step-0000200 /tmp/t-200 --overwrite --json
""",
)
def export_command(
    checkpoint: Path = typer.Argument(..., help="A complete training checkpoint: RUN/checkpoints/step-NNNNNNN."),
    output: Path = typer.Argument(..., help="Hugging Face folder to write (config, tokenizer, safetensors, manifest)."),
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Turn a sharded checkpoint into a Hugging Face folder on CPU, tensor group by tensor group (any model size)."""
    from smolctl.train.checkpoint import export_checkpoint

    manifest = export_checkpoint(checkpoint, output, overwrite=overwrite)
    exported = Exported(
        str(output),
        str(checkpoint),
        manifest.get("step"),
        [s["name"] for s in manifest["shards"]],
        sum(s["bytes"] for s in manifest["shards"]),
    )
    if json_out:
        emit_json(exported.to_dict())
        return
    show(
        key_values(
            f"export {exported.output}",
            [
                ("from", f"{exported.checkpoint} (step {exported.step})"),
                ("weights", f"{len(exported.shards)} safetensors file(s), {exported.bytes:,} bytes"),
                ("load", f"AutoModelForCausalLM.from_pretrained({exported.output!r})"),
            ],
        )
    )


@dataclass
class Exported(Result):
    """What `smolctl export` wrote: the Hugging Face folder, from which checkpoint, and its safetensors files."""

    output: str
    checkpoint: str
    step: int | None
    shards: list[str]
    bytes: int


def _train_command(
    stage: str,
    recipe: Path,
    run: Path | None,
    *,
    data,
    overrides,
    resume: str,
    dry_run: bool,
    world_size: int | None,
    overwrite: bool,
    json_out: bool,
    init_from: str | None = None,
    keep_optimizer: bool = False,
    gpu: str | None = None,
) -> None:
    from smolctl.launcher import world_size_from_env
    from smolctl.train.pretrain import load_train_recipe, train

    rank = rank_from_env()
    try:
        planning_only = [flag for flag, value in (("--world-size", world_size), ("--gpu", gpu)) if value is not None]
        if planning_only and not dry_run:
            raise UserError(
                planning_only[0],
                "plans a --dry-run only: a training run is as large as the processes torchrun starts, on their GPUs",
                f"add --dry-run, or drop {planning_only[0]}",
            )
        if dry_run:
            from smolctl.train.dryrun import dry_run as plan_run

            result = plan_run(
                load_train_recipe(recipe, overrides, data, stage),
                world_size=world_size or world_size_from_env(),
                gpu=(gpu or "h100").lower(),
            )
            emit_json(result.to_dict()) if json_out else _render_dry_run(recipe, result)
            return
        run = require_run(run, stage, recipe)
        with resume_hint_on_interrupt(stage, recipe, run):
            outcome = train(
                recipe,
                run,
                overrides=overrides,
                data=data,
                stage=stage,
                resume=resume,
                overwrite=overwrite,
                init_from=init_from,
                keep_optimizer=keep_optimizer,
                show=not json_out and rank == 0,
            )
    except (UserError, CheckFailed, Interrupted) as exc:
        quiet_on_other_ranks(exc)
    if rank == 0:
        emit_json(outcome.to_dict()) if json_out else _render_train(outcome)
    if outcome.preempted:
        from smolctl.train.pretrain import PREEMPTED_EXIT

        raise typer.Exit(PREEMPTED_EXIT)  # recipes/slurm/pretrain.sbatch requeues the job on this code


def _render_dry_run(recipe: Path, r: DryRun) -> None:

    model, training = r.recipe["model"], r.recipe["training"]
    mem, layout = r.memory, r.layout
    fsdp = layout["dp_shard"] > 1
    rows = [
        (
            "model",
            f"{model['architecture']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
            f"FFN {model['intermediate_size']}, {model['num_attention_heads']} heads / {model['num_key_value_heads'] or model['num_attention_heads']} KV, "
            f"vocab {r.vocab_size:,}, rope θ {model['rope_theta']:g}",
        ),
        (
            "parameters",
            f"{human_count(r.parameters)} ({r.parameters:,}; {human_count(r.non_embedding_parameters)} non-embedding)",
        ),
        (
            "layout",
            f"world {r.world_size} = tp {layout['tp']} × dp {r.data_parallel} (dp_replicate {layout['dp_replicate']} × "
            f"dp_shard {layout['dp_shard']}){'; FSDP2 over dp' if fsdp else ''}",
        ),
        (
            "batch",
            f"{r.global_batch} sequences × {training['seq_len']} = {r.tokens_per_step:,} tokens/step; micro batch "
            f"{r.micro_batch} × dp {r.data_parallel} × accumulation {r.grad_accum}",
        ),
        (
            "budget",
            f"{r.steps:,} steps = {human_count(r.total_tokens)} tokens, {r.total_flops:.3g} FLOPs "
            f"({r.flops_per_token:.3g} per token)",
        ),
        (
            "memory / GPU",
            f"{human_bytes(mem['total'])} of {human_bytes(mem['capacity'])} on {mem['gpu']}: "
            f"{'fits' if mem['fits'] else 'does NOT fit'} ({human_bytes(mem['activations'])} activations, "
            f"checkpointing {training['activation_checkpointing']}; same model as `smolctl estimate`)",
        ),
        (
            "time",
            f"{r.estimate['gpu_hours']:,.0f} {r.estimate['gpu']} GPU-hours at {r.estimate['assumed_mfu']:.0%} MFU"
            f" = {r.estimate['days']:,.1f} days on {r.world_size}",
        ),
    ]
    if r.would_fit is not None:
        options = [f"micro_batch {r.would_fit['largest_micro_batch']}"] if r.would_fit["largest_micro_batch"] else []
        options += [
            ", ".join(f"{k} = {str(v).lower()}" for k, v in o.items() if k != "total") + f" ({human_bytes(o['total'])})"
            for o in r.would_fit["layouts"]
        ]
        rows.append(
            ("would fit", "\n".join(options) or "nothing on this many GPUs: add GPUs or pick a larger one (--gpu)")
        )
    show(key_values(f"{recipe} (dry run: nothing trained, model built on the meta device)", rows))
    show(table("data", ["folder", "status"], r.data.items(), justify="left"))
    show(styled("resolved recipe: [bold]--json[/] prints it in full"))


def _render_train(r) -> None:
    from smolctl.train.monitor import CHECKPOINT_BUDGET_S_PER_1000_STEPS, flops_text

    if r.nothing_to_do:
        stderr_console().print(f"nothing to do: {r.run} finished at step {r.steps:,}; {r.final} left as it was")
    elif r.preempted:
        stderr_console().print(
            f"[yellow]{r.preempted}[/]: stopped after saving step {r.steps:,}; continue with --resume auto"
        )
    speed = r.speed
    rate = f"{human_count(speed['tokens_per_s'])} tokens/s, " + (
        f"MFU {speed['mfu']:.1%}"
        if speed["mfu"] is not None
        else f"{flops_text(speed['flops_per_s'])} (no MFU: no known peak)"
    )
    loss = f"{r.first_loss:.4f} → {r.final_loss:.4f}" if r.first_loss is not None else "-"
    show(
        key_values(
            f"{r.stage} {r.run}",
            [
                ("final model", f"{r.final}  (AutoModelForCausalLM.from_pretrained loads it; next stage: --from)"),
                (
                    "steps",
                    f"{r.steps:,} ({speed['steps_run']:,} run now{', resumed from ' + r.resumed_from if r.resumed_from else ''})",
                ),
                ("tokens seen", human_count(r.tokens_seen)),
                ("parameters", human_count(r.parameters)),
                ("loss", loss + (f"  (validation {r.val_loss:.4f})" if r.val_loss is not None else "")),
                (
                    "batch",
                    f"{r.plan['global_batch']} seq × {r.plan['seq_len']} = {r.plan['tokens_per_step']:,} tokens/step "
                    f"(micro {r.plan['micro_batch']} × world {r.plan['world_size']} × accumulation {r.plan['grad_accum']})",
                ),
                ("speed", f"{rate}; data wait {speed['data_wait']:.2%} of step time"),
                (
                    "checkpoint cost",
                    f"{speed['checkpoints_saved']} saves, {speed['checkpoint_s_each']:.2f} s blocking each, "
                    f"{speed['checkpoint_share']:.2%} of wall time, {speed['checkpoint_s_per_1000_steps']:.0f} s per 1,000 steps "
                    f"(yardstick < {CHECKPOINT_BUDGET_S_PER_1000_STEPS:.0f})",
                ),
                (
                    "guards",
                    f"{r.skipped_steps} skipped (non-finite), {r.spikes} spikes, {r.rollbacks} rollbacks"
                    + (f" — see {r.run}/events.jsonl" if r.events else ""),
                ),
                ("parent", r.parent or "-"),
                ("checkpoints", "\n".join(r.checkpoints) or "-"),
            ],
        )
    )


@app.command(
    "report",
    epilog="""[bold]Examples[/]

  smolctl report demo-out/pretrain

  smolctl report runs/lr-3e-3 runs/lr-1e-3 --html compare.html

  smolctl report demo-out/sft --json
""",
)
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run folders of any training command (they hold metrics.jsonl)."),
    html: Path | None = typer.Option(
        None, "--html", help="Also write one self-contained HTML file (plots inline, no network)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --html file if it exists."),
    json_out: JsonOpt = False,
) -> None:
    """A run in the playbook's terms: loss/lr/grad-norm/throughput plots, KPIs against targets, and a diagnosis."""
    from smolctl.train.report import Reports, build_reports
    from smolctl.train.report_views import write_html

    reports = build_reports(runs)
    if html is not None:
        write_html(html, reports, overwrite)
    made = Reports(reports, str(html) if html is not None else None)
    if json_out:
        emit_json(made.to_dict())
    else:
        _render_report(made)


def _render_report(made) -> None:
    from smolctl.train.report_views import (
        legend,
        plotted_metrics,
        rows_text,
        text_plot,
        when,
    )

    reports, html_path = made.runs, made.html
    colors = {"pass": "green", "warn": "yellow", "n/a": "dim"}
    for report in reports:
        s = report.summary
        loss = (
            f"{s['first_loss']:.4f} → {s['last_loss']:.4f} (min {s['min_loss']:.4f})"
            if s["first_loss"] is not None
            else "-"
        )
        show(
            key_values(
                f"{report.stage} {report.run}",
                [
                    (
                        "steps",
                        f"{s['steps']:,}"
                        + (
                            f" on {s['world_size']} process{'es' if s['world_size'] > 1 else ''}"
                            if s["world_size"]
                            else ""
                        ),
                    ),
                    ("loss", loss + (f"  (validation {s['val_loss']:.4f})" if s["val_loss"] is not None else "")),
                    (
                        "tokens/s",
                        human_count(s["tokens_per_s"]) + " (median)" if s["tokens_per_s"] is not None else "-",
                    ),
                    ("guards", f"{s['skipped']} skipped, {s['spikes']} spikes, {s['rollbacks']} rollbacks"),
                ],
            )
        )
    if len(reports) > 1:
        show(styled(legend(reports)))
    for metric in plotted_metrics(reports):
        show(styled(text_plot(reports, metric, width=min(72, max(32, stderr_console().width - 16)))))
    for report in reports:
        show(
            table(
                f"KPIs · {report.run}",
                ["KPI", "target", "value", "status", "what to do"],
                [
                    (k.name, k.target, k.shown, styled(f"[{colors[k.status]}]{k.status}[/]"), k.advice)
                    for k in report.kpis
                ],
                justify="left",
            )
        )
        if report.findings:
            show(
                table(
                    f"diagnosis · {report.run}",
                    ["what", "when", "detail", "likely cause", "what to do"],
                    [
                        (f.kind, when(f), f.detail + (f"\n{rows_text(f.rows)}" if f.rows else ""), f.cause, f.remedy)
                        for f in report.findings
                    ],
                    justify="left",
                )
            )
        else:
            show(
                styled(f"diagnosis · {escape(report.run)}: [green]no spike, drift, plateau, slowdown or guard event[/]")
            )
    if html_path is not None:
        show(f"HTML report: {html_path}")
