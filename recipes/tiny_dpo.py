"""DPO on CPU in about a minute: the 2-layer tiny Llama learns to prefer the right answer of a pair
(builtin:tiny-preferences: four toy tasks, each prompt with a correct answer chosen and a wrong one
rejected); the eval's rewards/accuracies climbs well above 0.5.

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_dpo
    python finetune/run.py --recipe tiny_dpo strategy=ddp          # one process

The reference is a frozen copy of the starting weights, partitioned by ZeRO-3 like the policy;
precompute_reference=true, dpo_loss=ipo or simpo, lora=true each change it (README: preference tuning).
About 42 MiB per process by the planner (python -m finetune.plan --recipe tiny_dpo --gpus 2).
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="builtin:tiny-llama",
    dataset="builtin:tiny-preferences",
    dataset_format="preference",
    objective="dpo",
    dpo_loss="sigmoid",
    dpo_beta=0.1,
    eval_fraction=0.05,
    max_seq_len=128,
    strategy="zero3",
    mixed_precision="no",
    micro_batch_size=8,
    grad_accum=2,
    lr=5e-4,
    lr_scheduler="cosine",
    warmup_steps=5,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    max_steps=60,
    seed=42,
    output_dir="runs/tiny_dpo",
    log_every=10,
    eval_every=20,
    eval_at_start=True,
    eval_max_samples=64,
    sample_max_new_tokens=8,  # the longest right answer (6 letters) and its end-of-sequence token, and a bit
)
