"""Per-GPU memory: what a recipe will need before anything is loaded, and what a live run holds.

Estimate (no model loaded, no GPU needed)
-----------------------------------------
1. Parameters, counted exactly from the model's config: transformers builds the model from it on the
   meta device (no memory, no weights) and the planner counts what is there (`measure`): every
   family transformers knows, with its own layout (Phi-3's fused qkv_proj/gate_up_proj, Gemma's four
   norms per layer, Qwen3's q/k norms, a mixture of experts' experts and router, tied embeddings
   once), the largest decoder layer (FSDP and ZeRO-3 gather one at a time), and every Linear a LoRA
   adapter can sit on. Where transformers cannot build it (published numbers from the table below,
   an unknown model_type) the count is the formula of a Llama/Mistral/Qwen2-style decoder
   (`Architecture.num_parameters`): embeddings V*h; per layer q/k/v/o with grouped-query attention
   (k and v have kv_heads*head_dim outputs), gate/up/down of the SwiGLU MLP, two RMSNorms; a final
   RMSNorm; lm_head V*h unless tied. Qwen2 adds q/k/v biases (`attention_bias`).

2. Model states, the ZeRO paper's accounting (arXiv:1910.02054 section 3.1): Adam keeps 16 bytes per trained parameter, split
   2 P weights + 2 P gradients + 12 P (fp32 master, momentum, variance) in 16-bit mixed precision,
   4 P + 4 P + 8 P in fp32 (`mixed_precision=no`). Per GPU with N data-parallel ranks:

       ddp 16 P | zero1 4 P + 12 P/N | zero2 2 P + 14 P/N | zero3, fsdp 16 P/N   (16-bit)
       ddp 16 P | zero1 8 P +  8 P/N | zero2 4 P + 12 P/N | zero3, fsdp 16 P/N   (fp32)

   `paper_model_states` is exactly that table. `estimate` splits the same bytes the way this
   toolkit holds them, which differs from the paper's split in three documented places:
   - ddp and fsdp keep fp32 weights and gradients also under bf16/fp16 (Accelerate autocasts DDP;
     FSDP's MixedPrecisionPolicy casts each gathered layer): 4 P + 4 P + 8 P, same total, so the
     sharded-optimizer DDP (torch ZeroRedundancyOptimizer) is 8 P + 8 P/N, not 4 P + 12 P/N;
   - DeepSpeed clones an fp32 master partition also when training in fp32: optimizer 12 P/N
     instead of 8 P/N for zero1/2/3 (measured with held_bytes, deepspeed 0.19);
   - LoRA: the frozen base is loaded in the training precision (model.base_dtype: 2 bytes per
     parameter under bf16/fp16, 4 in fp32) and sharded by zero3/fsdp; the adapters are fp32 and only
     they have gradients and optimizer states.
   - QLoRA (load_in_4bit): the decoder layers' Linear weights are NF4, 0.5 byte per weight sharded
     by zero3/fsdp (replicated by ddp), plus 1/64 + 1/4096 byte per weight of quantization constants
     that every rank keeps whole (see estimate).
   Offload moves states off the GPU: `offload_optimizer` (zero2/zero3) moves the optimizer states to
   CPU (or NVMe) and the gradient partition to CPU, as fp32 for CPU Adam (ZeRO-3 also keeps its
   gradient buffer there: 2 + 4 bytes per parameter / N in 16-bit), `offload_params` (zero3) the
   parameter partition; FSDP with `offload_params=cpu` keeps parameters, gradients and optimizer on
   the CPU.

3. Activations, per GPU (not sharded by any strategy; divided by sequence_parallel=N, which splits
   every row), counted tensor by tensor on transformers' Llama decoder layer rather than taken from
   Korthikanti et al.'s GPT formula (arXiv:2205.05198: 34*B*T*h + 5*B*a*T^2 bytes per layer in
   16-bit, for a 4h GeLU MLP and dropout). With t = B*T/N tokens per rank and p bytes per element
   of the compute dtype (2 in bf16/fp16, 4 in fp32):

       one layer keeps  t * (2*(4 + 2p)*h  +  p*(2*q + 2*kv) + 4*a  +  4*p*i)      (layer_bytes_per_token)
                        its two RMSNorms (the fp32 upcast, the normalised input, the output), q, k, v
                        and the attention output with the kernel's fp32 log-sum-exp, the SwiGLU MLP's
                        gate, up, activation and product (q = a*head_dim, kv = kv_heads*head_dim,
                        i = intermediate size)
       attention scores: none under sdpa and flash_attention_2 (memory-efficient kernels allocate no
                        T^2 matrix; measured on CPU, the Ulysses-gathered heads take SDPA's flash kernel);
                        eager keeps each layer's softmax, (a/N)*B*T^2 * (4 + 2 in 16-bit) bytes, and a
                        float causal mask B*T^2*p

       kept for the backward:  without checkpointing  L * one layer + the final norm's tensors
                               with checkpointing     L * p*h*t (each layer's input) + the final norm's
                               with activation_offload those live in CPU memory (the cpu column)
       plus the larger of      the loss's working set at the end of the forward: one chunk of fp32
                               logits (loss_rows; plus their 16-bit matmul output in 16-bit: 6 bytes
                               per logit), the fp32 gradient of lm_head (V*h*4, not with LoRA) and the
                               last hidden states' gradient; with loss_impl=full all B*T rows' logits,
                               their fp32 log-softmax and its gradient (p + 8 bytes per logit)
                       and     one layer's backward: its recomputed activations with checkpointing,
                               the first gradients it makes (one [t, i], one [t, h]; each saved tensor
                               is freed as its node runs) and the eager scores'

   Measured against torch's own count of the bytes a step allocates (bench/studies/activation_memory.py,
   docs/benchmarks.md section 11: a 20M Llama on CPU, fp32, 2K-16K tokens, SP 1 and 2, checkpointing
   off and with offload); not yet against a GPU. padding_free=true makes the micro-batch one row of at
   most B*T tokens, so every t term holds; its mask covers the whole row: (B*T)^2 instead of B*T^2
   (eager scores; a bool mask under sdpa), per example (varlen) under flash_attention_2. tiled_mlp's
   saving is not counted.

4. Buffers: what a strategy allocates beyond the model states (rough, stated so that it can be
   checked): ddp, a second copy of every gradient in DDP's reduction buckets (Accelerate leaves
   gradient_as_bucket_view off); zero1/2, two reduce buckets (h^2, at least 1e6 elements) and, in 16-bit, the fp32
   copy of the gradient partition made for the optimizer step; zero3, two gathered units (the
   current one and the prefetched one; a unit is a decoder layer or the embedding) in the compute
   dtype, one layer's unreduced gradients, the reduce bucket (h^2, at least 1e6 elements) and, in
   16-bit, the fp32 gradient of one optimizer sub-group (at most 1e9 elements); fsdp, the root unit
   (embeddings, lm_head, final norm, kept gathered through the step), two gathered decoder layers and
   one layer's unreduced gradients.
   ddp and fsdp add the one fp32 temporary that torch's foreach AdamW makes the size of the states
   it steps (4 bytes per trained parameter, / N where the optimizer is sharded).

5. GRPO's rollout phase (objective=grpo), before each step's forwards: the run generates every
   completion of its prompts on this rank in one batched KV-cache loop (finetune/generation.py), with
   the whole model gathered once for the phase (zero3, fsdp: Strategy.gathered_bytes, the whole model
   in the compute dtype; ddp, zero1 and zero2 hold it whole already). With R = the rank's completions
   (its prompts x num_generations: global_batch_size / data-parallel ranks x num_generations, or
   micro_batch_size x grad_accum without a global batch), P = the prompt tokens (max_prompt_len, else
   max_seq_len - max_completion_len) and S = P + max_completion_len (at most max_seq_len):

       KV cache:    R * S * 2 * L * kv_heads * head_dim * (2 in 16-bit, 4 in fp32)
       prefill:     34 * R * P * h (one layer's transients of the prompts' forward, no gradient kept;
                    the Korthikanti layer term without the scores, which sdpa does not keep)
       log-probs:   R * S * 4 per kept copy: the rollout's old log-probs (num_iterations > 1) and the
                    reference's (beta > 0), fp32, held from the rollout through the step's updates

   With generation_backend=vllm (finetune/vllm_engine.py) the rank's vLLM engine generates instead: it holds
   the whole model in the compute dtype and the KV cache of the rank's completions (the same bytes as above),
   at least, and on a GPU the share vllm_gpu_memory_utilization of it while awake (vLLM fills the share
   with KV blocks); during the step it keeps that much, or nothing with vllm_enable_sleep_mode (level 1:
   weights to CPU memory, KV cache freed). A push gathers vllm_push_layers decoder layers at a time (fp32
   masters) beside their copy in the engine's dtype: the push transient. Nothing is gathered for our
   generator then, and the trainer keeps its log-probs of the rollout and the importance weights (two
   fp32 copies). `finetune plan` with a budget counts the share; without one, the engine's minimum.

   The rollout's peak is model states + reference + gathered weights + KV cache + prefill + log-probs
   (the step's activations and buffers are freed then); the step's total adds the log-probs too. A setup
   fits when both do. beta > 0 holds the reference as DPO does (recipe.reference_kind): a frozen copy
   under a full fine-tune, the adapter disabled under LoRA.

The total is the plain sum of the columns. That is conservative: activations are freed before the
optimizer step's temporaries appear. Everything not counted (CUDA context, allocator fragmentation,
NCCL buffers) is what the headroom (10% by default) is for.

How the estimate compares with measured GPU memory (one H100, five setups) and with held_bytes
(every strategy, on CPU): docs/memory-planner.md.

What a live rank holds is measured by bench/helpers/held.py (held_bytes), beside the benchmarks that use it;
the architecture facts (parameter counts, shapes) are finetune/arch.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from finetune import objective_rules
from finetune.arch import Architecture, EstimateError, load_architecture
from finetune.recipe import Recipe, padding_free_scores, reference_kind
from finetune.strategy import strategy_for

GiB = 2**30
HEADROOM = 0.10
# QLoRA (model._load_4bit): NF4 packs two weights in a byte; double quantization keeps one 8-bit absmax
# per block of 64 weights and one fp32 absmax per 256 of those blocks (bitsandbytes' QuantState).
QUANT_PACKED = 0.5
QUANT_CONSTANTS = 1 / 64 + 4 / (64 * 256)
QUANT_TABLES = (16 + 256) * 4  # per quantized Linear: the NF4 code and the 8-bit absmax code, fp32



# ---------------------------------------------------------------- LoRA


def lora_parameters(arch: Architecture, r: int, targets=()) -> int:
    """Adapter parameters: r*(in + out) per targeted Linear (A is r x in, B is out x r), in every layer.
    No targets means the Linears finetune/model.py's lora_targets picks (every attention and MLP
    projection, fused ones included)."""
    if arch.linears is not None:
        names = list(targets) or list(arch.lora_default or ())
        known = sorted({n for n, *_ in arch.linears})
        total = 0
        for name in names:
            found = [(i, o, k) for n, i, o, k in arch.linears if n == name]
            if found:
                total += sum(k * r * (i + o) for i, o, k in found)
            elif name in ("lm_head", "embed_tokens"):
                total += r * (arch.vocab_size + arch.hidden_size)
            else:
                raise EstimateError(f"lora_target_modules: {name!r} is not a Linear in a {arch.model_type} decoder "
                                    f"layer ({', '.join(known + ['lm_head', 'embed_tokens'])})")
        return total
    proj = arch.projections()
    names = list(targets) or list(proj)
    total = 0
    for name in names:
        if name in proj:
            n_in, n_out, _ = proj[name]
            total += arch.num_hidden_layers * r * (n_in + n_out)
        elif name in ("lm_head", "embed_tokens"):
            total += r * (arch.vocab_size + arch.hidden_size)
        else:
            raise EstimateError(f"lora_target_modules: {name!r} is not a module the planner knows in a "
                                f"{arch.model_type} decoder ({', '.join(list(proj) + ['lm_head', 'embed_tokens'])})")
    return total


def recipe_lora(recipe: Recipe) -> tuple[bool, int, tuple]:
    """(lora on, r, targets)."""
    return recipe.lora, recipe.lora_r, tuple(recipe.lora_target_modules)


# ---------------------------------------------------------------- setups and formulas


@dataclass(frozen=True)
class Setup:
    """A strategy with its offload settings: one row of the planner's table."""
    strategy: str
    ddp_shard_optimizer: bool = False
    offload_optimizer: str = "none"
    offload_params: str = "none"
    shard_size: int = 0  # hsdp: the shard group (0: a node)
    hpz_size: int = 1  # zero3: hpZ's secondary partition group (1: none)

    @property
    def label(self) -> str:
        parts = [self.strategy + (" + sharded optimizer" if self.ddp_shard_optimizer else "")
                 + (f" shard {self.shard_size}" if self.shard_size else "")
                 + (f" + hpZ {self.hpz_size}" if self.hpz_size > 1 else "")]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        return ", ".join(parts)

    def overrides(self) -> dict:
        return {"strategy": self.strategy, "ddp_shard_optimizer": self.ddp_shard_optimizer,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params,
                "shard_size": self.shard_size, "zero_hpz_partition_size": self.hpz_size}

    @classmethod
    def of(cls, recipe: Recipe) -> "Setup":
        return cls(recipe.strategy, recipe.ddp_shard_optimizer, recipe.offload_optimizer, recipe.offload_params,
                   recipe.shard_size, recipe.zero_hpz_partition_size)


