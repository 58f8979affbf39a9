"""smolctl merge (MergeKit behind a recipe) on tiny checkpoints: the tensors it writes are the method's arithmetic,
the output is a model folder transformers loads and generates with, and its lineage names every parent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli
from tiny_checkpoint import make_tiny_checkpoint

from smolctl.errors import UserError
from smolctl.train.merge import load_merge_recipe, run_merge

pytest.importorskip("mergekit")


@pytest.fixture(scope="module")
def parents(tokenizer_dir, tmp_path_factory) -> list[Path]:
    """Three checkpoints of one architecture with different random weights; the second inside a run folder."""
    root = tmp_path_factory.mktemp("merge")
    first = make_tiny_checkpoint(tokenizer_dir, root / "a", seed=0)
    second = make_tiny_checkpoint(tokenizer_dir, root / "run-b" / "final", seed=1).parent
    third = make_tiny_checkpoint(tokenizer_dir, root / "c", seed=2)
    return [first, second, third]


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def merge(tmp_path: Path, method: str, models: list[str], *overrides: str, name: str = "out") -> Path:
    recipe, where = load_merge_recipe(None, list(overrides), method, models)
    run_merge(recipe, tmp_path / name, where=where)
    return tmp_path / name


def test_linear_merge_is_the_weighted_average_exactly(parents, tmp_path):
    a, run_b, _ = parents
    out = merge(tmp_path, "linear", [f"{a}:0.75", f"{run_b}:0.25"])  # a run folder merges its final/
    first, second, merged = tensors(a), tensors(run_b / "final"), tensors(out)
    assert set(merged) == set(first)
    for name, tensor in merged.items():
        # 0.25 is a power of two, so 0.75·a + 0.25·b has one rounding in float32 whatever the order of operations.
        assert tensor.dtype == first[name].dtype
        assert (tensor == 0.75 * first[name] + 0.25 * second[name]).all(), name
    assert not all((merged[n] == first[n]).all() for n in merged), "the parents differ, so the merge must too"

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["stage"] == "merge"
    assert [ref["path"] for ref in manifest["inputs"]] == [str(a.resolve()), str((run_b / "final").resolve())]
    assert all(ref["manifest_sha256"] for ref in manifest["inputs"])
    assert [m["weight"] for m in manifest["merge"]["models"]] == [0.75, 0.25]
    assert [s["name"] for s in manifest["shards"]] == ["model.safetensors"]


def test_merged_folder_loads_and_generates(parents, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = merge(tmp_path, "linear", [str(parents[0]), str(parents[2])])  # no weights: a soup, 0.5 each
    assert json.loads((out / "manifest.json").read_text())["merge"]["models"][1]["weight"] == 0.5
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which module provides `sqrt`?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 5


def test_slerp_of_a_model_with_itself_is_the_model_and_t_picks_an_end(parents, tmp_path):
    a, run_b, _ = parents
    twin = tmp_path / "twin"
    shutil.copytree(a, twin)
    itself = tensors(merge(tmp_path, "slerp", [str(a), str(twin)], "options.t=0.3", name="itself"))
    first = tensors(a)
    for name, tensor in itself.items():
        assert tensor.allclose(first[name], rtol=1e-6, atol=0), name  # (1 - t)·x + t·x, rounded once per term
    at_end = tensors(merge(tmp_path, "slerp", [str(a), str(run_b)], "options.t=1.0", name="end"))
    second = tensors(run_b / "final")
    assert all((at_end[n] == second[n]).all() for n in second)
    recipe, where = load_merge_recipe(None, [], "slerp", [str(a), str(run_b)])
    result = run_merge(recipe, tmp_path / "half", where=where)
    halfway = tensors(tmp_path / "half")
    assert not any((halfway[n] == first[n]).all() for n in first if first[n].ndim == 2)
    assert result.method_parameters == {"t": 0.5}  # the default it ran with, for the summary to show


def test_smollm3_recipe_soup_then_linear_through_the_cli(parents, tmp_path):
    a, run_b, c = parents
    result = run_cli(
        "merge",
        "recipes/smollm3-merge.toml",
        tmp_path / "merged",
        "--json",
        "--set",
        'dtype="float32"',
        "--set",
        f'models.0.soup=["{a}", "{run_b}"]',
        "--set",
        f'models.1.path="{c}"',
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(p["path"], p["weight"]) for p in report["parents"]] == [
        (str(a.resolve()), 0.45),
        (str((run_b / "final").resolve()), 0.45),
        (str(c.resolve()), 0.1),
    ]
    merged, first, second, third = (tensors(p) for p in (tmp_path / "merged", a, run_b / "final", c))
    for name, tensor in merged.items():
        assert tensor.allclose(0.45 * first[name] + 0.45 * second[name] + 0.1 * third[name], rtol=1e-5, atol=1e-7)


def test_ties_needs_a_base_and_a_density(parents, tmp_path):
    with pytest.raises(UserError, match="needs a base model"):
        merge(tmp_path, "ties", [str(parents[1]), str(parents[2])])
    with pytest.raises(UserError, match="has no density"):
        recipe, where = load_merge_recipe(None, [], "ties", [str(parents[1]), str(parents[2])], base=str(parents[0]))
        run_merge(recipe, tmp_path / "out", where=where)
    recipe, where = load_merge_recipe(None, ["options.density=1.0"], "ties", [str(parents[1])], base=str(parents[0]))
    run_merge(recipe, tmp_path / "ties", where=where)
    # One task vector kept whole, weight 1, normalised by its weight: the merge is that model again.
    merged, second = tensors(tmp_path / "ties"), tensors(parents[1] / "final")
    assert all(merged[n].allclose(second[n], rtol=1e-5, atol=1e-6) for n in second)
    assert not (tmp_path / "out").exists()
