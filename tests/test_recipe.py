"""Recipes: loading by name and by path, typed key=value overrides, and every user error as one
RecipeError whose message names the key, the bad value and what would work."""

import dataclasses
import importlib
import textwrap
from pathlib import Path

import pytest
import torch

from finetune.recipe import (
    RECIPES_DIR,
    Recipe,
    RecipeError,
    apply_overrides,
    available_recipes,
    load_recipe_module,
    resolve,
    validate,
)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------- loading


def test_load_tiny_by_name():
    r = load_recipe_module("tiny")
    assert isinstance(r, Recipe)
    assert r == importlib.import_module("recipes.tiny").recipe
    assert r != Recipe()
    assert r.model == "builtin:tiny-llama"
    assert r.dataset == "builtin:tiny-tasks"
    assert r.mixed_precision == "no"  # runs on a CPU-only machine
    assert "tiny" in available_recipes()
    assert validate(r) is r


def test_load_tiny_by_file_path():
    by_path = load_recipe_module(str(RECIPES_DIR / "tiny.py"))
    assert by_path == load_recipe_module("tiny")


def test_derived_recipe_file(tmp_path):
    path = write(tmp_path / "mine.py", """
        from dataclasses import replace
        from recipes.tiny import recipe as base
        recipe = replace(base, lr=1.0)
    """)
    r = resolve(str(path), [])
    tiny = load_recipe_module("tiny")
    assert r.lr == 1.0
    assert dataclasses.replace(r, lr=tiny.lr) == tiny


def test_resolve_applies_overrides_on_a_file(tmp_path):
    path = write(tmp_path / "mine.py", """
        from dataclasses import replace
        from recipes.tiny import recipe as base
        recipe = replace(base, lr=1.0)
    """)
    r = resolve(str(path), ["lr=0.5", "seed=7"])
    assert r.lr == 0.5 and r.seed == 7


# ---------------------------------------------------------------- overrides, typed by field


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("false", False), ("1", True), ("0", False), ("True", True), ("FALSE", False),
])
def test_bool_overrides(text, expected):
    r = apply_overrides(Recipe(), [f"packing={text}"])
    assert r.packing is expected


@pytest.mark.parametrize("text,expected", [("100", 100), ("1e3", 1000), (" 7 ", 7)])
def test_int_overrides(text, expected):
    r = apply_overrides(Recipe(), [f"max_steps={text}"])
    assert r.max_steps == expected and type(r.max_steps) is int


@pytest.mark.parametrize("text,expected", [("1e-5", 1e-5), ("0.25", 0.25), ("3", 3.0)])
def test_float_overrides(text, expected):
    r = apply_overrides(Recipe(), [f"lr={text}"])
    assert r.lr == expected and type(r.lr) is float


def test_str_overrides_keep_text_verbatim():
    r = apply_overrides(Recipe(), ["output_dir=runs/a=b", "strategy=fsdp"])
    assert r.output_dir == "runs/a=b"  # split on the first '=' only
    assert r.strategy == "fsdp"


def test_override_leaves_base_unchanged():
    base = load_recipe_module("tiny")
    before = base.lr
    changed = apply_overrides(base, ["lr=1e-5"])
    assert changed.lr == 1e-5 and base.lr == before != 1e-5


def test_later_override_wins():
    assert apply_overrides(Recipe(), ["seed=1", "seed=2"]).seed == 2


# ---------------------------------------------------------------- errors


def error_of(name_or_overrides, overrides=None) -> str:
    if isinstance(name_or_overrides, list):
        name, overrides = "tiny", name_or_overrides
    else:
        name = name_or_overrides
    with pytest.raises(RecipeError) as info:
        resolve(name, overrides or [])
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_unknown_recipe_lists_available_and_suggests():
    msg = error_of("tiyn")
    assert "'tiyn'" in msg
    assert "did you mean tiny?" in msg
    assert f"available: {', '.join(available_recipes())};" in msg


def test_unknown_recipe_without_close_match_still_lists_available():
    msg = error_of("zzzzzzzz")
    assert "did you mean" not in msg
    assert f"available: {', '.join(available_recipes())};" in msg


def test_missing_recipe_file(tmp_path):
    msg = error_of(str(tmp_path / "nope.py"))
    assert "nope.py" in msg and "does not exist" in msg


@pytest.mark.parametrize("key,suggestion", [("lrr", "lr"), ("micro_batch", "micro_batch_size"),
                                            ("stratgy", "strategy")])
