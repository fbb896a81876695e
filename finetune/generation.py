"""Generation, shared by the samples at eval (finetune/training/samples.py), `finetune chat` (finetune/chat.py)
and any objective that generates before its step: how a prompt becomes tokens (render_prompt), where
an answer ends (stop_ids), and one batched generation with the model's KV cache (generate).

generate takes a plain Hugging Face causal LM whose weights are whole: the caller gathers a sharded
model once around the call (Strategy.whole_weights), never per token. Prompts of different lengths are
left-padded into one batch (an attention mask hides the padding, position ids count each prompt's own
tokens from 0), so every sequence's next token comes from one forward. Each sequence ends at its own
stop token, at max_new_tokens, or where its prompt and answer fill the model's context; a finished
sequence rides along on padding until the batch ends. Sampling draws each sequence's tokens from its own
torch.Generator (seeded per sequence), so a sequence's tokens do not depend on what else is in the batch.
Greedy tokens equal those of one sequence at a time (tests/test_generation.py, real tokenizers); a batch
of one, or of prompts of one length, runs exactly the forwards one sequence would (no mask, no position
ids: the model's own)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from finetune import data as D
from finetune.recipe import RecipeError

# How a prompt typed by a user becomes the tokens the model continues (render_prompt): the chat
# template with its generation prompt, a run's alpaca or prompt_completion prompt, or the text as is.
PROMPT_FORMATS = ("chat", "alpaca", "prompt_completion", "prompt", "raw")


def render_prompt(tokenizer, text: str, fmt: str, input: str = "") -> list[int]:
    """The prompt's token ids exactly as training rendered the same prompt before its answer
    (finetune.data.encode_row): tests/test_samples.py checks this against encode_row's prompt part on
    real tokenizers. fmt=raw: `text` is the whole prompt as the model sees it (template markers
    included), tokenized with its special tokens and the tokenizer's BOS once. input: alpaca's input
    field (the text is its instruction)."""
    if fmt == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise RecipeError("the tokenizer has no chat template; pass --format alpaca, prompt_completion or raw")
        text = D.render_chat(tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
        fmt = "raw"
    if fmt == "raw":
        ids = tokenizer(text, add_special_tokens=False).input_ids
        bos = D.bos_ids(tokenizer)
        return (bos if ids[:len(bos)] != bos else []) + ids
    if fmt == "alpaca":
        text = (D.ALPACA_PROMPT_WITH_INPUT if input else D.ALPACA_PROMPT).format(instruction=text, input=input)
    elif fmt not in ("prompt_completion", "prompt"):  # prompt: GRPO's text prompts, BOS + text as well
        raise RecipeError(f"prompt format {fmt!r}; allowed: {', '.join(PROMPT_FORMATS)}")
    return D.bos_ids(tokenizer) + D.text_ids(tokenizer, text)


def answer_length(recipe) -> int:
    """The most tokens a run's own answers get, in its samples at eval (and `finetune chat`'s default): a
    GRPO run's completions are max_completion_len long; other runs' samples sample_max_new_tokens."""
    return recipe.max_completion_len if recipe.objective == "grpo" else recipe.sample_max_new_tokens


def stop_ids(tokenizer, model, generation_config=None) -> set[int]:
    """Where an answer ends: the tokenizer's EOS and the generation config's (a chat model's end of turn).
    generation_config: the one the run writes into final/ (finetune/end_of_turn.py), so that samples at
    eval stop where `finetune chat` on final/ stops; else the model's own."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    config_eos = getattr(config, "eos_token_id", None)
    ids |= set(config_eos if isinstance(config_eos, (list, tuple)) else [] if config_eos is None else [config_eos])
    return ids


def pad_id_for(tokenizer) -> int:
    """The id that left-pads prompts (never attended to): the tokenizer's pad, else its EOS, else 0."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p; 1: all
    top_k: int = 0  # the k most likely tokens; 0: all

    def __post_init__(self):
        if self.max_new_tokens < 0 or self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"{self}: max_new_tokens, temperature and top_k must be >= 0, top_p in (0, 1]")


@dataclass
class Completion:
    tokens: list[int]  # the generated ids, without the prompt; ends with the stop id when one was hit
    stopped: bool  # True: ended on a stop id; False: cut at max_new_tokens, at the context, or by should_stop
    seconds: float = 0.0  # from the call's start until this sequence ended


def _filtered(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One sequence's logits / temperature, with the tokens top_k and top_p leave out at -inf."""
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
        drop = before >= sampling.top_p  # the tokens after the set reached top_p (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    probs = torch.softmax(_filtered(logits, sampling), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def check_request(prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None) -> bool:
    """A generation backend's checks of its arguments; whether it samples (temperature > 0)."""
    if any(not p for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    sampled = sampling.temperature > 0
    if sampled and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("generate: sampling (temperature > 0) needs one seed per prompt")
    return sampled


@torch.no_grad()  # without it every token's forward stays in an autograd graph held by the KV cache
def generate(model, prompts: list[list[int]], sampling: Sampling, *, stop_ids: Collection[int], pad_id: int,
             context: int | None, seeds: list[int] | None = None,
             should_stop: Callable[[], bool] | None = None) -> list[Completion]:
    """Batched KV-cache generation over left-padded prompts on an unwrapped HF causal LM whose weights are
    already whole (the caller gathers them once around the call). seeds[i] seeds sequence i's own
    torch.Generator, so its tokens do not depend on what else is in the batch. Greedy needs no seeds.
    context: the model's positions (finetune.model.context_length; None: no bound): a sequence ends
    where its prompt and answer fill it. should_stop: read before each token (a stop request); True
    ends every sequence where it is."""
    if not prompts:
        return []
    sampled = check_request(prompts, sampling, seeds)
    generators = [torch.Generator().manual_seed(s) for s in seeds] if sampled else []
    n, lengths = len(prompts), [len(p) for p in prompts]
    budget = [sampling.max_new_tokens if context is None else min(sampling.max_new_tokens, max(context - k, 0))
              for k in lengths]
    device = next(model.parameters()).device
    width = max(lengths)
    padded = width != min(lengths)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = positions = None
    if padded:  # otherwise the model's own mask and positions, as for one sequence
        mask = torch.tensor([[0] * (width - k) + [1] * k for k in lengths], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stop = set(stop_ids)
    out = [Completion([], False) for _ in prompts]
    active = [b > 0 for b in budget]
    t0 = time.perf_counter()
    past = None
    router_logits = getattr(getattr(model, "config", None), "output_router_logits", False)
    while any(active):
        if should_stop is not None and should_stop():
            break
        extra = {"attention_mask": mask, "position_ids": positions} if padded else {}
        if router_logits:  # a mixture of experts' training-only router loss, whose mask cannot follow a cache
            extra["output_router_logits"] = False
        result = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1, **extra)
        past = result.past_key_values
        logits = result.logits[:, -1].float()
        if sampled:
            tokens = [_sample(logits[i], sampling, generators[i]) if active[i] else pad_id for i in range(n)]
        else:
            tokens = logits.argmax(-1).tolist()
        now = time.perf_counter() - t0
        for i in range(n):
            if not active[i]:
                tokens[i] = pad_id
                continue
            out[i].tokens.append(tokens[i])
            out[i].seconds = now
            if tokens[i] in stop:
                out[i].stopped, active[i] = True, False
            elif len(out[i].tokens) >= budget[i]:
                active[i] = False
        if not any(active):
            break
        ids = torch.tensor(tokens, device=device).view(n, 1)
        if padded:
            mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
            positions = positions[:, -1:] + 1
    return out
