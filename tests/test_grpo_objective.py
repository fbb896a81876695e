"""GRPO's loss family and advantages against TRL's formulas on the same random tensors, per-token log-probs and
entropies a chunk at a time against the full logits, the objective on a real (tiny) model, the rollout
batch's layout.

TRL is not a dependency (bench only) and its loss is a method of GRPOTrainer that needs a model and an
accelerator, so TRL's lines are reproduced below as written in trl 1.16.0, trl/trainer/grpo_trainer.py:
GRPOTrainer._compute_loss (lines 3020-3290: old log-probs, token- and sequence-level ratios, the k3 KL and
its bias correction, the cispo, clipped, sapo and vespo token losses, the eight normalisations, the
entropy, kl, clip_ratio, cispo_clip_ratio and vespo/phi_seq_mean metrics) and get_gamma_weights (lines
2965-3018); _generate_and_score_completions lines 2756-2790 and 2807 (sum_then_normalize advantages);
trl/trainer/utils.py nanstd, nanmin, nanmax. Branches for settings this toolkit does not offer (vLLM's
correction, entropy masks, off-policy masks, delta, the entropy bonus, aux loss) are left out; nothing
else is changed. bench/studies/grpo_loss_vs_trl.py checks these copies against TRL's real method."""

import collections
import json
import math
import types

import pytest
import torch

from finetune.data import IGNORE
from finetune.loss import token_logps, token_logps_entropy
from finetune.training.objectives.grpo import GRPO
from finetune.rl_losses import (CLIPPED, GRPO_LOSS_TYPES, TOKEN_COUNTED, LossSettings, group_advantages,
                                merged_sums, policy_loss)
from finetune.training.rollouts import rollout_batch
from finetune.rewards import weighted_rewards
from finetune.recipe import Recipe


# ----------------------------------------------------------------------------- TRL 1.16.0, as written
def trl_nanstd(tensor, dim=None, keepdim=False):
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)  # count of non-NaN values
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction  # Bessel's correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    if isinstance(dim, int):
        return std.squeeze(dim)


def trl_advantages(self, rewards_per_func, num_generations, device="cpu"):
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if self.scale_rewards in ["group", "none"]:
        # If self.scale_rewards = "none", we'll only use std_rewards to check for zero std for logging
        if num_generations > 1:
            std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:  # doesn't occur during training, but could occur in eval when num_generations_eval=1
            std_rewards = torch.zeros_like(rewards)
    elif self.scale_rewards == "batch":
        # Compute global std
        if rewards.numel() > 1:
            std_rewards = trl_nanstd(rewards).expand_as(rewards)
        else:  # doesn't occur during training, but could occur in eval when num_generations_eval=batch_size=1
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if self.scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return advantages, is_std_zero


def trl_nanmin(tensor):
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.min(tensor[~torch.isnan(tensor)])


def trl_nanmax(tensor):
    if torch.isnan(tensor).all():
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return torch.max(tensor[~torch.isnan(tensor)])


@torch.no_grad()
def trl_get_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos=2.0, lambda_pos=3.0,
                          k_neg=3.0, lambda_neg=2.0):
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)  # (B, 1)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi_seq  # (B, 1)


def trl_compute_loss(self, per_token_logps, inputs, entropies=None):
    """One micro-batch's loss on one rank, and the metrics it appends (TRL's accelerator.reduce and gather
    are the identity here: one rank)."""
    mask = inputs["completion_mask"]
    entropies = torch.zeros_like(per_token_logps) if entropies is None else entropies
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

    log_ratio = per_token_logps - old_per_token_logps
    if self.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif self.importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)

    coef_1 = torch.exp(log_importance_weights)

    # Compute the KL divergence between the model and the reference model
    if self.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        )
        # Importance sampling correction for the KL divergence
        if self.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if self.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif self.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif self.loss_type == "vespo":
        phi_seq = trl_get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=self.args.vespo_k_pos,
            lambda_pos=self.args.vespo_lambda_pos,
            k_neg=self.args.vespo_k_neg,
            lambda_neg=self.args.vespo_lambda_neg,
        )
        per_token_loss = -phi_seq * advantages * per_token_logps

    if self.beta != 0.0:
        per_token_loss = per_token_loss + self.beta * per_token_kl

    mode = "train" if self.model.training else "eval"
    if self.loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no accum in eval
        loss = loss / normalizer
    elif self.loss_type in ["cispo", "dapo", "vespo"]:
        # `num_items_in_batch` spans the generation batch, so rescale it to one accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":  # in eval, the batch is neither split across steps nor accumulated
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
    elif self.loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss / normalizer

    if self._entropy_bonus_enabled:
        effective_mask = mask
        accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (
            (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor
        )
        apply_coef = self.entropy_coef
        loss = loss - apply_coef * entropy_loss

    def masked_seq_mean(x):
        if x.shape[1] == 1:  # when importance_sampling_level == "sequence": already one value per sequence
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:  # when importance_sampling_level == "sequence": one value per sequence
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if self.beta != 0.0:
        self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))

    self._metrics[mode]["entropy"].append(global_masked_mean(entropies))

    if self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(is_low_clipped.float()))
        self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(is_high_clipped.float()))
        self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(is_region_clipped.float()))
        gathered_low_clip = self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))
        self._metrics[mode]["clip_ratio/low_min"].append(trl_nanmin(gathered_low_clip).item())
        gathered_high_clip = self.accelerator.gather(masked_seq_mean(is_high_clipped.float()))
        self._metrics[mode]["clip_ratio/high_max"].append(trl_nanmax(gathered_high_clip).item())
    elif self.loss_type == "cispo":
        is_cispo_clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
        self._metrics[mode]["cispo_clip_ratio"].append(global_masked_mean(is_cispo_clipped.float()))
    elif self.loss_type == "vespo":
        self._metrics[mode]["vespo/phi_seq_mean"].append(global_masked_mean(phi_seq))
    return loss


