"""Part 6 (`bench/run.py --gpu`): a 1B-class Llama-style model in bf16 on one GPU through
finetune/run.py (strategy=ddp, one process, `python finetune/run.py ...`): tokens/s, MFU, peak memory.

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

from common import CACHE, MODELS, PY, build_model, fmt, fresh_dir, read_jsonl, run, shown, table
from throughput import ours_steps, steady

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


def measure(work: Path, smoke: bool = False) -> dict:
    """smoke=True: the same pipeline on CPU with a small model in fp32, to check it without a GPU."""
    import torch

    if not smoke and not torch.cuda.is_available():
        return {"ok": False, "error": "no CUDA GPU on this machine"}
    spec = MODELS["llama-7m" if smoke else "llama-1b"]
    seq, micro, steps, warmup = (128, 2, 6, 2) if smoke else (2048, 4, 40, 10)
    model_dir = build_model(spec, device="cpu" if smoke else "cuda")
    data = long_text_dataset(rows=64 if smoke else 600, min_chars=seq + 64)
    out = fresh_dir(work / ("gpu-smoke" if smoke else "gpu"))
    overrides = [f"model={model_dir}", f"dataset={data}", "dataset_format=text", f"max_seq_len={seq}",
                 "packing=false", "strategy=ddp", f"mixed_precision={'no' if smoke else 'bf16'}",
                 f"micro_batch_size={micro}", "grad_accum=1", f"max_steps={steps}", "log_every=1",
                 "eval_fraction=0", "eval_at_start=false", "save_every=0", "warmup_steps=2", "lr=1e-4",
                 "activation_checkpointing=false", "attn_implementation=sdpa", f"output_dir={out}"]
    cmd = [PY, "finetune/run.py", "--recipe", "tiny", *overrides]
    launch = run(cmd, work / ("gpu-smoke.log" if smoke else "gpu.log"), timeout=1800, done=(out / "summary.json").exists)
    from common import versions

    res = {"ok": launch.ok, "command": shown(cmd), "versions": versions(), "seconds": round(launch.seconds, 1), "model": spec.describe(),
           "parameters": spec.num_parameters(), "seq_len": seq, "micro_batch_size": micro, "steps": steps,
           "warmup": warmup, "hung_at_exit": launch.hung_at_exit}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res["gpu"] = props.name
        res["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        res["torch_cuda"] = torch.version.cuda
    if not launch.ok:
        res["error"] = launch.error(6)
        return res
    steps_data = ours_steps(out)
    target_tps = steady(steps_data["tokens"], steps_data["seconds"], warmup)
    tokens_tps = target_tps * seq / (seq - 1) if target_tps else None
    a = spec.architecture()
    flops_per_token = 6 * spec.num_parameters() + 12 * a.num_hidden_layers * a.num_attention_heads * a.head_size * seq
    peak, peak_name = peak_flops(res.get("gpu", ""))
    res.update(target_tokens_per_s=target_tps, tokens_per_s=tokens_tps, flops_per_token=flops_per_token,
               achieved_tflops=tokens_tps * flops_per_token / 1e12 if tokens_tps else None,
               peak_flops=peak, peak_name=peak_name,
               mfu=tokens_tps * flops_per_token / peak if tokens_tps and peak else None,
               losses=[steps_data["losses"][0], steps_data["losses"][-1]], loop_fields=steps_data["loop_fields"],
               peak_memory=steps_data["summary"].get("peak_memory_per_rank"),
               peak_memory_kind=steps_data["summary"].get("peak_memory_kind"),
               loop_records=[r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r][-2:],
               summary_tokens_per_s=steps_data["summary"].get("tokens_per_s"),
               summary_train_seconds=steps_data["summary"].get("train_seconds"),
               summary_eval_seconds=steps_data["summary"].get("eval_seconds"),
               summary_checkpoint_seconds=steps_data["summary"].get("checkpoint_seconds"),
               checkpoint_seconds=_manifest_seconds(out))
    return res


def _manifest_seconds(out: Path):
    manifests = sorted((out / "checkpoints").glob("step_*/manifest.json"))
    return json.loads(manifests[-1].read_text()).get("seconds") if manifests else None


def render(res: dict, command: str, when: str, versions: dict) -> str:
    if not res.get("ok"):
        return f"Not measured: {res.get('error', 'unknown error')} (`{command}`, {when})."
    peak = res.get("peak_memory") or [None]
    rows = [
        ["GPU", f"{res.get('gpu', '?')} ({res.get('gpu_memory_gib', '?')} GiB), CUDA {res.get('torch_cuda', '?')}"],
        ["model", f"{res['model']}: {res['parameters']:,} parameters, bf16 autocast over fp32 master weights"],
        ["batch", f"{res['micro_batch_size']} rows x {res['seq_len']} tokens, no padding; {res['steps']} steps, "
                  f"the first {res['warmup']} left out"],
        ["tokens/s", f"{fmt(res['tokens_per_s'])} ({fmt(res['target_tokens_per_s'])} target tokens/s)"],
        ["FLOPs per token", f"{res['flops_per_token'] / 1e9:.2f} G (6 N + 12 L H Q T)"],
        ["achieved", f"{fmt(res['achieved_tflops'], 1)} TFLOP/s"],
        ["MFU", (f"{res['mfu']:.1%} of {res['peak_name']} dense bf16 {res['peak_flops'] / 1e12:.0f} TFLOP/s"
                 if res.get("mfu") is not None else "peak of this GPU not known")],
        ["peak memory", f"{peak[0] / 2**30:.2f} GiB ({res.get('peak_memory_kind')}, torch.cuda.max_memory_allocated)"
         if peak[0] else "-"],
        ["loss", f"{res['losses'][0]:.4f} at step 1 -> {res['losses'][-1]:.4f} at step {res['steps']}"],
        ["loop's last record", ", ".join(f"{k}={v}" for k, v in (res.get("loop_fields") or {}).items()) or "-"],
        ["summary.json", f"tokens_per_s {fmt(res.get('summary_tokens_per_s'))} (every step, the first ones "
                         f"included) over train_seconds {fmt(res.get('summary_train_seconds'), 1)}, of which eval "
                         f"{fmt(res.get('summary_eval_seconds'), 1)} s and checkpoints "
                         f"{fmt(res.get('summary_checkpoint_seconds'), 1)} s are left out of tokens/s"],
        ["versions", ", ".join(f"{k} {v}" for k, v in (res.get("versions") or versions).items())],
    ]
    return table(["", f"measured {when}"], rows) + f"\n\nCommand: `{command}`; training launched as `{res['command']}`."


def render_profile(text: str, command: str, when: str) -> str:
    """The phase table and the largest GPU-time entries of `bench/gpu_profile.py`'s output."""
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
