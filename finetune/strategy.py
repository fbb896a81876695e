"""Everything that differs between ddp, zero1-3 and fsdp, in one object per strategy.

`strategy_for(name)` (or `Plan.strategy`) gives a Ddp, Zero(stage) or Fsdp object. It answers every
question whose answer depends on the strategy: the Accelerate plugin or DeepSpeed config, which ranks
read the weights, where a 4-bit base is placed and how it is prepared, the optimizer, how checkpoint
state is saved and loaded, how a live model's weights are gathered (a LoRA adapter at the end, the
whole model for samples at eval), whether a resume on another world size needs DeepSpeed's universal
conversion, and the memory planner's per-strategy terms (bytes per parameter, what is sharded or
offloaded, the buffers). The rest of the package asks these objects and never compares strategy names.

This is also the only place with the CPU/gloo workaround: on a machine without a GPU, Accelerate does
not turn FSDP or DeepSpeed on by itself, so we start the gloo process group first and tell Accelerate
which distributed type to take (docs/design-notes.md).

The module imports no torch at load time, so that the planner (memory.py) stays light.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

from finetune.recipe import RecipeError


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


# ---------------------------------------------------------------- the strategy objects


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

    takes_4bit_base = True  # a QLoRA base is sharded (fsdp, zero3) or replicated (ddp); recipe.validate
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


class Ddp(Strategy):
    """One full copy of the model per process; gradients all-reduced (optionally a sharded optimizer)."""
    name = "ddp"

    def paper_model_states(self, mixed_precision, params, world_size):
        return 16 * params

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


class Zero(Strategy):
    """DeepSpeed ZeRO stage 1 (optimizer states sharded), 2 (+ gradients) or 3 (+ parameters)."""
    launcher_switch = "ACCELERATE_USE_DEEPSPEED"
    shards_optimizer = True
    converts_on_world_size_change = True
    final_in_training_dtype = True

    def __init__(self, stage: int):
        self.zero_stage = stage
        self.name = f"zero{stage}"
        self.shards_grads = stage >= 2
        self.shards_params = stage == 3
        self.takes_4bit_base = stage == 3

    def state_bytes(self, mixed_precision):
        # 16-bit engine: bf16/fp16 weights and gradients, fp32 master + Adam m, v. In fp32 DeepSpeed
        # still clones an fp32 master partition (ZeRO-3 means to reuse the partition when the dtypes
        # agree, but compares a torch.device with a string and never does; seen with deepspeed 0.19).
        return (2, 2, 12) if mixed_precision != "no" else (4, 4, 12)

    def paper_model_states(self, mixed_precision, params, world_size):
        n = world_size
        sixteen = mixed_precision != "no"
        if self.zero_stage == 1:
            return (4 * params + 12 * params / n) if sixteen else (8 * params + 8 * params / n)
        if self.zero_stage == 2:
            return (2 * params + 14 * params / n) if sixteen else (4 * params + 12 * params / n)
        return 16 * params / n

    def offload(self, setup, params, grads, optimizer, trained, grad_bytes, world_size):
        off = {"cpu": 0.0, "nvme": 0.0}
        if setup.offload_optimizer != "none" and self.zero_stage >= 2:
            off[setup.offload_optimizer] += optimizer
            # CPU Adam steps on an fp32 gradient partition in (pinned) CPU memory; ZeRO-3 also keeps its
            # gradient accumulation buffer (gradient dtype) there.
            off["cpu"] += trained * (4 + (grad_bytes if self.zero_stage == 3 else 0)) / world_size
            grads = optimizer = 0.0
        if setup.offload_params != "none" and self.zero_stage == 3:
            off[setup.offload_params] += params
            params = 0.0
        return params, grads, optimizer, off

    def buffers(self, arch, setup, trained, grad_bytes, world_size, compute_bytes, sixteen, layer, layer_trained):
        lp = compute_bytes
        h2 = arch.hidden_size ** 2
        if self.zero_stage < 3:
            buffers = 2 * h2 * lp  # the reduce bucket, doubled when communication overlaps
            if sixteen and setup.offload_optimizer == "none":
                buffers += 4 * trained / world_size  # fp32 gradient partition for the optimizer step
            return buffers
        unit = max(layer, arch.embedding_parameters)
        buffers = 2 * unit * lp + max(layer_trained, 0) * lp + h2 * lp
        if sixteen and setup.offload_optimizer == "none":
            buffers += 4 * min(trained / world_size, 10**9)  # fp32 gradient of one optimizer sub-group
        return buffers

    def plugins(self, plan, config):
        from accelerate import DeepSpeedPlugin

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=deepspeed_config(plan, config.hidden_size))}

    def build_optimizer(self, plan, groups, adam, fused):
        if plan.recipe.offload_optimizer == "none":
            return super().build_optimizer(plan, groups, adam, fused)
        from accelerate.utils import DummyOptim

        return DummyOptim(groups, **adam)  # DeepSpeed builds its CPU Adam from the config

    def save_state(self, accelerator, directory, lora):
        # universal_checkpoint_info lets ds_to_universal convert it for another world size (models
        # without tensor parallelism need no patterns); a LoRA run leaves its frozen base out
        accelerator.save_state(str(directory), exclude_frozen_parameters=lora, client_state={
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})

    def load_state(self, accelerator, directory, lora):
        if lora:
            accelerator.load_state(str(directory), load_module_strict=False)  # the frozen base comes from the model
        else:
            accelerator.load_state(str(directory))

    @contextmanager
    def whole_weights(self, accelerator, model):
        """ZeRO-3: `deepspeed.zero.GatheredParameters` over every parameter, with all of the engine's
        parameter hooks taken off for the duration: the per-module fetch/release hooks (as TRL's
        unwrap_model_for_generation does) and the start-of-forward hook that resets the fetch trace.

        The parameters an eval prefetched are released first (engine.empty_partition_cache). An eval's
        forward follows the training trace (forward and backward), so at its end it has prefetched the
        parameters of a backward that never comes. Left in flight, the start-of-forward hook of the
        first generated token released them inside the gather; the next read of such a parameter then
        gathered it again through DeepSpeed's external-parameter discovery, which registers it on the
        innermost module in DeepSpeed's process-global forward stack: with no hooked module running,
        that is the root of the last engine built, a DPO run's frozen reference. The reference's next
        forward then fetched 6 of the policy's parameters its trace did not hold ("tracing error at
        step 0 ... expected the next 6 parameters in the parameter fetch queue": the tiny_dpo recipe
        at the first step after its second round of samples)."""
        engine = _deepspeed_engine(model)
        if self.zero_stage < 3 or engine is None:
            with super().whole_weights(accelerator, model) as whole:
                yield whole
            return
        import deepspeed

        offload = engine.optimizer.parameter_offload
        engine.empty_partition_cache()  # every fetched or in-flight parameter released
        module = offload.module
        start_of_forward = module._forward_pre_hooks[offload.fwd_pre_hook.id]
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            for p in module.parameters():
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield module
            finally:
                # the same hooks in the same order as the engine registered them; re-registering
                # invalidates the fetch trace, so the next forward records it again
                offload.fwd_pre_hook = module.register_forward_pre_hook(start_of_forward)
                offload._register_deepspeed_module(module)

    def gathered_bytes(self, model):
        """ZeRO-3: the whole model in its partitions' dtype."""
        engine = _deepspeed_engine(model)
        if self.zero_stage < 3 or engine is None:
            return 0
        return sum(p.ds_numel * p.ds_tensor.element_size() for p in engine.module.parameters())

    @property
    def reference_sharded(self):
        return self.zero_stage == 3

    def wrap_reference(self, accelerator, model):
        """ZeRO-3: partitioned as the policy is (from_pretrained read it under zero.Init), in an engine of
        its own with the policy's ZeRO-3 settings and no optimizer, as TRL's prepare_deepspeed does."""
        if self.zero_stage < 3:
            return super().wrap_reference(accelerator, model)
        import copy

        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    def gather_trainable(self, accelerator, named):
        if self.zero_stage < 3:
            return super().gather_trainable(accelerator, named)
        import deepspeed

        out = {}
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            if accelerator.is_main_process:
                out = {n: p.detach().to("cpu", copy=True) for n, p in named}
        return out


