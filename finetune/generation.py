"""Generation, shared by the samples at eval (finetune/training/samples.py), `finetune chat` (finetune/chat.py)
and any objective that generates before its step: how a prompt becomes tokens (render_prompt), where
an answer ends (stop_ids), and one batched generation with the model's KV cache (generate).

generate takes a plain Hugging Face causal LM whose weights are whole: the caller gathers a sharded
model once around the call (Strategy.whole_weights), never per token. Prompts of different lengths are
left-padded into one batch (an attention mask hides the padding, position ids count each prompt's own
tokens from 0), so every sequence's next token comes from one forward. Each sequence ends at its own
stop token, at max_new_tokens, or where its prompt and answer fill the model's context; a finished
sequence rides along on padding until the batch ends.

Each token is chosen for the whole batch at once, on the model's device (next_tokens): greedy, the
argmax; sampled, one Gumbel-max draw, argmax(logits / temperature, top_k and top_p applied row by row,
+ Gumbel noise), whose noise is a pure function of (the sequence's seed, the token's position in its
completion, the token id) computed by a counter-based generator in integer ops (noise_bits). So a
sequence's tokens do not depend on what else is in the batch, on the rank or process count, nor on a
resume, and the host reads the batch's state once per token (once per 8 on a GPU), never per row.
Ids past the tokenizer's vocabulary (vocab_size: embedding rows padded for speed) are never chosen.

Greedy tokens equal those of one sequence at a time (tests/test_generation.py, real tokenizers); a
batch of one, or of prompts of one length, runs exactly the forwards one sequence would (no mask, no
position ids: the model's own). compiled=True: the same tokens from a preallocated StaticCache and a
compiled one-token step (CUDA graphs on a GPU); the default on a GPU through generation_compile=auto."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from finetune import data as D
from finetune.memory import static_cache_length
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
    GRPO or distillation run's completions are max_completion_len long; other runs' samples sample_max_new_tokens."""
    return recipe.max_completion_len if recipe.objective in ("grpo", "distill") else recipe.sample_max_new_tokens


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
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability, when asked (generate's logprobs)
    mask: list[int] | None = None  # with turns: 1 where the model drew the token, 0 where it was fed (a tool's answer)


class Turns:
    """What a multi-turn generation asks between turns (finetune/training/agent.py holds one per batch):
    called when sequence `row` draws a stop token (the last of `tokens`, its completion so far), with
    `room` tokens left to it, it answers the tokens to feed the sequence before it draws again (a tool's
    answer as the chat template renders it), or None: the sequence ends there. Fed tokens never end a
    turn, count against the budget, and are marked 0 in Completion.mask."""

    def turn_ended(self, row: int, tokens: list[int], room: int) -> list[int] | None:
        raise NotImplementedError


# A counter-based generator (splitmix64's output function: Steele, Lea and Flood, "Fast splittable
# pseudorandom number generators", 2014) in torch int64 ops, which wrap modulo 2**64 alike on CPU and
# CUDA: the noise of token id v at completion position t of the completion seeded s is
# mix64(key(s, t) + (v + 1) * GAMMA), a pure function of (s, t, v). Nothing depends on the other rows of
# the batch, the device, the rank or how many tokens were drawn before.
def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k as an unsigned 64-bit shift (torch's >> on int64 copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit integers (int64 tensors, wrapping)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def noise_bits(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] int64: 64 random bits per token id for each row's completion seed (seeds: [rows]
    int64) at completion position `position` (the token's index in its completion, from 0)."""
    key = mix64(mix64(seeds + GAMMA) ^ mix64(torch.full_like(seeds, position + 1) * GAMMA))
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    return mix64(key[:, None] + ids * GAMMA)


def gumbel_noise(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 standard Gumbel noise, -log(-log(u)), u = the top 52 bits + 1/2 over 2**52
    (in (0, 1), never 0 or 1)."""
    u = (_shift_right(noise_bits(seeds, position, vocab), 12).double() + 0.5) * 2.0 ** -52
    return -torch.log(-torch.log(u))


def _filtered(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[rows, vocab] logits / temperature, with the tokens top_k and top_p leave out at -inf, row by row."""
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p  # after the set reached top_p (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, seeds: torch.Tensor | None, position: int,
                vocab_size: int | None = None) -> torch.Tensor:
    """Each row's next token from its [rows, vocab] logits, on their device, in one batched draw: greedy,
    the argmax; sampled, the Gumbel-max draw argmax(filtered logits + Gumbel noise of (seed, position)),
    a draw from softmax(filtered logits). Ids from vocab_size on (embedding rows past the tokenizer's
    vocabulary) are never chosen."""
    logits = logits.float()
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = torch.cat([logits[:, :vocab_size], logits.new_full((len(logits), logits.shape[-1] - vocab_size),
                                                                    float("-inf"))], dim=-1)
    if sampling.temperature == 0:
        return logits.argmax(-1)
    scores = _filtered(logits, sampling).double() + gumbel_noise(seeds, position, logits.shape[-1])
    return scores.argmax(-1)


def check_request(prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None) -> bool:
    """A generation backend's checks of its arguments; whether it samples (temperature > 0)."""
    if any(not p for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    sampled = sampling.temperature > 0
    if sampled and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("generate: sampling (temperature > 0) needs one seed per prompt")
    return sampled


@torch.no_grad()  # no autograd graph: a cache chained through every token's forward would hold them all
def generate(model, prompts: list[list[int]], sampling: Sampling, *, stop_ids: Collection[int], pad_id: int,
             context: int | None, seeds: list[int] | None = None,
             should_stop: Callable[[], bool] | None = None, vocab_size: int | None = None,
             compiled: bool = False, logprobs: bool = False, logprob_rows: int | None = None,
             turns: Turns | None = None) -> list[Completion]:
    """Batched KV-cache generation over left-padded prompts on an unwrapped HF causal LM whose weights are
    already whole (the caller gathers them once around the call). seeds[i] is sequence i's own seed: its
    tokens are drawn with noise keyed by (seeds[i], position) (next_tokens), so they do not depend on
    what else is in the batch. Greedy needs no seeds. context: the model's positions
    (finetune.model.context_length; None: no bound): a sequence ends where its prompt and answer fill it.
    should_stop: read before each token (a stop request); True ends every sequence where it is.
    vocab_size: the tokenizer's vocabulary (len(tokenizer)); ids from it on are never generated.
    compiled: the KV cache preallocated (transformers' StaticCache) and each one-token step a compiled
    graph (torch.compile; CUDA graphs on a GPU): the same tokens as eager (tests/test_generation.py),
    worth its compile time on a GPU (decode_compiled). logprobs: also each drawn token's log-probability
    under the distribution a trainer scores (token_logps_within: softmax of the logits / temperature, 1
    when greedy, over the first vocab_size ids, before top_k and top_p), in Completion.logprobs;
    logprob_rows: over the output layer's first logprob_rows ids instead (all of them: a loss's token_logps).
    turns: a multi-turn generation (Turns): a sequence
    that ends a turn may be fed more tokens and go on, in the same KV cache (nothing is computed again);
    its sampled tokens keep their positions' noise, so a seed fixes the whole conversation."""
    if not prompts:
        return []
    sampled = check_request(prompts, sampling, seeds)
    n, lengths = len(prompts), [len(p) for p in prompts]
    budget = [sampling.max_new_tokens if context is None else min(sampling.max_new_tokens, max(context - k, 0))
              for k in lengths]
    device = next(model.parameters()).device
    width = max(lengths)
    padded = width != min(lengths)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    seed_ids = torch.tensor(seeds, dtype=torch.int64, device=device) if sampled else None
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    left = torch.tensor(budget, device=device)  # tokens each sequence may still take
    active, stopped = left > 0, torch.zeros(n, dtype=torch.bool, device=device)
    mask = positions = None
    if padded:  # otherwise the model's own mask and positions, as for one sequence
        mask = torch.tensor([[0] * (width - k) + [1] * k for k in lengths], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    longest = max(budget)
    step = _Decoder(model, n, width, longest, mask, positions) if compiled and longest < 2**20 else None
    # is any sequence still going: read every token on CPU (free), every 8th on a GPU (a device sync); every
    # token with turns, whose ends the host answers
    check_every = 8 if device.type == "cuda" and turns is None else 1
    fed = _Fed(n, pad_id, device) if turns is not None else None
    columns: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []  # each column's log-probabilities (logprobs=True)
    checked: list[tuple[int, float]] = []  # (tokens drawn, seconds since t0) where the host looked
    t0 = time.perf_counter()
    past = None
    router_logits = getattr(getattr(model, "config", None), "output_router_logits", False)
    going = longest > 0
    while going:
        if should_stop is not None and should_stop():
            break
        t = len(columns)
        if step is not None:
            logits = step(ids, t)
        else:
            extra = {"attention_mask": mask, "position_ids": positions} if padded else {}
            if router_logits:  # a mixture of experts' training-only router loss, whose mask cannot follow a cache
                extra["output_router_logits"] = False
            result = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1, **extra)
            past, logits = result.past_key_values, result.logits[:, -1]
        tokens = next_tokens(logits, sampling, seed_ids, t, vocab_size)
        if fed is not None:
            tokens = fed.override(tokens)
        tokens = torch.where(active, tokens, pad_id)
        columns.append(tokens)
        if logprobs:
            scores.append(drawn_logps(logits, tokens, sampling.temperature or 1.0, logprob_rows or vocab_size))
        hit = active & torch.isin(tokens, stop)
        if fed is not None:
            hit = fed.answer(turns, tokens, active, hit, left)
        stopped |= hit
        left = left - active.long()
        active = active & ~hit & (left > 0)
        if (t + 1) % check_every == 0:
            going = bool(active.any())
            checked.append((t + 1, time.perf_counter() - t0))
        if not going or t + 1 == longest:
            break
        ids = tokens.view(n, 1)
        if padded and step is None:
            mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
            positions = positions[:, -1:] + 1
    checked.append((len(columns), time.perf_counter() - t0))
    drawn = torch.stack(columns, 1).cpu().tolist() if columns else [[] for _ in prompts]
    lengths_out = (torch.tensor(budget, device=device) - left).cpu().tolist()
    logps = torch.stack(scores, 1).cpu().tolist() if scores else [[] for _ in prompts]
    out = []
    for row, count, hit, lp in zip(drawn, lengths_out, stopped.cpu().tolist(), logps):
        # the seconds at the first look of the host once its last token was drawn
        seconds = next((s for k, s in checked if k >= count), checked[-1][1]) if count else 0.0
        out.append(Completion(row[:count], bool(hit), seconds, lp[:count]))
    if fed is not None:
        for completion, mask in zip(out, fed.masks):
            completion.mask = mask[:len(completion.tokens)]
    return out


def drawn_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                vocab_size: int | None = None) -> torch.Tensor:
    """[rows] float32: each row's drawn token's log-probability under softmax(logits / temperature) over the
    first vocab_size ids (the distribution a trainer scores: finetune.loss.token_logps_within)."""
    logits = logits.float()[:, :vocab_size] if vocab_size else logits.float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.clamp(max=logits.shape[-1] - 1)[:, None])[:, 0]


class _Fed:
    """A multi-turn generation's host side (generate's turns): each sequence's tokens so far, which of them
    were fed, and the tokens it is still to be fed."""

    def __init__(self, n: int, pad_id: int, device):
        self.pad_id, self.device = pad_id, device
        self.rows: list[list[int]] = [[] for _ in range(n)]
        self.masks: list[list[int]] = [[] for _ in range(n)]
        self.queue: list[list[int]] = [[] for _ in range(n)]
        self.now = [False] * n  # fed at this step

    def override(self, drawn: torch.Tensor) -> torch.Tensor:
        """The step's tokens: each sequence's next fed token where it has one, else what it drew."""
        self.now = [bool(q) for q in self.queue]
        if not any(self.now):
            return drawn
        forced = torch.tensor([q.pop(0) if q else self.pad_id for q in self.queue], device=self.device)
        return torch.where(torch.tensor(self.now, device=self.device), forced, drawn)

    def answer(self, turns: Turns, tokens: torch.Tensor, active: torch.Tensor, hit: torch.Tensor,
               left: torch.Tensor) -> torch.Tensor:
        """Record the step and ask `turns` about every sequence whose drawn token ends a turn; the sequences
        that end (a stop token drawn and nothing to feed them)."""
        going, values = active.tolist(), tokens.tolist()
        for i, on in enumerate(going):
            if on:
                self.rows[i].append(values[i])
                self.masks[i].append(0 if self.now[i] else 1)
        ended = [on and h and not now for on, h, now in zip(going, hit.tolist(), self.now)]
        rooms = left.tolist()
        for i in [i for i, e in enumerate(ended) if e]:
            more = turns.turn_ended(i, list(self.rows[i]), int(rooms[i]) - 1)
            if more:
                if len(more) > rooms[i] - 1:
                    raise ValueError(f"turns fed {len(more)} tokens to a sequence with room for {rooms[i] - 1}")
                self.queue[i] = list(more)
                ended[i] = False
        return torch.tensor(ended, dtype=torch.bool, device=hit.device)


class _Decoder:
    """The compiled decode loop's state: a StaticCache of prompt width + the longest budget (rounded up), filled by
    an eager forward of the prompts, then one compiled one-token forward a step at fixed shapes (the
    cache's whole attention mask, the prompts' padding at 0, and the step's positions as tensors), so
    the graph is traced once per model and batch shape and replayed for every token."""

    def __init__(self, model, n: int, width: int, new_tokens: int, mask, positions):
        device = next(model.parameters()).device
        self.model, self.width, self.n = model, width, n
        # the cache's length rounded up to a multiple, so that rollouts whose longest prompts differ a little
        # replay the same graph (its shapes include this length)
        self.length = static_cache_length(width + new_tokens)
        self.cache = _one_dtype_cache()(config=model.config, max_cache_len=self.length)
        self.mask = torch.ones(n, self.length, dtype=torch.long, device=device)
        if mask is not None:
            self.mask[:, :width] = mask
        self.start = (positions[:, -1:] + 1) if positions is not None else \
            torch.full((n, 1), width, dtype=torch.long, device=device)
        self.positions = positions if positions is not None else \
            torch.arange(width, device=device).expand(n, width)
        self.forward = _compiled_forward(model)
        # a mixture of experts' training-only router loss, whose mask cannot follow a cache
        self.extra = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}

    def __call__(self, ids: torch.Tensor, t: int) -> torch.Tensor:
        if t == 0:
            result = self.model(input_ids=ids, attention_mask=self.mask, position_ids=self.positions,
                                past_key_values=self.cache, cache_position=torch.arange(self.width, device=ids.device),
                                use_cache=True, logits_to_keep=1, **self.extra)
            return result.logits[:, -1]
        at = self.width + t - 1  # the cache slot of the token fed now
        with torch.compiler.set_stance("default"):  # callers hold compiled training layers eager around generation
            result = self.forward(input_ids=ids, attention_mask=self.mask, position_ids=self.start + (t - 1),
                                  past_key_values=self.cache,
                                  cache_position=torch.tensor([at], device=ids.device), use_cache=True, **self.extra)
        return result.logits[:, -1].clone()  # a CUDA graph's output is overwritten by its next replay


@functools.cache  # made once: the compiled step guards on the cache's type, a new class would retrace it
def _one_dtype_cache():
    """A StaticCache subclass that stores each layer's keys in its values' dtype.

    A static cache allocates one tensor per layer for keys and one for values, both in the dtype of the
    first keys it is given. Under autocast over fp32 weights (mixed_precision=bf16 or fp16 under ddp) the
    value projection comes out in 16 bits, but the keys come out in fp32, since transformers computes the
    rotary embedding's cos and sin in fp32 and the product promotes; some releases (5.17) then fail at the
    first value copy, "index_copy_(): self and source expected to have the same dtype". Attention under
    autocast reads keys and values in 16 bits either way, so storing the keys rounded to the values'
    dtype changes no token against the eager loop's cache, which keeps the fp32 keys and rounds them at
    each attention (tests/test_generation.py)."""

    from transformers.cache_utils import StaticCache

    class OneDtypeStaticCache(StaticCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(value_states.dtype), value_states, layer_idx, *args, **kwargs)

    return OneDtypeStaticCache


def _one_step(model, **inputs):
    return model(**inputs)


# one compiled step for every model, per device type, built at first use (dynamo guards on the model it
# is given and compiles once per model and shape; the weights are the graph's inputs, so regathered
# weights reuse it); CUDA graphs on a GPU
_STEP: dict = {}


def _compiled_forward(model):
    """The compiled one-token forward for the model's device type."""
    kind = "cuda" if next(model.parameters()).device.type == "cuda" else "cpu"
    if kind not in _STEP:
        _STEP[kind] = torch.compile(_one_step, mode="reduce-overhead" if kind == "cuda" else None, dynamic=False)
    return lambda **inputs: _STEP[kind](model, **inputs)


def decode_compiled(setting: str, device: torch.device) -> bool:
    """Whether generation runs the compiled decode loop: generation_compile=auto: on a GPU only (on CPU
    the compile takes longer than it saves: docs/benchmarks.md, rollout section); true, false."""
    return device.type == "cuda" if setting == "auto" else setting == "true"
