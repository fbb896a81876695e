"""Part 3b: padding-free batches (padding_free=true: each micro-batch one row of its examples, no pad
token, position ids restarting per example) against today's packing, in real target tokens per second,
on the variable-length data and settings of parts 2 and 3, through finetune/run.py with 2 processes:

  packing=true                      (part 3's run: rows of max_seq_len, tail-padded; reused if measured)
  packing=true  padding_free=true   (the same packed rows, their tail padding dropped, one row per micro-batch)
  packing=false padding_free=true   (the micro-batch's examples as they come, one row)

On CPU attention is sdpa: a padding-free row is attended under one block-diagonal mask over the whole
row (masking_utils), so its attention costs micro_batch_size times a padded row's; flash_attention_2
(GPU) attends per example (varlen) instead, which this CPU part cannot measure.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.parts.common import fmt, table, wait_quiet
from bench.parts.throughput import NOISE_LIMIT, QUIET_WAIT, run_ours

RUNS = {  # name -> overrides
    "packed": ["packing=true", "padding_free=false"],
    "packed_free": ["packing=true", "padding_free=true"],
    "free": ["packing=false", "padding_free=true"],
}
LABELS = {"packed": "packing=true (today)", "packed_free": "packing=true padding_free=true",
          "free": "packing=false padding_free=true", "off": "packing=false (padded)"}


def _per_step(side: dict, warmup: int) -> None:
    if side.get("ok"):
        steps = len(side["tokens"])
        side["mean_seconds_per_step"] = sum(side["seconds"][warmup:]) / max(1, steps - warmup)
        side["mean_tokens_per_step"] = sum(side["tokens"][warmup:]) / max(1, steps - warmup)


def measure(overrides: list[str], work: Path, warmup: int, packed: dict | None = None, off: dict | None = None,
            strategy: str = "ddp", model_dir: Path | None = None, dataset: Path | None = None, seq_len: int = 256,
            micro: int = 4) -> dict:
    """packed: part 3's packing=true run of these settings (not run again); off: the padded packing=false
    run (parts 2/3), shown for reference only."""
    base = [o for o in overrides if not o.startswith(("packing=", "padding_free="))] + [f"strategy={strategy}"]
    load = os.getloadavg()
    result = {"strategy": strategy, "load_before": [round(x, 2) for x in load], "runs": {}}
    for name, extra in RUNS.items():
        if name == "packed" and packed is not None and packed.get("ok"):
            side = dict(packed, reused=True)
        else:
            wait_quiet(QUIET_WAIT)
            side = run_ours(f"padding-free-{name}-{strategy}", base + extra, work, warmup)
            side["reused"] = False
        _per_step(side, warmup)
        result["runs"][name] = side
        print(f"  {LABELS[name]} ({strategy}): {fmt(side.get('tokens_per_s'))} tok/s", flush=True)
    if off is not None and off.get("ok"):
        result["runs"]["off"] = dict(off, reused=True)
        _per_step(result["runs"]["off"], warmup)
    if model_dir is not None and dataset is not None:
        wait_quiet(QUIET_WAIT)
        result["alternating"] = alternating(model_dir, dataset, seq_len, micro)
        print("  one process, alternating: " + ", ".join(
            f"{k} {v * 1000:.0f} ms" for k, v in result["alternating"]["median_seconds"].items()), flush=True)
    today = result["runs"]["packed"].get("tokens_per_s")
    result["ratios"] = {name: side["tokens_per_s"] / today for name, side in result["runs"].items()
                        if today and side.get("tokens_per_s")}
    return result


def alternating(model_dir: Path, dataset: Path, seq_len: int, micro: int, reps: int = 7) -> dict:
    """One forward and backward (finetune's loss_sum) of the same micro-batches in each layout, in this
    process on one thread, the layouts alternating, median of reps (the first left out): the compute of a
    micro-batch with less exposure to other jobs than whole launches. Same rows for packing=true with
    and without padding_free, and for packing=false padded and padding-free."""
    import json
    import statistics
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune import data as D
    from finetune.model import loss_sum
    from finetune.recipe import Recipe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        with open(dataset) as f:  # in memory: nothing written to a datasets cache
            raw = Dataset.from_list([json.loads(line) for _, line in zip(range(40 * micro * reps), f)])
        packed = D.tokenize_dataset(raw, "prompt_completion", tok, Recipe(max_seq_len=seq_len, packing=True), "bench")
        rows = D.tokenize_dataset(raw, "prompt_completion", tok, Recipe(max_seq_len=seq_len), "bench")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        layouts = {"packed": (packed, True, False), "packed_free": (packed, True, True),
                   "off": (rows, False, False), "free": (rows, False, True)}
        seconds = {k: [] for k in layouts}
        shapes = {}
        for rep in range(reps):
            picks = list(range(rep * micro, (rep + 1) * micro))
            for name, (ds, is_packed, free) in layouts.items():
                batch = D.fetch(ds, picks, pad, is_packed, free)
                shapes.setdefault(name, list(batch["input_ids"].shape))
                t0 = time.perf_counter()
                loss_sum(model, batch).backward()
                seconds[name].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
        return {"reps": reps, "micro": micro, "shapes": shapes,
                "median_seconds": {k: statistics.median(v[1:]) for k, v in seconds.items()}}
    finally:
        torch.set_num_threads(threads)


def render_alternating(a: dict) -> str:
    rows = []
    for name in ("off", "free", "packed", "packed_free"):
        shape = a["shapes"][name]
        base = "off" if name in ("off", "free") else "packed"
        rows.append([LABELS[name], f"{shape[0]} x {shape[1]}", f"{a['median_seconds'][name] * 1000:.0f}",
                     f"{a['median_seconds'][name] / a['median_seconds'][base]:.2f}x"])
    return table(["layout", "first micro-batch (rows x tokens)", "forward + backward ms (median)",
                  "vs the same rows padded"], rows)


def render(result: dict) -> str:
    rows = []
    for name in ("off", "packed", "packed_free", "free"):
        side = result["runs"].get(name)
        if side is None:
            continue
        ratio = result["ratios"].get(name)
        rows.append([LABELS[name], fmt(side.get("tokens_per_s")) if side.get("ok") else f"failed: {side.get('error')}",
                     f"{ratio:.2f}x" if ratio else "-", fmt(side.get("mean_tokens_per_step")),
                     fmt(side.get("mean_seconds_per_step"), 2),
                     "-" if side.get("other_load") is None else f"{side['other_load']:.2f}",
                     "reused" if side.get("reused") else "this part"])
    return table(["run", "target tokens/s", "vs packing=true", "target tokens per step", "s per step",
                  "other load (cores)", "run"], rows)


def notes(result: dict) -> str:
    runs, out = result["runs"], []
    packed, packed_free, free = runs.get("packed", {}), runs.get("packed_free", {}), runs.get("free", {})
    if packed.get("ok") and packed_free.get("ok"):
        out.append(f"- packing=true padding_free=true trains the very rows of packing=true (target tokens per step "
                   f"{fmt(packed.get('mean_tokens_per_step'))} and {fmt(packed_free.get('mean_tokens_per_step'))}) in "
                   f"{packed_free['mean_seconds_per_step'] / packed['mean_seconds_per_step']:.2f}x the time per step. "
                   "The two differ in the packed rows' tail padding (dropped; packed rows are nearly full) and in "
                   "attention: one mask over the whole micro-batch's row instead of one per packed row.")
    if free.get("ok") and packed.get("ok"):
        out.append(f"- packing=false padding_free=true carries {free['mean_tokens_per_step'] / packed['mean_tokens_per_step']:.2f}x "
                   "packing=true's target tokens per step (a micro-batch of raw examples holds fewer tokens than one "
                   f"of packed rows) in {free['mean_seconds_per_step'] / packed['mean_seconds_per_step']:.2f}x the time.")
    loads = [s.get("other_load") for s in runs.values() if not s.get("reused") and s.get("other_load") is not None]
    if loads and max(loads) > NOISE_LIMIT:
        out.append(f"- Other processes used {min(loads):.2f} to {max(loads):.2f} of the 2 cores during these launches "
                   f"(more than the {NOISE_LIMIT} the throughput part tolerates): the launches' tokens/s ratios are "
                   "not reliable; the one-process alternating timings below are the steadier comparison.")
    return "\n".join(out) + "\n"


ATTENTION_NOTE = ("With sdpa/eager (this CPU part) the model builds a block-diagonal mask over the concatenated row "
                  "and the attention kernel computes the whole row's scores, masked: micro_batch_size times a padded "
                  "row's attention. With flash_attention_2 on a GPU the row is attended per example (varlen, "
                  "transformers' _is_packed_sequence on a batch of one row), which is where padding_free is meant to "
                  "pay; this part does not measure that.")


def section(result: dict, command: str, started: str, versions: dict) -> str:
    """The whole section, for docs/benchmarks.md (between its markers)."""
    load = result.get("load_before")
    first = next((s for s in result["runs"].values() if not s.get("reused") and s.get("command")), {})
    return "\n".join([
        f"Measured by `{command}` on {started}; load average (1, 5, 15 min) before it: "
        f"{', '.join(map(str, load)) if load else '-'} on 2 cores shared with other jobs (\"other load\": "
        "CPU cores other processes used during each run, on average). finetune/run.py, "
        f"strategy={result['strategy']}, the data and settings of parts 2 and 3 (variable-length prompt/completion "
        "rows, max_seq_len 256, micro batch 4, 2 accumulation steps, 2 processes, fp32, sdpa); each run's target "
        "tokens/s over the steps after the warm-up. versions: "
        + ", ".join(f"{k} {x}" for k, x in versions.items()) + ".\n",
        render(result) + "\n",
        notes(result),
        *([f"One process, one thread, {result['alternating']['reps']} micro-batches of {result['alternating']['micro']} "
           "rows in each layout, the layouts alternating, median forward + backward time (the first left out), "
           "`bench/parts/padding_free.py` alternating():\n", render_alternating(result["alternating"]) + "\n"]
          if result.get("alternating") else []),
        ATTENTION_NOTE + "\n",
        f"Command: `{first.get('command', '')}` (and the same with the other packing= / padding_free= values).",
    ])
