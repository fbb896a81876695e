"""The one training loop, for every strategy and objective, in four parts that read top to bottom:
setup (the run's parts from the plan), optimizer_step (one step over a global batch, asking the
objective for each micro-batch's loss and for how the batch is counted), the Reporter (called once
per step and once per eval) and finish (final/, the summary)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.checkpointing.checkpoint import Checkpointer, after_nonfinite
from finetune.checkpointing.layout import FINAL, FINAL_MERGED, checkpoints_dir, saved_names
from finetune.checkpointing.run_state import LoopState
from finetune.end_of_turn import base_generation_config, describe, trains_chats, with_end_of_turn
from finetune.checkpointing.export import merge_adapter, save_final_model
from finetune.recipe import padding_free_scores
from finetune.training.metrics import (LossPlot, MetricsFile, Progress, Throughput, format_summary, log, peak_memory_bytes,
                              setup_logging, start_trackers)
from finetune.model import (concatenation_problem, load_config, load_model, load_tokenizer,
                            sample_length_problem)
from finetune.training.objectives import Context, Objective, objective_for
from finetune.parallel import Parallel
from finetune.objective_rules import loss_settings_named
from finetune.offload import activation_offload
from finetune.generation import answer_length
from finetune.plan import Plan
from finetune.recipe import RecipeError
from finetune.checkpointing.identity import model_identity
from finetune.training.samples import SampleWriter, eval_prompts, sample_at_eval
from finetune.collectives import counted_step
from finetune.faults import fault_point
from finetune.training.stopping import StopRequest
from finetune.distributed import accumulate, build_accelerator, prepare

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase


def main_first(accelerator, fn):
    """Run fn on each machine's main process, then on the others (which then hit its caches).

    A failure on the main process is shared with every rank, so all exit with the same message
    instead of the others waiting at a barrier until a timeout.
    """
    result, error = None, None
    if accelerator.is_local_main_process:
        try:
            result = fn()
        except Exception as e:  # re-raised below on this rank, reported to the others
            error = e
    errors = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        kind, message = failed
        raise RecipeError(message) if kind in ("RecipeError", "DataError") else RuntimeError(
            f"the main process failed: {kind}: {message}")
    return result if accelerator.is_local_main_process else fn()


def evaluate(model, ds, batches, pad_id: int, packed: bool, device, reduce, objective,
             padding_free: bool = False, shard=SP.Layout().shard, stop=None) -> tuple[float, dict] | None:
    """The mean loss per counted unit (the objective's: target tokens, pairs) over the whole eval set,
    exact across ranks, and the objective's metrics (their means) over it. shard: this rank's part of a
    batch (its slice of every row under sequence parallelism). stop (finetune.training.stopping.StopRequest):
    read before each batch, agreed by the ranks (one small all-reduce a batch, as each batch's forward
    is collective under ZeRO-3 and FSDP); a request ends the eval there and returns None."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    objective.take_metrics()
    with torch.no_grad():
        for rows in batches:
            if stop is not None and reduce(torch.tensor([float(bool(stop.requested))], device=device)).item() > 0:
                objective.take_metrics()
                model.train()
                return None
            batch = to_device(shard(D.fetch(ds, rows, pad_id, packed, padding_free)), device)
            total[0] += objective.loss(model, batch).double()
            total[1] += objective.eval_count(batch)
    model.train()
    total = reduce(total)
    return float(total[0] / total[1]), mean_metrics(objective, reduce, total[1])


def mean_metrics(objective, reduce, count) -> dict:
    """The objective's metrics since it was last asked, as means over the global batch (or eval set):
    their sums reduced over ranks, made values by the objective (divided by the global count for SFT and
    DPO: Objective.means). A collective: every rank calls it."""
    sums = objective.take_metrics()
    if sums is None:
        return {}
    return dict(zip(objective.metrics, objective.means(reduced_metrics(sums, objective.maxed, reduce), count)))


def reduced_metrics(sums: torch.Tensor, maxed: int, reduce) -> torch.Tensor:
    """An objective's metric sums over ranks: summed (reduce), the last `maxed` by max (a min kept negated:
    GRPO's clip_ratio/low_min and high_max)."""
    if not maxed:
        return reduce(sums)
    tail = sums[-maxed:].clone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tail, op=torch.distributed.ReduceOp.MAX)
    return torch.cat([reduce(sums[:-maxed]), tail])


