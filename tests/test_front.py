"""`finetune` (finetune/cli.py): the launch command it builds, and mistakes caught in its own process
before anything is launched. The real launch through it is in tests/distributed/test_run_experience.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from finetune.commands.cli import RUN_SCRIPT, _launcher_options, launch_command

REPO = Path(__file__).resolve().parents[1]


def test_one_process_runs_without_a_launcher():
    assert launch_command({}, ["--recipe", "tiny"], 1) == [sys.executable, str(RUN_SCRIPT), "--recipe", "tiny"]


def test_several_processes_go_through_accelerate_launch():
    options, rest = _launcher_options(["tiny", "--num_processes", "4", "lr=1e-5", "--main_process_port=2950"])
    assert options == {"--num_processes": "4", "--main_process_port": "2950"} and rest == ["tiny", "lr=1e-5"]
    cmd = launch_command(options, ["--recipe", "tiny", "lr=1e-5"], 4)
    assert cmd[:5] == [sys.executable, "-m", "finetune.cli", "_launch", "accelerate"]  # accelerate launch, in-process
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[cmd.index("--main_process_port") + 1] == "2950"
    assert cmd[-4:] == [str(RUN_SCRIPT), "--recipe", "tiny", "lr=1e-5"] and "--multi_gpu" in cmd


def test_a_launcher_config_gives_the_process_count(tmp_path):
    from finetune.commands.cli import _processes

    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    assert _processes({"--config_file": str(config)}) == 8
    cmd = launch_command({"--config_file": str(config)}, ["--recipe", "tiny"], 8)
    assert cmd[5:7] == ["--config_file", str(config)] and "--multi_gpu" not in cmd


def failure(rank: int, exitcode: int, timestamp: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = timestamp
    return rank, f


@pytest.mark.parametrize("failures,code,line", [
    ([failure(0, 2, 7), failure(1, 2, 7)], 2, None),  # a user error: the rank said it
    ([failure(0, -15, 7), failure(1, 2, 7)], 2, None),  # rank 0 stopped by the launcher in the same second
    ([failure(0, 143, 7), failure(1, 1, 7)], 1, None),  # a crash; rank 0 left by its SIGTERM handler
    ([failure(0, 2, 9), failure(1, -9, 8)], 137,
     "error: rank 1 was killed by SIGKILL (the kernel's out-of-memory killer, or from outside the run); "
     "--resume auto continues from the newest complete checkpoint"),
], ids=["user-error", "the-others-stopped", "crash", "killed"])
def test_a_failed_launch_exits_with_the_failed_ranks_code(failures, code, line):
    """torch's launcher ends a launch whose worker failed with ChildFailedError (a traceback, a failure
    table, exit code 1); the front's launch exits with the code of the rank that failed first instead."""
    from finetune.commands.cli import failed_rank

    assert failed_rank(dict(failures)) == (code, line)


