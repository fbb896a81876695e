"""Preference tuning: a micro-batch holds pairs (its rows: every pair's chosen sequence, then every
pair's rejected one, finetune/data/batches.py collate_pairs), run in ONE forward; each sequence is
scored by its summed log-probability of its response tokens (loss.sequence_logps). A pair's loss
compares the policy's margin between chosen and rejected with the reference's:

    sigmoid (DPO):  -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z),   z = (pc - pr) - (rc - rr)
    ipo:            (z - 1 / (2 beta))^2, on log-probs averaged per response token
    simpo:          the sigmoid form on z = pc - pr - gamma / beta, log-probs averaged per token, no reference

with pc, pr the policy's and rc, rr the reference's log-probs of chosen and rejected, s the label
smoothing; TRL's DPOTrainer (sigmoid, ipo) and CPOTrainer (simpo) formulas, compared step by step in
bench/studies/dpo_vs_trl.py. A global batch is counted in pairs: the loss the optimizer steps on is the mean
over its pairs whatever their split into ranks and micro-batches, as SFT's is over target tokens.
The metrics are TRL's: rewards/chosen = beta (pc - rc) on summed log-probs (also under ipo; SimPO:
beta pc, averaged), rewards/rejected, rewards/accuracies (chosen's reward strictly above rejected's: 0
at the first step, where policy and reference agree), rewards/margins, logps/chosen, logps/rejected
(summed; SimPO's averaged). Label smoothing is conservative DPO's (Mitchell 2023), as TRL's sigmoid had
it before 1.0.

The reference (finetune/training/reference.py; which one: recipe.reference_kind) is the objective's to set up:
a precompute_reference run's file is looked for before the model loads (a resume's must be the very
file its run started with: refused then, not after the load), and after the strategy has prepared the
policy the reference is built, or the log-probs are computed with the policy (where no file was
found), read, checked and attached to the pairs.

Under sequence parallelism (finetune/sequence_parallel.py) each rank holds a slice of every sequence:
the log-probs are the whole rows' (SP.row_logps sums the shards' over the SP group, with a backward),
and the first rank of each group counts the pairs' losses, metrics and number (SP.counts_pairs)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.data import IGNORE
from finetune.training.metrics import log
from finetune.training.objectives.base import Basic, Context
from finetune.recipe import reference_kind
from finetune.training.reference import (attach, build_reference, check_precomputed, precompute, precompute_key,
                                precomputed_path, read_precomputed, split_passes)
from finetune.checkpointing.resume import reference_record

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def real_pairs(batch: dict) -> torch.Tensor:
    """Which pairs of a micro-batch are real: a placeholder pair (keeping ranks in lock-step) carries
    no target token. A sequence-parallel shard carries them, computed on the whole rows."""
    if "real_pairs" in batch:
        return batch["real_pairs"]
    n = batch["input_ids"].shape[0] // 2
    return (batch["labels"][:n, 1:] != IGNORE).any(-1)


def pair_losses(kind: str, beta: float, policy: torch.Tensor, reference: torch.Tensor | None, *,
                label_smoothing: float = 0.0, gamma: float = 0.0) -> torch.Tensor:
    """Per-pair losses from [2n] log-probs (chosen first), already averaged per token where the loss
    asks for it (ipo, simpo)."""
    n = policy.shape[0] // 2
    pc, pr = policy[:n], policy[n:]
    if kind == "simpo":
        z = pc - pr - gamma / beta
    else:
        z = (pc - pr) - (reference[:n] - reference[n:])
    if kind == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing


class DPO(Basic):
    name = "dpo"
    metrics = METRICS
    shown = {"rewards/accuracies": "acc", "rewards/margins": "margin"}
    panels = (("loss", "preference loss (mean per pair)", "loss"),
              ("accuracy: the share of pairs whose implicit reward ranks chosen above rejected", "accuracy",
               "rewards/accuracies"),
              ("margin: implicit reward of chosen minus rejected, beta x log-ratio to the reference",
               "reward margin (mean per pair)", "rewards/margins"))
    identifies_model = True  # the precomputed log-probs are keyed by it; a resume reads the frozen reference again

    def __init__(self, recipe, reference=None):
        """reference: what gives the reference's log-probs of a batch (finetune/training/reference.py); None for
        SimPO, which has none."""
        self.kind, self.beta = recipe.dpo_loss, recipe.dpo_beta
        self.label_smoothing, self.gamma = recipe.dpo_label_smoothing, recipe.simpo_gamma
        self.per_token = recipe.dpo_loss in ("ipo", "simpo")
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        self.recipe, self.reference = recipe, reference
        self.precomputed = None  # precompute_reference: (key, the places the file may be, the one found, its sha256)
        self.sums = None

    def before_model(self, context: Context) -> None:
        """precompute_reference: the file that holds the log-probs, if one does (and, on resume, the one
        its checkpoint names, or a one-line refusal)."""
        if reference_kind(self.recipe) != "precomputed":
            return
        r = context.recipe
        key = self.reference_key(context)
        paths = precomputed_path(r, context.datasets, key)
        self.precomputed = (key, paths, *check_precomputed(r, paths, reference_record(context.plan.resume)))

    def after_prepare(self, context: Context, model) -> dict:
        """The reference (finetune/training/reference.py); precompute_reference: the pairs with their reference
        log-probs, computed now with the policy (which has not trained yet: it is the reference) where
        no file was found. Returns what recipe.json and the checkpoints record: the file and its sha256."""
        accelerator, r = context.accelerator, context.recipe
        self.reference = build_reference(context.plan, accelerator, context.model_path, context.config,
                                         context.weights_on_this_rank)
        if self.reference is not None and accelerator.is_main_process:
            log.info(f"reference: {self.reference.kind}")
        if self.precomputed is None:
            return {}
        key, paths, found, sha256 = self.precomputed
        if found is None:
            t0 = time.perf_counter()
            found = precompute(accelerator, model, self.reference_passes(context), r, context.tokenizer.pad_token_id,
                               paths, context.to_device, key, context.sp)
            if accelerator.is_main_process:
                log.info(f"reference log-probs of every pair computed in {time.perf_counter() - t0:.1f}s: {found}")
        values, sha256 = read_precomputed(found, key, sha256)
        self.attach_reference(context, found, values)
        return {"reference_logps": {"path": str(found), "sha256": sha256}}

    def reference_key(self, context: Context) -> dict:
        """What the precomputed log-probs are of (reference.precompute_key): the prepared pairs and the model."""
        return precompute_key(context.recipe, context.datasets, context.identity, context.tokenizer)

    def reference_passes(self, context: Context) -> list[tuple]:
        """What precompute_reference scores: every pair of each split once (reference.split_passes)."""
        return split_passes(context.datasets, context.recipe, context.sp)

    def attach_reference(self, context: Context, path, values: dict) -> None:
        """The precomputed log-probs (read and checked) onto the pairs, as two columns of each split."""
        attach(context.datasets, path, values)

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch's pairs; its metrics' sums are kept for take_metrics."""
        reference = self.reference.logps(model, batch) if self.reference is not None else None
        sums, counts = SP.row_logps(model, batch, self.loss_impl, self.chunk)
        tokens = counts.clamp(min=1)
        if reference is not None:
            reference = reference.to(sums.device)
        if self.per_token:  # each side's log-probs (and log-ratios) averaged over its own response tokens
            losses = pair_losses(self.kind, self.beta, sums / tokens,
                                 reference / tokens if reference is not None else None, gamma=self.gamma)
        else:
            losses = pair_losses(self.kind, self.beta, sums, reference, label_smoothing=self.label_smoothing)
        logps = (sums / tokens if self.kind == "simpo" else sums).detach()
        rewards = self.beta * (logps if reference is None else logps - reference)
        real = real_pairs(batch).to(losses.device) & SP.counts_pairs()
        n = real.shape[0]
        chosen, rejected = rewards[:n], rewards[n:]
        values = torch.stack([chosen, rejected, (chosen > rejected).to(chosen.dtype), chosen - rejected,
                              logps[:n], logps[n:]]).double()
        sums_now = (values * real).sum(-1)
        self.sums = sums_now if self.sums is None else self.sums + sums_now
        return (losses * real).sum()

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [pairs, response tokens, input tokens], float64;
        summed over ranks."""
        return torch.tensor([sum(self.eval_count(b) for b in micro_batches),
                             sum(D.target_tokens(b) for b in micro_batches),
                             sum(D.input_tokens(b) for b in micro_batches)], dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        """The real pairs of a batch (counted by one rank of each sequence-parallel group)."""
        return int(real_pairs(batch).sum()) if SP.counts_pairs() else 0
