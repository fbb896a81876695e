"""On-policy distillation against TRL 1.16's own DistillationTrainer: the same completions replayed through both
trainers for STEPS optimizer steps (AdamW, fp32), from the same student (the builtin tiny Llama, random) and
teacher (its wider sibling builtin:tiny-llama-h64, random, same vocabulary).

TRL: its real DistillationTrainer._compute_loss (the student's and the teacher's backbones through its
_get_last_hidden_state, then its chunked divergence kernel, trl/kernels/chunked_divergence.py, on CPU its torch
tile path) on a stand-in trainer (no __init__: the attributes _compute_loss reads), on the whole batch, with
num_items_in_batch the batch's completion tokens, as TRL computes it. finetune: Distill.loss
(finetune/training/objectives/distill.py: the divergence inside the student's output layer, finetune/divergence.py)
on the batch in 2 micro-batches, each over the global batch's completion tokens, as the loop steps on it.
Compared at every step: the loss and the gradient of every weight; after the last step, the weights.

Rows:
- on-policy (lmbda=1, TRL's DistillationTrainer): each step's 8 completions sampled by finetune's generator from
  finetune's student as it stands (seeded per row and step, up to 8 tokens at the temperature), replayed into TRL;
  at TRL's defaults (beta 1: reverse KL, temperature 1) and at beta 0.5, temperature 0.7 (the JSD);
- off-policy (lmbda=0, equal data): fixed completions of 1 to 8 tokens, at beta 0 (forward KL), temperature 1;
- what the comparison catches: finetune at temperature 1 against TRL at 0.7 (the divergence's temperature left out).

Prompts are all PROMPT_LEN tokens long, so that TRL's left-padded prompts carry no padding and both trainers
compute on the same positions. Needs trl importable (PYTHONPATH=DIR holding a `pip install --no-deps --target DIR
trl==1.16.0`), figures in docs/distillation.md:

    PYTHONPATH=$PWD:trl-1.16 python bench/studies/distill_vs_trl.py
"""
from pathlib import Path
import copy
import sys
import types

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune
import trl
from trl.trainer.distillation_trainer import DistillationTrainer

from finetune.assets import resolve_model
from finetune.generation import Sampling, generate
from finetune.recipe import Recipe
from finetune.training.objectives.distill import Distill, completion_seed, on_policy_batch

STEPS, LR, ROWS, PROMPT_LEN, MAX_NEW, SEED = 5, 1e-3, 8, 6, 8, 0
MICRO = [slice(0, 4), slice(4, 8)]  # finetune's 2 micro-batches
# the loss and gradients agree to float32 noise; AdamW's first steps divide each gradient by its own root mean
# square, so where a gradient is near 0 that noise moves the weights by up to about 1e-5 in 5 steps of lr 1e-3
TOLERANCE, WEIGHT_TOLERANCE = 1e-6, 1e-4


def models():
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-llama"), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-llama-h64"), dtype=torch.float32)
    teacher.requires_grad_(False).eval()
    return student, teacher


def stand_in(teacher, beta, temperature):
    """A DistillationTrainer without __init__: what _compute_loss and _get_last_hidden_state read (one process,
    no wrapper: the forward redirection calls the method itself)."""
    fake = DistillationTrainer.__new__(DistillationTrainer)
    fake.teacher_model, fake.beta, fake.temperature = teacher, beta, temperature
    fake.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True)
    fake._forward_redirection = lambda wrapper, original, method, *args, **kwargs: method(*args, **kwargs)
    fake.model_kwarg_keys = ()
    fake._is_vlm = False
    return fake


