"""docs/benchmarks.md: the measured tables of one run of bench/run.py, with the machine, the versions
and the command. The GPU section (bench/run.py --gpu) is kept between CPU runs and replaced only by a
GPU run, since the two run on different machines."""

from __future__ import annotations

import re
from pathlib import Path

from bench.parts import checkpoints as C
from bench.parts import memory as M
from bench.parts import packing as P
from bench.parts import padding_free as PF
from bench.parts import throughput as T
from bench.parts.common import fmt, mib, table

GPU_BEGIN, GPU_END = "<!-- gpu-section:begin -->", "<!-- gpu-section:end -->"
GPU_PLACEHOLDER = ("Not yet measured: no CUDA GPU has run `python bench/run.py --gpu` for this report. It trains a "
                   "0.95B Llama-style model (hidden 2048, 16 layers, 32 heads, intermediate 5632, vocab 32000) in "
                   "bf16 on one GPU, `python finetune/run.py` against the Hugging Face Trainer for strategy ddp, "
                   "fsdp and zero3 (one process each), and reports tokens/s, MFU (6 N + 12 L H Q T FLOPs per token "
                   "over the GPU's dense bf16 peak), peak memory and finetune / Trainer per strategy.")


def _gpu_block(doc: Path) -> str:
    if doc.is_file():
        m = re.search(re.escape(GPU_BEGIN) + r"\n(.*?)\n" + re.escape(GPU_END), doc.read_text(), re.S)
        if m:
            return m.group(1)
    return GPU_PLACEHOLDER


def write_gpu_section(doc: Path, section: str) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.is_file() else _skeleton()
    if GPU_BEGIN not in text:
        text = text.rstrip() + "\n\n## 6. One GPU, 1B model, bf16\n\n" + GPU_BEGIN + "\n" + GPU_PLACEHOLDER + "\n" + GPU_END + "\n"
    text = re.sub(re.escape(GPU_BEGIN) + r"\n.*?\n" + re.escape(GPU_END),
                  lambda _: GPU_BEGIN + "\n" + section + "\n" + GPU_END, text, flags=re.S)
    doc.write_text(text)


LOSS_BEGIN, LOSS_END = "<!-- loss-memory:begin -->", "<!-- loss-memory:end -->"
LOSS_TITLE = "## 7. The loss with a large vocabulary"
DATA_BEGIN, DATA_END = "<!-- data-prep:begin -->", "<!-- data-prep:end -->"
FREE_BEGIN, FREE_END = "<!-- padding-free:begin -->", "<!-- padding-free:end -->"
FREE_TITLE = "## 3b. Padding-free batches"
DATA_TITLE = "## 8. Data preparation against TRL"
STEP_BEGIN, STEP_END = "<!-- step-overhead:begin -->", "<!-- step-overhead:end -->"
STEP_TITLE = "## 9. What a step costs beyond the model, against the Trainer"
SAMPLES_BEGIN, SAMPLES_END = "<!-- samples:begin -->", "<!-- samples:end -->"
SAMPLES_TITLE = "## 10. Samples at eval: seconds per sample under ddp, zero3 and fsdp"
SP_BEGIN, SP_END = "<!-- sp-memory:begin -->", "<!-- sp-memory:end -->"
SP_TITLE = "## 11. Sequence parallelism and activations: memory per rank (bench/studies/activation_memory.py)"
DPO_BEGIN, DPO_END = "<!-- dpo-vs-trl:begin -->", "<!-- dpo-vs-trl:end -->"
DPO_TITLE = "## 12. DPO against TRL's DPOTrainer"
GRPO_BEGIN, GRPO_END = "<!-- grpo-vs-trl:begin -->", "<!-- grpo-vs-trl:end -->"
GRPO_TITLE = "## 14. A whole GRPO step against TRL's GRPOTrainer (bench/studies/grpo_vs_trl.py)"
TOOLS_BEGIN, TOOLS_END = "<!-- grpo-tools-vs-trl:begin -->", "<!-- grpo-tools-vs-trl:end -->"
TOOLS_TITLE = "## 17. GRPO with tools against TRL's GRPOTrainer (bench/studies/grpo_tools_vs_trl.py)"
# Sections measured by other benches, kept as they are and in this order by the report:
# bench/parts/loss_memory.py; bench/studies/ data_prep.py, step_overhead.py, samples.py, sp_memory.py, dpo_vs_trl.py,
# grpo_vs_trl.py, grpo_tools_vs_trl.py
KEPT_SECTIONS = [(LOSS_TITLE, LOSS_BEGIN, LOSS_END), (DATA_TITLE, DATA_BEGIN, DATA_END),
                 (STEP_TITLE, STEP_BEGIN, STEP_END), (SAMPLES_TITLE, SAMPLES_BEGIN, SAMPLES_END),
                 (SP_TITLE, SP_BEGIN, SP_END), (DPO_TITLE, DPO_BEGIN, DPO_END),
                 (GRPO_TITLE, GRPO_BEGIN, GRPO_END), (TOOLS_TITLE, TOOLS_BEGIN, TOOLS_END)]


