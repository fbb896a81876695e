"""Supervised fine-tuning: a micro-batch's loss is the next-token cross-entropy summed over its target
tokens (finetune/loss.py), and a global batch is counted in target tokens, so the optimizer steps on
their mean over the whole global batch whatever its split into ranks and micro-batches."""

from __future__ import annotations

import torch

from finetune import data as D
from finetune.model import loss_sum
from finetune.training.objectives.base import Basic


class SFT(Basic):
    """No set-up, no rollout, no metrics of its own beyond the loss (a mixture of experts' router loss
    goes by `aux`)."""
    name = "sft"

    def __init__(self, recipe):
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch (a mixture of experts' router loss goes into aux)."""
        return loss_sum(model, batch, self.loss_impl, self.chunk, aux)

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [what the loss is averaged over (target tokens),
        target tokens, input tokens], float64; the loop sums it over ranks."""
        targets = sum(D.target_tokens(b) for b in micro_batches)
        return torch.tensor([targets, targets, sum(D.input_tokens(b) for b in micro_batches)], dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        """What an eval batch's summed loss is averaged over."""
        return D.target_tokens(batch)
