"""Llama-3.1-70B-Instruct DPO with QLoRA (a 4-bit NF4 base, LoRA r=16 on every attention and MLP
projection) and PyTorch FSDP2, bf16, on 2 GPUs of 48 GB, on UltraFeedback's binarized preference pairs.

    pip install -e .[qlora]        # bitsandbytes
    accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe llama70b_dpo_qlora_fsdp

Sized for 2 x 48 GB GPUs (RTX 6000 Ada, A6000, L40S). The reference is the 4-bit base with the adapter
disabled (no second copy); FSDP shards the base as in llama70b_qlora_fsdp. Each micro batch is 1 pair:
2 sequences of up to 1024 tokens in one forward.
Memory per GPU, the planner's estimate (python -m finetune.plan --recipe llama70b_dpo_qlora_fsdp --gpus 2 --gpu-mem 48GB):
    params 19.29 + grads 0.39 + optimizer 0.77 + activations 3.56 + buffers 5.54 = total 29.55 GiB
compile stays off: finetune refuses compile=true for a 4-bit base under fsdp (bitsandbytes re-attaches
each sharded weight's quantization state inside the layer, a graph break at every Linear).
"""

from finetune.recipe import Recipe

recipe = Recipe(
    model="meta-llama/Llama-3.1-70B-Instruct",
    dataset="HuggingFaceH4/ultrafeedback_binarized",
    dataset_split="train_prefs",
    dataset_format="preference",
    eval_dataset="HuggingFaceH4/ultrafeedback_binarized",
    eval_split="test_prefs",
    eval_max_samples=500,
    sample_prompts=0,
    objective="dpo",
    dpo_loss="sigmoid",
    dpo_beta=0.1,
    max_seq_len=1024,
    max_prompt_len=512,
    strategy="fsdp",
    mixed_precision="bf16",
    activation_checkpointing=True,
    lora=True,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    load_in_4bit=True,
    micro_batch_size=1,
    global_batch_size=32,
    lr=5e-6,
    lr_scheduler="cosine",
    warmup_steps=10,
    weight_decay=0.0,
    max_grad_norm=1.0,
    epochs=1,
    output_dir="runs/llama70b_dpo_qlora_fsdp",
    log_every=10,
    eval_every=100,
    save_every=100,
    keep_last=2,
)
