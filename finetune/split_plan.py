"""The planner for GRPO's generation on GPUs of its own (rollout_processes; finetune/training/rollout_group.py):
memory per group, and the split it would run, from measured or modelled generation and training times.

Memory per GPU, for g generating and t = N - g training GPUs:
    training   the recipe's strategy on t GPUs (finetune/memory.py's step: model states, reference, activations,
               buffers; no rollout phase: nothing is generated there), plus the lagging rollouts' kept
               log-probs (old and importance weights: 2 fp32 copies of its completions' rows) and the push
               transient (vllm_push_layers decoder layers gathered whole, fp32)
    generating the whole model in the compute dtype (rollout_worker.generator_dtype) and the KV cache of its
               share of the step's completions (global_batch_size / g prompts x num_generations rows, prompt +
               completion tokens: memory.Rollout), with the prompts' prefill transients

Times (seconds per step), with P parameters, R = global_batch_size x num_generations completions of L tokens
after a prompt of p tokens, on a GPU of F 16-bit FLOP/s and B bytes/s of memory bandwidth (an H100's), with
two figures calibrated on a lent H200's measurements (the constants below):
    generation on n GPUs   L decode steps of max((W + r x kv) / B, r x 2P / F) + layers x 0.167 ms, r = R / n
                           rows each (a step reads the weights W once for the batch and each row's cache;
                           compute-bound only for large batches; the per-layer time our compiled loop spent over
                           that bound), plus the prefill r x p x 2P / F
    training on n GPUs     (6 + 2 c) P x R (p + L) / (n F MFU): forward and backward, and c more forwards
                           (the old and reference log-probs); MFU as measured (zero3 0.151, others 0.33)
    push                   W over the node's links (comm.INTRA_GBPS)
    colocated              generation on N + training on N (today's synchronous run)
    split, max_staleness 0 generation on g + push + training on t (a generating GPU waits while the others train)
    split, max_staleness 1 max(generation on g, training on t + push): each overlaps the other
Measured times (--generation-seconds, --training-seconds: a colocated run's rollout_seconds and the rest of its
step, on --gpus N) replace the model's at N; the model scales them to g and t. Memory-bound decoding is why a
split pays: generating the whole step on g GPUs takes about as long as on all N while the batch per GPU stays
small, and the other t GPUs train meanwhile."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.arch import Architecture
from finetune.comm import INTRA_GBPS
from finetune.memory import HEADROOM, Rollout, recipe_estimate
from finetune.memory_tables import gib

# One H100 SXM: dense 16-bit FLOP/s (finetune/training/metrics.py PEAK_FLOPS_16BIT) and HBM3 bytes/s.
FLOPS, BANDWIDTH = 989e12, 3.35e12
# Calibrated on what a lent H200 measured (docs/benchmarks.md): the share of the FLOPs our training step reached
# (section 6, the 0.95B model in bf16: ddp 33.0%, fsdp 33.5%, zero3 15.1%), and our compiled decode loop's time
# per token over the bandwidth bound (GRPO rollout on one GPU: 64 completions x 512 tokens in 1.88 s, 3.67 ms a
# step where reading the weights and the KV cache at 4.8 TB/s takes 1.0 ms: 0.167 ms more per decoder layer,
# the kernels' launches and the host's share, which a larger model does not shrink).
MFU = {"zero3": 0.151, "zero3_offload": 0.151}
DEFAULT_MFU = 0.33
LAYER_STEP_S = 1.67e-4


@dataclass(frozen=True)
class Split:
    generating: int
    training: int
    training_bytes: int  # per training GPU
    generating_bytes: int  # per generating GPU
    generation_s: float
    training_s: float
    push_s: float

    @property
    def synchronous_s(self) -> float:
        return self.generation_s + self.push_s + self.training_s

    @property
    def overlapped_s(self) -> float:
        return max(self.generation_s, self.training_s + self.push_s)


def compute_bytes(recipe) -> int:
    return 4 if recipe.mixed_precision == "no" else 2


def rows_and_tokens(recipe) -> tuple[int, int, int]:
    """The step's completions, a prompt's tokens and a completion's (the recipe's bounds)."""
    completion = recipe.max_completion_len
    prompt = min(recipe.max_prompt_len or max(0, recipe.max_seq_len - completion), recipe.max_seq_len)
    return recipe.global_batch_size * recipe.num_generations, prompt, completion


def generating_bytes(recipe, arch: Architecture, gpus: int) -> int:
    """One generating GPU: the weights in the compute dtype, its rows' KV cache and the prompts' prefill."""
    rows, prompt, completion = rows_and_tokens(recipe)
    share = -(-rows // gpus)
    lp = compute_bytes(recipe)
    cache = Rollout(rows=share, prompt_tokens=prompt, tokens=prompt + completion, logp_copies=0,
                    compiled=recipe.generation_compile != "false").kv_cache(arch, lp)
    prefill = 34 * share * prompt * arch.hidden_size * (1 if lp == 2 else 2)  # as memory.estimate's rollout prefill
    return arch.num_parameters() * lp + cache + prefill


def training_bytes(recipe, arch: Architecture, gpus: int) -> int:
    """One training GPU: the strategy's step on `gpus` GPUs (no rollout phase: memory.Rollout.of), the log-probs it
    keeps through the step (a lagging rollout's old ones and importance weights, the reference's) and the push
    transient."""
    from dataclasses import replace

    e = recipe_estimate(replace(recipe, rollout_processes=max(1, recipe.rollout_processes)), gpus, arch)
    rows, prompt, completion = rows_and_tokens(recipe)
    copies = 2 * (recipe.max_staleness > 0 or recipe.weight_sync_steps > 1) + (recipe.beta > 0)
    kept = -(-rows // gpus) * (prompt + completion) * 4 * copies
    layers = min(recipe.vllm_push_layers, arch.num_hidden_layers)
    push = max(arch.layer_parameters() * layers, arch.vocab_size * arch.hidden_size) * 4
    return e.total + kept + push


def generation_seconds(recipe, arch: Architecture, gpus: int) -> float:
    rows, prompt, completion = rows_and_tokens(recipe)
    share = rows / gpus
    lp = compute_bytes(recipe)
    weights, params = arch.num_parameters() * lp, arch.num_parameters()
    kv_per_token = 2 * arch.num_hidden_layers * arch.kv_heads * arch.head_size * lp
    context = prompt + completion / 2  # the cache a decode step reads, on average
    step = max((weights + share * context * kv_per_token) / BANDWIDTH, share * 2 * params / FLOPS)
    return completion * (step + arch.num_hidden_layers * LAYER_STEP_S) + share * prompt * 2 * params / FLOPS


def training_seconds(recipe, arch: Architecture, gpus: int) -> float:
    rows, prompt, completion = rows_and_tokens(recipe)
    forwards = (recipe.beta > 0) + (recipe.max_staleness > 0 or recipe.weight_sync_steps > 1)
    mfu = MFU.get(recipe.strategy, DEFAULT_MFU)
    return (6 + 2 * forwards) * arch.num_parameters() * rows * (prompt + completion) / (gpus * FLOPS * mfu)


def push_seconds(recipe, arch: Architecture) -> float:
    return arch.num_parameters() * compute_bytes(recipe) * 8 / (INTRA_GBPS * 1e9)


def splits(recipe, arch: Architecture, gpus: int, generation_s: float | None = None,
           training_s: float | None = None) -> list[Split]:
    """Every split of `gpus` GPUs (1 generating or more, 1 training or more) the recipe's global batch divides; times
    modelled, or measured on the colocated run of `gpus` (generation_s, training_s) and scaled by the model."""
    gen_scale = generation_s / generation_seconds(recipe, arch, gpus) if generation_s else 1.0
    train_scale = training_s / training_seconds(recipe, arch, gpus) if training_s else 1.0
    out = []
    for g in range(1, gpus):
        t = gpus - g
        if recipe.global_batch_size % g or recipe.global_batch_size % t:
            continue
        out.append(Split(g, t, training_bytes(recipe, arch, t), generating_bytes(recipe, arch, g),
                         generation_seconds(recipe, arch, g) * gen_scale, training_seconds(recipe, arch, t) * train_scale,
                         push_seconds(recipe, arch)))
    return out


def colocated_seconds(recipe, arch: Architecture, gpus: int, generation_s: float | None = None,
                      training_s: float | None = None) -> float:
    return (generation_s or generation_seconds(recipe, arch, gpus)) + (training_s or training_seconds(recipe, arch, gpus))


def split_table(recipe, arch: Architecture, gpus: int, budget: int | None = None, headroom: float = HEADROOM,
                generation_s: float | None = None, training_s: float | None = None, name: str = "") -> str:
    """`finetune plan --split`: memory per group and step seconds of every split, and the one it would run."""
    rows = splits(recipe, arch, gpus, generation_s, training_s)
    if not rows:
        return (f"no split of {gpus} GPUs divides global_batch_size={recipe.global_batch_size} prompts between the "
                "generating and the training GPUs")
    colocated = colocated_seconds(recipe, arch, gpus, generation_s, training_s)
    limit = budget * (1 - headroom) if budget else None
    fits = [s for s in rows if limit is None or max(s.training_bytes, s.generating_bytes) <= limit]
    best = min(fits, key=lambda s: s.overlapped_s, default=None)
    source = "measured on the colocated run, scaled by the model" if generation_s or training_s else "modelled"
    lines = [f"{name or 'recipe'}: GRPO with generation on GPUs of its own, {gpus} GPUs ({recipe.strategy} over the "
             f"training ones); times {source} (finetune/split_plan.py); colocated (synchronous, every GPU generates "
             f"then trains): {colocated:.2f} s per step",
             f"{'gen':>4} {'train':>5} {'train GiB':>9} {'gen GiB':>8} {'fits':>4} {'gen s':>7} {'train s':>7} "
             f"{'push s':>6} {'step k=0':>8} {'step k=1':>8} {'speed-up':>8}"]
    for s in rows:
        fit = "-" if limit is None else "yes" if s in fits else "no"
        lines.append(f"{s.generating:>4} {s.training:>5} {gib(s.training_bytes):>9} {gib(s.generating_bytes):>8} "
                     f"{fit:>4} {s.generation_s:>7.2f} {s.training_s:>7.2f} {s.push_s:>6.2f} {s.synchronous_s:>8.2f} "
                     f"{s.overlapped_s:>8.2f} {colocated / s.overlapped_s:>7.2f}x")
    if best is not None:
        lines.append(f"recommended: rollout_processes={best.generating} ({best.training} training GPUs) with "
                     f"max_staleness=1: {best.overlapped_s:.2f} s per step, {colocated / best.overlapped_s:.2f}x the "
                     "colocated run; max_staleness=0 on the same split trains the synchronous run's policy at "
                     f"{best.synchronous_s:.2f} s per step")
    else:
        lines.append(f"no split fits {gib(budget)} GiB per GPU with {headroom:.0%} headroom")
    return "\n".join(lines)


def split_memory_lines(recipe, arch: Architecture, world_size: int) -> list[str]:
    """For `--dry-run` of a recipe with rollout_processes > 0 (world_size: its training processes): memory per GPU
    of each group."""
    g = recipe.rollout_processes
    return [f"memory per GPU with rollout_processes={g}: training GPUs ({world_size}, {recipe.strategy}) "
            f"{gib(training_bytes(recipe, arch, world_size))} GiB (the step, 2 kept log-prob copies where a rollout "
            f"lags, the push transient); generating GPUs ({g}) {gib(generating_bytes(recipe, arch, g))} GiB (the "
            "model in the compute dtype, the KV cache of its share of the step's completions, the prefill)"]

