"""Part 6 (`bench/run.py --gpu`): a 1B-class Llama-style model in bf16 on one GPU, finetune/run.py
against the Hugging Face Trainer (bench/helpers/trainer_baseline.py) for strategy ddp, fsdp (FSDP2) and
zero3: tokens/s, MFU, peak memory and the losses at the first and last step, one row per (toolkit,
strategy, variant), with finetune's ratio to the Trainer of the same strategy.

Every run is one process, `python finetune/run.py ...` or `python bench/helpers/trainer_baseline.py OUT ...`,
which forms a 1-process group for every strategy (finetune.strategy.ensure_process_env), so fsdp and
zero3 run on the one GPU through the same code as on many. Both get the same model, rows in the same
order, batch, AdamW hyper-parameters, schedule, DeepSpeed config or FSDP2 mixed-precision policy
(bench/helpers/trainer_baseline.py says what is shared and what differs). Variants, each with the Trainer's
counterpart alongside: loss_impl=liger under ddp (the Trainer with the same Liger kernel) when
liger_kernel is importable, else a row that says so; compile=true under ddp and fsdp (the Trainer with
torch_compile=True: its own whole-model compile against finetune's per-layer one) when
finetune/recipe.py has the field, else a row that says so. A run that fails is a row with its error;
the others still run.

Disk: a finetune run of the 1B model leaves ~15 GB (the end-of-run checkpoint and final/), and the 64
GiB disk of a lent machine filled at the 8th row. Each run's output directory is emptied once its row
is read (prune_outputs), keeping only the small files the row was read from (metrics.jsonl,
summary.json, trainer_summary.json, recipe.json); the log stays beside it.
Peak memory is torch.cuda.max_memory_allocated of the one process over its whole life: finetune's as
its summary.json reports it (taken after its final save), the Trainer's after train() (it saves
nothing here).

Budget: 30 steps per run, the first 10 left out (as summary.json's tokens_per_s_steady leaves them
out of a 30-step run). Timed on an H200 (../shared/reference/gpu.md): 9 rows took 257 s in all, a
finetune row 35-46 s (16-18 s of it the end-of-run checkpoint and final model), a Trainer row
15-26 s; the 12 rows with the compile pairs, about 6-7 minutes (estimated). `--deadline SECONDS`
bounds the whole run: a row does not start with under ROW_MIN_S left (it is "not run", and `--reuse`
runs it later) and a running launch is stopped at the deadline. Run it again with `--reuse` and the
same `--work` if it was cut off: the finished rows are kept. `--gpu-smoke` runs the same matrix on
CPU with llama-7m in fp32, 128 tokens x 2 rows, 5 steps (2 left out): it checks the pipeline, it
measures nothing worth reading.

Data: "text" rows longer than max_seq_len, so every row is max_seq_len tokens with no padding and
every token but the first is a target (the plain causal mask; no packing mask). MFU uses the
PaLM / nanoGPT / torchtitan count of ../shared/reference/figures.md: training FLOPs per token
6 N + 12 L H Q T, over the GPU's dense bf16 peak (H100 SXM 989e12, A100 312e12, H200 989e12 as an
H100-class part); tokens are the rows' tokens (target tokens x T / (T - 1)).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import shutil
import time

from bench.parts.common import CACHE, MODELS, PY, build_model, fmt, fresh_dir, run, shown, table
from bench.parts.throughput import ours_steps, steady

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (figures.md; H200 = H100 chip)


def long_text_dataset(rows: int, min_chars: int, seed: int = 11) -> Path:
    path = CACHE / "data" / f"longtext-{rows}-{min_chars}-{seed}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w") as f:
        for _ in range(rows):
            text = []
            while sum(len(w) + 1 for w in text) < min_chars:
                text.append(rng.choice(words))
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    tmp.rename(path)
    return path


def peak_flops(name: str) -> tuple[float | None, str]:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value, key
    return None, ""


STRATEGIES = ("ddp", "fsdp", "zero3")
KEEP = ("metrics.jsonl", "summary.json", "trainer_summary.json", "recipe.json")  # what a row is read from
ROW_MIN_S = 60  # with less than this left before --deadline, a row is not started (a row takes 15-46 s on an H200)
GPU_RUN = {"model": "llama-1b", "seq_len": 2048, "micro": 4, "steps": 30, "warmup": 10, "precision": "bf16",
           "rows": 600, "timeout": 600}
SMOKE_RUN = {"model": "llama-7m", "seq_len": 128, "micro": 2, "steps": 5, "warmup": 2, "precision": "no",
             "rows": 64, "timeout": 300}
TOOLKITS = {"finetune": "finetune", "trainer": "Trainer"}


def liger_problem(cuda: bool) -> str | None:
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # noqa: BLE001  (missing, or its triton does not import)
        return "liger_kernel not installed"
    return None if cuda else "liger needs CUDA"


def compile_problem() -> str | None:
    import dataclasses

    from finetune.recipe import Recipe

    if "compile" in {f.name for f in dataclasses.fields(Recipe)}:
        return None
    return "no compile field in finetune/recipe.py on this commit"


def cases(cuda: bool) -> list[dict]:
    """The matrix, in launch order: finetune and the Trainer for each (strategy, variant), who goes
    first alternating; the eager defaults of ddp and fsdp, then their compile=true pairs, then zero3 and
    liger, so that a run cut short by --deadline has the compiled comparison before the rest."""
    liger, compiled = liger_problem(cuda), compile_problem()
    pairs = [("ddp", "default", [], None), ("fsdp", "default", [], None),
             ("ddp", "compile=true", ["compile=true"], compiled), ("fsdp", "compile=true", ["compile=true"], compiled),
             ("zero3", "default", [], None), ("ddp", "loss_impl=liger", ["loss_impl=liger"], liger)]
    out = []
    for i, (strategy, variant, overrides, skip) in enumerate(pairs):
        pair = [("finetune", strategy, variant, overrides, skip), ("trainer", strategy, variant, overrides, skip)]
        out += pair if i % 2 == 0 else pair[::-1]
    return [{"toolkit": t, "strategy": s, "variant": v, "overrides": o, "skip": k} for t, s, v, o, k in out]


def base_overrides(model_dir: Path, data: Path, cfg: dict) -> list[str]:
    return [f"model={model_dir}", f"dataset={data}", "dataset_format=text", f"max_seq_len={cfg['seq_len']}",
            "packing=false", f"mixed_precision={cfg['precision']}", f"micro_batch_size={cfg['micro']}",
            "grad_accum=1", f"max_steps={cfg['steps']}", "log_every=1", "eval_fraction=0", "eval_at_start=false",
            "save_every=0", "warmup_steps=2", "lr=1e-4", "activation_checkpointing=false",
            "attn_implementation=sdpa", "plot_loss=false"]


def prune_outputs(out: Path, keep: tuple[str, ...] = KEEP) -> int:
    """Empties a run's output directory but for the files named in `keep` at its top level (the
    checkpoints, final/ and anything else go); returns the bytes removed. A missing directory is 0."""
    freed = 0
    if not out.is_dir():
        return 0
    for entry in out.iterdir():
        if entry.name in keep and entry.is_file() and not entry.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            freed += sum(f.lstat().st_size for f in entry.rglob("*") if f.is_file() or f.is_symlink())
            shutil.rmtree(entry)
        else:
            freed += entry.lstat().st_size
            entry.unlink()
    return freed


def time_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (a time.monotonic() value), None without one."""
    return None if deadline is None else deadline - time.monotonic()


