"""Reward modelling (objective=reward): a sequence-classification model (transformers'
AutoModelForSequenceClassification, num_labels=1, finetune/model.py load_model) scores each whole
sequence, prompt and response, with one number: its score head's output at the sequence's last token
that is not the pad id (transformers' rule, so config.pad_token_id is set: model.reward_config). The
preference data is DPO's (finetune/data/preference.py): a micro-batch holds pairs as 2n rows, every
pair's chosen sequence then every pair's rejected one, run in ONE forward. The labels only tell a
placeholder pair (keeping ranks in lock-step) from a real one; every token of a sequence is input.

A pair's loss is Bradley-Terry's, as TRL's RewardTrainer defines it (trl 1.16, reward_trainer.py
compute_loss):

    loss = -log sigmoid(r_chosen - r_rejected) + c (r_chosen + r_rejected)^2

with c the recipe's center_rewards_coefficient (TRL's; 0: off). TRL takes the mean over a micro-batch's
pairs; here a global batch is counted in pairs, so the loss the optimizer steps on is the mean over the
global batch's pairs whatever their split into ranks and micro-batches (the same as TRL's when every
micro-batch holds as many pairs). TRL's optional `margin` column is not read.

Metrics (means over the pairs of a step, or of the eval set): accuracy (the share of pairs whose chosen
reward is strictly above the rejected one's, TRL's), margin (r_chosen - r_rejected), mean_reward (over
both sides), rewards/chosen, rewards/rejected. TRL's min_reward and max_reward are not kept: the loop
reduces metrics by sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune import data as D
from finetune.training.objectives.dpo import real_pairs
from finetune.training.objectives.base import Basic

METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, center_coefficient: float = 0.0) -> torch.Tensor:
    """Per-pair Bradley-Terry losses from the pairs' rewards [n], [n]; with TRL's centring term."""
    losses = -F.logsigmoid(chosen - rejected)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[len(METRICS), n] float64: each pair's value of each metric."""
    chosen, rejected = chosen.detach().double(), rejected.detach().double()
    return torch.stack([(chosen > rejected).double(), chosen - rejected, (chosen + rejected) / 2, chosen, rejected])


def rewards(model, batch: dict) -> torch.Tensor:
    """Every row's reward [rows], float32: the score head's output at its last non-pad token."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits[:, 0].float()


class Reward(Basic):
    name = "reward"
    metrics = METRICS
    shown = {"accuracy": "acc", "margin": "margin"}
    panels = (("loss", "Bradley-Terry loss (mean per pair)", "loss"),
              ("accuracy: the share of pairs scored chosen above rejected", "accuracy", "accuracy"))
    generates = False  # a sequence-classification model scores; eval samples are skipped

    def __init__(self, recipe):
        self.center = recipe.center_rewards_coefficient

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch's pairs; its metrics' sums are kept for take_metrics."""
        scores = rewards(model, batch)
        n = scores.shape[0] // 2
        chosen, rejected = scores[:n], scores[n:]
        real = real_pairs(batch).to(scores.device)
        sums_now = (pair_metrics(chosen, rejected) * real).sum(-1)
        self.sums = sums_now if self.sums is None else self.sums + sums_now
        return (pair_losses(chosen, rejected, self.center) * real).sum()

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [pairs, tokens, input tokens], float64, summed over
        ranks; a reward model reads every token of a sequence, so both token counts are its input tokens."""
        inputs = sum(D.input_tokens(b) for b in micro_batches)
        return torch.tensor([sum(int(real_pairs(b).sum()) for b in micro_batches), inputs, inputs],
                            dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        return int(real_pairs(batch).sum())
