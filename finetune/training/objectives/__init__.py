"""What a run optimizes: an objective gives each micro-batch's loss and how a global batch is counted,
and sets up what it holds beside the policy (base.py: the interface the loop asks, in the order it asks).
The loop asks it; it never asks the loop. sft.py: next-token loss on target tokens; dpo.py: preference
pairs (DPO, IPO, SimPO) and their reference; grpo.py: group relative policy optimization (its rollout
phase generates the step's completions, scores and weighs them); reward.py: a reward model on preference
pairs (Bradley-Terry); kto.py: KTO on unpaired rows, with DPO's reference; distill.py: on-policy
distillation from a teacher (generalized JSD on the student's own completions)."""

from __future__ import annotations

from finetune.training.objectives.base import Basic, Context, Objective
from finetune.training.objectives.distill import Distill
from finetune.training.objectives.dpo import DPO
from finetune.training.objectives.grpo import GRPO
from finetune.training.objectives.kto import KTO
from finetune.training.objectives.reward import Reward
from finetune.training.objectives.sft import SFT

__all__ = ["Basic", "Context", "DPO", "Distill", "GRPO", "KTO", "Objective", "Reward", "SFT", "objective_for"]


# One entry per objective (its recipe rules: finetune/objective_rules, the same names)
OBJECTIVES = {cls.name: cls for cls in (SFT, DPO, GRPO, Reward, KTO, Distill)}


def objective_for(recipe) -> Objective:
    """The recipe's objective, before the model loads (DPO builds its reference in after_prepare)."""
    return OBJECTIVES[recipe.objective](recipe)
