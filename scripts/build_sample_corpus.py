"""Build the shipped sample corpus from the Python standard library's own text (PSF License 2.0).

Run once by a maintainer (`python scripts/build_sample_corpus.py data/sample`); the output is committed, so
neither the demo nor the tests depend on the Python installation they run on. Three document sources stand in
for SmolLM3's web / code / math mixture:

- web:  docstrings of modules, classes and functions (English prose about software)
- code: source code of functions and classes
- math: docstrings and code from the numeric modules (statistics, fractions, decimal, random, ...)

Documents are 0.2-5 KB. The standard library holds real near-duplicates (e.g. the pure-Python copies of C
modules, shared boilerplate docstrings), which dedup finds. From the same text come a small chat (SFT) set, a
preference (DPO) set and a prompt set with reference answers (PPO/GRPO).
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from smolctl.shards import KIND_DOCUMENTS, DatasetWriter, OutputFolder, schema_to_dict

MIN_CHARS, MAX_CHARS = 200, 5000
MATH_MODULES = {"statistics", "fractions", "_pydecimal", "random", "numbers", "decimal", "colorsys", "_pylong"}
SKIP_PARTS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip", "tkinter"}
WEB_BUDGET, CODE_BUDGET, MATH_BUDGET = 1_400_000, 700_000, 350_000


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def iter_definitions(tree: ast.Module, prefix: str = ""):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield f"{prefix}{node.name}", node
            if isinstance(node, ast.ClassDef):
                yield from iter_definitions(node, f"{prefix}{node.name}.")


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def collect(root: Path) -> list[dict]:
    docs: list[dict] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = module_name(root, path)
        top = module.split(".")[0]
        is_math = top in MATH_MODULES
        doc = ast.get_docstring(tree)
        if doc:
            docs.append({"kind": "docstring", "module": module, "name": module, "text": doc, "math": is_math})
        for qualname, node in iter_definitions(tree):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(
                    {
                        "kind": "docstring",
                        "module": module,
                        "name": f"{module}.{qualname}",
                        "text": doc,
                        "math": is_math,
                        "summary": first_paragraph(doc),
                        "def": type(node).__name__,
                    }
                )
            segment = ast.get_source_segment(source, node)
            if segment and "." not in qualname:
                docs.append(
                    {
                        "kind": "code",
                        "module": module,
                        "name": f"{module}.{qualname}",
                        "text": textwrap.dedent(segment),
                        "math": is_math,
                    }
                )
    return docs


def fit(text: str) -> str | None:
    text = text.strip()
    if len(text) < MIN_CHARS:
        return None
    if len(text) > MAX_CHARS:
        cut = text.rfind("\n", 0, MAX_CHARS)
        text = text[: cut if cut > MIN_CHARS else MAX_CHARS]
    return text


def write_folder(out: Path, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows)
    folder = OutputFolder(out, kind=KIND_DOCUMENTS, overwrite=True)
    writer = DatasetWriter(folder, shard_rows=max(1, (len(rows) + 1) // 2))
    writer.write(table)
    schema = writer.close()
    folder.commit(schema=schema_to_dict(schema), stats={"origin": "CPython standard library (PSF-2.0)"})
    print(f"{out}: {len(rows)} rows, {sum(len(r.get('text', '')) for r in rows) / 1e6:.2f} MB of text")


def budgeted(candidates: list[dict], budget: int, source: str, rng: random.Random) -> list[dict]:
    rng.shuffle(candidates)
    out, used = [], 0
    for doc in candidates:
        text = fit(doc["text"])
        if text is None:
            continue
        out.append({"id": f"{source}-{len(out):05d}", "text": text, "origin": f"cpython/Lib:{doc['name']}"})
        used += len(text)
        if used >= budget:
            break
    return out


def chat_rows(defs: list[dict], rng: random.Random) -> list[dict]:
    rows = []
    templates = {
        "explain": ("What does `{name}` do?", "{summary}"),
        "where": ("Which Python module provides `{short}`?", "`{short}` is provided by the `{module}` module."),
        "kind": ("Is `{name}` a function or a class?", "`{name}` is a {what}."),
    }
    for doc in defs:
        task = rng.choice(list(templates))
        user, answer = templates[task]
        short = doc["name"].rsplit(".", 1)[-1]
        what = "class" if doc["def"] == "ClassDef" else "function"
        values = {"name": doc["name"], "short": short, "module": doc["module"], "summary": doc["summary"], "what": what}
        rows.append(
            {
                "id": f"chat-{len(rows):05d}",
                "task": task,
                "messages": [
                    {"role": "system", "content": "You are a concise assistant for Python programmers."},
                    {"role": "user", "content": user.format(**values)},
                    {"role": "assistant", "content": answer.format(**values)},
                ],
            }
        )
    return rows


def preference_rows(defs: list[dict], rng: random.Random) -> list[dict]:
    rows = []
    for doc in defs:
        other = rng.choice(defs)
        if other["summary"] == doc["summary"]:
            continue
        rows.append(
            {
                "id": f"pref-{len(rows):05d}",
                "prompt": f"Summarise what `{doc['name']}` does in one sentence.",
                "chosen": doc["summary"].split(". ")[0].rstrip(".") + ".",
                "rejected": other["summary"].split(". ")[0].rstrip(".") + ".",
            }
        )
    return rows


def prompt_rows(defs: list[dict]) -> list[dict]:
    rows = []
    for doc in defs:
        short = doc["name"].rsplit(".", 1)[-1]
        rows.append(
            {
                "id": f"prompt-{len(rows):05d}",
                "prompt": f"Which Python module provides `{short}`? Answer with the module name.",
                "reference": doc["module"],
            }
        )
    return rows


def main(out: Path) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(20261202)
    docs = collect(root)
    web = budgeted([d for d in docs if d["kind"] == "docstring" and not d["math"]], WEB_BUDGET, "web", rng)
    code = budgeted([d for d in docs if d["kind"] == "code" and not d["math"]], CODE_BUDGET, "code", rng)
    math = budgeted([d for d in docs if d["math"]], MATH_BUDGET, "math", rng)
    for name, rows in (("web", web), ("code", code), ("math", math)):
        write_folder(out / name, rows)

    defs = [d for d in docs if d.get("summary") and 20 <= len(d["summary"]) <= 300 and "." in d["name"]]
    rng.shuffle(defs)
    write_folder(out / "chat", chat_rows(defs[:600], rng))
    write_folder(out / "preference", preference_rows(defs[600:1000], rng))
    functions = [d for d in defs[1000:] if d["def"] != "ClassDef" and "." not in d["module"]]
    write_folder(out / "prompts", prompt_rows(functions[:300]))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data/sample"))
