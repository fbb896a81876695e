"""What a run optimizes: an objective gives each micro-batch's loss and how a global batch is counted.
The loop asks it; it never asks the loop. sft.py: next-token loss on target tokens; dpo.py: preference
pairs (DPO, IPO, SimPO); reward.py: a reward model on preference pairs (Bradley-Terry)."""

from __future__ import annotations

from finetune.objectives.dpo import DPO
from finetune.objectives.reward import Reward
from finetune.objectives.sft import SFT


def objective_for(recipe, reference=None):
    """The recipe's objective; reference: a DPO run's reference (finetune/reference.py build_reference)."""
    if recipe.objective == "dpo":
        return DPO(recipe, reference)
    if recipe.objective == "reward":
        return Reward(recipe)
    return SFT(recipe)
