"""Communication per training step: the bytes each GPU sends, inside its node and across nodes, under
each layout, the time the links give them, and the layout the planner would run (docs/memory-planner.md
states the formulas, docs/multi-node.md the choice; tests/distributed/test_multinode.py holds these bytes
to the ones counted in real runs, finetune/collectives.py).

A collective over a buffer of B bytes in a group of n GPUs makes each GPU send B (n-1)/n on a ring
(all-gather, reduce-scatter; an all-reduce is both: 2 B (n-1)/n; collectives.sent_bytes). A group whose
GPUs are all on one node moves its bytes over the node's links (NVLink); a group that spans nodes runs
at the pace of its inter-node links, so all its bytes are counted as crossing nodes.

What each layout does per optimizer step (each strategy states its own: Strategy.step_collectives) of A micro-batches (P parameters, T of them trained, R the
root module's parameters (the embedding and the final norm), which FSDP2 keeps gathered from the forward
to the backward; gathers in the compute dtype (bf16: 2 bytes, fp32: 4), FSDP2 reduces in fp32, DeepSpeed
in its engine's dtype):

    ddp           all-reduce of T gradients (fp32) once per step, over all N GPUs
    zero1, zero2  all-reduce of T gradients (DeepSpeed's bucketed all-reduce, each rank keeping its
                  partition): zero2 in each micro-batch, zero1 once per step; then all-gather of the T
                  updated weights once per step
    fsdp          all-gather of P weights in each micro-batch's forward and again in its backward (the root
                  once): A (2P - R); reduce-scatter of T gradients (fp32) once per step; all over N
    hsdp          fsdp's all-gathers and reduce-scatter within a shard group of S GPUs (a node: inside),
                  then an all-reduce of each GPU's T/S gradient shard (fp32) among the N/S GPUs holding
                  the same shard (across nodes)
    zero3         per micro-batch, an all-gather of P in the forward and again in the backward, a
                  reduce-scatter of T gradients; all over N
    zero3 + hpZ   the step's first all-gather (P) over N, from the updated primary partition; every later
                  gather of the step (the other micro-batches, the backward's) from the secondary copy
                  within S (inside); the reduce-scatter over N
    DPO, GRPO     a frozen reference sharded by fsdp/hsdp/zero3 adds one all-gather of P per micro-batch
                  (its forward); GRPO's rollout gathers the whole model once per step (zero3, fsdp, hsdp)

Small collectives (the loss and token counts, the gradient norm: a few bytes) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.arch import Architecture

# Link rates per GPU and direction, in Gbit/s (the defaults of `finetune plan --nodes`): NVLink 4 (H100:
# 450 GB/s a direction) inside a node; one 400 Gb/s InfiniBand NDR NIC per GPU across nodes.
INTRA_GBPS = 3600.0
INTER_GBPS = 400.0


@dataclass(frozen=True)
class Link:
    """A collective's group, its kind and what it moves in one step."""
    op: str  # all_gather, reduce_scatter, all_reduce
    group: int  # GPUs in the group
    across: bool  # the group spans nodes
    buffer_bytes: float  # the collective's whole buffer, summed over the step's calls

    @property
    def sent(self) -> float:
        from finetune.collectives import sent_bytes

        return sent_bytes(self.op, self.group, self.buffer_bytes)


@dataclass(frozen=True)
class Traffic:
    """What one GPU sends in one optimizer step, and how long the links take."""
    links: tuple[Link, ...]

    @property
    def inside(self) -> float:
        return sum(l.sent for l in self.links if not l.across)

    @property
    def across(self) -> float:
        return sum(l.sent for l in self.links if l.across)

    def seconds(self, intra_gbps: float = INTRA_GBPS, inter_gbps: float = INTER_GBPS) -> float:
        """Communication time with nothing overlapped: inside bytes at the node's rate plus the bytes
        across nodes at the network's."""
        return self.inside * 8 / (intra_gbps * 1e9) + self.across * 8 / (inter_gbps * 1e9)

    def by_collective(self) -> dict[tuple[str, int], float]:
        """(op, group size) -> buffer bytes per step: the shape of what finetune/collectives.py counts."""
        out: dict[tuple[str, int], float] = {}
        for l in self.links:
            if l.group > 1:
                out[(l.op, l.group)] = out.get((l.op, l.group), 0.0) + l.buffer_bytes
        return out


