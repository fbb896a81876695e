"""`python finetune/run.py ARGS` as a call of run.main in the test process, for runs that end before
training (refusals, dry runs): the same checks, messages and exit code, without starting an
interpreter (5-10 s here). Used by tests/test_cli.py and tests/distributed/conftest.py."""

from __future__ import annotations

import contextlib
import io
import signal


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of run.main(argv); its signal handlers are undone after, and a
    run that would start training fails instead (that needs a real launch)."""
    from finetune import run
    from finetune.training import loop

    def no_training(plan):
        # not an Exception: train.main's handler of one would end the process (os._exit) with pytest in it
        raise WouldTrain("run.main in the test process is for runs that stop before training; launch it")

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    train, loop.train = loop.train, no_training
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run.main(argv)
    finally:
        loop.train = train
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, out.getvalue(), err.getvalue()


class WouldTrain(BaseException):
    """run.main went past every check into training, which a call in the test process must not do: the
    test fails with this rather than the test process exiting."""

