"""Plan -> an Accelerator that shards the model the way the recipe says (DDP, FSDP, DeepSpeed ZeRO),
plus the optimizer and scheduler that strategy needs.

This is the only module that knows Accelerate's and DeepSpeed's knobs, and the only place with the
CPU/gloo workaround (see ../shared/reference/cpu-distributed.md): on a machine without a GPU,
Accelerate does not turn FSDP or DeepSpeed on by itself, so we start the gloo process group first
and tell Accelerate which distributed type to take.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
from pathlib import Path

import torch

from finetune.plan import Plan


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


def deepspeed_config(plan: Plan, hidden_size: int) -> dict:
    """A complete DeepSpeed config: nothing left as "auto", so what runs is what is written here."""
    r = plan.recipe
    h2 = hidden_size * hidden_size
    zero = {
        "stage": plan.zero_stage,
        "overlap_comm": plan.device == "cuda",
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": h2,
        "allgather_bucket_size": max(h2, 5 * 10**7) if plan.zero_stage < 3 else h2,
    }
    if plan.zero_stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": int(0.9 * h2),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": 10**9,
            "stage3_max_reuse_distance": 10**9,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    pin = plan.device == "cuda"
    if r.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": r.offload_optimizer, "pin_memory": pin}
        if r.offload_optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = r.nvme_path
    if r.offload_params != "none":
        zero["offload_param"] = {"device": r.offload_params, "pin_memory": pin}
        if r.offload_params == "nvme":
            zero["offload_param"]["nvme_path"] = r.nvme_path
    config = {
        "train_micro_batch_size_per_gpu": r.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "train_batch_size": plan.global_batch_size,
        "gradient_clipping": r.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": r.mixed_precision == "bf16"},
        "fp16": {"enabled": r.mixed_precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    if plan.resumes_on_other_world_size:
        config["checkpoint"] = {"load_universal": True}  # see resume.ensure_universal
    if r.offload_optimizer != "none":
        # Offloaded optimizer steps run in DeepSpeed's own CPU Adam; it is built from this section.
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": r.lr, "betas": [r.adam_beta1, r.adam_beta2], "eps": r.adam_eps, "weight_decay": r.weight_decay}}
    return config


def fsdp2_mixed_precision(mixed_precision: str):
    """FSDP2's own mixed precision instead of autocast over fp32 weights: each layer's parameters are
    all-gathered once per forward in bf16 (half the traffic, and no per-op casts of fp32 weights,
    which were most of the non-matmul GPU time in docs/benchmarks.md section 6); gradients are reduced
    in fp32 into the fp32 sharded parameters, which stay the optimizer's master weights.

    output_dtype stays unset. Accelerate's default casts every unit's output to bf16, and lm_head's
    output is our loss (finetune/loss.py computes it inside lm_head's forward, in fp32): the cast
    rounded it to 8 bits of mantissa, and the loss check refused the run. Measured on CPU before
    this: fsdp with mixed_precision=bf16 stopped at step 1 with "llama changes the logits after its
    output layer"; zero3 and ddp ran."""
    if mixed_precision == "no":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=None)


def _fsdp_plugin(plan: Plan, no_split_modules: list[str]):
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

    r = plan.recipe
    common = dict(
        fsdp_version=r.fsdp_version,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(no_split_modules),
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=True,  # rank 0 reads the weights, the others start on the meta device
        activation_checkpointing=False,  # done by the model (model.py), the same way for every strategy
    )
    if r.fsdp_version == 2:
        return FullyShardedDataParallelPlugin(
            reshard_after_forward=True,
            cpu_offload=CPUOffloadPolicy(pin_memory=plan.device == "cuda") if r.offload_params == "cpu" else OffloadPolicy(),
            mixed_precision_policy=fsdp2_mixed_precision(r.mixed_precision),
            **common)
    return FullyShardedDataParallelPlugin(
        sharding_strategy="FULL_SHARD", use_orig_params=True, sync_module_states=True,
        cpu_offload=CPUOffload(offload_params=r.offload_params == "cpu"), **common)


