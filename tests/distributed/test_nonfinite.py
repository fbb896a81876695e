"""A run that diverges (lr=1e30: the loss is NaN from step 3) on 2 real processes: with
max_nonfinite_steps=2 the loop skips steps 3 and 4 without applying them (a checkpoint at step 4
holds exactly step 2's weights, all finite), then stops at step 5 with one `error:` line naming the
step and the newest good checkpoint; no checkpoint of NaN weights and no final/ are written.
FSDP (the torch path: the loop does not call optimizer.step) and ZeRO-3 (DeepSpeed steps inside
backward and drops a step whose gradient norm is not finite)."""

from __future__ import annotations

import math

import pytest
import torch


def weights(ckpt) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.checkpointing.export import checkpoint_state_dict

    template = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt / "hf")).state_dict()
    return checkpoint_state_dict(ckpt, template)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(strategy, launch, tmp_path):
    out = tmp_path / "out"
    run = launch(2, f"strategy={strategy}", "lr=1e30", "save_every=2", "max_nonfinite_steps=2", output_dir=out,
                 check=False)
    assert run.returncode != 0, "a run that diverged must not count as a success"
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-4000:]
    assert errors[0].startswith("error: step 5: loss nan"), errors[0]
    assert "2 such step(s) were skipped already" in errors[0]
    assert f"the newest checkpoint, {out / 'checkpoints' / 'step_000000004'}, is from before it" in errors[0]
    # no rank crashed (the one traceback left is the launcher's report that its workers exited with 2)
    assert "error: rank" not in run.stderr and run.stderr.count("Traceback") <= 1
    for step, n in ((3, 1), (4, 2)):  # said once (rank 0), not per rank
        assert run.stderr.count(f"step {step}: loss nan") == 1 and f"({n} of max_nonfinite_steps=2)" in run.stderr

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000002", "step_000000004"]
    assert not (out / "final").exists()
    before, after = weights(out / "checkpoints" / "step_000000002"), weights(out / "checkpoints" / "step_000000004")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name}: a skipped step changed the weights"
        assert torch.isfinite(after[name]).all(), name
    losses = {r["step"]: r["loss"] for r in run.train_records}
    assert math.isfinite(losses[2]) and losses[3] is None and losses[4] is None  # NaN: null in metrics.jsonl


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_non_finite_weights_are_never_saved_and_the_advice_runs(strategy, launch, tmp_path):
    """Weights can turn NaN with the loss and gradient norm finite (adam_eps=0 did, before the recipe
    refused it: 0/0 in a row of embed_tokens no token of the batch uses). Here a NaN is written into
    rank 1's part of the weights after step 3 (FINETUNE_FAULT ...:NAN: its FSDP shard of embed_tokens,
    its ZeRO-3 fp32 partition), in a row no token uses, so step 4's loss and norm stay finite and only
    the save of step 4 sees it. Both ranks stop with one line naming the newest good checkpoint and a
    command that continues from it; that command runs (fsdp)."""
    out = tmp_path / "out"
    args = (f"strategy={strategy}", "max_steps=6", "save_every=2")
    run = launch(2, *args, output_dir=out, check=False, extra_env={"FINETUNE_FAULT": "after_step:1:3:NAN"})
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    good = out / "checkpoints" / "step_000000002"
    assert len(errors) == 1, run.stderr[-4000:]
    assert errors[0].startswith("error: step 4: the weights to be saved hold 1 NaN/inf value(s)"), errors[0]
    assert f"the newest checkpoint, {good}, is from before it; continue from it with --resume {good}" in errors[0]
    assert "error: rank" not in run.stderr and run.stderr.count("Traceback") <= 1  # the launcher's, as above
    losses = {r["step"]: r["loss"] for r in run.train_records}
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())  # the guard saw nothing
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000002"]  # no partial either
    assert not (out / "final").exists() and not (out / "finetune.lock").exists()
    if strategy != "fsdp":
        return
    resumed = launch(2, *args, "--resume", str(good), output_dir=out)  # the command the line gives
    assert f"resumed from {good} at step 2" in resumed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_000000006"
    final = weights_of_final(out / "final")
    assert all(torch.isfinite(t).all() for t in final.values())


def weights_of_final(final):
    from safetensors.torch import load_file

    return load_file(str(final / "model.safetensors"))
