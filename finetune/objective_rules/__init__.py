"""The recipe rules an objective owns, one module per objective, asked by recipe.validate as it asks the
strategy (finetune/strategy): which keys belong to the objective and what it cannot take. They sit on the
ground floor, beside recipe.py, so that validate reaches them before anything loads; the objectives
themselves (finetune/training/objectives) sit above and read the same recipe. grpo.py: GRPO's keys and
its generation backend's (generation_backend=vllm); distill.py: on-policy distillation's. DPO's and the
reward model's rules are still in recipe.py."""

from __future__ import annotations

from finetune.objective_rules import distill, grpo


def check(recipe, strategy) -> None:
    """Every objective's own rules that live here (each checks that its keys are left at their defaults
    under another objective): a RecipeError naming the key, the value and what is allowed."""
    grpo.check(recipe, strategy)
    distill.check(recipe, strategy)
