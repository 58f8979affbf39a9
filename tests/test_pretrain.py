"""`smolctl pretrain` / `midtrain`: recipe errors, document-boundary labels, exact resume after SIGKILL, the NaN
guard and rollback, two torchrun processes against one, midtrain lineage, and the 3B recipe's dry run.

Models here are tiny (hidden 32, 2 layers, seq 64) so the whole file stays within its CI budget on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SAMPLE, run_cli

from smolctl.errors import UserError
from smolctl.train.loader import IGNORE_INDEX, fill_padding_positions, make_labels
from smolctl.train.pretrain import Trainer, load_train_recipe, train

TEST_RECIPE = """
[model]
architecture = "smollm3"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
no_rope_layer_interval = 2

[data]
paths = ["{packed}"]

[optimizer]
lr = 1e-2

[schedule]
kind = "wsd"
warmup_steps = 2
decay_fraction = 0.2

[training]
steps = 12
seq_len = 64
micro_batch = 2
global_batch = 8
seed = 7

[checkpoint]
interval = 4
keep = 2

[logging]
interval = 1
"""


def packed_folder(root: Path, tokenizer: Path, seq_len: int) -> Path:
    from smolctl.data.pack import PackConfig, pack

    out = root / f"packed-{seq_len}"
    pack(str(SAMPLE / "web"), out, tokenizer_spec=str(tokenizer), config=PackConfig(seq_len=seq_len))
    return out


@pytest.fixture(scope="session")
def packed(tmp_path_factory, tokenizer_dir) -> Path:
    return packed_folder(tmp_path_factory.mktemp("packed"), tokenizer_dir, 64)


@pytest.fixture(scope="session")
def recipe(tmp_path_factory, packed) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "tiny.toml"
    path.write_text(TEST_RECIPE.replace("{packed}", str(packed)))
    return path


def pretrained_overrides(packed: Path) -> list[str]:
    validation = [f'data.validation="{packed}"', "data.validation_interval=15", "data.validation_batches=2"]
    return ["training.steps=30", *validation]


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory, recipe, packed) -> tuple[Path, object]:
    run = tmp_path_factory.mktemp("runs") / "pretrain"
    result = train(recipe, run, overrides=pretrained_overrides(packed), show=False)
    return run, result


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---- recipe validation and bad input, all before any compute --------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.micro_bach=2", "training.micro_bach: unknown key — did you mean 'micro_batch'?"),
        ('training.micro_batch="3"', "training.micro_batch: expected int, got '3'"),
        (
            "schedule.kind=cosinus",
            "schedule.kind: must be 'wsd', 'cosine', 'constant' or 'exponential', got 'cosinus' — did you mean 'cosine'?",
        ),
        ("model.num_attention_heads=3", "hidden_size 32 is not divisible by num_attention_heads 3"),
        ("training.tokens=1000", "give either steps or tokens"),
    ],
)
def test_recipe_errors_name_the_key(recipe, override, message):
    with pytest.raises(UserError) as error:
        load_train_recipe(recipe, [override])
    assert message in error.value.line()


@pytest.mark.parametrize(
    "overrides, where, message",
    [
        (
            ["training.global_batch=9"],
            "training.global_batch",
            "9 sequences is not divisible by micro_batch 2 × data-parallel size 1",
        ),
        (["training.seq_len=128"], "packed-64", "is packed at seq_len 64 but training.seq_len is 128"),
        (["model.vocab_size=100"], "model.vocab_size", "is smaller than the tokenizer's"),
        (['data.paths=["/nonexistent/packed"]'], "/nonexistent/packed", "no such folder"),
        (["model.architecture=lama"], "model.architecture", "did you mean 'llama'?"),
    ],
)
def test_bad_input_is_refused_before_compute(recipe, tmp_path, overrides, where, message):
    run = tmp_path / "run"
    with pytest.raises(UserError) as error:
        train(recipe, run, overrides=overrides, show=False)
    assert where in error.value.where and message in error.value.line()
    assert not run.exists()


def test_tokenizer_mismatch_is_refused(recipe, tmp_path):
    from smolctl.data.tokenizer import train_tokenizer

    other = tmp_path / "other-tok"
    train_tokenizer(str(SAMPLE / "math"), str(other), vocab_size=300)
    with pytest.raises(UserError, match="was packed with tokenizer"):
        Trainer(load_train_recipe(recipe, [f'model.tokenizer="{other}"']), tmp_path / "run", show=False)


def test_cli_error_is_one_line_exit_2(recipe, tmp_path):
    done = run_cli("pretrain", recipe, tmp_path / "run", "--set", "training.global_batch=9")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: training.global_batch:") and "Traceback" not in done.stderr


# ---- document boundaries ----------------------------------------------------------------------------------------


def test_labels_never_cross_a_document_boundary():
    #                   doc A (3 tokens)  doc B (2)  pad pad
    ids = np.array([[11, 12, 13, 21, 22, 1, 1]])
    positions = np.array([[0, 1, 2, 0, 1, -1, -1]])
    assert make_labels(ids, positions).tolist() == [
        [12, 13, IGNORE_INDEX, 22, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    ]
    assert fill_padding_positions(positions).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    # a row that starts mid-document (concat packing) keeps its first label
    assert make_labels(np.array([[5, 6, 7]]), np.array([[40, 41, 0]])).tolist() == [[6, IGNORE_INDEX, IGNORE_INDEX]]


def test_data_order_is_a_seeded_permutation_of_every_row():
    from smolctl.train.loader import permuted_index

    for n in (1, 7, 1000, 4097):
        assert sorted(permuted_index(np.arange(n), n, (3, 0, 0)).tolist()) == list(range(n))
    first, again, other_epoch = (permuted_index(np.arange(50), 50, key) for key in ((3, 0, 0), (3, 0, 0), (3, 0, 1)))
    assert np.array_equal(first, again) and not np.array_equal(first, other_epoch)
    assert permuted_index(np.array([0, 10**9]), 2_700_000_000, (0, 0, 0)).max() < 2_700_000_000  # no array of n rows


def test_real_packed_rows_mask_exactly_the_boundaries(packed):
    from smolctl.shards import open_packed

    shard = open_packed(packed).load_shard(0)
    ids, positions = shard["input_ids"][:64].astype(np.int64), shard["position_ids"][:64].astype(np.int64)
    labels = make_labels(ids, positions)
    next_is_new = np.zeros_like(ids, dtype=bool)
    next_is_new[:, :-1] = positions[:, 1:] <= 0
    next_is_new[:, -1] = True
    assert np.array_equal(labels == IGNORE_INDEX, next_is_new | (positions < 0))
    assert (positions == 0).sum() > 64  # rows really hold several documents


def test_attention_stays_inside_documents(tokenizer_dir, recipe):
    import torch

    from smolctl.train.model import build_config, build_model

    config = build_config(load_train_recipe(recipe).model, vocab_size=2048, seq_len=64, eos_id=0, pad_id=1)
    model = build_model(config, seed=0)
    ids = torch.randint(2, 2048, (1, 10))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    changed = ids.clone()
    changed[0, :4] = 5  # rewrite the first document only
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        b = model(input_ids=changed, position_ids=positions, use_cache=False).logits
    assert torch.equal(a[0, 4:], b[0, 4:]) and not torch.equal(a[0, :4], b[0, :4])


# ---- training, checkpoints, exact resume ------------------------------------------------------------------------


def test_pretrain_loss_falls_and_final_model_loads(pretrained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, result = pretrained
    assert result.steps == 30 and result.final_loss < result.first_loss - 1.0
    # keep = 2; the last step always gets a checkpoint
    assert [Path(p).name for p in result.checkpoints] == ["step-0000028", "step-0000030"]
    final = run / "final"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["parent"] is None and manifest["inputs"][0]["kind"] == "packed"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    out = model.generate(**tokenizer("The module", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 2
    assert torch.equal(model.state_dict()["model.norm.weight"], weights(final)["model.norm.weight"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == list(range(1, 31))
    validations = [(line["step"], line["val_loss"]) for line in lines if "val_loss" in line]
    assert [step for step, _ in validations] == [15, 30] and result.val_loss == validations[1][1] < validations[0][1]


def test_a_resume_with_no_step_left_writes_the_loss_it_was_saved_at(pretrained, recipe, packed, tmp_path):
    """A run killed after its last save but before final/ was written: the resume has nothing to train and wrote
    final/ with loss None."""
    run, result = pretrained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "final")
    resumed = train(recipe, copy, resume="auto", overrides=pretrained_overrides(packed), show=False)
    saved = json.loads((copy / "final" / "manifest.json").read_text())["stats"]
    assert saved == {"steps": 30, "loss": resumed.final_loss} and resumed.final_loss == result.final_loss


def _cli(recipe: Path, run: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "smolctl",
        "pretrain",
        str(recipe),
        str(run),
        "--set",
        "training.steps=60",
        "--set",
        "checkpoint.interval=5",
        "--json",
        *extra,
    ]


def test_sigkill_then_resume_is_bit_identical(recipe, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = subprocess.run(_cli(recipe, tmp_path / "straight"), env=env, capture_output=True, text=True, cwd=REPO)
    assert straight.returncode == 0, straight.stderr

    killed_run = tmp_path / "killed"
    victim = subprocess.Popen(
        _cli(recipe, killed_run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO
    )
    metrics = killed_run / "metrics.jsonl"
    while victim.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if lines and json.loads(lines[-1])["step"] >= 13:  # past the step-10 checkpoint, mid-interval
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert victim.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed_run / "final").exists()

    resumed = subprocess.run(
        _cli(recipe, killed_run, "--resume", "auto"), env=env, capture_output=True, text=True, cwd=REPO
    )
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["resumed_from"].endswith(("step-0000010", "step-0000015")) and result["steps"] == 60
    a, b = weights(tmp_path / "straight" / "final"), weights(killed_run / "final")
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 61))  # the steps re-run after the kill are logged once
    # What happened besides steps, as every training command records it: the saves and the resume, each once.
    events = [json.loads(line) for line in (killed_run / "events.jsonl").read_text().splitlines()]
    resumed_at = int(result["resumed_from"][-7:])
    saves = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in events if e["event"] == "resume"] == [resumed_at]
    assert saves == sorted(set(saves)) and saves[-1] == 60 and resumed_at in saves


# ---- guards -----------------------------------------------------------------------------------------------------


def test_nan_burst_rolls_back_once_to_before_the_burst(recipe, tmp_path):
    import torch

    run = tmp_path / "run"
    # The guards judge at logging points (every 5 steps) and before saves (every 4): a NaN inside an interval is
    # still caught at its own step. Batch 3: one NaN, its update skipped on the device. Batches 7, 8, 9: a burst
    # across the step-8 checkpoint, judged at steps 8 and 10 → one rollback, to step 4 (step-8 was saved inside
    # the incident), skipping the three batches.
    result = train(
        recipe,
        run,
        overrides=["guards.inject_nan_batches=[3, 7, 8, 9]", "guards.max_bad_steps=3", "logging.interval=5"],
        show=False,
    )
    assert (result.skipped_steps, result.rollbacks, result.steps) == (4, 1, 12)
    logged = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if e["event"] == "checkpoint"] == [4, 8, 8, 12]  # step 8 saved again after it
    events = [e for e in logged if e["event"] != "checkpoint"]
    assert [e["event"] for e in events] == ["nonfinite"] * 4 + ["rollback"]
    assert [e["step"] for e in events] == [3, 7, 8, 9, 4] and [e["batch"] for e in events[:4]] == [3, 7, 8, 9]
    assert events[-1]["skipped_batches"] == [7, 8, 9] and events[-1]["to"].endswith("step-0000004")
    # each bad step names the packed rows of its global batch (8 sequences), for `smolctl report` to show
    assert all(sum(len(part["rows"]) for part in e["rows"]) == 8 for e in events[:4])
    assert events[0]["rows"][0]["shard"].endswith(".safetensors")
    assert all(torch.isfinite(t).all() for t in weights(run / "final").values())
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [5, 10, 12]


def test_a_rollback_passes_over_a_checkpoint_damaged_since_its_save(recipe, tmp_path, monkeypatch):
    """The newest checkpoint before the burst (step 6) has a flipped byte by the time the burst is judged: the run
    goes back to step 4 instead of ending, and says which checkpoint it passed over."""
    from smolctl.train import pretrain

    run = tmp_path / "run"
    check = pretrain.saved_bytes_problem

    def damaged_step_6(path, dist=None):
        if path.name == "step-0000006" and not getattr(damaged_step_6, "done", False):
            shard = next(path.glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x10
            shard.write_bytes(data)
            damaged_step_6.done = True
        return check(path, dist)

    monkeypatch.setattr(pretrain, "saved_bytes_problem", damaged_step_6)
    overrides = ["guards.inject_nan_batches=[7, 8, 9]", "guards.max_bad_steps=3", "logging.interval=5"]
    result = train(recipe, run, overrides=overrides + ["checkpoint.interval=2", "checkpoint.keep=4"], show=False)
    assert (result.rollbacks, result.steps) == (1, 12)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "damaged_checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0]["path"].endswith("step-0000006") and "sha256" in skipped[0]["problem"]
    rollback = next(e for e in events if e["event"] == "rollback")
    assert rollback["to"].endswith("step-0000004") and rollback["step"] == 4
    from smolctl.train.report import guard_findings

    assert "passed over" in next(f for f in guard_findings(events) if f.kind == "damaged checkpoint").detail


def test_a_level_shift_rebaselines_instead_of_looping():
    from smolctl.train.config import GuardsSection
    from smolctl.train.guards import Guards

    guards = Guards(GuardsSection(spike_window=20, spike_zscore=6.0, max_bad_steps=3))
    rng = np.random.default_rng(0)
    losses = np.concatenate([3.0 + 0.01 * rng.standard_normal(30), 3.8 + 0.01 * rng.standard_normal(60)])
    verdicts = [guards.observe(step, step, float(loss), 1.0) for step, loss in enumerate(losses, start=1)]
    assert not any(v.rollback for v in verdicts)
    shifts = [v.level_shift for v in verdicts if v.level_shift]
    assert len(shifts) == 1 and shifts[0]["step"] == 33 and shifts[0]["to"] == pytest.approx(3.8, abs=0.05)
    assert guards.spikes == 3 and all(v.event is None for v in verdicts[33:])
    # a divergence is not a level: it rolls back, to before its first bad step
    for step, loss in enumerate([5.0, 7.0, 11.0], start=91):
        verdict = guards.observe(step, step, loss, 1.0)
    assert verdict.rollback and verdict.first_bad_step == 91 and verdict.bad_batches == [91, 92, 93]


def test_sigusr1_saves_the_current_step_and_exits_75(recipe, tmp_path):
    run = tmp_path / "run"
    command = _cli(recipe, run, "--set", "checkpoint.interval=100")
    process = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    while process.poll() is None and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.01)
    process.send_signal(signal.SIGUSR1)
    result = json.loads(process.communicate(timeout=300)[0])
    assert process.returncode == 75 and result["preempted"] == "SIGUSR1"
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == [f"step-{result['steps']:07d}"]
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == result["steps"] < 60
    assert not (run / "final").exists()


def test_spike_detector_flags_outliers_and_counts_consecutive_bad_steps():
    from smolctl.train.config import GuardsSection
    from smolctl.train.guards import Guards

    guards = Guards(GuardsSection(spike_window=20, spike_zscore=6.0, max_bad_steps=2))
    rng = np.random.default_rng(0)
    for step, loss in enumerate(3.0 + 0.01 * rng.standard_normal(20), start=1):
        assert guards.observe(step, step, float(loss), 1.0).event is None
    spike = guards.observe(21, 21, 3.5, 1.0)
    assert spike.apply_update and spike.event["event"] == "spike" and not spike.rollback
    assert guards.observe(22, 22, 3.0, 1.0).event is None  # a normal loss ends the bad run
    guards.observe(23, 23, 3.6, 1.0)
    second = guards.observe(24, 24, float("nan"), 1.0)
    assert not second.apply_update and second.rollback and second.bad_batches == [23, 24]
    assert (guards.spikes, guards.skipped) == (2, 1)


def test_resume_auto_on_a_finished_run_does_nothing_and_never_retrains_the_tail(pretrained, recipe, packed, tmp_path):
    import shutil

    from smolctl.shards import sha256_file

    run = tmp_path / "run"
    shutil.copytree(pretrained[0], run)
    moved = shutil.copytree(packed, tmp_path / "moved-packed")  # the same data at another path is the same data
    args = [
        "pretrain",
        recipe,
        run,
        "--data",
        moved,
        "--set",
        "training.steps=30",
        "--set",
        f'data.validation="{packed}"',
        "--set",
        "data.validation_interval=15",
        "--set",
        "data.validation_batches=2",
        "--resume",
        "auto",
        "--json",
    ]
    before = {p.name: sha256_file(p) for p in (run / "final").iterdir()}
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert (
        json.loads(done.stdout)["nothing_to_do"]
        and {p.name: sha256_file(p) for p in (run / "final").iterdir()} == before
    )

    shutil.rmtree(run / "final")  # killed after its last checkpoint, before final/ was written
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["resumed_from"].endswith("step-0000030") and result["speed"]["steps_run"] == 0
    assert sha256_file(run / "final" / "model.safetensors") == before["model.safetensors"]


def test_export_interval_writes_hf_folders_beside_the_run(recipe, tmp_path):
    run = tmp_path / "run"
    train(
        recipe,
        run,
        overrides=[
            "training.steps=2",
            "checkpoint.interval=1",
            "checkpoint.export_interval=2",
            "schedule.warmup_steps=0",
        ],
        show=False,
    )
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step-0000002"]
    exported, final = weights(run / "exports" / "step-0000002"), weights(run / "final")
    assert exported.keys() == final.keys() and all(np.array_equal(exported[k].numpy(), final[k].numpy()) for k in final)


def test_an_export_someone_else_is_writing_is_skipped_and_the_run_goes_on(recipe, tmp_path, monkeypatch):
    """A user's own `smolctl export` into RUN/exports/step-N holds that folder: the run's export of the same step
    is refused by the lock, which stopped the run."""
    from smolctl.folder_lock import FolderBusy
    from smolctl.train import checkpoint

    def busy(source, out, **kwargs):
        raise FolderBusy(out, "is being written by another smolctl run (pid 1 on here)", "wait")

    monkeypatch.setattr(checkpoint, "export_checkpoint", busy)
    run = tmp_path / "run"
    settings = ["training.steps=2", "checkpoint.interval=1", "checkpoint.export_interval=1", "schedule.warmup_steps=0"]
    assert train(recipe, run, overrides=settings, show=False).steps == 2
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "export_skipped"]
    assert len(skipped) == 2 and "is being written by another smolctl run" in skipped[0]["reason"]


def test_resume_refuses_a_different_model(pretrained, recipe):
    with pytest.raises(UserError, match=r"model\.hidden_size: differs from the run being resumed"):
        Trainer(load_train_recipe(recipe, ["model.hidden_size=64"]), pretrained[0], resume="auto", show=False)


# ---- distributed ------------------------------------------------------------------------------------------------


def _launch(recipe: Path, run: Path, processes: int, settings: list[str], port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = (
        [sys.executable, "-m", "smolctl"]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(port),
            "-m",
            "smolctl",
        ]
    )
    args = [
        "pretrain",
        str(recipe),
        str(run),
        "--json",
        "--set",
        "training.steps=10",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "model.hidden_size=64",
        "--set",
        "model.intermediate_size=128",
        "--set",
        "logging.profile_interval=2",
    ]
    for setting in settings:
        args += ["--set", setting]
    done = subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _losses(run: Path) -> list[float]:
    return [row["loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in row]


@pytest.fixture(scope="module")
def single_process(recipe, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    _launch(recipe, run, 1, [], 0)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes, settings, accumulation",
    [
        (2, [], 2),  # DDP
        (2, ["parallel.tp=2"], 4),  # tensor parallel: both ranks read the same rows
        (4, ["parallel.tp=2", "parallel.dp_shard=2"], 2),  # FSDP2 × TP on a 2 × 2 mesh
    ],
    ids=["ddp", "tp2", "fsdp2xtp2"],
)
def test_parallel_layouts_follow_the_single_process_run(
    recipe, single_process, tmp_path, processes, settings, accumulation
):
    """Same global batch, same data order: every layout follows one process's loss curve over 10 steps, and its
    final model (gathered from DTensor shards) loads in transformers and equals the single-process one."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    result = _launch(recipe, run, processes, settings, 29613 + processes)
    assert result["plan"]["grad_accum"] == accumulation
    reference = _losses(single_process)
    assert len(reference) == 10 and _losses(run) == pytest.approx(reference, rel=1e-4)
    expected, got = weights(single_process / "final"), weights(run / "final")
    assert got.keys() == expected.keys()
    assert all(np.allclose(expected[k].numpy(), got[k].numpy(), atol=2e-4) for k in expected)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.config.hidden_size == 64
    shards = sorted(p.name for p in (run / "checkpoints" / "step-0000010").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(processes)]  # each rank writes its part of the state (DCP)
    if not settings:
        # every second step is profiled: the share of its time spent in gloo collectives is on the next line
        shares = [line.get("comm_share") for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
        assert [share is not None for share in shares] == [False, True] * 5 and all(0 < s <= 1 for s in shares[1::2])
        assert all("comm_share" not in line for line in (single_process / "metrics.jsonl").read_text().splitlines())


# ---- midtrain ---------------------------------------------------------------------------------------------------


def test_midtrain_extends_context_and_records_its_parent(pretrained, recipe, tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from smolctl.shards import lineage_chain

    parent = pretrained[0] / "final"
    long_packed = packed_folder(tmp_path, tokenizer_dir, 128)
    run = tmp_path / "midtrain"
    result = train(
        recipe,
        run,
        stage="midtrain",
        init_from=str(parent),
        data=[str(long_packed)],
        show=False,
        overrides=[
            "training.seq_len=128",
            "model.rope_theta=500000.0",
            "training.steps=4",
            "schedule.warmup_steps=0",
            "schedule.decay_fraction=1.0",
        ],
    )
    assert result.parent == str(parent.resolve())
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    assert manifest["parent"] == str(parent.resolve()) and manifest["stage"] == "midtrain"
    assert {ref["path"] for ref in manifest["inputs"]} == {str(long_packed.resolve()), str(parent.resolve())}
    chain = [entry["path"] for entry in lineage_chain(run / "final")]
    assert str(parent.resolve()) in chain and str((SAMPLE / "web").resolve()) in chain
    config = AutoModelForCausalLM.from_pretrained(run / "final").config
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.max_position_embeddings == 128
    assert result.first_loss < pretrained[1].first_loss - 0.5  # it started from the trained weights, not from scratch


def test_midtrain_from_a_sharded_checkpoint_keeps_its_optimizer(pretrained, recipe, tmp_path):
    parent = pretrained[0] / "checkpoints" / "step-0000030"
    result = train(
        recipe,
        tmp_path / "run",
        stage="midtrain",
        init_from=str(parent),
        keep_optimizer=True,
        show=False,
        overrides=["training.steps=2", "schedule.warmup_steps=0", "schedule.decay_fraction=1.0"],
    )
    assert result.parent == str(parent.resolve()) and result.steps == 2
    assert result.first_loss < pretrained[1].first_loss - 0.5  # the checkpoint's weights, loaded through DCP


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "nope", "no such checkpoint folder"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "incomplete model folder"),
    ],
)
def test_midtrain_from_a_missing_or_incomplete_checkpoint(recipe, tmp_path, setup, message):
    with pytest.raises(UserError, match=message):
        train(recipe, tmp_path / "run", stage="midtrain", init_from=str(setup(tmp_path)), show=False)


