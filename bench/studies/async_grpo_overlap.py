"""GRPO with generation on a process of its own, on CPU: recipes/tiny_grpo.py on 2 colocated processes (each
generates its share, then trains) against 1 generating + 2 training processes (rollout_processes=1) at
max_staleness=0 and 1: seconds per step, and the share of the step each group waits.

    python bench/studies/async_grpo_overlap.py                              # ~4 min on 2 cores
    python bench/studies/async_grpo_overlap.py --doc docs/benchmarks.md     # also writes its section

What is measured, per step (medians over the steps after the first WARMUP, from metrics.jsonl): step s (tokens /
tokens_per_s: from one step's logging to the next's); trainers wait: the training processes' seconds blocked on
the generating process (perf/rollout_wait_s: the rollout not there yet; perf/weight_sync_s: the push, which
waits for the generating process to take it, and its check) over step s; generator waits: the generating
process's seconds blocked on the trainers before the rollout it generated (rollout/backpressure_s: waiting for
the weights it is generated from) over step s; gen s: its rollout's generation and scoring (rollout_seconds).
On a machine with fewer cores than processes the groups share cores: the split's overlap cannot show as a
shorter step there, only as the waits moving (the section says the core count)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from bench.parts.common import accelerate_launch, launch_env, machine, run, table, versions  # noqa: E402
from bench.parts.report import write_marked_section  # noqa: E402

RECIPE = "tiny_grpo"
WARMUP = 3
TITLE = "## GRPO with generation on a process of its own, on CPU (bench/studies/async_grpo_overlap.py)"
BEGIN, END = "<!-- async-grpo-overlap:begin -->", "<!-- async-grpo-overlap:end -->"
VARIANTS = {"colocated": (2, []), "split, max_staleness=0": (3, ["rollout_processes=1"]),
            "split, max_staleness=1": (3, ["rollout_processes=1", "max_staleness=1"])}


def measure(steps: int, strategy: str, work: Path) -> dict:
    rows = {}
    for name, (nprocs, extra) in VARIANTS.items():
        out = work / name.replace(", ", "-").replace("=", "")
        args = ["--recipe", RECIPE, f"strategy={strategy}", f"max_steps={steps}", "log_every=1", "save_every=0",
                "eval_fraction=0", "plot_loss=false", f"output_dir={out}", *extra]
        launch = run(accelerate_launch("finetune/run.py", args, nprocs), work / f"{out.name}.log", env=launch_env())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if '"loss"' in line] if launch.returncode == 0 else []
        seconds = step_seconds(records)
        timed = list(zip(records, seconds))[WARMUP:]

        def median(f):
            values = [f(r, s) for r, s in timed]
            return statistics.median(values) if values else None

        split = nprocs == 3
        rows[name] = {
            "rc": launch.returncode, "processes": nprocs, "other_load": launch.other_load, "steps": len(records),
            "step_s": median(lambda r, s: s), "gen_s": median(lambda r, s: r.get("rollout_seconds", 0.0)),
            "trainers_wait": median(lambda r, s: (r["perf/rollout_wait_s"] + r["perf/weight_sync_s"]) / s)
            if split else None,
            "generator_wait": median(lambda r, s: r["rollout/backpressure_s"] / s) if split else None,
            "reward_last": records[-1]["reward"] if records else None,
        }
    return {"rows": rows, "machine": machine(), "versions": versions(), "steps": steps, "strategy": strategy,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def step_seconds(records: list[dict]) -> list[float]:
    """Each logged step's seconds as metrics.jsonl's window gives them (log_every=1): its tokens over its tokens/s."""
    out, before = [], 0
    for r in records:
        out.append((r["tokens"] - before) / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))
        before = r["tokens"]
    return out


def section(results: dict) -> str:
    m, rows = results["machine"], results["rows"]
    body = []
    base = rows["colocated"]["step_s"]
    for name, r in rows.items():
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
        body.append([name, r["processes"], "-" if r["step_s"] is None else f"{r['step_s']:.3f}",
                     "-" if r["step_s"] is None or not base else f"{base / r['step_s']:.2f}x",
                     "-" if r["gen_s"] is None else f"{r['gen_s']:.3f}", pct(r["trainers_wait"]),
                     pct(r["generator_wait"]), "-" if r["other_load"] is None else f"{r['other_load']:.2f}",
                     "" if r["rc"] == 0 else f"failed (rc {r['rc']})"])
    lines = [f"Measured {results['started']} on {m['cpu']}, **{m['cores']} cores**, {m['memory']}; "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".", "",
             f"recipes/{RECIPE}.py (the 2-layer tiny Llama, 16 prompts x 8 completions of up to 8 tokens a step, fp32), "
             f"strategy={results['strategy']}, {results['steps']} steps, no eval or checkpoints; medians over the steps "
             f"after the first {WARMUP}. colocated: `accelerate launch --num_processes 2` (each process generates its "
             "share, then trains); split: `--num_processes 3 rollout_processes=1` (the third process generates and "
             "scores every rollout, the other two train).", "",
             table(["run", "processes", "step s", "vs colocated", "gen s", "trainers wait", "generator waits",
                    "other load", "note"], body), "",
             "trainers wait: the training processes' share of the step blocked on the generating process (the "
             "rollout not ready, or the push waiting for it to take the weights); generator waits: the generating "
             "process's share blocked on the trainers (for the weights its next rollout is generated from); other "
             "load: cores the rest of the machine used meanwhile. At max_staleness=0 the groups take turns (each "
             "waits while the other works); at 1 each step's training overlaps the next rollout's generation. "
             f"With {m['cores']} cores for 3 processes the overlap shares the cores instead of adding to them: the step "
             "time says what the waits cost here, not what separate GPUs would give (finetune/split_plan.py models "
             "those: docs/async-rl.md)."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--work", default=f"/tmp/async-grpo-overlap-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--doc", default="")
    p.add_argument("--render", default="", help="a results.json of an earlier run: only render it")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(a.render).read_text()) if a.render else measure(a.steps, a.strategy, work)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    text = section(results)
    print(text)
    if a.doc:
        write_marked_section(Path(a.doc), TITLE, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
