"""Ulysses sequence parallelism (recipe.sequence_parallel=N): each sequence is split across N ranks,
and DeepSpeed's Ulysses attention (deepspeed.runtime.sequence_parallel.ulysses_sp) exchanges heads
for sequence with an all-to-all before and after attention, so every rank attends over the whole
sequence for 1/N of the heads. Everything else (embeddings, MLPs, norms, the chunked loss) runs on
the rank's 1/N of the tokens, so activations per rank are divided by N. All SP setup is here: the
layout of ranks, the registration with transformers, the slicing of a micro-batch.

Ranks: DeepSpeed's groups (parallel_state_sp) put consecutive ranks in one SP group ([0, 1], [2, 3]
for N=2 on 4 processes), so a rank's place in its group is rank % N and its data-parallel rank is
rank // N, of world / N. The whole SP group reads the same rows (the BatchSchedule is indexed by the
data-parallel rank): the global batch is micro x accum x world / N rows.

Exactness (tests/distributed/test_sequence_parallel.py: 2 processes with SP 2 equal 1 process on whole
sequences to fp32 round-off):
- positions are global: each shard carries its slice of arange(length) as position_ids (without
  them transformers gives every shard positions 0..length/N-1, and rotary embeddings go wrong on all
  but the first shard, silently: gradients about 50% off);
- labels are shifted before slicing (`shift_labels`), so a shard's last token predicts the first
  token of the next shard; finetune/loss.py uses them as given;
- a row is padded on the right to a multiple of N (and a short micro-batch to micro_batch_size rows,
  which the Ulysses wrapper fixes at registration) with IGNORE labels: the attention is causal over
  the gathered sequence, so real tokens never see the padding, and padding is no target;
- the loss of a shard is its sum over its target tokens and the counts are per shard, summed over
  every rank: the loop divides the sum over all ranks by the global target count. The shards hold
  different numbers of targets, so a mean of per-rank means would be wrong.
- gradients: every strategy averages them over all the world's ranks (DeepSpeed's engine is not
  given the SP groups, so it treats every rank as data parallel), and the loop scales each rank's
  loss by world x accum / global target count. The Ulysses all-to-all carries each shard's gradient
  back to the rank that computed its queries, keys and values, so the sum over ranks of the local
  gradients is the gradient of the sum over all shards: the update is the gradient of (sum over
  target tokens) / (global count), as without SP.

Preference pairs (objective=dpo: DPO, IPO, SimPO) are scored by each sequence's summed log-probability
of its response tokens, which the pair's loss (nonlinear in it) needs whole: each shard sums its own
tokens' log-probs and counts (loss.sequence_logps) and `row_logps` sums them over the SP group with an
all-reduce whose backward is the all-reduce of the gradients (`sum_over_sequence`), so every rank of
the group holds the whole row's values and the gradient of its local sum is the pair loss's gradient
with respect to the whole sum. Every rank of the group then computes the same pair losses and
metrics; only the group's first rank counts them (`counts_pairs`): its loss is the pair losses, the
others' is 0 times them (they still run the backward through the all-reduce, whose sum gives each
rank's shard the first rank's gradient), and the pairs of a global batch are counted once. A pair
micro-batch is 2 x micro_batch_size rows (every chosen sequence, then every rejected one), padded
per side with placeholder pairs (no targets), and shard() carries the pairs' whole-row facts
(real_pairs, precomputed ref_logps) unsliced. The reference (a frozen copy, the adapter-disabled
policy) runs on the same shards and is summed over the group too; precompute_reference scores the
pairs so before training.

GRPO's completions (objective=grpo, every loss type) are sampled, and their old and reference log-probs
computed, on whole sequences (whole_sequences: every rank of a group holds its group's completions, and
GRPO's gathers keep each group's first rank). The loss's per-token log-probs (and entropies) are computed
on the shards and made the whole rows' on every rank of the group by `whole_tokens` (each rank's slice put
in place, summed over the group with the backward of sum_over_sequence), so that the loss type's
per-sequence sums, means and ratios are those of whole rows; shard() carries the rows' labels, advantages
and old, reference and engine values whole. As for pairs, the group's first rank counts the completions,
the loss and the metrics; the others' loss is 0 times it.

The attention mask is dropped (Ulysses runs causal attention over the gathered sequence), which is
why packed rows (several examples per row, kept apart only by a mask) are refused with SP, and eager
attention (DeepSpeed refuses it: it needs a 4D mask).

A mixture of experts' router (load-balancing) loss is refused under SP (config_problem): the model
computes it inside its forward from the router logits of the tokens it sees, as num_experts x sum over
experts of (fraction of tokens routed to e) x (mean router probability of e), a product of means over
the whole batch, and it drops padding by the attention mask, which Ulysses never sees. Per shard it is
another number (and counts the shards' padding); the whole row's would need the family's own formula
re-done on router statistics summed over the group, per model family.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

from finetune import objective_rules

IGNORE = -100  # finetune.data.formats.IGNORE (imported lazily there: this module stays light for the planner)


def world_problem(recipe, world_size: int) -> str | None:
    """sequence_parallel must divide the processes (a plan-time check: it needs the world size)."""
    n = recipe.sequence_parallel
    if n > 1 and world_size % n:
        return (f"sequence_parallel={n} does not divide the {world_size} process(es): each sequence is split across "
                f"{n} ranks and data parallel runs over processes / {n}; launch a multiple of {n} processes or set "
                f"sequence_parallel to a divisor of {world_size}")
    return None


def config_problem(recipe, config) -> str | None:
    """Ulysses splits the attention heads across the SP ranks: the heads must divide by N, and the kv
    heads too (or N by them: DeepSpeed then replicates each kv head). Checked from the config, before
    any weight is read."""
    n = recipe.sequence_parallel
    if n <= 1:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return (f"sequence_parallel={n}: model type {getattr(config, 'model_type', '?')} names no "
                "num_attention_heads in its config; Ulysses splits attention heads; set sequence_parallel=1")
    if heads % n:
        return (f"sequence_parallel={n}: the model has {heads} attention heads, not divisible by {n} (Ulysses gives "
                f"each rank heads / {n}); use a sequence_parallel that divides {heads}")
    if kv % n and n % kv:
        return (f"sequence_parallel={n}: the model has {kv} key/value heads; Ulysses needs them divisible by {n} "
                f"(or {n} divisible by them); use a sequence_parallel that divides {kv}")
    if getattr(text, "output_router_logits", False) and (getattr(text, "router_aux_loss_coef", 0.0) or 0.0):
        return (f"sequence_parallel={n}: the model ({getattr(config, 'model_type', '?')}) trains a mixture of experts' "
                "router loss (output_router_logits=true), which it computes per shard, over the shard's tokens and "
                "padding, not over the whole row; set output_router_logits=false in the model's config (no router "
                "loss) or sequence_parallel=1")
    return None


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: `size` ranks share each sequence (its SP group), `rank` is its place in
    the group (which slice it keeps), `dp_rank` of `dp_size` data-parallel groups (which rows it reads)."""
    size: int = 1
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    rows: int = 1  # micro_batch_size: the rows of each half of a pair batch (forward_rows: the wrapper's)
    pad_id: int = 0
    pairs: bool = False  # micro-batches laid out as pairs (objective=dpo; kto: rows, then their KL rows)

    @classmethod
    def of(cls, recipe, rank: int, world_size: int, pad_id: int = 0) -> "Layout":
        n = recipe.sequence_parallel
        return cls(n, rank % n, rank // n, world_size // n, recipe.micro_batch_size, pad_id,
                   objective_rules.rules(recipe).PAIR_BATCHES)

    def shard(self, batch: dict) -> dict:
        """This rank's contiguous 1/size of every row of a collated micro-batch; unchanged without SP."""
        if self.size == 1:
            return batch
        return shard(batch, self.size, self.rank, self.rows, self.pad_id, self.pairs)