def next_step(case: dict, earlier: dict | None, left: float | None, timeout: float) -> tuple[str, object]:
    """What to do with a case of the matrix: ("skip", why) for a case that cannot run here or would
    start with under ROW_MIN_S left before the deadline; ("reuse", row) for a row an earlier run in
    the same --work finished (`earlier`, given with --reuse); else ("run", the launch's timeout: the
    case's, or what is left before the deadline if less)."""
    if case["skip"]:
        return "skip", case["skip"]
    if earlier and earlier.get("ok"):
        return "reuse", dict(earlier, reused=True)
    if left is not None and left < ROW_MIN_S:
        return "skip", f"--deadline: {max(left, 0):.0f} s left, under {ROW_MIN_S} s; --reuse runs it"
    return "run", timeout if left is None else min(timeout, left)


def measure(work: Path, smoke: bool = False, reuse: bool = False, deadline: float | None = None) -> dict:
    """smoke=True: the same pipeline on CPU with a small model in fp32, to check it without a GPU.
    reuse=True (`bench/run.py --gpu --reuse --work DIR`): rows that an earlier, interrupted run in the
    same DIR finished are read back, not run again (each row is saved as it ends).
    deadline (a time.monotonic() value, `--deadline`): no row starts with under ROW_MIN_S left, and a
    running launch is stopped there."""
    import torch

    from bench.parts.common import launch_env, versions

    cuda = torch.cuda.is_available()
    if not smoke and not cuda:
        return {"ok": False, "error": "no CUDA GPU on this machine"}
    cfg = dict(SMOKE_RUN if smoke else GPU_RUN)
    spec = MODELS[cfg["model"]]
    seq = cfg["seq_len"]
    model_dir = build_model(spec, device="cuda" if cuda and not smoke else "cpu")
    data = long_text_dataset(rows=cfg["rows"], min_chars=seq + 64)
    work = work / ("gpu-smoke" if smoke else "gpu")
    work.mkdir(parents=True, exist_ok=True)
    base = base_overrides(model_dir, data, cfg)
    env = launch_env(DS_ACCELERATOR="cuda" if cuda and not smoke else "cpu")
    a = spec.architecture()
    flops_per_token = 6 * spec.num_parameters() + 12 * a.num_hidden_layers * a.num_attention_heads * a.head_size * seq
    res = {"ok": False, "smoke": smoke, "versions": versions(), "model": spec.describe(), "model_name": spec.name,
           "parameters": spec.num_parameters(), "seq_len": seq, "micro_batch_size": cfg["micro"],
           "steps": cfg["steps"], "warmup": cfg["warmup"], "precision": cfg["precision"],
           "flops_per_token": flops_per_token, "base_overrides": base, "rows": []}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        res["gpu"] = props.name
        res["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        res["torch_cuda"] = torch.version.cuda
    peak, peak_name = peak_flops(res.get("gpu", "")) if not smoke else (None, "")
    res["peak_flops"], res["peak_name"] = peak, peak_name
    for case in cases(cuda and not smoke):
        row = {k: case[k] for k in ("toolkit", "strategy", "variant")}
        saved = work / (case_name(case) + ".row.json")
        earlier = json.loads(saved.read_text()) if reuse and saved.is_file() else None
        action, what = next_step(case, earlier, time_left(deadline), cfg["timeout"])
        if action == "skip":
            row.update(ok=None, skipped=what)
        elif action == "reuse":
            row = what
        else:  # what: the launch's timeout
            try:
                row.update(run_case(case, base, work, env, dict(cfg, timeout=what), flops_per_token, peak))
            except Exception as e:  # noqa: BLE001  (a row that cannot be read back is a failed row)
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            finally:
                row["outputs_removed_bytes"] = prune_outputs(work / case_name(case))
            saved.write_text(json.dumps(row, indent=2) + "\n")
        res["rows"].append(row)
        print(f"  {row['toolkit']} {row['strategy']} {row['variant']}: " + (
            f"not run ({row['skipped']})" if row.get("skipped") else
            f"{fmt(row.get('tokens_per_s'))} tok/s" + (f", MFU {row['mfu']:.1%}" if row.get("mfu") else "")
            if row.get("ok") else f"failed: {str(row.get('error'))[:300]}"), flush=True)
    res["ok"] = any(r.get("ok") for r in res["rows"])
    res["not_run_deadline"] = sum(1 for r in res["rows"] if str(r.get("skipped", "")).startswith("--deadline"))
    res["failed"] = sum(1 for r in res["rows"] if r.get("ok") is False)
    if not res["ok"]:
        res["error"] = "every run failed; see the rows"
    return res


def run_case(case: dict, base: list[str], work: Path, env: dict, cfg: dict, flops_per_token: int,
             peak: float | None) -> dict:
    name = case_name(case)
    out = fresh_dir(work / name)
    overrides = [*base, f"strategy={case['strategy']}", *case["overrides"], f"output_dir={out}"]
    if case["toolkit"] == "finetune":
        cmd = [PY, "finetune/run.py", "--recipe", "tiny", *overrides]
        done = out / "summary.json"
    else:
        cmd = [PY, "bench/helpers/trainer_baseline.py", str(out), "--recipe", "tiny", *overrides]
        done = out / "trainer_summary.json"
    launch = run(cmd, work / f"{name}.log", timeout=cfg["timeout"], env=env, done=done.exists)
    row = {"command": shown(cmd), "ok": launch.ok and done.exists(), "seconds": round(launch.seconds, 1),
           "hung_at_exit": launch.hung_at_exit, "log": str(work / f"{name}.log")}
    if not row["ok"]:
        row["error"] = launch.error(6) or f"exit code {launch.returncode}"
        return row
    if case["toolkit"] == "finetune":
        got = ours_steps(out)
        tokens, seconds, losses = got["tokens"], got["seconds"], got["losses"]
        peaks = got["summary"].get("peak_memory_per_rank") or [None]
        row.update(peak_memory=peaks[0], peak_memory_kind=got["summary"].get("peak_memory_kind"),
                   loop_fields=got["loop_fields"],
                   summary_tokens_per_s=got["summary"].get("tokens_per_s"),
                   summary_tokens_per_s_steady=got["summary"].get("tokens_per_s_steady"),
                   summary_steady_steps=got["summary"].get("steady_steps"))
    else:
        s = json.loads(done.read_text())
        tokens, seconds, losses = s["tokens"], s["step_seconds"], s["losses"]
        row.update(peak_memory=s.get("peak_memory"), peak_memory_kind=s.get("peak_memory_kind"),
                   engine=s.get("engine"), optim=s.get("optim"), autocast=s.get("autocast"), compiled=s.get("compiled"),
                   fsdp_mixed_precision_policy=s.get("fsdp_mixed_precision_policy"))
    seq = cfg["seq_len"]
    target_tps = steady(tokens, seconds, cfg["warmup"])
    tokens_tps = target_tps * seq / (seq - 1) if target_tps else None
    row.update(steps_run=len(losses), target_tokens_per_s=target_tps, tokens_per_s=tokens_tps,
               achieved_tflops=tokens_tps * flops_per_token / 1e12 if tokens_tps else None,
               mfu=tokens_tps * flops_per_token / peak if tokens_tps and peak else None,
               losses=[losses[0], losses[-1]] if losses else None)
    if tokens_tps is None:
        row.update(ok=False, error=f"no steady-state steps to time ({len(losses)} steps logged)")
    return row


def case_name(case: dict) -> str:
    return "-".join(slug(x) for x in (case["toolkit"], case["strategy"], case["variant"]))


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def reference(res: dict, row: dict) -> tuple[dict | None, str]:
    """The Trainer row finetune's row is compared with: the same strategy and variant, else (that row
    failed or was not run) the same strategy's default, named so in the table."""
    trainer = [r for r in res["rows"] if r["toolkit"] == "trainer" and r["strategy"] == row["strategy"] and r.get("ok")]
    same = next((r for r in trainer if r["variant"] == row["variant"]), None)
    if same:
        return same, ""
    default = next((r for r in trainer if r["variant"] == "default"), None)
    return default, (" (Trainer default)" if default and row["variant"] != "default" else "")


def ratio_value(res: dict, row: dict) -> tuple[float | None, str]:
    """finetune's tokens/s over its reference Trainer row's, and a note naming that row if it is not
    the same variant; None where either did not run."""
    if row["toolkit"] != "finetune" or not row.get("ok"):
        return None, ""
    ref, note = reference(res, row)
    if not ref or not ref.get("tokens_per_s") or not row.get("tokens_per_s"):
        return None, ""
    return row["tokens_per_s"] / ref["tokens_per_s"], note


def ratio(res: dict, row: dict) -> str:
    value, note = ratio_value(res, row)
    return "-" if value is None else f"{value:.2f}x{note}"


def _memory(row: dict) -> str:
    b = row.get("peak_memory")
    return f"{b / 2**30:.2f}" if b else "-"


def _losses(row: dict) -> str:
    losses = row.get("losses")
    if not losses:
        return "-"
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}"


