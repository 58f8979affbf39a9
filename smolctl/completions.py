"""Generate the shell completion scripts shipped in completions/ (`python -m smolctl.completions completions`).

The scripts are the ones `smolctl --show-completion` prints, kept here because Typer writes them only from a
private module. Each script calls smolctl back with `_SMOLCTL_COMPLETE=complete_SHELL`, the protocol Typer's public
runtime answers; tests/test_cli.py checks that every shell's call is answered with the commands."""

from __future__ import annotations

import sys
from pathlib import Path

BASH = """\
_smolctl_completion() {
    local IFS=$'\n'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \\
                   COMP_CWORD=$COMP_CWORD \\
                   _SMOLCTL_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _smolctl_completion smolctl"""

ZSH = """\
#compdef smolctl

_smolctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _SMOLCTL_COMPLETE=complete_zsh smolctl)
}

compdef _smolctl_completion smolctl"""

FISH = (
    'complete --command smolctl --no-files --arguments "(env _SMOLCTL_COMPLETE=complete_fish '
    '_TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) smolctl)" --condition "env '
    "_SMOLCTL_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=is-args _TYPER_COMPLETE_ARGS=(commandline -cp) "
    'smolctl"'
)

# Each file ends in a newline, as a text file does (`source` and `cat` read it the same way either way).
SCRIPTS = {"smolctl.bash": BASH + "\n", "_smolctl": ZSH + "\n", "smolctl.fish": FISH + "\n"}


def completion_scripts() -> dict[str, str]:
    """File name → script text."""
    return dict(SCRIPTS)


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in completion_scripts().items():
        (folder / name).write_text(text)


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "completions"))
