"""The file contract: round trips, atomicity under failure, overwrite refusal, foreign parquet, checksums."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from smolctl.errors import UserError
from smolctl.shards import (
    KIND_DOCUMENTS,
    KIND_PACKED,
    MANIFEST_NAME,
    DatasetWriter,
    OutputFolder,
    PackedWriter,
    open_documents,
    open_packed,
    read_manifest,
    schema_to_dict,
    verify_checksums,
)


def _table(n: int, start: int = 0) -> pa.Table:
    return pa.table(
        {
            "id": [f"doc-{i}" for i in range(start, start + n)],
            "text": [f"document number {i} " * (1 + i % 7) for i in range(start, start + n)],
        }
    )


def _write(path, n=250, shard_rows=100, overwrite=False):
    with OutputFolder(path, kind=KIND_DOCUMENTS, overwrite=overwrite) as folder:
        writer = DatasetWriter(folder, shard_rows=shard_rows)
        for start in range(0, n, 60):
            writer.write(_table(min(60, n - start), start))
        schema = writer.close()
        return folder.commit(schema=schema_to_dict(schema), stats={"note": "test"})


def test_round_trip_rolls_shards_and_records_manifest(tmp_path):
    out = tmp_path / "ds"
    manifest = _write(out)
    assert [s["rows"] for s in manifest["shards"]] == [100, 100, 50]
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST_NAME,
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert manifest["rows"] == 250 and manifest["schema"] == {"id": "string", "text": "string"}
    source = open_documents(out)
    rows = [r for b in source.iter_batches() for r in b.to_pylist()]
    assert rows == _table(250).to_pylist()
    assert not list(tmp_path.glob(".*")), "no staging folder is left behind"
    assert verify_checksums(out) == []


def test_byte_limit_rolls_shards(tmp_path):
    with OutputFolder(tmp_path / "ds", kind=KIND_DOCUMENTS) as folder:
        writer = DatasetWriter(folder, shard_bytes=4000, shard_rows=None)
        writer.write(_table(300))
        writer.close()
        manifest = folder.commit()
    assert len(manifest["shards"]) > 2 and manifest["rows"] == 300


def test_exception_mid_shard_leaves_nothing(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError), OutputFolder(out, kind=KIND_DOCUMENTS) as folder:
        writer = DatasetWriter(folder, shard_rows=100)
        writer.write(_table(150))
        raise RuntimeError("killed mid-shard")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_earlier_output(tmp_path):
    out = tmp_path / "ds"
    before = _write(out)
    with pytest.raises(RuntimeError), OutputFolder(out, kind=KIND_DOCUMENTS, overwrite=True) as folder:
        DatasetWriter(folder, shard_rows=10).write(_table(50))
        raise RuntimeError("disk full")
    assert read_manifest(out)["shards"] == before["shards"]
    assert verify_checksums(out) == []


def test_an_output_that_is_a_link_is_written_where_it_points_and_stays_a_link(tmp_path):
    """`out -> /scratch/...` on a cluster: the data goes to the link's target, the link stays, nothing is left
    beside either (a swap of the link itself moved it aside and made a local folder in its place)."""
    (tmp_path / "scratch" / "ds").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    link = tmp_path / "home" / "out"
    link.symlink_to(tmp_path / "scratch" / "ds")
    _write(link, n=50)
    _write(link, n=120, overwrite=True)
    assert link.is_symlink() and link.resolve() == tmp_path / "scratch" / "ds"
    assert read_manifest(tmp_path / "scratch" / "ds")["rows"] == 120
    assert verify_checksums(link) == []
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["ds"]


def test_a_command_with_a_work_area_writes_through_a_link_and_refuses_bad_input_in_one_line(tmp_path):
    """dedup, mix and pack keep their work area in OUTPUT/_work: made where the link points too, and cleared from
    there when the input turns out bad (rmdir of the link itself was an internal error)."""
    raw = [b"one two three", b"caf\xc3"]
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary()).view(pa.string())}), tmp_path / "bad.parquet")
    pq.write_table(pa.table({"text": ["one two three", "one two three", "four"]}), tmp_path / "good.parquet")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "scratch" / "dd")  # not made yet
    result = run_cli("dedup", tmp_path / "bad.parquet", tmp_path / "out", "--workers", "1")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "not UTF-8" in result.stderr and (tmp_path / "out").is_symlink()
    result = run_cli("dedup", tmp_path / "good.parquet", tmp_path / "out", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out").is_symlink() and open_documents(tmp_path / "scratch" / "dd").num_rows == 2
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["dd"]


def test_sigkill_mid_write_never_leaves_a_complete_looking_folder(tmp_path):
    out = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from test_shards import _table
        from smolctl.shards import OutputFolder, DatasetWriter, KIND_DOCUMENTS
        folder = OutputFolder({str(out)!r}, kind=KIND_DOCUMENTS)
        writer = DatasetWriter(folder, shard_rows=50)
        writer.write(_table(120))
        print("written", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the output only appears when complete"
    assert (tmp_path / ".ds.partial").is_dir()
    manifest = _write(out)  # a re-run clears the stale staging folder and finishes
    assert manifest["rows"] == 250 and not (tmp_path / ".ds.partial").exists()


def test_an_output_folder_the_disk_refuses_is_a_refused_write(tmp_path, monkeypatch):
    """Not bad input: a plain run keeps its finished units for the run after the fix (a disk full at commit)."""
    import errno
    from pathlib import Path

    from smolctl.errors import WriteRefused

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(WriteRefused, match="cannot create the output folder: No space left on device"):
        OutputFolder(tmp_path / "out", kind=KIND_DOCUMENTS)


def test_overwrite_is_refused_without_the_flag(tmp_path):
    out = tmp_path / "ds"
    _write(out)
    with pytest.raises(UserError, match="--overwrite"):
        _write(out)
    assert _write(out, n=20, overwrite=True)["rows"] == 20
    assert len(open_documents(out).files) == 1


def _partitioned(folder, rows: dict[str, list[str]]) -> None:
    """A Hive-partitioned folder as Spark and pyarrow write it: one file per `key=value/...` folder."""
    for where, texts in rows.items():
        (folder / where).mkdir(parents=True)
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), folder / where / "part-0.parquet")


def test_hive_partition_values_are_read_as_columns_typed_as_pyarrow_types_them(tmp_path):
    import pyarrow.dataset as ds

    folder = tmp_path / "in"
    _partitioned(
        folder,
        {
            "year=2021/lang=en": ["a", "b"],
            "year=2021/lang=a%2Fb%20c%25": ["c"],  # Spark's escaping of "a/b c%"
            "year=__HIVE_DEFAULT_PARTITION__/lang=fr": ["d", "e", "f"],
            "year=07/lang=de": [],
        },
    )
    (folder / "_SUCCESS").touch()
    source = open_documents(folder)
    expected = ds.dataset(folder, partitioning="hive", exclude_invalid_files=True).to_table()
    assert source.schema == expected.schema
    read = pa.Table.from_batches(source.iter_batches(), schema=source.schema)
    assert sorted(read.to_pylist(), key=str) == sorted(expected.to_pylist(), key=str)
    assert {"text": "c", "year": 2021, "lang": "a/b c%"} in read.to_pylist()
    # A glob's partition folders start after its leading folders without wildcards, as pyarrow's base dir.
    for pattern in (folder / "*" / "*" / "*.parquet", folder / "**" / "*.parquet"):
        assert open_documents(str(pattern)).schema == expected.schema
    assert open_documents(str(folder / "year=2021" / "*" / "*.parquet")).schema.names == ["text", "lang"]
    # Any subset, in the order asked; a file's own column is taken for one its folder also names.
    batch = next(
        source.iter_file_batches(source.files.index(folder / "year=2021/lang=en/part-0.parquet"), ["lang", "text"])
    )
    assert batch.to_pylist() == [{"lang": "en", "text": "a"}, {"lang": "en", "text": "b"}]
    own = tmp_path / "own" / "lang=en"
    own.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["g"], "lang": ["own"]}), own / "part-0.parquet")
    assert pa.Table.from_batches(open_documents(tmp_path / "own").iter_batches()).to_pylist() == [
        {"text": "g", "lang": "own"}
    ]


def test_files_under_different_partition_keys_are_refused_in_one_line(tmp_path):
    _partitioned(tmp_path / "in", {"lang=en": ["a"], "year=2021": ["b"]})
    with pytest.raises(UserError, match="partitioned by lang in one place and by year at year=2021"):
        open_documents(tmp_path / "in")
    _partitioned(tmp_path / "in2", {"lang=en": ["a"], "plain": ["b"]})
    with pytest.raises(UserError, match="by nothing at plain"):
        open_documents(tmp_path / "in2")


def test_missing_column_names_the_existing_ones(tmp_path):
    _write(tmp_path / "ds")
    source = open_documents(tmp_path / "ds")
    with pytest.raises(UserError, match=r"no column 'content' \(columns: id, text\)"):
        source.require(text=["content"])
    with pytest.raises(UserError, match="holds int64, not text"):
        pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
        open_documents(tmp_path / "ints.parquet").require(text=["text"])
    # Read as large_binary, a name the file's writer never used: named as what it holds.
    pq.write_table(pa.table({"text": pa.array([b"a"], pa.binary_view())}), tmp_path / "view.parquet")
    with pytest.raises(UserError, match="column 'text' holds bytes, not text"):
        open_documents(tmp_path / "view.parquet").require(text=["text"])


def test_reads_foreign_parquet_folders_files_and_globs(tmp_path):
    spark = tmp_path / "spark"
    (spark / "lang=en").mkdir(parents=True)
    pq.write_table(_table(30), spark / "lang=en" / "c000.snappy.parquet")
    pq.write_table(_table(20, 30), spark / "lang=en" / "c001.snappy.parquet")
    (spark / "_SUCCESS").write_text("")
    (spark / ".hidden.parquet").write_text("not parquet")
    assert open_documents(spark).num_rows == 50
    assert open_documents(spark / "lang=en" / "c001.snappy.parquet").num_rows == 20
    assert open_documents(str(spark / "**" / "*.parquet")).num_rows == 50
    assert open_documents(str(spark / "lang=en" / "c00[01].snappy.parquet")).num_rows == 50


def test_a_quoted_glob_under_home_is_read_as_the_shell_would_expand_it(tmp_path, monkeypatch):
    """A glob must be quoted to reach smolctl whole, and quoted, the shell leaves its `~` alone."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "crawl").mkdir(parents=True)
    pq.write_table(_table(30), tmp_path / "home" / "crawl" / "a.parquet")
    monkeypatch.chdir(tmp_path)
    source = open_documents("~/crawl/*.parquet")
    assert source.num_rows == 30 and source.spec == str(tmp_path / "home" / "crawl" / "*.parquet")
    assert open_documents("~/crawl").num_rows == 30
    from smolctl.inspect import inspect_path

    assert inspect_path("~/crawl").rows == 30
    (tmp_path / "~").mkdir()  # a folder named ~ where the command runs: read as written
    pq.write_table(_table(5), tmp_path / "~" / "b.parquet")
    assert open_documents("~").num_rows == 5


