"""Per-GPU memory: what a recipe will need before anything is loaded, and what a live run holds.

Estimate (no model loaded, no GPU needed)
-----------------------------------------
1. Parameters, counted exactly from the model's config: transformers builds the model from it on the
   meta device (no memory, no weights) and the planner counts what is there (`measure`): every
   family transformers knows, with its own layout (Phi-3's fused qkv_proj/gate_up_proj, Gemma's four
   norms per layer, Qwen3's q/k norms, a mixture of experts' experts and router, tied embeddings
   once), the largest decoder layer (FSDP and ZeRO-3 gather one at a time), and every Linear a LoRA
   adapter can sit on. Where transformers cannot build it (published numbers from the table below,
   an unknown model_type) the count is the formula of a Llama/Mistral/Qwen2-style decoder
   (`Architecture.num_parameters`): embeddings V*h; per layer q/k/v/o with grouped-query attention
   (k and v have kv_heads*head_dim outputs), gate/up/down of the SwiGLU MLP, two RMSNorms; a final
   RMSNorm; lm_head V*h unless tied. Qwen2 adds q/k/v biases (`attention_bias`).

2. Model states, the ZeRO paper's accounting (arXiv:1910.02054 section 3.1, and
   ../shared/reference/figures.md): Adam keeps 16 bytes per trained parameter, split
   2 P weights + 2 P gradients + 12 P (fp32 master, momentum, variance) in 16-bit mixed precision,
   4 P + 4 P + 8 P in fp32 (`mixed_precision=no`). Per GPU with N data-parallel ranks:

       ddp 16 P | zero1 4 P + 12 P/N | zero2 2 P + 14 P/N | zero3, fsdp 16 P/N   (16-bit)
       ddp 16 P | zero1 8 P +  8 P/N | zero2 4 P + 12 P/N | zero3, fsdp 16 P/N   (fp32)

   `paper_model_states` is exactly that table. `estimate` splits the same bytes the way this
   toolkit holds them, which differs from the paper's split in three documented places:
   - ddp and fsdp keep fp32 weights and gradients also under bf16/fp16 (Accelerate autocasts DDP;
     FSDP's MixedPrecisionPolicy casts each gathered layer): 4 P + 4 P + 8 P, same total, so the
     sharded-optimizer DDP (torch ZeroRedundancyOptimizer) is 8 P + 8 P/N, not 4 P + 12 P/N;
   - DeepSpeed clones an fp32 master partition also when training in fp32: optimizer 12 P/N
     instead of 8 P/N for zero1/2/3 (measured with held_bytes, deepspeed 0.19);
   - LoRA: the frozen base is loaded in the training precision (model.base_dtype: 2 bytes per
     parameter under bf16/fp16, 4 in fp32) and sharded by zero3/fsdp; the adapters are fp32 and only
     they have gradients and optimizer states.
   - QLoRA (load_in_4bit): the decoder layers' Linear weights are NF4, 0.5 byte per weight sharded
     by zero3/fsdp (replicated by ddp), plus 1/64 + 1/4096 byte per weight of quantization constants
     that every rank keeps whole (see estimate).
   Offload moves states off the GPU: `offload_optimizer` (zero2/zero3) moves the optimizer states to
   CPU (or NVMe) and the gradient partition to CPU, as fp32 for CPU Adam (ZeRO-3 also keeps its
   gradient buffer there: 2 + 4 bytes per parameter / N in 16-bit), `offload_params` (zero3) the
   parameter partition; FSDP with `offload_params=cpu` keeps parameters, gradients and optimizer on
   the CPU.

3. Activations, per GPU (not sharded by any strategy), from Korthikanti et al., "Reducing Activation
   Recomputation in Large Transformer Models" (arXiv:2205.05198, section 4.1): one transformer layer
   keeps  34*B*T*h + 5*B*a*T^2  bytes with 16-bit activations (B micro batch, T sequence length,
   h hidden size, a attention heads; the T^2 term is the attention scores, softmax and dropout mask,
   which fused SDPA/flash kernels do not keep, so it is an upper bound for them). Then

       without activation checkpointing:  L * (34*B*T*h + 5*B*a*T^2)
       with activation checkpointing:     L * 2*B*T*h   (each layer's input)  +  (34*B*T*h + 5*B*a*T^2)
                                          (one layer recomputed during its backward)
       plus the logits:                   B*T*V * (2 + 4 + 4)   (16-bit logits, the fp32 log-softmax
                                          that the loss keeps, its gradient; 4 + 4 + 4 in fp32)

   all doubled for fp32 activations (`mixed_precision=no`). T is max_seq_len: packed rows are that
   long, padded batches at most that long.

4. Buffers: what a strategy allocates beyond the model states (rough, stated so that it can be
   checked): ddp, a second copy of every gradient in DDP's reduction buckets (Accelerate leaves
   gradient_as_bucket_view off); zero1/2, two reduce buckets of h^2 elements and, in 16-bit, the fp32
   copy of the gradient partition made for the optimizer step; zero3, two gathered units (the
   current one and the prefetched one; a unit is a decoder layer or the embedding) in the compute
   dtype, one layer's unreduced gradients, the reduce bucket and, in 16-bit, the fp32 gradient of one
   optimizer sub-group (at most 1e9 elements); fsdp, the root unit (embeddings, lm_head, final norm,
   kept gathered through the step), two gathered decoder layers and one layer's unreduced gradients.
   ddp and fsdp add the one fp32 temporary that torch's foreach AdamW makes the size of the states
   it steps (4 bytes per trained parameter, / N where the optimizer is sharded).

The total is the plain sum of the columns. That is conservative: activations are freed before the
optimizer step's temporaries appear. Everything not counted (CUDA context, allocator fragmentation,
NCCL buffers) is what the headroom (10% by default) is for.

Measured (one H100, a 0.94 B Llama: h=2048, 16 layers, vocab 32000, T=2048; torch 2.11, transformers
5.17; one process, so DDP's buckets are not there and are left out of the estimate): peak
torch.cuda.max_memory_allocated over a training step against this estimate, GiB:

    checkpointing on:  ddp B=1 17.8 / 18.7   ddp B=4 17.7 / 22.2   fsdp B=4 17.7 / 22.8
                       fsdp params->cpu B=4 3.7 / 5.2              fsdp LoRA r=16 B=4 7.3 / 8.8
    checkpointing off: ddp eager attention B=1 22.5 / 25.3 (the T^2 term is real there)
                       ddp SDPA B=4 29.2 / 48.5 (SDPA keeps no T^2 scores: an overestimate)

held_bytes equalled the estimate's parameters, gradients and optimizer states (cpu_* under
offload) in every case; for zero1/2/3 (with and without offload) it did so in one-process CPU runs
(fp32, deepspeed 0.19.8), the gradients between micro-steps and the Adam states after a step.

Live runs
---------
`held_bytes(model, optimizer)` counts what this rank actually holds, by tensor storage, for plain
modules, FSDP2 (DTensor shards), DeepSpeed ZeRO engines and ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.recipe import BUILTIN_PREFIX, Recipe, RecipeError, looks_local

GiB = 2**30
HEADROOM = 0.10
# QLoRA (model._load_4bit): NF4 packs two weights in a byte; double quantization keeps one 8-bit absmax
# per block of 64 weights and one fp32 absmax per 256 of those blocks (bitsandbytes' QuantState).
QUANT_PACKED = 0.5
QUANT_CONSTANTS = 1 / 64 + 4 / (64 * 256)
QUANT_TABLES = (16 + 256) * 4  # per quantized Linear: the NF4 code and the 8-bit absmax code, fp32
QLORA_STRATEGIES = ("ddp", "fsdp", "zero3")
LLAMA_LIKE = ("llama", "mistral", "qwen2")


class EstimateError(RecipeError):
    """The estimate cannot be made (an unreadable config, an unknown architecture); one line."""


# ---------------------------------------------------------------- architecture and parameter count


@dataclass(frozen=True)
class Architecture:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: as many as attention heads (no GQA)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2)
    o_proj_bias: bool = False  # Llama's attention_bias=true also puts one on o_proj
    mlp_bias: bool = False
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    model_type: str = "llama"
    source: str = ""  # where the numbers came from, for reports
    # Counted on the model built from the config (see measure); None: the Llama-style formula.
    measured_parameters: int | None = None
    measured_layer: int | None = None  # the largest decoder layer
    measured_embedding: int | None = None
    measured_lm_head: int | None = None  # 0 when tied to the embedding
    linears: tuple[tuple[str, int, int, int], ...] | None = None  # decoder Linears: (name, in, out, how many)
    lora_default: tuple[str, ...] | None = None  # the Linears model.lora_targets picks by default

    @property
    def measured(self) -> bool:
        return self.measured_parameters is not None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def projections(self) -> dict[str, tuple[int, int, bool]]:
        """The Linear layers of one decoder layer: name -> (in_features, out_features, has_bias)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_size, self.kv_heads * self.head_size
        ab, mb = self.attention_bias, self.mlp_bias
        return {"q_proj": (h, q, ab), "k_proj": (h, kv, ab), "v_proj": (h, kv, ab), "o_proj": (q, h, self.o_proj_bias),
                "gate_proj": (h, i, mb), "up_proj": (h, i, mb), "down_proj": (i, h, mb)}

    def layer_parameters(self) -> int:
        if self.measured_layer is not None:
            return self.measured_layer
        linear = sum(n_in * n_out + (n_out if bias else 0) for n_in, n_out, bias in self.projections().values())
        return linear + 2 * self.hidden_size  # input_layernorm, post_attention_layernorm

    @property
    def embedding_parameters(self) -> int:
        return self.measured_embedding if self.measured_embedding is not None else self.vocab_size * self.hidden_size

    @property
    def lm_head_parameters(self) -> int:
        if self.measured_lm_head is not None:
            return self.measured_lm_head
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def decoder_linear_weights(self) -> int:
        """Weights of the decoder layers' Linears (what QLoRA quantizes)."""
        if self.linears is not None:
            return sum(n_in * n_out * k for _, n_in, n_out, k in self.linears)
        return self.num_hidden_layers * sum(i * o for i, o, _ in self.projections().values())

    def decoder_linears(self) -> int:
        """How many Linears the decoder layers hold (each quantized one has its own code tables)."""
        if self.linears is not None:
            return sum(k for *_, k in self.linears)
        return self.num_hidden_layers * len(self.projections())

    def largest_linear(self) -> int:
        """Weights of the largest Linear in a decoder layer (what bitsandbytes dequantizes at a time)."""
        if self.linears is not None:
            return max((n_in * n_out for _, n_in, n_out, _ in self.linears), default=0)
        return max(i * o for i, o, _ in self.projections().values())

    def num_parameters(self) -> int:
        if self.measured_parameters is not None:
            return self.measured_parameters
        return (self.embedding_parameters + self.num_hidden_layers * self.layer_parameters()
                + self.hidden_size + self.lm_head_parameters)