def write_marked_section(doc: Path, title: str, begin: str, end: str, section: str) -> None:
    """Put `section` between its markers in doc (appended under `title` the first time), leaving the
    rest of the file as it is: for parts measured by their own command (bench/parts/loss_memory.py)."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.is_file() else _skeleton()
    if begin not in text:
        text = text.rstrip() + f"\n\n{title}\n\n{begin}\n{end}\n"
    text = re.sub(re.escape(begin) + r"\n.*?" + re.escape(end), lambda _: begin + "\n" + section + "\n" + end, text,
                  flags=re.S)
    doc.write_text(text)


def padding_free_block(results: dict) -> str:
    return PF.section(results["padding_free"], results["command"], results["started"], results["versions"])


def write_padding_free_section(doc: Path, results: dict) -> str:
    """`bench/run.py --only padding_free`: its section alone, the rest of the report as it was (placed
    before section 4 the first time)."""
    section = padding_free_block(results)
    text = doc.read_text() if doc.is_file() else _skeleton()
    if FREE_BEGIN not in text and "\n## 4. " in text:
        at = text.index("\n## 4. ") + 1
        text = text[:at] + f"{FREE_TITLE}\n\n{FREE_BEGIN}\n{FREE_END}\n\n" + text[at:]
        doc.write_text(text)
    write_marked_section(doc, FREE_TITLE, FREE_BEGIN, FREE_END, section)
    return section


def _marked_block(doc: Path, begin: str, end: str) -> str | None:
    if doc.is_file():
        m = re.search(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), doc.read_text(), re.S)
        if m:
            return m.group(1)
    return None


def _skeleton() -> str:
    return ("# Benchmarks\n\nThe CPU sections have not been generated yet: run `python bench/run.py --quick`.\n")


def _verdict(met) -> str:
    return {True: "met", False: "**missed**", None: "not measured",
            "within noise": "**missed**, within the run's noise (per-step ratios straddle 1.0)"}[met]


def _targets(results: dict) -> str:
    rows = []
    for part in ("memory", "throughput", "packing", "checkpoints"):
        for t in (results.get(part) or {}).get("targets", []):
            measured = t["measured"]
            shown = "-" if measured is None else (f"{measured:.3f} x 16P/N" if part == "memory" else f"{measured:.2f}x")
            rows.append([part, t["setup"], t["what"], shown, _verdict(t["met"])])
    return table(["part", "setup", "target", "measured", "verdict"], rows)


def recompute(results: dict) -> None:
    """Derived figures and verdicts again from the raw per-run data (after a change to how they are
    derived); measures nothing."""
    if "memory" in results:
        results["memory"]["targets"] = M.targets(results["memory"]["rows"])
    if "throughput" in results:
        r = results["throughput"]
        for row in r["rows"]:
            row["ours"].setdefault("warmup", r["warmup"])
            row.update(T.compare(row["ours"], row["trainer"]))
            if row.get("round_pairs"):  # several rounds: the row's ratio is their median
                for g in row["round_pairs"]:
                    g["ours"].setdefault("warmup", r["warmup"])
                row.update({k: v for k, v in T.combine(row["strategy"], [
                    {**g, **T.compare(g["ours"], g["trainer"])} for g in row["round_pairs"]]).items()
                    if k not in ("ours", "trainer")})
        r["targets"] = T.targets(r["rows"])


def hung_runs(results: dict) -> list[str]:
    out = []
    for row in (results.get("memory") or {}).get("rows", []):
        if row.get("hung_at_exit"):
            out.append(f"memory probe {row['setup']}")
    for row in (results.get("throughput") or {}).get("rows", []):
        for side in ("ours", "trainer"):
            if row[side].get("hung_at_exit"):
                out.append(f"{'finetune' if side == 'ours' else 'Trainer'} {row['strategy']}")
    p = results.get("packing") or {}
    if (p.get("on") or {}).get("hung_at_exit"):
        out.append("finetune packing=true")
    for name, side in ((results.get("padding_free") or {}).get("runs") or {}).items():
        if side.get("hung_at_exit") and not side.get("reused"):
            out.append(f"finetune {PF.LABELS[name]}")
    for row in (results.get("checkpoints") or {}).get("rows", []):
        for i, hung in enumerate(row.get("hung_at_exit") or []):
            if hung:
                out.append(f"finetune {row['strategy']} {'resume at' if i else 'to'} step {row['step']}")
    return out


def write_cpu_report(doc: Path, results: dict) -> str:
    out = []
    add = out.append
    m, v = results["machine"], results["versions"]
    add("# Benchmarks\n")
    add(f"Measured by `{results['command']}` on {results['started']}, {results['wall_seconds']:.0f} s in all "
        f"({results['mode']} mode). Every number below comes from that run; raw results were written to "
        f"`{results['work']}/results.json`. Re-run it to refresh this file; `python bench/run.py` (no --quick) runs "
        "the ~100M-parameter memory model, a larger training model, more steps and more strategies.\n")
    add(f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory']}, {m['os']}; no GPU. 2 processes "
        "(`accelerate launch --multi_gpu --num_processes 2`, gloo), 1 thread each (OMP_NUM_THREADS=1), fp32.")
    add(f"- versions: Python {m['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items()) +
        f"; finetune at git {results['git']}.")
    add("- CPU timings on a small shared machine are noisy (another job may be running): read ratios between "
        "runs made back to back, not absolute speeds.\n")
    add("## Targets\n")
    add(_targets(results) + "\n")

    if "memory" in results:
        r = results["memory"]
        add("## 1. Model-state memory per rank\n")
        add(f"Model: {r['model']} ({r['model_description']}, {r['parameters']:,} parameters = P), "
            f"{r['world_size']} processes, fp32, micro batch 1 x {r['seq_len']} tokens, 2 accumulation steps. "
            "`bench/helpers/memory_probe.py` builds each setup with finetune's own functions (make_plan, build_accelerator, "
            "load_model, prepare, loss_sum, accelerator.accumulate/backward), trains one optimizer step so that "
            "Adam's states exist, then reads `held_bytes` (bench/helpers/held.py) (tensor storage of parameters, gradients "
            "and optimizer states held by the rank) after the next step's first micro-step (DeepSpeed: Accelerate "
            "steps and frees its gradients at the accumulation boundary) and after its last one (DDP, FSDP: the "
            "reduced gradients), and keeps the larger. Per-rank figures are the larger of the two ranks. "
            "\"Toolkit estimate\" is `finetune.memory.estimate` (the planner of `python -m finetune.plan`); "
            "\"ZeRO formula\" is the paper's fp32 line of ../shared/reference/figures.md "
            "(`finetune.memory.paper_model_states`): ddp 16P, zero1 8P + 8P/N, zero2 4P + 12P/N, zero3 and fsdp "
            "16P/N; offload rows use their strategy's line. Peak RSS is the process's `ru_maxrss`."
            + ("" if r.get("with_offload", True) else " Quick mode leaves out the offload rows (each costs a "
               "DeepSpeed CPU-Adam launch); `python bench/run.py` measures them.") + "\n")
        add(M.render(r) + "\n")
        add(memory_notes(r))
        add("Commands (one per setup): `" + "`, `".join(x["command"] for x in r["rows"][:1]) + "` and the same with "
            + ", ".join(" ".join(x["overrides"]) for x in r["rows"][1:]) + ".\n")

    if "throughput" in results:
        r = results["throughput"]
        add("## 2. Throughput against the Hugging Face Trainer\n")
        add(f"Model: {r['model']} ({r['model_description']}, {r['parameters']:,} parameters). Data: "
            "3,000 generated prompt/completion rows of widely varying length (bench/parts/common.py varlen_dataset), "
            f"max_seq_len {r['seq_len']}, loss on the completions only, padding to the longest row of each micro "
            f"batch; micro batch {r['micro_batch_size']}, {r['grad_accum']} accumulation steps, 2 processes; "
            f"AdamW lr 1e-3, cosine schedule with 2 warm-up steps, clipping at 1.0; {r['steps']} optimizer steps. "
            "The Trainer (`bench/helpers/trainer_baseline.py`) gets the same recipe-derived settings, the same tokenized "
            "rows in the same order on the same ranks, the same padding, and for ZeRO the very DeepSpeed config "
            "finetune builds (`finetune.strategy.deepspeed_config`); for FSDP, FSDP2 wrapping the decoder layers, "
            "reshard after forward, and the same CPU offload setting.\n")
        add(f"tokens/s: target tokens (labels[:, 1:] != -100, all ranks) of steps {r['warmup'] + 1}..{r['steps']} "
            "over their wall time, from the end of one optimizer step to the end of the next (finetune: each "
            "metrics.jsonl record's tokens / tokens_per_s; Trainer: a TrainerCallback's clock at on_step_end and "
            "its own num_items_in_batch). \"same rows\": both counted the same target tokens at every step. Loss "
            "is the mean per target token of each step as each logs it.\n")
        rounds = r.get("rounds", 1)
        if rounds > 1:
            add(f"Each pair of launches ran {rounds} times, round after round, who goes first alternating; "
                "\"finetune / Trainer\" is the median of the rounds' ratios (each listed), and the tokens/s and "
                "losses shown are the round nearest to that median.\n")
        else:
            add("One pair of launches per strategy (quick mode). On this 2-core machine one pair's ratio moves by "
                "up to about 20% from one run to the next, for both toolkits alike; `python bench/run.py` "
                "(full mode) runs every pair 3 times and reports the median with each round's ratio.\n")
        add(T.render(r) + "\n")
        add(throughput_notes(r, results.get("loss_overhead")))
        add(LOSS_FIX_NOTE)
        add("Commands: " + "; ".join(f"`{x['ours']['command']}` against `{x['trainer']['command']}`"
                                     for x in r["rows"][:1]) +
            "; the other rows change only strategy= / offload settings.\n")

    if "packing" in results:
        r = results["packing"]
        add("## 3. Packing\n")
        add(f"finetune/run.py, strategy={r['strategy']}, the data and settings of part 2, packing=false against "
            "packing=true (rows filled to max_seq_len with whole examples, each with its own position ids, from "
            "which the model builds a block-diagonal causal mask). Target tokens never include padding, so this "
            "is real tokens/s.\n")
        add(P.render(r) + "\n")
        add(packing_notes(r))
        add(f"Command: `{r['on']['command']}` (and the same with packing=false).\n")

    free_block = padding_free_block(results) if "padding_free" in results else _marked_block(doc, FREE_BEGIN, FREE_END)
    if free_block is not None:  # measured now, or by an earlier `--only padding_free`, kept as it is
        add(FREE_TITLE + "\n")
        add(FREE_BEGIN + "\n" + free_block + "\n" + FREE_END + "\n")

    if "checkpoints" in results:
        r = results["checkpoints"]
        add("## 4. Checkpoints\n")
        add(f"The tiny recipe (builtin tiny Llama, 2 layers), 2 processes: train N steps (a checkpoint is written at "
            f"the end), then `--resume auto max_steps=N+1` in the same output_dir, for N = {r['early']} and "
            f"N = {r['late']}. \"save s\" is manifest.json's \"seconds\" (every rank's shards written and synced); "
            "\"resume s\" is the resumed run's metrics.jsonl record resume_seconds (model, optimizer, scheduler, "
            "RNG and loop state loaded); the whole-wall column is the resumed launch from process start to exit.\n")
        add(C.render(r) + "\n")
        add(checkpoint_notes(r))
        add("Commands: " + "; ".join(f"`{x['command']}` then `{x.get('resume_command', '')}`" for x in r["rows"][:1])
            + ".\n")

    hung = hung_runs(results)
    if hung:
        add("## Runs that did not exit\n")
        add(f"{len(hung)} launch(es) finished their work (summary written) but a process never exited: "
            + ", ".join(hung) + ". The bench killed them 60 s after their result files appeared; their "
            "measurements stand. This is a finetune bug, not a bench artefact.\n")
        add(HANG_NOTE)
    add("## 5. What the loop logs\n")
    add(loop_log_notes(results))

    add("## 6. One GPU, 1B model, bf16\n")
    add(GPU_BEGIN + "\n" + _gpu_block(doc) + "\n" + GPU_END + "\n")
    for title, begin, end in KEPT_SECTIONS:  # measured by their own scripts (--doc), kept as they are
        block = _marked_block(doc, begin, end)
        if block is not None:
            add(title + "\n")
            add(begin + "\n" + block + "\n" + end + "\n")
    text = "\n".join(out)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


# ---------------------------------------------------------------- notes that depend on what was measured


def memory_notes(r: dict) -> str:
    notes = []
    rows = {x["setup"]: x for x in r["rows"] if x["ok"]}
    per = r["parameters"] / r["world_size"]  # parameters in one rank's partition
    z3 = rows.get("zero3")
    if z3 and z3["vs_paper"] > 1 + M.TOLERANCE:
        extra = z3["held"] - z3["paper"]
        notes.append(
            f"- **zero3 misses the 5% target ({z3['vs_paper']:.3f} x 16P/N) because of DeepSpeed, not finetune.** The "
            f"excess, {mib(extra)} MiB per rank = {extra / per:.2f} bytes per parameter of the partition, is a second "
            "fp32 copy of the parameter partition. In fp32 training ZeRO-3 means to use the partition itself as the "
            "fp32 master (deepspeed/runtime/zero/stage3.py, `_create_fp32_partitions`: \"we don't need another copy "
            "of the weights\"), but its test is `self.fp16_partitioned_groups_flat[i].device == self.device`, and "
            "`self.device` is the string from `get_accelerator().current_device_name()` ('cpu', or 'cuda:0' on a GPU): "
            "a torch.device never equals a str (`torch.device('cpu') == 'cpu'` is False), so it always clones, "
            "20P/N instead of 16P/N. In bf16/fp16 training (every GPU recipe) the fp32 master is needed anyway and "
            "the paper's 16P/N holds. finetune could drop the copy only by patching DeepSpeed; the toolkit's "
            "estimate already counts it (held / estimate = "
            f"{z3['vs_estimate']:.3f}).")
    over = [(name, rows[name]["vs_paper"]) for name in ("zero1", "zero2")
            if name in rows and rows[name]["vs_paper"] > 1 + M.TOLERANCE]
    if over:
        notes.append("- " + " and ".join(f"{name} holds {v:.3f} x" for name, v in over) + " the paper's fp32 line, "
                     "by DeepSpeed's design: ZeRO-1/2 always clone an fp32 master partition "
                     "(deepspeed/runtime/zero/stage_1_and_2.py: \"cloned and detached from the origin params\"), "
                     "4 bytes per parameter / N more than fp32 Adam needs; the paper's line assumes 16-bit training.")
    fs = rows.get("fsdp")
    if fs:
        notes.append(f"- fsdp holds {fs['vs_paper']:.3f} x 16P/N: the fp32 parameter, gradient and two Adam shards, "
                     "nothing else (shards are padded to a multiple of the world size).")
    off = [k for k in rows if "cpu" in k]
    if off:
        notes.append("- Offload rows: on a CPU-only machine \"offloaded\" states stay in the same memory, so the held "
                     "bytes are what the rank holds wherever they live. DeepSpeed's CPU-Adam path keeps an fp32 "
                     "master, an fp32 gradient partition for CPU Adam and (ZeRO-3) its gradient buffer, which is why "
                     "the zero3 offload rows are above zero3 and the toolkit estimate counts them; FSDP with "
                     "params->cpu holds exactly what fsdp holds.")
    if rows:
        worst = max(rows.values(), key=lambda x: abs(x["vs_estimate"] - 1))
        notes.append(f"- The toolkit's planner (`python -m finetune.plan`) matched every measured row within "
                     f"{abs(worst['vs_estimate'] - 1):.1%} (largest difference: {worst['setup']}).")
        notes.append("- Peak RSS is far above the model states: every rank but FSDP's and ZeRO-3's loads the full "
                     "fp32 model before wrapping it, DDP keeps gradient buckets, and the process itself (torch, "
                     "DeepSpeed, transformers, gloo) takes several hundred MiB.")
    return "\n".join(notes) + ("\n" if notes else "")


def throughput_notes(r: dict, loss: dict | None) -> str:
    notes = []
    for x in r["rows"]:
        t = x["trainer"]
        if not t["ok"]:
            notes.append(f"- {x['strategy']}: the Trainer did not run on this CPU machine: `{t.get('error')}` "
                         f"(log: {t['output_dir']}.log).")
        if not x["ours"]["ok"]:
            notes.append(f"- {x['strategy']}: finetune failed: `{x['ours'].get('error')}`.")
        if x.get("ratio") is not None and x["ratio"] < 1.0:
            spread = x.get("step_ratio") or {}
            why = [f"- {x['strategy']}: finetune at {x['ratio']:.2f}x the Trainer"]
            if spread:
                why.append(f"; step by step (the same rows) the Trainer/finetune time ratio has its middle half "
                           f"between {spread['q1']:.2f} and {spread['q3']:.2f}")
            if (x.get("noise") or 0) > T.NOISE_LIMIT:
                why.append(f"; other processes used {x['noise']:.2f} cores on average during this pair, so the "
                           "machine was shared")
            notes.append("".join(why) + ".")
        if x.get("same_tokens") is False:
            notes.append(f"- {x['strategy']}: the two runs did not count the same target tokens per step.")
        if x.get("losses_match") is False and x["ours"]["ok"] and t["ok"]:
            notes.append(f"- {x['strategy']}: losses differ by up to {x['max_rel_loss_diff']:.1e} (relative), above "
                         f"the {T.LOSS_TOLERANCE:.0e} allowed for reduction order.")
    return "\n".join(notes) + ("\n" if notes else "")


LOSS_FIX_NOTE = (
    "An earlier run of this benchmark found a cost in finetune that the Trainer does not pay: `loss_sum` sliced "
    "`logits[:, :-1]` before the cross-entropy, which copies the batch x length x vocab logits (and fills a second "
    "full-size gradient in backward). It now shifts the labels instead, as transformers' ForCausalLMLoss does, the "
    "same sum. `python bench/studies/loss_overhead.py 15` times the old way against finetune's loss_sum on the quick "
    "training model (batch 4 x 256, vocab 8192, one thread, alternately, median of 15; the last run: 794 ms against 719 ms, 1.10x, identical losses).\n")


HANG_NOTE = (
    "- An earlier run of this benchmark caught such launches and read the cause with py-spy: the DDP model's "
    "Reducer held the last reference to the process group; freeing it as train() returned destroyed the gloo "
    "process group with the GIL held and waited for a gloo worker, which waited for the GIL to free a finished "
    "all-gather's Python-made tensors. finetune now keeps the accelerator, model and optimizer referenced until "
    "the process ends (finetune.training.loop.KEEP_UNTIL_EXIT), ends train() with a barrier, and leaves through "
    "os._exit once its files are flushed (finetune/run.py), so no destructor runs. A launch listed here means "
    "that did not suffice.\n")


def packing_notes(r: dict) -> str:
    ratio = r.get("ratio")
    if ratio is None:
        return ""
    on, off = r["on"], r["off"]
    return (f"- With packing each step carries {on['mean_tokens_per_step'] / off['mean_tokens_per_step']:.2f}x the "
            f"target tokens in {on['mean_seconds_per_step'] / off['mean_seconds_per_step']:.2f}x the time: padded "
            "micro-batches spend compute on padding up to their longest row; packed rows are nearly full "
            "(finetune.data.plan_packing: best-fit decreasing, longest examples first, each into the fullest row it "
            "fits) but every row is max_seq_len long, so a packed step costs more per row.\n")


def checkpoint_notes(r: dict) -> str:
    notes = []
    for t in r["targets"]:
        if t["measured"] is not None:
            notes.append(f"- {t['setup']}: resume at step {r['late']} took {t['measured']:.2f}x the time of the "
                         f"resume at step {r['early']}: the data position is computed, not replayed "
                         "(finetune.data.BatchSchedule), so nothing grows with the step count; checkpoint size "
                         "is the same at both steps.")
    return "\n".join(notes) + ("\n" if notes else "")


def loop_log_notes(results: dict) -> str:
    rows = []
    for x in (results.get("throughput") or {}).get("rows", []):
        o = x["ours"]
        if o.get("ok"):
            fields = o.get("loop_fields") or {}
            rows.append([x["strategy"], fmt(o["summary"].get("tokens_per_s")),
                         ", ".join(f"{k}={v}" for k, v in fields.items()) or "(none)",
                         "yes" if any("mfu" in k for k in fields) else "no (no known peak FLOP/s for a CPU)"])
    if not rows:
        return "No finetune runs in this benchmark run.\n"
    return ("Every finetune run writes metrics.jsonl (one record per step with step, loss, lr, grad_norm, tokens, "
            "tokens_per_s, and whatever else the loop adds) and summary.json. From the throughput runs above "
            "(summary tokens/s covers every step including the first, slower ones; evaluation and checkpoint time "
            "are left out of it and reported on their own as eval_seconds and checkpoint_seconds):\n\n"
            + table(["strategy", "summary.json tokens/s", "extra fields in the last metrics.jsonl record", "MFU logged"],
                    rows) + "\n")
