"""The vLLM backend (finetune/vllm_engine.py) against transformers' generate, in one process on CPU: the
seconds of a push (every weight of the model) and completion tokens per second of a GRPO-shaped
rollout (prompts x generations, sampled, no stop), with finetune.generation.generate where that module
exists. Run in the vLLM venv (bash scripts/test_vllm.sh builds it):
    .venv-vllm/bin/python bench/studies/vllm_generation.py [--size small|medium] [--rounds 3]
Prints one table; docs/vllm.md has the figures measured here."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from finetune.vllm_engine import Sampling, VLLMEngine

SIZES = {  # head_dim 64: vLLM's CPU attention refuses 16
    "small": dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2),
    "medium": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, **SIZES[args.size])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = [p for p in base for _ in range(args.generations)]
    seeds = list(range(len(prompts)))
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        start = time.perf_counter()
        engine = VLLMEngine(tmp, dtype="float32", max_model_len=args.prompt_len + args.new_tokens, seed=0)
        build = time.perf_counter() - start
    rows = {"vllm": [], "hf generate": []}
    ours = None
    if importlib.util.find_spec("finetune.generation") is not None:
        from finetune import generation

        ours, rows["finetune.generation"] = generation, []
    pushes = []
    for _ in range(args.rounds):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        pushes.append(engine.push(model.named_parameters()))
        t = time.perf_counter()
        out = engine.generate(prompts, sampling, stop_ids=[], seeds=seeds)
        rows["vllm"].append(sum(len(c.tokens) for c in out) / (time.perf_counter() - t))
        t = time.perf_counter()
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
        rows["hf generate"].append((hf.shape[1] - args.prompt_len) * hf.shape[0] / (time.perf_counter() - t))
        if ours is not None:
            t = time.perf_counter()
            out = ours.generate(model, prompts, ours.Sampling(max_new_tokens=args.new_tokens, temperature=1.0),
                                stop_ids=[], pad_id=0, context=None, seeds=seeds)
            rows["finetune.generation"].append(sum(len(c.tokens) for c in out) / (time.perf_counter() - t))
    print(f"model: Llama {params / 1e6:.2f}M parameters, fp32; rollout: {args.prompts} prompts x {args.generations} "
          f"generations, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, sampled; "
          f"torch threads {torch.get_num_threads()}; {args.rounds} rounds, median")
    print(f"engine build: {build:.1f} s; push of every weight: {statistics.median(pushes) * 1e3:.1f} ms median "
          f"({', '.join(f'{s * 1e3:.1f}' for s in pushes)})")
    print("| backend | completion tokens/s | rounds |")
    print("| --- | ---: | --- |")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