def forward_rows(recipe) -> int:
    """Rows per forward: micro_batch_size, or twice that for pairs (chosen and rejected in one forward;
    KTO forwards each half of its pair batch on its own)."""
    return recipe.micro_batch_size * objective_rules.rules(recipe).FORWARD_ROWS


def shard(batch: dict, size: int, rank: int, rows: int, pad_id: int, pairs: bool = False) -> dict:
    """A padded micro-batch (input_ids, labels, attention_mask) as rank `rank` of `size` keeps it: rows
    padded to `rows` and to a length divisible by `size` (pad tokens, IGNORE labels, mask 0), global
    position ids, labels shifted over the whole row before slicing (shift_labels), then the slice
    [rank * length / size, (rank + 1) * length / size). The slice keeps its attention_mask so that its
    real tokens can be counted (finetune/loss.py does not give it to the model).

    pairs: a micro-batch of preference pairs (finetune/data/batches.py collate_pairs: every chosen
    sequence, then every rejected one); each side is padded to `rows` with placeholder pairs, and the
    shard carries, whole, which pairs are real (real_pairs, [rows]: a pair whose chosen sequence has a
    target token), the precomputed reference log-probs where the pairs have them (ref_logps, [2 rows]) and
    KTO's labels (desirable, [rows]).

    A micro-batch of GRPO's completions (it has advantages) keeps its whole rows' labels (row_labels),
    advantages, placeholder flags and old, reference and engine per-token values (ROLLOUT_KEYS), unsliced
    and without the padding rows."""
    import torch
    import torch.nn.functional as F

    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    b, s = ids.shape
    width = -(-s // size) * size
    if mask is None:
        mask = torch.ones(b, s, dtype=torch.long)

    def grow(t, value):
        if not pairs:
            return F.pad(t, (0, width - s, 0, max(rows - b, 0)), value=value)
        n = t.shape[0] // 2
        return torch.cat([F.pad(half, (0, width - s, 0, max(rows - n, 0)), value=value) for half in (t[:n], t[n:])])

    ids, labels, mask = grow(ids, pad_id), grow(labels, IGNORE), grow(mask, 0)
    positions = torch.arange(width, dtype=torch.long).expand(ids.shape[0], width)
    targets = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]  # each position's target: the next token
    part = slice(rank * width // size, (rank + 1) * width // size)
    out = {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
           "shift_labels": targets[:, part].contiguous(), "attention_mask": mask[:, part].contiguous()}
    if "advantages" in batch:  # GRPO's completions: the loss reads their whole rows (whole_tokens)
        out["row_labels"] = batch["labels"]
        out.update({k: batch[k] for k in ROLLOUT_KEYS if k in batch})
    if pairs:
        n = ids.shape[0] // 2
        out["real_pairs"] = (targets[:n] != IGNORE).any(-1)
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
            k = ref.shape[0] // 2
            out["ref_logps"] = torch.cat([F.pad(half, (0, max(n - k, 0))) for half in (ref[:k], ref[k:])])
        if "desirable" in batch:
            out["desirable"] = F.pad(batch["desirable"], (0, max(n - batch["desirable"].shape[0], 0)), value=False)
    return out


ROLLOUT_KEYS = ("advantages", "real", "old_logps", "ref_logps", "is_ratio")  # GRPO's whole-row facts (shard)


def whole_tokens(t, length: int):
    """Per-token values of a shard ([rows, width / N], laid out as its shift_labels) as the whole rows'
    laid out as the labels ([rows, length]: out[b, t] the value of the label at t, 0 at t = 0), on every
    rank of the SP group, differentiably (sum_over_sequence: each rank puts its slice in place, the
    all-reduce sums them; the backward hands each shard the sum of the ranks' gradients of its slice)."""
    import torch.nn.functional as F

    size, rank = _GROUP["size"], _GROUP["rank"]
    width = t.shape[1] * size
    placed = F.pad(t, (rank * t.shape[1], width - (rank + 1) * t.shape[1]))
    return F.pad(sum_over_sequence(placed)[:, :length - 1], (1, 0))


_GROUP: dict = {}  # "group": this rank's SP process group (DeepSpeed's, the one Ulysses attention uses), "rank", "size"


@functools.cache
def _sum_function():
    """The autograd function, built once (torch is imported inside functions here: the planner imports
    this module)."""
    import torch

    class SumOverSequence(torch.autograd.Function):
        """All-reduce (sum) over the SP group; backward: the all-reduce of the incoming gradients, the
        gradient of the sum over the group's ranks of what each computed from the total."""

        @staticmethod
        def forward(ctx, t, group):
            ctx.group = group
            t = t.clone()
            torch.distributed.all_reduce(t, group=group)
            return t

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            torch.distributed.all_reduce(grad, group=ctx.group)
            return grad, None

    return SumOverSequence


def sum_over_sequence(t):
    """A per-shard tensor summed over this rank's SP group (differentiably); itself without SP."""
    group = _GROUP.get("group")
    if group is None:
        return t
    return _sum_function().apply(t, group)


def group_size() -> int:
    """The ranks of this rank's SP group (1 without SP)."""
    return _GROUP.get("size", 1)


def counts_pairs() -> bool:
    """Whether this rank counts what is computed once per row (a pair's loss, metrics and count): the
    first rank of each SP group (every rank without SP)."""
    return _GROUP.get("rank", 0) == 0


def row_logps(model, batch: dict, impl: str = "chunked", chunk: int | None = None):
    """loss.sequence_logps of whole rows: of a shard, its sums and counts summed over the SP group."""
    from finetune.loss import sequence_logps

    sums, counts = sequence_logps(model, batch, impl, chunk)
    if "shift_labels" not in batch:
        return sums, counts
    return sum_over_sequence(sums), sum_over_sequence(counts)


_ATTENTION: dict = {}  # the implementation's name -> (its own function, the Ulysses wrapper)


def start(recipe, model) -> None:
    """Register DeepSpeed's Ulysses attention for the recipe's attn_implementation (it replaces that
    implementation in transformers' ALL_ATTENTION_FUNCTIONS for the whole process) and build the SP
    groups. After the process group exists and the model is loaded (its config's attention must be the
    recipe's), before the model is wrapped."""
    n = recipe.sequence_parallel
    if n <= 1:
        return
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from finetune.distributed import no_shared_memory_allreduce
    from finetune.unwrap import hf_model

    # deepspeed.comm over the existing group (ZeRO's Accelerator has made it already; fsdp and ddp not), without
    # its shared-memory op (left 128 MiB in /dev/shm after every fsdp run with sequence_parallel=2)
    no_shared_memory_allreduce()
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    impl = recipe.attn_implementation
    own = ALL_ATTENTION_FUNCTIONS[impl]
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model(model), core_attn_implementation=impl, sequence_parallel_size=n,
        micro_batch_size=forward_rows(recipe), seq_length_is_variable=True, disable_in_eval=False)
    _ATTENTION[impl] = (own, ALL_ATTENTION_FUNCTIONS[impl])
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    group = parallel_state_sp.get_sequence_parallel_group()
    _GROUP.update(group=group, rank=torch.distributed.get_rank(group=group), size=n)


