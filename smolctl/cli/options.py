"""Options and arguments that several commands share, declared once as `Annotated` aliases, so that a signature
reads `json_out: JsonOpt = False` and the flag means the same thing everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object with the result on stdout.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace OUTPUT if it already holds files.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe key, e.g. --set training.steps=200 (repeatable; values are TOML).",
    ),
]
TextColumnOpt = Annotated[str, typer.Option("--text-column", help="Column holding the documents.")]

# Slurm arrays: the same command run as task N of M, each doing its share of the units
TasksOpt = Annotated[
    int | None,
    typer.Option(
        "--tasks",
        help="Run as one task of a Slurm array of this size (with dedup and mix: of one "
        "--stage): units are split round-robin; the task that finishes the last unit writes OUTPUT.",
    ),
]
TaskIdOpt = Annotated[
    int,
    typer.Option(
        "--task-id",
        help="This task's index in 0..tasks-1: in an array job pass $SLURM_ARRAY_TASK_ID (never read from the "
        "environment, as an array may number its tasks from 1).",
    ),
]

# Training commands: pretrain, midtrain, sft, dpo, ppo, grpo share the recipe schema and the run layout
RecipeArg = Annotated[
    Path,
    typer.Argument(
        metavar="RECIPE",
        help="TOML recipe: [model] [data] [optimizer] [schedule] [training] ... (one "
        'schema for every training command: README, "One recipe schema").',
        show_default=False,
    ),
]
RunArg = Annotated[
    Path | None,
    typer.Argument(
        metavar="[RUN]",
        help="Run folder: run.json, metrics.jsonl, events.jsonl, checkpoints/step-N/, final/ (the HF model).",
        show_default=False,
    ),
]
FromOpt = Annotated[
    str | None,
    typer.Option(
        "--from",
        metavar="PATH",
        help="Starting checkpoint: a model folder or a run folder (its final/); overrides the recipe's model.from.",
    ),
]
ResumeOpt = Annotated[
    str,
    typer.Option(
        "--resume",
        metavar="auto|none|PATH",
        help="auto: continue from the newest checkpoint in "
        "RUN/checkpoints (a no-op when the run finished, a fresh start when there is none); none: start "
        "fresh; or a RUN/checkpoints/step-N folder.",
    ),
]
OverwriteRunOpt = Annotated[bool, typer.Option("--overwrite", help="Delete RUN first if it already holds a run.")]
DataOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--data",
        metavar="PACKED",
        help="Packed folder(s) to train on, replacing the recipe's [data] paths/stages (repeatable).",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Validate, print the resolved recipe, parameter count and a memory/time "
        "estimate; build the model on the meta device; train nothing.",
    ),
]
WorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        metavar="N",
        min=1,
        help="--dry-run only: plan for this many processes (default: WORLD_SIZE or 1).",
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        metavar="GPU",
        help="--dry-run only: the GPU whose memory the plan must fit (h100, h200, "
        "a100-80, ... as in `smolctl estimate`; default h100).",
    ),
]