class NonFiniteError(RecipeError):
    """The run diverged: said as one line (exit code 2), after which the newest checkpoint is still good."""


def skip_nonfinite(state: LoopState, loss: float, grad_norm, recipe, out: Path) -> bool:
    """Whether to skip this step's update because its loss or gradient norm is NaN or inf; raises
    NonFiniteError once more than recipe.max_nonfinite_steps such steps were seen. Called before
    optimizer.step() with values all ranks share (the reduced loss, the global norm), so every rank
    decides alike and no NaN update is applied, checkpointed or exported. DeepSpeed steps inside
    backward(), but ZeRO drops a step whose gradient norm is not finite and reports the norm as inf,
    so skipping there is already done. Under fp16 an inf gradient norm is the loss scaler's routine
    overflow (it skips the step and lowers the scale itself), so only the loss counts."""
    norm = float(grad_norm) if grad_norm is not None else 0.0
    if math.isfinite(loss) and (math.isfinite(norm) or recipe.mixed_precision == "fp16"):
        return False
    step = state.step + 1
    state.nonfinite_steps += 1
    if state.nonfinite_steps <= recipe.max_nonfinite_steps:
        if os.environ.get("RANK", "0") == "0":  # every rank decides the same; one says so
            log.warning(f"step {step}: loss {loss}, gradient norm {norm}: not finite; update skipped "
                        f"({state.nonfinite_steps} of max_nonfinite_steps={recipe.max_nonfinite_steps})")
        return True
    allowed = (f"{recipe.max_nonfinite_steps} such step(s) were skipped already; " if recipe.max_nonfinite_steps
               else "")
    named = loss_settings_named(recipe)  # GRPO's entropy_coef, sapo's, vespo's, where changed
    raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {norm}: not finite; {allowed}stopped "
                         f"without saving ({named + '; ' if named else ''}"
                         f"{after_nonfinite(out / 'checkpoints', recipe, step)})")


def to_device(data, device):
    """A tensor, or a dict of them, on the training device. On a GPU through pinned memory and without
    waiting: PyTorch's blocking copy from pageable memory synchronises the stream, so every micro-batch's
    `.to(cuda)` made the host wait for the previous micro-batch's backward before it could queue the
    next forward."""
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    if device.type == "cuda":
        return data.pin_memory().to(device, non_blocking=True)
    return data.to(device)


def one_sync_per_step(step_loss, counts, stop: StopRequest, reduce_sum) -> tuple[float, int, int, bool]:
    """What the host must know of a step, read back at once: the loss (for the NaN check before the
    update, and the log), the global token counts, and whether any rank was asked to stop (a signal
    caught during the step stops the run after it). The loop waits for the device here only, after
    backward (the gradient norm, read next, is computed by then): a wait for the counts before the
    forward would keep the host from queueing a step's kernels while the previous step's optimizer
    runs (bench/studies/step_overhead.py; docs/design-notes.md)."""
    ends = reduce_sum(torch.stack([step_loss, torch.tensor(float(stop.requested), dtype=torch.float64,
                                                           device=step_loss.device)]))
    loss_sum, stops, denominator, targets, inputs = torch.cat([ends, counts]).tolist()
    return loss_sum / denominator, int(targets), int(inputs), stops > 0


# The wrapped model holds the process group (DDP's reducer holds the last reference to it). Freed
# on return from train(), it would tear the group down, which can deadlock (see
# run.exit_without_teardown); kept here, it lives until run.py ends the process.
KEEP_UNTIL_EXIT: list = []


