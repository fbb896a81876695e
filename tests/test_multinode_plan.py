"""Multi-node layouts without launching anything: the recipe keys of hybrid sharding (strategy=hsdp,
shard_size) and hierarchical ZeRO-3 (zero_hpz_partition_size; mics_shard_size refused), their checks
before anything loads, checkpoints moving between fsdp and hsdp, and `finetune plan --nodes`: the
bytes each layout sends inside and across nodes and the layout it would run. The bytes are held to the
real runs' counted collectives in tests/distributed/test_multinode.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import comm
from finetune import memory as M
from finetune import memory_tables as MT
from finetune.arch import load_architecture
from finetune.checkpointing.manifest import fingerprint
from finetune.checkpointing.resume import ResumePoint, check_fits
from finetune.plan import make_plan
from finetune.recipe import RecipeError, resolve

REPO = Path(__file__).resolve().parents[1]


def error_of(*overrides, env=None) -> str:
    """The error a launch on GPUs (fsdp_version=1 needs them) meets before anything loads."""
    with pytest.raises(RecipeError) as info:
        make_plan(resolve("tiny", list(overrides)), env=env or {}, cuda_available=True)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- recipe keys and their checks


@pytest.mark.parametrize("overrides,words", [
    (["strategy=fsdp", "shard_size=2"], "shard_size=2 with strategy=fsdp: it applies to strategy=hsdp only"),
    (["strategy=ddp", "shard_size=2"], "shard_size=2 with strategy=ddp: it applies to strategy=hsdp only"),
    (["strategy=fsdp", "zero_hpz_partition_size=8"], "zero_hpz_partition_size=8 with strategy=fsdp: it applies to "
                                                     "strategy=zero3 only"),
    (["strategy=zero3", "mics_shard_size=8"], "MiCS was removed from DeepSpeed in 0.19 (deepspeedai/DeepSpeed#8489"),
])
def test_layout_keys_belong_to_their_strategy(overrides, words):
    assert words in error_of(*overrides)


@pytest.mark.parametrize("overrides,env,words", [
    (["strategy=hsdp", "shard_size=3"], {"WORLD_SIZE": "4"}, "shard_size=3: the shard groups must divide the 4 "
                                                             "processes"),
    (["strategy=hsdp"], {"WORLD_SIZE": "4", "ACCELERATE_NUM_MACHINES": "4"},
     "groups of one GPU shard nothing (that is ddp)"),
    (["strategy=hsdp", "shard_size=2", "fsdp_version=1"], {"WORLD_SIZE": "4"}, "hybrid sharding is built on FSDP2"),
])
def test_hsdp_layout_problems_before_anything_loads(overrides, env, words):
    assert words in error_of(*overrides, env=env)
    dry = make_plan(resolve("tiny", overrides), env=env, cuda_available=True, dry_run=True)  # planned elsewhere
    assert any(words in p for p in dry.unchecked)


def test_hsdp_shards_within_a_node_by_default():
    plan = make_plan(resolve("tiny", ["strategy=hsdp"]), env={"WORLD_SIZE": "16", "ACCELERATE_NUM_MACHINES": "2"},
                     cuda_available=False)
    assert "hsdp (2 replicas, each sharded over 8 GPUs) on 16 cpu process(es), 2 machine(s)" in plan.describe()
    plan = make_plan(resolve("tiny", ["strategy=hsdp", "shard_size=4"]), env={"WORLD_SIZE": "16"},
                     cuda_available=False)
    assert "hsdp (4 replicas, each sharded over 4 GPUs)" in plan.describe()


def test_hsdp_builds_a_two_dimensional_mesh_config():
    from finetune.strategy import strategy_for

    plan = make_plan(resolve("tiny", ["strategy=hsdp"]), env={"WORLD_SIZE": "32", "ACCELERATE_NUM_MACHINES": "4"},
                     cuda_available=False)
    from transformers import LlamaConfig

    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    config = strategy_for("hsdp").plugins(plan, tiny)
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    pc = config["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (4, 8) and config["fsdp_plugin"].fsdp_version == 2


@pytest.mark.parametrize("size,world,words", [
    (3, 4, "zero_hpz_partition_size=3 with 4 process(es): hpZ's groups must divide the processes; use one of 2, 4 "
           "(usually one node's GPUs), or zero_hpz_partition_size=1 (no hpZ)"),
    (3, 2, "zero_hpz_partition_size=3 with 2 process(es): hpZ's groups must divide the processes; use one of 2"),
    (4, 2, "zero_hpz_partition_size=4 with 2 process(es)"),
    (3, 16, "use one of 2, 4, 8, 16 (usually one node's GPUs)"),
    (2, 1, "zero_hpz_partition_size=2 with 1 process(es): hpZ's groups must divide the processes; use none here, or "
           "zero_hpz_partition_size=1 (no hpZ)"),
])
def test_hpz_groups_must_divide_the_processes(size, world, words):
    """DeepSpeed asserted "4 is not divisible by 3" in every rank, and on 2 processes made 3 and 4 into
    one group of 2 without a word: one line before anything loads (the strategy's layout_problem, which
    the planner asks too)."""
    from finetune.strategy import strategy_for

    assert words in error_of("strategy=zero3", f"zero_hpz_partition_size={size}", env={"WORLD_SIZE": str(world)})
    recipe = resolve("tiny", ["strategy=zero3", f"zero_hpz_partition_size={size}"])
    assert words in strategy_for("zero3").layout_problem(recipe, world, 1)
    for fits in (2, 4, 8, 16):
        if fits % size == 0 and fits >= size:
            assert strategy_for("zero3").layout_problem(recipe, fits, 1) is None


def test_hpz_goes_into_the_deepspeed_config():
    from finetune.strategy import deepspeed_config

    plan = make_plan(resolve("tiny", ["strategy=zero3", "zero_hpz_partition_size=8"]), env={"WORLD_SIZE": "16"},
                     cuda_available=False)
    assert deepspeed_config(plan, 64)["zero_optimization"]["zero_hpz_partition_size"] == 8
    plain = make_plan(resolve("tiny", ["strategy=zero3"]), env={"WORLD_SIZE": "16"}, cuda_available=False)
    assert "zero_hpz_partition_size" not in deepspeed_config(plain, 64)["zero_optimization"]


@pytest.mark.parametrize("saved,current,fits", [("fsdp", "hsdp", True), ("hsdp", "fsdp", True),
                                                ("hsdp", "hsdp", True), ("hsdp", "zero3", False)])
def test_fsdp_and_hsdp_checkpoints_resume_into_each_other(saved, current, fits, tmp_path):
    """Both write DCP shards, which load on any mesh (tests/distributed/test_multinode.py resumes across
    them for real); ZeRO's do not."""
    written = resolve("tiny", [f"strategy={saved}"])
    point = ResumePoint(path=tmp_path, step=5, world_size=4, global_batch_size=16, strategy=saved, recipe={},
                        manifest={"fingerprint": fingerprint(written)})
    if fits:
        check_fits(point, resolve("tiny", [f"strategy={current}"]), allow_data_change=False)
    else:
        with pytest.raises(RecipeError, match="was written with strategy=hsdp"):
            check_fits(point, resolve("tiny", [f"strategy={current}"]), allow_data_change=False)