def render(res: dict, command: str, when: str, versions: dict) -> str:
    if not res.get("rows"):
        return f"Not measured: {res.get('error', 'unknown error')} (`{command}`, {when})."
    smoke = res.get("smoke")
    header = ["toolkit", "strategy", "variant", "tokens/s", "MFU", "finetune / Trainer", "peak memory (GiB)",
              f"loss step 1 -> {res['steps']}", "launch (s)", "note"]
    body = []
    for r in res["rows"]:
        who = TOOLKITS.get(r["toolkit"], r["toolkit"])
        if r.get("skipped"):
            body.append([who, r["strategy"], r["variant"], "not run", "-", "-", "-", "-", "-", r["skipped"]])
            continue
        if not r.get("ok"):
            err = " ".join(str(r.get("error", "unknown error")).split()).replace("|", "/")
            body.append([who, r["strategy"], r["variant"], "failed", "-", "-", "-", "-",
                         fmt(r.get("seconds"), 1), f"error: {err[:300]}"])
            continue
        note = "reference" if r["toolkit"] == "trainer" else ""
        if r.get("reused"):
            note = (note + "; " if note else "") + "from the interrupted run (--reuse)"
        if r.get("hung_at_exit"):
            note = (note + "; " if note else "") + "did not exit after its work (killed)"
        body.append([who, r["strategy"], r["variant"], fmt(r.get("tokens_per_s")),
                     f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-", ratio(res, r), _memory(r),
                     _losses(r), fmt(r.get("seconds"), 1), note])
    kinds = sorted({r.get("peak_memory_kind") for r in res["rows"] if r.get("peak_memory_kind")})
    where = (f"{res.get('gpu', '?')} ({res.get('gpu_memory_gib', '?')} GiB), CUDA {res.get('torch_cuda', '?')}"
             if res.get("gpu") else "CPU (smoke: no GPU)")
    precision = ("bf16 (ddp: autocast over fp32 weights; fsdp: FSDP2 bf16 parameters, fp32 reduction and "
                 "masters; zero3: DeepSpeed bf16)" if res.get("precision") == "bf16" else "fp32")
    peak = (f"{res['peak_name']} dense bf16 {res['peak_flops'] / 1e12:.0f} TFLOP/s" if res.get("peak_flops")
            else "peak of this device not known: no MFU")
    lines = [
        ("Smoke run (`--gpu-smoke`): the --gpu pipeline on CPU with a small model in fp32; its numbers check "
         "the pipeline and say nothing about speed.\n\n" if smoke else "")
        + f"Measured {when} on {where}. Model: {res['model']}, {res['parameters']:,} parameters, random weights; "
        f"{precision}. Batch: {res['micro_batch_size']} rows x {res['seq_len']} tokens, no padding (generated text "
        f"longer than a row), grad_accum 1; {res['steps']} steps per run, tokens/s over the steps after the first "
        f"{res['warmup']}. One process per run: a 1-process group for every strategy. MFU: "
        f"{res['flops_per_token'] / 1e9:.2f} GFLOPs per token (6 N + 12 L H Q T) x tokens/s over {peak}. "
        f"finetune / Trainer: tokens/s against the Trainer's row of the same strategy and variant (else its "
        f"default). Peak memory: {', '.join(kinds) or '-'} (rank 0).",
        "",
        table(header, body),
    ]
    ran = [f"{r['strategy']}{'' if r['variant'] == 'default' else ' ' + r['variant']}: {r.get('engine')}, "
           f"{r.get('optim')}, autocast {'on' if r.get('autocast') else 'off'}"
           + (f", {r['fsdp_mixed_precision_policy']}" if r.get("fsdp_mixed_precision_policy") else "")
           + (", compiled (torch_compile=True)" if r.get("compiled") else "")
           for r in res["rows"] if r["toolkit"] == "trainer" and r.get("ok") and r.get("engine")]
    if ran:
        lines += ["", "The Trainer as its Accelerator took it: " + "; ".join(ran) + "."]
    verdict = targets(res)
    if verdict:
        lines += ["", "Targets: " + "; ".join(verdict) + "."]
    base = " ".join(res.get("base_overrides") or [])
    lines += ["", f"Command: `{command}`. Runs launched as `python finetune/run.py --recipe tiny {base} "
              f"strategy=S [variant] output_dir=...` and `python bench/helpers/trainer_baseline.py OUT --recipe tiny "
              f"{base} strategy=S [variant] output_dir=OUT`.",
              "", "Versions: " + ", ".join(f"{k} {v}" for k, v in (res.get("versions") or versions).items()) + "."]
    return "\n".join(lines)