def test_bytes_that_are_not_utf8_are_named_by_their_row_in_the_file_not_in_the_batch(tmp_path):
    raw = [f"document {i}".encode() for i in range(10)]
    raw[7] = b"caf\xc3"
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary()).view(pa.string())}), tmp_path / "a.parquet")
    source = open_documents(tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a\.parquet: row 7 \(from 0\): column 'text' holds bytes that are not UTF-8"):
        list(source.iter_file_batches(0, batch_size=3))  # the second row of the third batch
    assert len(list(source.iter_file_batches(0, batch_size=3, validated=["text"]))) == 4  # checked before: not again


def test_bytes_that_are_not_utf8_inside_a_list_column_are_named_by_their_row(tmp_path):
    """A slice of a list array keeps every value of its child, so checking prefixes of it finds row 0."""
    raw = [f"tag {i}".encode() for i in range(10)]
    raw[8] = b"caf\xc3"
    tags = pa.ListArray.from_arrays(pa.array(range(11), pa.int32()), pa.array(raw, pa.binary()).view(pa.string()))
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(10)], "tags": tags}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a\.parquet: row 8 \(from 0\): column 'tags' holds bytes that are not UTF-8"):
        list(open_documents(tmp_path / "a.parquet").iter_file_batches(0))


def test_a_folder_holding_another_tools_manifest_is_read_as_a_plain_folder(tmp_path):
    """A manifest.json with none of smolctl's keys (a dataset card, a list) is another tool's: the folder's
    parquet files are read. One that holds a smolctl key but no kind is a damaged smolctl manifest, refused."""
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(_table(5), data / "train-00000-of-00001.parquet")
    for foreign in (
        {"dataset": "web", "splits": ["train"]},
        [1, 2],
        "card",
        {"kind": "dataset"},
        {"format_version": 1},
    ):
        (data / "manifest.json").write_text(json.dumps(foreign))
        source = open_documents(data)
        assert source.num_rows == 5 and source.manifest is None
    (data / "manifest.json").write_text(json.dumps({"smolctl_version": "0.1.0", "shards": []}))
    with pytest.raises(UserError, match="is not a smolctl manifest"):
        open_documents(data)


