"""GRPO's loss against TRL's own GRPOTrainer (trl 1.16), in two parts.

1. On tensors: TRL's _compute_loss, called on a stand-in trainer whose per-token log-probs are fixed
   tensors, for grpo, dapo, dr_grpo x num_iterations 1, 2 x beta 0 and 0.04 (with beta > 0 under both
   values of use_bias_correction_kl), on tests/test_grpo_objective.py's tensors (8 completions of up to 9
   tokens, one truncated and masked out, one with advantage 0; old log-probs 0.3 away with num_iterations
   2, the reference's 0.2 away). Compared: the loss, the gradient of the per-token log-probs, and the
   metrics finetune keeps (kl with beta > 0, clip_ratio/low_mean, high_mean, region_mean), finetune's
   policy_loss on the batch split as 2 ranks x 2 micro-batches; and the lines tests/test_grpo_objective.py
   copies from TRL against TRL's real method.

2. On a model, log-probs included: the same completions replayed through both trainers for STEPS
   optimizer steps (AdamW) at temperature 0.7, beta 0.04, num_iterations 2, from the same random tiny
   Llama (fp32). TRL: its real _get_per_token_logps_and_entropies on the model patched by its own
   add_fused_lm_head(temperature) (what GRPOTrainer.__init__ does), for the loss, for the old log-probs at
   each rollout's first step and for the reference (a frozen copy of the starting weights), then its real
   _compute_loss, on the whole batch. finetune: GRPO.token_logps (the old log-probs), the frozen
   reference's token_logps at the objective's temperature (finetune.training.reference.Frozen) and
   GRPO.loss on the batch in 2 micro-batches (each over the global batch's count). Compared at every
   step: the loss, the gradient of every weight; after the last step, the weights. Rows for each loss
   type under use_bias_correction_kl true (TRL's default) and false, and two rows that show what the
   comparison catches: finetune's log-probs of the raw logits (temperature 1, while the completions were
   sampled at 0.7), and finetune's plain k3 KL against TRL's default.

Needs trl importable (pip install -e .[bench], or PYTHONPATH=DIR holding a `pip install --no-deps
--target DIR trl==1.16.0`):

    python bench/studies/grpo_loss_vs_trl.py
"""
from pathlib import Path
import collections
import contextlib
import copy
import sys
import types

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head
import test_grpo_objective as T
from finetune.data import IGNORE
from finetune.training.objectives.grpo import GRPO
from finetune.rl_losses import policy_loss
from finetune.training.rollouts import rollout_batch
from finetune.training.reference import Frozen
from finetune.recipe import Recipe

EPS, EPS_HIGH, MAX_LEN, ROWS = 0.2, 0.28, 9, 8
MICRO = [slice(i, i + 2) for i in range(0, ROWS, 2)]  # 2 ranks x 2 micro-batches of 2 completions
TOLERANCE = 1e-5

# part 2: the replay on a model
TEMPERATURE, BETA, ITERATIONS, STEPS, LR = 0.7, 0.04, 2, 4, 1e-3
PROMPT_LEN, COMPLETIONS, VOCAB = 5, 8, 97


def stand_in(loss_type, beta, corrected, *, max_len):
    """A GRPOTrainer without __init__: the attributes _compute_loss and _get_per_token_logps_and_entropies
    read, for one process and one micro-batch a step."""
    fake = T.trainer(loss_type, beta, ga=1, world=1, max_len=max_len, epsilon=EPS, epsilon_high=EPS_HIGH,
                     bias_correction_kl=corrected)
    fake.top_entropy_quantile = 1.0; fake.aux_loss_enabled = False; fake.off_policy_mask_threshold = None
    fake.use_vllm = False; fake._entropy_bonus_enabled = False
    fake.args.delta = None
    fake.accelerator.gather = lambda t: t.reshape(-1)
    fake.accelerator.autocast = contextlib.nullcontext
    fake.accelerator.is_main_process = True  # TRL's profiling decorator reads it
    fake._metrics["train"] = collections.defaultdict(list)
    return fake