@dataclass
class Run:
    """The run's parts, built from the plan by setup()."""
    plan: Plan
    out: Path
    accelerator: Accelerator
    model_path: str
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    datasets: D.Datasets
    schedule: D.BatchSchedule
    total_steps: int
    eval_rows: list[list[int]] | None  # this rank's eval micro-batches (row indices); None: no eval set
    prompts: list  # the eval prompts samples.jsonl follows (samples.Prompt)
    generation_config: GenerationConfig
    stops: str  # the stop tokens final/ names, in words
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: Objective  # it holds what it set up beside the policy (DPO: the reference)
    checkpoints: Checkpointer
    reporter: Reporter
    samples: SampleWriter
    wall_t0: float
    parallel: Parallel  # the strategy, and this rank's place under sequence parallelism

    @property
    def recipe(self):
        return self.plan.recipe

    def reduce_sum(self, t):
        return self.accelerator.reduce(t, reduction="sum")


def setup(plan: Plan) -> tuple[Run, LoopState]:
    """Everything a run needs, in the order it must be built: the process group before the model (so
    that ZeRO-3 partitions and FSDP ranks other than 0 skip the weights as they load), the data and the
    objective's checks before the model (a data error costs no model load), what the objective holds
    beside the policy once the policy is prepared, the checkpoint's state last. Returns the run and the
    loop state it starts from."""
    wall_t0 = time.perf_counter()
    r = plan.recipe
    setup_logging(r.log_level, int(os.environ.get("RANK", "0")))
    model_path, config = load_config(r)
    problem = concatenation_problem(r, config) or SP.config_problem(r, config) or sample_length_problem(r, config)
    if problem:
        raise RecipeError(problem)
    accelerator = build_accelerator(plan, config)
    log.info(plan.describe())
    torch.manual_seed(r.seed)

    tokenizer = load_tokenizer(r, model_path)
    parallel = Parallel.of(plan, accelerator.process_index, accelerator.num_processes, tokenizer.pad_token_id)
    sp = parallel.sp
    objective = objective_for(r)
    datasets, schedule, total_steps, eval_rows, prompts = load_data(plan, accelerator, tokenizer, sp, objective)
    generation_config, stops = stop_tokens(accelerator, model_path, config, tokenizer, datasets, objective.converses)
    context = Context(plan, accelerator, model_path, config, tokenizer, datasets,
                      identity=weights_identity(r, objective, accelerator, model_path),
                      weights_on_this_rank=parallel.strategy.reads_weights(accelerator), to_device=to_device,
                      sp=sp, schedule=schedule, total_steps=total_steps)
    objective.before_model(context)

    model, optimizer, scheduler = load_and_prepare(plan, accelerator, model_path, config, total_steps)
    identity = {"model_identity": context.identity} if context.identity else {}
    records = identity | objective.after_prepare(context, model)  # what checkpoints and recipe.json record
    write_resolved_recipe(plan, accelerator, model_path, datasets, records)
    out = Path(r.output_dir)
    reporter = Reporter(accelerator, r, out, total_steps, objective)
    samples = SampleWriter(out / "samples.jsonl", accelerator.is_main_process, accelerator)
    checkpoints = Checkpointer(plan, accelerator, optimizer, model_path, config, tokenizer, generation_config,
                               records=records)
    checkpoints.in_flight = objective.in_flight  # what each checkpoint holds of the objective's work in flight
    checkpoints.reserve_host_buffers(model)
    run = Run(plan=plan, out=out, accelerator=accelerator, model_path=model_path, config=config, tokenizer=tokenizer,
              datasets=datasets, schedule=schedule, total_steps=total_steps, eval_rows=eval_rows, prompts=prompts,
              generation_config=generation_config, stops=stops, model=model, optimizer=optimizer, scheduler=scheduler,
              objective=objective, checkpoints=checkpoints, reporter=reporter, samples=samples, wall_t0=wall_t0,
              parallel=parallel)
    return run, start_state(run)


