"""bench/gpu/e2e.sh's checks and table (issue 46: what a GPU user runs, end to end).

    python bench/gpu/e2e_check.py recipe NAME RUN_DIR SECONDS RC   # one recipe's row (a JSON line into rows.jsonl)
    python bench/gpu/e2e_check.py compiled-equals-eager            # the compiled decode loop against the eager one, fp32
    python bench/gpu/e2e_check.py resolve "SPEC,SPEC,..." STATE    # every row checked without training (smoke mode)
    python bench/gpu/e2e_check.py table ROWS.jsonl                 # the markdown table of every row

Each tiny recipe's target is the figure its header promises, read from its metrics.jsonl (train and
eval records, finetune.training.metrics.run_history): tiny's eval loss falls from about 4.8 to about 2.2,
tiny_dpo's eval rewards/accuracies climbs well above 0.5, tiny_reward's eval accuracy too, tiny_grpo's
eval reward rises (0.057 -> 0.144 over 60 steps on CPU), tiny_kto's eval rewards/chosen climbs above 0
and rewards/rejected falls below it (their margin 0 -> 0.66 on 2 CPU processes), tiny_rloo's eval reward
rises (0.054 -> 0.227), tiny_distill's eval divergence falls (2.889 -> 0.389 over 200 steps). The GPU runs
one process in bf16: the targets leave room for that against the headers' 2-process fp32 figures (a
1-process bf16 run of each on CPU: docs/gpu-e2e.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# recipe -> (the eval metric its header names, the value the last eval must reach, higher is better)
TARGETS = {
    "tiny": ("eval_loss", 2.6, False),
    "tiny_dpo": ("eval_rewards/accuracies", 0.9, True),
    "tiny_reward": ("eval_accuracy", 0.75, True),
    "tiny_grpo": ("eval_reward", 0.10, True),
    "tiny_kto": ("eval_rewards/margins", 0.4, True),
    "tiny_rloo": ("eval_reward", 0.15, True),
    "tiny_distill": ("eval_loss", 0.8, False),
}
TEACHERS = {"tiny_distill": "tiny"}  # the row whose final/ a row reads (e2e.sh's teacher)


def recipe_row(name: str, run_dir: str, seconds: float, rc: int, smoke: bool = False) -> dict:
    """One recipe's row: whether it finished, its metric's first and last eval values against the target
    (smoke: a few steps on CPU, the target not asked)."""
    from finetune.training.metrics import read_metrics, run_history

    recipe = name.split()[0]
    metric, target, higher = TARGETS[recipe]
    row = {"recipe": name, "seconds": round(seconds, 1), "rc": rc, "metric": metric, "target": target}
    path = Path(run_dir) / "metrics.jsonl"
    records = run_history(read_metrics(path)) if path.is_file() else []
    evals = [r[metric] for r in records if r.get(metric) is not None]
    row["first"], row["last"] = (evals[0], evals[-1]) if evals else (None, None)
    steps = [r["step"] for r in records if "loss" in r]
    row["steps"] = steps[-1] if steps else 0
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        peaks = s.get("peak_memory_per_rank") or []
        row["peak_gib"] = round(max(peaks) / 2**30, 2) if peaks else None
    reached = row["last"] is not None and (row["last"] >= target if higher else row["last"] <= target)
    row["ok"] = rc == 0 and row["last"] is not None and (smoke or reached)
    if rc != 0:
        log = Path(run_dir).with_suffix(".log")
        errors = [line for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()] \
            if log.is_file() else []
        row["error"] = (errors[-1] if errors else f"exit code {rc}")[:300]
    elif not row["ok"]:
        row["error"] = f"{metric} {row['last']} did not reach {target}"
    return row


# the compiled-against-eager check's shapes: on a GPU a 4-layer model; on CPU (the script's smoke mode) a
# smaller one and fewer tokens
COMPARE_SIZES = {
    "cuda": {"model": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4), "rows": 32, "new_tokens": 128},
    "cpu": {"model": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2), "rows": 8, "new_tokens": 16},
}


def compiled_equals_eager() -> dict:
    """The compiled decode loop (StaticCache, compiled one-token step, CUDA graphs on a GPU) against the
    eager loop in fp32, greedy and sampled, on a random-weight Llama of 4 layers: the same tokens in
    every row, as on CPU (tests/test_generation.py). A check that can fail: it compares, it does not
    allow for rounding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.generation import Sampling, generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = COMPARE_SIZES[device]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, max_position_embeddings=1024, **size["model"])
    model = LlamaForCausalLM(config).to(device).eval()
    rng = torch.Generator().manual_seed(1)
    new_tokens = size["new_tokens"]
    prompts = [torch.randint(3, 4096, (int(n),), generator=rng).tolist()
               for n in torch.randint(16, 64, (size["rows"],), generator=rng)]
    out = {"device": device, "rows": len(prompts), "new_tokens": new_tokens}
    for name, sampling, seeds in (("greedy", Sampling(new_tokens), None),
                                  ("sampled", Sampling(new_tokens, temperature=1.0), list(range(len(prompts))))):
        kw = dict(stop_ids=(), pad_id=0, context=None, seeds=seeds)
        eager = generate(model, prompts, sampling, **kw)
        compiled = generate(model, prompts, sampling, compiled=True, **kw)
        out[name] = sum(a.tokens == b.tokens for a, b in zip(eager, compiled))
    out["ok"] = out["greedy"] == out["sampled"] == len(prompts)
    return out


