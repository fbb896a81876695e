"""Llama-3.1-8B-Instruct KTO with LoRA (r=16 on every attention and MLP projection) and PyTorch FSDP2, bf16,
on 4 x 24 GB GPUs, on trl-lib/kto-mix-14k's unpaired rows (conversational prompt, completion, label).

    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama8b_kto_lora_fsdp

Sized for 4 x 24 GB GPUs (RTX 4090, A10G, L4). The reference is the policy with its adapter disabled: the
frozen base it started from, no second copy. Each micro batch is 2 rows (KTO's KL estimate pairs each prompt
with the other row's completion, TRL's rotation within a micro batch); before each step's forward with
gradient the rows' KL rows are scored without one. TRL's defaults: beta 0.1, both weights 1.0 (kto-mix-14k
is about half desirable).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_kto_lora_fsdp --gpus 4 --gpu-mem 24GB):
    params 3.78 + grads 0.04 + optimizer 0.08 + activations 2.06 + buffers 2.81 = total 8.77 GiB
(2 rows of 2048 tokens with gradient, as DPO's one pair of llama8b_dpo_lora_fsdp; the KL rows' forward keeps
no activations.)
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    dataset="trl-lib/kto-mix-14k",
    dataset_split="train",
    dataset_format="unpaired",
    eval_dataset="trl-lib/kto-mix-14k",
    eval_split="test",
    eval_max_samples=500,
    objective="kto",
    kto_loss="kto",
    kto_beta=0.1,
    desirable_weight=1.0,
    undesirable_weight=1.0,
    max_seq_len=2048,
    max_prompt_len=1024,
    strategy="fsdp",
    mixed_precision="bf16",
    activation_checkpointing=True,
    lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    micro_batch_size=2,
    global_batch_size=64,
    lr=5e-6,
    lr_scheduler="cosine",
    warmup_steps=10,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama8b_kto_lora_fsdp",
    log_every=10,
    eval_every=100,
    save_every=100,
    keep_last=2,
)
