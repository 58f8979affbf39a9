"""One rule for sizes and counts (smolctl/units.py): the parsers, the formatters, and every size flag of every
command accepting the documented units, refusing an ambiguous `B` count, and saying the rule in its --help."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

from smolctl.errors import UserError
from smolctl.units import (
    BYTES_HELP,
    COUNT_HELP,
    NCCL_HELP,
    format_bytes,
    format_count,
    parse_bytes,
    parse_count,
    parse_nccl_bytes,
    parse_shard_size,
)


@pytest.mark.parametrize(
    "text, value",
    [
        ("11.2T", 11_200_000_000_000),
        ("5e9", 5_000_000_000),
        ("2_359_296", 2_359_296),
        ("350m", 350_000_000),
        ("2.5M", 2_500_000),
        ("100G", 100_000_000_000),
        ("1K", 1000),
        ("7", 7),
        (4096, 4096),
    ],
)
def test_counts_are_si(text, value):
    assert parse_count(text, "--tokens") == value


@pytest.mark.parametrize("text", ["100B", "8b", "1GB", "1GiB"])
def test_a_count_with_b_is_refused_with_the_way_to_write_billions(text):
    with pytest.raises(UserError) as refused:
        parse_count(text, "--tokens")
    assert "B means bytes" in refused.value.line() and "--tokens" in refused.value.line()
    if text == "100B":
        assert "100G or 100e9" in refused.value.line()


@pytest.mark.parametrize(
    "text, value",
    [
        ("100MB", 100_000_000),
        ("1GiB", 2**30),
        ("100B", 100),
        ("4096", 4096),
        ("256k", 256_000),
        ("1.5 KiB", 1536),
        ("2TiB", 2 * 2**40),
        ("1 GB", 10**9),
    ],
)
def test_bytes_take_si_and_iec_and_b_is_bytes(text, value):
    assert parse_bytes(text, "--bytes") == value


@pytest.mark.parametrize(
    "text, value",
    [
        ("8", 8),
        ("1K", 1024),
        ("64k", 65536),
        ("1M", 2**20),
        ("8G", 8 * 2**30),
        ("0.5G", 2**29),
        ("1MiB", 2**20),
        ("512KB", 512_000),  # with a B, the bytes rule
    ],
)
def test_nccl_sizes_keep_nccl_tests_powers_of_1024(text, value):
    assert parse_nccl_bytes(text, "--max-bytes") == value


def test_shard_sizes_are_bytes_or_rows():
    assert parse_shard_size("256MB") == (256_000_000, None)
    assert parse_shard_size("1GiB") == (2**30, None)
    assert parse_shard_size("5000rows") == (None, 5000)
    assert parse_shard_size("8Krows") == (None, 8000)
    with pytest.raises(
        UserError, match=r"^--shard-size: '0rows' is not a number of rows of at least 1 — write e\.g\. 50000rows"
    ):
        parse_shard_size("0rows")


@pytest.mark.parametrize("text", ["lots", "1.2X", "-5", "0", "T", "", "1Ki", "nan", "0.4", 0.3, "0.0004K"])
def test_junk_is_one_user_error(text):
    """Including amounts that round to 0: `--documents 0.4` committed an empty dataset."""
    for parse in (parse_count, parse_bytes, parse_nccl_bytes):
        with pytest.raises(UserError):
            parse(text, "--flag")


@pytest.mark.parametrize("value", [999, 1000, 2_500_000, 11_200_000_000_000, 123_456_789])
def test_formatted_counts_parse_back_to_three_digits(value):
    text = format_count(value)
    assert "B" not in text
    assert parse_count(text, "x") == pytest.approx(value, rel=5e-3)


def test_a_count_that_rounds_up_to_the_next_prefix_is_written_with_it():
    """999,800 tokens rounds to 1000 at three digits: mix's summary table printed it as '1e+03K'."""
    assert [format_count(n) for n in (999.6, 999_800, 999_499, 999_600_000)] == ["1K", "1M", "999K", "1G"]


@pytest.mark.parametrize("value", [100, 4096, 2**30, 3 * 2**40, 256_000_000])
def test_formatted_bytes_parse_back(value):
    assert parse_bytes(format_bytes(value), "x") == pytest.approx(value, rel=5e-3)


