"""A whole GRPO step, ours (objective=grpo, recipes/tiny_grpo.py) against TRL's GRPOTrainer (its own
generation, use_vllm off): seconds per step, 2 processes over gloo on CPU, strategy zero3 and fsdp.

    PYTHONPATH=$PWD:/tmp/trlpkg python bench/studies/grpo_vs_trl.py                       # zero3 and fsdp, ~6 min on 2 cores
    PYTHONPATH=$PWD:/tmp/trlpkg python bench/studies/grpo_vs_trl.py --doc docs/benchmarks.md   # also writes section 14
    ... --phases    # under zero3 each side once more with timers per phase and collective (phases_main)
    python bench/studies/grpo_vs_trl.py --finetune /path/to/tree ...   # the finetune tree both sides import (default: this one)

TRL is a bench-only dependency (`pip install --no-deps --target /tmp/trlpkg trl==1.16.0` beside the project's
pinned accelerate/datasets/transformers, then PYTHONPATH=$PWD:/tmp/trlpkg).

Both sides get recipes/tiny_grpo.py's numbers, read from the recipe at run time (the section prints them):
the builtin 2-layer tiny Llama and its character tokenizer, fp32, builtin:tiny-prompts (prompt + answer
columns), the recipe's reward functions (from finetune.rewards: TRL calls them with the same keyword
arguments), num_generations, temperature, top_p, top_k, max_completion_len, loss_type, beta, epsilon,
scale_rewards, num_iterations, global_batch_size prompts a step, micro_batch_size completions a micro-batch,
lr (constant), AdamW betas/eps, weight decay, max_grad_norm, seed, dropout off, no gradient checkpointing;
the same DeepSpeed ZeRO-3 config (finetune.strategy's, through bench/helpers/trainer_baseline.py) or FSDP2
settings. TRL: GRPOConfig(per_device_train_batch_size=micro_batch_size, gradient_accumulation_steps=
prompts x num_generations / (2 x micro_batch_size)), so steps_per_generation (its default, the
accumulation) makes generation_batch_size = prompts x num_generations: one generation per optimizer
step, as ours. What is not the same: the prompts' order (TRL's RepeatSampler shuffles with its own
generator; ours follows its prompt schedule) and the sampled tokens (each side's own generator), so the
completions differ; the table gives each side's completion tokens per step.

A step's time: TRL's, between on_step_end callbacks (generation, rewards, forward/backward of every
micro-batch, the optimizer step); ours, metrics.jsonl's window per step (tokens / tokens_per_s, from
the end of one step's logging to the end of the next). Median of each run's steps after the first WARMUP.

What TRL's GRPOTrainer needs on CPU with 2 processes (bench/helpers/trainer_baseline.py's shim): DeepSpeed and
FSDP on CPU take Accelerate's configured state (a gloo PartialState, FSDP marked MULTI_GPU) and
DS_ACCELERATOR=cpu; use_cpu is not set under zero3/fsdp (Accelerate would drop the DeepSpeed/FSDP
plugin); bf16 False (GRPOConfig's default is True: TrainingArguments refuses bf16 on CPU without
use_cpu); use_vllm False (its default).
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
FINETUNE_ROOT = Path(os.environ.get("GRPO_FINETUNE_ROOT") or REPO).resolve()
# finetune from FINETUNE_ROOT; bench.parts and bench.helpers from it too where that tree has them, else from here
sys.path[:0] = [str(FINETUNE_ROOT), str(REPO), str(REPO / "tests")]

STRATEGIES = ("zero3", "fsdp")
WARMUP = 2  # timed steps left out at the start (first generation, allocator, DeepSpeed/FSDP first gathers)
RECIPE = "tiny_grpo"


def overrides(strategy: str, steps: int) -> list[str]:
    """What both sides are given on top of recipes/tiny_grpo.py (TRL's side reads the same recipe)."""
    return [f"strategy={strategy}", f"max_steps={steps}", "log_every=1", "save_every=0", "eval_every=0",
            "eval_fraction=0", "sample_prompts=0", "plot_loss=false", "activation_checkpointing=false",
            "mixed_precision=no"]


# ---------------------------------------------------------------- TRL's side (a process of its own)


def trl_main(argv: list[str]) -> int:
    """`accelerate launch ... bench/studies/grpo_vs_trl.py trl OUT --recipe NAME key=value ...`: TRL's GRPOTrainer
    on the recipe's model, prompts, rewards and numbers; writes OUT/trl_summary.json on rank 0."""
    from bench.helpers import trainer_baseline as TB

    out, r, plan = TB.recipe_and_plan(argv)

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from bench.parts.common import read_jsonl
    from finetune.training import loop
    from finetune.assets import resolve_dataset
    from finetune.model import load_config, load_tokenizer
    from finetune.rewards import resolve as resolve_reward

    hf_logging.set_verbosity_warning()
    model_path, config = load_config(r)
    on_cpu = plan.device == "cpu"
    kw = TB.trainer_kwargs(r, plan, config, on_cpu)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    completions = r.global_batch_size * r.num_generations
    if completions % (world * r.micro_batch_size):
        print(f"error: {completions} completions a step do not split into {world} ranks x micro-batches of "
              f"{r.micro_batch_size}", file=sys.stderr)
        return 2
    accum = completions // (world * r.micro_batch_size)
    targs = trl.GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=r.micro_batch_size,
        gradient_accumulation_steps=accum, learning_rate=r.lr, adam_beta1=r.adam_beta1, adam_beta2=r.adam_beta2,
        adam_epsilon=r.adam_eps, weight_decay=r.weight_decay, max_grad_norm=r.max_grad_norm,
        lr_scheduler_type=r.lr_scheduler, warmup_steps=r.warmup_steps, max_steps=r.max_steps, seed=r.seed,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=r.activation_checkpointing, disable_dropout=True,
        num_generations=r.num_generations, max_completion_length=r.max_completion_len, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k or 0, loss_type=r.loss_type, beta=r.beta, epsilon=r.epsilon,
        epsilon_high=r.epsilon_high or r.epsilon, scale_rewards=r.scale_rewards, num_iterations=r.num_iterations,
        mask_truncated_completions=r.mask_truncated_completions, use_bias_correction_kl=r.use_bias_correction_kl,
        use_vllm=False,
        reward_weights=[float(w) for w in r.reward_weights] or None,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": r.attn_implementation}, **kw)

    rows = read_jsonl(Path(resolve_dataset(r.dataset)))
    tokenizer = load_tokenizer(r, model_path)
    rewards = [resolve_reward(f) for f in r.reward_funcs]

    step_end: list[float] = []
    logs: dict[int, dict] = {}

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logs_by_step[state.global_step] = dict(logs)

    logs_by_step = logs  # on_log's own argument is named logs
    trainer = trl.GRPOTrainer(model=str(model_path), reward_funcs=rewards, args=targs,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[Recorder()])
    result = trainer.train()
    if trainer.is_world_process_zero():
        steps = trainer.state.global_step
        summary = {
            "trl": trl.__version__, "strategy": r.strategy, "world_size": targs.world_size, "grad_accum": accum,
            "steps_per_generation": targs.steps_per_generation, "generation_batch_size": targs.generation_batch_size,
            "engine": type(trainer.model_wrapped).__name__, "steps": steps,
            "train_runtime": result.metrics.get("train_runtime"),
            "step_seconds": [b - a for a, b in zip(step_end, step_end[1:])],
            "logs": [logs.get(s) for s in range(1, steps + 1)],
            "deepspeed_config": kw.get("deepspeed"), "fsdp_config": kw.get("fsdp_config"), **TB.what_ran(trainer),
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "trl_summary.json").write_text(json.dumps(summary) + "\n")
    loop.KEEP_UNTIL_EXIT.append(trainer)
    loop.finish_together()
    return 0


# ---------------------------------------------------------------- both sides, launched


def env() -> dict:
    from bench.parts.common import launch_env

    return launch_env(PYTHONPATH=os.pathsep.join(filter(None, [str(FINETUNE_ROOT), os.environ.get("PYTHONPATH")])),
                      GRPO_FINETUNE_ROOT=str(FINETUNE_ROOT), DS_ACCELERATOR="cpu")


def ours_step_seconds(records: list[dict]) -> list[float]:
    """Each step's wall-clock seconds: its record's window (tokens / tokens_per_s)."""
    seconds, prev = [], 0
    for r in records:
        seconds.append((r["tokens"] - prev) / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))
        prev = r["tokens"]
    return seconds


