"""On-policy distillation of Llama-3.1-70B-Instruct into Llama-3.1-8B-Instruct (one tokenizer, 128,256 tokens),
full fine-tune of the student with DeepSpeed ZeRO-3, bf16, on 8 x 80 GB GPUs, on GSM8K's questions (openai/gsm8k,
config main; the worked answers are the off-policy completions when lmbda < 1).

    accelerate launch --multi_gpu --num_processes 8 finetune/run.py --recipe llama8b_distill_from_70b

Sized for 8 x 80 GB GPUs (A100/H100 80GB). Each step the student samples one completion of up to 512 tokens for
each of the step's 64 questions (8 per GPU, generated in one batch with the student gathered once on each GPU),
and learns the teacher's next-token distribution at every completion token under the reverse KL (distill_beta=1,
TRL's default). The teacher is partitioned by ZeRO-3 beside the student, in bf16 (17.6 GB per GPU), and is
never written to the checkpoints. The divergence is computed a chunk of tokens at a time inside the output
layers (finetune/divergence.py): the two models' 128K-vocabulary logits never exist whole; the teacher's
output layer is copied whole for the loss (2 GiB). docs/distillation.md.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_distill_from_70b --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + teacher 16.43 + activations 4.64 + buffers 8.08 = total 44.11 GiB
    rollout: model states 14.96 + teacher 16.43 + gathered weights 14.96 + KV cache 1.50 + prefill 1.06 = rollout peak 48.90 GiB
compile stays off: finetune refuses compile=true under zero3.
"""

from finetune.recipe import DataSource, Recipe

GSM8K = dict(path="openai/gsm8k", config="main", format="prompt_completion",
             columns={"prompt": "question", "completion": "answer"})

recipe = Recipe(
    model="meta-llama/Llama-3.1-8B-Instruct",
    teacher_model="meta-llama/Llama-3.1-70B-Instruct",
    datasets=(DataSource(split="train", **GSM8K),),
    eval_dataset=DataSource(split="test", **GSM8K),
    eval_max_samples=256,
    objective="distill",
    lmbda=1.0,
    distill_beta=1.0,
    temperature=1.0,
    max_completion_len=512,
    max_seq_len=1024,
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
    output_dir="runs/llama8b_distill_from_70b",
    log_every=1,
    eval_every=50,
    save_every=50,
    keep_last=2,
)
