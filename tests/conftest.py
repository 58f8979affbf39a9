"""Fixtures shared by the foundation tests: the sample corpus, a trained tokenizer, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data" / "sample"
# The files that take longest (CI's --durations, most first). `make test` runs `-n 2 --dist loadfile`, which hands
# whole files to the two workers in collection order: collected alphabetically, test_slurm.py came last and ran
# alone on one worker for its last four minutes while the other idled.
LONGEST_FILES = (
    "test_slurm.py",
    "test_checkpoints.py",
    "test_pretrain.py",
    "test_pipeline.py",
    "test_crash_safety.py",
    "test_posttrain.py",
    "test_examples.py",
    "test_report.py",
    "test_ppo.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (longest-first scheduling), the rest in their usual order after them."""
    rank = {name: position for position, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def work_area(output: Path) -> Path:
    """OUTPUT/_work/<run>/ of the one run under OUTPUT."""
    (run,) = (output / "_work").iterdir()
    return run


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "smolctl", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=full_env,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def sample() -> Path:
    return SAMPLE


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from smolctl.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(str(SAMPLE / "web"), str(out), vocab_size=2048)
    return out


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Keep smolctl's cache (e.g. estimate's measured model shapes) out of the user's home during tests."""
    os.environ["SMOLCTL_CACHE"] = str(tmp_path_factory.mktemp("smolctl-cache"))
    yield
