"""GRPO's rollout on CPU, our sampler before and after the batched on-device draw (issue 40): rollout
seconds and whole-step seconds, 2 processes over gloo, strategy zero3 and fsdp, on a ~106M-parameter
Llama (bench/parts/common.py's llama-100m: hidden 768, 8 layers, a 32000-row embedding and head over
the builtin 108-token character tokenizer), fp32, completions of max_completion_len tokens.

    python bench/studies/rollout_speed.py                          # before (ba2306b) and after, zero3 and fsdp
    python bench/studies/rollout_speed.py --compile                # also after with generation_compile=true
    python bench/studies/rollout_speed.py --trl                    # also TRL's GRPOTrainer (its own generation)
    python bench/studies/rollout_speed.py --doc docs/benchmarks.md # also writes the section
    python bench/studies/rollout_speed.py --render results.json --doc docs/benchmarks.md
    ... --work DIR again: the rows DIR/results.json holds as ok are kept, the others run

"before" is finetune as it was at --before (default ba2306b, the last commit with the per-row sampler),
taken with `git archive` into the work folder and run with its own finetune/run.py; "after" is this
tree. Both run recipes/tiny_grpo.py with the same overrides (overrides()): the model above, 4 prompts x
num_generations 4 = 16 completions a step (8 per rank, one micro-batch), max_completion_len 128,
temperature 1, no eval, no checkpoints. The tokens differ (a new sampler; "before" also draws the ids
past the tokenizer's 108, which "after" masks, so "before" almost never draws the end token and its
completions run to max_completion_len, while "after"'s end at the end token 1 time in ~100 a token):
a rollout still takes max_completion_len forwards of the rank's whole batch wherever one of its 8
completions runs that long (finished ones ride along), and the table gives each row's completion
tokens a step. Rollout seconds: metrics.jsonl's rollout_seconds (the weights gathered, generation,
decoding; GRPO.sample's timer); step seconds: the record's window (tokens / tokens_per_s). Medians over
the steps after the first WARMUP (the first rollout is also reported: it holds the compile with
generation_compile=true).

TRL (--trl): bench/studies/grpo_vs_trl.py's TRL side (GRPOTrainer, use_vllm off: `model.generate`) on the
same recipe and overrides, with its phase timers: rollout = GRPOTrainer._generate per step, step = between
optimizer steps (zero3 only: the phase timers count DeepSpeed's steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

BEFORE = "ba2306b"
STRATEGIES = ("zero3", "fsdp")
WARMUP = 1
MODEL = "llama-100m"
RECIPE = "tiny_grpo"
TRL_ROW = "TRL GRPOTrainer (model.generate)"


def overrides(strategy: str, steps: int, model_dir: str, new_tokens: int) -> list[str]:
    return [f"model={model_dir}", f"strategy={strategy}", f"max_steps={steps}", "global_batch_size=4",
            "num_generations=4", "micro_batch_size=8", f"max_completion_len={new_tokens}",
            f"max_seq_len={64 + new_tokens}", "log_every=1", "save_every=0", "eval_every=0", "eval_fraction=0",
            "sample_prompts=0", "plot_loss=false", "activation_checkpointing=false", "mixed_precision=no"]


def before_tree(work: Path, ref: str) -> Path:
    """finetune as it was at `ref`, unpacked once into work/before-REF."""
    target = work / f"before-{ref}"
    if not (target / "finetune" / "run.py").is_file():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def rollout_and_step_seconds(records: list[dict]) -> dict:
    """From a run's per-step metrics records: each step's rollout and whole-step seconds, their medians
    after WARMUP, and the first rollout's seconds."""
    from bench.studies.grpo_vs_trl import ours_step_seconds

    records = [r for r in records if "loss" in r and "step" in r]
    rollout = [r.get("rollout_seconds", float("nan")) for r in records]
    steps = ours_step_seconds(records)
    return {"rollout_seconds": rollout, "step_seconds": steps, "first_rollout": rollout[0] if rollout else None,
            "rollout": median_after(rollout), "step": median_after(steps),
            "completion_tokens": [r.get("completions/mean_length", 0) * 16 for r in records]}


def median_after(values: list[float], warmup: int = WARMUP) -> float | None:
    kept = [v for v in values[warmup:] if v == v]
    return statistics.median(kept) if kept else None


