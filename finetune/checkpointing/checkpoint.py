"""The Checkpointer: a checkpoint's writes and its load, behind one narrow interface: `save(state)` and
`.load(point)`; finetune/checkpointing/resume.py decides, before anything is loaded, which checkpoint a
run continues from.

A save writes every rank's part into the checkpoint's hidden `.step_N.partial/` (layout.py), hashes it
(each rank about 1/N of the bytes), then rank 0 writes the manifest (manifest.py) and renames it into
place, then applies keep_last. With async_save the same code stages each rank's part in host memory and a
thread writes it (background.py, snapshot.py, staging.py); poll() publishes it once every rank's write
finished. A write that fails on any rank fails on every rank alike (SaveError).

Model, optimizer, scheduler and RNG states go through Accelerate's save_state/load_state: FSDP
writes distributed-checkpoint shards (which load resharded on any world size), DeepSpeed its
per-rank files (converted to a universal checkpoint for another world size, see
resume.ensure_universal), all read back under safe_loading.py. The loop's own state is JSON (run_state.py).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from finetune.checkpointing.background import BackgroundWrite, read_markers, remove_markers
from finetune.checkpointing.layout import (HF_DIR, MANIFEST, checkpoint_name, checkpoints_dir, complete_checkpoints,
                                           rotate)
from finetune.checkpointing.manifest import CHECKSUM, file_checksums, fingerprint, shares, verify_checksums
from finetune.checkpointing.run_state import (LOOP_STATE, RNG_DIR, LoopState, load_rng, read_loop_state, save_in_flight,
                                              save_rng)
from finetune.checkpointing.safe_loading import UnsafeCheckpointError, safe_loading
from finetune.checkpointing.snapshot import Snapshotter, reserve_pinned, state_storage_sizes
from finetune.checkpointing.staging import claim_staging_dir, run_staging_dir, wait_limit_s
from finetune.files import publish
from finetune.recipe import RecipeError
from finetune.faults import fault_point
from finetune.optim import nonfinite_count

ZERO_REDUNDANCY_OPTIMIZER = "zero_redundancy_optimizer.pt"


class Checkpointer:
    """Two calls: `save(state)` writes a checkpoint of everything (collective), `load(point)` restores
    it in place and returns the loop's state. Built once the model and optimizer are prepared."""

    def __init__(self, plan, accelerator, optimizer, model_path: str, model_config=None, tokenizer=None,
                 generation_config=None, records: dict | None = None):
        """records: what each manifest records of the run's inputs (the model's identity, the precomputed
        reference log-probs' file and sha256), for a resume to check (resume.check_identity)."""
        r = plan.recipe
        self.root = checkpoints_dir(r.output_dir)
        # copied in, so export needs nothing else (the generation config: the one final/ gets)
        self.model_config, self.tokenizer, self.generation_config = model_config, tokenizer, generation_config
        self.strategy = plan.strategy
        self.strategy.on_checkpointer(accelerator, r.lora)
        self.accelerator, self.optimizer = accelerator, optimizer
        self.recipe = r
        self.fingerprint = fingerprint(r, model_path)
        self.global_batch_size = plan.global_batch_size
        self.keep_last = r.keep_last
        self.records = dict(records or {})
        # work in flight a checkpoint holds (Objective.in_flight: step -> {name: (tensors, plain data)})
        self.in_flight = None
        # rank 0: the save_id of the newest checkpoint this run started to save (or resumed from): what a
        # vLLM engine's rollouts generated after it are sealed with (rollouts.save_recorded)
        self.latest_id = plan.resume.manifest.get("save_id") if plan.resume is not None else None
        self.save_ids: dict[str, str] = {}  # checkpoint name -> its save_id, until its manifest is written
        # async_save (background.py): the write in flight, if any (every rank has one or none alike),
        # and what the loop reports of each save (take_saved)
        self.async_save = r.async_save
        self.staging = run_staging_dir(r.output_dir)
        self.pending: BackgroundWrite | None = None
        self.snapshotter = Snapshotter()
        self.reserving = None  # the thread reserving the first save's pinned host memory (reserve_host_buffers)
        self.timings: list[dict] = []
        self._lines: list[str] = []
        self._records: list[dict] = []
        if accelerator.is_local_main_process:  # what a run killed during a background write left in RAM
            shutil.rmtree(self.staging, ignore_errors=True)

    def save(self, state: LoopState) -> Path:
        """Collective: every rank calls it. Returns the checkpoint directory: committed, or with
        async_save the one its background write will publish (see poll). Refuses (every rank
        alike, NonFiniteWeights) weights that are not finite; a write that fails on any rank (a full disk)
        fails the save on every rank alike (SaveError), the partial directory removed and the newest
        complete checkpoint untouched."""
        if self.async_save:
            return self._save_in_background(state)
        t_start = time.perf_counter()
        acc = self.accelerator
        name = checkpoint_name(state.step)
        final, tmp = self.root / name, self.root / f".{name}.partial"
        self.check_finite(state.step)
        self.new_save_id(name)

        def start():
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        self._together(start, tmp, state.step)
        t0 = time.perf_counter()
        self._together(lambda: self._write(state, tmp), tmp, state.step)  # every rank's shards are on disk
        files = None
        if acc.is_main_process:
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        files = _broadcast(acc, files)  # one listing (a shared filesystem may list late on other nodes)
        # each rank hashes about 1/N of the bytes, in parallel
        mine = file_checksums(tmp, shares(files, acc.num_processes)[acc.process_index])
        checksums = {k: v for part in _all_gather(acc)(mine) for k, v in part.items()}

        def commit():
            if acc.is_main_process:
                self._commit(tmp, final, state.step, files, checksums, time.perf_counter() - t0)

        self._together(commit, tmp, state.step)
        self._saved(state.step, final, time.perf_counter() - t_start, None)
        return final

    def new_save_id(self, name: str) -> None:
        """A random id for the checkpoint `name` about to be saved (rank 0's is the one its manifest records):
        names this very save, where a step number could name another run's, or another attempt's."""
        import secrets

        self.latest_id = self.save_ids[name] = secrets.token_hex(16)

    def _commit(self, tmp: Path, final: Path, step: int, files: dict, checksums: dict, seconds: float) -> None:
        """Rank 0: the manifest (fsync'd: an empty manifest after a power cut would hide a complete
        checkpoint), then the rename that publishes the checkpoint, then keep_last."""
        manifest = {"step": step, "world_size": self.accelerator.num_processes,
                    "global_batch_size": self.global_batch_size, "fingerprint": self.fingerprint,
                    "files": files, "checksum": CHECKSUM, "checksums": dict(sorted(checksums.items())),
                    "seconds": round(seconds, 3), "save_id": self.save_ids.pop(final.name, None), **self.records}
        fault_point("before_publish", self.accelerator.process_index, step)
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, final)  # a checkpoint of this step from an earlier attempt is replaced whole
        rotate(self.root, self.keep_last, keep=final)

    # ------------------------------------------------ async_save: stage, write in the background, publish

    def _save_in_background(self, state: LoopState) -> Path:
        """Waits for the previous background write (published, or its failure raised), stages this
        rank's part with the synchronous save's own code, its serialisations deferred (the state
        copied into host memory: snapshot.py), and starts its writer."""
        acc = self.accelerator
        waited = 0.0
        if self.pending is not None:
            t0 = time.perf_counter()
            previous = self.pending.name
            self.poll(wait=True)
            waited = time.perf_counter() - t0
            self._lines.append(f"step {state.step}: waited {waited:.2f}s for checkpoint "
                               f"{previous}'s background write before this save")
        if self.reserving is not None:  # long done, unless the first save comes at the first steps
            self.reserving.join()
            self.reserving = None
        t_start = time.perf_counter()
        name = checkpoint_name(state.step)
        final, tmp = self.root / name, self.root / f".{name}.partial"
        staged = self.staging / f"{name}.rank_{acc.process_index}"
        self.check_finite(state.step)
        self.new_save_id(name)

        def start():
            claim_staging_dir(self.staging)  # this user's alone: nothing another can read or plant there
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir()
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        def stage():
            with self.snapshotter.deferring(staged):
                self._write(state, staged, sync=False)

        try:
            self._together(start, tmp, state.step)
            self._together(stage, tmp, state.step)
        except SaveError:
            self.snapshotter.take()
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self.pending = BackgroundWrite(state.step, name, acc.process_index, staged, tmp,
                                       blocking_s=time.perf_counter() - t_start, waited_s=waited,
                                       describe=first_failure, jobs=self.snapshotter.take())
        self.pending.start()
        self._lines.append(f"step {state.step}: checkpoint {final} staged in {self.pending.blocking_s:.2f}s "
                           f"({self.pending.nbytes / 2**20:.1f} MiB on this rank); writing in the background")
        return final

    def reserve_host_buffers(self, model) -> None:
        """async_save on a GPU: the pinned host memory its first save copies into, allocated now, on a thread
        beside the first steps, not while the loop waits at that save (snapshot.reserve_pinned)."""
        import torch

        if self.async_save and torch.cuda.is_available():
            self.reserving = reserve_pinned(state_storage_sizes(model, self.optimizer))

    @property
    def writing(self) -> bool:
        """A background write is in flight (the same on every rank)."""
        return self.pending is not None

    def poll(self, wait: bool = False) -> None:
        """Collective while a background write is in flight (a no-op otherwise; every rank has one or
        none alike). The ranks agree on the main thread: once every rank's write finished, rank 0
        writes the manifest and publishes the checkpoint; a write that failed on any rank raises the
        same SaveError on every rank (its partial directory removed, earlier checkpoints untouched).
        wait: first wait (bounded by FINETUNE_ASYNC_WAIT_S) for this rank's write."""
        w = self.pending
        if w is None:
            return
        if wait and not w.done:
            if not w.join(wait_limit_s()):
                w.error = w.error or (f"its background write did not finish within {wait_limit_s():.0f}s "
                                      "(FINETUNE_ASYNC_WAIT_S)")
        status = "failed" if w.error else "done" if w.done else "running"
        states = _all_gather(self.accelerator)((status, w.error, w.checksums if status == "done" else None))
        failed = [(rank, error) for rank, (s, error, _) in enumerate(states) if s == "failed"]
        if failed:  # every rank's writer stopped before rank 0 removes the partial directory
            self.pending = None
            if not wait:  # (a wait that ran out has waited already)
                w.join(wait_limit_s())
            _all_gather(self.accelerator)(None)
            if self.accelerator.is_main_process:
                shutil.rmtree(w.partial, ignore_errors=True)
            raise SaveError(self.root, w.step, failed)
        if any(s == "running" for s, _, _ in states):
            return
        checksums = {k: v for _, _, part in states for k, v in part.items()}
        final = self.root / w.name
        background = max(w.background_s, 0.0)

        def commit():
            if self.accelerator.is_main_process:
                remove_markers(w.partial)
                files = {rel: (w.partial / rel).stat().st_size for rel in sorted(checksums)}
                self._commit(w.partial, final, w.step, files, checksums, w.blocking_s + background)

        self.pending = None
        self._together(commit, w.partial, w.step)
        self._saved(w.step, final, w.blocking_s, background, w.waited_s)

    def wait(self) -> None:
        """The end of a run (finished, or stopped by a signal): the write in flight finished and
        published, or its failure raised; bounded by FINETUNE_ASYNC_WAIT_S, said in a line. Collective."""
        if self.pending is not None:
            if not self.pending.done:
                self._lines.append(f"waiting (at most {wait_limit_s():.0f}s) for checkpoint {self.pending.name}'s "
                                   "background write before the run ends")
            self.poll(wait=True)
        if self.accelerator.is_local_main_process:
            shutil.rmtree(self.staging, ignore_errors=True)

    def wait_after_error(self, log=print) -> None:
        """On the way out after an error, when the ranks may not reach a collective: each rank waits
        (bounded) for its own write; rank 0 publishes the checkpoint if every rank's marker says its
        write finished, else leaves it `.partial` (never seen as a checkpoint). This run's staging
        directory goes, also after a save that failed (nothing in flight then)."""
        w, self.pending = self.pending, None
        if w is not None:
            self._finish_after_error(w, log)
        if self.accelerator.is_local_main_process:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _finish_after_error(self, w: BackgroundWrite, log) -> None:
        log(f"waiting (at most {wait_limit_s():.0f}s) for checkpoint {w.name}'s background write before exiting")
        w.join(wait_limit_s())
        if self.accelerator.is_main_process and w.done and not w.error:
            deadline = time.perf_counter() + max(60.0, 2 * w.background_s)
            checksums = read_markers(w.partial, self.accelerator.num_processes)
            while checksums is None and time.perf_counter() < deadline:
                time.sleep(0.5)
                checksums = read_markers(w.partial, self.accelerator.num_processes)
            if checksums is None:
                log(f"checkpoint {w.name} not published: not every rank's background write finished")
            else:
                remove_markers(w.partial)
                files = {rel: (w.partial / rel).stat().st_size for rel in sorted(checksums)}
                self._commit(w.partial, self.root / w.name, w.step, files, checksums, w.blocking_s + w.background_s)
                log(f"checkpoint {self.root / w.name} published")

    def _saved(self, step: int, final: Path, blocking: float, background: float | None, waited: float = 0.0) -> None:
        """waited: what the save blocked for before staging, for the previous save's background write."""
        timing = {"step": step, "blocking_s": round(blocking, 3),
                  "background_s": None if background is None else round(background, 3), "waited_s": round(waited, 3)}
        self.timings.append(timing)
        self._records.append({"step": step, "checkpoint": str(final), "checkpoint_blocking_s": timing["blocking_s"],
                              "checkpoint_background_s": timing["background_s"],
                              "checkpoint_waited_s": timing["waited_s"]})
        self._lines.append(f"step {step}: checkpoint {final} ({blocking:.2f}s" + (
            ")" if background is None else f" blocking, {background:.2f}s in the background)"))

    def take_saved(self) -> tuple[list[str], list[dict]]:
        """What the loop reports since it last asked: log lines, and metrics.jsonl records (one per
        published checkpoint: its seconds blocking and in the background)."""
        lines, records, self._lines, self._records = self._lines, self._records, [], []
        return lines, records

    def summary(self) -> dict:
        """The summary's account of the saves: seconds blocking the loop, seconds in the background."""
        background = [t["background_s"] for t in self.timings if t["background_s"] is not None]
        return {"checkpoint_saves": len(self.timings), "async_save": self.async_save,
                "checkpoint_blocking_seconds": round(sum(t["blocking_s"] for t in self.timings), 3),
                "checkpoint_waited_seconds": round(sum(t["waited_s"] for t in self.timings), 3),
                "checkpoint_background_seconds": round(sum(background), 3) if background else None}

    def _write(self, state: LoopState, tmp: Path, sync: bool = True) -> None:
        """This rank's part of a checkpoint (rank 0 also writes the loop state, recipe and hf/); sync:
        flushed to disk (not where it stages in host memory: the background writer fsyncs)."""
        acc, optimizer = self.accelerator, self.optimizer
        self.strategy.save_state(acc, tmp, self.recipe.lora)
        save_rng(tmp / RNG_DIR, acc.process_index)
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather shards on rank 0
            import torch

            optimizer.consolidate_state_dict(to=0)
            if acc.is_main_process:
                torch.save(optimizer.state_dict(), tmp / ZERO_REDUNDANCY_OPTIMIZER)
        for name, (tensors, data) in (self.in_flight(state.step) if self.in_flight else {}).items():
            save_in_flight(tmp, name, tensors, data)
        fault_point("during_save", acc.process_index, state.step)
        if acc.is_main_process:
            (tmp / LOOP_STATE).write_text(json.dumps(asdict(state), indent=2) + "\n")
            (tmp / "recipe.json").write_text(json.dumps(self.recipe.to_dict(), indent=2) + "\n")
            if self.model_config is not None:
                self.model_config.save_pretrained(tmp / HF_DIR)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp / HF_DIR)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(tmp / HF_DIR)
        if sync and acc.local_process_index == 0:
            os.sync()

    def _together(self, fn, tmp: Path, step: int) -> None:
        """fn() on this rank, then a collective in place of a barrier: every rank learns whether any rank
        failed, and then all raise the same SaveError (rank 0 first removes the partial directory). A
        rank raising alone would leave the others waiting at the next barrier; DCP's CheckpointException
        is a BaseException, which would pass run.py's handlers and leave the lock behind."""
        from torch.distributed.checkpoint.api import CheckpointException

        error = None
        try:
            fn()
        except (Exception, CheckpointException) as e:
            error = first_failure(e, tmp)
        failed = [(rank, e) for rank, e in enumerate(_all_gather(self.accelerator)(error)) if e is not None]
        if not failed:
            return
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(self.root, step, failed)

    def check_finite(self, step: int) -> None:
        """Collective: refuse to save weights that hold NaN or inf, on any rank. The guard before each
        update (loop.skip_nonfinite) sees the loss and gradient norm only; an update can still turn
        weights non-finite with both finite (adam_eps=0 can: the recipe refuses it, docs/design-notes.md).
        Each rank counts the non-finite values of its
        part of the weights (updated_weights; one pass over them per save) and one all-reduce adds the
        counts up (averages them where every rank holds all the weights)."""
        import torch

        acc = self.accelerator
        count = nonfinite_count(self.optimizer).to(acc.device, torch.float64)
        replicated = self.strategy.replicates_weights  # every rank holds them all
        bad = math.ceil(acc.reduce(count, reduction="mean" if replicated else "sum").item())
        if bad:
            raise NonFiniteWeights(f"step {step}: the weights to be saved hold {bad} NaN/inf value(s), while the "
                                   f"loss and gradient norm were finite; stopped without saving "
                                   f"({after_nonfinite(self.root, self.recipe, step)})")

    def load(self, point) -> LoopState:
        """Collective. Restores model, optimizer, scheduler and RNG in place from a resume.ResumePoint
        (its `source`: the checkpoint, or its universal conversion); returns the loop state."""
        import logging

        import torch

        acc, optimizer = self.accelerator, self.optimizer
        source = point.source

        verify_checksums(point.path, point.manifest, acc.process_index, acc.num_processes,
                         _all_gather(acc), log=logging.getLogger("finetune").warning)
        with safe_loading():
            try:
                self.strategy.load_state(acc, source, self.recipe.lora)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(f"checkpoint {point.path}: {e}; use a checkpoint from a source you "
                                            "trust") from None
        # DeepSpeed's ZeRO-3 universal load gives every parameter group one shared `step` tensor; torch's
        # Adam increments it in place once per group, so bias correction would run ahead. One each:
        for param_state in _innermost(optimizer).state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
        zro = point.path / ZERO_REDUNDANCY_OPTIMIZER
        if hasattr(optimizer, "consolidate_state_dict") and zro.is_file():
            optimizer.load_state_dict(torch.load(zro, map_location="cpu", weights_only=True))
        state = read_loop_state(point.path)
        load_rng(point.path / RNG_DIR, acc.process_index, self.recipe.seed, state.step)
        return state


