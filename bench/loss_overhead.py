"""What finetune.model.loss_sum costs against the same loss computed the way transformers' ForCausalLMLoss
does it (shift the labels, not the logits), in one process, forward + backward of a real batch.

    python bench/loss_overhead.py [REPEATS] [MODEL_DIR]

loss_sum slices `logits[:, :-1]` and flattens it, which copies the whole (batch x length x vocab) logits
tensor (and its gradient in backward); padding the labels by one IGNORE position and flattening the
logits as they are gives the identical sum without the copy. The two are timed alternately (A B A B
...) so that a busy machine slows both alike; prints the medians and checks the losses are equal.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str]) -> int:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from common import MODELS, build_model
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

    def shifted_labels(model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        target = F.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")

    def timed(fn):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = fn(model, batch)
        loss.backward()
        return time.perf_counter() - t0, float(loss)

    for fn in (loss_sum, shifted_labels):  # warm-up
        timed(fn)
    a, b = [], []
    for _ in range(repeats):
        ta, la = timed(loss_sum)
        tb, lb = timed(shifted_labels)
        a.append(ta)
        b.append(tb)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"loss_sum (slices logits):       {ma * 1000:8.1f} ms forward+backward (median of {repeats})")
    print(f"shifted labels (no logits copy): {mb * 1000:8.1f} ms")
    print(f"loss_sum takes {ma / mb:.3f}x; losses {la:.6f} vs {lb:.6f} (relative difference {abs(la - lb) / lb:.1e})")
    print("RESULT " + json.dumps({"loss_sum_ms": ma * 1000, "shifted_ms": mb * 1000, "ratio": ma / mb,
                                  "loss_sum": la, "shifted": lb, "repeats": repeats, "batch": list(ids.shape),
                                  "vocab": model.config.vocab_size, "model": model_dir}))
    return 0


def measure(work: Path, repeats: int) -> dict:
    """Run this file as its own process (one thread, like one rank) and read its result."""
    from common import PY, run, shown

    cmd = [PY, "bench/loss_overhead.py", str(repeats)]
    launch = run(cmd, work / "loss_overhead.log", timeout=600)
    lines = [ln for ln in launch.log.read_text().splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if launch.ok and lines else {"error": launch.error()}
    res["command"] = shown(cmd)
    return res


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
