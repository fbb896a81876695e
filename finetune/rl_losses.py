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

import dataclasses
import math

import torch

from finetune.rewards import weighted_rewards

GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")  # TRL's GRPOTrainer
LOSS_TYPES = GRPO_LOSS_TYPES + ("rloo",)  # and its RLOOTrainer (rloo_advantages, rloo_loss)
CLIPPED = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")  # PPO's clipped surrogate
TOKEN_COUNTED = ("dapo", "cispo", "vespo")  # averaged over the global batch's completion tokens, else completions
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")


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


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """A loss type and its hyper-parameters, TRL's GRPOConfig names and defaults (epsilon_high None:
    epsilon, as TRL's; for cispo it is the cap on the ratio itself, ScaleRL's 5.0)."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    bias_correction_kl: bool = True
    max_completion_len: int = 1
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r}: must be one of "
                             f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_recipe(cls, r) -> "LossSettings":
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("bias_correction_kl", "epsilon_high")]
        return cls(**{n: getattr(r, n) for n in names}, epsilon_high=r.epsilon_high or r.epsilon,
                   bias_correction_kl=r.use_bias_correction_kl)


def metric_names(loss_type: str, beta: float) -> tuple[str, ...]:
    """The loss's metrics under TRL's names, in the order metric_values gives them (rloo: its kl is the
    rollout's, its penalty is in the reward)."""
    names = (("kl",) if beta != 0.0 and loss_type != "rloo" else ()) + ("entropy",)
    if loss_type in CLIPPED or loss_type == "rloo":
        return names + CLIP_METRICS
    return names + {"cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",), "sapo": ()}[loss_type]


# policy_loss's sums: [kl, entropy, tokens, a, b, c, count, -low_min, high_max]: the first 7 summed over
# micro-batches and ranks, the last MAXED by max (a min kept negated). a, b, c over count: the clip ratios
# low, high, region (clipped loss types), cispo's clipped share (a), vespo's phi (a); count is the
# completion tokens at token level, the completions where the quantity is one per sequence.
SUMS, MAXED = 9, 2


def metric_values(sums: torch.Tensor, loss_type: str, beta: float) -> list[float]:
    """The metrics' values (metric_names' order) from policy_loss's sums reduced over micro-batches and
    ranks: means over what each counts; NaN where nothing was counted."""
    def mean(x, n):
        return x / n if n > 0 else float("nan")

    kl, entropy, tokens, a, b, c, count, low_min, high_max = sums.tolist()
    values = ([mean(kl, tokens)] if beta != 0.0 and loss_type != "rloo" else []) + [mean(entropy, tokens)]
    if loss_type in CLIPPED or loss_type == "rloo":
        extremes = [-low_min if math.isfinite(low_min) else float("nan"),
                    high_max if math.isfinite(high_max) else float("nan")]
        return values + [mean(a, count), mean(b, count), mean(c, count)] + extremes
    return values + ([mean(a, count)] if loss_type in ("cispo", "vespo") else [])


