"""What a resumed run may change: pure logic on a checkpoint's saved recipe, no training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from finetune.checkpointing.resume import ResumePoint
from finetune.checkpointing.resume import changes as resume_changes
from finetune.recipe import Recipe, RecipeError

SAVED = Recipe(max_steps=12, micro_batch_size=4, global_batch_size=16, lr=1e-3, output_dir="/runs/a")


def point(recipe: Recipe = SAVED, world_size: int = 2) -> ResumePoint:
    return ResumePoint(path=Path("/runs/a/checkpoints/step_000000005"), step=5, world_size=world_size,
                       global_batch_size=16, strategy=recipe.strategy,
                       recipe=json.loads(json.dumps(recipe.to_dict())))


def test_unchanged_recipe_has_nothing_to_say():
    assert resume_changes(point(), SAVED) == []


def test_run_length_and_micro_batch_apply_and_are_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    notes = resume_changes(point(), dataclasses.replace(SAVED, max_steps=20, micro_batch_size=2,
                                                        output_dir="/runs/b", eval_every=3))
    assert notes == ["micro_batch_size: 4 -> 2 (the global batch is kept, accumulation is recomputed)",
                     "max_steps: 12 -> 20 (the run's length; the lr schedule is recomputed for it from this step on)",
                     "eval_every: 100 -> 3 (applies from this step on)"]


@pytest.mark.parametrize("key,value", [("lr", 5e-4), ("warmup_steps", 3), ("lr_scheduler", "linear"),
                                       ("weight_decay", 0.1), ("mixed_precision", "no")])
def test_optimizer_and_schedule_changes_are_refused_not_ignored(key, value):
    with pytest.raises(RecipeError) as e:
        resume_changes(point(), dataclasses.replace(SAVED, **{key: value}))
    old = getattr(SAVED, key)
    assert f"{key}: {old} -> {value}" in str(e.value) and "restore them" in str(e.value)


def test_another_global_batch_is_refused_not_reverted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"global_batch_size=32 \(the checkpoint's global batch is 16\)"):
        resume_changes(point(), dataclasses.replace(SAVED, global_batch_size=32))
    no_fixed_batch = dataclasses.replace(SAVED, global_batch_size=0, grad_accum=2)
    with pytest.raises(RecipeError, match=r"grad_accum=4 \(a global batch of 32; the checkpoint's is 16"):
        resume_changes(point(no_fixed_batch), dataclasses.replace(no_fixed_batch, grad_accum=4))
    # the same global batch asked for another way is fine: 4 x 4 x 1 process = 16
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_changes(point(no_fixed_batch), dataclasses.replace(no_fixed_batch, grad_accum=4)) == []


def test_another_world_size_keeps_the_global_batch_silently():
    unfixed = dataclasses.replace(SAVED, global_batch_size=0, grad_accum=2)
    saved_after_pin = dataclasses.replace(unfixed, global_batch_size=16)  # run.prepare pins it on resume
    assert resume_changes(point(saved_after_pin), unfixed) == []


def test_a_change_of_max_prompt_len_needs_allow_data_change_as_max_seq_len_does():
    """max_prompt_len decides which tokens of a pair's prompt are kept (and so which pairs are dropped):
    a resumed run that changes it trains other tokens at the checkpoint's data position."""
    from finetune.checkpointing.manifest import fingerprint
    from finetune.checkpointing.resume import check_fits

    dpo = dataclasses.replace(SAVED, objective="dpo", max_prompt_len=64)
    resumed = dataclasses.replace(point(dpo), manifest={"fingerprint": fingerprint(dpo)})
    check_fits(resumed, dpo, allow_data_change=False)
    for key, value in (("max_prompt_len", 32), ("max_prompt_len", 0), ("max_seq_len", 1024)):
        with pytest.raises(RecipeError) as e:
            check_fits(resumed, dataclasses.replace(dpo, **{key: value}), allow_data_change=False)
        assert f"{key}: {getattr(dpo, key)} -> {value}" in str(e.value) and "--allow-data-change" in str(e.value)
        check_fits(resumed, dataclasses.replace(dpo, **{key: value}), allow_data_change=True)
    # a checkpoint whose fingerprint predates max_prompt_len: its recipe.json holds the value it trained with
    older = {k: v for k, v in fingerprint(dpo).items() if k != "max_prompt_len"}
    resumed = dataclasses.replace(point(dpo), manifest={"fingerprint": older})
    check_fits(resumed, dpo, allow_data_change=False)
    with pytest.raises(RecipeError, match="max_prompt_len: 64 -> 0"):
        check_fits(resumed, dataclasses.replace(dpo, max_prompt_len=0), allow_data_change=False)
    assert "max_prompt_len" not in fingerprint(SAVED)  # unset, an SFT run's fingerprint is the one it was


def test_every_recipe_key_the_data_preparation_reads_is_a_data_key():
    """The data fingerprint a resume checks holds every key that changes which tokens a step trains:
    each recipe field read by finetune/data/ (and the tokenizer's), but num_proc (the same rows in any
    number of processes) and objective (it only checks the rows' format, a data key)."""
    import re

    import finetune.data
    from finetune.checkpointing.manifest import DATA_KEYS
    from finetune.recipe import FIELDS

    read = {name for path in Path(finetune.data.__file__).parent.glob("*.py")
            for name in re.findall(r"\brecipe\.([a-z_]+)", path.read_text()) if name in FIELDS}
    assert {"max_seq_len", "max_prompt_len", "train_on_prompt", "packing"} <= read
    assert read - {"num_proc", "objective"} | {"tokenizer", "chat_template"} <= set(DATA_KEYS)


def test_a_checkpoint_from_before_a_data_key_existed_still_fits(tmp_path):
    """Checkpoints written before `tokenizer` and `chat_template` joined the data fingerprint lack them:
    they had the defaults, so resuming them with the defaults is no data change."""
    from finetune.checkpointing.manifest import fingerprint
    from finetune.checkpointing.resume import check_fits

    old = {k: v for k, v in fingerprint(SAVED).items() if k not in ("tokenizer", "chat_template")}
    resumed = dataclasses.replace(point(), manifest={"fingerprint": old})  # as resume.find reads it
    check_fits(resumed, SAVED, allow_data_change=False)
    with pytest.raises(RecipeError, match="chat_template"):
        check_fits(resumed, dataclasses.replace(SAVED, chat_template="{{ messages }}"), allow_data_change=False)


@pytest.mark.parametrize("key,value", [("num_generations", 4), ("num_iterations", 2)])
def test_grpo_rollout_keys_are_refused_with_the_route(key, value):
    """GRPO's prompt schedule is global batch / num_generations prompts a step, a rollout serving
    num_iterations steps: either changed, a resumed step would train on other prompts."""
    grpo = dataclasses.replace(SAVED, objective="grpo", reward_funcs=("finetune.rewards:exact_match",),
                               num_generations=8)
    with pytest.raises(RecipeError) as e:
        resume_changes(point(grpo), dataclasses.replace(grpo, **{key: value}))
    assert f"{key}: {getattr(grpo, key)} -> {value}" in str(e.value)
    assert "start a new run with model=OUT" in str(e.value) and "\n" not in str(e.value)
    assert resume_changes(point(grpo), dataclasses.replace(grpo, temperature=0.5)) == [
        "temperature: 1.0 -> 0.5 (applies from this step on)"]
