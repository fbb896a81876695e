"""The plan (recipe x launch environment) and the DeepSpeed config built from it."""

import os

import pytest
import torch

from finetune.plan import make_plan
from finetune.recipe import Recipe, RecipeError, apply_overrides, load_recipe_module, validate
from finetune.strategy import deepspeed_config


def recipe(*overrides) -> Recipe:
    """The tiny recipe in fp32 (runs on CPU), with overrides."""
    return apply_overrides(load_recipe_module("tiny"), ["mixed_precision=no", *overrides])


def plan(*overrides, env=None, cuda=False):
    return make_plan(recipe(*overrides), env=env or {}, cuda_available=cuda)


# ---------------------------------------------------------------- world size and batch


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_world_size_and_global_batch_from_env(world):
    p = plan("micro_batch_size=3", "grad_accum=5", env={"WORLD_SIZE": str(world)})
    assert p.world_size == world
    assert p.grad_accum == 5
    assert p.global_batch_size == 3 * 5 * world
    assert p.device == "cpu"
    assert f"global batch {15 * world} = micro 3 x accum 5 x {world}" in p.describe()


def test_a_batch_that_grows_with_the_processes_says_so():
    """tiny (global_batch_size=0) on 3 processes trains a global batch of 48, not the 32 of its 2: the start
    line says the batch follows the process count and how to fix it; a fixed one says nothing more."""
    grows = make_plan(load_recipe_module("tiny"), env={"WORLD_SIZE": "3"}, cuda_available=False).describe()
    assert ("global batch 48 = micro 8 x accum 2 x 3 (global_batch_size=0: the batch grows with the processes; set "
            "global_batch_size to keep it the same on any count); precision") in grows
    for p in (plan("global_batch_size=48", "micro_batch_size=8", env={"WORLD_SIZE": "3"}), plan(env={"WORLD_SIZE": "1"})):
        assert "grows with the processes" not in p.describe()


def test_grpo_global_batch_is_told_in_prompts_and_completions():
    """A GRPO step reads global_batch_size / num_generations prompts and trains on global_batch_size
    completions: the start line says both."""
    p = make_plan(load_recipe_module("tiny_grpo"), env={"WORLD_SIZE": "2"}, cuda_available=False)
    assert "global batch 16 prompts x 8 = 128 completions = micro 16 x accum 4 x 2" in p.describe()


def test_no_world_size_means_one_process():
    p = plan()
    assert p.world_size == 1 and p.num_machines == 1
    assert p.global_batch_size == p.recipe.micro_batch_size * p.recipe.grad_accum


