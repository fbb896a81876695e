"""generation_backend=vllm on real 2-process launches (recipes/tiny_grpo_vllm.py: the tiny Llama with head size
64, a vLLM engine in each process): under ZeRO-3 the reward rises and every rollout's engine log-probs equal
the trainer's within fp32 noise (the push took, after each of the steps), the importance weights are 1; a
SIGKILLed run resumed from its checkpoint trains on the completions its engine had generated (the rollout
cache) and then continues exactly as the uninterrupted run; LoRA under FSDP pushes merged weights (the log-probs
agree) and saves the adapter only; a push that a fault skips (the engine keeps the old weights) is caught at
the next rollout, and a push that fails on one rank is one error line naming it; 1 process generates and
trains on the same completions as 2.

Every strategy's push path: ZeRO-3 and FSDP2 (parameters offloaded to CPU) for 24 steps, whose reward rises;
ZeRO-2 with its optimizer offloaded and ZeRO-3 with parameters and optimizer offloaded for 3 steps, each push
taken and the same completions as ZeRO-3's; ddp on 1 process. Padded vocabulary rows are never drawn (the
tiny model's 128 output rows against 108 tokens: rollouts.jsonl counts no undecodable id).

At mixed_precision=bf16 under ZeRO-3 and FSDP2, every push takes within bf16's tolerance.

Launches: 12 (eleven of 2 processes, each starting two engines, and one of 1 process). Runs only where vLLM is installed (bash scripts/test_vllm.sh)."""

from __future__ import annotations

import json
import shutil

import pytest

from finetune.training.metrics import read_metrics, run_history

# 8 prompts x 8 completions a step, each process generating 4 prompts' groups in one call; checkpoints every
# 3 steps; an eval of 8 prompts every 6 steps.
VLLM = ["global_batch_size=8", "micro_batch_size=16", "num_generations=8", "save_every=3", "keep_last=4",
        "eval_every=6", "eval_max_samples=8", "warmup_steps=0", "log_every=1"]
LONG = 24  # steps of the uninterrupted ZeRO-3 run, whose reward rises
TIMING = ("tokens_per_s", "rollout_seconds", "peak_memory_gib", "step_seconds", "mfu", "vllm/push_seconds")
FP32_NOISE = 1e-4  # the largest |engine - trainer| log-prob of any sampled token in fp32 (measured: about 1e-6)


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def records(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("tokens_per")}
            for r in run_history(read_metrics(run.output_dir / "metrics.jsonl")) if "loss" in r]


def eval_records(run) -> list[dict]:
    return [r for r in run_history(read_metrics(run.output_dir / "metrics.jsonl"))
            if any(k.startswith("eval_") for k in r)]


@pytest.fixture(scope="module")
def zero3(launch):
    return launch(2, "strategy=zero3", *VLLM, f"max_steps={LONG}", recipe="tiny_grpo_vllm")


