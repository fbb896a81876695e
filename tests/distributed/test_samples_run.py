"""Samples at eval on 2 real processes equal `finetune chat` on the exported final/ (greedy, fp32, token
for token): ZeRO-3 and FSDP2 generate with their weights gathered once per eval, chat loads final/ as a
plain model (or base + adapter) in one process. Asserts on the suite's existing launches."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO


def _samples(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()]


ALPACA = re.compile(r"<s>### Instruction:\n(.*)\n\n### Input:\n(.*)\n\n### Response:\n", re.S)


def _chat(run, path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """`finetune chat PATH INSTRUCTION --input INPUT` as a user asks (the run's alpaca format is found in
    its recipe.json), once per prompt of samples.jsonl (its prompt is the rendered alpaca prompt)."""
    answers = []
    for prompt in prompts:
        instruction, input = ALPACA.fullmatch(prompt).groups()
        proc = subprocess.run([sys.executable, "-m", "finetune.cli", "chat", str(path), instruction, "--input", input,
                               "--max-new-tokens", str(max_new_tokens)], cwd=REPO, env=run.env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answers.append(proc.stdout.removesuffix("\n"))
    return answers


def assert_samples_equal_chat(run, path=None):
    samples = _samples(run)
    recipe = json.loads((run.output_dir / "recipe.json").read_text())
    steps = sorted({s["step"] for s in samples})
    assert steps == [0, 6, 12]  # eval_at_start, eval_every=6, the end
    last = [s for s in samples if s["step"] == 12]
    assert len(last) == recipe["sample_prompts"] == 3
    assert all(s["reference"] and ALPACA.fullmatch(s["prompt"]) for s in last)
    first = [s["generated"] for s in samples if s["step"] == 0]
    assert first != [s["generated"] for s in last]  # training changed the answers
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["samples"] == last
    assert "step 12: sample (3 in" in run.stderr
    chat = _chat(run, path or run.output_dir / "final", [s["prompt"] for s in last], recipe["sample_max_new_tokens"])
    assert chat == [s["generated"] for s in last]
    assert any(chat)  # not all empty answers: the comparison compared tokens


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_samples_equal_chat_on_final(name, strategy_run):
    assert_samples_equal_chat(strategy_run(name))


def test_samples_equal_chat_on_checkpoint(strategy_run):
    """A checkpoint is rebuilt in memory (the export path) and answers like final/ of the same step."""
    run = strategy_run("zero3")
    assert_samples_equal_chat(run, run.output_dir / "checkpoints" / "step_000000012")


def test_more_samples_than_eval_rows_is_one_line(launch):
    run = launch(1, "strategy=ddp", "sample_prompts=40", check=False)  # eval_max_samples=32
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and lines == [
        "error: sample_prompts=40 is more than the 32 eval rows (eval_max_samples); lower sample_prompts "
        "(0: no samples)"], run.stderr[-2000:]
    assert not (run.output_dir / "checkpoints").exists()
