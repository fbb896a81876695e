"""A 2-node job on one machine: two `accelerate launch` commands with --num_machines 2 and machine
ranks 0 and 1, rendezvous on 127.0.0.1, one process each: the same loss curve as 2 processes on one
node (the same ranks, the same gloo all-reduces, so the same numbers)."""

from __future__ import annotations

import subprocess
import sys

from pathlib import Path

from finetune.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_two_nodes_match_one_node(strategy_run, launch_env, fast_overrides, free_port, tmp_path):
    one_node = strategy_run("fsdp")  # the suite's 2-process fsdp launch (its checkpoints do not move the curve)
    out = tmp_path / "two-nodes"
    port = free_port
    nodes = []
    for machine_rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
               "--num_processes", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, "--rdzv_backend", "static", "--same_network",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               "finetune/run.py", "--recipe", "tiny", *fast_overrides, f"output_dir={out}", "strategy=fsdp"]
        nodes.append(subprocess.Popen(cmd, cwd=REPO, env=launch_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [node.communicate(timeout=600) for node in nodes]
    for node, (_, stderr) in zip(nodes, results):
        assert node.returncode == 0, stderr[-4000:]
    assert "fsdp on 2 cpu process(es), 2 machine(s)" in results[0][1]
    two = [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    one = [(r["step"], r["loss"]) for r in one_node.train_records]
    assert [s for s, _ in two] == list(range(1, 13))
    assert two == one


# ---------------------------------------------------------------- 2 nodes x 2 GPUs as 4 processes
# One launch per layout, which the tests below share: hybrid sharding (hsdp: shard within a node, replicate
# across) and ZeRO-3 with hpZ, each equal to 1 process, each counted to check the planner; then a resume
# chain across layouts: hybrid 2x2 -> flat fsdp 4 -> 1 process -> flat fsdp 4 -> hybrid 2x2.

import math  # noqa: E402

import pytest  # noqa: E402

from finetune.collectives import read_counts  # noqa: E402
from layouts import COUNT_COLLECTIVES, HPZ, HYBRID, assert_planner_matches, counting  # noqa: E402
from suite_runs import SAVE, resume_copy  # noqa: E402

CURVE_RTOL = 1e-6  # measured: the 4-process layouts and 1 process agree to ~1e-8 in fp32


def records(run):
    return [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("tokens")) for r in run.train_records + run.eval_records]


def assert_close_after(run, reference, step=0, last=12):
    """run's records after `step` up to its `last` equal reference's (a leg stopped early ends sooner)."""
    got = [r for r in records(run) if r[0] > step]
    # a leg stopped by a signal saves and stops without the eval its last step would have had
    evaluated = {r[0] for r in got if r[2] is not None}
    want = [r for r in records(reference) if step < r[0] < last or (r[0] == last and (r[2] is None or last in evaluated))]
    assert [(r[0], r[3]) for r in got] == [(r[0], r[3]) for r in want], "same steps, same global batches"
    for g, w in zip(got, want):
        for a, b in ((g[1], w[1]), (g[2], w[2])):
            assert (a is None) == (b is None)
            if a is not None:
                assert math.isclose(a, b, rel_tol=CURVE_RTOL), (g, w)


@pytest.fixture(scope="module")
def four(launch, tmp_path_factory):
    """four(name) -> (Run, counting env): the 4-process SFT launch of a layout, launched once."""
    runs = {}

    def get(name):
        if name not in runs:
            counts = counting(tmp_path_factory)
            overrides = {"hybrid": HYBRID, "hpz": HPZ}[name]
            runs[name] = launch(4, *overrides, *SAVE, extra_env=counts), counts
        return runs[name]

    return get


def test_hybrid_2x2_equals_one_process(four, strategy_run):
    run, counts = four("hybrid")
    assert "hsdp (2 replicas, each sharded over 2 GPUs) on 4 cpu process(es)" in run.stderr
    # the mesh is 2 x 2: the weights gathered and the gradients reduce-scattered within [0, 1] (a node),
    # the gradient shard all-reduced with rank 2 (the other node), nothing gathered over all 4
    groups = {(c["op"], tuple(c["group"])) for r in read_counts(counts[COUNT_COLLECTIVES]) if r["rank"] == 0
              for c in r["calls"] if c["bytes"] >= 1024}  # not the loss and token counts
    assert groups == {("all_gather", (0, 1)), ("reduce_scatter", (0, 1)), ("all_reduce", (0, 2))}, groups
    assert_close_after(run, strategy_run("fsdp", nprocs=1))


def test_hybrid_bytes_match_the_planner(four):
    run, counts = four("hybrid")
    got = assert_planner_matches(run, counts, "tiny", HYBRID, steps=range(2, 13))
    assert set(got) == {("all_gather", 2, False), ("reduce_scatter", 2, False), ("all_reduce", 2, True)}


def test_zero3_hpz_2x2_equals_one_process_and_the_planner(four, strategy_run):
    """hpZ passes the one-process equality here (fp32, 12 steps of the tiny model); DeepSpeed#4851, #5059
    and #6926 report it not converging elsewhere (bf16, larger models), which this cannot rule out."""
    run, counts = four("hpz")
    assert_close_after(run, strategy_run("zero3", nprocs=1))
    # steady steps: not the first after an eval (0, 6), whose gathers re-record ZeRO-3's fetch trace (all
    # from the secondary copy: finetune/strategy/zero.py Zero3.step_collectives)
    got = assert_planner_matches(run, counts, "tiny", HPZ, steps=[2, 3, 4, 5, 6, 8, 9, 10, 11, 12])
    assert ("all_gather", 2, False) in got and ("all_gather", 4, True) in got  # the secondary copy within a node


def newest_step(run) -> int:
    return max(int(p.name.split("_")[1]) for p in (run.output_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


def test_resume_across_layouts(four, launch, tmp_path_factory):
    """hybrid 2x2 -> flat fsdp over 4 -> 1 process -> flat 4 -> hybrid 2x2: each stopped by a SIGTERM (a
    preempted job) one step after it resumed, continued from its checkpoint on the next layout; every
    step of every leg equals the uninterrupted hybrid run's, and the flat leg's bytes the planner's."""
    hybrid, _ = four("hybrid")
    legs = [(4, ["strategy=fsdp"], "(4 -> 4 processes)"), (1, ["strategy=fsdp"], "(4 -> 1 processes)"),
            (4, ["strategy=fsdp"], "(1 -> 4 processes)"), (4, HYBRID, "(4 -> 4 processes)")]
    source, step = hybrid, 5
    for i, (nprocs, overrides, moved) in enumerate(legs):
        out = resume_copy(source, step, tmp_path_factory)
        last = i == len(legs) - 1
        counts = counting(tmp_path_factory)
        env = dict(counts, **({} if last else {"FINETUNE_FAULT": f"after_step:0:{step + 1}:SIGTERM"}))
        run = launch(nprocs, *overrides, *SAVE, "--resume", "auto", output_dir=out, extra_env=env, check=last)
        assert f"at step {step}" in run.stderr, run.stderr[-3000:]
        if moved.split()[0] != moved.split()[2]:
            assert moved in run.stderr, run.stderr[-3000:]
        stopped = 12 if last else newest_step(run)
        assert_close_after(run, hybrid, step, stopped)
        if i == 0:  # flat fsdp over 2 nodes x 2: one group of 4 for everything
            assert_planner_matches(run, counts, "tiny", ["strategy=fsdp"], steps=[r[0] for r in records(run)
                                                                                    if r[1] is not None])
        if last:
            assert [r[0] for r in records(run) if r[1] is not None][-1] == 12
        else:
            assert step < stopped < 12, stopped
            source, step = run, stopped
