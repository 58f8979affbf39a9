"""Generate the shell completion scripts shipped in completions/ (`python -m smolctl.completions completions`)."""

from __future__ import annotations

import sys
from pathlib import Path

from typer._completion_shared import get_completion_script

SCRIPTS = {"bash": "smolctl.bash", "zsh": "_smolctl", "fish": "smolctl.fish"}


def completion_scripts() -> dict[str, str]:
    """File name → script text, exactly what `smolctl --show-completion SHELL` prints."""
    return {name: get_completion_script(prog_name="smolctl", complete_var="_SMOLCTL_COMPLETE", shell=shell)
            for shell, name in SCRIPTS.items()}


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in completion_scripts().items():
        (folder / name).write_text(text)


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "completions"))