class NonFiniteWeights(RecipeError):
    """Weights about to be saved hold NaN or inf: said as one line (exit code 2); nothing is written."""


class SaveError(RecipeError):
    """Writing a checkpoint failed on some rank (a full disk, a read-only or vanished filesystem): one
    line naming the rank, the error and the newest complete checkpoint, which is left as it was."""

    def __init__(self, root: Path, step: int, failed: list):
        rank, error = failed[0]
        saved = complete_checkpoints(root)
        kept = (f"the newest complete checkpoint, {saved[-1]}, is intact; continue from it with --resume {saved[-1]} "
                "once there is room (free space, lower keep_last, or move output_dir to a larger filesystem)"
                if saved else "no complete checkpoint had been saved")
        super().__init__(f"saving checkpoint {checkpoint_name(step)} into {root} failed on rank {rank}: {error}; the "
                         f"partial checkpoint was removed and {kept}")


def first_failure(error: BaseException, directory: Path) -> str:
    """One line for an exception of a save: for DCP's CheckpointException (each failed rank's exception
    and traceback, many lines), the first rank's exception; led by "the filesystem is full" when it
    is: ENOSPC, or torch.save's short write ("unexpected pos"), which loses the errno, on a filesystem
    with (almost) nothing left."""
    import errno

    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    try:
        usage = shutil.disk_usage(directory if directory.exists() else directory.parent)
    except OSError:
        return line
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(getattr(e, "errno", None) == errno.ENOSPC for e in chain) or usage.free <= usage.total // 100:
        return f"the filesystem is full ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB; {line})"
    return line


