"""GRPO's loss family as pure functions on tensors, as TRL's GRPOTrainer defines it (trl 1.16,
trl/trainer/grpo_trainer.py: _generate_and_score_completions for the advantages, _compute_loss for the
loss and its metrics), so that users can carry their settings over. The objective that feeds them
(rollouts, batches, the loop's interface) is finetune/training/objectives/grpo.py.

Each prompt of a step has num_generations completions (a group). Their rewards (one column per reward
function, NaN where a function did not score, finetune/rewards.py) are summed with the weights (nansum)
and the advantage of each completion is its reward minus its group's mean, divided by (std + 1e-4)
where std is the group's (scale_rewards=group), the whole batch's (batch), or not divided (none); a
completion no function scored gets advantage 0. Per completion token, with r = exp(logp - old_logp):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = r (exp(ref_logp - logp) - (ref_logp - logp) - 1)  (only when beta > 0)

kl_t is the k3 estimator times the importance ratio (use_bias_correction_kl=true, TRL 1.16's default: the
gradient of the unbiased reverse KL, DeepSeek-V3.2); use_bias_correction_kl=false leaves the plain k3
term. The ratio is differentiable, so it changes the KL's gradient even where its value is 1.
old_logp is the policy's at the rollout (num_iterations > 1 steps reuse one rollout); with one iteration
it is logp itself, detached, so r = 1 and only its gradient acts.

Every log-prob (logp, old_logp, ref_logp) is of the logits divided by the sampling temperature
(loss.token_logps): the distribution the completions were drawn from, as TRL's GRPOTrainer and verl
score them; temperature=0 (greedy) scores the logits as they are. How the token losses make the loss
the optimizer steps on, over the whole global batch whatever its split into ranks and micro-batches
(TRL's per micro-batch normalisations, averaged by DDP over ranks and summed over accumulation steps,
come to the same when every micro-batch holds as many completions):

    grpo:     the mean over completions of each completion's mean token loss
    dapo:     the mean over all completion tokens of the global batch
    dr_grpo:  the sum over all completion tokens / (completions x max_completion_len)

so `policy_loss` returns a micro-batch's sum of those terms and the objective's `counts` says what it is
averaged over (completions, or completion tokens for dapo), as SFT and DPO do.

Metrics (policy_loss gives their sums, the objective's `means` turns the rank-summed sums into values):
kl (beta > 0), clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, each a mean over the
global batch's completion tokens (TRL: a mean per micro-batch, then over micro-batches; the same with one
micro-batch per rank)."""

from __future__ import annotations

import torch

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
    # in float64: the squares of float32 rewards beyond about 1e19 overflow float32 (an inf std would make
    # every advantage 0); the advantages themselves are of order 1, float32 again
    rewards = weighted_rewards(per_func.double(), weights)
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0).float(), zero_std


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, old_logps=None,
                ref_logps=None, loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, max_completion_len: int = 1, bias_correction_kl: bool = True,
                is_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
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
    if is_ratio is not None:  # vLLM's completions: TRL's importance-sampling correction (generators.importance_weights)
        per_token = per_token * is_ratio.to(per_token)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps) in the batch")
        delta = ref_logps.to(logps) - logps
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:
            kl = kl * ratio
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
