"""DDP: one full copy of the model per process, gradients all-reduced; ddp_shard_optimizer=true
shards the optimizer states with torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

import os

from finetune.strategy.base import Strategy


class Ddp(Strategy):
    """One full copy of the model per process; gradients all-reduced (optionally a sharded optimizer)."""
    name = "ddp"

    def option_problem(self, recipe):
        return self.layout_option_problem(recipe)

    def paper_model_states(self, mixed_precision, params, world_size):
        return 16 * params

    def step_collectives(self, s):
        n = s.gpus
        out = [("all_reduce", n, s.spans_nodes(n), s.trained * 4)]  # fp32 gradients, once per step
        return out

    def buffers(self, arch, setup, trained, grad_bytes, world_size, compute_bytes, sixteen, layer, layer_trained):
        buffers = trained * grad_bytes  # DDP's reduction buckets hold a copy of every gradient
        # torch AdamW (foreach) makes one fp32 temporary the size of the states it steps
        return buffers + 4 * trained / (world_size if setup.ddp_shard_optimizer else 1)

    def start_cpu_group(self):
        from accelerate import PartialState

        PartialState(cpu=True, backend="gloo")  # MULTI_CPU: Accelerate wraps DDP without device ids

    def accelerator_cpu(self, on_cpu):
        return on_cpu

    def quantized_base_device(self):
        """Every process loads the quantized base onto its own device."""
        import torch

        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"

    prepares_for_kbit_training = True
    replicates_weights = True

    def on_checkpointer(self, accelerator, lora):
        if lora:
            accelerator.register_save_state_pre_hook(_keep_trainable_weights)

    def load_state(self, accelerator, directory, lora):
        if lora:
            accelerator.load_state(str(directory), strict=False)
        else:
            accelerator.load_state(str(directory))

    def build_optimizer(self, plan, groups, adam, fused):
        if not plan.recipe.ddp_shard_optimizer:
            return super().build_optimizer(plan, groups, adam, fused)
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            weight_decay=groups[0]["weight_decay"], fused=fused or None, **adam)
        for group in groups[1:]:
            optimizer.add_param_group({"params": group["params"], "weight_decay": group["weight_decay"]})
        return optimizer


def _keep_trainable_weights(models, weights, output_dir) -> None:
    """Accelerate save_state hook for DDP LoRA runs: write the adapter, not the frozen base."""
    for i, model in enumerate(models):
        inner = getattr(model, "module", model)
        trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
        if i < len(weights) and trainable:
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable}