def run_ours(variant: str, tree: Path, over: list[str], work: Path) -> dict:
    from bench.parts.common import accelerate_launch, fresh_dir, launch_env, read_jsonl, run, shown

    out = fresh_dir(work / f"{variant}")
    cmd = accelerate_launch(str(tree / "finetune" / "run.py"), ["--recipe", RECIPE, *over, f"output_dir={out}"])
    env = launch_env(PYTHONPATH=str(tree))
    launch = run(cmd, work / f"{variant}.log", env=env, done=(out / "summary.json").exists, timeout=1800)
    res = {"command": shown(cmd), "ok": launch.ok, "seconds": round(launch.seconds, 1),
           "other_load": launch.other_load}
    if launch.ok:
        res.update(rollout_and_step_seconds(read_jsonl(out / "metrics.jsonl")))
    else:
        res["error"] = launch.error(4)
    return res


def run_trl(name: str, over: list[str], work: Path) -> dict:
    """TRL's GRPOTrainer on the same recipe, under grpo_vs_trl's phase timers (zero3)."""
    from bench.parts.common import accelerate_launch, fresh_dir, launch_env, run

    out = fresh_dir(work / f"trl-{name}")
    args = ["--recipe", RECIPE, *over, f"output_dir={out}"]
    cmd = accelerate_launch("bench/studies/grpo_vs_trl.py", ["phases", str(out / "phases.json"), "trl", str(out), *args])
    launch = run(cmd, work / f"trl-{name}.log", env=launch_env(DS_ACCELERATOR="cpu"),
                 done=(out / "phases.json").exists, timeout=1800)
    if not (out / "phases.json").exists():
        return {"ok": False, "error": launch.error(4), "other_load": launch.other_load}
    ph = json.loads((out / "phases.json").read_text())
    gen = ph["phases"].get("GRPOTrainer._generate", [None, 0])
    return {"ok": True, "other_load": launch.other_load, "steps": ph["steps"], "rollout": gen[0],
            "step": ph.get("step_seconds"), "first_rollout": None}


def measure(a) -> dict:
    from bench.parts.common import MODELS, build_model, git_state, machine, versions, wait_quiet

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(MODELS[MODEL])
    spec = MODELS[MODEL]
    results = {"command": "python bench/studies/rollout_speed.py " + " ".join(a.argv), "git": git_state(),
               "before": a.before, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": machine(), "versions": versions(), "model": spec.describe(),
               "parameters": spec.num_parameters(), "steps": a.steps, "warmup": WARMUP,
               "new_tokens": a.new_tokens, "rows": []}
    earlier = json.loads((work / "results.json").read_text()) if (work / "results.json").is_file() else {}
    # --work again: the rows that finished are reused; with --only, every earlier row but those named
    only = {tuple(x.split("/", 1)) for x in a.only.split(",") if x}
    kept = {(r["strategy"], r["variant"]): r for r in earlier.get("rows", [])
            if (r.get("ok") and not only) or (only and (r["strategy"], r["variant"]) not in only)}
    t0 = time.time() - 60 * earlier.get("minutes", 0)
    if earlier:
        results["command"] = f"{earlier['command']}`, then `{results['command']}"
        results["started"] = earlier["started"]
    old = before_tree(work, a.before)
    for strategy in a.strategies.split(","):
        over = overrides(strategy, a.steps, str(model_dir), a.new_tokens)
        variants = [("before", old, over), ("after", REPO, over)]
        if a.compile:
            variants.append(("after, generation_compile=true", REPO, [*over, "generation_compile=true"]))
        for variant, tree, args in variants:
            if (strategy, variant) in kept:
                results["rows"].append(kept[strategy, variant])
                continue
            wait_quiet(30)
            res = run_ours(f"{strategy}-{variant.split(',')[0]}{'-compiled' if ',' in variant else ''}", tree, args,
                           work)
            results["rows"].append({"strategy": strategy, "variant": variant, **res})
            print(f"{strategy} {variant}: rollout {res.get('rollout')} s, step {res.get('step')} s"
                  + ("" if res["ok"] else f"; failed: {res.get('error')}"), flush=True)
            save(work, results, t0)
        if a.trl and strategy == "zero3" and (strategy, TRL_ROW) in kept:
            results["rows"].append(kept[strategy, TRL_ROW])
        elif a.trl and strategy == "zero3":
            res = run_trl(strategy, over, work)
            results["rows"].append({"strategy": strategy, "variant": TRL_ROW, **res})
            print(f"{strategy} TRL: {res}", flush=True)
            save(work, results, t0)
    save(work, results, t0)
    return results