def nogc_main(argv: list[str]) -> None:
    """`bench/studies/grpo_vs_trl.py nogc RUN_PY ARGS...`: finetune/run.py with DeepSpeed's
    DeepSpeedEngine.empty_partition_cache minus its gc.collect() (and accelerator empty_cache): what a
    ZeRO-3 step costs without the full garbage collection finetune's whole_weights pays at every rollout
    (the --nogc row)."""
    import runpy

    from deepspeed.runtime.engine import DeepSpeedEngine

    def empty_partition_cache(self):
        if hasattr(self.optimizer, "empty_partition_cache"):
            self.optimizer.empty_partition_cache()

    DeepSpeedEngine.empty_partition_cache = empty_partition_cache
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


# What phases_main times, per optimizer step after the warm-up, on rank 0: (row, what it times on each side).
PHASES = (
    ("rollout: generation, rewards, advantages", "GRPO.new_rollout", "GRPOTrainer._generate_and_score_completions"),
    ("of which generation (weights gathered once)", "generate_completions", "GRPOTrainer._generate"),
    ("forward of the micro-batches", "DeepSpeedEngine.forward", "DeepSpeedEngine.forward"),
    ("backward of the micro-batches (gradient reduce-scatter included)", "DeepSpeedEngine.backward",
     "DeepSpeedEngine.backward"),
    ("optimizer step", "DeepSpeedEngine.step", "DeepSpeedEngine.step"),
    ("collective: reduce_scatter_tensor", "dist.reduce_scatter_tensor", "dist.reduce_scatter_tensor"),
    ("collective: all_gather_into_tensor", "dist.all_gather_into_tensor", "dist.all_gather_into_tensor"),
    ("collective: all_reduce, broadcast, all_gather(_object)", "dist.other", "dist.other"),
    ("subprocesses started", "subprocess.Popen", "subprocess.Popen"),
)