# ----------------------------------------------------------------------------- the comparison
def trainer(loss_type, beta, *, ga, world, max_len, epsilon=0.2, epsilon_high=0.28, bias_correction_kl=True,
            level="token"):
    args = types.SimpleNamespace(steps_per_generation=ga, use_bias_correction_kl=bias_correction_kl,
                                 sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                                 vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    return types.SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=epsilon, epsilon_high=epsilon_high, max_completion_length=max_len,
        importance_sampling_level=level, current_gradient_accumulation_steps=ga,
        accelerator=types.SimpleNamespace(num_processes=world, reduce=lambda t, reduction: t, gather=lambda t: t),
        args=args, model=types.SimpleNamespace(training=True), _metrics={"train": collections.defaultdict(list)},
        _entropy_bonus_enabled=False, entropy_coef=0.0)


def rollout_tensors(rows=8, length=9, seed=0, iterations=1):
    g = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(rows, length, generator=g)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    mask[3] = 0  # a truncated completion, masked out of the loss
    advantages = torch.randn(rows, generator=g)
    advantages[5] = 0.0
    old = logps + 0.3 * torch.randn(rows, length, generator=g) if iterations > 1 else None
    ref = logps + 0.2 * torch.randn(rows, length, generator=g)
    return logps, old, ref, advantages, mask


def entropies_of(logps, seed=7):
    return 2 * torch.rand(logps.shape, generator=torch.Generator().manual_seed(seed))


# each loss type's upper epsilon here: where the ratios of num_iterations 2 (old log-probs 0.3 away) cross it
EPSILON_HIGH = {"cispo": 1.2}


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta,corrected", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_gradient_and_metrics_as_trl(loss_type, level, iterations, beta, corrected):
    """Each loss type of finetune/rl_losses.py against TRL's _compute_loss (as copied above) on the same
    tensors: the global batch of 8 completions split over 2 ranks x 2 micro-batches; TRL's loss (per
    micro-batch, summed over accumulation, averaged over ranks as DDP does) against ours (micro-batch
    sums over the global batch's count), values and gradients; the metrics (entropy, kl, clip ratios and
    their min/max, cispo's and vespo's) on one micro-batch. Token- and sequence-level (GSPO) ratios; with
    beta > 0 under both values of use_bias_correction_kl (TRL's default: true)."""
    world, ga, max_len = 2, 2, 9
    eps_high = EPSILON_HIGH.get(loss_type, 0.28)
    base, old, ref, advantages, mask = rollout_tensors(iterations=iterations)
    entropies = entropies_of(base)
    micro = [slice(i, i + 2) for i in range(0, 8, 2)]  # rank r's micro-batch k: micro[r * ga + k]
    settings = LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=eps_high, beta=beta,
                            max_completion_len=max_len, bias_correction_kl=corrected, importance_sampling_level=level)

    trl_logps = base.clone().requires_grad_()
    t = trainer(loss_type, beta, ga=ga, world=world, max_len=max_len, bias_correction_kl=corrected, level=level,
                epsilon_high=eps_high)
    trl_loss = 0.0
    for part in micro:
        inputs = {"completion_mask": mask[part], "advantages": advantages[part],
                  "ref_per_token_logps": ref[part], "num_items_in_batch": mask.sum()}
        if old is not None:
            inputs["old_per_token_logps"] = old[part]
        trl_loss = trl_loss + trl_compute_loss(t, trl_logps[part], inputs) / world
    trl_loss.backward()

    ours_logps = base.clone().requires_grad_()
    count = mask.sum() if loss_type in TOKEN_COUNTED else 8
    ours_loss = 0.0
    for part in micro:
        loss, _ = policy_loss(ours_logps[part], advantages[part], mask[part],
                              old_logps=old[part] if old is not None else None, ref_logps=ref[part], settings=settings)
        ours_loss = ours_loss + loss / count
    ours_loss.backward()
    assert abs(ours_loss.item() - trl_loss.item()) < 1e-6
    assert torch.allclose(ours_logps.grad, trl_logps.grad, rtol=0, atol=1e-6)
    assert trl_logps.grad.abs().sum() > 0

    t = trainer(loss_type, beta, ga=1, world=1, max_len=max_len, bias_correction_kl=corrected, level=level,
                epsilon_high=eps_high)  # metrics: one batch
    trl_compute_loss(t, base, {"completion_mask": mask, "advantages": advantages, "ref_per_token_logps": ref,
                               "num_items_in_batch": mask.sum(), **({"old_per_token_logps": old} if old is not None
                                                                    else {})}, entropies)
    sums = None
    for p in micro:
        sums = merged_sums(sums, policy_loss(base[p], advantages[p], mask[p], old_logps=old[p] if old is not None
                                             else None, ref_logps=ref[p], entropies=entropies[p], settings=settings)[1])
    objective = GRPO(Recipe(objective="grpo", loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high,
                            max_completion_len=max_len, use_bias_correction_kl=corrected,
                            importance_sampling_level=level, **REWARD))
    ours = dict(zip(objective.loss_metrics, objective.means(sums)))  # then the rollout's (NaN: none yet)
    theirs = {k: v[0] for k, v in t._metrics["train"].items() if v}
    assert set(ours) == set(theirs)
    for name in ours:
        assert abs(ours[name] - theirs[name]) < 1e-6, name
    if iterations == 2 and loss_type in CLIPPED and level == "token":
        assert theirs["clip_ratio/region_mean"] > 0 and theirs["clip_ratio/high_max"] > 0  # the clipping is exercised
    if iterations == 2 and loss_type == "cispo" and level == "token":
        assert 0 < theirs["cispo_clip_ratio"] < 1
    if beta:
        assert theirs["kl"] > 0


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_entropy_bonus_as_trl(loss_type):
    """entropy_coef (TRL's static entropy bonus: each micro-batch's mean token entropy, scaled for
    accumulation) on 2 ranks x 2 micro-batches: the loss and its gradients (of the log-probs and of the
    entropies) as TRL's, for every loss type (the bonus in each one's unit: rl_losses.entropy_bonus)."""
    world, ga, max_len, coef = 2, 2, 9, 0.3
    base, old, _, advantages, mask = rollout_tensors(iterations=2)
    entropies = entropies_of(base)
    micro = [slice(i, i + 2) for i in range(0, 8, 2)]
    t = trainer(loss_type, 0.0, ga=ga, world=world, max_len=max_len, epsilon_high=EPSILON_HIGH.get(loss_type, 0.28))
    t._entropy_bonus_enabled, t.entropy_coef = True, coef
    trl_logps, trl_ent = base.clone().requires_grad_(), entropies.clone().requires_grad_()
    trl_loss = sum(trl_compute_loss(t, trl_logps[p], {"completion_mask": mask[p], "advantages": advantages[p],
                                                      "old_per_token_logps": old[p], "num_items_in_batch": mask.sum()},
                                    trl_ent[p]) for p in micro) / world
    trl_loss.backward()
    count = mask.sum() if loss_type in TOKEN_COUNTED else 8
    settings = LossSettings(loss_type=loss_type, epsilon_high=EPSILON_HIGH.get(loss_type, 0.28), max_completion_len=max_len,
                            entropy_coef=coef)
    ours_logps, ours_ent = base.clone().requires_grad_(), entropies.clone().requires_grad_()
    ours_loss = sum(policy_loss(ours_logps[p], advantages[p], mask[p], old_logps=old[p], entropies=ours_ent[p],
                                settings=settings, micro_batch_count=count / len(micro))[0] for p in micro) / count
    ours_loss.backward()
    assert abs(ours_loss.item() - trl_loss.item()) < 1e-6
    assert torch.allclose(ours_logps.grad, trl_logps.grad, atol=1e-6)
    assert torch.allclose(ours_ent.grad, trl_ent.grad, atol=1e-7) and trl_ent.grad.abs().sum() > 0