def test_folders_read_upper_case_parquet_and_symlinked_folders_once(tmp_path):
    """Files named PART-2.PARQUET, and shards behind a symlinked folder (lang=de -> elsewhere), are part of the
    dataset; a link back up the tree is not followed round, and hidden or underscore entries stay out."""
    data = tmp_path / "data"
    (data / "lang=en").mkdir(parents=True)
    (data / "lang=fr").mkdir()
    (data / ".cache").mkdir()
    (tmp_path / "elsewhere").mkdir()
    pq.write_table(_table(3), data / "lang=en" / "part-0.parquet")
    pq.write_table(_table(4, 3), data / "lang=fr" / "PART-2.PARQUET")
    pq.write_table(_table(1, 7), data / "lang=fr" / "part-3.Parquet")
    pq.write_table(_table(6, 8), tmp_path / "elsewhere" / "part-5.parquet")
    pq.write_table(_table(9), data / ".cache" / "stale.parquet")
    (data / "lang=de").symlink_to(tmp_path / "elsewhere")
    (data / "lang=en" / "up").symlink_to(data)
    source = open_documents(data)
    assert source.num_rows == 14 and len(source.files) == 4
    ids = [i for batch in source.iter_batches(["id"]) for i in batch.column(0).to_pylist()]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(14))


