"""GRPO on 2 CPU processes with finetune's generator against the vLLM engine (generation_backend=vllm), under
zero3 and fsdp: rollout seconds and whole-step seconds on a ~100M-parameter Llama (random weights, head size
64 so that vLLM's CPU attention serves it; builtin:tiny-prompts' tokenizer), every completion generated to
max_completion_len (random weights rarely stop). Each (strategy, backend) is one real launch of
recipes/tiny_grpo_vllm.py with overrides; the figures are medians over the steps after the first (the
first rollout warms up both generators).

Run in the vLLM venv (bash scripts/test_vllm.sh builds it):
    .venv-vllm/bin/python bench/studies/vllm_grpo_steps.py --work runs/vllm-bench [--new-tokens 128] [--steps 4]
Prints a markdown table (docs/vllm.md has the figures measured here)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=128, hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
             rms_norm_eps=1e-5)


PORTS = {("zero3", "finetune"): 0, ("zero3", "vllm"): 1, ("fsdp", "finetune"): 2, ("fsdp", "vllm"): 3}


def model_dir(work: Path) -> Path:
    """The benchmark's model, saved once with save_pretrained beside the builtin tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.assets import build_tokenizer

    out = work / "model-100m"
    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    config = LlamaConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         **MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return out


def launch(work: Path, model: Path, strategy: str, backend: str, args) -> dict:
    out = work / f"{strategy}-{backend}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(29800 + PORTS[strategy, backend]), "finetune/run.py", "--recipe", "tiny_grpo_vllm",
           f"model={model}", f"strategy={strategy}", f"generation_backend={backend}", f"max_steps={args.steps}",
           f"global_batch_size={args.prompts}", f"num_generations={args.generations}",
           f"micro_batch_size={args.prompts * args.generations // 2}", f"max_completion_len={args.new_tokens}",
           f"max_seq_len={args.new_tokens + 64}", "eval_every=0", "eval_fraction=0", "save_every=0",
           "log_every=1", "plot_loss=false", f"output_dir={out}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    metrics = out / "metrics.jsonl"
    done = metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= args.steps
    start = time.perf_counter()
    if not done:  # a finished launch of an earlier call is read, not repeated
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{strategy}/{backend} failed:\n{proc.stderr[-4000:]}")
    wall = time.perf_counter() - start
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    # a record's tokens count from the run's start; tokens_per_s is the step's (its rollout included)
    seconds = [(r["tokens"] - (p["tokens"] if p else 0)) / r["tokens_per_s"] for p, r in zip([None] + recs, recs)]
    recs, seconds = recs[1:], seconds[1:]  # the first step warms up
    return {"rollout": statistics.median(r["rollout_seconds"] for r in recs),
            "step": statistics.median(seconds),
            "length": statistics.mean(r["completions/mean_length"] for r in recs),
            "push": statistics.median(r.get("vllm/push_seconds", 0.0) for r in recs),
            "logp_diff": max(r.get("vllm/logp_diff/max", 0.0) for r in recs), "wall": wall}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "vllm-bench")
    parser.add_argument("--strategies", default="zero3,fsdp")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.work)
    rows = []
    for strategy in args.strategies.split(","):
        for backend in ("finetune", "vllm"):
            m = launch(args.work, model, strategy, backend, args)
            rows.append((strategy, backend, m))
            print(strategy, backend, m, flush=True)
    print(f"\n{args.prompts} prompts x {args.generations} completions of {args.new_tokens} tokens a step, 2 processes; "
          f"medians of steps 2-{args.steps}\n")
    print("| strategy | generator | rollout s | step s | mean completion tokens | generated tokens/s | push s | "
          "max logp diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for strategy, backend, m in rows:
        rate = args.prompts * args.generations * m["length"] / m["rollout"]
        print(f"| {strategy} | {backend} | {m['rollout']:.1f} | {m['step']:.1f} | {m['length']:.0f} | {rate:.0f} | "
              f"{m['push']:.2f} | {m['logp_diff']:.1e} |")


if __name__ == "__main__":
    main()
