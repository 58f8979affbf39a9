"""`smolctl report`: a training run read in the playbook's terms — KPIs against their targets and a diagnosis of
what went wrong where, from the files every training command leaves (RUN/metrics.jsonl, RUN/events.jsonl).

    smolctl report demo-out/pretrain
    smolctl report runs/lr-3e-3 runs/lr-1e-3 --html compare.html

The diagnosis works on the logged loss and throughput: a spike (one loss far above the recent median: a bad
batch, named with the rows that fed it when the guards recorded them), a drift (the smoothed loss climbing for a
long stretch: the learning rate is too high), a plateau (the smoothed loss not improving for a long stretch: the
schedule or the mixture), a throughput drop (tokens/s well under the run's median for several lines, with the
cause that grew: data wait, communication, checkpointing or compute), and each guard's rollback or skipped step.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from smolctl.errors import UserError
from smolctl.results import Result

# The playbook's targets.
MFU_TARGET = 0.45
MEMORY_RANGE = (0.85, 0.95)
COMM_LIMIT = 0.15
CHECKPOINT_LIMIT_S = 300.0  # per 1,000 steps
DATA_WAIT_LIMIT = 0.05

SPIKE_ZSCORE = 6.0  # the guards' default: robust z-score over the recent window
SPIKE_MIN_RISE = 0.05  # and at least 5% above the recent median, so a tiny noise band cannot make a spike
DRIFT_MIN_RISE = 0.02  # smoothed loss 2% above its low point ...
PLATEAU_MAX_GAIN = 0.005  # ... or gaining under 0.5% over ...
LONG_STRETCH = 0.2  # ... at least this share of the logged points
LONG_STEPS = 50  # ... and this many steps: early on, warmup and noise make short flat or rising stretches normal
SLOW_FRACTION = 0.6  # tokens/s under 60% of the run's median ...
SLOW_MIN_POINTS = 3  # ... for at least this many lines in a row
MAX_POINTS = 400  # series are averaged down to this many points before the trend checks and the plots

PLOTTED = ("loss", "lr", "grad_norm", "tokens_per_s")


@dataclass
class Kpi:
    name: str
    target: str
    value: float | None
    shown: str
    status: str  # pass, warn, n/a
    advice: str = ""


@dataclass
class Finding:
    kind: str  # spike, drift, plateau, slowdown, nonfinite, rollback, damaged checkpoint
    start_step: int
    end_step: int
    detail: str
    cause: str
    remedy: str
    rows: list = field(default_factory=list)


@dataclass
class RunReport:
    run: str
    stage: str
    summary: dict
    kpis: list[Kpi]
    findings: list[Finding]
    series: dict[str, list[tuple[int, float]]]

    def to_dict(self, with_series: bool = False) -> dict:
        out = {
            "run": self.run,
            "stage": self.stage,
            "summary": self.summary,
            "kpis": [asdict(k) for k in self.kpis],
            "findings": [asdict(f) for f in self.findings],
        }
        return {**out, "series": self.series} if with_series else out


@dataclass
class Reports(Result):
    """What `smolctl report` made: one report per run, and the HTML file when one was written."""

    runs: list[RunReport]
    html: str | None = None

    def to_dict(self) -> dict:
        return {"runs": [run.to_dict() for run in self.runs], "html": self.html}


def build_reports(runs: list[str | Path]) -> list[RunReport]:
    """Every run is checked before any is read, so a typo in the third folder costs nothing."""
    for run in runs:
        _check_run(Path(run))
    return [build_report(Path(run)) for run in runs]


def build_report(run: Path) -> RunReport:
    info = _run_info(run)
    lines = _read_jsonl(run / "metrics.jsonl")
    events = _read_jsonl(run / "events.jsonl") if (run / "events.jsonl").is_file() else []
    rows = [_normalise(r) for r in lines if "train_runtime" not in r and "val_loss" not in r]
    _derive_tokens_per_s(rows)
    series = {key: [(r["step"], r[key]) for r in rows if _finite(r.get(key))] for key in PLOTTED}
    series["val_loss"] = [(r["step"], r["val_loss"]) for r in lines if _finite(r.get("val_loss"))]
    if not rows:
        raise UserError(
            run / "metrics.jsonl", "holds no logged steps yet", "report on it once the run has logged a step"
        )
    return RunReport(
        str(run),
        info["stage"],
        _summary(rows, series, events, info),
        kpis(rows, info),
        diagnose(rows, events),
        {k: _downsample(v) for k, v in series.items() if v},
    )


# ---------------------------------------------------------------------------------------------------------------
# Reading any training command's run folder


def _check_run(run: Path) -> None:
    if not run.exists():
        raise UserError(run, "no such run folder", "pass the RUN folder a training command wrote (pretrain, sft, ...)")
    if not run.is_dir():
        raise UserError(run, "is a file, not a run folder", "pass the RUN folder a training command wrote")
    if not (run / "metrics.jsonl").is_file():
        raise UserError(
            run,
            "is not a training run folder (no metrics.jsonl)",
            "pass the RUN folder given to pretrain, midtrain, sft, dpo or ppo",
        )


def _run_info(run: Path) -> dict:
    """Stage and world size from run.json (pretrain, midtrain) or final/manifest.json (TRL stages)."""
    for path in (run / "run.json", run / "final" / "manifest.json"):
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise UserError(path, f"is not JSON ({exc.msg}, line {exc.lineno})", "restore or remove it") from None
            if not isinstance(data, dict):
                raise UserError(path, f"holds a JSON {type(data).__name__}, not an object", "restore or remove it")
            plan = data.get("plan") or {}
            return {"stage": data.get("stage") or "train", "world_size": plan.get("world_size")}
    return {"stage": "train", "world_size": None}


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a run killed mid-write leaves a torn last line
            raise UserError(path, f"line {number} is not JSON", "repair or remove the line") from None
        if isinstance(record, dict) and "step" in record:
            if not isinstance(record["step"], int) or isinstance(record["step"], bool):
                raise UserError(
                    path, f"line {number}: step is {record['step']!r}, not a whole number", "repair or remove the line"
                )
            out.append(record)
    return out


def _normalise(record: dict) -> dict:
    """One vocabulary for every stage: the Trainer's `learning_rate` is our `lr`; non-finite values read as NaN."""
    out = {k: (float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v) for k, v in record.items()}
    if "lr" not in out and "learning_rate" in out:
        out["lr"] = out["learning_rate"]
    return out


