"""What the model answers: greedy generations from the first eval prompts at each eval (samples.jsonl),
by the generation `finetune chat` (finetune/chat.py) also uses (finetune/generation.py), so that a
sample at the end of a run and `finetune chat` on its final/ give the same tokens.

Generation needs whole weights. A sharded model would all-gather every layer at every token if it were
simply called in a loop (the hour-long ZeRO-3 stalls of huggingface/trl#3858), so the weights are
gathered once for all of an eval's samples (Strategy.whole_weights in finetune/strategy/):
- ZeRO-3: `deepspeed.zero.GatheredParameters` over every parameter, with the engine's per-module
  fetch/release hooks taken off for the duration (TRL's unwrap_model_for_generation does the same);
- FSDP2: each FSDP module keeps its parameters unsharded after its first forward
  (set_reshard_after_forward(False)) and is resharded at the end;
- FSDP1: called through its wrapper, which gathers per forward: it all-gathers at every token;
- ddp, zero1, zero2: the weights are whole on every rank already.
Every rank generates the same prompts with the same whole weights: the gather is a collective all
ranks join anyway, and then none waits at a barrier for rank 0; rank 0 writes. The gathered copy
costs the whole model in the compute dtype per rank for the eval's duration (finetune/memory.py
counts it when sample_prompts > 0).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import data as D
from finetune.generation import Sampling, generate, pad_id_for, stop_ids
from finetune.model import context_length
from finetune.recipe import RecipeError
from finetune.strategy import running_strategy

log = logging.getLogger("finetune")

# ---------------------------------------------------------------- samples at eval


@dataclass
class Prompt:
    ids: list[int]  # the prompt's tokens, as the run rendered them
    text: str  # the same, decoded with its special tokens: `finetune chat --format raw` gives back the ids
    reference: str  # the row's answer


def eval_prompts(ds, n: int, tokenizer, limit: int = 0) -> list[Prompt]:
    """The prompts of the first n eval rows (of the first `limit`, eval_max_samples, when set): each
    row's tokens before its first target token, and its first answer (the target tokens that follow).
    A packed row gives its first example, a preference pair its chosen side (its prompt, and the chosen
    answer as the reference), a prompt row (GRPO) its prompt and its `answer` column as the reference
    (the column exact_match scores against; empty where it has none). An unpaired row (KTO) is a
    reference only where it is desirable: the desirable rows come first, and an undesirable row, taken
    where there are fewer than n desirable ones, has an empty reference (its completion is what the
    model should not answer). Rows without a prompt (text rows, train_on_prompt=true) give none; an eval
    set smaller than n is a RecipeError."""
    available = min(len(ds), limit) if limit else len(ds)
    if n > available:
        raise RecipeError(f"sample_prompts={n} is more than the {available} eval rows"
                          f"{' (eval_max_samples)' if limit and limit < len(ds) else ''}; lower sample_prompts "
                          "(0: no samples)")
    order = list(range(available))
    desirable = list(ds.select(order)["desirable"]) if "desirable" in ds.column_names else [1] * available
    order = [i for i in order if desirable[i]] + [i for i in order if not desirable[i]]
    prompts = []
    for i in order[:n]:
        row = ds[i]
        if "prompt_input_ids" in row:
            prompt = list(row["prompt_input_ids"])
            answer = row.get("answer")
            prompts.append(Prompt(prompt, tokenizer.decode(prompt), "" if answer is None else str(answer)))
            continue
        side = "chosen_" if "chosen_input_ids" in row else ""  # a preference pair: its chosen side
        ids, labels = row[f"{side}input_ids"], row[f"{side}labels"]
        if "position_ids" in row:  # packed: the first example ends where position ids restart
            pos = row["position_ids"]
            end = next((j for j in range(1, len(pos)) if pos[j] == 0), len(pos))
            ids, labels = ids[:end], labels[:end]
        start = next((j for j, x in enumerate(labels) if x != D.IGNORE), None)
        if not start:  # no target token, or targets from the first token on: no prompt to give
            continue
        stop = next((j for j in range(start, len(labels)) if labels[j] == D.IGNORE), len(labels))
        prompt = list(ids[:start])
        answer = tokenizer.decode(ids[start:stop], skip_special_tokens=True) if desirable[i] else ""
        prompts.append(Prompt(prompt, tokenizer.decode(prompt), answer))
    return prompts


def gather_problem(needed: int, free: int | None, headroom: float = 0.1) -> str | None:
    """Why this eval's samples are skipped: the gathered model would not fit the GPU memory left free
    by training (an out-of-memory at an eval could come before any checkpoint). None when it fits, or
    off a GPU (free is None: host memory is not checked)."""
    if free is None or needed <= free * (1 - headroom):
        return None
    return (f"samples skipped: gathering the whole model for generation needs {needed / 2**30:.1f} GiB per GPU and "
            f"{free / 2**30:.1f} GiB is free; set sample_prompts=0 (or generate from final/ with finetune chat)")


def samples_fit(accelerator, model) -> str | None:
    """gather_problem on every rank, agreed: the gather is a collective, so all ranks skip or none does."""
    needed = running_strategy(accelerator).gathered_bytes(model)
    device = accelerator.device
    free = None
    if needed and device.type == "cuda":  # the driver's free memory and the blocks PyTorch holds unused
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    problem = gather_problem(needed, free)
    flag = torch.tensor([1.0 if problem else 0.0], device=device)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    if flag.item() == 0:
        return None
    return problem or ("samples skipped: another rank lacks the free GPU memory to gather the whole model for "
                       "generation; set sample_prompts=0 (or generate from final/ with finetune chat)")


def run_samples(accelerator, model, prompts: list[Prompt], tokenizer, max_new_tokens: int,
                generation_config=None, stop=None) -> list[dict] | None:
    """Greedy answers to the prompts, generated as one batch with the weights gathered once; every rank
    gets the same list. Each sample also says how many tokens it generated and the seconds from the
    batch's start until its answer ended (the gather not included). Empty when
    the gathered model would not fit the GPU (samples_fit: said as a warning). None when a stop request
    (stop: finetune.training.stopping.StopRequest) came on any rank: each rank stops generating before its next
    token (generation holds no collective), then all agree."""
    problem = samples_fit(accelerator, model)
    if problem:
        if accelerator.is_main_process:
            log.warning(problem)
        return []
    requested = (lambda: bool(stop.requested)) if stop is not None else None
    was_training = model.training
    model.eval()
    try:
        # compile=true layers run eagerly here: a token at a time with a growing cache would recompile
        # them (about a minute each on CPU), for a few forwards
        with torch.compiler.set_stance("force_eager"), running_strategy(accelerator).whole_weights(accelerator, model) as whole:
            answers = generate(whole, [p.ids for p in prompts], Sampling(max_new_tokens),
                               stop_ids=stop_ids(tokenizer, whole, generation_config), pad_id=pad_id_for(tokenizer),
                               context=context_length(whole.config), should_stop=requested,
                               vocab_size=len(tokenizer))
    finally:
        model.train(was_training)
    if stop is not None and stop_agreed(accelerator, stop):
        return None
    return [{"prompt": p.text, "reference": p.reference, "generated": tokenizer.decode(a.tokens, skip_special_tokens=True),
             "tokens": len(a.tokens), "seconds": round(a.seconds, 4)} for p, a in zip(prompts, answers)]


def stop_agreed(accelerator, stop) -> bool:
    """Whether any rank was asked to stop (a collective: every rank calls it at the same place)."""
    flag = torch.tensor([float(bool(stop.requested))], device=accelerator.device)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    return flag.item() > 0


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


class SampleWriter:
    """samples.jsonl (one line per sample: step, prompt, reference, generated, and the generated tokens
    and seconds), a TensorBoard text
    entry per eval, and one short sample for the progress output."""

    def __init__(self, path: Path, enabled: bool, accelerator=None):
        self.path, self.enabled, self.accelerator = path, enabled, accelerator
        self.last: list[dict] = []

    def write(self, step: int, samples: list[dict], seconds: float) -> str:
        self.last = [{"step": step, **s} for s in samples]
        if not self.enabled or not samples:
            return ""
        with self.path.open("a") as f:
            for s in self.last:
                f.write(json.dumps(s) + "\n")
        tracker = self._tensorboard()
        if tracker is not None:
            table = "| prompt | reference | generated |\n|---|---|---|\n" + "\n".join(
                "| " + " | ".join(s[k].replace("|", "\\|").replace("\n", "<br>") for k in
                                  ("prompt", "reference", "generated")) + " |" for s in samples)
            tracker.add_text("samples", table, step)
        first = samples[0]
        return (f"step {step}: sample ({len(samples)} in {seconds:.2f}s, samples.jsonl): "
                f"{_short(first['prompt'])!r} -> {_short(first['generated'])!r}")

    def _tensorboard(self):
        """TensorBoard's SummaryWriter when the run reports to it (report_to=tensorboard)."""
        if self.accelerator is None or not self.accelerator.trackers:
            return None
        try:
            return self.accelerator.get_tracker("tensorboard", unwrap=True)
        except ValueError:
            return None

    def summary(self) -> list[dict]:
        return self.last


def sample_at_eval(accelerator, model, prompts, tokenizer, max_new_tokens: int, writer: SampleWriter,
                   step: int, generation_config=None, stop=None) -> str | None:
    """One eval's samples, written; returns the progress line ('' when there are none; None when a stop
    request cut them short: nothing is written)."""
    if not prompts:
        return ""
    t0 = time.perf_counter()
    samples = run_samples(accelerator, model, prompts, tokenizer, max_new_tokens, generation_config, stop)
    if samples is None:
        return None
    return writer.write(step, samples, time.perf_counter() - t0)