def test_the_loss_types_differ():
    """The eight loss types are eight losses on the same tensors (num_iterations 2): no two give the same
    gradient of the loss (over its count), so a test above that passes for one cannot pass by another's
    formula."""
    base, old, ref, advantages, mask = rollout_tensors(iterations=2)
    grads = {}
    for loss_type in GRPO_LOSS_TYPES:
        logps = base.clone().requires_grad_()
        settings = LossSettings(loss_type=loss_type, max_completion_len=9)
        loss = sum(policy_loss(logps[p], advantages[p], mask[p], old_logps=old[p], settings=settings)[0]
                   for p in (slice(0, 4), slice(4, 8)))  # 2 micro-batches: bnpo's token mean is per micro-batch
        (loss / (mask.sum() if loss_type in TOKEN_COUNTED else len(mask))).backward()
        grads[loss_type] = logps.grad
    for a in GRPO_LOSS_TYPES:
        for b in GRPO_LOSS_TYPES:
            if a < b:
                assert not torch.allclose(grads[a], grads[b], atol=1e-6), (a, b)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_as_trl(scale):
    g = torch.Generator().manual_seed(3)
    per_func = torch.randn(12, 3, generator=g)
    per_func[2, 1] = float("nan")  # one function did not score this completion
    per_func[7] = float("nan")  # no function scored this one: advantage 0
    per_func[8:12, 0] = 1.0
    per_func[8:12, 1:] = float("nan")  # a group of equal rewards
    weights = torch.tensor([1.0, 0.5, 2.0])
    theirs, theirs_zero = trl_advantages(types.SimpleNamespace(reward_weights=weights, scale_rewards=scale), per_func, 4)
    ours, zero = group_advantages(per_func, weights, 4, scale)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6) and torch.equal(zero, theirs_zero)
    assert ours[7] == 0 and (ours[8:12] == 0).all()
    assert torch.isnan(weighted_rewards(per_func, weights)[7])


# ----------------------------------------------------------------------------- on a model
REWARD = {"reward_funcs": ["finetune.rewards:exact_match"]}


def tiny_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def test_rollout_batch_layout():
    batch = rollout_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 11, 12, 13]], [True, False], torch.tensor([0.5, -1.0]),
                          pad_id=0, mask_truncated=True, real=[True, False])
    assert batch["input_ids"].tolist() == [[1, 5, 6, 8, 9, 2], [1, 7, 10, 11, 12, 13]]
    assert batch["labels"].tolist() == [[IGNORE] * 3 + [8, 9, 2], [IGNORE] * 6]  # truncated, masked
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 6]
    assert batch["real"].tolist() == [True, False]
    kept = rollout_batch([[1, 7]], [[10, 11]], [False], torch.tensor([1.0]), pad_id=0)
    assert kept["labels"].tolist() == [[IGNORE, IGNORE, 10, 11]]


def rollout(seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (2 + i % 3,), generator=g).tolist() for i in range(4)]
    completions = [torch.randint(3, 97, (1 + (3 * i) % 5,), generator=g).tolist() for i in range(4)]
    return rollout_batch(prompts, completions, [True, True, False, True], torch.tensor([1.0, -0.5, 0.3, -0.8]),
                         pad_id=0)


