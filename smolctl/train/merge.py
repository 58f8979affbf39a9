"""`smolctl merge`: weight-space merges of checkpoints through MergeKit, behind a recipe.

    smolctl merge recipes/smollm3-merge.toml runs/merged
    smolctl merge --method linear --model runs/apo/final:0.9 --model runs/midtrain:0.1 runs/merged
    smolctl merge --method slerp --model runs/a --model runs/b --set options.t=0.3 runs/slerp

Methods: linear (weights summing to 1; without weights, a model soup: equal weights), slerp (two models, `t` of
the way from the first to the second), ties and dare_ties (task vectors against a `base`, each kept at `density`).
Every parent is checked before anything is written: present, a causal LM with the same tensors (names and shapes)
and the same vocabulary as the first. The output is a Hugging Face folder with the first (slerp, linear) or base
(ties, dare_ties) model's tokenizer and a manifest whose lineage lists every parent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field
from safetensors import safe_open

from smolctl.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from smolctl.errors import UserError
from smolctl.folder_lock import holds_output
from smolctl.recipe import RecipePath, Section, apply_overrides, load_recipe, validate
from smolctl.results import Result
from smolctl.shards import KIND_MODEL, OutputFolder, check_output_path, lineage_ref, read_manifest
from smolctl.train.checkpoint import KIND_CHECKPOINT, refuse_run_folder
from smolctl.train.posttrain_run import quiet_offline

METHODS = ("linear", "slerp", "ties", "dare_ties")
# The [options] keys each method reads; any other key set in the recipe is a mistake worth naming.
METHOD_OPTIONS = {
    "linear": set(),
    "slerp": {"t"},
    "ties": {"density", "lambda_", "normalize"},
    "dare_ties": {"density", "lambda_", "normalize", "seed"},
}
WEIGHT_TOLERANCE = 1e-6


FLAGS = "--model"  # where a merge given by flags (no recipe) is named in errors


class MergeModelSection(Section):
    path: RecipePath | None = None
    """A model folder, or a run folder (its final/ is used)."""
    soup: list[RecipePath] | None = None
    """linear only, instead of `path`: these checkpoints share `weight` equally (a model soup inside the merge)."""
    weight: float | None = None
    """linear: the model's share (all weights sum to 1; leave them all out for equal shares); ties, dare_ties:
    the task vector's weight (default 1)."""
    density: float | None = Field(None, gt=0, le=1)
    """ties, dare_ties: fraction of the task vector's entries kept (default: options.density)."""


class MergeOptionsSection(Section):
    t: float | None = Field(None, ge=0, le=1)
    """slerp: 0 gives the first model, 1 the second (default 0.5)."""
    density: float | None = Field(None, gt=0, le=1)
    """ties, dare_ties: the density of models that set none."""
    lambda_: float | None = Field(None, alias="lambda")
    """ties, dare_ties: scale of the merged task vector (default 1)."""
    normalize: bool | None = None
    """ties, dare_ties: divide the merged task vector by the sum of the weights (default true)."""
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    """dare_ties: seeds the random pruning (default 0), so a merge is reproducible."""


class MergeRecipe(Section):
    method: Literal["linear", "slerp", "ties", "dare_ties"]
    base: RecipePath | None = None
    """ties, dare_ties: the model the task vectors are taken against (e.g. the SFT checkpoint)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The merged weights' dtype (the arithmetic runs in float32 either way)."""
    models: list[MergeModelSection]
    options: MergeOptionsSection = MergeOptionsSection()


def load_merge_recipe(
    path: str | Path | None,
    overrides: list[str],
    method: str | None = None,
    models: list[str] = (),
    base: str | None = None,
) -> tuple[MergeRecipe, str]:
    """The recipe from a file, or from --method/--model/--base (then --set edits the same keys). Returns the
    recipe and where it came from, for error messages."""
    if path is not None:
        if method or models or base:
            raise UserError(
                "--method/--model/--base",
                "cannot be combined with a recipe",
                "put them in the recipe, or edit it with --set (e.g. --set models.0.weight=0.8)",
            )
        return load_recipe(MergeRecipe, path, overrides), str(path)
    if not method or not models:
        raise UserError(
            "merge",
            "needs a recipe, or --method and --model (repeat it)",
            "e.g. smolctl merge --method linear --model A:0.9 --model B:0.1 OUT",
        )
    data: dict = {"method": method, "models": [parse_model(text) for text in models]}
    if base is not None:
        data["base"] = base
    return validate(MergeRecipe, apply_overrides(data, overrides), "--method/--model"), FLAGS


