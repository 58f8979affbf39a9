"""The bad-input catalogue: every case runs the real CLI in a subprocess and must end with exit code 2, one line
`error: ...` that names the offending file/key/row, no traceback, and an output folder absent or unchanged."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, run_cli, work_area


@dataclass
class Case:
    name: str
    # Given a scratch folder, prepare inputs and return (argv, text the message must contain, output folder).
    setup: Callable[[Path], tuple[list, str, Path | None]]
    env: dict | None = None  # environment variables the case runs with


def snapshot(folder: Path | None) -> dict[str, str] | None:
    if folder is None or not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def corrupt_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    shard = sorted(p for p in dst.iterdir() if p.name.startswith("part-"))[0]
    data = shard.read_bytes()
    shard.write_bytes(
        data[: len(data) // 2]
        if how == "truncate"
        else data[:100] + bytes(b ^ 0xFF for b in data[100:400]) + data[400:]
    )
    return shard


def parquet_with(tmp: Path, name: str, columns: dict) -> Path:
    path = tmp / name
    pq.write_table(pa.table(columns), path)
    return path


_SHARED: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def shared_inputs(tokenizer_dir, tmp_path_factory):
    """A tokenizer, a packed folder and a tiny model checkpoint that the training cases start from."""
    from test_pretrain import TEST_RECIPE
    from tiny_checkpoint import make_tiny_checkpoint

    from smolctl.data.pack import PackConfig, pack

    root = tmp_path_factory.mktemp("bad-inputs")
    _SHARED["tokenizer"] = tokenizer_dir
    _SHARED["packed"] = root / "packed"
    pack(str(SAMPLE / "math"), _SHARED["packed"], tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64))
    _SHARED["recipe"] = root / "tiny.toml"
    _SHARED["recipe"].write_text(TEST_RECIPE.replace("{packed}", str(_SHARED["packed"])))
    _SHARED["model"] = make_tiny_checkpoint(tokenizer_dir, root / "model")
    _SHARED["narrow"] = make_tiny_checkpoint(tokenizer_dir, root / "narrow", hidden_size=32)
    _SHARED["big-vocab"] = make_tiny_checkpoint(tokenizer_dir, root / "big-vocab", vocab_size=2048 + 64)
    from smolctl.train.pretrain import train

    _SHARED["run"] = root / "run"  # a finished 2-step run with checkpoints at steps 1 and 2
    train(
        _SHARED["recipe"],
        _SHARED["run"],
        overrides=["training.steps=2", "checkpoint.interval=1", "schedule.warmup_steps=0"],
        show=False,
    )
    _SHARED["other-packed"] = root / "other-packed"
    pack(str(SAMPLE / "web"), _SHARED["other-packed"], tokenizer_spec=str(tokenizer_dir), config=PackConfig(seq_len=64))


def tok() -> Path:
    return _SHARED["tokenizer"]


def packed() -> Path:
    return _SHARED["packed"]


def recipe() -> Path:
    return _SHARED["recipe"]


def model() -> Path:
    return _SHARED["model"]


def run_copy(tmp: Path, *, unfinished: bool = False) -> Path:
    """A copy of the shared run; `unfinished`: its final/ and last checkpoint gone, as after a crash."""
    copy = tmp / "run"
    shutil.copytree(_SHARED["run"], copy)
    if unfinished:
        shutil.rmtree(copy / "final")
        shutil.rmtree(copy / "checkpoints" / "step-0000002")
    return copy


def run_that_saved_nothing(tmp: Path) -> Path:
    """A copy of the shared run as it is before its first save: run.json and logs, no checkpoint, no final/."""
    run = run_copy(tmp)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "final")
    return run


def started_from(run: Path, parent: Path) -> Path:
    """The run as if it had started from `parent` (midtrain --from)."""
    recorded = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(recorded | {"parent": str(Path(parent).resolve())}))
    return run


def other_model(tmp: Path) -> Path:
    return Path(shutil.copytree(model(), tmp / "other"))


def partial_checkpoint(tmp: Path) -> Path:
    """A save that never finished: DCP files in the hidden staging folder, no manifest."""
    run = run_copy(tmp)
    partial = run / "checkpoints" / ".step-0000003.partial"
    shutil.copytree(run / "checkpoints" / "step-0000002", partial)
    (partial / "manifest.json").unlink()
    return partial


def other(name: str) -> Path:
    return _SHARED[name]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def truncated_packed(tmp: Path) -> Path:
    copy = tmp / "packed"
    shutil.copytree(packed(), copy)
    shard = copy / "part-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return copy


def model_missing_weights(tmp: Path) -> Path:
    copy = tmp / "model"
    shutil.copytree(model(), copy)
    (copy / "model.safetensors").unlink()
    return copy


def tokenizer_without_eos(tmp: Path) -> Path:
    folder = tmp / "no-eos"
    shutil.copytree(tok(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def documents_with_bytes_that_are_not_utf8(tmp: Path) -> Path:
    """Two shards of documents; the second holds, in its row 2, bytes a string column must not (other tools than
    arrow write such files, and arrow reads them as they are)."""
    folder = tmp / "docs"
    folder.mkdir()
    texts = [f"document {i} talks about {i * 7} things" for i in range(6)]
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(6)], "text": texts}), folder / "part-00000.parquet")
    raw = [t.encode() for t in texts]
    raw[2] = b"caf\xc3 \xff\xfe cut off: \xe2\x82"
    text = pa.array(raw, pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(6)], "text": text}), folder / "part-00001.parquet")
    return folder


NOT_UTF8 = "part-00001.parquet: row 2 (from 0): column 'text' holds bytes that are not UTF-8 text"


def dedup_work_with_a_damaged_file(tmp: Path, how: str) -> Path:
    """OUTPUT/_work of a dedup run whose first two stages finished, one signatures file removed or cut short since."""
    out = tmp / "out"
    for stage in ("signatures", "buckets"):
        done = run_cli("dedup", SAMPLE / "math", out, "--minhash", "--stage", stage, "--tasks", "1", "--task-id", "0")
        assert done.returncode == 0, done.stderr
    shingles = next((work_area(out) / "signatures").glob("*.shingles"))
    if how == "removed":
        shingles.unlink()
    else:
        shingles.write_bytes(shingles.read_bytes()[:100])
    return out


def components_over_damaged_work(tmp: Path, how: str) -> list:
    out = dedup_work_with_a_damaged_file(tmp, how)
    return ["dedup", SAMPLE / "math", out, "--minhash", "--stage", "components", "--tasks", "1", "--task-id", "0"]


def plain_folder(tmp: Path) -> Path:
    """A folder of parquet files without a manifest (every file under it is input)."""
    folder = tmp / "plain"
    folder.mkdir()
    for shard in (SAMPLE / "math").glob("*.parquet"):
        shutil.copy(shard, folder / shard.name)
    return folder


def _edited_run(tmp: Path, name: str, text: str) -> Path:
    run = run_copy(tmp)
    (run / name).write_text(text)
    return run


def _damaged(tmp: Path, name: str, *, digests: bool = True) -> Path:
    """The newest checkpoint of a copy of the shared run, with `name` overwritten at its own size (the manifest's
    size check passes; the bytes are wrong, as after a bad copy or a failing disk). digests=False: its manifest
    lists no sha256, as a checkpoint saved before they were recorded, so only reading the bytes finds the damage."""
    checkpoint = run_copy(tmp) / "checkpoints" / "step-0000002"
    size = (checkpoint / name).stat().st_size
    (checkpoint / name).write_bytes(b"Y" * size)
    if not digests:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["files"] = [{k: v for k, v in f.items() if k != "sha256"} for f in manifest["files"]]
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint


def _tool_calls(tmp: Path) -> Path:
    user, answer = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "add"}}]}
    return parquet_with(tmp, "tools.parquet", {"messages": [[user, answer], [user, call]], "task": ["math", "tool"]})


def _chat_with_list_tags(tmp: Path) -> Path:
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    return parquet_with(tmp, "tagged.parquet", {"messages": [turns, turns], "tags": [["math"], ["math", "easy"]]})


def _pairs(tmp: Path, how: str) -> Path:
    """Preference pairs whose chosen holds a user turn, or whose prompt alone is longer than any max_length here."""
    prompt = "what is two and two? " * (40 if how == "long" else 1)
    chosen = [{"role": "user", "content": "what?"}] if how == "user" else [{"role": "assistant", "content": "4"}]
    rejected = [{"role": "assistant", "content": "5"}]
    return parquet_with(
        tmp, "pairs.parquet", {"prompt": [prompt] * 2, "chosen": [chosen] * 2, "rejected": [rejected] * 2}
    )


def _models_in(tmp: Path) -> list[Path]:
    """Two models inside one folder, t/d/a and t/d/b (made once per case)."""
    if not (tmp / "d").exists():
        for name in ("a", "b"):
            shutil.copytree(model(), tmp / "d" / name)
    return [tmp / "d" / "a", tmp / "d" / "b"]


def _run_holding_data(tmp: Path) -> Path:
    run = run_copy(tmp)
    shutil.copytree(packed(), run / "packed")
    return run


def _existing_output(tmp: Path) -> Path:
    out = tmp / "existing"
    shutil.copytree(SAMPLE / "math", out)
    return out


CASES = [
    Case("inspect: missing path", lambda t: (["inspect", t / "nope"], "no such file or folder", None)),
    Case(
        "inspect: empty folder",
        lambda t: ((t / "empty").mkdir(), ["inspect", t / "empty"], "holds no parquet files", None)[1:],
    ),
    Case(
        "dedup: a JSON-lines file (corpora often ship them)",
        lambda t: (
            (t / "docs.jsonl").write_text('{"text": "a"}\n'),
            ["dedup", t / "docs.jsonl", t / "out"],
            'docs.jsonl: is JSON lines, not parquet — convert it to parquet first, e.g. python -c "import datasets; '
            f"datasets.load_dataset('json', data_files='{t / 'docs.jsonl'}', split='train').to_parquet",
            t / "out",
        )[1:],
    ),
    Case(
        "pack: a folder of compressed JSON lines",
        lambda t: (
            (t / "crawl").mkdir(),
            (t / "crawl" / "part-0.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd"),
            ["pack", t / "crawl", t / "out", "--tokenizer", tok()],
            f"holds no parquet files (it holds part-0.jsonl.zst) — convert it to parquet first, e.g. python -c "
            f"\"import datasets; datasets.load_dataset('json', data_files='{t / 'crawl'}/*.json*'",
            t / "out",
        )[2:],
    ),
    Case(
        "inspect: text file named .parquet",
        lambda t: ((t / "x.parquet").write_text("hi"), ["inspect", t / "x.parquet"], "x.parquet", None)[1:],
    ),
    Case(
        "inspect: --lineage on a folder of smolctl folders",
        lambda t: (
            shutil.copytree(SAMPLE / "math", t / "all" / "math"),
            ["inspect", t / "all", "--lineage"],
            "--lineage: ",
            None,
        )[1:],
    ),
    Case(
        "inspect: --verify of a run that has saved nothing yet",
        lambda t: (["inspect", run_that_saved_nothing(t), "--verify"], "run: holds no smolctl folder to verify", None),
    ),
    Case(
        "inspect: --lineage of a run that has saved nothing yet",
        lambda t: (
            ["inspect", run_that_saved_nothing(t), "--lineage"],
            "run is a run with no checkpoint or final model yet",
            None,
        ),
    ),
    Case(
        "inspect: truncated shard",
        lambda t: (["inspect", corrupt_copy(SAMPLE / "math", t / "m", "truncate")], "part-00000.parquet", None),
    ),
    Case(
        "inspect: corrupt manifest json",
        lambda t: (
            shutil.copytree(SAMPLE / "math", t / "m"),
            (t / "m" / "manifest.json").write_text("{oops"),
            ["inspect", t / "m"],
            "manifest.json: is not valid JSON",
            None,
        )[2:],
    ),
    Case(
        "inspect: shard listed in manifest is missing",
        lambda t: (
            shutil.copytree(SAMPLE / "math", t / "m"),
            (t / "m" / "part-00001.parquet").unlink(),
            ["inspect", t / "m"],
            "part-00001.parquet: is listed in the manifest but missing",
            None,
        )[2:],
    ),
    Case(
        "train-tokenizer: missing text column",
        lambda t: (
            ["train-tokenizer", parquet_with(t, "a.parquet", {"body": ["x" * 50]}), t / "out"],
            "no column 'text' (columns: body)",
            t / "out",
        ),
    ),
    Case(
        "train-tokenizer: text column of ints",
        lambda t: (
            ["train-tokenizer", parquet_with(t, "a.parquet", {"text": [1, 2]}), t / "out"],
            "column 'text' holds int64, not text",
            t / "out",
        ),
    ),
    Case(
        "train-tokenizer: zero vocab",
        lambda t: (
            ["train-tokenizer", SAMPLE / "math", t / "out", "--vocab-size", "0"],
            "--vocab-size: 0 is too small",
            t / "out",
        ),
    ),
    Case(
        "train-tokenizer: --sample-bytes smaller than every document",
        lambda t: (
            ["train-tokenizer", SAMPLE / "math", t / "out", "--sample-bytes", "5"],
            "--sample-bytes: 5 bytes hold none of the documents drawn",
            t / "out",
        ),
    ),
    Case(
        "train-tokenizer: output exists",
        lambda t: (
            ["train-tokenizer", SAMPLE / "math", _existing_output(t)],
            "already exists and is not empty",
            t / "existing",
        ),
    ),
    Case(
        "train-tokenizer: output is a file",
        lambda t: (
            (t / "f").write_text("x"),
            ["train-tokenizer", SAMPLE / "math", t / "f"],
            "exists and is a file",
            t / "f",
        )[1:],
    ),
    Case(
        "train-tokenizer: glob matches nothing",
        lambda t: (["train-tokenizer", str(t / "*.parquet"), t / "out"], "the pattern matches no files", t / "out"),
    ),
    # dedup
    *(
        Case(
            f"{name}: a string column holding bytes that are not UTF-8",
            lambda t, arguments=arguments: (
                arguments(documents_with_bytes_that_are_not_utf8(t), t / "out"),
                NOT_UTF8,
                t / "out",
            ),
        )
        for name, arguments in (
            ("dedup", lambda docs, out: ["dedup", docs, out]),
            ("dedup --minhash", lambda docs, out: ["dedup", docs, out, "--minhash"]),
            ("pack", lambda docs, out: ["pack", docs, out, "--tokenizer", tok(), "--seq-len", "64"]),
            ("train-tokenizer", lambda docs, out: ["train-tokenizer", docs, out, "--vocab-size", "300"]),
            ("mix by documents", lambda docs, out: ["mix", out, "--source", f"a={docs}:1", "--documents", "12"]),
            (
                "mix by tokens",
                lambda docs, out: ["mix", out, "--source", f"a={docs}:1", "--tokens", "200", "--tokenizer", tok()],
            ),
        )
    ),
    Case(
        "dedup: threshold outside (0,1)",
        lambda t: (["dedup", SAMPLE / "math", t / "out", "--minhash", "--threshold", "1.5"], "--threshold", t / "out"),
    ),
    Case(
        "dedup: bands x rows != num-perm",
        lambda t: (
            ["dedup", SAMPLE / "math", t / "out", "--minhash", "--num-perm", "100", "--bands", "9", "--rows", "12"],
            "--num-perm",
            t / "out",
        ),
    ),
    Case(
        "dedup: negative bands and rows whose product is num-perm",
        lambda t: (
            ["dedup", SAMPLE / "math", t / "out", "--minhash", "--bands", "-4", "--rows", "-25"],
            "each must be at least 1",
            t / "out",
        ),
    ),
    Case(
        "dedup: duplicate ids",
        lambda t: (
            ["dedup", parquet_with(t, "d.parquet", {"id": ["a", "b", "a"], "text": ["x y z"] * 3}), t / "out"],
            "'a'",
            t / "out",
        ),
    ),
    Case(
        "dedup: task id out of range",
        lambda t: (
            [
                "dedup",
                SAMPLE / "math",
                t / "out",
                "--minhash",
                "--stage",
                "signatures",
                "--tasks",
                "2",
                "--task-id",
                "5",
            ],
            "--task-id",
            t / "out",
        ),
    ),
    Case(
        "dedup: filter stage before its inputs",
        lambda t: (
            ["dedup", SAMPLE / "math", t / "out", "--minhash", "--stage", "filter", "--tasks", "1", "--task-id", "0"],
            "has not finished",
            t / "out",
        ),
    ),
    Case(
        "dedup: missing id column",
        lambda t: (
            ["dedup", SAMPLE / "math", t / "out", "--id-column", "uuid"],
            "no column 'uuid' (columns: id, text, origin) — pass one of them with --id-column",
            t / "out",
        ),
    ),
    Case(
        "dedup: missing text column",
        lambda t: (
            ["dedup", SAMPLE / "math", t / "out", "--text-column", "body"],
            "no column 'body' (columns: id, text, origin) — pass one of them with --text-column",
            t / "out",
        ),
    ),
    Case(
        "dedup: the id column is the text column",
        lambda t: (["dedup", SAMPLE / "math", t / "out", "--id-column", "text"], "also the text column", t / "out"),
    ),
    Case(
        "dedup: ids that are lists",
        lambda t: (
            ["dedup", parquet_with(t, "d.parquet", {"id": [[1], [2]], "text": ["x y z", "a b c"]}), t / "out"],
            "column 'id' holds list<element: int64>, which cannot be written as text ids",
            t / "out",
        ),
    ),
    Case(
        "dedup: binary ids that are not UTF-8",
        lambda t: (
            [
                "dedup",
                parquet_with(t, "d.parquet", {"id": [b"\xff\x00", b"\xff\x01"], "text": ["x y", "a b"]}),
                t / "out",
            ],
            "d.parquet: column 'id' holds ids that are not UTF-8 text",
            t / "out",
        ),
    ),
    Case(
        "dedup: a reference whose ids are structs",
        lambda t: (
            [
                "dedup",
                SAMPLE / "math",
                t / "out",
                "--against",
                parquet_with(t, "ref.parquet", {"id": [{"n": 1}], "text": ["x y z"]}),
            ],
            "ref.parquet: column 'id' holds struct<n: int64>",
            t / "out",
        ),
    ),
    Case(
        "dedup: a reference that holds the input's own file (a folder around it): every document would go",
        lambda t: (
            ["dedup", next(plain_folder(t).glob("*.parquet")), t / "out", "--against", t / "plain"],
            "--against: also holds the input",
            t / "out",
        ),
    ),
    Case(
        "dedup: a reference that is the input's files by a glob",
        lambda t: (
            ["dedup", plain_folder(t), t / "out", "--against", str(t / "plain" / "*.parquet")],
            "--against: is the input itself",
            t / "out",
        ),
    ),
    Case(
        "dedup: the output is the input, with --overwrite",
        lambda t: (
            ["dedup", _existing_output(t), t / "existing", "--overwrite"],
            "existing: is the input",
            t / "existing",
        ),
    ),
    Case(
        "dedup: a work file removed between stages",
        lambda t: (
            components_over_damaged_work(t, "removed"),
            "00000.shingles: is missing from the work area",
            t / "out",
        ),
    ),
    Case(
        "dedup: a work file cut short between stages",
        lambda t: (
            components_over_damaged_work(t, "truncated"),
            "00000.shingles: cannot be read as its unit wrote it (100 bytes, not",
            t / "out",
        ),
    ),
    Case(
        "dedup: the output inside the input folder, which the next run would read",
        lambda t: (
            ["dedup", plain_folder(t), t / "plain" / "deduped"],
            "is inside the input folder",
            t / "plain",
        ),
    ),
    Case(
        "dedup: the output where the input's ** glob finds files, which the next run would read",
        lambda t: (
            ["dedup", f"{plain_folder(t).parent}/**/*.parquet", t / "plain" / "runs" / "deduped"],
            "is where the input pattern",
            t / "plain" / "runs",
        ),
    ),
    Case(
        "dedup: zero tasks",
        lambda t: (["dedup", SAMPLE / "math", t / "out", "--tasks", "0"], "--tasks: 0 is not a task count", t / "out"),
    ),
    # mix
    Case(
        "mix: the output holds a source, with --overwrite",
        lambda t: (
            ["mix", t, "--source", f"math={_existing_output(t)}:1", "--overwrite"],
            "holds the input",
            t / "existing",
        ),
    ),
    Case(
        "mix: the output where a source's glob finds files, which the next run would read",
        lambda t: (
            ["mix", t / "mixed", "--source", f"math={plain_folder(t).parent}/*/*.parquet:1"],
            "is where the input pattern",
            t / "mixed",
        ),
    ),
    Case(
        "mix: two sources reading the same file, which would mix its documents twice",
        lambda t: (
            ["mix", t / "out", "--source", f"a={SAMPLE / 'web'}:1", "--source", f"b={SAMPLE / 'web'}/*.parquet:1"],
            "as source 'a' does: its documents would be mixed under both names",
            t / "out",
        ),
    ),
    Case(
        "mix: zero tasks",
        lambda t: (
            ["mix", t / "out", "--source", f"web={SAMPLE / 'web'}:1", "--stage", "measure", "--tasks", "0"],
            "--tasks: 0 is not a task count",
            t / "out",
        ),
    ),
    Case(
        "mix: the text column is named source",
        lambda t: (
            [
                "mix",
                t / "out",
                "--source",
                f"code={parquet_with(t, 's.parquet', {'source': ['def f(): pass']})}:1",
                "--text-column",
                "source",
            ],
            "'source' is where mix writes each document's source name",
            t / "out",
        ),
    ),
    Case(
        "mix: a tokenizer without an end-of-sequence token",
        lambda t: (
            ["mix", t / "out", "--source", f"web={SAMPLE / 'web'}:1", "--tokenizer", tokenizer_without_eos(t)],
            "no-eos: has no end-of-sequence token",
            t / "out",
        ),
    ),
    Case(
        "mix: weight does not parse",
        lambda t: (["mix", t / "out", "--source", f"web={SAMPLE / 'web'}:lots"], "lots", t / "out"),
    ),
    Case(
        "mix: weights sum to zero",
        lambda t: (
            ["mix", t / "out", "--source", f"web={SAMPLE / 'web'}:0", "--source", f"code={SAMPLE / 'code'}:0"],
            "zero",
            t / "out",
        ),
    ),
    Case(
        "mix: source path missing",
        lambda t: (["mix", t / "out", "--source", f"web={t / 'nowhere'}:1"], "nowhere", t / "out"),
    ),
    Case(
        "mix: recipe TOML syntax error",
        lambda t: (
            ["mix", t / "out", "--recipe", write(t / "m.toml", "[[stages]\nname = 1\n")],
            "m.toml: is not valid TOML",
            t / "out",
        ),
    ),
    Case(
        "mix: recipe unknown key",
        lambda t: (
            [
                "mix",
                t / "out",
                "--recipe",
                write(t / "m.toml", "seeed = 3\n" + Path("recipes/demo-mix.toml").read_text()),
            ],
            "did you mean 'seed'",
            t / "out",
        ),
    ),
    Case(
        "mix: negative budget",
        lambda t: (["mix", t / "out", "--source", f"web={SAMPLE / 'web'}:1", "--documents", "-5"], "-5", t / "out"),
    ),
    # pack
    Case(
        "pack: seq-len below 2",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", tok(), "--seq-len", "1"],
            "--seq-len",
            t / "out",
        ),
    ),
    Case(
        "pack: tokenizer folder missing",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", t / "no-tok", "--seq-len", "64"],
            "no-tok",
            t / "out",
        ),
    ),
    Case(
        "pack: folder that is not a tokenizer",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", SAMPLE / "math", "--seq-len", "64"],
            "not a tokenizer folder",
            t / "out",
        ),
    ),
    Case(
        "pack: packed folder given as documents",
        lambda t: (
            ["pack", packed(), t / "out", "--tokenizer", tok(), "--seq-len", "64"],
            "packed folder, not a dataset",
            t / "out",
        ),
    ),
    Case(
        "pack: hub tokenizer id while offline",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", "no-org/no-tok", "--seq-len", "64"],
            "the Hub is offline (HF_HUB_OFFLINE is set)",
            t / "out",
        ),
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case(
        "pack: a tokenizer without an end-of-sequence token",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", tokenizer_without_eos(t), "--seq-len", "64"],
            "no-eos: has no end-of-sequence token",
            t / "out",
        ),
    ),
    Case(
        "pack: the output holds the input file, with --overwrite",
        lambda t: (
            [
                "pack",
                parquet_with(_existing_output(t), "extra.parquet", {"text": ["a b c"]}),
                t / "existing",
                "--tokenizer",
                tok(),
                "--seq-len",
                "64",
                "--overwrite",
            ],
            "holds the input",
            t / "existing",
        ),
    ),
    Case(
        "pack: zero tasks",
        lambda t: (
            ["pack", SAMPLE / "math", t / "out", "--tokenizer", tok(), "--seq-len", "64", "--tasks", "0"],
            "--tasks: 0 is not a task count",
            t / "out",
        ),
    ),
    Case(
        "pack: input without a text column",
        lambda t: (
            ["pack", SAMPLE / "prompts", t / "out", "--tokenizer", tok(), "--seq-len", "64"],
            "no column 'text'",
            t / "out",
        ),
    ),
    # pretrain / midtrain
    Case(
        "pretrain: recipe typo",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--set", "training.micro_bach=2"],
            "did you mean 'micro_batch'",
            t / "run",
        ),
    ),
    Case(
        "pretrain: the run folder path is a file",
        lambda t: (
            (t / "run").write_text("notes"),
            ["pretrain", recipe(), t / "run", "--resume", "auto"],
            "run: exists and is a file, not a folder",
            t / "run",
        )[1:],
    ),
    Case(
        "pretrain: --resume auto with --overwrite",
        lambda t: (
            ["pretrain", recipe(), run_copy(t, unfinished=True), "--resume", "auto", "--overwrite"],
            "--overwrite: --resume continues the run and --overwrite deletes it",
            t / "run",
        ),
    ),
    Case(
        "pretrain: training.steps below the checkpoint to resume",
        lambda t: (
            shutil.rmtree(run_copy(t) / "final"),
            [
                "pretrain",
                recipe(),
                t / "run",
                "--resume",
                "auto",
                "--set",
                "training.steps=1",
                "--set",
                "schedule.warmup_steps=0",
            ],
            "training.steps: is 1, but the checkpoint to resume (",
            t / "run",
        )[1:],
    ),
    Case(
        "pretrain: wrong type",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--set", 'training.micro_batch="3"'],
            "training.micro_batch: expected int",
            t / "run",
        ),
    ),
    Case(
        "pretrain: missing packed folder",
        lambda t: (["pretrain", recipe(), t / "run", "--data", t / "gone"], "gone", t / "run"),
    ),
    Case(
        "pretrain: documents folder where packed is needed",
        lambda t: (["pretrain", recipe(), t / "run", "--data", SAMPLE / "math"], "not a packed folder", t / "run"),
    ),
    Case(
        "pretrain: truncated packed shard",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--data", truncated_packed(t)],
            "part-00000.safetensors: is",
            t / "run",
        ),
    ),
    Case(
        "pretrain: packed seq_len differs from the recipe",
        lambda t: (["pretrain", recipe(), t / "run", "--set", "training.seq_len=128"], "seq_len", t / "run"),
    ),
    Case(
        "pretrain: global batch not divisible",
        lambda t: (["pretrain", recipe(), t / "run", "--set", "training.global_batch=7"], "global_batch", t / "run"),
    ),
    Case(
        "pretrain: zero steps",
        lambda t: (["pretrain", recipe(), t / "run", "--set", "training.steps=0"], "training.steps", t / "run"),
    ),
    Case(
        "pretrain: negative learning rate",
        lambda t: (["pretrain", recipe(), t / "run", "--set", "optimizer.lr=-1.0"], "optimizer.lr", t / "run"),
    ),
    Case(
        "pretrain: tp does not divide the KV heads",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--set", "parallel.tp=4"],
            "parallel.tp: 4 does not divide model.num_key_value_heads = 2",
            t / "run",
        ),
    ),
    Case(
        "pretrain: a world size the mesh cannot cover",
        lambda t: (
            [
                "pretrain",
                recipe(),
                "--dry-run",
                "--world-size",
                "6",
                "--set",
                "parallel.tp=2",
                "--set",
                "parallel.dp_shard=2",
            ],
            "parallel.dp_shard: 2 does not divide the 3 ranks",
            None,
        ),
    ),
    Case(
        "pretrain: tp on an architecture without a TP plan",
        lambda t: (
            [
                "pretrain",
                recipe(),
                "--dry-run",
                "--world-size",
                "2",
                "--set",
                "parallel.tp=2",
                "--set",
                'model.architecture="falcon"',
            ],
            "parallel.tp: falcon has no tensor-parallel plan",
            None,
        ),
    ),
    Case(
        "pretrain: flash_attention_2 without a GPU",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--set", 'training.attention="flash_attention_2"'],
            "training.attention: flash_attention_2 needs a CUDA GPU",
            t / "run",
        ),
    ),
    Case(
        "midtrain: --from missing",
        lambda t: (["midtrain", recipe(), t / "run", "--from", t / "nope"], "nope", t / "run"),
    ),
    Case(
        "midtrain: a resume with another --from than the run started from",
        lambda t: (
            started_from(run_copy(t, unfinished=True), model()),
            ["midtrain", recipe(), t / "run", "--from", other_model(t), "--resume", "auto"],
            f"--from: {t / 'other'} is not the model {t / 'run'} started from ({model()})",
            t / "run",
        )[1:],
    ),
    Case(
        "midtrain: checkpoint with a missing weights file",
        lambda t: (["midtrain", recipe(), t / "run", "--from", model_missing_weights(t)], "model", t / "run"),
    ),
    Case(
        "pretrain: --resume of a save that never finished",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--resume", partial_checkpoint(t)],
            "is not a complete checkpoint",
            t / "run",
        ),
    ),
    Case(
        "pretrain: --resume of another run's checkpoint",
        lambda t: (
            ["pretrain", recipe(), t / "mine", "--resume", _SHARED["run"] / "checkpoints" / "step-0000001"],
            "is not a complete checkpoint of",
            t / "mine",
        ),
    ),
    Case(
        "pretrain: --resume auto with another model",
        lambda t: (
            [
                "pretrain",
                recipe(),
                run_copy(t, unfinished=True),
                "--resume",
                "auto",
                "--set",
                "training.steps=2",
                "--set",
                "model.hidden_size=64",
            ],
            "model.hidden_size: differs from the run being resumed",
            t / "run",
        ),
    ),
    Case(
        "pretrain: --resume auto on other data",
        lambda t: (
            [
                "pretrain",
                recipe(),
                run_copy(t, unfinished=True),
                "--resume",
                "auto",
                "--set",
                "training.steps=2",
                "--data",
                _SHARED["other-packed"],
            ],
            "holds other data than the folder the run was trained on",
            t / "run",
        ),
    ),
    Case(
        "export: a save that never finished",
        lambda t: (["export", partial_checkpoint(t), t / "out"], "is not a complete checkpoint", t / "out"),
    ),
    Case(
        "export: OUTPUT under a file",
        lambda t: (
            (t / "notes").write_text("x"),
            ["export", _SHARED["run"] / "checkpoints" / "step-0000002", t / "notes" / "out"],
            "notes: is a file, so ",
            None,
        )[1:],
    ),
    Case(
        "inspect: a checkpoint whose save never finished",
        lambda t: (["inspect", partial_checkpoint(t)], "is a training checkpoint whose save never finished", None),
    ),
    Case(
        "export: a run folder instead of one of its checkpoints",
        lambda t: (
            ["export", run_copy(t), t / "out"],
            "run is a training run folder — pass one of its checkpoints, e.g. ",
            t / "out",
        ),
    ),
    Case(
        "midtrain: --from a run that has no final model yet",
        lambda t: (
            ["midtrain", recipe(), t / "m", "--from", run_copy(t, unfinished=True)],
            "run is a training run folder without a final model yet — pass its newest checkpoint, ",
            t / "m",
        ),
    ),
    Case(
        "export: a model folder, not a checkpoint",
        lambda t: (
            ["export", _SHARED["run"] / "final", t / "out"],
            "is a model folder, not a training checkpoint",
            t / "out",
        ),
    ),
    Case(
        "export: output exists",
        lambda t: (
            ["export", _SHARED["run"] / "checkpoints" / "step-0000002", _existing_output(t)],
            "already exists and is not empty",
            t / "existing",
        ),
    ),
    Case(
        "report: run.json that is not JSON",
        lambda t: (["report", _edited_run(t, "run.json", "{bad")], "run.json: is not JSON", t / "run"),
    ),
    Case(
        "report: run.json that is a list",
        lambda t: (["report", _edited_run(t, "run.json", "[]")], "holds a JSON list, not an object", t / "run"),
    ),
    Case(
        "report: a metrics line whose step is not a number",
        lambda t: (
            ["report", _edited_run(t, "metrics.jsonl", '{"step": "abc", "loss": 5}\n{"step": 9, "loss": 5}\n')],
            "line 1: step is 'abc', not a whole number",
            t / "run",
        ),
    ),
    Case(
        "train-tokenizer: a negative --min-frequency",
        lambda t: (
            ["train-tokenizer", SAMPLE / "web", t / "tok", "--min-frequency", "-3"],
            "--min-frequency",
            t / "tok",
        ),
    ),
    Case(
        "merge: ties by flags without --base says --base, not the recipe key",
        lambda t: (
            ["merge", "--method", "ties", "--model", model(), "--model", _SHARED["narrow"], t / "out"],
            "ties needs a base model to take task vectors against — pass --base PATH",
            t / "out",
        ),
    ),
    Case(
        "merge: ties by flags without a density says --set options.density",
        lambda t: (
            [
                "merge",
                "--method",
                "ties",
                "--model",
                model(),
                "--model",
                _SHARED["narrow"],
                "--base",
                model(),
                t / "out",
            ],
            "has no density — pass --set options.density=0.5",
            t / "out",
        ),
    ),
    Case(
        "generate: OUTPUT inside the plain parquet folder of prompts",
        lambda t: (
            shutil.copytree(SAMPLE / "prompts", t / "prompts", ignore=shutil.ignore_patterns("manifest.json")),
            ["generate", t / "prompts", t / "prompts" / "gen", "--model", model(), "--limit", "1"],
            "prompts/gen: is inside the input ",
            t / "prompts",
        )[1:],
    ),
    Case(
        "merge: OUTPUT inside one of the models",
        lambda t: (
            ["merge", "--method", "linear", "--model", model(), "--model", other_model(t), t / "other" / "merged"],
            "merged: is inside the input ",
            t / "other",
        ),
    ),
    Case(
        "generate: --model a training checkpoint",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--model", _SHARED["run"] / "checkpoints" / "step-0000002"],
            "is a training checkpoint (model and optimizer state in DCP shards), not a model folder — export it first",
            t / "out",
        ),
    ),
    Case(
        "merge: a run that has no final model yet",
        lambda t: (
            ["merge", "--method", "linear", "--model", run_copy(t, unfinished=True), "--model", model(), t / "out"],
            "run is a training run folder without a final model yet — export one of its checkpoints first",
            t / "out",
        ),
    ),
    Case(
        "generate: --pairs of one model against itself",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--pairs", "--chosen", model(), "--rejected", model()],
            "--rejected: is the --chosen model",
            t / "out",
        ),
    ),
    Case(
        "merge: a dare_ties seed numpy cannot take",
        lambda t: (
            ["merge", "--method", "dare_ties", "--model", model(), "--model", _SHARED["narrow"], "--base", model()]
            + ["--set", "options.density=0.5", "--set", "options.seed=-1", t / "out"],
            "options.seed: must be >= 0, got -1",
            t / "out",
        ),
    ),
    Case(
        "export: a checkpoint shard damaged at its size",
        lambda t: (
            ["export", _damaged(t, "__0_0.distcp"), t / "out"],
            "__0_0.distcp differs from the sha256 it was saved with",
            t / "out",
        ),
    ),
    Case(
        "export: a shard damaged at its size, in a checkpoint whose manifest lists no digests",
        lambda t: (
            ["export", _damaged(t, "__0_0.distcp", digests=False), t / "out"],
            "cannot be read: UnpicklingError",
            t / "out",
        ),
    ),
    Case(
        "export: a checkpoint's config.json damaged at its size, no digests",
        lambda t: (
            ["export", _damaged(t, "config.json", digests=False), t / "out"],
            "cannot be read: JSONDecodeError",
            t / "out",
        ),
    ),
    Case(
        "export: a checkpoint's tokenizer damaged at its size, no digests",
        lambda t: (
            ["export", _damaged(t, "tokenizer.json", digests=False), t / "out"],
            "'s tokenizer cannot be read",
            t / "out",
        ),
    ),
    Case(
        "pretrain: resume with another number of rows a step",
        lambda t: (
            [
                "pretrain",
                recipe(),
                run_copy(t, unfinished=True),
                "--resume",
                "auto",
                "--set",
                "training.global_batch=4",
            ],
            "training.global_batch: the run trained 8 rows a step and this launch would train 4",
            t / "run",
        ),
    ),
    Case(
        "pretrain: resume from a checkpoint whose metadata is damaged",
        lambda t: (
            [
                "pretrain",
                recipe(),
                _damaged(t, ".metadata").parents[1],
                "--resume",
                "auto",
                "--set",
                "training.steps=3",
            ],
            "step-0000002: .metadata differs from the sha256 it was saved with",
            t / "run",
        ),
    ),
    Case(
        "export: --overwrite of the run folder that holds the checkpoint",
        lambda t: (
            ["export", run_copy(t) / "checkpoints" / "step-0000002", t / "run", "--overwrite"],
            "run: holds the input",
            t / "run",
        ),
    ),
    Case(
        "merge: --overwrite of the folder that holds the models",
        lambda t: (
            [
                "merge",
                "--method",
                "linear",
                "--model",
                _models_in(t)[0],
                "--model",
                _models_in(t)[1],
                t / "d",
                "--overwrite",
            ],
            "d: holds the input",
            t / "d",
        ),
    ),
    Case(
        "generate: --overwrite of the run folder whose model generates",
        lambda t: (
            ["generate", SAMPLE / "prompts", run_copy(t), "--model", t / "run", "--limit", "1", "--overwrite"],
            "run: holds the input",
            t / "run",
        ),
    ),
    Case(
        "pretrain: --overwrite of a run folder that holds its data",
        lambda t: (
            ["pretrain", recipe(), _run_holding_data(t), "--data", t / "run" / "packed", "--overwrite"],
            "run: holds the run's input",
            t / "run",
        ),
    ),
    Case(
        "sft: --overwrite of the run folder it starts from",
        lambda t: (
            ["sft", "recipes/sft-tiny.toml", run_copy(t), "--from", t / "run", "--overwrite"],
            "run: holds the run's input",
            t / "run",
        ),
    ),
    Case(
        "report: --html over a run's metrics",
        lambda t: (["report", run_copy(t), "--html", t / "run" / "metrics.jsonl"], "is not an .html file", t / "run"),
    ),
    Case(
        "report: --html over an existing report",
        lambda t: (
            (t / "r.html").write_text("kept"),
            ["report", _SHARED["run"], "--html", t / "r.html"],
            "r.html already exists — pass --overwrite",
            t,
        )[1:],
    ),
    # sft / dpo / ppo
    Case(
        "sft: data without messages",
        lambda t: (
            ["sft", "recipes/sft-tiny.toml", t / "run", "--from", model(), "--set", f'data.path="{SAMPLE / "math"}"'],
            "messages",
            t / "run",
        ),
    ),
    Case(
        "sft: --from is not a model",
        lambda t: (["sft", "recipes/sft-tiny.toml", t / "run", "--from", SAMPLE / "math"], "math", t / "run"),
    ),
    Case(
        "dpo: data without chosen/rejected",
        lambda t: (
            ["dpo", "recipes/dpo-tiny.toml", t / "run", "--from", model(), "--set", f'data.path="{SAMPLE / "chat"}"'],
            "chosen",
            t / "run",
        ),
    ),
    Case(
        "sft: a tool call the model's chat template does not render (it trained as an empty reply)",
        lambda t: (
            ["sft", "recipes/sft-tiny.toml", t / "run", "--from", model(), "--set", f'data.path="{_tool_calls(t)}"'],
            "tools.parquet: row 1 (from 0): column 'messages' turn 1 holds tool calls, which the model's chat "
            "template does not render",
            t / "run",
        ),
    ),
    Case(
        "sft: balance_by a column of lists",
        lambda t: (
            [
                "sft",
                "recipes/sft-tiny.toml",
                t / "run",
                "--from",
                model(),
                "--set",
                f'data.path="{_chat_with_list_tags(t)}"',
                "--set",
                'data.balance_by="tags"',
            ],
            "data.balance_by: column 'tags' holds list<element: string>, not categories to balance",
            t / "run",
        ),
    ),
    Case(
        "dpo: chosen holds a user turn after the prompt",
        lambda t: (
            ["dpo", "recipes/dpo-tiny.toml", t / "run", "--from", model(), "--set", f'data.path="{_pairs(t, "user")}"'],
            "pairs.parquet: row 0 (from 0): column 'chosen' holds a 'user' turn after the prompt",
            t / "run",
        ),
    ),
    Case(
        "dpo: no pair fits dpo.max_length (the run folder it began is taken away)",
        lambda t: (
            ["dpo", "recipes/dpo-tiny.toml", t / "run", "--from", model(), "--set", f'data.path="{_pairs(t, "long")}"']
            + ["--set", "dpo.max_length=16"],
            "no pair fits dpo.max_length 16",
            t / "run",
        ),
    ),
    Case(
        "ppo: a null reference (it scored 0 without a word)",
        lambda t: (
            [
                "ppo",
                "recipes/ppo-tiny.toml",
                t / "run",
                "--from",
                model(),
                "--set",
                "data.path="
                + f'"{parquet_with(t, "q.parquet", {"prompt": ["2+2?", "3+3?"], "reference": ["4", None]})}"',
            ],
            "q.parquet: row 1 (from 0): column 'reference' is null, not a reference to match",
            t / "run",
        ),
    ),
    Case(
        "ppo: reward callable that does not import",
        lambda t: (
            [
                "ppo",
                "recipes/ppo-tiny.toml",
                t / "run",
                "--from",
                model(),
                "--set",
                'rewards.0.match="callable"',
                "--set",
                'rewards.0.function="nowhere_module:score"',
            ],
            "nowhere_module",
            t / "run",
        ),
    ),
    Case(
        "sft: a key that moved names its new place",
        lambda t: (
            ["sft", "recipes/sft-tiny.toml", t / "run", "--from", model(), "--set", "checkpoint.every=5"],
            "checkpoint.every moved to checkpoint.interval",
            t / "run",
        ),
    ),
    Case(
        "dpo: the old lr key names optimizer.lr",
        lambda t: (
            ["dpo", "recipes/dpo-tiny.toml", t / "run", "--from", model(), "--set", "training.lr=1e-5"],
            "training.lr moved to optimizer.lr",
            t / "run",
        ),
    ),
    Case(
        "pretrain: a table only post-training reads",
        lambda t: (
            ["pretrain", recipe(), t / "run", "--set", "peft.r=8"],
            "[peft] is read by sft and dpo and ppo and grpo, not by pretrain",
            t / "run",
        ),
    ),
    Case(
        "ppo: the old algorithm switch names smolctl grpo",
        lambda t: (
            ["ppo", "recipes/ppo-tiny.toml", t / "run", "--from", model(), "--set", 'algorithm="grpo"'],
            "algorithm moved to its own command: smolctl grpo",
            t / "run",
        ),
    ),
    Case(
        "grpo: completions per step not whole groups",
        lambda t: (
            ["grpo", "recipes/grpo-tiny.toml", t / "run", "--from", model(), "--set", "grpo.num_generations=3"],
            "grpo.num_generations",
            t / "run",
        ),
    ),
    Case(
        "sft: architecture keys in post-training",
        lambda t: (
            ["sft", "recipes/sft-tiny.toml", t / "run", "--from", model(), "--set", "model.hidden_size=64"],
            "keeps the starting checkpoint's architecture",
            t / "run",
        ),
    ),
    Case(
        "ppo: reward key its kind ignores",
        lambda t: (
            ["ppo", "recipes/ppo-tiny.toml", t / "run", "--from", model(), "--set", 'rewards.1.function="m:f"'],
            "rewards[1]: function is only used",
            t / "run",
        ),
    ),
    # merge / generate
    Case(
        "merge: missing parent",
        lambda t: (
            ["merge", "--method", "linear", "--model", f"{model()}:0.5", "--model", f"{t / 'gone'}:0.5", t / "out"],
            "parent " + str(t / "gone") + " does not exist",
            t / "out",
        ),
    ),
    Case(
        "merge: linear weights do not sum to 1",
        lambda t: (
            [
                "merge",
                "--method",
                "linear",
                "--model",
                f"{model()}:0.9",
                "--model",
                f"{other('narrow')}:0.2",
                t / "out",
            ],
            "sum to 1.1",
            t / "out",
        ),
    ),
    Case(
        "merge: architectures differ",
        lambda t: (
            ["merge", "--method", "linear", "--model", model(), "--model", other("narrow"), t / "out"],
            "differ in tensor",
            t / "out",
        ),
    ),
    Case(
        "merge: vocabularies differ",
        lambda t: (
            ["merge", "--method", "slerp", "--model", model(), "--model", other("big-vocab"), t / "out"],
            "vocabulary of 2112 tokens",
            t / "out",
        ),
    ),
    Case(
        "merge: slerp of three models",
        lambda t: (
            [
                "merge",
                "--method",
                "slerp",
                "--model",
                model(),
                "--model",
                other("narrow"),
                "--model",
                other("big-vocab"),
                t / "out",
            ],
            "exactly two models, not 3",
            t / "out",
        ),
    ),
    Case(
        "merge: option the method ignores",
        lambda t: (
            [
                "merge",
                "--method",
                "linear",
                "--model",
                model(),
                "--model",
                other("narrow"),
                "--set",
                "options.t=0.5",
                t / "out",
            ],
            "t is not used by linear",
            t / "out",
        ),
    ),
    Case(
        "generate: --pairs without --rejected",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--pairs", "--chosen", model()],
            "--pairs: takes --chosen STRONG and --rejected WEAK",
            t / "out",
        ),
    ),
    Case(
        "generate: prompt column missing",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--model", model(), "--prompt-column", "question"],
            "no column 'question'",
            t / "out",
        ),
    ),
    Case(
        "generate: greedy with K completions",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--model", model(), "--temperature", "0", "-k", "2"],
            "greedy",
            t / "out",
        ),
    ),
    Case(
        "generate: --rank-by a recipe without rewards",
        lambda t: (
            [
                "generate",
                SAMPLE / "prompts",
                t / "out",
                "--model",
                model(),
                "-k",
                "2",
                "--rank-by",
                "recipes/dpo-tiny.toml",
            ],
            "has no rewards tables",
            t / "out",
        ),
    ),
    Case(
        "generate: --rank-by with one completion",
        lambda t: (
            ["generate", SAMPLE / "prompts", t / "out", "--model", model(), "--rank-by", "recipes/ppo-tiny.toml"],
            "at least 2 completions",
            t / "out",
        ),
    ),
    Case(
        "generate: --model is a dataset",
        lambda t: (["generate", SAMPLE / "prompts", t / "out", "--model", SAMPLE / "math"], "math", t / "out"),
    ),
    Case(
        "mix: unknown stage order",
        lambda t: (
            ["mix", t / "out", "--recipe", "recipes/demo-mix.toml", "--set", 'stages.0.order="hardest-first"'],
            "'hardest-first' is not an order",
            t / "out",
        ),
    ),
    # estimate / cluster checks
    Case("estimate: unknown model", lambda t: (["estimate", "--model", "gpt-17"], "smollm3-3b", None)),
    Case(
        "estimate: a serving option without --inference",
        lambda t: (
            ["estimate", "--model", "smollm3-3b", "--context", "4096"],
            "--context: sizes serving, which only",
            None,
        ),
    ),
    Case("estimate: unknown gpu", lambda t: (["estimate", "--model", "smollm3-3b", "--gpu", "h900"], "h100", None)),
    Case(
        "estimate: layout does not match --gpus",
        lambda t: (["estimate", "--model", "smollm3-3b", "--gpus", "10", "--tp", "4"], "--gpus", None),
    ),
    Case(
        "estimate: TP does not divide the heads",
        lambda t: (["estimate", "--model", "smollm3-3b", "--gpus", "12", "--tp", "3"], "heads", None),
    ),
    Case(
        "estimate: unparsable token count",
        lambda t: (["estimate", "--model", "smollm3-3b", "--tokens", "eleven"], "eleven", None),
    ),
    Case(
        "stress-gpu: memory fraction outside (0,1)",
        lambda t: (["stress-gpu", "--memory-fraction", "1.5"], "--memory-fraction", None),
    ),
    Case("stress-gpu: unknown dtype", lambda t: (["stress-gpu", "--dtype", "fp12"], "fp12", None)),
    Case(
        "stress-gpu: cpu in a list of GPUs",
        lambda t: (["stress-gpu", "--devices", "cpu,0"], "--devices: cpu stands alone, not in a list (cpu,0)", None),
    ),
    Case("benchmark-nccl: one process", lambda t: (["benchmark-nccl"], "torchrun", None)),
    Case(
        "benchmark-nccl: threshold for an op not run",
        lambda t: (["benchmark-nccl", "--ops", "all_reduce", "--expect-busbw", "all_to_all=40"], "all_to_all", None),
    ),
    Case(
        "estimate: unknown --find framework",
        lambda t: (["estimate", "--model", "smollm3-3b", "--framework", "deepspeed"], "--framework", None),
    ),
    Case(
        "stress-gpu: --expect-tflops not a rate",
        lambda t: (["stress-gpu", "--expect-tflops", "0"], "--expect-tflops", None),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path: Path):
    argv, needle, output = case.setup(tmp_path)
    before = snapshot(output)
    result = run_cli(*argv, env=case.env)
    lines = result.stderr.splitlines()  # not an empty line either (a progress bar stopped off a terminal)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert snapshot(output) == before, "the output folder must be absent or unchanged"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["export", "CKPT", "", "--overwrite"], "argument 3 (after CKPT) is empty"),
        (["export", "CKPT", "--overwrite", ""], "argument 4 (after --overwrite) is empty"),
        (["dedup", "IN", "o", "--text-column="], "--text-column is given an empty value"),
    ],
)
def test_an_empty_argument_is_refused_before_it_can_mean_the_working_folder(tmp_path, argv, message):
    """`smolctl export CKPT "$OUT" --overwrite` with OUT unset replaced the working folder with the export (a
    repository, in the run that found it). Run from a scratch folder: broken, this test replaces only that."""
    (tmp_path / "kept.txt").write_text("kept")
    paths = {"CKPT": str(_SHARED["run"] / "checkpoints" / "step-0000002"), "IN": str(SAMPLE / "math")}
    result = run_cli(*[paths.get(a, a) for a in argv], cwd=tmp_path)
    command, message = argv[0], message.replace("CKPT", paths["CKPT"])
    assert result.stderr.strip() == f"error: smolctl {command}: {message} (an unset shell variable?) — give it a value"
    assert result.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=320k"):
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def test_full_disk_stops_with_a_clear_error_and_keeps_the_earlier_output(small_disk):
    earlier = small_disk / "out"
    shutil.copytree(SAMPLE / "math", earlier)
    before = snapshot(earlier)
    result = run_cli("train-tokenizer", SAMPLE / "web", earlier, "--vocab-size", "8192", "--overwrite")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("reading")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("error: ") and "No space left on device" in lines[-1]
    assert snapshot(earlier) == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["out"], "no staging folder is left behind"


def test_a_full_disk_keeps_the_finished_units_for_the_run_after_the_fix(tmp_path):
    """dedup onto a disk that fills up after the signatures stage: one line naming the output, no half-written
    work file left, and the finished units kept (bad input discards them; a full disk must not), so that the same
    command resumes once there is room and writes the bytes a run with room writes."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=1100k"):
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        argv = ["dedup", SAMPLE / "web", disk / "out", "--minhash"]
        full = run_cli(*argv)
        line = full.stderr.strip()
        assert full.returncode == 2 and "No space left on device" in line and len(line.splitlines()) == 1, line
        assert line.startswith(f"error: {disk / 'out'}"), line
        assert not [p for p in disk.rglob("*") if ".tmp-" in p.name]
        assert list((disk / "out" / "_work").glob("*/signatures/*.done")), "finished units are kept"
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        resumed = run_cli(*argv, "--json")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["units_skipped"] > 0
        assert run_cli("dedup", SAMPLE / "web", tmp_path / "roomy", "--minhash").returncode == 0
        for shard in ("part-00000.parquet", "duplicates/part-00000.parquet"):
            assert (disk / "out" / shard).read_bytes() == (tmp_path / "roomy" / shard).read_bytes()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_full_disk_under_the_worker_pool_keeps_the_finished_units_too(tmp_path, monkeypatch):
    """The same with the stages in pool processes (the default on real inputs): a worker's refused write comes
    back to the parent as one, not as bad input, so the finished units are not discarded."""
    from smolctl.data.dedup import DedupConfig, run
    from smolctl.data.minhash.params import MinHashParams
    from smolctl.errors import WriteRefused

    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=700k"):  # full in the signatures stage
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        monkeypatch.setattr("smolctl.data.dedup.POOL_MIN_DOCUMENTS", 0)
        config = DedupConfig(input=str(SAMPLE / "web"), output=str(disk / "out"), minhash=MinHashParams())
        with pytest.raises(WriteRefused, match="cannot write: No space left on device"):
            run(config, workers=2)
        assert list((disk / "out" / "_work").glob("*/config.json")), "the work area is kept"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_refused_write_without_a_file_name_names_the_output():
    import errno

    from smolctl.errors import environment_error, writing_to

    writing_to(None)
    writing_to(Path("/data/out"))
    writing_to(Path("/data/out/_work/run/pack/00003"))  # a folder the command makes inside its output
    assert environment_error(OSError(errno.ENOSPC, "No space left on device")).startswith(
        "/data/out: No space left on device — free some space"
    )
    writing_to(None)


