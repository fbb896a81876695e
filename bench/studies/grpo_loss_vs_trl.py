"""GRPO's loss family and RLOO against TRL's own GRPOTrainer and RLOOTrainer (trl 1.16), in two parts.

1. On tensors: TRL's GRPOTrainer._compute_loss, called on a stand-in trainer whose per-token log-probs and
   entropies are fixed tensors, for every loss type (grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo, vespo)
   x importance_sampling_level token and sequence (GSPO) x num_iterations 1, 2 x beta 0 and 0.04 (with
   beta > 0 under both values of use_bias_correction_kl), on tests/test_grpo_objective.py's tensors (8
   completions of up to 9 tokens, one truncated and masked out, one with advantage 0; old log-probs 0.3
   away with num_iterations 2, the reference's 0.2 away); and RLOOTrainer._compute_loss likewise
   (num_iterations 1, 2). Compared: the loss, the gradient of the per-token log-probs, and every metric
   TRL logs there (entropy, kl, clip_ratio/low_mean, high_mean, region_mean, low_min, high_max,
   cispo_clip_ratio, vespo/phi_seq_mean), finetune's policy_loss on the batch split as 2 ranks x 2
   micro-batches; the lines tests/test_grpo_objective.py and tests/test_rloo.py copy from TRL against TRL's
   real methods (the RLOO advantages' lines, inside TRL's generation method, against its source text).

2. On a model, log-probs included: the same completions replayed through both trainers for STEPS
   optimizer steps (AdamW) at temperature 0.7, for every loss type and rloo x num_iterations 1, 2 x beta 0,
   0.04 (rloo: 0, 0.05, its default), from the same random tiny Llama (fp32). TRL: its real
   _get_per_token_logps_and_entropies on the model patched by its own add_fused_lm_head(temperature) (what
   the trainers' __init__ does), for the loss, for the old log-probs at each rollout's first step and for
   the reference (a frozen copy of the starting weights), then its real _compute_loss, in the same 2
   micro-batches as finetune (its entropy metric, a mean per micro-batch, weighed by their tokens).
   finetune: GRPO.token_logps (the old log-probs), the frozen reference's token_logps at the objective's
   temperature (finetune.training.reference.Frozen) and GRPO.loss on the batch in 2 micro-batches (each
   over the global batch's count). Compared at every step: the loss, the gradient of every weight, the
   entropy metric; after the last step, the weights. Two rows show what the comparison catches:
   finetune's log-probs of the raw logits (temperature 1, while the completions were sampled at 0.7), and
   finetune's plain k3 KL against TRL's default.

Needs trl importable (pip install -e .[bench], or PYTHONPATH=DIR holding a `pip install --no-deps
--target DIR trl==1.16.0`):

    python bench/studies/grpo_loss_vs_trl.py
"""
from pathlib import Path
import collections
import contextlib
import copy
import dataclasses
import sys
import types

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import add_fused_lm_head
import test_grpo_objective as T
import test_rloo as TR
from finetune.data import IGNORE
from finetune.training.objectives.grpo import GRPO
from finetune.rl_losses import GRPO_LOSS_TYPES, TOKEN_COUNTED, LossSettings, merged_sums, policy_loss
from finetune.training.rollouts import rollout_batch
from finetune.training.reference import Frozen
from finetune.recipe import Recipe

EPS, EPS_HIGH, MAX_LEN, ROWS = 0.2, 0.28, 9, 8
EPS_HIGH_OF = {"cispo": 1.2}  # cispo's epsilon_high caps the ratio itself: one the ratios cross
MICRO = [slice(i, i + 2) for i in range(0, ROWS, 2)]  # 2 ranks x 2 micro-batches of 2 completions
TOLERANCE = 1e-5

# part 2: the replay on a model
TEMPERATURE, STEPS, LR = 0.7, 4, 1e-3
PROMPT_LEN, COMPLETIONS, VOCAB = 5, 8, 97


