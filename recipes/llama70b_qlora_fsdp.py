"""Llama-3.1-70B-Instruct QLoRA (a 4-bit NF4 base, LoRA r=16 on every attention and MLP projection) with
PyTorch FSDP2, bf16, on 2 GPUs of 48 GB.

    pip install -e .[qlora]        # bitsandbytes
    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe llama70b_qlora_fsdp

Sized for 2 x 48 GB GPUs (RTX 6000 Ada, A6000, L40S) and a host with about 64 GB of RAM. Rank 0 reads the
bf16 checkpoint and quantizes it tensor by tensor (no process ever holds the unquantized model); FSDP
shards the 4-bit base (its bits stored in bf16) across both GPUs, and each rank keeps the quantization
constants whole (1.01 GiB). Only the adapters (207,093,760 parameters) have gradients and Adam states.
On 2 x 24 GB it does NOT fit by the planner: the sharded 4-bit base alone is 17.8 GiB per GPU, and the
unquantized embedding and lm_head (2.1 GB each in bf16), the activations and the gathered layers take
the rest; the planner says so (below), and offloading a 4-bit base is not supported here.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama70b_qlora_fsdp --gpus 2 --gpu-mem 48GB):
    params 19.29 (4-bit base shard 15.95 + quantization constants 1.01 + bf16 embedding and lm_head
    shards 1.96 + adapters 0.39) + grads 0.39 + optimizer 0.77 + activations 3.56 + buffers 5.54
    = total 29.55 GiB: fits 48 GB; with --gpu-mem 24GB it says "does NOT fit" (and so does every setup).
compile stays off: finetune refuses compile=true for a 4-bit base under fsdp (bitsandbytes re-attaches
each sharded weight's quantization state inside the layer, a graph break at every Linear).
"""

from dataclasses import replace

from finetune.recipe import FIELDS, Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-70B-Instruct",
    dataset="tatsu-lab/alpaca",
    dataset_format="alpaca",
    eval_fraction=0.02,
    max_seq_len=2048,
    packing=True,
    strategy="fsdp",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=1,
    global_batch_size=32,
    lr=1e-4,
    lr_scheduler="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama70b_qlora_fsdp",
    sample_prompts=0,  # samples at eval gather the whole 70B model on each GPU: it would not fit
    log_every=5,
    eval_every=100,
    save_every=100,
    keep_last=2,
)

# ---- QLoRA settings ---------------------------------------------------------------------------------
# finetune.recipe's LoRA fields; applied only where this version of finetune.recipe has them (FIELDS),
# so that this file loads everywhere.
QLORA = dict(lora=True, lora_r=16, lora_alpha=32, lora_dropout=0.05, load_in_4bit=True)
recipe = replace(recipe, **{k: v for k, v in QLORA.items() if k in FIELDS})
