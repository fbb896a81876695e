"""What a training step costs beyond the model and the framework, in finetune and in the Hugging Face
Trainer: both launched as in the throughput part (bench/parts/throughput.py: same model, rows, batch and
DeepSpeed config or FSDP2 settings), each rank under cProfile, and the per-step time split into

  forward   the model's forward with the loss (finetune: loss_sum; Trainer: compute_loss),
  backward  the strategy's backward, its gradient collectives included,
  step      the optimizer step, clipping and the scheduler,
  own       everything else the step's code calls: fetching and collating rows, counting tokens across
            ranks, the NaN check, metrics and progress (finetune); the dataloader, get_batch_samples'
            token count, callbacks and logging (Trainer),

as cumulative seconds in those functions over the run's steps, divided by the steps. cProfile slows
Python-heavy code more than the kernels, so `own` is an upper bound of the real cost; compare the two
toolkits' rows with each other, not with the unprofiled tokens/s.

    python bench/studies/step_overhead.py [--strategies ddp,zero2,fsdp] [--steps 15] [--work DIR] [--doc docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from bench.parts.common import REPO, MODELS, build_model, table, varlen_dataset  # noqa: E402
from bench.parts.throughput import common_overrides  # noqa: E402

# (function-name pattern, phase) per toolkit; the first pattern a profiled function matches wins
PHASES = {
    "finetune": [("finetune/loss.py:.*(loss_sum)", "forward"),
                 ("accelerate/accelerator.py:.*(backward)", "backward"),
                 ("accelerate/accelerator.py:.*(clip_grad_norm_)", "step"),
                 ("accelerate/optimizer.py:.*(step)|accelerate/utils/deepspeed.py:.*(step)", "step"),
                 ("accelerate/scheduler.py:.*(step)", "step"),
                 ("finetune/data/batches.py:.*(fetch)", "own"), ("finetune/training/loop.py:.*(reduce_sum|one_sync_per_step)", "own"),
                 ("finetune/training/loop.py:.*(skip_nonfinite)", "own"), ("finetune/training/metrics.py:.*(write|update|step|window)", "own"),
                 ("finetune/faults.py:.*(fault_point)", "own"), ("finetune/distributed.py:.*(accumulate)", "own"),
                 ("accelerate/accelerator.py:.*(gather)", "own")],
    "trainer": [("transformers/trainer.py:.*(compute_loss)", "forward"),
                ("accelerate/accelerator.py:.*(backward)", "backward"),
                ("accelerate/accelerator.py:.*(clip_grad_norm_)", "step"),
                ("accelerate/optimizer.py:.*(step)|accelerate/utils/deepspeed.py:.*(step)", "step"),
                ("accelerate/scheduler.py:.*(step)", "step"),
                ("accelerate/data_loader.py:.*(__iter__)", "own"),
                ("transformers/trainer.py:.*(get_batch_samples|_prepare_inputs|_maybe_log_save_evaluate)", "own"),
                ("transformers/trainer_callback.py:.*(on_step_end|on_step_begin|on_log|on_substep_end)", "own")],
}

PROFILED = '''
import cProfile, os, sys
sys.path.insert(0, {repo!r})
os.environ.setdefault("DS_ACCELERATOR", "cpu")
prof, out = cProfile.Profile(), {out!r} + "/rank" + os.environ.get("RANK", "0") + ".prof"
if {trainer!r}:
    from bench.helpers import trainer_baseline as T
    from transformers import Trainer
    inner = Trainer.train
    def train(self, *a, **k):
        prof.enable()
        try:
            return inner(self, *a, **k)
        finally:
            prof.disable(); prof.dump_stats(out)
    Trainer.train = train
    from finetune.run import exit_without_teardown
    exit_without_teardown(T.main(sys.argv[1:]))
else:
    import finetune.training.loop as L
    from finetune import run
    inner = L.train
    def train(plan):
        prof.enable()
        try:
            return inner(plan)
        finally:
            prof.disable(); prof.dump_stats(out)
    L.train = train
    sys.exit(run.main(sys.argv[1:]))
'''


def profile(toolkit: str, strategy: str, base: list[str], work: Path, reuse: bool = False) -> Path:
    out = work / f"{toolkit}-{strategy}"
    if reuse and (out / "rank0.prof").is_file():
        return out / "rank0.prof"
    out.mkdir(parents=True, exist_ok=True)
    script = out / "profiled.py"
    script.write_text(PROFILED.format(repo=str(REPO), out=str(out),
                                      trainer=toolkit == "trainer"))
    args = ["--recipe", "tiny", *base, f"strategy={strategy}", "plot_loss=false", f"output_dir={out / 'run'}"]
    if toolkit == "trainer":
        args = [str(out / "run"), *[a for a in args if a != "plot_loss=false"]]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{toolkit} {strategy} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (out / "load.json").write_text(json.dumps({"before": before, "after": os.getloadavg()[0],
                                               "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))
    return out / "rank0.prof"


def loads(work: Path) -> str:
    """The machine's 1-minute load average around each launch, as recorded next to its profile."""
    seen = sorted((json.loads(f.read_text()) for f in work.glob("*/load.json")), key=lambda d: d["at"])
    if not seen:
        return "load average not recorded"
    values = [x for d in seen for x in (d["before"], d["after"])]
    return f"launches at {seen[0]['at']} to {seen[-1]['at']}, 1-minute load average {min(values):.2f} to {max(values):.2f}"


