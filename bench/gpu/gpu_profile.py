"""Where a GPU training step of the --gpu benchmark goes: the same recipe built with finetune's own
functions (make_plan, build_accelerator, load_model, prepare, loss_sum), each phase timed with CUDA
events, then torch.profiler's top kernels. Run on a GPU after `python bench/run.py --gpu` (which
builds the model and data it reads):

    python bench/gpu/gpu_profile.py MODEL_DIR DATA_JSONL [steps]

Prints a table; the numbers go into docs/benchmarks.md only through a person reading them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository


def main(argv: list[str]) -> int:
    import torch

    from finetune import data as D
    from finetune.model import load_config, load_model, load_tokenizer, loss_sum
    from finetune.plan import make_plan
    from finetune.recipe import resolve
    from finetune.strategy import build_accelerator, prepare

    model_dir, data, steps = argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 8
    recipe = resolve("tiny", [f"model={model_dir}", f"dataset={data}", "dataset_format=text", "max_seq_len=2048",
                              "packing=false", "strategy=ddp", "mixed_precision=bf16", "micro_batch_size=4",
                              "grad_accum=1", "eval_fraction=0", "output_dir=/tmp/bench-gpu-profile"])
    plan = make_plan(recipe)
    model_path, config = load_config(recipe)
    accelerator = build_accelerator(plan, config)
    tokenizer = load_tokenizer(recipe, model_path)
    ds = D.build_datasets(recipe, tokenizer).train
    model = load_model(recipe, model_path, config)
    model, optimizer, scheduler = prepare(accelerator, plan, model, total_steps=100)
    schedule = D.BatchSchedule(len(ds), recipe.micro_batch_size, 1, 1, recipe.seed)
    phases = ("fetch", "forward+loss", "backward", "clip", "optimizer")

    def step(i, times=None):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
        ev[0].record()
        batch = {k: v.to(accelerator.device) for k, v in D.fetch(ds, schedule.rows(i, 0)[0], 0, False).items()}
        ev[1].record()
        with accelerator.accumulate(model):
            loss = loss_sum(model, batch) / D.target_tokens(batch)
            ev[2].record()
            accelerator.backward(loss)
        ev[3].record()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        ev[4].record()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ev[5].record()
        torch.cuda.synchronize()
        if times is not None:
            for k, name in enumerate(phases):
                times[name] = times.get(name, 0.0) + ev[k].elapsed_time(ev[k + 1])

    for i in range(3):
        step(i)
    times: dict = {}
    for i in range(3, 3 + steps):
        step(i, times)
    total = sum(times.values())
    print(f"{'phase':14s} {'ms/step':>8s} {'share':>6s}")
    for name in phases:
        print(f"{name:14s} {times[name] / steps:8.1f} {times[name] / total:6.1%}")
    print(f"{'step':14s} {total / steps:8.1f}   -> {4 * 2048 / (total / steps / 1000):,.0f} tokens/s")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step(100 + i)
    try:
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=22, max_name_column_width=60))
    except Exception:  # older torch names it cuda_time_total
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
