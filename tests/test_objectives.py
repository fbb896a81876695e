"""The objective interface the loop asks (finetune/training/objectives/base.py), the one rule for which
reference a run holds (recipe.reference_kind) and every part that asks it, and the loop and reporter
naming no objective of their own."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from finetune.memory import holds_reference, load_architecture
from finetune.memory_tables import describe_run
from finetune.training.objectives import DPO, SFT, Objective, objective_for
from finetune.training.objectives.grpo import GRPO
from finetune.recipe import Recipe, RecipeError, reference_kind, validate
from finetune.checkpointing.resume import reads_model_again

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"
DPO_RECIPE = Recipe(model="meta-llama/Llama-2-7b-hf", objective="dpo", mixed_precision="bf16", max_seq_len=1024)


def test_every_objective_answers_the_whole_interface():
    recipes = {SFT: Recipe(), DPO: Recipe(objective="dpo"), GRPO: Recipe(objective="grpo", beta=0.04)}
    for cls, recipe in recipes.items():
        objective = cls(recipe)
        assert isinstance(objective, Objective), cls
        assert set(objective.shown) <= set(objective.metrics), cls  # it shows only metrics it has
        batches = [{"input_ids": torch.zeros(2, 3, dtype=torch.long)}]
        if cls is not GRPO:  # GRPO generates (its rollouts: tests/distributed/test_grpo.py)
            assert objective.rollout(None, 0, batches) is batches and not objective.makes_batches
        assert objective.take_metrics() is None
        if cls is SFT:  # no set-up (DPO's and GRPO's: their distributed runs, tests/distributed/)
            assert objective.before_model(None) is None and objective.after_prepare(None, None) == {}
        if cls is not GRPO:  # the loop's loss eval, as it is (GRPO's eval generates: tests/distributed/test_grpo.py)
            assert objective.evaluate(None, 3, None, lambda: (1.5, {"m": 2.0})) == (1.5, {"m": 2.0})
        assert objective.evaluates
    assert type(objective_for(Recipe(objective="dpo"))) is DPO and type(objective_for(Recipe())) is SFT


def test_the_metrics_reduction_is_the_objectives():
    """SFT and DPO average their sums over the global batch's count; GRPO over the tokens its sums count."""
    sums, count = torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 12.0], dtype=torch.float64), torch.tensor(4.0)
    assert DPO(Recipe(objective="dpo")).means(sums, count) == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    # kl, entropy, tokens, clipped low, high, either, their count; then -low_min, high_max (reduced by max)
    grpo = torch.tensor([1.0, 4.0, 8.0, 2.0, 3.0, 4.0, 8.0, -0.25, 0.5], dtype=torch.float64)
    # then the rollout's metrics (NaN before any rollout)
    assert GRPO(Recipe(objective="grpo", beta=0.04)).means(grpo, count)[:7] == [0.125, 0.5, 0.25, 0.375, 0.5, 0.25, 0.5]
    assert GRPO(Recipe(objective="grpo")).means(grpo, count)[:4] == [0.5, 0.25, 0.375, 0.5]
    assert GRPO(Recipe(objective="grpo")).maxed == 2 and DPO(Recipe(objective="dpo")).maxed == 0


@pytest.mark.parametrize("change,kind", [
    ({}, "frozen"),
    ({"lora": True}, "adapter"),
    ({"precompute_reference": True}, "precomputed"),
    ({"precompute_reference": True, "lora": True}, "precomputed"),
    ({"dpo_loss": "simpo", "dpo_beta": 2.0}, None),
    ({"objective": "sft"}, None),
])
def test_which_reference_is_decided_once_and_every_part_agrees(change, kind):
    """The planner (memory), resume (what it reads from the model again), the run's description and the
    recipe's fsdp_version=1 rule all follow recipe.reference_kind."""
    r = dataclasses.replace(DPO_RECIPE, **change)
    assert reference_kind(r) == kind
    assert holds_reference(r) == (kind == "frozen")
    assert (reads_model_again(r) == "the DPO reference (a frozen copy of the model as training started)") == (
        kind == "frozen")
    if r.objective == "dpo":
        said = {None: "none (reference-free)", "precomputed": "precomputed log-probs",
                "adapter": "the base, adapter disabled", "frozen": "a frozen copy"}[kind]
        assert f"reference: {said}" in describe_run(r, 8, load_architecture(r.model))
    if r.objective == "dpo":
        fsdp1 = dataclasses.replace(r, model="builtin:tiny-llama", mixed_precision="no", max_seq_len=128,
                                    strategy="fsdp", fsdp_version=1)
        if kind == "frozen":
            with pytest.raises(RecipeError, match="frozen reference is sharded by FSDP2 only"):
                validate(fsdp1)
        else:
            validate(fsdp1)

def test_the_progress_line_and_summary_show_the_objectives_chosen_metrics(caplog):
    from finetune.training.metrics import Progress, format_summary

    record = {"loss": 0.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "rewards/accuracies": 0.75,
              "rewards/margins": 0.25, "rewards/chosen": 0.1}
    with caplog.at_level(logging.INFO, logger="finetune"):
        logger = logging.getLogger("finetune")
        propagate, logger.propagate = logger.propagate, True
        try:
            Progress(10, 0, True, DPO.shown).update(1, record)
            Progress(10, 0, True, SFT.shown).update(1, record)
        finally:
            logger.propagate = propagate
    # once each (a handler an earlier test's setup_logging left on the logger may record them twice)
    dpo_line, sft_line = dict.fromkeys(m for m in caplog.messages if m.startswith("step 1/10"))
    assert "loss 0.5000 acc 0.750 margin 0.250 lr" in dpo_line and "chosen" not in dpo_line
    assert "loss 0.5000 lr" in sft_line
    summary = {"steps": 3, "train_seconds": 1.0, "wall_seconds": 2.0, "tokens": 10, "tokens_per_s": 10.0,
               "final_eval_loss": 0.5, "best_eval_loss": 0.4, "final_eval_rewards/accuracies": 0.75,
               "final_eval_rewards/margins": 0.25}
    rows = [" ".join(line.split()) for line in format_summary(summary, DPO.shown).splitlines()]
    assert "eval metrics acc 0.7500, margin 0.2500 (final)" in rows
    assert "eval metrics" not in format_summary(summary, SFT.shown)


def test_the_loop_and_the_reporter_name_no_objective():
    """The loop's set-up asks the objective (objective_for, before_model, after_prepare) and holds no
    objective's rule; metrics.py shows what the objective names."""
    for module in ("training/loop.py", "training/metrics.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & {"dpo", "sft", "grpo", "rewards/accuracies", "rewards/margins"}, module
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"finetune.training.reference", "finetune.training.objectives.dpo",
                                "finetune.checkpointing.resume"}, module
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"precompute_reference", "dpo_loss", "objective_kind"}, module
