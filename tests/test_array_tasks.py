"""pack and mix as Slurm array tasks without Slurm: any split and order of tasks gives the bytes of a plain run,
a task killed mid-unit resumes to the same bytes, a committed run's late tasks exit 0, bad task arguments are
one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli, work_area

from smolctl.data import array_tasks
from smolctl.data import mix as mix_module
from smolctl.data import pack as pack_module
from smolctl.data.array_tasks import WorkArea
from smolctl.data.mix import prepare_mix
from smolctl.data.mix_schedule import schedule_from_recipe
from smolctl.data.pack import PackConfig, prepare_pack
from smolctl.errors import UserError
from smolctl.shards import read_manifest

MIX_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo-mix.toml"


def shard_bytes(folder: Path) -> dict[str, bytes]:
    """Every shard under a folder (stages included) by relative path, and the manifests' data-bearing fields."""
    files = {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    for manifest in sorted(folder.rglob("manifest.json")):
        fields = {k: v for k, v in json.loads(manifest.read_text()).items() if k not in ("created_at", "command")}
        files[str(manifest.relative_to(folder))] = json.dumps(fields, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def four_shards(sample, tmp_path_factory) -> Path:
    """The sample web documents in four shards of unequal size (units of different lengths)."""
    table = pq.read_table(sample / "web" / "part-00000.parquet", columns=["id", "text"])
    folder = tmp_path_factory.mktemp("four") / "web"
    folder.mkdir()
    for index, (start, stop) in enumerate([(0, 100), (100, 350), (350, 420), (420, table.num_rows)]):
        pq.write_table(table.slice(start, stop - start), folder / f"part-{index:05d}.parquet")
    return folder


def run_pack(source: Path, output: Path, tokenizer_dir: Path, **options):
    config = PackConfig(
        seq_len=128, batch_documents=64, buffer_tokens=4096, shard_size="40rows", **options.pop("config", {})
    )
    return prepare_pack(str(source), output, tokenizer_spec=str(tokenizer_dir), config=config).run(**options)


@pytest.mark.parametrize("fmt", ["safetensors", "datatrove"])
def test_pack_tasks_in_any_order_give_the_bytes_of_one_run(four_shards, tokenizer_dir, tmp_path, fmt):
    plain = run_pack(four_shards, tmp_path / "plain", tokenizer_dir, config={"format": fmt})
    results = [
        run_pack(four_shards, tmp_path / "tasks", tokenizer_dir, config={"format": fmt}, tasks=3, task_id=i)
        for i in (2, 0, 1)
    ]
    assert [r.finished for r in results] == [False, False, True]
    assert [r.units_done for r in results] == [1, 2, 1]  # units 2 | 0, 3 | 1
    assert shard_bytes(tmp_path / "tasks") == shard_bytes(tmp_path / "plain")
    assert not (tmp_path / "tasks" / "_work").exists()
    # The accounting is the sum over units, equal to the plain run's.
    assert results[-1].stats == plain.stats and plain.stats.documents == 926 - plain.stats.skipped_empty
    manifest = read_manifest(tmp_path / "tasks")
    assert manifest["documents"] == plain.stats.documents and manifest["tokens"] == plain.stats.tokens
    # A re-submitted array after the commit, or a task with no units of a large array, has nothing to do.
    again = run_pack(four_shards, tmp_path / "tasks", tokenizer_dir, config={"format": fmt}, tasks=64, task_id=63)
    assert again.already_committed


def test_a_pack_task_killed_mid_unit_resumes_to_the_same_bytes(four_shards, tokenizer_dir, tmp_path, monkeypatch):
    run_pack(four_shards, tmp_path / "plain", tokenizer_dir)
    original, calls = pack_module.UnitPacking.add, []

    def dies_on_the_third_batch(self, *batch):
        calls.append(self.unit)
        if len(calls) == 1:
            time.sleep(0.5)  # the reader runs ahead: the unit's last batch and the next unit's first wait queued
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill between batches: shards of the unit already written, no marker
        return original(self, *batch)

    monkeypatch.setattr(pack_module.UnitPacking, "add", dies_on_the_third_batch)
    monkeypatch.setattr(pack_module.UnitPacking, "abandon", lambda self: None)  # a kill cleans nothing up
    with pytest.raises(KeyboardInterrupt):
        run_pack(four_shards, tmp_path / "tasks", tokenizer_dir, tasks=2, task_id=1)
    # Nothing queued behind the failed batch is packed: its unit's last batch and then the next unit's first
    # would finish the unit without it, and mark it done.
    assert calls == [1, 1, 1]
    monkeypatch.setattr(pack_module.UnitPacking, "add", original)
    work = work_area(tmp_path / "tasks") / "pack"
    (staging,) = work.glob(".00001.partial*")  # the killed copy's own staging folder
    assert staging.is_dir() and not (work / "00001.done").exists()
    for task in (1, 0):
        run_pack(four_shards, tmp_path / "tasks", tokenizer_dir, tasks=2, task_id=task)
    assert shard_bytes(tmp_path / "tasks") == shard_bytes(tmp_path / "plain")


def run_mix(output: Path, **options):
    sample = MIX_RECIPE.parent.parent / "data" / "sample"
    paths = [f'sources.{name}.path="{sample / name}"' for name in ("web", "code", "math")]
    # The last stage a curriculum (one writing unit), the others shuffled (one unit per block).
    plan = schedule_from_recipe(MIX_RECIPE, ["shuffle_buffer=300", 'stages.2.order="ascending:length"', *paths])
    return prepare_mix(plan, output).run(**options)


def test_mix_tasks_in_any_order_give_the_bytes_of_one_run(tmp_path, monkeypatch):
    plain = run_mix(tmp_path / "plain")
    # ~1200, 500, 400 documents (budgets are met to a bin) in blocks of 300: several blocks per stage
    assert [s.shards for s in plain.stages] == [-(-s.documents // 300) for s in plain.stages] and plain.stages[
        2
    ].shards > 1
    with pytest.raises(UserError, match="the measure stage has not finished"):
        run_mix(tmp_path / "tasks", stage="write", tasks=3, task_id=0)
    original, calls = mix_module.write_block, []

    def dies_after_writing(*args):  # a kill after the block file is written, before its marker
        rows = original(*args)
        calls.append(rows)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return rows

    for task in (2, 0, 1):
        run_mix(tmp_path / "tasks", stage="measure", tasks=3, task_id=task)
    monkeypatch.setattr(mix_module, "write_block", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        run_mix(tmp_path / "tasks", stage="write", tasks=3, task_id=2)
    monkeypatch.setattr(mix_module, "write_block", original)
    results = [run_mix(tmp_path / "tasks", stage="write", tasks=3, task_id=task) for task in (2, 0, 1)]
    assert [r.finished for r in results] == [False, False, True]
    assert shard_bytes(tmp_path / "tasks") == shard_bytes(tmp_path / "plain")
    assert [s.documents for s in results[-1].stages] == [s.documents for s in plain.stages]
    late = run_mix(tmp_path / "tasks", stage="measure", tasks=3, task_id=0)
    assert late.already_committed


def test_bad_task_arguments_are_one_line_errors(four_shards, tokenizer_dir, tmp_path):
    out = tmp_path / "packed"
    base = ["pack", four_shards, out, "--tokenizer", tokenizer_dir, "--seq-len", "128"]
    done = run_cli(*base, "--tasks", "3", "--task-id", "3")
    assert done.returncode == 2 and "--task-id: 3 is out of range for --tasks 3" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()
    run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=0)
    done = run_cli(*base[:-1], "256", "--tasks", "3", "--task-id", "0")
    assert done.returncode == 2 and "holds an unfinished run with other inputs or settings" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = run_cli(
        "mix", tmp_path / "mix", "--recipe", MIX_RECIPE, "--stage", "write", "--tasks", "2", "--task-id", "0"
    )
    assert done.returncode == 2 and "the measure stage has not finished" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "mix").exists()
    with pytest.raises(UserError, match="add --stage measure"):
        run_mix(tmp_path / "mix", tasks=2, task_id=0)


def test_a_plain_run_that_fails_leaves_nothing(tokenizer_dir, tmp_path):
    pq.write_table(pa.table({"text": ["", None]}), tmp_path / "empty.parquet")
    with pytest.raises(UserError, match="holds no non-empty documents"):
        run_pack(tmp_path / "empty.parquet", tmp_path / "new" / "deeper" / "out", tokenizer_dir)
    assert not (tmp_path / "new").exists(), "nor the folders made to hold OUTPUT and its lock"


def test_a_plain_run_while_another_task_commits_leaves_the_work_alone(
    four_shards, tokenizer_dir, tmp_path, monkeypatch
):
    """Array tasks finished every unit and one on another node holds the assembly lock: a plain run of the same
    command must say so and delete nothing (it removed OUTPUT/_work, the files the lock holder was linking)."""
    out = tmp_path / "packed"
    for task_id in range(2):
        run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=task_id)
    (work_area(out) / "assemble.lock").write_text('{"host": "another-node", "pid": 5}')
    with monkeypatch.context() as patch:  # the last task finishes its unit and waits for the holder, still at work
        patch.setattr(WorkArea, "commit_once", lambda self, assemble, wait=False: None)
        run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=2)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(UserError, match=r"another process .* is writing OUTPUT"):
        run_pack(four_shards, out, tokenizer_dir)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and len(before) > 8


