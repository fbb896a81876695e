"""Reward functions for tests/distributed/test_grpo.py, named on the command line as grpo_rewards:NAME
(the launches put this folder on PYTHONPATH)."""

import os

CALLS = {"n": 0}


def broken(completions, **kwargs):
    """Scores like a reward function for two rollouts, then raises on rank 1 only: the other rank is then
    waiting for it in a collective. (The first call is the check before the model loads.)"""
    CALLS["n"] += 1
    if CALLS["n"] >= 4 and os.environ.get("RANK", "0") == "1":
        raise ZeroDivisionError("division by zero")
    return [float(len(c)) for c in completions]


SCORER = {}


def reward_model(prompts, completions, **kwargs):
    """A sequence-classification model directory as a reward function: finetune.rewards.RewardModel on
    the directory named by GRPO_REWARD_MODEL, loaded once per process."""
    from finetune.rewards import RewardModel

    if "model" not in SCORER:
        SCORER["model"] = RewardModel(os.environ["GRPO_REWARD_MODEL"])
    return SCORER["model"](prompts, completions)


def hangs(completions, **kwargs):
    """Scores for two steps, then never returns (a reward function stuck on a network call): before it
    blocks, it writes hanging.RANK into GRPO_HANG_DIR, so that a test knows when to signal."""
    CALLS["n"] += 1
    if CALLS["n"] >= 3:
        import time
        from pathlib import Path

        Path(os.environ["GRPO_HANG_DIR"], f"hanging.{os.environ.get('RANK', '0')}").touch()
        while True:
            time.sleep(3600)
    return [float(len(c)) for c in completions]


def unscored(completions, **kwargs):
    """Scores no completion (None for each): a step with no learning signal."""
    return [None] * len(completions)


def _scorer():
    from finetune.rewards import RewardModel

    return RewardModel(os.environ.get("GRPO_REWARD_MODEL", "GRPO_REWARD_MODEL is not set"), name="scorer")


# A RewardModel itself as a reward function (reward_funcs=grpo_rewards:scorer): GRPO checks it (check)
# before the policy loads, then loads it on its first call.
scorer = _scorer()


def half_equal(completions, answer, **kwargs):
    """answer_chars where the answer's first letter is odd (a, c, e, ...), 0.0 for every completion where it
    is even: about half the groups have equal rewards (dynamic sampling drops them)."""
    from finetune.rewards import answer_chars

    dense = answer_chars(completions, answer)
    return [d if ord(str(a)[0]) % 2 else 0.0 for d, a in zip(dense, answer)]