def _derive_tokens_per_s(rows: list[dict]) -> None:
    """TRL stages log cumulative `num_tokens` and seconds since the start: tokens/s is their ratio of differences."""
    previous = None
    for row in rows:
        if "tokens_per_s" in row or "num_tokens" not in row or "time" not in row:
            continue
        if previous is not None and row["time"] > previous["time"]:
            row["tokens_per_s"] = (row["num_tokens"] - previous["num_tokens"]) / (row["time"] - previous["time"])
        previous = row


def _nan_or_inf(value) -> bool:
    """A loss gone NaN or infinite (read from JSON as a float, or as the Trainer's strings); not a missing one."""
    return isinstance(value, float) and not math.isfinite(value)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _values(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if _finite(r.get(key))]


def _downsample(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most MAX_POINTS points, each the mean of a run of consecutive ones (its step: the run's last)."""
    if len(points) <= MAX_POINTS:
        return points
    size = len(points) / MAX_POINTS
    buckets = [points[int(i * size) : int((i + 1) * size)] for i in range(MAX_POINTS)]
    return [(b[-1][0], sum(v for _, v in b) / len(b)) for b in buckets if b]


# ---------------------------------------------------------------------------------------------------------------
# Summary and KPIs


def _summary(rows: list[dict], series: dict, events: list[dict], info: dict) -> dict:
    loss = [v for _, v in series["loss"]]
    speed = _values(rows[1:], "tokens_per_s") or _values(rows, "tokens_per_s")
    last = rows[-1] if rows else {}
    count = {kind: sum(1 for e in events if e.get("event") == kind) for kind in ("nonfinite", "spike", "rollback")}
    return {
        "steps": last.get("step", 0),
        "first_loss": loss[0] if loss else None,
        "last_loss": loss[-1] if loss else None,
        "min_loss": min(loss) if loss else None,
        "val_loss": series["val_loss"][-1][1] if series["val_loss"] else None,
        "tokens_per_s": statistics.median(speed) if speed else None,
        "world_size": info["world_size"],
        "skipped": last.get("skipped", count["nonfinite"]),
        "spikes": last.get("spikes", count["spike"]),
        "rollbacks": last.get("rollbacks", count["rollback"]),
    }


def kpis(rows: list[dict], info: dict) -> list[Kpi]:
    """The playbook's KPI set, each pass / warn with what to do about a miss, or n/a when the run cannot tell."""
    steady = rows[1:] or rows  # the first line carries start-up costs (allocation, compilation)
    out = []
    mfu = _values(steady, "mfu")
    out.append(
        _kpi(
            "MFU",
            f"> {MFU_TARGET:.0%}",
            statistics.median(mfu) if mfu else None,
            "{:.1%}",
            lambda v: v > MFU_TARGET,
            "no MFU without a known GPU peak (CPU, fp32 or an unknown GPU)",
            "raise the micro batch, torch.compile, fused kernels; check data wait and communication",
        )
    )
    memory = _values(rows, "memory_share")
    out.append(
        _kpi(
            "memory",
            f"{MEMORY_RANGE[0]:.0%}–{MEMORY_RANGE[1]:.0%} of the device",
            max(memory) if memory else None,
            "{:.1%}",
            lambda v: MEMORY_RANGE[0] <= v <= MEMORY_RANGE[1],
            _memory_na(rows),
            "above: close to OOM — activation checkpointing, a smaller micro batch or optimizer offload; "
            "below: raise the micro batch (fewer accumulation steps)",
        )
    )
    comm = _values(rows, "comm_share")
    na_comm = (
        "this run does not record communication"
        if info["world_size"] is None
        else "one process: no collectives"
        if info["world_size"] <= 1
        else "not profiled yet (logging.profile_interval)"
    )
    out.append(
        _kpi(
            "communication",
            f"< {COMM_LIMIT:.0%} of step time",
            statistics.median(comm) if comm else None,
            "{:.1%}",
            lambda v: v < COMM_LIMIT,
            na_comm,
            "check the interconnect (smolctl benchmark-nccl), shard less (DDP before FSDP), overlap or "
            "bucket the gradient all-reduce; a straggler node shows as waiting in collectives",
        )
    )
    steps = rows[-1]["step"] if rows else 0
    checkpoint = _values(rows, "checkpoint_s")
    per_thousand = sum(checkpoint) / steps * 1000 if checkpoint and steps else None
    out.append(
        _kpi(
            "checkpointing",
            f"< {CHECKPOINT_LIMIT_S / 60:.0f} min per 1,000 steps",
            per_thousand,
            "{:.0f} s per 1,000 steps",
            lambda v: v < CHECKPOINT_LIMIT_S,
            "this run does not record save times",
            "save less often (checkpoint.interval), asynchronously, or to faster storage",
        )
    )
    data = _values(steady, "data_wait")
    out.append(
        _kpi(
            "data wait",
            f"< {DATA_WAIT_LIMIT:.0%} of step time",
            statistics.median(data) if data else None,
            "{:.1%}",
            lambda v: v < DATA_WAIT_LIMIT,
            "this run does not record data wait",
            "prefetch batches, more loader workers, faster storage",
        )
    )
    return out


def _kpi(name, target, value, fmt, ok, na_reason, advice) -> Kpi:
    if value is None:
        return Kpi(name, target, None, na_reason, "n/a")
    passed = ok(value)
    return Kpi(name, target, value, fmt.format(value), "pass" if passed else "warn", "" if passed else advice)


def _memory_na(rows: list[dict]) -> str:
    peak = _values(rows, "memory_peak_bytes")
    return (
        f"CPU run: peak RSS {max(peak) / 2**30:.2f} GiB (the target is for accelerators)"
        if peak
        else "this run does not record memory"
    )


# ---------------------------------------------------------------------------------------------------------------
# Diagnosis


def diagnose(rows: list[dict], events: list[dict]) -> list[Finding]:
    loss = [(r["step"], r["loss"]) for r in rows if _finite(r.get("loss"))]
    found = spikes(loss, events) + trends(_downsample(loss)) + slowdowns(rows) + guard_findings(events)
    return sorted(found + logged_nonfinite(rows, events), key=lambda f: (f.start_step, f.kind))


def logged_nonfinite(rows: list[dict], events: list[dict]) -> list[Finding]:
    """NaN or inf losses in metrics.jsonl that no guard recorded: the TRL stages (sft, dpo, grpo) log them and
    train on, and the plots drop them, so a run gone NaN read as one with no finding at all."""
    guarded = {e.get("step") for e in events if e.get("event") == "nonfinite"}
    steps = [r["step"] for r in rows if _nan_or_inf(r.get("loss")) and r["step"] not in guarded]
    if not steps:
        return []
    return [
        Finding(
            "nonfinite",
            steps[0],
            steps[-1],
            f"loss not finite at {len(steps)} logged step(s), from step {steps[0]}",
            "an lr too high, a bf16 overflow, or a bad batch",
            "resume from a checkpoint before it with a lower lr (or fp32), and inspect the data it trained on",
        )
    ]


def spikes(loss: list[tuple[int, float]], events: list[dict], window: int = 20) -> list[Finding]:
    """The spikes the guards recorded at full resolution (with their batch's rows), and losses far above the
    median of the lines before them (runs without guards, e.g. the TRL stages)."""
    out = [
        _spike(e["step"], f"loss {e['loss']:.4f} (robust z-score {e.get('zscore')})", e.get("rows", []))
        for e in events
        if e.get("event") == "spike"
    ]
    recorded = {f.start_step for f in out}
    recent: list[float] = []
    for step, value in loss:
        if len(recent) >= 8:
            median = statistics.median(recent)
            mad = statistics.median(abs(v - median) for v in recent)
            z = (value - median) / max(1.4826 * mad, 1e-3 * abs(median), 1e-8)
            if (z > SPIKE_ZSCORE and value > median * (1 + SPIKE_MIN_RISE)) or step in recorded:
                if step not in recorded:
                    out.append(_spike(step, f"loss {value:.4f} against a recent median of {median:.4f}", []))
                continue  # a spike does not join the baseline
        recent = (recent + [value])[-window:]
    return out


def _spike(step: int, detail: str, rows: list) -> Finding:
    return Finding(
        "spike",
        step,
        step,
        detail,
        "a bad batch (or a too-high lr meeting an outlier)",
        "inspect the batch's rows"
        + (" listed here" if rows else "")
        + "; if it repeats, skip the batch (guards.max_bad_steps) or lower the lr",
        rows,
    )


def trends(loss: list[tuple[int, float]]) -> list[Finding]:
    """Drifts and plateaus of the smoothed loss, each over at least LONG_STRETCH of the run and LONG_STEPS steps."""
    if len(loss) < 20:
        return []
    smooth = _rolling_median([v for _, v in loss], max(3, len(loss) // 20))
    steps = [s for s, _ in loss]
    span = max(10, int(LONG_STRETCH * len(loss)))
    out = []
    low = 0
    for i in range(len(smooth)):  # drift: well above the lowest point so far, for long
        if smooth[i] < smooth[low]:
            low = i
        rise = (smooth[i] - smooth[low]) / abs(smooth[low])
        if rise > DRIFT_MIN_RISE and i - low >= span and steps[i] - steps[low] >= LONG_STEPS:
            end = max(range(i, len(smooth)), key=lambda j: smooth[j])
            out.append(
                Finding(
                    "drift",
                    steps[low],
                    steps[end],
                    f"smoothed loss rose {smooth[low]:.4f} → {smooth[end]:.4f} over {steps[end] - steps[low]} steps",
                    "the learning rate is too high",
                    "lower the lr (or lengthen the warmup); resume from a checkpoint before the drift",
                )
            )
            break
    start = 0
    while start < len(smooth) - span:  # plateau: no real gain over a long stretch (and not a drift)
        end = start
        while (
            end + 1 < len(smooth)
            and (smooth[start] - min(smooth[start : end + 2])) / abs(smooth[start]) < PLATEAU_MAX_GAIN
            and (smooth[end + 1] - smooth[start]) / abs(smooth[start]) < DRIFT_MIN_RISE
        ):
            end += 1
        if end - start >= span and steps[end] - steps[start] >= LONG_STEPS:
            out.append(
                Finding(
                    "plateau",
                    steps[start],
                    steps[end],
                    f"smoothed loss stayed near {smooth[start]:.4f} for {steps[end] - steps[start]} steps",
                    "the schedule or the data mixture",
                    "change the schedule (start the decay, or raise the lr if it is tiny) or the mixture",
                )
            )
            start = end + 1
        else:
            start += 1
    return out


def slowdowns(rows: list[dict]) -> list[Finding]:
    """Stretches of several lines under SLOW_FRACTION of the median tokens/s, with the cost that grew most."""
    points = [r for r in rows[1:] if _finite(r.get("tokens_per_s"))]
    if len(points) < 2 * SLOW_MIN_POINTS:
        return []
    median = statistics.median(r["tokens_per_s"] for r in points)
    normal = [r for r in points if r["tokens_per_s"] >= SLOW_FRACTION * median]
    out, stretch = [], []
    for row in points + [None]:
        if row is not None and row["tokens_per_s"] < SLOW_FRACTION * median:
            stretch.append(row)
            continue
        if len(stretch) >= SLOW_MIN_POINTS:
            cause, remedy = _slowdown_cause(stretch, normal)
            speed = statistics.median(r["tokens_per_s"] for r in stretch)
            out.append(
                Finding(
                    "slowdown",
                    stretch[0]["step"],
                    stretch[-1]["step"],
                    f"{speed:,.0f} tokens/s against a median of {median:,.0f}",
                    cause,
                    remedy,
                )
            )
        stretch = []
    return out


def _slowdown_cause(slow: list[dict], normal: list[dict]) -> tuple[str, str]:
    """Split each line's step time into data wait, communication, checkpoint and compute; the part that grew most
    against the normal lines is the cause."""

    def parts(rows):
        step = statistics.median(r.get("step_s", 0.0) for r in rows)
        data = statistics.median(r.get("data_wait", 0.0) * r.get("step_s", 0.0) for r in rows)
        comm_rows = [r for r in rows if _finite(r.get("comm_share"))]
        comm = statistics.median(r["comm_share"] * r.get("step_s", 0.0) for r in comm_rows) if comm_rows else 0.0
        return {"data loading": data, "communication": comm, "compute": max(0.0, step - data - comm)}

    if not any("step_s" in r for r in slow):
        return "unknown: this run does not split step time", "compare tokens/s with the machine's load at those steps"
    before, during = parts(normal or slow), parts(slow)
    cause = max(during, key=lambda k: during[k] - before[k])
    remedies = {
        "data loading": "the loader starved the GPU: prefetch more, add loader workers, check the storage or the "
        "shards read at those steps",
        "communication": "collectives grew: check the interconnect (smolctl benchmark-nccl) and look for a "
        "straggler node",
        "compute": "the same work ran slower: a throttled or faulty device (smolctl stress-gpu), or other jobs on "
        "the node",
    }
    grew = during[cause] - before[cause]
    return f"{cause} (+{grew * 1000:.0f} ms per step)", remedies[cause]


def guard_findings(events: list[dict]) -> list[Finding]:
    out = []
    for e in events:
        if e.get("event") == "nonfinite":
            out.append(
                Finding(
                    "nonfinite",
                    e["step"],
                    e["step"],
                    f"loss {e.get('loss')}, grad norm {e.get('grad_norm')}: update skipped",
                    "a bad batch, an lr too high, or a bf16 overflow",
                    "inspect the batch's rows; if it repeats lower the lr",
                    e.get("rows", []),
                )
            )
        elif e.get("event") == "rollback":
            out.append(
                Finding(
                    "rollback",
                    e["step"],
                    e["step"],
                    f"rolled back to {e.get('to')}, skipping batches {e.get('skipped_batches')}",
                    "consecutive bad steps",
                    "the batches are skipped from now on; if rollbacks repeat, lower the lr or clean the data",
                )
            )
        elif e.get("event") == "damaged_checkpoint_skipped":
            out.append(
                Finding(
                    "damaged checkpoint",
                    e["step"],
                    e["step"],
                    f"passed over {e.get('path')} for an earlier one: {e.get('problem')}",
                    "its bytes changed on disk after the save",
                    "check the file system that holds the run",
                )
            )
    return out


def _rolling_median(values: list[float], width: int) -> list[float]:
    half = width // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]
