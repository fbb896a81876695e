"""The command line: every user mistake is one `error:` line on stderr and exit code 2, before any
model is loaded; --dry-run prints the plan. A few cases are real `python finetune/run.py` processes
(SUBPROCESS: what a user's shell sees, import-time output included); the others call the same
run.main in this process, which checks the same things without a few seconds of imports each."""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from in_process import run_main

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
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes(good.read_bytes() + '{"instruction": "caf\xe9", "output": "x"}\n'.encode("latin-1"))
    binary = root / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    gaps = root / "gaps.csv"
    gaps.write_text("instruction,input,output\nReverse the word.,abc,cba\nReverse the word.,xyz,\n")
    a_file = root / "a_file"
    a_file.write_text("not a directory")
    busy = root / "busy"
    busy.mkdir()
    (busy / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    other, mine = root / "other", root / "mine"
    for run, step in ((other, 5), (mine, 10)):
        (run / "checkpoints" / f"step_{step:09d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:09d}" / "manifest.json").write_text("{}")
    return {"root": root, "good": good, "bad": bad, "empty": empty, "missing": root / "missing" / "train.jsonl",
            "finished": finished, "latin1": latin1, "binary": binary, "gaps": gaps, "a_file": a_file,
            "readonly": root / "readonly", "nvme_missing": root / "no_nvme_here", "busy": busy, "mine": mine,
            "other_ckpt": other / "checkpoints" / "step_000000005"}


def _make_read_only(path: Path) -> None:
    """chmod is no obstacle to root, so as root the directory is made immutable (chattr +i), which
    stops root as a read-only filesystem would."""
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o555)
    assert not os.access(path, os.W_OK)


def _undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


def _hold_lock(output_dir: Path, proc) -> None:
    """A lock as a run in progress writes it (finetune/lock.py), held by a live process."""
    from finetune import lock

    info = {"pid": proc.pid, "started": "2026-11-23 08:00:00 +0000", "command": "finetune/run.py --recipe tiny",
            "launch": "127.0.0.1:29500:none", "slurm_job": None, "proc_start": lock._process_start(proc.pid),
            **lock._machine()}
    (output_dir / lock.LOCK_NAME).write_text(json.dumps(info))