def stand_in(loss_type, beta, corrected, *, max_len, level="token", ga=1, world=1):
    """A GRPOTrainer (or RLOOTrainer) without __init__: the attributes _compute_loss and
    _get_per_token_logps_and_entropies read, for `world` processes (their averaging is the caller's) and
    `ga` micro-batches a step."""
    fake = T.trainer(loss_type, beta, ga=ga, world=world, max_len=max_len, epsilon=EPS,
                     epsilon_high=EPS_HIGH_OF.get(loss_type, EPS_HIGH), bias_correction_kl=corrected, level=level)
    fake.top_entropy_quantile = 1.0; fake.aux_loss_enabled = False; fake.off_policy_mask_threshold = None
    fake.use_vllm = False; fake._entropy_bonus_enabled = False
    fake.vllm_importance_sampling_correction = False
    fake.args.delta = None
    fake.accelerator.gather = lambda t: t.reshape(-1)
    fake.accelerator.gather_for_metrics = lambda t: t.reshape(-1)
    fake.accelerator.autocast = contextlib.nullcontext
    fake.accelerator.is_main_process = True  # TRL's profiling decorator reads it
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    fake._metrics["train"] = collections.defaultdict(list)
    return fake


def settings(loss_type, beta, corrected, level="token", max_len=MAX_LEN) -> LossSettings:
    return LossSettings(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH_OF.get(loss_type, EPS_HIGH), beta=beta,
                        max_completion_len=max_len, bias_correction_kl=corrected, importance_sampling_level=level)


# ---------------------------------------------------------------- part 1: tensors


def sliced(inputs: dict, part: slice) -> dict:
    """A micro-batch of TRL's inputs (its rows; num_items_in_batch stays the generation batch's)."""
    return {k: v if k == "num_items_in_batch" else v[part] for k, v in inputs.items()}