# ---------------------------------------------------------------- part 1: tensors


def trl_real(loss_type, beta, corrected, base, old, ref, adv, mask):
    """TRL's GRPOTrainer._compute_loss itself on fixed log-probs: loss, d loss / d logps, metrics."""
    fake = stand_in(loss_type, beta, corrected, max_len=MAX_LEN)
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


def ours(loss_type, beta, corrected, base, old, ref, adv, mask):
    """finetune's loss as the loop steps on it: per micro-batch sums over the global batch's count."""
    logp = base.clone().requires_grad_()
    count = mask.sum() if loss_type == "dapo" else ROWS
    total, sums = 0.0, None
    for p in MICRO:
        loss, s = policy_loss(logp[p], adv[p], mask[p], old_logps=old[p] if old is not None else None,
                              ref_logps=ref[p], loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta,
                              max_completion_len=MAX_LEN, bias_correction_kl=corrected)
        total = total + loss / count
        sums = s if sums is None else sums + s
    total.backward()
    objective = GRPO(Recipe(objective="grpo", loss_type=loss_type, beta=beta, epsilon=EPS, epsilon_high=EPS_HIGH,
                            max_completion_len=MAX_LEN, use_bias_correction_kl=corrected,
                            reward_funcs=("finetune.rewards:exact_match",)))
    names = [n for n in objective.metrics if n == "kl" or n.startswith("clip_ratio/")]
    return total.item(), logp.grad, dict(zip(names, objective.means(sums)))


def tensors() -> tuple[list, float, float]:
    rows, worst_all, worst_copy = [], 0.0, 0.0
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        for it in (1, 2):
            for beta, corrected in ((0.0, True), (0.04, True), (0.04, False)):
                base, old, ref, adv, mask = T.rollout_tensors(iterations=it)
                t_loss, t_grad, t_metrics, inputs = trl_real(loss_type, beta, corrected, base, old, ref, adv, mask)
                o_loss, o_grad, o_metrics = ours(loss_type, beta, corrected, base, old, ref, adv, mask)
                # TRL also logs entropy and clip_ratio/low_min, high_max (a min / max over sequences), which
                # finetune does not keep (its metrics reduce by sum); every metric finetune keeps is compared
                assert set(o_metrics) <= set(t_metrics), (set(o_metrics), set(t_metrics))
                d_metric = max(abs(o_metrics[k] - t_metrics[k]) for k in o_metrics)
                assert t_grad.abs().sum() > 0 and o_grad.abs().sum() > 0  # the gradients compared are not zero
                d_loss, d_grad = abs(o_loss - t_loss), (o_grad - t_grad).abs().max().item()
                copied = T.trainer(loss_type, beta, ga=1, world=1, max_len=MAX_LEN, epsilon=EPS, epsilon_high=EPS_HIGH,
                                   bias_correction_kl=corrected)
                d_copy = abs(T.trl_compute_loss(copied, base, inputs).item() - t_loss)
                d_copy = max([d_copy] + [abs(v[0] - t_metrics[k]) for k, v in copied._metrics["train"].items() if v])
                worst_all = max(worst_all, d_loss, d_grad, d_metric)
                worst_copy = max(worst_copy, d_copy)
                rows.append((loss_type, it, beta, corrected, t_loss, d_loss, d_grad, d_metric,
                             t_metrics.get("kl", float("nan")), t_metrics["clip_ratio/region_mean"]))
    return rows, worst_all, worst_copy


# ---------------------------------------------------------------- part 2: on a model, log-probs included