def load_data(plan: Plan, accelerator, tokenizer, sp: SP.Layout, objective: Objective) -> tuple:
    """The datasets (built on each machine's main process first), the batch schedule, the number of
    steps, this rank's eval batches and the eval prompts samples.jsonl follows (none for a model that
    does not generate); said in the log."""
    r = plan.recipe
    datasets = main_first(accelerator, lambda: D.build_datasets(r, tokenizer))
    schedule = objective.schedule(plan, len(datasets.train), sp.dp_size)
    if schedule.problem():
        raise RecipeError(schedule.problem())
    total_steps = r.max_steps or r.epochs * schedule.steps_per_epoch * r.num_iterations
    eval_rows = D.eval_batches(datasets.eval, r.micro_batch_size, sp.dp_rank, sp.dp_size, r.eval_max_samples) \
        if datasets.eval is not None and objective.evaluates else None
    layout = (", packed" if r.packing else "") + (", padding-free: one row per micro-batch" if r.padding_free else "")
    log.info(f"{len(datasets.train)} training rows ({datasets.format}{layout}), "
             f"{schedule.steps_per_epoch} steps per epoch, {total_steps} steps")
    prompts = eval_prompts(datasets.eval, r.sample_prompts, tokenizer, r.eval_max_samples) \
        if eval_rows is not None and r.sample_prompts and objective.generates else []
    for line in D.summary_lines(datasets, r):
        log.info(line)
    if padding_free_scores(r) and r.packing and r.micro_batch_size > 1 and accelerator.is_main_process:
        log.warning(f"padding_free=true with packing and attn_implementation={r.attn_implementation}: the attention "
                    "covers each micro-batch's whole row under one mask, micro_batch_size times a packed row's "
                    "(measured on CPU: 0.65x packing's tokens/s, docs/benchmarks.md section 3b); it pays with "
                    "flash_attention_2, else set padding_free=false")
    return datasets, schedule, total_steps, eval_rows, prompts


def stop_tokens(accelerator, model_path: str, config, tokenizer, datasets, converses: bool = False) -> tuple:
    """The generation config final/ and every checkpoint's hf/ save, whose stop tokens include a chat
    run's end-of-turn token (a run whose objective converses, GRPO with tools, too), and those stop tokens
    in words."""
    generation_config, turn = with_end_of_turn(base_generation_config(model_path, config), tokenizer,
                                               converses or trains_chats(s["format"] for s in datasets.sources))
    stops = describe(turn, generation_config)
    if turn is not None and accelerator.is_main_process:
        (log.info if turn.ids else log.warning)(f"end of turn: {stops}")
    return generation_config, stops


def weights_identity(r, objective: Objective, accelerator, model_path: str) -> dict | None:
    """The weights' identity (finetune/checkpointing/identity.py) for the runs whose resume reads the model again
    (LoRA's base; the objective's, as DPO's frozen reference: resume.check_identity) or whose objective
    keys a file by it (DPO's precomputed log-probs): Objective.identifies_model. Hashed once, on rank 0,
    and shared. A full fine-tune's checkpoint holds every weight it needs."""
    wanted = accelerator.is_main_process and (r.lora or objective.identifies_model)
    identity = [model_identity(model_path) if wanted else None]
    torch.distributed.broadcast_object_list(identity, src=0)
    return identity[0]


def load_and_prepare(plan: Plan, accelerator, model_path: str, config, total_steps: int) -> tuple:
    """The model loaded (on the ranks the strategy has read the weights), sequence parallelism's and
    tiled MLPs' patches, then prepared by the strategy with its optimizer and LR schedule."""
    r = plan.recipe
    model = load_model(r, model_path, config, weights_on_this_rank=plan.strategy.reads_weights(accelerator))
    SP.start(r, model)
    if r.tiled_mlp:
        log.info(f"tiled_mlp: {SP.tile_mlps(model)} MLPs compute a slice of the sequence at a time")
    model, optimizer, scheduler = prepare(accelerator, plan, model, total_steps)
    KEEP_UNTIL_EXIT.append((accelerator, model, optimizer))
    return model, optimizer, scheduler


