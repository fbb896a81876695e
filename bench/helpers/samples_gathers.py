"""finetune/run.py with the collectives each eval's samples make counted (bench/studies/samples.py launches it):
torch.distributed's all-gathers and broadcasts, which FSDP2 (all_gather_single) and DeepSpeed ZeRO-3 use
to gather weights, per rank, printed to stderr with the tokens generated. Gathering once per eval shows
as a count that does not grow with the tokens; a per-token gather as one that does."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it

import torch.distributed as dist  # noqa: E402

from finetune import run  # noqa: E402
from finetune.training import samples  # noqa: E402

calls = {"n": 0}
for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "_all_gather_base", "broadcast"):
    if hasattr(dist, name):
        def counted(*args, _call=getattr(dist, name), **kwargs):
            calls["n"] += 1
            return _call(*args, **kwargs)
        setattr(dist, name, counted)

run_samples = samples.run_samples


def measured(accelerator, model, prompts, tokenizer, max_new_tokens, *args, **kwargs):
    calls["n"] = 0
    t0 = time.perf_counter()
    out = run_samples(accelerator, model, prompts, tokenizer, max_new_tokens, *args, **kwargs) or []
    print(f"[rank{dist.get_rank()}] samples: {len(out)} prompts, {sum(s['tokens'] for s in out)} tokens, "
          f"{calls['n']} gather calls, {time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)
    return out


samples.run_samples = measured
run.exit_without_teardown(run.main(sys.argv[1:]))
