"""RLOO (TRL's RLOOTrainer: loss_type=rloo) on CPU in a few minutes: tiny_grpo's task (the 2-layer tiny Llama,
untrained, learns from rewards alone to copy a word of 2-4 letters a-m or write it in capitals), with
TRL's RLOO defaults: num_generations=2 completions a prompt, each one's advantage its reward minus the
other's (the leave-one-out baseline), beta=0.05 times its KL to the starting weights (the summed log
ratio of its tokens) taken off its reward, the clipped ratio of whole sequences (epsilon 0.2). 64 prompts
a step (128 completions, as tiny_grpo's 16 x 8). MEASURED

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_rloo
    python finetune/run.py --recipe tiny_rloo strategy=ddp          # one process

rollouts.jsonl in output_dir has every step's prompts, completions, rewards and advantages; docs/rl.md.
"""

from finetune.recipe import Recipe
from finetune.rewards import answer_chars, char_match, exact_match

recipe = Recipe(
    model="builtin:tiny-llama",
    dataset="builtin:tiny-prompts",
    dataset_format="prompt",
    objective="grpo",
    loss_type="rloo",
    reward_funcs=(exact_match, char_match, answer_chars),
    num_generations=2,  # TRL's RLOOConfig default
    beta=0.05,  # TRL's RLOOConfig default: a frozen reference
    temperature=1.0,
    max_completion_len=8,
    eval_fraction=0.02,  # 80 prompts held out; the first 32 evaluated (2 completions each) every 10 steps
    eval_max_samples=32,
    eval_every=10,
    max_seq_len=64,
    strategy="zero3",
    mixed_precision="no",
    micro_batch_size=16,
    global_batch_size=64,
    lr=3e-3,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=60,
    seed=42,
    output_dir="runs/tiny_rloo",
    log_every=5,
    sample_prompts=0,
)