def targets(res: dict) -> list[str]:
    """The issue's targets: MFU >= 40% for the 1B model on one H100, and ahead of the Trainer."""
    out = []
    ours = [r for r in res["rows"] if r["toolkit"] == "finetune" and r.get("ok")]
    best = max((r for r in ours if r.get("mfu") is not None), key=lambda r: r["mfu"], default=None)
    if best:
        out.append(f"MFU >= 40%: {'met' if best['mfu'] >= 0.40 else 'not met'} (best finetune row "
                   f"{best['mfu']:.1%}, {best['strategy']} {best['variant']})")
    for strategy in STRATEGIES:
        row = next((r for r in ours if r["strategy"] == strategy and r["variant"] == "default"), None)
        value = ratio_value(res, row)[0] if row else None
        if value is None:
            out.append(f"ahead of the Trainer, {strategy}: not compared")
        else:
            out.append(f"ahead of the Trainer, {strategy}: {'met' if value > 1.0 else 'not met'} ({value:.3f}x)")
    return out


def render_profile(text: str, command: str, when: str) -> str:
    """The phase table and the largest GPU-time entries of `bench/gpu/gpu_profile.py`'s output."""
    lines = text.splitlines()
    phases = [ln.split() for ln in lines if ln.split() and ln.split()[0] in
              ("fetch", "forward+loss", "backward", "clip", "optimizer", "step")]
    rows = [[p[0], p[1], p[2] if len(p) > 2 and p[2].endswith("%") else ""] for p in phases]
    total = next((ln for ln in lines if ln.startswith("Self CUDA time total")), "")
    ops = []
    for ln in lines:
        cells = [c for c in ln.split("  ") if c.strip()]
        if len(cells) == 11 and cells[0].strip().startswith(("aten::", "Optimizer.step")) and cells[7].strip() != "0.00%":
            ops.append([cells[0].strip(), cells[6].strip(), cells[7].strip(), cells[10].strip()])
    out = [f"Where a step goes: `{command}` ({when}; CUDA events around each phase over 8 steps after 3 warm-up "
           "steps, then torch.profiler over 2 steps):", "", table(["phase", "ms per step", "share"], rows)]
    if ops:
        out += ["", f"Largest self GPU times over the 2 profiled steps ({total.strip()}):", "",
                table(["op", "self CUDA", "share of GPU time", "calls"], ops[:8])]
    return "\n".join(out)
