"""Does the compiled decode loop pay on CPU? finetune.generation.generate eager against compiled=True
(StaticCache + a torch.compile'd one-token step: what generation_compile=true runs) in one process, one
thread, on the ~106M-parameter Llama of bench/studies/rollout_speed.py (bench/parts/common.py's
llama-100m), 8 completions of NEW_TOKENS tokens, sampled; the first compiled call holds the compile.

    python bench/studies/decode_compile_cpu.py [--new-tokens 128]

Prints seconds and peak resident memory after each call, and whether the tokens are the eager ones.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from bench.parts.common import MODELS, build_model
    from finetune.generation import Sampling, generate

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(build_model(MODELS["llama-100m"]), dtype=torch.float32).eval()
    rows = [[1 + (i * 7 + j) % 100 for j in range(20 + i)] for i in range(8)]
    kw = dict(stop_ids=(), pad_id=0, context=None, seeds=list(range(8)), vocab_size=108)
    eager_tokens = None
    for name, compiled in (("eager", False), ("compiled, first call", True), ("compiled, second call", True)):
        t0 = time.perf_counter()
        out = generate(model, rows, Sampling(a.new_tokens, temperature=1.0), compiled=compiled, **kw)
        seconds = time.perf_counter() - t0
        tokens = [c.tokens for c in out]
        eager_tokens = eager_tokens or tokens
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{name}: {seconds:.1f} s, peak RSS {peak:.2f} GiB, tokens as eager: {tokens == eager_tokens}",
              flush=True)


if __name__ == "__main__":
    main()
