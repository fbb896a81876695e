"""Llama-3.1-8B-Instruct LoRA (r=16 on every attention and MLP projection) with PyTorch FSDP2, bf16, on
4 x 24 GB GPUs.

    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama8b_lora_fsdp

Sized for 4 x 24 GB GPUs (RTX 4090, A10G, L4). The frozen base is sharded by FSDP; only the adapters
(41,943,040 parameters) have gradients and Adam states. Llama 3's 128k vocabulary makes the logits the
largest activation: raise micro_batch_size only with more memory.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_lora_fsdp --gpus 4 --gpu-mem 24GB):
    params 3.78 + grads 0.04 + optimizer 0.08 + activations 2.06 + buffers 2.81 = total 8.77 GiB
compile stays off: finetune accepts compile=true with LoRA, and the adapted layers compile without
graph breaks on CPU, but LoRA was not measured compiled on a GPU (only full fine-tunes were); try
compile=true and compare the steady tokens/s (summary.json's tokens_per_s_steady).
"""

from dataclasses import replace

from finetune.recipe import FIELDS, Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    dataset="tatsu-lab/alpaca",
    dataset_format="alpaca",
    eval_fraction=0.02,
    max_seq_len=2048,
    packing=True,
    strategy="fsdp",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=2,
    global_batch_size=64,
    lr=2e-4,
    lr_scheduler="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=2,
    output_dir="runs/llama8b_lora_fsdp",
    log_every=10,
    eval_every=200,
    save_every=200,
    keep_last=2,
)

# ---- LoRA settings ----------------------------------------------------------------------------------
# finetune.recipe's LoRA fields; applied only where this version of finetune.recipe has them (FIELDS),
# so that this file loads everywhere. Without them the run would train every weight: the dry run's
# memory line says which (python finetune/run.py --recipe llama8b_lora_fsdp --dry-run).
LORA = dict(lora=True, lora_r=16, lora_alpha=32, lora_dropout=0.05)
recipe = replace(recipe, **{k: v for k, v in LORA.items() if k in FIELDS})