@dataclass(frozen=True)
class StepShape:
    """What a strategy's step_collectives needs to know: the GPUs, the parameters and the micro-batches."""
    nodes: int
    gpus_per_node: int
    params: int  # P
    trained: int  # T
    root: int  # R: FSDP2's root unit, the embedding and the final norm
    micro_batches: int  # A, per GPU per optimizer step
    compute_bytes: int  # the dtype weights are gathered in (2 in bf16/fp16, 4 in fp32)
    weight_bytes: float = 0  # the whole model as gathered: P in the compute dtype, a 4-bit base's weights packed
    shard_size: int = 0  # hsdp's shard group (0: a node)
    hpz_size: int = 1  # zero3's hpZ secondary partition group (1: none)
    # per optimizer step, averaged over GRPO's rollout cycle (a rollout every num_iterations steps):
    reference_forwards: float = 0  # micro-batches of a frozen reference's forward (DPO; GRPO with beta > 0)
    policy_forwards: float = 0  # the policy's forwards without a backward (GRPO's old log-probs)
    whole_gathers: float = 0  # the whole model gathered for generation (GRPO's rollout)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def whole(self) -> float:
        """The bytes of one gather of every parameter."""
        return self.weight_bytes or self.params * self.compute_bytes

    @property
    def root_bytes(self) -> float:
        return self.root * self.compute_bytes

    def spans_nodes(self, group: int) -> bool:
        """Whether a group of `group` consecutive ranks (a shard group, or the whole world) spans nodes."""
        return group > self.gpus_per_node


def traffic(arch: Architecture, strategy: str, *, nodes: int, gpus_per_node: int, micro_batches: int,
            mixed_precision: str = "bf16", trained: int | None = None, shard_size: int = 0,
            hpz_size: int = 1) -> Traffic:
    """Per-GPU traffic of one optimizer step of `micro_batches` micro-batches on nodes x gpus_per_node GPUs,
    as the strategy states it (Strategy.step_collectives). trained: the trained parameters (a LoRA run's
    adapters; default all). shard_size: hsdp's shard group (0: a node). hpz_size: zero3's hpZ group."""
    from finetune.strategy import strategy_for

    p = arch.num_parameters()
    shape = StepShape(nodes=nodes, gpus_per_node=gpus_per_node, params=p, trained=p if trained is None else trained,
                      root=arch.embedding_parameters + arch.hidden_size, micro_batches=micro_batches,
                      compute_bytes=2 if mixed_precision != "no" else 4, shard_size=shard_size, hpz_size=hpz_size)
    links = [Link(*c) for c in strategy_for(strategy).step_collectives(shape)]
    return Traffic(tuple(l for l in links if l.group > 1))


# ---------------------------------------------------------------- the layouts of a cluster, and the choice


@dataclass(frozen=True)
class Layout:
    """One row of `finetune plan --nodes`: a setup's memory per GPU and its traffic per step."""
    estimate: object  # memory.Estimate
    traffic: Traffic
    seconds: float  # communication per step on the given links, nothing overlapped

    @property
    def setup(self):
        return self.estimate.setup


