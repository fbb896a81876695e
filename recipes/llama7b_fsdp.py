"""Llama-2-7B full fine-tune with FSDP2 (PyTorch), bf16, on 8 x 80 GB GPUs; derived from llama7b_zero3.

    accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama7b_fsdp
"""

from dataclasses import replace

from recipes.llama7b_zero3 import recipe as base

recipe = replace(base, strategy="fsdp", output_dir="runs/llama7b_fsdp")
