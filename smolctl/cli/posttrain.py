"""Post-training commands: sft, dpo, ppo, grpo (one recipe schema, one run layout), generate and merge."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import typer

from smolctl.cli.app import app
from smolctl.cli.common import (
    quiet_on_other_ranks,
    require_run,
    resume_hint_on_interrupt,
)
from smolctl.cli.options import (
    FromOpt,
    JsonOpt,
    OverwriteOpt,
    OverwriteRunOpt,
    RecipeArg,
    ResumeOpt,
    RunArg,
    SetOpt,
)
from smolctl.console import (
    emit_json,
    human_count,
    human_duration,
    key_values,
    progress,
    show,
    stderr_console,
    table,
    warn,
)
from smolctl.errors import CheckFailed, Interrupted, UserError
from smolctl.launcher import rank_from_env


def _post_train(
    stage: str,
    run_stage,
    recipe: Path,
    run: Path | None,
    from_: str | None,
    overrides: list[str] | None,
    resume: str,
    overwrite: bool,
    json_out: bool,
) -> None:
    """Shared by sft, dpo, ppo and grpo: validate the recipe, train with a live bar, print the summary."""

    from smolctl.train.config import load_command_recipe

    rank = rank_from_env()
    try:
        config = load_command_recipe(stage, recipe, overrides or [])
        with ExitStack() as stack:
            live: dict = {}

            def on_step(step: int, total: int, metrics: dict) -> None:
                # The bar opens at the first step, so that an input error is one line with no bar above it.
                if not live:
                    live["bar"] = stack.enter_context(progress(not json_out))
                    live["task"] = live["bar"].add_task(stage, total=total, rate="")
                shown = [
                    f"{label} {metrics[key]:.4g}"
                    for key, label in (
                        ("loss", "loss"),
                        ("reward", "reward"),
                        ("rewards/accuracies", "acc"),
                        ("kl", "kl"),
                    )
                    if key in metrics
                ]
                live["bar"].update(live["task"], completed=step, total=total, rate="  ".join(shown))

            with resume_hint_on_interrupt(stage, recipe, run or "RUN"):
                result = run_stage(
                    config,
                    require_run(run, stage, recipe),
                    start=from_,
                    resume=resume,
                    overwrite=overwrite,
                    on_step=on_step,
                )
    except (UserError, CheckFailed, Interrupted) as exc:
        quiet_on_other_ranks(exc)  # under torchrun every rank refuses; rank 0 says it once
    if rank != 0:
        return
    if json_out:
        emit_json(result.to_dict())
        return
    if result.nothing_to_do:
        stderr_console().print(
            f"nothing to do: {result.run} finished at step {result.steps}; {result.final} is unchanged "
            "(raise training.steps to train longer)"
        )
    facts = [
        ("model", result.final),
        ("from", result.parent),
        ("steps", result.steps),
        ("time", human_duration(result.seconds)),
    ]
    if result.parameters:
        share = result.parameters["trainable"] / max(1, result.parameters["total"])
        facts.append(
            (
                "parameters",
                f"{human_count(result.parameters['trainable'])} trainable of "
                f"{human_count(result.parameters['total'])} ({share:.2%})",
            )
        )
    if result.adapter:
        facts.append(("adapter", f"{result.adapter} (final/ holds it merged)"))
    if result.resumed_from:
        facts.append(("resumed from", result.resumed_from))
    facts += [(key, f"{value:.4g}" if isinstance(value, float) else value) for key, value in result.metrics.items()]
    facts += [
        (key, ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else value)
        for key, value in result.data.items()
    ]
    facts.append(("metrics", str(Path(result.run) / "metrics.jsonl")))
    show(key_values(f"{result.stage} → {result.run}", facts))


@app.command(
    "sft",
    epilog="""[bold]Examples[/]

  smolctl sft recipes/sft-tiny.toml demo-out/sft --from demo-out/pretrain/final

  smolctl sft recipes/smollm3-sft.toml runs/sft --from runs/midtrain --resume auto

  smolctl sft recipes/sft-tiny.toml out/ --from ckpt/ --set sft.packing=padding_free --set training.steps=10

  smolctl sft recipes/sft-lora-tiny.toml demo-out/sft-lora --from demo-out/midtrain     (LoRA: [peft] table)

  torchrun --nproc_per_node 8 -m smolctl sft recipes/smollm3-sft.toml runs/sft --from runs/midtrain