def step_shape_of(recipe, arch: Architecture, nodes: int, gpus_per_node: int, setup=None) -> StepShape:
    """A recipe's step on nodes x gpus_per_node GPUs: its micro-batches per GPU (the accumulation), the
    trained parameters, and the forwards without a backward: a DPO run's frozen reference in each
    micro-batch; a GRPO run's rollout, every num_iterations steps: the model gathered once, the old
    log-probs (num_iterations > 1) and the reference's (beta > 0) in micro-batches."""
    from finetune.memory import QUANT_PACKED, holds_reference, lora_parameters, recipe_lora
    from finetune.plan import derive_grad_accum

    accum = derive_grad_accum(recipe, nodes * gpus_per_node)
    lora, r, targets = recipe_lora(recipe)
    p = arch.num_parameters()
    reference = accum if holds_reference(recipe) else 0
    policy = gathers = 0.0
    if recipe.objective == "grpo":
        cycle = recipe.num_iterations
        gathers, reference = 1 / cycle, reference / cycle
        policy = accum / cycle if cycle > 1 else 0.0
    lp = 2 if recipe.mixed_precision != "no" else 4
    packed = arch.decoder_linear_weights() if lora and recipe.load_in_4bit else 0  # NF4: half a byte a weight
    return StepShape(nodes=nodes, gpus_per_node=gpus_per_node, params=p, weight_bytes=(p - packed) * lp + packed * QUANT_PACKED,
                     trained=lora_parameters(arch, r, targets) if lora else p,
                     root=arch.embedding_parameters + arch.hidden_size, micro_batches=accum,
                     compute_bytes=lp, shard_size=getattr(setup, "shard_size", 0), hpz_size=getattr(setup, "hpz_size", 1),
                     reference_forwards=reference, policy_forwards=policy, whole_gathers=gathers)


def layout_traffic(recipe, arch: Architecture, setup, nodes: int, gpus_per_node: int) -> Traffic:
    """The traffic of a recipe's step under `setup` (a memory.Setup)."""
    from finetune.strategy import strategy_for

    shape = step_shape_of(recipe, arch, nodes, gpus_per_node, setup)
    links = [Link(*c) for c in strategy_for(setup.strategy).step_collectives(shape)]
    return Traffic(tuple(l for l in links if l.group > 1))


def resolved(setup, gpus: int, gpus_per_node: int):
    """The setup with its shard group written out (hsdp's shard_size=0: a node's GPUs)."""
    from dataclasses import replace

    from finetune.strategy import strategy_for

    shard = strategy_for(setup.strategy).sharding_group(setup, gpus, gpus_per_node)
    return replace(setup, shard_size=shard) if shard < gpus and not setup.shard_size else setup


def cluster_setups(recipe, nodes: int, gpus_per_node: int) -> list:
    """The layouts `finetune plan --nodes` weighs: ddp, zero1, zero2, flat fsdp and zero3 over every GPU,
    and with more than one node hsdp (a node's GPUs shard, the nodes replicate) and zero3 with hpZ (a
    secondary copy within a node); plus the recipe's own. A 4-bit base: ddp, fsdp, hsdp, zero3 only."""
    from finetune.memory import Setup
    from finetune.strategy import strategy_for

    setups = [Setup("ddp"), Setup("zero1"), Setup("zero2"), Setup("fsdp"), Setup("zero3")]
    if nodes > 1:
        setups[4:4] = [Setup("hsdp", shard_size=gpus_per_node)]
        setups.append(Setup("zero3", hpz_size=gpus_per_node))
    if recipe.load_in_4bit:
        setups = [s for s in setups if strategy_for(s.strategy).takes_4bit_base]
    own = resolved(Setup.of(recipe), nodes * gpus_per_node, gpus_per_node)
    if own not in setups:
        setups.append(own)
    return setups


def layouts(recipe, arch: Architecture, nodes: int, gpus_per_node: int, intra_gbps: float = INTRA_GBPS,
            inter_gbps: float = INTER_GBPS) -> list[Layout]:
    """The rows of `finetune plan --nodes`: cluster_setups, less those the run refuses on this cluster
    (memory.setup_problem)."""
    from finetune.memory import recipe_estimate, setup_problem

    out = []
    for setup in cluster_setups(recipe, nodes, gpus_per_node):
        if setup_problem(recipe, setup, nodes * gpus_per_node, nodes) is not None:
            continue
        estimate = recipe_estimate(recipe, nodes * gpus_per_node, arch, setup, gpus_per_node=gpus_per_node)
        t = layout_traffic(recipe, arch, setup, nodes, gpus_per_node)
        out.append(Layout(estimate, t, t.seconds(intra_gbps, inter_gbps)))
    return out


