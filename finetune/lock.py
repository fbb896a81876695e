"""One run per output_dir: a lock file, and the rule that keeps two runs' checkpoints apart.

Two runs writing into one output_dir interleave metrics.jsonl, delete each other's partial
checkpoints and replace each other's checkpoints of the same step. So rank 0 takes
`output_dir/finetune.lock` before anything is loaded and removes it when the run ends. The lock
is created with O_CREAT|O_EXCL, which is atomic on local and network filesystems (flock is not
honoured across NFS clients), and holds who owns it: host, pid, start time and command.

A lock whose process is gone (SIGKILL, OOM, a machine that rebooted) is stale. On the host that
wrote it, that is checkable (the pid is gone or now belongs to another process), and the lock is
taken over with a line saying so. From another host it is not, so such a lock is never taken
over: the message says where the other run is and how to remove the lock.

Ranks of one launch recognise their own lock by a launch id that the launcher sets alike on every
rank (master address and port, torchelastic run id); only rank 0 writes the lock.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from finetune.recipe import RecipeError

LOCK_NAME = "finetune.lock"
_HELD: list["OutputDirLock"] = []  # this process's locks, for release_all on any way out


class BusyError(RecipeError):
    """output_dir belongs to another run."""


def launch_id(env=os.environ) -> str:
    """The same string on every rank of one launch, different for two launches running at once
    (they cannot share a rendezvous address and port)."""
    if "MASTER_PORT" in env:
        return f"{env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']}:{env.get('TORCHELASTIC_RUN_ID', '')}"
    return f"pid:{os.getpid()}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which tells a reused pid apart."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name


def _exited(pid: int) -> bool:
    """The process has ended but its parent has not reaped it yet (state Z, a zombie, or X): a rank
    SIGKILLed a moment ago, its launcher still winding down, holds its pid for a while (Linux)."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")  # field 3, after the command name


def _machine() -> dict:
    """What makes a pid meaningful: the host, this boot, and the pid namespace (containers)."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


@dataclass
class Holder:
    info: dict

    @property
    def pid(self) -> int:
        return int(self.info.get("pid", -1))

    def same_machine(self) -> bool:
        here = _machine()
        return all(self.info.get(k) == here[k] for k in ("host", "boot_id", "pid_ns"))

    def alive(self) -> bool | None:
        """True/False on the machine that wrote the lock; None (cannot tell) elsewhere. A zombie is gone."""
        if not self.same_machine():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        except (OverflowError, ValueError):
            return False
        if _exited(self.pid):
            return False
        started = self.info.get("proc_start")
        now = _process_start(self.pid)
        return not (started and now and started != now)  # the pid was reused by another process

    def same_job(self, env=os.environ) -> bool:
        """A requeued SLURM job keeps its job id and may land on other nodes; SLURM never runs one job
        twice at once, so a lock of the same job id is an earlier attempt of this one, gone."""
        job = self.info.get("slurm_job")
        return bool(job) and job == env.get("SLURM_JOB_ID")

    def describe(self) -> str:
        i = self.info
        command = f" ({i['command']})" if i.get("command") else ""
        return f"pid {i.get('pid')} on host {i.get('host')}, started {i.get('started')}{command}"


def _holder(path: Path, wait_s: float = 2.0) -> Holder | None:
    """The lock's content; None if the lock vanished. A lock just created may still be empty for a
    moment (create, then write): read again briefly before calling it unreadable."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RecipeError(f"cannot read the lock {path}: {e.strerror}; delete it if no run uses "
                              "output_dir") from None
        try:
            info = json.loads(text)
            if isinstance(info, dict) and "pid" in info:
                return Holder(info)
        except json.JSONDecodeError:
            pass
        if time.monotonic() > deadline:
            return Holder({"pid": -1, "host": "unknown", "started": "unknown", "unreadable": True})
        time.sleep(0.05)


def _busy_message(output_dir: Path, path: Path, holder: Holder) -> str:
    if holder.info.get("unreadable"):
        return (f"output_dir={output_dir} is locked by {path}, which holds no readable owner; if no run uses "
                f"output_dir, delete {path}")
    if holder.alive() is None:
        return (f"output_dir={output_dir} is in use by another run: {holder.describe()}; that host is not this "
                f"one, so whether it still runs cannot be checked from here: wait for it or choose another "
                f"output_dir, and if it is gone, delete {path}")
    return (f"output_dir={output_dir} is in use by another run: {holder.describe()}; wait for it to finish, "
            f"stop it (kill -TERM {holder.pid} saves a checkpoint first), or choose another output_dir")