@contextmanager
def whole_sequences():
    """Attention as without SP for a block (generating samples: every rank runs the same whole prompt)."""
    if not _ATTENTION:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for impl, (own, _) in _ATTENTION.items():
        ALL_ATTENTION_FUNCTIONS[impl] = own
    try:
        yield
    finally:
        for impl, (_, wrapper) in _ATTENTION.items():
            ALL_ATTENTION_FUNCTIONS[impl] = wrapper


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def tile_mlps(model) -> int:
    """tiled_mlp=true: each gated MLP (Llama, Mistral, Qwen, Gemma: gate/up/down projections) computes a
    slice of the sequence at a time with DeepSpeed's TiledMLP, which recomputes a slice's forward in the
    backward, so that the [tokens, intermediate] activations (3 of them, at 3.5x the hidden size for
    Llama) exist for one slice only. Slices: ceil(tokens / hidden size), as DeepSpeed's example, agreed
    by every rank (their MLP calls must pair up under ZeRO-3 and FSDP) once per forward of the model, at
    its first MLP: every layer's MLP sees the same tokens, and the count holds for the recomputed forwards
    of activation checkpointing. Set on each MLP object, before the model is wrapped. Returns how many MLPs
    were tiled."""
    import math

    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    agreed = {"slices": None}  # this forward's slice count, agreed by the ranks

    def new_forward(module, args):
        agreed["slices"] = None

    def slice_forward(module, x):
        return module.finetune_untiled_forward(x)

    def slices_for(x) -> int:
        if agreed["slices"] is None:
            slices = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]), device=x.device)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(slices, op=torch.distributed.ReduceOp.MAX)
            agreed["slices"] = int(slices)
        return agreed["slices"]

    model.register_forward_pre_hook(new_forward)
    count = 0
    for module in model.modules():
        if not all(isinstance(getattr(module, name, None), torch.nn.Module) for name in MLP_PROJECTIONS):
            continue
        module.finetune_untiled_forward = module.forward

        def forward(x, module=module):
            return TiledMLP.apply(slice_forward, module, x, slices_for(x), list(module.parameters()))

        module.forward = forward
        count += 1
    return count
