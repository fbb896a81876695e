"""Part 1: model-state memory per rank, every strategy and offload setting, 2 processes.

For each setup, bench/helpers/memory_probe.py runs under `accelerate launch --multi_gpu --num_processes 2`
and reports what each rank holds (bench/helpers/held.py held_bytes: tensor storage of parameters,
gradients and optimizer states) and its peak resident memory. Next to it: the ZeRO paper's fp32
formula (finetune.memory.paper_model_states, ../shared/reference/figures.md) and the toolkit's own
planner estimate (finetune.memory.estimate), which knows where DeepSpeed departs from the paper.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.parts.common import MODELS, accelerate_launch, build_model, fresh_dir, mib, run, shown, table

# (label, overrides): finetune.memory.SETUPS without nvme (no NVMe here)
SETUPS = [
    ("ddp", ["strategy=ddp"]),
    ("ddp + ZeroRedundancyOptimizer", ["strategy=ddp", "ddp_shard_optimizer=true"]),
    ("zero1", ["strategy=zero1"]),
    ("zero2", ["strategy=zero2"]),
    ("zero3", ["strategy=zero3"]),
    ("fsdp", ["strategy=fsdp"]),
    ("zero2, optimizer->cpu", ["strategy=zero2", "offload_optimizer=cpu"]),
    ("zero3, optimizer->cpu", ["strategy=zero3", "offload_optimizer=cpu"]),
    ("zero3, optimizer+params->cpu", ["strategy=zero3", "offload_optimizer=cpu", "offload_params=cpu"]),
    ("fsdp, params->cpu", ["strategy=fsdp", "offload_params=cpu"]),
]
TARGET_STRATEGIES = ("zero3", "fsdp")  # issue 5: within 5% of 16 P / N
TOLERANCE = 0.05
WORLD = 2


def _setup_of(overrides: list[str]):
    from finetune.memory import Setup

    kv = dict(o.split("=", 1) for o in overrides)
    return Setup(kv["strategy"], kv.get("ddp_shard_optimizer") == "true", kv.get("offload_optimizer", "none"),
                 kv.get("offload_params", "none"))


def measure(model_name: str, work: Path, seq_len: int = 32, with_offload: bool = True) -> dict:
    from finetune.memory import estimate, paper_model_states

    spec = MODELS[model_name]
    model_dir = build_model(spec)
    params = spec.num_parameters()
    arch = spec.architecture()
    rows = []
    for label, overrides in SETUPS:
        if not with_offload and any(o.startswith("offload_") for o in overrides):
            continue
        out = fresh_dir(work / label.replace(" ", "").replace(",", "_").replace("+", "_").replace(">", ""))
        args = [str(out), f"model={model_dir}", f"max_seq_len={seq_len}", "micro_batch_size=1", "grad_accum=2",
                *overrides]
        cmd = accelerate_launch("bench/helpers/memory_probe.py", args, WORLD)
        launch = run(cmd, out / "log.txt", timeout=900, done=lambda: len(list(out.glob("rank_*.json"))) == WORLD)
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
        setup = _setup_of(overrides)
        est = estimate(arch, setup, world_size=WORLD, mixed_precision="no", micro_batch_size=1, seq_len=seq_len)
        row = {"setup": label, "overrides": overrides, "command": shown(cmd), "ok": launch.ok and len(ranks) == WORLD,
               "seconds": round(launch.seconds, 1), "error": None if launch.ok else launch.error(),
               "hung_at_exit": launch.hung_at_exit,
               # ZeroRedundancyOptimizer shards the optimizer states only: the paper's ZeRO-1 line
               "paper": paper_model_states("zero1" if setup.ddp_shard_optimizer else setup.strategy, "no", params,
                                           WORLD),
               "estimate": est.params + est.grads + est.optimizer + est.cpu + est.nvme,
               "ranks": ranks}
        if row["ok"]:
            held = [r["reported"] for r in ranks]
            row["held"] = max(h["total"] + h["cpu_total"] for h in held)
            row["parts"] = {k: max(h[k] + h["cpu_" + k] for h in held) for k in ("params", "grads", "optimizer")}
            row["peak_rss"] = [r["peak_rss"] for r in ranks]
            row["vs_paper"] = row["held"] / row["paper"]
            row["vs_estimate"] = row["held"] / row["estimate"]
        rows.append(row)
        print(f"  memory {label}: " + (f"{mib(row['held'])} MiB held per rank ({row['vs_paper']:.3f} x the ZeRO "
                                       f"formula), {launch.seconds:.0f}s" if row["ok"] else f"FAILED: {row['error']}"),
              flush=True)
    return {"model": model_name, "model_description": spec.describe(), "parameters": params, "world_size": WORLD,
            "seq_len": seq_len, "with_offload": with_offload, "rows": rows, "targets": targets(rows)}


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        if row["overrides"] and row["setup"] in TARGET_STRATEGIES:
            ok = row["ok"] and abs(row["vs_paper"] - 1) <= TOLERANCE
            out.append({"setup": row["setup"], "met": ok,
                        "measured": row.get("vs_paper"), "what": f"within {TOLERANCE:.0%} of 16 P / N"})
    return out


def render(result: dict) -> str:
    header = ["setup", "params MiB", "grads MiB", "optimizer MiB", "held per rank MiB", "toolkit estimate MiB",
              "ZeRO formula (fp32) MiB", "held / formula", "held / estimate", "peak RSS rank 0 / 1 MiB"]
    body = []
    for r in result["rows"]:
        if not r["ok"]:
            body.append([r["setup"], "failed", "", "", "", mib(r["estimate"]), mib(r["paper"]), "", "", r["error"]])
            continue
        body.append([r["setup"], mib(r["parts"]["params"]), mib(r["parts"]["grads"]), mib(r["parts"]["optimizer"]),
                     mib(r["held"]), mib(r["estimate"]), mib(r["paper"]), f"{r['vs_paper']:.3f}",
                     f"{r['vs_estimate']:.3f}",
                     " / ".join(mib(x) for x in r["peak_rss"])])
    return table(header, body)