def merged_sums(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Two micro-batches' sums as one: summed, the MAXED ones by max."""
    if old is None:
        return new
    return torch.cat([old[:-MAXED] + new[:-MAXED], torch.maximum(old[-MAXED:], new[-MAXED:])])


# ---------------------------------------------------------------- the token losses, one per loss type
# Each takes coef = exp(log ratio) ([rows, length] at token level, [rows, 1] at sequence level) and the
# advantages [rows, 1], and gives the per-token loss before the KL term (trl 1.16 _compute_loss).


def clipped_loss(coef: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float) -> torch.Tensor:
    """grpo, dapo, dr_grpo, bnpo, luspo: PPO's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps_high) A)."""
    clipped = torch.clamp(coef, 1 - epsilon, 1 + epsilon_high)
    return -torch.min(coef * advantages, clipped * advantages)


def cispo_loss(coef: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_high: float) -> torch.Tensor:
    """cispo (MiniMax-M1, ScaleRL): the ratio capped at epsilon_high and detached, a REINFORCE weight:
    -sg(min(r, eps_high)) A logp."""
    return -torch.clamp(coef, max=epsilon_high).detach() * advantages * logps


def sapo_loss(coef: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """sapo: a soft gate instead of the clip, -sigmoid(tau (r - 1)) 4 / tau A, tau by the advantage's sign."""
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)
    return -torch.sigmoid(tau * (coef - 1)) * 4 / tau * advantages


def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, is_ratio=None, *,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
                  lambda_neg: float = 2.0) -> torch.Tensor:
    """vespo's per-sequence weight phi(w) = exp(lambda + k log w - lambda w) [rows, 1], no gradient, w the
    sequence's importance ratio (the summed token log ratios, times a vLLM engine's importance weights),
    log w clamped to [log 1e-8, 20]; k and lambda by the advantage's sign."""
    with torch.no_grad():
        low = math.log(1e-8)
        log_w = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
        if is_ratio is not None:
            log_w = log_w + torch.sum(torch.clamp(torch.log(is_ratio), low, 20.0), dim=-1, keepdim=True)
        log_w = torch.clamp(log_w, low, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(phi: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """vespo: -phi(w) A logp, phi from gamma_weights."""
    return -phi * advantages * logps


def aggregated(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_len: int) -> torch.Tensor:
    """A micro-batch's token losses summed in the loss type's unit (module docstring): divided by the global
    batch's count (completions, or completion tokens for TOKEN_COUNTED) it is TRL's loss."""
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type == "bnpo":  # TRL's mean over the micro-batch's tokens, weighted as its completions
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) * mask.shape[0]
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / max_completion_len
    return (per_token * mask).sum()  # dapo, cispo, vespo (over tokens); luspo (each completion's sum)


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, old_logps=None,
                ref_logps=None, is_ratio=None, entropies=None, settings: LossSettings | None = None,
                micro_batch_count: float | None = None, **values) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss terms of some completions ([rows, length] per-token log-probs, their rows'
    advantages [rows], the tokens that count [rows, length]) and the sums of the metrics (the SUMS layout
    above, float64). settings: a LossSettings, or its fields as keywords. old_logps: the policy's at the
    rollout (None: logps detached, one iteration); ref_logps: the reference's (beta > 0); is_ratio: a vLLM
    engine's importance weights; entropies: each token's entropy (the entropy metric, and with entropy_coef
    the bonus: entropy_bonus). micro_batch_count: the loss's count over the global batch divided by its
    micro-batches (entropy_coef only; None: the rows, right for the types counted in completions)."""
    s = settings or LossSettings(**values)
    loss, sums = _policy_loss(logps, advantages, mask, old_logps, ref_logps, is_ratio, entropies, s)
    if s.entropy_coef != 0.0:
        loss = loss - entropy_bonus(entropies, mask, s.entropy_coef,
                                    mask.shape[0] if micro_batch_count is None else micro_batch_count)
    return loss, sums


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, coef: float, micro_batch_count: float) -> torch.Tensor:
    """TRL's entropy bonus (entropy_coef; its static form): coef x the micro-batch's mean token entropy, in
    the loss's unit (x micro_batch_count, the global count over the micro-batches): over the global
    count, the mean over micro-batches of their mean token entropy, as TRL's per micro-batch mean
    divided by the accumulation steps and averaged over ranks comes to."""
    mask = mask.to(entropies.dtype)
    return coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0) * micro_batch_count


def _policy_loss(logps, advantages, mask, old_logps, ref_logps, is_ratio, entropies, s: LossSettings):
    eps_high = s.high
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps)
    if s.loss_type == "rloo":
        loss, coef = rloo_loss(logps, old, advantages, mask, s.epsilon, eps_high)
        with torch.no_grad():
            return loss, metric_sums(s, coef, advantages, mask, None, entropies, None)
    log_ratio = logps - old
    if s.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log ratio
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef = torch.exp(log_weights)
    phi = None
    if s.loss_type in CLIPPED:
        per_token = clipped_loss(coef, advantages, s.epsilon, eps_high)
    elif s.loss_type == "cispo":
        per_token = cispo_loss(coef, advantages, logps, eps_high)
    elif s.loss_type == "sapo":
        per_token = sapo_loss(coef, advantages, s.sapo_temperature_pos, s.sapo_temperature_neg)
    else:
        phi = gamma_weights(advantages, log_ratio, mask, is_ratio, k_pos=s.vespo_k_pos, lambda_pos=s.vespo_lambda_pos,
                            k_neg=s.vespo_k_neg, lambda_neg=s.vespo_lambda_neg)
        per_token = vespo_loss(phi, advantages, logps)
    if is_ratio is not None and phi is None:  # vLLM's completions: TRL's correction (vespo has it in phi)
        per_token = per_token * is_ratio.to(per_token)
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps) in the batch")
        delta = ref_logps.to(logps) - logps
        kl = torch.exp(delta) - delta - 1
        if s.bias_correction_kl:
            kl = kl * coef
        per_token = per_token + s.beta * kl
    loss = aggregated(per_token, mask, s.loss_type, s.max_completion_len)
    with torch.no_grad():
        return loss, metric_sums(s, coef, advantages, mask, kl, entropies, phi)


def metric_sums(s: LossSettings, coef, advantages, mask, kl, entropies, phi) -> torch.Tensor:
    """The SUMS of one micro-batch (policy_loss), TRL's metrics: global_masked_mean's sums and counts (over
    tokens, or over completions for a per-sequence quantity), masked_seq_mean's min and max."""
    zero = mask.new_zeros(())
    tokens = mask.sum()
    per_sequence = coef.shape[1] == 1

    def total(x):
        return (x.sum(), mask.new_tensor(float(x.shape[0]))) if x.shape[1] == 1 else ((x * mask).sum(), tokens)

    a = b = c = count = zero
    low_min = high_max = mask.new_tensor(-math.inf)
    if s.loss_type in CLIPPED or s.loss_type == "rloo":
        low = ((coef < 1 - s.epsilon) & (advantages < 0)).to(mask)
        high = ((coef > 1 + s.high) & (advantages > 0)).to(mask)
        (a, count), (b, _), (c, _) = total(low), total(high), total(torch.maximum(low, high))
        if per_sequence:  # one value per completion, every completion's
            kept, seq_low, seq_high = torch.ones_like(low.squeeze(1), dtype=torch.bool), low.squeeze(1), high.squeeze(1)
        else:  # each completion's share of its tokens; one without tokens is NaN, left out (TRL's nanmin)
            kept = mask.sum(-1) > 0
            seq_low, seq_high = (low * mask).sum(-1) / mask.sum(-1), (high * mask).sum(-1) / mask.sum(-1)
        if kept.numel():
            low_min = torch.where(kept, -seq_low, -math.inf).max()
            high_max = torch.where(kept, seq_high, -math.inf).max()
    elif s.loss_type == "cispo":
        a, count = total(((coef > s.high) & (advantages > 0)).to(mask))
    elif s.loss_type == "vespo":
        a, count = total(phi.to(mask))
    sums = [(kl * mask).sum() if kl is not None else zero,
            (entropies.to(mask) * mask).sum() if entropies is not None else zero, tokens, a, b, c, count]
    return torch.stack(sums + [low_min, high_max]).double()