# ---------------------------------------------------------------- the communication model


def test_what_crosses_nodes_under_each_layout():
    arch = load_architecture("meta-llama/Llama-3.1-8B")
    P = arch.num_parameters()

    def t(strategy, **kw):
        return comm.traffic(arch, strategy, nodes=4, gpus_per_node=8, micro_batches=2, **kw)

    ddp = t("ddp")
    assert ddp.inside == 0 and ddp.across == pytest.approx(2 * 4 * P * 31 / 32)  # fp32 gradients all-reduced
    hsdp = t("hsdp")
    assert {(l.op, l.group, l.across) for l in hsdp.links} == {
        ("all_gather", 8, False), ("reduce_scatter", 8, False), ("all_reduce", 4, True)}
    assert hsdp.across == pytest.approx(2 * 4 * P / 8 * 3 / 4)  # each GPU's fp32 gradient shard, among 4 replicas
    fsdp = t("fsdp")
    assert fsdp.inside == 0 and fsdp.across == pytest.approx(hsdp.inside * 31 / 32 / (7 / 8))  # the same, over 32
    hpz = t("zero3", hpz_size=8)
    assert {(l.op, l.group, l.across) for l in hpz.links} == {
        ("all_gather", 32, True), ("all_gather", 8, False), ("reduce_scatter", 32, True)}
    assert hpz.across < t("zero3").across
    one_node = comm.traffic(arch, "fsdp", nodes=1, gpus_per_node=8, micro_batches=2)
    assert one_node.across == 0 and one_node.inside > 0


