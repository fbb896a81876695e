"""Llama-2-7B full fine-tune with PyTorch FSDP2 and CPU offload (parameters, gradients and optimizer in CPU
memory; the optimizer steps on the CPU), bf16, on 4 x 24 GB GPUs; derived from llama7b_fsdp.

    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama7b_fsdp_offload

Sized for 4 x 24 GB GPUs (RTX 4090, A10G, L4) and a host with at least 160 GB of RAM (25 GiB of states per
GPU, plus one full fp32 copy of the model on rank 0 while loading). Without offload FSDP needs 16 P / 4 =
25 GiB of states per GPU and does not fit. If DeepSpeed is available, the planner ranks ZeRO-3 with only the
optimizer offloaded (strategy=zero3 offload_optimizer=cpu offload_params=none, 12.30 GiB) cheaper.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama7b_fsdp_offload --gpus 4 --gpu-mem 24GB):
    params 0.00 + grads 0.00 + optimizer 0.00 + activations 3.97 + buffers 1.62 = total 5.59 GiB;
    offloaded to CPU 25.10 GiB
compile stays off (llama7b_fsdp has it on): compiled layers with FSDP2's CPU offload were not tried, and the
step here is bound by the CPU optimizer and the host copies, not by what compile fuses.
"""

from dataclasses import replace

from recipes.llama7b_fsdp import recipe as base

recipe = replace(base, offload_params="cpu", compile=False, output_dir="runs/llama7b_fsdp_offload")
