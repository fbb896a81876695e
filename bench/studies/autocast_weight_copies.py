"""Does bf16 autocast over fp32 weights (DDP's mixed precision: Accelerate wraps the model's forward in
torch.autocast) hold a bf16 copy of every trained weight, and for how long? One process, CPU.

    python bench/studies/autocast_weight_copies.py [--hidden 512 --layers 4 --tokens 512]

A Llama from a saved config (from_pretrained, fp32, random weights, sdpa) runs one forward with labels
(the loss inside the forward, as finetune's output-layer hook computes it) and one backward, in four
ways: fp32 (no autocast); the forward under torch.autocast("cpu", bfloat16) as Accelerate wraps it
(cache on, torch's default); the same with cache_enabled=False; each with activation checkpointing off
and on (non-reentrant, as finetune sets it). A TorchDispatchMode keys every allocated storage (its
bytes, dtype, whether it has a Linear weight's shape) and drops it when freed. Reported, in MiB:

- peak: the most bytes alive at once over forward + backward (the parameters' gradients included,
  none before the backward: finetune's loop zeroes them with set_to_none); forward's peak: up to the
  forward's end;
- in: bytes alive at the end of the forward, still inside the autocast region;
- out: bytes alive after the region exited (torch clears its cast cache there) = held into backward;
- w16 in / w16 out: of those, the bf16 tensors of a decoder/lm_head Linear weight's shape;
- and 2 bytes x the Linear weights (what one bf16 copy of every trained Linear weight takes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

MIB = 2**20


def tracker():
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):
        def __init__(self, weight_shapes):
            super().__init__()
            self.shapes, self.live, self.peak = weight_shapes, {}, 0

        def sweep(self):
            for key in [k for k, v in self.live.items() if v[0].expired()]:
                del self.live[key]

        def now(self, w16=False):
            self.sweep()
            return sum(n for _, n, is_w16 in self.live.values() if is_w16 or not w16)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in self.live:
                        w16 = t.dtype == torch.bfloat16 and tuple(t.shape) in self.shapes
                        self.live[ref.cdata] = (ref, t.untyped_storage().nbytes(), w16)
            self.peak = max(self.peak, self.now())
            return out

    return Live


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=384)  # not a weight dimension (shapes are matched)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = args.hidden
    config = LlamaConfig(hidden_size=h, num_hidden_layers=args.layers, intermediate_size=int(h * 2.6875) // 8 * 8,
                         num_attention_heads=h // 64, num_key_value_heads=h // 64, vocab_size=args.vocab,
                         tie_word_embeddings=False, use_cache=False)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(config).save_pretrained(path)
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    print(f"torch {torch.__version__}; autocast cache enabled by default: {torch.is_autocast_cache_enabled()}")
    rows = []
    for ckpt in (False, True):
        for mode in ("fp32", "autocast", "autocast, no cache"):
            model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
            model.train()
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
            shapes = {tuple(w.shape) for w in linears}
            live = tracker()(shapes)
            region = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=mode == "autocast")
                      if mode != "fp32" else torch.autocast("cpu", enabled=False))
            with live:
                with region:
                    cached = torch.is_autocast_cache_enabled() if mode != "fp32" else None
                    loss = model(input_ids=ids, labels=ids).loss
                    inside, w16_in, forward_peak = live.now(), live.now(w16=True), live.peak
                outside, w16_out = live.now(), live.now(w16=True)
                loss.backward()
            rows.append(dict(checkpointing=ckpt, mode=mode, cache=cached, peak=live.peak / MIB, forward_peak=forward_peak / MIB, **{
                "in": inside / MIB, "out": outside / MIB, "w16 in": w16_in / MIB, "w16 out": w16_out / MIB,
                "2 x linear weights": 2 * sum(w.numel() for w in linears) / MIB}))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: hidden {h}, {args.layers} layers, vocab {args.vocab}, {params:,} parameters; "
          f"1 x {args.tokens} tokens")
    print("| checkpointing | forward | cache | peak | forward's peak | in | out | w16 in | w16 out | 2 x Linear weights |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['checkpointing'] else 'off'} | {r['mode']} | {r['cache']} | {r['peak']:.1f} | {r['forward_peak']:.1f} | "
              f"{r['in']:.1f} | {r['out']:.1f} | {r['w16 in']:.1f} | {r['w16 out']:.1f} | "
              f"{r['2 x linear weights']:.1f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