def write_resolved_recipe(plan: Plan, accelerator, model_path: str, datasets, records: dict) -> None:
    """recipe.json in output_dir (on the main process): the recipe as run, with what was resolved (the
    model's path, the world size, the batch, the data) and the records."""
    if not accelerator.is_main_process:
        return
    r, out = plan.recipe, Path(plan.recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = r.to_dict() | {"model": model_path, "world_size": accelerator.num_processes,
                              "grad_accum": plan.grad_accum, "global_batch_size": plan.global_batch_size,
                              "data": {"sources": datasets.sources, "summary": datasets.summary}, **records}
    (out / "recipe.json").write_text(json.dumps(resolved, indent=2) + "\n")


def start_state(run: Run) -> LoopState:
    """The loop state to start from: a fresh one, or the resumed checkpoint's (its record written)."""
    plan, world = run.plan, run.accelerator.num_processes
    if plan.resume is None:
        return LoopState()
    t0 = time.perf_counter()
    state = run.checkpoints.load(plan.resume)
    seconds = time.perf_counter() - t0
    log.info(f"resumed from {plan.resume.path} at step {state.step} "
             f"({plan.resume.world_size} -> {world} processes) in {seconds:.2f}s")
    run.reporter.resumed({"step": state.step, "resumed_from": str(plan.resume.path), "world_size": world,
                          "resume_seconds": round(seconds, 3)})
    return state


@dataclass
class StepResult:
    loss: float  # mean per counted unit (the objective's: target token, pair) over the global batch
    grad_norm: object
    metrics: object  # the objective's metrics' sums over this rank's part (device), or None
    count: object  # what they are averaged over: the global batch's count (a device tensor)
    aux: list  # a mixture of experts' router loss per micro-batch, when its config asks for one
    stopping: bool  # a rank was asked to stop: save and stop after this step


def optimizer_step(run: Run, state: LoopState, stop: StopRequest, meter: Throughput) -> StepResult | None:
    """One optimizer step over the global batch of step state.step: the objective's rollout (if it has
    one), forward and backward of this rank's micro-batches, the update unless the loss or gradient
    norm is not finite, and the state advanced. None where a stop request ended the rollout: the step
    is not taken."""
    r, accelerator, model, objective = run.recipe, run.accelerator, run.model, run.objective
    device, world = accelerator.device, accelerator.num_processes
    pad_id = run.tokenizer.pad_token_id
    sp = run.parallel.sp
    fetched = [] if objective.makes_batches else [
        D.fetch(run.datasets.train, rows, pad_id, r.packing, r.padding_free)
        for rows in run.schedule.rows(state.step, sp.dp_rank)]
    # an objective that generates before its step (a rollout) makes the step's batches from these
    made = objective.rollout(run, state.step, fetched, stop)
    if made is None:  # a stop request during the rollout (agreed by the ranks): no step
        return None
    micro_batches = [sp.shard(b) for b in made]
    # The global batch's counts, summed on the device and not read back here: the host queues the
    # forward without waiting for the previous step to finish (see one_sync_per_step)
    counts = run.reduce_sum(to_device(objective.counts(micro_batches), device))
    scale = (world * run.plan.grad_accum / counts[0]).float()  # the framework averages over ranks and micro-steps
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    aux = []
    for index, batch in enumerate(to_device(b, device) for b in micro_batches):
        with accumulate(accelerator, model, index):
            with activation_offload(r.activation_offload):
                loss = objective.loss(model, batch, aux)
            accelerator.backward(loss * scale)
        step_loss += loss.detach().double()
    fault_point("before_update", accelerator.process_index, state.step + 1)  # a kill mid-step (tests)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), r.max_grad_norm or float("inf"))
    step_loss, global_tokens, global_inputs, stopping = one_sync_per_step(step_loss, counts, stop, run.reduce_sum)
    if not skip_nonfinite(state, step_loss, grad_norm, r, run.out):  # or raises: a NaN run stops here
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.tokens += global_tokens
    state.samples += run.schedule.global_batch
    meter.step(global_tokens, global_inputs)
    fault_point("after_step", accelerator.process_index, state.step, run.optimizer)
    return StepResult(step_loss, grad_norm, objective.take_metrics(), counts[0], aux, stopping)


class Reporter:
    """What the run tells the person watching it: the log line or progress bar, metrics.jsonl, the
    recipe's trackers and loss.png. The loop calls it once per step (`step`) and once per eval
    (`eval`), on every rank: a step's record gathers the ranks' peak memory."""

    def __init__(self, accelerator, recipe, out: Path, total_steps: int, objective: Objective):
        self.accelerator, self.recipe, self.total_steps = accelerator, recipe, total_steps
        self.objective = objective  # its metrics' names, values (means) and which of them are shown
        self.metrics = MetricsFile(out / "metrics.jsonl", accelerator.is_main_process, accelerator)
        start_trackers(accelerator, recipe, out)
        self.plot = LossPlot(out / "metrics.jsonl", out / "loss.png",
                             enabled=accelerator.is_main_process and recipe.plot_loss, panels=objective.panels)
        self.progress = None
        self.last: dict = {}  # the last step's record: the summary keeps the objective's shown metrics of it

    def resumed(self, record: dict) -> None:
        self.metrics.write(record)

    def begin(self, step: int) -> None:
        """The progress bar (or log lines), from the step the run starts at."""
        self.progress = Progress(self.total_steps, step, self.accelerator.is_main_process, self.objective.shown)
        if self.objective.loss_note:
            self.progress.note(self.objective.loss_note)

    def step(self, state: LoopState, result: StepResult, scheduler, meter: Throughput, epoch: int) -> None:
        """After each optimizer step: a record every log_every steps and at the last."""
        accelerator, device = self.accelerator, self.accelerator.device
        record = None
        if state.step % self.recipe.log_every == 0 or state.step == self.total_steps:
            memory = accelerator.gather(torch.tensor([peak_memory_bytes(device)], device=device)).tolist()
            grad_norm = result.grad_norm
            record = {"step": state.step, "loss": result.loss, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                      "tokens": state.tokens, **meter.window(), "epoch": epoch,
                      "peak_memory_gib": [round(b / 2**30, 3) for b in memory]}
            if result.metrics is not None:
                sums = reduced_metrics(result.metrics, self.objective.maxed,
                                       lambda t: accelerator.reduce(t, reduction="sum"))
                record.update(zip(self.objective.metrics, self.objective.means(sums, result.count)))
            if result.aux:
                record["aux_loss"] = float(accelerator.reduce(torch.stack(result.aux).mean(), reduction="sum")
                                           / accelerator.num_processes)
            self.metrics.write(record)
            self.last = record
        self.progress.update(state.step, record)

    def eval(self, step: int, eval_loss: float | None, metrics: dict, shown: str, plot: bool = True) -> None:
        """After each eval: its loss (none where the objective has no eval loss) and the objective's metrics,
        the samples' progress line, and loss.png (redrawn at most every so often)."""
        loss = {} if eval_loss is None else {"eval_loss": eval_loss}
        self.metrics.write({"step": step} | loss | {f"eval_{k}": v for k, v in metrics.items()})
        head = f"step {step}: eval" + ("" if eval_loss is None else f"_loss {eval_loss:.4f}")
        self.progress.note(head + "".join(
            f" {k} {v:.4f}" for k, v in metrics.items() if k in self.objective.shown))
        if shown:
            self.progress.note(shown)
        if plot:
            self.plot.update()

    def note(self, text: str) -> None:
        self.progress.note(text)

    def saved(self, lines: list[str], records: list[dict]) -> None:
        """What the checkpointer says of its saves: log lines, and per checkpoint its seconds blocking the
        loop and in the background (metrics.jsonl)."""
        for record in records:
            self.metrics.write(record)
        for line in lines:
            self.progress.note(line)

    def close(self) -> None:
        self.progress.close()

    def final_plot(self) -> Path | None:
        """loss.png drawn now (on the main process; its path, if one was drawn)."""
        return self.plot.final()


def run_eval(run: Run, step: int, meter: Throughput, stop: StopRequest) -> tuple[tuple | None, str, bool]:
    """The objective's eval (its loss, None where it has none, and its metrics; for SFT and DPO the mean
    loss over the eval batches, evaluate), the samples' progress line, and whether a stop request (agreed
    by the ranks) came during them; paused out of the training speed. An eval a stop request ends before
    its last batch gives None (nothing recorded); samples it cuts short are not written (the finished
    eval is)."""
    r = run.recipe
    with meter.paused("eval"):
        result = run.objective.evaluate(run, step, stop, lambda: evaluate(
            run.model, run.datasets.eval, run.eval_rows, run.tokenizer.pad_token_id, r.packing, run.accelerator.device,
            run.reduce_sum, run.objective, r.padding_free, shard=run.parallel.sp.shard, stop=stop))
        if result is None:
            run.reporter.note(f"step {step}: eval stopped by a stop request before its end; not recorded")
            return None, "", True
        with SP.whole_sequences():
            shown = sample_at_eval(run.accelerator, run.model, run.prompts, run.tokenizer,
                                   answer_length(r), run.samples, step, run.generation_config, stop)
    if shown is None:
        run.reporter.note(f"step {step}: samples stopped by a stop request; not written")
    return result, shown or "", shown is None


def train(plan: Plan) -> dict:
    run, state = setup(plan)
    try:
        return train_from(run, state)
    except BaseException:  # a checkpoint's background write (async_save) finishes before the process ends
        run.checkpoints.wait_after_error(log.warning)
        raise


def train_from(run: Run, state: LoopState) -> dict:
    r, reporter = run.recipe, run.reporter
    stop = StopRequest()
    reporter.begin(state.step)
    meter = Throughput(run.accelerator.device, r.mixed_precision, run.config, r.max_seq_len,
                       run.accelerator.num_processes, tokens_at_start=state.tokens,
                       steps=run.total_steps - state.step, first_step=state.step)
    last_eval, last_metrics = None, {}
    if run.eval_rows is not None and r.eval_at_start and state.step == 0:
        result, shown, stopped = run_eval(run, 0, meter, stop)
        if result is not None:
            last_eval, last_metrics = result
            reporter.eval(0, last_eval, last_metrics, shown, plot=False)
        if stopped:  # before the first step: nothing to save
            return finish(run, state, meter, last_eval, last_metrics, stopped=True)
    run.model.train()
    stopping = False
    saved = state.step if run.plan.resume is not None else None  # the step of the newest checkpoint
    while state.step < run.total_steps:
        run.checkpoints.poll()  # async_save: publishes a finished background write, raises a failed one
        reporter.saved(*run.checkpoints.take_saved())
        with counted_step(state.step + 1):  # FINETUNE_COUNT_COLLECTIVES (finetune/collectives.py)
            result = optimizer_step(run, state, stop, meter)
        if result is None:  # stopped within the step's rollout: the step before it is the one saved
            stopping = True
            if state.step and state.step != saved:
                with meter.paused("checkpoint"):
                    run.checkpoints.save(state)
                reporter.saved(*run.checkpoints.take_saved())
            break
        stopping = result.stopping
        reporter.step(state, result, run.scheduler, meter, (state.step - 1) // run.schedule.steps_per_epoch)
        end = state.step == run.total_steps
        if run.eval_rows is not None and ((r.eval_every and state.step % r.eval_every == 0) or end):
            evaluated, shown, stopped = run_eval(run, state.step, meter, stop)
            stopping = stopping or stopped
            if evaluated is not None:
                last_eval, last_metrics = evaluated
                if last_eval is not None:
                    state.best_eval_loss = min(last_eval, state.best_eval_loss or float("inf"))
                reporter.eval(state.step, last_eval, last_metrics, shown)
        if (r.save_every and state.step % r.save_every == 0) or end or stopping:
            with meter.paused("checkpoint"):
                run.checkpoints.save(state)
            saved = state.step
            reporter.saved(*run.checkpoints.take_saved())
        if stopping:
            break
    with meter.paused("checkpoint"):
        run.checkpoints.wait()  # async_save: the last background write published (bounded)
    reporter.saved(*run.checkpoints.take_saved())
    return finish(run, state, meter, last_eval, last_metrics, stopping)


def finish(run: Run, state: LoopState, meter: Throughput, last_eval: float | None, last_metrics: dict,
           stopped: bool) -> dict:
    """final/ (and final_merged/), summary.json and the summary; or, stopped by a signal, just the word."""
    r, accelerator, reporter, out = run.recipe, run.accelerator, run.reporter, run.out
    device, world, is_main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
    reporter.close()
    if stopped:
        reporter.final_plot()
        if is_main:  # every rank stops alike, whichever rank the signal reached: one line
            log.warning(f"stopped by signal at step {state.step}; checkpoint saved; continue with --resume auto"
                        if state.step else "stopped by signal before the first training step; nothing to save")
        finish_together(accelerator)
        return {"steps": state.step, "stopped": True}
    final = save_final_model(accelerator, run.model, run.tokenizer, out / FINAL,
                             generation_config=run.generation_config)
    if r.merge_lora:
        if is_main:
            merge_adapter(run.model_path, final, out / FINAL_MERGED,
                          "bfloat16" if r.mixed_precision == "bf16" else "float32")
        accelerator.wait_for_everyone()
    peaks = [0] * world
    torch.distributed.all_gather_object(peaks, peak_memory_bytes(device))
    saved = saved_names(checkpoints_dir(out))
    summary = {"steps": state.step, "resumed_at": run.plan.resume.step if run.plan.resume else None,
               **meter.summary(state.tokens), "wall_seconds": round(time.perf_counter() - run.wall_t0, 2),
               "tokens": state.tokens, "final_eval_loss": last_eval,
               **{f"final_eval_{k}": v for k, v in last_metrics.items()}, "best_eval_loss": state.best_eval_loss,
               "peak_memory_per_rank": peaks, "peak_memory_kind": "GPU allocated" if device.type == "cuda"
               else "process resident",
               "final_model": str(final), "end_of_turn": run.stops,
               "checkpoints": f"{checkpoints_dir(out)} ({', '.join(saved)})" if saved else "",
               **run.checkpoints.summary(),
               "loss_plot": None, "metrics": str(out / "metrics.jsonl"), "samples": run.samples.summary(),
               **{f"last_step_{k}": reporter.last[k] for k in run.objective.shown if k in reporter.last}}
    if is_main:
        summary |= run.objective.summary(out)
        summary["loss_plot"] = str(reporter.final_plot() or "") or None
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.info(format_summary(summary, run.objective.shown))
    finish_together(accelerator)
    return summary


def finish_together(accelerator=None) -> None:
    """Trackers flushed, and every rank has written its part (metrics, checkpoint, final model) before
    any rank exits; run.py then ends the process without tearing the process group down (see its
    exit_without_teardown). Not accelerator.end_training(): it destroys the process group, which is
    that teardown (it can abort the process at exit with "terminate called without an active
    exception": docs/design-notes.md), and the barrier below would then never run."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        tracker.finish()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
