"""The launches that several test modules share (see the strategy_run fixture in conftest.py)."""

import shutil

# Every strategy as the suite launches it; one launch per (strategy, processes) serves every test that
# asserts on an uninterrupted run (the curves in test_strategies, the resumes and exports in
# test_checkpoint). Checkpoints every 5 steps: 5 and 10 are steps where a resume on another world
# size changes accumulation in the middle of the old run's micro-step count (2 -> 1 processes:
# 5 x 2 micro-steps is not a multiple of the new accumulation of 4).
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "ddp_zero_redundancy_optimizer": ["strategy=ddp", "ddp_shard_optimizer=true"],
    "fsdp": ["strategy=fsdp"],
    "fsdp_cpu_offload": ["strategy=fsdp", "offload_params=cpu"],
    "zero1": ["strategy=zero1"],
    "zero2": ["strategy=zero2"],
    "zero3": ["strategy=zero3"],
    "zero3_cpu_offload": ["strategy=zero3", "offload_optimizer=cpu", "offload_params=cpu"],
}
SAVE = ["save_every=5", "keep_last=3"]


def resume_copy(run, step, tmp_path_factory):
    """A new output_dir holding only `run`'s checkpoint of `step` (as if the run had stopped there)."""
    out = tmp_path_factory.mktemp("resume")
    name = f"step_{step:09d}"
    shutil.copytree(run.output_dir / "checkpoints" / name, out / "checkpoints" / name)
    return out
