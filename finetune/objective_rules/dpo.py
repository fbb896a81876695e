"""DPO's recipe rules (the objective: finetune/training/objectives/dpo.py; sigmoid, ipo, simpo): its keys only
with objective=dpo (max_prompt_len is shared with the other objectives that cut a prompt); with it, a
beta and a SimPO margin where the loss stays finite in float32, each loss's own settings only with it,
whole unpacked pairs, and a reference the strategy can hold. Each failure is one RecipeError naming the
key, its value and what is allowed."""

from __future__ import annotations

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules.common import check_prompt_budget, default

NAME = "dpo"
FIELDS = ("dpo_loss", "dpo_beta", "dpo_label_smoothing", "simpo_gamma", "precompute_reference", "max_prompt_len")
SHARES: tuple[str, ...] = ()
ROWS = ("preference",)
FORWARD_ROWS = 2  # a pair: its chosen and rejected sequences in one forward
PAIR_BATCHES = True  # a micro-batch is 2n rows, a row and its partner (sequence_parallel.shard)

# The ranges where every DPO loss and its gradient stay finite in float32 (the log-probs are float32 in
# bf16 runs too). beta multiplies the margin z of summed (or averaged) log-probs, and is cast to float32
# doing so: past 3.4e38 it is inf, and the first step (z = 0, the policy equal to its reference) gives
# inf x 0 = NaN; well before that, the gradient, up to beta per trained token's log-prob, overflows the
# gradient norm's float32 sum of squares (1.8e19 an element). ipo and simpo divide by beta (the target
# margin 1/(2 beta), squared by ipo: inf below beta 3e-20; simpo's gamma / beta). Within these ranges
# beta x |z| stays under 1e10 for a margin of 1e7 nats (100,000 tokens a side at 30 nats each), the
# gradient under 1e3 per token, 1/(2 beta) and gamma / beta under 1e6. Published values sit 10x inside:
# beta 0.01 to 0.5 (sigmoid, ipo's tau), 2 to 10 (simpo), simpo_gamma up to 16.
DPO_BETA_RANGE = (1e-3, 1e3)
SIMPO_GAMMA_MAX = 1e3


def reference(r) -> str | None:
    """SimPO holds none; else the precomputed log-probs, the adapter disabled (LoRA) or a frozen copy."""
    if r.dpo_loss == "simpo":
        return None
    if r.precompute_reference:
        return "precomputed"
    return "adapter" if r.lora else "frozen"


def check(r, strategy) -> None:
    low, high = DPO_BETA_RANGE
    if not low <= r.dpo_beta <= high:
        raise RecipeError(f"dpo_beta={r.dpo_beta:g}: must be in [{low:g}, {high:g}], where the loss and its gradient "
                          "stay finite in float32 (the usual values: 0.1 for sigmoid and ipo, 2.0 for simpo)")
    if r.simpo_gamma > SIMPO_GAMMA_MAX:
        raise RecipeError(f"simpo_gamma={r.simpo_gamma:g}: must be in [0, {SIMPO_GAMMA_MAX:g}], where simpo_gamma / "
                          "dpo_beta stays finite and leaves the log-probs their float32 precision (the usual values: "
                          "0.5 to 1.6 x dpo_beta)")
    if r.dpo_loss == "simpo" and r.precompute_reference:
        raise RecipeError("precompute_reference=true with dpo_loss=simpo: SimPO is reference-free, there is no "
                          "reference to precompute; set precompute_reference=false, or dpo_loss=sigmoid or ipo")
    if r.dpo_label_smoothing and r.dpo_loss != "sigmoid":
        raise RecipeError(f"dpo_label_smoothing={r.dpo_label_smoothing} with dpo_loss={r.dpo_loss}: label smoothing "
                          "is a sigmoid (DPO) loss setting; set dpo_loss=sigmoid or dpo_label_smoothing=0")
    if r.simpo_gamma != default(r, "simpo_gamma") and r.dpo_loss != "simpo":
        raise RecipeError(f"simpo_gamma={r.simpo_gamma} with dpo_loss={r.dpo_loss}: gamma is SimPO's margin; set "
                          "dpo_loss=simpo or leave simpo_gamma out")
    refuse_switched_on(r, ("packing", "padding_free", "train_on_prompt"), "objective=dpo",
                       "a preference pair is scored as its two whole sequences, on the responses only")
    problem = strategy.frozen_reference_problem(r) if reference(r) == "frozen" else None
    if problem:
        raise RecipeError(f"objective=dpo with {problem}, or precompute_reference=true (no reference held while "
                          "training)")
    check_prompt_budget(r)
