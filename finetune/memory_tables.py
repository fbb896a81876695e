"""The planner's answers as text, from memory.py's estimates: the table of setups with their per-GPU
memory and the fastest that fits (`finetune plan`), the longest sequence each setup fits (`finetune plan
--max-seq-len`), the dry run's memory report, and sizes read (`--gpu-mem 80GB`) and written.
"""

from __future__ import annotations

import re

from finetune.arch import LLAMA_LIKE, TABLE_SOURCE, Architecture, EstimateError, load_architecture, offline
from finetune.memory import (HEADROOM, Estimate, GiB, Rollout, Setup, all_estimates, holds_reference, lora_parameters,
                             own_setup_line, recipe_estimate, recipe_lora, teacher_architecture)
from finetune.recipe import BUILTIN_PREFIX, Recipe, looks_local, reference_kind


def longest_sequence(recipe: Recipe, world_size: int, arch: Architecture, setup: Setup, budget: int,
                     headroom: float = HEADROOM, sequence_parallel: int | None = None, limit: int = 2**24) -> int:
    """The longest max_seq_len (a multiple of sequence_parallel, which splits it) whose estimate for
    `setup` fits budget*(1-headroom) per GPU; 0 if not even one token per rank fits. GRPO: the longest
    max_completion_len after the recipe's prompt (grpo_prompt_tokens), the rollout phase's peak included.
    The estimate grows with the length, so a bisection finds it."""
    from dataclasses import replace

    n = sequence_parallel or recipe.sequence_parallel
    prompt = grpo_prompt_tokens(recipe)

    def fits(tokens: int) -> bool:
        if prompt is None:
            r = replace(recipe, max_seq_len=tokens, sequence_parallel=n)
        else:
            r = replace(recipe, max_seq_len=prompt + tokens, max_completion_len=max(tokens, 1), sequence_parallel=n)
        return recipe_estimate(r, world_size, arch, setup).fits(budget, headroom)

    low, high = 0, limit // n  # in units of n tokens: low fits (or is 0), high does not (or is the limit)
    if fits(high * n):
        return high * n
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * n) else (low, mid)
    return low * n


def grpo_prompt_tokens(recipe: Recipe) -> int | None:
    """GRPO: the prompt's tokens a completion follows (max_prompt_len, else what max_seq_len leaves beside
    max_completion_len), so that the planner's length question is the completion's; None for the others."""
    if recipe.objective != "grpo":
        return None
    return recipe.max_prompt_len or max(recipe.max_seq_len - recipe.max_completion_len, 0)


