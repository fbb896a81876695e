"""Non-finite values: refused in the recipe (nan passes every `<` bound, so it is checked by itself),
and during training the loop's skip_nonfinite decides per step, from values every rank shares,
whether an update is skipped or the run stops with one line naming the step and the checkpoint
that is still good (tests/distributed/test_nonfinite.py runs it on real diverging runs)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from finetune.checkpointing.run_state import LoopState
from finetune.training.loop import NonFiniteError, skip_nonfinite
from finetune.recipe import Recipe, RecipeError, apply_overrides, load_recipe_module, validate


@pytest.mark.parametrize("override,words", [
    ("lr=inf", "lr=inf: must be a finite number >= 0.0"),
    ("lr=nan", "lr=nan: must be a finite number >= 0.0"),
    ("max_grad_norm=nan", "max_grad_norm=nan: must be a finite number >= 0.0"),
    ("adam_beta2=-inf", "adam_beta2=-inf: must be a finite number >= 0.0 and <= 1.0"),
    ("weight_decay=inf", "weight_decay=inf: must be a finite number"),
    ("seed=1e14", "seed=100000000000000: must be <= 4294967295"),
    ("seed=4294967296", "seed=4294967296: must be <= 4294967295"),
    ("max_nonfinite_steps=-1", "max_nonfinite_steps=-1: must be >= 0"),
])
def test_non_finite_and_out_of_range_values_are_refused(override, words):
    with pytest.raises(RecipeError) as e:
        validate(apply_overrides(load_recipe_module("tiny"), [override]))
    assert str(e.value).startswith(words), str(e.value)


def test_every_float_field_refuses_nan():
    floats = [f.name for f in dataclasses.fields(Recipe) if f.type in ("float", float)]
    assert {"lr", "max_grad_norm", "eval_fraction", "lora_dropout"} <= set(floats)
    for name in floats:
        with pytest.raises(RecipeError, match=f"^{name}=nan: must be a finite number"):
            validate(dataclasses.replace(load_recipe_module("tiny"), **{name: math.nan}))


def test_largest_seed_is_accepted():
    assert validate(apply_overrides(load_recipe_module("tiny"), ["seed=4294967295"])).seed == 2**32 - 1


def recipe(**kw) -> Recipe:
    return dataclasses.replace(Recipe(), **kw)


def test_finite_steps_pass(tmp_path):
    state = LoopState(step=3)
    assert skip_nonfinite(state, 2.5, torch.tensor(1.0), recipe(), tmp_path) is False
    assert skip_nonfinite(state, 2.5, None, recipe(), tmp_path) is False  # a strategy that reports no norm
    assert state.nonfinite_steps == 0


@pytest.mark.parametrize("loss,norm", [(math.nan, 1.0), (math.inf, 1.0), (2.0, math.nan), (2.0, math.inf)])
def test_a_non_finite_step_stops_the_run_by_default(tmp_path, loss, norm):
    (tmp_path / "checkpoints" / "step_000000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000000004" / "manifest.json").write_text("{}")
    with pytest.raises(NonFiniteError) as e:
        skip_nonfinite(LoopState(step=6), loss, torch.tensor(norm), recipe(lr=1e30), tmp_path)
    message = str(e.value)
    assert isinstance(e.value, RecipeError)  # printed as one `error:` line by run.py, exit code 2
    assert message.startswith("step 7: loss") and "not finite" in message and "\n" not in message
    assert f"the newest checkpoint, {tmp_path / 'checkpoints' / 'step_000000004'}, is from before it" in message
    # the advice names what runs: resuming keeps the checkpoint's lr (resume.changes refuses another), so
    # the checkpoint itself, with the keys a resume may change, or a new run for a lower lr
    assert f"continue from it with --resume {tmp_path / 'checkpoints' / 'step_000000004'}" in message
    assert "max_nonfinite_steps=N" in message and "max_grad_norm" in message
    assert "lr (now 1e+30) start a new run in another output_dir" in message and "--resume auto" not in message


def test_max_nonfinite_steps_skips_that_many_then_stops(tmp_path, caplog):
    state = LoopState(step=2)
    r = recipe(max_nonfinite_steps=2)
    assert skip_nonfinite(state, math.nan, math.nan, r, tmp_path) is True
    state.step += 1
    assert skip_nonfinite(state, 1.0, 2.0, r, tmp_path) is False
    state.step += 1
    assert skip_nonfinite(state, 1.0, math.inf, r, tmp_path) is True
    state.step += 1
    assert "step 3: loss nan" in caplog.text and "update skipped (1 of max_nonfinite_steps=2)" in caplog.text
    with pytest.raises(NonFiniteError, match="^step 6: .*2 such step\\(s\\) were skipped already; .*no checkpoint"):
        skip_nonfinite(state, math.nan, 1.0, r, tmp_path)


def test_fp16_gradient_overflow_is_the_loss_scalers_business(tmp_path):
    """fp16 overflows routinely while the loss scale settles: the scaler (or DeepSpeed) skips those
    steps itself; only a non-finite loss counts."""
    state = LoopState()
    assert skip_nonfinite(state, 3.0, math.inf, recipe(mixed_precision="fp16"), tmp_path) is False
    with pytest.raises(NonFiniteError):
        skip_nonfinite(state, math.nan, math.inf, recipe(mixed_precision="fp16"), tmp_path)


def test_loop_state_of_older_checkpoints_still_loads():
    assert LoopState(**{"step": 4, "tokens": 10, "samples": 16, "best_eval_loss": None}).nonfinite_steps == 0


def test_metrics_file_writes_null_for_nan_and_inf(tmp_path):
    """metrics.jsonl wrote a bare NaN (a step whose every reward was None, a NaN loss), which is not JSON:
    strict readers refuse the whole file. Non-finite values are null now, in lists too."""
    import json

    from finetune.training.metrics import MetricsFile, read_metrics

    path = tmp_path / "metrics.jsonl"
    MetricsFile(path, enabled=True).write({"step": 1, "loss": 0.0, "reward": math.nan, "reward_std": math.inf,
                                           "peak_memory_gib": [1.5, -math.inf], "tokens": 3})

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    strict = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert strict == read_metrics(path) == [{"step": 1, "loss": 0.0, "reward": None, "reward_std": None,
                                             "peak_memory_gib": [1.5, None], "tokens": 3}]
