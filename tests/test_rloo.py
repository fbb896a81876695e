"""loss_type=rloo (finetune/rl_losses.py rloo_advantages, rloo_loss; the objective: objectives/grpo.py) against
TRL's RLOOTrainer on the same random tensors. TRL is not a dependency (bench only), so its lines are
reproduced below as written in trl 1.16.0, trl/trainer/rloo_trainer.py: _generate_and_score_completions
lines 1646-1699 (unscorable rows, the KL penalty in the reward, the leave-one-out baseline, normalize_advantages,
is_std_zero) and 1712-1716 (the kl metric), RLOOTrainer._compute_loss lines 1823-1860 (the sequence ratio,
the clipped loss, the clip_ratio metrics; the entropy metric's lines 1840-1843). The reward_clip_range and
aux-loss branches (settings this toolkit does not offer) are left out; nothing else is changed.
bench/studies/grpo_loss_vs_trl.py checks these copies against TRL's real trainer."""

import collections
import types

import pytest
import torch

from finetune.recipe import Recipe, RecipeError, validate
from finetune.rl_losses import LossSettings, merged_sums, policy_loss, rloo_advantages
from finetune.training.objectives.grpo import GRPO
from test_grpo_objective import REWARD, entropies_of, rollout_tensors, trl_nanmax, trl_nanmin, trl_nanstd