def test_token_logps_chunked_as_full_values_and_gradients():
    model = tiny_model()
    batch = rollout()
    weights = torch.randn(batch["labels"].shape)
    grads = {}
    for impl in ("chunked", "full"):
        model.zero_grad()
        logps = token_logps(model, batch, impl, chunk=3)
        (logps * weights).sum().backward()
        grads[impl] = (logps.detach(), model.lm_head.weight.grad.clone(), model.model.embed_tokens.weight.grad.clone())
    mask = batch["labels"] != IGNORE
    assert (grads["full"][0][~mask] == 0).all() and (grads["full"][0][mask] < 0).all()
    for a, b in zip(grads["chunked"], grads["full"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # the layout: out[b, t] = log p(labels[b, t] | tokens before t)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    b, t = mask.nonzero()[0].tolist()
    direct = torch.log_softmax(logits[b, t - 1].float(), -1)[batch["input_ids"][b, t]]
    assert abs(direct.item() - grads["chunked"][0][b, t].item()) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_chunked_as_full_as_a_hand_computation(temperature):
    """Each completion token's entropy of softmax(logits / T) (TRL's `entropy` metric, its entropy_from_logits
    on the same logits), a chunk of tokens at a time inside the output layer as from the full logits, laid
    out as the labels, 0 elsewhere; the log-probs of the same call are token_logps'."""
    model = tiny_model()
    batch = rollout()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / temperature
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # the position before each token
        mask = batch["labels"] != IGNORE
        expected = torch.zeros_like(h)
        expected[:, 1:] = h[:, :-1] * mask[:, 1:]
        for impl in ("chunked", "full"):
            logps, entropies = token_logps_entropy(model, batch, impl, 3, temperature)
            assert torch.allclose(entropies, expected, atol=1e-5), impl
            assert torch.equal(logps, token_logps(model, batch, impl, 3, temperature))
    assert expected[mask].min() > 0


def test_token_entropy_gradient_chunked_as_full():
    """The entropy's gradient (TRL's entropy bonus, entropy_coef) through the chunked output layer equals
    autograd's through the full logits, together with the log-probs' and alone."""
    batch = rollout()
    weights = torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(3))
    for with_logps in (True, False):
        grads = []
        for impl in ("chunked", "full"):
            model = tiny_model()
            logps, entropies = token_logps_entropy(model, batch, impl, 3, 0.7)
            loss = (entropies * weights).sum() + ((logps * weights.flip(0)).sum() if with_logps else 0.0)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
        assert max(g.abs().max() for g in grads[0]) > 0


def test_cast_lm_head_to_fp32_computes_the_logits_in_float32():
    """cast_lm_head_to_fp32 (TRL's name, ScaleRL): a bf16 model's output layer computed in float32 from its
    (bf16) hidden states and weight, as a float32 lm_head would; without it the matmul is bf16's, which
    differs. The objective passes it to every log-prob it takes (policy, old, reference)."""
    import torch.nn.functional as F

    model = tiny_model().to(torch.bfloat16)
    batch = rollout()
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = F.linear(hidden.float(), model.lm_head.weight.float()) / 0.7
        mask = batch["labels"] != IGNORE
        targets = batch["labels"][:, 1:].clamp(min=0)
        expected = torch.zeros(mask.shape)
        expected[:, 1:] = torch.log_softmax(logits, -1)[:, :-1].gather(-1, targets[..., None]).squeeze(-1) * mask[:, 1:]
        cast = token_logps(model, batch, "chunked", None, 0.7, torch.float32)
        plain = token_logps(model, batch, "chunked", None, 0.7)
    assert torch.allclose(cast, expected, rtol=0, atol=1e-5)
    assert (plain - expected).abs().max() > 1e-4 > 10 * (cast - expected).abs().max()  # bf16 logits: visibly not fp32
    objective = GRPO(Recipe(objective="grpo", cast_lm_head_to_fp32=True, **REWARD))
    assert objective.head_dtype is torch.float32 and GRPO(Recipe(objective="grpo", **REWARD)).head_dtype is None


def test_objective_on_a_model_is_policy_loss_of_its_logps():
    model = tiny_model()
    batch = rollout()
    with torch.no_grad():
        batch["old_logps"] = token_logps(model, batch, "full") + 0.3  # ratio exp(-0.3) < 1 - epsilon: clipped
        batch["ref_logps"] = batch["old_logps"] - 0.2
    recipe = Recipe(objective="grpo", loss_type="grpo", beta=0.04, num_iterations=2, max_completion_len=8, **REWARD)
    objective = GRPO(recipe)
    loss = objective.loss(model, batch)
    mask = batch["labels"] != IGNORE
    full, entropies = token_logps_entropy(model, batch, "full")
    expected, sums = policy_loss(full, batch["advantages"], mask, old_logps=batch["old_logps"],
                                 ref_logps=batch["ref_logps"], entropies=entropies, loss_type="grpo", beta=0.04,
                                 epsilon=0.2, epsilon_high=0.2)
    assert abs(loss.item() - expected.item()) < 1e-5
    assert objective.loss_metrics == ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                      "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")
    assert objective.metrics[7:] == ("rewards/exact_match/mean", "rewards/exact_match/std", "reward", "reward_std",
                                     "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                                     "completions/max_length", "completions/clipped_ratio", "rollout_seconds")
    taken = objective.take_metrics()
    assert torch.allclose(taken, sums, rtol=1e-5) and objective.take_metrics() is None
    assert taken[1] > 0  # the entropy
    assert taken[3] > 0 and taken[3] == taken[5] and taken[4] == 0  # negative advantages' tokens clipped low
    assert objective.counts([batch]).tolist() == [4, mask.sum().item(), batch["attention_mask"].sum().item()]
    dapo = GRPO(Recipe(objective="grpo", loss_type="dapo", max_completion_len=8, **REWARD))
    assert dapo.counts([batch])[0] == mask.sum() and dapo.metrics[:2] == ("entropy", "clip_ratio/low_mean")


def test_bias_corrected_kl_against_a_hand_computation():
    """use_bias_correction_kl: the k3 term times the ratio r = exp(logp - old), whose gradient acts even
    where r is 1: d/dlogp [r k3] = r k3 + r (1 - exp(ref - logp)); off: d k3/dlogp = 1 - exp(ref - logp)."""
    base, old, ref, _, mask = rollout_tensors(iterations=2)
    zero = torch.zeros(8)  # no policy term: the loss is the KL term alone
    for olds in (old, None):  # num_iterations 2, and 1 (old = logp detached: r = 1)
        r = torch.exp(base - (base if olds is None else olds))
        delta = ref - base
        k3 = torch.exp(delta) - delta - 1
        for corrected, value, grad in ((True, r * k3, r * k3 + r * (1 - torch.exp(delta))),
                                       (False, k3, 1 - torch.exp(delta))):
            logps = base.clone().requires_grad_()
            loss, sums = policy_loss(logps, zero, mask, old_logps=olds, ref_logps=ref, loss_type="dapo", beta=0.04,
                                     bias_correction_kl=corrected)
            loss.backward()
            assert torch.allclose(loss, 0.04 * (value * mask).sum(), rtol=1e-6)
            assert torch.allclose(logps.grad, 0.04 * grad * mask, rtol=1e-5, atol=1e-7)
            assert torch.allclose(sums[0].float(), (value * mask).sum(), rtol=1e-6)  # the kl metric: the term
        if olds is None:
            assert not torch.allclose(r * k3 + r * (1 - torch.exp(delta)), 1 - torch.exp(delta))


def test_recipe_offers_use_bias_correction_kl_with_trls_default():
    assert Recipe(objective="grpo", **REWARD).use_bias_correction_kl is True
    assert GRPO(Recipe(objective="grpo", beta=0.04, use_bias_correction_kl=False, **REWARD)).settings.bias_correction_kl is False


def test_the_objective_scores_at_its_sampling_temperature():
    """At temperature 0.7 the policy's log-probs in the loss, the old ones kept at the rollout
    (num_iterations 2) and the frozen reference's are log_softmax(logits / 0.7), as TRL's and verl's."""
    import contextlib
    import copy

    from finetune.training.reference import Frozen

    model = tiny_model()
    reference_model = tiny_model(seed=3).requires_grad_(False)
    recipe = Recipe(objective="grpo", loss_type="grpo", beta=0.04, num_iterations=2, temperature=0.7,
                    micro_batch_size=4, max_completion_len=8, **REWARD)
    objective = GRPO(recipe)
    objective.reference = Frozen(reference_model, types.SimpleNamespace(autocast=contextlib.nullcontext), recipe)
    run = types.SimpleNamespace(recipe=recipe, model=model, accelerator=types.SimpleNamespace(device="cpu"),
                                tokenizer=types.SimpleNamespace(pad_token_id=0))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (2 + i % 3,), generator=g).tolist() for i in range(4)]
    completions = [torch.randint(3, 97, (1 + (3 * i) % 5,), generator=g).tolist() for i in range(4)]
    [batch] = objective.batches(run, prompts, completions, [True] * 4, torch.tensor([1.0, -0.5, 0.3, -0.8]))

    def direct(m, temperature=0.7):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"]
        targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        logps = torch.log_softmax(logits / temperature, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        return torch.nn.functional.pad((logps * (targets != IGNORE))[:, :-1], (1, 0))

    with torch.no_grad():
        assert torch.allclose(batch["old_logps"], direct(model), atol=1e-5)
        assert torch.allclose(batch["ref_logps"], direct(reference_model), atol=1e-5)
        assert not torch.allclose(batch["old_logps"], direct(model, 1.0), atol=1e-3)
    moved = copy.deepcopy(model)  # a step later: the policy moved, so the ratio is not 1
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    loss = objective.loss(moved, batch)
    expected, _ = policy_loss(direct(moved), batch["advantages"], batch["labels"] != IGNORE,
                              old_logps=batch["old_logps"], ref_logps=batch["ref_logps"], loss_type="grpo", beta=0.04,
                              epsilon=0.2, epsilon_high=0.2)
    assert abs(loss.item() - expected.item()) < 1e-5


# ----------------------------------------------------------------------------- the rollout phase's pure parts
def test_completion_seeds_are_stable_and_distinct():
    from finetune.training.rollouts import completion_seed

    seeds = {completion_seed(42, k, row, j) for k in range(3) for row in (0, 7, 4000) for j in range(8)}
    assert len(seeds) == 3 * 3 * 8 and all(0 <= s < 2**63 for s in seeds)
    # a pure function of its arguments: not Python's hash(), which differs per process (PYTHONHASHSEED)
    assert completion_seed(42, 1, 7, 3) == completion_seed(42, 1, 7, 3) == 8721221471273241057  # pinned: a change would break resuming older runs
    assert completion_seed(43, 1, 7, 3) != completion_seed(42, 1, 7, 3)


def test_each_rank_gets_whole_groups_and_the_prompts_do_not_depend_on_the_process_count():
    from finetune.training.rollouts import prompt_schedule, rank_prompts

    schedule = prompt_schedule(100, 8, seed=3)
    step = schedule.rows(2, 0)[0]
    assert len(step) == 8 and len(set(step)) == 8
    assert step == prompt_schedule(100, 8, seed=3).rows(2, 0)[0]
    for ranks in (1, 2, 4):
        shares = [rank_prompts(step, rank, ranks) for rank in range(ranks)]
        assert [row for share in shares for row in share] == step and {len(s) for s in shares} == {8 // ranks}
    with pytest.raises(ValueError, match="8 prompts do not split over 3 ranks"):
        rank_prompts(step, 0, 3)
    epoch = [row for k in range(schedule.steps_per_epoch) for row in schedule.rows(k, 0)[0]]
    assert len(set(epoch)) == len(epoch) == 96  # an epoch reads each prompt at most once


def test_grpo_global_batch_counts_prompts():
    from finetune.plan import derive_grad_accum
    from finetune.recipe import RecipeError

    r = Recipe(objective="grpo", reward_funcs=("finetune.rewards:exact_match",), global_batch_size=4,
               num_generations=4, micro_batch_size=4)
    assert derive_grad_accum(r, 1) == 4 and derive_grad_accum(r, 2) == 2 and derive_grad_accum(r, 4) == 1
    with pytest.raises(RecipeError, match="global_batch_size=4 prompts do not split into whole groups on 8"):
        derive_grad_accum(r, 8)


def test_rollouts_file_is_cut_to_the_resumed_step(tmp_path):
    from finetune.training.rollouts import keep_rollouts, read_rollouts

    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"step": s, "completion": "x"}) + "\n" for s in (1, 1, 3, 3, 5)))
    keep_rollouts(path, 4)
    assert [r["step"] for r in read_rollouts(path)] == [1, 1, 3, 3]
    keep_rollouts(path, 0)
    assert not path.exists()


