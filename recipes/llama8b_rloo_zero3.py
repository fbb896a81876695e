"""Llama-3.1-8B-Instruct RLOO (TRL's RLOOTrainer: loss_type=rloo), full fine-tune, DeepSpeed ZeRO-3, bf16, on
8 x 80 GB GPUs: llama8b_grpo_zero3's GSM8K prompts, rewards and batch, with RLOO's leave-one-out baseline
(each completion's reward less the mean of its group's other 7) and TRL's RLOO KL penalty in the reward
(beta=0.05: a frozen reference, partitioned by ZeRO-3 like the policy). Sized for 8 x 80 GB GPUs (A100/H100 80GB).

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_rloo_zero3

Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_rloo_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + reference 1.87 + activations 4.64 + buffers 6.12 = total 27.59 GiB
    rollout: model states 14.96 + reference 1.87 + gathered weights 14.96 + KV cache 8.00 + prefill 4.25 = rollout peak 44.04 GiB
(the planner would run zero2, 55.25 GiB per GPU: less communication, and it fits)
"""

from dataclasses import replace

from recipes.llama8b_grpo_zero3 import recipe as grpo

recipe = replace(grpo, loss_type="rloo", beta=0.05, output_dir="runs/llama8b_rloo_zero3")
