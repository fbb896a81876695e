"""Llama-3.1-8B-Instruct GRPO on GSM8K (recipes/llama8b_grpo_zero3.py's task, rewards and batch shape) with
generation on GPUs of its own: of 8 x 80 GB GPUs, the last 2 generate and score the rollouts while the other 6
train under FSDP2, each step on a rollout generated from the weights of the step before (max_staleness=1,
TRL's importance-sampling correction on the lag). docs/async-rl.md.

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_grpo_async

48 prompts x 8 completions a step (global_batch_size divides both groups: each generating GPU samples 24
prompts' 192 completions in one batch, each training GPU trains on 8 prompts' 64), 512-token completions
after prompts of up to 512. The trainers push their weights to the generating GPUs after every step (FSDP2
gathers 4 decoder layers at a time, trainer 0 sends them), and both check the push by scoring the same probe.
Sized for 8 x 80 GB GPUs (A100/H100 80GB). Memory per training GPU (its tables plan the 6 training GPUs),
the planner's estimate (python -m finetune.plan --recipe llama8b_grpo_async --gpus 8 --gpu-mem 80GB):
    params 4.99 + grads 4.99 + optimizer 9.97 + activations 4.64 + buffers 8.16 = total 32.75 GiB
and with the lag's 2 kept log-prob copies and the push transient 36.00 GiB; each generating GPU 51.71 GiB (the
model in bf16, the KV cache of its 192 completions, the prefill).
The split (python -m finetune.plan --recipe llama8b_grpo_async --gpus 8 --gpu-mem 80GB --split), modelled
with the H200-calibrated decode and training figures of finetune/split_plan.py:
    gen train  train GiB  gen GiB  gen s  train s  step k=0  step k=1  speed-up
      2     6      36.00    51.71   9.74    12.90     22.68     12.94     1.24x
      4     4      48.46    33.33   7.47    19.35     26.85     19.39     0.83x
      6     2      85.86    27.21   6.71    38.70     45.44     38.74     0.41x  (does not fit: 85.86 GiB)
colocated (every GPU generates, then trains): 16.00 s per step; 2 + 6 at max_staleness=1: 12.94 s, 1.24x; at
max_staleness=0 the same split is slower than colocated (22.68 s: each group waits for the other).
Not yet measured on GPUs (no lent GPU has run a split); a measured colocated step refines the table:
    python -m finetune.plan --recipe llama8b_grpo_async --gpus 8 --gpu-mem 80GB --split \\
        --generation-seconds ROLLOUT_S --training-seconds REST_S
"""

from dataclasses import replace

from recipes.llama8b_grpo_zero3 import recipe as zero3

recipe = replace(
    zero3,
    strategy="fsdp",
    rollout_processes=2,
    max_staleness=1,
    global_batch_size=48,
    output_dir="runs/llama8b_grpo_async",
)
