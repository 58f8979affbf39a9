"""`smolctl report` and the trackers: planted anomalies (a spike, a drift, a plateau, a data-wait and a
communication slowdown) each named at their steps with their cause; KPIs against the playbook's targets; a real
tiny pretrain run with TensorBoard and Trackio (read back with their own readers) that the report finds clean;
the HTML rendered by headless Chromium; and the one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE, run_cli

from smolctl.errors import UserError
from smolctl.train.report import build_reports

STEPS = 400


def healthy(step: int, rng: random.Random) -> dict:
    """One metrics line of a run going well: a power-law loss (still improving at the end), steady throughput."""
    return {
        "step": step,
        "loss": 2.0 + 6.0 * step**-0.3 + rng.gauss(0, 0.01),
        "lr": 1e-3,
        "grad_norm": 0.5 + rng.gauss(0, 0.02),
        "tokens_per_s": 10_000 * (1 + rng.gauss(0, 0.02)),
        "data_wait": 0.01,
        "step_s": 0.2,
        "mfu": 0.5,
        "memory_share": 0.9,
        "checkpoint_s": 2.0 if step % 100 == 1 and step > 1 else 0.0,
        "skipped": 0,
        "spikes": 0,
        "rollbacks": 0,
        "time": 1000.0 + step * 0.2,
    }


def write_run(root: Path, name: str, plant=None, events: list[dict] = (), world_size: int = 8) -> Path:
    """A pretrain run folder with synthetic metrics; `plant(line)` alters a line in place."""
    run = root / name
    run.mkdir(parents=True)
    rng = random.Random(0)
    lines = [healthy(step, rng) for step in range(1, STEPS + 1)]
    for line in lines:
        if plant:
            plant(line)
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "run.json").write_text(
        json.dumps({"stage": "pretrain", "plan": {"world_size": world_size, "global_batch": 64, "seq_len": 256}})
    )
    return run


def findings(run: Path) -> list:
    return build_reports([run])[0].findings


def test_a_healthy_run_has_no_finding_and_passes_every_kpi(tmp_path):
    report = build_reports([write_run(tmp_path, "ok", plant=lambda line: line.update(comm_share=0.05))])[0]
    assert report.findings == []
    assert [(k.name, k.status) for k in report.kpis] == [
        ("MFU", "pass"),
        ("memory", "pass"),
        ("communication", "pass"),
        ("checkpointing", "pass"),
        ("data wait", "pass"),
    ]


def test_a_spike_is_named_at_its_step_with_the_rows_behind_it(tmp_path):
    rows = [{"folder": "packed/web", "shard": "shard-00001.safetensors", "rows": [17, 230]}]

    def plant(line):
        if line["step"] in (137, 301):
            line["loss"] += 1.5

    # step 301's spike was recorded by the guards (with its rows); step 137's is found in the metrics alone
    run = write_run(
        tmp_path,
        "spike",
        plant,
        events=[{"event": "spike", "step": 301, "batch": 301, "loss": 4.1, "zscore": 40.0, "rows": rows}],
    )
    found = findings(run)
    assert [(f.kind, f.start_step) for f in found] == [("spike", 137), ("spike", 301)]
    assert found[1].rows == rows and found[0].rows == []
    assert "bad batch" in found[0].cause and "skip the batch" in found[0].remedy


def test_a_slow_drift_is_named_with_the_learning_rate_as_cause(tmp_path):
    def plant(line):
        if line["step"] > 200:
            line["loss"] += 0.003 * (line["step"] - 200)  # +0.6 over the last 200 steps

    found = findings(write_run(tmp_path, "drift", plant))
    assert [f.kind for f in found] == ["drift"]
    assert 190 <= found[0].start_step <= 230 and found[0].end_step >= 390
    assert "learning rate is too high" in found[0].cause and "lower the lr" in found[0].remedy


def test_a_plateau_is_named_with_the_schedule_or_mixture_as_cause(tmp_path):
    def plant(line):
        if line["step"] > 150:
            line["loss"] = 3.0 + (line["loss"] - (2.0 + 6.0 * line["step"] ** -0.3))  # flat, same noise

    found = findings(write_run(tmp_path, "plateau", plant))
    assert [f.kind for f in found] == ["plateau"]
    assert 140 <= found[0].start_step <= 175 and found[0].end_step >= 390
    assert "schedule or the data mixture" in found[0].cause


@pytest.mark.parametrize("cause,field", [("data loading", "data_wait"), ("communication", "comm_share")])
def test_a_throughput_drop_is_named_with_what_grew(tmp_path, cause, field):
    def plant(line):
        line["comm_share"] = 0.05
        if 300 <= line["step"] <= 330:  # each step takes twice as long, the extra time spent in `field`
            line["tokens_per_s"] /= 2
            line["step_s"] = 0.4
            line[field] = 0.5 + line[field] / 2

    found = findings(write_run(tmp_path, field, plant))
    assert [(f.kind, f.start_step, f.end_step) for f in found] == [("slowdown", 300, 330)]
    assert found[0].cause.startswith(cause)


def test_guard_events_and_kpi_misses_come_with_the_playbook_remedy(tmp_path):
    def plant(line):
        line.update(mfu=0.3, memory_share=0.97, comm_share=0.25, checkpoint_s=40.0 if line["step"] % 100 == 0 else 0.0)

    events = [
        {
            "event": "nonfinite",
            "step": 50,
            "batch": 50,
            "loss": "nan",
            "grad_norm": "nan",
            "action": "update skipped",
            "rows": [{"folder": "p", "shard": "s", "rows": [3]}],
        },
        {"event": "rollback", "step": 40, "to": "run/checkpoints/step-0000040", "skipped_batches": [50, 51]},
    ]
    report = build_reports([write_run(tmp_path, "misses", plant, events=events)])[0]
    kpis = {k.name: k for k in report.kpis}
    assert all(kpis[name].status == "warn" for name in ("MFU", "memory", "communication", "checkpointing"))
    assert "activation checkpointing" in kpis["memory"].advice and "smaller micro batch" in kpis["memory"].advice
    assert kpis["checkpointing"].value == pytest.approx(400.0)  # 4 saves × 40 s over 400 steps
    assert [(f.kind, f.start_step) for f in report.findings] == [("rollback", 40), ("nonfinite", 50)]
    assert report.findings[1].rows == [{"folder": "p", "shard": "s", "rows": [3]}]


def test_trl_metrics_read_in_the_same_terms(tmp_path):
    """The Trainer's lines (learning_rate, cumulative num_tokens, seconds since start) give lr and tokens/s."""
    run = tmp_path / "sft"
    run.mkdir()
    lines = [
        {
            "step": s,
            "time": 2.0 * s,
            "loss": 3 - 0.01 * s,
            "learning_rate": 1e-5,
            "grad_norm": 1.0,
            "num_tokens": 1000.0 * s,
        }
        for s in range(1, 31)
    ] + [{"step": 30, "time": 61.0, "train_runtime": 61.0, "train_loss": 2.8}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = build_reports([run])[0]
    assert report.series["lr"][0] == (1, 1e-5) and report.series["tokens_per_s"][0] == (2, pytest.approx(500.0))
    assert report.summary["steps"] == 30 and report.findings == []
    assert {k.name: k.status for k in report.kpis}["MFU"] == "n/a"


def test_a_run_logging_nan_losses_without_a_guard_is_named(tmp_path):
    """The TRL stages log NaN and train on: the plots dropped the points and the report said nothing was wrong."""
    run = tmp_path / "sft"
    run.mkdir()
    lines = [{"step": s, "loss": 3 - 0.01 * s if s < 20 else "nan", "learning_rate": 1e-5} for s in range(1, 31)]
    lines[5]["loss"] = None  # a step that logged no loss is not one gone NaN
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    [finding] = build_reports([run])[0].findings
    assert (finding.kind, finding.start_step, finding.end_step) == ("nonfinite", 20, 30)
    assert "11 logged step(s)" in finding.detail


def test_missing_or_foreign_folder_is_one_line_exit_2(tmp_path):
    (tmp_path / "data").mkdir()
    for folder, message in ((tmp_path / "nope", "no such run folder"), (tmp_path / "data", "no metrics.jsonl")):
        done = run_cli("report", folder, "--json")
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr and done.stdout == ""
    with pytest.raises(UserError, match="no such run folder"):
        build_reports([tmp_path / "nope"])


def test_json_and_several_runs_overlaid(tmp_path):
    a = write_run(tmp_path, "a")
    b = write_run(tmp_path, "b", lambda line: line.update(loss=line["loss"] + 0.3))
    done = run_cli("report", a, b, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["run"] for r in out["runs"]] == [str(a), str(b)]
    assert {k["name"] for k in out["runs"][0]["kpis"]} == {
        "MFU",
        "memory",
        "communication",
        "checkpointing",
        "data wait",
    }
    text = run_cli("report", a, b)
    assert text.returncode == 0 and any(0x2801 <= ord(c) <= 0x28FF for c in text.stdout)  # braille plots
    assert str(a) in text.stdout and str(b) in text.stdout


# ---- a real run, real trackers, a real browser -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """The demo's pretrain recipe, 30 steps, logging every step to TensorBoard and Trackio (a private store)."""
    from smolctl.data.pack import PackConfig, pack

    root = tmp_path_factory.mktemp("report-run")
    pack(str(SAMPLE / "web"), root / "packed", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=256))
    store = root / "trackio"
    done = run_cli(
        "pretrain",
        "recipes/smollm3-tiny.toml",
        root / "run",
        "--data",
        root / "packed",
        "--json",
        "--set",
        "training.steps=30",
        "--set",
        "logging.interval=1",
        "--set",
        "checkpoint.interval=15",
        "--set",
        'logging.report_to=["tensorboard", "trackio"]',
        env={"TRACKIO_DIR": str(store), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["steps"] == 30  # trackio's banner went to stderr: stdout is one JSON object
    return root / "run", store


def test_tensorboard_event_files_hold_the_metrics(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tiny_run
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/memory_peak_bytes"} <= set(
        events.Tags()["scalars"]
    )
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(line["step"], pytest.approx(line["loss"], rel=1e-6)) for line in logged if "loss" in line]


def test_trackio_local_store_holds_the_metrics(tiny_run):
    run, store = tiny_run
    read = (
        "import json; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps([[l['step'], l['train/loss']] for l in SQLiteStorage.get_logs('smolctl', 'run')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", read],
        env={**os.environ, "TRACKIO_DIR": str(store)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads(done.stdout) == [
        [line["step"], pytest.approx(line["loss"], rel=1e-6)] for line in logged if "loss" in line
    ]


def test_a_clean_real_run_raises_no_false_alarm(tiny_run):
    run, _ = tiny_run
    report = build_reports([run])[0]
    # The loss-based findings must be silent. Throughput on a shared CI machine really can sag (other jobs),
    # so a slowdown is allowed, but only blamed on compute: this run's data sits in the page cache.
    assert [f for f in report.findings if f.kind != "slowdown"] == []
    assert all(f.cause.startswith("compute") for f in report.findings)
    kpis = {k.name: k.status for k in report.kpis}
    assert kpis == {"MFU": "n/a", "memory": "n/a", "communication": "n/a", "checkpointing": "pass", "data wait": "pass"}
    assert report.summary["last_loss"] < report.summary["first_loss"] - 1.0


def test_an_asked_for_tracker_that_is_missing_names_the_extra(tiny_run, tmp_path):
    if importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    done = run_cli(
        "pretrain",
        "recipes/smollm3-tiny.toml",
        tmp_path / "run",
        "--data",
        tiny_run[0].parent / "packed",
        "--set",
        'logging.report_to=["wandb"]',
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "pip install 'smolctl[wandb]'" in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_html_report_renders_its_plots_in_a_real_browser(tmp_path, tiny_run):
    Image = pytest.importorskip("PIL.Image")
    planted = write_run(
        tmp_path, "drift", lambda line: line.update(loss=line["loss"] + 0.003 * max(0, line["step"] - 200))
    )
    html, png = tmp_path / "report.html", tmp_path / "report.png"
    done = run_cli("report", tiny_run[0], planted, "--html", html)
    assert done.returncode == 0, done.stderr
    page = html.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # nothing fetched
    render = subprocess.run(
        ["bash", str(REPO / "scripts" / "render_report.sh"), str(html), str(png)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert render.returncode == 0, render.stderr
    image = Image.open(png).convert("RGB")
    raw = image.tobytes()
    pixels = [tuple(raw[i : i + 3]) for i in range(0, len(raw), 3)]

    def near(color):
        return sum(1 for p in pixels if all(abs(a - b) < 40 for a, b in zip(p, color)))

    # both runs' lines are drawn (blue: the real run, red: the planted one), not a blank or black page
    assert near((31, 119, 180)) > 500 and near((214, 39, 40)) > 500
    assert len(set(pixels)) > 50 and near((0, 0, 0)) < len(pixels) * 0.05


def test_collective_time_counts_overlapping_events_once():
    """The comm share's numerator: the union of collective intervals (µs); on GPU only NCCL kernels count."""
    from types import SimpleNamespace as Ns

    from smolctl.train.monitor import collective_seconds

    def event(name, start, end, device="CPU"):
        return Ns(name=name, time_range=Ns(start=start, end=end), device_type=Ns(name=device))

    cpu = [
        event("gloo:all_reduce", 0, 100),
        event("c10d::allreduce_", 50, 150),
        event("aten::mm", 0, 1000),
        event("gloo:broadcast", 300, 400),
    ]
    assert collective_seconds(cpu, on_gpu=False) == pytest.approx(250e-6)
    gpu = [
        event("ncclDevKernel_AllReduce_Sum_f32", 0, 100, "CUDA"),
        event("nccl:all_reduce", 0, 500),
        event("ncclDevKernel_AllGather", 50, 200, "CUDA"),
    ]
    assert collective_seconds(gpu, on_gpu=True) == pytest.approx(200e-6)


def test_html_written_through_a_link_replaces_what_it_points_to(tmp_path, tiny_run):
    """The link stays, as an output folder's does: it was replaced by a regular file, leaving its target stale."""
    from smolctl.train.report import build_reports
    from smolctl.train.report_views import write_html

    target = tmp_path / "reports" / "latest.html"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "report.html"
    link.symlink_to(target)
    write_html(link, build_reports([tiny_run[0]]), overwrite=True)
    assert link.is_symlink() and "<html" in target.read_text().lower()
