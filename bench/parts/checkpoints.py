"""Part 4: checkpoint save time and size, and resume time, at two step counts far apart.

For each step count N: finetune/run.py trains the tiny recipe for N steps (it checkpoints at the end),
then `finetune/run.py ... --resume auto max_steps=N+1` continues it in the same output_dir. The
first run's final/ is moved aside first: a run refuses an output_dir that holds a finished model.
Read back: the checkpoint's manifest.json ("seconds": the save, every rank's shards on disk, as
rank 0 measured it; "files": every file and its size) and the resumed run's metrics.jsonl record
{"resume_seconds": ...} (loading model, optimizer, scheduler, RNG and loop state), plus the resumed
launch's whole wall time (process start to exit: imports, model load, resume, one step, final save).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.parts.common import accelerate_launch, fmt, fresh_dir, read_jsonl, run, shown, table

GROWTH_LIMIT = 1.5  # "does not grow with the step count": resume at the late step within 1.5x the early one
COMMON = ["eval_fraction=0", "eval_at_start=false", "save_every=0", "log_every=50", "mixed_precision=no",
          "warmup_steps=2"]


def _manifest(out: Path, step: int) -> dict:
    path = out / "checkpoints" / f"step_{step:09d}" / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def one(strategy: str, steps: int, work: Path) -> dict:
    out = fresh_dir(work / f"ckpt-{strategy}-{steps}")
    overrides = ["--recipe", "tiny", f"strategy={strategy}", *COMMON, f"output_dir={out}"]
    first_cmd = accelerate_launch("finetune/run.py", overrides + [f"max_steps={steps}"])
    first = run(first_cmd, work / f"ckpt-{strategy}-{steps}.log", done=(out / "summary.json").exists)
    res = {"strategy": strategy, "step": steps, "command": shown(first_cmd), "train_ok": first.ok,
           "train_seconds": round(first.seconds, 1), "hung_at_exit": [first.hung_at_exit]}
    if not first.ok:
        res["error"] = first.error()
        return res
    m = _manifest(out, steps)
    res["save_seconds"] = m.get("seconds")
    res["size_bytes"] = sum(m.get("files", {}).values())
    res["files"] = len(m.get("files", {}))
    shutil.move(str(out / "final"), str(out / "final.first"))
    resume_cmd = accelerate_launch("finetune/run.py", ["--resume", "auto", *overrides, f"max_steps={steps + 1}"])
    (out / "summary.json").unlink()  # the resumed run writes its own
    resumed = run(resume_cmd, work / f"ckpt-{strategy}-{steps}-resume.log", done=(out / "summary.json").exists)
    res["hung_at_exit"].append(resumed.hung_at_exit)
    res["resume_command"] = shown(resume_cmd)
    res["resume_ok"] = resumed.ok
    res["resume_launch_seconds"] = round(resumed.seconds, 1)
    if not resumed.ok:
        res["error"] = resumed.error()
        return res
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "resume_seconds" in r]
    res["resume_seconds"] = records[-1]["resume_seconds"] if records else None
    res["resumed_at"] = records[-1]["step"] if records else None
    summary = json.loads((out / "summary.json").read_text())
    res["resume_run_wall_seconds"] = summary.get("wall_seconds")
    m2 = _manifest(out, steps + 1)
    res["save_seconds_after_resume"] = m2.get("seconds")
    return res


def measure(strategies: list[str], early: int, late: int, work: Path) -> dict:
    rows = []
    for strategy in strategies:
        for steps in (early, late):
            r = one(strategy, steps, work)
            rows.append(r)
            print(f"  checkpoint {strategy} step {steps}: save {fmt(r.get('save_seconds'), 2)}s, "
                  f"{fmt((r.get('size_bytes') or 0) / 2**20, 1)} MiB, resume {fmt(r.get('resume_seconds'), 2)}s"
                  + (f" FAILED: {r['error']}" if r.get("error") else ""), flush=True)
    return {"rows": rows, "early": early, "late": late, "targets": targets(rows, early, late)}


def targets(rows: list[dict], early: int, late: int) -> list[dict]:
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        by = {r["step"]: r for r in rows if r["strategy"] == strategy}
        a, b = by.get(early, {}).get("resume_seconds"), by.get(late, {}).get("resume_seconds")
        ratio = b / a if a and b else None
        out.append({"setup": f"resume ({strategy})", "met": None if ratio is None else ratio <= GROWTH_LIMIT,
                    "measured": ratio,
                    "what": f"resume time at step {late} / at step {early} <= {GROWTH_LIMIT} (does not grow)"})
    return out


def render(result: dict) -> str:
    header = ["strategy", "checkpoint at step", "save s", "size MiB", "files", "resume s (load)",
              "resumed launch, whole wall s", "train launch wall s"]
    body = []
    for r in result["rows"]:
        if r.get("error"):
            body.append([r["strategy"], r["step"], "failed", "", "", "", "", r["error"]])
            continue
        body.append([r["strategy"], r["step"], fmt(r.get("save_seconds"), 3), fmt(r["size_bytes"] / 2**20, 2),
                     r["files"], fmt(r.get("resume_seconds"), 3), fmt(r.get("resume_launch_seconds"), 1),
                     fmt(r.get("train_seconds"), 1)])
    return table(header, body)
