"""recipes/tiny_grpo.py's run with generation on a process of its own: of 3 CPU processes, the last generates
and scores every rollout while the other 2 train (ZeRO-3), each step on a rollout generated from the weights the
step before started from (max_staleness=1; TRL's importance-sampling correction weighs the lag). docs/async-rl.md.

    finetune train tiny_grpo_async --num_processes 3
    accelerate launch --multi_gpu --num_processes 3 finetune/run.py --recipe tiny_grpo_async

Measured on a 2-core CPU machine shared with another helper's job (3 processes on 2 cores: the groups share the
cores, so the split cannot be faster here; bench/studies/async_grpo_overlap.py measures the waits), the first
command above: eval reward at steps 10..60 0.053, 0.076, 0.100, 0.120, 0.136, 0.158 (the colocated recipe's
0.057 .. 0.144); the train reward of those steps' batches 0.038, 0.068, 0.089, 0.089, 0.064, 0.116; every step
trains on a rollout one step stale (sample/staleness_max 1), its importance ratio's mean 0.99-1.03 and none
clipped; 78 s of training (eval 2.6 s) of 205 s in all (summary.json).
"""

from dataclasses import replace

from recipes.tiny_grpo import recipe as colocated

recipe = replace(colocated, rollout_processes=1, max_staleness=1, output_dir="runs/tiny_grpo_async")
