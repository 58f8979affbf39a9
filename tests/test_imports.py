"""The package's import graph has no cycle, and `smolctl --help` stays free of the heavy libraries.

The graph is read from the source with `ast`, not by importing: every `import` / `from ... import` of a smolctl
module is an edge, wherever it sits. A function-local import that closes a cycle is still a cycle (it only moves
the failure to run time and hides that a shared piece belongs lower down), and so is one under `if TYPE_CHECKING:`
(a module that needs a type from a module above it to describe its own arguments sits at the wrong level).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "smolctl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> dict[str, int]:
    """The smolctl modules `path` imports → the first line that does. `from a.b import c` is an edge to a.b.c when
    that is a module (a submodule import), else to a.b; relative imports are resolved against the module."""
    is_package = path.name == "__init__.py"
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            # `import smolctl.a.b` names the module itself; keep the longest prefix that is a smolctl module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    modules = package_modules()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module are the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def describe_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """The shortest loop from the component's first module back to it, with the line of each import:
    a → b (a.py line 12) → a (b.py line 40). A breadth-first search inside the component always finds one."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier, end = [start], None
    while end is None:
        following = []
        for here in frontier:
            for target in sorted(t for t in graph[here] if t in members):
                if target == start:
                    end = here
                    break
                if target not in parent:
                    parent[target] = here
                    following.append(target)
            if end is not None:
                break
        frontier = following
    chain = [end]  # end imports start; walk the search's parents back from end to start
    while chain[-1] != start:
        chain.append(parent[chain[-1]])
    path = [*reversed(chain), start]
    hops = [f"{b} ({a.rpartition('.')[2]}.py line {graph[a][b]})" for a, b in itertools.pairwise(path)]
    return " → ".join([path[0], *hops])


def test_the_graph_reader_sees_function_local_relative_and_type_checking_imports(tmp_path, monkeypatch):
    """The reader must catch the cycle this test exists for: one direction at module top, the other inside a
    function; relative imports resolve against the importing module; a type-only import is an edge too."""
    root = tmp_path / "smolctl"
    (root / "infra").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "infra" / "__init__.py").write_text("")
    (root / "infra" / "report.py").write_text("def run():\n    from smolctl.infra.runner import Runner\n")
    (root / "infra" / "runner.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .report import run\nfrom smolctl import errors\n"
        "if TYPE_CHECKING:\n    from smolctl.infra.stress import Stress\n"
    )
    (root / "infra" / "stress.py").write_text("from smolctl.infra import runner\n")
    (root / "errors.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    graph = import_graph()
    assert graph["smolctl.infra.runner"] == {"smolctl.infra.report": 2, "smolctl.errors": 3, "smolctl.infra.stress": 5}
    assert graph["smolctl.infra.report"] == {"smolctl.infra.runner": 2}
    assert graph["smolctl.infra.stress"] == {"smolctl.infra.runner": 1}  # a submodule named after `import`
    cycles = strongly_connected(graph)
    assert cycles == [["smolctl.infra.report", "smolctl.infra.runner", "smolctl.infra.stress"]]
    assert describe_cycle(cycles[0], graph) == (
        "smolctl.infra.report → smolctl.infra.runner (report.py line 2) → smolctl.infra.report (runner.py line 2)"
    )


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is PACKAGE the source folder?"
    cycles = strongly_connected(graph)
    found = [describe_cycle(c, graph) for c in cycles]
    assert not found, "import cycles (move the shared piece down into a module both can import):\n" + "\n".join(found)


HEAVY = ("torch", "transformers", "trl", "peft", "mergekit")


@pytest.mark.parametrize(
    ("module", "heavy"),
    [
        ("smolctl.cli", (*HEAVY, "pyarrow")),  # `smolctl --help`, and every command before it starts its work
        ("smolctl.data.dedup", HEAVY),
        ("smolctl.data.mix", HEAVY),
        ("smolctl.infra.estimate", HEAVY),  # estimate reads a model's config.json, never its weights
    ],
)
def test_light_entry_points_do_not_import_heavy_libraries(module, heavy):
    """The CLI and the commands that need no model start without the libraries that take seconds to import."""
    probe = f"import sys, {module}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "", f"importing {module} loads {result.stdout.strip()}"


@pytest.mark.parametrize(
    ("command", "schema_needs_pydantic"),
    [
        (["pack", "missing.parquet", "out", "--tokenizer", "tok", "--seq-len", "4096", "--workers", "1"], False),
        (["dedup", "missing", "out", "--minhash", "--threshold", "0.8", "--num-perm", "128", "--workers", "1"], False),
        (["train-tokenizer", "missing", "tok", "--vocab-size", "300"], False),
        (["mix", "out", "--source", "web=missing:1", "--bytes", "1MB"], True),  # its stage schedule is a pydantic model
    ],
)
def test_data_commands_start_with_what_they_need(command, schema_needs_pydantic, tmp_path):
    """pack and dedup run as thousands of array tasks at corpus scale, and their start-up is part of the time the
    benchmarks compare with the raw tokenizer and rensa. Their options are str, int and paths: parsing them must
    not import pydantic and build its validators (Typer 0.29 does, before every command). The data commands
    import numpy to index arrays: OpenBLAS must not start its thread per core (counted, on Linux, among the
    threads that carry the process's name; pyarrow's allocator names its own)."""
    probe = (
        "import os, sys\nfrom smolctl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]\n"
        "    print(exc.code, 'pydantic' in sys.modules, 'numpy' in sys.modules, names.count(open('/proc/self/comm').read()))"
    )
    environment = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", probe, *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=environment,
        check=False,
    )
    assert "missing" in result.stderr and "no such file" in result.stderr, result.stderr  # parsed, then refused
    # exit 2, pydantic only where the command's own schema needs it, numpy, one thread
    assert result.stdout.split() == ["2", str(schema_needs_pydantic), "True", "1"], result.stdout


@pytest.mark.parametrize("command", ["pack", "dedup"])
def test_a_json_run_that_draws_nothing_does_not_import_rich(command, sample, tokenizer_dir, tmp_path):
    """Under --json in a pipe (an array task, a script) pack and dedup draw nothing: no bar, no table. Rich is
    ~50 ms of their start-up, so it is not imported; the same run without --json draws its summary with it."""
    template = {
        "pack": ["pack", str(sample / "math"), "OUT", "--tokenizer", str(tokenizer_dir), "--seq-len", "64"],
        "dedup": ["dedup", str(sample / "web"), "OUT", "--minhash", "--workers", "1"],
    }[command]
    probe = (
        "import sys\nfrom smolctl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    print(exc.code, file=sys.stderr)\n"
        "print('RICH', any(m == 'rich' or m.startswith('rich.') for m in sys.modules), file=sys.stderr)"
    )
    for flags, output, draws in (["--json"], "quiet", False), ([], "drawn", True):
        arguments = [a if a != "OUT" else str(tmp_path / output) for a in template]
        result = subprocess.run(
            [sys.executable, "-c", probe, *arguments, *flags],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            check=False,
        )
        assert f"RICH {draws}" in result.stderr, result.stderr
        assert (tmp_path / output / "manifest.json").exists(), result.stderr
        if draws:  # the summary, not the JSON object
            assert ("rows" in result.stdout or "kept" in result.stdout) and "{" not in result.stdout, result.stdout
        else:
            json.loads(result.stdout)
