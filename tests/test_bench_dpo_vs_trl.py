"""bench/dpo_vs_trl.py's pure parts: the generated pairs, the per-step comparison and TRL's pair layout.
No launches, no TRL; the metric values below are made up to exercise the comparison."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench modules import each other by name

import dpo_vs_trl as B  # noqa: E402


def test_rows_are_explicit_distinct_pairs_of_unequal_lengths():
    rows = B.rows()
    assert len(rows) == 64 and rows == B.rows()  # the same pairs on every call
    assert all(set(r) == {"prompt", "chosen", "rejected"} and r["chosen"] != r["rejected"] for r in rows)
    assert sum(len(r["chosen"]) != len(r["rejected"]) for r in rows) >= 32  # ipo's per-side token counts differ
    assert all(len(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) + 2 < 256 for r in rows)  # no truncation


def test_differences_absolute_for_small_values_relative_for_sums():
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -120.0, "logps/rejected": -130.0} for _ in range(3)]
    ours = [dict(r) for r in trl]
    ours[1]["loss"] += 2e-6
    ours[2]["logps/chosen"] -= 7.6e-4  # 6.3e-6 relative: a few fp32 ulps of a sum near -120 would pass
    d = B.differences(ours, trl)
    assert d["loss"]["step"] == 2 and abs(d["loss"]["max_abs_diff"] - 2e-6) < 1e-9 and d["loss"]["within"]
    assert d["logps/chosen"]["within"] and abs(d["logps/chosen"]["max_scaled_diff"] - 7.6e-4 / 120) < 1e-9
    ours[0]["rewards/margins"] += 2e-5  # above 1e-5 on a value below 1: absolute
    assert not B.differences(ours, trl)["rewards/margins"]["within"]
    del ours[2]["rewards/accuracies"]  # a step that lacks a metric never passes
    assert B.differences(ours, trl)["rewards/accuracies"]["max_abs_diff"] == float("inf")


def test_trl_pair_layout_as_ours():
    sides = B.trl_sides({"prompt_ids": [1, 5, 6], "chosen_ids": [7, 2], "rejected_ids": [8, 9, 2]})
    assert sides == {"chosen": ([1, 5, 6, 7, 2], [0, 0, 0, 1, 1]), "rejected": ([1, 5, 6, 8, 9, 2], [0, 0, 0, 1, 1, 1])}
