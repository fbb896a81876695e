"""What the distillation loss costs with Llama-3's 128,256-token vocabulary: the process's peak memory of one
forward and backward of finetune/divergence.py's divergence_sum, loss_impl=full (both models' logits of every
token at once, their log-softmax, the gradient) against loss_impl=chunked (each chunk's logits inside the
output layers), on CPU.

The student a 2-layer Llama-style model of hidden size 64, the teacher one of hidden size 128 (random weights,
untied, fp32), one row of T tokens all of them targets, reverse KL (TRL's default). Each setting in a process
of its own (the peak resident memory, ru_maxrss, after the models are built is subtracted from the one after
the step); one process at a time.

    python bench/studies/distill_loss_memory.py [--tokens 512 1024]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128256

CHILD = r"""
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from finetune.divergence import divergence_sum
impl, tokens = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
def model(hidden, heads):
    return LlamaForCausalLM(LlamaConfig(vocab_size=%d, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                                        tie_word_embeddings=False))
student, teacher = model(64, 4), model(128, 4)
teacher.requires_grad_(False)
ids = torch.randint(0, %d, (1, tokens))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
loss, _ = divergence_sum(student, teacher, batch, 1.0, 1.0, impl)
loss.backward()
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"impl": impl, "tokens": tokens, "step_gib": (peak - base) / 2**20, "seconds": seconds,
                  "loss": loss.item()}))
""" % (VOCAB, VOCAB)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024])
    args = parser.parse_args()
    logits_gib = {t: t * VOCAB * 4 / 2**30 for t in args.tokens}
    print("| tokens | one fp32 logits tensor | full: memory added by the step | chunked | full s | chunked s |")
    print("|---|---|---|---|---|---|")
    for tokens in args.tokens:
        rows = {}
        for impl in ("full", "chunked"):
            out = subprocess.run([sys.executable, "-c", CHILD, impl, str(tokens)], cwd=REPO, capture_output=True,
                                 text=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
            if out.returncode:
                print(out.stderr[-2000:])
                return 1
            rows[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        assert abs(rows["full"]["loss"] - rows["chunked"]["loss"]) <= 1e-4 * abs(rows["full"]["loss"])
        print(f"| {tokens} | {logits_gib[tokens]:.2f} GiB | {rows['full']['step_gib']:.2f} GiB | "
              f"{rows['chunked']['step_gib']:.2f} GiB | {rows['full']['seconds']:.1f} | {rows['chunked']['seconds']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