def test_unknown_key_suggests(key, suggestion):
    msg = error_of([f"{key}=1"])
    assert f"unknown recipe key '{key}'" in msg
    assert f"did you mean {suggestion}?" in msg


@pytest.mark.parametrize("key,suggestion", [
    ("learning_rate", "lr"), ("num_train_epochs", "epochs"),
    ("gradient_accumulation_steps", "grad_accum (or global_batch_size, from which grad_accum is derived)"),
    ("per_device_train_batch_size", "micro_batch_size")])
def test_the_trainers_names_point_at_ours(key, suggestion):
    """What a user of transformers' Trainer or TRL types; no close spelling of ours to suggest."""
    from finetune.recipe import FIELDS, PEER_NAMES

    msg = error_of([f"{key}=1"])
    assert msg.startswith(f"unknown recipe key '{key}' (the Trainer's and TRL's name); did you mean {suggestion}?"), msg
    assert all(ours.split()[0] in FIELDS for ours in PEER_NAMES.values()) and not set(PEER_NAMES) & set(FIELDS)


def test_a_recipe_files_unknown_key_is_named_as_the_command_line_names_it(tmp_path):
    """Recipe(learning_rate=...) in a recipe file was a TypeError line without the hint the command line
    gives: now the same hint, with the file's line; a misspelt DataSource field likewise."""
    from finetune.recipe import load_recipe_module

    path = tmp_path / "my_sft.py"
    path.write_text("from finetune.recipe import DataSource, Recipe\n\nrecipe = Recipe(\n    learning_rate=1e-4)\n")
    with pytest.raises(RecipeError) as e:
        load_recipe_module(str(path))
    assert str(e.value) == (f"recipe {path} line 3: unknown recipe key 'learning_rate' (the Trainer's and TRL's "
                            "name); did you mean lr? (see finetune/recipe.py for all keys)")
    assert str(e.value).endswith(error_of(["learning_rate=1e-4"]))
    path.write_text("from finetune.recipe import DataSource, Recipe\nrecipe = Recipe(datasets=[DataSource('a.jsonl', "
                    "colums={})])\n")
    with pytest.raises(RecipeError, match=rf"^recipe {path} line 2: DataSource has no field 'colums'; did you mean "
                                          "columns\\? \\(fields: path, format,"):
        load_recipe_module(str(path))
    path.write_text("from finetune.recipe import Recipe\nrecipe = Recipe(lr=len(3))\n")  # another TypeError: as was
    with pytest.raises(RecipeError, match=r"failed to import: TypeError: object of type 'int' has no len\(\)"):
        load_recipe_module(str(path))


def test_override_without_equals():
    msg = error_of(["lr"])
    assert "'lr'" in msg and "key=value" in msg


@pytest.mark.parametrize("override,expected", [
    ("max_steps=abc", "max_steps=abc: expected an integer"),
    ("max_steps=1.5", "max_steps=1.5: expected an integer"),
    ("lr=fast", "lr=fast: expected a number"),
    ("packing=maybe", "packing=maybe: expected a boolean"),
])
def test_wrong_type(override, expected):
    assert expected in error_of([override])


def test_out_of_choices_names_allowed_values():
    msg = error_of(["strategy=zero4"])
    assert "strategy=zero4" in msg
    assert "ddp, fsdp, hsdp, zero1, zero2, zero3" in msg


@pytest.mark.parametrize("override,expected", [
    ("micro_batch_size=0", "micro_batch_size=0: must be >= 1"),
    ("eval_fraction=0.9", "eval_fraction=0.9: must be <= 0.5"),
    ("lr=-1", "must be >= 0"),
])
def test_out_of_range(override, expected):
    assert expected in error_of([override])


def test_wrong_type_in_recipe_file(tmp_path):
    path = write(tmp_path / "typed.py", """
        from finetune.recipe import Recipe
        recipe = Recipe(micro_batch_size="8")
    """)
    assert "micro_batch_size='8': expected an integer" in error_of(str(path))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "ddp"])
def test_offload_params_needs_sharded_params(strategy):
    msg = error_of([f"strategy={strategy}", "offload_params=cpu"])
    assert f"offload_params=cpu with strategy={strategy}" in msg
    assert "zero3" in msg and "fsdp" in msg


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_offload_params_cpu_allowed_when_sharded(strategy):
    assert resolve("tiny", [f"strategy={strategy}", "offload_params=cpu"]).offload_params == "cpu"


