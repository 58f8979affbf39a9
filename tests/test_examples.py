"""Every shell example a user is shown runs as written: the ```bash blocks of README.md and docs/*.md, the commented
examples at the top of recipes/*.toml and recipes/slurm/*.sbatch, and the examples in each command's --help. A broken
example fails here, naming the file and line (or the command whose help shows it).

How each example is checked (all in a scratch workspace that links recipes/, data/, completions/ and holds a
`demo-out/` built by the demo's data stages, so `demo-out/...` paths mean what they mean after `make demo`):
- a synopsis (`[--flag N]`, `a|b`): not run; every --flag it names must exist on that command;
- every example naming a smolctl command is parsed by the CLI itself (unknown flags, missing arguments);
- then it runs, with PLACEHOLDERS (`RECIPE`, `crawl/`, `/data/crawl`) and SUBSTITUTIONS (sizes: 64 array tasks
  become 2) applied. `pretrain`/`midtrain` examples run as `--dry-run` at the example's world size (torchrun's
  processes × nodes); those on a TINY_RECIPE also train for real (a few steps, `slow`), as do sft/dpo/ppo on tiny
  recipes (examples only in --help are parsed and, for training, dry-run). `sbatch` runs the script under stand-ins for sbatch/srun/scontrol, so its own lines (the dry-run, the
  array chaining) execute and the srun line is recorded; `srun CMD` runs CMD once here. Cheap examples run
  together in one process (smolctl's `main` per example), so the fast part of this file takes well under a minute.

Adding an example: nothing to do if it runs on the sample data. Otherwise the test fails with what to add:
PLACEHOLDERS (a word or path of the example → what it stands for here), WORKSPACE (a path the example reads →
a folder made for it), SKIP (the example cannot run here: say why, e.g. it needs GPUs), or XFAIL (it is known to
fail: name the issue; the test starts checking once the issue is fixed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO

# --------------------------------------------------------------------------------------------------------------
# The tables to extend

# Examples that cannot run here, by their exact text (after `#` comments are dropped), with the reason.
PUBLISHED_MIX = "the published mixture asks for trillions of tokens; recipes/demo-mix.toml runs the same schema here"
REAL_SLURM = "submits job arrays and afterok chains: tests/test_slurm.py runs these scripts on a real local Slurm"
FULL_SIZE_POSTTRAIN = "a full-size post-training recipe: needs GPUs (its tiny twin recipes/*-tiny.toml runs here)"
SKIP = {
    "make demo": "the whole demo: tests/test_pipeline.py runs the same stages with fewer steps",
    "make test": "the test suite itself",
    "make wheel": "builds the wheel: tests/test_packaging.py builds one and installs it into a fresh venv",
    "pip install .": "installs into the user's environment: tests/test_packaging.py installs the wheel into a fresh venv",
    "pip install '.[merge,tensorboard]'": "installs into the user's environment (the extras' packages are in the test venv)",
    "cp completions/_smolctl ~/.zfunc/ && autoload -U compinit && compinit": "installs into the user's zsh setup",
    "cp completions/smolctl.fish ~/.config/fish/completions/": "installs into the user's fish setup",
    "accelerate launch -m smolctl pretrain RECIPE RUN": "the process count comes from the user's accelerate config; the torchrun examples dry-run the same command",
    "... --set dpo.loss_type=sigmoid --set dpo.beta=0.1": "continues the line above it",
    "smolctl mix /data/smollm3-mix --recipe recipes/smollm3-mix.toml --set sources.web.path=/data/web "
    "--set sources.code.path=/data/code --set sources.math.path=/data/math": PUBLISHED_MIX,
    "smolctl mix out/ --recipe recipes/smollm3-mix.toml --set stages.0.tokens=1_000_000_000 --json": PUBLISHED_MIX,
    "smolctl pack mix/ packed/ --tokenizer HuggingFaceTB/SmolLM3-3B --seq-len 4096 --workers 8": "downloads the SmolLM3 tokenizer from the Hugging Face Hub",
    "smolctl stress-gpu": "needs GPUs (a 60 s burn-in); `smolctl stress-gpu --duration 3s --devices cpu` runs here",
    "smolctl stress-gpu --duration 10m --expect-tflops 600 --json": "needs GPUs",
    "srun --ntasks-per-node 1 smolctl stress-gpu --duration 10m --json": "needs GPUs on every node",
    "torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --expect-busbw all_reduce=350,all_to_all=40": "needs 8 GPUs on NVLink",
    "torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --ops all_reduce,all_to_all --min-bytes 1M --max-bytes 8G": "needs 8 GPUs (8 GiB buffers)",
    "DATA=data/sample OUT=run1/ TASKS=64 bash recipes/slurm/pipeline.sh": REAL_SLURM,
    'OUTPUT=mix/ MIX_ARGS="--recipe recipes/demo-mix.toml" TASKS=64 bash recipes/slurm/mix.sbatch': REAL_SLURM,
    "INPUT=mix/ OUTPUT=packed/ TOKENIZER=tok/ TASKS=64 bash recipes/slurm/pack.sbatch": REAL_SLURM,
    'OUTPUT=/data/mix MIX_ARGS="--recipe recipes/smollm3-mix.toml --tokenizer /data/tokenizer" TASKS=64 '
    "bash recipes/slurm/mix.sbatch": REAL_SLURM,
    "INPUT=/data/mix OUTPUT=/data/packed TOKENIZER=/data/tokenizer TASKS=64 bash recipes/slurm/pack.sbatch": REAL_SLURM,
    "smolctl inspect demo-out/ppo --lineage": "needs the demo's post-training output; tests/test_pipeline.py checks this lineage from the final model",
}
# Post-training examples on these recipes are parsed only (see FULL_SIZE_POSTTRAIN).
FULL_SIZE_RECIPES = {
    "recipes/smollm3-sft.toml",
    "recipes/smollm3-dpo.toml",
    "recipes/smollm3-ppo.toml",
    "recipes/smollm3-grpo.toml",
}
# Training examples on these recipes also train for real, a few steps, with TINY_RUN's overrides.
TINY_RECIPES = {
    "recipes/smollm3-tiny.toml",
    "recipes/smollm3-tiny-midtrain.toml",
    "recipes/sft-tiny.toml",
    "recipes/sft-lora-tiny.toml",
    "recipes/dpo-tiny.toml",
    "recipes/ppo-tiny.toml",
    "recipes/grpo-tiny.toml",
}
TINY_RUN = {
    "pretrain": ["training.steps=2", "schedule.warmup_steps=1", "checkpoint.interval=100", "logging.interval=1"],
    "midtrain": [
        "training.steps=2",
        "training.micro_batch=2",
        "training.global_batch=2",
        "schedule.warmup_steps=0",
        "checkpoint.interval=100",
        "logging.interval=1",
    ],
    "sft": ["training.steps=1", "schedule.warmup_steps=0", "checkpoint.interval=100", "sft.max_length=128"],
    "dpo": ["training.steps=1", "checkpoint.interval=100", "dpo.max_length=64", "data.limit=8"],
    "ppo": [
        "training.steps=1",
        "ppo.batch_size=4",
        "ppo.minibatch_size=4",
        "training.micro_batch=4",
        "ppo.epochs=1",
        "checkpoint.interval=100",
        "ppo.max_new_tokens=4",
    ],
    "grpo": [
        "training.steps=1",
        "training.micro_batch=4",
        "training.global_batch=4",
        "grpo.num_generations=2",
        "checkpoint.interval=100",
        "grpo.max_new_tokens=4",
    ],
}
# generate, merge, report and export read trained runs: examples on demo-out/ run (slow) after the tiny chain, with these
# flags; those on the user's runs/ are parsed only (USER_RUNS).
MODEL_CONSUMERS = {"generate": ["--limit", "4", "--max-new-tokens", "4"], "merge": [], "report": [], "export": []}
USER_RUNS = "reads the user's own runs (runs/...); the examples on demo-out/ run here"
# Examples known to fail, by exact text, with the issue that fixes them (the test passes again once it is fixed).
XFAIL: dict[str, str] = {}
# Words and paths that stand for the user's own: replaced, whole word, before running.
PLACEHOLDERS = {
    "RECIPE": "recipes/smollm3.toml",
    "RUN": "runs/smollm3",
    "/data/crawl-dedup": "deduped/",
    "/data/crawl": "crawl/",
    "$SLURM_ARRAY_TASK_ID": "0",
}
# Sizes that would take too long here; the example is otherwise run as written.
SUBSTITUTIONS = {
    "TASKS=64": "TASKS=2",  # 64 array tasks, one process each, over a 2-shard sample
    "--tokens 2G": "--tokens 100K",  # the sample corpus holds about a million tokens
}


# Paths examples read that the workspace provides: a repository path to link, or a function making the folder.
def _corpus(folder: Path) -> None:
    """Parquet files as another tool writes them, the documents under `content` (and `text`)."""
    import pyarrow.parquet as pq

    folder.mkdir()
    for shard in sorted((REPO / "data" / "sample" / "web").glob("part-*.parquet")):
        table = pq.read_table(shard)
        pq.write_table(table.append_column("content", table["text"]), folder / shard.name)


WORKSPACE = {
    "crawl": "data/sample/web",
    "new-crawl": "data/sample/web",
    "last-release": "data/sample/math",
    **{name: f"data/sample/{name}" for name in ("web", "code", "math")},
    "corpus": _corpus,
    "mix": lambda path: path.symlink_to("demo-out/mix"),
    "path/to/model-folder/config.json": lambda path: path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 2048,
            }
        )
    ),
}
# The demo's data stages (scripts/demo.sh), run first: what `demo-out/...` in an example refers to.
DEMO_OUT = [
    ["train-tokenizer", "data/sample/web", "demo-out/tokenizer", "--vocab-size", "2048"],
    *[["dedup", f"data/sample/{s}", f"demo-out/dedup/{s}", "--workers", "1"] for s in ("web", "code", "math")],
    [
        "mix",
        "demo-out/mix",
        "--recipe",
        "recipes/demo-mix.toml",
        "--set",
        "sources.web.path=demo-out/dedup/web",
        "--set",
        "sources.code.path=demo-out/dedup/code",
        "--set",
        "sources.math.path=demo-out/dedup/math",
    ],
    ["pack", "demo-out/mix/stage-1", "demo-out/packed", "--tokenizer", "demo-out/tokenizer", "--seq-len", "256"],
    ["pack", "demo-out/mix/stage-3", "demo-out/packed-long", "--tokenizer", "demo-out/tokenizer", "--seq-len", "512"],
]

# --------------------------------------------------------------------------------------------------------------
# Finding the examples

LAUNCHERS = ("smolctl", "torchrun", "accelerate", "sbatch", "srun", "bash", "source", "cp", "make", "...")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # shlex has already joined a quoted value


@dataclass
class Example:
    text: str
    origins: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{', '.join(self.origins)}: {self.text}"

    @property
    def only_in_help(self) -> bool:
        return all(origin.endswith("--help") for origin in self.origins)


def _starts_a_command(line: str) -> bool:
    words = line.split()
    return bool(words) and (words[0] in LAUNCHERS or bool(ENV_ASSIGNMENT.match(words[0])))


def _clean(text: str) -> str:
    """Drop a trailing `# comment` or `   (remark)` and collapse whitespace."""
    text = re.sub(r"\s#\s.*$", "", text)
    text = re.sub(r"\s{2,}\(.*\)$", "", text)
    return " ".join(text.split())


def readme_examples() -> list[tuple[str, str]]:
    """Commands in ```bash blocks of README.md and docs/*.md; `\\` continues a line, and so does an indented line
    (a wrapped synopsis)."""
    found: list[tuple[str, str]] = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        inside, continued = False, False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                inside, continued = line.strip() == "```bash", False
                continue
            if not inside or not line.strip() or line.lstrip().startswith("#"):
                continued = False
                continue
            if (continued or line.startswith(" ")) and found:
                found[-1] = (found[-1][0], found[-1][1] + " " + line.strip().rstrip("\\"))
            else:
                found.append((f"{path.relative_to(REPO)}:{number}", line.rstrip().rstrip("\\")))
            continued = line.rstrip().endswith("\\")
    return found


