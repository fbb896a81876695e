"""The Hugging Face Trainer given what finetune/run.py is given: same model, data, sequence length,
batch, AdamW hyper-parameters, LR schedule, clipping, and the same DeepSpeed config (built by
finetune.strategy.deepspeed_config) or FSDP2 settings.

Launched by bench/parts/throughput.py exactly like finetune/run.py:
    accelerate launch --multi_gpu --num_processes 2 bench/helpers/trainer_baseline.py OUT_DIR --recipe NAME key=value ...

What is shared with the toolkit, and why it is fair:
- the recipe (finetune.recipe.resolve) and plan (finetune.plan.make_plan): the same numbers;
- the tokenized rows (finetune.data.build_datasets) and the padding (finetune.data.collate): the
  same tensors reach the model;
- the row order: a sampler that yields finetune.data.BatchSchedule's order, so that Accelerate's
  batch sharding (batch k to rank k mod N) hands every rank the rows it gets in finetune at every
  step: the two loss curves can be compared step by step;
- the CPU process-group shim of finetune/distributed.py (see ../shared/reference/cpu-distributed.md).
  finetune.strategy.ensure_process_env is imported; the PartialState lines are repeated in
  `form_cpu_group` because finetune has them inside build_accelerator, not as a function.
The Trainer's own code does everything else: model wrapping, loss (the model's ForCausalLMLoss with
num_items_in_batch over all ranks: the same sum / global target tokens), accumulation, clipping,
optimizer, scheduler, logging.

Precision and device follow the recipe and the machine, as finetune's plan does (plan.device):
- mixed_precision=bf16 (fp16) is TrainingArguments(bf16=True) (fp16=True): Accelerate's autocast over
  fp32 weights under ddp, as finetune; under zero1-3 the same DeepSpeed config with its "bf16" section
  enabled (DeepSpeed's bf16 engine, as finetune).
- fsdp: FSDP2 with finetune's own policy (finetune.strategy.fsdp2_mixed_precision: bf16 parameters for
  compute, fp32 gradient reduction, fp32 sharded masters, no output cast) and autocast off, as
  finetune/strategy/fsdp.py sets it. Left to itself the Trainer would take Accelerate's default policy
  (bf16 reduction, bf16 outputs) with autocast on top; that is a different numeric recipe, not a
  different toolkit, so the comparison gives both the same one.
- on a GPU (no gloo shim, NCCL group) the optimizer is AdamW "adamw_torch_fused" (the Trainer's own
  default since torch 2.8, and the fused AdamW finetune uses on CUDA) and the DataLoader pins memory
  (the Trainer's default; finetune copies from pinned memory too). On CPU: "adamw_torch" unfused and
  no pinning, as finetune, and as section 2 of docs/benchmarks.md was measured.
- loss_impl=liger in the recipe gives the Trainer use_liger_kernel=True with only Liger's fused linear
  cross-entropy on (liger_kernel_config), the one kernel finetune's loss_impl=liger uses; any other
  loss_impl is the model's own ForCausalLMLoss over full logits (finetune's default "chunked" never
  holds them: that difference is finetune's and stays).
- compile=true in the recipe gives the Trainer torch_compile=True: its own way to compile (Accelerate
  torch.compiles the whole prepared model, default backend and mode), against finetune's compile of each
  decoder layer (finetune/model.py compile_layers); so a compiled finetune row is compared with a
  compiled Trainer, not an eager one. trainer_summary.json's "compiled" says whether the model it
  trained was a compiled module.
What still differs: the Trainer keeps its DDP default find_unused_parameters=True (a PreTrainedModel
without gradient checkpointing), and it logs through its own callbacks; both are the Trainer as a
user gets it.

Launched as one process (`python bench/helpers/trainer_baseline.py OUT_DIR --recipe NAME ...`), it forms a
1-process group like `python finetune/run.py` (finetune.strategy.ensure_process_env), so ddp, fsdp
and zero3 each run on one GPU: bench/gpu/gpu.py does that.

Writes OUT_DIR/trainer_summary.json on rank 0: per-step wall-clock times (TrainerCallback.on_step_end),
per-step target tokens (the Trainer's own num_items_in_batch: labels[..., 1:] != -100 over all
ranks), per-step losses (the Trainer's logs), train_runtime, and the peak memory of rank 0
(finetune.training.metrics.peak_memory_bytes: torch.cuda.max_memory_allocated on a GPU, peak RSS on CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: finetune and bench.* import from it


def form_cpu_group(strategy: str) -> bool:
    """finetune/distributed.py's CPU shim for DeepSpeed and FSDP; returns whether the Trainer must use the
    configured state. DDP needs none: the Trainer's use_cpu=True + ddp_backend=gloo is the same."""
    from accelerate import DistributedType, PartialState

    if strategy == "ddp":
        return False
    if strategy.startswith("zero"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    elif strategy == "fsdp":
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        state = PartialState(backend="gloo")
        state.distributed_type = DistributedType.MULTI_GPU  # Accelerate turns FSDP on only for GPU-like types
    return True


def trainer_kwargs(r, plan, config, on_cpu: bool) -> dict:
    """The TrainingArguments that depend on strategy, precision and device (the module's docstring
    says why each is what it is). On CPU it also forms the gloo group (form_cpu_group)."""
    from finetune.strategy import deepspeed_config, no_split_modules

    kw = {"bf16": r.mixed_precision == "bf16", "fp16": r.mixed_precision == "fp16",
          "optim": "adamw_torch" if on_cpu else "adamw_torch_fused", "dataloader_pin_memory": not on_cpu}
    configured = form_cpu_group(r.strategy) if on_cpu else False
    if r.strategy.startswith("zero"):
        kw["deepspeed"] = deepspeed_config(plan, config.hidden_size)
    elif r.strategy == "fsdp":
        kw["fsdp"] = True
        kw["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": no_split_modules(config),
                             "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                             "activation_checkpointing": False, "cpu_offload": r.offload_params == "cpu",
                             "cpu_ram_efficient_loading": False}
    elif on_cpu:
        kw["use_cpu"] = True
        kw["ddp_backend"] = "gloo"
    if on_cpu and r.mixed_precision != "no":
        kw["use_cpu"] = True  # TrainingArguments refuses bf16 on CPU without it
    if configured:
        kw["accelerator_config"] = {"use_configured_state": True}
    if r.compile:
        kw["torch_compile"] = True
    if r.loss_impl == "liger":
        kw["use_liger_kernel"] = True
        kw["liger_kernel_config"] = {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False,
                                     "rms_norm": False, "swiglu": False}
    return kw


def fsdp_mixed_precision(targs, r) -> bool:
    """Give the Trainer's FSDP2 plugin finetune's MixedPrecisionPolicy; returns whether autocast must be
    turned off (as finetune/strategy/fsdp.py does when FSDP2's policy casts)."""
    if r.strategy != "fsdp" or r.mixed_precision == "no" or targs.fsdp_plugin_args is None:
        return False
    from finetune.strategy import fsdp2_mixed_precision

    targs.fsdp_plugin_args["mixed_precision_policy"] = fsdp2_mixed_precision(r.mixed_precision)
    return True


def what_ran(trainer) -> dict:
    """Precision, optimizer, FSDP policy and compile as the Trainer's Accelerator took them (not as asked)."""
    from accelerate.utils import is_compiled_module

    acc = trainer.accelerator
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    fused = any(g.get("fused") for g in trainer.optimizer.param_groups)
    policy = getattr(getattr(acc.state, "fsdp_plugin", None), "mixed_precision_policy", None)
    return {"mixed_precision": acc.mixed_precision, "optim": type(inner).__name__ + (" (fused)" if fused else ""),
            "autocast": bool(acc.native_amp and (acc.autocast_handler is None or acc.autocast_handler.enabled)),
            "fsdp_mixed_precision_policy": None if policy is None else str(policy),
            "compiled": any(is_compiled_module(m) for m in (trainer.model_wrapped, trainer.model))}


class ScheduleSampler:
    """finetune.data.BatchSchedule's row order as one flat sequence of micro-batches: for each step, for
    each accumulation index a, for each rank r, the rows rank r runs at micro-step a. Accelerate gives
    batch k to rank k mod world, which is exactly that split."""

    def __init__(self, schedule, steps: int):
        self.order = []
        for step in range(steps):
            per_rank = [schedule.rows(step, r) for r in range(schedule.world_size)]
            for a in range(schedule.grad_accum):
                for r in range(schedule.world_size):
                    self.order.extend(per_rank[r][a])

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


def recipe_and_plan(argv: list[str]):
    """`OUT --recipe NAME key=value ...` (a launched peer's arguments) -> (OUT, the resolved recipe, its plan),
    with the process environment set as finetune/run.py sets it."""
    out = Path(argv[0])
    args = argv[1:]
    recipe_name = args[args.index("--recipe") + 1]
    overrides = [a for i, a in enumerate(args) if a != "--recipe" and (i == 0 or args[i - 1] != "--recipe")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from finetune.recipe import resolve
    from finetune.plan import make_plan
    from finetune.strategy import ensure_process_env

    recipe = resolve(recipe_name, overrides)
    ensure_process_env()
    return out, recipe, make_plan(recipe)


def main(argv: list[str]) -> int:
    out, recipe, plan = recipe_and_plan(argv)
    r = recipe
    t_wall = time.perf_counter()

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from finetune import data as D
    from finetune.training import loop
    from finetune.training.metrics import peak_memory_bytes
    from finetune.model import load_config, load_tokenizer

    hf_logging.set_verbosity_warning()
    model_path, config = load_config(r)
    on_cpu = plan.device == "cpu"
    kw = trainer_kwargs(r, plan, config, on_cpu)
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=r.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum, learning_rate=r.lr, adam_beta1=r.adam_beta1,
        adam_beta2=r.adam_beta2, adam_epsilon=r.adam_eps, weight_decay=r.weight_decay,
        max_grad_norm=r.max_grad_norm, lr_scheduler_type=r.lr_scheduler, warmup_steps=r.warmup_steps,
        max_steps=r.max_steps, seed=r.seed, logging_steps=1, logging_first_step=True,
        save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, **kw)
    autocast_off = fsdp_mixed_precision(targs, r)

    tokenizer = load_tokenizer(r, model_path)
    with targs.main_process_first():
        datasets = D.build_datasets(r, tokenizer)
    world = targs.world_size
    schedule = D.BatchSchedule(len(datasets.train), r.micro_batch_size, plan.grad_accum, world, r.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation=r.attn_implementation)
    model.config.use_cache = False
    pad_id = tokenizer.pad_token_id

    def collator(rows):
        rows = [{k: (list(v) if not isinstance(v, list) else v) for k, v in row.items()} for row in rows]
        return D.collate(rows, pad_id, r.packing)

    step_end: list[float] = []
    losses: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())  # step 0's "end": training starts here

        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    items: list = []

    class SameRowsTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return ScheduleSampler(schedule, r.max_steps)

        def _build_accelerator_args(self, **kwargs):
            args = super()._build_accelerator_args(**kwargs)
            if autocast_off:  # FSDP2's policy casts; autocast over it is off in finetune too
                from accelerate.utils import AutocastKwargs

                args["kwargs_handlers"] = [*args.get("kwargs_handlers", []), AutocastKwargs(enabled=False)]
            return args

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            items.append(num_items)  # a tensor; read once training is over
            return batch_samples, num_items

    trainer = SameRowsTrainer(model=model, args=targs, train_dataset=datasets.train, data_collator=collator,
                              callbacks=[Clock()])
    result = trainer.train()
    peak = peak_memory_bytes(torch.device("cpu") if on_cpu else trainer.args.device)
    tokens = [int(t.item()) if torch.is_tensor(t) else int(t or 0) for t in items]
    if trainer.is_world_process_zero():
        summary = {
            "strategy": r.strategy, "world_size": world, "grad_accum": plan.grad_accum,
            "engine": type(trainer.model_wrapped).__name__, "optimizer": type(trainer.optimizer).__name__,
            "steps": trainer.state.global_step, "train_runtime": result.metrics.get("train_runtime"),
            "step_seconds": [b - a for a, b in zip(step_end, step_end[1:])], "tokens": tokens,
            "losses": [losses.get(s) for s in range(1, trainer.state.global_step + 1)],
            "wall_seconds": time.perf_counter() - t_wall,
            "deepspeed_config": kw.get("deepspeed"), "fsdp_config": kw.get("fsdp_config"),
            **what_ran(trainer),
            "liger": bool(kw.get("use_liger_kernel")), "device": plan.device,
            "peak_memory": peak, "peak_memory_kind": "GPU allocated" if not on_cpu else "process resident",
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "trainer_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    loop.KEEP_UNTIL_EXIT.append(trainer)  # ends like finetune/run.py: no teardown
    loop.finish_together()
    return 0


if __name__ == "__main__":
    if not __import__("torch").cuda.is_available():  # as finetune/run.py: say it, rather than have DeepSpeed guess
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from finetune.run import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))