def test_num_machines_from_env():
    assert plan(env={"WORLD_SIZE": "4", "ACCELERATE_NUM_MACHINES": "2"}).num_machines == 2
    assert plan(env={"WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}).num_machines == 2


@pytest.mark.parametrize("world,accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_size_derives_grad_accum(world, accum):
    p = plan("global_batch_size=32", "micro_batch_size=4", "grad_accum=99", env={"WORLD_SIZE": str(world)})
    assert p.grad_accum == accum
    assert p.global_batch_size == 32


def test_global_batch_size_not_divisible_names_working_values():
    with pytest.raises(RecipeError) as info:
        plan("global_batch_size=12", "micro_batch_size=2", env={"WORLD_SIZE": "4"})
    msg = str(info.value)
    assert "global_batch_size=12" in msg
    assert "2 x 4 = 8" in msg
    assert "global_batch_size=8 or 16" in msg


def test_global_batch_size_below_one_step_suggests_the_smallest():
    with pytest.raises(RecipeError) as info:
        plan("global_batch_size=4", "micro_batch_size=4", env={"WORLD_SIZE": "2"})
    msg = str(info.value)
    assert "global_batch_size=8" in msg and "global_batch_size=0" not in msg


def test_is_deepspeed_and_zero_stage():
    assert plan("strategy=zero2").zero_stage == 2
    assert plan("strategy=zero3").is_deepspeed
    fsdp = plan("strategy=fsdp")
    assert not fsdp.is_deepspeed and fsdp.zero_stage == 0


# ---------------------------------------------------------------- launcher conflicts


@pytest.mark.parametrize("strategy,env,fragment", [
    ("fsdp", {"ACCELERATE_USE_DEEPSPEED": "true"}, "enables DeepSpeed but strategy=fsdp"),
    ("ddp", {"ACCELERATE_USE_DEEPSPEED": "TRUE"}, "enables DeepSpeed but strategy=ddp"),
    ("zero3", {"ACCELERATE_USE_FSDP": "true"}, "enables FSDP but strategy=zero3"),
    ("zero3", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
     "ZeRO stage 2 but strategy=zero3"),
    ("zero2", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"},
     "deepspeed_config_file"),
    ("zero3", {"ACCELERATE_MIXED_PRECISION": "bf16"}, "launcher says mixed_precision=bf16"),
])
def test_launcher_conflicts(strategy, env, fragment):
    with pytest.raises(RecipeError) as info:
        plan(f"strategy={strategy}", env=env)
    assert fragment in str(info.value)


@pytest.mark.parametrize("strategy,env", [
    ("zero3", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}),
    ("zero2", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}),
    ("fsdp", {"ACCELERATE_USE_FSDP": "true"}),
    ("ddp", {"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_USE_FSDP": "false"}),
    ("zero3", {"ACCELERATE_MIXED_PRECISION": "no"}),
])
def test_matching_launcher_passes(strategy, env):
    p = plan(f"strategy={strategy}", env=dict(env, WORLD_SIZE="2"))
    assert p.recipe.strategy == strategy and p.world_size == 2


def test_launcher_mixed_precision_matching_recipe_passes():
    p = plan("mixed_precision=bf16", env={"ACCELERATE_MIXED_PRECISION": "bf16"}, cuda=True)
    assert p.device == "cuda" and p.recipe.mixed_precision == "bf16"


def test_fp16_needs_cuda_and_bf16_runs_on_cpu():
    with pytest.raises(RecipeError) as info:
        plan("mixed_precision=fp16", cuda=False)
    assert "mixed_precision=fp16 needs a CUDA GPU" in str(info.value)
    assert "mixed_precision=no (fp32) or bf16" in str(info.value)
    assert plan("mixed_precision=bf16", cuda=False).recipe.mixed_precision == "bf16"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp2_mixed_precision_is_its_own_policy(precision):
    """bf16 (fp16) parameters for compute, gradients reduced in fp32, and no cast of the units' outputs:
    lm_head's output is the loss, computed in fp32 (strategy.fsdp2_mixed_precision)."""
    from finetune.strategy import fsdp2_mixed_precision, fsdp_plugin

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    policy = fsdp_plugin(plan(f"mixed_precision={precision}", "strategy=fsdp", cuda=True),
                          ["LlamaDecoderLayer"]).mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (dtype, torch.float32, None)
    assert fsdp2_mixed_precision("no") is None


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cpu", False)])
def test_adamw_is_fused_on_cuda(device, fused):
    """One kernel for the whole update on GPUs; on CPU the reference's own loop, which the curves
    equal to TRL's were measured with."""
    from finetune.strategy import build_optimizer_and_scheduler

    p = plan("strategy=fsdp", cuda=device == "cuda")
    optimizer, _ = build_optimizer_and_scheduler(p, torch.nn.Linear(4, 4), 10)
    assert bool(optimizer.defaults.get("fused")) is fused


def test_flash_attention_needs_cuda():
    with pytest.raises(RecipeError, match="flash_attention_2 needs a CUDA GPU"):
        plan("attn_implementation=flash_attention_2")


# ---------------------------------------------------------------- DeepSpeed config


H = 4096


def ds(*overrides, world=4):
    p = plan(*overrides, env={"WORLD_SIZE": str(world)})
    return p, deepspeed_config(p, hidden_size=H)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_stage_and_batch(stage):
    p, cfg = ds(f"strategy=zero{stage}", "micro_batch_size=3", "grad_accum=5", "max_grad_norm=0.7", world=4)
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["gradient_accumulation_steps"] == 5
    assert cfg["train_batch_size"] == 3 * 5 * 4 == p.global_batch_size
    assert cfg["gradient_clipping"] == 0.7
    assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    assert "optimizer" not in cfg
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert "offload_param" not in cfg["zero_optimization"]
    assert "auto" not in repr(cfg)


def test_deepspeed_zero3_buckets():
    _, cfg = ds("strategy=zero3")
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == H * H
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * H * H)
    assert z["stage3_param_persistence_threshold"] == 10 * H
    assert z["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_reduce_bucket_has_a_floor_for_small_models(strategy):
    """hidden^2 elements, but no fewer than REDUCE_BUCKET_MIN: a small model's gradients in one
    collective, not one per weight; a large model keeps hidden^2."""
    from finetune.strategy.zero import REDUCE_BUCKET_MIN, reduce_bucket

    assert reduce_bucket(4096) == 4096 * 4096 and reduce_bucket(64) == REDUCE_BUCKET_MIN
    z = deepspeed_config(plan(f"strategy={strategy}", env={"WORLD_SIZE": "2"}), hidden_size=64)["zero_optimization"]
    assert z["reduce_bucket_size"] == REDUCE_BUCKET_MIN
    assert z["allgather_bucket_size"] == (64 * 64 if strategy == "zero3" else 5 * 10**7)
    big = deepspeed_config(plan(f"strategy={strategy}", env={"WORLD_SIZE": "2"}), hidden_size=4096)
    assert big["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096


def test_deepspeed_zero2_has_no_stage3_keys():
    _, cfg = ds("strategy=zero2")
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == H * H
    assert not any(k.startswith("stage3_") for k in z)


def test_deepspeed_global_batch_size_derivation_reaches_config():
    _, cfg = ds("strategy=zero3", "global_batch_size=64", "micro_batch_size=2", world=4)
    assert cfg["gradient_accumulation_steps"] == 8
    assert cfg["train_batch_size"] == 64


def test_deepspeed_offload_cpu_sections_and_optimizer():
    _, cfg = ds("strategy=zero3", "offload_optimizer=cpu", "offload_params=cpu", "lr=1e-4",
                "weight_decay=0.1", "adam_beta2=0.95", "adam_eps=1e-6")
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "cpu" and "nvme_path" not in z["offload_optimizer"]
    assert z["offload_param"]["device"] == "cpu"
    assert z["offload_optimizer"]["pin_memory"] is False  # plan.device is cpu
    assert cfg["optimizer"]["type"] == "AdamW"
    params = cfg["optimizer"]["params"]
    assert params["lr"] == 1e-4 and params["weight_decay"] == 0.1
    assert params["betas"] == [0.9, 0.95] and params["eps"] == 1e-6


def test_deepspeed_offload_params_only_has_no_optimizer_section():
    _, cfg = ds("strategy=zero3", "offload_params=cpu")
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert "optimizer" not in cfg


def test_deepspeed_offload_nvme_paths(tmp_path):
    """The plan checks that DeepSpeed's async_io op can be built (libaio, a compiler, ninja) before it makes
    an nvme config; where it cannot (scripts/setup.sh without --nvme), that check's own line is the skip's
    reason. CI's setup has --nvme, so the test runs there."""
    from finetune.plan import async_io_problem

    problem = async_io_problem(cuda_available=False)
    if problem:
        pytest.skip(f"this machine cannot build DeepSpeed's async_io op: {problem} (bash scripts/setup.sh --nvme)")
    _, cfg = ds("strategy=zero3", "offload_optimizer=nvme", "offload_params=nvme", f"nvme_path={tmp_path}")
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "nvme", "pin_memory": False, "nvme_path": str(tmp_path)}
    assert z["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": str(tmp_path)}
    assert "optimizer" in cfg


def test_deepspeed_precision_flags_follow_recipe():
    p = make_plan(recipe("strategy=zero3", "mixed_precision=bf16"), env={}, cuda_available=True)
    cfg = deepspeed_config(p, hidden_size=H)
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["overlap_comm"] is True


def test_deepspeed_op_builds_use_this_environments_ninja(monkeypatch):
    """A run started as .venv/bin/accelerate without activating the venv found the system's ninja,
    whose other build-log version made DeepSpeed recompile CPU Adam and the CPU collectives (~2 min)."""
    import shutil
    import sys
    from pathlib import Path

    from finetune.strategy import prefer_environment_ninja

    own = Path(sys.executable).parent / "ninja"
    assert own.is_file(), "deepspeed depends on the ninja package, which installs bin/ninja beside python"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    prefer_environment_ninja()
    assert shutil.which("ninja") == str(own)
    prefer_environment_ninja()  # idempotent: the directory is not added twice
    assert os.environ["PATH"].split(os.pathsep).count(str(own.parent)) == 1


def test_deepspeed_on_cpu_counts_its_devices_without_a_subprocess(monkeypatch):
    """Without LOCAL_SIZE, DeepSpeed's CPU accelerator ran `numactl --hardware` in a subprocess at every
    device_count(), which ZeRO-3 calls once per gradient bucket it reduce-scatters (76 forks a
    tiny_grpo step). The run sets it to the node's process count, as DeepSpeed's launcher does, but only
    once DeepSpeed's communication is up: set before, DeepSpeed's backend creates /dev/shm buffers that
    nothing removes."""
    import subprocess

    import deepspeed.comm
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from finetune.distributed import deepspeed_cpu_local_size

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(deepspeed.comm, "is_initialized", lambda: False)
    deepspeed_cpu_local_size()  # before DeepSpeed's backend starts: left unset
    assert "LOCAL_SIZE" not in os.environ
    monkeypatch.setattr(deepspeed.comm, "is_initialized", lambda: True)
    deepspeed_cpu_local_size()
    monkeypatch.setattr(subprocess, "check_output", no_subprocess)
    assert os.environ["LOCAL_SIZE"] == "2"
    assert CPU_Accelerator().device_count() == 2
    monkeypatch.setenv("LOCAL_SIZE", "4")  # a launcher's own value is kept
    deepspeed_cpu_local_size()
    assert os.environ["LOCAL_SIZE"] == "4"


def test_stale_build_lock_is_named_with_its_fix(tmp_path):
    """torch 2.13's FileBaton: a killed DeepSpeed op build leaves `<op>/lock`, and every later build or load
    of that op would sleep on it forever. Only the ops the run builds or loads are checked."""
    import os

    from torch.utils.file_baton import FileBaton

    from finetune.plan import STALE_BUILD_LOCK_S, build_lock_scheme, stale_build_lock_problems

    assert build_lock_scheme() == "baton", "the torch installed here is 2.13's (pyproject allows 2.14 too)"
    batons = {op: FileBaton(str(tmp_path / op / "lock")) for op in ("deepspeed_shm_comm", "cpu_adam", "async_io")}
    for baton in batons.values():
        os.makedirs(os.path.dirname(baton.lock_file_path))
        assert baton.try_acquire()  # as a build takes it; a kill leaves the file behind
    stale = batons["deepspeed_shm_comm"].lock_file_path
    now = os.stat(stale).st_mtime + STALE_BUILD_LOCK_S + 60
    fresh = batons["cpu_adam"].lock_file_path
    os.utime(fresh, (now - 60, now - 60))  # a build that is running now
    zero3 = validate(Recipe(strategy="zero3"))
    problems = stale_build_lock_problems(zero3, now=now, root=str(tmp_path), scheme="baton")
    assert len(problems) == 1 and "deepspeed_shm_comm op was interrupted" in problems[0] and f"rm {stale}" in problems[0]
    # async_io's lock is as old, but a run without NVMe never builds or loads that op (before: refused)
    assert stale_build_lock_problems(zero3, now=now, root=str(tmp_path), scheme="baton", cuda_available=True) == []
    os.utime(fresh, (now - STALE_BUILD_LOCK_S - 60,) * 2)
    offload = validate(Recipe(strategy="zero3", offload_optimizer="cpu"))
    assert len(stale_build_lock_problems(offload, now=now, root=str(tmp_path), scheme="baton", cuda_available=True)) == 1
    assert stale_build_lock_problems(validate(Recipe(strategy="fsdp")), now=now, root=str(tmp_path),
                                     scheme="baton") == []


def test_torch_2_14_build_lock_left_behind_or_held_is_no_problem(tmp_path):
    """torch 2.14 (torch/utils/cpp_extension.py _jit_compile: `with FileLock(os.path.join(build_directory,
    'lock'))`, filelock's flock) leaves `<op>/lock` after every build and load, blocking nobody: an
    old file no one holds, or one a build holds now, refuses nothing (before: every ZeRO run refused 30
    minutes after any op build), and clearing stale locks never deletes either."""
    import os
    import types

    from filelock import FileLock

    from finetune.plan import (STALE_BUILD_LOCK_S, build_lock_scheme, clear_stale_build_locks, lock_is_held,
                               stale_build_lock_problems)

    def jit_compile_2_14(build_directory):  # the lock torch 2.14 takes around a build or load
        with FileLock(os.path.join(build_directory, "lock")):
            pass

    assert build_lock_scheme(types.SimpleNamespace(_jit_compile=jit_compile_2_14)) == "os_lock"
    left, held = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (left, held):
        lock.parent.mkdir()
    jit_compile_2_14(str(left.parent))
    assert left.exists() and not lock_is_held(str(left)), "2.14 leaves the file behind, unlocked"
    holder = FileLock(str(held))
    holder.acquire()
    try:
        assert lock_is_held(str(held)) and lock_is_held(str(held)), "the probe lets go of its own try"
        now = os.stat(left).st_mtime + 10 * STALE_BUILD_LOCK_S
        offload = validate(Recipe(strategy="zero3", offload_optimizer="cpu"))
        assert stale_build_lock_problems(offload, now=now, root=str(tmp_path), scheme="os_lock") == []
        assert len(stale_build_lock_problems(offload, now=now, root=str(tmp_path), scheme="baton")) == 2
    finally:
        holder.release()
    assert held.exists() and not lock_is_held(str(held))


def test_clearing_stale_build_locks_follows_the_scheme(tmp_path, monkeypatch):
    """scripts/setup.sh clears stale locks through clear_stale_build_locks: under 2.13's scheme the old
    ones, under 2.14's none (removing a held one would let a second build start beside it)."""
    import os

    from finetune import plan

    monkeypatch.setattr(plan, "extensions_root", lambda: str(tmp_path))
    old, young = tmp_path / "async_io" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (old, young):
        lock.parent.mkdir()
        lock.touch()
    os.utime(old, (os.stat(old).st_mtime - plan.STALE_BUILD_LOCK_S - 60,) * 2)
    monkeypatch.setattr(plan, "build_lock_scheme", lambda: "os_lock")
    assert plan.clear_stale_build_locks() == [] and old.exists() and young.exists()
    monkeypatch.setattr(plan, "build_lock_scheme", lambda: "baton")
    assert plan.clear_stale_build_locks() == [str(old)] and not old.exists() and young.exists()
    assert plan.clear_stale_build_locks(0, ["async_io"]) == [] and young.exists()
    assert plan.clear_stale_build_locks(0, ["cpu_adam"]) == [str(young)] and not young.exists()


@pytest.mark.parametrize("kind", ["constant", "constant_with_warmup", "linear", "cosine"])
def test_schedules_equal_transformers(kind):
    """finetune's own schedules (no transformers.optimization import at start) give transformers'
    learning rates at every step, bit for bit."""
    import torch
    from transformers import get_scheduler

    from finetune.strategy import build_scheduler

    def lrs(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        scheduler = make(optimizer)
        out = []
        for _ in range(40):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    recipe = validate(Recipe(lr_scheduler=kind, warmup_steps=7, max_steps=37))
    ours = lrs(lambda opt: build_scheduler(recipe, opt, 37))
    theirs = lrs(lambda opt: get_scheduler(kind, opt, num_warmup_steps=7, num_training_steps=37))
    assert ours == theirs


@pytest.mark.parametrize("args,reason", [
    (["--gpus", "3", "sequence_parallel=2"], "sequence_parallel=2 does not divide the 3 process(es)"),
    (["--gpus", "3", "sequence_parallel=3"], "sequence_parallel=3: the model has 4 attention heads, not divisible by 3"),
    (["--gpus", "3", "sequence_parallel=2", "--max-seq-len"], "sequence_parallel=2 does not divide the 3 process(es)"),
])
def test_the_planner_refuses_what_the_run_refuses(args, reason, capsys):
    """`finetune plan` called these setups "fits"; the run refuses them (make_plan on the processes, the
    front and the run on the model's heads). The planner now says so, with the run's reason."""
    from finetune.commands.plan import main

    capsys.readouterr()
    assert main(["--recipe", "tiny", "--gpu-mem", "80GB", *args]) == 2
    captured = capsys.readouterr()
    assert "fits" not in captured.out + captured.err and "per GPU" not in captured.out  # no table, no verdict
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: the run refuses this setup on 3 GPU(s): {reason}")
    with pytest.raises(RecipeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        if "does not divide" in reason:
            plan(*[a for a in args if "=" in a], env={"WORLD_SIZE": "3"})
        else:  # the run's own check, on the model's config (finetune.training.loop.setup and the finetune train front)
            from finetune.model import load_config
            from finetune.sequence_parallel import config_problem

            r = recipe(*[a for a in args if "=" in a])
            raise RecipeError(config_problem(r, load_config(r)[1]))
    assert main(["--recipe", "tiny", "--gpu-mem", "80GB", "--gpus", "4", "sequence_parallel=2"]) == 0
    assert "the recipe's setup (zero3):" in capsys.readouterr().out


def test_zero_on_cpu_builds_no_shared_memory_allreduce(monkeypatch):
    """DeepSpeed's CPU communication builds its deepspeed_shm_comm op as it starts (TorchBackend.__init__ calls
    build_shm_op: minutes of C++ the first time), for an allreduce training never calls; the zero strategies
    replace that builder before their group starts. A DeepSpeed that renamed it fails here, not in a run."""
    import importlib
    import inspect

    backend = importlib.import_module("deepspeed.comm.torch")

    from finetune.distributed import no_shared_memory_allreduce

    assert "build_shm_op()" in inspect.getsource(backend.TorchBackend.__init__)
    monkeypatch.setattr(backend, "build_shm_op", backend.build_shm_op)  # put back after the test
    no_shared_memory_allreduce()
    assert backend.build_shm_op() is None