def max_seq_len_table(recipe: Recipe, world_size: int, budget: int, headroom: float = HEADROOM,
                      name: str = "", arch: Architecture | None = None, budget_text: str = "") -> str:
    """The planner's answer to "how long a sequence fits": per setup, the longest max_seq_len whose
    per-GPU estimate fits the budget, without sequence parallelism and with the recipe's
    sequence_parallel (or, with none, with every power of two up to the GPUs that divides them and
    the heads)."""
    arch = arch or load_architecture(recipe.model)
    own_sp = recipe.sequence_parallel
    sizes = [1, own_sp] if own_sp > 1 else [
        n for n in (1, 2, 4, 8, 16, 32, 64) if n <= world_size and world_size % n == 0
        and arch.num_attention_heads % n == 0 and (arch.kv_heads % n == 0 or n % arch.kv_heads == 0)]
    rows = all_estimates(recipe, world_size, arch)
    given = f" ({budget_text})" if budget_text else ""
    prompt = grpo_prompt_tokens(recipe)
    what = "max_seq_len" if prompt is None else \
        f"max_completion_len after a {prompt}-token prompt (the rollout's peak and the step's)"
    lines = [f"recipe {name or '(given)'}: {describe_run(recipe, world_size, arch)}",
             f"longest {what} whose estimate fits {gib(budget * (1 - headroom))} GiB per GPU{given}, "
             f"{headroom:.0%} headroom, micro batch {recipe.micro_batch_size}:"]
    header = ["setup"] + [f"sequence_parallel={n}" for n in sizes]
    table = [header]
    own = Setup.of(recipe)
    for _, e in rows:
        mark = "* " if e.setup == own else "  "
        longest = [longest_sequence(recipe, world_size, arch, e.setup, budget, headroom, n) for n in sizes]
        table.append([mark + e.setup.label] + [f"{t:,}" for t in longest])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    scores = ("attn_implementation=eager keeps each layer's attention scores (a T^2 term)" if recipe.attn_implementation
              == "eager" else f"attn_implementation={recipe.attn_implementation} keeps no attention scores (no T^2 term)")
    lines.append(f"* the recipe's own setup; tokens per {'row' if prompt is None else 'completion'}; 0: not even the "
                 f"model states fit. {scores}; activations "
                 "as measured on CPU (docs/benchmarks.md section 11), not yet on a GPU"
                 + ("; activation_offload: the layer inputs in CPU memory" if recipe.activation_offload else ""))
    refused = own_setup_line(recipe, world_size)
    return "\n".join(lines + ([refused] if refused else []))


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
    """The planner's first lines: the model; what trains; the objective and what it holds beside the policy;
    the GPUs, precision and micro batch (each in lines short enough to read in a terminal)."""
    lora, r, targets = recipe_lora(recipe)
    n = arch.num_parameters()
    trains = "full fine-tune"
    if lora:
        trains = f"LoRA r={r} on {','.join(targets) or 'every projection'}: {lora_parameters(arch, r, targets):,} trained"
    what = {"sft": "sft: the next-token loss on the responses",
            "reward": "reward: a reward model's score head on preference pairs (Bradley-Terry)"}.get(recipe.objective, "")
    if recipe.objective in ("dpo", "kto"):
        reference = {None: "none (reference-free)", "precomputed": "precomputed log-probs",
                     "adapter": "the base, adapter disabled", "frozen": "a frozen copy"}[reference_kind(recipe)]
        loss = (f"{recipe.dpo_loss} preference loss (micro batch in pairs)" if recipe.objective == "dpo" else
                f"{recipe.kto_loss} loss on unpaired rows (and a KL row each, scored without gradient)")
        what = f"{loss}, reference: {reference}"
    rollout = Rollout.of(recipe, world_size)
    if rollout is not None and recipe.objective == "grpo":
        reference = {None: "none (beta=0)", "adapter": "the base, adapter disabled",
                     "frozen": "a frozen copy"}[reference_kind(recipe)]
        what = (f"GRPO {recipe.loss_type}: {rollout.rows} completions per GPU each rollout "
                f"(num_generations={recipe.num_generations}), up to {rollout.prompt_tokens} prompt + "
                f"{recipe.max_completion_len} completion tokens, reference: {reference}")
    if recipe.objective == "distill":
        teacher, why = teacher_architecture(recipe.teacher_model)
        held = (f"{teacher.num_parameters():,} parameters, held as a reference is" if teacher is not None else
                f"NOT counted: {why}")
        what = (f"distillation (beta {recipe.distill_beta:g}, lmbda {recipe.lmbda:g}) from teacher "
                f"{recipe.teacher_model} ({held})")
        if rollout is not None:
            what += (f", {rollout.rows} completions per GPU each on-policy step, up to "
                     f"{recipe.max_completion_len} tokens")
    size = f" ({n / 1e9:.2f} B)" if n >= 10**8 else ""
    sp = recipe.sequence_parallel
    split = f" (sequence_parallel={sp}: each row split across {sp} GPUs)" if sp > 1 else ""
    machine = (f"{world_size} GPU(s){split}, {_precision(recipe.mixed_precision)}, micro batch "
               f"{recipe.micro_batch_size} x {recipe.max_seq_len} tokens, activation checkpointing "
               f"{'on' if recipe.activation_checkpointing else 'off'}"
               + (", the layer inputs offloaded to CPU memory" if recipe.activation_offload else "")
               + f", attention {recipe.attn_implementation}")
    return "\n".join([f"{recipe.model}: {n:,} parameters{size}"]
                     + [note_lines(part, indent="  ") for part in (trains, what, machine) if part])


