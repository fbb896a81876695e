"""Llama-3.1-8B-Instruct full fine-tune on long chats (32K tokens per row) with Ulysses sequence
parallelism 8 under DeepSpeed ZeRO-3, bf16, activation checkpointing, on one node of 8 x 80 GB GPUs.

    accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama8b_longctx_zero3

Sized for 8 x 80 GB GPUs (A100/H100 80GB). Each 32,768-token row is split across the 8 GPUs (4,096
tokens each; Llama 3.1 8B's 32 attention and 8 key/value heads take sequence_parallel=8), which read the
same rows: one data-parallel rank, the global batch is micro x accum. Without sequence parallelism 32K
tokens fit too, with 8x the activations per GPU.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_longctx_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + activations 3.49 + buffers 6.12 = total 24.57 GiB
The longest row that fits (python -m finetune.plan --recipe llama8b_longctx_zero3 --gpus 8 --gpu-mem 80GB --max-seq-len):
    730,296 tokens with sequence_parallel=8, 91,287 without (sdpa keeps no T^2 scores; activations as
    measured on CPU, docs/benchmarks.md section 11, not yet on a GPU)
compile stays off: finetune refuses compile=true with sequence_parallel > 1 (compiled layers around
Ulysses' all-to-all were not tried).
"""

from dataclasses import replace

from recipes.llama8b_longctx_fsdp import recipe as fsdp

recipe = replace(fsdp, strategy="zero3", output_dir="runs/llama8b_longctx_zero3")
