"""Model and tokenizer loading: a hub id, a local directory, or a builtin asset, all through
`from_pretrained`, so the embedded default exercises the same path as a 70B hub model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.assets import resolve_model
from finetune.data import IGNORE
from finetune.recipe import Recipe, RecipeError, chat_template_text


def load_config(recipe: Recipe):
    """Only the config: cheap, and enough to size DeepSpeed buckets and name FSDP's wrap units."""
    from transformers import AutoConfig

    path = resolve_model(recipe.model)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise RecipeError(f"model={recipe.model}: cannot read its config ({str(e).splitlines()[0]}); "
                          "offline? set HF_HUB_OFFLINE=0 or give a local directory") from None
    return path, config


def no_split_modules(config) -> list[str]:
    """The decoder-layer class names, which FSDP wraps as its units."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = list(getattr(skeleton, "_no_split_modules", None) or [])
    if not names:
        raise RecipeError(f"model type {config.model_type} does not name its decoder layers (_no_split_modules); "
                          "FSDP cannot tell what to wrap: use a ZeRO strategy")
    return names


def load_tokenizer(recipe: Recipe, model_path: str):
    """The model's tokenizer, or the recipe's `tokenizer`; the recipe's `chat_template` replaces the
    one it ships (and is saved with the checkpoints and final/, so the model keeps the template it
    was trained with)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.tokenizer) if recipe.tokenizer else model_path)
    template = chat_template_text(recipe)
    if template is not None:
        tokenizer.chat_template = template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_dtype(recipe: Recipe) -> torch.dtype:
    """fp32 master weights for everything that trains; a LoRA run's frozen base is only ever computed
    with, so it is held in the training precision (2 bytes per parameter under bf16/fp16)."""
    if recipe.lora and recipe.mixed_precision != "no":
        return torch.bfloat16 if recipe.mixed_precision == "bf16" else torch.float16
    return torch.float32


def load_model(recipe: Recipe, model_path: str, config, weights_on_this_rank: bool = True):
    """fp32 master weights (see base_dtype); mixed precision is autocast (DDP/FSDP) or DeepSpeed's bf16 engine.

    Under ZeRO-3 `from_pretrained` partitions weights as it reads them (the Accelerator made before
    this call switched on deepspeed.zero.Init). Under FSDP only rank 0 reads them: the other ranks
    build the skeleton with parameters on the meta device (buffers stay real, they are not
    broadcast) and receive their shards from rank 0 when Accelerate prepares the model.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        if recipe.load_in_4bit:
            model = _load_4bit(recipe, model_path)
        elif weights_on_this_rank:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=base_dtype(recipe), attn_implementation=recipe.attn_implementation)
        else:
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(
                    config, dtype=base_dtype(recipe), attn_implementation=recipe.attn_implementation)
            # init_empty_weights re-creates every parameter on the meta device, which unties tied
            # embeddings (Qwen2.5, Llama 3.2, Gemma); FSDP then finds an lm_head rank 0 does not have.
            model.tie_weights()
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        raise RecipeError(f"attn_implementation={recipe.attn_implementation}: model type {config.model_type} does "
                          "not support it in this transformers version; set attn_implementation=eager") from None
    model.config.use_cache = False
    if recipe.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if recipe.lora:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    if recipe.lora:
        model = add_lora(model, recipe)
    return model


def _load_4bit(recipe: Recipe, model_path: str):
    """QLoRA: the frozen base in 4-bit NF4 on this process's GPU, computing in the recipe's precision."""
    import os

    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = torch.bfloat16 if recipe.mixed_precision == "bf16" else torch.float16
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quant,
                                                 device_map={"": int(os.environ.get("LOCAL_RANK", "0"))},
                                                 attn_implementation=recipe.attn_implementation)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.activation_checkpointing)


def is_default_lora_target(name: str, module) -> bool:
    short = name.rsplit(".", 1)[-1]
    return (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and short != "gate"
            and not short.endswith("_gate"))


def lora_targets(model, recipe: Recipe) -> list[str]:
    """The recipe's modules, else every Linear inside the decoder layers: the attention and MLP
    projections, fused ones included (Phi-3's qkv_proj, gate_up_proj), but not a mixture of experts'
    router or shared-expert gate (`gate`, `*_gate`), which pick experts rather than transform tokens.
    Experts held as one 3-D parameter (transformers 5's Mixtral, Qwen-MoE) are no Linear and stay frozen."""
    if recipe.lora_target_modules:
        return list(recipe.lora_target_modules)
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if is_default_lora_target(name, module)}
    if not names:
        raise RecipeError(f"found no Linear layers inside {type(model).__name__}'s decoder layers to put LoRA on; "
                          "name them with lora_target_modules=")
    return sorted(names)


def add_lora(model, recipe: Recipe):
    """peft LoRA on the frozen base. Works on a meta-device skeleton too (FSDP ranks other than 0):
    the adapter weights then arrive with rank 0's broadcast like every other weight."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, recipe)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise RecipeError(f"lora_target_modules: {', '.join(missing)} not found in {type(model).__name__}; "
                          f"it has for example {', '.join(sorted(present - {''})[:8])}")
    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, config, autocast_adapter_dtype=True)  # adapters in fp32 on a 16-bit base


def loss_sum(model, batch: dict, impl: str = "chunked", chunk: int = 0, aux: list | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over target tokens: the caller divides by the
    target tokens of the whole global batch, so every split of that batch gives the same update.
    impl and chunk are the recipe's loss_impl and loss_chunk_tokens; finetune/loss.py says how each works;
    aux collects a mixture of experts' router loss (see loss.router_aux_loss)."""
    from finetune import loss

    return loss.loss_sum(model, batch, impl, chunk or None, aux)