def test_a_torn_last_line_of_rollouts_is_cut_without_being_read(tmp_path):
    """A kill or a full disk in the middle of a write leaves half a record past the checkpoint: the resume
    cuts the file by step, up to the first line that is not a whole record, and parses nothing past it
    (before: JSONDecodeError on every resume)."""
    from finetune.training.rollouts import keep_rollouts, read_rollouts, write_rollouts

    path = tmp_path / "rollouts.jsonl"
    ds = {"prompt": ["p0", "p1"]}
    for step in (1, 2, 3):
        write_rollouts(path, step, step - 1, [0], _Rows(ds), 2, [[5], [6]], ["a", "b"], [True, False],
                       ["f"], torch.tensor([[1.0], [float("nan")]]), torch.tensor([1.0, float("nan")]),
                       torch.tensor([0.5, -0.5]))
    whole = path.read_bytes()
    torn = whole + b'{"step": 4, "rollout": 3, "row": 0, "prompt": "p0", "compl'
    path.write_bytes(torn)
    keep_rollouts(path, 3)
    assert path.read_bytes() == whole
    assert [r["step"] for r in read_rollouts(path)] == [1, 1, 2, 2, 3, 3]
    assert read_rollouts(path)[1]["reward"] is None and read_rollouts(path)[1]["rewards"] == {"f": None}
    path.write_bytes(torn)
    keep_rollouts(path, 2)  # a torn line past an earlier checkpoint: cut at that checkpoint's step
    assert path.read_bytes() == whole[:whole.index(b'{"step": 3')]
    path.write_bytes(whole[:-1])  # a last line without its end: a cut write, even if it parses
    keep_rollouts(path, 3)
    assert path.read_bytes() == whole[:whole.rindex(b'{"step": 3')]