""",
)
def sft_command(
    recipe: RecipeArg,
    run: RunArg = None,
    from_: FromOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Supervised fine-tuning on chat data with TRL's SFTTrainer: assistant-only loss, BFD packing or padding-free,
    task-balanced sampling, LoRA adapters through peft."""
    from smolctl.train.posttrain import run_sft

    _post_train("sft", run_sft, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command(
    "dpo",
    epilog="""[bold]Examples[/]

  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft

  smolctl dpo recipes/smollm3-dpo.toml runs/apo --from runs/sft --set dpo.loss_type=apo_zero --set dpo.beta=0.05

  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft --resume auto --json
""",
)
def dpo_command(
    recipe: RecipeArg,
    run: RunArg = None,
    from_: FromOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Preference optimisation (DPO, APO-zero, IPO, ...) with TRL's DPOTrainer against the starting checkpoint as
    reference; reports reward accuracy and margins."""
    from smolctl.train.posttrain import run_dpo

    _post_train("dpo", run_dpo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command(
    "ppo",
    epilog="""[bold]Examples[/]

  smolctl ppo recipes/ppo-tiny.toml demo-out/ppo --from demo-out/dpo

  smolctl ppo recipes/smollm3-ppo.toml runs/ppo --from runs/apo --resume auto

  torchrun --nproc_per_node 8 -m smolctl ppo recipes/smollm3-ppo.toml runs/ppo --from runs/apo
""",
)
def ppo_command(
    recipe: RecipeArg,
    run: RunArg = None,
    from_: FromOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """PPO on composable rewards (task match, length penalty, n-gram diversity): value head, KL to the reference,
    GAE, clipped losses; data-parallel under torchrun (each process generates its share of ppo.batch_size)."""
    from smolctl.train.ppo import run_ppo

    _post_train("ppo", run_ppo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command(
    "grpo",
    epilog="""[bold]Examples[/]

  smolctl grpo recipes/grpo-tiny.toml demo-out/grpo --from demo-out/dpo

  torchrun --nproc_per_node 8 -m smolctl grpo recipes/smollm3-grpo.toml runs/grpo --from runs/apo
""",
)
def grpo_command(
    recipe: RecipeArg,
    run: RunArg = None,
    from_: FromOpt = None,
    set_: SetOpt = None,
    resume: ResumeOpt = "none",
    overwrite: OverwriteRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """GRPO with TRL's GRPOTrainer on the same rewards as ppo: groups of completions per prompt, rewards
    normalised within each group, no value model."""
    from smolctl.train.grpo import run_grpo

    _post_train("grpo", run_grpo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command(
    "generate",
    epilog="""[bold]Examples[/]

  smolctl generate data/sample/prompts demo-out/completions --model demo-out/sft --num-completions 2

  smolctl generate data/sample/prompts demo-out/pairs --pairs --chosen demo-out/dpo --rejected demo-out/sft

  smolctl generate data/sample/prompts demo-out/ranked --model demo-out/sft -k 4 --rank-by recipes/ppo-tiny.toml

  smolctl generate prompts/ runs/synthetic --model runs/sft --max-new-tokens 1024 --backend vllm --json
""",
)
def generate_command(
    prompts: str = typer.Argument(..., help="Dataset folder (or parquet file/glob) with a column of prompt strings."),
    output: Path = typer.Argument(..., help="Dataset folder to write (a rerun of a killed run continues it)."),
    model: str | None = typer.Option(None, "--model", help="Model or run folder to sample (not with --pairs)."),
    pairs: bool = typer.Option(False, "--pairs", help="Preference pairs: --chosen's answer vs --rejected's."),
    chosen: str | None = typer.Option(None, "--chosen", help="--pairs: the strong model (its answers are chosen)."),
    rejected: str | None = typer.Option(None, "--rejected", help="--pairs: the weak model (answers rejected)."),
    rank_by: Path | None = typer.Option(
        None,
        "--rank-by",
        help="Recipe whose [[rewards]] tables (as ppo/grpo use) rank K completions: best chosen, worst rejected.",
    ),
    num_completions: int = typer.Option(1, "--num-completions", "-k", help="Completions per prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens sampled per completion."),
    temperature: float = typer.Option(0.6, "--temperature", help="0 is greedy (SmolLM3 suggests 0.6)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (SmolLM3 suggests 0.95)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sampling of every batch."),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="Column holding the prompts."),
    limit: int | None = typer.Option(None, "--limit", help="Use only the first N prompts."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per generate call."),
    shard_prompts: int = typer.Option(
        256, "--shard-prompts", help="Prompts per output shard (a killed run resumes from the last whole shard)."
    ),
    backend: str = typer.Option(
        "auto", "--backend", help="auto (vLLM when installed and on a GPU), transformers or vllm."
    ),
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Sample a model on prompts (chat template applied): completions for SFT data, or preference pairs for dpo
    from a strong and a weak model or from K completions ranked by rewards."""
    from smolctl.train.generate import GenerateJob, Sampling, run_generate

    if pairs:
        if model or not (chosen and rejected):
            raise UserError(
                "--pairs",
                "takes --chosen STRONG and --rejected WEAK (and no --model)",
                "e.g. --pairs --chosen runs/dpo --rejected runs/sft",
            )
        if rank_by:
            raise UserError("--rank-by", "ranks K completions of one --model, not --pairs", "use one of the two")
        models, mode = [chosen, rejected], "pairs"
    else:
        if chosen or rejected:
            raise UserError("--chosen/--rejected", "are the two models of --pairs", "add --pairs, or use --model")
        if not model:
            raise UserError("--model", "no model to sample", "pass --model PATH (a model folder or a run folder)")
        models, mode = [model], "ranked" if rank_by else "completions"
    reward, reference_column = None, "reference"
    if rank_by:
        from smolctl.train.rewards import load_reward_tables

        reward, reference_column = load_reward_tables(rank_by)
    job = GenerateJob(
        prompts=prompts,
        output=output,
        models=[Path(m) for m in models],
        mode=mode,
        sampling=Sampling(
            num_completions=num_completions,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        ),
        prompt_column=prompt_column,
        limit=limit,
        batch_size=batch_size,
        shard_prompts=shard_prompts,
        backend=backend,
        reward=reward,
        reward_recipe=str(rank_by) if rank_by else None,
        reference_column=reference_column,
        overwrite=overwrite,
    )
    with progress(not json_out) as bar:
        task = bar.add_task(f"generating ({mode})", total=None, rate="", visible=False)

        def on_progress(done: int, total: int, rate: float) -> None:
            bar.update(task, completed=done, total=total, visible=True, rate=f"{human_count(rate)} tok/s")

        result = run_generate(job, on_progress=on_progress)
    if json_out:
        emit_json(result.to_dict())
        return
    facts = [
        ("mode", result.mode),
        ("models", ", ".join(result.models)),
        ("backend", result.backend),
        ("prompts", result.prompts),
        ("rows", result.rows),
        ("shards", result.shards),
        ("tokens sampled", f"{human_count(result.completion_tokens)} ({result.tokens_per_second:.0f} tok/s)"),
    ]
    if result.resumed_shards:
        facts.append(("resumed", f"{result.resumed_shards} shards were already done"))
    if result.without_chat_template:
        facts.append(("prompts as text", f"no chat template: {', '.join(result.without_chat_template)}"))
    if result.mode == "ranked":
        facts.append(("dropped (all K tied)", result.dropped_tied))
    show(key_values(f"generate → {result.output}", facts))
    for model, count in result.past_context.items():
        warn(
            f"{count} prompt(s) with max_new_tokens run past {model}'s positions (max_position_embeddings): sampled "
            "all the same, past what it was trained on"
        )


@app.command(
    "merge",
    epilog="""[bold]Examples[/]

  smolctl merge recipes/smollm3-merge.toml runs/merged

  smolctl merge --method linear --model demo-out/dpo:0.9 --model demo-out/midtrain:0.1 demo-out/merged

  smolctl merge --method linear --model runs/apo-a --model runs/apo-b --model runs/apo-c runs/soup

  smolctl merge --method slerp --model runs/a --model runs/b --set options.t=0.3 runs/slerp
""",
)
def merge_command(
    arguments: list[str] = typer.Argument(
        ...,
        help="[RECIPE] OUTPUT: a TOML recipe (method, models, options) "
        "and the model folder to write; OUTPUT alone with --method/--model.",
        metavar="[RECIPE] OUTPUT",
    ),
    method: str | None = typer.Option(None, "--method", help="linear, slerp, ties or dare_ties (without a recipe)."),
    model: list[str] | None = typer.Option(
        None,
        "--model",
        help="PATH[:WEIGHT] (repeat): a model folder or "
        "a run folder (its final/). Linear without weights: a model soup.",
    ),
    base: str | None = typer.Option(None, "--base", help="ties, dare_ties: the model task vectors are taken against."),
    overrides: SetOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Merge checkpoints in weight space with MergeKit (linear, model soups, SLERP, TIES, DARE-TIES) into a model
    folder whose lineage lists every parent."""
    from smolctl.train.merge import load_merge_recipe, run_merge

    if len(arguments) > 2:
        raise UserError(
            "merge",
            f"takes [RECIPE] OUTPUT, got {len(arguments)} arguments",
            "pass the models with --model, or list them in the recipe",
        )
    recipe_path, output = (arguments[0], arguments[1]) if len(arguments) == 2 else (None, arguments[0])
    recipe, where = load_merge_recipe(recipe_path, overrides or [], method, model or [], base)
    with stderr_console().status(f"merging {len(recipe.models)} model entries ({recipe.method})", spinner="dots"):
        result = run_merge(recipe, output, where=where, overwrite=overwrite)
    if json_out:
        emit_json(result.to_dict())
        return
    show(
        table(
            f"merge ({result.method}) → {result.output}  ({human_count(result.parameters)} parameters, "
            f"{result.seconds:.1f}s)",
            ["parent", "weight", "density"],
            (
                [
                    p["path"],
                    "" if p["weight"] is None else f"{p['weight']:.4g}",
                    "" if p["density"] is None else f"{p['density']:.3g}",
                ]
                for p in result.parents
            ),
        )
    )
    if result.base:
        show(f"base: {result.base}")
    if result.method_parameters:
        show(f"{result.method}: " + ", ".join(f"{key} {value}" for key, value in result.method_parameters.items()))
