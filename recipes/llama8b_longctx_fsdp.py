"""Llama-3.1-8B-Instruct full fine-tune on long chats (32K tokens per row) with Ulysses sequence
parallelism 8 under PyTorch FSDP2, bf16, activation checkpointing, on one node of 8 x 80 GB GPUs.

    accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama8b_longctx_fsdp

Sized for 8 x 80 GB GPUs (A100/H100 80GB). Each 32,768-token row is split across the 8 GPUs (4,096
tokens each; Llama 3.1 8B's 32 attention and 8 key/value heads take sequence_parallel=8), which read the
same rows: one data-parallel rank, the global batch is micro x accum. Without sequence parallelism 32K
tokens fit too, with 8x the activations per GPU.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_longctx_fsdp --gpus 8 --gpu-mem 80GB):
    params 3.74 + grads 3.74 + optimizer 7.48 + activations 3.49 + buffers 6.92 = total 25.36 GiB
The longest row that fits (python -m finetune.plan --recipe llama8b_longctx_fsdp --gpus 8 --gpu-mem 80GB --max-seq-len):
    717,664 tokens with sequence_parallel=8, 89,708 without (sdpa keeps no T^2 scores; activations as
    measured on CPU, docs/benchmarks.md section 11, not yet on a GPU)
compile stays off: finetune refuses compile=true with sequence_parallel > 1 (compiled layers around
Ulysses' all-to-all were not tried).
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    dataset="HuggingFaceH4/ultrachat_200k",
    dataset_split="train_sft",
    dataset_format="messages",
    eval_split="test_sft",
    max_seq_len=32768,
    packing=False,
    strategy="fsdp",
    sequence_parallel=8,
    attn_implementation="sdpa",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=1,
    global_batch_size=16,
    lr=1e-5,
    lr_scheduler="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama8b_longctx_fsdp",
    log_every=1,
    eval_every=100,
    eval_max_samples=64,
    save_every=100,
    keep_last=2,
)