def phases_main(argv: list[str]) -> None:
    """`bench/studies/grpo_vs_trl.py phases JSON (RUN_PY ARGS... | trl OUT ARGS...)`: ours (finetune/run.py) or TRL's
    side under zero3 with timers around each phase (PHASES) and each collective; rank 0 writes JSON: seconds
    and calls per optimizer step, over the steps after the first WARMUP (counted by DeepSpeedEngine.step)."""
    import functools
    import subprocess

    import torch.distributed as dist
    from deepspeed.runtime.engine import DeepSpeedEngine

    path, argv = Path(argv[0]), argv[1:]
    totals: dict[str, list[float]] = {}
    steps = {"n": 0, "t0": None, "t1": None, "in_dist": False}

    def timed(owner, name, key):
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **k):
            collective = key.startswith("dist.")
            outer = not (collective and steps["in_dist"])  # not all_gather_object's own all_gather
            on, t = steps["n"] >= WARMUP and outer, time.perf_counter()
            if collective:
                steps["in_dist"] = True
            try:
                return f(*a, **k)
            finally:
                if collective and outer:
                    steps["in_dist"] = False
                if on:
                    entry = totals.setdefault(key, [0.0, 0])
                    entry[0] += time.perf_counter() - t
                    entry[1] += 1
        setattr(owner, name, wrapper)

    step = DeepSpeedEngine.step

    def counted_step(self, *a, **k):  # Accelerate calls it once per optimizer step, after the last backward
        out = step(self, *a, **k)
        steps["n"] += 1
        steps["t0" if steps["n"] == WARMUP else "t1"] = time.perf_counter()
        return out
    DeepSpeedEngine.step = counted_step
    for name in ("forward", "backward", "step"):
        timed(DeepSpeedEngine, name, f"DeepSpeedEngine.{name}")
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        timed(dist, name, f"dist.{name}")
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object"):
        timed(dist, name, "dist.other")
    timed(subprocess.Popen, "__init__", "subprocess.Popen")

    def write():
        if os.environ.get("RANK", "0") != "0":
            return
        n = max(steps["n"] - WARMUP, 1)
        path.write_text(json.dumps({"steps": n, "step_seconds": (steps["t1"] - steps["t0"]) / n
                                    if steps["t0"] and steps["t1"] else None,
                                    "phases": {k: [v[0] / n, v[1] / n] for k, v in totals.items()}}) + "\n")

    import finetune.commands.train as train_command

    leave = train_command.exit_without_teardown

    def write_then_leave(code):
        write()
        leave(code)
    train_command.exit_without_teardown = write_then_leave
    if argv[0] == "trl":
        import trl

        timed(trl.GRPOTrainer, "_generate_and_score_completions", "GRPOTrainer._generate_and_score_completions")
        timed(trl.GRPOTrainer, "_generate", "GRPOTrainer._generate")
        write_then_leave(trl_main(argv[1:]))
    import runpy

    import finetune.training.objectives.grpo as grpo

    timed(grpo.GRPO, "new_rollout", "GRPO.new_rollout")
    timed(grpo, "generate_completions", "generate_completions")
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def run_ours(name: str, over: list[str], work: Path, nogc: bool = False) -> dict:
    from bench.parts.common import accelerate_launch, fresh_dir, read_jsonl, run, shown

    out = fresh_dir(work / f"ours-{name}")
    run_py = str(FINETUNE_ROOT / "finetune" / "run.py")
    args = ["--recipe", RECIPE, *over, f"output_dir={out}"]
    cmd = accelerate_launch("bench/studies/grpo_vs_trl.py", ["nogc", run_py, *args]) if nogc else accelerate_launch(run_py, args)
    launch = run(cmd, work / f"ours-{name}.log", env=env(), done=(out / "summary.json").exists)
    res = {"command": shown(cmd), "ok": launch.ok, "seconds": round(launch.seconds, 1), "other_load": launch.other_load}
    if launch.ok:
        records = [x for x in read_jsonl(out / "metrics.jsonl") if "loss" in x and "step" in x]
        res["step_seconds"] = ours_step_seconds(records)
        res["completion_tokens"] = [x["completions/mean_length"] * len_batch(over) for x in records
                                    if "completions/mean_length" in x]
    else:
        res["error"] = launch.error(4)
    return res