def parse_model(text: str) -> dict:
    """'runs/apo:0.9' → path and weight; a suffix that is not a number is part of the path."""
    path, colon, weight = text.rpartition(":")
    if colon:
        try:
            return {"path": path, "weight": float(weight)}
        except ValueError:
            pass
    return {"path": text}


# ---------------------------------------------------------------------------------------------------------------
# Checks, before anything is written


@dataclass
class Parent:
    path: Path
    weight: float | None
    density: float | None = None


def resolve_parent(spec: str, where: str) -> Path:
    """A model folder (config.json + safetensors), or a run folder holding one in final/."""
    path = Path(spec)
    if not path.exists():
        raise UserError(where, f"parent {spec} does not exist", "check the path (a run folder or its final/)")
    if path.is_dir() and not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
        path = path / "final"
    if path.is_dir():  # a run without its final model, or a training checkpoint: what to pass instead
        refuse_run_folder(path, where, "export one of its checkpoints first: smolctl export {checkpoint} OUT")
        if (read_manifest(path) or {}).get("kind") == KIND_CHECKPOINT:
            raise UserError(
                where,
                f"parent {spec} is a training checkpoint, not a model folder",
                f"export it first: smolctl export {spec} OUT, then merge OUT",
            )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(
            where,
            f"parent {spec} is not a model folder (no config.json)",
            "pass a Hugging Face model folder or a run folder with final/",
        )
    manifest = read_manifest(path)
    if manifest is not None and manifest["kind"] != KIND_MODEL:
        raise UserError(where, f"parent {spec} is a {manifest['kind']} folder, not a model", "pass a model folder")
    if not any(path.glob("*.safetensors")):
        raise UserError(where, f"parent {spec} holds no *.safetensors weights", "pass a model saved as safetensors")
    for weights in (path / "config.json", *sorted(path.glob("*.safetensors"))):
        if not os.access(weights, os.R_OK):  # the safetensors reader calls that "no such file"
            raise UserError(where, f"{weights} cannot be read (permissions)", "make it readable, or pass a copy")
    return path


def parents_of(recipe: MergeRecipe, where: str) -> tuple[list[Parent], Parent | None]:
    """(the models to merge, the base or None), soups expanded, method rules checked."""
    method = recipe.method
    unused = {name for name, value in recipe.options if value is not None} - METHOD_OPTIONS[method]
    if unused:
        raise UserError(
            f"{where}: options",
            f"{', '.join(sorted(n.rstrip('_') for n in unused))} "
            f"{'is' if len(unused) == 1 else 'are'} not used by {method}",
            f"{method} reads {', '.join(sorted(n.rstrip('_') for n in METHOD_OPTIONS[method])) or 'no options'}",
        )
    parents: list[Parent] = []
    for i, model in enumerate(recipe.models):
        at = f"{where}: models[{i}]"
        if (model.path is None) == (model.soup is None):
            raise UserError(at, "needs exactly one of path and soup", 'give path = "PATH" (or soup = [...] for linear)')
        if model.soup is not None:
            if method != "linear" or not model.soup:
                raise UserError(
                    f"{at}.soup",
                    "a soup is a list of checkpoints inside a linear merge",
                    'use method = "linear" and list at least one checkpoint',
                )
            parents += [
                Parent(
                    resolve_parent(p, f"{at}.soup"),
                    None if model.weight is None else model.weight / len(model.soup),
                    model.density,
                )
                for p in model.soup
            ]
        else:
            parents.append(Parent(resolve_parent(model.path, f"{at}.path"), model.weight, model.density))
    seen = [p.path.resolve() for p in parents]
    if len(set(seen)) != len(seen):
        twice = next(path for path in seen if seen.count(path) > 1)
        raise UserError(
            f"{where}: models", f"{twice} is listed twice", "list each checkpoint once, with its total weight"
        )
    base = Parent(resolve_parent(recipe.base, f"{where}: base"), None) if recipe.base else None
    check_method(recipe, parents, base, where)
    return parents, base


