"""What torchrun and accelerate launch tell each process through its environment, read in one place.

It sits below every other module (only smolctl.errors, itself a leaf), so the CLI, the run layout and the
distributed setup can all ask for the rank without importing each other. A value that is not a whole number, or
a rank outside the world, is refused in one line: set by hand or by a broken launcher script, it would otherwise
end in a ValueError or a rendezvous that waits for ranks that never come.
"""

from __future__ import annotations

import os

from smolctl.errors import UserError

LAUNCH_FIX = "launch with torchrun (e.g. torchrun --nproc_per_node 2 -m smolctl ...), or unset it to run alone"


def _whole_number(name: str, default: int, least: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UserError(name, f"is {text!r}, not a whole number", LAUNCH_FIX) from None
    if value < least:
        raise UserError(name, f"is {value}, below {least}", LAUNCH_FIX)
    return value


def world_size_from_env() -> int:
    """How many processes the launcher started (1 when run alone)."""
    return _whole_number("WORLD_SIZE", 1, 1)


def rank_from_env() -> int:
    """This process's rank as torchrun and accelerate launch set it (0 when run alone)."""
    rank = _whole_number("RANK", 0, 0)
    if rank >= world_size_from_env():  # WORLD_SIZE unset is a world of 1
        world = world_size_from_env()
        raise UserError("RANK", f"is {rank}, outside a world of {world} process{'es' if world > 1 else ''}", LAUNCH_FIX)
    return rank


def local_rank_from_env() -> int:
    """This process's rank on its node (0 when run alone)."""
    return _whole_number("LOCAL_RANK", 0, 0)


def check_rendezvous_env() -> None:
    """The process group's env:// rendezvous reads MASTER_ADDR and MASTER_PORT, which torchrun sets: a launch
    by hand without them fails deep in torch (a ValueError), so say which is missing first."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise UserError(
            " and ".join(missing),
            f"{'is' if len(missing) == 1 else 'are'} not set, and the {world_size_from_env()} processes of WORLD_SIZE "
            f"need {'it' if len(missing) == 1 else 'them'} to meet",
            LAUNCH_FIX,
        )
