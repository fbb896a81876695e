"""How a run is asked to stop: the signals a scheduler or a terminal sends (StopRequest, which the
loop checks between steps), and the front's death (stop_with_front). The faults the crash tests
inject at exact places are finetune/faults.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager

from finetune.lock import release_all


class Interrupted(BaseException):
    """A stop request that came during a call the run can abandon (StopRequest.interrupting): raised out of
    it at once. A BaseException, as KeyboardInterrupt, so that the call's own `except Exception` (a reward
    function's, or the scoring's around it) does not take it for a failure."""


class StopRequest:
    """SIGTERM / SIGUSR1 (what schedulers send before preemption) and SIGINT (Ctrl-C) ask for a
    checkpoint and a clean exit; the loop checks `requested` between steps, agreed across ranks.

    A second Ctrl-C stops at once, without saving (the newest complete checkpoint stays). Run
    directly, the process gets both SIGINTs. Under accelerate launch (torchrun) the workers run in
    their own sessions: the launcher forwards the first Ctrl-C as SIGINT and answers a second one
    by sending SIGTERM, so a SIGTERM after a SIGINT is the second Ctrl-C (a third one ends the
    launcher, and the kernel then kills the workers: run.py sets PR_SET_PDEATHSIG). One keypress
    can also reach a worker twice within milliseconds (srun signals the launchers and the workers
    of a job step alike), so a SIGINT within REPEAT_S of the first is the same one.
    """

    REPEAT_S = 1.0

    def __init__(self):
        self.requested = 0
        self._interrupted_at = None
        self._interrupting = False
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self._interrupted_at is not None and (
                signum == signal.SIGTERM or (signum == signal.SIGINT and now - self._interrupted_at >= self.REPEAT_S)):
            _say("error: interrupted twice: stopped at once, without a checkpoint of this step (the newest complete "
                 "checkpoint is kept; continue from it with --resume auto)")
            release_all()
            os._exit(130)
        if signum == signal.SIGINT and self._interrupted_at is None:
            self._interrupted_at = now
            if not self.requested:
                _say("interrupted: stopping with a checkpoint within a step (Ctrl-C again to stop at once, "
                     "without saving)")
        self.requested = self.requested or signum
        if self._interrupting:
            self._interrupting = False
            raise Interrupted()

    @contextmanager
    def interrupting(self):
        """Within it, a stop request (one made before, or one that comes) raises Interrupted at once, out of
        whatever runs: for a call whose result the run can drop and which may never return by itself (a
        reward function that hangs: GRPO's rollout drops the step and saves the one before)."""
        if self.requested:
            raise Interrupted()
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False


def stop_with_front() -> None:
    """In the process the `finetune` front starts (its launcher, or the one run): SIGTERM, which saves a
    checkpoint and stops, when the front dies (the kernel's PR_SET_PDEATHSIG), instead of training on
    orphaned. The front's pid comes in FINETUNE_FRONT_PID, taken out of the environment here so that the
    workers a launcher starts do not see it (they die with their launcher: run.py)."""
    front = os.environ.pop("FINETUNE_FRONT_PID", None)
    if not front or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(front):  # the front was gone before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _say(line: str) -> None:
    """One line on stderr from rank 0, safe inside a signal handler (print could re-enter a print
    the signal interrupted)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, (line + "\n").encode())
