"""Llama-3.1-8B-Instruct GRPO with LoRA (r=16 on every attention and MLP projection) and PyTorch FSDP2,
bf16, on 4 x 48 GB GPUs, on GSM8K's grade-school math questions (openai/gsm8k, config main).

    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama8b_grpo_lora_fsdp

Sized for 4 x 48 GB GPUs (L40S, RTX 6000 Ada, A6000). Each step takes 16 prompts and samples 8
completions of each (128 completions, 32 per GPU, generated in one batch with the whole model gathered
once on each GPU for the rollout: FSDP shards the frozen base too), scored as llama8b_grpo_zero3 scores
them (math-verify against the number after GSM8K's "####", and a \\boxed{} format reward). beta=0: no
reference held (with beta > 0 the reference is the base with the adapter disabled: no second copy).
Needs the math-verify package (pip install math-verify).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_grpo_lora_fsdp --gpus 4 --gpu-mem 48GB):
    params 3.78 + grads 0.04 + optimizer 0.08 + activations 2.06 + buffers 2.81 = total 8.77 GiB
    rollout: model states 3.90 + gathered weights 15.04 + KV cache 4.00 + prefill 2.12 = rollout peak 25.06 GiB
(the planner's cheapest fit here is strategy=ddp, 21.71 GiB: the bf16 base whole on each GPU is no more
than the gathered one; fsdp is the setup whose model states shrink with more GPUs)
With vLLM generating the rollouts (pip install vllm; docs/vllm.md): one engine per GPU built from the base,
pushed the merged weights (base + B @ A x scale; the adapter itself untouched) before each rollout:
    accelerate launch --multi_gpu --num_processes 4 finetune/run.py --recipe llama8b_grpo_lora_fsdp generation_backend=vllm vllm_enable_sleep_mode=true
planner (python -m finetune.plan --recipe llama8b_grpo_lora_fsdp --gpus 4 --gpu-mem 48GB generation_backend=vllm vllm_enable_sleep_mode=true):
    step total 8.77 GiB (the engine asleep); rollout: model states 3.90 + engine 18.96 (bf16 weights 14.96 + KV
    cache 4.00) + push 4.88 = 27.73 GiB per GPU; 27.73 without sleep mode too (the step is smaller)
compile stays off: LoRA with a rollout phase (generation through the gathered, adapted model) was not
measured compiled on a GPU.
"""

from dataclasses import replace

from recipes.llama8b_grpo_zero3 import recipe as full

recipe = replace(
    full,
    strategy="fsdp",
    lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    micro_batch_size=4,
    global_batch_size=16,
    lr=1e-5,
    output_dir="runs/llama8b_grpo_lora_fsdp",
)