def after_nonfinite(root: Path, recipe, step: int) -> str:
    """What a NaN stop leaves, and what continues from it: commands that run. A resumed run keeps the
    checkpoint's lr and Adam settings (resume.changes refuses another lr), so a lower lr is a new run."""
    saved = complete_checkpoints(root)
    lower = (f"for a lower lr (now {recipe.lr}) start a new run in another output_dir (a resumed run keeps the "
             "checkpoint's lr)")
    if not saved:
        return f"no checkpoint had been saved; {lower}, or check the data of step {step}"
    return (f"the newest checkpoint, {saved[-1]}, is from before it; continue from it with --resume {saved[-1]} "
            f"(with max_grad_norm lower, or max_nonfinite_steps=N to skip such steps), or {lower}, or check the data "
            f"of step {step}")



def _all_gather(acc):
    """gather(obj) -> [obj of rank 0, obj of rank 1, ...]; [obj] without a process group."""
    import torch.distributed as dist

    def gather(obj):
        if not (dist.is_available() and dist.is_initialized()) or acc.num_processes == 1:
            return [obj]
        out = [None] * acc.num_processes
        dist.all_gather_object(out, obj)
        return out

    return gather


def _broadcast(acc, obj):
    """rank 0's obj on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or acc.num_processes == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _innermost(optimizer):
    """Accelerate wraps DeepSpeed's optimizer, which wraps the torch optimizer that holds the groups."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