def front(*args):
    return subprocess.run([sys.executable, "-m", "finetune.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,message", [
    (["train", "tiny", "max_step=3"], "error: unknown recipe key 'max_step'; did you mean max_steps?"),
    (["train", "tiny", "--num_processes", "3", "global_batch_size=16", "micro_batch_size=4"],
     "error: global_batch_size=16 is not a multiple of micro_batch_size x processes = 4 x 3 = 12"),
    (["train", "nope"], "error: unknown recipe 'nope'"),
    (["fly"], "error: unknown command 'fly'"),
    (["train", "tiny", "--bogus", "auto"], "error: unrecognized arguments: --bogus"),
])
def test_mistakes_are_one_line_and_exit_2_before_any_launch(args, message, tmp_path):
    proc = front(*args, f"output_dir={tmp_path / 'out'}") if args[0] == "train" else front(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and "finetune: " not in proc.stderr  # nothing was launched
    assert not (tmp_path / "out").exists()


def test_plan_and_export_are_the_same_tools():
    plan = front("plan", "--recipe", "llama7b_zero3", "--gpus", "8", "--gpu-mem", "80GB")
    assert plan.returncode == 0 and "would run: " in plan.stdout
    export = front("export", "/nonexistent/step_000000001", "/tmp/never-written")
    assert export.returncode == 2 and export.stderr.startswith("error: ")


def test_the_console_script_is_installed():
    script = Path(sys.executable).parent / "finetune"
    assert script.is_file(), "pip install -e . installs the `finetune` command (pyproject [project.scripts])"
    assert subprocess.run([str(script), "--help"], capture_output=True, text=True).stdout.startswith("usage: finetune")


def test_data_command_shows_what_is_trained(capsys):
    """`finetune data` is finetune.data's inspector: --json gives each row's input_ids and labels."""
    import json

    from finetune.cli import main

    assert main(["data", "--recipe", "tiny", "--show", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) >= 2 and all(len(r["input_ids"]) == len(r["labels"]) for r in rows[:2])
    assert all(any(label != -100 for label in r["labels"]) for r in rows[:2])


# ---------------------------------------------------------------- found before the launch, not by the ranks


@pytest.mark.parametrize("args,message", [
    (["tiny", "sequence_parallel=3", "--num_processes", "3"],
     "error: sequence_parallel=3: the model has 4 attention heads, not divisible by 3"),
    (["tiny", "max_seq_len=16"], "error: builtin:tiny-tasks: no example has a response token left within "
                                 "max_seq_len=16; raise max_seq_len or set train_on_prompt=true"),
    (["tiny_dpo", "max_seq_len=8", "strategy=ddp"],
     "error: builtin:tiny-preferences: no pair has a response token left on both sides within max_seq_len=8"),
    (["tiny", "global_batch_size=4096", "micro_batch_size=8"],
     "error: the dataset has 3800 training rows, fewer than one global batch of 4096"),
    (["tiny", "--num_processes", "2", "strategy=zero3", "zero_hpz_partition_size=3"],
     "error: zero_hpz_partition_size=3 with 2 process(es): hpZ's groups must divide the processes; use one of 2"),
    (["tiny_grpo_vllm", "--num_processes", "2"], "error: generation_backend=vllm needs vLLM, which is not installed "
                                                 "here: pip install vllm on a GPU machine"),
], ids=["heads-not-divisible", "no-response-token", "every-pair-dropped", "fewer-rows-than-a-batch", "hpz-size",
        "no-vllm"])
def test_config_and_tokenized_data_are_checked_before_the_launch(args, message, tmp_path, capsys, monkeypatch):
    """These were found by each launched rank after its start (one error per rank, then the launcher's
    traceback); the front now reads the model's config and tokenizes the data itself (into the datasets
    cache the ranks read), checks that vLLM is installed where the recipe generates with it (here it is
    not, whether or not this machine has it) and launches nothing."""
    import importlib.util

    from finetune.commands import cli

    def launched(cmd, output_dir):
        raise AssertionError(f"launched {cmd}")

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.setattr(cli, "supervise", launched)
    capsys.readouterr()
    code = cli.main(["train", *args, f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(message), err
    assert "Traceback" not in err and "finetune: " not in err
    assert not (tmp_path / "out").exists()


def teacher_dirs(root: Path) -> dict:
    """A reward model's final/ (its config: LlamaForSequenceClassification, one label; the student's tokenizer)
    and a directory whose config.json is not JSON."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.assets import resolve_model
    from finetune.model import reward_config

    student = resolve_model("builtin:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(student)
    reward = root / "reward" / "final"
    reward_config(AutoConfig.from_pretrained(student), tokenizer.pad_token_id).save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    garbled = root / "garbled"
    garbled.mkdir()
    (garbled / "config.json").write_text("{not json")
    return {"REWARD": str(reward), "GARBLED": str(garbled)}


@pytest.mark.parametrize("teacher,message", [
    ("builtin:nosuch", "error: teacher_model=builtin:nosuch: unknown builtin; available: builtin:tiny-llama"),
    ("REWARD", "error: teacher_model=REWARD: it is a LlamaForSequenceClassification, a reward model (one score per "
               "row): distillation learns the teacher's next-token distribution"),
    ("GARBLED", "error: teacher_model=GARBLED: cannot read its config"),
], ids=["unknown-builtin", "reward-model", "unreadable"])
def test_a_teacher_that_cannot_teach_is_found_before_the_launch(teacher, message, tmp_path, capsys, monkeypatch):
    """The teacher was checked by each rank after its start (an AssertionError traceback for an unknown
    builtin, an IndexError in the divergence for a reward model, 45 s in for an unreadable one): the front
    checks it before launching anything, in one line."""
    from finetune.commands import cli

    def launched(cmd, output_dir):
        raise AssertionError(f"launched {cmd}")

    teacher = teacher_dirs(tmp_path).get(teacher, teacher)
    monkeypatch.setattr(cli, "supervise", launched)
    capsys.readouterr()
    code = cli.main(["train", "tiny_distill", f"teacher_model={teacher}", "--num_processes", "2",
                     f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith(message.replace("REWARD", teacher).replace("GARBLED", teacher)), err
    assert "Traceback" not in err and "finetune: " not in err
    assert not (tmp_path / "out").exists()


SIGNAL_FRONT = """
import os, signal, sys, time
time.sleep(float(sys.argv[1]))
os.kill(os.getppid(), signal.SIGTERM)  # the front, while this launcher has no handler of its own yet
time.sleep(60)
"""


@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["as-it-starts", "before-its-handlers"])
def test_a_sigterm_as_the_launch_starts_exits_143(delay, tmp_path):
    """The front forwards a SIGTERM to the launcher; one that comes before the launcher has its own
    handlers kills it (a return code of -15), which the front passed on as its exit code: 241, not
    128 + 15. A signal before the launcher exists is forwarded once it does."""
    front_code = ("import sys; from pathlib import Path; from finetune.commands.cli import supervise; "
                  f"sys.exit(supervise([sys.executable, '-c', {SIGNAL_FRONT!r}, '{delay}'], Path({str(tmp_path)!r})))")
    proc = subprocess.run([sys.executable, "-c", front_code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)


def test_finetune_train_help_lists_every_recipe_key(capsys):
    """The docs' idiom is `finetune train`: its --help lists the keys (python finetune/run.py --help did)."""
    from finetune.commands.cli import main
    from finetune.recipe import FIELDS

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: finetune train RECIPE") and "recipe keys (override with key=value):" in out
    listed = {line.split("=", 1)[0].strip() for line in out.splitlines() if line.startswith("  ") and "=" in line}
    assert set(FIELDS) <= listed, set(FIELDS) - listed
    assert main(["train"]) == 2 and "finetune train --help lists them" in capsys.readouterr().out