@pytest.mark.parametrize("command", ["dedup", "mix", "pack"])
def test_a_second_plain_run_into_the_same_output_is_refused_and_touches_nothing(
    command, four_shards, tokenizer_dir, tmp_path
):
    """Two plain runs into one OUTPUT each did every unit; the first to commit removed the work area under the
    other, which crashed (mix) or cleaned up after its error and told the user to --overwrite the finished output
    (dedup, pack). The second is refused in one line while the first holds OUTPUT, and the first finishes."""
    out = tmp_path / "out"
    argv = {
        "dedup": ["dedup", four_shards, out],
        "mix": ["mix", out, "--source", f"web={four_shards}:1", "--documents", "200"],
        "pack": ["pack", four_shards, out, "--tokenizer", tokenizer_dir, "--seq-len", "128"],
    }[command]
    first = WorkArea(out, ("units",), {"run": 1})  # the lock is OUTPUT's, whatever run holds it
    with first.alone():  # the first run, between its first write and its commit
        first.prepare()
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        second = run_cli(*argv)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert f"{out}: is being written by another smolctl run (pid {os.getpid()} on " in second.stderr
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    shutil.rmtree(out)
    assert [p.name for p in tmp_path.iterdir()] == [], "the lock file goes with its run"
    assert run_cli(*argv).returncode == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("lock", ['{"host": "another-node", "pid": 5}', ""], ids=["another node", "empty"])