def test_hsdp_memory_is_fsdp_on_one_node():
    """Hybrid sharding holds what flat sharding over one node's GPUs holds, whatever the node count."""
    recipe = resolve("llama8b_lora_fsdp", [])
    arch = load_architecture(recipe.model)
    hybrid = M.recipe_estimate(recipe, 32, arch, M.Setup("hsdp", shard_size=8), gpus_per_node=8)
    one_node = M.recipe_estimate(recipe, 8, arch, M.Setup("fsdp"))
    assert (hybrid.params, hybrid.grads, hybrid.optimizer) == (one_node.params, one_node.grads, one_node.optimizer)


def _plan(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "finetune.plan", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_plan_nodes_table_and_choice():
    proc = _plan("--recipe", "llama7b_zero3", "--nodes", "4", "--gpus-per-node", "8")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    assert "cluster: 4 node(s) x 8 GPUs; links per GPU: 3600 Gb/s inside a node, 400 Gb/s across nodes" in out
    header = next(line for line in out.splitlines() if line.startswith("layout"))
    assert header.split() == ["layout", "GiB", "per", "GPU", "fits", "sent", "inside", "node", "sent", "across",
                              "nodes", "comm", "per", "step"]
    first = out.splitlines().index(header) + 2  # the header, its rule, then the layouts
    labels = [line[2:].split("  ")[0] for line in out.splitlines()[first:first + 7]]
    assert labels == ["ddp", "zero1", "zero2", "fsdp", "hsdp shard 8", "zero3", "zero3 + hpZ 8"], labels
    assert "MiCS is not offered: MiCS was removed from DeepSpeed 0.19" in out
    assert "would run: hsdp shard 8 (" in out and "override with strategy=hsdp shard_size=8" in out
    assert "why: the fastest that fits" in out


def test_plan_nodes_prefers_flat_layouts_on_a_fast_network():
    """With a network as fast as the node's links, hybrid sharding gains nothing: a flat layout sends least
    (zero1: bf16 gradients all-reduced once, bf16 weights gathered once; zero3 + hpZ within 5% of it, and
    later in the table)."""
    fast = _plan("--recipe", "llama7b_zero3", "--nodes", "4", "--gpus-per-node", "8", "--inter-node-gbps", "3600")
    assert fast.returncode == 0 and "would run: zero1 (" in fast.stdout, fast.stdout[-800:]


@pytest.mark.parametrize("args,words", [
    (["--nodes", "0"], "--nodes 0: must be more than zero"),
    (["--nodes", "2", "--inter-node-gbps", "-1"], "--inter-node-gbps -1: must be a link rate from 0.1 to 100000 Gbit/s"),
    (["--nodes", "2", "--max-seq-len", "--gpu-mem", "80GB"], "--max-seq-len and --nodes"),
])
def test_plan_nodes_errors_are_one_line(args, words):
    proc = _plan("--recipe", "llama7b_zero3", *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert words in proc.stderr


def test_finetune_train_passes_the_node_count_through(capsys, monkeypatch):
    """`finetune train --num_machines 2 --num_processes 4`: the run's plan (checked in this process, as
    the launched ranks will check it) shards within each machine's 2 processes, and the launcher gets
    --num_machines (cli.launch_command)."""
    from finetune.commands import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["train", "tiny", "strategy=hsdp", "--num_processes", "4", "--num_machines", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "hsdp (2 replicas, each sharded over 2 GPUs) on 4 cpu process(es), 2 machine(s)" in out
    shard_of_2 = M.recipe_estimate(resolve("tiny", ["strategy=hsdp"]), 4, load_architecture(resolve("tiny", []).model),
                                   gpus_per_node=2)
    assert f"params {MT.gib(shard_of_2.params, 2**20)}" in out
    cmd = cli.launch_command({"--num_machines": "2", "--machine_rank": "1", "--main_process_ip": "10.0.0.1"},
                             ["--recipe", "tiny"], 4)
    assert cmd[cmd.index("--num_machines") + 1] == "2" and cmd[cmd.index("--machine_rank") + 1] == "1"


def test_where_a_node_cannot_hold_a_copy_hybrid_over_more_nodes_is_offered():
    """A full fine-tune of 70B: 16 bytes a parameter over a node's 8 GPUs does not fit 80 GB, over 2 nodes
    neither, over 4 it does: the table adds hsdp over 32 GPUs after the node-wide row."""
    recipe = resolve("llama70b_lora_hsdp", ["lora=false"])
    arch = load_architecture(recipe.model)
    text = comm.cluster_table(recipe, arch, 8, 8, MT.parse_size("80GB"), M.HEADROOM)
    labels = [line[2:].split("  ")[0] for line in text.splitlines() if line[:2] in ("  ", "* ")]
    assert labels[labels.index("hsdp shard 8") + 1] == "hsdp shard 32" and "hsdp shard 16" not in labels
    small = comm.cluster_table(resolve("llama70b_lora_hsdp", []), arch, 8, 8, MT.parse_size("80GB"), M.HEADROOM)
    assert "hsdp shard 16" not in small and "hsdp shard 32" not in small  # LoRA: a node holds a copy


@pytest.mark.parametrize("flag,value", [("--inter-node-gbps", "nan"), ("--inter-node-gbps", "inf"),
                                        ("--inter-node-gbps", "1e-300"), ("--intra-node-gbps", "nan"),
                                        ("--intra-node-gbps", "1e300")])
def test_plan_nodes_link_rates_must_be_finite_and_sane(flag, value, capsys):
    """nan died in comm.choose (min() of an empty sequence), inf printed 0.0 ms everywhere and 1e-300
    300-digit times: each is now one line naming the option, exit code 2."""
    from finetune.commands.plan import main

    capsys.readouterr()
    assert main(["--recipe", "llama7b_zero3", "--nodes", "2", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {flag} {float(value):g}: must be a link rate from "
                                                          "0.1 to 100000 Gbit/s"), captured.err
    assert captured.err.count("\n") == 1


def cluster_labels(text: str) -> list[str]:
    return [line[2:].split("  ")[0] for line in text.splitlines() if line[:2] in ("  ", "* ")]


@pytest.mark.parametrize("overrides,nodes,words", [
    (["strategy=hsdp", "shard_size=3"], 2, "the shard groups must divide the 16 processes"),
    (["strategy=hsdp", "shard_size=16", "global_batch_size=48"], 3, "the shard groups must divide the 24 processes"),
    (["strategy=zero3", "shard_size=0", "zero_hpz_partition_size=3"], 2, "hpZ's groups must divide the processes; use one of 2, 4, 8, 16"),
])
def test_plan_nodes_neither_lists_nor_runs_a_layout_the_run_refuses(overrides, nodes, words):
    """The recipe's own layout that the run refuses (make_plan on these processes: the strategy's
    layout_problem) is in no row and never the choice: a line says the run refuses it, and why (the
    planner said 'would run: hsdp shard 3'). Every layout it lists the run takes."""
    recipe = resolve("llama70b_lora_hsdp", overrides)
    arch = load_architecture(recipe.model)
    text = comm.cluster_table(recipe, arch, nodes, 8, MT.parse_size("80GB"), M.HEADROOM)
    own = M.Setup.of(recipe).label
    assert own not in cluster_labels(text) and f"would run: {own}" not in text
    assert f"the recipe's setup ({own}): not listed, the run refuses it on {nodes * 8} GPU(s): " in text and words in text
    with pytest.raises(RecipeError, match=words):
        make_plan(recipe, env={"WORLD_SIZE": str(nodes * 8), "ACCELERATE_NUM_MACHINES": str(nodes)}, cuda_available=True)
    for row in comm.layouts(recipe, arch, nodes, 8):
        assert M.setup_problem(recipe, row.setup, nodes * 8, nodes) is None
        make_plan(resolve("llama70b_lora_hsdp", [*overrides, *(f"{k}={v}" for k, v in row.setup.overrides().items())]),
                  env={"WORLD_SIZE": str(nodes * 8), "ACCELERATE_NUM_MACHINES": str(nodes)}, cuda_available=True)


def test_plan_on_one_gpu_lists_no_hybrid_layout(capsys):
    """On 1 GPU the table listed the recipe's 'hsdp shard 8', which cannot exist there."""
    from finetune.commands.plan import main

    capsys.readouterr()
    for extra in ([], ["--max-seq-len"]):
        assert main(["--recipe", "llama70b_lora_hsdp", "--gpus", "1", "--gpu-mem", "80GB", *extra]) == 0
        out = capsys.readouterr().out
        assert not [line for line in out.splitlines() if line[2:].startswith("hsdp")], out
        assert "the recipe's setup (hsdp shard 8): not listed, the run refuses it on 1 GPU(s): " in out