class OutputDirLock:
    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.info: dict | None = None
        self.created: list[Path] = []  # directories made to hold the lock, removed again if left empty

    def acquire(self, log=print, command: list[str] | None = None, env=os.environ) -> "OutputDirLock":
        """Take the lock or raise BusyError naming the run that holds it; never waits."""
        self._make_dirs()
        info = {"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "command": " ".join(command if command is not None else sys.argv), "launch": launch_id(env),
                "slurm_job": env.get("SLURM_JOB_ID"),
                "proc_start": _process_start(os.getpid()), **_machine()}
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _holder(self.path)
                if holder is None:
                    continue  # released meanwhile
                if holder.alive() is not False and not holder.same_job(env):
                    self._undo_dirs()
                    raise BusyError(_busy_message(self.output_dir, self.path, holder))
                if self._break_stale(holder):
                    log(f"output_dir={self.output_dir}: taking over the lock of a run that is gone "
                        f"({holder.describe()}); its files are kept")
                continue
            except OSError as e:
                self._undo_dirs()
                raise RecipeError(f"output_dir={self.output_dir}: cannot create {self.path}: {e.strerror}; "
                                  "choose a writable output_dir") from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.info = info
            _HELD.append(self)
            return self
        self._undo_dirs()
        raise RecipeError(f"output_dir={self.output_dir}: could not take {self.path}; other runs keep taking it")

    def _break_stale(self, holder: Holder) -> bool:
        """Remove the lock judged stale, if it is still that one. Runs that break the same stale lock at once
        take turns under flock on output_dir (local to this host, where a stale lock is judged; released by
        the kernel if a holder dies): each reads the lock again and removes it only if it is still the stale
        one, so no run removes the fresh lock of a faster one. Only these turns remove a stale lock, and a
        live run removes only its own, so the lock cannot change between that read and the removal."""
        import fcntl

        fd = os.open(self.output_dir, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a filesystem without flock: the read again below still narrows the race
                pass
            current = _holder(self.path, wait_s=0)
            if current is None or current.info != holder.info:
                return False  # gone, or another run's lock now: look again
            self.path.unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)  # releases the flock

    def release(self) -> None:
        """Remove the lock if it is still this run's; idempotent."""
        if self.info is None:
            return
        holder = _holder(self.path, wait_s=0)
        if holder is not None and holder.info == self.info:
            self.path.unlink(missing_ok=True)
        self.info = None
        if self in _HELD:
            _HELD.remove(self)

    def abandon(self) -> None:
        """The run stopped before it wrote anything: leave output_dir as it was found."""
        self.release()
        self._undo_dirs()

    def _make_dirs(self) -> None:
        missing = []
        p = self.output_dir
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.created = missing  # deepest first

    def _undo_dirs(self) -> None:
        for d in self.created:
            try:
                d.rmdir()
            except OSError:
                break
        self.created = []


def release_all(abandon: bool = False) -> None:
    """Release this process's locks (run.py at every exit, StopRequest before an abort).
    abandon: the run wrote nothing, so the directories made for the lock go too."""
    for lock in list(_HELD):
        lock.abandon() if abandon else lock.release()


def release_for(output_dir: Path, pids: set[int]) -> None:
    """Remove the lock of output_dir when one of `pids` held it and is gone: the `finetune` front, after it
    killed the run it launched (a second Ctrl-C or SIGTERM)."""
    path = Path(output_dir) / LOCK_NAME
    try:
        holder = _holder(path, wait_s=0)
    except RecipeError:
        return
    if holder is not None and holder.pid in pids and holder.alive() is False:
        path.unlink(missing_ok=True)


def check_not_busy(output_dir: Path, env=os.environ) -> None:
    """For the ranks that do not take the lock: refuse exactly when rank 0 will, i.e. when the lock
    belongs to another launch whose process is alive on this machine. Anything else (no lock yet,
    our own, stale, written on another host) is rank 0's to decide."""
    path = Path(output_dir) / LOCK_NAME
    holder = _holder(path, wait_s=0) if path.exists() else None
    if holder is None or holder.info.get("launch") == launch_id(env) or holder.info.get("unreadable") \
            or holder.same_job(env):
        return
    if holder.alive():
        raise BusyError(_busy_message(Path(output_dir), path, holder))