# Every size flag of every command: (command, flag, its rule's help text, a valid value, an invalid one).
SIZE_FLAGS = [
    ("train-tokenizer", "--sample-documents", COUNT_HELP, "1K", "1B"),
    ("train-tokenizer", "--sample-bytes", BYTES_HELP, "64KiB", "64 apples"),
    ("mix", "--tokens", COUNT_HELP, "100K", "2B"),
    ("mix", "--bytes", BYTES_HELP, "100KiB", "100 apples"),
    ("mix", "--documents", COUNT_HELP, "0.1K", "100B"),
    ("pack", "--shard-size", BYTES_HELP, "1MiB", "lots"),
    ("pack", "--buffer-tokens", COUNT_HELP, "8M", "8B"),
    ("estimate", "--tokens", COUNT_HELP, "1G", "100B"),
    ("estimate", "--global-batch-tokens", COUNT_HELP, "2.36M", "2GB"),
    ("benchmark-nccl", "--min-bytes", NCCL_HELP, "1K", "1X"),
    ("benchmark-nccl", "--max-bytes", NCCL_HELP, "1M", "1X"),
]


def _help(command: str) -> str:
    from typer.testing import CliRunner

    from smolctl.cli import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "2000"}, prog_name="smolctl")
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _refusal(command: str, flag: str, value: str, tmp_path) -> str:
    """Run the command with `value` for `flag` (and otherwise good arguments) and return its one error line."""
    arguments = {
        "train-tokenizer": ["data/sample/web", tmp_path / "tok"],
        "mix": [tmp_path / "mix", "--source", "web=data/sample/web:1"],
        "pack": ["data/sample/web", tmp_path / "packed", "--tokenizer", tmp_path / "no-tokenizer"],
        "estimate": ["--model", "smollm3-3b"],
        "benchmark-nccl": [],
    }[command]
    env = {"RANK": "0", "WORLD_SIZE": "2"} if command == "benchmark-nccl" else None
    result = run_cli(command, *arguments, flag, value, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command, flag, rule, good, bad", SIZE_FLAGS, ids=[f"{c} {f}" for c, f, *_ in SIZE_FLAGS])
def test_every_size_flag_says_its_rule_and_refuses_a_wrong_unit_in_one_line(command, flag, rule, good, bad, tmp_path):
    shown = _help(command)
    assert flag in shown and rule in shown, f"{command} {flag}: --help does not say the units rule"
    line = _refusal(command, flag, bad, tmp_path)
    assert line.startswith(f"error: {flag}:"), line
    if rule == COUNT_HELP and "B" in bad:
        assert "B means bytes" in line


def test_size_flags_accept_and_print_the_documented_units(tmp_path, sample):
    """The valid values of SIZE_FLAGS, through commands that print what they understood."""
    estimate = json.loads(
        run_cli(
            "estimate",
            "--model",
            "smollm3-3b",
            "--tokens",
            "1G",
            "--global-batch-tokens",
            "4.096M",
            "--gpus",
            "8",
            "--json",
        ).stdout
    )
    assert estimate["compute"]["tokens"] == 10**9
    assert estimate["layout"]["global_batch_tokens"] == 4_096_000  # 1,000 sequences of 4,096 tokens
    mixed = run_cli("mix", tmp_path / "mix", "--source", f"web={sample / 'web'}:1", "--bytes", "100KiB", "--json")
    assert mixed.returncode == 0, mixed.stderr
    achieved = json.loads(mixed.stdout)["stages"][0]["units"]
    assert 100 * 1024 <= achieved < 110 * 1024  # whole documents: at least the budget, and not much more
    human = run_cli("mix", tmp_path / "mix2", "--source", f"web={sample / 'web'}:1", "--bytes", "100KiB")
    printed = re.search(r"\(([0-9.]+[KMGT]?) bytes,", " ".join(human.stdout.split()))
    assert human.returncode == 0 and printed, human.stdout
    assert parse_count(printed.group(1), "printed") == pytest.approx(achieved, rel=5e-3)  # SI, read back
