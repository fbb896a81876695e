"""bench/studies/grpo_vs_trl.py's pure parts: step times from metrics records, the warm-up median and the report
section. No launches, no TRL; the numbers below are made up to exercise them."""

from bench.studies import grpo_vs_trl as B


def test_step_seconds_from_token_windows():
    records = [{"tokens": 500, "tokens_per_s": 250.0}, {"tokens": 1000, "tokens_per_s": 1000.0}, {"tokens": 1400}]
    seconds = B.ours_step_seconds(records)
    assert seconds[:2] == [2.0, 0.5] and seconds[2] != seconds[2]  # no rate: NaN, left out of the median


def test_median_leaves_out_warmup_and_nan():
    assert B.median_after_warmup([9.0, 9.0, 1.0, float("nan"), 3.0]) == 2.0
    assert B.median_after_warmup([9.0, 9.0]) is None


def side(seconds, tokens, ok=True, error=None, **extra):
    return {"ok": ok, "command": "accelerate launch ...", "other_load": 0.5, "seconds_per_step": seconds,
            "tokens_per_step": tokens, "error": error, **extra}


def test_section_renders_rows_what_if_and_failure():
    results = {
        "command": "python bench/studies/grpo_vs_trl.py --nogc", "git": "abc1234", "finetune": "/tree",
        "finetune_git": "def5678 grpo", "started": "2026-11-26 12:00 UTC", "minutes": 4.0,
        "machine": {"cpu": "CPU", "cores": 2}, "versions": {"torch": "2.13", "trl": "1.16.0"},
        "recipe": {"global_batch_size": 16, "num_generations": 8, "micro_batch_size": 16, "max_completion_len": 8,
                   "temperature": 1.0, "loss_type": "dapo", "beta": 0.0, "lr": 3e-3,
                   "reward_funcs": ["exact_match", "char_match"]},
        "timing": {"steps": 8, "warmup": 2, "rows": [
            {"strategy": "zero3", "ours": side(2.0, 1014), "trl": side(1.0, 995, engine="DeepSpeedEngine",
                                                                       steps_per_generation=4,
                                                                       generation_batch_size=128),
             "trl_over_ours": 0.5},
            {"strategy": "zero3, no gc.collect at the rollout (what-if)", "ours": side(0.8, 1014),
             "trl": side(1.0, 995), "trl_over_ours": 1.25, "what_if": True},
            {"strategy": "fsdp", "ours": side(0.4, 1014),
             "trl": side(None, None, ok=False, error="RuntimeError: no"), "trl_over_ours": None}]}}
    text = B.section(results)
    assert "16 prompts x num_generations 8 = 128 completions" in text and "steps_per_generation = 4" in text
    zero3 = next(line for line in text.splitlines() if line.startswith("| zero3 "))
    assert [c.strip() for c in zero3.split("|")[1:7]] == ["zero3", "2.000", "1.000", "0.50x", "1014", "995"]
    assert "1.25x" in text and "gc.collect()" in text  # the what-if row and its explanation
    assert "fsdp, TRL failed: `RuntimeError: no`" in text
    assert "def5678" in text and "exact_match, char_match" in text


def test_phase_table_per_side_and_failure():
    side_phases = {"ok": True, "steps": 6, "step_seconds": 0.5, "other_load": 0.3,
                   "phases": {"GRPO.new_rollout": [0.1, 1.0], "DeepSpeedEngine.backward": [0.25, 4.0],
                              "dist.reduce_scatter_tensor": [0.125, 76.0]}}
    trl = {"ok": True, "steps": 6, "step_seconds": 0.6, "other_load": 0.1,
           "phases": {"GRPOTrainer._generate_and_score_completions": [0.2, 1.0], "subprocess.Popen": [0.05, 76.0]}}
    text = B.phase_table({"strategy": "zero3", "ours": side_phases, "trl": trl}, 2)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]] for line in text.splitlines()
            if line.startswith("| ")}
    assert rows["rollout: generation, rewards, advantages"] == ["100 ms (1)", "200 ms (1)"]
    assert rows["collective: reduce_scatter_tensor"] == ["125 ms (76)", "0 ms (0)"]
    assert rows["subprocesses started"] == ["0", "76"]
    assert rows["the whole step (between optimizer steps)"] == ["500 ms", "600 ms"]
    assert "other load 0.30 / 0.10" in text
    failed = B.phase_table({"strategy": "zero3", "ours": side_phases, "trl": {"ok": False, "error": "boom"}}, 2)
    assert failed == "TRL's phase launch failed: `boom`"
