"""bench/studies/dpo_vs_trl.py's pure parts: the generated pairs, the per-step comparison and TRL's pair layout.
No launches, no TRL; the metric values below are made up to exercise the comparison."""

from bench.studies import dpo_vs_trl as B


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


def test_section_renders_every_part():
    """The report section from a synthetic result (made-up numbers): every part, a failed loss, kept rows."""
    trl = [{m: 0.5 for m in B.METRICS} | {"logps/chosen": -120.0, "logps/rejected": -130.0}] * 2
    ok = {"ok": True, "steps_ours": 2, "steps_trl": 2, "diffs": B.differences(trl, trl), "ours": trl, "pairs": 64,
          "pairs_trl": 64, "same_tokens": 64, "match": True}
    side = {"ok": True, "other_load": 0.1, "seconds_per_step": 2.0, "engine": "DeepSpeedEngine",
            "reference": "DeepSpeedEngine"}
    row = {"round": 0, "noisy": False, "ours": side, "trl": dict(side, seconds_per_step=3.0), "trl_over_ours": 1.5,
           "uptime_before": "up 1:00, load average: 0.50, 0.40, 0.30", "worst_scaled_diff": 3e-7,
           "worst_metric": "rewards/chosen", "loss_max_abs_diff": 2e-7}
    results = {"command": "python bench/studies/dpo_vs_trl.py", "git": "abc1234", "started": "2026-01-01 10:00 UTC",
               "minutes": 12.0, "machine": {"cpu": "CPU", "cores": 2}, "versions": {"trl": "1.16.0"},
               "kept": ["the timing rows of 2026-01-01 09:00 UTC"],
               "compare": {"steps": 2, "losses": {"sigmoid": ok, "ipo": {"ok": False, "error": "ours: boom"}}},
               "tokens": {"mistral-v3": {"pairs": 21, "same": 20, "differ": [
                   {"pair": 19, "side": "rejected", "ours": ["ma", "<|end_of_text|>"], "trl": ["▁Par", "ma"]}]}},
               "timing": {"model": "m", "steps": 13, "warmup": 3,
                          "strategies": {"zero3": [dict(row, started="2026-01-01 09:00 UTC"), row]}}}
    text = B.section(results)
    assert "ipo: failed: ours: boom" in text and "64 of 64" in text and "20 of 21" in text
    assert "finetune trains ma <\\|end_of_text\\|>, TRL ▁Par ma" in text and "Kept from an earlier run" in text
    timing = [line for line in text.splitlines() if line.startswith("| zero3")]
    assert len(timing) == 2 and "09:00 UTC, round 0" in timing[0] and "10:00 UTC, round 0" in timing[1]
    assert "1.50x" in timing[1] and "rewards/chosen 3.0e-07" in timing[1] and "2.0e-07" in timing[1]
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line.count("|") - line.count("\\|"))
        elif block:
            tables, block = tables + [block], []
    assert len(tables) == 3 and all(len(set(t)) == 1 for t in tables)  # no stray "|" splits a cell


def test_ipo_lengths_differ_from_trls_only_where_the_answer_starts_the_sequence():
    """Issue 34: tekken (no BOS), an empty prompt, ipo: the same tokens, the loss 3.3 apart. TRL 1.16's ipo
    divides a side's summed log-ratio by completion_mask.sum(), unshifted: where the answer starts the
    sequence it counts the first token, which follows nothing and has no log-prob. Ours divides by the
    tokens summed. With a prompt (or a BOS) the two agree."""
    empty = B.trl_sides({"prompt_ids": [], "chosen_ids": [7, 8, 2], "rejected_ids": [9, 2]})
    for side, n in (("chosen", 3), ("rejected", 2)):
        mask = empty[side][1]
        assert B.scored(mask) == n - 1 and B.trl_ipo_length(mask) == n and B.first_token_counted(mask)
    prompted = B.trl_sides({"prompt_ids": [1], "chosen_ids": [7, 8, 2], "rejected_ids": [9, 2]})
    assert all(B.scored(m) == B.trl_ipo_length(m) and not B.first_token_counted(m) for _, m in prompted.values())
    # the tokens part passes on that difference, and on no other
    same = {"pairs": 2, "ours": 2, "trl": 2, "same": 2, "differ": []}
    counted = {"pair": 0, "side": "chosen", "ours": 2, "trl": 3, "first_token": True}
    assert B.tokens_match({"tekken": dict(same, ipo_lengths=[counted])})
    assert not B.tokens_match({"tekken": dict(same, ipo_lengths=[dict(counted, first_token=False)])})
    assert not B.tokens_match({"chats": dict(same, same=1, ipo_lengths=[])})
    text = B.section({"command": "c", "git": "g", "started": "2026-01-01 10:00 UTC", "minutes": 1.0,
                      "machine": {"cpu": "CPU", "cores": 2}, "versions": {},
                      "tokens": {"tekken, empty prompts": dict(same, ipo_lengths=[counted])}})
    assert "| 2 of 2 " in text and "1 (e.g. pair 0 chosen: 2 / 3)" in text and B.IPO_LENGTH_NOTE in text


def test_our_ipo_averages_over_the_tokens_it_sums_on_tekken_with_an_empty_prompt(tmp_path):
    """Our side of that difference, on the real tekken tokenizer: a pair with an empty prompt starts with
    its answer (tekken adds no BOS); sequence_logps sums that side's scored tokens (the first has no
    log-prob) and counts the same number, the length ipo divides by."""
    import torch
    import transformers

    import family_assets as FA
    from finetune import data as D
    from finetune.loss import sequence_logps

    tok = FA.tekken_tokenizer(tmp_path / "tekken")
    pair = D.encode_pair({"prompt": "", "chosen": " zulu tango", "rejected": " alpha"}, tok, 64)
    masks = [[int(x != D.IGNORE) for x in pair[f"{s}_labels"]] for s in ("chosen", "rejected")]
    assert all(m[0] == 1 for m in masks), "the answer starts the sequence"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    batch = D.collate_pairs([pair], tok.eos_token_id)
    with torch.no_grad():
        sums, counts = sequence_logps(model, batch, "full")
        logps = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), -1)
    for k, (side, mask) in enumerate(zip(("chosen", "rejected"), masks)):
        ids = pair[f"{side}_input_ids"]
        by_hand = sum(logps[k, t - 1, ids[t]].item() for t in range(1, len(ids)) if mask[t])
        assert abs(sums[k].item() - by_hand) < 1e-4
        assert counts[k].item() == B.scored(mask) == B.trl_ipo_length(mask) - 1
