"""Llama-3.1-8B-Instruct GRPO, full fine-tune, with DeepSpeed ZeRO-3, bf16, on 8 x 80 GB GPUs, on GSM8K's
grade-school math questions (openai/gsm8k, config main), rewarded for the right final answer.

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_grpo_zero3

Sized for 8 x 80 GB GPUs (A100/H100 80GB). Each step takes 64 prompts and samples 8 completions of
each (512 completions, 64 per GPU, generated in one batch with the whole model gathered once on each
GPU for the rollout), scored by the math answer check against the number after GSM8K's "####" and a
format reward for a \\boxed{} answer (Llama 3.1's habit on math). beta=0: no reference held. GSM8K's
`question` column is mapped onto `prompt` (a text prompt, the model's BOS then the question); its
`answer` column goes to the reward functions. Needs the math-verify package (pip install math-verify).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_grpo_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + activations 4.64 + buffers 6.12 = total 25.72 GiB
    rollout: model states 14.96 + gathered weights 14.96 + KV cache 8.00 + prefill 4.25 = rollout peak 42.17 GiB
With vLLM generating the rollouts (pip install vllm; docs/vllm.md): one engine per GPU, bf16, pushed the
trained weights 4 layers at a time before each rollout, asleep during the step:
    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_grpo_zero3 generation_backend=vllm vllm_enable_sleep_mode=true
planner (python -m finetune.plan --recipe llama8b_grpo_zero3 --gpus 8 --gpu-mem 80GB generation_backend=vllm vllm_enable_sleep_mode=true):
    step total 25.72 GiB (the engine asleep); rollout: model states 14.96 + engine 22.96 (bf16 weights 14.96 +
    KV cache 8.00; vllm_gpu_memory_utilization=0.3 of the GPU while awake) + push 4.88 = 42.79 GiB per GPU;
    without sleep mode the engine keeps its share through the step: 48.68 GiB
compile stays off: finetune refuses compile=true under zero3 (ZeRO-3's gather hook before each Linear
and norm breaks a compiled layer into pieces).
"""

import re

from finetune.recipe import DataSource, Recipe
from finetune.rewards import completion_text, math_answer

BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def gsm8k_answer(completions, answer, **kwargs):
    """math_answer against GSM8K's final answer: the number after the worked solution's '####'."""
    return math_answer(completions, [str(a).rsplit("####", 1)[-1].strip() for a in answer])


def boxed_format(completions, **kwargs):
    """1.0 where the completion gives its answer in \\boxed{...}, else 0.0."""
    return [1.0 if BOXED.search(completion_text(c)) else 0.0 for c in completions]


GSM8K = dict(path="openai/gsm8k", config="main", format="prompt", columns={"prompt": "question"})

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    datasets=(DataSource(split="train", **GSM8K),),
    eval_dataset=DataSource(split="test", **GSM8K),
    eval_max_samples=256,
    objective="grpo",
    reward_funcs=(gsm8k_answer, boxed_format),
    reward_weights=(1.0, 0.2),
    num_generations=8,
    max_completion_len=512,
    max_prompt_len=512,
    max_seq_len=1024,
    temperature=1.0,
    loss_type="dapo",
    beta=0.0,
    strategy="zero3",
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=8,
    global_batch_size=64,
    lr=1e-6,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama8b_grpo_zero3",
    log_every=1,
    eval_every=50,
    save_every=50,
    keep_last=2,
)
