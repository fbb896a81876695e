"""Part 3: packing on against off, in real target tokens per second (labels != -100: padding and
prompts never count), on a dataset of variable-length examples (common.varlen_dataset), through
finetune/run.py with 2 processes. The run with packing off can be the throughput part's run of the
same strategy and settings (it is then not run twice)."""

from __future__ import annotations

from pathlib import Path

from bench.parts.common import fmt, table, wait_quiet
from bench.parts.throughput import QUIET_WAIT, run_ours

TARGET = 1.3


def measure(overrides: list[str], work: Path, warmup: int, off: dict | None = None, strategy: str = "ddp") -> dict:
    base = [o for o in overrides if not o.startswith("packing=")] + [f"strategy={strategy}"]
    if off is None:
        off = run_ours(f"packing-off-{strategy}", base + ["packing=false"], work, warmup)
        off["reused"] = False
    wait_quiet(QUIET_WAIT)
    on = run_ours(f"packing-on-{strategy}", base + ["packing=true"], work, warmup)
    result = {"strategy": strategy, "off": off, "on": on}
    if off.get("tokens_per_s") and on.get("tokens_per_s"):
        result["ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    for side in (off, on):
        if side.get("ok"):
            steps = len(side["tokens"])
            side["mean_seconds_per_step"] = sum(side["seconds"][warmup:]) / max(1, steps - warmup)
            side["mean_tokens_per_step"] = sum(side["tokens"][warmup:]) / max(1, steps - warmup)
    ratio = result.get("ratio")
    result["targets"] = [{"setup": f"packing ({strategy})", "met": None if ratio is None else ratio >= TARGET,
                          "measured": ratio, "what": f">= {TARGET}x target tokens/s with packing"}]
    print(f"  packing ({strategy}): off {fmt(off.get('tokens_per_s'))} tok/s, on {fmt(on.get('tokens_per_s'))} tok/s"
          + (f", {ratio:.2f}x" if ratio else ""), flush=True)
    return result


def render(result: dict) -> str:
    rows = []
    for name in ("off", "on"):
        side = result[name]
        rows.append([f"packing={'true' if name == 'on' else 'false'}",
                     fmt(side.get("tokens_per_s")) if side.get("ok") else f"failed: {side.get('error')}",
                     fmt(side.get("mean_tokens_per_step")), fmt(side.get("mean_seconds_per_step"), 2),
                     "reused from the throughput table" if side.get("reused", False) else "this part"])
    ratio = result.get("ratio")
    rows.append(["on / off", f"{ratio:.2f}x" if ratio else "-", "", "", ""])
    return table(["run", "target tokens/s", "target tokens per step", "s per step", "run"], rows)