def plan_table(recipe: Recipe, world_size: int, budget: int | None = None, headroom: float = HEADROOM,
               name: str = "", arch: Architecture | None = None, budget_text: str = "", choose=None) -> str:
    """The planner's report: every setup's per-GPU estimate, and the one it would run within `budget`:
    choose(estimates) -> (the Estimate chosen or None, what to say of it), the command's rule
    (finetune/comm.py one_node_choice: the fastest that fits)."""
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
    unit, unit_name = (GiB, "GiB") if max(e.peak + e.cpu + e.nvme for _, e in rows) >= GiB else (2**20, "MiB")
    with_reference = any(e.reference for _, e in rows) or holds_reference(recipe)
    distill = recipe.objective == "distill"
    with_rollout = recipe.objective == "grpo" or distill and recipe.lmbda > 0
    with_engine = with_rollout and recipe.generation_backend == "vllm"
    header = [f"per GPU, {unit_name}", "params", "grads", "optimizer"] + (
        ["teacher" if distill else "reference"] if with_reference else []) + (
        ["log-probs"] if with_rollout and not distill else []) + ["activations", "buffers", "total"] + (
        (["engine", "push", "rollout"] if with_engine else ["gathered", "kv cache", "prefill", "rollout"])
        if with_rollout else []) + ["offloaded"]
    if budget:
        header.append("fits")
    table = [header]
    for _, e in rows:
        mark = "* " if e.setup == own else "  "
        values = (e.params, e.grads, e.optimizer) + ((e.reference,) if with_reference else ()) + (
            (e.logps,) if with_rollout and not distill else ()) + (e.activations, e.buffers, e.total) + (
            ((e.engine, e.push, e.rollout_peak) if with_engine else (e.rollout_weights, e.kv_cache, e.prefill,
                                                                     e.rollout_peak)) if with_rollout else ())
        row = [mark + e.setup.label] + [gib(x, unit) for x in values] + [_offloaded(e, unit)]
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
    refused = own_setup_line(recipe, world_size)
    if refused:
        lines.append(refused)
    if with_engine:
        lines.append(note_lines("GRPO with a vLLM engine per GPU: engine is its weights and the KV cache of the GPU's "
                     "completions (its minimum; with a budget, fits counts the share vllm_gpu_memory_utilization "
                     "while it generates, and through the step unless vllm_enable_sleep_mode=true), push a weight "
                     "push's transient (vllm_push_layers layers), rollout the generation phase's peak; total the "
                     "step's, with what the engine keeps then"))
    elif with_rollout:
        lines.append(note_lines(("distill" if distill else "GRPO") + ": total is the step's peak, rollout the generation "
                     "phase's (model states, " + ("teacher" if distill else "reference, log-probs") + ", "
                     "the weights gathered for generation under zero3/fsdp, the KV cache of every "
                     "completion of the GPU, one layer's prefill); fits: both do"))
    if distill and with_reference:
        lines.append(note_lines("teacher: the distillation teacher in the compute dtype, sharded under fsdp and zero3, "
                                "whole on each GPU under ddp, zero1 and zero2; buffers add its output layer, copied "
                                "whole for the loss"
                                + ("; rollout: the on-policy completions' generation phase" if with_rollout else "")))
    elif with_reference:
        lines.append(note_lines(reference_note(recipe.objective)))
    lines.append(note_lines("buffers: what the strategy holds beside the model states: communication buckets (ddp: a "
                            "copy of every gradient; zero: the reduce bucket), layers gathered for compute (zero3, fsdp), "
                            "the optimizer step's fp32 temporaries"
                            + ("; the teacher's output layer" if distill and with_reference else "")))
    if budget:
        best, said = choose([e for _, e in rows]) if choose else (None, [])
        mine = next((e for _, e in rows if e.setup == own), None)
        if mine is not None:  # else refused, said above
            verdict = "fits" if mine.fits(budget, headroom) else "does NOT fit"
            lines.append(f"the recipe's setup ({own.label}): {gib(mine.peak_within(budget), unit)} {unit_name} per "
                         f"GPU, {verdict}")
        if best is None:
            lora = recipe_lora(recipe)[0]
            lines.append(f"nothing fits in {gib(budget * (1 - headroom))} GiB per GPU: use more GPUs, a smaller "
                         "micro_batch_size or max_seq_len" + (", activation_checkpointing=true"
                                                              if not recipe.activation_checkpointing else "")
                         + (", or LoRA" if not lora else ", or load_in_4bit=true (QLoRA)"
                            if not recipe.load_in_4bit else ""))
        else:
            changes = {k: v for k, v in best.setup.overrides().items() if getattr(recipe, k) != v}
            how = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())
            note = " (and nvme_path=...)" if "nvme" in (best.setup.offload_optimizer, best.setup.offload_params) \
                and not recipe.nvme_path else ""
            lines.append(f"would run: {best.setup.label} ({gib(best.peak, unit)} {unit_name} per GPU"
                         + "".join(f", {x}" for x in said[:1]) + ")"
                         + (f"; override with {how}{note}" if how else "; the recipe's own"))
            lines += said[1:]
    if not budget:
        lines.append(f"which of these fit, and the one it would run: add --gpu-mem, one GPU's memory (--gpus {world_size} "
                     "--gpu-mem 80GB)")
    lines.append("estimates: ZeRO paper model states + activations counted per tensor of a Llama layer; see finetune/memory.py")
    return "\n".join(lines)