def test_read_only_output_folder(tmp_path):
    readonly = tmp_path / "ro"
    if not _mount_tmpfs(readonly, "ro,size=64k"):
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        result = run_cli("train-tokenizer", SAMPLE / "math", readonly / "tok")
        assert result.returncode == 2 and result.stderr.startswith("error: ") and "is not writable" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    finally:
        subprocess.run(["umount", str(readonly)], check=False)


def test_inspect_verify_of_a_run_checks_its_checkpoints_beside_its_final_model(tmp_path):
    """A run is copied and resumed whole: `inspect RUN --verify` showed final/ and checked only it, so a checkpoint
    flipped at its size passed."""
    run = run_copy(tmp_path)
    shard = run / "checkpoints" / "step-0000001" / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    shard.write_bytes(damaged)
    result = run_cli("inspect", run, "--verify", "--json", "--samples", "0")
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)
    assert found["kind"] == "model" and found["verified"] is False
    assert [Path(f).relative_to(run).as_posix() for f in found["verified_folders"]] == [
        "final",
        "checkpoints/step-0000001",
        "checkpoints/step-0000002",
    ]
    assert found["problems"] == [f"{shard}: sha256 differs from the manifest"]
    # a step-N folder that lost its manifest is passed over by listings and resumes alike: --verify names it
    (run / "checkpoints" / "step-0000002" / "manifest.json").unlink()
    found = json.loads(run_cli("inspect", run, "--verify", "--json", "--samples", "0").stdout)
    assert found["problems"][-1].startswith(f"{run / 'checkpoints' / 'step-0000002'}: no manifest.json")


