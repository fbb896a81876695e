"""Model and tokenizer loading: a hub id, a local directory, or a builtin asset, all through
`from_pretrained`, so the embedded default exercises the same path as a 70B hub model."""

from __future__ import annotations

import torch

from finetune import loss
from finetune.arch import is_default_lora_target
from finetune.assets import resolve_model
from finetune.recipe import Recipe, RecipeError, chat_template_text
from finetune.strategy import strategy_for
from finetune.unwrap import hf_model, without_zero3_init  # noqa: F401 (export.py imports it from here)


def load_config(recipe: Recipe):
    """Only the config: cheap, and enough to size DeepSpeed buckets and name FSDP's wrap units."""
    from transformers import AutoConfig

    path = resolve_model(recipe.model)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise RecipeError(f"model={recipe.model}: cannot read its config ({str(e).splitlines()[0]}); "
                          "offline? set HF_HUB_OFFLINE=0 or give a local directory") from None
    if recipe.objective == "reward":
        config = reward_config(config, load_tokenizer(recipe, path).pad_token_id, recipe.model)
    return path, config


def reward_config(config, pad_token_id: int, name: str = ""):
    """objective=reward: the model's config as its sequence-classification model's (transformers'
    AutoModelForSequenceClassification): one label (the reward), the class in `architectures` (what
    every checkpoint's hf/ and final/ record, and what export rebuilds), and the tokenizer's pad id,
    which the model needs to find each row's last real token (the one it scores); TRL's RewardTrainer
    sets the same. A copy: the causal LM's config is not changed."""
    import copy

    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if cls is None:
        raise RecipeError(f"objective=reward with model={name or config.model_type}: model type {config.model_type} "
                          "has no sequence-classification class in transformers (AutoModelForSequenceClassification); "
                          "use a model that has one (Llama, Qwen, Mistral, Gemma, ...)")
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.architectures = [cls]
    config.pad_token_id = pad_token_id
    text = config.get_text_config()
    if text is not config:
        text.pad_token_id = pad_token_id
    return config


def is_reward_config(config) -> bool:
    """Whether a config is a reward model's (reward_config): a sequence-classification class, one label."""
    return any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or []) \
        and getattr(config, "num_labels", None) == 1


def model_class(config):
    """The transformers Auto class a model of this config is built with: a reward model's or a causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if is_reward_config(config) else AutoModelForCausalLM


def init_score_head(model, seed: int) -> None:
    """A reward model's score head drawn from its own generator seeded by the run's seed, with the
    distribution transformers gives it (normal, std initializer_range, as _init_weights): the same
    starting head on any number of processes and under any strategy (from_pretrained would draw it from
    the global generator, where a ZeRO-3 or meta-device load draws differently). Every rank computes
    the same values; a ZeRO-3 partitioned head is gathered, set and partitioned again. A meta-device
    skeleton (FSDP ranks other than 0) is skipped: those ranks receive rank 0's."""
    head = hf_model(model).score
    weight = head.weight
    if weight.is_meta:
        return
    std = getattr(model.config.get_text_config(), "initializer_range", None) or 0.02
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * std
    if hasattr(weight, "ds_id"):  # ZeRO-3: partitioned
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            with torch.no_grad():
                weight.copy_(values.to(weight.dtype))
    else:
        with torch.no_grad():
            weight.copy_(values.to(weight.dtype))
    if getattr(head, "bias", None) is not None and not head.bias.is_meta and not hasattr(head.bias, "ds_id"):
        with torch.no_grad():
            head.bias.zero_()


# Model types (transformers 5.x) whose layers carry state along the sequence (state-space, recurrent,
# convolutional or linear-attention layers), or whose attention is not masked from position ids
# (masking_utils.find_packed_sequence_indices): examples concatenated into one row would leak into one
# another whatever the position ids say. Read from transformers' modeling files: the causal LMs that
# build no mask through masking_utils, and those with mamba/conv/linear-attention layers.
SEQUENCE_STATE_MODELS = frozenset({
    "bailing_hybrid", "bamba", "cpmant", "falcon_h1", "falcon_mamba", "fuyu", "glm5_next", "granitemoehybrid",
    "inkling", "inkling2", "jamba", "kimi_linear", "kosmos2", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2",
    "minimax", "nemotron_h", "olmo_hybrid", "prophetnet", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp",
    "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2"})


