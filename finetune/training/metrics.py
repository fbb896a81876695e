"""What a run tells the person watching it: metrics.jsonl, a progress bar or log lines, a summary."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
import warnings
from pathlib import Path

from finetune.arch import EstimateError, architecture_from_config

log = logging.getLogger("finetune")


def setup_logging(level: str, rank: int) -> None:
    """Our messages at `level` on rank 0 (warnings on every rank, prefixed); dependencies' chatter
    (DeepSpeed, Accelerate, Transformers, Datasets) at warning unless the user asks for debug."""
    fmt = f"[rank{rank}] %(levelname)s %(message)s" if rank else "%(message)s"
    if not isinstance(sys.stdout, QuietStdout):
        sys.stdout = QuietStdout(sys.stdout)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if level == "debug":
        log.setLevel(logging.DEBUG)
    noisy = logging.DEBUG if level == "debug" else logging.WARNING
    if level != "debug":
        # torch.distributed's deprecation notices fire on every collective DeepSpeed issues
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        warnings.filterwarnings("ignore", message=r".*OMP_NUM_THREADS.*")
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
    for name in ("DeepSpeed", "deepspeed", "accelerate", "transformers", "datasets", "torch.distributed"):
        logging.getLogger(name).setLevel(noisy)
    load_reports = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, OneLineLoadReport) for f in load_reports.filters):
        load_reports.addFilter(OneLineLoadReport())
    # bitsandbytes (imported by peft on every LoRA run) warns as it loads that the `kernels` package's CPU
    # 4-bit kernel is missing: its own CPU path serves a 4-bit base without it (tests/test_qlora_cpu_paths.py)
    kernels = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if _no_kernels_notice not in kernels.filters:
        kernels.addFilter(_no_kernels_notice)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(noisy)
    except ImportError:
        pass
    try:
        import datasets
        import transformers

        transformers.utils.logging.set_verbosity(noisy)
        transformers.utils.logging.disable_progress_bar()
        datasets.utils.logging.set_verbosity(noisy)
        datasets.disable_progress_bars()
    except ImportError:
        pass


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _no_kernels_notice(record: logging.LogRecord) -> bool:
    return "gemm_4bit_forward from kernels-community" not in record.getMessage()


# A sequence classifier made from a causal LM (a reward model's start): its score head is new and the
# lm_head unused, as they should be
EXPECTED_FOR_A_NEW_HEAD = {"MISSING": re.compile(r"^score\.(weight|bias)$"), "UNEXPECTED": re.compile(r"^lm_head\.")}


class OneLineLoadReport(logging.Filter):
    """transformers' LOAD REPORT (a table with terminal colour codes, and notes) as one line: the keys by
    status. A reward model's new score head (MISSING) and the causal LM's unused lm_head (UNEXPECTED),
    which every reward run starting from a causal LM has, are not reported: nothing else is, or the
    line names the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = ANSI.sub("", record.getMessage())
        if "LOAD REPORT" not in text:
            return True
        head, _, table = text.partition("\n")
        new_head = "ForSequenceClassification" in head
        by_status: dict[str, list[str]] = {}
        for row in table.splitlines():
            cells = [c.strip() for c in row.split("|")]
            if len(cells) >= 2 and cells[0] and cells[1] and cells[0] != "Key" and not set(cells[0]) <= set("-+"):
                expected = EXPECTED_FOR_A_NEW_HEAD.get(cells[1])
                if not (new_head and expected and expected.match(cells[0])):
                    by_status.setdefault(cells[1], []).append(cells[0])
        if not by_status:
            return False
        notes = {"MISSING": "newly initialized", "UNEXPECTED": "in the checkpoint, unused"}
        keys = "; ".join(f"{status} ({notes.get(status, status.lower())}): {', '.join(names)}"
                         for status, names in by_status.items())
        record.msg, record.args = f"{head.replace(' LOAD REPORT', ' loaded')}: {keys}", None
        return True


class QuietStdout:
    """Standard output less DeepSpeed's `DeepSpeed ... deepspeed_shm_comm_op built successfully`, which
    its backend prints on every rank of every launch as it starts (deepspeed/comm/torch.py build_shm_op):
    it says nothing the run's own start line does not."""

    REPEATED = re.compile(r"^DeepSpeed \S+ built successfully\n?$")

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not self.REPEATED.match(line):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.REPEATED.match(self.pending):
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's
        return getattr(self.stream, name)


