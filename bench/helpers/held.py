"""What a live rank holds, by tensor storage: parameters, gradients and optimizer states, on the
accelerator and offloaded to the CPU, for plain modules, FSDP2 (DTensor shards), DeepSpeed ZeRO
engines and ZeroRedundancyOptimizer. A measuring tool for the memory planner's figures
(bench/helpers/memory_probe.py, tests/distributed/test_memory_measured.py), not part of a training run."""

from __future__ import annotations

def _is_zero_optimizer(opt) -> bool:
    return hasattr(opt, "fp32_partitioned_groups_flat") or hasattr(opt, "single_partition_of_fp32_groups")


def _unwrap_optimizer(model, optimizer):
    opt = optimizer
    if opt is None:
        opt = getattr(model, "optimizer", None)  # a DeepSpeedEngine holds its ZeRO optimizer
    for _ in range(8):
        if opt is None or _is_zero_optimizer(opt) or type(opt).__name__ == "ZeroRedundancyOptimizer":
            return opt
        inner = getattr(opt, "optimizer", None)  # accelerate's AcceleratedOptimizer / DeepSpeedOptimizerWrapper
        if inner is None or inner is opt:
            return opt
        opt = inner
    return opt


def _tensors(value):
    """Tensors inside an optimizer-state value, a list or a dict."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def held_bytes(model, optimizer=None, device: str | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer states that THIS rank holds, by distinct storage.

    Counts each tensor storage once (untyped_storage().data_ptr()), in the order parameters,
    gradients, optimizer, so a storage shared between them (ZeRO-3's fp32 master that is the
    partition itself in fp32 training, tied embeddings) counts once, as the first. Handles plain
    modules and DDP; FSDP2 DTensor parameters, gradients and states (their local shards); DeepSpeed
    ZeRO engines (stage 1/2: the flat 16-bit groups, `single_partition_of_fp32_groups` and their
    gradients, `averaged_gradients`, `all_grad_tensors`, `grads_in_partition`; stage 3: each parameter's `ds_tensor`,
    `fp32_partitioned_groups_flat`, `grad_partitions_flat_buffer`; states in `optimizer.optimizer.state`);
    torch ZeroRedundancyOptimizer (only the local shard's states, `optimizer.optim.state`).
    Meta tensors count 0, and so do scalar step counters and communication buckets. On a GPU run,
    tensors in CPU memory (offload) are reported apart as cpu_params / cpu_grads / cpu_optimizer.

    Gradients exist between backward and zero_grad, Adam's states from the first step on: call it
    after a backward (and a step) to see everything. Under Accelerate, DeepSpeed's backward also
    steps and frees the gradients at an accumulation boundary: they show between micro-steps only.
    """
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        DTensor = ()

    module = getattr(model, "module", model)
    if device is None:
        device = "cpu"
        for t in list(module.parameters()) + list(module.buffers()):
            for cand in (t, getattr(t, "ds_tensor", None)):
                if isinstance(cand, DTensor):
                    cand = cand.to_local()
                if isinstance(cand, torch.Tensor) and cand.device.type not in ("cpu", "meta"):
                    device = cand.device.type
                    break
            if device != "cpu":
                break
    out = {"params": 0, "grads": 0, "optimizer": 0, "cpu_params": 0, "cpu_grads": 0, "cpu_optimizer": 0}
    seen: set = set()

    def add(kind: str, t) -> None:
        if t is None:
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.dim() == 0:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or storage.nbytes() == 0:
            return
        key = (t.device.type, t.device.index, ptr)
        if key in seen:
            return
        seen.add(key)
        if t.device.type == "cpu" and device != "cpu":
            out["cpu_" + kind] += storage.nbytes()
        else:
            out[kind] += storage.nbytes()

    opt = _unwrap_optimizer(model, optimizer)
    params = list(module.parameters())
    for p in params:
        add("params", getattr(p, "ds_tensor", None))
        add("params", p)
    if opt is not None and _is_zero_optimizer(opt):
        for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat"):
            for t in getattr(opt, name, None) or []:
                add("params", t)

    for p in params:
        add("grads", p.grad)
    if opt is not None and _is_zero_optimizer(opt):
        for name in ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer"):
            for t in _tensors(getattr(opt, name, None)):
                add("grads", t)
        masters = getattr(opt, "fp32_partitioned_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups", [])
        for t in masters:
            add("grads", t.grad)
        for t in masters:
            add("optimizer", t)
        states = getattr(getattr(opt, "optimizer", None), "state", {}) or {}
    elif opt is not None and type(opt).__name__ == "ZeroRedundancyOptimizer":
        states = opt.optim.state
    else:
        states = getattr(opt, "state", {}) or {}
    for state in states.values():
        for t in _tensors(state):
            add("optimizer", t)

    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["cpu_total"] = out["cpu_params"] + out["cpu_grads"] + out["cpu_optimizer"]
    out["device"] = device
    return out
