"""KTO (objective=kto): Kahneman-Tversky optimization on unpaired rows (finetune/data/unpaired.py), each a
prompt and ONE completion labelled desirable or not, as TRL 1.16's KTOTrainer defines it
(trl/trainer/kto_trainer.py _compute_loss). With z = beta (p - r) the completion's implied reward (p, r
the policy's and the reference's summed log-probs of its completion tokens) and z0 = beta x KL:

    kto:               desirable  w_d (1 - sigmoid(z - z0)),   undesirable  w_u (1 - sigmoid(z0 - z))
    apo_zero_unpaired: desirable  w_d (1 - sigmoid(z)),        undesirable  w_u sigmoid(z)

w_d, w_u the recipe's desirable_weight and undesirable_weight. KL is the reference point, TRL's estimate
from mismatched pairs: each row's KL row (its prompt with the completion of the row before it in its
micro-batch as fetched, the first row's with the last's: TRL's rule, finetune/data/unpaired.py) scored by
the policy and the reference, KL = max(0, mean over rows of (p_KL - r_KL)), detached. The training rows
are shuffled, so rollout fetches each step's micro-batches itself and makes their KL rows from them; the
eval split, read in order, carries its KL rows as columns (unpaired.with_kl_rows), paired over chunks of
micro_batch_size rows as TRL pairs its eval set. TRL takes the KL's mean over a micro-batch and its copies
on the other ranks; here it is the mean over the step's whole global batch (computed before the step's
first forward with grad, rollout), so that the loss does not depend on how the batch is split into ranks
and micro-batches (2 processes = 1 process); with grad_accum 1 (one micro-batch per rank and step) it is
TRL's. An eval's KL is its eval set's. A global batch is counted in rows: the loss the optimizer steps on
is the mean over its rows (TRL: the mean over a micro-batch's).

Metrics (TRL's names): rewards/chosen and rewards/rejected (the mean of z over the desirable rows, over
the undesirable ones), rewards/margins (their difference), logps/chosen, logps/rejected (summed log-probs),
kl. A side with no row in the batch has none (NaN, written as null).

The reference is DPO's (finetune/training/reference.py: a frozen copy, the adapter disabled under LoRA,
or precompute_reference: every row's and its KL row's log-probs computed before training: the training
KL rows of each epoch the run reaches, made from its micro-batches as training makes them), set up as DPO
sets it up; a micro-batch is laid out as DPO's pairs are, its rows then their KL rows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.data.unpaired import one_sided, with_kl_rows
from finetune.errors import RecipeError
from finetune.training.objectives.base import Context
from finetune.training.metrics import log
from finetune.training.objectives.dpo import DPO, real_pairs
from finetune.training.reference import attach

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")  # a shard's too


def kto_losses(kind: str, beta: float, policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor | float = 0.0, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-row losses from the rows' summed log-probs [n] (policy, reference), their labels [n] (bool) and
    the KL estimate (kto; apo_zero_unpaired has none)."""
    ratio = policy - reference
    if kind == "kto":
        chosen, rejected = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:
        chosen, rejected = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)


def half(batch: dict, second: bool) -> dict:
    """A micro-batch's rows (second=False) or their KL rows (second=True), as a batch of their own."""
    n = batch["input_ids"].shape[0] // 2
    part = slice(n, 2 * n) if second else slice(0, n)
    return {k: batch[k][part] for k in ROW_KEYS if k in batch}


