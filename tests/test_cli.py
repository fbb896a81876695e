"""The command line: every user mistake is one `error:` line on stderr and exit code 2, before any
model is loaded; --dry-run prints the plan. Each case is a real `python finetune/run.py` process
(all started at once, since each spends a few seconds importing)."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOOD = {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}


def _files(root: Path) -> dict:
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(4)))
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + '{"instruction": "x",\n')
    empty = root / "empty.jsonl"
    empty.write_text("")
    finished = root / "finished"
    (finished / "final").mkdir(parents=True)
    return {"good": good, "bad": bad, "empty": empty, "missing": root / "missing" / "train.jsonl",
            "finished": finished}


# name -> (arguments, fragments the single stderr line must contain)
ERROR_CASES = {
    "unknown_recipe": (["--recipe", "tiyn"], ["unknown recipe 'tiyn'", "did you mean tiny?", "available: ", "tiny,"]),
    "unknown_key": (["--recipe", "tiny", "lrr=1e-3"], ["unknown recipe key 'lrr'", "did you mean lr?"]),
    "bad_value": (["--recipe", "tiny", "max_steps=abc"], ["max_steps=abc: expected an integer"]),
    "bad_choice": (["--recipe", "tiny", "strategy=zero4"], ["strategy=zero4", "ddp, fsdp, zero1, zero2, zero3"]),
    "impossible_combination": (["--recipe", "tiny", "strategy=ddp", "offload_params=cpu"],
                               ["offload_params=cpu with strategy=ddp"]),
    "missing_dataset": (["--recipe", "tiny", "dataset={missing}"], ["dataset={missing}: no such file or directory"]),
    "malformed_row": (["--recipe", "tiny", "dataset={bad}"], ["{bad} line 3", "not valid JSON"]),
    "empty_dataset": (["--recipe", "tiny", "dataset={empty}"], ["dataset={empty}", "empty"]),
    "finished_output_dir": (["--recipe", "tiny", "dataset={good}", "output_dir={finished}"],
                            ["output_dir={finished} already holds a finished model"]),
}
OK_CASES = {
    "dry_run_tiny": ["--recipe", "tiny", "--dry-run"],
    "dry_run_overrides": ["--recipe", "tiny", "--dry-run", "dataset={good}", "strategy=fsdp", "micro_batch_size=4",
                          "grad_accum=3", "output_dir={finished}"],
}


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCELERATE_") and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", FINETUNE_CACHE=str(cache))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory, finetune_cache):
    files = _files(tmp_path_factory.mktemp("cli"))
    env = _env(finetune_cache)
    cases = {name: args for name, (args, _) in ERROR_CASES.items()} | OK_CASES

    def run(args):
        argv = [a.format(**files) for a in args]
        return subprocess.run([sys.executable, "finetune/run.py", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(max_workers=max(2, min(len(cases), os.cpu_count() or 2))) as pool:
        futures = {name: pool.submit(run, args) for name, args in cases.items()}
        results = {name: f.result() for name, f in futures.items()}
    return files, results


@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_user_error_is_one_line_and_exit_2(runs, name):
    files, results = runs
    proc = results[name]
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, report
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, report
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, report
    assert lines[0].startswith("error: "), report
    for fragment in ERROR_CASES[name][1]:
        assert fragment.format(**files) in lines[0], report


def test_dry_run_prints_the_plan(runs):
    _, results = runs
    proc = results["dry_run_tiny"]
    assert proc.returncode == 0, proc.stderr
    assert "error:" not in proc.stderr and "Traceback" not in proc.stderr
    from finetune.recipe import load_recipe_module

    tiny = load_recipe_module("tiny")
    micro, accum = tiny.micro_batch_size, tiny.grad_accum
    out = proc.stdout.strip()
    assert out.startswith(f"{tiny.strategy} on 1 ")
    assert f"global batch {micro * accum} = micro {micro} x accum {accum} x 1" in out
    assert "precision no" in out and "offload none" in out
    assert f"memory per GPU (planner estimate, {tiny.strategy} on 1 process(es)): params " in out
    assert "parameters; config from builtin:tiny-llama" in out


def test_dry_run_with_overrides_and_local_dataset(runs):
    _, results = runs
    proc = results["dry_run_overrides"]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out.startswith("fsdp on 1 ")
    assert "global batch 12 = micro 4 x accum 3 x 1" in out
