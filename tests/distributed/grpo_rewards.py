"""Reward functions for tests/distributed/test_grpo.py, named on the command line as grpo_rewards:NAME
(the launches put this folder on PYTHONPATH)."""

import os

CALLS = {"n": 0}


def broken(completions, **kwargs):
    """Scores like a reward function for two steps, then raises on rank 1 only: the other rank is then
    waiting for it in a collective."""
    CALLS["n"] += 1
    if CALLS["n"] >= 3 and os.environ.get("RANK", "0") == "1":
        raise ZeroDivisionError("division by zero")
    return [float(len(c)) for c in completions]
