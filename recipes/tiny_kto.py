"""KTO on CPU in about a minute: the 2-layer tiny Llama learns from unpaired rows (builtin:tiny-kto: the
tiny preference tasks, each row a prompt and one answer, the right one labelled desirable or a wrong one
labelled undesirable, half and half): rewards/chosen climbs above 0 and rewards/rejected falls below it.

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_kto
    python finetune/run.py --recipe tiny_kto strategy=ddp          # one process

Measured (2 processes under zero3, the command above; a shared 2-core machine under load, 51 s of training,
71 s in all): eval loss 0.500, 0.457, 0.425, 0.418 at steps 0, 20, 40, 60; eval rewards/chosen 0.00, 0.20,
0.30, 0.33 and rewards/rejected 0.00, -0.15, -0.30, -0.33 (margin 0.00, 0.35, 0.61, 0.66); train loss 0.488
(step 10) to 0.413 (step 60), grad_norm 0.15-0.18 throughout. The KL estimate (the policy against the
reference on mismatched prompts and answers, clamped at 0) stays small and noisy on these short answers:
eval kl 0.00, 0.20, 0.00, 0.00, train kl between 0 and 0.67 at the logged steps. As with tiny_dpo, what the untrained tiny
model learns is what tells the labels apart (the case, letters a-m against n-z): its greedy answers go
from noise to the right case and letter range ('Capitals: bbkl' -> 'GGGGGGGC'). loss.png shows the loss,
rewards/chosen, rewards/rejected and kl, train and eval.

The reference is a frozen copy of the starting weights, partitioned by ZeRO-3 like the policy;
precompute_reference=true, lora=true or kto_loss=apo_zero_unpaired change it (docs/kto.md).
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="builtin:tiny-llama",
    dataset="builtin:tiny-kto",
    dataset_format="unpaired",
    objective="kto",
    kto_loss="kto",
    kto_beta=0.1,
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
    output_dir="runs/tiny_kto",
    log_every=10,
    eval_every=20,
    eval_at_start=True,
    eval_max_samples=64,
    sample_max_new_tokens=8,
)
