"""On-policy distillation on CPU: the untrained 2-layer tiny Llama (the student) learns builtin:tiny-tasks from
a teacher, the same model trained by the `tiny` recipe (two steps: run `tiny` first, about a minute, then this
recipe reads its final/ as teacher_model). Each step the student samples its own completions of the step's
prompts (lmbda=1, TRL's DistillationTrainer) and moves its next-token distributions towards the teacher's on
them under the reverse KL (distill_beta=1, TRL's default); the eval scores the eval split's dataset answers
(the first 64 of 80 held-out rows). Measured on a 2-core CPU machine, 2 processes under ZeRO-3 (the commands
below; the teacher from the first): the eval divergence at steps 0, 25, 50, ..., 200: 2.889, 1.949, 1.413,
1.262, 1.105, 0.937, 0.574, 0.436, 0.389, and the student's top-1 agreement with the teacher on the eval
answers 0.003, 0.203, 0.203, 0.253, 0.271, 0.259, 0.303, 0.368, 0.353; the student's completions shorten from
16 tokens (never stopping) to about 4 as it learns where the teacher ends an answer. 97 s of training, 113 s
in all (`tiny` itself: 64 s).

    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny        # the teacher
    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe tiny_distill
    python finetune/run.py --recipe tiny_distill strategy=ddp teacher_model=runs/tiny/final   # one process

docs/distillation.md: the data, the keys and the figures of this recipe.
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="builtin:tiny-llama",
    teacher_model="runs/tiny/final",
    dataset="builtin:tiny-tasks",
    dataset_format="alpaca",
    objective="distill",
    lmbda=1.0,
    distill_beta=1.0,
    temperature=1.0,
    max_completion_len=16,
    eval_fraction=0.02,
    eval_max_samples=64,
    eval_every=25,
    eval_at_start=True,
    max_seq_len=128,
    strategy="zero3",
    mixed_precision="no",
    micro_batch_size=8,
    grad_accum=2,
    lr=3e-3,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=200,
    seed=42,
    output_dir="runs/tiny_distill",
    log_every=10,
    sample_prompts=0,
)
