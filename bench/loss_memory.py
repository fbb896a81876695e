"""What the loss costs with a large vocabulary: peak memory and step time of loss_impl=full (every
logit at once, the loss before finetune/loss.py) against loss_impl=chunked, on CPU, one process.

    python bench/loss_memory.py [--steps 8] [--sweep] [--work DIR]

The setup of the issue's measurement (../shared/reference/real-assets.md, "The loss's memory with a
large vocabulary"): a 2-layer Llama-style model with hidden size 64 and Llama-3's 128,256-token
vocabulary (random weights, untied, built locally), the builtin character tokenizer, text rows longer
than the sequence, micro batch 1, `strategy=ddp mixed_precision=no`, no eval set; `finetune/run.py`
as a user runs it. Memory: `peak_memory_gib` of the step-3 record of metrics.jsonl (the process's
peak RSS by then, which is what a `max_steps=3` run reports). Time: the median over steps 2..N of each
step's wall time (its record's tokens over tokens_per_s, log_every=1), ms/step. --sweep adds chunked
runs at 2048 tokens with loss_chunk_tokens 128 ... 2048, the measurement behind finetune/loss.py's
CHUNK_BYTES. Prints a markdown table (and writes it with the raw numbers to --work).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (CACHE, PY, ModelSpec, build_model, fresh_dir, git_state, launch_env, machine,  # noqa: E402
                    read_jsonl, run, shown, table, versions, wait_quiet)

MODEL = ModelSpec("llama-2l-h64-v128k", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=176, vocab_size=128256)
SEQ_LENS = (256, 2048)
SWEEP = (128, 256, 512, 1024, 2048)


def text_rows(n: int = 64, chars: int = 3000, seed: int = 3) -> Path:
    """Rows of `chars` characters (the character tokenizer makes them that many tokens), so that every
    row fills max_seq_len."""
    path = CACHE / "data" / f"text-{n}-{chars}-{seed}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n):
            text = ""
            while len(text) < chars:
                text += rng.choice(words) + " "
            f.write(json.dumps({"text": text}) + "\n")
    return path


def measure(work: Path, model: Path, data: Path, seq_len: int, impl: str, steps: int, chunk: int = 0) -> dict:
    out = fresh_dir(work / f"{impl}-{seq_len}-{chunk}")
    cmd = [PY, "finetune/run.py", "--recipe", "tiny", f"model={model}", f"dataset={data}", "dataset_format=text",
           "eval_fraction=0", "eval_at_start=false", "strategy=ddp", "mixed_precision=no", f"max_steps={steps}",
           "micro_batch_size=1", "grad_accum=1", f"max_seq_len={seq_len}", "warmup_steps=0", "log_every=1",
           f"loss_impl={impl}", f"loss_chunk_tokens={chunk}", f"output_dir={out}"]
    wait_quiet()
    launch = run(cmd, out.parent / f"{out.name}.log", timeout=1800, env=launch_env())
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    if not launch.ok or len(records) < steps:
        raise SystemExit(f"{shown(cmd)} failed: {launch.error()}")
    step3 = next(r for r in records if r["step"] == min(3, steps))
    times = [(b["tokens"] - a["tokens"]) / b["tokens_per_s"] for a, b in zip(records, records[1:])]
    return {"impl": impl, "seq_len": seq_len, "chunk": chunk, "peak_gib": step3["peak_memory_gib"][0],
            "ms_per_step": 1000 * statistics.median(times), "losses": [r["loss"] for r in records],
            "other_load": launch.other_load, "command": shown(cmd)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (>= 3)")
    parser.add_argument("--sweep", action="store_true", help="also chunked runs at 2048 tokens per chunk size")
    parser.add_argument("--work", default=f"/tmp/bench-loss-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--doc", help="also write the results as section 7 of this file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    model, data = build_model(MODEL), text_rows()
    results = []
    for seq_len in SEQ_LENS:
        for impl in ("full", "chunked"):
            results.append(measure(work, model, data, seq_len, impl, args.steps))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    if args.sweep:
        for chunk in SWEEP:
            results.append(measure(work, model, data, 2048, "chunked", args.steps, chunk))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)

    def row(r):
        same = next(x for x in results if x["impl"] == "full" and x["seq_len"] == r["seq_len"])
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], same["losses"]))
        chunk = r["chunk"] or ("-" if r["impl"] == "full" else f"auto ({_auto(MODEL.vocab_size)})")
        return [r["impl"], chunk, r["seq_len"], f"{r['peak_gib']:.3f}", f"{r['ms_per_step']:,.0f}",
                f"{diff:.1e}", f"{r['other_load']:.2f}" if r["other_load"] is not None else "-"]

    header = ["loss_impl", "loss_chunk_tokens", "max_seq_len", "peak GiB (step 3)", "ms/step (median)",
              "max rel. loss diff to full", "other load (cores)"]
    growth = {}
    for impl in ("full", "chunked"):
        by_len = {r["seq_len"]: r["peak_gib"] for r in results if r["impl"] == impl and not r["chunk"]}
        growth[impl] = by_len[2048] - by_len[256]
    command = "python bench/loss_memory.py" + (f" --steps {args.steps}" if args.steps != 8 else "") + \
        (" --sweep" if args.sweep else "")
    v = versions()
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` at git {git_state()}; "
        f"{machine()['cpu']}, {machine()['cores']} cores, shared; torch {v['torch']}, transformers {v['transformers']}.",
        "",
        f"One process, `python finetune/run.py --recipe tiny` with model {MODEL.name} ({MODEL.describe()}, random "
        f"weights), text rows longer than max_seq_len (every row full), micro batch 1, strategy=ddp, "
        f"mixed_precision=no, no eval set, {args.steps} steps. Peak: `peak_memory_gib` of the step-3 record in "
        "metrics.jsonl (process peak RSS, what a max_steps=3 run reports). ms/step: median over steps 2..N of each "
        "step's wall time (log_every=1). The loss columns compare each run's logged losses with the full-logits run "
        "of the same length.",
        "",
        table(header, [row(r) for r in results]),
        "",
        f"Peak at 2048 tokens minus peak at 256 tokens: full {growth['full']:.3f} GiB, chunked {growth['chunked']:.3f} "
        "GiB (target: at most 0.5 GiB). The issue's baseline at aa2ca07, before finetune/loss.py: 1.154 and 3.693 GiB "
        "(2.539 GiB apart).",
        "",
        f"Each run: `{results[0]['command']}` with its own max_seq_len, loss_impl and loss_chunk_tokens (the model "
        "and rows are built by the script into bench/.cache/).",
    ])
    print(text)
    if args.doc:
        from report import LOSS_BEGIN, LOSS_END, LOSS_TITLE, write_marked_section

        write_marked_section(Path(args.doc), LOSS_TITLE, LOSS_BEGIN, LOSS_END, text)
    (work / "loss_memory.md").write_text(text + "\n")
    (work / "loss_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _auto(vocab: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from finetune.loss import chunk_rows

    return chunk_rows(vocab)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
