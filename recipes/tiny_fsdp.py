"""The tiny default under strategy=fsdp (CPU, 2 processes):

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_fsdp
"""

from dataclasses import replace

from recipes.tiny import recipe as tiny

recipe = replace(tiny, strategy="fsdp", output_dir="runs/tiny_fsdp")
