"""recipes/tiny_grpo.py's run with generation on a process of its own: of 3 CPU processes, the last generates
and scores every rollout while the other 2 train (ZeRO-3), each step on a rollout generated from the weights the
step before started from (max_staleness=1; TRL's importance-sampling correction weighs the lag). docs/async-rl.md.

    finetune train tiny_grpo_async --num_processes 3
    accelerate launch --multi_gpu --num_processes 3 finetune/run.py --recipe tiny_grpo_async

MEASURED
"""

from dataclasses import replace

from recipes.tiny_grpo import recipe as colocated

recipe = replace(colocated, rollout_processes=1, max_staleness=1, output_dir="runs/tiny_grpo_async")