def test_a_shard_linked_to_nothing_is_refused_not_skipped(tmp_path):
    """A folder of links to shards on a file system that is not mounted read as the shards still there: a
    smaller input, silently. Named in one line, in a folder and through a glob; a link that works is read."""
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(_table(3), tmp_path / "real.parquet")
    (data / "part-0.parquet").symlink_to(tmp_path / "real.parquet")
    assert open_documents(data).num_rows == 3
    (data / "part-1.parquet").symlink_to(tmp_path / "unmounted" / "part-1.parquet")
    for spec in (data, f"{data}/*.parquet"):
        with pytest.raises(
            UserError, match=r"part-1\.parquet: is a link to .*unmounted/part-1\.parquet, which does not"
        ):
            open_documents(spec)


def test_a_folder_of_smolctl_datasets_is_refused_with_the_ones_to_pass(tmp_path, sample):
    """dedup per source leaves OUTPUT/web, OUTPUT/code..., each with its removal report in duplicates/: read as one
    plain folder, the reports' rows failed as a schema mismatch with advice to change the shards. A tokenizer or
    another tool's manifest.json among plain shards changes nothing."""
    import shutil

    for name in ("web", "math"):
        shutil.copytree(sample / name, tmp_path / "dedup" / name)
    with pytest.raises(UserError, match=r"holds smolctl folders \(math, web\), each a dataset of its own — pass one"):
        open_documents(tmp_path / "dedup")
    plain = tmp_path / "plain"
    (plain / "other").mkdir(parents=True)
    pq.write_table(_table(3), plain / "part-0.parquet")
    (plain / "other" / "manifest.json").write_text("{not json")
    assert open_documents(plain).num_rows == 3