def test_offload_optimizer_with_fsdp_points_to_offload_params():
    msg = error_of(["strategy=fsdp", "offload_optimizer=cpu"])
    assert "offload_optimizer=cpu with strategy=fsdp" in msg
    assert "offload_params=cpu" in msg


def test_offload_optimizer_with_ddp_points_to_zero():
    msg = error_of(["strategy=ddp", "offload_optimizer=cpu"])
    assert "offload_optimizer=cpu with strategy=ddp" in msg
    assert "zero2 or zero3" in msg


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_offload_optimizer_cpu_allowed_with_zero(strategy):
    assert resolve("tiny", [f"strategy={strategy}", "offload_optimizer=cpu"]).offload_optimizer == "cpu"


@pytest.mark.parametrize("override", ["offload_params=nvme", "offload_optimizer=nvme"])
def test_nvme_needs_nvme_path(override, tmp_path):
    assert "nvme_path" in error_of(["strategy=zero3", override])
    ok = resolve("tiny", ["strategy=zero3", override, f"nvme_path={tmp_path}"])
    assert ok.nvme_path == str(tmp_path)


def test_offload_optimizer_nvme_needs_zero3(tmp_path):
    msg = error_of(["strategy=zero2", "offload_optimizer=nvme", f"nvme_path={tmp_path}"])
    assert "offload_optimizer=nvme with strategy=zero2" in msg


def test_offload_params_nvme_not_with_fsdp(tmp_path):
    msg = error_of(["strategy=fsdp", "offload_params=nvme", f"nvme_path={tmp_path}"])
    assert "strategy=fsdp" in msg and "offload_params=cpu" in msg


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_ddp_shard_optimizer_only_with_ddp(strategy):
    msg = error_of([f"strategy={strategy}", "ddp_shard_optimizer=true"])
    assert f"ddp_shard_optimizer=true with strategy={strategy}" in msg
    assert resolve("tiny", ["strategy=ddp", "ddp_shard_optimizer=true"]).ddp_shard_optimizer is True


def test_warmup_longer_than_max_steps():
    msg = error_of(["warmup_steps=20", "max_steps=5"])
    assert "warmup_steps=20" in msg and "max_steps=5" in msg


def test_dataset_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    msg = error_of([f"dataset={missing}"])
    assert f"dataset={missing}: no such file or directory" in msg


def test_eval_dataset_path_that_does_not_exist(tmp_path):
    msg = error_of([f"eval_dataset={tmp_path / 'eval.jsonl'}"])
    assert msg.startswith("eval_dataset=") and "no such file" in msg


def test_dataset_with_unsupported_extension(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("hello\n")
    msg = error_of([f"dataset={path}"])
    assert "unsupported file type" in msg and ".jsonl" in msg


def test_existing_dataset_file_accepted(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "hi"}\n')
    assert resolve("tiny", [f"dataset={path}"]).dataset == str(path)


def test_unknown_builtin_dataset_and_model():
    assert "builtin:tiny-tasks" in error_of(["dataset=builtin:nope"])
    assert "builtin:tiny-llama" in error_of(["model=builtin:nope"])


def test_local_model_dir_that_does_not_exist(tmp_path):
    msg = error_of([f"model={tmp_path / 'missing-model'}"])
    assert "no such directory" in msg


def test_hub_ids_are_not_checked_locally():
    r = resolve("tiny", ["model=org/name", "dataset=org/data"])
    assert r.model == "org/name" and r.dataset == "org/data"


def test_recipe_file_with_syntax_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("from finetune.recipe import Recipe\n\nrecipe = Recipe(lr=1e-5\n")
    msg = error_of(str(path))
    assert str(path) in msg
    assert "syntax error on line 3" in msg


def test_recipe_file_that_raises_on_import(tmp_path):
    path = write(tmp_path / "raises.py", """
        import no_such_module_anywhere
    """)
    msg = error_of(str(path))
    assert str(path) in msg and "ModuleNotFoundError" in msg and "no_such_module_anywhere" in msg


def test_recipe_file_without_recipe(tmp_path):
    path = write(tmp_path / "empty.py", """
        from finetune.recipe import Recipe
        other = Recipe()
    """)
    msg = error_of(str(path))
    assert str(path) in msg and "must define `recipe" in msg and "NoneType" in msg


def test_recipe_file_with_recipe_of_wrong_type(tmp_path):
    path = write(tmp_path / "dict.py", """
        recipe = {"lr": 1.0}
    """)
    assert "(found dict)" in error_of(str(path))


# ---------------------------------------------------------------- AdamW's bounds: a first update that is finite


@pytest.mark.parametrize("overrides,words", [
    (["adam_eps=0"], "adam_eps=0.0: must be > 0 (at least 1.18e-38"),
    (["adam_eps=1e-46"], "adam_eps=1e-46: must be > 0"),  # > 0, but 0 in float32
    (["adam_beta1=1"], "adam_beta1=1.0: must be >= 0 and < 1"),
    (["adam_beta2=1.0"], "adam_beta2=1.0: must be >= 0 and < 1"),
    (["lr=1e38"], "lr=1e+38 with adam_beta1=0.9 and weight_decay=0.0: the first update would move a weight by up "
                  "to max(lr / (1 - adam_beta1), lr x weight_decay) = 1e+39, beyond float32's largest number"),
    (["lr=1e30", "weight_decay=1e10"], "lr=1e+30 with adam_beta1=0.9 and weight_decay=10000000000.0"),
])
def test_adam_settings_whose_first_update_is_not_finite_are_refused(overrides, words):
    assert error_of(overrides).startswith(words)


def _first_adamw_step(lr=1e-3, eps=1e-8, betas=(0.9, 0.999), weight_decay=0.0, foreach=True):
    """One real torch.optim.AdamW step (what every strategy runs) on float32 weights, one of which
    gets a zero gradient (an embedding row no token of the batch uses)."""
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p], lr=lr, eps=eps, betas=betas, weight_decay=weight_decay, foreach=foreach)
    p.grad = torch.tensor([1.0, -2.0, 0.0, 3.0])
    optimizer.step()
    return p.detach()


