"""The bad-input catalogue: every case runs the real CLI in a subprocess and must end with exit code 2, one line
`error: ...` that names the offending file/key/row, no traceback, and an output folder absent or unchanged."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import SAMPLE, run_cli


@dataclass
class Case:
    name: str
    # Given a scratch folder, prepare inputs and return (argv, text the message must contain, output folder).
    setup: Callable[[Path], tuple[list, str, Path | None]]


def snapshot(folder: Path | None) -> dict[str, str] | None:
    if folder is None or not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def corrupt_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    shard = sorted(p for p in dst.iterdir() if p.name.startswith("part-"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if how == "truncate" else data[:100] + bytes(b ^ 0xFF for b in data[100:400]) + data[400:])
    return shard


def parquet_with(tmp: Path, name: str, columns: dict) -> Path:
    path = tmp / name
    pq.write_table(pa.table(columns), path)
    return path


def _tok(tmp: Path) -> Path:
    return _SHARED["tokenizer"]


_SHARED: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def shared_tokenizer(tokenizer_dir):
    _SHARED["tokenizer"] = tokenizer_dir


def _existing_output(tmp: Path) -> Path:
    out = tmp / "existing"
    shutil.copytree(SAMPLE / "math", out)
    return out


CASES = [
    Case("inspect: missing path", lambda t: (["inspect", t / "nope"], "no such file or folder", None)),
    Case("inspect: empty folder", lambda t: ((t / "empty").mkdir(), ["inspect", t / "empty"], "holds no parquet files", None)[1:]),
    Case("inspect: text file named .parquet", lambda t: ((t / "x.parquet").write_text("hi"), ["inspect", t / "x.parquet"], "x.parquet", None)[1:]),
    Case("inspect: truncated shard", lambda t: (["inspect", corrupt_copy(SAMPLE / "math", t / "m", "truncate")], "part-00000.parquet", None)),
    Case("inspect: corrupt manifest json", lambda t: (shutil.copytree(SAMPLE / "math", t / "m"), (t / "m" / "manifest.json").write_text("{oops"),
                                                    ["inspect", t / "m"], "manifest.json: is not valid JSON", None)[2:]),
    Case("inspect: shard listed in manifest is missing", lambda t: (shutil.copytree(SAMPLE / "math", t / "m"), (t / "m" / "part-00001.parquet").unlink(),
                                                                  ["inspect", t / "m"], "part-00001.parquet: is listed in the manifest but missing", None)[2:]),
    Case("train-tokenizer: missing text column", lambda t: (["train-tokenizer", parquet_with(t, "a.parquet", {"body": ["x" * 50]}), t / "out"], "no column 'text' (columns: body)", t / "out")),
    Case("train-tokenizer: text column of ints", lambda t: (["train-tokenizer", parquet_with(t, "a.parquet", {"text": [1, 2]}), t / "out"], "column 'text' holds int64, not text", t / "out")),
    Case("train-tokenizer: zero vocab", lambda t: (["train-tokenizer", SAMPLE / "math", t / "out", "--vocab-size", "0"], "--vocab-size: 0 is too small", t / "out")),
    Case("train-tokenizer: output exists", lambda t: (["train-tokenizer", SAMPLE / "math", _existing_output(t)], "already exists and is not empty", t / "existing")),
    Case("train-tokenizer: output is a file", lambda t: ((t / "f").write_text("x"), ["train-tokenizer", SAMPLE / "math", t / "f"], "exists and is a file", t / "f")[1:]),
    Case("train-tokenizer: glob matches nothing", lambda t: (["train-tokenizer", str(t / "*.parquet"), t / "out"], "the pattern matches no files", t / "out")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path: Path):
    argv, needle, output = case.setup(tmp_path)
    before = snapshot(output)
    result = run_cli(*argv)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert snapshot(output) == before, "the output folder must be absent or unchanged"


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0


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