def header_examples(path: Path) -> list[tuple[str, str]]:
    """Indented commands in the comment block a recipe or sbatch file starts with (#SBATCH lines are not)."""
    found: list[tuple[str, str]] = []
    continued = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#!") or line.startswith("#SBATCH"):
            continue
        if not line.startswith("#"):
            break
        body = line[1:]
        if continued:
            found[-1] = (found[-1][0], found[-1][1] + " " + body.strip().rstrip("\\"))
        elif body.startswith("   ") and _starts_a_command(body.strip()):
            found.append((f"{path.relative_to(REPO)}:{number}", body.strip().rstrip("\\")))
        continued = bool(found) and body.rstrip().endswith("\\") and (continued or _starts_a_command(body.strip()))
    return found


def help_examples() -> list[tuple[str, str]]:
    """The example lines of each command's --help epilog; a line starting with -- continues the one above, and text
    after three spaces describes the example."""
    from smolctl.cli import app

    found: list[tuple[str, str]] = []
    for command in app.registered_commands:
        for line in (command.epilog or "").splitlines():
            text = re.split(r"\s{3,}", line.strip())[0]
            if text.startswith("--") and found:
                found[-1] = (found[-1][0], found[-1][1] + " " + text)
            elif _starts_a_command(text):
                found.append((f"smolctl {command.name} --help", text))
    return found