def one_node_choice(recipe, arch: Architecture, gpus: int, budget: int, headroom: float):
    """memory.plan_table's choose: of its estimates on one node of `gpus` GPUs, the one `choose` picks,
    and what to say of it (its bytes, the rule)."""
    def pick(estimates):
        rows = []
        for e in estimates:
            t = layout_traffic(recipe, arch, e.setup, 1, gpus)
            rows.append(Layout(e, t, t.seconds(INTRA_GBPS, INTER_GBPS)))
        best = choose(rows, budget, headroom)
        if best is None:
            return None, []
        rule = CHOICE_RULE.replace("the links above", f"{INTRA_GBPS:g} Gb/s links (NVLink 4)")
        return best.estimate, [f"each GPU sending {_bytes(best.traffic.inside)} per step",
                               f"why: {rule}; more than one node: --nodes N --gpus-per-node G"]

    return pick


def with_wider_hybrid(rows: list[Layout], recipe, arch: Architecture, nodes: int, gpus_per_node: int, budget: int,
                      headroom: float, intra_gbps: float, inter_gbps: float) -> list[Layout]:
    """Where one node cannot hold a copy (hsdp over a node does not fit), also hsdp over the fewest nodes
    that can (2, 4, ... nodes a copy, fewer than all), after the node-wide row."""
    from dataclasses import replace

    from finetune.memory import recipe_estimate

    at = next((i for i, r in enumerate(rows) if r.setup.shard_size == gpus_per_node and r.setup.hpz_size == 1
               and r.setup.shard_size), None)
    if at is None or rows[at].estimate.fits(budget, headroom):
        return rows
    shard = 2 * gpus_per_node
    while shard < nodes * gpus_per_node and (nodes * gpus_per_node) % shard == 0:
        setup = replace(rows[at].setup, shard_size=shard)
        estimate = recipe_estimate(recipe, nodes * gpus_per_node, arch, setup, gpus_per_node=gpus_per_node)
        if estimate.fits(budget, headroom):
            if any(r.setup == setup for r in rows):
                return rows
            t = layout_traffic(recipe, arch, setup, nodes, gpus_per_node)
            return rows[:at + 1] + [Layout(estimate, t, t.seconds(intra_gbps, inter_gbps))] + rows[at + 1:]
        shard *= 2
    return rows


# Layouts whose communication times are this close count as equally fast; the earlier in the table (the
# simpler: ddp, zero1, zero2, fsdp, hsdp, zero3, zero3 + hpZ) wins.
SAME_TIME = 0.05


def offload_level(setup) -> int:
    """How much a setup moves off the GPU: 0 nothing, 1 the optimizer to the CPU, 2 the parameters too
    (fsdp's offload_params=cpu moves all three), 3 anything to NVMe."""
    moved = (setup.offload_optimizer, setup.offload_params)
    return 3 if "nvme" in moved else 2 if setup.offload_params != "none" else 1 if setup.offload_optimizer != "none" else 0


def choose(rows: list[Layout], budget: int, headroom: float) -> Layout | None:
    """The fastest that fits: of the layouts whose memory per GPU fits the budget (less the headroom),
    those that offload least (nothing, if any such fits); among them the least communication time per
    step; within SAME_TIME of it, the first in the table. None if nothing fits."""
    fitting = [(i, r) for i, r in enumerate(rows) if r.estimate.fits(budget, headroom)]
    if not fitting:
        return None
    least = min(offload_level(r.setup) for _, r in fitting)
    pool = [(i, r) for i, r in fitting if offload_level(r.setup) == least]
    fastest = min(r.seconds for _, r in pool)
    return min((i, r) for i, r in pool if r.seconds <= fastest * (1 + SAME_TIME) + 1e-12)[1] if pool else None


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