# name -> (arguments, fragments the single stderr line must contain)
ERROR_CASES = {
    "unknown_recipe": (["--recipe", "tiyn"], ["unknown recipe 'tiyn'", "did you mean tiny?", "available: ", "tiny,"]),
    "unknown_key": (["--recipe", "tiny", "lrr=1e-3"], ["unknown recipe key 'lrr'", "did you mean lr?"]),
    "bad_value": (["--recipe", "tiny", "max_steps=abc"], ["max_steps=abc: expected an integer"]),
    "bad_choice": (["--recipe", "tiny", "strategy=zero4"], ["strategy=zero4", "ddp, fsdp, hsdp, zero1, zero2, zero3"]),
    "impossible_combination": (["--recipe", "tiny", "strategy=ddp", "offload_params=cpu"],
                               ["offload_params=cpu with strategy=ddp"]),
    "missing_dataset": (["--recipe", "tiny", "dataset={missing}"], ["dataset={missing}: no such file or directory"]),
    "malformed_row": (["--recipe", "tiny", "dataset={bad}"], ["{bad} line 3", "not valid JSON"]),
    "empty_dataset": (["--recipe", "tiny", "dataset={empty}"], ["dataset={empty}", "empty"]),
    "finished_output_dir": (["--recipe", "tiny", "dataset={good}", "output_dir={finished}"],
                            ["output_dir={finished} already holds a finished model"]),
    # issue 16, item 9: overrides anywhere (warmup_steps=9 comes after --dry-run and is applied)
    "override_after_option": (["--recipe", "tiny", "max_steps=8", "--dry-run", "warmup_steps=9"],
                              ["warmup_steps=9 is longer than max_steps=8"]),
    "dashed_override": (["--recipe", "tiny", "--lr=1e-3"],
                        ["unrecognized arguments: --lr=1e-3", "recipe keys take no dashes: lr=1e-3"]),
    # item 5: found before loading, one line
    "latin1_jsonl_dry_run": (["--recipe", "tiny", "dataset={latin1}", "--dry-run"],
                             ["{latin1} line 5 (byte offset ", "byte 0xe9): not UTF-8 text", "save it as UTF-8"]),
    "binary_jsonl": (["--recipe", "tiny", "dataset={binary}"],
                     ["{binary} line 1 (byte offset 0, byte 0x89): binary data, not text", "save it as UTF-8"]),
    "csv_empty_cell": (["--recipe", "tiny", "dataset={gaps}"],
                       ["{gaps} line 3 (row 2): column 'output' is empty (dataset_format=alpaca needs"]),
    "output_dir_is_a_file": (["--recipe", "tiny", "dataset={good}", "output_dir={a_file}"],
                             ["output_dir={a_file} is a file, not a directory"]),
    "output_dir_read_only": (["--recipe", "tiny", "dataset={good}", "output_dir={readonly}/run"],
                             ["output_dir={readonly}/run cannot be created: {readonly} is not writable"]),
    "nvme_path_missing": (["--recipe", "tiny", "dataset={good}", "strategy=zero3", "offload_optimizer=nvme",
                           "offload_params=nvme", "nvme_path={nvme_missing}"],
                          ["nvme_path={nvme_missing} does not exist", "mkdir -p {nvme_missing}"]),
    # item 4: one run per output_dir; resume never writes into another run's checkpoints
    "busy_output_dir": (["--recipe", "tiny", "dataset={good}", "output_dir={busy}", "--resume", "auto"],
                        ["output_dir={busy} is in use by another run: pid ", "started 2026-11-23 08:00:00",
                         "(finetune/run.py --recipe tiny)", "kill -TERM "]),
    # issue 38, item 3: sequence parallelism with the objectives it does not serve, refused before any model loads
    "grpo_vllm_sequence_parallel": (["--recipe", "tiny_grpo", "sequence_parallel=2", "generation_backend=vllm"],
                                    ["generation_backend=vllm with sequence_parallel=2", "set sequence_parallel=1"]),
    "reward_sequence_parallel": (["--recipe", "tiny_reward", "sequence_parallel=2"],
                                 ["sequence_parallel=2 with objective=reward", "set sequence_parallel=1"]),
    "resume_into_another_run": (["--recipe", "tiny", "dataset={good}", "output_dir={mine}", "--resume",
                                 "{other_ckpt}"],
                                ["--resume {other_ckpt}: output_dir={mine} already holds checkpoints of another "
                                 "run (step_000000010)"]),
}
OK_CASES = {
    "dry_run_tiny": ["--recipe", "tiny", "--dry-run"],
    "dry_run_overrides": ["--recipe", "tiny", "--dry-run", "dataset={good}", "strategy=fsdp", "micro_batch_size=4",
                          "grad_accum=3", "output_dir={finished}"],
    "dry_run_overrides_anywhere": ["--recipe", "tiny", "max_steps=8", "--dry-run", "warmup_steps=1",
                                   "--allow-data-change", "grad_accum=3"],
}


SUBPROCESS = {"unknown_recipe", "latin1_jsonl_dry_run", "busy_output_dir", "dry_run_tiny"}


