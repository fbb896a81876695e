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
