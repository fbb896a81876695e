"""The tiny default under strategy=ddp (CPU, 2 processes):

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_ddp
"""

from dataclasses import replace

from recipes.tiny import recipe as tiny

recipe = replace(tiny, strategy="ddp", output_dir="runs/tiny_ddp")