class MetricsFile:
    """metrics.jsonl: one JSON object per line, appended and flushed, never truncated."""

    def __init__(self, path: Path, enabled: bool, accelerator=None):
        self.path, self.enabled, self.accelerator = path, enabled, accelerator

    def write(self, record: dict) -> None:
        """On the main process; the numbers also go to the recipe's trackers (report_to)."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(json_values(record)) + "\n")
        if self.accelerator is not None and self.accelerator.trackers:
            values = {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in record.items()
                      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            # a checkpoint's record comes when it is published, steps after its own (trackers want steps in order)
            if values and "resumed_from" not in record and "checkpoint" not in record:
                self.accelerator.log(values, step=record["step"])


def json_values(value):
    """value with every NaN or infinite float as None: JSON has no NaN (json.dumps would write a bare NaN,
    which strict JSON readers refuse), and a value that is not a number is no value."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_values(v) for v in value]
    return value


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_history(records: list[dict]) -> list[dict]:
    """The records of the run as it finally went: a resume record ({"step": s, "resumed_from": ...})
    drops what an interrupted attempt logged after step s, which the resumed run logs again."""
    history: list[dict] = []
    for record in records:
        if "resumed_from" in record:
            history = [r for r in history if r["step"] <= record["step"]]
        history.append(record)
    return history


