"""metrics.Throughput: tokens/s over the window since the last record, with eval and checkpoint time
left out of it and of the summary; a resumed run counts only the tokens it trained itself."""

import time

import torch

from finetune.training.metrics import Throughput


def test_paused_time_is_left_out_of_speed():
    t0 = time.perf_counter()
    meter = Throughput(torch.device("cpu"), "no", None, 128, world=2, tokens_at_start=1000)
    meter.step(500, 600)
    time.sleep(0.2)
    with meter.paused("eval") as ev:
        time.sleep(0.4)
    window = meter.window()
    training = time.perf_counter() - t0 - ev.seconds  # what the window must divide by
    assert ev.seconds >= 0.4 and "mfu" not in window  # no known peak on CPU
    assert 500 / training <= window["tokens_per_s"] < 1.2 * 500 / training
    with meter.paused("checkpoint"):
        time.sleep(0.1)
    summary = meter.summary(tokens=1500)
    assert summary["eval_seconds"] >= 0.4 and summary["checkpoint_seconds"] >= 0.1
    assert summary["train_seconds"] >= summary["eval_seconds"] + summary["checkpoint_seconds"]
    stepping = summary["train_seconds"] - summary["eval_seconds"] - summary["checkpoint_seconds"]
    assert abs(summary["tokens_per_s"] - 500 / max(stepping, 1e-9)) / summary["tokens_per_s"] < 0.2


class FakeClock:
    """A clock the test moves by hand: Throughput's figures are then exact."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_steady_skip_leaves_out_the_first_steps():
    from finetune.training.metrics import steady_skip

    assert [steady_skip(n) for n in (0, 1, 2, 3, 5, 19, 20, 30, 10_000)] == [None, None, 1, 1, 2, 9, 10, 10, 10]


def test_steady_rate_is_tokens_over_seconds_between_two_marks():
    from finetune.training.metrics import steady_rate

    assert steady_rate((2.0, 100), (6.0, 500)) == 100.0
    assert steady_rate(None, (6.0, 500)) is None and steady_rate((2.0, 100), None) is None
    assert steady_rate((2.0, 100), (2.0, 100)) is None  # no time between them: no figure, not a division by 0


def test_steady_figure_leaves_out_warm_up_and_pauses():
    """30 steps of 1,000 tokens: the first two (compile) take 10 s each, the rest 0.5 s, and an eval of
    7 s and a checkpoint of 3 s fall in the steady part. tokens_per_s counts every step (30,000 tokens
    over 34 s of stepping); tokens_per_s_steady steps 11-30 (20,000 tokens over 10 s)."""
    clock = FakeClock()
    meter = Throughput(torch.device("cpu"), "no", None, 128, world=1, tokens_at_start=0, steps=30, clock=clock)
    for step in range(1, 31):
        clock.now += 10.0 if step <= 2 else 0.5
        meter.step(1000, 1000)
        if step == 15:
            with meter.paused("eval"):
                clock.now += 7.0
        if step == 30:
            with meter.paused("checkpoint"):
                clock.now += 3.0
    summary = meter.summary(tokens=30_000)
    assert summary["train_seconds"] == 44.0 and summary["eval_seconds"] == 7.0
    assert summary["tokens_per_s"] == 30_000 / 34.0
    assert summary["tokens_per_s_steady"] == 20_000 / 10.0
    assert summary["steady_steps"] == [11, 30]


def test_steady_figure_of_a_resumed_run_and_of_a_short_one():
    """A run resumed at step 100 of 110 times its own 10 steps (after the first 5), numbered as the run
    numbers them; a 1-step run, or one stopped before its warm-up ended, has no steady figure."""
    clock = FakeClock()
    meter = Throughput(torch.device("cpu"), "no", None, 128, world=1, tokens_at_start=50_000, steps=10,
                       first_step=100, clock=clock)
    for step in range(10):
        clock.now += 4.0 if step == 0 else 1.0
        meter.step(200 + step, 0)
    summary = meter.summary(tokens=50_000 + sum(200 + s for s in range(10)))
    assert summary["steady_steps"] == [106, 110]
    assert summary["tokens_per_s_steady"] == sum(200 + s for s in range(5, 10)) / 5.0
    for steps, taken in ((1, 1), (30, 10)):
        meter = Throughput(torch.device("cpu"), "no", None, 128, world=1, tokens_at_start=0, steps=steps, clock=clock)
        for _ in range(taken):
            clock.now += 1.0
            meter.step(10, 10)
        summary = meter.summary(tokens=10 * taken)
        assert summary["tokens_per_s_steady"] is None and summary["steady_steps"] is None
        assert summary["tokens_per_s"] == 10.0


def test_summary_line_shows_the_steady_figure_first():
    from finetune.training.metrics import format_summary

    base = {"steps": 30, "train_seconds": 44.0, "wall_seconds": 50.0, "tokens": 30_000, "tokens_per_s": 882.35}
    line = next(ln for ln in format_summary({**base, "tokens_per_s_steady": 2000.0, "steady_steps": [11, 30]})
                .splitlines() if ln.split()[:1] == ["tokens"])
    assert line.split(None, 1)[1] == ("30,000 target tokens, 2,000 tokens/s steady (steps 11-30), 882 tokens/s "
                                      "over every step (warm-up included)")
    line = next(ln for ln in format_summary({**base, "tokens_per_s_steady": None, "steady_steps": None})
                .splitlines() if ln.split()[:1] == ["tokens"])
    assert line.split(None, 1)[1] == "30,000 target tokens, 882 tokens/s while training"


def test_a_resumed_runs_summary_says_its_times_and_saves_are_since_the_resume():
    """A resumed launch's summary counts its own saves and seconds (the Checkpointer and the meter start
    with the launch): the run summary says so, and how many saves, instead of reading as the whole run's."""
    from finetune.training.metrics import format_summary

    base = {"steps": 12, "train_seconds": 4.0, "wall_seconds": 9.0, "tokens": 3_000, "tokens_per_s": 900.0,
            "checkpoints": "runs/x/checkpoints (step_000000010, step_000000012)", "async_save": True,
            "checkpoint_saves": 2, "checkpoint_blocking_seconds": 0.12, "checkpoint_background_seconds": 0.3}

    def rows(summary):
        return {ln.split()[0]: " ".join(ln.split()[1:]) for ln in format_summary(summary).splitlines()[2:-1]}

    resumed = rows({**base, "resumed_at": 5})
    assert resumed["steps"] == "12 (resumed at 5)"
    assert resumed["time"].startswith("4.0 s training since the resume (of which eval")
    assert resumed["checkpoints"].endswith("; async_save since the resume: 2 save(s), 0.12 s blocking, 0.30 s in "
                                           "the background")
    whole = rows(base)
    assert whole["time"].startswith("4.0 s training (of which eval")
    assert whole["checkpoints"].endswith("; async_save: 2 save(s), 0.12 s blocking, 0.30 s in the background")