def trl_real(loss_type, beta, corrected, level, base, old, ref, adv, mask, entropies):
    """TRL's _compute_loss itself on fixed log-probs and entropies: the loss (and d loss / d logps) of the
    batch as 2 ranks x 2 micro-batches (each micro-batch's loss as TRL scales it for accumulation, RLOO's
    by the HF Trainer, averaged over ranks as DDP does: bnpo's token mean is a micro-batch's), and the
    metrics of the batch as one micro-batch (TRL's min/max and means over it)."""
    inputs = {"prompt_ids": torch.ones(ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 1),
              "completion_ids": torch.ones(ROWS, MAX_LEN, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    if loss_type == "rloo":
        inputs["old_logps"] = ((base if old is None else old) * mask).sum(1)
    elif old is not None:
        inputs["old_per_token_logps"] = old
    cls = RLOOTrainer if loss_type == "rloo" else GRPOTrainer
    logp = base.clone().requires_grad_()
    fake = stand_in(loss_type, beta, corrected, max_len=MAX_LEN, level=level, ga=2, world=2)
    loss = 0.0
    for part in MICRO:
        fake._get_per_token_logps_and_entropies = lambda *a, part=part, **k: (logp[part], entropies[part], None)
        one = cls._compute_loss(fake, None, sliced(inputs, part))
        loss = loss + (one / 2 if loss_type == "rloo" else one) / 2  # RLOO: the HF Trainer's / ga; DDP's / world
    loss.backward()
    whole = stand_in(loss_type, beta, corrected, max_len=MAX_LEN, level=level)
    whole._get_per_token_logps_and_entropies = lambda *a, **k: (base, entropies, None)
    with torch.no_grad():
        whole_loss = cls._compute_loss(whole, None, inputs).item()
    metrics = {k: v[0] for k, v in whole._metrics["train"].items() if v}
    return loss.item(), logp.grad, metrics, (inputs, whole_loss)


def ours(loss_type, beta, corrected, level, base, old, ref, adv, mask, entropies):
    """finetune's loss as the loop steps on it: per micro-batch sums over the global batch's count."""
    logp = base.clone().requires_grad_()
    count = mask.sum() if loss_type in TOKEN_COUNTED else ROWS
    total, sums = 0.0, None
    for p in MICRO:
        loss, s = policy_loss(logp[p], adv[p], mask[p], old_logps=old[p] if old is not None else None,
                              ref_logps=ref[p], entropies=entropies[p],
                              settings=settings(loss_type, beta, corrected, level))
        total = total + loss / count
        sums = merged_sums(sums, s)
    total.backward()
    objective = GRPO(Recipe(objective="grpo", loss_type=loss_type, beta=beta, epsilon=EPS,
                            epsilon_high=EPS_HIGH_OF.get(loss_type, EPS_HIGH), max_completion_len=MAX_LEN,
                            **({} if loss_type == "rloo" else {"use_bias_correction_kl": corrected,
                                                                "importance_sampling_level": level}),
                            reward_funcs=("finetune.rewards:exact_match",)))
    return total.item(), logp.grad, dict(zip(objective.loss_metrics, objective.means(sums)))


def copy_difference(loss_type, beta, corrected, level, base, entropies, inputs, t_loss, t_metrics) -> float:
    """The tests' copies of TRL's lines against TRL's real method, on the batch as one micro-batch: loss and
    metrics."""
    if loss_type == "rloo":
        copied = TR.trainer(beta, False, epsilon=EPS, epsilon_high=EPS_HIGH)
        loss = TR.trl_rloo_compute_loss(copied, base, entropies, inputs)
    else:
        copied = T.trainer(loss_type, beta, ga=1, world=1, max_len=MAX_LEN, epsilon=EPS,
                           epsilon_high=EPS_HIGH_OF.get(loss_type, EPS_HIGH), bias_correction_kl=corrected, level=level)
        loss = T.trl_compute_loss(copied, base, inputs, entropies)
    metrics = {k: v[0] for k, v in copied._metrics["train"].items() if v}
    assert set(metrics) == set(t_metrics), (set(metrics), set(t_metrics))
    return max([abs(loss.item() - t_loss)] + [abs(v - t_metrics[k]) for k, v in metrics.items()])


def advantages_copy_in_trl_source() -> int:
    """tests/test_rloo.py's copy of RLOOTrainer's advantage lines (inside its generation method, which needs a
    generator to run): each of its code lines, but the few its stand-in changes, is a line of TRL's file."""
    import inspect

    source = {line.strip() for line in inspect.getsource(RLOOTrainer).splitlines()}
    changed = ("def ", "return", "self._metrics", "kl_stats = ", "std_rewards = ", "rewards = (rewards_per_func")
    text = inspect.getsource(TR.trl_rloo_advantages)
    body = text[text.index("):\n") + 3:].replace("trl_nanstd(", "nanstd(")  # past the signature; TRL's nanstd
    lines = [x.strip() for x in body.splitlines()]
    lines = [x for x in lines if x and not x.startswith(("#", '"""')) and not x.startswith(changed)]
    missing = [x for x in lines if x not in source]
    assert not missing, missing
    return len(lines)


def tensors() -> tuple[list, float, float]:
    rows, worst_all, worst_copy = [], 0.0, 0.0
    cases = [(lt, level) for lt in GRPO_LOSS_TYPES for level in ("token", "sequence")] + [("rloo", "sequence")]
    for loss_type, level in cases:
        for it in (1, 2):
            betas = ((0.0, True), (0.04, True), (0.04, False)) if loss_type != "rloo" else ((0.0, True),)
            for beta, corrected in betas:
                base, old, ref, adv, mask = T.rollout_tensors(iterations=it)
                entropies = T.entropies_of(base)
                t_loss, t_grad, t_metrics, (inputs, whole_loss) = trl_real(loss_type, beta, corrected, level, base, old, ref, adv,
                                                             mask, entropies)
                o_loss, o_grad, o_metrics = ours(loss_type, beta, corrected, level, base, old, ref, adv, mask,
                                                 entropies)
                assert set(o_metrics) == set(t_metrics), (set(o_metrics), set(t_metrics))  # every metric TRL logs
                d_metric = max(abs(o_metrics[k] - t_metrics[k]) for k in o_metrics)
                assert t_grad.abs().sum() > 0 and o_grad.abs().sum() > 0  # the gradients compared are not zero
                d_loss, d_grad = abs(o_loss - t_loss), (o_grad - t_grad).abs().max().item()
                worst_copy = max(worst_copy, copy_difference(loss_type, beta, corrected, level, base, entropies,
                                                             inputs, whole_loss, t_metrics))
                worst_all = max(worst_all, d_loss, d_grad, d_metric)
                rows.append((loss_type, level, it, beta, corrected, t_loss, d_loss, d_grad, d_metric,
                             t_metrics.get("kl", float("nan")), t_metrics.get("clip_ratio/region_mean", float("nan"))))
    return rows, worst_all, worst_copy


def bonus_rows() -> tuple[list, float]:
    """entropy_coef 0.3 (TRL's static entropy bonus) for every GRPO loss type at num_iterations 2: TRL's real
    _compute_loss on 2 ranks x 2 micro-batches against policy_loss, the loss and its gradients of the
    log-probs and of the entropies."""
    rows, worst = [], 0.0
    base, old, ref, adv, mask = T.rollout_tensors(iterations=2)
    for loss_type in GRPO_LOSS_TYPES:
        entropies = T.entropies_of(base)
        inputs = {"prompt_ids": torch.ones(ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 1),
                  "completion_ids": torch.ones(ROWS, MAX_LEN, dtype=torch.long), "completion_mask": mask,
                  "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
        fake = stand_in(loss_type, 0.0, True, max_len=MAX_LEN, ga=2, world=2)
        fake._entropy_bonus_enabled, fake.entropy_coef, fake.use_adaptive_entropy = True, 0.3, False
        fake.accelerator.sync_gradients = False
        logp, ent = base.clone().requires_grad_(), entropies.clone().requires_grad_()
        trl_loss = 0.0
        for part in MICRO:
            fake._get_per_token_logps_and_entropies = lambda *a, part=part, **k: (logp[part], ent[part], None)
            trl_loss = trl_loss + GRPOTrainer._compute_loss(fake, None, sliced(inputs, part)) / 2
        trl_loss.backward()
        count = mask.sum().item() if loss_type in TOKEN_COUNTED else ROWS
        ours_logp, ours_ent = base.clone().requires_grad_(), entropies.clone().requires_grad_()
        s = dataclasses.replace(settings(loss_type, 0.0, True), entropy_coef=0.3)
        ours_loss = sum(policy_loss(ours_logp[p], adv[p], mask[p], old_logps=old[p], entropies=ours_ent[p], settings=s,
                                    micro_batch_count=count / len(MICRO))[0] for p in MICRO) / count
        ours_loss.backward()
        d = (abs(ours_loss.item() - trl_loss.item()), (ours_logp.grad - logp.grad).abs().max().item(),
             (ours_ent.grad - ent.grad).abs().max().item())
        assert ent.grad.abs().sum() > 0
        worst = max(worst, *d)
        rows.append((loss_type, trl_loss.item(), *d))
    return rows, worst


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


def replay(loss_type, iterations, beta, corrected=True, level="token", *, ours_temperature=TEMPERATURE,
           ours_corrected=None) -> dict:
    """STEPS optimizer steps of each trainer on the same completions: the largest differences of the loss,
    the weights' gradients and the entropy metric over the steps, and of the weights after the last step.
    rloo: the advantages are the batch's, as both trainers would train on the same ones (their computation:
    part 1 and tests/test_rloo.py)."""
    ours_corrected = corrected if ours_corrected is None else ours_corrected
    prompts, tokens, stopped, advantages = completions_batch()
    start = tiny_llama()
    rloo = loss_type == "rloo"

    # TRL: the policy and the reference with its fused LM head at the temperature (the trainers' __init__)
    trl_model, trl_ref = copy.deepcopy(start), copy.deepcopy(start)
    add_fused_lm_head(trl_model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    add_fused_lm_head(trl_ref, temperature=TEMPERATURE)
    trl_ref.requires_grad_(False).eval()
    trainer = stand_in(loss_type, beta, corrected, max_len=COMPLETIONS, level=level, ga=2)  # ours' 2 micro-batches
    trainer.model = trl_model
    trainer.temperature = TEMPERATURE
    cls = RLOOTrainer if rloo else GRPOTrainer
    trainer._get_per_token_logps_and_entropies = types.MethodType(cls._get_per_token_logps_and_entropies, trainer)
    trl_opt = torch.optim.AdamW(trl_model.parameters(), lr=LR)

    # finetune: the objective, its frozen reference (a copy of the starting weights)
    keys = {} if rloo else {"use_bias_correction_kl": ours_corrected, "importance_sampling_level": level}
    recipe = Recipe(objective="grpo", loss_type=loss_type, beta=beta, epsilon=EPS,
                    epsilon_high=EPS_HIGH_OF.get(loss_type, EPS_HIGH), num_iterations=iterations,
                    temperature=ours_temperature, max_completion_len=COMPLETIONS, loss_chunk_tokens=16,
                    reward_funcs=("finetune.rewards:exact_match",), **keys)
    objective = GRPO(recipe)
    ours_model, ours_ref = copy.deepcopy(start), copy.deepcopy(start)
    ours_ref.requires_grad_(False).eval()
    objective.reference = Frozen(ours_ref, types.SimpleNamespace(autocast=contextlib.nullcontext), recipe)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=LR)
    micro = [rollout_batch(prompts[a:a + 4], tokens[a:a + 4], stopped[a:a + 4], advantages[a:a + 4], pad_id=0)
             for a in (0, 4)]
    count = sum(int((b["labels"] != IGNORE).sum()) for b in micro) if loss_type in TOKEN_COUNTED else len(tokens)

    d_loss = d_grad = d_entropy = 0.0
    inputs = trl_inputs(prompts, tokens, advantages)
    for step in range(STEPS):
        if step % iterations == 0:  # a rollout: old log-probs and the reference's
            args = (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), COMPLETIONS)
            with torch.no_grad():
                old = trainer._get_per_token_logps_and_entropies(trl_model, *args)[0]
                if rloo:  # RLOOTrainer always keeps the old log-probs' sums
                    inputs["old_logps"] = (old * inputs["completion_mask"]).sum(1)
                elif iterations > 1:
                    inputs["old_per_token_logps"] = old
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trl_ref, *args)[0]
                for b in micro:
                    b.pop("old_logps", None)
                    if iterations > 1 or rloo:
                        b["old_logps"] = objective.token_logps(ours_model, b)
                    if beta:
                        b["ref_logps"] = objective.reference.token_logps(ours_model, b, objective.temperature)
        trl_opt.zero_grad()
        trl_loss, entropy, tokens = 0.0, 0.0, 0.0
        for part in (slice(0, 4), slice(4, 8)):  # TRL's micro-batches: bnpo's token mean is a micro-batch's
            one = cls._compute_loss(trainer, trl_model, sliced(inputs, part))
            one = one / 2 if rloo else one  # RLOO's accumulation is the HF Trainer's
            one.backward()
            trl_loss = trl_loss + one.detach()
            n = inputs["completion_mask"][part].sum().item()  # TRL's entropy: a mean per micro-batch
            entropy, tokens = entropy + trainer._metrics["train"]["entropy"][-1] * n, tokens + n
        ours_opt.zero_grad()
        ours_loss = sum(objective.loss(ours_model, b) / count for b in micro)
        ours_loss.backward()
        d_loss = max(d_loss, abs(trl_loss.item() - ours_loss.item()))
        ours_metrics = dict(zip(objective.loss_metrics, objective.means(objective.take_metrics())))
        d_entropy = max(d_entropy, abs(ours_metrics["entropy"] - entropy / tokens))
        for (name, a), b in zip(trl_model.named_parameters(), ours_model.parameters()):
            d_grad = max(d_grad, (a.grad - b.grad).abs().max().item())
        trl_opt.step()
        ours_opt.step()
    d_weights = max((a - b).abs().max().item() for a, b in zip(trl_model.parameters(), ours_model.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(start.parameters(), trl_model.parameters()))
    kl = trainer._metrics["train"]["kl"][-1] if trainer._metrics["train"]["kl"] else float("nan")
    return {"loss": d_loss, "grad": d_grad, "weights": d_weights, "entropy": d_entropy, "moved": moved, "kl": kl}


def model_rows() -> tuple[list, float]:
    rows, worst = [], 0.0
    for loss_type in GRPO_LOSS_TYPES + ("rloo",):
        level = "sequence" if loss_type == "luspo" else "token"  # luspo: TRL's recommended setting
        for iterations in (1, 2):
            for beta in (0.0, 0.04 if loss_type != "rloo" else 0.05):
                r = replay(loss_type, iterations, beta, level=level)
                worst = max(worst, r["loss"], r["grad"], r["weights"], r["entropy"])
                rows.append((loss_type, level, iterations, beta, "as TRL", r))
    r = replay("dapo", 2, 0.04, level="sequence")  # GSPO's ratios on a model
    worst = max(worst, r["loss"], r["grad"], r["weights"], r["entropy"])
    rows.append(("dapo", "sequence", 2, 0.04, "as TRL", r))
    # what the comparison catches: the old raw-logit log-probs, and the plain k3 against TRL's default
    rows.append(("dapo", "token", 2, 0.04, "finetune scoring the raw logits (temperature 1) in its log-probs",
                 replay("dapo", 2, 0.04, ours_temperature=1.0)))
    rows.append(("dapo", "token", 2, 0.04, "finetune with the plain k3 KL (use_bias_correction_kl=false)",
                 replay("dapo", 2, 0.04, ours_corrected=False)))
    return rows, worst


def main():
    import trl

    t_rows, worst_all, worst_copy = tensors()
    b_rows, worst_bonus = bonus_rows()
    worst_all = max(worst_all, worst_bonus)
    copied_lines = advantages_copy_in_trl_source()
    m_rows, worst_model = model_rows()
    print(f"trl {trl.__version__}, torch {torch.__version__}; epsilon {EPS}, epsilon_high {EPS_HIGH} "
          f"(cispo: {EPS_HIGH_OF['cispo']})")
    print()
    print(f"Part 1, tensors: {ROWS} completions of up to {MAX_LEN} tokens; the loss on 2 ranks x 2 micro-batches, "
          "TRL's metrics of the batch as one micro-batch")
    print()
    print("| loss_type | importance_sampling_level | num_iterations | beta | use_bias_correction_kl | TRL loss | "
          "loss: abs diff | gradient: max abs diff | metrics: max abs diff | TRL kl | TRL clip_ratio/region_mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lt, level, it, beta, corrected, loss, dl, dg, dm, kl, clip in t_rows:
        print(f"| {lt} | {level if lt != 'rloo' else '(its own: whole sequences)'} | {it} | {beta:g} | "
              f"{'-' if not beta else str(corrected).lower()} | {loss:.6f} | {dl:.1e} | {dg:.1e} | {dm:.1e} | "
              f"{'-' if kl != kl else f'{kl:.6f}'} | {'-' if clip != clip else f'{clip:.4f}'} |")
    print()
    print("The entropy bonus (entropy_coef 0.3, num_iterations 2, beta 0):")
    print()
    print("| loss_type | TRL loss | loss: abs diff | gradient of the log-probs: max abs diff | gradient of the entropies: "
          "max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for lt, loss, dl, dg, de in b_rows:
        print(f"| {lt} | {loss:.6f} | {dl:.1e} | {dg:.1e} | {de:.1e} |")
    print()
    print(f"largest difference, finetune against TRL's _compute_loss (loss, gradient, metrics; the bonus too): {worst_all:.1e}; "
          f"within {TOLERANCE:g}: {'yes' if worst_all <= TOLERANCE else 'NO'}")
    print()
    print(f"tests/test_grpo_objective.py's and tests/test_rloo.py's copied lines against TRL's _compute_loss: "
          f"{worst_copy:.1e}; tests/test_rloo.py's {copied_lines} lines of RLOO's advantages found in TRL's source")
    print()
    print(f"Part 2, on a model: a random 2-layer Llama (hidden 32, vocab {VOCAB}, fp32), 8 completions of 1 to "
          f"{COMPLETIONS} tokens after prompts of {PROMPT_LEN}, temperature {TEMPERATURE}, {STEPS} AdamW steps "
          f"(lr {LR:g}); both in 2 micro-batches")
    print()
    print("| loss_type | importance_sampling_level | num_iterations | beta | finetune | loss: max abs diff | "
          f"gradients: max abs diff | entropy: max abs diff | weights after {STEPS} steps: max abs diff | "
          "how far TRL's weights moved | TRL kl at the last step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lt, level, it, beta, what, r in m_rows:
        print(f"| {lt} | {level if lt != 'rloo' else '-'} | {it} | {beta:g} | {what} | {r['loss']:.1e} | "
              f"{r['grad']:.1e} | {r['entropy']:.1e} | {r['weights']:.1e} | {r['moved']:.1e} | "
              f"{'-' if r['kl'] != r['kl'] else format(r['kl'], '.6f')} |")
    print()
    print(f"largest difference on the model, finetune as TRL (loss, gradients, entropy, weights): {worst_model:.1e}; "
          f"within {TOLERANCE:g}: {'yes' if worst_model <= TOLERANCE else 'NO'}")
    return 0 if max(worst_all, worst_model, worst_copy) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