class Progress:
    """A tqdm bar on a terminal; otherwise one compact line per logged step (CI, SLURM logs). shown: the
    objective's metrics it shows beside the loss, with their short labels (Objective.shown)."""

    def __init__(self, total: int, start: int, enabled: bool, shown: dict[str, str] | None = None):
        self.enabled, self.total, self.shown = enabled, total, shown or {}
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, dynamic_ncols=True, desc="train")
        self.t0, self.start = time.perf_counter(), start

    def update(self, step: int, record: dict | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if record:
                extra = {short: f"{record[name]:.3f}" for name, short in self.shown.items() if name in record}
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", **extra, lr=f"{record['lr']:.2e}",
                                     tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        elif record:
            done = step - self.start
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
            shown = "".join(f" {short} {record[name]:.3f}" for name, short in self.shown.items() if name in record)
            log.info(f"step {step}/{self.total} loss {record['loss']:.4f}{shown} lr {record['lr']:.2e} "
                     f"grad_norm {record['grad_norm']:.3f} tok/s {record['tokens_per_s']:.0f} eta {eta:.0f}s")

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            log.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- trackers


def tracker_value(v):
    """A recipe value as the trackers' hyper-parameters take it (TensorBoard: int, float, str or bool only):
    lists joined by commas, mappings as JSON, None and anything else as text."""
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def start_trackers(accelerator, recipe, output_dir: Path) -> None:
    """Accelerate's trackers, named after output_dir. A resumed run continues the same tracker run
    where the tracker allows it: TensorBoard appends to the same log directory, Weights & Biases
    resumes the run id kept in output_dir/wandb_run_id; MLflow starts a new run in the same experiment."""
    trackers = [t for t in recipe.report_to if t != "none"]
    if not trackers:
        return
    init_kwargs = {}
    if "wandb" in trackers:
        id_file = output_dir / "wandb_run_id"
        if accelerator.is_main_process and not id_file.exists():
            import uuid

            output_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(uuid.uuid4().hex[:12])
        accelerator.wait_for_everyone()
        init_kwargs["wandb"] = {"id": id_file.read_text().strip(), "resume": "allow", "name": output_dir.name}
    if "mlflow" in trackers:
        init_kwargs["mlflow"] = {"run_name": output_dir.name}
    config = {k: tracker_value(v) for k, v in recipe.to_dict().items()}
    # project "finetune": the W&B project / MLflow experiment; TensorBoard writes to output_dir/finetune/
    accelerator.init_trackers("finetune", config=config, init_kwargs=init_kwargs)


# ---------------------------------------------------------------- the run's plot (loss.png)

# A panel of the plot: (title, y-axis label, the metric's key): its train values under the key, its eval
# values under "eval_" + key. Each objective names its own (Objective.panels); the loss's is the default.
LOSS_PANELS = (("loss", "cross-entropy (mean per target token)", "loss"),)


def plot_losses(metrics_path: Path, png_path: Path, panels=LOSS_PANELS) -> Path | None:
    """loss.png: the curves the objective optimizes against optimizer steps, one panel each (`panels`,
    Objective.panels: SFT the loss; GRPO the reward, the completion length, the entropy, the clipped share
    (clipped loss types) and the KL when beta > 0; DPO the loss, accuracy and margin; a reward model the
    loss and accuracy; KTO the loss, rewards/chosen, rewards/rejected and kl), train and eval; the learning
    rate in a small panel below when it changes, in the title when it is constant."""
    records = run_history(read_metrics(metrics_path)) if Path(metrics_path).exists() else []
    records = [r for r in records if "resumed_from" not in r]
    if not records:
        return None
    panels_given, drawn_panels = panels, []
    for title, ylabel, key in panels:
        drawn = [(label, name, is_eval, [(r["step"], r[name]) for r in records
                                         if isinstance(r.get(name), (int, float)) and not isinstance(r[name], bool)])
                 for label, name, is_eval in (("train", key, False), ("eval", f"eval_{key}", True))]
        drawn = [d for d in drawn if d[3]]
        if drawn:
            drawn_panels.append((title, ylabel, drawn))
    if not drawn_panels:
        return None
    panels = drawn_panels
    lrs = [(r["step"], r["lr"]) for r in records if isinstance(r.get("lr"), (int, float))]
    lr_changes = len({v for _, v in lrs}) > 1
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # not pyplot: no global state, no GUI backend, a faster import

    heights = [3] * len(panels) + ([1] if lr_changes else [])
    fig = Figure(figsize=(9, 1.2 + 2.6 * len(panels) + (1.0 if lr_changes else 0)), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    points = {}
    for ax, (title, ylabel, drawn) in zip(axes, panels):
        for label, key, is_eval, xy in drawn:
            style = dict(marker="o", markersize=4, linewidth=1.5, color="tab:orange") if is_eval else \
                dict(linewidth=1.2, color="tab:blue", marker="." if len(xy) < 4 else None)  # a lone point shows
            ax.plot([x for x, _ in xy], [y for _, y in xy], label=label, **style)
            points[f"{'eval' if is_eval else 'train'}_{key.removeprefix('eval_')}"] = len(xy)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if lr_changes:
        lr_ax = axes[-1]
        lr_ax.plot([x for x, _ in lrs], [y for _, y in lrs], color="tab:green", linewidth=1)
        lr_ax.set_ylabel("learning rate", fontsize=8)
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        lr_ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    lr_note = f", constant learning rate {lrs[0][1]:.2g}" if len(lrs) > 1 and not lr_changes else ""
    fig.suptitle(f"{Path(metrics_path).parent.name}{lr_note}", fontsize=11)
    fig.tight_layout()
    tmp = Path(png_path).with_suffix(".tmp.png")
    if tuple(panels_given) == LOSS_PANELS:  # both curves named, drawn or not
        points = {"train_loss": points.get("train_loss", 0), "eval_loss": points.get("eval_loss", 0)}
    points["learning_rate"] = len(lrs) if lr_changes else 0  # 0: constant, named in the title instead
    points["last_step"] = max(r["step"] for r in records)
    fig.savefig(tmp, metadata={"Description": json.dumps(points)})  # lets a test count what was drawn
    tmp.replace(png_path)
    return Path(png_path)


class LossPlot:
    """loss.png kept current while training without stalling it: redrawn after an eval at most every
    `every_s` seconds (a redraw costs rank 0 about half a second, and the other ranks wait for it at
    the next collective), and always at the end."""

    def __init__(self, metrics_path: Path, png_path: Path, enabled: bool, every_s: float = 60.0,
                 panels=LOSS_PANELS):
        self.metrics_path, self.png_path, self.enabled, self.every_s = metrics_path, png_path, enabled, every_s
        self.panels = panels
        self.last = time.monotonic()  # the first eval's plot waits too: a short run draws once, at its end

    def update(self) -> None:
        if self.enabled and time.monotonic() - self.last >= self.every_s:
            self.final()

    def final(self) -> Path | None:
        if not self.enabled:
            return None
        self.last = time.monotonic()
        return plot_losses(self.metrics_path, self.png_path, self.panels)


# ---------------------------------------------------------------- training speed


STEADY_SKIP_MAX = 10  # steps left out of the steady state: the first compile, allocator and NCCL warm-up


def steady_skip(steps: int) -> int | None:
    """How many of a run's first steps the steady-state figure leaves out: half of a short run, 10 of
    one of 20 steps or more (torch.compile compiles at the first step and once more at the first other
    sequence length; DeepSpeed's and the CUDA allocator's warm-up take a few steps). None where the run
    has fewer than 2 steps: nothing would be left that is not warm-up."""
    if steps < 2:
        return None
    return min(STEADY_SKIP_MAX, steps // 2)


def steady_rate(start: tuple[float, int] | None, end: tuple[float, int] | None) -> float | None:
    """Tokens per second between two marks (training seconds, tokens so far), each taken at the end of
    a step. None where either is missing or no time passed between them."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


class Throughput:
    """Training speed, as the log records and the summary report it: target tokens per second over
    the window since the last record, with evaluation and checkpoint time left out (`paused`), and
    MFU where the GPU's peak is known (model FLOPs of the real, non-padding input tokens).

    The summary gives two figures: tokens_per_s over all the steps this process trained (its first
    steps, which warm up and compile, included) and tokens_per_s_steady over the steps after the first
    steady_skip(steps) of them, the figure other toolkits' logs are compared with (steady_steps says
    which steps, numbered as the run numbers them). `steps` is how many steps this process will train,
    from step `first_step` on (a resumed run: the rest, from where it resumed)."""

    def __init__(self, device, mixed_precision: str, config, seq_len: int, world: int, tokens_at_start: int,
                 steps: int = 0, first_step: int = 0, clock=time.perf_counter):
        self.peak = peak_flops(device, mixed_precision)
        self.flops = flops_per_token(config, seq_len) if self.peak else 0.0
        self.world, self.tokens_at_start = world, tokens_at_start  # a resumed run counts only what it trained
        self.clock = clock
        self.paused_seconds = {"eval": 0.0, "checkpoint": 0.0}
        self.t0 = self.window_t0 = clock()
        self.window_tokens = self.window_inputs = 0
        self.skip, self.first_step = steady_skip(steps), first_step
        self.steps_done, self.tokens_done = 0, 0
        self.skip_mark = self.last_mark = None  # (training seconds, tokens) at the end of step skip, of the latest

    def stepping_seconds(self) -> float:
        """Training time so far, eval and checkpoint pauses left out."""
        return self.clock() - self.t0 - sum(self.paused_seconds.values())

    def step(self, target_tokens: int, input_tokens: int) -> None:
        self.window_tokens += target_tokens
        self.window_inputs += input_tokens
        self.steps_done += 1
        self.tokens_done += target_tokens
        self.last_mark = (self.stepping_seconds(), self.tokens_done)
        if self.steps_done == self.skip:
            self.skip_mark = self.last_mark

    class _Pause:
        def __init__(self, meter, kind):
            self.meter, self.kind = meter, kind

        def __enter__(self):
            self.start = self.meter.clock()
            return self

        def __exit__(self, *exc):
            self.seconds = self.meter.clock() - self.start
            self.meter.paused_seconds[self.kind] += self.seconds
            self.meter.window_t0 += self.seconds  # the window measures training alone

    def paused(self, kind: str) -> "Throughput._Pause":
        """with meter.paused("eval" | "checkpoint") as p: ...  (p.seconds afterwards)"""
        return Throughput._Pause(self, kind)

    def window(self) -> dict:
        """The record's speed fields for the window since the last call; starts the next window."""
        now = self.clock()
        seconds = now - self.window_t0
        fields = {"tokens_per_s": self.window_tokens / seconds}
        if self.peak and self.flops:
            fields["mfu"] = self.window_inputs / seconds * self.flops / (self.world * self.peak)
        self.window_tokens = self.window_inputs = 0
        self.window_t0 = now
        return fields

    def summary(self, tokens: int) -> dict:
        train = self.clock() - self.t0
        stepping = train - sum(self.paused_seconds.values())
        steady = steady_rate(self.skip_mark, self.last_mark)
        return {"train_seconds": round(train, 2), "eval_seconds": round(self.paused_seconds["eval"], 2),
                "checkpoint_seconds": round(self.paused_seconds["checkpoint"], 2),
                "tokens_per_s": (tokens - self.tokens_at_start) / stepping if stepping > 0 else 0.0,
                "tokens_per_s_steady": steady,
                "steady_steps": [self.first_step + self.skip + 1, self.first_step + self.steps_done] if steady else None}


# ---------------------------------------------------------------- memory and the end-of-run summary


def peak_memory_bytes(device) -> int:
    """Peak GPU memory allocated on a GPU run; peak resident memory of the process on CPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# Dense 16-bit peak FLOP/s of the GPUs we know (vendor datasheets, without sparsity), for MFU.
PEAK_FLOPS_16BIT = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(device, mixed_precision: str) -> float | None:
    """None where MFU would mean nothing: CPU, fp32 runs, GPUs not in the table."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or mixed_precision == "no":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS_16BIT.items() if key in name), None)


def flops_per_token(config, seq_len: int) -> float:
    """6 N + 12 L H Q T (PaLM appendix B), N without the input embedding, which is a lookup, not a matmul.
    A LoRA run is counted as if it trained the whole model: its backward skips only the weight gradients."""
    try:
        arch = architecture_from_config(config)
    except EstimateError:  # not a Llama-layout decoder: no MFU rather than a wrong one
        return 0.0
    n = arch.num_parameters() - arch.embedding_parameters
    return 6 * n + 12 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_size * seq_len


def speed_line(summary: dict) -> str:
    """The steady state first (what other toolkits' logs show), then the figure over every step."""
    overall = f"{summary['tokens_per_s']:,.0f} tokens/s over every step"
    steady, steps = summary.get("tokens_per_s_steady"), summary.get("steady_steps")
    if not steady or not steps:
        return overall.replace("over every step", "while training")
    return f"{steady:,.0f} tokens/s steady (steps {steps[0]}-{steps[1]}), {overall} (warm-up included)"


def format_summary(summary: dict, shown: dict[str, str] | None = None) -> str:
    """The run summary's lines; shown: the objective's metrics it gives beside the eval loss (their final
    values), with their labels (Objective.shown)."""
    gib = 2**30
    final = [f"{label} {summary[f'final_eval_{name}']:.4f}" for name, label in (shown or {}).items()
             if summary.get(f"final_eval_{name}") is not None]
    peaks = summary.get("peak_memory_per_rank") or []
    kind = summary.get("peak_memory_kind", "")
    # a resumed run's times and saves are this launch's, since the resume (every save's are in
    # metrics.jsonl's checkpoint records)
    leg = " since the resume" if summary.get("resumed_at") else ""
    rows = [
        ("steps", f"{summary['steps']}" + (f" (resumed at {summary['resumed_at']})" if summary.get("resumed_at") else "")),
        ("time", f"{summary['train_seconds']:.1f} s training{leg} (of which eval {summary.get('eval_seconds', 0):.1f} s, "
                 f"checkpoints {summary.get('checkpoint_seconds', 0):.1f} s), {summary['wall_seconds']:.1f} s in all"),
        ("tokens", f"{summary['tokens']:,} target tokens, " + speed_line(summary)),
        # an objective without an eval loss (GRPO: a reward) shows its eval metrics alone
        *([] if final and summary.get("final_eval_loss") is None else [
            ("eval loss", "n/a" if summary.get("final_eval_loss") is None else
             f"final {summary['final_eval_loss']:.4f}, best {summary['best_eval_loss']:.4f}")]),
        *([("eval metrics", ", ".join(final) + " (final)")] if final else []),
        (f"peak memory ({kind})", ", ".join(f"rank {i}: {b / gib:.2f} GiB" for i, b in enumerate(peaks)) or "n/a"),
        ("model", summary.get("final_model", "")),
        ("stops at", summary.get("end_of_turn") or "n/a"),
        ("checkpoints", (summary.get("checkpoints") or "none written") + (
            f"; async_save{leg}: {summary['checkpoint_saves']} save(s), "
            f"{summary['checkpoint_blocking_seconds']:.2f} s blocking, "
            f"{summary['checkpoint_background_seconds'] or 0:.2f} s in the background"
            if summary.get("async_save") and summary.get("checkpoint_saves") else "")),
        *([("undecodable", f"{summary['undecodable_completions']} of {summary['completions']} completions hold "
                            f"{summary['undecodable_ids']} ids the tokenizer cannot decode (rollouts.jsonl: "
                            "undecodable_ids)")] if summary.get("undecodable_ids") else []),
        ("plot", summary.get("loss_plot") or "n/a"),
        ("metrics", summary.get("metrics", "")),
    ]
    for sample in summary.get("samples") or []:  # the last eval's, as samples.jsonl has them
        rows.append(("sample", f"{' '.join(sample['prompt'].split())[-50:]!r} -> "
                               f"{' '.join(sample['generated'].split())[:60]!r} (reference "
                               f"{' '.join(sample['reference'].split())[:40]!r})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["=" * 72, "run summary"] + [f"  {k:<{width}}  {v}" for k, v in rows] + ["=" * 72])
