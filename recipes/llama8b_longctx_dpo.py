"""Llama-3.1-8B-Instruct DPO on long preference pairs (up to 65,536 tokens per sequence) with Ulysses
sequence parallelism 8 under DeepSpeed ZeRO-3, bf16, activation checkpointing, on one node of 8 x 80 GB GPUs.

    accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama8b_longctx_dpo

Each pair's chosen and rejected sequences (one forward of 2 rows) are split across the 8 GPUs (8,192
tokens of each row per GPU at 65,536; Llama 3.1 8B's 32 attention and 8 key/value heads take
sequence_parallel=8), and the frozen reference is partitioned by ZeRO-3 like the policy. The 8 GPUs
read the same pairs: one data-parallel rank, the global batch is micro x accum pairs. Replace the
dataset with your long pairs (UltraFeedback's are short; it is here as the format's example).

Sized for 8 x 80 GB GPUs (A100/H100 80GB).
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama8b_longctx_dpo --gpus 8 --gpu-mem 80GB):
    params 1.87 + grads 1.87 + optimizer 11.22 + reference 1.87 + activations 8.25 + buffers 6.12 = total 31.20 GiB
The longest sequence that fits (... --max-seq-len): 350,296 tokens with sequence_parallel=8, 43,787
without; with activation_offload=true 770,440 and 96,305. Activations as measured on CPU at 2K-16K
tokens (docs/benchmarks.md section 11), not yet on a GPU.
compile stays off: finetune refuses compile=true with sequence_parallel > 1.
"""

from dataclasses import replace

from recipes.llama8b_dpo_zero3 import recipe as dpo

recipe = replace(
    dpo,
    eval_max_samples=256,
    max_seq_len=65536,
    max_prompt_len=0,
    sequence_parallel=8,
    attn_implementation="sdpa",
    micro_batch_size=1,
    global_batch_size=16,
    output_dir="runs/llama8b_longctx_dpo",
    log_every=1,
)
