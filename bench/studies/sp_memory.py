"""What sequence parallelism saves: peak memory per rank of 2-process runs at 1K, 2K and 4K tokens per
row, data parallel (sequence_parallel=1: each rank holds whole rows) against Ulysses sequence
parallelism (sequence_parallel=2: each rank holds half of every row), on CPU.

    python bench/studies/sp_memory.py [--steps 3] [--lengths 1024,2048,4096] [--work DIR] [--doc docs/benchmarks.md]

Each run: `accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny` with model
llama-20m (bench/parts/common.py: hidden 256, 4 layers, 4 heads, 32000-token vocabulary, random weights),
text rows longer than max_seq_len (every row full), micro batch 1, strategy=ddp (every rank holds the
whole model, so the model states are the same in both layouts and the difference is the step's
activations), mixed_precision=no, no eval set; `peak_memory_gib` of the last step's record in
metrics.jsonl (each rank's peak RSS). The activation share is what grows with the length: the peak at
T minus the peak at the shortest length measured, which SP 2 should halve.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from bench.parts.common import (MODELS, accelerate_launch, build_model, fresh_dir, git_state, launch_env, machine,  # noqa: E402
                    read_jsonl, run, shown, table, versions)
from bench.parts.loss_memory import text_rows  # noqa: E402

MODEL = MODELS["llama-20m"]


def measure(work: Path, model: Path, data: Path, seq_len: int, sp: int, steps: int) -> dict:
    out = fresh_dir(work / f"sp{sp}-{seq_len}")
    args = ["--recipe", "tiny", f"model={model}", f"dataset={data}", "dataset_format=text", "eval_fraction=0",
            "eval_at_start=false", "strategy=ddp", "mixed_precision=no", f"max_steps={steps}", "micro_batch_size=1",
            "grad_accum=1", "global_batch_size=0", f"max_seq_len={seq_len}", "warmup_steps=0", "log_every=1",
            f"sequence_parallel={sp}", "sample_prompts=0", "plot_loss=false", f"output_dir={out}"]
    cmd = accelerate_launch("finetune/run.py", args, nprocs=2)
    launch = run(cmd, out.parent / f"{out.name}.log", timeout=3600, env=launch_env())
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    if not launch.ok or len(records) < steps:
        raise SystemExit(f"{shown(cmd)} failed: {launch.error()}")
    last = records[-1]
    return {"sp": sp, "seq_len": seq_len, "peak_gib": last["peak_memory_gib"], "tokens_per_s": last.get("tokens_per_s"),
            "command": shown(cmd)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--work", default=f"/tmp/bench-sp-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--doc", help="also append the result as a section of this file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.work)
    model, data = build_model(MODEL), text_rows(n=64, chars=max(lengths) + 500)
    results = []
    for seq_len in lengths:
        for sp in (1, 2):
            results.append(measure(work, model, data, seq_len, sp, args.steps))
            print(json.dumps(results[-1]), flush=True)

    def peak(sp, t):
        return max(next(r for r in results if r["sp"] == sp and r["seq_len"] == t)["peak_gib"])

    base = min(lengths)
    rows = []
    for t in lengths:
        p1, p2 = peak(1, t), peak(2, t)
        g1, g2 = p1 - peak(1, base), p2 - peak(2, base)
        rows.append([f"{t:,}", f"{p1:.3f}", f"{p2:.3f}", f"{p1 - p2:.3f}",
                     f"{g1:.3f}" if t != base else "-", f"{g2:.3f}" if t != base else "-",
                     f"{g2 / g1:.2f}" if t != base and g1 > 0 else "-"])
    header = ["tokens per row", "peak GiB per rank, SP 1", "SP 2", "SP 1 - SP 2",
              f"growth from {base:,}, SP 1", "SP 2", "SP 2 / SP 1"]
    v = versions()
    command = "python bench/studies/sp_memory.py" + (f" --steps {args.steps}" if args.steps != 3 else "") + \
        (f" --lengths {args.lengths}" if args.lengths != "1024,2048,4096" else "") + \
        (f" --doc {args.doc}" if args.doc else "")
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` at git {git_state()}; "
        f"{machine()['cpu']}, {machine()['cores']} cores, shared with other jobs; torch {v['torch']}, "
        f"transformers {v['transformers']}.",
        "",
        f"Two processes, strategy=ddp, model {MODEL.name} ({MODEL.describe()}, random weights), micro batch 1, one "
        f"full row per micro-batch, mixed_precision=no, {args.steps} steps; the larger of the two ranks' "
        "`peak_memory_gib` (peak RSS) at the last step. SP 1: data parallel, each rank a whole row; SP 2: both ranks "
        "on the same row, half each (DeepSpeed's Ulysses attention). Growth: the peak at that length minus the peak "
        f"at {base:,} tokens, the part of the peak that grows with the row (activations).",
        "",
        table(header, rows),
        "",
        f"Each run: `{results[0]['command']}` with its own max_seq_len and sequence_parallel.",
    ])
    print(text)
    if args.doc:
        from bench.parts.report import SP_BEGIN, SP_END, SP_TITLE, write_marked_section

        write_marked_section(Path(args.doc), SP_TITLE, SP_BEGIN, SP_END, text)
    (work / "sp_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
