"""Llama-3.1-8B-Instruct GRPO with a calculator tool over several turns, full fine-tune, with DeepSpeed ZeRO-3,
bf16, on 8 x 80 GB GPUs, on GSM8K's grade-school math questions (openai/gsm8k, config main), rewarded for
the right final answer.

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_grpo_tools_zero3

Each question (GSM8K's `question`, a text prompt: the user's message) is rendered by Llama 3.1's chat
template with the calculator's schema (finetune.tools:calculator: + - * / // % ** and parentheses); the
model calls it as Llama 3.1 writes calls ({"name": "calculator", "parameters": {"expression": "..."}},
read by finetune/tools.py's llama3_json format), the answer comes back as an `ipython` turn, masked out
of the loss, and the model goes on, for at most 4 rounds of calls and max_completion_len=1024 tokens
in all (its turns and the calculator's answers together, TRL's budget). Rewarded as llama8b_grpo_zero3: the
math answer of the last turn against the number after GSM8K's "####", and a \\boxed{} format reward
weighted 0.2. Before the first rollout the template's prefix check passes (docs/agents.md): Llama 3.1's
template renders each turn as the model writes it. Each step takes 64 prompts and samples 8 conversations
of each (64 per GPU, generated in one batch with the whole model gathered once on each GPU; the KV cache of
each conversation goes on across its turns). Needs the math-verify package (pip install math-verify).
Sized for 8 x 80 GB GPUs (H100 or A100 80 GB): the rollout's peak, not the step's, sets the size.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_grpo_tools_zero3 --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + activations 7.22 + buffers 6.12 = total 28.30 GiB
    rollout: model states 14.96 + gathered weights 14.96 + KV cache 14.00 + prefill 6.38 = rollout peak 50.29 GiB
The rollout's KV cache is the longest conversation's, prompt (with the tool's schema) and 1,024 tokens
of turns and tool answers, for each of the GPU's 64 conversations.
"""

from finetune.recipe import DataSource, Recipe
from finetune.tools import calculator

from recipes.llama8b_grpo_zero3 import GSM8K, boxed_format, gsm8k_answer

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    datasets=(DataSource(split="train", **GSM8K),),
    eval_dataset=DataSource(split="test", **GSM8K),
    eval_max_samples=256,
    objective="grpo",
    tools=(calculator,),
    max_tool_calling_iterations=4,
    tool_timeout=10.0,
    reward_funcs=(gsm8k_answer, boxed_format),
    reward_weights=(1.0, 0.2),
    num_generations=8,
    max_completion_len=1024,
    max_prompt_len=768,
    max_seq_len=1792,
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
    output_dir="runs/llama8b_grpo_tools_zero3",
    log_every=1,
    eval_every=50,
    save_every=50,
    keep_last=2,
)
