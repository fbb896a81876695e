"""Llama-2-7B full fine-tune on ONE 24 GB GPU: DeepSpeed ZeRO-3 with optimizer and parameters offloaded to
CPU memory (ZeRO-Offload), bf16; derived from llama7b_zero3.

    python finetune/run.py --recipe llama7b_zero3_offload

Sized for 1 x 24 GB GPU (RTX 4090, A10G, L4) and a host with at least 192 GB of RAM: the CPU holds the
weights, gradients and Adam states (about 20 bytes per parameter, 126 GiB). Expect each step to be many
times slower than on GPUs that hold the states (CPU Adam; see ../shared/reference/figures.md).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama7b_zero3_offload --gpus 1 --gpu-mem 24GB):
    params 0.00 + grads 0.00 + optimizer 0.00 + activations 3.97 + buffers 1.16 = total 5.13 GiB;
    offloaded to CPU 125.51 GiB
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces: no fusion, slower than eager); strategy=fsdp shards the
same way and compiles.
"""

from dataclasses import replace

from recipes.llama7b_zero3 import recipe as base

recipe = replace(base, offload_optimizer="cpu", offload_params="cpu", output_dir="runs/llama7b_zero3_offload")