class KTO(DPO):
    name = "kto"
    metrics = METRICS
    shown = {"kl": "kl", "rewards/margins": "margin"}
    panels = (("loss", "KTO loss (mean per row)", "loss"),
              ("rewards/chosen: beta x log-ratio to the reference of the desirable completions", "reward (mean)",
               "rewards/chosen"),
              ("rewards/rejected: the same of the undesirable completions", "reward (mean)", "rewards/rejected"),
              ("kl: the policy's KL from the reference, estimated on mismatched prompts and completions",
               "KL (nats)", "kl"))

    def __init__(self, recipe, reference=None):
        self.kind, self.beta = recipe.kto_loss, recipe.kto_beta
        self.weights = (recipe.desirable_weight, recipe.undesirable_weight)
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        self.recipe, self.reference = recipe, reference
        self.precomputed = None
        self.sums = None
        self.kl = torch.zeros(())  # the step's (or the eval's) KL estimate, set before its losses
        self.to_device = None  # a batch onto the training device (the loop's, given by before_model)
        # kto: rollout fetches the step's rows itself, to make their KL rows from each micro-batch (TRL's rule)
        self.makes_batches = self.kind == "kto"
        self.batch_schedule, self.total_steps = None, 0
        self.epoch_reference = None  # precomputed, kto: per epoch, [rows, 2] a training row's and its KL row's

    def before_model(self, context: Context) -> None:
        """The eval split's KL rows (with_kl_rows: it is read in order), a line where every training row has one
        label (unpaired.one_sided), then DPO's: the precomputed log-probs' file, if any."""
        r, datasets = context.recipe, context.datasets
        self.to_device = context.to_device
        self.batch_schedule, self.total_steps = context.schedule, context.total_steps
        if self.kind == "kto" and datasets.eval is not None:
            datasets.eval = with_kl_rows(datasets.eval, r.micro_batch_size, r.max_seq_len)
        warning = one_sided(datasets.train["desirable"])
        if warning and context.accelerator.is_main_process:
            log.warning(warning)
        super().before_model(context)

    def epochs(self) -> int:
        """The epochs of the training rows the run reaches (their KL rows differ from epoch to epoch)."""
        return -(-self.total_steps // self.batch_schedule.steps_per_epoch)

    def reference_key(self, context: Context) -> dict:
        """DPO's, and for kto the schedule that makes the training KL rows: seed, micro-batch, global batch and
        the epochs the run reaches."""
        key = super().reference_key(context)
        if self.kind == "kto":
            s = self.batch_schedule
            key["data"] = D.cache_fingerprint(key["data"], "KL rows per micro-batch", s.seed, s.micro_batch_size,
                                            s.global_batch, self.epochs())
        return key

    def reference_passes(self, context: Context) -> list[tuple]:
        """kto: the eval split's rows and KL rows once, and the training rows with the KL rows each epoch's
        micro-batches make (this rank's micro-batches of every step of each epoch the run reaches)."""
        passes = super().reference_passes(context)
        if self.kind != "kto":
            return passes
        s, rank, per_epoch = self.batch_schedule, context.sp.dp_rank, self.batch_schedule.steps_per_epoch
        for epoch in range(self.epochs()):
            batches = [rows for step in range(epoch * per_epoch, (epoch + 1) * per_epoch) for rows in s.rows(step, rank)]
            passes.append((f"train/{epoch}", context.datasets.train, batches, context.recipe.max_seq_len))
        return [p for p in passes if p[0] != "train"]

    def attach_reference(self, context: Context, path, values: dict) -> None:
        """kto: the eval split's as columns (DPO's), the training rows' per epoch, read by rollout."""
        if self.kind != "kto":
            return super().attach_reference(context, path, values)
        attach(context.datasets, path, values, splits=("eval",))
        self.epoch_reference = []
        for epoch in range(self.epochs()):
            rows = values.get(f"train/{epoch}")
            if rows is None or len(rows) != len(context.datasets.train):
                raise RecipeError(f"{path}: holds no reference log-probs of epoch {epoch + 1}'s KL rows; delete it to "
                                  "compute them again")
            self.epoch_reference.append(torch.tensor([v if v is not None else (math.nan, math.nan) for v in rows],
                                                     dtype=torch.float32))

    def reference_logps(self, model, batch: dict, second: bool) -> torch.Tensor:
        """The reference's summed log-probs of a micro-batch's rows (or their KL rows)."""
        if "ref_logps" in batch:  # precomputed, rows then KL rows
            n = batch["input_ids"].shape[0] // 2
            return batch["ref_logps"][n:] if second else batch["ref_logps"][:n]
        return self.reference.logps(model, half(batch, second))

    def estimate_kl(self, run, batches) -> torch.Tensor:
        """max(0, the mean over the batches' real rows (on every rank) of the policy's minus the reference's
        log-probs of their KL rows), without gradient: TRL's KL estimate over a whole global batch. The
        batches as fetched: each is sharded here (sequence parallelism), its rows counted by one rank of
        each sequence-parallel group."""
        device = run.accelerator.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for batch in batches:
                batch = self.to_device(run.parallel.sp.shard(batch), device)
                policy = SP.row_logps(run.model, half(batch, True), self.loss_impl, self.chunk)[0]
                reference = self.reference_logps(run.model, batch, True).to(policy.device)
                real = real_pairs(batch).to(policy.device) & SP.counts_pairs()
                total += torch.stack([((policy - reference).double() * real).sum(), real.sum().double()])
        total = run.reduce_sum(total)
        return (total[0] / total[1].clamp(min=1)).clamp(min=0).float()

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict]:
        """kto: the step's micro-batches, fetched here with the KL rows each makes (TRL's rule; their reference
        log-probs from the precomputed epoch's, if any), and the step's KL estimate over its global batch, before
        the first forward with gradient."""
        if self.kind != "kto":
            return micro_batches
        rows = run.schedule.rows(step, run.parallel.sp.dp_rank)
        pad_id, max_len = run.tokenizer.pad_token_id, run.recipe.max_seq_len
        micro_batches = [D.fetch(run.datasets.train, part, pad_id, False, kl_max_len=max_len) for part in rows]
        if self.epoch_reference is not None:
            values = self.epoch_reference[step // run.schedule.steps_per_epoch]
            for batch, part in zip(micro_batches, rows):
                batch["ref_logps"] = values[part].T.reshape(-1)  # the rows', then their KL rows'
        self.kl = self.estimate_kl(run, micro_batches)
        return micro_batches

    def evaluate(self, run, step: int, stop, loss_eval):
        """The eval's KL estimate over the eval set, then the loop's mean loss over it (loss_eval)."""
        if self.kind == "kto":
            pad_id = run.tokenizer.pad_token_id
            self.kl = self.estimate_kl(run, (D.fetch(run.datasets.eval, rows, pad_id, False) for rows in run.eval_rows))
        return loss_eval()

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch's rows; its metrics' sums are kept for take_metrics."""
        policy = SP.row_logps(model, half(batch, False), self.loss_impl, self.chunk)[0]
        reference = self.reference_logps(model, batch, False).to(policy.device)
        desirable = batch["desirable"].to(policy.device)
        kl = self.kl.to(policy.device)
        losses = kto_losses(self.kind, self.beta, policy, reference, desirable, kl, *self.weights)
        real = real_pairs(batch).to(policy.device) & SP.counts_pairs()
        logps = policy.detach().double()
        rewards = self.beta * (logps - reference.double())
        chosen, rejected = (real & desirable).double(), (real & ~desirable).double()
        sums_now = torch.stack([(rewards * chosen).sum(), (rewards * rejected).sum(), (logps * chosen).sum(),
                                (logps * rejected).sum(), chosen.sum(), rejected.sum(),
                                kl.double() * real.double().sum()])
        self.sums = sums_now if self.sums is None else self.sums + sums_now
        return (losses * real).sum()

    def means(self, sums: torch.Tensor, count: torch.Tensor) -> list[float]:
        """METRICS from the sums reduced over ranks: the rewards and log-probs per side over that side's
        rows (NaN where it has none), the KL over all rows."""
        rc, rr, lc, lr, nc, nr, kl = sums.tolist()
        chosen, rejected = (rc / nc if nc else math.nan), (rr / nr if nr else math.nan)
        return [chosen, rejected, chosen - rejected, lc / nc if nc else math.nan, lr / nr if nr else math.nan,
                kl / float(count)]

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [rows, completion tokens, input tokens] of its rows (not
        their KL rows), float64; summed over ranks."""
        rows = [half(b, False) for b in micro_batches]
        return torch.tensor([sum(self.eval_count(b) for b in micro_batches),
                             sum(D.target_tokens(b) for b in rows),
                             sum(D.input_tokens(b) for b in rows)], dtype=torch.float64)