def len_batch(over: list[str]) -> int:
    """Completions a step: the recipe's global batch (prompts) x num_generations."""
    from finetune.recipe import resolve

    r = resolve(RECIPE, over)
    return r.global_batch_size * r.num_generations


def run_trl(name: str, over: list[str], work: Path) -> dict:
    from bench.parts.common import accelerate_launch, fresh_dir, run, shown

    out = fresh_dir(work / f"trl-{name}")
    cmd = accelerate_launch("bench/studies/grpo_vs_trl.py", ["trl", str(out), "--recipe", RECIPE, *over, f"output_dir={out}"])
    launch = run(cmd, work / f"trl-{name}.log", env=env(), done=(out / "trl_summary.json").exists)
    summary = out / "trl_summary.json"
    res = {"command": shown(cmd), "ok": launch.ok and summary.exists(), "seconds": round(launch.seconds, 1),
           "other_load": launch.other_load}
    if res["ok"]:
        s = json.loads(summary.read_text())
        res.update(s)
        n = len_batch(over)
        res["completion_tokens"] = [x["completions/mean_length"] * n for x in s["logs"]
                                    if x and "completions/mean_length" in x]
    else:
        res["error"] = launch.error(4)
    return res


def run_phases(side: str, name: str, over: list[str], work: Path) -> dict:
    """One more launch of a side with phases_main's timers: its phase table (rank 0), or the error."""
    from bench.parts.common import accelerate_launch, fresh_dir, run

    out = fresh_dir(work / f"phases-{side}-{name}")
    args = ["--recipe", RECIPE, *over, f"output_dir={out}"]
    target = [str(FINETUNE_ROOT / "finetune" / "run.py")] if side == "ours" else ["trl", str(out)]
    cmd = accelerate_launch("bench/studies/grpo_vs_trl.py", ["phases", str(out / "phases.json"), *target, *args])
    launch = run(cmd, work / f"phases-{side}-{name}.log", env=env(), done=(out / "phases.json").exists)
    if not (out / "phases.json").exists():
        return {"ok": False, "error": launch.error(4)}
    return {"ok": True, "other_load": launch.other_load, **json.loads((out / "phases.json").read_text())}


def median_after_warmup(seconds: list[float]) -> float | None:
    kept = [s for s in seconds[WARMUP:] if s == s]
    return statistics.median(kept) if kept else None


