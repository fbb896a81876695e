"""bench/gpu/e2e.sh (what a GPU user runs, end to end, on a lent GPU) in its CPU smoke mode: the script
itself works (one recipe through `finetune train` at bf16 on 2 processes, its row read from the run's
metrics, every other row of the GPU's list resolved without training it, the fp32 compiled-against-eager
check, the table), so that a lent GPU's few minutes are not lost to a broken script. It measures nothing."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import REPO


def test_the_gpu_end_to_end_script_runs_in_its_smoke_mode(tmp_path, launch_env):
    import sys

    env = dict(launch_env, E2E_SMOKE="1", E2E_PHASES="recipes,fp32", E2E_RECIPES="tiny_reward",
               OUT=str(tmp_path / "out"), E2E_STATE=str(tmp_path / "state"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu/e2e.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    recipe, resolved, check = rows
    assert recipe["recipe"] == "tiny_reward" and recipe["ok"] and recipe["rc"] == 0 and recipe["steps"] == 4, recipe
    assert recipe["metric"] == "eval_accuracy" and recipe["last"] is not None
    assert resolved["ok"] and resolved["what"].startswith("8 rows: tiny, tiny_dpo, tiny_reward, tiny_kto, tiny_grpo, "
                                                          "tiny_rloo, tiny_distill,"), resolved
    assert check["ok"] and "8/8 rows greedy, 8/8 sampled" in check["what"], check
    table = (tmp_path / "out" / "e2e.md").read_text()
    assert "| every row resolves (not trained) | yes |" in table
    assert "| `tiny_reward` | yes |" in table and "| compiled loop = eager loop (fp32) | yes |" in table
    assert os.path.isfile(tmp_path / "out" / "tiny_reward.summary.json")
