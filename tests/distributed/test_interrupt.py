"""Ctrl-C and a second run on a real 2-process launch, with real signals sent the way a terminal
sends them: SIGINT to the launcher's process group (torchrun starts each worker in a session of
its own, so only the launcher gets it, and forwards it).

One Ctrl-C: the workers finish the step, write a checkpoint at the step they stop at, print how
to continue and exit without tracebacks; `--resume auto` continues from there. A second Ctrl-C
(torchrun answers it by sending SIGTERM) stops at once without a checkpoint. While a run trains,
a second run into its output_dir is refused before loading anything, in one line naming it.

The launcher (torch's elastic agent, inside accelerate launch) reports any signal it forwarded
with its own SignalException traceback and exit code 1, whatever the workers did; the checks on
tracebacks are on the workers' output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from finetune.lock import LOCK_NAME

REPO = Path(__file__).resolve().parents[2]
# long enough never to finish by itself; no evals, so that steps come quickly
LONG = ["strategy=ddp", "max_steps=100000", "lr_scheduler=constant_with_warmup", "eval_every=0", "eval_at_start=false"]


def start(env, fast, port, out, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port,
           "finetune/run.py", "--recipe", "tiny", *fast, *LONG, f"output_dir={out}", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own, like a terminal's job


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def wait_for_step(proc, out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while step not in steps_logged(out):
        assert proc.poll() is None, f"the launch ended early ({proc.returncode}):\n{proc.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.1)


def workers(launcher_pid: int) -> list[int]:
    """The launcher's children (accelerate runs torchrun's agent in its own process), by rank order."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == launcher_pid:
                children.append(int(entry.name))
    return sorted(children)


def worker_lines(stderr: str, launcher_pid: int) -> list[str]:
    """stderr without the launcher's log lines and its SignalException tracebacks at the end."""
    lines = stderr.splitlines()
    ours = re.compile(r'File ".*/finetune/\w+\.py"')
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            tail = "\n".join(lines[i:])
            if f"SignalException: Process {launcher_pid} got signal: 2" in tail and not ours.search(tail):
                lines = lines[:i]
                break
    return [line for line in lines if not re.match(r"^[WIE]\d{4} ", line)]


def test_ctrl_c_saves_and_resume_continues_and_a_busy_dir_is_refused(launch_env, fast_overrides, run_in_process,
                                                                      tmp_path):
    out = tmp_path / "run"
    first = start(launch_env, fast_overrides, free_port(), out)
    try:
        wait_for_step(first, out, 1)
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == workers(first.pid)[0]  # rank 0 holds the lock

        # a second run into the busy output_dir (`python finetune/run.py`, its main called in this process):
        # refused before loading anything, nothing changed
        files = sorted(p.name for p in out.iterdir())
        busy = run_in_process(*LONG, "--resume", "auto", output_dir=out)
        assert busy.returncode == 2, busy.stderr
        assert busy.stderr.splitlines() == [busy.stderr.strip()] and busy.stderr.startswith(
            f"error: output_dir={out} is in use by another run: pid {holder['pid']} on host {holder['host']}, "
            f"started {holder['started']} ("), busy.stderr
        assert json.loads((out / LOCK_NAME).read_text()) == holder
        assert sorted(p.name for p in out.iterdir()) == files

        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    lines = worker_lines(stderr, first.pid)
    assert not any("Traceback" in line or "Error" in line for line in lines), stderr
    assert ("interrupted: stopping with a checkpoint within a step (Ctrl-C again to stop at once, without saving)"
            in lines), stderr
    stopped = [int(m.group(1)) for m in map(re.compile(r"^stopped by signal at step (\d+); checkpoint saved; "
                                                       r"continue with --resume auto$").match, lines) if m]
    assert len(stopped) == 1 and sum("stopped by signal" in line for line in lines) == 1, stderr  # by rank 0 only
    stop = stopped[0]
    assert steps_logged(out)[-1] == stop
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop:09d}"]
    assert not (out / LOCK_NAME).exists() and not (out / "final").exists()
    # torch's launcher: exit code 1 and its own traceback for the signal it forwarded
    assert first.returncode == 1 and stderr.rstrip().endswith("got signal: 2"), stderr[-2000:]

    # --resume auto continues from the stop step; then Ctrl-C twice stops at once, without a checkpoint.
    second = start(launch_env, fast_overrides, free_port(), out, "--resume", "auto")
    try:
        wait_for_step(second, out, stop + 1)
        rank0, rank1 = workers(second.pid)
        os.kill(rank0, signal.SIGSTOP)  # hold rank 0 inside a step, so that no save can finish meanwhile
        os.killpg(second.pid, signal.SIGINT)
        time.sleep(1.5)
        os.killpg(second.pid, signal.SIGINT)  # the launcher now sends SIGTERM to both
        time.sleep(3)
        os.kill(rank0, signal.SIGCONT)
        _, stderr = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("resumed_from", "").endswith(f"step_{stop:09d}") for r in records)
    lines = worker_lines(stderr, second.pid)
    assert not any("Traceback" in line for line in lines), stderr
    assert lines[-1].startswith("error: interrupted twice: stopped at once, without a checkpoint"), stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop:09d}"]
    assert not (out / LOCK_NAME).exists()