@pytest.mark.parametrize("foreach", [True, False])
def test_the_bounds_are_where_adamw_stops_being_finite(foreach):
    from finetune.recipe import FLOAT32_MAX, FLOAT32_TINY

    assert FLOAT32_MAX == torch.finfo(torch.float32).max and FLOAT32_TINY == torch.finfo(torch.float32).tiny
    # adam_eps: 0 turns the zero-gradient weight into 0/0 = NaN with everything else finite; the smallest
    # accepted value does not
    assert torch.isnan(_first_adamw_step(eps=0.0, foreach=foreach)[2])
    assert resolve("tiny", [f"adam_eps={FLOAT32_TINY}"]).adam_eps == FLOAT32_TINY
    assert torch.isfinite(_first_adamw_step(eps=FLOAT32_TINY, foreach=foreach)).all()
    # lr: the largest accepted lr still steps finitely; 1% more (refused) overflows torch's step size
    largest = FLOAT32_MAX * (1 - 0.9) * 0.999
    assert resolve("tiny", [f"lr={largest!r}"]).lr == largest
    assert torch.isfinite(_first_adamw_step(lr=largest, foreach=foreach)).all()
    assert "beyond float32's largest number" in error_of([f"lr={largest * 1.01!r}"])
    with pytest.raises(RuntimeError, match="overflow"):
        _first_adamw_step(lr=largest * 1.01, foreach=foreach)
    # weight decay scales weights by 1 - lr x weight_decay, refused where that leaves float32
    # weight decay scales weights by 1 - lr x weight_decay, refused where that leaves float32 (torch then
    # either refuses the scalar or writes inf)
    assert "lr x weight_decay" in error_of(["lr=1e30", "weight_decay=1e9"])
    try:
        assert not torch.isfinite(_first_adamw_step(lr=1e30, weight_decay=1e9, foreach=foreach)).all()
    except RuntimeError as e:
        assert "overflow" in str(e)
    assert torch.isfinite(_first_adamw_step(lr=1e30, weight_decay=1e8 * 0.3, foreach=foreach)).all()
    assert resolve("tiny", ["lr=1e30", "weight_decay=3e7"]).weight_decay == 3e7


def test_every_recipe_value_is_one_a_tracker_takes():
    """TensorBoard's hyper-parameters take int, float, str or bool: a recipe with a mapping (columns) or a
    None in it failed at the trackers' start (report_to=tensorboard) before its first step."""
    from finetune.training.metrics import tracker_value

    r = Recipe(columns={"label": "thumbs"}, objective="kto", dataset="data.jsonl")
    values = {k: tracker_value(v) for k, v in r.to_dict().items()}
    assert all(isinstance(v, bool | int | float | str) for v in values.values()), \
        {k: v for k, v in values.items() if not isinstance(v, bool | int | float | str)}
    assert values["columns"] == '{"label": "thumbs"}'
