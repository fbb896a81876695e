"""`finetune chat PATH [PROMPT]`: answers from any output of a run, with the prompt rendered as the run
rendered its prompts and generated as the run's samples are (finetune/generation.py), so that
`finetune chat OUTPUT_DIR/final` gives, token for token, the answers the run's last samples gave.

PATH is final/ or final_merged/ (a plain model), a LoRA adapter folder (its base: --base, else the
run's recipe.json, else the adapter's own record), or a checkpoint, whose weights are rebuilt in
memory the way `finetune export` rebuilds them, without writing a model to disk. A 4-bit (QLoRA)
base is loaded through finetune's own loading (finetune.model.load_model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from finetune.checkpointing.layout import HF_DIR, MANIFEST
from finetune.checkpointing.manifest import verify
from finetune.checkpointing.safe_loading import safe_loading
from finetune.checkpointing.export import ExportError, checkpoint_state_dict, lora_keys
from finetune.generation import Sampling, generate, pad_id_for, render_prompt, stop_ids
from finetune.model import add_lora, context_length, load_model
from finetune.recipe import FIELDS, Recipe, RecipeError
from finetune.strategy import final_in_training_dtype

# The run's data format -> how chat renders a prompt (finetune.generation.render_prompt). Preference pairs
# (objective=dpo) by their kind, recorded in recipe.json's data.sources as "pairs": string prompts are
# tokenized as prompt_completion rows are, conversations with the chat template (finetune.data.preference)
RUN_FORMATS = {"messages": "chat", "alpaca": "alpaca", "prompt_completion": "prompt_completion", "prompt": "prompt"}
PAIR_FORMATS = {"text": "prompt_completion", "conversational": "chat"}
# GRPO's prompt rows (recipe.json's data.sources "prompts"): text is BOS + text, conversations the chat template
PROMPT_ROW_FORMATS = {"text": "prompt", "conversational": "chat"}
DEFAULT_MAX_NEW_TOKENS = 256  # a model without a recipe.json of its run


def source_format(source: dict) -> str | None:
    if source.get("format") in ("preference", "unpaired"):  # KTO's rows are rendered as a pair's side is
        return PAIR_FORMATS.get(source.get("pairs"))
    if source.get("format") == "prompt" and source.get("prompts"):
        return PROMPT_ROW_FORMATS.get(source["prompts"])
    return RUN_FORMATS.get(source.get("format"))


def max_new_tokens_of(recipe: dict) -> int:
    """How long the run's own answers were (finetune.generation.answer_length, read from recipe.json): a
    GRPO or distillation run's completions (max_completion_len), else its samples at eval
    (sample_max_new_tokens); DEFAULT_MAX_NEW_TOKENS without a recipe.json."""
    key = "max_completion_len" if recipe.get("objective") in ("grpo", "distill") else "sample_max_new_tokens"
    value = recipe.get(key)
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_NEW_TOKENS


def refuse_reward_model(path: Path, recipe: dict) -> None:
    """A reward model scores a whole sequence; it has no output layer over the vocabulary, and a causal LM
    built from it would answer from a random one."""
    configs = [path / "config.json", path / HF_DIR / "config.json"]
    architectures = []
    for config in configs:
        try:
            architectures += json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            pass
    if recipe.get("objective") == "reward" or any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RecipeError(f"{path} is a reward model (objective=reward): it scores sequences and does not generate; "
                          f"score completions with finetune.rewards.RewardModel({str(path)!r}), or chat with a "
                          "policy's final/")


def run_recipe(path: Path) -> dict:
    """The recipe.json of the run PATH came from: in a checkpoint, beside final/, or in the output_dir
    above a checkpoint; {} when there is none."""
    for where in (path, path.parent, path.parent.parent):
        if (where / "recipe.json").is_file():
            try:
                return json.loads((where / "recipe.json").read_text())
            except (OSError, ValueError):
                return {}
    return {}


def run_format(recipe: dict) -> str | None:
    """The prompt format of the run's data, when it has one (a text run has none; nor has a preference
    run whose recipe.json does not say which kind its pairs were)."""
    sources = (recipe.get("data") or {}).get("sources") or []
    formats = {source_format(s) for s in sources}
    if not sources and recipe.get("dataset_format") not in (None, "auto"):
        formats = {RUN_FORMATS.get(recipe["dataset_format"])}
    return formats.pop() if len(formats) == 1 else None


def _model_recipe(recipe: dict):
    """The fields of a run's recipe that say how its model is built (LoRA, 4-bit, precision)."""
    keep = ("lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
            "mixed_precision", "attn_implementation")
    values = {k: recipe[k] for k in keep if k in recipe and k in FIELDS}
    if "lora_target_modules" in values:
        values["lora_target_modules"] = tuple(values["lora_target_modules"] or ())
    return dataclasses.replace(Recipe(), **values)


