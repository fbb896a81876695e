"""DPO as real launches (CPU, gloo, fp32) on the tiny model and builtin:tiny-preferences: every strategy's
2-process curve (loss, TRL's rewards/logps metrics, the eval's) equals the 1-process run's, with each kind
of reference: a frozen copy sharded by FSDP2 or partitioned by ZeRO-3, the adapter-disabled policy (LoRA,
QLoRA), precomputed log-probs (zero2, reused by a resume on 1 process), none (SimPO under ddp). A SIGKILLed
zero3 run resumes bit for bit (its reference rebuilt from the model); final/ loads with transformers (peft
for adapters); the tiny_dpo recipe learns (eval reward accuracy well above 0.5).

Under sequence parallelism (each pair's sequences split across 2 ranks, their log-probs summed over the
SP group): 2 processes with SP 2 under fsdp (a frozen reference sharded by FSDP2), under zero2 with the
reference precomputed under SP (equal to the whole pairs' file), QLoRA under zero3 (the adapter-disabled
reference), and 4 processes as SP 2 x data parallel 2 under zero3 (the frozen reference partitioned),
each equal to 1 process on whole pairs; a SIGKILLed SP run resumes bit for bit."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import once
from suite_runs import resume_copy

DPO = ["max_steps=6", "eval_every=3", "eval_max_samples=16", "sample_prompts=0", "save_every=3", "keep_last=3",
       "warmup_steps=1"]
LORA = ["lora=true", "lr=1e-2", "lora_dropout=0"]  # dropout draws differ with the process count
ONE_PROCESS = {  # the 1-process curves the 2-process runs must reproduce
    "full": ["strategy=ddp"],
    "lora": ["strategy=ddp", *LORA],
    "qlora": ["strategy=ddp", *LORA, "load_in_4bit=true"],
    "simpo": ["strategy=ddp", "dpo_loss=simpo", "dpo_beta=2.0"],
}
TWO_PROCESSES = {  # name: (its 1-process curve, overrides)
    "fsdp": ("full", ["strategy=fsdp"]),
    "zero3": ("full", ["strategy=zero3"]),
    "lora_fsdp": ("lora", ["strategy=fsdp", *LORA]),
    "qlora_fsdp": ("qlora", ["strategy=fsdp", *LORA, "load_in_4bit=true"]),
    "precompute_zero2": ("full", ["strategy=zero2", "precompute_reference=true"]),
    "simpo_ddp": ("simpo", ["strategy=ddp", "dpo_loss=simpo", "dpo_beta=2.0"]),
    "sp2_fsdp": ("full", ["strategy=fsdp", "sequence_parallel=2"]),
    "sp2_precompute_zero2": ("full", ["strategy=zero2", "sequence_parallel=2", "precompute_reference=true"]),
    "sp2_qlora_zero3": ("qlora", ["strategy=zero3", "sequence_parallel=2", *LORA, "load_in_4bit=true"]),
}
# Runs that precompute the reference in a datasets cache of their own: the file is keyed by the model and
# data, not by how the processes split the pairs, so a run in the shared cache would read another's.
OWN_CACHE = ("sp2_precompute_zero2",)
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
# fp32. The loss is held to 1e-6 (measured: up to 7.9e-7 between 2 processes and 1). The rewards and logps are
# sums of ~25 token log-probs (about -27 here); another split of the batch moves such a sum by about one fp32
# epsilon of its size (3e-6), so they are held to 4 epsilons of the record's largest log-prob sum (measured:
# 1.4e-6 in rewards/margins). Where chosen and rejected rewards agree within that (the policy still equal to
# a precomputed reference), which side is strictly ahead is noise, so rewards/accuracies is not compared.
ATOL, RTOL = 1e-6, 1e-7
SUM_EPSILONS = 4


def sum_tolerance(record: dict) -> float:
    scale = max(abs(v) for k, v in record.items() if "logps/" in k)
    return SUM_EPSILONS * torch.finfo(torch.float32).eps * scale


def assert_close(x: dict, y: dict, rtol: float = RTOL):
    """Record x equals record y within the tolerances above."""
    for key in x:
        plain = key.removeprefix("eval_")
        if plain == "rewards/accuracies" and abs(y[key.replace("accuracies", "margins")]) <= sum_tolerance(y):
            continue
        atol = ATOL if plain in ("step", "loss", "rewards/accuracies") else max(ATOL, sum_tolerance(y))
        assert math.isclose(x[key], y[key], rel_tol=rtol, abs_tol=atol), (key, atol, x, y)


@pytest.fixture(scope="module")
def dpo_run(launch, tmp_path_factory):
    def run(name: str, nprocs: int):
        overrides = ONE_PROCESS[name] if nprocs == 1 else TWO_PROCESSES[name][1]
        env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("datasets"))} if name in OWN_CACHE else None
        return launch(nprocs, *DPO, *overrides, recipe="tiny_dpo", extra_env=env)

    return once(run)


def reference_kind(overrides: list[str]) -> str | None:
    """What the run's log names its reference: build_reference's kinds."""
    if "precompute_reference=true" in overrides:
        return "precomputed"
    if "lora=true" in overrides:
        return "the policy with its adapter disabled"
    return None if "dpo_loss=simpo" in overrides else "a frozen copy"


def curve(run) -> list[dict]:
    keep = METRICS + tuple(f"eval_{m}" for m in ("loss",) + METRICS[1:])
    return [{"step": r["step"], **{k: r[k] for k in keep if k in r}} for r in run.train_records + run.eval_records]


def assert_same_curve(got, want):
    a, b = curve(got), curve(want)
    assert [sorted(r) for r in a] == [sorted(r) for r in b], "the same steps and metrics"
    for x, y in zip(a, b):
        assert_close(x, y)


@pytest.mark.parametrize("name", list(TWO_PROCESSES))
def test_two_processes_equal_one(name, dpo_run):
    one, overrides = TWO_PROCESSES[name]
    got, want = dpo_run(name, 2), dpo_run(one, 1)
    assert_equal_to_one_process(got, want, overrides)


def assert_equal_to_one_process(got, want, overrides):
    records = got.train_records
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(set(METRICS) <= set(r) for r in records), records[0]
    kind = reference_kind(overrides)
    if kind is not None:  # step 1: the policy is the reference
        first = records[0]
        assert abs(first["rewards/chosen"]) < 1e-5 and abs(first["rewards/rejected"]) < 1e-5, first
        if kind != "precomputed":  # computed in the same forward: equal, so never strictly ahead
            assert first["rewards/accuracies"] == 0.0, first
    assert_same_curve(got, want)
    if kind is not None:
        assert f"reference: {kind}" in got.stderr
    else:
        assert "reference:" not in got.stderr  # SimPO holds none
    resolved = json.loads((got.output_dir / "recipe.json").read_text())
    sp = int(next((o.split("=")[1] for o in overrides if o.startswith("sequence_parallel=")), 1))
    assert (resolved["sequence_parallel"], resolved["global_batch_size"]) == (sp, 16)


def test_eval_and_summary_carry_the_metrics(dpo_run):
    run = dpo_run("fsdp", 2)
    evals = run.eval_records
    assert [r["step"] for r in evals] == [0, 3, 6]  # tiny_dpo evaluates at the start too
    assert all(0.0 <= r["eval_rewards/accuracies"] <= 1.0 for r in evals)
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["final_eval_rewards/accuracies"] == evals[-1]["eval_rewards/accuracies"]
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]


@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_reference_never_in_checkpoints_and_final_loads(name, dpo_run):
    from transformers import AutoModelForCausalLM

    run = dpo_run(name, 2)
    checkpoint = run.output_dir / "checkpoints" / "step_000000006"
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    if name == "fsdp":
        assert any(f.startswith("pytorch_model_fsdp_0/") for f in files)
        assert not any(f.startswith("pytorch_model_fsdp_1") for f in files), files  # one model: the policy
    else:
        states = [f for f in files if f.endswith("model_states.pt")]
        assert sorted(states) == [f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)], states
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    base = AutoModelForCausalLM.from_pretrained(json.loads((run.output_dir / "recipe.json").read_text())["model"])
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert moved, "final/ holds the trained policy, not the reference"


@pytest.mark.parametrize("name", ["lora_fsdp", "qlora_fsdp"])
def test_adapter_final_loads_with_peft(name, dpo_run):
    from peft import PeftConfig

    run = dpo_run(name, 2)
    config = PeftConfig.from_pretrained(run.output_dir / "final")
    assert config.r == 16 and (run.output_dir / "final" / "adapter_model.safetensors").is_file()


def test_precomputed_reference_is_reused_by_a_resume_on_one_process(dpo_run, launch, tmp_path_factory):
    two = dpo_run("precompute_zero2", 2)
    assert "reference log-probs of every pair computed in" in two.stderr
    out = resume_copy(two, 3, tmp_path_factory)
    resumed = launch(1, *DPO, *TWO_PROCESSES["precompute_zero2"][1], "--resume", "auto", output_dir=out,
                     recipe="tiny_dpo")
    assert "(2 -> 1 processes)" in resumed.stderr
    assert "reference log-probs of every pair computed in" not in resumed.stderr, "read from the cache, not redone"
    # the file the run trained with is named with its sha256 in recipe.json and every checkpoint's manifest
    recorded = json.loads((two.output_dir / "recipe.json").read_text())["reference_logps"]
    assert hashlib.sha256(Path(recorded["path"]).read_bytes()).hexdigest() == recorded["sha256"]
    for run in (two, resumed):
        for manifest in (run.output_dir / "checkpoints").glob("step_*/manifest.json"):
            assert json.loads(manifest.read_text())["reference_logps"] == recorded, manifest
    got = curve(resumed)
    want = [r for r in curve(two) if r["step"] > 3]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for x, y in zip(got, want):
        assert_close(x, y, rtol=1e-5)


@pytest.mark.parametrize("damage", ["gone", "rewritten"])
def test_precomputed_reference_gone_or_rewritten_at_resume_is_one_line(damage, dpo_run, launch, tmp_path_factory):
    """The file the checkpoint names, moved away or rewritten at the same size with other values (a resume
    that trained on it would silently have another reference), is one line naming it."""
    two = dpo_run("precompute_zero2", 2)
    out = resume_copy(two, 3, tmp_path_factory)
    # the file the run recorded, in the run's cache (which every pytest-xdist worker of the run shares: another
    # worker's reference log-probs are left alone)
    files = [Path(json.loads((two.output_dir / "recipe.json").read_text())["reference_logps"]["path"])]
    saved = {path: path.read_bytes() for path in files}
    for path, raw in saved.items():
        if damage == "gone":
            path.unlink()
        else:  # one digit of a log-prob changed: the same size, still valid JSON
            at = raw.index(b"\n") + next(i for i, c in enumerate(raw[raw.index(b"\n"):]) if chr(c) in "12345678")
            path.write_bytes(raw[:at] + (b"9" if raw[at:at + 1] != b"9" else b"1") + raw[at + 1:])
            assert path.stat().st_size == len(raw)
    try:
        run = launch(1, *DPO, *TWO_PROCESSES["precompute_zero2"][1], "--resume", "auto", output_dir=out,
                     recipe="tiny_dpo", check=False)
    finally:
        for path, raw in saved.items():
            path.write_bytes(raw)
    assert files
    assert run.returncode == 2, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "precompute_reference=true" in lines[0], run.stderr[-2000:]
    recorded = json.loads((two.output_dir / "recipe.json").read_text())["reference_logps"]
    if damage == "gone":
        assert f"({recorded['path']}, sha256 {recorded['sha256'][:16]}...) are in none of" in lines[0], lines[0]
    else:
        assert f"{recorded['path']} is not the reference log-probs file this run was trained with" in lines[0]
    assert "restore" in lines[0] and "resume with precompute_reference=false" in lines[0]


def test_a_resume_that_reads_the_model_again_refuses_a_changed_model(dpo_run, run_in_process, tmp_path_factory):
    """The zero3 run's checkpoint names its model's identity (the weights' xxh3); resumed from weights other
    than those (here: the manifest says the run started from others), its frozen reference would be read
    from the new ones: one line, unless --allow-model-change."""
    from finetune.checkpointing.identity import model_identity

    run = dpo_run("zero3", 2)
    model = json.loads((run.output_dir / "recipe.json").read_text())["model"]
    out = resume_copy(run, 3, tmp_path_factory)
    manifest_path = out / "checkpoints" / "step_000000003" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["model_identity"] == model_identity(model)
    manifest["model_identity"]["files"]["model.safetensors"] = "0" * 32
    manifest_path.write_text(json.dumps(manifest))
    args = (*DPO, "strategy=zero3", "--resume", "auto", "--dry-run")
    refused = run_in_process(*args, output_dir=out, recipe="tiny_dpo")
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert "model.safetensors changed" in lines[0] and "the DPO reference" in lines[0], lines[0]
    assert "--allow-model-change" in lines[0]
    allowed = run_in_process(*args, "--allow-model-change", output_dir=out, recipe="tiny_dpo")
    assert allowed.returncode == 0, allowed.stderr[-2000:]


def test_sigkill_and_exact_resume_zero3(dpo_run, launch, tmp_path_factory):
    reference = dpo_run("zero3", 2)
    out = tmp_path_factory.mktemp("dpo-fault")
    first = launch(2, *DPO, "strategy=zero3", output_dir=out, check=False, recipe="tiny_dpo",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0
    second = launch(2, *DPO, "strategy=zero3", "--resume", "auto", output_dir=out, recipe="tiny_dpo")
    assert "at step 3" in second.stderr
    assert curve(second) == curve(reference), "the resumed run logs exactly what the uninterrupted one did"
    from safetensors.torch import load_file

    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(
        str(reference.output_dir / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_dpo_recipe_learns(launch, tmp_path_factory):
    """The recipe as a user runs it (2 processes, ZeRO-3 with its frozen reference, its hyper-parameters,
    data and samples at every eval), shortened to 20 steps (its cosine schedule with them) with an eval
    at step 10 as well: samples at the start and mid-run, then training goes on, the pattern of the
    recipe's 60 steps (samples at 0, 20, 40). It crashed at the first step after the mid-run samples
    (DeepSpeed's "tracing error at step 0" in the reference's forward: Zero.whole_weights). The eval's
    reward accuracy climbs well above chance."""
    out = tmp_path_factory.mktemp("tiny-dpo")
    run = launch(2, "max_steps=20", "eval_every=10", "eval_max_samples=64", "log_every=10", "warmup_steps=5",
                 "global_batch_size=32", "micro_batch_size=8", "loss_chunk_tokens=0", output_dir=out,
                 recipe="tiny_dpo")
    assert "reference: a frozen copy" in run.stderr and "zero3 on 2" in run.stderr
    evals = run.eval_records
    assert [r["step"] for r in evals] == [0, 10, 20]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 3 + [10] * 3 + [20] * 3  # the recipe's sample_prompts=3
    assert all(s["tokens"] >= 1 for s in samples)
    assert evals[0]["eval_rewards/accuracies"] == 0.0  # the policy is the reference at step 0
    assert evals[-1]["eval_rewards/accuracies"] >= 0.8, evals
    assert evals[-1]["eval_loss"] < math.log(2) - 0.1, evals


# ---------------------------------------------------------------- sequence parallelism


def test_reference_precomputed_under_sp_equals_the_whole_pairs_one(dpo_run):
    """The SP run computed its own file (its own datasets cache) and it holds the whole pairs' log-probs
    of every train and eval pair, as the file 2 processes without SP wrote."""
    sp, whole = dpo_run("sp2_precompute_zero2", 2), dpo_run("precompute_zero2", 2)
    files = []
    for run in (sp, whole):
        line = next(x for x in run.stderr.splitlines() if "reference log-probs of every pair computed in" in x)
        header, _, body = open(line.rsplit(": ", 1)[1]).read().partition("\n")  # finetune/training/reference.py's layout
        files.append(json.loads(body))
    assert files[0].keys() == files[1].keys() == {"train", "eval"}
    for split in ("train", "eval"):
        got, want = torch.tensor(files[0][split]), torch.tensor(files[1][split])
        assert got.shape == want.shape and got.shape[0] > 100
        tolerance = SUM_EPSILONS * torch.finfo(torch.float32).eps * want.abs()
        assert ((got - want).abs() <= tolerance).all(), (split, (got - want).abs().max())


def test_sp2_by_dp2_on_four_processes_equals_one(dpo_run, launch):
    """4 processes: SP groups [0, 1] and [2, 3], 2 data-parallel ranks reading their own pairs, the
    frozen reference partitioned by ZeRO-3 over the 4 (about 2 minutes on 2 loaded cores)."""
    overrides = ["strategy=zero3", "sequence_parallel=2"]
    run = launch(4, *DPO, *overrides, recipe="tiny_dpo")
    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    assert (resolved["world_size"], resolved["grad_accum"]) == (4, 2)
    assert_equal_to_one_process(run, dpo_run("full", 1), overrides)


def test_sigkill_and_exact_resume_under_sp(dpo_run, launch, tmp_path_factory):
    reference = dpo_run("sp2_fsdp", 2)
    overrides = TWO_PROCESSES["sp2_fsdp"][1]
    out = tmp_path_factory.mktemp("dpo-sp-fault")
    first = launch(2, *DPO, *overrides, output_dir=out, check=False, recipe="tiny_dpo",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0, "a killed rank must fail the launch"
    second = launch(2, *DPO, *overrides, "--resume", "auto", output_dir=out, recipe="tiny_dpo")
    assert f"resumed from {out / 'checkpoints' / 'step_000000003'} at step 3" in second.stderr
    assert curve(second) == curve(reference), "the resumed SP run logs exactly what the uninterrupted one did"
    from safetensors.torch import load_file

    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(
        str(reference.output_dir / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_hybrid_2x2_on_four_processes_equals_one(dpo_run, launch, tmp_path_factory):
    """hsdp over 2 nodes x 2 (4 processes: the model and its frozen reference sharded within [0, 1] and
    [2, 3], replicated across): the 1-process curve within 1e-6, and the planner's bytes per step within
    10% of the collectives counted (tests/distributed/layouts.py)."""
    from layouts import HYBRID, assert_planner_matches, counting

    counts = counting(tmp_path_factory)
    run = launch(4, *DPO, *HYBRID, recipe="tiny_dpo", extra_env=counts)
    assert "hsdp (2 replicas, each sharded over 2 GPUs) on 4 cpu process(es)" in run.stderr
    assert_equal_to_one_process(run, dpo_run("full", 1), HYBRID)
    assert_planner_matches(run, counts, "tiny_dpo", [*DPO, *HYBRID], steps=range(1, 7))
