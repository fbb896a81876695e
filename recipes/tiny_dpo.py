"""DPO on CPU in about a minute: the 2-layer tiny Llama learns to prefer the right answer of a pair
(builtin:tiny-preferences: four toy tasks, each prompt with a correct answer chosen and a wrong one
rejected); the eval's rewards/accuracies climbs well above 0.5.

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_dpo
    python finetune/run.py --recipe tiny_dpo strategy=ddp          # one process

lr 5e-4 and dpo_beta 0.1 (until 2026-11-27: lr 1e-2 and beta 0.5, whose loss reached 0.0000 and grad_norm
0.000 by step 30 of 60, the greedy samples 32 repeats of one letter): the loss falls all the way and the
gradient stays alive. grad_accum=2 (no global_batch_size): a step is 16 pairs on 1 process, 32 on 2.
Measured on a shared 2-core machine, 1 process (strategy=ddp, 16 pairs a step): eval loss 0.693, 0.551,
0.450, 0.431 at steps 0, 20, 40, 60; eval rewards/accuracies 0.00, 1.00, 0.98, 0.98; eval margin 0.00,
0.31, 0.57, 0.63; train loss 0.646 (step 10) to 0.434 (step 60), grad_norm 0.44-0.65 throughout.
2 processes under zero3 (the command above, 32 pairs a step, 2026-11-28): eval loss 0.693, 0.523, 0.405,
0.370; accuracies 0.00, 0.98, 0.98, 0.98; margin 0.00, 0.38, 0.72, 0.83; train loss 0.636 (step 10) to
0.394 (step 60), grad_norm 0.40-1.23. The tiny model starts untrained, so what DPO teaches it is what the
pairs tell apart (the case, letters a-m against n-z), not the words: its 8-token greedy samples go from
noise ('S; 7#"') to the right case and letter range (step 60: Copy: ibmb -> 'kkkkkkkk', Capitals:
mjegee -> 'CJCJCJCJ'). loss.png shows the loss, accuracy and margin, train and eval.

The reference is a frozen copy of the starting weights, partitioned by ZeRO-3 like the policy;
precompute_reference=true, dpo_loss=ipo or simpo, lora=true each change it (docs/preference-tuning.md).
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
