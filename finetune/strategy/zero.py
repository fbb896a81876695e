"""DeepSpeed ZeRO: Zero for stages 1 (optimizer states sharded) and 2 (+ gradients), Zero3 (+ parameters)
where stage 3 differs: parameter offload, the buffers, gathering the partitioned weights (samples,
the adapter at the end), the DPO reference in an engine of its own, a 4-bit base, tiled MLPs.

The DeepSpeed config is built here, complete: nothing left as "auto", so what runs is what is written.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from finetune.distributed import no_shared_memory_allreduce
from finetune.strategy.base import Strategy


class Zero(Strategy):
    """DeepSpeed ZeRO stage 1 (optimizer states sharded) or 2 (+ gradients); Zero3 below adds parameters."""
    launcher_switch = "ACCELERATE_USE_DEEPSPEED"
    shards_optimizer = True
    converts_on_world_size_change = True
    final_in_training_dtype = True
    takes_4bit_base = False

    def __init__(self, stage: int):
        self.zero_stage = stage
        self.name = f"zero{stage}"
        self.shards_grads = stage >= 2

    def start_cpu_group(self) -> None:
        no_shared_memory_allreduce()
        super().start_cpu_group()

    def state_bytes(self, mixed_precision):
        # 16-bit engine: bf16/fp16 weights and gradients, fp32 master + Adam m, v. In fp32 DeepSpeed
        # still clones an fp32 master partition (ZeRO-3 means to reuse the partition when the dtypes
        # agree, but compares a torch.device with a string and never does; seen with deepspeed 0.19).
        return (2, 2, 12) if mixed_precision != "no" else (4, 4, 12)

    def paper_model_states(self, mixed_precision, params, world_size):
        """The paper's bytes per parameter, (weights, gradients, optimizer) = (2, 2, 12) in mixed precision,
        (4, 4, 8) in fp32: those this stage shards count 1/world_size, the others whole."""
        weights, grads, optimizer = (2, 2, 12) if mixed_precision != "no" else (4, 4, 8)
        sharded = optimizer + (grads if self.shards_grads else 0) + (weights if self.shards_params else 0)
        return (weights + grads + optimizer - sharded) * params + sharded * params / world_size

    def step_collectives(self, s):
        """The gradients all-reduced in buckets (DeepSpeed's use_multi_rank_bucket_allreduce, on by default),
        each rank keeping its partition: ZeRO-2 in each micro-batch's backward, ZeRO-1 once at the step's
        end (counted: finetune/collectives.py); after the step the updated weights all-gathered. In the
        engine's dtype."""
        n, lp = s.gpus, s.compute_bytes
        reductions = s.micro_batches if self.shards_grads else 1
        return [("all_reduce", n, s.spans_nodes(n), reductions * s.trained * lp),
                ("all_gather", n, s.spans_nodes(n), s.trained * lp)]

    def offload(self, setup, params, grads, optimizer, trained, grad_bytes, world_size):
        off = {"cpu": 0.0, "nvme": 0.0}
        if setup.offload_optimizer != "none" and self.shards_grads:  # counted from stage 2 on
            off[setup.offload_optimizer] += optimizer
            # CPU Adam steps on an fp32 gradient partition in (pinned) CPU memory; ZeRO-3 also keeps its
            # gradient accumulation buffer (gradient dtype) there.
            off["cpu"] += trained * (4 + (grad_bytes if self.shards_params else 0)) / world_size
            grads = optimizer = 0.0
        return params, grads, optimizer, off

    def buffers(self, arch, setup, trained, grad_bytes, world_size, compute_bytes, sixteen, layer, layer_trained):
        lp = compute_bytes
        h2 = arch.hidden_size ** 2
        buffers = 2 * reduce_bucket(arch.hidden_size) * lp  # the reduce bucket, doubled when communication overlaps
        if sixteen and setup.offload_optimizer == "none":
            buffers += 4 * trained / world_size  # fp32 gradient partition for the optimizer step
        return buffers

    def zero_optimization(self, plan, hidden_size: int) -> dict:
        """The config's zero_optimization section, offload aside (deepspeed_config adds it)."""
        h2 = hidden_size * hidden_size
        return {
            "stage": self.zero_stage,
            "overlap_comm": plan.device == "cuda",
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": reduce_bucket(hidden_size),
            "allgather_bucket_size": max(h2, 5 * 10**7),
        }

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


class Zero3(Zero):
    """DeepSpeed ZeRO stage 3: parameters, gradients and optimizer states partitioned over the ranks."""
    shards_params = shards_grads = True
    takes_4bit_base = True
    tiles_mlp = True
    offloads_optimizer_to_nvme = True
    reference_sharded = True

    def __init__(self):
        super().__init__(3)

    def step_collectives(self, s):
        """Per micro-batch the forward gathers every parameter and the backward gathers them again; the
        gradients are reduce-scattered over all GPUs. With hpZ only the step's first gather reads the
        primary partition (over all GPUs); it also fills the secondary copy, from which every later gather
        of the step comes, within its group. (Counted, finetune/collectives.py: a run that never evaluates
        may keep a small model gathered from the forward to the backward, stage3_max_live_parameters
        allowing; the first step after an eval re-records the fetch trace and gathers twice from the
        secondary copy; neither is modelled.)"""
        n, a = s.gpus, s.micro_batches
        # the reference's forwards, the rollout's gathered model, the policy's forwards without a backward
        once = (s.reference_forwards + s.whole_gathers + s.policy_forwards) * s.whole
        gathers = 2 * a * s.whole + once
        if s.hpz_size > 1:
            out = [("all_gather", n, s.spans_nodes(n), s.whole),
                   ("all_gather", s.hpz_size, s.spans_nodes(s.hpz_size), gathers - s.whole)]
        else:
            out = [("all_gather", n, s.spans_nodes(n), gathers)]
        return out + [("reduce_scatter", n, s.spans_nodes(n), a * s.trained * s.compute_bytes)]

    def extra_param_bytes(self, setup, params, compute_bytes):
        """hpZ keeps a second copy of the parameters, sharded within its group (in the compute dtype)."""
        size = getattr(setup, "hpz_size", 1)
        return params * compute_bytes / size if size > 1 else 0.0

    def compile_problem(self, recipe):
        return ("compile=true with strategy=zero3: ZeRO-3 gathers every weight in a hook before each "
                "Linear and norm, which breaks the compiled layer into pieces at each of them (no fusion, "
                "slower than without compile); use strategy=fsdp, which shards like ZeRO-3, or "
                "compile=false")

    def offload(self, setup, params, grads, optimizer, trained, grad_bytes, world_size):
        params, grads, optimizer, off = super().offload(setup, params, grads, optimizer, trained, grad_bytes,
                                                        world_size)
        if setup.offload_params != "none":
            off[setup.offload_params] += params
            params = 0.0
        return params, grads, optimizer, off

    def buffers(self, arch, setup, trained, grad_bytes, world_size, compute_bytes, sixteen, layer, layer_trained):
        lp = compute_bytes
        h2 = arch.hidden_size ** 2
        unit = max(layer, arch.embedding_parameters)
        buffers = 2 * unit * lp + max(layer_trained, 0) * lp + reduce_bucket(arch.hidden_size) * lp
        if sixteen and setup.offload_optimizer == "none":
            buffers += 4 * min(trained / world_size, 10**9)  # fp32 gradient of one optimizer sub-group
        return buffers

    def layout_problem(self, recipe, world_size, machines):
        """hpZ's secondary groups split the processes evenly: DeepSpeed asserts "N is not divisible by G"
        in every rank otherwise, and on fewer processes than G quietly makes one group of them all."""
        size = recipe.zero_hpz_partition_size
        if size > 1 and world_size % size:
            sizes = [g for g in range(2, world_size + 1) if world_size % g == 0]
            use = f"one of {', '.join(map(str, sizes))} (usually one node's GPUs)" if sizes else "none here"
            return (f"zero_hpz_partition_size={size} with {world_size} process(es): hpZ's groups must divide the "
                    f"processes; use {use}, or zero_hpz_partition_size=1 (no hpZ)")
        return None

    def option_problem(self, recipe):
        if recipe.mics_shard_size:
            return (f"mics_shard_size={recipe.mics_shard_size}: MiCS was removed from DeepSpeed in 0.19 "
                    "(deepspeedai/DeepSpeed#8489; 0.19.8 refuses the key); use strategy=hsdp (shard within a node, "
                    "replicate across nodes) or mics_shard_size=0")
        return super().option_problem(recipe)

    def zero_optimization(self, plan, hidden_size):
        h2 = hidden_size * hidden_size
        section = super().zero_optimization(plan, hidden_size)
        if plan.recipe.zero_hpz_partition_size > 1:
            section["zero_hpz_partition_size"] = plan.recipe.zero_hpz_partition_size
        section["allgather_bucket_size"] = h2
        section.update({
            "stage3_prefetch_bucket_size": int(0.9 * h2),
            "stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_max_live_parameters": 10**9,
            "stage3_max_reuse_distance": 10**9,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
        return section

    @contextmanager
    def whole_weights(self, accelerator, model):
        """`deepspeed.zero.GatheredParameters` over every parameter, with all of the engine's
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
        if engine is None:
            with super().whole_weights(accelerator, model) as whole:
                yield whole
            return
        import deepspeed

        offload = engine.optimizer.parameter_offload
        # every fetched or in-flight parameter released; the optimizer's call, not the engine's, which adds a
        # full gc.collect() (2.6 of a 3.3 s rollout on CPU: bench/studies/grpo_vs_trl.py) and an empty_cache
        offload.empty_partition_cache()
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

    def weight_buckets(self, accelerator, model, layers: int):
        """ZeRO-3: a bucket's partitions gathered (deepspeed.zero.GatheredParameters, a collective) while it is
        read, then released; the parameters an eval prefetched released first, as in whole_weights."""
        engine = _deepspeed_engine(model)
        if engine is None:
            yield from super().weight_buckets(accelerator, model, layers)
            return
        import deepspeed

        from finetune.strategy.base import layer_buckets

        engine.optimizer.parameter_offload.empty_partition_cache()
        for bucket in layer_buckets(list(engine.module.named_parameters()), layers):
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                yield [(name, p.data) for name, p in bucket]

    def gathered_bytes(self, model):
        """The whole model in its partitions' dtype."""
        engine = _deepspeed_engine(model)
        if engine is None:
            return 0
        return sum(p.ds_numel * p.ds_tensor.element_size() for p in engine.module.parameters())

    def wrap_reference(self, accelerator, model):
        """Partitioned as the policy is (from_pretrained read it under zero.Init), in an engine of its own
        with the policy's ZeRO-3 settings and no optimizer, as TRL's prepare_deepspeed does."""
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
        import deepspeed

        out = {}
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            if accelerator.is_main_process:
                out = {n: p.detach().to("cpu", copy=True) for n, p in named}
        return out


# Every ZeRO stage reduces the gradients one collective per bucket of reduce_bucket_size elements (ZeRO-3
# reduce-scatters at every micro-batch's backward, zero1/2 at the accumulation boundary), and a
# parameter larger than the room left starts a new bucket: at hidden_size^2 (Hugging Face's "auto") a
# small model reduces almost every weight on its own (19 collectives a micro-batch for the 2-layer tiny
# Llama, hidden 64, where 1 does; each a wait for every rank). On 2 loaded cores: a tiny_grpo zero3
# step 0.48 -> 0.35 s; tiny_zero2 1,366-1,753 -> 3,163-3,228 tokens/s, tiny_zero1 2,127-2,500 ->
# 3,254-3,428 (two alternated runs each). Models from hidden 1000 up keep hidden^2; the floor's buffer
# is 4 MB in fp32. With 2 ranks every gradient element is the same a + b in any bucket: metrics,
# rollouts and final weights are identical with either size (scripts/compare_runs.py, cmp); with more
# ranks the summation order of an element may follow its place in the bucket (last bits).
REDUCE_BUCKET_MIN = 10**6


def reduce_bucket(hidden_size: int) -> int:
    """reduce_bucket_size in elements, every stage: hidden_size^2, at least REDUCE_BUCKET_MIN."""
    return max(hidden_size * hidden_size, REDUCE_BUCKET_MIN)


def _deepspeed_engine(model):
    return model if hasattr(model, "optimizer") and hasattr(model, "zero_optimization_stage") else None


def deepspeed_config(plan, hidden_size: int) -> dict:
    """A complete DeepSpeed config: nothing left as "auto", so what runs is what is written here."""
    r = plan.recipe
    zero = plan.strategy.zero_optimization(plan, hidden_size)
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
