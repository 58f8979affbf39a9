"""The smolctl process: `python -m smolctl` and the `smolctl` script both start here."""

import gc
import os


def main() -> None:
    """Run one command. Importing the CLI makes tens of thousands of objects (Typer, pydantic, rich, smolctl's
    command modules) that all live until the process ends, and Python's cyclic collector would walk them again
    and again while they are made, in every full collection after that, and once more at exit. None of them is
    garbage, so the collector is off while the CLI imports and what that made is frozen out of later collections;
    the command then runs with the collector on, as usual. What the command itself makes (torch, process groups)
    is left to the usual collection at exit, the path torch is tested on: while that was frozen too, a
    two-process gloo run aborted (SIGABRT) once in CI.

    numpy asks the kernel for transparent huge pages on every array of 4 MB or more. smolctl's big arrays are
    written once and streamed out, and with that advice `pack` spent ~2 s more of kernel time zeroing fresh
    2 MB pages per 68 M tokens, 6% of its run (benchmarks/RESULTS.md). Set NUMPY_MADVISE_HUGEPAGE=1 to have
    numpy ask again."""
    os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")  # read once, when numpy is imported
    gc.disable()
    try:
        from smolctl.cli import main as run_command
    finally:
        gc.freeze()
        gc.enable()
    run_command()


if __name__ == "__main__":
    main()
