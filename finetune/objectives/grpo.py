"""Group relative policy optimization (GRPO, DAPO, Dr. GRPO) as TRL's GRPOTrainer defines it (trl 1.16,
trl/trainer/grpo_trainer.py: _generate_and_score_completions for the advantages, _compute_loss for the
loss and its metrics), so that users can carry their settings over.

Each prompt of a step has num_generations completions (a group). Their rewards (one column per reward
function, NaN where a function did not score, finetune/rewards.py) are summed with the weights (nansum)
and the advantage of each completion is its reward minus its group's mean, divided by (std + 1e-4)
where std is the group's (scale_rewards=group), the whole batch's (batch), or not divided (none); a
completion no function scored gets advantage 0. Per completion token, with r = exp(logp - old_logp):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = exp(ref_logp - logp) - (ref_logp - logp) - 1      (the k3 estimator; only when beta > 0)

old_logp is the policy's at the rollout (num_iterations > 1 steps reuse one rollout); with one iteration
it is logp itself, detached, so r = 1 and only its gradient acts. How the token losses make the loss
the optimizer steps on, over the whole global batch whatever its split into ranks and micro-batches
(TRL's per micro-batch normalisations, averaged by DDP over ranks and summed over accumulation steps,
come to the same when every micro-batch holds as many completions):

    grpo:     the mean over completions of each completion's mean token loss
    dapo:     the mean over all completion tokens of the global batch
    dr_grpo:  the sum over all completion tokens / (completions x max_completion_len)

so `loss` returns a micro-batch's sum of those terms and `counts` says what it is averaged over
(completions, or completion tokens for dapo), as SFT and DPO do.

What the rollout phase (the objective's `rollout`, objectives/base.py) gives the loop, per micro-batch
(`rollout_batch` builds it):
    input_ids, attention_mask   [rows, length]: prompt then completion, right-padded
    labels                      [rows, length]: the completion's tokens where they count in the loss,
                                IGNORE elsewhere (prompt, padding, a truncated completion when
                                mask_truncated_completions)
    advantages                  [rows] float32 (group_advantages, computed on the whole global batch)
    real                        [rows] bool: False for a placeholder row keeping ranks in lock-step
    old_logps                   [rows, length] fp32 laid out as the labels (loss.token_logps under
                                no_grad at the rollout): only when num_iterations > 1
    ref_logps                   [rows, length] fp32, the reference's: only when beta > 0

Metrics (take_metrics gives their sums; `means` turns the rank-summed sums into values): kl (beta > 0),
clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, each a mean over the global batch's
completion tokens (TRL: a mean per micro-batch, then over micro-batches; the same with one micro-batch
per rank). TRL's clip_ratio/low_min and high_max (a min / max over sequences) are not kept: the loop
reduces metrics by sum. The rollout's own metrics (rewards per function, completion lengths) come from
`rollout_metrics`, on the gathered global batch."""

from __future__ import annotations

import torch

