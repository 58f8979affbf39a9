"""The smolctl process: `python -m smolctl` and the `smolctl` script both start here."""

import atexit
import gc


def main() -> None:
    """Run one command. Start-up makes tens of thousands of objects (Typer, pydantic, rich, the command's
    modules) that all live until the process ends, and Python's cyclic collector would walk them again and again
    while they are made, and once more, in full, at exit. None of them is garbage, so the collector is off while
    the CLI imports, what that made is frozen out of every later collection (the command then runs with the
    collector on, as usual), and so is whatever is still alive at exit, after every other exit handler (they run
    last-registered first). Finalisers of objects alive at exit are not guaranteed by Python anyway; outputs are
    closed explicitly."""
    atexit.register(gc.freeze)
    gc.disable()
    try:
        from smolctl.cli import main as run_command
    finally:
        gc.freeze()
        gc.enable()
    run_command()


if __name__ == "__main__":
    main()
