"""Seconds per sample at eval (finetune/training/samples.py) under ddp, zero3 and fsdp, 2 CPU processes, the tiny
model: `python bench/studies/samples.py [--prompts 8] [--tokens 32]`.

Each launch trains two steps of the tiny recipe with eval_at_start, so the step-0 samples come from the
untrained model, which rarely stops early: every prompt generates about --tokens tokens under every
strategy (the same greedy tokens); the end's samples, after two steps at lr 3e-3, stop after a token
or two. The launched script is bench/helpers/samples_gathers.py: it counts the gathers of each eval's samples,
which stay the same whether an eval generated many tokens or few. Reported per strategy: the eval's whole sample time (weights
gathered once, then every prompt) from the progress line, per sample, per generated token, and the
part that is the gather (the whole time less the generate calls' own, from samples.jsonl).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from bench.parts.common import REPO, accelerate_launch, launch_env  # noqa: E402

STRATEGIES = ("ddp", "zero3", "fsdp")
LINE = re.compile(r"step 0: sample \((\d+) in ([0-9.]+)s")
GATHERS = re.compile(r"\[rank0\] samples: \d+ prompts, (\d+) tokens, (\d+) gather calls")


def measure(strategy: str, prompts: int, tokens: int, work: Path) -> dict:
    out = work / strategy
    cmd = accelerate_launch(str(REPO / "bench" / "helpers" / "samples_gathers.py"), [
        "--recipe", "tiny", f"strategy={strategy}", "max_steps=2", "warmup_steps=0", "eval_at_start=true",
        "eval_every=0", "lr=3e-3",
        f"sample_prompts={prompts}", f"sample_max_new_tokens={tokens}", "eval_max_samples=32", "plot_loss=false",
        f"output_dir={out}"])
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
    n, total = LINE.search(proc.stderr).groups()
    first = [s for s in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if s["step"] == 0]
    generated = sum(s["tokens"] for s in first)
    generating = sum(s["seconds"] for s in first)
    counts = [tuple(map(int, m)) for m in GATHERS.findall(proc.stderr)]  # per eval: (tokens, gather calls)
    return {"strategy": strategy, "gathers": counts, "samples": int(n), "tokens": generated, "seconds": float(total),
            "per_sample": float(total) / int(n), "per_token_ms": 1000 * generating / generated,
            "gather": max(0.0, float(total) - generating), "answers": [s["generated"] for s in first]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/studies/samples.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-samples-") as tmp:
        for strategy in STRATEGIES:
            rows.append(measure(strategy, args.prompts, args.tokens, Path(tmp)))
            print(f"  {strategy}: {rows[-1]['per_sample']:.3f} s per sample", file=sys.stderr, flush=True)
    same = all(r["answers"] == rows[0]["answers"] for r in rows)
    print("| strategy | samples | tokens | seconds | s per sample | ms per token | gather s | vs ddp | "
          "gather calls per eval (tokens) |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['samples']} | {r['tokens']} | {r['seconds']:.2f} | {r['per_sample']:.3f} | "
              f"{r['per_token_ms']:.2f} | {r['gather']:.2f} | {r['per_sample'] / rows[0]['per_sample']:.2f}x | "
              + ", ".join(f"{g} ({t})" for t, g in r["gathers"]) + " |")
    print(f"\nthe same answers under every strategy: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
