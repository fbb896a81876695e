"""What the loop asks of an objective (the `Objective` protocol), and `Basic`, the defaults an objective
without set-up, rollout or metrics of its own takes.

An objective's life in a run, in the loop's order:

    before_model(context)         after the data, before the model loads: cheap checks that would
                                  otherwise fail after it (DPO: is the precomputed log-probs file there,
                                  and the one a resumed run needs)
    after_prepare(context, model) once the strategy has prepared the model: what it holds beside the
                                  policy (DPO: its reference, or the pairs' precomputed log-probs); gives
                                  what recipe.json and every checkpoint record of it
    schedule(plan, rows, ranks)   which training rows each step reads (SFT, DPO: micro_batch_size x
                                  grad_accum rows per rank; GRPO: the step's prompts)
    rollout(run, step, batches, stop)
                                  each step, before its micro-batches' forward: the batches the step
                                  trains on, made from the schedule's rows (an objective that generates
                                  before its step: GRPO's completions, rewards and advantages; None
                                  where a stop request ended it); as given for SFT and DPO
    counts, loss, take_metrics    each step: how the global batch is counted, each micro-batch's summed
                                  loss, the metrics' sums since last asked
    means(sums, count)            the metrics' values from their sums reduced over ranks (a step's or an
                                  eval's) and the global count; SFT and DPO: sums / count
    evaluate(run, step, stop, loss_eval)
                                  at each eval (evaluates): the eval loss (None: the objective has
                                  none) and the eval metrics, or None where a stop request ended it;
                                  SFT and DPO: loss_eval(), the loop's mean loss over the eval batches
                                  (loop.evaluate); GRPO: the eval prompts' completions sampled and
                                  scored by the reward functions, no loss
    eval_count                    what an eval batch's summed loss is averaged over (loss_eval)
    in_flight(step)               at each save, on each rank: the work in flight a resumed run must train
                                  on but cannot make again, {name: (tensors, plain JSON data)}, written
                                  into the checkpoint (finetune/checkpointing/run_state.py save_in_flight,
                                  read back with load_in_flight); GRPO: the rollout a checkpoint inside it
                                  needs (num_iterations > 1); the others: none

`metrics` names the values take_metrics sums (in order), `shown` those the progress line and the run
summary show beside the loss, with their short labels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from finetune.training.metrics import LOSS_PANELS


@dataclass
class Context:
    """The run's parts an objective's set-up reads, as they stand before the model loads."""
    plan: object  # finetune.plan.Plan
    accelerator: object  # accelerate.Accelerator
    model_path: str
    config: object  # the model's transformers PretrainedConfig
    tokenizer: object
    datasets: object  # finetune.data.Datasets (after_prepare may add columns to its splits)
    identity: dict | None  # the weights' identity (finetune/checkpointing/identity.py), where the run records one
    weights_on_this_rank: bool  # whether a model loaded now reads its weights on this rank (strategy.reads_weights)
    to_device: Callable  # a batch onto the training device (loop.to_device)
    sp: object  # this rank's sequence-parallel layout (finetune.sequence_parallel.Layout)
    schedule: object = None  # the rows each step reads (finetune.data.BatchSchedule, objective.schedule)
    total_steps: int = 0  # the steps the run trains for

    @property
    def recipe(self):
        return self.plan.recipe


@runtime_checkable
class Objective(Protocol):
    name: str
    metrics: tuple[str, ...]
    maxed: int  # the last `maxed` of take_metrics' values reduce over ranks by max (the rest by sum)
    shown: dict[str, str]  # metric -> its short label on the progress line and in the summary
    loss_note: str  # said once as training starts where the loss shown needs a word (GRPO's: about 0); "": none
    panels: tuple  # loss.png's panels: (title, y label, metric key), train and eval (training/metrics.py)
    generates: bool  # the trained model generates text (eval samples); a reward model only scores
    makes_batches: bool  # rollout() makes the step's batches itself (GRPO): the loop fetches no rows
    evaluates: bool  # the loop evaluates the eval split (evaluate)
    identifies_model: bool  # the run records the model's identity: it keys a file by it, or a resume reads the model

    def before_model(self, context: Context) -> None: ...

    def after_prepare(self, context: Context, model) -> dict: ...

    def schedule(self, plan, num_rows: int, ranks: int): ...

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict] | None: ...

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor: ...

    def counts(self, micro_batches: list[dict]) -> torch.Tensor: ...

    def evaluate(self, run, step: int, stop, loss_eval: Callable[[], tuple[float, dict] | None]
                 ) -> tuple[float | None, dict] | None: ...

    def eval_count(self, batch: dict) -> int: ...

    def take_metrics(self) -> torch.Tensor | None: ...

    def summary(self, out) -> dict: ...

    def means(self, sums: torch.Tensor, count: torch.Tensor) -> list[float]: ...

    def in_flight(self, step: int) -> dict: ...


class Basic:
    """The defaults: no set-up, no rollout, metrics averaged over the global batch's count. An objective
    with metrics adds their sums to self.sums in loss()."""
    metrics: tuple[str, ...] = ()
    shown: dict[str, str] = {}
    loss_note = ""
    panels = LOSS_PANELS  # loss.png: the loss
    generates = True
    identifies_model = False
    makes_batches = False  # True: rollout() makes the step's batches itself (GRPO), the loop fetches no rows
    evaluates = True  # False: the loop runs no eval
    converses = False  # True: prompts are conversations whose turns end at the chat template's end-of-turn token
    sums: torch.Tensor | None = None
    maxed = 0  # the last `maxed` of take_metrics' sums are reduced over ranks by max, not summed (a min negated)

    def before_model(self, context: Context) -> None:
        return None

    def after_prepare(self, context: Context, model) -> dict:
        return {}

    def in_flight(self, step: int) -> dict:
        return {}

    def schedule(self, plan, num_rows: int, ranks: int):
        """The rows each rank reads at each step: micro_batch_size x grad_accum per rank."""
        from finetune.data import BatchSchedule

        r = plan.recipe
        return BatchSchedule(num_rows, r.micro_batch_size, plan.grad_accum, ranks, r.seed)

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict] | None:
        return micro_batches

    def evaluate(self, run, step: int, stop, loss_eval: Callable[[], tuple[float, dict] | None]
                 ) -> tuple[float | None, dict] | None:
        """The eval: the loop's mean loss over the eval batches and the metrics' means (loss_eval)."""
        return loss_eval()

    def summary(self, out) -> dict:
        """Fields the objective adds to the run summary (summary.json), from what the run wrote in `out`."""
        return {}

    def take_metrics(self) -> torch.Tensor | None:
        """The metrics' sums since the last call (a step's, or an eval's), or None where none were kept."""
        sums, self.sums = self.sums, None
        return sums

    def means(self, sums: torch.Tensor, count: torch.Tensor) -> list[float]:
        return (sums / count).tolist()
