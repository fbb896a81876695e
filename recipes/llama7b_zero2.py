"""Llama-2-7B full fine-tune with DeepSpeed ZeRO-2, bf16, on one node of 8 x 80 GB GPUs; derived from llama7b_zero3.

    accelerate launch --config_file accelerate_configs/deepspeed_8gpu.yaml finetune/run.py --recipe llama7b_zero2

Sized for 8 x 80 GB GPUs (A100/H100 80GB). ZeRO-2 keeps the whole bf16 model on every GPU and shards
gradients and optimizer states (2 P + 14 P / N): less communication than ZeRO-3, more memory.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama7b_zero2 --gpus 8 --gpu-mem 80GB):
    params 12.55 + grads 1.57 + optimizer 9.41 + activations 3.97 + buffers 3.20 = total 30.70 GiB
compile stays off: finetune allows compile=true under zero2 and it trains on CPU, but it was not measured
on a GPU (ddp and fsdp were: faster there); try compile=true and compare the steady tokens/s
(summary.json's tokens_per_s_steady).
"""

from dataclasses import replace

from recipes.llama7b_zero3 import recipe as base

recipe = replace(base, strategy="zero2", output_dir="runs/llama7b_zero2")