def assert_push_took(run, steps: int):
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    for r in recs:  # every rollout: the engine sampled from the weights the trainer holds
        assert 0 <= r["vllm/logp_diff/mean"] <= r["vllm/logp_diff/max"] < FP32_NOISE, r
        assert r["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-3)
        assert r["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)


def test_zero3_with_vllm_reward_rises_and_every_push_takes(zero3):
    assert "zero3 on 2" in zero3.stderr
    assert_push_took(zero3, LONG)
    rewards = [r["reward"] for r in records(zero3)]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first * 1.3, f"the reward did not rise: {rewards}"
    evals = eval_records(zero3)
    assert [r["step"] for r in evals] == [6, 12, 18, 24] and all(r["eval_reward"] >= 0 for r in evals)
    lines = rollouts(zero3)
    assert len(lines) == LONG * 64 and all(r["completion_ids"] for r in lines)
    # the output layer's rows past the tokenizer's 108 tokens (128 in all) are never drawn
    assert all(r["undecodable_ids"] == 0 and max(r["completion_ids"]) < 108 for r in lines)
    # the engine's seeds: each completion's own, so a group's completions differ
    group = [tuple(r["completion_ids"]) for r in lines[:8]]
    assert len(set(group)) > 1


@pytest.fixture(scope="module")
def fsdp_offloaded(launch):
    return launch(2, "strategy=fsdp", "offload_params=cpu", *VLLM, f"max_steps={LONG}", recipe="tiny_grpo_vllm")


def test_fsdp_full_fine_tune_with_vllm_reward_rises_and_every_push_takes(fsdp_offloaded, zero3):
    """The full fine-tune under FSDP2 (its parameters offloaded to CPU: the push gathers DTensors held in host
    memory): every push takes, the reward rises, and it samples and trains on what ZeRO-3 did."""
    run = fsdp_offloaded
    assert "fsdp on 2" in run.stderr
    assert_push_took(run, LONG)
    rewards = [r["reward"] for r in records(run)]
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 * 1.3, f"the reward did not rise: {rewards}"
    assert rollouts(run) == rollouts(zero3)
    for a, b in zip(records(run), records(zero3), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), a["step"]


# The other push paths (Strategy.weight_buckets): ZeRO-1/2's whole parameters, under a CPU optimizer (DeepSpeed
# copies its updated fp32 partitions back into them), and ZeRO-3's gather of partitions held in host memory.
OTHER_PUSHES = {"zero2-offload": ["strategy=zero2", "offload_optimizer=cpu"],
                "zero3-offload": ["strategy=zero3", "offload_params=cpu", "offload_optimizer=cpu"]}


@pytest.mark.parametrize("name", list(OTHER_PUSHES))
def test_every_push_takes_under_each_strategy(name, zero3, launch):
    run = launch(2, *OTHER_PUSHES[name], *VLLM, "max_steps=3", recipe="tiny_grpo_vllm")
    assert f"{OTHER_PUSHES[name][0].split('=')[1]} on 2" in run.stderr
    assert_push_took(run, 3)
    assert rollouts(run) == [r for r in rollouts(zero3) if r["step"] <= 3]


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_bf16_engines_take_every_push(strategy, launch):
    """mixed_precision=bf16, as a GPU user runs it: the engine serves bfloat16 (generators.ENGINE_DTYPES) and is
    pushed the trainer's weights (ZeRO-3's bf16 partitions gathered; FSDP2's fp32 masters, cast by the
    engine's loader); each rollout's log-probs agree with the trainer's within bf16's tolerance (the push
    took) and the loss is finite."""
    import math

    from finetune.training.generators import LOGP_TOLERANCE

    run = launch(2, f"strategy={strategy}", "mixed_precision=bf16", *VLLM, "max_steps=3", recipe="tiny_grpo_vllm")
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert 0 <= r["vllm/logp_diff/mean"] <= LOGP_TOLERANCE["bfloat16"], r
        assert math.isfinite(r["loss"]) and math.isfinite(r["reward"]), r


def test_sigkill_and_resume_with_vllm_continue_as_the_uninterrupted_run(zero3, launch, tmp_path_factory):
    """Killed after step 5 (rank 1); resumed from step 3's checkpoint: steps 4 and 5 train on the completions the
    engine generated before the kill (the rollout cache), step 6 on new ones, all as the uninterrupted run."""
    out = tmp_path_factory.mktemp("vllm-killed")
    first = launch(2, "strategy=zero3", *VLLM, "max_steps=8", output_dir=out, check=False, recipe="tiny_grpo_vllm",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0
    # the engine's rollouts back to the checkpoint's are kept: rollouts 3 and 4 (0-based) of steps 4 and 5
    assert {"3", "4"} <= {p.name for p in (out / "rollout-cache").iterdir()}  # each sealed with step 3's save_id
    second = launch(2, "strategy=zero3", *VLLM, "max_steps=8", "--resume", "auto", output_dir=out,
                    recipe="tiny_grpo_vllm")
    assert "at step 3" in second.stderr
    want = records(zero3)[:8]
    got = records(second)
    assert got == want, "the resumed run logs exactly what the uninterrupted one did"
    assert rollouts(second) == [r for r in rollouts(zero3) if r["step"] <= 8]
    assert eval_records(second)[0] == eval_records(zero3)[0], "the eval at step 6, after the resume"


def test_lora_under_fsdp_pushes_merged_weights(launch):
    run = launch(2, "strategy=fsdp", "lora=true", "lr=2e-2", *VLLM, "max_steps=4", recipe="tiny_grpo_vllm")
    assert "fsdp on 2" in run.stderr
    assert_push_took(run, 4)
    assert records(run)[-1]["vllm/logp_diff/mean"] < FP32_NOISE
    final = run.output_dir / "final"
    assert (final / "adapter_config.json").is_file(), "the adapter is saved as an adapter, not merged"


def test_a_skipped_push_is_caught(launch):
    """FSDP: rank 1's push after step 3 gathers but does not reach its engine; the rollout of step 4 sees the
    engine's log-probs differ from the trainer's and stops the run with one line."""
    run = launch(2, "strategy=fsdp", *VLLM, "max_steps=6", recipe="tiny_grpo_vllm", check=False,
                 extra_env={"FINETUNE_FAULT": "vllm_push:1:3:SKIP"})
    assert run.returncode != 0
    assert_push_took(run, 3)  # fsdp's pushes take until the skipped one
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout 3" in errors[0] and "did not take" in errors[0], errors


def test_a_failing_push_is_one_line_naming_the_rank(launch):
    run = launch(2, "strategy=zero3", *VLLM, "max_steps=6", recipe="tiny_grpo_vllm", check=False,
                 extra_env={"FINETUNE_FAULT": "vllm_push:1:2:RAISE"})
    assert run.returncode != 0
    assert [r["step"] for r in records(run)] == [1, 2]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failed on rank 1" in errors[0] and "injected fault" in errors[0], errors
    assert (run.output_dir / "rollouts.jsonl").is_file()


def test_one_process_samples_what_two_did(zero3, launch):
    """The engine's completions do not depend on the process count: 1 process (ddp) generates, scores and
    trains on the same completions as the 2-process ZeRO-3 run for 3 steps (losses and metrics within 1e-5:
    the two reduce the gradients in different orders)."""
    one = launch(1, "strategy=ddp", *VLLM, "max_steps=3", recipe="tiny_grpo_vllm")
    assert rollouts(one) == [r for r in rollouts(zero3) if r["step"] <= 3]
    for a, b in zip(records(one), records(zero3)[:3], strict=False):
        for k, v in a.items():
            if isinstance(v, float) and not k.startswith("vllm/"):
                assert v == pytest.approx(b[k], abs=1e-5, rel=1e-5), (a["step"], k, v, b[k])
