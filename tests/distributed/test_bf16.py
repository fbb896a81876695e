"""mixed_precision=bf16 as a GPU runs it, on CPU with 2 processes: FSDP2 casts each layer's parameters
to bf16 for compute through its MixedPrecisionPolicy (no autocast over fp32 weights) and reduces
gradients in fp32; DeepSpeed's bf16 engine computes in bf16. In both the optimizer's master weights
and states stay fp32, which is what makes a bf16 run converge like an fp32 one.

Before the policy, fsdp with bf16 stopped at its first step: Accelerate's default policy cast every
unit's output to bf16, lm_head's output (our loss) included (strategy.fsdp2_mixed_precision)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from suite_runs import SAVE, resume_copy

# bf16 keeps 8 bits of mantissa: one rounding is 2**-8 relative. The tiny model's 12-step curve in bf16
# stayed within 2e-4 of fp32's on CPU (measured); 1e-2 leaves room for other machines' kernels while
# still catching a run that trains wrongly (the curve falls by about 10% over these 12 steps).
BF16_RTOL = 1e-2


@pytest.fixture(scope="module")
def bf16_runs(launch):
    return {s: launch(2, f"strategy={s}", "mixed_precision=bf16", *SAVE) for s in ("fsdp", "zero3")}


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_bf16_trains_like_fp32_but_computes_in_bf16(strategy, bf16_runs, strategy_run):
    bf16, fp32 = bf16_runs[strategy].losses, strategy_run(strategy).losses
    assert len(bf16) == len(fp32) == 12 and all(math.isfinite(x) for x in bf16)
    worst = max(abs(a - b) / b for a, b in zip(bf16, fp32))
    assert worst < BF16_RTOL, (bf16, fp32)
    assert worst > 1e-6, "the bf16 run equals the fp32 one: it did not compute in bf16"
    assert bf16[-1] < bf16[0]
    summary = json.loads((bf16_runs[strategy].output_dir / "summary.json").read_text())
    assert math.isfinite(summary["final_eval_loss"])


def dcp_dtypes(folder):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata()  # our own test's files
    return {name: m.properties.dtype for name, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def test_fsdp_bf16_keeps_fp32_master_weights_and_states(bf16_runs):
    ckpt = bf16_runs["fsdp"].output_dir / "checkpoints" / "step_000000010"
    params, states = dcp_dtypes(ckpt / "pytorch_model_fsdp_0"), dcp_dtypes(ckpt / "optimizer_0")
    assert params and set(params.values()) == {torch.float32}, params
    moments = {k: v for k, v in states.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) == 2 * len(params) and set(moments.values()) == {torch.float32}, states


def test_zero3_bf16_keeps_fp32_master_partitions(bf16_runs):
    ckpt = bf16_runs["zero3"].output_dir / "checkpoints" / "step_000000010" / "pytorch_model"
    shards = sorted(ckpt.glob("*optim_states.pt"))
    assert len(shards) == 2
    for shard in shards:
        optim = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        masters = optim["fp32_flat_groups"]
        assert masters and all(t.dtype == torch.float32 for t in masters)
        moments = [v for s in optim["optimizer_state_dict"]["state"].values() for k, v in s.items()
                   if k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(t.dtype == torch.float32 for t in moments)
    model = torch.load(next(ckpt.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    assert model["ds_config"]["bf16"]["enabled"] is True


def test_fsdp_bf16_resumes_exactly(bf16_runs, launch, tmp_path_factory):
    run = bf16_runs["fsdp"]
    out = resume_copy(run, 5, tmp_path_factory)
    resumed = launch(2, "strategy=fsdp", "mixed_precision=bf16", *SAVE, "--resume", "auto", output_dir=out)
    assert resumed.losses == run.losses[5:]
