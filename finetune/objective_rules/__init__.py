"""The recipe rules an objective owns, one module per objective, asked by recipe.validate as it asks the
strategy (finetune/strategy): which keys belong to the objective, what it cannot take, which reference
it holds and which rows it trains on. They sit on the ground floor, beside recipe.py, so that validate
reaches them before anything loads; the objectives themselves (finetune/training/objectives) sit above
and read the same recipe.

Each module is one objective's entry, with:

    NAME            the recipe's objective=NAME
    FIELDS          the recipe keys it owns: refused under another objective unless that one SHARES them
    SHARES          other objectives' keys it takes too (max_prompt_len, DPO's, for every prompt cutter)
    LISTS           (optional) those of its keys written comma-separated in a refusal
    ROWS            the data formats it trains on (finetune/data/sources.py check_objective): () SFT's,
                    "preference" pairs, "prompt" rows, "unpaired" (prompt, completion, label) rows
    FORWARD_ROWS    sequences per example in one forward (a preference pair: 2), for the planner and
                    sequence parallelism
    PAIR_BATCHES    a micro-batch is laid out as pairs, 2n rows (DPO's and the reward model's chosen then
                    rejected, KTO's rows then their KL rows): sequence parallelism shards each half alike
    reference(r)    the reference it holds beside the policy: None, "precomputed", "adapter" or "frozen"
    check(r, strategy)  its own rules, asked only under objective=NAME
    resume_problem(r, changed)  (optional) why a resumed run may not make these changes, or None
    in_flight(r, step)  (optional) the work in flight a checkpoint after `step` steps must hold for a run
                    to resume from it: (its name, why a resume cannot do without it), or None
    loss_settings_named(r)  (optional) its settings that can make the loss blow up by themselves, named
                    where a run stops on a loss that is not finite (GRPO's entropy_coef, sapo's, vespo's)

Adding an objective is a module here, its entry in OBJECTIVES, its recipe keys in recipe.py and its
class in finetune/training/objectives."""

from __future__ import annotations

from finetune.objective_rules import distill, dpo, grpo, kto, reward, sft
from finetune.objective_rules.common import refuse_foreign

# In the order their keys are checked (a recipe that breaks several rules is told of the first).
OBJECTIVES = {m.NAME: m for m in (sft, grpo, reward, dpo, kto, distill)}
NAMES = ("sft", "dpo", "grpo", "reward", "kto", "distill")  # the recipe's choices, as the docs list them


def rules(recipe):
    """The recipe's objective's rules module."""
    return OBJECTIVES[recipe.objective]


def check(recipe, strategy) -> None:
    """Every objective's keys left at their defaults under the others (a RecipeError naming the key, the
    value and the objective it belongs to), then the recipe's objective's own rules."""
    grpo.check_generation_backend(recipe)
    own = rules(recipe)
    for name, module in OBJECTIVES.items():
        if name != recipe.objective:
            refuse_foreign(recipe, name, module.FIELDS, own.SHARES, getattr(module, "LISTS", ()))
    own.check(recipe, strategy)


def reference_kind(recipe) -> str | None:
    """Which reference a run holds beside the policy, decided here for everything that asks (the
    objective's set-up, reference.build_reference, the planner, resume, the rules): None (SFT; SimPO,
    reference-free; GRPO with beta=0), "precomputed" (log-probs of every row computed before training,
    carried by the rows), "adapter" (LoRA: the policy with its adapter disabled) or "frozen" (a frozen
    copy of the starting weights, placed by the strategy)."""
    return rules(recipe).reference(recipe)


def loss_settings_named(recipe) -> str | None:
    """The objective's own settings that can make its loss blow up whatever the learning rate and data, in
    words, where the recipe changed them (None: none); said where a run stops on a loss that is not finite."""
    named = getattr(rules(recipe), "loss_settings_named", None)
    return named(recipe) if named else None
