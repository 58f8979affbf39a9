"""smolctl's cache of what it can derive again, so that a repeat run skips deriving it: `$SMOLCTL_CACHE`, else
`$XDG_CACHE_HOME/smolctl`, else `~/.cache/smolctl`. Every entry is an optimisation: one that is missing, unreadable
or cannot be written costs a run only the time to derive it again, and an entry's name carries everything its
content depends on, so a stale entry is never read."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import atomic_write_bytes


def cache_path(*parts: str) -> Path | None:
    """Where the entry named by `parts` lives, or None where there is no home to keep a cache in."""
    root = os.environ.get("SMOLCTL_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        try:
            base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG spec ignores relative paths
        except RuntimeError:  # no home directory to be found
            return None
        root = base / "smolctl"
    return Path(root, *parts)


def read_entry(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def save_entry(path: Path | None, data: bytes) -> None:
    """Write an entry atomically (readers see all of it or none), best effort: a read-only or full cache is skipped.
    Not fsynced: a crash only costs deriving the entry again."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data, durable=False)
    except (OSError, UserError):
        pass


_DIGEST_SIZE = 32


def derived_bytes(path: Path | None, derive: Callable[[], bytes], size: int) -> memoryview:
    """The `size` bytes `derive()` returns, kept at `path` followed by their sha256: read back when the entry has
    that size and digest, else (missing, short, damaged) derived again and the entry replaced."""
    entry = read_entry(path)
    if entry is not None and len(entry) == size + _DIGEST_SIZE:
        data = memoryview(entry)[:-_DIGEST_SIZE]
        if hashlib.sha256(data).digest() == entry[-_DIGEST_SIZE:]:
            return data
    data = derive()
    save_entry(path, data + hashlib.sha256(data).digest())
    return memoryview(data)