def test_a_lock_left_by_a_dead_assembler_is_taken_over(four_shards, tokenizer_dir, tmp_path, monkeypatch, lock):
    """An assembler killed on another node, or before it wrote its lock: every later task returned unfinished,
    exited 0 and left no OUTPUT, so an afterok job started on nothing."""
    monkeypatch.setattr(array_tasks, "LOCK_STALE_S", 0.3)
    monkeypatch.setattr(array_tasks, "LOCK_POLL_S", 0.05)
    out = tmp_path / "tasks"
    for task_id in range(2):
        run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=task_id)
    (work_area(out) / "assemble.lock").write_text(lock)
    assert run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=2).finished
    run_pack(four_shards, tmp_path / "plain", tokenizer_dir)
    assert shard_bytes(out) == shard_bytes(tmp_path / "plain")


def test_a_refreshed_lock_from_another_node_is_waited_for_until_it_goes(
    four_shards, tokenizer_dir, tmp_path, monkeypatch
):
    """A holder on another node (its pid means nothing here) is alive as long as its lock is refreshed: the last
    task must not take it over after LOCK_STALE_S, only assemble once the holder lets go."""
    monkeypatch.setattr(array_tasks, "LOCK_STALE_S", 0.3)
    monkeypatch.setattr(array_tasks, "LOCK_POLL_S", 0.05)
    original, assembled = pack_module.PackJob._assemble, []

    def timed_assembly(self):
        assembled.append(time.monotonic())
        return original(self)

    monkeypatch.setattr(pack_module.PackJob, "_assemble", timed_assembly)
    out = tmp_path / "tasks"
    for task_id in range(2):
        run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=task_id)
    lock = work_area(out) / "assemble.lock"
    lock.write_text('{"host": "another-node", "pid": 5}')
    released = []

    def holder_on_another_node() -> None:
        for _ in range(20):  # 1 s of refreshes, three times LOCK_STALE_S
            time.sleep(0.05)
            os.utime(lock)
        released.append(time.monotonic())
        lock.unlink()  # it failed: the waiting task assembles

    with ThreadPoolExecutor(1) as other:
        holder = other.submit(holder_on_another_node)
        assert run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=2).finished
        holder.result()
    assert len(assembled) == 1 and assembled[0] >= released[0]


