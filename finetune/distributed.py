"""The process environment and the Accelerator: what a run starts with, the same for every strategy
except where it asks the strategy (plan.strategy: its plugins, its CPU process group, which ranks read
the weights, its optimizer and what it needs after prepare).

This is also the only place with the CPU/gloo workaround: on a machine without a GPU, Accelerate does
not turn FSDP or DeepSpeed on by itself, so we start the gloo process group first and tell Accelerate
which distributed type to take (the strategy's start_cpu_group; docs/design-notes.md).

Imports no torch at load time.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from finetune.collectives import install_if_asked
from finetune.optim import build_optimizer_and_scheduler


def prefer_environment_ninja() -> None:
    """DeepSpeed JIT-compiles its ops (CPU Adam, the shared-memory collectives on CPU) with the first
    `ninja` on PATH. A virtual environment ships its own ninja, and a run started as
    `.venv/bin/accelerate ...` without activating it finds the system's instead; two ninja versions
    discard each other's build log, so every switch recompiled the ops (measured: 49 s for the CPU
    collectives, 86 s for CPU Adam). Putting this interpreter's ninja first makes the build cache hold."""
    own = Path(sys.executable).parent
    if (own / "ninja").is_file() and shutil.which("ninja") != str(own / "ninja"):
        os.environ["PATH"] = str(own) + os.pathsep + os.environ.get("PATH", "")


def ensure_process_env() -> None:
    """Make a plain `python finetune/run.py` a one-process group, so every strategy takes the same
    code path as under a launcher (ZeRO-3 with offload on one GPU is a real use)."""
    prefer_environment_ninja()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def deepspeed_cpu_local_size() -> None:
    """On CPU, DeepSpeed counts its devices from LOCAL_SIZE (set by its own launcher, not by
    Accelerate or torchrun); without it, every call of its CPU accelerator's device_count() runs
    `numactl --hardware` in a subprocess (deepspeed/utils/numa.py). ZeRO-3 calls it once per
    gradient bucket it reduce-scatters (stage3.py __avg_scatter_grads), so a process fork per bucket:
    20% of a tiny_grpo zero3 step on 2 loaded cores (bench/studies/grpo_vs_trl.py, docs/benchmarks.md
    section 14). The count only chooses between reduce-scatter and the quantized all-to-all
    (zero_quantized_gradients, more than one node), so the processes on this node
    (LOCAL_WORLD_SIZE) changes nothing else.

    Set only once DeepSpeed's communication is up (after prepare): DeepSpeed's backend reads
    LOCAL_SIZE as it starts, and where it equals the world size it creates a shared-memory allreduce
    buffer per rank in /dev/shm (64 MiB each, for inference_all_reduce, which training never calls)
    that nothing removes when the process ends: every run left 128 MiB of RAM behind until the
    machine ran out (tests/distributed/conftest.py checks each launch leaves none). The zero strategies now keep
    that op from being built at all (no_shared_memory_allreduce below)."""
    import deepspeed.comm as dist

    if dist.is_initialized():
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


def no_shared_memory_allreduce() -> None:
    """On CPU, DeepSpeed's communication starts by building its shared-memory allreduce op
    (deepspeed/comm/torch.py build_shm_op: deepspeed_shm_comm, a C++ build of one to four minutes on 2 cores
    the first time on a machine, and again for every path DeepSpeed is imported from) for
    inference_all_reduce, which training never calls, and with it a 64 MiB buffer per rank in /dev/shm that nothing
    removes. Without the op DeepSpeed's inference_all_reduce takes the process group's all_reduce, and every
    collective training uses is the gloo group's as before. Called before deepspeed.comm starts: by the zero
    strategies and by sequence parallelism under fsdp and ddp (Ulysses runs on deepspeed.comm). tests/test_plan.py
    checks that DeepSpeed still builds it by that name (a rename would bring the build back, not break a run)."""
    import importlib

    # not `import deepspeed.comm.torch as`: that finds deepspeed.comm's attribute `torch`, which is torch itself
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


def build_accelerator(plan, config):
    """Create the process group and the Accelerator for the recipe's strategy, from the model's config
    (its hidden size sizes DeepSpeed's buckets; its decoder-layer class is FSDP's unit).

    Must run before the model is loaded: under ZeRO-3 the Accelerator's DeepSpeed config is what makes
    `from_pretrained` partition weights as they load, and under FSDP it is what makes ranks other
    than 0 load on the meta device.
    """
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    ensure_process_env()
    install_if_asked()  # FINETUNE_COUNT_COLLECTIVES (finetune/collectives.py)
    r = plan.recipe
    strategy = plan.strategy
    on_cpu = plan.device == "cpu"
    plugins = strategy.plugins(plan, config)
    if on_cpu:
        strategy.start_cpu_group()
    accelerator = Accelerator(
        cpu=strategy.accelerator_cpu(on_cpu),
        kwargs_handlers=strategy.autocast_handlers(r),
        mixed_precision=r.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.grad_accum, sync_with_dataloader=False, adjust_scheduler=False),
        step_scheduler_with_optimizer=False,  # the loop steps the scheduler once per optimizer step
        log_with=[t for t in r.report_to if t != "none"] or None,
        project_dir=r.output_dir,
        **plugins,
    )
    if accelerator.num_processes != plan.world_size:
        raise RuntimeError(f"Accelerate formed a group of {accelerator.num_processes} processes but the launcher "
                           f"started {plan.world_size}; see docs on launching")
    return accelerator


def reads_weights(plan, accelerator) -> bool:
    """Whether this rank reads the checkpoint's weights from disk (Strategy.reads_weights). ZeRO-3
    partitions as every rank reads."""
    return plan.strategy.reads_weights(accelerator)


def accumulate(accelerator, model, index: int):
    """The context for micro-batch `index` (0-based) of an optimizer step: gradients are reduced, and
    the optimizer (DeepSpeed's engine included) steps, after the step's last micro-batch only.

    Accelerate decides that from its running micro-batch counter, which a checkpoint restores. After
    a resume with another accumulation (another world size keeps the global batch, so accumulation
    changes) that counter does not fall on step boundaries, and the optimizer would skip steps or
    step mid-batch without a word. Counting from the step's own first micro-batch keeps both right.
    """
    accelerator.step = index
    return accelerator.accumulate(model)


def prepare(accelerator, plan, model, total_steps: int):
    """Wrap/shard the model, and the optimizer and scheduler with it."""
    if plan.recipe.load_in_4bit:
        plan.strategy.prepare_4bit(model, accelerator.device)
    optimizer, scheduler = build_optimizer_and_scheduler(plan, model, total_steps)
    if plan.recipe.ddp_shard_optimizer:
        # Accelerate's optimizer wrapper reads state_dict() on one rank, which ZeroRedundancyOptimizer
        # only allows after a collective consolidation; the loop needs no wrapper for it.
        model, scheduler = accelerator.prepare(model, scheduler)
        return model, optimizer, scheduler
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    plan.strategy.after_prepare(accelerator, model, optimizer)
    if plan.device == "cpu" and plan.strategy.is_deepspeed:
        deepspeed_cpu_local_size()
    return model, optimizer, scheduler
