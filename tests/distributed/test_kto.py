"""KTO as real launches (CPU, gloo, fp32) on the tiny model and builtin:tiny-kto (recipes/tiny_kto.py): the
2-process curves (loss, TRL's rewards/logps metrics, the KL estimate, the eval's) under ddp, zero3 and fsdp (a
frozen reference replicated, partitioned by ZeRO-3, sharded by FSDP2), LoRA under zero3 (the adapter-disabled
reference), precomputed log-probs under zero2 and sequence parallelism 2 under fsdp (each row and KL row
split across the ranks) each equal the 1-process run's; the precomputed run
resumes on 1 process from its step 3 with the same curve; a SIGKILLed zero3 run resumes bit for bit (its
reference rebuilt from the model); the last checkpoint exports to final/'s weights and `finetune chat`
answers as the run's own sample did."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import REPO, once
from suite_runs import resume_copy

KTO = ["max_steps=6", "eval_every=3", "eval_max_samples=16", "sample_prompts=1", "save_every=3", "keep_last=3",
       "warmup_steps=1", "micro_batch_size=4"]
LORA = ["lora=true", "lr=1e-2", "lora_dropout=0"]  # dropout draws differ with the process count
ONE_PROCESS = {"full": ["strategy=ddp"], "lora": ["strategy=ddp", *LORA]}
TWO_PROCESSES = {  # name: (its 1-process curve, overrides)
    "ddp": ("full", ["strategy=ddp"]),
    "zero3": ("full", ["strategy=zero3"]),
    "fsdp": ("full", ["strategy=fsdp"]),
    "lora_zero3": ("lora", ["strategy=zero3", *LORA]),
    "precompute_zero2": ("full", ["strategy=zero2", "precompute_reference=true"]),
    "sp2_fsdp": ("full", ["strategy=fsdp", "sequence_parallel=2"]),  # each row split across the 2 ranks
}
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
# fp32, as tests/distributed/test_dpo.py holds DPO: the loss to 1e-6; the rewards, logps and KL are sums of
# ~25 token log-probs (about -27 here), held to 4 fp32 epsilons of the record's largest log-prob sum.
ATOL, RTOL = 1e-6, 1e-7
SUM_EPSILONS = 4


@pytest.fixture(scope="module")
def kto_run(launch):
    def run(name: str, nprocs: int):
        overrides = ONE_PROCESS[name] if nprocs == 1 else TWO_PROCESSES[name][1]
        return launch(nprocs, *KTO, *overrides, recipe="tiny_kto")

    return once(run)


def curve(run) -> list[dict]:
    keep = METRICS + tuple(f"eval_{m}" for m in METRICS)
    return [{"step": r["step"], **{k: r[k] for k in keep if k in r}} for r in run.train_records + run.eval_records]


def assert_close(x: dict, y: dict, rtol: float = RTOL):
    scale = max(abs(v) for k, v in y.items() if "logps/" in k)
    for key in x:
        atol = ATOL if key in ("step", "loss", "eval_loss") else max(ATOL, SUM_EPSILONS * 1.2e-7 * scale)
        assert math.isclose(x[key], y[key], rel_tol=rtol, abs_tol=atol), (key, atol, x, y)


def assert_same_curve(got: list[dict], want: list[dict], rtol: float = RTOL):
    assert [sorted(r) for r in got] == [sorted(r) for r in want], "the same steps and metrics"
    for x, y in zip(got, want):
        assert_close(x, y, rtol)


@pytest.mark.parametrize("name", list(TWO_PROCESSES))
def test_two_processes_equal_one(name, kto_run):
    one, overrides = TWO_PROCESSES[name]
    got, want = kto_run(name, 2), kto_run(one, 1)
    records = got.train_records
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(set(METRICS) <= set(r) for r in records), records[0]
    first = records[0]  # step 1: the policy is the reference, the KL estimate and the rewards 0
    assert abs(first["rewards/chosen"]) < 1e-5 and abs(first["rewards/rejected"]) < 1e-5 and first["kl"] < 1e-5
    assert abs(first["loss"] - 0.5) < 1e-5, first  # 1 - sigmoid(0) for every row, weights 1
    assert_same_curve(curve(got), curve(want))
    kind = {"lora_zero3": "the policy with its adapter disabled", "precompute_zero2": "precomputed"}.get(
        name, "a frozen copy")
    assert f"reference: {kind}" in got.stderr
    resolved = json.loads((got.output_dir / "recipe.json").read_text())
    assert (resolved["objective"], resolved["global_batch_size"]) == ("kto", 16)


def test_the_curves_move_and_the_summary_carries_them(kto_run):
    run = kto_run("zero3", 2)
    last = run.train_records[-1]
    assert last["rewards/chosen"] > 0 > last["rewards/rejected"] and last["kl"] >= 0, last
    evals = run.eval_records
    assert [r["step"] for r in evals] == [0, 3, 6]  # tiny_kto evaluates at the start too
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"], evals
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["final_eval_kl"] == evals[-1]["eval_kl"]


def test_precomputed_reference_resumes_on_one_process(kto_run, launch, tmp_path_factory):
    two = kto_run("precompute_zero2", 2)
    assert "reference log-probs of every pair computed in" in two.stderr
    out = resume_copy(two, 3, tmp_path_factory)
    resumed = launch(1, *KTO, *TWO_PROCESSES["precompute_zero2"][1], "--resume", "auto", output_dir=out,
                     recipe="tiny_kto")
    assert "(2 -> 1 processes)" in resumed.stderr
    assert "reference log-probs of every pair computed in" not in resumed.stderr, "read, not computed again"
    got, want = curve(resumed), [r for r in curve(two) if r["step"] > 3]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert_same_curve(got, want, rtol=1e-5)


def test_sigkill_and_exact_resume_zero3(kto_run, launch, tmp_path_factory):
    reference = kto_run("zero3", 2)
    out = tmp_path_factory.mktemp("kto-fault")
    first = launch(2, *KTO, "strategy=zero3", output_dir=out, check=False, recipe="tiny_kto",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0
    second = launch(2, *KTO, "strategy=zero3", "--resume", "auto", output_dir=out, recipe="tiny_kto")
    assert "at step 3" in second.stderr
    assert curve(second) == curve(reference), "the resumed run logs exactly what the uninterrupted one did"
    from safetensors.torch import load_file

    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(
        str(reference.output_dir / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_and_chat_answer_as_the_run_sampled(kto_run, export_in_process, tmp_path):
    run = kto_run("fsdp", 2)
    exported = export_in_process(run.output_dir / "checkpoints" / "step_000000006", tmp_path / "exported")
    assert exported.returncode == 0, exported.stderr[-3000:]
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "exported" / "model.safetensors")), load_file(
        str(run.output_dir / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    sample = [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()][-1]
    assert sample["step"] == 6
    prompt = sample["prompt"].removeprefix("<s>")  # the prompt row as the data has it (its BOS is the tokenizer's)
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "chat", str(run.output_dir / "final"), prompt,
                           "--max-new-tokens", "8"], cwd=REPO, env=run.env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.removesuffix("\n") == sample["generated"]
