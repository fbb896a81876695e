"""compile=true (torch.compile of each decoder layer, finetune/model.py compile_layers) under FSDP2 with
activation checkpointing, on 2 real processes: the per-step losses and eval losses equal those of the
suite's uncompiled fsdp run (suite_runs.STRATEGIES["fsdp"], the same data, seeds and steps), the layers
compile a bounded number of times (not once per step, although every step has another sequence
length) and without graph breaks, and a resume from the run's middle checkpoint continues its curve.

One compiled launch and one resume; the uncompiled run is the one test_strategies already launches."""

from __future__ import annotations

import math
import re

import pytest
from suite_runs import SAVE, STRATEGIES, resume_copy

COMPILE = ["activation_checkpointing=true", "compile=true"]
# Inductor fuses and reorders fp32 element-wise ops (RMSNorm's mean, rotary, SwiGLU) and recomputes the
# checkpointed layers with its own kernels, so the losses are not bit-equal to eager. Measured over these
# 12 steps and 3 evals: at most 4.5e-8 relative (a loss of 4.5 has an fp32 ulp of 1.1e-7 relative), 7 of
# 15 values bit-equal. 1e-6, about 10 ulps, leaves room for another CPU's vector width (which changes
# the reduction order) and is 100 x tighter than the strategies' comparison with the 1-process reference
# (test_strategies.RTOL). The resume measured bit-equal to the compiled run; it gets the same bound.
RTOL = 1e-6
# Each rank compiles the layers' frame for training at the first shape, once more with a dynamic
# sequence length (automatic dynamic shapes: the second step has another length), and for eval (no
# grad, a frame or two); a compile per step would be 12 or more.
MAX_COMPILES = 6


def train_eval(run):
    return ([(r["step"], r["loss"], r["tokens"]) for r in run.train_records],
            [(r["step"], r["eval_loss"]) for r in run.eval_records])


def assert_close(got, want):
    (train_got, eval_got), (train_want, eval_want) = got, want
    assert [(s, t) for s, _, t in train_got] == [(s, t) for s, _, t in train_want], "same steps, same batches"
    assert [s for s, _ in eval_got] == [s for s, _ in eval_want]
    pairs = [(a[1], b[1]) for a, b in zip(train_got, train_want)] + [(a[1], b[1]) for a, b in zip(eval_got, eval_want)]
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    assert all(math.isclose(a, b, rel_tol=RTOL) for a, b in pairs), (worst, got, want)


def compiles_per_rank(stderr: str) -> dict[str, int]:
    """Frames compiled, from TORCH_LOGS=recompiles: each line names a frame id as [frame/compile]."""
    seen: dict[str, set] = {}
    for rank, frame in re.findall(r"\[rank(\d+)\]:\S+ .*?\[(\d+/\d+)\] \[__recompiles\] Recompiling", stderr):
        seen.setdefault(rank, set()).add(frame)
    return {rank: len(frames) + 1 for rank, frames in seen.items()}  # +1: the first compile is no recompile


@pytest.fixture(scope="module")
def compiled(launch):
    return launch(2, *STRATEGIES["fsdp"], *SAVE, *COMPILE,
                  extra_env={"TORCH_LOGS": "recompiles,graph_breaks"})


def test_compiled_fsdp_matches_uncompiled(compiled, strategy_run):
    assert "Graph break" not in compiled.stderr, compiled.stderr[-4000:]
    counts = compiles_per_rank(compiled.stderr)
    assert set(counts) == {"0", "1"}, "both ranks compiled, and recompiled at least once (another length)"
    assert all(n <= MAX_COMPILES for n in counts.values()), counts
    assert_close(train_eval(compiled), train_eval(strategy_run("fsdp")))


def test_compiled_fsdp_resumes(compiled, launch, tmp_path_factory):
    out = resume_copy(compiled, 5, tmp_path_factory)
    name = "step_000000005"
    resumed = launch(2, *STRATEGIES["fsdp"], *SAVE, *COMPILE, "--resume", "auto", output_dir=out)
    assert f"resumed from {out / 'checkpoints' / name} at step 5" in resumed.stderr
    train, evals = train_eval(compiled)
    assert_close(train_eval(resumed), ([r for r in train if r[0] > 5], [r for r in evals if r[0] > 5]))
