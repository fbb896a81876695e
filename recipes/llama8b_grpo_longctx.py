"""Llama-3.1-8B-Instruct GRPO with long completions (reasoning RL): llama8b_grpo_zero3's GSM8K prompts and
rewards, completions of up to 32,768 tokens after prompts of up to 512, full fine-tune, ZeRO-3, bf16, on
8 x 80 GB GPUs. Sized for 8 x 80 GB GPUs (A100/H100 80GB): 8 prompts a step x 8 completions, 8 per GPU.

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_grpo_longctx

Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_grpo_longctx --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + activations 16.76 + buffers 6.12 = total 37.84 GiB
    rollout: model states 14.96 + gathered weights 14.96 + KV cache 32.50 + prefill 0.53 = rollout peak 62.95 GiB
The longest completion per strategy and sequence_parallel degree (python -m finetune.plan --recipe
llama8b_grpo_longctx --gpus 8 --gpu-mem 80GB --max-seq-len): zero3 36,864 tokens at sequence_parallel=1,
17,920 at 2, 8,448 at 4; with the optimizer and parameters in CPU memory 52,224 at 1. Here the rollout's
KV cache sets the length, and sequence parallelism does not split the rollout: each rank of an SP group
generates its group's completions whole, and SP 2 halves the data-parallel ranks, doubling each one's
completions. sequence_parallel=2 or more (docs/long-context.md) pays where the step's activations set
the length: a smaller batch of longer rows per GPU, or the loss of one long row at a time.
"""

from dataclasses import replace

from recipes.llama8b_grpo_zero3 import recipe as grpo

recipe = replace(grpo, global_batch_size=8, micro_batch_size=1, max_prompt_len=512, max_seq_len=512 + 32768,
                 max_completion_len=32768, output_dir="runs/llama8b_grpo_longctx")
