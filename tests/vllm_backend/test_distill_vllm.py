"""objective=distill with generation_backend=vllm on real launches (recipes/tiny_distill.py with the tiny Llama of
head size 64 as the student, which vLLM's CPU attention serves, and the builtin tiny Llama as its teacher, one
vocabulary): the on-policy completions come from a vLLM engine in each process, given the trained weights
before each step; 2 processes under ZeRO-3 train as 1 process does (the same completions: each seeded per
step and row), and the divergence falls. Launches: 2. Runs only where vLLM is installed (bash
scripts/test_vllm.sh)."""

from __future__ import annotations

from test_distill import assert_same, records  # tests/distributed, on the path (conftest.py)

VLLM = ["model=builtin:tiny-llama-h64", "teacher_model=builtin:tiny-llama", "generation_backend=vllm",
        "max_steps=6", "eval_every=3", "eval_at_start=true", "eval_max_samples=16", "max_completion_len=8",
        "warmup_steps=0", "log_every=1", "save_every=0"]


def test_two_processes_with_engines_train_as_one(launch):
    two = launch(2, "strategy=zero3", *VLLM, recipe="tiny_distill")
    one = launch(1, "strategy=ddp", *VLLM, recipe="tiny_distill")
    assert_same(two, one, steps=(0, 1, 2, 3, 3, 4, 5, 6, 6))
    a = records(two)
    train = [r for r in a if "loss" in r]
    assert all(r["on_policy"] == 1.0 and 0 < r["completions/mean_length"] <= 8 for r in train)
    evals = [r for r in a if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"], "the student moved towards the teacher"
