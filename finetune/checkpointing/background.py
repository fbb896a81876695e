"""What `async_save=true` adds to a save (checkpoint.Checkpointer drives it; the loop never sees it).

Staging: each rank runs exactly the code of a synchronous save (the strategy's save_state, the RNG
state, the loop state, hf/) with its destination a directory of its own in host memory, a tmpfs
(`/dev/shm` unless FINETUNE_STAGING_DIR names another), and with its serialisations deferred
(snapshot.py): the tensors each file would hold are copied into host memory, and that copy is all the
loop waits for. Small files (JSON, hf/, DeepSpeed's `latest`) are written into the staging directory
then and there. One approach for every strategy (ddp, the ZeroRedundancyOptimizer, zero1-3 with or
without offload, fsdp, LoRA): the files are the very bytes a synchronous save writes, because the
same code makes them.

The background write: a thread per rank runs the deferred serialisations one at a time: DCP saves
first (their collectives run on a gloo group of their own, in the same order on every rank), into
the staging directory, each file then copied into the checkpoint's shared `.step_N.partial/`
directory (fsync'd, hashed as it goes: xxh3-128, the manifest's checksum) and removed from the
staging; torch.save and safetensors files straight into the partial directory, then read back for
their checksum and fsync'd; then the small files, copied as the DCP files are. It takes part in no collective of the
training's process group: the ranks agree that every write finished (or that one failed) on the main
thread, at the next step boundary, the next save, or the end of the run (Checkpointer.poll / wait),
and only then does rank 0 write the manifest and rename `.partial` into place. A write that fails is
one line on every rank at that boundary.

A rank's write also leaves `.written.rank_<i>.json` (its checksums) in the partial directory: on
the way out after an error, when the ranks cannot agree through a collective, rank 0 publishes only
if every rank's marker is there (finish_without_collectives). The markers are removed before the
manifest lists the files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from finetune.faults import fault_point
from finetune.checkpointing.manifest import BLOCK, file_xxh3

MARKER = ".written.rank_{rank}.json"


def staged_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


@dataclass
class BackgroundWrite:
    """One rank's background write of one checkpoint: staged -> partial, on a thread."""

    step: int
    name: str
    rank: int
    staged: Path  # this rank's staging directory (tmpfs)
    partial: Path  # the checkpoint's shared .partial directory
    blocking_s: float  # what the save blocked the loop for (staging)
    waited_s: float = 0.0  # what it blocked before staging, for the previous save's background write
    nbytes: int = 0
    error: str | None = None
    checksums: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    thread: threading.Thread | None = None
    # the one line an exception of the write becomes (checkpoint.first_failure: "the filesystem is full")
    describe: object = lambda error, directory: f"{type(error).__name__}: {error}"
    jobs: list = field(default_factory=list)  # snapshot.Deferred: the serialisations left to the thread

    def start(self) -> None:
        self.nbytes = staged_bytes(self.staged) + sum(job.nbytes for job in self.jobs)
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-{self.name}", daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    @property
    def background_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def join(self, timeout: float | None) -> bool:
        self.thread.join(timeout)
        return self.done

    def _run(self) -> None:
        lower_this_threads_priority()
        try:
            fault_point("async_before_shard", self.rank, self.step)
            # async_mid_shard tears the largest file: of the largest deferred serialisation, if any
            largest_job = max((job for job in self.jobs if job.cuttable), key=lambda job: job.nbytes, default=None)
            while self.jobs:
                job = self.jobs.pop(0)
                cut = job is largest_job
                if job.direct:  # straight into the checkpoint, then read back for its checksum
                    rel = str(job.path.relative_to(os.path.abspath(self.staged)))
                    target = self.partial / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    job.write(target, (lambda: fault_point("async_mid_shard", self.rank, self.step)) if cut else None)
                    self.checksums[rel] = file_xxh3(target, fsync=True)
                else:  # into the staging directory, then copied
                    before = set(self._files())
                    job.write(job.path, None)
                    self._copy(sorted(set(self._files()) - before), cut=cut)
                del job  # its host copy is freed (or back for the next save)
            self._copy(self._files(), cut=largest_job is None)
            fsync_tree(self.partial)
            fault_point("async_before_publish", self.rank, self.step)
            write_json_synced(self.partial / MARKER.format(rank=self.rank), self.checksums)
        except BaseException as e:  # noqa: BLE001 - reported on every rank at the next boundary
            self.error = self.describe(e, self.partial)
        finally:
            self.jobs.clear()
            shutil.rmtree(self.staged, ignore_errors=True)
            self.finished = time.perf_counter()

    def _files(self) -> list[Path]:
        return sorted(p for p in self.staged.rglob("*") if p.is_file())

    def _copy(self, files: list[Path], cut: bool) -> None:
        """Each staged file into the partial directory, hashed, then removed from the staging; cut:
        async_mid_shard fires halfway through the largest of them."""
        largest = max(files, key=lambda p: p.stat().st_size, default=None) if cut else None
        for src in files:
            rel = str(src.relative_to(self.staged))
            self.checksums[rel] = copy_hashed(src, self.partial / rel, self.rank, self.step, cut=src == largest)
            src.unlink()


def copy_hashed(src: Path, dst: Path, rank: int, step: int, cut: bool = False) -> str:
    """Copy src to dst (fsync'd) and return the xxh3-128 of the bytes written. cut: the fault point
    `async_mid_shard` fires once half of this file is written (a crash test's torn shard)."""
    import xxhash

    dst.parent.mkdir(parents=True, exist_ok=True)
    h = xxhash.xxh3_128()
    size = src.stat().st_size
    half = size // 2 if cut else -1
    written = 0
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while True:
            want = BLOCK if half < 0 or written >= half else min(BLOCK, half - written)
            n = fin.readinto(view[:want])
            if not n:
                break
            h.update(view[:n])
            _write_all(fout, view[:n])
            written += n
            if written == half:
                fault_point("async_mid_shard", rank, step)
        os.fsync(fout.fileno())
    return h.hexdigest()


def lower_this_threads_priority(by: int = 10) -> None:
    """The background writer yields the CPU to training where both want it: its thread's nice value
    raised (Linux schedules threads one by one; raising it needs no privilege). Elsewhere, nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


def _write_all(f, view) -> None:
    while len(view):
        n = f.write(view)
        if n is None or n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def fsync_tree(directory: Path) -> None:
    """fsync every directory under `directory` (and it): the files' names are durable too."""
    for d in [directory, *sorted(p for p in directory.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_synced(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_markers(partial: Path, world: int) -> dict | None:
    """Every rank's checksums from its marker, or None while one is missing."""
    checksums = {}
    for rank in range(world):
        try:
            checksums.update(json.loads((partial / MARKER.format(rank=rank)).read_text()))
        except (OSError, ValueError):
            return None
    return checksums


def remove_markers(partial: Path) -> None:
    for p in partial.glob(".written.rank_*.json*"):
        p.unlink(missing_ok=True)
