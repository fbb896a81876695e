"""Llama-3.1-70B-Instruct LoRA (r=16 on every attention and MLP projection) with DeepSpeed ZeRO-3,
parameters and optimizer offloaded to CPU memory, bf16, on one node of 8 x 24 GB GPUs.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml finetune/run.py --recipe llama70b_lora_zero3_offload

Sized for 8 x 24 GB GPUs (A10G, L4, RTX 4090) and a host with at least 256 GB of RAM: the frozen bf16
base (141 GB) lives in CPU memory, partitioned across the 8 ranks, and each layer is gathered onto the
GPUs as it runs. On 8 x 40 GB or larger, offload_params=none fits too and is much faster.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama70b_lora_zero3_offload --gpus 8 --gpu-mem 24GB):
    params 0.00 + grads 0.00 + optimizer 0.00 + activations 3.56 + buffers 4.04 = total 7.60 GiB;
    offloaded to CPU 16.91 GiB
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces: no fusion, slower than eager); strategy=fsdp shards the
same way and compiles.
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
    strategy="zero3",
    offload_optimizer="cpu",
    offload_params="cpu",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=1,
    global_batch_size=64,
    lr=1e-4,
    lr_scheduler="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama70b_lora_zero3_offload",
    sample_prompts=0,  # samples at eval gather the whole 70B model on each GPU: it would not fit
    log_every=5,
    eval_every=100,
    save_every=100,
    keep_last=2,
)

# ---- LoRA settings ----------------------------------------------------------------------------------
# finetune.recipe's LoRA fields; applied only where this version of finetune.recipe has them (FIELDS),
# so that this file loads everywhere. Without them the run would train every weight: the dry run's
# memory line says which (python finetune/run.py --recipe llama70b_lora_zero3_offload --dry-run).
LORA = dict(lora=True, lora_r=16, lora_alpha=32, lora_dropout=0.05)
recipe = replace(recipe, **{k: v for k, v in LORA.items() if k in FIELDS})