def test_a_dead_lock_is_removed_by_one_task_at_a_time_and_only_while_unchanged(tmp_path, monkeypatch):
    """Every task of a re-submitted array judges the same dead lock at once: one must not remove the lock that
    another has just taken over, nor may two check and remove at the same time."""
    lock, guard = tmp_path / "assemble.lock", tmp_path / "assemble.lock.takeover"
    lock.write_text('{"host": "another-node", "pid": 5}')
    dead = array_tasks._identity(lock.stat())
    taken = tmp_path / "taken"
    taken.write_text('{"host": "this-node", "pid": 6}')
    os.replace(taken, lock)  # another task took it over: same path, another file
    array_tasks._remove_if_unchanged(lock, dead)
    assert lock.read_text() == '{"host": "this-node", "pid": 6}'
    seen = array_tasks._identity(lock.stat())
    guard.write_text("")  # another task is checking this very lock
    array_tasks._remove_if_unchanged(lock, seen)
    assert lock.exists() and guard.exists()
    monkeypatch.setattr(array_tasks, "LOCK_STALE_S", 60.0)
    os.utime(guard, (time.time() - 120, time.time() - 120))  # its task was killed between the two calls
    array_tasks._remove_if_unchanged(lock, seen)
    assert lock.exists() and not guard.exists()
    array_tasks._remove_if_unchanged(lock, seen)
    assert not lock.exists() and not guard.exists()


def test_a_holder_taken_over_while_paused_leaves_its_successors_lock_alone(tmp_path, monkeypatch):
    """A holder paused past LOCK_STALE_S (SIGSTOP, a suspended job) is taken over; when it resumes and fails, it
    removed and refreshed by path the lock that was now its successor's."""
    monkeypatch.setattr(array_tasks, "LOCK_REFRESH_S", 0.02)
    area = WorkArea(tmp_path / "out", ("units",), {"run": 1})
    area.prepare()
    lock = area.root / "assemble.lock"

    def paused_then_failing() -> None:
        successor = lock.with_name("successor")
        successor.write_text('{"host": "another-node", "pid": 7}')
        os.utime(successor, (1_000_000, 1_000_000))
        os.replace(successor, lock)  # taken over while this holder was paused
        time.sleep(0.2)  # its heartbeat goes on meanwhile
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="went away"):
        area.commit_once(paused_then_failing, wait=True)
    assert lock.read_text() == '{"host": "another-node", "pid": 7}' and lock.stat().st_mtime == 1_000_000


def test_a_task_waits_for_a_live_assembler_and_does_not_take_over(four_shards, tokenizer_dir, tmp_path, monkeypatch):
    """The assembler refreshes its lock: a task that finds it held waits until OUTPUT is committed, longer than
    LOCK_STALE_S, and assembles nothing itself."""
    monkeypatch.setattr(array_tasks, "LOCK_STALE_S", 0.3)
    monkeypatch.setattr(array_tasks, "LOCK_REFRESH_S", 0.05)
    monkeypatch.setattr(array_tasks, "LOCK_POLL_S", 0.05)
    original, assembled = pack_module.PackJob._assemble, []

    def slow_assembly(self):
        assembled.append(time.monotonic())
        time.sleep(1.5)
        return original(self)

    monkeypatch.setattr(pack_module.PackJob, "_assemble", slow_assembly)
    out = tmp_path / "tasks"
    run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)
    with ThreadPoolExecutor(1) as other:
        holder = other.submit(run_pack, four_shards, out, tokenizer_dir, tasks=2, task_id=1)
        while not assembled:
            time.sleep(0.01)
        waiter = run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)  # its units are done: it commits
        assert (out / "manifest.json").is_file() and time.monotonic() - assembled[0] >= 1.5
        assert not waiter.finished and holder.result().finished and len(assembled) == 1


