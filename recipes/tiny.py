"""The embedded default: a 2-layer Llama-style model learns four toy tasks on CPU in about a minute.

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny
    python finetune/run.py --recipe tiny strategy=fsdp        # one process

Model, tokenizer and data are made locally on first use (see finetune/assets.py): no hub needed.
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="builtin:tiny-llama",
    dataset="builtin:tiny-tasks",
    dataset_format="alpaca",
    eval_fraction=0.05,
    max_seq_len=128,
    packing=False,
    strategy="zero3",
    mixed_precision="no",
    micro_batch_size=8,
    grad_accum=2,
    lr=3e-3,
    lr_scheduler="cosine",
    warmup_steps=10,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=2,
    max_steps=0,
    seed=42,
    output_dir="runs/tiny",
    log_every=10,
    eval_every=40,
    eval_at_start=True,
)