def timing(work: Path, steps: int, strategies: list[str], nogc: bool, phases: bool = False) -> dict:
    from bench.parts.common import wait_quiet

    results = {"steps": steps, "warmup": WARMUP, "rows": []}
    for i, strategy in enumerate(strategies):
        over = overrides(strategy, steps)
        wait_quiet(30)
        pair = {}
        for side in (("ours", "trl") if i % 2 == 0 else ("trl", "ours")):
            pair[side] = (run_ours if side == "ours" else run_trl)(strategy, over, work)
        if nogc and strategy.startswith("zero"):  # the same TRL run against ours without DeepSpeed's gc.collect
            pair["nogc"] = run_ours(f"{strategy}-nogc", over, work, nogc=True)
        row = {"strategy": strategy, "ours_first": i % 2 == 0}
        for side, res in pair.items():
            row[side] = {k: res.get(k) for k in ("ok", "command", "other_load", "step_seconds", "completion_tokens",
                                                  "error", "engine", "trl", "steps_per_generation",
                                                  "generation_batch_size")}
            row[side]["seconds_per_step"] = median_after_warmup(res.get("step_seconds") or [])
            toks = (res.get("completion_tokens") or [])[WARMUP:]
            row[side]["tokens_per_step"] = statistics.median(toks) if toks else None
        a, b = row["ours"]["seconds_per_step"], row["trl"]["seconds_per_step"]
        row["trl_over_ours"] = b / a if a and b else None
        results["rows"].append(row)
        if "nogc" in row:
            c = row["nogc"]["seconds_per_step"]
            results["rows"].append({"strategy": f"{strategy}, no gc.collect at the rollout (what-if)", "ours": row["nogc"],
                                    "trl": row["trl"], "trl_over_ours": b / c if b and c else None, "what_if": True})
            del row["nogc"]
        if phases and strategy == "zero3":  # both sides again, with timers around each phase
            results["phases"] = {"strategy": strategy, "ours": run_phases("ours", strategy, over, work),
                                 "trl": run_phases("trl", strategy, over, work)}
        print(f"{strategy}: ours {a} s/step, TRL {b} s/step" + ("" if pair["trl"]["ok"] else
                                                                f"; TRL failed: {pair['trl'].get('error')}")
              + ("" if pair["ours"]["ok"] else f"; ours failed: {pair['ours'].get('error')}"), flush=True)
    return results


# ---------------------------------------------------------------- the report