def setup_problem(recipe: Recipe, setup: Setup, world_size: int, machines: int = 1) -> str | None:
    """Why the run would refuse the recipe under `setup` on world_size processes over `machines` nodes
    (its strategy's layout_problem, which finetune.plan.make_plan asks before anything loads: shard
    groups or an hpZ group that do not divide the processes, ...), or None. The planner neither lists
    nor chooses a setup the run refuses."""
    from dataclasses import replace

    return strategy_for(setup.strategy).layout_problem(replace(recipe, **setup.overrides()), world_size, machines)


def own_setup_line(recipe: Recipe, world_size: int, machines: int = 1) -> str | None:
    """The planner's line where the run refuses the recipe's own setup here (it is then in no table row)."""
    own = Setup.of(recipe)
    problem = setup_problem(recipe, own, world_size, machines)
    return None if problem is None else (f"the recipe's setup ({own.label}): not listed, the run refuses it on "
                                         f"{world_size} GPU(s): {problem}")


# Cheapest first: least communication, then least offload. Setups with the same rank cost about the
# same; among those the recipe's own framework (DeepSpeed for zero*, PyTorch for ddp/fsdp) is preferred.
SETUPS: tuple[tuple[int, Setup], ...] = (
    (0, Setup("ddp")),
    (1, Setup("ddp", ddp_shard_optimizer=True)),
    (1, Setup("zero1")),
    (2, Setup("zero2")),
    (3, Setup("fsdp")),
    (3, Setup("zero3")),
    (4, Setup("zero2", offload_optimizer="cpu")),
    (5, Setup("zero3", offload_optimizer="cpu")),
    (6, Setup("fsdp", offload_params="cpu")),
    (6, Setup("zero3", offload_optimizer="cpu", offload_params="cpu")),
    (7, Setup("zero3", offload_optimizer="nvme", offload_params="nvme")),
)


