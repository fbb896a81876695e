"""Samples at eval on 2 real processes equal `finetune chat` on the exported final/ (greedy, fp32, token
for token): ZeRO-3 (with its parameters and optimizer offloaded) and FSDP2 generate with their weights
gathered once per eval, FSDP2 also with LoRA; chat loads final/ as a plain model (or base + adapter)
in one process. A low learning rate and 4 steps: the answers at the end differ from step 0's but are
not yet the empty answers a few steps at the recipe's rate give (an empty answer compares one token).
The ZeRO-3 run is the session's WATCHED run (conftest.py; test_run_experience checks its trackers,
plot and summary), launched through `finetune train` with an eval every 2 steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, once

SAMPLES = ["max_steps=4", "warmup_steps=1", "sample_max_new_tokens=16"]
RUNS = {
    "fsdp": ["strategy=fsdp", "lr=1e-4"],
    "fsdp_lora": ["strategy=fsdp", "lora=true", "lr=3e-4"],
}
# the directories of output_dir besides checkpoints/ and final/ (the WATCHED run's tensorboard logs)
TRACKER_DIRS = {"zero3_offload": ["finetune"]}


@pytest.fixture(scope="module")
def sample_run(launch, watched_run):
    return once(lambda name: watched_run if name == "zero3_offload" else launch(2, *RUNS[name], *SAMPLES))


def _samples(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()]


ALPACA = re.compile(r"<s>### Instruction:\n(.*)\n\n### Input:\n(.*)\n\n### Response:\n", re.S)


def _chat(run, path, prompts: list[str], max_new_tokens: int, chat_in_process) -> list[str]:
    """`finetune chat PATH INSTRUCTION --input INPUT` as a user asks (the run's alpaca format is found in
    its recipe.json), once per prompt of samples.jsonl (its prompt is the rendered alpaca prompt): the
    first as the command itself, in a process of its own with the launches' environment, the others as
    calls of its main in this process (the same loading and generation, without an interpreter and
    torch's import per prompt)."""
    answers = []
    for i, prompt in enumerate(prompts):
        instruction, input = ALPACA.fullmatch(prompt).groups()
        argv = [str(path), instruction, "--input", input, "--max-new-tokens", str(max_new_tokens)]
        if i == 0:
            proc = subprocess.run([sys.executable, "-m", "finetune.cli", "chat", *argv], cwd=REPO, env=run.env,
                                  capture_output=True, text=True, timeout=300)
        else:
            proc = chat_in_process(*argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answers.append(proc.stdout.removesuffix("\n"))
    return answers


def assert_samples_equal_chat(run, chat_in_process, path=None):
    samples = _samples(run)
    recipe = json.loads((run.output_dir / "recipe.json").read_text())
    steps = sorted({s["step"] for s in samples})
    assert recipe["max_steps"] == 4
    assert steps == [*range(0, 4, recipe["eval_every"]), 4]  # eval_at_start, every eval_every, the end
    last = [s for s in samples if s["step"] == 4]
    assert len(last) == recipe["sample_prompts"] == 3
    assert all(s["reference"] and ALPACA.fullmatch(s["prompt"]) for s in last)
    first = [s["generated"] for s in samples if s["step"] == 0]
    assert first != [s["generated"] for s in last]  # training changed the answers
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["samples"] == last
    assert "step 4: sample (3 in" in run.stderr
    chat = _chat(run, path or run.output_dir / "final", [s["prompt"] for s in last], recipe["sample_max_new_tokens"],
                 chat_in_process)
    assert chat == [s["generated"] for s in last]
    assert any(chat)  # not all empty answers: the comparison compared tokens


@pytest.mark.parametrize("name", ["zero3_offload", *RUNS])
def test_samples_equal_chat_on_final(name, sample_run, chat_in_process):
    assert_samples_equal_chat(sample_run(name), chat_in_process)


@pytest.mark.parametrize("name", ["zero3_offload", "fsdp_lora"])
def test_samples_equal_chat_on_checkpoint(name, sample_run, chat_in_process):
    """A checkpoint is rebuilt in memory (the export path, nothing written) and answers like final/."""
    run = sample_run(name)
    before = sorted(run.output_dir.rglob("*"))
    assert_samples_equal_chat(run, chat_in_process, run.output_dir / "checkpoints" / "step_000000004")
    assert sorted(p.name for p in run.output_dir.iterdir() if p.is_dir()) == \
        sorted(["checkpoints", "final", *TRACKER_DIRS.get(name, [])])
    assert sorted(run.output_dir.rglob("*")) == before  # nothing written anywhere


@pytest.mark.parametrize("name", ["fsdp", "fsdp_lora"])
def test_chat_on_an_export_answers_as_on_final(name, sample_run, export_in_process, chat_in_process, tmp_path):
    """`finetune export` of the last checkpoint, away from the run's output_dir: chat on it without
    --max-new-tokens or --format answers as chat on final/ does, and as the run's last samples (an export
    carried no recipe.json, and chat fell back to the chat template and 256 tokens)."""
    run = sample_run(name)
    exported = export_in_process(run.output_dir / "checkpoints" / "step_000000004", tmp_path / "export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    last = [s for s in _samples(run) if s["step"] == 4]
    for sample in last:
        instruction, input = ALPACA.fullmatch(sample["prompt"]).groups()
        answers = []
        for path in (tmp_path / "export", run.output_dir / "final"):
            proc = chat_in_process(path, instruction, "--input", input)
            assert proc.returncode == 0, proc.stderr[-3000:]
            answers.append(proc.stdout.removesuffix("\n"))
        assert answers == [sample["generated"]] * 2, (answers, sample["generated"])
    assert any(s["generated"] for s in last)


def test_more_samples_than_eval_rows_is_one_line(launch):
    run = launch(1, "strategy=ddp", "sample_prompts=40", check=False)  # eval_max_samples=32
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and lines == [
        "error: sample_prompts=40 is more than the 32 eval rows (eval_max_samples); lower sample_prompts "
        "(0: no samples)"], run.stderr[-2000:]
    assert not (run.output_dir / "checkpoints").exists()