def all_examples() -> list[Example]:
    sources = readme_examples()
    for path in sorted([*(REPO / "recipes").glob("*.toml"), *(REPO / "recipes" / "slurm").glob("*.sbatch")]):
        sources += header_examples(path)
    sources += help_examples()
    examples: dict[str, Example] = {}
    for origin, text in sources:
        examples.setdefault(_clean(text), Example(_clean(text))).origins.append(origin)
    return list(examples.values())


def is_synopsis(text: str) -> bool:
    return bool(re.search(r"\[[-A-Za-z.]|\w\|\w|\]\.\.\.", text))


# --------------------------------------------------------------------------------------------------------------
# Reading an example as smolctl arguments


def _cli_group():
    import typer

    from smolctl.cli import app

    return typer.main.get_command(app)


@dataclass
class Plan:
    """How one example runs here."""

    example: Example
    argv: list[str]  # the example's words after substitution
    command: str | None = None  # the smolctl command it runs
    smolctl_args: list[str] = field(default_factory=list)
    world_size: int = 1
    launcher: str = "smolctl"


def _value_after(words: list[str], *flags: str, default: str | None = None) -> str | None:
    for i, word in enumerate(words):
        for flag in flags:
            if word == flag and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    return default


class Unmapped(AssertionError):
    """An example with a word of the user's that no table maps."""