def test_a_rerun_with_other_settings_over_an_unfinished_run_starts_again(four_shards, tokenizer_dir, tmp_path):
    """Half an array run, then the command again with another seq_len and --overwrite: the old markers must not
    count (they made it skip units whose work the new run had cleared, and crash)."""
    out = tmp_path / "packed"
    run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)
    redone = prepare_pack(
        str(four_shards), out, tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64), overwrite=True
    ).run()
    plain = prepare_pack(
        str(four_shards), tmp_path / "plain", tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64)
    ).run()
    assert redone.finished and redone.units_done == 4
    assert shard_bytes(out) == shard_bytes(tmp_path / "plain") and redone.stats == plain.stats
    done = run_cli("dedup", four_shards, tmp_path / "dedup", "--stage", "signatures", "--tasks", "2", "--task-id", "0")
    assert done.returncode == 0, done.stderr
    done = run_cli("dedup", four_shards, tmp_path / "dedup", "--minhash", "--overwrite", "--workers", "1")
    assert done.returncode == 0, done.stderr
    assert read_manifest(tmp_path / "dedup")["rows"] > 0


def test_a_task_of_a_replaced_run_never_writes_into_the_new_run(four_shards, tokenizer_dir, tmp_path, monkeypatch):
    """The command re-run with other settings and --overwrite while a task of the first run is mid-unit: that task
    wrote its unit and marker into the new run's work area, which the new run then trusted; or, finishing the
    first run, committed it and took the new run's work away with the old OUTPUT."""
    out = tmp_path / "packed"

    def task(seq_len: int, task_id: int):
        config = PackConfig(seq_len=seq_len, batch_documents=64, buffer_tokens=4096, shard_size="40rows")
        job = prepare_pack(str(four_shards), out, tokenizer_spec=str(tokenizer_dir), config=config, overwrite=True)
        return job.run(tasks=2, task_id=task_id)

    task(128, 0)
    original = pack_module.UnitPacking.add

    def rerun_meanwhile(self, *batch):
        monkeypatch.setattr(pack_module.UnitPacking, "add", original)
        task(64, 0)  # the new run starts while this task of the first is packing its unit
        return original(self, *batch)

    monkeypatch.setattr(pack_module.UnitPacking, "add", rerun_meanwhile)
    # The first run has all its units, but the later run is the one wanted: it does not commit over it (the swap
    # of OUTPUT would take the later run's work with it).
    with pytest.raises(UserError, match="started after this one"):
        task(128, 1)
    assert not (out / "manifest.json").exists()
    assert task(64, 1).finished
    plain = tmp_path / "plain"
    config = PackConfig(seq_len=64, batch_documents=64, buffer_tokens=4096, shard_size="40rows")
    prepare_pack(str(four_shards), plain, tokenizer_spec=str(tokenizer_dir), config=config).run()
    assert shard_bytes(out) == shard_bytes(plain)


def test_a_work_area_of_an_earlier_version_is_named_and_replaced_only_with_overwrite(
    four_shards, tokenizer_dir, tmp_path
):
    """Work areas before runs had folders: OUTPUT/_work/config.json and the stages beside it."""
    out = tmp_path / "packed"
    (out / "_work" / "pack" / "00000").mkdir(parents=True)
    (out / "_work" / "config.json").write_text("{}")
    (out / "_work" / "pack" / "00000.done").write_text("{}")
    with pytest.raises(UserError, match="an earlier smolctl version"):
        run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)
    for task_id in (0, 1):
        config = PackConfig(seq_len=128, batch_documents=64, buffer_tokens=4096, shard_size="40rows")
        job = prepare_pack(str(four_shards), out, tokenizer_spec=str(tokenizer_dir), config=config, overwrite=True)
        assert job.run(tasks=2, task_id=task_id).units_done == 2
    run_pack(four_shards, tmp_path / "plain", tokenizer_dir)
    assert shard_bytes(out) == shard_bytes(tmp_path / "plain") and not (out / "_work").exists()