def section(results: dict) -> str:
    from bench.parts.common import table

    tim = results["timing"]
    rc = results["recipe"]
    n = rc["global_batch_size"] * rc["num_generations"]
    tsum = next((row["trl"] for row in tim["rows"] if row["trl"].get("generation_batch_size")), {})
    lines = [f"Measured by `{results['command']}` at git {results['git']} (finetune tree: {results['finetune']} at "
             f"{results.get('finetune_git', '?')}, its working tree as it was) on "
             f"{results['started']} ({results['minutes']:.0f} min in all); {results['machine']['cpu']}, "
             f"{results['machine']['cores']} cores, shared with other jobs; "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".", "",
             f"A whole GRPO step (generation, rewards, forward and backward, optimizer step), ours against TRL's "
             "GRPOTrainer with its own generation (`model.generate`, use_vllm off), `accelerate launch --multi_gpu "
             f"--num_processes 2` over gloo, fp32, recipes/{RECIPE}.py's numbers on both sides: the builtin 2-layer "
             f"tiny Llama, builtin:tiny-prompts, its reward functions ({', '.join(rc['reward_funcs'])}), "
             f"{rc['global_batch_size']} prompts x num_generations {rc['num_generations']} = {n} completions a step, "
             f"max_completion_len {rc['max_completion_len']}, temperature {rc['temperature']}, loss_type "
             f"{rc['loss_type']}, beta {rc['beta']}, lr {rc['lr']}, micro-batch {rc['micro_batch_size']} completions "
             f"({n // (2 * rc['micro_batch_size'])} per rank a step; TRL: gradient_accumulation_steps = "
             f"steps_per_generation = {tsum.get('steps_per_generation')}, generation_batch_size "
             f"{tsum.get('generation_batch_size')}: one generation a step, as ours). "
             f"{tim['steps']} steps each; seconds per step: the median of the steps after the first {tim['warmup']}. "
             f"Completion tokens per step: each side's mean completion length x {n} (the median over the same steps); "
             "the prompts' order and the sampled tokens are each side's own (bench/studies/grpo_vs_trl.py's docstring).", ""]
    body = []
    for row in tim["rows"]:
        o, t = row["ours"], row["trl"]
        body.append([row["strategy"], f"{o['seconds_per_step']:.3f}" if o["seconds_per_step"] else "failed",
                     f"{t['seconds_per_step']:.3f}" if t["seconds_per_step"] else "failed",
                     f"{row['trl_over_ours']:.2f}x" if row["trl_over_ours"] else "-",
                     f"{o['tokens_per_step']:.0f}" if o["tokens_per_step"] else "-",
                     f"{t['tokens_per_step']:.0f}" if t["tokens_per_step"] else "-",
                     f"{(o['other_load'] or 0):.2f} / {(t['other_load'] or 0):.2f}", t.get("engine") or "-"])
    lines += [table(["strategy", "finetune s/step", "TRL s/step", "TRL / finetune", "finetune completion tokens/step",
                     "TRL completion tokens/step", "other load (finetune / TRL)", "TRL's engine"], body), ""]
    if any(row.get("what_if") for row in tim["rows"]):
        lines += ["Where ours loses under zero3: finetune's ZeRO-3 `whole_weights` (finetune/strategy/zero.py) starts "
                  "every rollout with DeepSpeed's `engine.empty_partition_cache()`, which after releasing the "
                  "partitions runs a full `gc.collect()` (deepspeed/runtime/engine.py), about 0.65 s a call per rank "
                  "here (cProfile of rank 0's generate_completions over 4 rollouts of 64 completions, measured once: "
                  "gc.collect 2.60 s of 3.25 s, the generation 0.46 s). The what-if row is the same finetune run with that method "
                  "replaced by `self.optimizer.empty_partition_cache()` alone (`bench/studies/grpo_vs_trl.py nogc`, "
                  "monkeypatched; the per-step losses are bit-identical with and without), against the same TRL run: "
                  "the release without the collection is what the rollout needs.", ""]
    if tim.get("phases"):
        lines += [phase_table(tim["phases"], tim["warmup"]), ""]
    for row in tim["rows"]:
        if row.get("what_if"):
            continue
        for side in ("ours", "trl"):
            if not row[side]["ok"]:
                lines.append(f"{row['strategy']}, {'finetune' if side == 'ours' else 'TRL'} failed: "
                             f"`{row[side]['error']}`")
    lines += ["TRL's GRPOTrainer on CPU, 2 processes: it ran under both strategies with no change to TRL. What it "
              "needs (bench/helpers/trainer_baseline.py's shim, as the Trainer baseline): Accelerate's configured state, a gloo "
              "PartialState (for fsdp marked MULTI_GPU, as Accelerate turns FSDP on only for GPU-like types) and "
              "accelerator_config use_configured_state; DS_ACCELERATOR=cpu; use_cpu left off under zero3/fsdp; "
              "bf16=False (GRPOConfig defaults to bf16=True, which TrainingArguments refuses on CPU without use_cpu); "
              "use_vllm=False (its default); the reward functions and the model path as plain arguments.", "",
              "other load: CPU cores used by the rest of the machine during each launch, on average. Commands: "
              + "; ".join(f"`{row[s]['command']}`" for row in tim["rows"][:1] for s in ("ours", "trl")) + "."]
    return "\n".join(lines).rstrip()