def plan(example: Example) -> Plan:
    text = example.text
    for old, new in SUBSTITUTIONS.items():
        text = text.replace(old, new)
    for old, new in PLACEHOLDERS.items():
        text = re.sub(rf"(?<![\w/.$-]){re.escape(old)}(?![\w/-])", new, text)
    words = shlex.split(text)
    left = [w for w in words if re.fullmatch(r"[A-Z][A-Z_-]{2,}", w) or w.startswith("$")]
    if left:
        raise Unmapped(
            f"{example}\nuses {left[0]!r}, which stands for something of the user's: add it to PLACEHOLDERS "
            "in tests/test_examples.py (or the example to SKIP with the reason it cannot run here)"
        )
    result = Plan(example, words)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    result.launcher = words[0]
    if "smolctl" in words:
        start = words.index("smolctl") + 1
        result.command, result.smolctl_args = words[start], words[start + 1 :]
    if words[0] == "torchrun":
        nodes = int(_value_after(words, "--nnodes", default="1"))
        result.world_size = nodes * int(_value_after(words, "--nproc_per_node", "--nproc-per-node", default="1"))
    return result


def check_parses(command: str, args: list[str], origin: Example) -> dict:
    """The CLI's own parser accepts the arguments (known flags, required arguments given); returns the values."""
    group = _cli_group()
    if command not in group.commands:
        pytest.fail(f"{origin}\n`smolctl {command}` is not a command (commands: {', '.join(group.commands)})")
    try:
        with group.commands[command].make_context(command, list(args)) as ctx:
            return dict(ctx.params)
    except Exception as exc:  # typer's usage errors; their text says what is wrong
        pytest.fail(f"{origin}\nsmolctl {command} does not accept these arguments: {getattr(exc, 'message', exc)}")


def check_synopsis(example: Example) -> None:
    words = example.text.replace("[", " ").replace("]", " ").split()
    command, args = words[words.index("smolctl") + 1], words[words.index("smolctl") + 2 :]
    group = _cli_group()
    assert command in group.commands, f"{example}\n`smolctl {command}` is not a command"
    known = {opt for param in group.commands[command].params for opt in (*param.opts, *param.secondary_opts)}
    named = {flag for word in args if word.startswith("--") for flag in word.split("/")}
    unknown = sorted(named - known)
    assert not unknown, f"{example}\nnames {unknown}, which `smolctl {command}` does not have"


