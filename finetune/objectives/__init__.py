"""What a run optimizes: an objective gives each micro-batch's loss and how a global batch is counted.
The loop asks it; it never asks the loop. sft.py is the first (next-token loss on target tokens)."""

from __future__ import annotations

from finetune.objectives.sft import SFT


def objective_for(recipe):
    """The recipe's objective (supervised fine-tuning is the only one so far)."""
    return SFT(recipe)
