"""GRPO with tools over several turns on real launches (recipes/tiny_grpo_tools.py: the calculator environment,
its prompts and rewards, shortened), from a model whose rollouts call the tool (tests/agent_tools.py
tool_happy_model: mul's calls, calls of a tool that does not exist, calls that do not parse, answers): the
conversations of 2 processes under ddp, ZeRO-3 and FSDP equal those of 1 process (rollouts.jsonl identical:
every turn, call, tool answer, tool mask and reward; the curve within 1e-6); a ZeRO-3 run SIGKILLed
between two turns of a rollout resumes to the 1-process curve and writes rollouts.jsonl byte for byte as
it; and bf16 under ZeRO-3 and FSDP runs its rollouts with tools to finite losses. 7 launches in all (ddp 1 and 2,
FSDP 2, ZeRO-3 killed and resumed, bf16 ZeRO-3 and FSDP)."""

from __future__ import annotations

import json

import pytest

from tests.agent_tools import tool_happy_model

# 4 prompts x 4 completions a step, 4 steps (2 rollouts on each side of the checkpoint at step 2 the killed
# run resumes from), evaluated at steps 2 and 4 on 4 eval prompts; max_tool_calling_iterations=2: a second
# round of calls in some conversations; lr 1e-4: the tool-happy model is a bigram table (attention and MLP outputs
# zero), which one AdamW step at the recipe's 1e-2 (or 1e-3 within 4 steps) turns into a loop of calls cut by the
# budget, where no call parses and every group has one reward (a loss of 0, which any two runs agree on); at 1e-4
# every step still calls, errs, fails to parse and trains
AGENT = ["max_steps=4", "global_batch_size=4", "num_generations=4", "micro_batch_size=4", "eval_every=2",
         "eval_max_samples=4", "save_every=2", "keep_last=3", "max_tool_calling_iterations=2", "max_completion_len=32",
         "lr=1e-4", "warmup_steps=0"]
TOLERANCE = 1e-6
TIMING = ("tokens_per_s", "rollout_seconds", "peak_memory_gib", "step_seconds", "mfu")


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def curve(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("tokens_per")}
            for r in run.train_records + run.eval_records]


def assert_same_curve(got, want):
    a, b = curve(got), curve(want)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if isinstance(v, float):
                assert v == pytest.approx(y[k], abs=TOLERANCE, rel=TOLERANCE), (x["step"], k, v, y[k])


@pytest.fixture(scope="module")
def agent_run(launch, tmp_path_factory):
    from conftest import once

    model = tool_happy_model(tmp_path_factory.mktemp("tool-happy"))
    def make(strategy, nprocs, *extra, fault="", output_dir=None):
        return launch(nprocs, f"strategy={strategy}", f"model={model}", *AGENT, *extra, recipe="tiny_grpo_tools",
                      output_dir=output_dir, check=not fault, extra_env={"FINETUNE_FAULT": fault} if fault else None)

    return once(make)


def test_conversations_call_tools_and_their_answers_stay_out_of_the_loss(agent_run):
    one = agent_run("ddp", 1)
    lines = rollouts(one)
    assert len(lines) == 4 * 16 and all(set(r["rewards"]) == {"tool_call", "char_match", "exact_match"} for r in lines)
    answers = [t for r in lines for t in r["turns"] if t["role"] == "tool"]
    assert any(t["error"] is None and t["content"] == str(r["columns"]["a"] * r["columns"]["b"])
               for r in lines for t in r["turns"] if t["role"] == "tool"), "calc answered the question's product"
    assert any(t["error"] == "unknown" for t in answers), "a call of a tool that does not exist is answered with an error"
    assert any(t["role"] == "assistant" and t["unparsed"] for r in lines for t in r["turns"])
    for r in lines:  # the tool mask: 0 exactly on the tokens fed after a turn, 1 on what the model drew
        assert len(r["tool_mask"]) == len(r["completion_ids"])
        fed = [i for i, m in enumerate(r["tool_mask"]) if m == 0]
        assert bool(fed) == any(t["role"] == "tool" and "dropped" not in t for t in r["turns"])
    records = one.train_records
    mean_drawn = sum(sum(r["tool_mask"]) for r in lines if r["step"] == 1) / 16
    assert records[0]["completions/mean_length"] == pytest.approx(mean_drawn), "lengths count the model's tokens"
    assert all(r["tools/call_frequency"] > 0 and 0 <= r["tools/failure_frequency"] <= 1 for r in records)
    assert all(r["loss"] != 0 and r["grad_norm"] > 0 for r in records), "every step trains (the 2 = 1 tests' power)"
    assert {"eval_tools/call_frequency", "eval_tools/turns", "eval_reward"} <= set(one.eval_records[-1])


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_two_processes_converse_and_train_as_one(agent_run, strategy):
    one = agent_run("ddp", 1)
    two = agent_run(strategy, 2) if strategy != "zero3" else resumed(agent_run)
    assert rollouts(two) == rollouts(one), "the same conversations: turns, calls, tool answers, masks, rewards"
    assert_same_curve(two, one)


def resumed(agent_run):
    """ZeRO-3 on 2 processes, killed on rank 1 between two turns of step 3's rollout, resumed from step 2."""
    killed = agent_run("zero3", 2, fault="turn:1:3")
    assert killed.returncode != 0 and "step 2: checkpoint" in killed.stderr
    return agent_run("zero3", 2, "--resume", "auto", output_dir=killed.output_dir)


def test_a_run_killed_between_turns_resumes_exactly(agent_run):
    one, again = agent_run("ddp", 1), resumed(agent_run)
    assert "resum" in again.stderr
    assert (again.output_dir / "rollouts.jsonl").read_bytes() == (one.output_dir / "rollouts.jsonl").read_bytes()
    assert_same_curve(again, one)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_bf16_converses_with_finite_losses(agent_run, strategy):
    run = agent_run(strategy, 2, "mixed_precision=bf16", "max_steps=2", "eval_every=0", "save_every=0")
    records = run.train_records
    assert len(records) == 2 and all(abs(r["loss"]) < 1e3 and r["tools/call_frequency"] > 0 for r in records)
    assert any(0 in r["tool_mask"] for r in rollouts(run))