def in_process(argv: list[str]) -> SimpleNamespace:
    code, out, err = run_main(argv)
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCELERATE_") and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", FINETUNE_CACHE=str(cache))
    return env


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, finetune_cache):
    files = _files(tmp_path_factory.mktemp("cli"))
    env = _env(finetune_cache)
    cases = {name: args for name, (args, _) in ERROR_CASES.items()} | OK_CASES
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the run in files['busy']
    _hold_lock(files["busy"], holder)
    _make_read_only(files["readonly"])
    before = {key: _snapshot(files[key]) for key in ("busy", "mine")}

    def argv_of(name, args):
        """The case's arguments, with an output_dir of its own in the temporary directory where it names
        none: the recipe's relative one (runs/tiny) may hold the README's first run, or any user's."""
        argv = [a.format(**files) for a in args]
        if not any(a.startswith("output_dir=") for a in argv):
            argv.append(f"output_dir={files['root']}/out/{name}")
        return argv

    def run(argv):
        return subprocess.run([sys.executable, "finetune/run.py", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=180)

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(run, argv_of(name, args)) for name, args in cases.items() if name in SUBPROCESS}
            results = {name: in_process(argv_of(name, args)) for name, args in cases.items() if name not in SUBPROCESS}
            results |= {name: f.result() for name, f in futures.items()}
        files["unchanged"] = {key: _snapshot(files[key]) == snap for key, snap in before.items()}
    finally:
        holder.kill()
        holder.wait()
        _undo_read_only(files["readonly"])
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


def test_refusals_change_nothing_on_disk(runs):
    """A run refused because output_dir is busy or holds another run's checkpoints leaves it as it was,
    and a missing nvme_path is not created."""
    files, results = runs
    assert results["busy_output_dir"].returncode == 2 and results["resume_into_another_run"].returncode == 2
    assert files["unchanged"] == {"busy": True, "mine": True}
    assert not files["nvme_missing"].exists()
    assert not (files["readonly"] / "run").exists()


def test_overrides_anywhere_on_the_command_line(runs):
    _, results = runs
    proc = results["dry_run_overrides_anywhere"]
    assert proc.returncode == 0, proc.stderr
    assert "global batch 24 = micro 8 x accum 3 x 1" in proc.stdout  # the last override, after two options


STOP_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from finetune.training.stopping import StopRequest
from finetune.lock import OutputDirLock

OutputDirLock(Path(sys.argv[1])).acquire()
stop = StopRequest()
for item in sys.argv[2:]:
    delay, name = item.split(":")
    time.sleep(float(delay))
    os.kill(os.getpid(), getattr(signal, name))
    time.sleep(0.05)  # the handler has run
    print(name, stop.requested, flush=True)
print("running on", flush=True)
"""


@pytest.mark.parametrize("signals,aborted", [
    (["0:SIGINT", "0:SIGINT"], False),     # one keypress delivered twice (srun): the same Ctrl-C
    (["0:SIGINT", "1.1:SIGINT"], True),    # a second Ctrl-C, run directly
    (["0:SIGINT", "0:SIGTERM"], True),     # a second Ctrl-C under accelerate launch: torchrun sends SIGTERM
    (["0:SIGTERM", "0:SIGTERM"], False),   # a scheduler's SIGTERM, forwarded by the launcher too
    (["0:SIGUSR1", "0:SIGINT"], False),    # a Ctrl-C during a scheduler's stop: one request
])
def test_ctrl_c_saves_and_a_second_one_stops_at_once(signals, aborted, tmp_path):
    """StopRequest with real signals: the first Ctrl-C asks for a checkpoint (like SIGTERM), with a
    line; a second one exits at once with code 130, one error line, and frees output_dir."""
    proc = subprocess.run([sys.executable, "-c", STOP_SCRIPT, str(tmp_path), *signals], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=_env(tmp_path))
    first = signals[0].split(":")[1]
    assert proc.stdout.splitlines()[0] == f"{first} {int(getattr(signal, first))}", proc.stdout
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    if first == "SIGINT":
        assert lines[0] == ("interrupted: stopping with a checkpoint within a step (Ctrl-C again to stop at once, "
                            "without saving)")
    if aborted:
        assert proc.returncode == 130 and "running on" not in proc.stdout
        assert lines[-1].startswith("error: interrupted twice: stopped at once") and len(lines) == 2, proc.stderr
        assert not (tmp_path / "finetune.lock").exists()
    else:
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "running on", proc.stderr
        assert len(lines) == (1 if first == "SIGINT" else 0), proc.stderr
