"""PyTorch FSDP (FSDP2 by default, FSDP1 on GPUs): parameters, gradients and optimizer states sharded
per decoder layer; the Accelerate plugin, the mixed-precision policy and the adapter-only checkpoints."""

from __future__ import annotations

import os
from contextlib import contextmanager

from finetune.errors import RecipeError
from finetune.strategy.base import Strategy


class Fsdp(Strategy):
    """PyTorch FSDP (version 2 by default): parameters, gradients and optimizer states sharded per layer."""
    name = "fsdp"
    launcher_switch = "ACCELERATE_USE_FSDP"
    shards_params = shards_grads = shards_optimizer = True
    saves_with_dcp = True

    tiles_mlp = True
    optimizer_offload_fix = "offload_params=cpu (FSDP then runs the optimizer on the CPU)"
    checkpoint_format = "fsdp"  # DCP shards, for hsdp too: they load on any mesh

    def offload_problem(self, recipe):
        if recipe.offload_params == "nvme":
            return ("offload_params=nvme with strategy=fsdp: FSDP offloads to cpu only; use offload_params=cpu "
                    "or strategy=zero3")
        return super().offload_problem(recipe)

    def quantized_base_problem(self, recipe):
        if recipe.load_in_4bit and recipe.fsdp_version == 1:
            return ("load_in_4bit=true with fsdp_version=1: the 4-bit base is sharded by FSDP2 only; "
                    "use fsdp_version=2")
        return None

    def compile_problem(self, recipe):
        if recipe.load_in_4bit:
            return ("compile=true with load_in_4bit=true and strategy=fsdp: bitsandbytes re-attaches each "
                    "sharded 4-bit weight's quantization state inside the layer, which breaks the compiled "
                    "graph at every Linear (slower than without compile); use compile=false, or strategy=ddp")
        if recipe.fsdp_version == 1:
            return ("compile=true with fsdp_version=1: compiled layers are tested under FSDP2 only; use "
                    "fsdp_version=2 or compile=false")
        return None

    def frozen_reference_problem(self, recipe):
        if recipe.fsdp_version == 1:
            return "fsdp_version=1: the frozen reference is sharded by FSDP2 only; use fsdp_version=2"
        return None

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

    def step_collectives(self, s):
        """Each micro-batch gathers every unit in its forward and again in its backward, but the root
        (kept gathered between the two); the fp32 gradients are reduce-scattered once per step (the other
        micro-batches accumulate unsharded: Accelerate's no_sync)."""
        n = self.sharding_group(s, s.gpus, s.gpus_per_node)
        # a frozen reference's forwards: every unit once but its root, which stays gathered from the first
        # (never resharded: no backward); the rollout's gathered model and the policy's forwards without
        # a backward (GRPO's old log-probs): every unit once
        once = s.reference_forwards * (s.whole - s.root_bytes) + (s.whole_gathers + s.policy_forwards) * s.whole
        out = [("all_gather", n, s.spans_nodes(n), s.micro_batches * (2 * s.whole - s.root_bytes) + once),
               ("reduce_scatter", n, s.spans_nodes(n), s.trained * 4)]
        if n < s.gpus:  # hsdp: the gradient shard all-reduced among the replicas
            out.append(("all_reduce", s.gpus // n, s.nodes > 1, s.trained * 4 / n))
        return out

    def gpu_only_problem(self, recipe):
        if recipe.fsdp_version == 1:
            return "fsdp_version=1 needs CUDA GPUs (PyTorch's FSDP1 will not run on CPU); use fsdp_version=2"
        return None

    def plugins(self, plan, config):
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        return {"fsdp_plugin": fsdp_plugin(plan, no_split_modules(config))}

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

    def weight_buckets(self, accelerator, model, layers: int):
        """FSDP2: each parameter of a bucket gathered from its shards (DTensor.full_tensor, a collective),
        in the parameters' own dtype (the fp32 masters), one bucket at a time."""
        from torch.distributed.tensor import DTensor

        from finetune.strategy.base import layer_buckets

        for bucket in layer_buckets(list(accelerator.unwrap_model(model).named_parameters()), layers):
            yield [(name, p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()) for name, p in bucket]

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


def fsdp_plugin(plan, no_split_modules: list[str]):
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


def _point_optimizer_at(optimizer, model) -> None:
    """Re-point the optimizer at the sharded parameters by name.

    Accelerate maps old to new parameters by storage address, and ranks that built the model on the
    meta device (all but rank 0, see model.load_model) have no addresses to tell parameters apart.
    The optimizer holds no state yet, so swapping the references is all it takes.
    """
    named = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [named[name] for name in group["param_names"]]


class Hsdp(Fsdp):
    """FSDP2 hybrid sharding: the model sharded within groups of `shard_size` GPUs (one node's by
    default) and replicated across the groups, on a 2-D device mesh (replicate x shard) that
    Accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size) builds. Each layer's all-gathers
    and reduce-scatters stay inside a group (a node's fast links); what crosses nodes is one
    all-reduce per step of each GPU's gradient shard among the GPUs holding the same shard.

    Everything else is fsdp's (offload, LoRA/QLoRA, the sharded DPO reference on the same mesh, the
    gathered GRPO rollout) and so are its checkpoints: DCP shards, which load on any layout (fsdp or
    hsdp, any number of processes; checkpoint_format)."""
    name = "hsdp"

    def layout_problem(self, recipe, world_size, machines):
        shard = hsdp_shard_size(recipe, world_size, machines)
        where = f"shard_size={recipe.shard_size}" if recipe.shard_size else \
            f"shard_size=0 (one node's GPUs: {world_size} processes / {machines} machine(s) = {shard})"
        if shard < 1 or world_size % shard:
            return (f"strategy=hsdp with {where}: the shard groups must divide the {world_size} processes; use a "
                    f"shard_size that divides {world_size}")
        if shard == 1 and world_size > 1:
            return (f"strategy=hsdp with {where}: groups of one GPU shard nothing (that is ddp); use a shard_size "
                    "of at least 2, or strategy=ddp")
        if recipe.fsdp_version != 2:
            return "strategy=hsdp with fsdp_version=1: hybrid sharding is built on FSDP2's 2-D mesh; use fsdp_version=2"
        if recipe.sequence_parallel > 1:
            return (f"strategy=hsdp with sequence_parallel={recipe.sequence_parallel}: not tried together; use "
                    "strategy=fsdp or sequence_parallel=1")
        return None

    def layout_text(self, recipe, world_size, machines):
        shard = hsdp_shard_size(recipe, world_size, machines)
        if shard >= world_size:
            return f" (one copy sharded over all {world_size} process(es): flat fsdp)"
        return f" ({world_size // shard} replicas, each sharded over {shard} GPUs)"

    def sharding_group(self, setup, world_size, gpus_per_node):
        return min(world_size, getattr(setup, "shard_size", 0) or gpus_per_node)

    def plugins(self, plan, config):
        from accelerate.parallelism_config import ParallelismConfig

        shard = hsdp_shard_size(plan.recipe, plan.world_size, plan.num_machines)
        kwargs = super().plugins(plan, config)
        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=plan.world_size // shard,
                                                         dp_shard_size=shard)
        return kwargs


def hsdp_shard_size(recipe, world_size: int, machines: int) -> int:
    """The GPUs that shard one copy of the model: recipe.shard_size, or 0 for one node's GPUs."""
    return recipe.shard_size or max(1, world_size // max(1, machines))
