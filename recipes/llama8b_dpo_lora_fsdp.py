"""Llama-3.1-8B-Instruct DPO with LoRA (r=16 on every attention and MLP projection) and PyTorch FSDP2,
bf16, on 4 x 24 GB GPUs, on UltraFeedback's binarized preference pairs.

    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama8b_dpo_lora_fsdp

Sized for 4 x 24 GB GPUs (RTX 4090, A10G, L4). The reference is the policy with its adapter disabled:
the frozen base it started from, no second copy. Each micro batch is 1 pair: 2 sequences in one forward.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_dpo_lora_fsdp --gpus 4 --gpu-mem 24GB):
    params 3.78 + grads 0.04 + optimizer 0.08 + activations 2.06 + buffers 2.81 = total 8.77 GiB
compile stays off: finetune accepts compile=true with LoRA, and the adapted layers compile without
graph breaks on CPU, but neither LoRA nor a DPO step (the policy's and the adapter-disabled
reference's forward through the same layers) was measured compiled on a GPU.
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
    strategy="fsdp",
    mixed_precision="bf16",
    activation_checkpointing=True,
    lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    micro_batch_size=1,
    global_batch_size=64,
    lr=5e-6,
    lr_scheduler="cosine",
    warmup_steps=10,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama8b_dpo_lora_fsdp",
    log_every=10,
    eval_every=100,
    save_every=100,
    keep_last=2,
)
