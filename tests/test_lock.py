"""The output_dir lock (finetune/lock.py) with real processes: a live holder is refused by name and
nothing changes on disk; a dead holder on this machine is taken over with a line; a lock from
another host never is; racing takers of one stale lock end with exactly one owner; and the lineage
rule for --resume PATH."""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import lock as L
from finetune.checkpointing.resume import check_lineage
from finetune.recipe import RecipeError


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def lock_info(**changes) -> dict:
    """A lock as this machine would write it for a process of ours, with some fields changed."""
    info = {"pid": os.getpid(), "started": "2026-01-01 00:00:00 +0000", "command": "finetune/run.py --recipe tiny",
            "launch": "127.0.0.1:29500:none", "slurm_job": None, "proc_start": L._process_start(os.getpid()),
            **L._machine()}
    return info | changes


def plant(output_dir: Path, info: dict) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / L.LOCK_NAME
    path.write_text(json.dumps(info))
    return path


@pytest.fixture
def sleeper():
    """A live process that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_writes_owner_and_release_removes_it(tmp_path):
    out = tmp_path / "a" / "b"
    lock = L.OutputDirLock(out).acquire(command=["finetune/run.py", "--recipe", "tiny"])
    info = json.loads((out / L.LOCK_NAME).read_text())
    assert info["pid"] == os.getpid() and info["host"] == L._machine()["host"]
    assert info["command"] == "finetune/run.py --recipe tiny" and info["started"]
    lock.release()
    assert not (out / L.LOCK_NAME).exists() and out.is_dir()  # the run's directory stays
    lock.release()  # idempotent


def test_live_holder_is_refused_by_name_and_nothing_changes(tmp_path, sleeper):
    out = tmp_path / "run"
    plant(out, lock_info(pid=sleeper.pid, proc_start=L._process_start(sleeper.pid)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(tmp_path)
    with pytest.raises(L.BusyError) as info:
        L.OutputDirLock(out).acquire()
    message = str(info.value)
    assert f"output_dir={out} is in use by another run: pid {sleeper.pid} on host {L._machine()['host']}" in message
    assert "finetune/run.py --recipe tiny" in message and f"kill -TERM {sleeper.pid}" in message
    assert "\n" not in message and isinstance(info.value, RecipeError)
    assert snapshot(tmp_path) == before


def test_dead_holder_on_this_machine_is_taken_over_with_a_line(tmp_path, dead_pid):
    out = tmp_path / "run"
    plant(out, lock_info(pid=dead_pid))
    lines = []
    lock = L.OutputDirLock(out).acquire(log=lines.append)
    assert len(lines) == 1 and "taking over the lock of a run that is gone" in lines[0]
    assert f"pid {dead_pid}" in lines[0]
    assert json.loads((out / L.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert [p.name for p in out.iterdir()] == [L.LOCK_NAME]  # the stale lock was not left aside
    lock.release()


def test_reused_pid_counts_as_gone(tmp_path, sleeper):
    """The holder's pid now belongs to another process (another start time): the holder is gone."""
    out = tmp_path / "run"
    plant(out, lock_info(pid=sleeper.pid, proc_start="1"))
    lines = []
    L.OutputDirLock(out).acquire(log=lines.append).release()
    assert "taking over" in lines[0]