def start_front(env, fast, port, out, *extra) -> subprocess.Popen:
    """`finetune train` as a container's entrypoint: its own process group (a container's pid 1 has no
    terminal's job around it); the signals below go to its pid only, as `docker stop` sends them."""
    cmd = [sys.executable, "-m", "finetune.cli", "train", "tiny", "--num_processes", "2", "--main_process_port", port,
           *fast, *LONG, f"output_dir={out}", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs) -> None:
    import psutil

    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"left running after the front exited: {alive}"


def kill_all(front, procs) -> None:
    import psutil

    for proc in [*procs, psutil.Process(front.pid)] if front.poll() is None else procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def signal_the_front(front, out, step: int, signum) -> tuple[int, str]:
    """Once the run reached `step`: signum to the front's pid only (as a container runtime sends it),
    then its exit code and stderr, after checking that the launcher and both workers are gone."""
    procs = []
    try:
        wait_for_step(front, out, step)
        procs = descendants(front.pid)  # the launcher and its two workers
        assert len(procs) == 3, procs
        os.kill(front.pid, signum)
        _, stderr = front.communicate(timeout=300)
        assert_all_gone(procs)
    finally:
        kill_all(front, procs)
    return front.returncode, stderr


def stopped_at(lines: list[str]) -> list[int]:
    """The steps of the workers' "stopped by signal" lines."""
    pattern = re.compile(r"^stopped by signal at step (\d+); checkpoint saved; continue with --resume auto$")
    return [int(m.group(1)) for m in map(pattern.match, lines) if m]


def test_the_front_passes_sigterm_and_ctrl_c_on_and_a_second_signal_stops_at_once(launch_env, fast_overrides,
                                                                                  tmp_path):
    """SIGTERM to the pid of `finetune train` (docker stop, Kubernetes, scancel to the entrypoint): the
    workers save a checkpoint and stop, the front exits 143 without a traceback, no process of the
    launch is left and output_dir is free. Ctrl-C (SIGINT): the same with exit 130 and only the clean
    message. A second signal while the first is being honoured: everything stops at once."""
    out = tmp_path / "run"
    first = start_front(launch_env, fast_overrides, free_port(), out)
    returncode, stderr = signal_the_front(first, out, 1, signal.SIGTERM)
    assert returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert "death signal" not in stderr and "closing signal" not in stderr, stderr  # the launcher's notices
    lines = worker_lines(stderr, -1)
    stopped = stopped_at(lines)
    assert len(stopped) == 1 and sum("stopped by signal" in line for line in lines) == 1, stderr  # by rank 0 only
    stop = stopped[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop:09d}"]
    assert not (out / LOCK_NAME).exists() and not (out / "final").exists()

    # Ctrl-C: continues from the SIGTERM's checkpoint, then stops with one of its own, exit 130
    second = start_front(launch_env, fast_overrides, free_port(), out, "--resume", "auto")
    returncode, stderr = signal_the_front(second, out, stop + 1, signal.SIGINT)
    assert returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    lines = worker_lines(stderr, -1)
    assert "interrupted: stopping with a checkpoint within a step (Ctrl-C again to stop at once, without saving)" \
        in lines, stderr
    stopped = stopped_at(lines)
    assert len(stopped) == 1 and stopped[0] > stop, stderr
    stop2 = stopped[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop:09d}", f"step_{stop2:09d}"]
    assert not (out / LOCK_NAME).exists()

    # a second signal: rank 0 is held inside a step, so the first cannot be honoured; the second stops all
    third = start_front(launch_env, fast_overrides, free_port(), out, "--resume", "auto")
    procs = []
    try:
        wait_for_step(third, out, stop2 + 1)
        procs = descendants(third.pid)
        launcher = [p for p in procs if p.ppid() == third.pid][0]
        rank0 = sorted(p.pid for p in launcher.children())[0]
        os.kill(rank0, signal.SIGSTOP)
        os.kill(third.pid, signal.SIGTERM)
        time.sleep(2)
        assert third.poll() is None  # still waiting for the checkpoint
        t0 = time.monotonic()
        os.kill(third.pid, signal.SIGTERM)
        _, stderr = third.communicate(timeout=60)
        took = time.monotonic() - t0
        assert_all_gone(procs)
    finally:
        kill_all(third, procs)
    assert third.returncode == 143 and took < 15, (third.returncode, took, stderr[-3000:])
    assert "Traceback" not in stderr, stderr
    assert stderr.rstrip().splitlines()[-1].startswith("error: interrupted twice: stopped at once"), stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop:09d}", f"step_{stop2:09d}"]
    assert not (out / LOCK_NAME).exists()