def concatenation_problem(recipe: Recipe, config) -> str | None:
    """packing=true and padding_free=true put several examples in one row and keep them apart only
    through the position ids; a model that cannot is refused (one line), not trained on leaking rows."""
    model_type = getattr(config, "model_type", "")
    if not (recipe.packing or recipe.padding_free) or model_type not in SEQUENCE_STATE_MODELS:
        return None
    keys = " and ".join(f"{k}=true" for k in ("packing", "padding_free") if getattr(recipe, k))
    return (f"{keys} with model type {model_type}: its layers carry state along the row (or its attention ignores "
            "position ids), so examples concatenated in one row would see one another; set packing=false "
            "padding_free=false (padded rows, one example each)")


# Where a config states how many positions the model has (GPT-2's n_positions and n_ctx, others'
# max_sequence_length or seq_length); a multimodal config states it in its text config.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(config) -> int | None:
    """How many positions the model has, prompt and answer together; None where its config says not."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sample_length_problem(recipe: Recipe, config) -> str | None:
    """sample_max_new_tokens that no prompt can leave room for: even a one-token prompt and that many
    new tokens exceed the model's positions. (Each sample is also cut where its prompt and answer
    fill the context: finetune/generation.py.)"""
    context = context_length(config)
    if not recipe.sample_prompts or context is None or recipe.sample_max_new_tokens < context:
        return None
    return (f"sample_max_new_tokens={recipe.sample_max_new_tokens} can never fit: the model has {context} positions "
            f"(its config's context), the prompt included, so at most {context - 1} new tokens follow even a "
            f"one-token prompt; lower sample_max_new_tokens (or sample_prompts=0: no samples)")


def load_tokenizer(recipe: Recipe, model_path: str):
    """The model's tokenizer, or the recipe's `tokenizer`; the recipe's `chat_template` replaces the
    one it ships (and is saved with the checkpoints and final/, so the model keeps the template it
    was trained with)."""
    from transformers import AutoTokenizer

    source = resolve_model(recipe.tokenizer) if recipe.tokenizer else model_path
    tokenizer = AutoTokenizer.from_pretrained(source)
    template = chat_template_text(recipe)
    if template is not None:
        tokenizer.chat_template = template
    # where the template came from, for the one line that says it failed (data._template_failed)
    tokenizer.chat_template_source = (f"the tokenizer's, in {source}" if template is None else "chat_template="
                                      + (recipe.chat_template if template != recipe.chat_template else "<the text>"))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_dtype(recipe: Recipe) -> torch.dtype:
    """fp32 master weights for everything that trains; a LoRA run's frozen base is only ever computed
    with, so it is held in the training precision (2 bytes per parameter under bf16/fp16)."""
    if recipe.lora and recipe.mixed_precision != "no":
        return torch.bfloat16 if recipe.mixed_precision == "bf16" else torch.float16
    return torch.float32


def load_model(recipe: Recipe, model_path: str, config, weights_on_this_rank: bool = True,
               dtype: torch.dtype | None = None):
    """fp32 master weights (see base_dtype); mixed precision is autocast (DDP/FSDP) or DeepSpeed's bf16 engine.

    Under ZeRO-3 `from_pretrained` partitions weights as it reads them (the Accelerator made before
    this call switched on deepspeed.zero.Init). Under FSDP only rank 0 reads them: the other ranks
    build the skeleton with parameters on the meta device (buffers stay real, they are not
    broadcast) and receive their shards from rank 0 when Accelerate prepares the model. dtype: instead
    of base_dtype (a DPO reference is held in the compute dtype).
    """
    from accelerate import init_empty_weights

    reward = is_reward_config(config)  # objective=reward: a sequence-classification model (reward_config)
    auto = model_class(config)
    try:
        if recipe.load_in_4bit:
            model = _load_4bit(recipe, model_path, config, weights_on_this_rank)
        elif weights_on_this_rank:
            model = auto.from_pretrained(model_path, dtype=dtype or base_dtype(recipe),
                                         attn_implementation=recipe.attn_implementation,
                                         **({"config": config} if reward else {}))
        else:
            with init_empty_weights(include_buffers=False):
                model = auto.from_config(
                    config, dtype=dtype or base_dtype(recipe), attn_implementation=recipe.attn_implementation)
            # init_empty_weights re-creates every parameter on the meta device, which unties tied
            # embeddings (Qwen2.5, Llama 3.2, Gemma); FSDP then finds an lm_head rank 0 does not have.
            model.tie_weights()
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        raise RecipeError(f"attn_implementation={recipe.attn_implementation}: model type {config.model_type} does "
                          "not support it in this transformers version; set attn_implementation=eager") from None
    model.config.use_cache = False
    if reward:
        init_score_head(model, recipe.seed)
    if recipe.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if recipe.lora:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    if recipe.lora:
        model = add_lora(model, recipe)
    if recipe.compile:
        compile_layers(model)
    return model


def compile_layers(model) -> int:
    """compile=true: torch.compile each decoder layer (the modules FSDP wraps, `_no_split_modules`), not
    the whole model; returns how many. Inductor fuses a layer's element-wise ops (RMSNorm, rotary,
    SwiGLU), which eager runs as one kernel each.

    In place (`module.compile()`, as torchtitan and Accelerate's regional compilation): the layer keeps
    its class, so Accelerate's transformer_based_wrap still finds it by class name, and its state-dict
    keys (no `_orig_mod.`), so checkpoints and final/ are those of an uncompiled run. The whole model is
    not compiled: lm_head, whose forward the chunked loss swaps per call (finetune/loss.py), the
    embeddings and the strategies' wrappers stay eager.

    Order: after gradient checkpointing and LoRA are set up, before Accelerate prepares the model (FSDP2's
    fully_shard, DDP, DeepSpeed), the order of torchtitan (checkpoint, compile, shard). Compiling is lazy,
    so what matters is what ends up inside the graph, traced at the first forward: dynamo runs a module's
    `_call_impl` eagerly and compiles the frame it calls, the layer's forward. So FSDP2's pre- and
    post-forward hooks (all-gather, reshard) stay outside the graph, and transformers 5's checkpointing,
    which wraps `forward` (GradientCheckpointingLayer, so that hooks are not re-run by the recompute), is
    inside it: torch.utils.checkpoint (non-reentrant) becomes a higher-order op whose recompute inductor
    places in the backward graph. Under ZeRO-3 the hooks that gather weights sit on every Linear inside
    the layer and break the graph at each one (measured: 44 graph breaks in 12 steps of the 2-layer tiny
    model, 4x slower steps), hence recipe.py refuses that pairing.

    Shapes: batches are padded to their longest row, so the sequence length changes every step. With
    torch.compile's default (dynamic=None, automatic dynamic shapes) the first step compiles for its
    length and the first step with another length compiles once more with a symbolic length, which then
    serves every length; eval (no grad) adds its own. The layers share one compiled frame (their
    parameters are graph inputs), so torch._dynamo's recompile_limit (8 per frame) counts these variants,
    not layers. dynamic=True would skip the static compile but took twice as long to compile on CPU
    (110 s against 52 s for the tiny model, 2 loaded cores). LoRA dropout inside a compiled layer draws
    from inductor's random numbers, not eager's: another random mask, so the curve differs from an
    uncompiled run's by noise (6e-4 relative measured at lora_dropout=0.05; 4e-8 at 0)."""
    names = set(getattr(hf_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RecipeError(f"compile=true: {type(hf_model(model)).__name__} names no decoder layers "
                          "(_no_split_modules) to compile; set compile=false")
    for layer in layers:
        layer.compile()
    return len(layers)


def _load_4bit(recipe: Recipe, model_path: str, config, weights_on_this_rank: bool):
    """QLoRA: the frozen base's decoder Linears in 4-bit NF4 (bitsandbytes Linear4bit), quantized tensor by
    tensor as they are read, so no rank ever holds the unquantized model.

    The packed weights are stored in the training dtype (`bnb_4bit_quant_storage`, model.base_dtype: fp32
    on CPU, bf16/fp16 on GPUs), as TRL and axolotl do for sharded QLoRA: FSDP2 flattens a layer's
    parameters into one all-gather buffer of one dtype, and DeepSpeed casts every parameter to its
    engine's dtype, so a uint8 storage would be cast (corrupted) or refused, while packed bits held
    in the training dtype go through both untouched. The quantization constants (absmax, bitsandbytes'
    QuantState) are no parameters: every rank keeps them whole, next to its shard (about 1/64 byte per
    weight with double quantization).

    ddp: every process loads the quantized base onto its device. zero3: every process loads it on the
    CPU, outside deepspeed.zero.Init (which would partition the unquantized weights), and DeepSpeed
    partitions it when the model is prepared. fsdp: rank 0 loads it on the CPU; the other ranks build
    a meta-device skeleton with the same Linear4bit modules and receive the quantization constants from
    rank 0 here and their shards of the packed weights when Accelerate prepares the model
    (strategy.Fsdp.prepare_4bit). Where each strategy puts the base is its Strategy object's answer.
    """
    strategy = strategy_for(recipe.strategy)
    dtype = base_dtype(recipe)
    device = strategy.quantized_base_device()
    if weights_on_this_rank:
        model = load_4bit_base(model_path, dtype, device, recipe.attn_implementation)
    else:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=recipe.attn_implementation)
        model.tie_weights()
        model.is_loaded_in_4bit = True  # as from_pretrained marks it; peft then puts its 4-bit LoRA layers on
    if strategy.shares_quantized_layers:
        _share_quantized_layers(model, weights_on_this_rank, dtype)
    keep_4bit_layout(model)  # the Linear4bit modules _share_quantized_layers made too (other ranks than 0)
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module._register_state_dict_hook(_without_quant_state)
    if strategy.prepares_for_kbit_training:
        from peft import prepare_model_for_kbit_training

        # peft's recipe for one GPU per process: norms and embeddings in fp32. Sharded runs keep them in
        # the training dtype: FSDP2 all-gathers a layer in one dtype (TRL skips this for sharded QLoRA too).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def load_4bit_base(model_path: str, dtype: torch.dtype, device: str = "cpu", attn_implementation: str | None = None):
    """The frozen base as a QLoRA run computes with it: `from_pretrained` quantizing the decoder Linears to
    NF4 with double quantization, compute and storage dtype `dtype` (model.base_dtype of the run: fp32
    on CPU), on `device`, with bitsandbytes' packed CPU layout kept off (keep_4bit_layout). The one
    loader of a 4-bit base: the run's (_load_4bit) and the one to evaluate or generate from a QLoRA
    adapter, `PeftModel.from_pretrained(load_4bit_base(base, dtype), "final")`, which then computes
    what the run computed on any CPU."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    with without_zero3_init():
        model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quant, dtype=dtype,
                                                     device_map={"": device}, attn_implementation=attn_implementation)
    keep_4bit_layout(model)
    return model


def keep_4bit_layout(model) -> int:
    """Keeps bitsandbytes' packed CPU inference layout off for every Linear4bit of `model` (returns how
    many); call it before the model's first forward.

    bitsandbytes (0.50.2) sets `support_avx512bf16_for_cpu = has_avx512bf16()` when it makes a
    Linear4bit, and with it true, the layer's first forward on the CPU in eval mode with an input that
    needs no gradient (any eval or generation under no_grad) rewrites the weight in place: NF4 bits
    regrouped in blocks of 32 output rows (uint8 [N, K/2]), absmax dequantized to bf16, computed by a
    bf16-only kernel. That is its only trigger (nn/modules.py, Linear4bit.forward; matmul_4bit and the
    CPU gemv kernel then follow the flag the layer's quant_state carries). Off for every layer, not only
    where the shape cannot take it:
    - it asserts out_features % 32 == 0 ("N must be divisible by block_n"): a model with any other
      projection (the tiny model's MLP: 176) would stop at its first eval;
    - the layer stays packed after model.train(), in a layout FSDP2's shards and ZeRO-3's partitions
      (the packed bits in the training dtype, see _load_4bit) do not hold;
    - its numbers are not the training forward's (bf16 activations and absmax), so an eval on such a
      CPU would not give the loss the run computed;
    - a state dict taken after it (save_pretrained of the 4-bit model) converts back with absmax
      re-quantized from bf16: other quantization constants than the ones the base was loaded with.
    Off, the layer computes as on any other CPU (dequantize NF4, then a matmul in the compute dtype)."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for module in layers:
        module.support_avx512bf16_for_cpu = False
    return len(layers)


def _without_quant_state(module, state_dict, prefix, local_metadata):
    """bitsandbytes adds each Linear4bit's quantization constants (weight.absmax, weight.quant_map, ...)
    to the state dict; they belong to the frozen base, which checkpoints leave out (the run re-reads
    it), so they stay out too."""
    for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
        del state_dict[key]


def _share_quantized_layers(model, has_weights: bool, dtype) -> None:
    """FSDP: rank 0 tells the other ranks which Linears it quantized, with their packed shapes and
    quantization constants; they replace those Linears of their meta skeleton with Linear4bit modules
    that hold the constants and a meta weight of the packed shape, as rank 0's."""
    import bitsandbytes as bnb
    import torch.distributed as dist
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    layers = None
    if has_weights:
        layers = {name: (m.in_features, m.out_features, m.bias is not None, tuple(m.weight.shape),
                         {k: v.cpu() for k, v in m.weight.quant_state.as_dict(packed=True).items()})
                  for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    box = [layers]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if has_weights:
        return
    for name, (n_in, n_out, bias, shape, state) in box[0].items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = bnb.nn.Linear4bit(n_in, n_out, bias, compute_dtype=dtype, compress_statistics=True,
                                  quant_type="nf4", quant_storage=dtype, device="meta")
        quant_state = QuantState.from_dict(state, device=torch.device("cpu"))
        layer.weight = Params4bit(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False,
                                  quant_state=quant_state, quant_type="nf4", quant_storage=dtype,
                                  bnb_quantized=True, module=layer)
        layer.quant_state = quant_state
        setattr(parent, child, layer)


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
    # a reward model (objective=reward) trains its new score head whole beside the adapters (peft's
    # modules_to_save: a trainable copy, saved with the adapter), as TRL advises for reward models
    reward = is_reward_config(model.config)
    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                        target_modules=targets, task_type="SEQ_CLS" if reward else "CAUSAL_LM", bias="none",
                        modules_to_save=["score"] if reward else None)
    model = get_peft_model(model, config, autocast_adapter_dtype=True)  # adapters in fp32 on a 16-bit base
    if reward:  # the head's trainable copy has the base's dtype: its master weights in fp32, as the adapters'
        for name, param in model.named_parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


def loss_sum(model, batch: dict, impl: str = "chunked", chunk: int = 0, aux: list | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over target tokens: the caller divides by the
    target tokens of the whole global batch, so every split of that batch gives the same update.
    impl and chunk are the recipe's loss_impl and loss_chunk_tokens; finetune/loss.py says how each works;
    aux collects a mixture of experts' router loss (see loss.router_aux_loss)."""
    return loss.loss_sum(model, batch, impl, chunk or None, aux)
