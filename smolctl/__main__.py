"""The smolctl process: `python -m smolctl` and the `smolctl` script both start here."""

import gc


def main() -> None:
    """Run one command. Importing the CLI makes tens of thousands of objects (Typer, pydantic, rich, smolctl's
    command modules) that all live until the process ends, and Python's cyclic collector would walk them again
    and again while they are made, in every full collection after that, and once more at exit. None of them is
    garbage, so the collector is off while the CLI imports and what that made is frozen out of later collections;
    the command then runs with the collector on, as usual. What the command itself makes (torch, process groups)
    is left to the usual collection at exit, the path torch is tested on: while that was frozen too, a
    two-process gloo run aborted (SIGABRT) once in CI."""
    gc.disable()
    try:
        from smolctl.cli import main as run_command
    finally:
        gc.freeze()
        gc.enable()
    run_command()


if __name__ == "__main__":
    main()