def phases(prof: Path, toolkit: str, steps: int) -> dict:
    stats = pstats.Stats(str(prof)).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rules = [(re.compile(p), phase) for p, phase in PHASES[toolkit]]
    seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0, "own": 0.0}
    counted = {}
    for (file, line, name), (_, _, _, cumtime, callers) in stats.items():
        where = f"{file}:{line}({name})"
        phase = next((ph for rule, ph in rules if rule.search(where)), None)
        if phase is None:
            continue
        # a matched function called from another matched one is already inside its caller's time
        caller_matched = any(any(rule.search(f"{f}:{ln}({n})") for rule, _ in rules) for f, ln, n in callers)
        if not caller_matched:
            seconds[phase] += cumtime
            counted[where] = cumtime
    return {k: v / steps for k, v in seconds.items()} | {"functions": counted}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="ddp,zero2,fsdp")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--work", default=f"/tmp/bench-overhead-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--reuse", action="store_true", help="read the profiles already in --work instead of launching")
    p.add_argument("--doc", help="also write the table as section 9 of this file (docs/benchmarks.md)")
    args = p.parse_args(argv)
    work = Path(args.work)
    base = common_overrides(build_model(MODELS["llama-7m"]), varlen_dataset(), args.steps, 256, 4, 2)
    rows, top = [], {}
    for strategy in args.strategies.split(","):
        for toolkit in ("finetune", "trainer"):
            ph = phases(profile(toolkit, strategy, base, work, args.reuse), toolkit, args.steps)
            rows.append([strategy, toolkit] + [f"{1000 * ph[k]:.1f}" for k in ("forward", "backward", "step", "own")])
            print(f"{strategy} {toolkit}: " + ", ".join(f"{k} {1000 * ph[k]:.1f} ms" for k in
                                                     ("forward", "backward", "step", "own")), flush=True)
            own = [(where, sec) for where, sec in ph["functions"].items()
                   if next(phase for rule, phase in PHASES[toolkit] if re.search(rule, where)) == "own"]
            top[strategy, toolkit] = sorted(own, key=lambda kv: -kv[1])[:3]
            for where, sec in sorted(ph["functions"].items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {1000 * sec / args.steps:8.1f} ms/step  {short(where)}")
    text = table(["strategy", "toolkit", "forward ms/step", "backward ms/step", "step ms/step", "own ms/step"], rows)
    print()
    print(text)
    if args.doc:
        from bench.parts.common import git_state, machine, versions

        from bench.parts.report import STEP_BEGIN, STEP_END, STEP_TITLE, write_marked_section

        v = versions()
        command = "python bench/studies/step_overhead.py" + (f" --strategies {args.strategies}"
                                                    if args.strategies != "ddp,zero2,fsdp" else "") + \
            (f" --steps {args.steps}" if args.steps != 15 else "") + f" --doc {args.doc}"
        biggest = "; ".join(f"{s} {t}: " + ", ".join(f"{short(w)} {1000 * sec / args.steps:.1f}" for w, sec in fns)
                            for (s, t), fns in top.items())
        section = "\n".join([
            f"Measured by `{command}` at git {git_state()} ({loads(work)}); {machine()['cpu']}, "
            f"{machine()['cores']} cores; torch {v['torch']}, transformers {v['transformers']}.",
            "",
            "Both toolkits on the throughput part's model and rows (llama-7m, max_seq_len 256, micro batch 4, 2 "
            f"accumulation steps, 2 processes, log every step, {args.steps} steps), rank 0 under cProfile; ms per "
            "optimizer step. forward: the model with its loss (finetune's loss_sum, the Trainer's compute_loss); "
            "backward: Accelerate's backward, the strategy's gradient collectives included; step: clipping, the "
            "optimizer and the scheduler; own: the rest of each toolkit's step code (rows to tensors, token "
            "counts across ranks, the NaN check, metrics and logging; the Trainer's dataloader, get_batch_samples, "
            "callbacks and _maybe_log_save_evaluate). A collective in `own` also holds the time the faster rank "
            "waits there for the slower one, which it would otherwise wait at the next collective.",
            "",
            text,
            "",
            f"Largest `own` items (ms/step): {biggest}.",
        ])
        write_marked_section(Path(args.doc), STEP_TITLE, STEP_BEGIN, STEP_END, section)
        print(f"wrote section 9 of {args.doc}")
    return 0


def short(where: str) -> str:
    return where.split("site-packages/")[-1].replace(str(REPO) + "/", "")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
