"""The faults the crash tests inject at exact places (tests/distributed/test_checkpoint.py and others):
a signal, an exception, a full disk or a NaN in the weights, on one rank at one step. The loop calls
fault_point after each step, checkpoint.py where a save can be cut short, export.py in the final write."""

from __future__ import annotations

import os
import signal

from finetune.optim import updated_weights


def fault_point(where: str, rank: int, step: int, optimizer=None) -> None:
    """Fault injection for the crash tests, real signals at exact places:
    FINETUNE_FAULT=where:rank:step[:SIGNAME] sends SIGNAME (default SIGKILL) to that rank there;
    SIGNAME=RAISE raises an exception instead (an unexpected failure on one rank), ENOSPC the OSError of
    a full disk; NAN writes a NaN
    into the first value of that rank's shard of what the optimizer updates (an update gone wrong);
    SLEEP<seconds> waits there (a slow disk, so that a background checkpoint write is still in flight
    at a later fault); JOBKILL SIGKILLs the launcher, then this process: the whole job at once (the other
    workers die with their parent, finetune.commands.train's PR_SET_PDEATHSIG). Several faults: separated
    by commas."""
    for spec in filter(None, os.environ.get("FINETUNE_FAULT", "").split(",")):
        _fault(spec, where, rank, step, optimizer)


def _fault(spec: str, where: str, rank: int, step: int, optimizer) -> None:
    parts = spec.split(":")
    if parts[:3] == [where, str(rank), str(step)]:
        how = parts[3] if len(parts) > 3 else "SIGKILL"
        if how == "RAISE":
            raise RuntimeError(f"injected fault ({spec})")
        if how == "ENOSPC":  # a disk that fills up there
            import errno

            raise OSError(errno.ENOSPC, f"No space left on device (injected fault {spec})")
        if how.startswith("SLEEP"):
            import time

            time.sleep(float(how[len("SLEEP"):]))
            return
        if how == "JOBKILL":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "NAN" and optimizer is not None:
            import torch

            with torch.no_grad():
                next(w for w in updated_weights(optimizer) if w.numel()).view(-1)[0] = float("nan")
            return
        os.kill(os.getpid(), getattr(signal, how))


def injected(where: str, rank: int, step: int) -> str | None:
    """The fault FINETUNE_FAULT names for this place, rank and step (its SIGNAME part, SIGKILL when left
    out), or None: for faults the caller acts out itself (vllm_push:RANK:STEP:SKIP, a weight push that
    gathers but does not reach the engine)."""
    parts = os.environ.get("FINETUNE_FAULT", "").split(":")
    if parts[:3] == [where, str(rank), str(step)]:
        return parts[3] if len(parts) > 3 else "SIGKILL"
    return None
