"""The reward model's recipe rules (the objective: finetune/training/objectives/reward.py): its key only with
objective=reward; with it, of DPO's keys max_prompt_len only, whole unpacked pairs, no sequence
parallelism (a sequence is scored at its last token) and no 4-bit base."""

from __future__ import annotations

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules.common import check_prompt_budget

NAME = "reward"
FIELDS = ("center_rewards_coefficient",)
SHARES = ("max_prompt_len",)
ROWS = ("preference",)
FORWARD_ROWS = 2  # a pair: its chosen and rejected sequences in one forward
PAIR_BATCHES = True  # a micro-batch is 2n rows, a row and its partner (sequence_parallel.shard)


def reference(r) -> str | None:
    return None


def check(r, strategy) -> None:
    refuse_switched_on(r, ("packing", "padding_free", "train_on_prompt"), "objective=reward",
                       "a preference pair is scored as its two whole sequences, one reward each")
    if r.sequence_parallel > 1:
        raise RecipeError(f"sequence_parallel={r.sequence_parallel} with objective=reward: a reward model scores each "
                          "sequence at its last token, which sequence parallelism would leave on one rank's slice "
                          "(not supported yet; it serves sft and dpo); set sequence_parallel=1")
    if r.load_in_4bit:
        raise RecipeError("load_in_4bit=true with objective=reward: the score head of a 4-bit base was not tried; "
                          "set load_in_4bit=false (lora=true keeps the base frozen)")
    check_prompt_budget(r)
