"""The tiny default with Ulysses sequence parallelism (CPU, 2 processes): each row split across both
ranks, which read the same rows (one data-parallel rank), under strategy=zero3:

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_sp
"""

from dataclasses import replace

from recipes.tiny import recipe as tiny

recipe = replace(tiny, strategy="zero3", sequence_parallel=2, output_dir="runs/tiny_sp")