def paper_model_states(strategy: str, mixed_precision: str, params: int, world_size: int) -> int:
    """Model-state bytes per rank exactly as the ZeRO paper gives them (arXiv:1910.02054 section 3.1)."""
    return strategy_for(strategy).paper_model_states(mixed_precision, params, world_size)


def state_bytes(strategy: str, mixed_precision: str) -> tuple[int, int, int]:
    """Bytes per trained parameter (weights, gradients, optimizer states) as this toolkit holds them."""
    return strategy_for(strategy).state_bytes(mixed_precision)


# finetune/loss.py's default chunk: the rows whose fp32 logits fit in CHUNK_BYTES (kept equal there;
# tests/test_memory.py checks it), here so that the planner needs no torch.
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_rows(vocab_size: int, tokens: int, loss_impl: str = "full", chunk_tokens: int = 0) -> int:
    """Token rows whose logits the loss holds at once: all of them for loss_impl=full, one chunk for
    the chunked loss (recipe.loss_chunk_tokens, else as many as fit LOSS_CHUNK_BYTES of fp32 logits)
    and for Liger's fused loss, which also works a chunk at a time."""
    if loss_impl == "full":
        return tokens
    return min(tokens, chunk_tokens or max(1, LOSS_CHUNK_BYTES // (4 * vocab_size)))


def layer_bytes_per_token(arch: Architecture, mixed_precision: str) -> int:
    """Bytes one Llama-style decoder layer keeps for its backward per token, as transformers' layer saves
    them (counted with saved-tensor hooks, bench/studies/activation_memory.py): each RMSNorm its input in fp32
    (the norm upcasts), the normalised input and its output (the next Linear's input) in the compute
    dtype; attention q, k, v and its output, and the kernel's fp32 log-sum-exp per head (sdpa and
    flash keep no scores: the eager scores are attention_scores_bytes); the gated MLP its gate and up
    outputs, the activation and their product (4 x intermediate). Rotary embeddings keep only the
    cos/sin tables (the weights are saved by reference, as parameters)."""
    p = 2 if mixed_precision != "no" else 4
    h, i, a = arch.hidden_size, arch.intermediate_size, arch.num_attention_heads
    q, kv = a * arch.head_size, arch.kv_heads * arch.head_size
    norms = 2 * (4 + 2 * p) * h
    attention = p * (2 * q + 2 * kv) + 4 * a
    return norms + attention + 4 * p * i


def activation_bytes(arch: Architecture, micro_batch_size: int, seq_len: int, mixed_precision: str,
                     activation_checkpointing: bool, loss_impl: str = "full", loss_chunk_tokens: int = 0,
                     one_row: bool = False, sequence_parallel: int = 1, attn_implementation: str = "sdpa",
                     activation_offload: bool = False, trained_head: bool = True) -> int:
    """The step's activation peak per GPU (this module's docstring, 3): what the forward keeps for the
    backward, plus the larger of the loss's working set (at the end of the forward) and one layer's
    backward (its recomputed activations with checkpointing, and the gradients it makes).

    t = B*T/N tokens per rank (sequence_parallel=N splits every row; Ulysses attends over the whole T
    with a/N heads, so every term is divided by N). attn_implementation: eager keeps each layer's
    softmax scores, a/N * B*T^2 (one_row: (B*T)^2, padding_free) in fp32 plus their compute-dtype copy,
    and a float causal mask; sdpa and flash_attention_2 keep no scores (a memory-efficient kernel:
    measured on CPU, the Ulysses-gathered heads take SDPA's flash kernel), only a bool mask under
    one_row. activation_offload (with checkpointing): the layer inputs and the final norm's tensors
    live in CPU memory (finetune/offload.py), the GPU keeps one layer's recompute."""
    b, t_row, h, layers = micro_batch_size, seq_len, arch.hidden_size, arch.num_hidden_layers
    n = sequence_parallel
    sixteen = mixed_precision != "no"
    p = 2 if sixteen else 4
    t = -(-b * t_row // n)  # tokens per rank
    per_layer = layer_bytes_per_token(arch, mixed_precision) * t
    square = (b * t_row) ** 2 if one_row else b * t_row * t_row
    scores = mask = 0
    if attn_implementation == "eager":
        scores = arch.num_attention_heads * square // n * (4 + (2 if sixteen else 0))
        mask = square * p
    elif one_row:
        mask = square  # the block-diagonal mask as bools
    final_norm = (4 + 2 * p) * h * t
    recompute = per_layer + scores + mask if activation_checkpointing else 0
    if activation_checkpointing:
        kept = 0 if activation_offload else layers * p * h * t + final_norm
    else:
        kept = layers * (per_layer + scores) + mask + final_norm
    grad_hidden = p * h * t  # the loss's gradient of the last hidden states, held into the backward
    layer_backward = recompute + p * t * (arch.intermediate_size + h) + scores + grad_hidden
    rows = loss_rows(arch.vocab_size, t, loss_impl, loss_chunk_tokens)
    if loss_impl == "full":
        loss = rows * arch.vocab_size * (p + 8)  # the logits, their fp32 log-softmax, its gradient
    else:  # one chunk's fp32 logits (and their 16-bit matmul output), and the head's fp32 gradient
        loss = rows * arch.vocab_size * (6 if sixteen else 4) + grad_hidden + (
            4 * arch.vocab_size * h if trained_head else 0)
    return kept + max(loss, layer_backward)


def offloaded_activation_bytes(arch: Architecture, micro_batch_size: int, seq_len: int, mixed_precision: str,
                               sequence_parallel: int = 1) -> int:
    """What activation_offload keeps in CPU memory per rank: each layer's checkpointed input and the
    final norm's tensors (the part activation_bytes leaves out)."""
    p = 2 if mixed_precision != "no" else 4
    t = -(-micro_batch_size * seq_len // sequence_parallel)
    return arch.num_hidden_layers * p * arch.hidden_size * t + (4 + 2 * p) * arch.hidden_size * t


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    world_size: int
    num_parameters: int
    trained_parameters: int
    params: int  # bytes per GPU
    grads: int
    optimizer: int
    activations: int
    buffers: int
    cpu: int = 0  # bytes per rank moved to CPU memory
    nvme: int = 0  # bytes per rank moved to NVMe
    samples: int = 0  # the whole model gathered on each GPU while it generates samples at eval (zero3, fsdp)
    reference: int = 0  # a DPO full fine-tune's frozen reference, in the compute dtype (finetune/training/reference.py)
    rollout_weights: int = 0  # GRPO: the whole model gathered on each GPU for the rollout phase (zero3, fsdp)
    kv_cache: int = 0  # GRPO: the KV cache of every completion this rank generates, in one batch
    prefill: int = 0  # GRPO: one layer's transients of the prompts' forward (no gradient)
    logps: int = 0  # GRPO: old (num_iterations > 1) and reference (beta > 0) log-probs, fp32, kept through the step
    engine: int = 0  # generation_backend=vllm: the engine's weights and KV cache while it generates (its minimum)
    engine_asleep: int = 0  # ... what it keeps during the step (0 with vllm_enable_sleep_mode)
    engine_share: float = 0.0  # ... vllm_gpu_memory_utilization: on a GPU it takes that share while awake
    push: int = 0  # ... a weight push's transient: a bucket of layers gathered, and its copy in the engine's dtype
    staging: int = 0  # async_save: the rank's part of a checkpoint staged in host memory (counted in cpu too)
    staging_tmpfs: int = 0  # of which in the staging tmpfs at once (fsdp's DCP files; the rest is process memory)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The training step's peak."""
        return self.model_states + self.reference + self.logps + self.activations + self.buffers + self.engine_asleep

    @property
    def rollout_peak(self) -> int:
        """GRPO's rollout phase (0 for other objectives): the weights gathered for generation, the KV
        cache of every completion of the rank and the prompts' prefill, beside the model states, the
        reference and the kept log-probs; the step's activations and buffers are freed then."""
        rollout = self.rollout_weights + self.kv_cache + self.prefill + self.engine + self.push
        return self.model_states + self.reference + self.logps + rollout if rollout else 0

    @property
    def peak(self) -> int:
        """What a setup must fit: the larger of the step and the rollout phase."""
        return max(self.total, self.rollout_peak)

    @property
    def samples_peak(self) -> int:
        """The peak while an eval generates its samples with the whole model gathered (after the step,
        its activations and buffers freed). Not part of total: where it does not fit, the run skips the
        samples with a warning instead of running out of memory (finetune/training/samples.py samples_fit)."""
        return self.model_states + self.reference + self.samples

    def peak_within(self, budget: int) -> int:
        """peak, with a vLLM engine's share of a GPU of `budget` bytes (vllm_gpu_memory_utilization) where
        that is more than its minimum: while it generates, and through the step unless it sleeps."""
        extra = max(0, round(self.engine_share * budget) - self.engine) if self.engine else 0
        return max(self.total + (extra if self.engine_asleep else 0), self.rollout_peak + extra)

    def fits(self, budget: int, headroom: float = HEADROOM) -> bool:
        return self.peak_within(budget) <= budget * (1 - headroom)


def estimate(arch: Architecture, setup: Setup, *, world_size: int, mixed_precision: str = "bf16",
             micro_batch_size: int = 1, seq_len: int = 2048, activation_checkpointing: bool = False,
             lora_params: int = 0, quantized_base: bool = False, loss_impl: str = "full",
             loss_chunk_tokens: int = 0, one_row: bool = False, samples: bool = False, reference: bool = False,
             pairs: bool = False, sequence_parallel: int = 1, attn_implementation: str = "sdpa",
             activation_offload: bool = False, rollout: "Rollout | None" = None,
             gpus_per_node: int | None = None, async_save: bool = False,
             teacher: Architecture | None = None) -> Estimate:
    """Bytes per GPU for one setup. lora_params > 0: a LoRA run with that many adapter parameters
    (the base is frozen); 0: a full fine-tune. quantized_base: QLoRA (model._load_4bit), the decoder
    layers' Linear weights of the frozen base in 4-bit NF4: 0.5 byte per weight (QUANT_PACKED, stored
    in the training dtype and sharded like any weight by fsdp/zero3) plus the quantization constants
    (QUANT_CONSTANTS, double-quantized absmax), which are no parameters and which every rank keeps
    whole; embeddings, lm_head and norms stay as they are. A gathered layer then holds its packed
    weights, and bitsandbytes dequantizes one Linear at a time into the compute dtype (buffers).
    samples: sample_prompts > 0, whose generation gathers the whole sharded model on each GPU at every
    eval (zero3, fsdp; ddp, zero1 and zero2 hold it whole already), in the dtype it computes in (FSDP2
    gathers bf16/fp16 copies of its fp32 masters; ZeRO-3 stores 16-bit partitions): Estimate.samples_peak.
    pairs: a preference run, whose micro-batch is micro_batch_size pairs, 2 x micro_batch_size sequences
    in one forward. reference: it also holds a frozen reference (a full fine-tune without
    precompute_reference or SimPO), in the compute dtype: sharded by fsdp and zero3 (and offloaded with
    the parameters), whole on each rank under ddp, zero1 and zero2 (Strategy.reference_sharded).
    rollout: a GRPO run's rollout phase (Rollout; this module's docstring, item 5), or a distillation run's
    (its on-policy completions). teacher: a distillation run's teacher (finetune/training/objectives/distill.py),
    held as the reference is (counted in the reference column), in the compute dtype, and its output layer's
    weight copied whole while the loss runs (finetune/divergence.py: in buffers). gpus_per_node: a node's GPUs
    (default world_size), hsdp's default shard group.
    async_save: each save copies the rank's part of the checkpoint (its trained weights and optimizer
    states as saved; a ZeroRedundancyOptimizer's consolidated on rank 0) into host memory, buffers
    kept for the next save: the cpu column. The background writer writes torch.save and safetensors
    files from them straight into the checkpoint; fsdp's DCP saves go through the staging tmpfs one at
    a time, the larger of the two (weights, optimizer states) more (finetune/checkpointing/snapshot.py)."""
    strategy = strategy_for(setup.strategy)
    n = strategy.sharding_group(setup, world_size, gpus_per_node or world_size)  # hsdp: its shard group
    base = arch.num_parameters()
    trained = lora_params or base
    total_params = base + lora_params
    pb, gb, ob = strategy.state_bytes(mixed_precision)
    sixteen = mixed_precision != "no"
    lp = 2 if sixteen else 4  # compute dtype: gathered layers, buckets
    # A LoRA run's frozen base is loaded in the training precision (model.base_dtype), and DeepSpeed's
    # 16-bit engine casts the whole module anyway.
    frozen_pb = 2 if sixteen else pb
    shard_params = strategy.shards_params
    shard_grads = strategy.shards_grads
    shard_opt = strategy.shards_optimizer or setup.ddp_shard_optimizer

    frozen = (total_params - trained) * frozen_pb
    quantized = arch.decoder_linear_weights() if quantized_base and lora_params else 0
    frozen -= quantized * (frozen_pb - QUANT_PACKED)
    params = (trained * pb + frozen) / (n if shard_params else 1)
    whole = (trained * min(pb, lp) + frozen) if shard_params else 0  # Strategy.gathered_bytes
    gathered = whole if samples else 0
    if quantized:
        params += quantized * QUANT_CONSTANTS + arch.decoder_linears() * QUANT_TABLES
    params += strategy.extra_param_bytes(setup, total_params, lp)
    grads = trained * gb / (n if shard_grads else 1)
    optimizer = trained * ob / (n if shard_opt else 1)

    saved_weights = trained * pb / (n if shard_params else 1)
    saved_optimizer = trained * ob / (n if strategy.shards_optimizer else 1)
    staging = staging_tmpfs = 0
    if async_save:
        staging = saved_weights + saved_optimizer
        if strategy.saves_with_dcp:
            staging_tmpfs = max(saved_weights, saved_optimizer)
            staging += staging_tmpfs
    params, grads, optimizer, off = strategy.offload(setup, params, grads, optimizer, trained, gb, n)
    off["cpu"] += staging
    held = base * lp / (n if strategy.reference_sharded else 1) if reference else 0
    if teacher is not None:
        held += teacher.num_parameters() * lp / (n if strategy.reference_sharded else 1)
    if held and setup.offload_params != "none" and strategy.reference_sharded:
        off[setup.offload_params] += held
        held = 0

    layer = arch.layer_parameters()
    dequantized = 0  # bitsandbytes' dequantized copy of the Linear being computed
    if quantized:
        layer_q = quantized / arch.num_hidden_layers
        layer -= layer_q * (1 - QUANT_PACKED / lp)  # a gathered layer in "compute-dtype elements"
        dequantized = arch.largest_linear() * lp
    if lora_params:
        layer_trained = lora_params / arch.num_hidden_layers
    else:
        layer_trained = layer
    buffers = strategy.buffers(arch, setup, trained, gb, n, lp, sixteen, layer, layer_trained)
    buffers += dequantized
    if teacher is not None:  # the teacher's output layer, copied whole for the divergence (finetune/divergence.py)
        buffers += teacher.vocab_size * teacher.hidden_size * lp
    rows = micro_batch_size * (2 if pairs else 1)
    acts = activation_bytes(arch, rows, seq_len, mixed_precision, activation_checkpointing, loss_impl,
                            loss_chunk_tokens, one_row, sequence_parallel, attn_implementation,
                            activation_offload and activation_checkpointing, trained_head=not lora_params)
    if activation_offload and activation_checkpointing:
        off["cpu"] += offloaded_activation_bytes(arch, rows, seq_len, mixed_precision, sequence_parallel)
    phase = {}
    if rollout is not None and rollout.engine:
        engine = base * lp + rollout.kv_cache(arch, lp)
        layers = min(rollout.push_layers, arch.num_hidden_layers)
        bucket = max(arch.layer_parameters() * layers, arch.vocab_size * arch.hidden_size) * (4 + lp)
        phase = dict(engine=round(engine), engine_asleep=0 if rollout.engine_sleeps else round(engine),
                     engine_share=rollout.engine_share, push=round(bucket),
                     logps=rollout.rows * rollout.tokens * 4 * rollout.logp_copies)
    elif rollout is not None:
        phase = dict(rollout_weights=round(whole), kv_cache=rollout.kv_cache(arch, lp),
                     prefill=34 * rollout.rows * rollout.prompt_tokens * arch.hidden_size * (1 if sixteen else 2),
                     logps=rollout.rows * rollout.tokens * 4 * rollout.logp_copies)
    return Estimate(setup=setup, world_size=n, num_parameters=base, trained_parameters=trained,
                    params=round(params), grads=round(grads), optimizer=round(optimizer), activations=acts,
                    buffers=round(buffers), cpu=round(off["cpu"]), nvme=round(off["nvme"]), samples=round(gathered),
                    reference=round(held), staging=round(staging), staging_tmpfs=round(staging_tmpfs), **phase)


def static_cache_length(tokens: int) -> int:
    """The positions of the compiled decode loop's StaticCache (generation._Decoder) for sequences up to tokens
    long: rounded up to a multiple of 256, so that rollouts whose longest prompts differ a little replay one
    graph. Here, torch-free, because the planner counts them."""
    return -(-tokens // 256) * 256


@dataclass(frozen=True)
class Rollout:
    """A GRPO rank's rollout phase: rows completions generated in one batch, each up to prompt_tokens +
    completion_tokens = tokens long, and how many fp32 log-prob copies of them the step keeps. With tools
    (docs/agents.md) a completion is a conversation whose turns and fed tool answers share
    max_completion_len, in one KV cache that goes on across the turns: the longest conversation's cache is
    the same prompt + max_completion_len positions (the prompt longer by the tools' schemas, which
    max_prompt_len / max_seq_len count)."""
    rows: int
    prompt_tokens: int
    tokens: int
    logp_copies: int
    engine: bool = False  # generation_backend=vllm
    engine_sleeps: bool = False  # vllm_enable_sleep_mode
    engine_share: float = 0.0  # vllm_gpu_memory_utilization
    push_layers: int = 4  # vllm_push_layers
    compiled: bool = False  # our generator's compiled decode loop on a GPU (generation_compile auto or true)

    @property
    def cache_tokens(self) -> int:
        """Cache positions a row holds: the compiled loop's StaticCache rounds its length up
        (generation.static_cache_length); eager generation and the engine hold what the row reaches."""
        if self.compiled and not self.engine:
            return static_cache_length(self.tokens)
        return self.tokens

    def kv_cache(self, arch: Architecture, compute_bytes: int) -> int:
        """Keys and values of every layer for every cache position of every row, in the compute dtype."""
        per_token = 2 * arch.num_hidden_layers * arch.kv_heads * arch.head_size * compute_bytes
        return self.rows * self.cache_tokens * per_token

    @classmethod
    def of(cls, recipe: Recipe, world_size: int) -> "Rollout | None":
        """None unless objective=grpo, or distill with on-policy steps (lmbda > 0). The rank's completions:
        GRPO: its share of the global batch's prompts (rounded up) x num_generations, or micro_batch_size x
        grad_accum without a global batch; distill: its rows of the step (one completion each, after a
        prompt of up to max_seq_len tokens)."""
        distill = recipe.objective == "distill"
        if not (recipe.objective == "grpo" or distill and recipe.lmbda > 0):
            return None
        if getattr(recipe, "rollout_processes", 0):  # generated on GPUs of their own: finetune/split_plan.py
            return None
        from finetune.plan import data_parallel_size

        dp = data_parallel_size(recipe, world_size)
        if distill:
            rows = -(-recipe.global_batch_size // dp) if recipe.global_batch_size else \
                recipe.micro_batch_size * recipe.grad_accum
            engine = recipe.generation_backend == "vllm"
            return cls(rows=rows, prompt_tokens=recipe.max_seq_len - 1,
                       tokens=recipe.max_seq_len - 1 + recipe.max_completion_len, logp_copies=0, engine=engine,
                       engine_sleeps=engine and recipe.vllm_enable_sleep_mode,
                       engine_share=recipe.vllm_gpu_memory_utilization if engine else 0.0,
                       push_layers=recipe.vllm_push_layers, compiled=not engine and recipe.generation_compile != "false")
        if recipe.global_batch_size:
            rows = -(-recipe.global_batch_size // dp) * recipe.num_generations
        else:
            rows = recipe.micro_batch_size * recipe.grad_accum
        completion = recipe.max_completion_len
        prompt = recipe.max_prompt_len or max(0, recipe.max_seq_len - completion)
        tokens = min(recipe.max_seq_len, prompt + completion)
        engine = recipe.generation_backend == "vllm"
        # the engine's rollouts keep the trainer's log-probs and their importance weights; rloo's KL penalty
        # in the reward keeps the old log-probs at one iteration too
        old = recipe.num_iterations > 1 or engine or (recipe.loss_type == "rloo" and recipe.beta > 0)
        copies = old + (recipe.beta > 0) + engine
        return cls(rows=rows, prompt_tokens=min(prompt, tokens), tokens=tokens, logp_copies=copies, engine=engine,
                   engine_sleeps=engine and recipe.vllm_enable_sleep_mode,
                   engine_share=recipe.vllm_gpu_memory_utilization if engine else 0.0,
                   push_layers=recipe.vllm_push_layers,
                   # the planner plans GPUs, where generation_compile=auto compiles (generation.decode_compiled)
                   compiled=not engine and recipe.generation_compile != "false")


def recipe_estimate(recipe: Recipe, world_size: int, arch: Architecture, setup: Setup | None = None,
                    gpus_per_node: int | None = None) -> Estimate:
    lora, r, targets = recipe_lora(recipe)
    return estimate(arch, setup or Setup.of(recipe), world_size=world_size, mixed_precision=recipe.mixed_precision,
                    micro_batch_size=recipe.micro_batch_size, seq_len=recipe.max_seq_len,
                    activation_checkpointing=recipe.activation_checkpointing,
                    lora_params=lora_parameters(arch, r, targets) if lora else 0,
                    quantized_base=lora and recipe.load_in_4bit,
                    loss_impl=recipe.loss_impl, loss_chunk_tokens=recipe.loss_chunk_tokens,
                    one_row=padding_free_scores(recipe),
                    samples=recipe.sample_prompts > 0 and recipe.objective != "reward",
                    reference=holds_reference(recipe), pairs=objective_rules.rules(recipe).FORWARD_ROWS == 2,
                    sequence_parallel=recipe.sequence_parallel, attn_implementation=recipe.attn_implementation,
                    activation_offload=recipe.activation_offload, rollout=Rollout.of(recipe, world_size),
                    gpus_per_node=gpus_per_node, async_save=recipe.async_save,
                    teacher=teacher_architecture(recipe.teacher_model)[0] if recipe.objective == "distill" else None)


@functools.lru_cache(maxsize=8)
def teacher_architecture(model: str) -> tuple[Architecture | None, str]:
    """A distillation run's teacher (load_architecture, read once), or None and why it cannot be read (a
    directory made by a run not yet launched, as the tiny_distill recipe's teacher before `tiny` has run)."""
    try:
        return load_architecture(model), ""
    except EstimateError as e:
        return None, str(e)


def holds_reference(recipe: Recipe) -> bool:
    """Whether a run holds a reference model beside the policy (finetune/training/reference.py build_reference)."""
    return reference_kind(recipe) == "frozen"


def all_estimates(recipe: Recipe, world_size: int, arch: Architecture) -> list[tuple[int, Estimate]]:
    """(cost rank, estimate) for every setup in SETUPS, plus the recipe's own if it is not one of them,
    less those the run refuses on world_size processes of one node (setup_problem).
    A 4-bit (QLoRA) base runs under ddp, fsdp and zero3 without parameter offload (recipe.validate),
    so then only those setups."""
    setups = [(rank, s) for rank, s in SETUPS if not recipe.load_in_4bit
              or (strategy_for(s.strategy).takes_4bit_base and s.offload_params == "none")]
    setups = [(rank, s) for rank, s in setups if setup_problem(recipe, s, world_size) is None]
    rows = [(rank, recipe_estimate(recipe, world_size, arch, setup)) for rank, setup in setups]
    own = Setup.of(recipe)
    if all(e.setup != own for _, e in rows) and setup_problem(recipe, own, world_size) is None:
        rank = max((rank for rank, s in SETUPS if strategy_for(s.strategy) == strategy_for(own.strategy)),
                   default=max(rank for rank, _ in SETUPS))  # hsdp, and zero3 with hpZ, are none of them
        rows.append((rank, recipe_estimate(recipe, world_size, arch, own)))
    return rows
