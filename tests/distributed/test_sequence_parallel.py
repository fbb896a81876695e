"""Ulysses sequence parallelism (finetune/sequence_parallel.py), launched for real: 2 processes with
sequence_parallel=2 (each row split in two, DeepSpeed's all-to-all attention, data parallel of one)
train the same global batches as 1 process on whole rows and log the same losses to fp32 round-off,
under zero3 and fsdp, and so do 4 processes as SP 2 x data parallel 2; a SIGKILLed SP run resumes
bit for bit; an SP checkpoint continues without SP on 1 process; final/ and an export load with plain
transformers and give the logged eval loss; LoRA under SP 2 trains the 1-process LoRA curve (DPO and
QLoRA under SP: tests/distributed/test_dpo.py).

One launch per strategy serves the curve, final/ and export asserts; the 1-process runs are the
suite's shared ones (strategy_run(name, nprocs=1), test_strategies and test_checkpoint use them too)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import once
from suite_runs import SAVE, resume_copy
from test_checkpoint import assert_close_after, assert_same_weights, records
from test_strategies import final_eval_loss

SP2 = ["sequence_parallel=2"]
# 1 process on whole rows and 2 with SP 2 sum each token's loss in another order (per shard, then over
# ranks): measured within 3e-7 over the 12 steps
SP_RTOL = 1e-5


@pytest.fixture(scope="module")
def sp_run(launch):
    return once(lambda strategy: launch(2, f"strategy={strategy}", *SP2, *SAVE))


def assert_same_curve(run, reference, rtol=SP_RTOL):
    got, want = records(run), records(reference)
    assert [(r[0], r[3]) for r in got] == [(r[0], r[3]) for r in want], "same steps, same global batches (tokens)"
    assert [r["step"] for r in run.train_records] == list(range(1, 13))
    for g, w in zip(got, want):
        for a, b in ((g[1], w[1]), (g[2], w[2])):
            assert (a is None) == (b is None)
            if a is not None:
                assert math.isclose(a, b, rel_tol=rtol, abs_tol=0), (got, want)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_two_processes_with_sp2_equal_one_process(strategy, sp_run, strategy_run, monkeypatch):
    run, reference = sp_run(strategy), strategy_run(strategy, nprocs=1)
    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    assert (resolved["sequence_parallel"], resolved["world_size"], resolved["grad_accum"],
            resolved["global_batch_size"]) == (2, 2, 4, 16), \
        "SP ranks share rows: 2 processes with SP 2 are one data-parallel rank, accumulating 4 micro-batches"
    assert_same_curve(run, reference)
    assert run.losses[-1] < run.losses[0]
    # final/ loads with plain transformers and, on whole rows without SP, gives the eval loss the run logged
    logged = run.eval_records[-1]["eval_loss"]
    assert math.isclose(final_eval_loss(run, monkeypatch), logged, rel_tol=1e-5)


def test_four_processes_sp2_by_dp2_equal_one_process(launch, strategy_run):
    """4 processes: 2 SP groups of 2 ([0, 1] and [2, 3]), 2 data-parallel ranks, each reading its own rows
    (about 2 minutes on 2 loaded cores)."""
    run = launch(4, "strategy=zero3", *SP2)
    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    assert (resolved["world_size"], resolved["grad_accum"], resolved["global_batch_size"]) == (4, 2, 16)
    assert_same_curve(run, strategy_run("zero3", nprocs=1))


def test_export_of_sp_checkpoint_equals_final(sp_run, export_in_process, tmp_path):
    run = sp_run("zero3")
    out = tmp_path / "exported"
    proc = export_in_process(run.output_dir / "checkpoints" / "step_000000012", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe logits identical" in proc.stdout
    assert_same_weights(out, run.output_dir / "final")


def test_sigkilled_sp_run_resumes_exactly(sp_run, launch, tmp_path_factory):
    reference = sp_run("fsdp")
    out = tmp_path_factory.mktemp("sp-fault")
    first = launch(2, "strategy=fsdp", *SP2, *SAVE, output_dir=out, check=False,
                   extra_env={"FINETUNE_FAULT": "after_step:1:7"})
    assert first.returncode != 0, "a killed rank must fail the launch"
    assert "step_000000005" in sorted(p.name for p in (out / "checkpoints").iterdir())
    second = launch(2, "strategy=fsdp", *SP2, *SAVE, "--resume", "auto", output_dir=out)
    assert f"resumed from {out / 'checkpoints' / 'step_000000005'} at step 5" in second.stderr
    assert records(second) == records(reference), "a resumed SP run must log exactly what the uninterrupted one did"
    assert_same_weights(out / "final", reference.output_dir / "final")


def test_sp2_checkpoint_continues_on_one_process_without_sp(sp_run, launch, tmp_path_factory):
    """zero3: 2 processes -> 1 goes through DeepSpeed's universal conversion; the rows of each global
    batch are the same (one data-parallel rank before and after), so the curve goes on."""
    reference = sp_run("zero3")
    out = resume_copy(reference, 5, tmp_path_factory)
    resumed = launch(1, "strategy=zero3", "sequence_parallel=1", *SAVE, "--resume", "auto", output_dir=out)
    assert "(2 -> 1 processes)" in resumed.stderr
    assert "resume: sequence_parallel: 2 -> 1" in resumed.stderr
    resolved = json.loads((out / "recipe.json").read_text())
    assert (resolved["world_size"], resolved["sequence_parallel"], resolved["global_batch_size"]) == (1, 1, 16)
    assert_close_after(resumed, reference, 5)


def test_tiled_mlp_checkpointing_and_offload_under_zero3_equal_plain(launch, strategy_run):
    """tiled_mlp=true (DeepSpeed's TiledMLP on each MLP, ceil(tokens / hidden) slices: 2 on the tiny
    model's micro-batches of up to 128 tokens, hidden 64) with activation checkpointing and
    activation_offload (each layer's checkpointed input copied to CPU memory and back,
    finetune/offload.py) trains the suite's zero3 curve: ZeRO-3 gathers the MLP's weights again for
    each slice's recomputed forward in the backward, and every tensor comes back as it was saved."""
    run = launch(2, "strategy=zero3", "tiled_mlp=true", "activation_checkpointing=true", "activation_offload=true",
                 *SAVE)
    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    assert (resolved["tiled_mlp"], resolved["activation_checkpointing"], resolved["activation_offload"]) == \
        (True, True, True)
    assert_same_curve(run, strategy_run("zero3"), rtol=1e-6)


def test_lora_under_sp2_equals_one_process(launch):
    """LoRA SFT (no dropout: its draws follow the tensors' shapes, a shard's are not the whole row's)
    with SP 2 under fsdp trains the 1-process curve, and final/ is an adapter peft loads."""
    from peft import PeftConfig

    lora = ["lora=true", "lora_dropout=0", "lr=1e-2"]
    run, reference = launch(2, "strategy=fsdp", *SP2, *lora), launch(1, "strategy=ddp", *lora)
    assert_same_curve(run, reference)
    assert run.losses[-1] < run.losses[0] - 0.1, run.losses
    assert PeftConfig.from_pretrained(run.output_dir / "final").r == 16