def _base_model(base: str, adapter_recipe):
    """The frozen base of a LoRA output, with a fresh adapter on it when it is 4-bit (finetune's own
    QLoRA loading); else the plain base in fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if adapter_recipe.load_in_4bit:
            return load_model(adapter_recipe, base, AutoConfig.from_pretrained(base)), True
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), False
    except (OSError, ValueError) as e:
        raise RecipeError(f"the LoRA base {base} cannot be loaded ({str(e).strip().splitlines()[0]}); pass "
                          "--base PATH_OR_HUB_ID of the model it was trained on") from None


def _with_adapter(base: str, recipe: dict, adapter: dict | None, adapter_dir: Path | None):
    """A peft model: the base with the adapter in `adapter_dir` (peft's files) or `adapter` (tensors)."""
    from peft import PeftModel, set_peft_model_state_dict

    settings = _model_recipe(recipe | {"lora": True})
    model, has_adapter = _base_model(base, settings)
    if adapter_dir is not None and not has_adapter:
        return PeftModel.from_pretrained(model, adapter_dir)
    if adapter is None:
        from safetensors.torch import load_file

        adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    if not has_adapter:
        model = add_lora(model, settings)
    result = set_peft_model_state_dict(model, adapter)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise RecipeError(f"the adapter does not fit the base {base}: missing {missing[:3]}, unexpected "
                          f"{list(result.unexpected_keys)[:3]}; pass --base with the model it was trained on")
    return model


def _from_checkpoint(ckpt: Path, base: str | None):
    """A checkpoint's model rebuilt in memory, as finetune.checkpointing.export rebuilds it before writing, after the
    same verification: every file's size and checksum (a shard corrupted at the same size answers from
    nothing)."""
    manifest = verify(ckpt, checksums=True, resume=False)
    if "checksums" not in manifest:
        print(f"note: {ckpt} has no checksums (written by an older finetune): only file sizes were checked",
              file=sys.stderr)
    recipe = json.loads((ckpt / "recipe.json").read_text()) if (ckpt / "recipe.json").is_file() else {}
    # DeepSpeed's ZeRO reader prints to stdout, which holds only the answers
    with contextlib.redirect_stdout(sys.stderr):
        return _rebuild(ckpt, base, manifest, recipe)


def _rebuild(ckpt: Path, base: str | None, manifest: dict, recipe: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if recipe.get("lora"):
            adapter = lora_keys(checkpoint_state_dict(ckpt, None))
            return _with_adapter(base or manifest["fingerprint"]["model"], recipe, adapter, None)
        config = AutoConfig.from_pretrained(ckpt / HF_DIR)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(checkpoint_state_dict(ckpt, model.state_dict()), strict=False)
    except ExportError as e:
        raise RecipeError(str(e)) from None
    if unexpected:
        raise RecipeError(f"{ckpt} does not match its config: unexpected {unexpected[:5]}")
    model.tie_weights()
    if final_in_training_dtype(recipe):
        model = model.to(torch.bfloat16 if recipe["mixed_precision"] == "bf16" else torch.float16)  # as final/
    return model


def load(path: Path, base: str | None = None):
    """(model in eval mode, tokenizer, the run's recipe.json or {}) for any output PATH, every file read
    under safe_loading (a torch.load of final/'s pytorch_model.bin or an adapter's .bin is weights-only
    whatever transformers' or peft's default)."""
    with safe_loading():
        return _load(path, base)


def _load(path: Path, base: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = run_recipe(path)
    refuse_reward_model(path, recipe)
    if (path / "adapter_config.json").is_file():
        adapter_config = json.loads((path / "adapter_config.json").read_text())
        base = base or recipe.get("model") or adapter_config.get("base_model_name_or_path")
        if not base:
            raise RecipeError(f"{path} is a LoRA adapter and names no base model; pass --base PATH_OR_HUB_ID")
        model, tokenizer_dir = _with_adapter(base, recipe, None, path), path
    elif (path / HF_DIR / "config.json").is_file() or (path / MANIFEST).is_file():
        model, tokenizer_dir = _from_checkpoint(path, base), path / HF_DIR
    elif (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()):
        model, tokenizer_dir = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), path
    else:
        raise RecipeError(f"{path} holds no model: give final/ or final_merged/ of a run, a LoRA adapter folder "
                          "(adapter_config.json), or a checkpoint (checkpoints/step_N)")
    return model.eval(), AutoTokenizer.from_pretrained(tokenizer_dir), recipe


def prompt_format(chosen: str | None, tokenizer, recipe: dict, path: Path) -> str:
    """--format, else the run's data format, else the tokenizer's chat template."""
    fmt = chosen or run_format(recipe) or ("chat" if getattr(tokenizer, "chat_template", None) else None)
    if fmt is None:
        raise RecipeError(f"{path}: the tokenizer has no chat template and no recipe.json of its run says how "
                          "prompts were written; pass --format alpaca, prompt_completion or raw")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise RecipeError(f"--format chat: the tokenizer in {path} has no chat template; pass --format alpaca, "
                          "prompt_completion or raw")
    pairs = [s for s in (recipe.get("data") or {}).get("sources") or [] if s.get("format") == "preference"]
    if chosen is None and pairs and not run_format(recipe):
        print(f"note: the recipe.json of {path} does not say whether the run's preference prompts were strings or "
              f"conversations; prompts are rendered as {fmt}; pass --format prompt_completion for string prompts",
              file=sys.stderr)
    return fmt


def context_warnings(model, recipe: dict, prompt_tokens: int) -> list[str]:
    """What a prompt of this many tokens goes beyond: the model's positions, the run's max_seq_len."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None)
    if context and prompt_tokens >= context:
        return [f"warning: the prompt is {prompt_tokens} tokens, the model's context is {context} positions "
                "(max_position_embeddings): the answer comes from past what the model can place; shorten the prompt"]
    trained = recipe.get("max_seq_len")
    if isinstance(trained, int) and prompt_tokens >= trained:
        return [f"warning: the prompt is {prompt_tokens} tokens, the run trained on rows of at most max_seq_len="
                f"{trained}: the model never saw one this long"]
    return []


def answer(model, tokenizer, text: str, fmt: str, max_new_tokens: int, temperature: float = 0.0,
           generator=None, input: str = "") -> str:
    """The model's answer to one prompt, ended by a stop token, max_new_tokens or the model's context.
    Sampled (temperature > 0): the answer's seed is drawn from `generator` (--seed), so a session's
    answers follow its seed."""
    import torch

    seeds = None
    if temperature > 0:
        seeds = [int(torch.randint(2**62, (1,), generator=generator or torch.Generator()))]
    [completion] = generate(model, [render_prompt(tokenizer, text, fmt, input)],
                            Sampling(max_new_tokens, temperature), stop_ids=stop_ids(tokenizer, model),
                            pad_id=pad_id_for(tokenizer), context=context_length(model.config), seeds=seeds,
                            vocab_size=len(tokenizer))
    return tokenizer.decode(completion.tokens, skip_special_tokens=True)


def tools_of(specs: str | None, recipe: dict) -> list:
    """--tools module:function,... as functions (tools.resolve_tools: one line where one cannot be used), else
    the tools of the run's recipe.json (an environment_factory, which needs a data row to reset, is not
    offered: name its tools' functions with --tools)."""
    from finetune.tools import ToolSpecError, resolve_tools

    names = [s.strip() for s in specs.split(",") if s.strip()] if specs else list(recipe.get("tools") or [])
    try:
        return resolve_tools(names)
    except ToolSpecError as e:
        raise RecipeError(f"--{e}" if str(e).startswith("tools=") else str(e)) from None


def answer_with_tools(model, tokenizer, text: str, funcs: list, max_new_tokens: int, temperature: float = 0.0,
                      generator=None, timeout: float = 60.0) -> tuple[str, list[str]]:
    """The model's answer to one chat prompt with tools (finetune/training/agent.py, as a GRPO run's rollout): the
    prompt rendered with the tools' schemas, the calls the model writes run between its turns and their
    answers fed back, until a turn without a call or max_new_tokens in all. (the last answer, a line per call:
    `[tool] name {arguments} -> answer`)."""
    import json as _json

    import torch

    from finetune.data import render_chat
    from finetune.end_of_turn import end_of_turn
    from finetune.tools import Toolbox, schema
    from finetune.training.agent import Conversations, template_for

    schemas = [schema(f) for f in funcs]
    stops = stop_ids(tokenizer, model) | set(end_of_turn(tokenizer).ids)
    template = template_for(tokenizer, schemas, stops, getattr(model, "name_or_path", "the model"))
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer(render_chat(tokenizer, messages, True, tools=schemas), add_special_tokens=False).input_ids
    turns = Conversations(template, Toolbox(funcs, schemas=schemas), [{"prompt": messages}], [0], [prompt],
                          max_rounds=0, timeout=timeout, context=context_length(model.config))
    seeds = None
    if temperature > 0:
        seeds = [int(torch.randint(2**62, (1,), generator=generator or torch.Generator()))]
    [completion] = generate(model, [prompt], Sampling(max_new_tokens, temperature), stop_ids=stops,
                            pad_id=pad_id_for(tokenizer), context=context_length(model.config), seeds=seeds,
                            vocab_size=len(tokenizer), turns=turns)
    turns.finish([completion])
    said = [m["content"] for m in turns.messages[0] if m["role"] == "assistant"]
    calls = [c for m in turns.messages[0] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    answers = [m for m in turns.messages[0] if m["role"] == "tool"]
    lines = [f"[tool] {c['function']['name']} {_json.dumps(c['function']['arguments'])} -> "
             f"{a['content'] if a is not None else '(not run: past max_new_tokens or the rounds)'}"
             for c, a in zip(calls, answers + [None] * (len(calls) - len(answers)))]
    return (said[-1] if said else ""), lines