def phase_table(ph: dict, warmup: int) -> str:
    """Where a step's time goes on each side (phases_main), as a paragraph and a table."""
    from bench.parts.common import table

    o, t = ph["ours"], ph["trl"]
    failed = [f"{'finetune' if s is o else 'TRL'}'s phase launch failed: `{s.get('error')}`" for s in (o, t)
              if not s.get("ok")]
    if failed:
        return "\n".join(failed)

    def cell(side, key, count=False):
        seconds, calls = side["phases"].get(key, [0.0, 0.0])
        return f"{calls:.0f}" if count else f"{seconds * 1000:.0f} ms ({calls:.0f})"

    body = [[row, *(cell(s, key, row.startswith("subprocesses")) for s, key in ((o, ours), (t, theirs)))]
            for row, ours, theirs in PHASES]
    body.append(["the whole step (between optimizer steps)", *(f"{s['step_seconds'] * 1000:.0f} ms"
                                                                 if s.get("step_seconds") else "-" for s in (o, t))])
    return "\n".join([
        f"Where a {ph['strategy']} step's time goes: each side launched once more with timers on rank 0 around each "
        f"phase and each collective (`bench/studies/grpo_vs_trl.py --phases`, phases_main: what PHASES wraps), per optimizer "
        f"step over the steps after the first {warmup} ({o['steps']} and {t['steps']}), milliseconds (calls a step); "
        f"other load {o.get('other_load') or 0:.2f} / {t.get('other_load') or 0:.2f}. The rows overlap: generation "
        "is part of the rollout, the collectives run inside the rollout, forward, backward and optimizer step, "
        "and a collective's time includes rank 0's wait for the other rank.", "",
        table(["phase", "finetune", "TRL"], body)])


def write_doc(doc: Path, text: str) -> None:
    from bench.parts.report import GRPO_BEGIN, GRPO_END, GRPO_TITLE, write_marked_section

    write_marked_section(doc, GRPO_TITLE, GRPO_BEGIN, GRPO_END, text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--nogc", action="store_true", help="under zero3 also run ours with DeepSpeed's "
                   "empty_partition_cache without its gc.collect() (a what-if row, nogc_main)")
    p.add_argument("--phases", action="store_true", help="under zero3 also run each side once more with "
                   "timers around each phase of the step (phases_main): the phase table")
    p.add_argument("--finetune", default="", help="the finetune tree both sides run (default: this repository)")
    p.add_argument("--work", default=f"/tmp/grpo-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--doc", default="", help="write section 14 into this report (docs/benchmarks.md)")
    p.add_argument("--render", default="", help="only write the report from a run's results.json")
    a = p.parse_args(argv)
    if a.finetune and Path(a.finetune).resolve() != FINETUNE_ROOT:  # re-run with that tree first on sys.path
        os.environ["GRPO_FINETUNE_ROOT"] = str(Path(a.finetune).resolve())
        os.execv(sys.executable, [sys.executable, __file__, *argv])
    if a.render:
        text = section(json.loads(Path(a.render).read_text()))
        print(text)
        if a.doc:
            write_doc(Path(a.doc), text)
        return 0
    if not (FINETUNE_ROOT / "recipes" / f"{RECIPE}.py").is_file():
        print(f"error: {FINETUNE_ROOT} has no recipes/{RECIPE}.py (objective=grpo); run a tree that has it: "
              f"--finetune DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from bench.parts.common import git_state, machine, versions

    import trl

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shown_argv = [x for x in argv]
    results = {"command": "PYTHONPATH=$PWD:/tmp/trlpkg python bench/studies/grpo_vs_trl.py " + " ".join(shown_argv),
               "git": git_state(), "finetune": str(FINETUNE_ROOT),
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "versions": {**versions(), "trl": trl.__version__}}
    from finetune.recipe import resolve

    r = resolve(RECIPE, overrides(STRATEGIES[0], a.steps))
    results["recipe"] = {k: getattr(r, k) for k in ("global_batch_size", "num_generations", "micro_batch_size",
                                                    "max_completion_len", "temperature", "loss_type", "beta", "lr")}
    results["recipe"]["reward_funcs"] = [getattr(f, "__name__", str(f).rsplit(":", 1)[-1]) for f in r.reward_funcs]
    results["finetune_git"] = subprocess.run(["git", "-C", str(FINETUNE_ROOT), "log", "-1", "--format=%h %s"],
                                             capture_output=True, text=True).stdout.strip()[:80]
    results["timing"] = timing(work, a.steps, a.strategies.split(","), a.nogc, a.phases)
    results["minutes"] = (time.time() - t0) / 60
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = section(results)
    print(text)
    print(f"results: {work / 'results.json'}")
    if a.doc:
        write_doc(Path(a.doc), text)
    return 0 if all(row["ours"]["ok"] and row["trl"]["ok"] for row in results["timing"]["rows"]) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from finetune.run import exit_without_teardown

        exit_without_teardown(trl_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "phases":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        phases_main(sys.argv[2:])
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "nogc":
        nogc_main(sys.argv[2:])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
