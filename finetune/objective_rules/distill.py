"""On-policy distillation's recipe rules (the objective: finetune/training/objectives/distill.py): its keys only
with objective=distill; with it, a teacher, a temperature above 0 (the divergence divides by it), sampling that
can run, rows scored on their completion tokens alone (no packing, padding-free rows or prompt training), no
sequence parallelism, and a strategy that can hold a frozen model beside the student. Whether the teacher
shares the student's vocabulary is the run's check, before either model loads (the objective's before_model).
Each failure is one RecipeError naming the key, its value and what is allowed."""

from __future__ import annotations

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules.grpo import sampling_problem

NAME = "distill"
FIELDS = ("teacher_model", "lmbda", "distill_beta")
SHARES = ("temperature", "top_p", "top_k", "max_completion_len")  # GRPO's sampling keys: it samples as GRPO does
ROWS = ()  # SFT's rows: a row's prompt is its tokens before the first target token
FORWARD_ROWS = 1
PAIR_BATCHES = False


def reference(r) -> str | None:
    """No reference of the policy: the teacher is a model of its own (the objective sets it up; the planner
    counts it)."""
    return None


def check(r, strategy) -> None:
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
