"""What the loss used to cost: finetune.model.loss_sum against the way it computed the same sum before
(slicing the logits), in one process, forward + backward of a real batch.

    python bench/studies/loss_overhead.py [REPEATS] [MODEL_DIR]

The old loss sliced `logits[:, :-1]` and flattened it, which copies the whole (batch x length x vocab)
logits tensor (and its gradient in backward); loss_sum now pads the labels by one IGNORE position and
flattens the logits as they are, as transformers' ForCausalLMLoss does: the identical sum without the
copy. The two are timed alternately (A B A B ...) so that a busy machine slows both alike; prints the
medians and checks the losses are equal.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it


def main(argv: list[str]) -> int:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from bench.parts.common import MODELS, build_model
    from finetune.data import IGNORE
    from finetune.model import loss_sum

    torch.set_num_threads(1)
    repeats = int(argv[0]) if argv else 15
    model_dir = argv[1] if len(argv) > 1 else str(build_model(MODELS["llama-7m"]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, model.config.vocab_size, (4, 256), generator=g)
    labels = ids.clone()
    labels[:, :100] = IGNORE  # a prompt
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}

    def sliced_logits(model, batch):  # finetune's loss_sum before the fix
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                               ignore_index=IGNORE, reduction="sum")

    def timed(fn):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = fn(model, batch)
        loss.backward()
        return time.perf_counter() - t0, float(loss)

    def full_logits(model, batch):  # loss_sum's full-logits path, which shifts the labels (the chunked default
        return loss_sum(model, batch, "full")  # is measured by bench/parts/loss_memory.py)

    for fn in (sliced_logits, full_logits):  # warm-up
        timed(fn)
    a, b = [], []
    for _ in range(repeats):
        ta, la = timed(sliced_logits)
        tb, lb = timed(full_logits)
        a.append(ta)
        b.append(tb)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"sliced logits (before):          {ma * 1000:8.1f} ms forward+backward (median of {repeats})")
    print(f"finetune loss_sum (shifts labels): {mb * 1000:8.1f} ms")
    print(f"the old way took {ma / mb:.3f}x; losses {la:.6f} vs {lb:.6f} (relative difference {abs(la - lb) / lb:.1e})")
    print("RESULT " + json.dumps({"sliced_ms": ma * 1000, "loss_sum_ms": mb * 1000, "ratio": ma / mb,
                                  "sliced": la, "loss_sum": lb, "repeats": repeats, "batch": list(ids.shape),
                                  "vocab": model.config.vocab_size, "model": model_dir}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