def note_lines(text: str, width: int = 110, indent: str = "") -> str:
    """A note of the planner's report in lines of at most `width` characters, the later ones indented."""
    import textwrap

    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def reference_note(objective: str) -> str:
    """The planner's word on the reference column: whose reference it is, where it lives, when there is none."""
    whose, none = {"grpo": ("GRPO's KL penalty (beta > 0)", "beta=0"),
                   "kto": ("KTO", "precompute_reference=true"),
                   "dpo": ("DPO", "dpo_loss=simpo or precompute_reference=true")}.get(objective, (objective, ""))
    return (f"reference: the {whose} reference model, a frozen copy in the compute dtype: sharded under fsdp and zero3, "
            f"whole on each GPU under ddp, zero1 and zero2 (none with LoRA{', ' + none if none else ''})")


def memory_report(recipe: Recipe, world_size: int, recipe_name: str = "", gpus_per_node: int | None = None) -> str:
    """Lines for `run.py --dry-run`: per-GPU memory of the recipe's own setup, and what was not checked.
    Never raises for an unreadable config: it says so instead."""
    unchecked = []
    try:
        arch = load_architecture(recipe.model)
        e = recipe_estimate(recipe, world_size, arch, gpus_per_node=gpus_per_node)
    except EstimateError as err:
        return f"memory per GPU: not estimated: {err}"
    unit, name = (GiB, "GiB") if e.peak + e.cpu + e.nvme >= GiB / 10 else (2**20, "MiB")
    off = f"; offloaded per GPU: {_offloaded(e, unit)} {name}" if e.cpu or e.nvme else ""
    held = "teacher" if recipe.objective == "distill" else "reference"
    phase = "distill on-policy generation" if recipe.objective == "distill" else "GRPO rollout"
    if recipe.objective == "distill" and teacher_architecture(recipe.teacher_model)[0] is None:
        unchecked.append(f"the teacher ({teacher_architecture(recipe.teacher_model)[1]})")
    sp = recipe.sequence_parallel
    where = f"{world_size} process(es)" + (f", sequence_parallel={sp}" if sp > 1 else "")
    lines = [f"memory per GPU (planner estimate, {e.setup.label} on {where}): "
             f"params {gib(e.params, unit)}, grads {gib(e.grads, unit)}, optimizer {gib(e.optimizer, unit)}, "
             + (f"{held} {gib(e.reference, unit)}, " if e.reference else "")
             + (f"log-probs {gib(e.logps, unit)}, " if e.logps else "")
             + f"activations {gib(e.activations, unit)}, buffers {gib(e.buffers, unit)}; total {gib(e.total, unit)} "
             f"{name}{off}",
             f"model: {arch.num_parameters():,} parameters; config from {arch.source}"]
    rollout = Rollout.of(recipe, world_size)
    if rollout is not None and rollout.engine:
        lines.insert(1, f"{phase} per GPU by a vLLM engine ({rollout.rows} completions of up to {rollout.tokens} "
                        f"tokens): engine weights and KV cache {gib(e.engine, unit)} at least (on a GPU the share "
                        f"vllm_gpu_memory_utilization={recipe.vllm_gpu_memory_utilization:g} of it while awake), "
                        f"push transient {gib(e.push, unit)}; a peak of {gib(e.rollout_peak, unit)} {name} per GPU "
                        f"while it generates; during the step the engine keeps {gib(e.engine_asleep, unit)} {name}"
                        + (" (asleep)" if rollout.engine_sleeps else " (vllm_enable_sleep_mode=true frees it on GPUs)"))
    elif rollout is not None:
        lines.insert(1, f"{phase} per GPU ({rollout.rows} completions of up to {rollout.tokens} tokens generated "
                        f"in one batch): gathered weights {gib(e.rollout_weights, unit)}, KV cache "
                        f"{gib(e.kv_cache, unit)}, prefill {gib(e.prefill, unit)}; a peak of "
                        f"{gib(e.rollout_peak, unit)} {name} per GPU (with the model states"
                        + (f", {held}" if e.reference else "") + (" and log-probs" if e.logps else "") + ")")
    if e.staging:
        lines.insert(1, f"async_save=true: each save stages {gib(e.staging, unit)} {name} per rank in host memory "
                        "(counted in the cpu column; docs/async-checkpoints.md)")
    if e.samples:
        lines.insert(1, f"samples at eval (sample_prompts={recipe.sample_prompts}) gather the whole model on each GPU: "
                        f"{gib(e.samples, unit)} {name}, a peak of {gib(e.samples_peak, unit)} {name} per GPU at each "
                        "eval; where that does not fit, the run skips them with a warning (sample_prompts=0: off)")
    if rollout is not None and rollout.engine:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            unchecked.append("vLLM, which is not installed here: generation_backend=vllm stops the run before the "
                             "model loads (docs/vllm.md)")
    if arch.source.startswith(TABLE_SOURCE):
        unchecked.append(f"the model's own config.json (not in the local cache{', offline' if offline() else ''}; "
                         "the published numbers were used)")
    if arch.model_type not in LLAMA_LIKE and not arch.measured:
        unchecked.append(f"the parameter count of model_type {arch.model_type} (counted as a Llama-style decoder)")
    if not looks_local(recipe.model) and not recipe.model.startswith(BUILTIN_PREFIX):
        unchecked.append("that the model's weights can be downloaded" if not offline()
                         else "that the model's weights are in the cache (offline)")
    gpu = _gpu_memory()
    if gpu is None:
        unchecked.append(f"whether {gib(e.peak, unit)} {name} fits the GPUs (no GPU here; python -m finetune.plan "
                         f"--recipe {recipe_name or 'NAME'} --gpus {world_size} --gpu-mem 80GB checks a budget)")
        host = _host_memory()
        if host is not None:  # trained here, on the CPU: every process holds its own copy of the estimate
            need = e.peak * world_size
            verdict = "fits" if need <= host * (1 - HEADROOM) else "does NOT fit"
            lines.append(f"this machine's memory, if it trains here on the CPU: {world_size} process(es) x "
                         f"{gib(e.peak, unit)} {name} = {gib(need, unit)} {name} of {gib(host, unit)} {name} available; "
                         f"the estimate {verdict} with {HEADROOM:.0%} headroom (each process's Python and torch "
                         "not counted)")
    else:
        verdict = "fits" if e.fits(gpu) else "does NOT fit"
        lines.append(f"this machine's GPU: {gib(gpu)} GiB; the estimate {verdict} with {HEADROOM:.0%} headroom")
    if unchecked:
        lines.append("not checked: " + "; ".join(unchecked))
    return "\n".join(lines)


def _host_memory() -> int | None:
    """The memory available to new processes on this machine (psutil's), or None where it cannot say."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - an estimate line is not worth a failure
        return None


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