# ---------------------------------------------------------------- RLOO (trl 1.16 RLOOTrainer)


def rloo_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, kl: torch.Tensor | None = None,
                    beta: float = 0.0, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024) as TRL's RLOOTrainer computes it
    (_generate_and_score_completions): each completion's reward (the weighted sum; NaN where no function
    scored) minus beta times its KL (kl: each completion's summed old - ref token log-probs, k1, at the
    rollout), minus the mean of its group's other scorable rewards; normalize: then over the whole batch to
    mean 0 and std 1 (+1e-4); NaN (unscorable, or alone in its group) -> 0. And whether each group's
    (penalised) rewards have std 0 (frac_reward_zero_std). In float32 with TRL's operations in TRL's order,
    so that a group of equal rewards keeps TRL's rounding in its advantages (a few float32 ulps of either
    sign, or 0): the clip metrics count an advantage by its sign, and more exact arithmetic would count
    other completions than TRL's. Only where float32 overflows (rewards near 1e30 under normalize: their
    squares) is it float64, which keeps their advantages where TRL's would all be 0."""
    made = _rloo(per_func.float(), weights, num_generations, kl, beta, normalize)
    if made is None:  # float32's squares overflowed
        made = _rloo(per_func.double(), weights, num_generations, kl, beta, normalize)
    advantages, zero_std = made
    return advantages.float(), zero_std


def _rloo(per_func, weights, num_generations, kl, beta, normalize) -> tuple[torch.Tensor, torch.Tensor] | None:
    rewards = weighted_rewards(per_func, weights)
    if beta != 0.0 and kl is not None:
        rewards = rewards - beta * kl.to(rewards)
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        spread = nanstd(advantages)
        if torch.isinf(spread):  # the squares overflowed: None (the caller computes in float64)
            return None
        advantages = (advantages - torch.nanmean(advantages)) / (spread + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std)).repeat_interleave(num_generations)
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOOTrainer's loss, summed over the completions (the objective averages over the global batch's):
    the clipped surrogate of each completion's ratio exp(sum logp - sum old_logp) over its whole sequence
    (a product of token ratios, not GSPO's mean), [rows, 1]; no KL term (it is in the reward). And the ratios."""
    seq, old_seq = (logps * mask).sum(-1, keepdim=True), (old_logps * mask).sum(-1, keepdim=True)
    coef = torch.exp(seq - old_seq)
    return clipped_loss(coef, advantages, epsilon, epsilon_high).sum(), coef