def test_relative_paths_whose_first_folder_looks_like_a_uri_scheme_are_local(tmp_path, tokenizer_dir):
    """Arrow reads `run:1/docs.parquet` as a URI of scheme `run`; as input and as output it is a local folder."""
    (tmp_path / "run:1").mkdir()
    pq.write_table(_table(40), tmp_path / "run:1" / "docs.parquet")
    for argv in (
        ["dedup", "run:1", "dedup:out", "--minhash"],
        ["mix", "mix:out", "--source", "a=run:1:1", "--documents", "10"],
        ["pack", "run:1", "pack:out", "--tokenizer", tokenizer_dir, "--seq-len", "64"],
    ):
        result = run_cli(*argv, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    assert open_documents(tmp_path / "dedup:out").num_rows == 40
    assert open_documents(tmp_path / "mix:out").num_rows >= 10
    assert open_packed(tmp_path / "pack:out").manifest["tokens"] > 40


@pytest.mark.parametrize(
    "other, message",
    [
        ({"id": ["x"], "text": [1]}, "holds text as int64 where a.parquet has string"),
        ({"id": ["x"], "text": ["t"], "lang": ["de"]}, "has lang, which a.parquet lacks"),
        ({"text": ["t"]}, "lacks id"),
    ],
)
def test_schema_mismatch_between_files_names_the_file_and_the_column(tmp_path, other, message):
    pq.write_table(_table(3), tmp_path / "a.parquet")
    pq.write_table(pa.table(other), tmp_path / "b.parquet")
    with pytest.raises(UserError, match=rf"b\.parquet: has other columns than a\.parquet: {message} —"):
        open_documents(tmp_path)
    # Per-language folders of files of one name: the first is named by its path under the common folder.
    for language, table in (("en", _table(3)), ("fr", pa.table(other))):
        (tmp_path / "langs" / language).mkdir(parents=True)
        pq.write_table(table, tmp_path / "langs" / language / "train-00000.parquet")
    with pytest.raises(UserError, match=r"fr/train-00000\.parquet: has other columns than en/train-00000\.parquet"):
        open_documents(tmp_path / "langs")


def test_shards_with_their_columns_in_another_order_are_read_in_the_first_ones_order(tmp_path):
    """Writers order columns as they please; every command reads each shard in the first shard's order."""
    pq.write_table(_table(3), tmp_path / "a.parquet")
    pq.write_table(_table(2, start=3).select(["text", "id"]), tmp_path / "b.parquet")
    source = open_documents(tmp_path)
    assert source.schema.names == ["id", "text"]
    batches = list(source.iter_batches())
    assert all(b.schema.names == ["id", "text"] for b in batches)
    assert pa.Table.from_batches(batches).column("id").to_pylist() == [f"doc-{i}" for i in range(5)]


@pytest.mark.parametrize("case", ["missing", "empty_folder", "not_parquet", "truncated", "empty_file"])
def test_bad_inputs_are_user_errors_naming_the_file(tmp_path, case):
    target = tmp_path / "input"
    if case == "empty_folder":
        target.mkdir()
    elif case == "not_parquet":
        target = tmp_path / "notes.parquet"
        target.write_text("hello, I am text")
    elif case == "truncated":
        target = tmp_path / "cut.parquet"
        pq.write_table(_table(100), target)
        target.write_bytes(target.read_bytes()[:-300])
    elif case == "empty_file":
        target = tmp_path / "zero.parquet"
        target.write_bytes(b"")
    with pytest.raises(UserError) as info:
        open_documents(target)
    assert str(target) in str(info.value)


def test_corrupt_page_inside_a_valid_footer_is_a_user_error(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(_table(500), path, compression="zstd")
    data = bytearray(path.read_bytes())
    for offset in range(20, 400):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    source = open_documents(path)
    with pytest.raises(UserError, match=r"bad\.parquet"):
        list(source.iter_batches())


def test_checksum_verification_catches_a_flipped_byte(tmp_path):
    out = tmp_path / "ds"
    _write(out)
    shard = out / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = verify_checksums(out)
    assert len(problems) == 1 and "part-00001.parquet" in problems[0]


def test_outputs_load_with_datasets_and_safetensors(tmp_path):
    import datasets
    from safetensors.torch import load_file

    _write(tmp_path / "ds")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "ds" / "*.parquet"), split="train")
    assert loaded.num_rows == 250 and loaded[0]["id"] == "doc-0"

    with OutputFolder(tmp_path / "packed", kind=KIND_PACKED) as folder:
        writer = PackedWriter(folder, rows_per_shard=4)
        ids = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
        writer.write(
            {"input_ids": ids, "position_ids": np.tile(np.arange(8, dtype=np.int32), (6, 1))}, row_tokens=np.full(6, 8)
        )
        writer.close()
        folder.commit(seq_len=8)
    packed = open_packed(tmp_path / "packed")
    assert packed.shard_rows == [4, 2] and packed.manifest["tokens"] == 48
    tensors = load_file(str(packed.files[1]))
    assert tensors["input_ids"].tolist() == ids[4:].tolist()
    with pytest.raises(UserError, match="not a packed folder"):
        open_packed(tmp_path / "ds")
    with pytest.raises(UserError, match="packed folder, not a dataset"):
        open_documents(tmp_path / "packed")


