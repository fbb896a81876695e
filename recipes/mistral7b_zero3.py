"""Mistral-7B-v0.1 full fine-tune with DeepSpeed ZeRO-3, bf16, on one node of 8 x 40 GB GPUs.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml finetune/run.py --recipe mistral7b_zero3

Sized for 8 x 40 GB GPUs (A100 40GB); on 80 GB GPUs raise micro_batch_size.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe mistral7b_zero3 --gpus 8 --gpu-mem 40GB):
    params 1.69 + grads 1.69 + optimizer 10.12 + activations 4.13 + buffers 4.62 = total 22.24 GiB
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces: no fusion, slower than eager); strategy=fsdp shards the
same way and compiles.
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="mistralai/Mistral-7B-v0.1",
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
    lr=1e-5,
    lr_scheduler="cosine",
    warmup_steps=30,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=3,
    output_dir="runs/mistral7b_zero3",
    log_every=10,
    eval_every=200,
    save_every=200,
    keep_last=2,
)