def build_accelerator(plan: Plan, config):
    """Create the process group and the Accelerator for the recipe's strategy, from the model's config
    (its hidden size sizes DeepSpeed's buckets; its decoder-layer class is FSDP's unit).

    Must run before the model is loaded: under ZeRO-3 the Accelerator's DeepSpeed config is what makes
    `from_pretrained` partition weights as they load, and under FSDP it is what makes ranks other
    than 0 load on the meta device.
    """
    from accelerate import Accelerator, DeepSpeedPlugin, DistributedType, PartialState
    from accelerate.utils import GradientAccumulationPlugin

    ensure_process_env()
    r = plan.recipe
    on_cpu = plan.device == "cpu"
    ds_plugin = fsdp_plugin = None
    if plan.is_deepspeed:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        ds_plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(plan, config.hidden_size))
    elif r.strategy == "fsdp":
        from finetune.model import no_split_modules

        os.environ["ACCELERATE_USE_FSDP"] = "true"
        fsdp_plugin = _fsdp_plugin(plan, no_split_modules(config))

    if on_cpu:
        if r.strategy == "ddp":
            PartialState(cpu=True, backend="gloo")  # MULTI_CPU: Accelerate wraps DDP without device ids
        else:
            state = PartialState(backend="gloo")
            if r.strategy == "fsdp":
                # Accelerate enables FSDP only for GPU-like types; FSDP itself runs on CPU tensors.
                state.distributed_type = DistributedType.MULTI_GPU

    handlers = []
    if r.strategy == "fsdp" and r.fsdp_version == 2 and r.mixed_precision != "no":
        from accelerate.utils import AutocastKwargs

        handlers.append(AutocastKwargs(enabled=False))  # FSDP2's policy casts (fsdp2_mixed_precision)
    accelerator = Accelerator(
        cpu=on_cpu and r.strategy == "ddp",
        kwargs_handlers=handlers,
        mixed_precision=r.mixed_precision,
        deepspeed_plugin=ds_plugin,
        fsdp_plugin=fsdp_plugin,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.grad_accum, sync_with_dataloader=False, adjust_scheduler=False),
        step_scheduler_with_optimizer=False,  # the loop steps the scheduler once per optimizer step
        log_with=[t for t in r.report_to if t != "none"] or None,
        project_dir=r.output_dir,
    )
    if accelerator.num_processes != plan.world_size:
        raise RuntimeError(f"Accelerate formed a group of {accelerator.num_processes} processes but the launcher "
                           f"started {plan.world_size}; see docs on launching")
    return accelerator


def reads_weights(plan: Plan, accelerator) -> bool:
    """Whether this rank reads the checkpoint's weights from disk. Under FSDP only rank 0 does: the
    others build a meta-device skeleton and receive their shards when the model is prepared, so no
    node holds one full copy per process in CPU RAM. ZeRO-3 partitions as every rank reads."""
    return plan.recipe.strategy != "fsdp" or accelerator.is_main_process


def accumulate(accelerator, model, index: int):
    """The context for micro-batch `index` (0-based) of an optimizer step: gradients are reduced, and
    the optimizer (DeepSpeed's engine included) steps, after the step's last micro-batch only.

    Accelerate decides that from its running micro-batch counter, which a checkpoint restores. After
    a resume with another accumulation (another world size keeps the global batch, so accumulation
    changes) that counter no longer falls on step boundaries, and the optimizer silently skipped
    steps or stepped mid-batch. Counting from the step's own first micro-batch keeps both right.
    """
    accelerator.step = index
    return accelerator.accumulate(model)