def test_export_merge_and_generate_refuse_an_output_another_run_is_writing(tmp_path):
    """Data stages and training held their output's lock; these three did not, and two runs into one OUTPUT mixed
    shards of both models under one model's manifest, or replaced each other, all exiting 0."""
    from smolctl.folder_lock import held_alone

    out = tmp_path / "out"
    commands = [
        ["export", run_copy(tmp_path) / "checkpoints" / "step-0000002", out],
        ["merge", "--method", "linear", "--model", model(), "--model", other_model(tmp_path), out],
        ["generate", SAMPLE / "prompts", out, "--model", model(), "--limit", "1"],
    ]
    with held_alone(out, "written", "wait"):  # the first run, still writing
        for command in commands:
            done = run_cli(*command)
            assert done.returncode == 2 and f"{out}: is being written by another smolctl run" in done.stderr, (
                done.stderr
            )
    assert not out.exists()


def test_the_folder_the_shell_is_in_is_never_an_output(tmp_path, monkeypatch):
    """An output is put in place whole: `smolctl merge ... .` swapped the folder out from under the shell."""
    from smolctl.errors import UserError
    from smolctl.shards import refuse_working_folder

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(UserError, match="is the folder you are in"):
        refuse_working_folder(Path("."))
    with pytest.raises(UserError, match="holds the folder you are in"):
        refuse_working_folder(tmp_path)
    refuse_working_folder(Path("out"))  # a new folder inside it is fine
    done = run_cli("merge", "--method", "linear", "--model", model(), "--model", other_model(tmp_path), ".", cwd=here)
    assert done.returncode == 2 and "here: is the folder you are in" in done.stderr


