"""metrics.Throughput: tokens/s over the window since the last record, with eval and checkpoint time
left out of it and of the summary; a resumed run counts only the tokens it trained itself."""

import time

import torch

from finetune.metrics import Throughput


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
