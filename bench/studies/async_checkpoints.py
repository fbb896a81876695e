"""async_save against the synchronous save (docs/async-checkpoints.md): per strategy, a run that saves
every few steps, once with async_save=false and once with async_save=true, both on 2 gloo processes
(CPU) or 1 GPU (--gpu). Read back from each run's metrics.jsonl: every save's seconds blocking the
loop (and, async, in the background), and each step's time (its tokens over its tokens/s, log_every=1;
checkpoint pauses are outside it): the steps a background write overlapped (from the save's step to
the step at whose start it was published) against the steps of the synchronous run after its first
two (warm-up), medians.

    python bench/studies/async_checkpoints.py                    # CPU: llama-60m, ddp fsdp zero3, 2 processes
    python bench/studies/async_checkpoints.py --gpu              # 1 GPU: llama-1b, bf16, ddp (one process)
    python bench/studies/async_checkpoints.py --doc docs/async-checkpoints.md   # also the results section
    python bench/studies/async_checkpoints.py --repeat 2         # two pairs of runs per strategy, medians
    python bench/studies/async_checkpoints.py --model llama-190m # a 2.3 GB checkpoint (~9 GB of RAM)

The CPU model is sized for a shared 2-core machine (at most ~3 GB in all): ~58M parameters, a
checkpoint of 0.7 GB (fp32 weights and Adam's two moments), two ranks' states and the staging.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.parts.common import (MODELS, ModelSpec, accelerate_launch, build_model, fresh_dir, launch_env,  # noqa: E402
                                read_jsonl, run, shown, table, wait_quiet)

CPU_SPEC = ModelSpec("llama-60m", 512, 8, 8, 1408)
# --model llama-190m: a checkpoint of 2.3 GB (the fixed costs of a save, state dicts and collectives,
# weigh less); about 9 GB of host memory in all under ddp
CPU_SPECS = {"llama-60m": CPU_SPEC, "llama-190m": ModelSpec("llama-190m", 1024, 10, 16, 2816),
             "llama-7m": MODELS["llama-7m"]}  # llama-7m: bench/gpu/e2e.sh's smoke mode, checks the script only
COMMON = ["eval_fraction=0", "eval_at_start=false", "log_every=1", "mixed_precision=no", "warmup_steps=1",
          "keep_last=2", "sample_prompts=0", "plot_loss=false", "max_seq_len=128", "micro_batch_size=2",
          "global_batch_size=4"]
SECTION = "## Results"


def one(strategy: str, async_save: bool, model: Path, work: Path, steps: int, every: int, gpu: bool) -> dict:
    name = f"{strategy}-{'async' if async_save else 'sync'}"
    out = fresh_dir(work / name)
    args = ["--recipe", "tiny", f"model={model}", f"strategy={strategy}", *COMMON, f"max_steps={steps}",
            f"save_every={every}", f"async_save={str(async_save).lower()}", f"output_dir={out}"]
    if gpu:
        args += ["mixed_precision=bf16"]
        cmd = [sys.executable, "finetune/run.py", *args]
    else:
        cmd = accelerate_launch("finetune/run.py", args)
    wait_quiet(max_wait=20)
    launched = run(cmd, work / f"{name}.log", timeout=3600, env=launch_env(**({"DS_ACCELERATOR": "cuda"} if gpu else {})),
                   done=(out / "summary.json").exists)
    res = {"strategy": strategy, "async_save": async_save, "command": shown(cmd), "ok": launched.ok,
           "other_load": launched.other_load}
    if not launched.ok:
        res["error"] = launched.error()
        return res
    records = read_jsonl(out / "metrics.jsonl")
    saves = [r for r in records if "checkpoint_blocking_s" in r]
    res["blocking_s"] = [r["checkpoint_blocking_s"] for r in saves]
    res["background_s"] = [r["checkpoint_background_s"] for r in saves]
    res["waited_s"] = [r.get("checkpoint_waited_s", 0.0) for r in saves]
    size = json.loads((out / "checkpoints" / f"step_{steps:09d}" / "manifest.json").read_text())["files"]
    res["checkpoint_bytes"] = sum(size.values())
    step_s, overlapped, tokens, last = {}, set(), 0, 0
    for r in records:
        if "checkpoint_blocking_s" in r:  # written when published: steps since the save overlapped it
            if async_save:
                overlapped.update(range(r["step"] + 1, last + 1))
            continue
        if "loss" in r:
            step_s[r["step"]] = (r["tokens"] - tokens) / r["tokens_per_s"]
            tokens, last = r["tokens"], r["step"]
    res["step_s"] = step_s
    res["overlapped_steps"] = sorted(overlapped)
    res["step_s_overlapped"] = statistics.median([step_s[s] for s in overlapped]) if overlapped else None
    res["step_s_quiet"] = statistics.median([v for s, v in step_s.items() if s > 2 and s not in overlapped])
    for bulky in ("checkpoints", "final"):  # a 1B run leaves ~30 GB; the pair's next run needs the disk
        shutil.rmtree(out / bulky, ignore_errors=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu", action="store_true", help="one CUDA GPU, llama-1b in bf16, ddp on one process")
    p.add_argument("--strategies", default=None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--work", default="/tmp/bench-async-checkpoints")
    p.add_argument("--doc", default=None, help="write the results section of this page")
    p.add_argument("--repeat", type=int, default=1, help="pairs of runs per strategy (medians over them)")
    p.add_argument("--model", default="llama-60m", choices=sorted(CPU_SPECS), help="the CPU model")
    a = p.parse_args()
    spec = MODELS["llama-1b"] if a.gpu else CPU_SPECS[a.model]
    strategies = (a.strategies or ("ddp" if a.gpu else "ddp,fsdp,zero3")).split(",")
    work = Path(a.work)
    model = build_model(spec)
    rows = []
    notes = []
    for strategy in strategies:
        pairs = []
        for i in range(a.repeat):
            pair = {s: one(strategy, s, model, work, a.steps, a.every, a.gpu) for s in (False, True)}
            (work / f"{strategy}-{i}.json").write_text(json.dumps(pair, indent=2, default=str))
            if not (pair[False]["ok"] and pair[True]["ok"]):
                print(json.dumps(pair, indent=2, default=str))
                continue
            pairs.append(pair)
        if not pairs:
            rows.append([strategy, "FAILED"] + [""] * 9)
            continue

        def med(key, run, reduce=statistics.median):
            return statistics.median(reduce(p[run][key]) for p in pairs)

        block_sync, block_async = med("blocking_s", False), med("blocking_s", True)
        overlapped = [p[True]["step_s_overlapped"] for p in pairs if p[True]["step_s_overlapped"]]
        rows.append([strategy, f"{pairs[0][False]['checkpoint_bytes'] / 2**20:.0f}", f"{block_sync:.2f}",
                     f"{block_async:.2f}", f"{block_async / block_sync:.3f}", f"{med('background_s', True):.2f}",
                     f"{med('waited_s', True, sum):.2f}",
                     f"{statistics.median(p[False]['step_s_quiet'] for p in pairs):.2f}",
                     f"{statistics.median(overlapped):.2f}" if overlapped else "n/a",
                     " / ".join(f"{p[s]['other_load']:.1f}" for p in pairs for s in (False, True)
                                if p[s]["other_load"] is not None)])
        notes.append(f"- {strategy}, per pair (sync blocking s -> async blocking s): " + "; ".join(
            f"{', '.join(f'{x:.2f}' for x in p[False]['blocking_s'])} -> "
            f"{', '.join(f'{x:.3f}' for x in p[True]['blocking_s'])}" for p in pairs))
        print(f"{strategy}: blocking sync {block_sync:.2f}s, async {block_async:.3f}s ({block_async / block_sync:.3f})",
              flush=True)
    header = ["strategy", "checkpoint MiB", "sync blocking s", "async blocking s", "async / sync",
              "async background s", "async waited s (all saves)", "step s (sync run, no write)",
              "step s overlapping a write", "other load, cores (sync / async per pair)"]
    where = "1 GPU, llama-1b (0.95B), bf16" if a.gpu else f"2 CPU processes (gloo), {spec.name} " \
        f"({spec.num_parameters() / 1e6:.0f}M parameters), fp32"
    text = (f"{where}; {a.steps} steps, a save every {a.every}; medians over the saves and steps"
            + (f", then over {a.repeat} pairs of runs" if a.repeat > 1 else "") + ". Other load: the CPU cores "
            "other processes of the machine used during each run, on average.\n\n"
            + table(header, rows) + "\n\n" + "\n".join(notes) + "\n\nCommand: `python bench/studies/async_checkpoints.py"
            + (" --gpu" if a.gpu else "") + (f" --repeat {a.repeat}" if a.repeat > 1 else "")
            + (f" --model {a.model}" if a.model != "llama-60m" and not a.gpu else "") + "`\n")
    print(text)
    if a.doc:
        doc = Path(a.doc)
        page = doc.read_text() if doc.exists() else ""
        title = f"### {'GPU' if a.gpu else 'CPU'}"
        block = f"{title}\n\n{text}\n"
        if title in page:  # the block up to the next heading (### or ##) is replaced
            head, rest = page.split(title, 1)
            ends = [i + 1 for i in (rest.find("\n### "), rest.find("\n## ")) if i >= 0]
            page = head + block + (rest[min(ends):] if ends else "")
        else:
            page = page.rstrip() + "\n\n" + block
        doc.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
