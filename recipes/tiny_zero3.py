"""The tiny default under strategy=zero3 (CPU, 2 processes):

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_zero3
"""

from dataclasses import replace

from recipes.tiny import recipe as tiny

recipe = replace(tiny, strategy="zero3", output_dir="runs/tiny_zero3")