def test_inspect_of_a_model_folder_another_tool_wrote_shows_its_config(tmp_path):
    """save_pretrained's folders, hub downloads and TRL checkpoints have no manifest: inspect told the user to
    convert config.json to parquet."""
    folder = Path(shutil.copytree(model(), tmp_path / "hf"))
    (folder / "manifest.json").unlink()
    found = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert found["kind"] == "model (no manifest)" and found["stats"]["model_type"] == "smollm3"
    assert "model.safetensors" in found["files"] and found["stats"]["tokenizer"] is True
    verify = run_cli("inspect", folder, "--verify")
    assert verify.returncode == 2 and "has no manifest.json to verify against" in verify.stderr
    lineage = run_cli("inspect", folder, "--lineage")
    assert lineage.returncode == 2 and "has no manifest.json, which is where lineage is recorded" in lineage.stderr


def test_inspect_of_a_tokenizer_folder_another_tool_wrote_shows_what_pack_takes_from_it(tmp_path):
    """A hub download or save_pretrained's tokenizer folder has no manifest: inspect told the user to convert
    tokenizer.json to parquet."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    tokenizer = AutoTokenizer.from_pretrained(str(model()))
    tokenizer.save_pretrained(str(folder))
    found = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert found["kind"] == "tokenizer (no manifest)" and "tokenizer.json" in found["files"]
    assert found["stats"]["eos_token"] == f"{tokenizer.eos_token} ({tokenizer.eos_token_id})"
    assert found["stats"]["vocab_size"] == len(tokenizer) and found["stats"]["chat_template"] is True
