"""What every command returns: a dataclass whose one `to_dict()` is what `--json` prints and what its renderer
reads, so the two never disagree."""

from __future__ import annotations

from dataclasses import asdict


class Result:
    """Mixed into a command's result dataclass: `to_dict()` is its fields, nested dataclasses as dicts."""

    def to_dict(self) -> dict:
        return asdict(self)