def test_a_killed_holder_not_yet_reaped_counts_as_gone(tmp_path):
    """A resume right after a SIGKILL: the killed rank is a zombie until its launcher reaps it (its pid and
    start time still in /proc). It was refused as "in use by another run: pid N"; it has ended."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = L._process_start(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # not waited for: a zombie until proc.wait() below
        deadline = time.monotonic() + 10
        while L._read(f"/proc/{proc.pid}/stat").rsplit(")", 1)[-1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed process never became a zombie"
            time.sleep(0.01)
        out = tmp_path / "run"
        plant(out, lock_info(pid=proc.pid, proc_start=started))
        assert L._process_start(proc.pid) == started  # the pid and its start time are still there
        L.check_not_busy(out, env={})  # the other ranks and the front agree with rank 0
        lines = []
        L.OutputDirLock(out).acquire(log=lines.append).release()
        assert len(lines) == 1 and "taking over the lock of a run that is gone" in lines[0]
    finally:
        proc.wait()


def test_lock_from_another_boot_or_pid_namespace_is_not_guessed(tmp_path, dead_pid):
    """Same host name, another boot or container: its pids mean nothing here, so never taken over."""
    out = tmp_path / "run"
    plant(out, lock_info(pid=dead_pid, boot_id="another-boot"))
    with pytest.raises(L.BusyError):
        L.OutputDirLock(out).acquire()
    plant(out, lock_info(pid=dead_pid, pid_ns="pid:[1]"))
    with pytest.raises(L.BusyError):
        L.OutputDirLock(out).acquire()


def test_other_host_is_never_taken_over(tmp_path, dead_pid):
    out = tmp_path / "run"
    path = plant(out, lock_info(pid=dead_pid, host="gpu-node-7", boot_id="x", pid_ns="y"))
    before = snapshot(tmp_path)
    with pytest.raises(L.BusyError) as info:
        L.OutputDirLock(out).acquire()
    message = str(info.value)
    assert f"pid {dead_pid} on host gpu-node-7" in message
    assert f"if it is gone, delete {path}" in message
    assert snapshot(tmp_path) == before


def test_requeued_slurm_job_takes_over_its_own_lock_from_another_host(tmp_path, dead_pid):
    out = tmp_path / "run"
    plant(out, lock_info(pid=dead_pid, host="gpu-node-7", boot_id="x", pid_ns="y", slurm_job="4242"))
    lines = []
    L.OutputDirLock(out).acquire(log=lines.append, env={"SLURM_JOB_ID": "4242"}).release()
    assert "taking over" in lines[0]
    plant(out, lock_info(pid=dead_pid, host="gpu-node-7", boot_id="x", pid_ns="y", slurm_job="4242"))
    with pytest.raises(L.BusyError):  # another job
        L.OutputDirLock(out).acquire(env={"SLURM_JOB_ID": "4243"})


def test_unreadable_lock_is_refused_with_the_fix(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / L.LOCK_NAME).write_text("")
    with pytest.raises(L.BusyError) as info:
        L.OutputDirLock(out).acquire()
    assert "holds no readable owner" in str(info.value) and f"delete {out / L.LOCK_NAME}" in str(info.value)


def test_abandon_leaves_no_directory_behind(tmp_path):
    """Directories made to hold the lock are removed again when the run stops before writing."""
    out = tmp_path / "new" / "run"
    lock = L.OutputDirLock(out).acquire()
    lock.abandon()
    assert not (tmp_path / "new").exists()


def _race(out, barrier, results, done):
    barrier.wait()
    try:
        L.OutputDirLock(Path(out)).acquire(log=lambda m: None)
        results.put(("won", os.getpid()))
    except L.BusyError:
        results.put(("busy", os.getpid()))
    done.wait(60)  # keep the winner alive until every racer has looked


@pytest.mark.parametrize("round_", range(20))
def test_racing_takers_of_a_stale_lock_end_with_one_owner(round_, tmp_path, dead_pid):
    """12 runs break one stale lock at once, 20 times: a lock moved aside and put back let a third run in,
    in about 1 race of 30 (measured), so 20 rounds catch such a window about half the time."""
    out = tmp_path / "run"
    plant(out, lock_info(pid=dead_pid))
    ctx = multiprocessing.get_context("fork")
    n = 12
    barrier, results, done = ctx.Barrier(n), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_race, args=(str(out), barrier, results, done)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in range(n)]
    winners = [pid for what, pid in outcomes if what == "won"]
    owner = json.loads((out / L.LOCK_NAME).read_text())["pid"]
    done.set()
    for p in procs:
        p.join(30)
    assert len(winners) == 1 and owner == winners[0], outcomes
    assert sorted(p.name for p in out.iterdir()) == [L.LOCK_NAME]


def test_other_ranks_refuse_exactly_when_rank_0_will(tmp_path, sleeper, dead_pid):
    out = tmp_path / "run"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
    L.check_not_busy(out, env)  # no lock yet: rank 0 decides
    live = lock_info(pid=sleeper.pid, proc_start=L._process_start(sleeper.pid))
    plant(out, live | {"launch": L.launch_id(env)})
    L.check_not_busy(out, env)  # our own launch's lock
    plant(out, live | {"launch": "127.0.0.1:29600:none"})
    with pytest.raises(L.BusyError):
        L.check_not_busy(out, env)
    plant(out, lock_info(pid=dead_pid, launch="127.0.0.1:29600:none"))
    L.check_not_busy(out, env)  # stale: rank 0 takes it over
    plant(out, live | {"launch": "127.0.0.1:29600:none", "host": "elsewhere"})
    L.check_not_busy(out, env)  # not checkable here: rank 0 decides (and refuses)


def _checkpoints(root: Path, *steps: int) -> list[Path]:
    paths = []
    for step in steps:
        p = root / "checkpoints" / f"step_{step:09d}"
        p.mkdir(parents=True)
        (p / "manifest.json").write_text("{}")
        paths.append(p)
    return paths


def test_resume_never_continues_into_another_runs_checkpoints(tmp_path):
    mine = _checkpoints(tmp_path / "mine", 5, 10)
    other = _checkpoints(tmp_path / "other", 5)
    check_lineage("auto", tmp_path / "mine", mine)
    check_lineage(str(other[0]), tmp_path / "empty", [])  # into an output_dir without checkpoints
    check_lineage(str(mine[1]), tmp_path / "mine", mine)  # the newest of its own output_dir
    with pytest.raises(RecipeError) as info:
        check_lineage(str(other[0]), tmp_path / "mine", mine)
    assert "already holds checkpoints of another run (step_000000005, step_000000010)" in str(info.value)
    with pytest.raises(RecipeError) as info:
        check_lineage(str(mine[0]), tmp_path / "mine", mine)
    assert "newer checkpoints (step_000000010)" in str(info.value) and "move them out" in str(info.value)
