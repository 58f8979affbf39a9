"""Recipe loading: key-path errors with did-you-mean, strict types, --set overrides, TOML syntax errors."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from conftest import REPO
from pydantic import Field

from smolctl.errors import UserError
from smolctl.recipe import Section, load_recipe


class Training(Section):
    steps: int = 10
    micro_batch: int = 1
    lr: float = Field(1e-3, gt=0)
    betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    precision: Literal["fp32", "bf16"] = "fp32"


class Stage(Section):
    name: str
    start_step: int = 0


class Recipe(Section):
    training: Training = Training()
    stages: list[Stage] = []


def _recipe(tmp_path, text):
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def test_valid_recipe_with_overrides(tmp_path):
    path = _recipe(tmp_path, "[training]\nsteps = 5\nlr = 3e-4\n[[stages]]\nname = 'a'\n[[stages]]\nname = 'b'\n")
    recipe = load_recipe(Recipe, path, ["training.steps=200", "training.lr=1", "stages.1.start_step=50"])
    assert recipe.training.steps == 200 and recipe.training.lr == 1.0 and recipe.stages[1].start_step == 50


@pytest.mark.parametrize(
    "text, message",
    [
        ('[training]\nmicro_batch = "3"\n', "training.micro_batch: expected int, got '3'"),
        ("[training]\nmicro_bach = 3\n", "training.micro_bach: unknown key — did you mean 'micro_batch'?"),
        ("[trainin]\nsteps = 3\n", "trainin: unknown key — did you mean 'training'?"),
        (
            '[training]\nprecision = "fp8"\n',
            "training.precision: must be 'fp32' or 'bf16', got 'fp8' — use one of them",
        ),
        ("[training]\nlr = -1\n", "training.lr: must be > 0.0, got -1 — set it to a value > 0.0"),
        ("[training]\nbetas = [0.9]\n", "training.betas: has 1 entry — give it at least 2"),
        ('[training]\nprecision = "bf61"\n', "got 'bf61' — did you mean 'bf16'?"),
        ("[[stages]]\nstart_step = 3\n", "stages[0].name: missing required key"),
        ("[training\nsteps = 3\n", "is not valid TOML"),
    ],
)
def test_errors_name_the_key_path(tmp_path, text, message):
    with pytest.raises(UserError) as info:
        load_recipe(Recipe, _recipe(tmp_path, text))
    assert message in str(info.value) and "r.toml" in str(info.value)


def test_a_misspelt_required_table_is_named_before_the_table_it_leaves_missing(tmp_path):
    class Needs(Section):
        optimizer: Training

    with pytest.raises(UserError) as info:
        load_recipe(Needs, _recipe(tmp_path, "[optimiser]\nlr = 1\n"))
    assert "optimiser: unknown key (and 1 more) — did you mean 'optimizer'?" in str(info.value)


def test_bad_override_syntax(tmp_path):
    with pytest.raises(UserError, match=r"key\.path=value"):
        load_recipe(Recipe, _recipe(tmp_path, ""), ["training.steps"])
    with pytest.raises(UserError, match="index out of range"):
        load_recipe(Recipe, _recipe(tmp_path, "[[stages]]\nname = 'a'\n"), ["stages.3.name=x"])


@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[-0.1, 0.95]"])
def test_adamw_betas_outside_0_1_are_refused(betas):
    """torch takes beta2 = 1.0 and trains on a second moment that never decays: the recipe refuses it."""
    from pathlib import Path

    from smolctl.train.pretrain import load_train_recipe

    recipe = Path(__file__).parent.parent / "recipes" / "smollm3-tiny.toml"
    with pytest.raises(UserError, match=r"optimizer\.betas\[[01]\]: must be"):
        load_train_recipe(recipe, [f"optimizer.betas={betas}"])


def test_token_counts_take_the_playbook_s_suffixes():
    from smolctl.train.config import TrainingSection

    def tokens(value):
        return TrainingSection(tokens=value, micro_batch=1).tokens

    assert [tokens(v) for v in ("11T", "1.1T", "2.359296M", "100B", "100G", "4k", 4096)] == [
        11 * 10**12,
        11 * 10**11,
        2_359_296,
        10**11,
        10**11,
        4000,
        4096,
    ]
    for bad in ("1.2345k", "3x", "1.5"):
        with pytest.raises(ValueError):
            tokens(bad)


def test_a_schedule_key_its_kind_never_reads_is_refused():
    """A cosine run given decay_steps would ignore it without a word."""
    from pydantic import ValidationError

    from smolctl.train.config import ScheduleSection

    with pytest.raises(ValidationError, match="decay_steps: not used by kind = 'cosine' \\(only by 'wsd'\\)"):
        ScheduleSection(kind="cosine", decay_steps=10)
    with pytest.raises(ValidationError, match="min_lr_ratio: not used by kind = 'constant'"):
        ScheduleSection(kind="constant", min_lr_ratio=0.1)
    with pytest.raises(ValidationError, match="decay_rate: not used by kind = 'wsd'"):
        ScheduleSection(decay_rate=0.99)
    assert ScheduleSection(kind="exponential", decay_rate=0.99, min_lr_ratio=0.1).decay_rate == 0.99


def test_paths_in_a_recipe_expand_a_leading_tilde_as_the_shell_would(tmp_path, monkeypatch):
    """TOML strings and --set values are quoted: the shell never expands their `~`. Hub ids are left as they are."""
    from smolctl.data.mix_schedule import MixRecipe
    from smolctl.train.config import load_command_recipe

    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = tmp_path / "sft.toml"
    recipe.write_text(
        (REPO / "recipes" / "sft-tiny.toml").read_text().replace('path = "data/sample/chat"', 'path = "~/chat"')
    )
    overrides = ["model.from=~/runs/base", "model.tokenizer=HuggingFaceTB/SmolLM3-3B"]
    loaded = load_command_recipe("sft", recipe, overrides)
    assert loaded.model.from_ == str(tmp_path / "runs" / "base")
    assert loaded.model.tokenizer == "HuggingFaceTB/SmolLM3-3B"
    assert loaded.data.path == str(tmp_path / "chat")
    mix = tmp_path / "mix.toml"
    mix.write_text(
        (REPO / "recipes" / "demo-mix.toml").read_text().replace('path = "data/sample/web"', 'path = "~/web/*.parquet"')
    )
    assert load_recipe(MixRecipe, mix).sources["web"].path == str(tmp_path / "web" / "*.parquet")


def test_every_path_a_recipe_holds_expands_a_leading_tilde(tmp_path, monkeypatch):
    """Each table's path fields, found by name across every recipe schema, so that a field added later without
    RecipePath (or one this change missed) fails here, not in a user's run."""
    from pydantic import TypeAdapter

    import smolctl.data.mix_schedule
    import smolctl.train.config
    import smolctl.train.merge
    import smolctl.train.rewards  # noqa: F401  (each defines recipe tables)
    from smolctl.recipe import Section

    monkeypatch.setenv("HOME", str(tmp_path))
    tables, pending = set(), [Section]
    while pending:
        for table in pending.pop().__subclasses__():
            tables.add(table)
            pending.append(table)
    names = {"path", "paths", "from_", "tokenizer", "base", "soup", "validation"}
    checked = []
    for table in tables:
        for name, field in table.model_fields.items():
            if name in names and "str" in str(field.annotation):
                value = "~/x" if "list" not in str(field.annotation) else ["~/x"]
                kind = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
                expanded = TypeAdapter(kind).validate_python(value)
                assert expanded in (str(tmp_path / "x"), [str(tmp_path / "x")]), f"{table.__name__}.{name}"
                checked.append(f"{table.__name__}.{name}")
    assert len(checked) >= 14, checked  # the 14 there are when this was written
