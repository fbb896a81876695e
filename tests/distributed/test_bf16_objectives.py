"""Every objective as a GPU user runs it (mixed_precision=bf16), on 2 CPU processes under ZeRO-3 and FSDP2:
SFT (tests/distributed/test_bf16.py), DPO and KTO with their frozen reference, the reward model, on-policy
distillation with its teacher, and GRPO with the
compiled decode loop (a StaticCache and a torch.compile'd one-token step: what generation_compile=auto
runs on a GPU) and with the eager one, both with a reference (beta > 0) and old-policy log-probs kept for a
second optimizer step (num_iterations=2). CPU autocast has bf16, so these runs take the dtypes a GPU's
do: DeepSpeed's bf16 engine holds bf16 weights, FSDP2 casts them to bf16 for compute.

GRPO at mixed_precision=bf16 with the compiled loop failed at its first rollout on a GPU (and on CPU with
transformers 5.17): the static cache held fp32 keys and was handed bf16 values. The GRPO launches are
marked `internals`: scripts/test_oldest.sh runs them again with the oldest transformers pyproject allows."""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO  # noqa: F401  (the launches run from the repository)
from finetune.training.metrics import read_metrics, run_history

STRATEGIES = ("zero3", "fsdp")
SHORT = ["mixed_precision=bf16", "max_steps=4", "eval_every=4", "eval_max_samples=8", "log_every=1",
         "save_every=0", "global_batch_size=8", "micro_batch_size=4"]
GRPO = ["mixed_precision=bf16", "global_batch_size=4", "num_generations=4", "micro_batch_size=4", "max_steps=4",
        "num_iterations=2", "beta=0.04", "temperature=0.7", "eval_fraction=0", "eval_dataset=builtin:tiny-prompts",
        "eval_max_samples=4", "eval_every=4", "save_every=0", "loss_chunk_tokens=8", "log_every=1"]


def history(run) -> list[dict]:
    return run_history(read_metrics(run.output_dir / "metrics.jsonl"))


def train_records(run) -> list[dict]:
    return [r for r in history(run) if "loss" in r]


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bf16_objective_runs(launch):
    runs = {}

    def get(kind: str, strategy: str):
        if (kind, strategy) not in runs:
            if kind == "dpo":
                runs[kind, strategy] = launch(2, f"strategy={strategy}", *SHORT, recipe="tiny_dpo")
            elif kind in ("reward", "kto"):
                runs[kind, strategy] = launch(2, f"strategy={strategy}", *SHORT, recipe=f"tiny_{kind}")
            elif kind == "distill":  # every step on-policy: the student's completions from the compiled loop
                runs[kind, strategy] = launch(2, f"strategy={strategy}", *SHORT, "teacher_model=builtin:tiny-llama-h64",
                                              "lmbda=1.0", "max_completion_len=8", "generation_compile=true",
                                              recipe="tiny_distill")
            else:
                compiled = "true" if kind == "grpo_compiled" else "false"
                runs[kind, strategy] = launch(2, f"strategy={strategy}", *GRPO, f"generation_compile={compiled}",
                                              recipe="tiny_grpo")
        return runs[kind, strategy]

    return get


def finished(run, metric: str) -> list[dict]:
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4], records
    assert all(math.isfinite(r["loss"]) and math.isfinite(r[metric]) for r in records), records
    assert (run.output_dir / "final" / "config.json").is_file()
    return records


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dpo_at_bf16_trains_with_its_reference(strategy, bf16_objective_runs):
    records = finished(bf16_objective_runs("dpo", strategy), "rewards/margins")
    # the reference is the starting policy: the first step's margin is 0 up to bf16 rounding, then it moves
    assert abs(records[0]["rewards/margins"]) < 0.05, records[0]
    assert any(abs(r["rewards/margins"]) > 1e-3 for r in records[1:]), records


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reward_model_at_bf16_trains(strategy, bf16_objective_runs):
    records = finished(bf16_objective_runs("reward", strategy), "accuracy")
    assert records[-1]["loss"] < records[0]["loss"] + 0.05, records


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kto_at_bf16_trains_with_its_reference(strategy, bf16_objective_runs):
    records = finished(bf16_objective_runs("kto", strategy), "rewards/margins")
    assert abs(records[0]["rewards/chosen"]) < 0.05 and abs(records[0]["rewards/rejected"]) < 0.05, records[0]
    assert any(abs(r["rewards/margins"]) > 1e-3 for r in records[1:]), records


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_distillation_at_bf16_samples_and_scores_with_its_teacher(strategy, bf16_objective_runs):
    records = finished(bf16_objective_runs("distill", strategy), "teacher_agreement")
    assert all(r["on_policy"] == 1 for r in records), records


@pytest.mark.internals
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grpo_at_bf16_rolls_out_with_the_compiled_loop_and_the_eager_one(strategy, bf16_objective_runs):
    """Both loops sample completions, score them, and train with the reference and the old-policy log-probs.
    The first rollout's first tokens are the same (the prompts' forward is eager in both); after them the
    compiled kernels' bf16 rounding may part a near tie (tests/test_generation.py compares the logits; in
    fp32 the compiled loop gives the eager tokens: tests/test_generation.py)."""
    compiled, eager = bf16_objective_runs("grpo_compiled", strategy), bf16_objective_runs("grpo_eager", strategy)
    for run in (compiled, eager):
        records = finished(run, "reward")
        assert all(math.isfinite(r["kl"]) for r in records), records
        assert any(r["kl"] > 0 for r in records[1:]), "the policy moved off its reference"
    first = [[r["completion_ids"][:1] for r in rollouts(run) if r["step"] == 1] for run in (compiled, eager)]
    assert first[0] == first[1] and len(first[0]) == 16, first
    assert [r["step"] for r in rollouts(compiled)] == [r["step"] for r in rollouts(eager)]