def check_method(recipe: MergeRecipe, parents: list[Parent], base: Parent | None, where: str) -> None:
    method, weights = recipe.method, [p.weight for p in parents]
    if method in ("linear", "slerp") and base is not None:
        raise UserError(f"{where}: base", f"{method} takes no base model", "list every model under models")
    if method == "linear":
        if len(parents) < 2:
            raise UserError(f"{where}: models", "a linear merge needs at least two models", "add another model")
        given = [w for w in weights if w is not None]
        if given and len(given) != len(weights):
            raise UserError(
                f"{where}: models",
                "some models have a weight and some do not",
                "give every model a weight, or none for equal weights (a model soup)",
            )
        if given and (any(w < 0 or not math.isfinite(w) for w in given) or abs(sum(given) - 1) > WEIGHT_TOLERANCE):
            raise UserError(
                f"{where}: models",
                f"linear weights {', '.join(f'{w:g}' for w in given)} sum to "
                f"{sum(given):.6g}; they must be >= 0 and sum to 1",
                "fix the weights (or leave them all out for equal weights)",
            )
        if not given:
            for parent in parents:
                parent.weight = 1 / len(parents)
    elif method == "slerp":
        if len(parents) != 2:
            raise UserError(
                f"{where}: models",
                f"slerp merges exactly two models, not {len(parents)}",
                "list two models (t = 0 gives the first)",
            )
        if any(w is not None for w in weights):
            raise UserError(f"{where}: models", "slerp takes no weights", "set options.t (0 = first model, 1 = second)")
    else:
        if base is None:
            give = "pass --base PATH" if where == FLAGS else 'set base = "PATH"'
            raise UserError(
                f"{where}: base",
                f"{method} needs a base model to take task vectors against",
                f"{give} (e.g. the checkpoint the models were fine-tuned from)",
            )
        for parent in parents:
            parent.weight = 1.0 if parent.weight is None else parent.weight
            parent.density = parent.density or recipe.options.density
            if parent.density is None:
                raise UserError(
                    f"{where}: models",
                    f"{parent.path} has no density",
                    "pass --set options.density=0.5"
                    if where == FLAGS
                    else "set density per model or options.density (e.g. 0.5)",
                )
        if abs(sum(p.weight for p in parents)) < WEIGHT_TOLERANCE and recipe.options.normalize is not False:
            raise UserError(
                f"{where}: models",
                "the weights sum to 0, and the merge divides by their sum",
                "give the task vectors weights that do not cancel out",
            )


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers (nothing is loaded)."""
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open's handle is not iterable
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_compatible(folders: list[Path], where: str) -> None:
    """Same architecture (config model_type, tensor names and shapes) and the same vocabulary as the first."""
    first = folders[0]
    config = json.loads((first / "config.json").read_text())
    shapes = tensor_shapes(first)
    vocabulary = tokenizer_fingerprint(load_tokenizer(first)) if has_tokenizer(first) else None
    for folder in folders[1:]:
        other = json.loads((folder / "config.json").read_text())
        if other.get("model_type") != config.get("model_type"):
            raise UserError(
                where,
                f"{folder} is a {other.get('model_type')} model but {first} is a {config.get('model_type')} model",
                "merge checkpoints of one architecture",
            )
        if other.get("vocab_size") != config.get("vocab_size"):
            raise UserError(
                where,
                f"{folder} has a vocabulary of {other.get('vocab_size')} tokens but {first} of "
                f"{config.get('vocab_size')}",
                "merge checkpoints that share a tokenizer",
            )
        theirs = tensor_shapes(folder)
        differing = sorted(set(shapes) ^ set(theirs)) or sorted(n for n in shapes if shapes[n] != theirs[n])
        if differing:
            name = differing[0]
            raise UserError(
                where,
                f"{folder} and {first} differ in tensor {name} ({theirs.get(name, 'absent')} vs "
                f"{shapes.get(name, 'absent')})",
                "merge checkpoints of the same architecture and size",
            )
        if vocabulary and has_tokenizer(folder) and tokenizer_fingerprint(load_tokenizer(folder)) != vocabulary:
            raise UserError(
                where, f"{folder} has a different tokenizer from {first}", "merge checkpoints that share a tokenizer"
            )


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


# ---------------------------------------------------------------------------------------------------------------
# The merge


@dataclass
class MergeResult(Result):
    output: str
    method: str
    parents: list[dict]
    """Each parent's path, weight and density, in the order given."""
    base: str | None
    tensors: int
    parameters: int
    seconds: float
    method_parameters: dict = field(default_factory=dict)
    """What the method ran with, defaults filled in (slerp's t; ties' normalize and lambda)."""