def test_a_full_disk_writing_rollouts_names_the_file(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does: one line naming the file (before: a
    bare OSError: [Errno 28] No space left on device)."""
    from finetune.recipe import RecipeError
    from finetune.training.rollouts import write_rollouts

    with pytest.raises(RecipeError, match=r"cannot write /dev/full at step 7: No space left on device; the run "
                                          r"stopped before step 7's update, its last checkpoint is intact"):
        write_rollouts("/dev/full", 7, 6, [0], _Rows({"prompt": ["p"]}), 1, [[5]], ["a"], [True], ["f"],
                       torch.tensor([[1.0]]), torch.tensor([1.0]), torch.tensor([0.0]))


class _Rows:
    """A dataset's rows as write_rollouts reads them (ds[rows]["prompt"])."""

    def __init__(self, columns):
        self.columns = columns
        self.column_names = list(columns)

    def __getitem__(self, rows):
        return {k: [v[i] for i in rows] for k, v in self.columns.items()}


def test_char_rewards():
    from finetune.rewards import answer_chars, char_match

    assert char_match(["abc", "ab", "abcd", "xbc", ""], ["abc"] * 5) == [1.0, 2 / 3, 0.75, 2 / 3, 0.0]
    assert answer_chars(["aab", "ax", "", " b "], ["ab"] * 4) == [1.0, 0.5, 0.0, 1.0]


# ----------------------------------------------------------------------------- the eval's pure parts
def test_eval_seeds_are_stable_and_apart_from_the_rollouts():
    from finetune.training.rollouts import completion_seed, eval_seed

    seeds = {eval_seed(42, row, j) for row in (0, 7, 199) for j in range(8)}
    assert len(seeds) == 3 * 8 and all(0 <= s < 2**63 for s in seeds)
    # a pure function of (seed, eval row, completion): the same at every eval, on any rank, after a resume
    assert eval_seed(42, 7, 3) == eval_seed(42, 7, 3) == 9022562333084904723  # pinned: a resumed run resamples it
    assert eval_seed(43, 7, 3) != eval_seed(42, 7, 3)
    assert not seeds & {completion_seed(42, k, row, j) for k in range(4) for row in (0, 7, 199) for j in range(8)}


def test_eval_batches_split_over_any_number_of_ranks_in_order():
    from finetune.training.rollouts import eval_prompt_batches, eval_share

    assert eval_prompt_batches(5, 4) == [[0, 1, 2, 3], [4]] and eval_prompt_batches(0, 4) == []
    for count in range(10):
        for ranks in (1, 2, 3, 4):
            for rows in eval_prompt_batches(count, 4):
                shares = [eval_share(rows, rank, ranks) for rank in range(ranks)]
                assert [row for share in shares for row in share] == rows  # contiguous, in rank order
                assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [eval_share([4], rank, 2) for rank in (0, 1)] == [[4], []]  # a rank may get none


def test_eval_metrics_do_not_depend_on_how_many_ranks_generated():
    """The same completions of 7 eval prompts (3 a batch, groups of 4), split over 1, 2 or 3 ranks as
    GRPO.evaluate splits them: the same metrics exactly, the rollout's metrics over all of them."""
    from finetune.rewards import weighted_rewards
    from finetune.training.rollouts import eval_metrics, eval_prompt_batches, eval_share, rollout_metrics

    g, names, weights = 4, ["a", "b"], torch.tensor([1.0, 0.5])
    torch.manual_seed(0)
    per_func = torch.rand(7 * g, 2)
    per_func[3, 1] = per_func[9] = float("nan")  # a function that did not score one, a completion none scored
    tokens = [[1] * (1 + i % 5) for i in range(7 * g)]
    stopped = [i % 3 != 0 for i in range(7 * g)]

    def gathered(ranks):
        out = []
        for rows in eval_prompt_batches(7, 3):
            parts = []
            for rank in range(ranks):
                idx = [row * g + j for row in eval_share(rows, rank, ranks) for j in range(g)]
                parts.append(([tokens[i] for i in idx], [stopped[i] for i in idx], per_func[idx].tolist(), None))
            out.append(parts)
        return out

    one = eval_metrics(gathered(1), weights, names, g)
    assert eval_metrics(gathered(2), weights, names, g) == one == eval_metrics(gathered(3), weights, names, g)
    assert one["reward"] == pytest.approx(torch.nanmean(weighted_rewards(per_func, weights)).item())
    assert one["rewards/b/mean"] == pytest.approx(torch.nanmean(per_func[:, 1]).item())
    assert one["completions/mean_length"] == pytest.approx(sum(map(len, tokens)) / len(tokens))
    assert one["completions/clipped_ratio"] == pytest.approx(stopped.count(False) / len(stopped))
    assert "rollout_seconds" not in one
    assert set(one) == set(rollout_metrics(per_func, weights, names, torch.zeros(1), torch.ones(1),
                                           torch.zeros(1, dtype=torch.bool)))


def test_a_reward_failure_on_any_rank_is_every_ranks():
    from finetune.training.rollouts import first_failure

    assert first_failure([([], [], [], None), ([], [], [], None)]) is None
    assert first_failure([([], [], [], None), ([], [], [], "step 3: reward function f raised")]) == \
        "step 3: reward function f raised"


def test_the_eval_shows_the_reward_where_there_is_no_eval_loss():
    """GRPO has no eval loss: the summary gives its eval reward, without an eval loss row of n/a."""
    from finetune.training.metrics import format_summary

    grpo = GRPO(Recipe(objective="grpo", reward_funcs=("finetune.rewards:exact_match",)))
    assert grpo.evaluates
    summary = {"steps": 3, "train_seconds": 1.0, "wall_seconds": 2.0, "tokens": 10, "tokens_per_s": 10.0,
               "final_eval_loss": None, "best_eval_loss": None, "final_eval_reward": 0.25}
    rows = [" ".join(line.split()) for line in format_summary(summary, grpo.shown).splitlines()]
    assert "eval metrics reward 0.2500 (final)" in rows and not any(r.startswith("eval loss") for r in rows)


def test_dynamic_sampling_keeps_the_groups_with_a_signal_in_generation_order():
    """Half the groups have equal rewards (std 0, or none scored): the batch takes the groups with a signal
    in the order the generation batches made them, the first `wanted`; with too few, groups of equal
    rewards after them; the dropped groups not in the batch are named (batch, group)."""
    from finetune.training.rollouts import fill_groups, signal_groups

    g, weights = 2, torch.tensor([1.0])
    nan = float("nan")
    first = ([10, 11, 12, 13], [[i] for i in range(8)], [True] * 8,
             torch.tensor([[1.0], [0.0], [0.5], [0.5], [nan], [nan], [0.2], [0.3]]), [{"c": i} for i in range(8)])
    second = ([20, 21], [[i] for i in range(8, 12)], [False] * 4, torch.tensor([[0.0], [0.0], [1.0], [nan]]),
              [None] * 4)
    assert signal_groups(first[3], weights, g).tolist() == [True, False, False, True]
    assert signal_groups(second[3], weights, g).tolist() == [False, False]  # one scored: no std
    rows, tokens, stopped, rewards, talk, found, dropped = fill_groups([first, second], 2, weights, g)
    assert rows == [10, 13] and tokens == [[0], [1], [6], [7]] and found == 2 and stopped == [True] * 4
    assert talk == [{"c": 0}, {"c": 1}, {"c": 6}, {"c": 7}]  # each completion's conversation goes with it
    assert rewards.view(-1)[:2].tolist() == [1.0, 0.0] and dropped == [(0, 1), (0, 2), (1, 0), (1, 1)]
    rows, tokens, _, _, _, found, dropped = fill_groups([first, second], 4, weights, g)
    assert rows == [10, 13, 11, 12] and found == 2 and dropped == [(1, 0), (1, 1)]  # short: equal groups fill in


def test_refill_prompts_and_seeds_are_their_own_and_stable():
    from finetune.training.rollouts import completion_seed, prompt_schedule, refill_schedule

    base = prompt_schedule(100, 4, 7).rows(3, 0)[0]
    refills = [refill_schedule(100, 4, 7, b).rows(3, 0)[0] for b in (1, 2)]
    assert refills[0] != base and refills[1] != refills[0]
    assert refills[0] == refill_schedule(100, 4, 7, 1).rows(3, 0)[0]  # a pure function of (seed, batch, rollout)
    assert completion_seed(7, 3, 5, 0) == completion_seed(7, 3, 5, 0, batch=0)  # batch 0: the seeds as before
    assert len({completion_seed(7, 3, 5, 0, batch=b) for b in range(3)}) == 3


def test_the_entropy_bonus_unit_is_the_loss_count_per_micro_batch():
    """The entropy bonus's scale (GRPO.count_per_micro_batch): the rollout's count over its micro-batches,
    completions for completion-counted types, completion tokens (those in the loss) for the others."""
    tokens, stopped = [[1] * 3, [1] * 5, [1] * 2, [1] * 6], [True, False, True, True]
    grpo = GRPO(Recipe(objective="grpo", loss_type="grpo", micro_batch_size=2, **REWARD))
    assert grpo.count_per_micro_batch(tokens, stopped) == 2.0
    dapo = GRPO(Recipe(objective="grpo", loss_type="dapo", micro_batch_size=2, **REWARD))
    assert dapo.count_per_micro_batch(tokens, stopped) == 16 / 2
    masked = GRPO(Recipe(objective="grpo", loss_type="cispo", micro_batch_size=2, mask_truncated_completions=True,
                         **REWARD))
    assert masked.count_per_micro_batch(tokens, stopped) == 11 / 2
    talk = [{"tool_mask": [1] * (len(t) - 1) + [0]} for t in tokens]  # with tools: the tokens the model drew
    assert dapo.count_per_micro_batch(tokens, stopped, talk) == (16 - len(tokens)) / 2


@pytest.mark.parametrize("changes,message", [
    ({"loss_type": "dapo", "sapo_temperature_pos": 2.0},
     "sapo_temperature_pos=2 applies to loss_type=sapo only (loss_type=dapo has no use for it); set loss_type=sapo"),
    ({"loss_type": "grpo", "vespo_lambda_neg": 5.0}, "vespo_lambda_neg=5 applies to loss_type=vespo only"),
    ({"loss_type": "sapo", "vespo_k_pos": 1.0}, "vespo_k_pos=1 applies to loss_type=vespo only"),
    ({"loss_type": "vespo", "vespo_k_neg": -1.0}, "vespo_k_neg=-1: must be >= 0; the weight phi(w)"),
    ({"loss_type": "vespo", "vespo_lambda_pos": 0.0}, "vespo_lambda_pos=0: must be > 0"),
    ({"loss_type": "vespo", "vespo_k_pos": 10.0, "vespo_lambda_pos": 1.0},
     "vespo_k_pos=10 with vespo_lambda_pos=1: the weight phi(w) = exp(lambda + k log w - lambda w) peaks at 1.2e+06 "
     "(at the ratio w = 10)"),
    ({"loss_type": "vespo", "vespo_k_neg": 0.0, "vespo_lambda_neg": 40.0},
     "vespo_k_neg=0 with vespo_lambda_neg=40: the weight phi(w) = exp(lambda + k log w - lambda w) peaks at 2.4e+17 "
     "(at the ratio w = 1e-08)"),
])
def test_loss_type_keys_and_vespo_weights_that_blow_up_are_refused(changes, message):
    """sapo's and vespo's keys were accepted and ignored under the other loss types; vespo's weight could peak
    at millions (one sequence outweighing a step) and the run stop on a NaN blamed on the learning rate."""
    from finetune.recipe import RecipeError, validate

    with pytest.raises(RecipeError) as e:
        validate(Recipe(objective="grpo", **REWARD, dataset_format="prompt", num_generations=2, global_batch_size=4,
                        micro_batch_size=4, **changes))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_vespo_s_peak_is_the_weight_s_largest_value():
    """The bound's peak against rl_losses.gamma_weights itself, over the sequence ratios it is computed for."""
    from finetune.objective_rules.grpo import vespo_peak, vespo_problem
    from finetune.rl_losses import gamma_weights

    log_w = torch.linspace(math.log(1e-8), 20.0, 200001).unsqueeze(1)
    for k, lam in ((2.0, 3.0), (3.0, 2.0), (10.0, 1.0), (5.0, 5.0), (0.5, 4.0)):
        phi = gamma_weights(torch.ones(len(log_w), 1), log_w, torch.ones(len(log_w), 1), k_pos=k, lambda_pos=lam)
        assert math.log(phi.double().max().item()) == pytest.approx(vespo_peak(k, lam)[0], abs=1e-3)
    assert all(vespo_problem(k, lam, side) is None for k, lam, side in ((2.0, 3.0, "pos"), (3.0, 2.0, "neg"),
                                                                           (5.0, 5.0, "pos"), (20.0, 10.0, "neg")))


def test_a_loss_that_stops_being_finite_names_the_loss_s_own_settings(tmp_path):
    """A NaN stop blamed the learning rate or the data; where entropy_coef, sapo's or vespo's settings were
    changed from TRL's defaults it names them first."""
    from finetune.checkpointing.checkpoint import LoopState
    from finetune.training.loop import NonFiniteError, skip_nonfinite

    r = Recipe(objective="grpo", loss_type="vespo", vespo_k_pos=4.0, vespo_lambda_pos=4.0, entropy_coef=0.5, **REWARD)
    with pytest.raises(NonFiniteError) as e:
        skip_nonfinite(LoopState(step=2), math.nan, 1.0, r, tmp_path)
    assert ("stopped without saving (entropy_coef=0.5 (TRL's default: 0) and vespo_k_pos=4 (TRL's default: 2) and "
            "vespo_lambda_pos=4 (TRL's default: 3) enter this loss and can make it blow up: try the default first; "
            "no checkpoint had been saved") in str(e.value)
    with pytest.raises(NonFiniteError) as e:
        skip_nonfinite(LoopState(step=2), math.nan, 1.0, Recipe(objective="grpo", **REWARD), tmp_path)
    assert "default first" not in str(e.value) and "(no checkpoint had been saved" in str(e.value)
