"""What a run tells the person watching it: metrics.jsonl, a progress bar or log lines, a summary."""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from pathlib import Path

log = logging.getLogger("finetune")


def setup_logging(level: str, rank: int) -> None:
    """Our messages at `level` on rank 0 (warnings on every rank, prefixed); dependencies' chatter
    (DeepSpeed, Accelerate, Transformers, Datasets) at warning unless the user asks for debug."""
    fmt = f"[rank{rank}] %(levelname)s %(message)s" if rank else "%(message)s"
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
    for name in ("DeepSpeed", "deepspeed", "accelerate", "transformers", "datasets", "torch.distributed"):
        logging.getLogger(name).setLevel(noisy)
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


class MetricsFile:
    """metrics.jsonl: one JSON object per line, appended and flushed, never truncated."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


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
    """A tqdm bar on a terminal; otherwise one compact line per logged step (CI, SLURM logs)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled, self.total = enabled, total
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
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                     tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        elif record:
            done = step - self.start
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
            log.info(f"step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
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
