"""Llama-3.1-8B-Instruct DPO, full fine-tune, with DeepSpeed ZeRO-3, bf16, on 8 x 80 GB GPUs, on
UltraFeedback's binarized preference pairs (HuggingFaceH4/ultrafeedback_binarized, the Zephyr recipe's).

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_dpo_zero3

Sized for 8 x 80 GB GPUs (A100/H100 80GB). The reference is a frozen bf16 copy of the starting weights,
partitioned by ZeRO-3 like the policy (2 bytes per parameter / 8 per GPU); precompute_reference=true
scores every pair once before training and holds none. Each micro batch is 2 pairs: 4 sequences in one
forward.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_dpo_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + reference 1.87 + activations 4.64 + buffers 6.12 = total 27.59 GiB
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces: no fusion, slower than eager); strategy=fsdp shards the
same way and compiles.
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    dataset="HuggingFaceH4/ultrafeedback_binarized",
    dataset_split="train_prefs",
    dataset_format="preference",
    eval_dataset="HuggingFaceH4/ultrafeedback_binarized",
    eval_split="test_prefs",
    eval_max_samples=1000,
    objective="dpo",
    dpo_loss="sigmoid",
    dpo_beta=0.1,
    max_seq_len=2048,
    max_prompt_len=1024,
    strategy="zero3",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=2,
    global_batch_size=128,
    lr=5e-7,
    lr_scheduler="cosine",
    warmup_steps=10,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama8b_dpo_zero3",
    log_every=10,
    eval_every=100,
    save_every=100,
    keep_last=2,
)
