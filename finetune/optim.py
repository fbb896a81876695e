"""The optimizer's parts that every strategy shares: the parameter groups (no weight decay on norms and
biases), the step-based LR schedule, the optimizer and scheduler built together (the strategy decides
which AdamW: finetune/strategy), and the weights an optimizer updates (read for the non-finite check).

Imports no torch at load time.
"""

from __future__ import annotations

import math


def param_groups(model, weight_decay: float):
    """No weight decay on norms and biases; by name, because ZeRO-3 partitioned params are flat."""
    groups = [{"params": [], "param_names": [], "weight_decay": weight_decay},
              {"params": [], "param_names": [], "weight_decay": 0.0}]
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = groups[1] if "norm" in name or name.endswith(".bias") else groups[0]
            group["params"].append(p)
            group["param_names"].append(name)
    return [g for g in groups if g["params"]]  # LoRA trains no norms: DeepSpeed drops empty groups


def lr_factor(step: int, kind: str, warmup: int, total: int) -> float:
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

    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, kind=recipe.lr_scheduler,
                                                                warmup=recipe.warmup_steps, total=total_steps))


def build_optimizer_and_scheduler(plan, model, total_steps: int):
    """AdamW, sharded or offloaded as the strategy says, and a step-based LR schedule."""
    from accelerate.utils import DummyOptim, DummyScheduler

    r = plan.recipe
    groups = param_groups(model, r.weight_decay)
    adam = dict(lr=r.lr, betas=(r.adam_beta1, r.adam_beta2), eps=r.adam_eps)
    # On GPUs one fused kernel updates every parameter (the foreach AdamW was the optimizer phase of the
    # 1B profile, docs/benchmarks.md section 6); on CPU the plain loop, with which the loss curves were
    # matched to TRL's. Parameters offloaded to CPU by FSDP step on CPU.
    fused = plan.device == "cuda" and r.offload_params == "none"
    optimizer = plan.strategy.build_optimizer(plan, groups, adam, fused)
    if isinstance(optimizer, DummyOptim):
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: build_scheduler(r, opt, total_steps))
        return optimizer, scheduler
    return optimizer, build_scheduler(r, optimizer, total_steps)


def updated_weights(optimizer) -> list:
    """This rank's part of the weights the optimizer updates: its shard under FSDP (the local tensor of
    each DTensor), its fp32 partitions under DeepSpeed, every parameter under DDP. ZeRO-3 hands its
    flat fp32 partitions to the torch optimizer only for the duration of a step (its param_groups are
    empty in between), so they are taken from ZeRO-3 itself."""
    while not hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return list(optimizer.fp32_partitioned_groups_flat)
    return [p.to_local() if hasattr(p, "to_local") else p for g in optimizer.param_groups for p in g["params"]]


def nonfinite_count(optimizer):
    """How many values of this rank's updated weights (updated_weights) are NaN or inf, as a tensor."""
    import torch

    weights = [t.detach() for t in updated_weights(optimizer) if t.numel()]
    # A NaN or inf makes its tensor's sum non-finite, and a sum is one pass without the boolean
    # tensors of isfinite: where every sum is finite there is nothing to count (a sum that overflows
    # finite values to inf only sends it to the exact count below).
    sums = {}  # per device, read back once each (a CPU-offloaded shard lives apart from the GPU's)
    for t in weights:
        sums.setdefault(t.device, []).append(t.sum().float())
    if all(bool(torch.isfinite(torch.stack(s)).all()) for s in sums.values()):
        return torch.zeros((), dtype=torch.int64)
    counts = {}
    for t in weights:
        n = (~torch.isfinite(t)).sum()
        counts[n.device] = counts.get(n.device, 0) + n
    return sum((n.cpu() for n in counts.values()), torch.zeros((), dtype=torch.int64))