def test_manifest_is_written_last_and_names_its_inputs(tmp_path):
    from smolctl.shards import lineage_chain, lineage_ref

    first = tmp_path / "first"
    _write(first)
    with OutputFolder(tmp_path / "second", kind=KIND_DOCUMENTS, inputs=[lineage_ref(first)]) as folder:
        writer = DatasetWriter(folder)
        writer.write(_table(5))
        writer.close()
        folder.commit()
    manifest = json.loads((tmp_path / "second" / MANIFEST_NAME).read_text())
    assert manifest["inputs"][0]["path"] == str(first.resolve())
    chain = lineage_chain(tmp_path / "second")
    assert [e["depth"] for e in chain] == [0, 1] and chain[1]["status"] == "ok"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_safetensors_shards_get_the_mode_the_umask_gives(tmp_path, umask):
    """safetensors 0.8 makes its files 0600 whatever the umask; other users of a cluster must be able to read
    packed data and models as they can read the manifest next to them."""
    previous = os.umask(umask)
    try:
        with OutputFolder(tmp_path / "packed", kind=KIND_PACKED) as folder:
            writer = PackedWriter(folder, rows_per_shard=2)
            writer.write({"input_ids": np.zeros((3, 4), np.int32)}, np.full(3, 4))
            writer.close()
            folder.commit()
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "packed").iterdir()}
    assert modes == {
        name: 0o666 & ~umask for name in ("part-00000.safetensors", "part-00001.safetensors", "manifest.json")
    }