# --------------------------------------------------------------------------------------------------------------
# The workspace and the runners


def make_workspace(root: Path) -> Path:
    for name in ("recipes", "data", "completions", "scripts"):
        (root / name).symlink_to(REPO / name)
    for relative, source in WORKSPACE.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if callable(source):
            source(target)
        else:
            target.symlink_to(REPO / source)
    stand_ins = root / ".bin"
    stand_ins.mkdir()
    for name, body in STAND_INS.items():
        (stand_ins / name).write_text(body.replace("{python}", sys.executable))
        (stand_ins / name).chmod(0o755)
    return root


def environment(workspace: Path) -> dict:
    return {
        **os.environ,
        "PATH": f"{workspace / '.bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "COLUMNS": "200",
        "OMP_NUM_THREADS": "1",
        "SRUN_LOG": str(workspace / "srun.log"),
        "BANDS": "2",
    }


# Stand-ins for Slurm: sbatch runs the script here (each array task in turn, so afterok holds) with the SLURM_*
# variables of the job it asked for; srun records its command line (training at scale is not run here);
# scontrol names one host.
STAND_INS = {
    "smolctl": '#!/bin/bash\nexec {python} -m smolctl "$@"\n',
    "sbatch": r"""#!/bin/bash
array=0-0; nodes=1; args=()
while (($#)); do
  case $1 in
    --array=*) array=${1#--array=};;
    --nodes=*) nodes=${1#--nodes=};;
    --nodes|-N) nodes=$2; shift;;
    --export=ALL,*) for kv in $(echo "${1#--export=ALL,}" | tr , ' '); do export "$kv"; done;;
    --parsable|--dependency=*|--export=*) ;;
    -*) ;;
    *) args+=("$1");;
  esac
  shift
done
for ((i=${array%-*}; i<=${array#*-}; i++)); do
  SLURM_JOB_ID=7 SLURM_ARRAY_TASK_ID=$i SLURM_NNODES=$nodes SLURM_JOB_NODELIST=node1 SLURM_CPUS_PER_TASK=1 \
    bash "${args[@]}" >&2 || exit 1
done
echo 7
""",
    "srun": '#!/bin/bash\necho "srun $*" >> "$SRUN_LOG"\n',
    "scontrol": "#!/bin/bash\necho node1\n",
}

# One process runs many smolctl invocations (`main` per example), each in its folder with its output captured.
IN_PROCESS = r"""
import contextlib, io, json, os, sys
from smolctl.cli import main
import shutil
jobs = json.load(sys.stdin)
for job in jobs:
    out, err = io.StringIO(), io.StringIO()
    os.chdir(job["cwd"])
    if job["clear"] and os.path.lexists(job["clear"]):  # the example's output, left by an earlier example
        shutil.rmtree(job["clear"]) if os.path.isdir(job["clear"]) and not os.path.islink(job["clear"]) else os.unlink(job["clear"])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(job["argv"])
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0
    print(json.dumps({"code": code, "stdout": out.getvalue()[-4000:], "stderr": err.getvalue()[-4000:]}), flush=True)
"""


def run_in_process(jobs: list[dict], env: dict, timeout: int = 600) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS],
        input=json.dumps(jobs),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"code"')]
    assert len(results) == len(jobs), f"the example runner stopped early:\n{done.stderr[-3000:]}"
    return results


def output_of(command: str, params: dict) -> str | None:
    """The folder an invocation writes (the `output`/`run` argument), to clear before it runs."""
    value = params.get("output") or params.get("run")
    return str(value) if value and command not in ("estimate", "inspect") else None


def clear_output(workspace: Path, output: str | None) -> None:
    if output is None:
        return
    target = (workspace / output).absolute()
    assert workspace in target.parents, f"{output}: an example writes outside its workspace"
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)


# --------------------------------------------------------------------------------------------------------------
# What runs where

EXAMPLES = all_examples()
TRAINING = ("pretrain", "midtrain")
POSTTRAINING = ("sft", "dpo", "ppo", "grpo")
STAGE_ORDER = [
    "train-tokenizer",
    "dedup",
    "mix",
    "pack",
    "pretrain",
    "midtrain",
    "sft",
    "dpo",
    "ppo",
    "grpo",
    "generate",
    "merge",
    "report",
    "export",
    "estimate",
    "benchmark-nccl",
    "stress-gpu",
    "inspect",
]


