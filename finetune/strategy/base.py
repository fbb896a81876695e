"""What ddp, zero1-3 and fsdp have in common: the Strategy base class, whose subclasses (ddp.py,
zero.py, fsdp.py) state where each differs.

A strategy answers every question whose answer depends on it: the recipe settings it cannot take
(recipe.validate asks), the Accelerate plugin or DeepSpeed config, which ranks read the weights, where
a 4-bit base is placed and how it is prepared, the optimizer, how checkpoint state is saved and
loaded, how a live model's weights are gathered (a LoRA adapter at the end, the whole model for
samples at eval), whether a resume on another world size needs DeepSpeed's universal conversion, and
the memory planner's per-strategy terms (bytes per parameter, what is sharded or offloaded, the
buffers). The rest of the package asks these objects and never compares strategy names
(tests/test_layout.py checks).

Imports no torch at load time, so that the recipe and the planner (memory.py) stay light.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


class Strategy:
    """What ddp, zero1-3 and fsdp have in common; each subclass states where it differs."""
    name = ""
    zero_stage = 0  # DeepSpeed's ZeRO stage; 0 for the PyTorch strategies
    # The Accelerate switch a launcher config sets for this strategy (plan.check_launcher refuses others).
    launcher_switch: str | None = None
    # Memory planner: whether parameters, gradients and optimizer states are split across the ranks.
    shards_params = shards_grads = shards_optimizer = False
    # A resume on another world size needs DeepSpeed's universal checkpoint (resume.ensure_universal).
    converts_on_world_size_change = False
    # Its model and optimizer are saved by torch.distributed.checkpoint, one save each (async_save
    # writes each into its staging tmpfs before copying it: memory.estimate).
    saves_with_dcp = False
    # final/ of a bf16/fp16 run holds 16-bit weights, and an export of its checkpoints matches them.
    final_in_training_dtype = False

    @property
    def is_deepspeed(self) -> bool:
        return self.zero_stage > 0

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Strategy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    # -- the recipe settings this strategy cannot take (recipe.validate asks, in its order; each answer
    # is one line naming the key, the value and the fix, or None)

    tiles_mlp = False  # tiled_mlp=true was tried with this strategy (zero3 and fsdp)
    optimizer_offload_fix = "strategy=zero2 or zero3"  # what to change for offload_optimizer without DeepSpeed
    offloads_optimizer_to_nvme = False  # DeepSpeed offloads the optimizer to nvme under ZeRO-3 only

    def offload_problem(self, recipe) -> str | None:
        """offload_params and offload_optimizer: parameters only where they are sharded, the optimizer only
        under DeepSpeed."""
        r = recipe
        if r.offload_params != "none" and not self.shards_params:
            return (f"offload_params={r.offload_params} with strategy={r.strategy}: parameters can only be offloaded "
                    "when they are sharded; use strategy=zero3 (cpu or nvme) or strategy=fsdp (cpu), or "
                    "offload_params=none")
        if r.offload_optimizer != "none" and not self.is_deepspeed:
            return (f"offload_optimizer={r.offload_optimizer} with strategy={r.strategy}: optimizer offload is a "
                    f"DeepSpeed feature; use {self.optimizer_offload_fix}, or offload_optimizer=none")
        if r.offload_optimizer == "nvme" and not self.offloads_optimizer_to_nvme:
            return (f"offload_optimizer=nvme with strategy={r.strategy}: DeepSpeed offloads the optimizer to nvme "
                    "only under ZeRO-3; use strategy=zero3 or offload_optimizer=cpu")
        return None

    def option_problem(self, recipe) -> str | None:
        """A setting that belongs to another strategy (ddp_shard_optimizer: Ddp answers None)."""
        if recipe.ddp_shard_optimizer:
            return (f"ddp_shard_optimizer=true with strategy={recipe.strategy}: it applies to strategy=ddp only "
                    "(ZeRO and FSDP shard the optimizer already)")
        return self.layout_option_problem(recipe)

    # the multi-node layout keys (docs/multi-node.md) and the strategy each belongs to
    layout_options = {"shard_size": (0, "hsdp"), "zero_hpz_partition_size": (1, "zero3"), "mics_shard_size": (0, "zero3")}

    def layout_option_problem(self, recipe) -> str | None:
        for key, (default, owner) in self.layout_options.items():
            if getattr(recipe, key) != default and self.name != owner:
                return (f"{key}={getattr(recipe, key)} with strategy={recipe.strategy}: it applies to "
                        f"strategy={owner} only; use strategy={owner} or {key}={default}")
        return None

    def layout_text(self, recipe, world_size: int, machines: int) -> str:
        """How the ranks are laid out, where it is more than "all of them" (plan.describe)."""
        return ""

    def layout_problem(self, recipe, world_size: int, machines: int) -> str | None:
        """What this strategy cannot do on world_size processes over `machines` nodes (plan.make_plan asks)."""
        return None

    # Checkpoints of the strategies with the same format load into one another (fsdp and hsdp: DCP shards).
    @property
    def checkpoint_format(self) -> str:
        return self.name

    def quantized_base_problem(self, recipe) -> str | None:
        """load_in_4bit=true: whether this strategy places a 4-bit (QLoRA) base (takes_4bit_base)."""
        if recipe.load_in_4bit and not self.takes_4bit_base:
            return (f"load_in_4bit=true with strategy={recipe.strategy}: a 4-bit (QLoRA) base is sharded by "
                    "strategy=fsdp or zero3, or replicated by ddp; use one of those")
        return None

    def compile_problem(self, recipe) -> str | None:
        """compile=true where it was tried and works (finetune/model.py compile_layers): ddp, fsdp (FSDP2),
        zero1, zero2, with or without activation checkpointing and LoRA, and a 4-bit base under ddp.
        Measured on the tiny model (CPU, 12 steps, TORCH_LOGS=graph_breaks): zero3 44 graph breaks, a 4-bit
        base under fsdp 41 (and 43 recompiles, past torch._dynamo's recompile_limit); the others none.
        FSDP1 needs a GPU and was not tried."""
        return None

    def tiled_mlp_problem(self, recipe) -> str | None:
        if recipe.tiled_mlp and not self.tiles_mlp:
            return (f"tiled_mlp=true with strategy={recipe.strategy}: the MLP's backward runs once per slice, "
                    "which DDP's reducer refuses (a parameter made ready twice) and ZeRO-1/2's per-parameter "
                    "gradient hooks were not tried with; tiled_mlp is tested under zero3 and fsdp, the "
                    "strategies for long rows: use one of them, or tiled_mlp=false")
        return None

    def frozen_reference_problem(self, recipe) -> str | None:
        """A run that holds a frozen copy of the model as its reference (wrap_reference): why this strategy
        cannot, and the fix on its side; the objective's own error line adds its alternative."""
        return None

    # -- the planner's terms (memory.py asks these)

    def state_bytes(self, mixed_precision: str) -> tuple[int, int, int]:
        """Bytes per trained parameter (weights, gradients, optimizer states) as this toolkit holds them:
        fp32 weights and gradients, casts happen per layer (autocast / FSDP policy)."""
        return 4, 4, 8

    def paper_model_states(self, mixed_precision: str, params: int, world_size: int) -> float:
        """Model-state bytes per rank exactly as the ZeRO paper gives them (arXiv:1910.02054 section 3.1)."""
        return 16 * params / world_size

    def offload(self, setup, params: float, grads: float, optimizer: float, trained: int, grad_bytes: int,
                world_size: int) -> tuple[float, float, float, dict]:
        """(params, grads, optimizer) left on the GPU and {"cpu": bytes, "nvme": bytes} moved off it."""
        return params, grads, optimizer, {"cpu": 0.0, "nvme": 0.0}

    def sharding_group(self, setup, world_size: int, gpus_per_node: int) -> int:
        """The GPUs the sharded states are divided over (hsdp: its shard group; the others: all)."""
        return world_size

    def extra_param_bytes(self, setup, params: int, compute_bytes: int) -> float:
        """Parameter bytes per GPU beyond the sharded states (zero3 hpZ: its secondary copy)."""
        return 0.0

    def step_collectives(self, s) -> list[tuple[str, int, bool, float]]:
        """One optimizer step's collectives on one GPU, for the planner (finetune/comm.py, its docstring
        gives each strategy's): (op, GPUs in the group, whether the group spans nodes, the buffer bytes
        summed over the step's calls). s: a comm.StepShape."""
        raise NotImplementedError

    def buffers(self, arch, setup, trained: int, grad_bytes: int, world_size: int, compute_bytes: int,
                sixteen: bool, layer: float, layer_trained: float) -> float:
        """What the strategy allocates beyond the model states (memory.py's term 4)."""
        raise NotImplementedError

    # -- the launch

    def launcher_problem(self, env) -> str | None:
        """A launcher config that turns on another strategy than this one (the fix is added by the caller)."""
        if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not self.is_deepspeed:
            return f"the launcher config enables DeepSpeed but strategy={self.name}"
        if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and self.launcher_switch != "ACCELERATE_USE_FSDP":
            return f"the launcher config enables FSDP but strategy={self.name}"
        return None

    def gpu_only_problem(self, recipe) -> str | None:
        """A setting of this strategy that needs CUDA GPUs, on a machine without one."""
        return None

    def plugins(self, plan, config) -> dict:
        """The keyword arguments of Accelerator that turn this strategy on (deepspeed_plugin, fsdp_plugin)."""
        return {}

    def start_cpu_group(self) -> None:
        """On CPU: the gloo process group, and the distributed type Accelerate should take for it."""
        from accelerate import PartialState

        PartialState(backend="gloo")

    def accelerator_cpu(self, on_cpu: bool) -> bool:
        """Accelerator(cpu=...): only DDP runs as Accelerate's MULTI_CPU type."""
        return False

    def autocast_handlers(self, recipe) -> list:
        return []

    def reads_weights(self, accelerator) -> bool:
        """Whether this rank reads the checkpoint's weights from disk."""
        return True

    # -- a 4-bit (QLoRA) base

    def quantized_base_device(self) -> str:
        """Where the 4-bit base is loaded: the CPU, sharded at prepare; Accelerate / DeepSpeed move the
        shards to the GPU."""
        return "cpu"

    takes_4bit_base = True  # a QLoRA base is sharded (fsdp, zero3) or replicated (ddp): quantized_base_problem
    shares_quantized_layers = False  # rank 0 sends the other ranks its Linear4bit layout (model._load_4bit)
    prepares_for_kbit_training = False  # peft's prepare_model_for_kbit_training (norms in fp32)

    def prepare_4bit(self, model, device) -> None:
        """Before the model is wrapped: the quantization constants to the run's device (DeepSpeed moves
        the parameters, not these)."""
        import bitsandbytes as bnb

        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit) and module.weight.quant_state is not None:
                module.weight.quant_state.to(device)
                module.quant_state = module.weight.quant_state

    # -- the optimizer, wrapping, and the weights of a live run

    def build_optimizer(self, plan, groups: list, adam: dict, fused: bool):
        import torch

        return torch.optim.AdamW(groups, fused=fused or None, foreach=False, **adam)

    def after_prepare(self, accelerator, model, optimizer) -> None:
        """Anything the wrapped model and optimizer need before the first step."""

    # -- checkpoints (checkpoint.Checkpointer asks these)

    replicates_weights = False  # every rank holds all the weights (a sum over ranks counts them N times)

    def on_checkpointer(self, accelerator, lora: bool) -> None:
        """Hooks that accelerator.save_state needs for this strategy."""

    def save_state(self, accelerator, directory: Path, lora: bool) -> None:
        """This rank's part of the model, optimizer and scheduler state. Collective."""
        accelerator.save_state(str(directory))

    def load_state(self, accelerator, directory: Path, lora: bool) -> None:
        """Restore what save_state wrote, in place. A LoRA checkpoint holds no frozen base: it comes from
        the model as loaded. Collective."""
        accelerator.load_state(str(directory))

    @contextmanager
    def whole_weights(self, accelerator, model):
        """The Hugging Face (or peft) model with whole weights on every rank for a block of forwards
        (samples at eval); a collective, every rank must enter it. ddp, zero1 and zero2 hold the weights
        whole already."""
        yield accelerator.unwrap_model(model)

    def gathered_bytes(self, model) -> int:
        """What whole_weights adds on each rank; 0 where the weights are whole already."""
        return 0

    def weight_buckets(self, accelerator, model, layers: int):
        """The model's parameters as whole tensors, `layers` decoder layers at a time (the rest, embeddings,
        final norm, output layer, in buckets of their own): yields lists of (name, tensor) as the unwrapped
        model names them, each tensor valid until the next bucket is asked for, so that no second whole
        copy of the model is ever held (a vLLM push, finetune/training/generators.py). A collective where
        the weights are sharded: every rank iterates to the end. Whole already here (ddp, zero1, zero2)."""
        for bucket in layer_buckets(list(accelerator.unwrap_model(model).named_parameters()), layers):
            yield [(name, p.detach()) for name, p in bucket]

    def gather_trainable(self, accelerator, named: list) -> dict:
        """Full tensors of the given (name, parameter) pairs on the main process. Collective."""
        import torch
        from torch.distributed.tensor import DTensor

        out = {}
        for name, param in named:
            full = param.full_tensor() if isinstance(param, DTensor) else param  # collective for FSDP2 shards
            if accelerator.is_main_process:
                out[name] = full.detach().to("cpu", torch.float32, copy=True)
        return out

    def wrap_reference(self, accelerator, model):
        """A DPO run's frozen reference (full fine-tune), placed as this strategy places it: whole on each
        rank here (ddp, zero1, zero2: it is not trained, so there is nothing of it to shard)."""
        return model.to(accelerator.device)

    reference_sharded = False  # the planner: the reference's weights are divided over the ranks


def layer_buckets(named: list, layers: int) -> list[list]:
    """(name, parameter) pairs in their order, cut into buckets: each run of `layers` decoder layers (a
    name's ".layers.N." part) is one, and so is each run of parameters outside the layers."""
    import re

    buckets, key_of_last = [], None
    for name, p in named:
        found = re.search(r"\.layers\.(\d+)\.", name)
        key = int(found.group(1)) // layers if found else -1
        if key != key_of_last or not buckets:
            buckets.append([])
        buckets[-1].append((name, p))
        key_of_last = key
    return buckets
