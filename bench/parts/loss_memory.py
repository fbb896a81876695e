"""What the loss costs with a large vocabulary: peak memory and step time of loss_impl=full (every
logit at once, the loss before finetune/loss.py) against loss_impl=chunked, on CPU.

    python bench/parts/loss_memory.py [--sweep] [--steps 3] [--rounds 5] [--work DIR] [--doc docs/benchmarks.md]

Memory, the setup of the issue's measurement (../shared/reference/real-assets.md, "The loss's memory
with a large vocabulary"): a 2-layer Llama-style model with hidden size 64 and Llama-3's 128,256-token
vocabulary (random weights, untied, built locally), the builtin character tokenizer, text rows longer
than the sequence, micro batch 1, `strategy=ddp mixed_precision=no max_steps=3`, no eval set, one
`python finetune/run.py` process per setting; `peak_memory_gib` of the step-3 record of metrics.jsonl
(the process's peak RSS), at max_seq_len 256 and 2048.

Time: ms per training step of each setting, measured in this one process with the variants taken in
turn (A B C A B C ...) and the median kept, because on a shared 2-core machine the wall time of the
separate runs moved 2x with the other jobs' load.

--sweep adds loss_chunk_tokens 128 ... 2048 at 2048 tokens: the measurement behind finetune/loss.py's
CHUNK_BYTES. --doc writes the result as section 7 of docs/benchmarks.md (bench/run.py keeps it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

from bench.parts.common import (CACHE, PY, ModelSpec, build_model, fresh_dir, git_state, launch_env, machine,  # noqa: E402
                    read_jsonl, run, shown, table, versions)

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
    launch = run(cmd, out.parent / f"{out.name}.log", timeout=1800, env=launch_env())
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    if not launch.ok or len(records) < steps:
        raise SystemExit(f"{shown(cmd)} failed: {launch.error()}")
    step3 = next(r for r in records if r["step"] == min(3, steps))
    return {"impl": impl, "seq_len": seq_len, "chunk": chunk, "peak_gib": step3["peak_memory_gib"][0],
            "losses": [r["loss"] for r in records], "command": shown(cmd)}


def time_steps(model_dir: Path, data: Path, variants: list[tuple[str, int, int]], rounds: int) -> dict:
    """ms per training step (forward with the loss, backward, AdamW step) of each (impl, seq_len,
    chunk) in this one process, one thread, the variants taken in turn (A B C A B C ...) so that a
    machine whose load changes slows them alike; the median over `rounds` after one warm-up round.
    Also the CPU cores that the rest of the machine used meanwhile."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.parts.common import _busy_ticks
    from finetune.model import loss_sum

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    text = json.loads(data.read_text().splitlines()[0])["text"]
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]])
    times: dict = {v: [] for v in variants}
    busy0, cpu0, t0 = _busy_ticks(), time.process_time(), time.perf_counter()
    for round_ in range(rounds + 1):
        for impl, seq_len, chunk in variants:
            x = ids[:, :seq_len]
            batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}
            start = time.perf_counter()
            loss_sum(model, batch, impl, chunk).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_:
                times[(impl, seq_len, chunk)].append(1000 * (time.perf_counter() - start))
    seconds = time.perf_counter() - t0
    import os

    other = (_busy_ticks() - busy0) / os.sysconf("SC_CLK_TCK") / seconds - (time.process_time() - cpu0) / seconds
    return {"ms": {v: statistics.median(t) for v, t in times.items()}, "other_load": max(0.0, other)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per memory run (>= 3)")
    parser.add_argument("--sweep", action="store_true", help="also chunked runs and timings at 2048 tokens per "
                        f"chunk size ({', '.join(map(str, SWEEP))})")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the in-process step timing (0: none)")
    parser.add_argument("--work", default=f"/tmp/bench-loss-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--doc", help="also write the results as section 7 of this file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    model, data = build_model(MODEL), text_rows()
    auto = _auto(MODEL.vocab_size)
    variants = [(impl, seq_len, 0) for seq_len in SEQ_LENS for impl in ("full", "chunked")]
    variants += [("chunked", 2048, chunk) for chunk in SWEEP if args.sweep]
    results = []
    for impl, seq_len, chunk in variants:
        results.append(measure(work, model, data, seq_len, impl, args.steps, chunk))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    timing = time_steps(model, data, variants, args.rounds) if args.rounds else {"ms": {}, "other_load": None}
    print(json.dumps({"timing": {str(k): v for k, v in timing["ms"].items()}, "other_load": timing["other_load"]}))

    def row(r):
        same = next(x for x in results if x["impl"] == "full" and x["seq_len"] == r["seq_len"])
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], same["losses"]))
        chunk = r["chunk"] or ("-" if r["impl"] == "full" else f"0 (auto: {auto})")
        ms = timing["ms"].get((r["impl"], r["seq_len"], r["chunk"]))
        full_ms = timing["ms"].get(("full", r["seq_len"], 0))
        return [r["impl"], chunk, r["seq_len"], f"{r['peak_gib']:.3f}", f"{ms:,.0f}" if ms else "-",
                f"{ms / full_ms:.2f}" if ms and full_ms else "-", f"{diff:.1e}"]

    header = ["loss_impl", "loss_chunk_tokens", "max_seq_len", f"peak GiB (step {min(3, args.steps)})",
              "ms/step", "time / full", f"max rel. loss diff to full ({args.steps} steps)"]
    growth = {}
    for impl in ("full", "chunked"):
        by_len = {r["seq_len"]: r["peak_gib"] for r in results if r["impl"] == impl and not r["chunk"]}
        growth[impl] = by_len[2048] - by_len[256]
    command = "python bench/parts/loss_memory.py" + (f" --steps {args.steps}" if args.steps != 3 else "") + \
        (" --sweep" if args.sweep else "") + (f" --rounds {args.rounds}" if args.rounds != 5 else "") + \
        (f" --doc {args.doc}" if args.doc else "")
    v = versions()
    other = timing["other_load"]
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` at git {git_state()}; "
        f"{machine()['cpu']}, {machine()['cores']} cores, shared with other jobs; torch {v['torch']}, "
        f"transformers {v['transformers']}.",
        "",
        f"Memory: one process, `python finetune/run.py --recipe tiny` with model {MODEL.name} ({MODEL.describe()}, "
        "random weights), text rows longer than max_seq_len (every row full), micro batch 1, strategy=ddp, "
        f"mixed_precision=no, no eval set, max_steps={args.steps}; `peak_memory_gib` of the step-{min(3, args.steps)} "
        "record in metrics.jsonl (the process's peak RSS). The last column compares each run's logged losses with "
        "the full-logits run of the same length.",
        "",
        f"Time: ms per training step (forward with the loss, backward, AdamW step; one thread) of the same model on "
        f"one row of the same data, all variants in one process and taken in turn, median of {args.rounds} rounds "
        f"after a warm-up round (the rest of the machine used {other:.2f} of its cores meanwhile; timings in the "
        "runs themselves moved 2x with that load, so they are not used)." if other is not None else
        "Time: not measured (--rounds 0).",
        "",
        table(header, [row(r) for r in results]),
        "",
        f"Peak at 2048 tokens minus peak at 256 tokens: full {growth['full']:.3f} GiB, chunked {growth['chunked']:.3f} "
        "GiB (issue 12's target: at most 0.5 GiB). The issue's baseline at aa2ca07, before finetune/loss.py: 1.154 and "
        "3.693 GiB (2.539 GiB apart).",
        "",
        f"Each memory run: `{results[0]['command']}` with its own max_seq_len, loss_impl and loss_chunk_tokens (the "
        "script builds the model and rows into bench/.cache/).",
    ])
    print(text)
    if args.doc:
        from bench.parts.report import LOSS_BEGIN, LOSS_END, LOSS_TITLE, write_marked_section

        write_marked_section(Path(args.doc), LOSS_TITLE, LOSS_BEGIN, LOSS_END, text)
    (work / "loss_memory.md").write_text(text + "\n")
    (work / "loss_memory.json").write_text(json.dumps({"runs": results, "timing": [
        {"impl": k[0], "seq_len": k[1], "chunk": k[2], "ms": ms} for k, ms in timing["ms"].items()],
        "timing_other_load": other}, indent=2) + "\n")
    return 0


def _auto(vocab: int) -> int:
    from finetune.loss import chunk_rows

    return chunk_rows(vocab)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
