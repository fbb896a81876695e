"""Part 2: target tokens per second of finetune/run.py against the Hugging Face Trainer, strategy by
strategy, both launched with `accelerate launch --multi_gpu --num_processes 2` on the same model,
data, rows in the same order, sequence length, batch, AdamW hyper-parameters and DeepSpeed config
or FSDP2 settings (bench/helpers/trainer_baseline.py says how).

Tokens are counted the same way for both: target tokens (labels[:, 1:] != -100, so no padding and no
prompt) of all ranks. Speed is the steady state: the tokens of the steps after the first `warmup`
divided by their wall-clock time; for finetune from metrics.jsonl (one record per step: its tokens
and tokens_per_s give its duration), for the Trainer from a callback's clock at every step's end.
Both durations run from the end of one optimizer step (after its logging) to the end of the next.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.parts.common import accelerate_launch, fmt, fresh_dir, read_jsonl, run, shown, table, wait_quiet

STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero1"],
    "zero2": ["strategy=zero2"],
    "zero3": ["strategy=zero3"],
    "fsdp": ["strategy=fsdp"],
    "zero3, optimizer+params->cpu": ["strategy=zero3", "offload_optimizer=cpu", "offload_params=cpu"],
    "fsdp, params->cpu": ["strategy=fsdp", "offload_params=cpu"],
}
LOSS_TOLERANCE = 1e-3  # relative; FSDP/ZeRO reduction order moves fp32 losses by ~1e-5 (cpu-distributed.md)


def common_overrides(model_dir: Path, dataset: Path, steps: int, seq_len: int, micro: int, accum: int) -> list[str]:
    return [f"model={model_dir}", f"dataset={dataset}", "dataset_format=prompt_completion", f"max_seq_len={seq_len}",
            f"micro_batch_size={micro}", f"grad_accum={accum}", f"max_steps={steps}", "log_every=1",
            "eval_fraction=0", "eval_at_start=false", "save_every=0", "warmup_steps=2", "lr=1e-3",
            "lr_scheduler=cosine", "weight_decay=0.0", "max_grad_norm=1.0", "mixed_precision=no", "seed=42"]


def ours_steps(out: Path) -> dict:
    """Per-step tokens, seconds and losses from finetune's metrics.jsonl, and the loop's extra fields."""
    from finetune.training.metrics import run_history

    records = [r for r in run_history(read_jsonl(out / "metrics.jsonl")) if "loss" in r]
    tokens, seconds, losses, prev = [], [], [], 0
    for r in records:
        step_tokens = r["tokens"] - prev
        prev = r["tokens"]
        tokens.append(step_tokens)
        seconds.append(step_tokens / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))
        losses.append(r["loss"])
    known = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "epoch"}
    extra = {k: v for k, v in (records[-1].items() if records else []) if k not in known}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"tokens": tokens, "seconds": seconds, "losses": losses, "loop_fields": extra, "summary": summary}


def steady(tokens: list[int], seconds: list[float], warmup: int) -> float | None:
    t, s = sum(tokens[warmup:]), sum(seconds[warmup:])
    return t / s if s > 0 else None


def run_ours(name: str, overrides: list[str], work: Path, warmup: int) -> dict:
    out = fresh_dir(work / f"ours-{slug(name)}")
    cmd = accelerate_launch("finetune/run.py", ["--recipe", "tiny", *overrides, f"output_dir={out}"])
    launch = run(cmd, work / f"ours-{slug(name)}.log", done=(out / "summary.json").exists)
    res = {"command": shown(cmd), "ok": launch.ok, "seconds": round(launch.seconds, 1), "output_dir": str(out),
           "hung_at_exit": launch.hung_at_exit, "other_load": launch.other_load}
    if launch.ok:
        res.update(ours_steps(out))
        res["tokens_per_s"] = steady(res["tokens"], res["seconds"], warmup)
        res["warmup"] = warmup
    else:
        res["error"] = launch.error()
    return res


def run_trainer(name: str, overrides: list[str], work: Path, warmup: int) -> dict:
    out = fresh_dir(work / f"trainer-{slug(name)}")
    cmd = accelerate_launch("bench/helpers/trainer_baseline.py", [str(out), "--recipe", "tiny", *overrides,
                                                          f"output_dir={out}"])
    launch = run(cmd, work / f"trainer-{slug(name)}.log", done=(out / "trainer_summary.json").exists)
    res = {"command": shown(cmd), "ok": launch.ok and (out / "trainer_summary.json").exists(),
           "seconds": round(launch.seconds, 1), "output_dir": str(out), "hung_at_exit": launch.hung_at_exit,
           "other_load": launch.other_load}
    if res["ok"]:
        s = json.loads((out / "trainer_summary.json").read_text())
        res.update(tokens=s["tokens"], seconds=s["step_seconds"], losses=s["losses"], engine=s["engine"],
                   train_runtime=s["train_runtime"])
        res["tokens_per_s"] = steady(res["tokens"], res["seconds"], warmup)
    else:
        res["error"] = launch.error(4)
    return res


QUIET_WAIT = 45  # seconds a pair waits, at most, for other processes to leave the CPU
NOISE_LIMIT = 0.25  # CPU cores used by other processes during a run, on average, above which a pair is re-run


def pair(name: str, overrides: list[str], work: Path, warmup: int, ours_first: bool) -> tuple[dict, dict]:
    wait_quiet(QUIET_WAIT)
    if ours_first:
        ours = run_ours(name, overrides, work, warmup)
        return ours, run_trainer(name, overrides, work, warmup)
    theirs = run_trainer(name, overrides, work, warmup)
    return run_ours(name, overrides, work, warmup), theirs


def noise(ours: dict, theirs: dict) -> float:
    return max(ours.get("other_load") or 0.0, theirs.get("other_load") or 0.0)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def compare(ours: dict, theirs: dict) -> dict:
    out = {}
    if ours.get("tokens_per_s") and theirs.get("tokens_per_s"):
        out["ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    if ours.get("ok") and theirs.get("ok"):
        a, b = ours["losses"], theirs["losses"]
        n = min(len(a), len(b))
        diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n]) if x is not None and y is not None]
        out["same_tokens"] = ours["tokens"][:n] == theirs["tokens"][:n]
        out["max_rel_loss_diff"] = max(diffs) if diffs else None
        out["losses_match"] = bool(diffs) and max(diffs) <= LOSS_TOLERANCE and len(a) == len(b)
        # the same rows at every step, so step i of one run and step i of the other did the same work
        w = ours.get("warmup", 0)
        ratios = sorted(t / o for o, t in zip(ours["seconds"][w:n], theirs["seconds"][w:n]) if o > 0)
        if ratios:
            q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
            out["step_ratio"] = {"median": q(0.5), "q1": q(0.25), "q3": q(0.75)}
    return out


def measure(names: list[str], model_dir: Path, dataset: Path, steps: int, seq_len: int, micro: int, accum: int,
            work: Path, warmup: int, rounds: int = 1) -> dict:
    """Each strategy's pair of launches `rounds` times, round after round (so that a slow drift of the
    shared machine spreads over every strategy), who goes first alternating; the ratio is the median
    over the rounds, since on a 2-core machine one pair can be off by 20% either way."""
    base = common_overrides(model_dir, dataset, steps, seq_len, micro, accum)
    pairs: dict[str, list[dict]] = {name: [] for name in names}
    for k in range(rounds):
        for i, name in enumerate(names):
            overrides = base + STRATEGIES[name]
            tag = name if rounds == 1 else f"{name} round {k + 1}"
            ours, theirs = pair(tag, overrides, work, warmup, ours_first=(i + k) % 2 == 0)
            retried = False
            if rounds == 1 and noise(ours, theirs) > NOISE_LIMIT:  # something else ran: measure once more
                retried = True
                again = pair(name + " again", overrides, work, warmup, ours_first=i % 2 == 1)
                if noise(*again) < noise(ours, theirs):
                    ours, theirs = again
            got = {"ours": ours, "trainer": theirs, "retried": retried, "noise": noise(ours, theirs),
                   **compare(ours, theirs)}
            pairs[name].append(got)
            print(f"  throughput {tag}: finetune {fmt(ours.get('tokens_per_s'))} tok/s, Trainer "
                  f"{fmt(theirs.get('tokens_per_s'))} tok/s" + (f", ratio {got['ratio']:.2f}" if "ratio" in got else "")
                  + ("" if theirs["ok"] else f" (Trainer failed: {theirs['error'][:200]})")
                  + ("" if ours["ok"] else f" (finetune failed: {ours['error'][:200]})"), flush=True)
    rows = [combine(name, pairs[name]) for name in names]
    return {"rows": rows, "steps": steps, "warmup": warmup, "seq_len": seq_len, "micro_batch_size": micro,
            "grad_accum": accum, "rounds": rounds, "overrides": base, "targets": targets(rows)}


def combine(name: str, got: list[dict]) -> dict:
    """One row per strategy: the median ratio over the rounds, shown with the pair nearest to it."""
    measured = [g for g in got if "ratio" in g]
    if not measured:
        return {"strategy": name, **got[0]}
    ratio = statistics.median(g["ratio"] for g in measured)
    shown_pair = min(measured, key=lambda g: abs(g["ratio"] - ratio))
    row = {"strategy": name, **shown_pair, "ratio": ratio}
    if len(got) > 1:
        row["round_ratios"] = [g.get("ratio") for g in got]
        row["round_pairs"] = [{"ours": g["ours"], "trainer": g["trainer"], "noise": g["noise"]} for g in got]
        row["losses_match"] = all(g.get("losses_match", False) for g in got)
        diffs = [g["max_rel_loss_diff"] for g in got if g.get("max_rel_loss_diff") is not None]
        row["max_rel_loss_diff"] = max(diffs) if diffs else None
    return row


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if "ratio" in r:
            met = r["ratio"] >= 1.0 and r.get("losses_match", False)
            spread = r.get("step_ratio")
            within = (not met and r.get("losses_match", False) and spread is not None
                      and spread["q1"] <= 1.0 <= spread["q3"])
            out.append({"setup": r["strategy"], "met": "within noise" if within else met,
                        "measured": r["ratio"], "what": ">= 1.0x the Trainer's tokens/s, matching losses"})
        else:
            out.append({"setup": r["strategy"], "met": None, "measured": None,
                        "what": "no comparison: " + ("the Trainer failed" if not r["trainer"]["ok"]
                                                     else "finetune failed")})
    return out


def render(result: dict) -> str:
    header = ["strategy", "finetune tok/s", "Trainer tok/s", "finetune / Trainer", "per-step ratio q1-q3", "same rows", "loss step 1 (ours / Trainer)",
              f"loss step {result['steps']} (ours / Trainer)", "max rel. loss diff", "other load (cores)"]
    body = []
    for r in result["rows"]:
        o, t = r["ours"], r["trainer"]
        lo, lt = o.get("losses") or [None], t.get("losses") or [None]
        load = (f"{r['noise']:.2f}" if r.get("noise") is not None else "-") + (" (re-run)" if r.get("retried") else "")
        body.append([r["strategy"], fmt(o.get("tokens_per_s")) if o["ok"] else "failed",
                     fmt(t.get("tokens_per_s")) if t["ok"] else "failed (see below)",
                     _ratio_cell(r),
                     f"{r['step_ratio']['q1']:.2f}-{r['step_ratio']['q3']:.2f}" if r.get("step_ratio") else "-",
                     {True: "yes", False: "NO"}.get(r.get("same_tokens"), "-"),
                     f"{fmt(lo[0], 4)} / {fmt(lt[0], 4)}", f"{fmt(lo[-1], 4)} / {fmt(lt[-1], 4)}",
                     f"{r['max_rel_loss_diff']:.1e}" if r.get("max_rel_loss_diff") is not None else "-", load])
    return table(header, body)


def _ratio_cell(r: dict) -> str:
    if "ratio" not in r:
        return "-"
    rounds = [x for x in r.get("round_ratios") or [] if x is not None]
    if len(rounds) < 2:
        return f"{r['ratio']:.2f}x"
    return f"{r['ratio']:.2f}x (median of " + ", ".join(f"{x:.2f}" for x in sorted(rounds)) + ")"