def file_sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "shapes",
    [
        {"position_ids": (3, 5), "input_ids": (3, 5)},  # given out of name order
        {"input_ids": (257, 4096), "position_ids": (257, 4096)},
        {"b": (1,), "a": (2, 3, 4), "c": (0, 7)},  # a zero-size tensor among them
        {"ids": (10_001, 3)},  # data offsets of another width: the header's padding changes
    ],
)
def test_a_shard_written_from_blocks_is_the_file_safetensors_writes(shapes, tmp_path):
    """Blocks of rows written where they lie make the bytes save_file writes for the stacked tensors, and the
    digest taken from memory is the file's own."""
    from safetensors.numpy import save_file

    import smolctl.shards as shards

    rng = np.random.default_rng(len(shapes))
    tensors = {name: rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int32) for name, shape in shapes.items()}
    # Uneven blocks, an empty one among them, each tensor cut at different rows.
    blocks = {}
    for i, (name, array) in enumerate(tensors.items()):
        cuts = sorted({0, min(len(array), 1 + i), len(array) // 2, len(array)})
        blocks[name] = [array[a:b] for a, b in itertools.pairwise(cuts)] + [array[len(array) :]]
    digest = shards.write_int32_safetensors(blocks, tmp_path / "blocks.safetensors")
    save_file(tensors, str(tmp_path / "stacked.safetensors"))
    assert (tmp_path / "blocks.safetensors").read_bytes() == (tmp_path / "stacked.safetensors").read_bytes()
    assert digest == file_sha256(tmp_path / "blocks.safetensors")


def test_a_shard_of_anything_but_int32_blocks_is_refused(tmp_path):
    import smolctl.shards as shards

    for blocks in (
        {"ids": [np.zeros(4, np.int32), np.zeros(4, np.int64)]},
        {"ids": [np.zeros(4, np.float32)]},
        {"ids": [np.zeros((2, 4), np.int32), np.zeros((2, 5), np.int32)]},
        {"ids": [np.zeros(4, ">i4")]},
        {"ids": []},
    ):
        with pytest.raises(ValueError, match="little-endian int32"):
            shards.write_int32_safetensors(blocks, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_packed_shards_cut_across_writes_hold_their_rows_and_tokens(tmp_path):
    """Rows written in uneven blocks land in shards of rows_per_shard, each block split where a shard ends, and
    each shard's manifest entry counts the real tokens of its own rows."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    written = [rng.integers(0, 1000, size=(n, 6), dtype=np.int32) for n in (3, 3, 5, 1, 7)]
    row_tokens = [rng.integers(1, 7, size=len(rows)) for rows in written]
    with OutputFolder(tmp_path / "packed", kind=KIND_PACKED) as folder:
        writer = PackedWriter(folder, rows_per_shard=4)
        for rows, tokens in zip(written, row_tokens):
            writer.write({"input_ids": rows, "position_ids": rows + 1}, tokens)
        with pytest.raises(ValueError, match="input_ids"):  # every write must give every tensor
            writer.write({"input_ids": written[0]}, row_tokens[0])
        writer.close()
        folder.commit()
    everything, tokens = np.concatenate(written), np.concatenate(row_tokens)
    manifest = json.loads((tmp_path / "packed" / MANIFEST_NAME).read_text())
    assert [shard["rows"] for shard in manifest["shards"]] == [4, 4, 4, 4, 3]
    start = 0
    for shard in manifest["shards"]:
        loaded = load_file(str(tmp_path / "packed" / shard["name"]))
        end = start + shard["rows"]
        assert np.array_equal(loaded["input_ids"], everything[start:end])
        assert np.array_equal(loaded["position_ids"], everything[start:end] + 1)
        assert shard["tokens"] == int(tokens[start:end].sum())
        assert shard["sha256"] == file_sha256(tmp_path / "packed" / shard["name"])
        start = end


def test_an_output_is_refused_only_where_the_inputs_glob_would_read_what_it_writes(tmp_path, monkeypatch):
    """The next run with the same glob would read the output as input: refused where the pattern, as glob.glob
    reads it, matches a file the command writes; not where it cannot (another depth, a hidden folder, a command
    that writes no parquet), and not missed through a link to the folder."""
    (tmp_path / "data" / "raw" / "deep").mkdir(parents=True)
    pq.write_table(_table(3), tmp_path / "data" / "raw" / "a.parquet")
    pq.write_table(_table(3), tmp_path / "data" / "raw" / "deep" / "b.parquet")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    mix_shards, dedup_shards = ["part-00000.parquet"], ["part-00000.parquet", "duplicates/part-00000.parquet"]
    refused = [
        ("data/*/*.parquet", "data/mixed", mix_shards),
        ("data/**/*.parquet", "data/a/b/c", mix_shards),
        (f"{tmp_path}/data/**", "data/out", mix_shards),
        ("data/*/*/*.parquet", "data/out", dedup_shards),  # its duplicates/ folder is one level down
        ("link/*/*.parquet", "data/mixed", mix_shards),
        ("data/*/*.parquet", "link/mixed", mix_shards),
    ]
    for pattern, output, shards in refused:
        with pytest.raises(UserError, match=re.escape(f"is where the input pattern {pattern} finds files")):
            open_documents(pattern).check_output_spares(output, shards=shards)
    accepted = [
        ("data/*/*.parquet", "data/tok", []),  # train-tokenizer and pack write no parquet
        ("data/*/*/*.parquet", "data/mixed", mix_shards),
        ("data/**/*.parquet", "data/.hidden", dedup_shards),  # glob never looks into a dot-folder
        ("data/raw/*.parquet", "data/mixed", dedup_shards),
        ("data/*/[ab].parquet", "data/mixed", mix_shards),
    ]
    for pattern, output, shards in accepted:
        open_documents(pattern).check_output_spares(output, shards=shards)


def test_a_finished_folder_is_never_seen_half_removed(tmp_path, monkeypatch):
    """A kill while a run removed its oldest checkpoint (checkpoint.keep) left checkpoints/step-N with its
    manifest and without its shards: a finished folder, by its look, that fails --verify. The folder goes aside
    under a hidden name first; what a kill leaves there goes with the next removal."""
    from smolctl import shards

    parent = tmp_path / "checkpoints"
    for step in (3, 6):
        (parent / f"step-{step}").mkdir(parents=True)
        (parent / f"step-{step}" / "__0_0.distcp").write_bytes(b"weights")
        (parent / f"step-{step}" / "manifest.json").write_text("{}")

    def killed_halfway(path, ignore_errors=False):
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shards.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        shards.remove_finished(parent / "step-3")
    monkeypatch.undo()
    assert sorted(p.name for p in parent.iterdir()) == [".step-3.removing", "step-6"]
    shards.remove_finished(parent / "step-6")
    assert list(parent.iterdir()) == []
    shards.remove_finished(parent / "step-6")  # already gone: nothing to do