def _param_groups(model, weight_decay: float):
    """No weight decay on norms and biases; by name, because ZeRO-3 partitioned params are flat."""
    groups = [{"params": [], "param_names": [], "weight_decay": weight_decay},
              {"params": [], "param_names": [], "weight_decay": 0.0}]
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = groups[1] if "norm" in name or name.endswith(".bias") else groups[0]
            group["params"].append(p)
            group["param_names"].append(name)
    return [g for g in groups if g["params"]]  # LoRA trains no norms: DeepSpeed drops empty groups


def _lr_factor(step: int, kind: str, warmup: int, total: int) -> float:
    """transformers' get_scheduler schedules, formula for formula (tests/test_plan.py compares them):
    importing transformers.optimization pulls in its Trainer's utilities, peft and bitsandbytes, which
    cost every rank about 2 s at start (measured with python -X importtime) for four lines of arithmetic."""
    if kind == "constant":
        return 1.0
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))  # cosine, half a cycle
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def build_scheduler(recipe, optimizer, total_steps: int):
    from functools import partial

    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_lr_factor, kind=recipe.lr_scheduler,
                                                                warmup=recipe.warmup_steps, total=total_steps))


def build_optimizer_and_scheduler(plan: Plan, model, total_steps: int):
    """AdamW, sharded or offloaded as the strategy says, and a step-based LR schedule."""
    from accelerate.utils import DummyOptim, DummyScheduler

    r = plan.recipe
    groups = _param_groups(model, r.weight_decay)
    adam = dict(lr=r.lr, betas=(r.adam_beta1, r.adam_beta2), eps=r.adam_eps)
    # On GPUs one fused kernel updates every parameter (the foreach AdamW was the optimizer phase of the
    # 1B profile, docs/benchmarks.md section 6); on CPU the plain loop, with which the loss curves were
    # matched to TRL's. Parameters offloaded to CPU by FSDP step on CPU.
    fused = plan.device == "cuda" and r.offload_params == "none"
    if plan.is_deepspeed and r.offload_optimizer != "none":
        optimizer = DummyOptim(groups, **adam)  # DeepSpeed builds its CPU Adam from the config
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: build_scheduler(r, opt, total_steps))
        return optimizer, scheduler
    if r.strategy == "ddp" and r.ddp_shard_optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            weight_decay=groups[0]["weight_decay"], fused=fused or None, **adam)
        for group in groups[1:]:
            optimizer.add_param_group({"params": group["params"], "weight_decay": group["weight_decay"]})
    else:
        optimizer = torch.optim.AdamW(groups, fused=fused or None, foreach=False, **adam)
    return optimizer, build_scheduler(r, optimizer, total_steps)


def prepare(accelerator, plan: Plan, model, total_steps: int):
    """Wrap/shard the model, and the optimizer and scheduler with it."""
    if plan.recipe.load_in_4bit:
        from finetune.model import move_quant_states, prepare_4bit_for_fsdp

        (prepare_4bit_for_fsdp if plan.recipe.strategy == "fsdp" else move_quant_states)(model, accelerator.device)
    optimizer, scheduler = build_optimizer_and_scheduler(plan, model, total_steps)
    if plan.recipe.ddp_shard_optimizer:
        # Accelerate's optimizer wrapper reads state_dict() on one rank, which ZeroRedundancyOptimizer
        # only allows after a collective consolidation; the loop needs no wrapper for it.
        model, scheduler = accelerator.prepare(model, scheduler)
        return model, optimizer, scheduler
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if plan.recipe.strategy == "fsdp":
        _point_optimizer_at(optimizer.optimizer, accelerator.unwrap_model(model))
    return model, optimizer, scheduler


def _point_optimizer_at(optimizer, model) -> None:
    """Re-point the optimizer at the sharded parameters by name.

    Accelerate maps old to new parameters by storage address, and ranks that built the model on the
    meta device (all but rank 0, see model.load_model) have no addresses to tell parameters apart.
    The optimizer holds no state yet, so swapping the references is all it takes.
    """
    named = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [named[name] for name in group["param_names"]]
