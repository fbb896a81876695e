"""padding_free=true launched for real (2 processes, FSDP2 over gloo): the same rows per micro-batch as the
padded run of the suite (test_strategies' fsdp launch, shared), so the same loss at every step and the same
eval loss, in fp32 within float noise; one launch added to the suite."""

from __future__ import annotations

import math

# One row of concatenated examples against padded rows: the same sums in another order (attention over
# other lengths, chunked loss over other chunks), ~1e-7 relative in fp32.
RTOL = 1e-5


def test_padding_free_has_the_padded_loss_curve(launch, strategy_run):
    padded = strategy_run("fsdp")
    free = launch(2, "strategy=fsdp", "padding_free=true")
    assert "padding-free: one row per micro-batch" in free.stderr
    assert [r["step"] for r in free.train_records] == list(range(1, 13))
    assert [r["tokens"] for r in free.train_records] == [r["tokens"] for r in padded.train_records]
    worst = max(abs(got - want) / want for got, want in zip(free.losses, padded.losses, strict=True))
    print(f"padding-free against padded: largest relative difference of a step's loss {worst:.1e}")
    assert worst <= RTOL, (free.losses, padded.losses)
    got = [(r["step"], r["eval_loss"]) for r in free.eval_records]
    want = [(r["step"], r["eval_loss"]) for r in padded.eval_records]
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 6, 12]
    for (_, a), (_, b) in zip(got, want):
        assert math.isclose(a, b, rel_tol=RTOL)
    assert padded.losses[-1] < padded.losses[0]
