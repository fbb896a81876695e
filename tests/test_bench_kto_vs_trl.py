"""bench/studies/kto_vs_trl.py's pure parts: our run given TRL's row order (TRL reads tiny_kto's rows in file
order; our schedule reads the rearranged file in that same order, on 1 process and on 2), the recipe both sides
get, the KL's tolerance relative to the log-prob sums, the bit-for-bit 2 = 1 check and the report. No launches,
no TRL; the metric values below are made up to exercise the comparison."""

import pytest
import torch

from bench.studies import kto_vs_trl as B
from finetune.data import BatchSchedule


def test_the_rows_are_tiny_kto_s_in_file_order():
    rows = B.rows()
    assert len(rows) == 4000 and all(set(r) == {"prompt", "completion", "label"} for r in rows)
    assert {r["label"] for r in rows} == {True, False}


@pytest.mark.parametrize("processes", [1, 2])
def test_our_schedule_reads_the_rearranged_rows_in_trl_s_order(processes):
    """TRL's sampler is sequential and accelerate deals batch k to rank k mod world: at step s rank p reads
    rows [(s world + p) m, ...) of the file. Ours reads ours_order's file through BatchSchedule: the same rows
    in the same order, every micro-batch of the epoch."""
    given = [{"i": i} for i in range(200)]
    ours = B.ours_order(given)
    assert sorted(r["i"] for r in ours) == list(range(200)) and ours != given
    schedule = BatchSchedule(len(ours), B.MICRO, 1, processes, B.SEED)
    for step in range(schedule.steps_per_epoch):
        for rank in range(processes):
            (micro,) = schedule.rows(step, rank)
            start = (step * processes + rank) * B.MICRO
            assert [ours[j]["i"] for j in micro] == list(range(start, start + B.MICRO))
    one = BatchSchedule(len(ours), B.MICRO, processes, 1, B.SEED)  # 1 process accumulating them: the same batches
    assert all(one.rows(s, 0) == [m for p in range(processes) for m in schedule.rows(s, p)] for s in range(5))


def test_both_sides_get_one_micro_batch_of_16_per_process_and_step():
    over = B.overrides("m", "d.jsonl", 5, B.SETTINGS["beta0.3_weights"][0])
    assert "grad_accum=1" in over and "micro_batch_size=16" in over and "objective=kto" in over
    assert "kto_beta=0.3" in over and "eval_fraction=0" in over and B.SETTINGS["default"] == ([], 1)
    assert "grad_accum=2" in B.overrides("m", "d.jsonl", 5, [], grad_accum=2)
    assert B.SETTINGS["two_processes"][1] == 2 and B.SETTINGS["precompute_reference"][0] == [
        "precompute_reference=true"]


def test_kl_is_held_relative_to_the_log_prob_sums():
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -115.0, "logps/rejected": -112.0}] * 2
    ours = [dict(r) for r in trl]
    ours[1]["kl"] += 1.3e-5  # 1.1e-7 of the sums: a few fp32 ulps of them
    from bench.studies.dpo_vs_trl import differences

    d = B.kl_relative(differences(ours, trl, B.METRICS), ours, trl)
    assert d["kl"]["within"] and not differences(ours, trl, B.METRICS)["kl"]["within"]
    ours[1]["kl"] += 2e-3
    assert not B.kl_relative(differences(ours, trl, B.METRICS), ours, trl)["kl"]["within"]


def test_two_equals_one_is_bit_for_bit(tmp_path):
    from safetensors.torch import save_file

    records = [{m: 0.25 for m in B.METRICS} | {"grad_norm": 0.5, "tokens_per_s": 10.0}]
    runs = []
    for name, weight, timing in (("a", 1.0, 10.0), ("b", 1.0, 99.0), ("c", 1.0 + 2 ** -23, 10.0)):
        (tmp_path / name / "final").mkdir(parents=True)
        save_file({"w": torch.tensor([weight, 2.0])}, str(tmp_path / name / "final" / "model.safetensors"))
        runs.append({"output_dir": str(tmp_path / name), "records": [r | {"tokens_per_s": timing} for r in records]})
    assert B.same_run(runs[0], runs[1])["equal"], "timings are not compared"
    assert B.same_run(runs[0], runs[2]) == {"metrics": True, "weights": False, "equal": False}
    runs[1]["records"] = [records[0] | {"kl": 0.25 + 2 ** -25}]
    assert not B.same_run(runs[0], runs[1])["metrics"]


def test_section_renders_each_setting():
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -115.0, "logps/rejected": -112.0}] * 2
    from bench.studies.dpo_vs_trl import differences

    ok = {"ok": True, "match": True, "processes": 1, "diffs": differences(trl, trl, B.METRICS),
          "weights": {"max_abs_diff": 4.9e-6}}
    two = ok | {"processes": 2, "two_equals_one": {"equal": True}}
    results = {"command": "python bench/studies/kto_vs_trl.py", "git": "abc1234", "started": "2026-01-01 10:00 UTC",
               "minutes": 2.0, "versions": {"trl": "1.16.0"},
               "compare": {"steps": 2, "micro_batch_size": 16, "settings": {
                   "default": ok, "two_processes": two, "apo_zero_unpaired": {"ok": False, "processes": 1,
                                                                             "error": "ours: boom"}}}}
    text = B.section(results)
    assert "| default" in text and "4.9e-06" in text and "failed: ours: boom" in text and "bit for bit" in text
    assert "16 rows per process" in text