def prompts_of(step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(8, 100, (ROWS, PROMPT_LEN), generator=g).tolist()


def fixed_completions(step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2000 + step)
    return [torch.randint(8, 100, (1 + i % MAX_NEW,), generator=g).tolist() for i in range(ROWS)]


def sampled_completions(student, prompts, step: int, temperature: float) -> list[list[int]]:
    student.eval()
    outs = generate(student, prompts, Sampling(MAX_NEW, temperature), stop_ids={3}, pad_id=0, context=None,
                    seeds=[completion_seed(SEED, step, i) for i in range(ROWS)], vocab_size=128)
    student.train()
    return [o.tokens for o in outs]


def trl_inputs(batch: dict) -> dict:
    """finetune's rows (prompt, then completion, right-padded) in TRL's layout: prompt_ids / completion_ids."""
    return {"prompt_ids": batch["input_ids"][:, :PROMPT_LEN], "prompt_mask": batch["attention_mask"][:, :PROMPT_LEN],
            "completion_ids": batch["input_ids"][:, PROMPT_LEN:],
            "completion_mask": batch["attention_mask"][:, PROMPT_LEN:]}


def replay(on_policy: bool, beta: float, temperature: float, ours_temperature: float | None = None) -> dict:
    student, teacher = models()
    trl_student = copy.deepcopy(student)
    ours_opt = torch.optim.AdamW(student.parameters(), lr=LR)
    trl_opt = torch.optim.AdamW(trl_student.parameters(), lr=LR)
    objective = Distill(Recipe(objective="distill", teacher_model="builtin:tiny-llama-h64", distill_beta=beta,
                               temperature=ours_temperature or temperature, loss_chunk_tokens=5))
    objective.teacher = teacher
    fake = stand_in(teacher, beta, temperature)
    worst_loss = worst_grad = 0.0
    losses = []
    for step in range(STEPS):
        prompts = prompts_of(step)
        completions = sampled_completions(student, prompts, step, temperature) if on_policy else \
            fixed_completions(step)
        batch = on_policy_batch(prompts, completions, pad_id=0)
        count = float((batch["labels"] != -100).sum())
        # finetune: 2 micro-batches, each summed loss over the global count
        ours_opt.zero_grad()
        ours_loss = 0.0
        for part in MICRO:
            micro = {k: v[part] for k, v in batch.items()}
            loss = objective.loss(student, micro) / count
            loss.backward()
            ours_loss += loss.item()
        objective.take_metrics()
        # TRL: the whole batch, over its completion tokens
        trl_opt.zero_grad()
        trl_loss, _, _ = DistillationTrainer._compute_loss(fake, trl_student, trl_inputs(batch), torch.tensor(count))
        trl_loss.backward()
        d_grad = max((a.grad - b.grad).abs().max().item() for a, b in zip(student.parameters(),
                                                                           trl_student.parameters()))
        worst_loss, worst_grad = max(worst_loss, abs(ours_loss - trl_loss.item())), max(worst_grad, d_grad)
        losses.append((ours_loss, trl_loss.item()))
        ours_opt.step()
        trl_opt.step()
    d_weights = max((a - b).abs().max().item() for a, b in zip(student.parameters(), trl_student.parameters()))
    return {"losses": losses, "loss": worst_loss, "grad": worst_grad, "weights": d_weights}


ROWS_RUN = [("on-policy, TRL's defaults", True, 1.0, 1.0, None),
            ("on-policy, beta 0.5 (JSD), temperature 0.7", True, 0.5, 0.7, None),
            ("off-policy (lmbda=0), beta 0 (forward KL)", False, 0.0, 1.0, None),
            ("catches: finetune at temperature 1, TRL at 0.7", True, 0.5, 0.7, 1.0)]


def main() -> int:
    torch.manual_seed(0)
    print(f"trl {trl.__version__}, torch {torch.__version__}; {STEPS} steps of {ROWS} completions, AdamW lr {LR}, fp32")
    print("| setting | loss step 1 (ours / TRL) | loss step 5 (ours / TRL) | max abs loss diff | max abs grad diff | "
          "max abs weight diff after 5 steps |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name, on_policy, beta, temperature, ours_t in ROWS_RUN:
        r = replay(on_policy, beta, temperature, ours_t)
        (a0, b0), (a1, b1) = r["losses"][0], r["losses"][-1]
        print(f"| {name} | {a0:.6f} / {b0:.6f} | {a1:.6f} / {b1:.6f} | {r['loss']:.1e} | {r['grad']:.1e} | "
              f"{r['weights']:.1e} |")
        within = max(r["loss"], r["grad"]) < TOLERANCE and r["weights"] < WEIGHT_TOLERANCE
        failed |= within == (ours_t is not None)  # equal rows within tolerance, the catching row not
    print(f"equal rows within {TOLERANCE:g} (loss, gradients) and {WEIGHT_TOLERANCE:g} (weights), the catching row "
          f"outside: {'yes' if not failed else 'NO'}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