class Fsdp(Strategy):
    """PyTorch FSDP (version 2 by default): parameters, gradients and optimizer states sharded per layer."""
    name = "fsdp"
    launcher_switch = "ACCELERATE_USE_FSDP"
    shards_params = shards_grads = shards_optimizer = True

    def offload(self, setup, params, grads, optimizer, trained, grad_bytes, world_size):
        if setup.offload_params == "cpu":
            return 0.0, 0.0, 0.0, {"cpu": params + grads + optimizer, "nvme": 0.0}
        return super().offload(setup, params, grads, optimizer, trained, grad_bytes, world_size)

    def buffers(self, arch, setup, trained, grad_bytes, world_size, compute_bytes, sixteen, layer, layer_trained):
        lp = compute_bytes
        root = arch.embedding_parameters + arch.lm_head_parameters + arch.hidden_size
        buffers = (root + 2 * layer) * lp + max(layer_trained, 0) * lp
        if setup.offload_params == "none":
            buffers += 4 * trained / world_size  # torch AdamW's foreach temporary (on the CPU when offloaded)
        return buffers

    def gpu_only_problem(self, recipe):
        if recipe.fsdp_version == 1:
            return "fsdp_version=1 needs CUDA GPUs (PyTorch's FSDP1 will not run on CPU); use fsdp_version=2"
        return None

    def plugins(self, plan, config):
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        return {"fsdp_plugin": _fsdp_plugin(plan, no_split_modules(config))}

    def start_cpu_group(self):
        from accelerate import DistributedType, PartialState

        state = PartialState(backend="gloo")
        # Accelerate enables FSDP only for GPU-like types; FSDP itself runs on CPU tensors.
        state.distributed_type = DistributedType.MULTI_GPU

    def autocast_handlers(self, recipe):
        if recipe.fsdp_version == 2 and recipe.mixed_precision != "no":
            from accelerate.utils import AutocastKwargs

            return [AutocastKwargs(enabled=False)]  # FSDP2's policy casts (fsdp2_mixed_precision)
        return []

    def reads_weights(self, accelerator):
        """Only rank 0: the others build a meta-device skeleton and receive their shards when the model
        is prepared, so no node holds one full copy per process in CPU RAM."""
        return accelerator.is_main_process

    shares_quantized_layers = True

    def prepare_4bit(self, model, device):
        """Before FSDP2 shards a 4-bit base: each Linear4bit's weight becomes a plain frozen Parameter
        holding the packed NF4 bits, and its quantization constants stay on the module (`quant_state`),
        on the run's device.

        Accelerate treats a model with bitsandbytes' Params4bit as one every rank loaded in full: it would
        skip the rank-0 load and broadcast and shard what each rank holds, so the meta skeletons of ranks
        other than 0 would never get weights. As plain parameters they are broadcast and sharded like any
        other (the packed bits in the training dtype, see model._load_4bit). At each forward, FSDP puts the
        gathered weight back on the module and bitsandbytes' Linear4bit re-attaches the module's
        quant_state to it (fix_4bit_weight_quant_state_from_module, which bitsandbytes has for FSDP)."""
        import bitsandbytes as bnb
        import torch

        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                state = module.weight.quant_state if module.weight.quant_state is not None else module.quant_state
                state.to(device)
                module.quant_state = state
                module.weight = torch.nn.Parameter(module.weight.data, requires_grad=False)

    def save_state(self, accelerator, directory, lora):
        with adapter_only_fsdp(lora):
            accelerator.save_state(str(directory))

    def load_state(self, accelerator, directory, lora):
        with adapter_only_fsdp(lora):
            accelerator.load_state(str(directory))

    @contextmanager
    def whole_weights(self, accelerator, model):
        """FSDP2: each FSDP module keeps its parameters unsharded after its first forward
        (set_reshard_after_forward(False)) and is resharded at the end. FSDP1: called through its
        wrapper, which gathers per forward (at every token)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            saved = [[g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups] for m in units]
            auto = [m._get_fsdp_state()._auto_reshard_after_forward for m in units]
            model.set_reshard_after_forward(False)
            try:
                yield model
            finally:
                for m, infos, a in zip(units, saved, auto):
                    m.reshard()
                    state = m._get_fsdp_state()
                    state._auto_reshard_after_forward = a
                    for g, info in zip(state._fsdp_param_groups, infos):
                        g.post_forward_mesh_info = info
            return
        if type(model).__name__ == "FullyShardedDataParallel":  # FSDP1
            yield model
            return
        yield accelerator.unwrap_model(model)

    def gathered_bytes(self, model):
        """FSDP2: the whole model in the mixed-precision policy's param_dtype, else the parameters' own."""
        import torch
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return 0
        dtype = model._get_fsdp_state()._mp_policy.param_dtype
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
        return sum(p.numel() * (size or p.element_size()) for p in model.parameters())

    def after_prepare(self, accelerator, model, optimizer):
        _point_optimizer_at(optimizer.optimizer, accelerator.unwrap_model(model))

    reference_sharded = True

    def wrap_reference(self, accelerator, model):
        """FSDP2: fully_shard'ed on the policy's mesh with its units, mixed precision and offload
        (Accelerate's own fsdp2_prepare_model: rank 0 read the weights and broadcasts the shards); not
        handed to the Accelerator, so its checkpoints never hold it."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)


def _deepspeed_engine(model):
    return model if hasattr(model, "optimizer") and hasattr(model, "zero_optimization_stage") else None


def strategy_for(name: str) -> Strategy:
    """The strategy object of a recipe's `strategy` value."""
    if name == "ddp":
        return Ddp()
    if name == "fsdp":
        return Fsdp()
    if name in ("zero1", "zero2", "zero3"):
        return Zero(int(name[-1]))
    raise ValueError(f"unknown strategy {name!r}")


def final_in_training_dtype(recipe: dict) -> bool:
    """Whether final/ of the run with this recipe.json holds 16-bit weights (a DeepSpeed run in bf16 or
    fp16), which an export or a model rebuilt from its checkpoints then matches."""
    name = recipe.get("strategy")
    return bool(name) and strategy_for(name).final_in_training_dtype and recipe.get("mixed_precision") in (
        "bf16", "fp16")


def running_strategy(accelerator) -> Strategy:
    """The strategy a live Accelerator runs (for code that has the Accelerator but not the plan)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        return Zero(int(plugin.zero_stage))
    if getattr(accelerator.state, "fsdp_plugin", None) is not None:
        return Fsdp()
    return Ddp()


def no_split_modules(config) -> list[str]:
    """The decoder-layer class names, which FSDP wraps as its units."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = list(getattr(skeleton, "_no_split_modules", None) or [])
    if not names:
        raise RecipeError(f"model type {config.model_type} does not name its decoder layers (_no_split_modules); "
                          "FSDP cannot tell what to wrap: use a ZeRO strategy")
    return names


# ---------------------------------------------------------------- the weights of each strategy


@contextmanager
def adapter_only_fsdp(enabled: bool):
    """Accelerate's FSDP save/load with adapter_only=True, so that a LoRA checkpoint holds the adapter
    (and its optimizer state) but not the frozen base, which every run reloads from the model."""
    if not enabled:
        yield
        return
    import functools

    import accelerate.accelerator as accelerator_module

    saved = accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model
    accelerator_module.save_fsdp_model = functools.partial(saved[0], adapter_only=True)
    accelerator_module.load_fsdp_model = functools.partial(saved[1], adapter_only=True)
    try:
        yield
    finally:
        accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model = saved


def _keep_trainable_weights(models, weights, output_dir) -> None:
    """Accelerate save_state hook for DDP LoRA runs: write the adapter, not the frozen base."""
    for i, model in enumerate(models):
        inner = getattr(model, "module", model)
        trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
        if i < len(weights) and trainable:
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable}


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

    counts = {}  # per device, read back once each (a CPU-offloaded shard lives apart from the GPU's)
    for t in updated_weights(optimizer):
        if t.numel():
            n = (~torch.isfinite(t.detach())).sum()
            counts[n.device] = counts.get(n.device, 0) + n
    return sum((n.cpu() for n in counts.values()), torch.zeros((), dtype=torch.int64))


# ---------------------------------------------------------------- building the run's parts


def deepspeed_config(plan, hidden_size: int) -> dict:
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
        # DeepSpeed counts every rank as data parallel (it is not given the sequence-parallel groups)
        "train_batch_size": r.micro_batch_size * plan.grad_accum * plan.world_size,
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
    would round it to 8 bits of mantissa, and the loss check would refuse the run ("llama changes the
    logits after its output layer")."""
    if mixed_precision == "no":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=None)


def _fsdp_plugin(plan, no_split_modules: list[str]):
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

    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_lr_factor, kind=recipe.lr_scheduler,
                                                                warmup=recipe.warmup_steps, total=total_steps))


def build_optimizer_and_scheduler(plan, model, total_steps: int):
    """AdamW, sharded or offloaded as the strategy says, and a step-based LR schedule."""
    from accelerate.utils import DummyOptim, DummyScheduler

    r = plan.recipe
    groups = _param_groups(model, r.weight_decay)
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