@pytest.mark.parametrize("damage", ["truncated", "removed", "unit folder removed"])
def test_a_work_file_damaged_between_tasks_is_never_committed(four_shards, tokenizer_dir, tmp_path, damage):
    """A unit's shard truncated or deleted under OUTPUT/_work before the last task: the commit must refuse it,
    not link it into an OUTPUT whose manifest then passes the size check with a wrong sha256. A whole unit
    folder gone was an internal TypeError."""
    out = tmp_path / "packed"
    run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=0)
    unit = work_area(out) / "pack" / "00000"
    shard = next(unit.glob("part-*.safetensors"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "removed":
        shard.unlink()
    else:
        shutil.rmtree(unit)
    run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=1)
    message = "is 100 bytes, not the" if damage == "truncated" else "is missing from the work area"
    with pytest.raises(UserError, match=message):
        run_pack(four_shards, out, tokenizer_dir, tasks=3, task_id=2)
    assert not (out / "manifest.json").exists()


def test_a_requeued_task_with_overwrite_finds_its_run_committed(four_shards, tokenizer_dir, tmp_path):
    """An sbatch that passes --overwrite to every task: a task requeued after the commit has nothing to do. It
    redid its units and left OUTPUT/_work inside the committed folder."""
    out = tmp_path / "packed"
    config = PackConfig(seq_len=128, batch_documents=64, buffer_tokens=4096, shard_size="40rows")

    def task(task_id: int):
        job = prepare_pack(str(four_shards), out, tokenizer_spec=str(tokenizer_dir), config=config, overwrite=True)
        return job.run(tasks=3, task_id=task_id)

    assert [task(i).finished for i in (0, 1, 2)] == [False, False, True]
    committed = shard_bytes(out)
    again = task(1)
    assert again.already_committed and again.units_done == 0
    assert shard_bytes(out) == committed and not (out / "_work").exists()


def _stage_unit_in_step(barrier, path: Path, content: str) -> None:
    from smolctl.shards import KIND_PACKED, OutputFolder

    folder = OutputFolder(path, kind=KIND_PACKED, overwrite=True, per_process=True)
    barrier.wait(timeout=30)  # both copies have staged before either writes or moves into place
    (folder.file("part.bin")).write_text(content)
    barrier.wait(timeout=30)
    folder.commit()


def test_two_copies_of_one_task_stage_a_unit_side_by_side(tmp_path):
    """A requeued task may run while its first copy still does: a unit's staging folder was shared, so one copy
    deleted the other's half-written shard (an internal SafetensorError)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    unit = tmp_path / "_work" / "pack" / "00000"
    unit.parent.mkdir(parents=True)
    copies = [context.Process(target=_stage_unit_in_step, args=(barrier, unit, "same bytes")) for _ in range(2)]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.join(timeout=60)
    assert [copy.exitcode for copy in copies] == [0, 0]
    assert (unit / "part.bin").read_text() == "same bytes" and read_manifest(unit)["kind"] == "packed"
    assert sorted(p.name for p in unit.parent.iterdir()) == ["00000"]  # no staging or old folder left


def test_a_unit_whose_move_into_place_fails_is_not_marked_and_keeps_the_other_copy(
    four_shards, tokenizer_dir, tmp_path, monkeypatch
):
    """Any failed move of a unit's staging folder was taken for another copy winning the race: the staging folder
    was deleted and the unit marked done with no folder, and every later task failed assembling it."""
    import smolctl.shards as shards
    from smolctl.shards import KIND_PACKED, OutputFolder

    rename = os.replace

    def moves_into_place_fail(unit: str):
        def replace(source, target):
            if ".partial-" in str(source) and Path(target).name == unit:
                raise PermissionError(13, "Permission denied")
            return rename(source, target)

        monkeypatch.setattr(shards.os, "replace", replace)

    out = tmp_path / "tasks"
    moves_into_place_fail("00000")
    with pytest.raises(UserError, match="cannot move the finished unit into place: Permission denied"):
        run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)
    assert not (work_area(out) / "pack" / "00000.done").exists()
    # A copy that already put its unit in place keeps it there when another copy's move fails.
    unit = tmp_path / "unit"
    first = OutputFolder(unit, kind=KIND_PACKED, overwrite=True, per_process=True)
    first.file("part.bin").write_text("first copy")
    first.commit()
    second = OutputFolder(unit, kind=KIND_PACKED, overwrite=True, per_process=True)
    moves_into_place_fail("unit")
    with pytest.raises(UserError, match="cannot move"):
        second.commit()
    assert (unit / "part.bin").read_text() == "first copy" and read_manifest(unit)["kind"] == "packed"
    assert sorted(p.name for p in tmp_path.iterdir() if "unit" in p.name) == ["unit"]
    monkeypatch.setattr(shards.os, "replace", rename)
    for task in (0, 1):
        run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=task)
    run_pack(four_shards, tmp_path / "plain", tokenizer_dir)
    assert shard_bytes(out) == shard_bytes(tmp_path / "plain")


def test_a_commit_whose_final_move_fails_keeps_the_work_area(four_shards, tokenizer_dir, tmp_path, monkeypatch):
    """OUTPUT, with the work area in it, was moved aside for the commit; when the move into place then failed it
    stayed hidden (and the next commit deleted it), and the error named a staging folder already deleted."""
    import smolctl.shards as shards

    rename = os.replace

    def fails_into_output(source, target):
        if Path(source).name == ".tasks.partial":
            raise PermissionError(13, "Permission denied")
        return rename(source, target)

    out = tmp_path / "tasks"
    run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=0)
    monkeypatch.setattr(shards.os, "replace", fails_into_output)
    with pytest.raises(UserError, match="nothing was replaced"):
        run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks"]
    assert sorted(p.name for p in (work_area(out) / "pack").glob("*.done")) == [f"0000{u}.done" for u in range(4)]
    monkeypatch.setattr(shards.os, "replace", rename)
    assert run_pack(four_shards, out, tokenizer_dir, tasks=2, task_id=1).finished
    run_pack(four_shards, tmp_path / "plain", tokenizer_dir)
    assert shard_bytes(out) == shard_bytes(tmp_path / "plain")


def test_a_task_that_fails_after_another_committed_has_nothing_to_do(tmp_path):
    """Whatever failed (here a shard whose folder the committing copy removed) is moot once OUTPUT is committed."""
    from smolctl.data.array_tasks import FINGERPRINT_KEY, AlreadyCommitted, WorkArea, digest, unless_committed

    area = WorkArea(tmp_path / "out", ("pack",), {"run": 1})
    (tmp_path / "out").mkdir()
    manifest = tmp_path / "out" / "manifest.json"
    own = {"kind": "packed", "format_version": 1, "smolctl_version": "0.1.0"}  # as every smolctl manifest has them
    manifest.write_text(json.dumps({**own, FINGERPRINT_KEY: digest({"run": 2})}))
    with pytest.raises(RuntimeError), unless_committed(area):  # another run's OUTPUT: the failure stands
        raise RuntimeError("Error while serializing: I/O error")
    manifest.write_text(json.dumps({**own, FINGERPRINT_KEY: digest({"run": 1})}))
    with pytest.raises(AlreadyCommitted), unless_committed(area):
        raise RuntimeError("Error while serializing: I/O error")


def test_one_output_has_one_lock_whatever_its_spelling(tmp_path, monkeypatch):
    """The lock sat beside the path as typed: a link and its target, or `.` and the absolute path, were two
    locks, and two runs held them at once (for `.` the lock file was made inside OUTPUT itself)."""
    from smolctl.errors import UserError
    from smolctl.folder_lock import held_alone

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    monkeypatch.chdir(tmp_path / "target")
    with held_alone(tmp_path / "link", "written", "wait"):
        for other in (tmp_path / "target", Path("."), tmp_path / "missing" / ".." / "target"):
            with pytest.raises(UserError, match="is being written by another"), held_alone(other, "written", "-"):
                pass
        assert list((tmp_path / "target").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