CHOICE_RULE = ("the fastest that fits: of the layouts whose memory per GPU fits, those that offload least "
               "(nothing, if any such fits), and among them the least communication time per step on the links "
               f"above, nothing overlapped; within {SAME_TIME:.0%} of that time, the first in the table (the simpler)")


def cluster_table(recipe, arch: Architecture, nodes: int, gpus_per_node: int, budget: int, headroom: float,
                  intra_gbps: float = INTRA_GBPS, inter_gbps: float = INTER_GBPS, name: str = "",
                  budget_text: str = "") -> str:
    """`finetune plan --nodes N --gpus-per-node G`: each layout's memory per GPU, the bytes each GPU sends
    per step inside its node and across nodes, their time on the links, and the choice."""
    from finetune.memory import Setup, own_setup_line
    from finetune.memory_tables import describe_run, gib

    rows = layouts(recipe, arch, nodes, gpus_per_node, intra_gbps, inter_gbps)
    n = nodes * gpus_per_node
    rows = with_wider_hybrid(rows, recipe, arch, nodes, gpus_per_node, budget, headroom, intra_gbps, inter_gbps)
    accum = step_shape_of(recipe, arch, nodes, gpus_per_node).micro_batches
    lines = [f"recipe {name or '(given)'}: {describe_run(recipe, n, arch)}",
             f"cluster: {nodes} node(s) x {gpus_per_node} GPUs; links per GPU: {intra_gbps:g} Gb/s inside a node, "
             f"{inter_gbps:g} Gb/s across nodes; {accum} micro-batch(es) per GPU per step",
             f"GPU memory{f' ({budget_text})' if budget_text else ''}: {gib(budget)} GiB, usable with {headroom:.0%} "
             f"headroom: {gib(budget * (1 - headroom))} GiB"]
    header = ["layout", "GiB per GPU", "fits", "sent inside node", "sent across nodes", "comm per step"]
    table = [header]
    own = resolved(Setup.of(recipe), n, gpus_per_node)
    for r in rows:
        mark = "* " if r.setup == own else "  "
        table.append([mark + r.setup.label, gib(r.estimate.peak), "yes" if r.estimate.fits(budget, headroom) else "no",
                      _bytes(r.traffic.inside), _bytes(r.traffic.across), _seconds(r.seconds)])
    widths = [max(len(t[i]) for t in table) for i in range(len(header))]
    for i, t in enumerate(table):
        lines.append("  ".join([t[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(t[1:], widths[1:])]).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    lines.append("* the recipe's own layout; sent: bytes each GPU sends per optimizer step (docs/memory-planner.md); "
                 "zero3 + MiCS is not offered: MiCS was removed from DeepSpeed 0.19 (deepspeedai/DeepSpeed#8489)")
    refused = own_setup_line(recipe, n, nodes)
    if refused:
        lines.append(refused)
    best = choose(rows, budget, headroom)
    if best is None:
        lines.append(f"nothing fits in {gib(budget * (1 - headroom))} GiB per GPU: use more GPUs, a smaller "
                     "micro_batch_size or max_seq_len, LoRA, or offload (python -m finetune.plan --gpus N lists them)")
    else:
        changes = {} if best.setup == own else {
            k: v for k, v in best.setup.overrides().items() if getattr(recipe, k) != v}
        how = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())
        others = sorted((r for r in rows if r is not best and r.estimate.fits(budget, headroom)), key=lambda r: r.seconds)
        runner_up = f"; next: {others[0].setup.label} ({_seconds(others[0].seconds)})" if others else ""
        lines.append(f"would run: {best.setup.label} ({gib(best.estimate.peak)} GiB per GPU, {_seconds(best.seconds)} of "
                     f"communication per step{runner_up})" + (f"; override with {how}" if how else "; the recipe's own"))
        lines.append(f"why: {CHOICE_RULE}")
    return "\n".join(lines)