def save(work: Path, results: dict, t0: float) -> None:
    results["minutes"] = (time.time() - t0) / 60
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def section(results: dict) -> str:
    """The docs section: what ran, one row per (strategy, variant), each "after" against its "before"."""
    from bench.parts.common import table

    def num(x, digits=2):
        return f"{x:.{digits}f}" if isinstance(x, (int, float)) and x == x else "-"

    base = {r["strategy"]: r for r in results["rows"] if r["variant"] == "before" and r.get("ok")}
    body = []
    for r in results["rows"]:
        b = base.get(r["strategy"])
        if not r.get("ok"):
            body.append([r["strategy"], r["variant"], "failed", "-", "-", "-", "-", "-", f"`{r.get('error')}`"])
            continue
        speed = (f"{b['rollout'] / r['rollout']:.2f}x" if b and r is not b and r.get("rollout") and b.get("rollout")
                 else "-")
        toks = [t for t in (r.get("completion_tokens") or [])[results["warmup"]:] if t]
        body.append([r["strategy"], r["variant"], num(r.get("rollout")), num(r.get("first_rollout")),
                     num(r.get("step")), speed, f"{statistics.median(toks):.0f}" if toks else "-",
                     num(r.get("other_load")), r.get("note", "")])
    n = results["parameters"]
    lines = [
        f"Measured by `{results['command']}` at git {results['git']} on {results['started']} "
        f"({results['minutes']:.0f} min in all); {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        "shared with other jobs; " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".", "",
        f"GRPO on 2 processes over gloo (`accelerate launch --multi_gpu --num_processes 2`), fp32, "
        f"recipes/{RECIPE}.py with {results['model']} ({n / 1e6:.0f}M parameters), 4 prompts x 4 completions a "
        f"step (8 per rank), at most {results['new_tokens']} new tokens each, "
        f"{results['steps']} steps; medians over the steps after the first {results['warmup']}. before: "
        f"finetune at {results['before']} (one completion at a time: filter, softmax, a host copy and "
        "torch.multinomial per row per token); after: this tree (one batched Gumbel-max draw per token on the "
        "device, counter-based noise keyed by (completion seed, position)).", "",
        table(["strategy", "sampler", "rollout s", "first rollout s", "step s", "rollout speed-up",
               "completion tokens/step", "other load", "note"], body), "",
        "rollout s: metrics.jsonl's rollout_seconds (gathering the weights, generating, decoding); step s: the "
        "whole optimizer step (rollout, rewards, forward and backward, update); other load: CPU cores the rest of "
        "the machine used meanwhile, on average (the noise). TRL's row: GRPOTrainer._generate per step "
        "(bench/studies/grpo_vs_trl.py's phase timers) and the time between its optimizer steps."]
    return "\n".join(lines)


TITLE = "## GRPO rollout on CPU: the batched sampler before and after"
BEGIN, END = "<!-- rollout-speed:begin -->", "<!-- rollout-speed:end -->"


def write_doc_section(doc: Path, title: str, begin: str, end: str, text: str) -> None:
    """A section between its markers, replaced in place, or appended at the end of the page."""
    page = doc.read_text() if doc.exists() else ""
    block = f"{title}\n\n{begin}\n{text}\n{end}\n"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        head = head[:head.rfind(title)] if title in head else head
        after = rest.split(end, 1)[1].lstrip("\n")
        page = head + block + ("\n" + after if after else "")
    else:
        page = page.rstrip("\n") + "\n\n" + block
    doc.write_text(page)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--before", default=BEFORE)
    p.add_argument("--compile", action="store_true", help="also after with generation_compile=true")
    p.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer under zero3")
    p.add_argument("--work", default=f"/tmp/rollout-speed-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--only", default="", help="with --work again: run only these rows (strategy/variant, "
                   "comma-separated, e.g. zero3/before), keep every other earlier row as it was")
    p.add_argument("--doc", default="")
    p.add_argument("--render", default="")
    a = p.parse_args(argv)
    a.argv = [x for i, x in enumerate(argv) if not x.startswith("--work") and (i == 0 or argv[i - 1] != "--work")]
    results = json.loads(Path(a.render).read_text()) if a.render else measure(a)
    text = section(results)
    print(text)
    if a.doc:
        write_doc_section(Path(a.doc), TITLE, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