def _param(example: Example, runs: bool = True):
    marks = []
    if runs and example.text in XFAIL:
        marks.append(pytest.mark.xfail(reason=XFAIL[example.text], strict=False))
    return pytest.param(example, id=example.origins[0], marks=marks)


def fast_invocation(p: Plan) -> list[str] | None:
    """The smolctl arguments an example runs with in the shared process, or None when it runs otherwise."""
    if p.command is None or p.launcher not in ("smolctl", "torchrun", "accelerate", "srun"):
        return None
    args = list(p.smolctl_args)
    if p.command in TRAINING:
        if "--dry-run" not in args:
            args.append("--dry-run")
        if "--world-size" not in args:
            args += ["--world-size", str(p.world_size)]
        return [p.command, *args]
    if p.launcher in ("smolctl", "srun") and p.command not in (*POSTTRAINING, *MODEL_CONSUMERS, "benchmark-nccl"):
        return [p.command, *args]
    return None


def tiny_run(p: Plan) -> list[str] | None:
    """The command line of an example that trains for real on a tiny recipe (slow), or None."""
    if "--dry-run" in p.smolctl_args or p.example.only_in_help:
        return None
    if p.command in MODEL_CONSUMERS and not _reads_user_runs(p):
        overrides = MODEL_CONSUMERS[p.command]
    elif p.command in (*TRAINING, *POSTTRAINING) and set(p.smolctl_args) & TINY_RECIPES:
        overrides = [f"--set={item}" for item in TINY_RUN[p.command]]
    else:
        return None
    prefix = p.argv[: p.argv.index("smolctl")]
    if p.launcher == "smolctl":
        return [sys.executable, "-m", "smolctl", p.command, *p.smolctl_args, *overrides]
    if p.launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            *prefix[1:],
            "smolctl",
            p.command,
            *p.smolctl_args,
            *overrides,
        ]
    pytest.fail(f"{p.example}\nno tiny run for launcher {p.launcher!r}: add one to tiny_run")


def _reads_user_runs(p: Plan) -> bool:
    return any(arg.startswith("runs/") or arg.split(":")[0].startswith("runs/") for arg in p.smolctl_args)


def _sort_key(example: Example) -> int:
    words = example.text.split()
    command = words[words.index("smolctl") + 1] if "smolctl" in words else ""
    return STAGE_ORDER.index(command) if command in STAGE_ORDER else len(STAGE_ORDER)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("examples"))


@pytest.fixture(scope="module")
def fast_results(workspace) -> dict[str, dict]:
    """Build demo-out, then run every cheap example in pipeline order in one process."""
    jobs = [{"cwd": str(workspace), "argv": argv, "clear": None} for argv in DEMO_OUT]
    names: list[str] = []
    for example in sorted(EXAMPLES, key=_sort_key):
        if example.text in SKIP or is_synopsis(example.text):
            continue
        argv = fast_invocation(plan(example))
        if argv is not None:
            names.append(example.text)
            params = check_parses(argv[0], argv[1:], example)
            jobs.append({"cwd": str(workspace), "argv": argv, "clear": output_of(argv[0], params)})
    results = run_in_process(jobs, environment(workspace))
    for job, result in zip(jobs[: len(DEMO_OUT)], results):
        assert result["code"] == 0, f"building demo-out: smolctl {' '.join(job['argv'])}\n{result['stderr']}"
    return dict(zip(names, results[len(DEMO_OUT) :]))


def _fail_message(example: Example, argv, result: dict) -> str:
    return (
        f"{example}\nran: {' '.join(map(str, argv))}\nexit {result['code']}\n{result['stderr'][-2500:]}\n"
        "If the example is right and cannot run here, extend a table at the top of tests/test_examples.py."
    )


def _is_script(p: Plan) -> bool:
    return p.launcher in ("sbatch", "bash")


def _is_real_run(p: Plan) -> bool:
    cpu_collectives = p.command == "benchmark-nccl" and p.launcher == "torchrun" and not p.example.only_in_help
    return tiny_run(p) is not None or cpu_collectives


def _planned(example: Example) -> Plan | None:
    try:
        return plan(example)
    except Unmapped:  # test_example says what to add
        return None