def _arch(h, layers, inter, vocab, heads, kv, model_type="llama", **kw) -> Architecture:
    return Architecture(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab,
                        num_attention_heads=heads, num_key_value_heads=kv, model_type=model_type, **kw)


_LLAMA2_7B = _arch(4096, 32, 11008, 32000, 32, 32)
_LLAMA2_13B = _arch(5120, 40, 13824, 32000, 40, 40)
_LLAMA2_70B = _arch(8192, 80, 28672, 32000, 64, 8)
_LLAMA3_8B = _arch(4096, 32, 14336, 128256, 32, 8)
_LLAMA3_70B = _arch(8192, 80, 28672, 128256, 64, 8)
_MISTRAL_7B = _arch(4096, 32, 14336, 32000, 32, 8, "mistral")
_QWEN25_7B = _arch(3584, 28, 18944, 152064, 28, 4, "qwen2", attention_bias=True)
_QWEN25_14B = _arch(5120, 48, 13824, 152064, 40, 8, "qwen2", attention_bias=True)

# The published config.json numbers of some common bases, for planning with no hub access.
# Keys are matched case-insensitively.
KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    "meta-llama/Llama-2-7b-hf": _LLAMA2_7B,
    "meta-llama/Llama-2-7b-chat-hf": _LLAMA2_7B,
    "meta-llama/Llama-2-13b-hf": _LLAMA2_13B,
    "meta-llama/Llama-2-13b-chat-hf": _LLAMA2_13B,
    "meta-llama/Llama-2-70b-hf": _LLAMA2_70B,
    "meta-llama/Llama-2-70b-chat-hf": _LLAMA2_70B,
    "meta-llama/Meta-Llama-3-8B": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3.1-8B": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3.1-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Llama-3.1-8B": _LLAMA3_8B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3-70B": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3.1-70B": _LLAMA3_70B,
    "meta-llama/Meta-Llama-3.1-70B-Instruct": _LLAMA3_70B,
    "meta-llama/Llama-3.1-70B": _LLAMA3_70B,
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA3_70B,
    "mistralai/Mistral-7B-v0.1": _MISTRAL_7B,
    "mistralai/Mistral-7B-Instruct-v0.1": _MISTRAL_7B,
    "Qwen/Qwen2.5-7B": _QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen/Qwen2.5-14B": _QWEN25_14B,
    "Qwen/Qwen2.5-14B-Instruct": _QWEN25_14B,
}
_KNOWN_LOWER = {k.lower(): k for k in KNOWN_ARCHITECTURES}
TABLE_SOURCE = "finetune.memory's table of published config.json numbers"
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def known_architecture(model: str) -> Architecture | None:
    key = _KNOWN_LOWER.get(model.lower())
    if key is None:
        return None
    return dataclasses.replace(KNOWN_ARCHITECTURES[key], source=f"{TABLE_SOURCE} ({key})")


