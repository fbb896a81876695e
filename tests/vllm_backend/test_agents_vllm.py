"""GRPO with tools and generation_backend=vllm on a real 2-process launch (recipes/tiny_grpo_tools.py, from a model
of head size 64 whose rollouts call tools: tests/agent_tools.py tool_happy_model): each turn of a conversation
is a request of its own to the rank's engine (the conversation so far its prompt), the calculator's answers
are fed between them as finetune's decode loop feeds them, and the engine's log-probs of the tokens the model
drew equal the trainer's within fp32 noise at every step (the fed tokens, 0 in the tool mask, in no term and
no comparison). 1 launch."""

from __future__ import annotations

import json

import pytest

from finetune.training.metrics import read_metrics, run_history
from tests.agent_tools import tool_happy_model

FP32_NOISE = 1e-4


def test_tools_with_the_vllm_engine(launch, tmp_path_factory):
    model = tool_happy_model(tmp_path_factory.mktemp("tool-happy-h64"), base="tiny-llama-h64")
    run = launch(2, "strategy=zero3", f"model={model}", "generation_backend=vllm", "max_steps=3", "global_batch_size=4",
                 "num_generations=4", "micro_batch_size=4", "eval_every=0", "eval_at_start=false",
                 "max_tool_calling_iterations=2", "max_completion_len=32", "lr=1e-4", "warmup_steps=0",
                 recipe="tiny_grpo_tools")
    records = [r for r in run_history(read_metrics(run.output_dir / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the engine sampled the drawn tokens from the trainer's weights; the fed ones are not compared
        assert 0 <= r["vllm/logp_diff/mean"] <= r["vllm/logp_diff/max"] < FP32_NOISE, r
        assert r["tools/call_frequency"] > 0
    lines = [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert any(0 in r["tool_mask"] for r in lines)
    assert any(t["role"] == "tool" and t["error"] is None and t["content"] == str(r["columns"]["a"] * r["columns"]["b"])
               for r in lines for t in r["turns"])
    assert records[0]["completions/mean_length"] == pytest.approx(
        sum(sum(r["tool_mask"]) for r in lines if r["step"] == 1) / 16)
