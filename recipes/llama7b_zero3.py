"""Llama-2-7B full fine-tune, DeepSpeed ZeRO-3, bf16, on one node of 8 x 80 GB GPUs.

    accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama7b_zero3

Sized for 8 x 80 GB GPUs (A100/H100 80GB); it would also fit 8 x 40 GB.
Model states: 16 bytes x 6.7e9 params / 8 GPUs = 13.5 GB per GPU, plus activations (checkpointed).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama7b_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.57 + grads 1.57 + optimizer 9.41 + activations 3.97 + buffers 4.30 = total 20.82 GiB
Point `model` at a local directory if the node has no hub access.
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces: no fusion, slower than eager); strategy=fsdp shards the
same way and compiles.
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="meta-llama/Llama-2-7b-hf",
    dataset="tatsu-lab/alpaca",
    dataset_format="alpaca",
    eval_fraction=0.02,
    max_seq_len=2048,
    packing=True,
    strategy="zero3",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=4,
    global_batch_size=128,
    lr=2e-5,
    lr_scheduler="cosine",
    warmup_steps=30,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=3,
    output_dir="runs/llama7b_zero3",
    log_every=10,
    eval_every=200,
    save_every=200,
    keep_last=2,
)
