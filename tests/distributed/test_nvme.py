"""NVMe offload for real: ZeRO-3 with parameters and optimizer states swapped to files in nvme_path
through DeepSpeed's async_io op (libaio; scripts/setup.sh --nvme installs it and builds the op), on 2
processes. The optimizer on NVMe steps as the optimizer on CPU does, bit for bit: both keep the fp32
master weights and Adam states off the accelerator and step them with the same CPU Adam; NVMe only
moves them through files.

DeepSpeed swaps only tensors of at least 1 MiB per rank (swap_tensor.utils.MIN_AIO_BYTES); every
tensor of the builtin tiny model is smaller, so NVMe offload of it would write nothing. The model
here is the tiny one with a 4096-token vocabulary (1.2M parameters): its embedding and output
matrices (512 Ki elements, 1 MiB of fp32 per rank) and its optimizer partition are swapped.

Resume: with parameters on NVMe it is exact; with the optimizer on NVMe DeepSpeed restores it
wrongly (see finetune.checkpointing.resume.nvme_resume_problem), so finetune refuses that resume in one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from suite_runs import resume_copy

SHORT = ["max_steps=4", "eval_at_start=false", "strategy=zero3"]
# After a 2-process resume of ZeRO-3 with the optimizer on cpu the next loss differed from the
# uninterrupted one (then on cpu) by 5e-7 relative (7.4890647 vs 7.4890683 at step 4; one process: bit for bit):
# fp32 rounding, well inside the 1e-5 that checkpoints moved between world sizes are held to.
RESUME_RTOL = 1e-5
STOP_AT_2 = {"FINETUNE_FAULT": "after_step:1:1:SIGTERM"}  # rank 1 gets SIGTERM after step 1; all stop at 2


@pytest.fixture(scope="module")
def async_io_built(launch_env) -> None:
    """DeepSpeed's async_io op, built (scripts/setup.sh --nvme does it, as .ci/run asks; minutes if not) before the launches,
    which would otherwise each build it inside their time limit."""
    import subprocess
    import sys

    # with this interpreter's ninja first on PATH, as setup.sh and every run build it: another ninja
    # would discard their build log and compile the op again
    proc = subprocess.run([sys.executable, "-c", "from finetune.strategy import prefer_environment_ninja; "
                           "prefer_environment_ninja(); from deepspeed.ops.op_builder import AsyncIOBuilder; "
                           "AsyncIOBuilder().load(verbose=False)"],
                          env=dict(launch_env, DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, \
        f"DeepSpeed's async_io op does not build here (bash scripts/setup.sh --nvme):\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def swappable_model(tmp_path_factory, launch_env, async_io_built) -> str:
    """The builtin tiny Llama with vocab_size=4096, written by save_pretrained like any local model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.assets import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    out = tmp_path_factory.mktemp("swappable-model")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def swap_files(nvme: Path, kind: str) -> dict:
    """rank -> sizes of DeepSpeed's swap files (zero_stage_3/{optimizer,float32params}/rank<i>)."""
    ranks = sorted((nvme / "zero_stage_3" / kind).glob("rank*"))
    return {d.name: [f.stat().st_size for f in d.glob("*.tensor.swp")] for d in ranks}


def curve(run) -> list[tuple]:
    return [(r["step"], r["tokens"], r["loss"]) for r in run.train_records]


def test_nvme_offload_trains_like_cpu_offload_and_params_on_nvme_resume(launch, run_in_process, swappable_model,
                                                                         tmp_path, tmp_path_factory):
    model = f"model={swappable_model}"
    # parameters and optimizer on NVMe, uninterrupted
    both = tmp_path / "nvme-both"
    both.mkdir()
    reference = launch(2, *SHORT, model, "offload_optimizer=nvme", "offload_params=nvme", f"nvme_path={both}",
                       "save_every=2")
    assert [s for s, _, _ in curve(reference)] == [1, 2, 3, 4] and reference.losses[-1] < reference.losses[0]
    for kind in ("optimizer", "float32params"):  # both ranks swapped both, in files of at least 1 MiB
        files = swap_files(both, kind)
        assert list(files) == ["rank0", "rank1"] and all(s and max(s) >= 2**20 for s in files.values()), (kind, files)
    checkpoint = reference.output_dir / "checkpoints" / "step_000000002"
    assert len([p for p in (checkpoint / "pytorch_model" / "offloaded_tensors").iterdir() if any(p.iterdir())]) == 2

    # ... whose resume DeepSpeed gets wrong: refused before anything loads, in one line
    stopped_there = resume_copy(reference, 2, tmp_path_factory)
    copied = stopped_there / "checkpoints" / "step_000000002"
    refused = run_in_process(*SHORT, model, "offload_optimizer=nvme", "offload_params=nvme", f"nvme_path={both}",
                             "--resume", "auto", output_dir=stopped_there)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"error: --resume {copied}: the checkpoint was written with offload_optimizer=nvme, which deepspeed "
        f"{__import__('deepspeed').__version__} does not resume correctly (Adam's step count restarts and the small "
        "optimizer partitions return to their initial values); runs that must resume: offload_optimizer=cpu "
        "(offload_params=nvme resumes correctly)"], refused.stderr

    # parameters on NVMe, the optimizer on CPU, stopped by a scheduler's SIGTERM: the same numbers, bit for
    # bit (the same CPU Adam on the same values in the same order; NVMe only stores them in between) ...
    params = tmp_path / "nvme-params"
    params.mkdir()
    nvme_params = ["offload_optimizer=cpu", "offload_params=nvme", f"nvme_path={params}"]
    stopped = launch(2, *SHORT, model, *nvme_params, extra_env=STOP_AT_2)
    assert "stopped by signal at step 2" in stopped.stderr
    assert curve(stopped) == curve(reference)[:2]
    assert swap_files(params, "float32params") and all(swap_files(params, "float32params").values())
    assert not swap_files(params, "optimizer")

    # ... and resumed: the uninterrupted curve
    resumed = launch(2, *SHORT, model, *nvme_params, "--resume", "auto", output_dir=stopped.output_dir)
    assert "at step 2" in resumed.stderr
    got, want = curve(resumed), curve(reference)
    assert got[:2] == want[:2] and [t for _, t, _ in got] == [t for _, t, _ in want]
    for (step, _, loss), (_, _, ref) in zip(got, want):
        assert math.isclose(loss, ref, rel_tol=RESUME_RTOL), (step, got, want)
    assert math.isclose(resumed.eval_records[-1]["eval_loss"], reference.eval_records[-1]["eval_loss"],
                        rel_tol=RESUME_RTOL)
    assert (resumed.output_dir / "final" / "config.json").is_file()
