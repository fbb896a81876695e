"""What a model is, in the numbers memory and speed depend on: hidden size, layers, heads, vocabulary,
every Linear, the exact parameter count. Read from a config.json (a local directory, the hub cache,
or the table of published numbers below when offline) without loading any weight: the planner
(finetune/memory.py) sizes a run with it, metrics.py counts the FLOPs per token behind MFU."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from finetune.assets import resolve_model
from finetune.recipe import BUILTIN_PREFIX, RecipeError, looks_local

LLAMA_LIKE = ("llama", "mistral", "qwen2")


class EstimateError(RecipeError):
    """The estimate cannot be made (an unreadable config, an unknown architecture); one line."""



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


def offline() -> bool:
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
    if model.startswith(BUILTIN_PREFIX):  # the builtin model is built locally on first use
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
    if not offline():
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


def is_default_lora_target(name: str, module) -> bool:
    """The Linears a LoRA adapter targets by default: the decoder layers' projections, not MoE routers."""
    import torch

    short = name.rsplit(".", 1)[-1]
    return (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and short != "gate"
            and not short.endswith("_gate"))
