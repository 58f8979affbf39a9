"""`smolctl generate`: sample a model on prompts, for synthetic SFT data or preference pairs.

    smolctl generate data/sample/prompts demo-out/completions --model demo-out/sft --num-completions 2
    smolctl generate data/sample/prompts demo-out/pairs --pairs --chosen demo-out/dpo --rejected demo-out/sft
    smolctl generate data/sample/prompts demo-out/ranked --model demo-out/sft -k 4 --rank-by recipes/ppo-tiny.toml

Three outputs, all dataset folders with a manifest whose lineage names the prompts and every model:
- completions: `prompt`, `completion`, `model`, `completion_index`, `completion_tokens`, `finish_reason` and the
  sampling settings (`temperature`, `top_p`, `max_new_tokens`, `seed`), K rows per prompt; `sft` reads them.
- --pairs: the strong model's answer is `chosen`, the weak model's `rejected` (SmolLM3's preference data).
- --rank-by: K answers of one model scored by a recipe's `[[rewards]]` tables (those ppo/grpo train on); the
  best is `chosen`, the worst `rejected`, with their rewards; a prompt whose answers all score alike is dropped.
Pairs feed `smolctl dpo` as they are.

Prompts are strings, shown to the model through its chat template (as a user turn) when it has one. Sampling is
batched with transformers, or with vLLM when it is installed and a GPU is present (`--backend`); the rows have the
same columns either way. The output is written in shards of `shard_prompts` prompts, each renamed into place
whole, in OUTPUT's staging folder: a run that is killed keeps its finished shards, and the same command run again
continues after them (each batch's sampling seed derives from the seed and its position, so the resumed output
equals an uninterrupted one on the same backend and device).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from smolctl.data.tokenizer import load_tokenizer
from smolctl.errors import Interrupted, UserError
from smolctl.folder_lock import holds_output
from smolctl.shards import (
    KIND_DOCUMENTS,
    OutputFolder,
    check_output_path,
    lineage_ref,
    open_documents,
    read_manifest,
    schema_to_dict,
)
from smolctl.train.chat_data import checked_rows, plain_text, reference_text
from smolctl.train.posttrain import check_rows
from smolctl.train.posttrain_run import chat_stop_ids, check_start, quiet_offline
from smolctl.train.rewards import CompositeReward

SETTINGS_FILE = ".generate-settings.json"  # what a rerun must match to keep the finished shards
# Each shard's file carries the tokens sampled for it, so a resumed run's manifest counts the shards it kept too.
SAMPLED_TOKENS_KEY = b"smolctl.sampled_tokens"
BACKENDS = ("auto", "transformers", "vllm")


@dataclass(kw_only=True)
class Sampling:
    num_completions: int = 1
    """K: completions per prompt."""
    max_new_tokens: int = 256
    temperature: float = 0.6
    """0 is greedy decoding. 0.6 and top_p 0.95 are SmolLM3's recommended settings."""
    top_p: float = 0.95
    seed: int = 0

    def check(self) -> None:
        for flag, value, low in (
            ("--num-completions", self.num_completions, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
        ):
            if value < low:
                raise UserError(flag, f"is {value}", f"use a whole number >= {low}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UserError("--temperature", f"is {self.temperature}", "use 0 (greedy) or a positive number")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p", f"is {self.top_p}", "use a number in (0, 1]")
        if self.temperature == 0 and self.num_completions > 1:
            raise UserError(
                "--temperature",
                "0 (greedy) gives K identical completions",
                "sample with a temperature > 0, or ask for --num-completions 1",
            )


@dataclass(kw_only=True)
class GenerateJob:
    """What to generate; `mode` is completions, pairs or ranked (the columns above)."""

    prompts: str
    output: Path
    models: list[Path]
    """completions and ranked: one model; pairs: the chosen (strong) then the rejected (weak) model."""
    mode: str = "completions"
    sampling: Sampling = field(default_factory=Sampling)
    prompt_column: str = "prompt"
    limit: int | None = None
    batch_size: int = 16
    """Prompts per generate call (each with K completions)."""
    shard_prompts: int = 256
    """Prompts per output shard: the unit a killed run resumes from."""
    backend: str = "auto"
    reward: CompositeReward | None = None
    reward_recipe: str | None = None
    reference_column: str = "reference"
    overwrite: bool = False


@dataclass
class GenerateResult:
    output: str
    mode: str
    backend: str
    models: list[str]
    prompts: int
    rows: int
    shards: int
    resumed_shards: int
    """Shards found finished in the staging folder and kept."""
    completion_tokens: int
    """Tokens sampled by this run (resumed shards not included)."""
    dropped_tied: int
    """ranked: prompts whose completions all scored the same, so no preference could be read."""
    sampling_seconds: float
    """Time spent sampling (after the models loaded)."""
    seconds: float
    without_chat_template: list[str] = field(default_factory=list)
    """Models whose tokenizer has no chat template: they were given each prompt's text as it is."""
    past_context: dict[str, int] = field(default_factory=dict)
    """Per model, the prompts whose tokens and max_new_tokens run past its positions (max_position_embeddings):
    sampled all the same, past what the model was trained on."""

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.sampling_seconds if self.sampling_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": round(self.tokens_per_second, 1)}


@dataclass
class Completion:
    text: str
    tokens: int
    finish_reason: str
    """stop (an end-of-turn or EOS token) or length (max_new_tokens reached)."""


class Sampler(Protocol):
    name: str

    def sample(self, prompts: list[str], sampling: Sampling, seed: int) -> list[list[Completion]]:
        """K completions for each prompt."""


# ---------------------------------------------------------------------------------------------------------------
# Backends


def prompts_past_context(model: Path, prompts: list[str], max_new_tokens: int) -> int:
    """How many prompts, rendered as `render` does, leave fewer than max_new_tokens of the model's positions."""
    try:
        limit = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return 0
    if not isinstance(limit, int):
        return 0
    room = limit - max_new_tokens
    # A token holds at least one byte, so only a prompt of more bytes than the room (less the template's own
    # tokens) can run past it: the rest are never rendered.
    candidates = [p for p in prompts if len(p.encode()) + TEMPLATE_TOKENS >= room]
    if not candidates:
        return 0
    tokenizer = load_tokenizer(model)
    return sum(len(render(tokenizer, p)) > room for p in candidates)


TEMPLATE_TOKENS = 512
"""More tokens than any chat template adds around one user turn."""


def render(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids: a user turn through the chat template (with the assistant header) when there is
    one, else the text as is."""
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    return tokenizer(prompt)["input_ids"]


class TransformersSampler:
    """Batched sampling with `model.generate`, prompts padded on the left."""

    name = "transformers"

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        self.tokenizer = load_tokenizer(path)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        except (OSError, ValueError, KeyError, AssertionError) as exc:  # a config the model cannot be built from
            raise UserError(
                path,
                f"cannot load the model: {str(exc).splitlines()[0][:200]}",
                "pass a complete Hugging Face model folder",
            ) from exc
        self.model.to(self.device).eval()
        self.stop_ids = chat_stop_ids(self.tokenizer)
        # Padding sits under a zero attention mask: any id serves when the tokenizer names none.
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.stop_ids), 0)

    def sample(self, prompts: list[str], sampling: Sampling, seed: int) -> list[list[Completion]]:
        import torch

        encoded = [render(self.tokenizer, p) for p in prompts]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in encoded], device=self.device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=self.device)
        torch.manual_seed(seed)
        greedy = sampling.temperature == 0
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None,
                num_return_sequences=sampling.num_completions,
                eos_token_id=self.stop_ids or None,
                pad_token_id=self.pad_id,
            )
        completions = []
        for row in out[:, width:].tolist():  # [B*K, new tokens], the K of a prompt adjacent
            stop = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            kept = row if stop is None else row[:stop]
            completions.append(
                Completion(
                    self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                    len(kept),
                    "length" if stop is None else "stop",
                )
            )
        k = sampling.num_completions
        return [completions[i * k : (i + 1) * k] for i in range(len(prompts))]


class VllmSampler:
    """vLLM on a GPU (not exercised by the CPU test suite): the same prompts, token ids in, the same columns out."""

    name = "vllm"

    def __init__(self, path: Path, memory_share: float):
        from vllm import LLM

        self.tokenizer = load_tokenizer(path)
        self.stop_ids = chat_stop_ids(self.tokenizer)
        self.llm = LLM(model=str(path), gpu_memory_utilization=memory_share, enable_prefix_caching=True)

    def sample(self, prompts: list[str], sampling: Sampling, seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=sampling.num_completions,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            stop_token_ids=self.stop_ids,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": render(self.tokenizer, p)} for p in prompts], params, use_tqdm=False
        )
        return [
            [
                Completion(o.text.strip(), len(o.token_ids), "stop" if o.finish_reason == "stop" else "length")
                for o in out.outputs
            ]
            for out in outputs
        ]


def choose_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UserError(
            "--backend", f"{backend!r} is not one of {', '.join(BACKENDS)}", "use auto, transformers or vllm"
        )
    has_vllm = importlib.util.find_spec("vllm") is not None
    if backend == "vllm" and not has_vllm:
        raise UserError(
            "--backend", "vllm is not installed", "pip install vllm on a GPU machine, or use --backend transformers"
        )
    if backend == "auto":
        import torch

        return "vllm" if has_vllm and torch.cuda.is_available() else "transformers"
    return backend


# ---------------------------------------------------------------------------------------------------------------
# Rows


SETTINGS_SCHEMA = [
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("max_new_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
]
SCHEMAS = {
    "completions": pa.schema(
        [
            pa.field("prompt", pa.string()),
            pa.field("completion", pa.string()),
            pa.field("model", pa.string()),
            pa.field("completion_index", pa.int32()),
            pa.field("completion_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),
            *SETTINGS_SCHEMA,
        ]
    ),
    "pairs": pa.schema(
        [
            pa.field("prompt", pa.string()),
            pa.field("chosen", pa.string()),
            pa.field("rejected", pa.string()),
            pa.field("chosen_model", pa.string()),
            pa.field("rejected_model", pa.string()),
            *SETTINGS_SCHEMA,
        ]
    ),
    "ranked": pa.schema(
        [
            pa.field("prompt", pa.string()),
            pa.field("chosen", pa.string()),
            pa.field("rejected", pa.string()),
            pa.field("chosen_reward", pa.float64()),
            pa.field("rejected_reward", pa.float64()),
            pa.field("model", pa.string()),
            *SETTINGS_SCHEMA,
        ]
    ),
}


def shard_rows(
    job: GenerateJob,
    samplers: list[Sampler],
    prompts: list[str],
    references: list,
    shard: int,
    on_batch: Callable[[int, int], None],
) -> list[dict]:
    """One shard's rows; on_batch(prompts, tokens sampled) after every batch."""
    s, names = job.sampling, [str(m) for m in job.models]
    settings = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "seed": s.seed}
    rows = []
    for start in range(0, len(prompts), job.batch_size):
        batch = prompts[start : start + job.batch_size]
        seed = s.seed * 1_000_003 + shard * 10_007 + start  # a batch's seed depends only on where it is
        answers = [sampler.sample(batch, s, seed) for sampler in samplers]
        batch_tokens = sum(c.tokens for per_model in answers for group in per_model for c in group)
        for i, prompt in enumerate(batch):
            if job.mode == "completions":
                rows += [
                    {
                        "prompt": prompt,
                        "completion": c.text,
                        "model": names[0],
                        "completion_index": k,
                        "completion_tokens": c.tokens,
                        "finish_reason": c.finish_reason,
                        **settings,
                    }
                    for k, c in enumerate(answers[0][i])
                ]
            elif job.mode == "pairs":
                rows.append(
                    {
                        "prompt": prompt,
                        "chosen": answers[0][i][0].text,
                        "rejected": answers[1][i][0].text,
                        "chosen_model": names[0],
                        "rejected_model": names[1],
                        **settings,
                    }
                )
            elif ranked := best_and_worst(answers[0][i], references[start + i], job.reward):
                (best, chosen), (worst, rejected) = ranked
                rows.append(
                    {
                        "prompt": prompt,
                        "chosen": chosen.text,
                        "rejected": rejected.text,
                        "chosen_reward": best,
                        "rejected_reward": worst,
                        "model": names[0],
                        **settings,
                    }
                )
        on_batch(len(batch), batch_tokens)
    return rows


def best_and_worst(group: list[Completion], reference: str | None, reward: CompositeReward):
    """((reward, completion) of the best, (reward, completion) of the worst), or None when no two scores differ
    (NaN rewards left out): such a group says nothing about which answer is preferred."""
    scores = reward.score([c.text for c in group], [c.tokens for c in group], [reference] * len(group)).totals
    finite = [(score, k) for k, score in enumerate(scores) if math.isfinite(score)]
    if not finite or max(finite)[0] == min(finite)[0]:
        return None
    (best, b), (worst, w) = max(finite), min(finite)
    return (best, group[b]), (worst, group[w])


# ---------------------------------------------------------------------------------------------------------------
# The command


def read_prompts(job: GenerateJob):
    """(prompts, references, source) with every check that needs no model."""
    source = open_documents(job.prompts)
    source.require(text=[job.prompt_column], flags={job.prompt_column: "--prompt-column"})
    needs_reference = job.reward is not None and job.reward.needs_reference
    if needs_reference and job.reference_column not in source.columns:
        raise UserError(
            source.spec,
            f"has no column '{job.reference_column}', which the rewards of "
            f"{job.reward_recipe} compare against (columns: {', '.join(source.columns)})",
            "pass prompts with references, or rank by rewards that need none (length, diversity, regex)",
        )
    check_rows(source, [job.prompt_column], non_empty=(job.prompt_column,))  # a null or empty prompt, by row
    columns = [job.prompt_column] + ([job.reference_column] if job.reference_column in source.columns else [])

    def prepare(row: dict) -> tuple:
        reference = row.get(job.reference_column)
        if needs_reference:  # every completion is scored against it: a null one would rank nothing
            reference = reference_text(reference, job.reference_column)
        return plain_text(row[job.prompt_column], job.prompt_column), reference

    rows = checked_rows(source, columns, prepare)
    if job.limit is not None:
        rows = rows[: job.limit]
    if not rows:
        raise UserError(source.spec, "holds no prompts", "pass a non-empty dataset")
    prompts, references = (list(column) for column in zip(*rows))
    return prompts, references, source


def check_job(job: GenerateJob) -> None:
    job.sampling.check()
    for flag, value in (("--batch-size", job.batch_size), ("--shard-prompts", job.shard_prompts)):
        if value < 1:
            raise UserError(flag, f"is {value}", "use a whole number >= 1")
    if job.limit is not None and job.limit < 1:
        raise UserError("--limit", f"is {job.limit}", "use a whole number >= 1")
    if job.mode == "pairs" and job.sampling.num_completions != 1:
        raise UserError(
            "--num-completions",
            "--pairs takes one completion per model",
            "drop --num-completions, or rank K completions of one model with --rank-by",
        )
    if job.mode == "ranked" and job.sampling.num_completions < 2:
        raise UserError(
            "--num-completions",
            "--rank-by needs at least 2 completions per prompt to rank",
            "pass e.g. --num-completions 4",
        )


def _file_times(files) -> list:
    return [[str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns] for f in files]


def resume_state(folder: OutputFolder, settings: dict, shards: int) -> int:
    """How many leading shards in the staging folder a rerun with the same settings keeps; anything else is removed."""
    settings_path = folder.file(SETTINGS_FILE)
    same = settings_path.is_file() and json.loads(settings_path.read_text()) == settings
    done = 0
    while same and done < shards and folder.file(shard_name(done)).is_file():
        done += 1
    for stale in folder.staging.iterdir():  # half-written temporaries, shards of other settings or past the gap
        keep = stale.name == SETTINGS_FILE and same
        keep = keep or any(stale.name == shard_name(i) for i in range(done))
        if not keep:
            stale.unlink()
    if not same:
        settings_path.write_text(json.dumps(settings))
    return done


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _let_go(folder: OutputFolder, job: GenerateJob, error: BaseException) -> None:
    """A run stopped before its commit: without a finished shard the staging folder (only the settings) goes; with
    them, Ctrl-C says they wait there for the same command to continue."""
    kept = sum(1 for _ in folder.staging.glob("part-*.parquet"))
    if not kept:
        folder.abort()
    elif isinstance(error, KeyboardInterrupt):
        raise Interrupted(
            f"{job.output}: {kept} finished shard(s) kept in {folder.staging.name} — run the same command again "
            "to continue from them"
        ) from None


@holds_output(lambda job, *args, **kwargs: job.output)
def run_generate(
    job: GenerateJob,
    on_progress: Callable[[int, int, float], None] | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> GenerateResult:
    """Generate, shard by shard. on_progress(prompts done, prompts total, tokens/s) after every batch;
    on_shard(index) after every shard is in place."""
    started = time.perf_counter()
    check_job(job)
    flags = ["--chosen", "--rejected"] if job.mode == "pairs" else ["--model"]
    job.models = [check_start(str(m), flag) for m, flag in zip(job.models, flags)]
    if job.mode == "pairs" and job.models[0].resolve() == job.models[1].resolve():
        raise UserError(
            "--rejected",
            f"is the --chosen model ({job.models[0]}): every pair would be one model against itself",
            "pass a weaker model (e.g. the SFT checkpoint the chosen one was trained from)",
        )
    prompts, references, source = read_prompts(job)
    check_output_path(job.output, job.overwrite)
    backend = choose_backend(job.backend)
    schema = SCHEMAS[job.mode]
    shards = math.ceil(len(prompts) / job.shard_prompts)
    inputs = [*source.lineage(), *[lineage_ref(m) for m in job.models]]
    settings = {
        "mode": job.mode,
        "backend": backend,
        "inputs": inputs,
        # inputs without a manifest have no digest in `inputs`: their files' sizes and times stand for it, so
        # shards of prompts or weights since replaced are not kept by a resume
        "unlisted_inputs": [
            _file_times(source.files) if source.manifest is None else None,
            *[
                _file_times(sorted(p for p in m.iterdir() if p.is_file()))
                for m in job.models
                if read_manifest(m) is None
            ],
        ],
        "sampling": asdict(job.sampling),
        "prompt_column": job.prompt_column,
        "limit": job.limit,
        "batch_size": job.batch_size,
        "shard_prompts": job.shard_prompts,
        "reward_recipe": job.reward_recipe,
    }
    quiet_offline()
    folder = OutputFolder(job.output, kind=KIND_DOCUMENTS, overwrite=job.overwrite, inputs=inputs, resumable=True)
    resumed = resume_state(folder, settings, shards)
    done, tokens, total = resumed * job.shard_prompts, 0, len(prompts)
    sampled: int | None = 0  # over every shard of the output, the kept ones included

    def advance(count: int, batch_tokens: int) -> None:
        nonlocal done, tokens
        done, tokens = done + count, tokens + batch_tokens
        if on_progress:
            on_progress(done, total, tokens / max(1e-9, time.perf_counter() - sampling_started))

    try:
        samplers = (
            [
                TransformersSampler(m) if backend == "transformers" else VllmSampler(m, 0.9 / len(job.models))
                for m in job.models
            ]
            if resumed < shards
            else []
        )
        sampling_started = time.perf_counter()  # tokens/s counts sampling, not loading the models
        for index in range(shards):
            lo, hi = index * job.shard_prompts, min(total, (index + 1) * job.shard_prompts)
            if index >= resumed:
                before = tokens
                rows = shard_rows(job, samplers, prompts[lo:hi], references[lo:hi], index, advance)
                with_count = schema.with_metadata({**(schema.metadata or {}), SAMPLED_TOKENS_KEY: str(tokens - before)})
                tmp = folder.file(f".{shard_name(index)}.tmp")
                pq.write_table(pa.Table.from_pylist(rows, schema=with_count), tmp, compression="zstd")
                os.replace(tmp, folder.file(shard_name(index)))
                if on_shard:
                    on_shard(index)
            elif on_progress:
                on_progress(hi, total, 0.0)
            written = pq.read_metadata(folder.file(shard_name(index)))
            counted = (written.metadata or {}).get(SAMPLED_TOKENS_KEY)
            # a shard an older smolctl wrote carries no count: the total is then unknown, not too small
            sampled = None if sampled is None or counted is None else sampled + int(counted)
            folder.add_shard(shard_name(index), written.num_rows)
    except BaseException as exc:
        _let_go(folder, job, exc)
        raise
    sampling_seconds, seconds = time.perf_counter() - sampling_started, time.perf_counter() - started
    tokenizers = [sampler.tokenizer for sampler in samplers] or [load_tokenizer(m) for m in job.models]
    untemplated = [str(m) for m, t in zip(job.models, tokenizers) if not getattr(t, "chat_template", None)]
    past_context = {
        str(m): n for m in job.models if (n := prompts_past_context(m, prompts, job.sampling.max_new_tokens))
    }
    folder.file(SETTINGS_FILE).unlink()
    rows = sum(s["rows"] for s in folder.shards)
    tied = total - rows if job.mode == "ranked" else 0  # ranked writes one row per prompt it could rank
    if job.mode == "ranked" and total and not rows:  # an empty preference set, written and exiting 0, is no result
        folder.abort()
        raise UserError(
            "--rank-by",
            f"the completions of every one of the {total} prompts tied on the reward: there is no pair to keep",
            "sample more per prompt (-k), raise --temperature, or rank by a reward that tells them apart",
        )
    result = GenerateResult(
        str(job.output),
        job.mode,
        backend,
        [str(m) for m in job.models],
        total,
        rows,
        shards,
        resumed,
        tokens,
        tied,
        sampling_seconds,
        seconds,
        untemplated,
        past_context,
    )
    folder.commit(
        schema=schema_to_dict(schema),
        stats={
            "prompts": total,
            "completion_tokens": sampled,
            "dropped_tied": tied,
            "prompts_past_context": past_context,
            "resumed_shards": resumed,
            "sampling_seconds": round(sampling_seconds, 2),
            "seconds": round(seconds, 2),
        },
        generate={**{k: v for k, v in settings.items() if k != "inputs"}, "models": result.models},
    )
    return result
