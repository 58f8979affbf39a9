"""TOML recipes: load, apply `--set key.path=value` overrides, validate against a pydantic schema.

Every stage that takes a recipe declares its schema as pydantic models built on `Section` (unknown keys are
errors, types are strict) and calls `load_recipe`. Errors name the file and the key path, with a did-you-mean
for typos: `recipe.toml: training.micro_batch: expected int, got '3'`.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from smolctl.errors import UserError

ModelT = TypeVar("ModelT", bound=BaseModel)

RecipePath = Annotated[str, AfterValidator(os.path.expanduser)]
"""A path (or hub id) in a recipe: a leading `~` or `~user` is expanded as the shell would, which it never does
inside a TOML string or a --set value."""


class Section(BaseModel):
    """Base of every recipe table: unknown keys are errors and values are not coerced from strings."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(path, "no such recipe file", "check the path (recipes/ has examples)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(path, f"is not valid TOML: {exc}", "fix the syntax at that line") from exc
    except UnicodeDecodeError as exc:
        raise UserError(path, "is not a text file", "pass a TOML recipe") from exc


def parse_override(text: str) -> tuple[list[str], Any]:
    """'training.steps=200' → (['training', 'steps'], 200). The value is read as TOML, else kept as a string."""
    if "=" not in text:
        raise UserError("--set", f"{text!r} is not key.path=value", "write e.g. --set training.steps=200")
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".")]
    if not all(path):
        raise UserError("--set", f"{key!r} is not a key path", "write e.g. --set training.steps=200")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_index(part, path[: i + 1], len(node))]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise UserError(
                    "--set", f"{'.'.join(path[: i + 1])} is a value, not a table", "set a key inside a table"
                )
        last = path[-1]
        if isinstance(node, list):
            node[_index(last, path, len(node))] = value
        else:
            node[last] = value
    return data


def _index(part: str, path: list[str], length: int) -> int:
    if not part.isdigit() or int(part) >= length:
        raise UserError(
            "--set", f"{'.'.join(path)}: index out of range (the list has {length} entries)", "use 0-based indices"
        )
    return int(part)


_TYPE_NAMES = {
    "int_type": "int",
    "int_parsing": "int",
    "float_type": "float",
    "float_parsing": "float",
    "string_type": "string",
    "bool_type": "bool",
    "bool_parsing": "bool",
    "list_type": "list",
    "dict_type": "table",
    "model_type": "table",
    "model_attributes_type": "table",
    "tuple_type": "list",
}


def _format_loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """Field names of the (sub)model that the location points into, for did-you-mean."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        info = current.model_fields.get(part)
        if info is None:
            break
        current = _inner_model(info.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def describe_error(model: type[BaseModel], error: dict) -> tuple[str, str | None]:
    """What is wrong at the error's key path, and what to do about it."""
    loc = error["loc"]
    where = _format_loc(loc) or "(top level)"
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        known = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return f"{where}: unknown key", hint
    if kind == "missing":
        return f"{where}: missing required key", "add it to the recipe"
    if kind in _TYPE_NAMES:
        return f"{where}: expected {_TYPE_NAMES[kind]}, got {got!r}", f"write a TOML {_TYPE_NAMES[kind]} there"
    if kind in _BOUNDS:
        bound = f"{_BOUNDS[kind]} {next(iter(ctx.values()))}"
        return f"{where}: must be {bound}, got {got!r}", f"set it to a value {bound}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", ctx.get("expected", ""))
        close = difflib.get_close_matches(str(got), choices, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "use one of them"
        return f"{where}: must be {ctx.get('expected')}, got {got!r}", hint
    if kind == "too_short":
        return f"{where}: has {_entries(ctx.get('actual_length'))}", f"give it at least {ctx.get('min_length')}"
    if kind == "too_long":
        return f"{where}: has {_entries(ctx.get('actual_length'))}", f"give it at most {ctx.get('max_length')}"
    if kind in ("value_error", "assertion_error"):  # smolctl's own checks: their message says what to give
        return f"{where}: {error['msg'].removeprefix('Value error, ').removeprefix('Assertion failed, ')}", None
    return f"{where}: {error['msg']}", "change it in the recipe or with --set"


def _entries(count: int | None) -> str:
    return "1 entry" if count == 1 else f"{count} entries"


def validate(model: type[ModelT], data: dict, source: str | Path) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A misspelt table is both an unknown key and a missing one: the misspelling is the one to name.
        errors = sorted(exc.errors(), key=lambda error: error["type"] != "extra_forbidden")
        what, fix = describe_error(model, errors[0])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(source, what + more, fix) from exc


def load_recipe(model: type[ModelT], path: str | Path, overrides: Sequence[str] = ()) -> ModelT:
    """Read a TOML recipe, apply --set overrides and validate it. Errors name the file and key path."""
    data = apply_overrides(load_toml(path), overrides)
    return validate(model, data, path)
