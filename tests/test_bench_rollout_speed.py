"""The rollout benchmarks' pure parts: bench/studies/rollout_speed.py (CPU, before/after) and
bench/gpu/grpo_rollout.py (a lent GPU): medians from metrics records, the rounds' summary, the docs
sections and their markers. No launches, no GPU; every number below is made up to exercise them."""

from bench.gpu import grpo_rollout as G
from bench.studies import rollout_speed as R


def test_rollout_and_step_seconds_from_metrics_records():
    records = [{"step": 1, "loss": 0.1, "tokens": 100, "tokens_per_s": 10.0, "rollout_seconds": 9.0,
                "completions/mean_length": 128.0},
               {"step": 2, "loss": 0.1, "tokens": 200, "tokens_per_s": 50.0, "rollout_seconds": 1.0},
               {"step": 3, "loss": 0.1, "tokens": 300, "tokens_per_s": 25.0, "rollout_seconds": 3.0},
               {"step": 3, "eval_reward": 0.5}]
    got = R.rollout_and_step_seconds(records)
    assert got["rollout_seconds"] == [9.0, 1.0, 3.0] and got["first_rollout"] == 9.0
    assert got["rollout"] == 2.0 and got["step_seconds"] == [10.0, 2.0, 4.0] and got["step"] == 3.0
    assert got["completion_tokens"][0] == 128.0 * 16


def results():
    row = dict(ok=True, rollout=4.0, first_rollout=5.0, step=10.0, other_load=1.5, command="accelerate launch ...")
    return {"command": "python bench/studies/rollout_speed.py", "git": "abc1234", "before": "ba2306b",
            "started": "2026-11-27 11:00 UTC", "minutes": 20.0, "machine": {"cpu": "CPU", "cores": 2},
            "versions": {"torch": "2.13"}, "model": "Llama-style", "parameters": 106e6, "steps": 4, "warmup": 1,
            "new_tokens": 128,
            "rows": [{"strategy": "zero3", "variant": "before", **row},
                     {"strategy": "zero3", "variant": "after", **row, "rollout": 2.0},
                     {"strategy": "fsdp", "variant": "before", "ok": False, "error": "RuntimeError: no"}]}


def test_cpu_section_rows_speed_up_and_failure(tmp_path):
    text = R.section(results())
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| zero3")
            or line.startswith("| fsdp")]
    assert rows[0][:6] == ["zero3", "before", "4.00", "5.00", "10.00", "-"]
    assert rows[1][:6] == ["zero3", "after", "2.00", "5.00", "10.00", "2.00x"]
    assert rows[2][2] == "failed" and "RuntimeError: no" in rows[2][-1] and rows[0][6] == "-"
    assert "106M parameters" in text and "ba2306b" in text


def test_doc_section_is_appended_once_then_replaced_in_place(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## 15. Another helper's section\n\ntext\n")
    R.write_doc_section(doc, R.TITLE, R.BEGIN, R.END, "first")
    R.write_doc_section(doc, R.TITLE, R.BEGIN, R.END, "second")
    page = doc.read_text()
    assert page.count(R.TITLE) == 1 and "second" in page and "first" not in page
    assert page.index("Another helper") < page.index(R.TITLE), "appended at the end"
    doc.write_text(page + "\n## A later section\n")
    R.write_doc_section(doc, R.TITLE, R.BEGIN, R.END, "third")
    assert doc.read_text().endswith("third\n" + R.END + "\n\n## A later section\n")


def test_gpu_rounds_summary_leaves_the_first_round_out():
    got = G.summarize([30.0, 2.0, 4.0], 64 * 512)
    assert got["first"] == 30.0 and got["seconds"] == 3.0 and got["tokens_per_s"] == 64 * 512 / 3.0
    assert G.summarize([5.0], 10)["seconds"] == 5.0
    rows = G.prompts_for(3, 4, 1000, 5, 9)
    assert len(rows) == 12 and rows[0] == rows[3] != rows[4] and all(5 <= len(r) <= 9 for r in rows)
    assert all(3 <= t < 1000 for r in rows for t in r)


def gpu_results(compiled_seconds):
    def v(s, first=None):
        return G.summarize([first or s, s], 64 * 512) | {"peak_gib": 3.5}

    return {"command": "python bench/gpu/grpo_rollout.py --deadline 420", "git": "abc1234",
            "started": "2026-11-27 12:00 UTC", "versions": {"torch": "2.11"},
            "generation": {"device": "SYNTHETIC GPU", "model": "Llama-style", "parameters": 0.95e9, "dtype": "bfloat16",
                           "completions": 64, "new_tokens": 512, "prompt_tokens": [64, 128],
                           "variants": {"before": {"error": "RuntimeError: CUDA out of memory"},
                                        "after, eager": v(6.0), "after, compiled": v(compiled_seconds, 40.0),
                                        "TRL generate": v(6.0)},
                           "checks": {"noise_bits_equal_cpu": True, "compiled_equals_eager_greedy": 16,
                                      "compiled_equals_eager_sampled": 15, "rows_compared": 16}},
            "steps": [{"variant": "after", "ok": True, "rollout": 2.0, "step": 5.0},
                      {"variant": "TRL GRPOTrainer", "skipped": "trl not importable"}]}


def test_gpu_section_against_trl_target_checks_and_steps():
    text = G.section(gpu_results(1.5))
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
             if line.startswith("| ")}
    assert cells["after, compiled"][:5] == ["40.00", "1.50", "21,845", "4.00x", "3.50"]
    assert cells["TRL generate"][3] == "1.00x" and "CUDA out of memory" in cells["before"][-1]
    assert "met (4.00x)" in text and "15 of 16 rows greedy" not in text and "16 of 16 rows greedy, 15 sampled" in text
    assert cells["after"][:2] == ["2.00", "5.00"] and "trl not importable" in cells["TRL GRPOTrainer"][-1]
    assert "not met (2.00x)" in G.section(gpu_results(3.0))