def architecture_from_config(config, source: str = "", count: bool = True) -> Architecture:
    """A config.json dict (or a transformers config) -> Architecture, its parameters counted on the model
    transformers builds from it (see measure; count=False: the formula alone); raises EstimateError
    if transformers cannot build it and it is not a dense decoder with the Llama layout's numbers."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    model_type = str(cfg.get("model_type", ""))
    where = f" ({source})" if source else ""
    counts = measure(cfg) if count else None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    cfg = {**text, **{k: v for k, v in cfg.items() if v is not None}} if text else cfg
    moe = [k for k in MOE_KEYS if (cfg.get(k) or 0) > 1]
    if moe and counts is None:
        raise EstimateError(f"model_type {model_type}{where} is a mixture of experts ({moe[0]}={cfg[moe[0]]}) that "
                            "transformers cannot build here to count; finetune.memory's formula counts dense "
                            "Llama/Mistral/Qwen2-style decoders only")
    needed = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    missing = [k for k in needed + (() if counts else ("intermediate_size",)) if not isinstance(cfg.get(k), int)]
    if missing:
        raise EstimateError(f"model config{where} (model_type {model_type or 'unknown'}) has no {', '.join(missing)}; "
                            "finetune.memory counts Llama/Mistral/Qwen2-style decoders only")
    qwen2 = model_type == "qwen2"
    attention_bias = True if qwen2 else bool(cfg.get("attention_bias", False))
    return Architecture(
        **(counts or {}), hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        intermediate_size=cfg.get("intermediate_size") or 0, vocab_size=cfg["vocab_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg.get("num_key_value_heads"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias, o_proj_bias=attention_bias and not qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)), head_dim=cfg.get("head_dim"),
        model_type=model_type, source=source)


def measure(cfg: dict) -> dict | None:
    """Counts from the model itself: transformers builds it from the config on the meta device (no
    memory, no weights; about 2 s for a 70B), and its parameters are counted as they are, whatever the
    family's layout. None where transformers cannot build it (an unknown model_type)."""
    return _measure(json.dumps(cfg, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _measure(cfg_json: str) -> dict | None:
    cfg = json.loads(cfg_json)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        return None
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from finetune.model import is_default_lora_target
    except ImportError:
        return None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a config made for another vocabulary warns about its token ids
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an unknown or incomplete config: the caller falls back to the formula
        return None
    finally:
        hf_logging.set_verbosity(verbosity)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    linears: dict[tuple[str, int, int], int] = {}
    lora_default = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            key = (name.rsplit(".", 1)[-1], module.in_features, module.out_features)
            linears[key] = linears.get(key, 0) + 1
            if is_default_lora_target(name, module):
                lora_default.add(key[0])
    return {
        "measured_parameters": sum(p.numel() for p in model.parameters()),  # a tied weight is one parameter
        "measured_layer": max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
        "measured_embedding": embedding.numel(),
        "measured_lm_head": 0 if head is None or head.weight is embedding else head.weight.numel(),
        "linears": tuple((n, i, o, k) for (n, i, o), k in sorted(linears.items())),
        "lora_default": tuple(sorted(lora_default)),
    }


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _read_config_file(path: Path, source: str) -> Architecture:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EstimateError(f"cannot read {path}: {e}") from None
    return architecture_from_config(cfg, source)


def _from_hub_cache(model: str) -> Architecture | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # a malformed repo id, an unreadable cache: not found
        return None
    if isinstance(found, str) and Path(found).is_file():
        return _read_config_file(Path(found), f"Hugging Face cache ({model})")
    return None


def load_architecture(model: str) -> Architecture:
    """Architecture numbers for a recipe's `model`, cheapest source first: builtin asset; local
    directory's config.json; the Hugging Face cache; the table of known architectures; the hub
    (transformers.AutoConfig, only when HF_HUB_OFFLINE is not set)."""
    if model.startswith(BUILTIN_PREFIX):
        from finetune.assets import resolve_model  # the builtin model is built locally on first use

        directory = Path(resolve_model(model))
        return _read_config_file(directory / "config.json", f"{model} ({directory})")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EstimateError(f"model={model}: the directory has no config.json; point model at a directory "
                                "written by save_pretrained")
        return _read_config_file(path / "config.json", f"config.json in {path}")
    if looks_local(model):
        raise EstimateError(f"model={model}: no such directory; point model at a local directory with config.json")
    arch = _from_hub_cache(model) or known_architecture(model)
    if arch is not None:
        return arch
    if not _offline():
        try:
            from transformers import AutoConfig

            return architecture_from_config(AutoConfig.from_pretrained(model), f"hub ({model})")
        except EstimateError:
            raise
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise EstimateError(f"model={model}: cannot read its config.json from the hub ({reason}); point model at "
                                "a local directory that holds config.json") from None
    raise EstimateError(f"model={model}: cannot read its config.json offline (HF_HUB_OFFLINE=1): it is not a local "
                        "directory, not in the Hugging Face cache and not in finetune.memory's table of known "
                        "architectures; point model at a local directory that holds config.json (a save_pretrained "
                        "or downloaded snapshot), or unset HF_HUB_OFFLINE on a machine with hub access")


# ---------------------------------------------------------------- LoRA


def lora_parameters(arch: Architecture, r: int, targets=()) -> int:
    """Adapter parameters: r*(in + out) per targeted Linear (A is r x in, B is out x r), in every layer.
    No targets means the Linears finetune/model.py's lora_targets picks (every attention and MLP
    projection, fused ones included)."""
    if arch.linears is not None:
        names = list(targets) or list(arch.lora_default or ())
        known = sorted({n for n, *_ in arch.linears})
        total = 0
        for name in names:
            found = [(i, o, k) for n, i, o, k in arch.linears if n == name]
            if found:
                total += sum(k * r * (i + o) for i, o, k in found)
            elif name in ("lm_head", "embed_tokens"):
                total += r * (arch.vocab_size + arch.hidden_size)
            else:
                raise EstimateError(f"lora_target_modules: {name!r} is not a Linear in a {arch.model_type} decoder "
                                    f"layer ({', '.join(known + ['lm_head', 'embed_tokens'])})")
        return total
    proj = arch.projections()
    names = list(targets) or list(proj)
    total = 0
    for name in names:
        if name in proj:
            n_in, n_out, _ = proj[name]
            total += arch.num_hidden_layers * r * (n_in + n_out)
        elif name in ("lm_head", "embed_tokens"):
            total += r * (arch.vocab_size + arch.hidden_size)
        else:
            raise EstimateError(f"lora_target_modules: {name!r} is not a module the planner knows in a "
                                f"{arch.model_type} decoder ({', '.join(list(proj) + ['lm_head', 'embed_tokens'])})")
    return total


def recipe_lora(recipe: Recipe) -> tuple[bool, int, tuple]:
    """(lora on, r, targets), read defensively: the LoRA fields are newer than some recipes' code."""
    return (bool(getattr(recipe, "lora", False)), int(getattr(recipe, "lora_r", 16)),
            tuple(getattr(recipe, "lora_target_modules", ()) or ()))


# ---------------------------------------------------------------- setups and formulas


@dataclass(frozen=True)
class Setup:
    """A strategy with its offload settings: one row of the planner's table."""
    strategy: str
    ddp_shard_optimizer: bool = False
    offload_optimizer: str = "none"
    offload_params: str = "none"

    @property
    def label(self) -> str:
        parts = [self.strategy + (" + sharded optimizer" if self.ddp_shard_optimizer else "")]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        return ", ".join(parts)

    def overrides(self) -> dict:
        return {"strategy": self.strategy, "ddp_shard_optimizer": self.ddp_shard_optimizer,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params}

    @classmethod
    def of(cls, recipe: Recipe) -> "Setup":
        return cls(recipe.strategy, recipe.ddp_shard_optimizer, recipe.offload_optimizer, recipe.offload_params)


# Cheapest first: least communication, then least offload. Setups with the same rank cost about the
# same; among those the recipe's own framework (DeepSpeed for zero*, PyTorch for ddp/fsdp) is preferred.
SETUPS: tuple[tuple[int, Setup], ...] = (
    (0, Setup("ddp")),
    (1, Setup("ddp", ddp_shard_optimizer=True)),
    (1, Setup("zero1")),
    (2, Setup("zero2")),
    (3, Setup("fsdp")),
    (3, Setup("zero3")),
    (4, Setup("zero2", offload_optimizer="cpu")),
    (5, Setup("zero3", offload_optimizer="cpu")),
    (6, Setup("fsdp", offload_params="cpu")),
    (6, Setup("zero3", offload_optimizer="cpu", offload_params="cpu")),
    (7, Setup("zero3", offload_optimizer="nvme", offload_params="nvme")),
)


def paper_model_states(strategy: str, mixed_precision: str, params: int, world_size: int) -> int:
    """Model-state bytes per rank exactly as the ZeRO paper / figures.md give them."""
    n = world_size
    sixteen = mixed_precision != "no"
    if strategy == "ddp":
        return 16 * params
    if strategy == "zero1":
        return (4 * params + 12 * params / n) if sixteen else (8 * params + 8 * params / n)
    if strategy == "zero2":
        return (2 * params + 14 * params / n) if sixteen else (4 * params + 12 * params / n)
    if strategy in ("zero3", "fsdp"):
        return 16 * params / n
    raise ValueError(f"unknown strategy {strategy!r}")


def state_bytes(strategy: str, mixed_precision: str) -> tuple[int, int, int]:
    """Bytes per trained parameter (weights, gradients, optimizer states) as this toolkit holds them."""
    sixteen = mixed_precision != "no"
    if strategy.startswith("zero"):
        # 16-bit engine: bf16/fp16 weights and gradients, fp32 master + Adam m, v. In fp32 DeepSpeed
        # still clones an fp32 master partition (ZeRO-3 means to reuse the partition when the dtypes
        # agree, but compares a torch.device with a string and never does; seen with deepspeed 0.19).
        return (2, 2, 12) if sixteen else (4, 4, 12)
    return 4, 4, 8  # ddp, fsdp: fp32 weights and gradients, casts happen per layer (autocast / FSDP policy)


def activation_bytes(arch: Architecture, micro_batch_size: int, seq_len: int, mixed_precision: str,
                     activation_checkpointing: bool) -> int:
    """Activations per GPU; the formula is in this module's docstring (Korthikanti et al. 2022)."""
    b, t, h, a, layers = micro_batch_size, seq_len, arch.hidden_size, arch.num_attention_heads, arch.num_hidden_layers
    scale = 1 if mixed_precision != "no" else 2
    one_layer = 34 * b * t * h + 5 * b * a * t * t
    body = layers * 2 * b * t * h + one_layer if activation_checkpointing else layers * one_layer
    logits = b * t * arch.vocab_size * ((2 if mixed_precision != "no" else 4) + 8)
    return body * scale + logits


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    world_size: int
    num_parameters: int
    trained_parameters: int
    params: int  # bytes per GPU
    grads: int
    optimizer: int
    activations: int
    buffers: int
    cpu: int = 0  # bytes per rank moved to CPU memory
    nvme: int = 0  # bytes per rank moved to NVMe

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers

    def fits(self, budget: int, headroom: float = HEADROOM) -> bool:
        return self.total <= budget * (1 - headroom)


def estimate(arch: Architecture, setup: Setup, *, world_size: int, mixed_precision: str = "bf16",
             micro_batch_size: int = 1, seq_len: int = 2048, activation_checkpointing: bool = False,
             lora_params: int = 0, quantized_base: bool = False) -> Estimate:
    """Bytes per GPU for one setup. lora_params > 0: a LoRA run with that many adapter parameters
    (the base is frozen); 0: a full fine-tune. quantized_base: QLoRA (model._load_4bit), the decoder
    layers' Linear weights of the frozen base in 4-bit NF4: 0.5 byte per weight (QUANT_PACKED, stored
    in the training dtype and sharded like any weight by fsdp/zero3) plus the quantization constants
    (QUANT_CONSTANTS, double-quantized absmax), which are no parameters and which every rank keeps
    whole; embeddings, lm_head and norms stay as they are. A gathered layer then holds its packed
    weights, and bitsandbytes dequantizes one Linear at a time into the compute dtype (buffers)."""
    n = world_size
    strategy = setup.strategy
    base = arch.num_parameters()
    trained = lora_params or base
    total_params = base + lora_params
    pb, gb, ob = state_bytes(strategy, mixed_precision)
    sixteen = mixed_precision != "no"
    lp = 2 if sixteen else 4  # compute dtype: gathered layers, buckets
    # A LoRA run's frozen base is loaded in the training precision (model.base_dtype), and DeepSpeed's
    # 16-bit engine casts the whole module anyway.
    frozen_pb = 2 if sixteen else pb
    shard_params = strategy in ("zero3", "fsdp")
    shard_grads = strategy in ("zero2", "zero3", "fsdp")
    shard_opt = strategy != "ddp" or setup.ddp_shard_optimizer

    frozen = (total_params - trained) * frozen_pb
    quantized = arch.decoder_linear_weights() if quantized_base and lora_params else 0
    frozen -= quantized * (frozen_pb - QUANT_PACKED)
    params = (trained * pb + frozen) / (n if shard_params else 1)
    if quantized:
        params += quantized * QUANT_CONSTANTS + arch.decoder_linears() * QUANT_TABLES
    grads = trained * gb / (n if shard_grads else 1)
    optimizer = trained * ob / (n if shard_opt else 1)

    off = {"cpu": 0.0, "nvme": 0.0}
    if strategy == "fsdp" and setup.offload_params == "cpu":
        off["cpu"] += params + grads + optimizer
        params = grads = optimizer = 0.0
    else:
        if setup.offload_optimizer != "none" and strategy in ("zero2", "zero3"):
            off[setup.offload_optimizer] += optimizer
            # CPU Adam steps on an fp32 gradient partition in (pinned) CPU memory; ZeRO-3 also keeps its
            # gradient accumulation buffer (gradient dtype) there.
            off["cpu"] += trained * (4 + (gb if strategy == "zero3" else 0)) / n
            grads = optimizer = 0.0
        if setup.offload_params != "none" and strategy == "zero3":
            off[setup.offload_params] += params
            params = 0.0

    h2 = arch.hidden_size ** 2
    layer = arch.layer_parameters()
    dequantized = 0  # bitsandbytes' dequantized copy of the Linear being computed
    if quantized:
        layer_q = quantized / arch.num_hidden_layers
        layer -= layer_q * (1 - QUANT_PACKED / lp)  # a gathered layer in "compute-dtype elements"
        dequantized = arch.largest_linear() * lp
    if lora_params:
        layer_trained = lora_params / arch.num_hidden_layers
    else:
        layer_trained = layer
    if strategy == "ddp":
        buffers = trained * gb  # DDP's reduction buckets hold a copy of every gradient
        # torch AdamW (foreach) makes one fp32 temporary the size of the states it steps
        buffers += 4 * trained / (n if setup.ddp_shard_optimizer else 1)
    elif strategy in ("zero1", "zero2"):
        buffers = 2 * h2 * lp  # the reduce bucket, doubled when communication overlaps
        if sixteen and setup.offload_optimizer == "none":
            buffers += 4 * trained / n  # fp32 gradient partition for the optimizer step
    elif strategy == "zero3":
        unit = max(layer, arch.embedding_parameters)
        buffers = 2 * unit * lp + max(layer_trained, 0) * lp + h2 * lp
        if sixteen and setup.offload_optimizer == "none":
            buffers += 4 * min(trained / n, 10**9)  # fp32 gradient of one optimizer sub-group
    else:  # fsdp
        root = arch.embedding_parameters + arch.lm_head_parameters + arch.hidden_size
        buffers = (root + 2 * layer) * lp + max(layer_trained, 0) * lp
        if setup.offload_params == "none":
            buffers += 4 * trained / n  # torch AdamW's foreach temporary (on the CPU when offloaded)
    buffers += dequantized
    acts = activation_bytes(arch, micro_batch_size, seq_len, mixed_precision, activation_checkpointing)
    return Estimate(setup=setup, world_size=n, num_parameters=base, trained_parameters=trained,
                    params=round(params), grads=round(grads), optimizer=round(optimizer), activations=acts,
                    buffers=round(buffers), cpu=round(off["cpu"]), nvme=round(off["nvme"]))


def recipe_estimate(recipe: Recipe, world_size: int, arch: Architecture, setup: Setup | None = None) -> Estimate:
    lora, r, targets = recipe_lora(recipe)
    return estimate(arch, setup or Setup.of(recipe), world_size=world_size, mixed_precision=recipe.mixed_precision,
                    micro_batch_size=recipe.micro_batch_size, seq_len=recipe.max_seq_len,
                    activation_checkpointing=recipe.activation_checkpointing,
                    lora_params=lora_parameters(arch, r, targets) if lora else 0,
                    quantized_base=lora and bool(getattr(recipe, "load_in_4bit", False)))


def all_estimates(recipe: Recipe, world_size: int, arch: Architecture) -> list[tuple[int, Estimate]]:
    """(cost rank, estimate) for every setup in SETUPS, plus the recipe's own if it is not one of them.
    A 4-bit (QLoRA) base runs under ddp, fsdp and zero3 without parameter offload (recipe.validate),
    so then only those setups."""
    setups = [(rank, s) for rank, s in SETUPS if not getattr(recipe, "load_in_4bit", False)
              or (s.strategy in QLORA_STRATEGIES and s.offload_params == "none")]
    rows = [(rank, recipe_estimate(recipe, world_size, arch, setup)) for rank, setup in setups]
    own = Setup.of(recipe)
    if all(e.setup != own for _, e in rows):
        rank = max(rank for rank, s in SETUPS if s.strategy == own.strategy)
        rows.append((rank, recipe_estimate(recipe, world_size, arch, own)))
    return rows


def cheapest_fit(rows: list[tuple[int, Estimate]], budget: int, headroom: float = HEADROOM,
                 prefer: str | None = None) -> Estimate | None:
    """The lowest-cost setup whose total fits budget*(1-headroom); among equal costs, the one of the
    framework of `prefer` (a strategy name), then the order of SETUPS. None if nothing fits."""
    deepspeed = (prefer or "").startswith("zero")

    def key(item):
        index, (rank, est) = item
        same_framework = est.setup.strategy.startswith("zero") == deepspeed
        return rank, 0 if prefer is None or same_framework else 1, index

    fitting = [(i, row) for i, row in enumerate(rows) if row[1].fits(budget, headroom)]
    return min(fitting, key=key)[1][1] if fitting else None


# ---------------------------------------------------------------- sizes and reports

_UNITS = {"": None, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'80GB' (10^9 bytes), '40GiB' (2^30), '24G' (a bare letter is binary, like `free -g`) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise EstimateError(f"--gpu-mem {text}: not a size; write it like 80GB, 40GiB or 24G")
    if _UNITS[unit] is None:
        raise EstimateError(f"--gpu-mem {text}: give a unit, for example {text}GB (10^9 bytes) or {text}GiB (2^30)")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise EstimateError(f"--gpu-mem {text}: must be more than zero")
    return int(value)


def gib(n: float, unit: int = GiB) -> str:
    return f"{n / unit:.2f}"


def _offloaded(e: Estimate, unit: int = GiB) -> str:
    parts = [f"{where} {gib(n, unit)}" for where, n in (("cpu", e.cpu), ("nvme", e.nvme)) if n]
    return ", ".join(parts) or "-"


def _precision(mixed_precision: str) -> str:
    return "fp32 (mixed_precision=no)" if mixed_precision == "no" else f"{mixed_precision} mixed precision"


def describe_run(recipe: Recipe, world_size: int, arch: Architecture) -> str:
    lora, r, targets = recipe_lora(recipe)
    n = arch.num_parameters()
    what = "full fine-tune"
    if lora:
        what = f"LoRA r={r} on {','.join(targets) or 'every projection'}: {lora_parameters(arch, r, targets):,} trained"
    size = f" ({n / 1e9:.2f} B)" if n >= 10**8 else ""
    return (f"{recipe.model}: {n:,} parameters{size}, {what}; {world_size} GPU(s), "
            f"{_precision(recipe.mixed_precision)}, micro batch {recipe.micro_batch_size} x {recipe.max_seq_len} tokens, "
            f"activation checkpointing {'on' if recipe.activation_checkpointing else 'off'}")


def plan_table(recipe: Recipe, world_size: int, budget: int | None = None, headroom: float = HEADROOM,
               name: str = "", arch: Architecture | None = None, budget_text: str = "") -> str:
    """The planner's report: every setup's per-GPU estimate, and the cheapest that fits `budget`."""
    arch = arch or load_architecture(recipe.model)
    rows = all_estimates(recipe, world_size, arch)
    own = Setup.of(recipe)
    lines = [f"recipe {name or '(given)'}: {describe_run(recipe, world_size, arch)}",
             f"model config: {arch.source}"]
    if arch.model_type not in LLAMA_LIKE and not arch.measured:
        lines.append(f"note: model_type {arch.model_type or 'unknown'} is counted as a Llama-style decoder (q/k/v/o, "
                     "gate/up/down, two norms per layer); check the parameter count above")
    if budget:
        given = f" ({budget_text})" if budget_text else ""
        lines.append(f"GPU memory{given}: {gib(budget)} GiB; usable with {headroom:.0%} headroom: "
                     f"{gib(budget * (1 - headroom))} GiB")
    unit, unit_name = (GiB, "GiB") if max(e.total + e.cpu + e.nvme for _, e in rows) >= GiB else (2**20, "MiB")
    header = [f"per GPU, {unit_name}", "params", "grads", "optimizer", "activations", "buffers", "total", "offloaded"]
    if budget:
        header.append("fits")
    table = [header]
    for _, e in rows:
        mark = "* " if e.setup == own else "  "
        row = [mark + e.setup.label] + [gib(x, unit) for x in (e.params, e.grads, e.optimizer, e.activations,
                                                                 e.buffers, e.total)] + [_offloaded(e, unit)]
        if budget:
            row.append("yes" if e.fits(budget, headroom) else "no")
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    lines.append(f"* the recipe's own setup; offloaded: {unit_name} per GPU kept in CPU memory or on NVMe")
    if budget:
        best = cheapest_fit(rows, budget, headroom, prefer=recipe.strategy)
        mine = next(e for _, e in rows if e.setup == own)
        verdict = "fits" if mine.fits(budget, headroom) else "does NOT fit"
        lines.append(f"the recipe's setup ({own.label}): {gib(mine.total, unit)} {unit_name} per GPU, {verdict}")
        if best is None:
            lora = recipe_lora(recipe)[0]
            lines.append(f"nothing fits in {gib(budget * (1 - headroom))} GiB per GPU: use more GPUs, a smaller "
                         "micro_batch_size or max_seq_len" + (", activation_checkpointing=true"
                                                              if not recipe.activation_checkpointing else "")
                         + (", or LoRA" if not lora else ", or load_in_4bit=true (QLoRA)"
                            if not getattr(recipe, "load_in_4bit", False) else ""))
        else:
            changes = {k: v for k, v in best.setup.overrides().items() if getattr(recipe, k) != v}
            how = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())
            note = " (and nvme_path=...)" if "nvme" in (best.setup.offload_optimizer, best.setup.offload_params) \
                and not recipe.nvme_path else ""
            lines.append(f"cheapest that fits: {best.setup.label} ({gib(best.total, unit)} {unit_name} per GPU)"
                         + (f"; override with {how}{note}" if how else "; the recipe's own"))
    lines.append("estimates: ZeRO paper model states + Korthikanti et al. activations; see finetune/memory.py")
    return "\n".join(lines)


def memory_report(recipe: Recipe, world_size: int, recipe_name: str = "") -> str:
    """Lines for `run.py --dry-run`: per-GPU memory of the recipe's own setup, and what was not checked.
    Never raises for an unreadable config: it says so instead."""
    unchecked = []
    try:
        arch = load_architecture(recipe.model)
        e = recipe_estimate(recipe, world_size, arch)
    except EstimateError as err:
        return f"memory per GPU: not estimated: {err}"
    unit, name = (GiB, "GiB") if e.total + e.cpu + e.nvme >= GiB / 10 else (2**20, "MiB")
    off = f"; offloaded per GPU: {_offloaded(e, unit)} {name}" if e.cpu or e.nvme else ""
    lines = [f"memory per GPU (planner estimate, {e.setup.label} on {world_size} process(es)): "
             f"params {gib(e.params, unit)}, grads {gib(e.grads, unit)}, optimizer {gib(e.optimizer, unit)}, "
             f"activations {gib(e.activations, unit)}, buffers {gib(e.buffers, unit)}; total {gib(e.total, unit)} "
             f"{name}{off}",
             f"model: {arch.num_parameters():,} parameters; config from {arch.source}"]
    if arch.source.startswith(TABLE_SOURCE):
        unchecked.append(f"the model's own config.json (not in the local cache{', offline' if _offline() else ''}; "
                         "the published numbers were used)")
    if arch.model_type not in LLAMA_LIKE and not arch.measured:
        unchecked.append(f"the parameter count of model_type {arch.model_type} (counted as a Llama-style decoder)")
    if not looks_local(recipe.model) and not recipe.model.startswith(BUILTIN_PREFIX):
        unchecked.append("that the model's weights can be downloaded" if not _offline()
                         else "that the model's weights are in the cache (offline)")
    gpu = _gpu_memory()
    if gpu is None:
        unchecked.append(f"whether {gib(e.total, unit)} {name} fits the GPUs (no GPU here; python -m finetune.plan "
                         f"--recipe {recipe_name or 'NAME'} --gpus {world_size} --gpu-mem 80GB checks a budget)")
    else:
        verdict = "fits" if e.fits(gpu) else "does NOT fit"
        lines.append(f"this machine's GPU: {gib(gpu)} GiB; the estimate {verdict} with {HEADROOM:.0%} headroom")
    if unchecked:
        lines.append("not checked: " + "; ".join(unchecked))
    return "\n".join(lines)


def _gpu_memory() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        return None
    return None


# ---------------------------------------------------------------- what a live rank holds


def _is_zero_optimizer(opt) -> bool:
    return hasattr(opt, "fp32_partitioned_groups_flat") or hasattr(opt, "single_partition_of_fp32_groups")


def _unwrap_optimizer(model, optimizer):
    opt = optimizer
    if opt is None:
        opt = getattr(model, "optimizer", None)  # a DeepSpeedEngine holds its ZeRO optimizer
    for _ in range(8):
        if opt is None or _is_zero_optimizer(opt) or type(opt).__name__ == "ZeroRedundancyOptimizer":
            return opt
        inner = getattr(opt, "optimizer", None)  # accelerate's AcceleratedOptimizer / DeepSpeedOptimizerWrapper
        if inner is None or inner is opt:
            return opt
        opt = inner
    return opt


def _tensors(value):
    """Tensors inside an optimizer-state value, a list or a dict."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def held_bytes(model, optimizer=None, device: str | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer states that THIS rank holds, by distinct storage.

    Counts each tensor storage once (untyped_storage().data_ptr()), in the order parameters,
    gradients, optimizer, so a storage shared between them (ZeRO-3's fp32 master that is the
    partition itself in fp32 training, tied embeddings) counts once, as the first. Handles plain
    modules and DDP; FSDP2 DTensor parameters, gradients and states (their local shards); DeepSpeed
    ZeRO engines (stage 1/2: the flat 16-bit groups, `single_partition_of_fp32_groups` and their
    gradients, `averaged_gradients`, `all_grad_tensors`, `grads_in_partition`; stage 3: each parameter's `ds_tensor`,
    `fp32_partitioned_groups_flat`, `grad_partitions_flat_buffer`; states in `optimizer.optimizer.state`);
    torch ZeroRedundancyOptimizer (only the local shard's states, `optimizer.optim.state`).
    Meta tensors count 0, and so do scalar step counters and communication buckets. On a GPU run,
    tensors in CPU memory (offload) are reported apart as cpu_params / cpu_grads / cpu_optimizer.

    Gradients exist between backward and zero_grad, Adam's states from the first step on: call it
    after a backward (and a step) to see everything. Under Accelerate, DeepSpeed's backward also
    steps and frees the gradients at an accumulation boundary: they show between micro-steps only.
    """
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        DTensor = ()

    module = getattr(model, "module", model)
    if device is None:
        device = "cpu"
        for t in list(module.parameters()) + list(module.buffers()):
            for cand in (t, getattr(t, "ds_tensor", None)):
                if isinstance(cand, DTensor):
                    cand = cand.to_local()
                if isinstance(cand, torch.Tensor) and cand.device.type not in ("cpu", "meta"):
                    device = cand.device.type
                    break
            if device != "cpu":
                break
    out = {"params": 0, "grads": 0, "optimizer": 0, "cpu_params": 0, "cpu_grads": 0, "cpu_optimizer": 0}
    seen: set = set()

    def add(kind: str, t) -> None:
        if t is None:
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.dim() == 0:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or storage.nbytes() == 0:
            return
        key = (t.device.type, t.device.index, ptr)
        if key in seen:
            return
        seen.add(key)
        if t.device.type == "cpu" and device != "cpu":
            out["cpu_" + kind] += storage.nbytes()
        else:
            out[kind] += storage.nbytes()

    opt = _unwrap_optimizer(model, optimizer)
    params = list(module.parameters())
    for p in params:
        add("params", getattr(p, "ds_tensor", None))
        add("params", p)
    if opt is not None and _is_zero_optimizer(opt):
        for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat"):
            for t in getattr(opt, name, None) or []:
                add("params", t)

    for p in params:
        add("grads", p.grad)
    if opt is not None and _is_zero_optimizer(opt):
        for name in ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer"):
            for t in _tensors(getattr(opt, name, None)):
                add("grads", t)
        masters = getattr(opt, "fp32_partitioned_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups", [])
        for t in masters:
            add("grads", t.grad)
        for t in masters:
            add("optimizer", t)
        states = getattr(getattr(opt, "optimizer", None), "state", {}) or {}
    elif opt is not None and type(opt).__name__ == "ZeroRedundancyOptimizer":
        states = opt.optim.state
    else:
        states = getattr(opt, "state", {}) or {}
    for state in states.values():
        for t in _tensors(state):
            add("optimizer", t)

    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["cpu_total"] = out["cpu_params"] + out["cpu_grads"] + out["cpu_optimizer"]
    out["device"] = device
    return out


__all__ = ["Architecture", "EstimateError", "Estimate", "Setup", "SETUPS", "KNOWN_ARCHITECTURES",
           "architecture_from_config", "load_architecture", "known_architecture", "lora_parameters",
           "paper_model_states", "state_bytes", "activation_bytes", "estimate", "recipe_estimate",
           "all_estimates", "cheapest_fit", "parse_size", "plan_table", "memory_report", "held_bytes"]
