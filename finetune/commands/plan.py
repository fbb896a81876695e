"""`python -m finetune.plan --recipe NAME --gpus N --gpu-mem 80GB [key=value ...]`: the memory planner;
with `--nodes N --gpus-per-node G`, the layouts of a cluster and the one it would run (finetune/comm.py)."""

from __future__ import annotations

import argparse
import sys

from finetune.arch import load_architecture
from finetune.comm import INTER_GBPS, INTRA_GBPS, cluster_table, one_node_choice
from finetune.memory_tables import max_seq_len_table, parse_size, plan_table
from finetune.plan import data_parallel_size, derive_grad_accum
from finetune.recipe import RecipeError, resolve


def _parse_planner_args(argv):
    """`python -m finetune.plan` arguments; a usage mistake is a RecipeError (one line, exit 2)."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise RecipeError(f"{message} (see python -m finetune.plan --help)")

    parser = Parser(
        prog="python -m finetune.plan",
        description="Per-GPU memory of a recipe under every strategy and offload setting (the ZeRO paper's "
                    "model states plus an activation estimate; see finetune/memory.py), the bytes each GPU sends per "
                    "step (finetune/comm.py), and the setup it would run: the fastest that fits (the least "
                    "communication time per step of those that fit, offload only when nothing fits without). "
                    "Needs no GPU and no hub access for the models it knows.")
    parser.add_argument("--recipe", required=True, help="name in recipes/ or path to a .py file")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel processes in all (default 1)")
    parser.add_argument("--gpu-mem", help="memory of one GPU: 80GB (10^9 bytes), 40GiB, 24G (2^30)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of --gpu-mem kept free for the CUDA context and fragmentation (0.10)")
    parser.add_argument("--max-seq-len", action="store_true",
                        help="instead: the longest max_seq_len that fits --gpu-mem per setup, without sequence "
                             "parallelism and with the recipe's sequence_parallel (or every size the GPUs and heads "
                             "take); needs --gpu-mem")
    parser.add_argument("--nodes", type=int,
                        help="instead: the layouts of a cluster of this many nodes (with --gpus-per-node): memory "
                             "per GPU, bytes each GPU sends per step inside and across nodes, their time, and the "
                             "layout it would run (docs/multi-node.md)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in each node, with --nodes (8)")
    parser.add_argument("--intra-node-gbps", type=float, default=INTRA_GBPS,
                        help=f"link rate inside a node per GPU and direction, Gbit/s ({INTRA_GBPS:g}: NVLink 4)")
    parser.add_argument("--inter-node-gbps", type=float, default=INTER_GBPS,
                        help=f"network rate across nodes per GPU, Gbit/s ({INTER_GBPS:g}: a 400G NIC per GPU)")
    parser.add_argument("overrides", nargs="*", help="key=value, as for finetune/run.py")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        raise RecipeError(f"--gpus {args.gpus}: must be at least 1")
    if args.nodes is not None:
        for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
            if value <= 0:
                raise RecipeError(f"{flag} {value:g}: must be more than zero")
        for flag, value in (("--intra-node-gbps", args.intra_node_gbps), ("--inter-node-gbps", args.inter_node_gbps)):
            low, high = LINK_GBPS
            if not low <= value <= high:  # nan and inf too: no time per step to compare
                raise RecipeError(f"{flag} {value:g}: must be a link rate from {low:g} to {high:g} Gbit/s (a 400G NIC "
                                  f"is 400, NVLink 4 is {INTRA_GBPS:g})")
        if args.max_seq_len:
            raise RecipeError("--max-seq-len and --nodes: one question at a time; drop one of them")
        args.gpus = args.nodes * args.gpus_per_node
    if args.max_seq_len and args.gpu_mem is None:
        raise RecipeError("--max-seq-len needs --gpu-mem (the memory of one GPU, like 80GB)")
    if not 0 <= args.headroom < 1:
        raise RecipeError(f"--headroom {args.headroom}: must be at least 0 and below 1")
    return args


# The link rates the planner takes, Gbit/s per GPU: from a slow 100 Mbit/s link to 100 Tbit/s (several times
# NVLink 5); outside them its times would be meaningless (0.0 ms, or hundreds of digits)
LINK_GBPS = (0.1, 100_000)

CLUSTER_GPU_MEM = "80GB"  # --nodes without --gpu-mem: an H100's


def refused(recipe, gpus: int, arch) -> None:
    """The run's own refusals of this setup on `gpus` processes, raised as the run raises them (a setup
    the run refuses does not "fit"): sequence_parallel must divide the processes (finetune.plan.make_plan)
    and the model's attention heads (checked by the run and the `finetune train` front on its config)."""
    from finetune.sequence_parallel import config_problem, world_problem

    problem = world_problem(recipe, gpus) or config_problem(recipe, arch)
    if problem:
        raise RecipeError(f"the run refuses this setup on {gpus} GPU(s): {problem}")


def main(argv=None) -> int:
    """`python -m finetune.plan --recipe NAME --gpus N --gpu-mem 80GB [key=value ...]`"""
    try:
        args = _parse_planner_args(sys.argv[1:] if argv is None else argv)
        budget = parse_size(args.gpu_mem) if args.gpu_mem is not None else None
        recipe = resolve(args.recipe, args.overrides)  # the same loading and checks as finetune/run.py
        accum = derive_grad_accum(recipe, args.gpus)
        arch = load_architecture(recipe.model)
        refused(recipe, args.gpus, arch)
        if args.nodes is not None:
            print(cluster_table(recipe, arch, args.nodes, args.gpus_per_node, budget or parse_size(CLUSTER_GPU_MEM),
                                args.headroom, args.intra_node_gbps, args.inter_node_gbps, name=args.recipe,
                                budget_text=args.gpu_mem or f"{CLUSTER_GPU_MEM}, the default"))
            return 0
        if args.max_seq_len:
            print(max_seq_len_table(recipe, args.gpus, budget, headroom=args.headroom, name=args.recipe, arch=arch,
                                    budget_text=args.gpu_mem))
            return 0
        table = plan_table(recipe, args.gpus, budget, headroom=args.headroom, name=args.recipe, arch=arch,
                           budget_text=args.gpu_mem or "",
                           choose=one_node_choice(recipe, arch, args.gpus, budget, args.headroom) if budget else None)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    dp = data_parallel_size(recipe, args.gpus)
    ranks = f"{args.gpus} GPUs" if dp == args.gpus else \
        f"{dp} data-parallel ranks ({args.gpus} GPUs / sequence_parallel)"
    batch = f"{recipe.micro_batch_size * accum * dp}"
    if recipe.objective == "grpo":  # completions; a step reads global / num_generations prompts
        batch = (f"{recipe.micro_batch_size * accum * dp // recipe.num_generations} prompts x "
                 f"{recipe.num_generations} = {batch} completions")
    print(f"global batch {batch} = micro {recipe.micro_batch_size} x accum "
          f"{accum} x {ranks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
