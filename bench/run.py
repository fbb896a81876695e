"""The benchmark: `python bench/run.py [--quick] [--gpu]`.

Without --gpu it runs on this machine's CPU with 2 processes (gloo) and measures
  1. model-state memory per rank for every strategy and offload setting (bench/parts/memory.py),
  2. target tokens/s of finetune/run.py against the Hugging Face Trainer (bench/parts/throughput.py),
  3. packing on against off (bench/parts/packing.py),
  3b. padding-free batches against today's packing (bench/parts/padding_free.py),
  4. checkpoint save and resume cost at two step counts (bench/parts/checkpoints.py),
  5. what the loop itself logs (read from the runs of 2 and 3),
  7. the loss's memory with a 128k vocabulary at 256 and 2048 tokens (bench/parts/loss_memory.py),
prints the tables and writes docs/benchmarks.md. --quick uses smaller models, fewer steps, no offload
rows in part 1 and one pair of launches per strategy in part 2 (the full mode: three, median), and
finishes in under 10 minutes on 2 cores. With --gpu it runs part 6 on one CUDA GPU (bench/gpu/gpu.py:
the 1B model in bf16, finetune against the Trainer for ddp, fsdp and zero3, one process each, with
MFU) and rewrites only the GPU section of docs/benchmarks.md.

Run outputs go to /tmp/bench-<time>/ (or --work); the models and data it builds are cached in
bench/.cache/ (or $BENCH_CACHE).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* and finetune import from it

from bench.parts import common  # noqa: E402
from bench.parts.common import MODELS, build_model, save_json, varlen_dataset  # noqa: E402

QUICK = {"memory_model": "llama-20m", "train_model": "llama-7m",
         "strategies": ["ddp", "zero1", "zero2", "zero3", "fsdp"],
         "steps": 7, "warmup": 2, "seq_len": 256, "micro": 4, "accum": 2, "rounds": 1, "memory_offload": False,
         "checkpoint_strategies": ["ddp"], "checkpoint_steps": (5, 300)}
FULL = {"memory_model": "llama-100m", "train_model": "llama-20m",
        "strategies": ["ddp", "zero1", "zero2", "zero3", "fsdp", "zero3, optimizer+params->cpu", "fsdp, params->cpu"],
        "steps": 20, "warmup": 5, "seq_len": 256, "micro": 4, "accum": 2, "rounds": 3, "memory_offload": True,
        "checkpoint_strategies": ["zero3", "fsdp", "ddp"], "checkpoint_steps": (5, 300)}
PARTS = ("memory", "throughput", "packing", "padding_free", "checkpoints", "loss_memory")


def parse(argv):
    p = argparse.ArgumentParser(prog="python bench/run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller models, fewer steps: under 10 minutes on 2 cores")
    p.add_argument("--gpu", action="store_true", help="part 6 only: the 1B bf16 model on one CUDA GPU, finetune "
                   "against the Trainer for ddp, fsdp, zero3 (+ liger, compile variants), MFU")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--rounds", type=int, help="times each throughput pair runs, median taken (default: quick 1, full 3)")
    p.add_argument("--work", help="where run outputs go (default /tmp/bench-<time>)")
    p.add_argument("--doc", default=str(common.REPO / "docs" / "benchmarks.md"), help="the report to write")
    p.add_argument("--render", metavar="RESULTS_JSON", help="rewrite the report from a run's results.json, measuring "
                   "nothing (for changes to the report's wording)")
    p.add_argument("--reuse", action="store_true", help="with --gpu and the --work of an interrupted run: keep the "
                   "rows it finished instead of running them again")
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="with --gpu: stop within SECONDS from now; "
                   "rows that would start too late are 'not run' (--reuse runs them) and a running launch is "
                   "stopped at the deadline")
    p.add_argument("--gpu-smoke", action="store_true", help=argparse.SUPPRESS)  # the --gpu pipeline on CPU, tiny
    return p.parse_args(argv)


def command_line(args) -> str:
    return "python bench/run.py" + (" --quick" if args.quick else "") + (" --gpu" if args.gpu else "") + \
        (" --gpu-smoke" if args.gpu_smoke else "") + \
        ("" if args.only == ",".join(PARTS) else f" --only {args.only}") + \
        (f" --rounds {args.rounds}" if args.rounds else "") + \
        ("" if Path(args.doc).resolve() == (common.REPO / "docs" / "benchmarks.md").resolve() else f" --doc {args.doc}")


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    started = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    work = Path(args.work or f"/tmp/bench-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    from bench.parts import report

    if args.render:
        import json

        results = json.loads(Path(args.render).read_text())
        report.recompute(results)
        report.write_cpu_report(Path(args.doc), results)
        print(f"rewrote {args.doc} from {args.render}")
        return 0
    if args.gpu or args.gpu_smoke:
        from bench.gpu import gpu

        print(f"GPU benchmark; outputs in {work}", flush=True)
        deadline = time.monotonic() + args.deadline if args.deadline else None
        res = gpu.measure(work, smoke=args.gpu_smoke, reuse=args.reuse, deadline=deadline)
        res["wall_seconds"] = round(time.perf_counter() - t0, 1)
        save_json(work / "gpu.json", res)
        section = gpu.render(res, command_line(args), started, common.versions())
        print(section)
        if res.get("ok") and not args.gpu_smoke:  # failed rows are written too, with their errors
            report.write_gpu_section(Path(args.doc), section)
            print(f"wrote the GPU section of {args.doc}")
        print(f"{res['wall_seconds']:.0f}s in all; raw results: {work / 'gpu.json'}")
        return 0 if res.get("ok") and not res.get("failed") else 1

    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds:
        cfg["rounds"] = args.rounds
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"error: unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    print(f"{'quick' if args.quick else 'full'} CPU benchmark, 2 processes; outputs in {work}", flush=True)
    results = {"mode": "quick" if args.quick else "full", "config": cfg, "command": command_line(args),
               "started": started, "machine": common.machine(), "versions": common.versions(),
               "git": common.git_state(), "work": str(work)}
    # everything it builds, built once up front (cached across runs)
    train_dir = build_model(MODELS[cfg["train_model"]])
    dataset = varlen_dataset()

    if "memory" in parts:
        from bench.parts import memory

        print("1. memory per rank", flush=True)
        results["memory"] = memory.measure(cfg["memory_model"], work / "memory", with_offload=cfg["memory_offload"])
    throughput_result = None
    if "throughput" in parts:
        from bench.parts import throughput

        print("2. throughput against the Hugging Face Trainer", flush=True)
        throughput_result = throughput.measure(cfg["strategies"], train_dir, dataset, cfg["steps"], cfg["seq_len"],
                                               cfg["micro"], cfg["accum"], work / "throughput", cfg["warmup"],
                                               rounds=cfg["rounds"])
        throughput_result["model"] = cfg["train_model"]
        throughput_result["model_description"] = MODELS[cfg["train_model"]].describe()
        throughput_result["parameters"] = MODELS[cfg["train_model"]].num_parameters()
        results["throughput"] = throughput_result
    if "packing" in parts:
        from bench.parts import packing
        from bench.parts import throughput

        print("3. packing", flush=True)
        base = throughput.common_overrides(train_dir, dataset, cfg["steps"], cfg["seq_len"], cfg["micro"],
                                           cfg["accum"])
        off = None
        if throughput_result:  # the throughput part's ddp run had these very settings with packing off
            ddp = next((r for r in throughput_result["rows"] if r["strategy"] == "ddp"), None)
            if ddp and ddp["ours"].get("ok"):
                off = dict(ddp["ours"], reused=True)
        results["packing"] = packing.measure(base, work / "packing", cfg["warmup"], off=off, strategy="ddp")
    if "padding_free" in parts:
        from bench.parts import padding_free
        from bench.parts import throughput

        print("3b. padding-free batches", flush=True)
        base = throughput.common_overrides(train_dir, dataset, cfg["steps"], cfg["seq_len"], cfg["micro"],
                                           cfg["accum"])
        packing_result = results.get("packing") or {}
        results["padding_free"] = padding_free.measure(base, work / "padding_free", cfg["warmup"],
                                                       packed=packing_result.get("on"), off=packing_result.get("off"),
                                                       strategy="ddp", model_dir=train_dir, dataset=dataset,
                                                       seq_len=cfg["seq_len"], micro=cfg["micro"])
    if "checkpoints" in parts:
        from bench.parts import checkpoints

        print("4. checkpoints", flush=True)
        early, late = cfg["checkpoint_steps"]
        results["checkpoints"] = checkpoints.measure(cfg["checkpoint_strategies"], early, late, work / "checkpoints")

    if "loss_memory" in parts:
        from bench.parts import loss_memory

        # Written into its own marked section of the report (section 7), which write_cpu_report keeps.
        print("7. the loss with a 128k vocabulary: peak memory at 256 and 2048 tokens", flush=True)
        loss_memory.main(["--work", str(work / "loss_memory"), "--doc", args.doc]
                         + (["--rounds", "1"] if args.quick else ["--sweep"]))
        results["loss_memory"] = str(work / "loss_memory" / "loss_memory.json")

    results["wall_seconds"] = round(time.perf_counter() - t0, 1)
    save_json(work / "results.json", results)
    if parts == ["loss_memory"]:  # its section is written; the others stay as measured
        print(f"\nwrote the loss-memory section of {args.doc}; {results['wall_seconds']:.0f}s in all")
        return 0
    if parts == ["padding_free"]:  # its own section only: the other sections of the report stay as measured
        text = report.write_padding_free_section(Path(args.doc), results)
        print()
        print(text)
        print(f"\nwrote the padding-free section of {args.doc} (raw results: {work / 'results.json'}); "
              f"{results['wall_seconds']:.0f}s in all")
        return 0
    text = report.write_cpu_report(Path(args.doc), results)
    print()
    print(text)
    print(f"\nwrote {args.doc} (raw results: {work / 'results.json'}); {results['wall_seconds']:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