def test_sigterm_during_a_long_eval_and_its_samples_stops_there_with_a_checkpoint(launch_env, fast_overrides,
                                                                                  tmp_path):
    """SIGTERM to `finetune train` as the workers start step 2's eval (every eval row, one a micro-batch:
    100 forwards a rank; then samples of up to 1,000 tokens, which by step 2 end early on EOS): the
    eval (or its samples) ends before the next batch (token), step 2's checkpoint is saved, the front
    exits 143. At f685e70, where stop requests were read only between optimizer steps, the eval and
    its samples ran to their end and the run stopped after step 3 (this test failed there: [3] == [2]).
    A stop within a generation: tests/test_generation.py."""
    out = tmp_path / "run"
    front = start_front(launch_env, fast_overrides, free_port(), out, "eval_every=2", "eval_max_samples=0",
                        "micro_batch_size=1", "sample_max_new_tokens=1000")
    returncode, stderr = signal_the_front(front, out, 2, signal.SIGTERM)  # step 2's record comes before its eval
    assert returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    lines = worker_lines(stderr, -1)
    assert stopped_at(lines) == [2], stderr[-3000:]
    cut = [line for line in lines if line.startswith("step 2: ") and "stopped by a stop request" in line]
    assert len(cut) == 1, stderr[-3000:]  # the eval ("not recorded") or its samples ("not written")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000002"]
    assert not (out / "samples.jsonl").exists() or all(
        json.loads(line)["step"] != 2 for line in (out / "samples.jsonl").read_text().splitlines())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "loss" in r) == 2  # no step after the signal
    assert not (out / LOCK_NAME).exists() and not (out / "final").exists()


# tiny_grpo's prompts, 4 completions each, no eval; a reward function that never returns from its third
# call (the first is the check before the model loads: step 2's rollout)
HANGING_GRPO = ["--recipe", "tiny_grpo", "global_batch_size=4", "num_generations=4", "micro_batch_size=4",
                "max_steps=100", "save_every=100", "eval_every=0", "eval_at_start=false", "log_every=1",
                "max_completion_len=4", "reward_funcs=grpo_rewards:hangs"]


def hang_then_signal(cmd, env, out: Path, signum, ranks: int) -> tuple[subprocess.Popen, str, float]:
    """Starts cmd, waits until every rank is inside the hanging reward function, sends signum to the
    process cmd started; returns the process, its stderr and the seconds from the signal to its exit."""
    env = dict(env, PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'distributed'}", GRPO_HANG_DIR=str(out.parent))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not all((out.parent / f"hanging.{rank}").exists() for rank in range(ranks)):
            assert proc.poll() is None, f"the launch ended early ({proc.returncode}):\n{proc.communicate()[1][-4000:]}"
            assert time.monotonic() < deadline, "the reward function was never called a third time"
            time.sleep(0.1)
        t0 = time.monotonic()
        os.kill(proc.pid, signum)
        _, stderr = proc.communicate(timeout=120)
        return proc, stderr, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_hanging_reward_function_stops_at_the_first_signal(launch_env, tmp_path):
    """SIGTERM to the launcher while both ranks hang inside a reward function (step 2's rollout): the
    workers drop the step, save step 1's checkpoint, let go of output_dir and exit well before torchrun's
    30 s grace ends (before: they never read the request there; torchrun killed both after about 31 s and
    finetune.lock stayed). One process, one Ctrl-C: the same (before: a second Ctrl-C was needed, no
    checkpoint)."""
    out = tmp_path / "two" / "run"
    out.parent.mkdir()
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                free_port(), "finetune/run.py", *HANGING_GRPO, "strategy=ddp", f"output_dir={out}"]
    proc, stderr, took = hang_then_signal(launcher, launch_env, out, signal.SIGTERM, 2)
    lines = worker_lines(stderr, proc.pid)
    assert took < 25, (took, stderr[-3000:])
    assert stopped_at(lines) == [1], stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000001"]
    assert not (out / LOCK_NAME).exists() and not (out / "final").exists()
    assert not any(re.search(r'File ".*/finetune/', line) for line in lines), stderr[-3000:]

    out = tmp_path / "one" / "run"
    out.parent.mkdir()
    proc, stderr, took = hang_then_signal([sys.executable, "finetune/run.py", *HANGING_GRPO, "strategy=ddp",
                                           f"output_dir={out}"], launch_env, out, signal.SIGINT, 1)
    assert "Traceback" not in stderr and took < 25, (proc.returncode, took, stderr[-3000:])
    assert stopped_at(stderr.splitlines()) == [1], stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000001"]
    assert not (out / LOCK_NAME).exists()