from finetune import data as D
from finetune.data import IGNORE
from finetune.loss import token_logps
from finetune.objectives.base import Basic
from finetune.rewards import weighted_rewards

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction; NaN where fewer than 2 values
    (TRL's trl/trainer/utils.py nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages of a whole global batch of completions, each prompt's num_generations adjacent,
    and whether each one's std was zero (TRL's frac_reward_zero_std): TRL's sum_then_normalize."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: must be one of {', '.join(SCALE_REWARDS)}")
    rewards = weighted_rewards(per_func, weights)
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def rollout_metrics(per_func: torch.Tensor, weights: torch.Tensor, names: list[str], zero_std: torch.Tensor,
                    lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """A step's rollout metrics, on the gathered global batch, under TRL's names: reward (mean, std) in
    all and per function (over the completions it scored), the share of completions in a group of
    equal rewards, completion lengths (mean, min, max, and the share cut at max_completion_len)."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    rewards = weighted_rewards(per_func, weights)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    lengths = lengths.float()
    out["completions/mean_length"] = lengths.mean().item()
    out["completions/min_length"] = lengths.min().item()
    out["completions/max_length"] = lengths.max().item()
    out["completions/clipped_ratio"] = truncated.float().mean().item()
    return out


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, old_logps=None,
                ref_logps=None, loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, max_completion_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss terms of some completions ([rows, length] per-token log-probs, their rows'
    advantages [rows], the tokens that count [rows, length]) and the sums of the metrics over their
    counted tokens: [kl, clipped low, clipped high, clipped either, tokens], float64. The sum's unit is
    the loss type's (module docstring): divided by the global batch's count it is TRL's loss."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps) in the batch")
        delta = ref_logps.to(logps) - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / max_completion_len
    else:
        loss = (per_token * mask).sum()
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        sums = [(kl * mask).sum() if kl is not None else mask.new_zeros(()),
                (low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum(), mask.sum()]
        sums = torch.stack(sums).double()
    return loss, sums


def real_rows(batch: dict) -> torch.Tensor:
    """Which rows are completions of the step (not placeholders keeping ranks in lock-step)."""
    real = batch.get("real")
    return torch.ones(batch["input_ids"].shape[0], dtype=torch.bool) if real is None else real.bool()


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], stopped: list[bool],
                  advantages: torch.Tensor, pad_id: int, *, mask_truncated: bool = False,
                  real: list[bool] | None = None) -> dict:
    """One micro-batch of the rollout as the loss reads it: each row the prompt's tokens then the
    completion's, right-padded; the completion's tokens as labels, none for a truncated completion
    (not stopped) when mask_truncated. old_logps / ref_logps are added by the caller (token_logps of
    this batch under no_grad)."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attention[i, :len(p) + len(c)] = 1
        if not (mask_truncated and not stopped[i]):
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
            "advantages": advantages.float(),
            "real": torch.tensor([True] * len(rows) if real is None else real, dtype=torch.bool)}


class GRPO(Basic):
    name = "grpo"

    def __init__(self, recipe):
        self.loss_type, self.beta = recipe.loss_type, recipe.beta
        self.epsilon, self.epsilon_high = recipe.epsilon, recipe.epsilon_high or recipe.epsilon  # 0: epsilon
        self.max_completion_len = recipe.max_completion_len
        self.num_iterations = recipe.num_iterations
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        self.metrics = (("kl",) if self.beta != 0.0 else ()) + CLIP_METRICS
        self.sums = None

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch of completions; its metrics' sums are kept for take_metrics."""
        logps = token_logps(model, batch, self.loss_impl, self.chunk)
        mask = (batch["labels"] != IGNORE).to(logps.device)
        loss, sums = policy_loss(
            logps, batch["advantages"], mask, old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"),
            loss_type=self.loss_type, epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta,
            max_completion_len=self.max_completion_len)
        self.sums = sums if self.sums is None else self.sums + sums
        return loss

    def count(self, batch: dict) -> int:
        """What a micro-batch's loss is averaged over: completions, or completion tokens for dapo."""
        if self.loss_type == "dapo":
            return D.target_tokens(batch)
        return int(real_rows(batch).sum())

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [what the loss is averaged over, completion tokens in
        the loss, input tokens], float64; summed over ranks."""
        return torch.tensor([sum(self.count(b) for b in micro_batches),
                             sum(D.target_tokens(b) for b in micro_batches),
                             sum(D.input_tokens(b) for b in micro_batches)], dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        return self.count(batch)

    def take_metrics(self) -> torch.Tensor | None:
        """The metrics' sums since the last call ([kl, clipped low, high, either, tokens]), or None."""
        sums, self.sums = self.sums, None
        return sums

    def means(self, sums: torch.Tensor, count: torch.Tensor | None = None) -> list[float]:
        """The metrics' values (in `metrics` order) from take_metrics' sums reduced over ranks: means
        over the completion tokens they count themselves (not over the global batch's count)."""
        values = (sums[:4] / sums[4].clamp(min=1)).tolist()
        return values if self.beta != 0.0 else values[1:]