def completions_batch():
    """8 completions of 1 to 8 tokens after prompts of PROMPT_LEN tokens (equal lengths, so that TRL's
    layout, prompts left-padded, and finetune's, rows right-padded, hold the same tokens at the same
    positions), 2 prompts' groups of 4, with their group-relative advantages from made-up rewards; one completion cut at the
    length limit (not stopped)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(2) for _ in range(4)]
    lengths = [3, 8, 1, 5, 6, 2, 8, 4]
    tokens = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    rewards = torch.tensor([0.2, 1.0, 0.0, 0.5, 0.9, 0.1, 0.4, 0.4])
    groups = rewards.view(2, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    stopped = [n < COMPLETIONS for n in lengths]
    return prompts, tokens, stopped, advantages


def trl_inputs(prompts, tokens, advantages, pad_id=0):
    ids = torch.full((len(tokens), COMPLETIONS), pad_id, dtype=torch.long)
    mask = torch.zeros(len(tokens), COMPLETIONS)
    for i, t in enumerate(tokens):
        ids[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    return {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(len(prompts), PROMPT_LEN, dtype=torch.long),
            "completion_ids": ids, "completion_mask": mask.long(), "advantages": advantages,
            "num_items_in_batch": mask.sum()}


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def replay(loss_type, corrected, *, ours_temperature=TEMPERATURE, ours_corrected=None) -> dict:
    """STEPS optimizer steps of each trainer on the same completions: the largest differences of the loss
    and the weights' gradients over the steps, and of the weights after the last step."""
    ours_corrected = corrected if ours_corrected is None else ours_corrected
    prompts, tokens, stopped, advantages = completions_batch()
    start = tiny_llama()

    # TRL: the policy and the reference with its fused LM head at the temperature (GRPOTrainer.__init__)
    trl_model, trl_ref = copy.deepcopy(start), copy.deepcopy(start)
    add_fused_lm_head(trl_model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    add_fused_lm_head(trl_ref, temperature=TEMPERATURE)
    trl_ref.requires_grad_(False).eval()
    trainer = stand_in(loss_type, BETA, corrected, max_len=COMPLETIONS)
    trainer.model = trl_model
    trainer.temperature = TEMPERATURE
    trainer._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies,
                                                                  trainer)
    trl_opt = torch.optim.AdamW(trl_model.parameters(), lr=LR)

    # finetune: the objective, its frozen reference (a copy of the starting weights)
    recipe = Recipe(objective="grpo", loss_type=loss_type, beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH,
                    num_iterations=ITERATIONS, temperature=ours_temperature, max_completion_len=COMPLETIONS,
                    use_bias_correction_kl=ours_corrected, loss_chunk_tokens=16,
                    reward_funcs=("finetune.rewards:exact_match",))
    objective = GRPO(recipe)
    ours_model, ours_ref = copy.deepcopy(start), copy.deepcopy(start)
    ours_ref.requires_grad_(False).eval()
    objective.reference = Frozen(ours_ref, types.SimpleNamespace(autocast=contextlib.nullcontext), recipe)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=LR)
    micro = [rollout_batch(prompts[a:a + 4], tokens[a:a + 4], stopped[a:a + 4], advantages[a:a + 4], pad_id=0)
             for a in (0, 4)]
    count = sum(int((b["labels"] != IGNORE).sum()) for b in micro) if loss_type == "dapo" else len(tokens)

    d_loss = d_grad = 0.0
    inputs = trl_inputs(prompts, tokens, advantages)
    for step in range(STEPS):
        if step % ITERATIONS == 0:  # a rollout: old log-probs (num_iterations > 1) and the reference's
            args = (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), COMPLETIONS)
            with torch.no_grad():
                inputs["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trl_model, *args)[0]
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trl_ref, *args)[0]
                for b in micro:
                    b["old_logps"] = objective.token_logps(ours_model, b)
                    b["ref_logps"] = objective.reference.token_logps(ours_model, b, objective.temperature)
        trl_opt.zero_grad()
        trl_loss = GRPOTrainer._compute_loss(trainer, trl_model, inputs)
        trl_loss.backward()
        ours_opt.zero_grad()
        ours_loss = sum(objective.loss(ours_model, b) / count for b in micro)
        ours_loss.backward()
        d_loss = max(d_loss, abs(trl_loss.item() - ours_loss.item()))
        for (name, a), b in zip(trl_model.named_parameters(), ours_model.parameters()):
            d_grad = max(d_grad, (a.grad - b.grad).abs().max().item())
        trl_opt.step()
        ours_opt.step()
    d_weights = max((a - b).abs().max().item() for a, b in zip(trl_model.parameters(), ours_model.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(start.parameters(), trl_model.parameters()))
    kl = trainer._metrics["train"]["kl"][-1]
    return {"loss": d_loss, "grad": d_grad, "weights": d_weights, "moved": moved, "kl": kl}


def model_rows() -> tuple[list, float]:
    rows, worst = [], 0.0
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        for corrected in (True, False):
            r = replay(loss_type, corrected)
            worst = max(worst, r["loss"], r["grad"], r["weights"])
            rows.append((loss_type, f"{str(corrected).lower()}", "as TRL", r))
    # what the comparison catches: the old raw-logit log-probs, and the plain k3 against TRL's default
    rows.append(("dapo", "true", "finetune scoring the raw logits (temperature 1) in its log-probs",
                 replay("dapo", True, ours_temperature=1.0)))
    rows.append(("dapo", "true", "finetune with the plain k3 KL (use_bias_correction_kl=false)",
                 replay("dapo", True, ours_corrected=False)))
    return rows, worst


def main():
    import trl

    t_rows, worst_all, worst_copy = tensors()
    m_rows, worst_model = model_rows()
    print(f"trl {trl.__version__}, torch {torch.__version__}; epsilon {EPS}, epsilon_high {EPS_HIGH}")
    print()
    print(f"Part 1, tensors: {ROWS} completions of up to {MAX_LEN} tokens; finetune on 2 ranks x 2 micro-batches, "
          "TRL on one batch")
    print()
    print("| loss_type | num_iterations | beta | use_bias_correction_kl | TRL loss | loss: abs diff | gradient: max abs "
          "diff | metrics: max abs diff | TRL kl | TRL clip_ratio/region_mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lt, it, beta, corrected, loss, dl, dg, dm, kl, clip in t_rows:
        print(f"| {lt} | {it} | {beta:g} | {'-' if not beta else str(corrected).lower()} | {loss:.6f} | {dl:.1e} | "
              f"{dg:.1e} | {dm:.1e} | {'-' if kl != kl else f'{kl:.6f}'} | {clip:.4f} |")
    print()
    print(f"largest difference, finetune against TRL's _compute_loss (loss, gradient, metrics): {worst_all:.1e}; "
          f"within {TOLERANCE:g}: {'yes' if worst_all <= TOLERANCE else 'NO'}")
    print(f"tests/test_grpo_objective.py's copied lines against TRL's _compute_loss: {worst_copy:.1e}")
    print()
    print(f"Part 2, on a model: a random 2-layer Llama (hidden 32, vocab {VOCAB}, fp32), 8 completions of 1 to "
          f"{COMPLETIONS} tokens after prompts of {PROMPT_LEN}, temperature {TEMPERATURE}, beta {BETA}, num_iterations "
          f"{ITERATIONS}, {STEPS} AdamW steps (lr {LR:g}); finetune in 2 micro-batches, TRL in one")
    print()
    print("| loss_type | use_bias_correction_kl (TRL) | finetune | loss: max abs diff | gradients: max abs diff | "
          f"weights after {STEPS} steps: max abs diff | how far TRL's weights moved | TRL kl at the last step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for lt, corrected, what, r in m_rows:
        print(f"| {lt} | {corrected} | {what} | {r['loss']:.1e} | {r['grad']:.1e} | {r['weights']:.1e} | "
              f"{r['moved']:.1e} | {r['kl']:.6f} |")
    print()
    print(f"largest difference on the model, finetune as TRL (loss, gradients, weights): {worst_model:.1e}; "
          f"within {TOLERANCE:g}: {'yes' if worst_model <= TOLERANCE else 'NO'}")
    return 0 if max(worst_all, worst_model) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