def mergekit_config(recipe: MergeRecipe, parents: list[Parent], base: Parent | None) -> dict:
    """The MergeKit configuration (its YAML schema, as a dict) for the checked parents."""

    def entry(parent: Parent) -> dict:
        params = {k: v for k, v in (("weight", parent.weight), ("density", parent.density)) if v is not None}
        return {"model": str(parent.path), **({"parameters": params} if params else {})}

    options = recipe.options
    config: dict = {"merge_method": recipe.method, "dtype": recipe.dtype, "models": [entry(p) for p in parents]}
    if recipe.method == "linear":
        config["parameters"] = {"normalize": False}  # the weights were checked to sum to 1; use them as given
    elif recipe.method == "slerp":
        config["base_model"] = str(parents[0].path)
        config["parameters"] = {"t": 0.5 if options.t is None else options.t}
    else:
        config["base_model"] = str(base.path)
        config["parameters"] = {
            "normalize": options.normalize is not False,
            "lambda": 1.0 if options.lambda_ is None else options.lambda_,
        }
    return config


@contextmanager
def quiet_mergekit() -> Iterator[None]:
    """MergeKit logs through the root logger (e.g. that it infers SmolLM3's layout, which is expected here)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


@holds_output(lambda recipe, output, **kwargs: output)
def run_merge(recipe: MergeRecipe, output: str | Path, *, where: str, overwrite: bool = False) -> MergeResult:
    """Check every parent, merge with MergeKit into a staging folder, add the tokenizer and the manifest."""
    started = time.perf_counter()
    parents, base = parents_of(recipe, where)
    folders = [p.path for p in ([base] if base else []) + parents]
    check_compatible(folders, where)
    tokenizer_from = folders[0]
    if not has_tokenizer(tokenizer_from):
        raise UserError(
            where,
            f"{tokenizer_from} holds no tokenizer to copy into the merged model",
            "save the tokenizer beside that model (or list a model with one first)",
        )
    output = Path(output)
    check_output_path(output, overwrite)
    try:
        import mergekit.config
        import mergekit.merge
        from mergekit.options import MergeOptions
    except ImportError as exc:
        raise UserError(
            "merge",
            f"needs MergeKit ({exc.name} is not installed)",
            "pip install 'smolctl[merge]' (or pip install mergekit)",
        ) from exc
    import torch

    quiet_offline()
    settings = mergekit_config(recipe, parents, base)
    config = mergekit.config.MergeConfiguration.model_validate(settings)
    options = MergeOptions(
        copy_tokenizer=False,
        write_model_card=False,
        quiet=True,
        lazy_unpickle=False,
        cuda=torch.cuda.is_available(),
        random_seed=recipe.options.seed or 0,
    )
    inputs = [lineage_ref(folder) for folder in folders]
    with OutputFolder(output, kind=KIND_MODEL, overwrite=overwrite, inputs=inputs) as folder:
        with quiet_mergekit():
            mergekit.merge.run_merge(config, str(folder.staging), options=options)
        tokenizer = load_tokenizer(tokenizer_from)
        tokenizer.save_pretrained(str(folder.staging))
        if (tokenizer_from / "generation_config.json").is_file():  # stop tokens (e.g. the chat end-of-turn)
            shutil.copy2(tokenizer_from / "generation_config.json", folder.file("generation_config.json"))
        shapes = tensor_shapes(folder.staging)
        for weights in sorted(folder.staging.glob("*.safetensors")):
            folder.add_shard(weights.name, rows=0)
        described = [{"path": str(p.path.resolve()), "weight": p.weight, "density": p.density} for p in parents]
        folder.commit(
            stage="merge",
            parent=str(tokenizer_from.resolve()),
            merge={
                "method": recipe.method,
                "dtype": recipe.dtype,
                "models": described,
                "base": str(base.path.resolve()) if base else None,
                "options": recipe.options.model_dump(by_alias=True, exclude_none=True),
            },
            tokenizer={
                "path": str(output.resolve()),
                "name": tokenizer.name_or_path,
                "fingerprint": tokenizer_fingerprint(tokenizer),
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
        )
    return MergeResult(
        str(output),
        recipe.method,
        described,
        str(base.path) if base else None,
        len(shapes),
        sum(math.prod(s) for s in shapes.values()),
        time.perf_counter() - started,
        settings["parameters"] if recipe.method != "linear" else {},  # linear's weights are in the table
    )
