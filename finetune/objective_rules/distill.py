"""On-policy distillation's recipe rules (the objective: finetune/training/objectives/distill.py): its keys only
with objective=distill; with it, a teacher, a temperature above 0 (the divergence divides by it), sampling that
can run, rows scored on their completion tokens alone (no packing, padding-free rows or prompt training), no
sequence parallelism, and a strategy that can hold a frozen model beside the student. Whether the teacher
shares the student's vocabulary is the run's check, before either model loads (the objective's before_model).
Each failure is one RecipeError naming the key, its value and what is allowed."""

from __future__ import annotations

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules.grpo import default, sampling_problem

DISTILL_FIELDS = ("teacher_model", "lmbda", "distill_beta")


def check(r, strategy) -> None:
    if r.objective != "distill":
        changed = [k for k in DISTILL_FIELDS if getattr(r, k) != default(r, k)]
        if changed:
            key = changed[0]
            raise RecipeError(f"{key}={getattr(r, key)} applies to objective=distill only; set objective=distill, or "
                              f"leave {key} out")
        return
    if not r.teacher_model:
        raise RecipeError("objective=distill needs a teacher: teacher_model=<hub id or directory> with the student's "
                          "vocabulary (e.g. a model trained by the tiny recipe: teacher_model=runs/tiny/final)")
    if r.temperature == 0:
        raise RecipeError("temperature=0 with objective=distill: the divergence compares softmax(logits / temperature) "
                          "of student and teacher; use temperature > 0 (TRL's default: 1)")
    problem = sampling_problem(r)
    if problem:
        raise RecipeError(problem)
    refuse_switched_on(r, ("packing", "padding_free", "train_on_prompt"), "objective=distill",
                       "the divergence is taken on each row's completion tokens, which on-policy steps replace by "
                       "the student's own")
    if r.sequence_parallel > 1:
        raise RecipeError(f"sequence_parallel={r.sequence_parallel} with objective=distill: the completions are "
                          "sampled whole on each data-parallel rank and the divergence needs the teacher's and the "
                          "student's whole vocabulary at each position of the same shard (TRL refuses it too); set "
                          "sequence_parallel=1 (shorter max_completion_len, activation_checkpointing or a sharding "
                          "strategy lower the memory instead)")
    problem = strategy.frozen_reference_problem(r)
    if problem:
        raise RecipeError(f"objective=distill holds its teacher as a frozen model beside the student: {problem}")