# ----------------------------------------------------------------------------- TRL 1.16.0, as written
def trl_rloo_advantages(self, rewards_per_func, num_generations, old_per_token_logps, ref_per_token_logps,
                        completion_mask):
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * self.reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan

    if self.beta != 0.0:
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - self.beta * kl

    grouped_rewards = rewards.view(-1, num_generations)
    mean_grouped_rewards = torch.nanmean(grouped_rewards, dim=1)
    std_rewards = trl_nanstd(grouped_rewards, dim=1)

    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)  # (num_prompts, 1)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)  # (num_prompts, 1)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)  # (num_prompts, num_generations)
    baselines = baselines.view(-1)  # Flatten back to match rewards shape
    advantages = rewards - baselines

    if self.normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (trl_nanstd(advantages) + 1e-4)

    advantages = torch.nan_to_num(advantages, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging
    if self.beta != 0.0:
        kl_stats = torch.stack([(per_token_kl * completion_mask).sum(), completion_mask.sum().float()])
        self._metrics["train"]["kl"].append((kl_stats[0] / kl_stats[1].clamp(min=1.0)).item())
    self._metrics["train"]["frac_reward_zero_std"].append(is_std_zero.float().mean().item())
    return advantages, mean_grouped_rewards


def trl_rloo_compute_loss(self, per_token_logps, entropies, inputs):
    completion_mask = inputs["completion_mask"]
    logps = (per_token_logps * completion_mask).sum(1)  # mask out padding and tokens after EOS
    old_logps = inputs["old_logps"]
    log_ratio = logps - old_logps

    # Compute the loss
    advantages = inputs["advantages"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
    per_sequence_loss1 = coef_1 * advantages
    per_sequence_loss2 = coef_2 * advantages
    per_sequence_loss = -torch.min(per_sequence_loss1, per_sequence_loss2)
    loss = per_sequence_loss.mean()

    mode = "train"
    entropy_stats = torch.stack([(entropies * completion_mask).sum(), completion_mask.sum().float()])
    self._metrics[mode]["entropy"].append((entropy_stats[0] / entropy_stats[1].clamp(min=1.0)).item())

    # Compute the clipped probability ratios
    is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    gathered_low_clip = is_low_clipped.float()
    self._metrics[mode]["clip_ratio/low_mean"].append(gathered_low_clip.nanmean().item())
    self._metrics[mode]["clip_ratio/low_min"].append(trl_nanmin(gathered_low_clip).item())
    gathered_high_clip = is_high_clipped.float()
    self._metrics[mode]["clip_ratio/high_mean"].append(gathered_high_clip.nanmean().item())
    self._metrics[mode]["clip_ratio/high_max"].append(trl_nanmax(gathered_high_clip).item())
    gathered_clip_ratio = is_region_clipped.float()
    self._metrics[mode]["clip_ratio/region_mean"].append(gathered_clip_ratio.nanmean().item())
    return loss


# ----------------------------------------------------------------------------- the comparison
def trainer(beta, normalize, epsilon=0.2, epsilon_high=0.28, weights=(1.0, 0.5)):
    return types.SimpleNamespace(beta=beta, normalize_advantages=normalize, epsilon_low=epsilon,
                                 epsilon_high=epsilon_high, reward_weights=torch.tensor(weights),
                                 _metrics={"train": collections.defaultdict(list)})


def rewards(rows=8, seed=4):
    per_func = torch.randn(rows, 2, generator=torch.Generator().manual_seed(seed))
    per_func[2, 1] = float("nan")  # one function did not score this completion
    per_func[6] = float("nan")  # none scored this one: out of its group's baseline, advantage 0
    return per_func


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("g", [4, 2])
def test_advantages_as_trl(beta, normalize, g):
    """The leave-one-out advantages of 8 completions in groups of g (TRL's RLOO default: 2), with beta's
    k1 KL of the old log-probs against the reference's in the reward, normalised or not; frac_reward_zero_std
    and the kl metric."""
    base, old, ref, _, mask = rollout_tensors(iterations=2)
    per_func = rewards()
    t = trainer(beta, normalize)
    want, _ = trl_rloo_advantages(t, per_func, g, old, ref, mask)
    kl = ((old - ref) * mask).sum(-1)
    got, zero_std = rloo_advantages(per_func, torch.tensor([1.0, 0.5]), g, kl, beta, normalize)
    assert torch.equal(got, want), "TRL's float32 arithmetic, bit for bit"
    assert got[6] == 0 and got.abs().sum() > 0
    assert zero_std.float().mean().item() == t._metrics["train"]["frac_reward_zero_std"][0]
    if beta:
        assert t._metrics["train"]["kl"][0] == pytest.approx(((old - ref) * mask).sum().item() / mask.sum().item())


def test_a_group_of_equal_rewards_has_zero_advantages_and_std():
    per_func = torch.tensor([[1.0], [1.0], [0.0], [2.0]])
    advantages, zero_std = rloo_advantages(per_func, torch.tensor([1.0]), 2)
    assert advantages.tolist() == [0.0, 0.0, -2.0, 2.0] and zero_std.tolist() == [True, True, False, False]


@pytest.mark.parametrize("normalize", [False, True])
def test_groups_of_equal_rewards_keep_trl_s_rounding_and_its_clip_metrics(normalize):
    """Groups whose completions all got the same (non-dyadic) reward: TRL's float32 leave-one-out leaves a few
    ulps in their advantages (here +3e-8 in one group, and under normalize_advantages every group's), which
    clip_ratio/high_mean counts by their sign where the ratio is past 1 + epsilon_high. Ours computes as TRL
    does, so the advantages are TRL's bit for bit and so are the clip metrics; more exact arithmetic (float64)
    gives these groups exactly 0 and counts other completions."""
    per_func = torch.tensor([[0.1, 0.7]] * 4 + [[0.3, 0.9]] * 4 + [[1.0, 0.0], [0.0, 1.0], [0.2, 0.3], [0.9, 0.1]]
                            + [[0.35, 0.15]] * 4)
    weights = (1.0, 0.5)
    want, _ = trl_rloo_advantages(trainer(0.0, normalize, weights=weights), per_func, 4, None, None, None)
    got, zero_std = rloo_advantages(per_func, torch.tensor(weights), 4, None, 0.0, normalize)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert zero_std.tolist() == [True] * 8 + [False] * 4 + [True] * 4
    assert (want[:4] != 0).all() and (want[:4] > 0).all(), "TRL's rounding leaves a positive advantage here"
    exact = (per_func.double() * torch.tensor(weights, dtype=torch.float64)).sum(1).view(-1, 4)
    exact = (exact - (exact.sum(1, keepdim=True) - exact) / 3).view(-1)
    if normalize:
        exact = (exact - exact.mean()) / (exact.std() + 1e-4)
    assert (exact[:4] == 0).all() and (exact[12:] == 0).all(), "float64 leaves none"

    logps = torch.randn(16, 5, generator=torch.Generator().manual_seed(3)) * 0.1 - 1.0
    mask = torch.ones(16, 5)
    old = logps - 0.1  # every sequence's ratio exp(0.5) = 1.65, past 1 + epsilon_high: clipped where A > 0
    t = trainer(0.0, normalize, weights=weights)
    trl_rloo_compute_loss(t, logps, torch.zeros(16, 5), {"completion_mask": mask, "old_logps": (old * mask).sum(1),
                                                         "advantages": want})
    settings = LossSettings(loss_type="rloo", epsilon=0.2, epsilon_high=0.28)
    objective = GRPO(Recipe(objective="grpo", loss_type="rloo", epsilon=0.2, epsilon_high=0.28, **REWARD))

    def clip_metrics(advantages):
        sums = policy_loss(logps, advantages, mask, old_logps=old, entropies=torch.zeros(16, 5), settings=settings)[1]
        values = dict(zip(objective.loss_metrics, objective.means(sums)))
        return {k: v for k, v in values.items() if k.startswith("clip_ratio/")}

    ours = clip_metrics(got)
    theirs = {k: v[0] for k, v in t._metrics["train"].items() if k.startswith("clip_ratio/")}
    assert ours == theirs and ours["clip_ratio/high_mean"] > 0
    assert clip_metrics(exact.float())["clip_ratio/high_mean"] != theirs["clip_ratio/high_mean"]


def test_huge_rewards_keep_their_normalized_advantages():
    """Rewards near 1e30 under normalize_advantages: float32's squares overflow (TRL's advantages would all be
    0, without a word); those are computed in float64 and keep their advantages."""
    per_func = torch.tensor([[1e30], [3e30], [-1e30], [1e30]])
    advantages, zero_std = rloo_advantages(per_func, torch.ones(1), 2, normalize=True)
    small, _ = rloo_advantages(per_func / 1e30, torch.ones(1), 2, normalize=True)
    assert advantages.dtype == torch.float32 and torch.allclose(advantages, small, rtol=1e-4)
    assert advantages.abs().min() > 0.5 and not zero_std.any()


@pytest.mark.parametrize("iterations", [1, 2])
def test_loss_gradient_and_metrics_as_trl(iterations):
    """RLOO's loss on 8 completions split over 2 ranks x 2 micro-batches: TRL's (each micro-batch's mean,
    divided by gradient accumulation by the HF Trainer, averaged over ranks by DDP) against ours (sums over
    the global batch's completions), values and gradients; the metrics (entropy, clip ratios over
    sequences and their min/max) on one micro-batch."""
    world, ga = 2, 2
    base, old, _, advantages, mask = rollout_tensors(iterations=iterations)
    old = base if old is None else old  # TRL computes the old log-probs even with one iteration: the same
    old = old * 0.98 if iterations == 2 else old  # sequence ratios that cross the clip range
    entropies = entropies_of(base)
    micro = [slice(i, i + 2) for i in range(0, 8, 2)]
    t = trainer(0.05, False)
    trl_logps = base.clone().requires_grad_()
    trl_loss = 0.0
    for part in micro:
        inputs = {"completion_mask": mask[part], "old_logps": (old[part] * mask[part]).sum(1),
                  "advantages": advantages[part]}
        trl_loss = trl_loss + trl_rloo_compute_loss(t, trl_logps[part], entropies[part], inputs) / ga / world
    trl_loss.backward()

    settings = LossSettings(loss_type="rloo", epsilon=0.2, epsilon_high=0.28, beta=0.05)
    ours_logps = base.clone().requires_grad_()
    ours_loss = sum(policy_loss(ours_logps[p], advantages[p], mask[p], old_logps=old[p], settings=settings)[0]
                    for p in micro) / 8
    ours_loss.backward()
    assert abs(ours_loss.item() - trl_loss.item()) < 1e-6
    assert torch.allclose(ours_logps.grad, trl_logps.grad, rtol=0, atol=1e-6) and trl_logps.grad.abs().sum() > 0

    t = trainer(0.05, False)
    trl_rloo_compute_loss(t, base, entropies, {"completion_mask": mask, "old_logps": (old * mask).sum(1),
                                               "advantages": advantages})
    sums = None
    for p in micro:
        sums = merged_sums(sums, policy_loss(base[p], advantages[p], mask[p], old_logps=old[p], entropies=entropies[p],
                                             settings=settings)[1])
    objective = GRPO(Recipe(objective="grpo", loss_type="rloo", beta=0.05, epsilon=0.2, epsilon_high=0.28, **REWARD))
    ours = dict(zip(objective.loss_metrics, objective.means(sums)))
    theirs = {k: v[0] for k, v in t._metrics["train"].items()}
    assert set(ours) == set(theirs) and "kl" in objective.rollout_names  # rloo's kl: the rollout's
    for name in ours:
        assert abs(ours[name] - theirs[name]) < 1e-6, name
    if iterations == 2:
        assert theirs["clip_ratio/region_mean"] > 0


RLOO = {"objective": "grpo", "loss_type": "rloo", "reward_funcs": ("finetune.rewards:exact_match",),
        "dataset_format": "prompt", "num_generations": 2, "beta": 0.05, "global_batch_size": 4, "micro_batch_size": 4}


@pytest.mark.parametrize("changes,message", [
    ({"scale_rewards": "none"}, "scale_rewards=none does not apply to loss_type=rloo"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level=sequence does not apply to loss_type=rloo"),
    ({"use_bias_correction_kl": False}, "use_bias_correction_kl=False does not apply to loss_type=rloo"),
    ({"loss_type": "dapo", "normalize_advantages": True}, "normalize_advantages=true applies to loss_type=rloo only"),
])
def test_rloo_keys_are_checked(changes, message):
    """GRPO's keys that TRL's RLOOTrainer has no use for are refused with it, and rloo's own without it, in
    one line naming the key."""
    validate(Recipe(**RLOO))
    validate(Recipe(**RLOO | {"normalize_advantages": True}))
    with pytest.raises(RecipeError) as e:
        validate(Recipe(**RLOO | changes))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
