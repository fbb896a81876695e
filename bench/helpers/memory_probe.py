"""One rank's model-state memory under one strategy, measured on the toolkit's own components.

Launched by bench/parts/memory.py as
    accelerate launch --multi_gpu --num_processes 2 bench/helpers/memory_probe.py OUT_DIR key=value ...
(key=value are recipe fields). It builds everything the way finetune/training/loop.py does (make_plan,
build_accelerator, load_model, prepare, loss_sum, accelerator.accumulate/backward), trains one full
optimizer step of two micro-steps so that Adam's states exist, then runs the next step's two
micro-steps and reads `held_bytes` (bench/helpers/held.py) twice:

- after the first micro-step's backward (not an accumulation boundary): DeepSpeed under Accelerate
  steps and frees its gradients at the boundary, so this is where its gradients are visible;
- after the second micro-step's backward (the boundary, before optimizer.step): where DDP's and
  FSDP's reduced gradients are.

The reported figure is the larger of the two (every state present). Writes OUT_DIR/rank_<i>.json.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    overrides = argv[1:]
    t_start = time.perf_counter()
    import torch

    from finetune.training import loop
    from finetune.data import collate
    from bench.helpers.held import held_bytes
    from finetune.model import load_config, load_model, loss_sum
    from finetune.plan import make_plan
    from finetune.recipe import Recipe, apply_overrides, validate
    from finetune.strategy import build_accelerator, prepare, reads_weights

    recipe = validate(apply_overrides(Recipe(mixed_precision="no", output_dir=str(out / "run")), overrides))
    plan = make_plan(recipe)
    model_path, config = load_config(recipe)
    accelerator = build_accelerator(plan, config)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    rss = {"after_setup": rss_bytes()}

    t0 = time.perf_counter()
    model = load_model(recipe, model_path, config, weights_on_this_rank=reads_weights(plan, accelerator))
    model, optimizer, scheduler = prepare(accelerator, plan, model, total_steps=10)
    load_seconds = time.perf_counter() - t0
    rss["after_prepare"] = rss_bytes()
    held = {"after_prepare": held_bytes(model, optimizer)}

    # Synthetic rows of random tokens (what they say does not matter to memory); each rank its own.
    g = torch.Generator().manual_seed(1000 + rank)
    seq, micro = recipe.max_seq_len, recipe.micro_batch_size

    def micro_batch():
        ids = torch.randint(8, config.vocab_size, (micro, seq), generator=g).tolist()
        return collate([{"input_ids": r, "labels": r} for r in ids], pad_id=0, packed=False)

    def micro_step(batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        with accelerator.accumulate(model):
            loss = loss_sum(model, batch)
            accelerator.backward(loss / (micro * (seq - 1) * plan.grad_accum))
        return float(loss)

    def optimizer_step():
        accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    assert plan.grad_accum == 2, "the probe needs grad_accum=2: one micro-step inside the step, one at its end"
    t0 = time.perf_counter()
    for _ in range(plan.grad_accum):  # step 1: creates Adam's states
        micro_step(micro_batch())
    optimizer_step()
    rss["after_step_1"] = rss_bytes()
    micro_step(micro_batch())  # step 2, first micro-step: not an accumulation boundary
    held["inside_step"] = held_bytes(model, optimizer)
    rss["inside_step"] = rss_bytes()
    micro_step(micro_batch())  # step 2, last micro-step: the boundary (DeepSpeed steps inside backward)
    held["at_boundary"] = held_bytes(model, optimizer)
    rss["at_boundary"] = rss_bytes()
    optimizer_step()
    step_seconds = time.perf_counter() - t0
    held["after_step_2"] = held_bytes(model, optimizer)
    best = max(("inside_step", "at_boundary"), key=lambda k: held[k]["total"] + held[k]["cpu_total"])

    result = {
        "rank": rank, "world_size": world, "strategy": recipe.strategy,
        "ddp_shard_optimizer": recipe.ddp_shard_optimizer, "offload_optimizer": recipe.offload_optimizer,
        "offload_params": recipe.offload_params, "model": model_path, "micro_batch_size": micro,
        "seq_len": seq, "held": held, "reported_at": best, "reported": held[best],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss": rss,
        "load_seconds": round(load_seconds, 2), "two_steps_seconds": round(step_seconds, 2),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
        "optimizer_class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "engine": type(model).__name__,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{rank}.json").write_text(json.dumps(result, indent=2) + "\n")
    loop.KEEP_UNTIL_EXIT.append((accelerator, model, optimizer))  # ends like finetune/run.py: no teardown
    loop.finish_together()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from finetune.run import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))
