"""objective=distill on real launches (recipes/tiny_distill.py shortened; the teacher the builtin tiny Llama's
wider sibling, builtin:tiny-llama-h64, with its vocabulary): 4 steps of lmbda=0.5, on-policy at steps 1 and
4 (the student's own completions, sampled at temperature 0.7) and off-policy at steps 2 and 3 (the dataset's
completions), under the JSD (distill_beta=0.5), evaluated at steps 0, 2 and 4. 2 processes under ZeRO-3
(the teacher partitioned) and FSDP (the teacher sharded) train as 1 process does (loss and metrics within
1e-5), also with a LoRA student under FSDP; a 2-process ZeRO-3 run SIGKILLed after step 3 and resumed from step 2's checkpoint logs exactly what
the uninterrupted one did, and resumed on 1 process what it did within 1e-5 (and with another teacher is
refused in one line); the checkpoint exports to the weights of final/, which `finetune chat` answers from."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune.training.metrics import read_metrics, run_history

DISTILL = ["teacher_model=builtin:tiny-llama-h64", "max_steps=4", "lmbda=0.5", "distill_beta=0.5",
           "temperature=0.7", "max_completion_len=8", "save_every=2", "keep_last=3", "eval_every=2",
           "eval_at_start=true", "eval_max_samples=16", "log_every=1"]
TIMING = ("tokens_per_s", "peak_memory_gib", "step_seconds", "mfu")


def records(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("tokens_per")}
            for r in run_history(read_metrics(run.output_dir / "metrics.jsonl")) if "loss" in r or "eval_loss" in r]


def assert_same(got, want, steps=(0, 1, 2, 2, 3, 4, 4), tolerance=1e-5):
    """The two runs' records (train and eval, in `steps`) with the same keys and values within tolerance."""
    a, b = records(got), records(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(steps)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if isinstance(v, float):
                assert v == pytest.approx(y[k], abs=tolerance, rel=tolerance), (x["step"], k, v, y[k])


@pytest.fixture(scope="module")
def distill_run(launch):
    runs = {}

    def get(strategy: str, nprocs: int, *extra: str):
        if (strategy, nprocs, extra) not in runs:
            runs[strategy, nprocs, extra] = launch(nprocs, f"strategy={strategy}", *DISTILL, *extra,
                                                   recipe="tiny_distill")
        return runs[strategy, nprocs, extra]

    return get


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_two_processes_train_as_one(distill_run, strategy):
    one, two = distill_run("ddp", 1), distill_run(strategy, 2)
    assert f"{strategy} on 2" in two.stderr and "teacher: builtin:tiny-llama-h64" in two.stderr
    assert_same(two, one)
    train = [r for r in records(one) if "loss" in r]
    assert [r["on_policy"] for r in train] == [1.0, 0.0, 0.0, 1.0]
    # the student's completions are at most max_completion_len tokens
    assert all(0 < r["completions/mean_length"] <= 8 for r in (train[0], train[3]))
    assert all(r["loss"] > 0 and 0 <= r["teacher_agreement"] <= 1 and r["entropy"] > 0 for r in train)
    evals = [r for r in records(one) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals[2]["eval_loss"] < evals[0]["eval_loss"], "the student moved towards the teacher"
    assert all(r["eval_on_policy"] == 0.0 for r in evals), "the eval scores the dataset's completions"


def test_lora_student_under_fsdp(distill_run):
    """A LoRA student (the teacher a separate frozen model, sharded by FSDP2): 2 processes train as 1, and the
    adapter alone moves towards the teacher."""
    lora = ("lora=true", "lora_r=8", "lora_dropout=0", "lr=1e-2")  # no dropout: its masks differ by process count
    one, two = distill_run("ddp", 1, *lora), distill_run("fsdp", 2, *lora)
    assert "fsdp on 2" in two.stderr
    assert_same(two, one)
    evals = [r for r in records(one) if "eval_loss" in r]
    assert evals[2]["eval_loss"] < evals[0]["eval_loss"]
    assert (two.output_dir / "final" / "adapter_model.safetensors").is_file(), "the student's adapter, as any LoRA run's"


@pytest.fixture(scope="module")
def killed_zero3(launch, tmp_path_factory):
    """A 2-process ZeRO-3 run SIGKILLed after step 3 (rank 1), and a copy of its output directory as the kill
    left it (step 2's checkpoint) for a resume on 1 process."""
    out = tmp_path_factory.mktemp("distill-fault")
    first = launch(2, "strategy=zero3", *DISTILL, output_dir=out, check=False, recipe="tiny_distill",
                   extra_env={"FINETUNE_FAULT": "after_step:1:3"})
    assert first.returncode != 0
    snapshot = tmp_path_factory.mktemp("distill-fault-copy") / "run"
    shutil.copytree(out, snapshot)
    return out, snapshot


def test_sigkill_and_exact_resume(distill_run, launch, killed_zero3):
    """Resumed from step 2's checkpoint: step 3 off-policy, step 4 on-policy with the completions the
    uninterrupted run sampled (seeded per step and row): every record bit for bit."""
    want = distill_run("zero3", 2)
    out, _ = killed_zero3
    second = launch(2, "strategy=zero3", *DISTILL, "--resume", "auto", output_dir=out, recipe="tiny_distill")
    assert "at step 2" in second.stderr
    assert records(second) == records(want)


def test_resume_on_one_process(distill_run, launch, killed_zero3, tmp_path_factory):
    want = distill_run("zero3", 2)
    out = tmp_path_factory.mktemp("distill-fault-1proc") / "run"
    shutil.copytree(killed_zero3[1], out)
    resumed = launch(1, "strategy=zero3", *DISTILL, "--resume", "auto", output_dir=out, recipe="tiny_distill")
    assert "at step 2" in resumed.stderr
    assert_same(resumed, want)


def test_resume_with_another_teacher_is_one_line(killed_zero3, launch, tmp_path):
    """The killed run's step-2 checkpoint resumed (1 process) with another teacher (the builtin tiny Llama: one
    vocabulary, other weights) is refused in one line before any model loads: the checkpoint records its
    teacher's identity. A launch: the check is the objective's, in the run itself."""
    out = tmp_path / "run"
    shutil.copytree(killed_zero3[1], out)
    manifest = json.loads((out / "checkpoints" / "step_000000002" / "manifest.json").read_text())
    assert manifest["teacher_identity"]["files"], "the teacher's weight files hashed"
    run = launch(1, "strategy=zero3", *DISTILL, "teacher_model=builtin:tiny-llama", "--resume", "auto",
                 output_dir=out, recipe="tiny_distill", check=False)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-3000:]
    assert "teacher_model=builtin:tiny-llama is not the teacher checkpoint" in errors[0]
    assert "model.safetensors changed" in errors[0]


def test_export_and_chat(distill_run, export_in_process, chat_in_process, tmp_path):
    """The ZeRO-3 run's last checkpoint exports to the weights of its final/; `finetune chat` answers from
    final/ (the student: a plain causal LM, the teacher nowhere in it)."""
    from safetensors.torch import load_file

    run = distill_run("zero3", 2)
    exported = export_in_process(run.output_dir / "checkpoints" / "step_000000004", tmp_path / "exported")
    assert exported.returncode == 0, exported.stderr[-3000:]

    def weights(path):
        return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}

    final, ours = weights(run.output_dir / "final"), weights(tmp_path / "exported")
    assert final.keys() == ours.keys() and all(torch.equal(final[k], ours[k]) for k in final)
    config = json.loads((run.output_dir / "final" / "config.json").read_text())
    assert config["hidden_size"] == 64, "the student's weights, not the teacher's (hidden 128)"
    chat = chat_in_process(run.output_dir / "final", "Reverse the word.", "--input", "cat", "--max-new-tokens", "8")
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr[-3000:]