def resolve_rows(specs: list[str], state: str) -> dict:
    """Every row of e2e.sh's list without training it (the smoke mode trains one): each recipe, with the
    script's overrides, loads and validates as `finetune train` takes it; it has a target, whose metric the
    run logs at eval (eval_loss where the objective has an eval loss, else eval_ and one of its metrics);
    a row that reads another's final/ comes after it."""
    from finetune.recipe import RecipeError, apply_overrides, load_recipe_module, validate
    from finetune.training.objectives import objective_for

    problems, names = [], [spec.split()[0] for spec in specs]
    for k, spec in enumerate(specs):
        name, *overrides = spec.split()
        if name not in TARGETS:
            problems.append(f"{spec}: no target in TARGETS")
            continue
        teacher = TEACHERS.get(name)
        if teacher and teacher not in names[:k]:
            problems.append(f"{spec}: its teacher, {teacher}'s final/, is made by no row before it")
        overrides += ["mixed_precision=bf16", f"output_dir={state}/runs/{name}"] + (
            [f"teacher_model={state}/runs/{teacher}/final"] if teacher else [])
        try:
            recipe = validate(apply_overrides(load_recipe_module(name), overrides))
        except RecipeError as e:
            problems.append(f"{spec}: {e}")
            continue
        objective, metric = objective_for(recipe), TARGETS[name][0]
        logged = ["eval_loss"] * (objective.name != "grpo") + [f"eval_{m}" for m in objective.metrics]
        if metric not in logged:
            problems.append(f"{spec}: its target metric {metric} is not one the run logs ({', '.join(logged)})")
    return {"check": "every row resolves (not trained)", "ok": not problems,
            "what": f"{len(specs)} rows: {', '.join(specs)}", **({"error": "; ".join(problems)[:600]} if problems else {})}


def table(rows: list[dict]) -> str:
    def num(x):
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| run | ok | seconds | steps | metric: first -> last (target) | peak GiB | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "recipe" in r:
            arrow = "<=" if r["metric"] == "eval_loss" else ">="
            lines.append(f"| `{r['recipe']}` | {'yes' if r['ok'] else '**no**'} | {r['seconds']} | {r['steps']} | "
                         f"{r['metric']}: {num(r['first'])} -> {num(r['last'])} ({arrow} {r['target']}) | "
                         f"{num(r.get('peak_gib'))} | {r.get('error', '')} |")
        else:
            lines.append(f"| {r['check']} | {'yes' if r.get('ok') else '**no**'} | {r.get('seconds', '-')} | - | "
                         f"{r.get('what', '')} | - | {r.get('error', '')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[0] == "recipe":
        name, run_dir, seconds, rc = argv[1], argv[2], float(argv[3]), int(argv[4])
        row = recipe_row(name, run_dir, seconds, rc, smoke="--smoke" in argv)
        print(json.dumps(row))
        return 0
    if argv[0] == "compiled-equals-eager":
        import time

        t0 = time.time()
        try:
            res = compiled_equals_eager()
            what = (f"compiled = eager tokens, fp32 on {res['device']}: {res['greedy']}/{res['rows']} rows greedy, "
                    f"{res['sampled']}/{res['rows']} sampled ({res['new_tokens']} tokens)")
            row = {"check": "compiled loop = eager loop (fp32)", "ok": res["ok"], "what": what}
        except Exception as e:  # recorded, the script goes on
            row = {"check": "compiled loop = eager loop (fp32)", "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row))
        return 0
    if argv[0] == "resolve":
        print(json.dumps(resolve_rows([s for s in argv[1].split(",") if s.strip()], argv[2])))
        return 0
    if argv[0] == "table":
        rows = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