SLOW = [
    (e, p)
    for e in sorted(EXAMPLES, key=_sort_key)
    if e.text not in SKIP and not is_synopsis(e.text) and (p := _planned(e)) is not None
]
SCRIPTS = [e for e, p in SLOW if _is_script(p)]
REAL_RUNS = [e for e, p in SLOW if _is_real_run(p)]


@pytest.mark.parametrize("example", [_param(e, runs=e.text not in {x.text for x in SCRIPTS}) for e in EXAMPLES])
def test_example(example: Example, workspace, fast_results):
    if example.text in SKIP:
        if "smolctl" in example.text.split() and not example.text.startswith("..."):
            p = plan(example)
            check_parses(p.command, p.smolctl_args, example)
        pytest.skip(SKIP[example.text])
    if is_synopsis(example.text):
        assert "smolctl" in example.text.replace("[", " ").split(), (
            f"{example}\nreads as a synopsis but names no smolctl command"
        )
        check_synopsis(example)
        return
    p = plan(example)
    if p.command is not None:
        check_parses(p.command, p.smolctl_args, example)
    if p.command in POSTTRAINING and set(p.smolctl_args) & FULL_SIZE_RECIPES:
        pytest.skip(FULL_SIZE_POSTTRAIN)
    if p.command in MODEL_CONSUMERS and _reads_user_runs(p):
        pytest.skip(USER_RUNS)
    if example.text in fast_results:
        result = fast_results[example.text]
        assert result["code"] == 0, _fail_message(example, fast_invocation(p), result)
    elif p.launcher == "source":
        run_script(p, workspace)
    elif p.command in (*POSTTRAINING, *MODEL_CONSUMERS, "benchmark-nccl") and example.only_in_help:
        return  # parsed above; the README's examples of the same command train for real
    else:  # run for real by the slow tests below
        assert _is_script(p) or _is_real_run(p), (
            f"{example}\nis neither run nor skipped: teach tests/test_examples.py its launcher {p.launcher!r}"
        )


_SCRIPTS_RUN: set[tuple[str, ...]] = set()


def run_script(p: Plan, workspace: Path) -> None:
    """sbatch/bash/source lines: the shell runs them here, with the Slurm stand-ins on PATH. Two examples that read
    the same once their placeholders are mapped (README's and the script header's) run once."""
    if tuple(p.argv) in _SCRIPTS_RUN:
        return
    _SCRIPTS_RUN.add(tuple(p.argv))
    words = list(p.argv)
    env = environment(workspace)
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "source":
        words = ["bash", "-c", f"source {shlex.quote(words[1])}"]
    if env.get("OUTPUT"):
        clear_output(workspace, env["OUTPUT"])
    done = subprocess.run(words, cwd=workspace, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, _fail_message(p.example, words, {"code": done.returncode, "stderr": done.stderr})


@pytest.mark.slow
@pytest.mark.parametrize("example", [_param(e) for e in SCRIPTS])
def test_script_example(example: Example, workspace, fast_results):
    """sbatch and `bash recipes/slurm/...` lines, through the scripts' own lines with the Slurm stand-ins."""
    run_script(plan(example), workspace)


@pytest.mark.slow
@pytest.mark.parametrize("example", [_param(e) for e in REAL_RUNS])
def test_tiny_example(example: Example, workspace, fast_results):
    """The tiny recipes' training examples in pipeline order (each reads what the one before wrote: demo-out/sft
    is the --from of dpo), and torchrun examples that fit on a CPU."""
    p = plan(example)
    launch = p.argv[1 : p.argv.index("smolctl")]
    argv = tiny_run(p) or [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        *launch,
        "smolctl",
        *p.argv[p.argv.index("smolctl") + 1 :],
    ]
    clear_output(workspace, output_of(p.command, check_parses(p.command, p.smolctl_args, example)))
    done = subprocess.run(argv, cwd=workspace, env=environment(workspace), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, _fail_message(example, argv, {"code": done.returncode, "stderr": done.stderr})


def test_the_tables_name_examples_that_exist():
    """A SKIP or XFAIL entry whose example was edited away would silently stop covering it."""
    texts = {example.text for example in EXAMPLES}
    stale = sorted(set(SKIP) - texts) + sorted(set(XFAIL) - texts)
    assert not stale, f"no example reads like these any more; update the tables: {stale}"