def test_keep_optimizer_needs_a_checkpoint_with_optimizer_state(pretrained, recipe, tmp_path):
    with pytest.raises(UserError, match="holds no optimizer state"):
        train(
            recipe,
            tmp_path / "run",
            stage="midtrain",
            init_from=str(pretrained[0] / "final"),
            keep_optimizer=True,
            show=False,
        )


# ---- the published recipe ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        (["--dry-run", "--world-size", "0"], "Invalid value for '--world-size': 0 is not in the range x>=1"),
        (["runs/x", "--world-size", "384"], "--world-size: plans a --dry-run only"),
        (["runs/x", "--gpu", "h200"], "--gpu: plans a --dry-run only"),
    ],
)
def test_planning_options_are_refused_where_they_would_be_ignored(options, message):
    """--world-size 0 planned for WORLD_SIZE or 1, and --world-size or --gpu without --dry-run were ignored."""
    done = run_cli("pretrain", "recipes/smollm3.toml", *options)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_smollm3_recipe_dry_run_shows_the_published_layout():
    """TP 2 × DP 192 on 384 GPUs, micro batch 3, no accumulation; stages at 0 / 8T / 10T tokens with their own
    folders; the WSD decay spans stage 3; memory from estimate's model, which agrees with `smolctl estimate`."""
    done = run_cli("pretrain", "recipes/smollm3.toml", "--dry-run", "--world-size", "384", "--gpu", "H100", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["parameters"] == 3_075_098_624 and plan["global_batch"] == 576 and plan["grad_accum"] == 1
    assert plan["layout"] == {"dp_replicate": 1, "dp_shard": 192, "tp": 2} and plan["data_parallel"] == 192
    stages = plan["recipe"]["data"]["stages"]
    tokens_per_step = plan["tokens_per_step"]
    assert [round(s["start_step"] * tokens_per_step / 1e12, 3) for s in stages] == [0, 8, 10]
    assert len({tuple(s["paths"]) for s in stages}) == 3  # each stage brings its own datasets
    assert plan["recipe"]["schedule"]["decay_steps"] == plan["steps"] - stages[2]["start_step"]
    assert plan["memory"]["fits"]
    estimate = run_cli("estimate", "recipes/smollm3.toml", "--gpus", "384", "--json")
    assert estimate.returncode == 0, estimate.stderr
    assert json.loads(estimate.stdout)["memory"]["total"] == pytest.approx(plan["memory"]["total"])


def test_dry_run_names_a_layout_that_fits_when_the_recipe_does_not():
    from smolctl.train.dryrun import dry_run

    recipe = load_train_recipe(
        REPO / "recipes/smollm3.toml", ["training.micro_batch=6", "training.global_batch_tokens=4718592"]
    )
    plan = dry_run(recipe, world_size=384)
    assert not plan.memory["fits"]
    layouts = plan.would_fit["layouts"]
    assert layouts and all(o["total"] < plan.memory["capacity"] for o in layouts)
    assert 1 <= plan.would_fit["largest_micro_batch"] < 6

    # each suggestion is what applying it gives: without FSDP the trainer runs amp, which the suggestion priced as
    # bf16 weights (59.7 GiB suggested, 61.9 GiB once applied)
    # (and tp 8 was suggested for SmolLM3's 4 KV heads, which pretrain refuses)
    wide = ["training.micro_batch=6", "training.global_batch_tokens=4718592"]
    for overrides, world in ((["parallel.tp=1"], 1), (wide, 384)):
        recipe = load_train_recipe(REPO / "recipes/smollm3.toml", overrides)
        for option in dry_run(recipe, world_size=world).would_fit["layouts"]:
            sets = [f"{key}={json.dumps(value)}" for key, value in option.items() if key != "total"]
            applied = dry_run(load_train_recipe(REPO / "recipes/smollm3.toml", [*overrides, *sets]), world_size=world)
            assert applied.memory["fits"] and applied.memory["total"] == pytest.approx(option["total"]), option


def test_long_context_recipe_runs_both_published_stages():
    from smolctl.train.dryrun import dry_run

    path = REPO / "recipes/smollm3-long-context.toml"
    first = dry_run(load_train_recipe(path), world_size=48)
    second = dry_run(
        load_train_recipe(path, ["training.seq_len=65536", "model.rope_theta=5e6", "parallel.tp=4"]), world_size=48
    )
    assert first.recipe["model"]["rope_theta"] == 1.5e6 and second.recipe["model"]["rope_theta"] == 5e6
    assert first.total_tokens == pytest.approx(50e9, rel=0.01) and second.total_tokens == pytest.approx(50e9, rel=0.01)
    assert first.memory["fits"] and second.memory["fits"]


def test_pretrain_sbatch_forwards_usr1_and_requeues_after_the_save(tmp_path):
    """The sbatch's own logic, with stand-ins for srun (a trainer that saves and exits 75 on USR1), scontrol and
    smolctl: Slurm's USR1 reaches the trainers, the script waits for them, then requeues; the user's options
    reach the dry-run line too."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    scripts = {
        "srun": "trap 'echo saved >> {calls}; exit 75' USR1\necho training >> {calls}\nfor i in $(seq 300); do sleep 0.1; done\n",
        "scontrol": '[[ $1 == show ]] && {{ echo node1; exit 0; }}\necho "scontrol $*" >> {calls}\n',
        "smolctl": 'echo "smolctl $*" >> {calls}\n',
    }
    for name, body in scripts.items():
        (stubs / name).write_text("#!/bin/bash\n" + body.format(calls=calls))
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1"}
    job = subprocess.Popen(
        ["bash", "recipes/slurm/pretrain.sbatch", "r.toml", str(tmp_path / "run"), "--set", "a.b=1"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while "training" not in (calls.read_text() if calls.is_file() else ""):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=60) == 0, job.stdout.read()
    assert calls.read_text().splitlines() == [
        "smolctl pretrain r.toml --dry-run --world-size 8 --set a.b=1",
        "training",
        "saved",
        "scontrol requeue 42",
    ]
    assert (tmp_path / "run" / "nccl-trace").is_dir()
