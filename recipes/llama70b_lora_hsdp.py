"""Llama-3.1-70B-Instruct LoRA (r=16 on every attention and MLP projection) on 4 nodes x 8 GPUs (80 GB),
hybrid sharded: the bf16 base and the adapters sharded over each node's 8 GPUs, the 4 nodes replicas of
one another (strategy=hsdp, shard_size=8; docs/multi-node.md).

    sbatch --nodes 4 scripts/slurm_multinode.sbatch llama70b_lora_hsdp

which runs on each node R (0-3), NODE0 the first:

    accelerate launch --multi_gpu --num_machines 4 --num_processes 32 --machine_rank R --main_process_ip NODE0 finetune/run.py --recipe llama70b_lora_hsdp

Sized for 32 x 80 GB GPUs (4 nodes of 8 H100 or A100 80 GB) and 400 Gb/s per GPU between nodes.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama70b_lora_hsdp --gpus 32 --gpu-mem 80GB):
    params 16.52 + grads 0.10 + optimizer 0.19 + activations 3.56 + buffers 7.20 = total 27.57 GiB
The layout is the planner's choice for this cluster (python -m finetune.plan --recipe llama70b_lora_hsdp
--nodes 4 --gpus-per-node 8): each node holds a whole copy of the model, so every layer's all-gather stays
on the node's NVLink; across nodes each GPU all-reduces its 1/8 of the adapters' gradients once per step:
155 MB per GPU per step, against 544 GB that flat fsdp or zero3 over 32 GPUs would send across nodes. With
400 Gb/s per GPU across nodes and NVLink 4 inside, the planner's communication per step, nothing
overlapped: hsdp 1.1 s, zero3 + hpZ 3.6 s, fsdp and zero3 11 s; ddp and zero1/2 do not fit (the whole bf16
base on every GPU). Not measured on a cluster: docs/multi-node.md says what a
measurement needs.
"""

from dataclasses import replace

from finetune.recipe import FIELDS, Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-70B-Instruct",
    dataset="tatsu-lab/alpaca",
    dataset_format="alpaca",
    eval_fraction=0.02,
    max_seq_len=2048,
    packing=True,
    strategy="hsdp",
    shard_size=8,  # one node's 8 GPUs shard the model; the 4 nodes replicate it (0: a node, whatever its size)
    mixed_precision="bf16",
    activation_checkpointing=True,
    micro_batch_size=1,
    global_batch_size=64,  # 2 micro-batches per GPU per step on 32 GPUs
    lr=1e-4,
    lr_scheduler="cosine",
    warmup_steps=20,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama70b_lora_hsdp",
    sample_prompts=0,  # samples at eval gather the whole 70B model on each GPU: 141 GB, it would not fit
    log_every=5,
    eval_every=100,
    save_every=100,
    keep_last=2,
)

LORA = dict(lora=True, lora_r=16, lora_alpha=32, lora_dropout=0.05)
recipe = replace(recipe, **{k: v for k, v in LORA.items() if k in FIELDS})
