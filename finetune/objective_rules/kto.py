"""KTO's recipe rules (the objective: finetune/training/objectives/kto.py): its keys only with objective=kto;
with it, of DPO's keys precompute_reference and max_prompt_len; a beta where the loss stays finite in
float32, the KL estimate's chunks of 2 rows or more, unpacked rows, no sequence parallelism yet, and a
reference the strategy can hold. Each failure is one RecipeError naming the key, its value and what is
allowed."""

from __future__ import annotations

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules.common import check_prompt_budget
from finetune.objective_rules.dpo import DPO_BETA_RANGE

NAME = "kto"
FIELDS = ("kto_loss", "kto_beta", "desirable_weight", "undesirable_weight")
SHARES = ("precompute_reference", "max_prompt_len")
ROWS = ("unpaired",)
FORWARD_ROWS = 1  # a row with grad; its KL row is scored before, without (the step's KL estimate)
PAIR_BATCHES = True  # a micro-batch is 2n rows, a row and its partner (sequence_parallel.shard)
WEIGHT_MAX = 1e3  # a weight past this only rescales the learning rate (TRL's advice: 1 to 4/3)


def reference(r) -> str | None:
    """The precomputed log-probs, the adapter disabled (LoRA) or a frozen copy, as DPO's."""
    if r.precompute_reference:
        return "precomputed"
    return "adapter" if r.lora else "frozen"


def resume_problem(r, changed: dict) -> str | None:
    """What a resumed run may not change (changed: key -> (the checkpoint's value, this run's)): the KL rows
    pair rows within each micro-batch, so another micro_batch_size would estimate the resumed steps' KL on
    other pairs than the uninterrupted run's."""
    if r.kto_loss == "kto" and "micro_batch_size" in changed:
        old, new = changed["micro_batch_size"]
        return (f"micro_batch_size: {old} -> {new}: objective=kto's KL rows pair each row's prompt with the "
                "completion of the row before it within its micro-batch, so the resumed steps would estimate the KL "
                f"on other pairs; resume with micro_batch_size={old}")
    return None


def check(r, strategy) -> None:
    low, high = DPO_BETA_RANGE  # beta x a log-ratio of summed log-probs, as DPO's
    if not low <= r.kto_beta <= high:
        raise RecipeError(f"kto_beta={r.kto_beta:g}: must be in [{low:g}, {high:g}], where the loss and its gradient "
                          "stay finite in float32 (the usual value: 0.1, TRL's default)")
    for key in ("desirable_weight", "undesirable_weight"):
        value = getattr(r, key)
        if not 0 < value <= WEIGHT_MAX:
            raise RecipeError(f"{key}={value:g}: must be in (0, {WEIGHT_MAX:g}] (0 drops those rows from the loss: "
                              "leave them out of the data instead); TRL's advice: desirable_weight x desirable rows "
                              "within 1 to 4/3 of undesirable_weight x undesirable rows")
    if r.kto_loss == "kto" and r.micro_batch_size < 2:
        raise RecipeError(f"micro_batch_size={r.micro_batch_size} with objective=kto: the KL estimate pairs each "
                          "prompt with the completion of the row before it within its micro-batch (TRL's rule), so a "
                          "micro-batch of one pairs a row with itself; set micro_batch_size=2 or more, or "
                          "kto_loss=apo_zero_unpaired (no KL estimate)")
    refuse_switched_on(r, ("packing", "padding_free", "train_on_prompt"), "objective=kto",
                       "a row is scored as its whole sequence, on the completion only")
    if r.sequence_parallel > 1 and r.precompute_reference:
        raise RecipeError(f"precompute_reference=true with sequence_parallel={r.sequence_parallel} and objective=kto: "
                          "the precompute pass scores a row and its KL row in one forward, which Ulysses' wrapper, "
                          "registered for KTO's forwards of one of them, does not take; set precompute_reference="
                          "false (the reference is held) or sequence_parallel=1")
    problem = strategy.frozen_reference_problem(r) if reference(r) == "frozen" else None
    if problem:
        raise RecipeError(f"objective=kto with {problem}, or precompute_reference=true (no reference held while "
                          "training)")
    check_prompt_budget(r)
