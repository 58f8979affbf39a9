"""What torchrun and accelerate launch tell each process through its environment, read in one place.

It sits below every other module (no imports of smolctl's own), so the CLI, the run layout and the distributed
setup can all ask for the rank without importing each other.
"""

from __future__ import annotations

import os


def rank_from_env() -> int:
    """This process's rank as torchrun and accelerate launch set it (0 when run alone)."""
    return int(os.environ.get("RANK", "0"))
