"""bench/studies/kto_vs_trl.py's pure parts: the unpaired rows, the recipe both sides get, the KL's tolerance
relative to the log-prob sums and the report. No launches, no TRL; the metric values below are made up to
exercise the comparison."""

from bench.studies import kto_vs_trl as B


def test_rows_alternate_labels_and_neighbours_have_other_prompts():
    rows = B.rows()
    assert len(rows) == 64 and rows == B.rows()
    assert [r["label"] for r in rows[:4]] == [True, False, True, False]
    assert all(set(r) == {"prompt", "completion", "label"} for r in rows)
    assert all(a["prompt"] != b["prompt"] for a, b in zip(rows, rows[1:]))  # a KL row pairs unrelated rows


def test_one_micro_batch_per_step_where_trls_kl_is_ours():
    over = B.overrides("m", "d.jsonl", 5, B.SETTINGS["beta0.3_weights"])
    assert "grad_accum=1" in over and "micro_batch_size=8" in over and "objective=kto" in over
    assert "kto_beta=0.3" in over and B.SETTINGS["default"] == []


def test_kl_is_held_relative_to_the_log_prob_sums():
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -115.0, "logps/rejected": -112.0}] * 2
    ours = [dict(r) for r in trl]
    ours[1]["kl"] += 1.3e-5  # 1.1e-7 of the sums: a few fp32 ulps of them
    from bench.studies.dpo_vs_trl import differences

    d = B.kl_relative(differences(ours, trl, B.METRICS), ours, trl)
    assert d["kl"]["within"] and not differences(ours, trl, B.METRICS)["kl"]["within"]
    ours[1]["kl"] += 2e-3
    assert not B.kl_relative(differences(ours, trl, B.METRICS), ours, trl)["kl"]["within"]


def test_section_renders_each_setting():
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -115.0, "logps/rejected": -112.0}] * 2
    from bench.studies.dpo_vs_trl import differences

    ok = {"ok": True, "match": True, "diffs": differences(trl, trl, B.METRICS), "weights": {"max_abs_diff": 4.9e-6}}
    results = {"command": "python bench/studies/kto_vs_trl.py", "git": "abc1234", "started": "2026-01-01 10:00 UTC",
               "minutes": 2.0, "versions": {"trl": "1.16.0"},
               "compare": {"steps": 2, "settings": {"default": ok, "apo_zero_unpaired": {"ok": False,
                                                                                         "error": "ours: boom"}}}}
    text = B.section(results)
    assert "| default" in text and "4.9e-06" in text and "failed: ours: boom" in text
