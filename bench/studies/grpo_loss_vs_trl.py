"""GRPO's loss against TRL's own GRPOTrainer._compute_loss (trl 1.16, called on a stand-in trainer whose
per-token log-probs are fixed tensors), for grpo, dapo, dr_grpo x num_iterations 1, 2 x beta 0, 0.04, on
tests/test_grpo_objective.py's tensors (8 completions of up to 9 tokens, one truncated and masked out,
one with advantage 0; old log-probs 0.3 away with num_iterations 2, the reference's 0.2 away):

- TRL's real _compute_loss on the whole batch (one process, one micro-batch): loss, the gradient of the
  per-token log-probs, and its metrics that finetune keeps (kl with beta > 0, clip_ratio/low_mean,
  high_mean, region_mean; not entropy, clip_ratio/low_min, high_max);
- finetune's policy_loss on the same batch split as 2 ranks x 2 micro-batches (each micro-batch's sum
  over the global batch's count, summed: what the loop steps on), and GRPO.means for the metrics;
- the lines tests/test_grpo_objective.py copies from TRL, against TRL's real method (that the copy is
  still TRL's).

Needs trl importable (pip install -e .[bench], or PYTHONPATH=DIR holding a `pip install --no-deps
--target DIR trl==1.16.0`):

    PYTHONPATH=.:/path/to/trl python bench/studies/grpo_loss_vs_trl.py
"""
from pathlib import Path
import collections
import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from trl.trainer.grpo_trainer import GRPOTrainer
import test_grpo_objective as T
from finetune.training.objectives.grpo import GRPO, policy_loss
from finetune.recipe import Recipe

EPS, EPS_HIGH, MAX_LEN, ROWS = 0.2, 0.28, 9, 8
MICRO = [slice(i, i + 2) for i in range(0, ROWS, 2)]  # 2 ranks x 2 micro-batches of 2 completions


def trl_real(loss_type, beta, base, old, ref, adv, mask):
    """TRL's GRPOTrainer._compute_loss itself: loss, d loss / d logps, metrics."""
    fake = T.trainer(loss_type, beta, ga=1, world=1, max_len=MAX_LEN, epsilon=EPS, epsilon_high=EPS_HIGH)
    fake.top_entropy_quantile = 1.0; fake.aux_loss_enabled = False; fake.off_policy_mask_threshold = None
    fake.use_vllm = False; fake._entropy_bonus_enabled = False
    fake.args.delta = None; fake.args.use_bias_correction_kl = False
    fake.accelerator.gather = lambda t: t.reshape(-1)
    fake._metrics["train"] = collections.defaultdict(list)
    logp = base.clone().requires_grad_()
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    inputs = {"prompt_ids": torch.ones(ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 1),
              "completion_ids": torch.ones(ROWS, MAX_LEN, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    metrics = {k: v[0] for k, v in fake._metrics["train"].items() if v}
    return loss.item(), logp.grad, metrics, inputs


def ours(loss_type, beta, base, old, ref, adv, mask):
    """finetune's loss as the loop steps on it: per micro-batch sums over the global batch's count."""
    logp = base.clone().requires_grad_()
    count = mask.sum() if loss_type == "dapo" else ROWS
    total, sums = 0.0, None
    for p in MICRO:
        loss, s = policy_loss(logp[p], adv[p], mask[p], old_logps=old[p] if old is not None else None,
                              ref_logps=ref[p], loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta,
                              max_completion_len=MAX_LEN)
        total = total + loss / count
        sums = s if sums is None else sums + s
    total.backward()
    objective = GRPO(Recipe(objective="grpo", loss_type=loss_type, beta=beta, epsilon=EPS, epsilon_high=EPS_HIGH,
                            max_completion_len=MAX_LEN, reward_funcs=("finetune.rewards:exact_match",)))
    names = [n for n in objective.metrics if n == "kl" or n.startswith("clip_ratio/")]
    return total.item(), logp.grad, dict(zip(names, objective.means(sums)))


def main():
    rows, worst_all, worst_copy = [], 0.0, 0.0
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        for it in (1, 2):
            for beta in (0.0, 0.04):
                base, old, ref, adv, mask = T.rollout_tensors(iterations=it)
                t_loss, t_grad, t_metrics, inputs = trl_real(loss_type, beta, base, old, ref, adv, mask)
                o_loss, o_grad, o_metrics = ours(loss_type, beta, base, old, ref, adv, mask)
                # TRL also logs entropy and clip_ratio/low_min, high_max (a min / max over sequences), which
                # finetune does not keep (its metrics reduce by sum); every metric finetune keeps is compared
                assert set(o_metrics) <= set(t_metrics), (set(o_metrics), set(t_metrics))
                d_metric = max(abs(o_metrics[k] - t_metrics[k]) for k in o_metrics)
                assert t_grad.abs().sum() > 0 and o_grad.abs().sum() > 0  # the gradients compared are not zero
                d_loss, d_grad = abs(o_loss - t_loss), (o_grad - t_grad).abs().max().item()
                copy = T.trainer(loss_type, beta, ga=1, world=1, max_len=MAX_LEN, epsilon=EPS, epsilon_high=EPS_HIGH)
                d_copy = abs(T.trl_compute_loss(copy, base, inputs).item() - t_loss)
                d_copy = max([d_copy] + [abs(v[0] - t_metrics[k]) for k, v in copy._metrics["train"].items() if v])
                worst_all = max(worst_all, d_loss, d_grad, d_metric)
                worst_copy = max(worst_copy, d_copy)
                rows.append((loss_type, it, beta, t_loss, d_loss, d_grad, d_metric, t_metrics.get("kl", float("nan")),
                             t_metrics["clip_ratio/region_mean"]))
    import trl

    print(f"trl {trl.__version__}, torch {torch.__version__}; epsilon {EPS}, epsilon_high {EPS_HIGH}, "
          f"{ROWS} completions of up to {MAX_LEN} tokens; finetune on 2 ranks x 2 micro-batches, TRL on one batch")
    print()
    print("| loss_type | num_iterations | beta | TRL loss | loss: abs diff | gradient: max abs diff | metrics: max abs diff "
          "| TRL kl | TRL clip_ratio/region_mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lt, it, beta, loss, dl, dg, dm, kl, clip in rows:
        print(f"| {lt} | {it} | {beta:g} | {loss:.6f} | {dl:.1e} | {dg:.1e} | {dm:.1e} | "
              f"{'-' if kl != kl else f'{kl:.6f}'} | {clip:.4f} |")
    print()
    print(f"largest difference, finetune against TRL's _compute_loss (loss, gradient, metrics): {worst_all:.1e}; "
          f"within 1e-5: {'yes' if worst_all <= 1e-5 else 'NO'}")
    print(f"tests/test_grpo_objective.py's copied lines against TRL's _compute_loss: {worst_copy:.1e}")
    return 0 if worst_all <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
