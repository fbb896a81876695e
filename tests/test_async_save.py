"""async_save's parts that need no launch: the background writer on real files (what it writes, its
checksums, its faults), the planner's staging bytes and the refusal where host memory cannot hold
them. The launches are tests/distributed/test_async_checkpoint.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from finetune import arch as A
from finetune import memory as M
from finetune.checkpointing import staging as S
from finetune.checkpointing import background as B
from finetune.checkpointing.checkpoint import first_failure
from finetune.checkpointing.manifest import file_checksums
from finetune.faults import fault_point
from finetune.recipe import apply_overrides, load_recipe_module


def staged_files(root):
    (root / "sub").mkdir(parents=True)
    (root / "big.bin").write_bytes(os.urandom(3 * B.BLOCK + 12345))  # more than one copy block, odd size
    (root / "sub" / "small.json").write_text('{"a": 1}\n')
    (root / "empty").write_bytes(b"")
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def write(tmp_path, step=5):
    staged, partial = tmp_path / "stage" / "step.rank_0", tmp_path / "ckpt" / ".step.partial"
    content = staged_files(staged)
    partial.mkdir(parents=True)
    w = B.BackgroundWrite(step, "step_000000005", 0, staged, partial, blocking_s=0.1, describe=first_failure)
    w.start()
    assert w.join(60)
    return w, content, staged, partial


def test_background_write_copies_every_staged_file_with_its_checksum(tmp_path):
    w, content, staged, partial = write(tmp_path)
    assert w.error is None and w.nbytes == sum(len(v) for v in content.values())
    for rel, data in content.items():
        assert (partial / rel).read_bytes() == data
    assert w.checksums == file_checksums(partial, sorted(content))  # what the manifest's checksums are
    assert not staged.exists(), "the staging in host memory is freed once written"
    assert B.read_markers(partial, 1) == w.checksums and B.read_markers(partial, 2) is None
    B.remove_markers(partial)
    assert sorted(p.relative_to(partial).as_posix() for p in partial.rglob("*") if p.is_file()) == sorted(content)


def test_background_write_of_a_full_disk_is_an_error_not_an_exception(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_FAULT", "async_mid_shard:0:5:ENOSPC")
    w, _, staged, _ = write(tmp_path)
    assert w.error is not None and w.error.startswith("the filesystem is full") and "No space left" in w.error
    assert not staged.exists()


def test_a_write_that_cannot_create_its_files_fails_with_the_os_error(tmp_path):
    staged, partial = tmp_path / "stage", tmp_path / "gone" / ".partial"
    staged_files(staged)
    (tmp_path / "gone").write_text("a file where the checkpoint directory should be")
    w = B.BackgroundWrite(5, "step_000000005", 0, staged, partial, blocking_s=0.1)
    w.start()
    assert w.join(60) and w.error and "Error" in w.error


def test_faults_several_at_once_and_a_slow_disk(monkeypatch):
    monkeypatch.setenv("FINETUNE_FAULT", "after_step:0:9:RAISE,async_before_shard:1:5:SLEEP0.3")
    t0 = time.perf_counter()
    fault_point("async_before_shard", 1, 5)
    assert time.perf_counter() - t0 >= 0.3
    fault_point("async_before_shard", 0, 5)  # another rank: nothing
    with pytest.raises(RuntimeError, match="injected fault"):
        fault_point("after_step", 0, 9)


# ---------------------------------------------------------------- the planner and the refusal



@pytest.mark.parametrize("strategy,n,sharded", [("ddp", 8, False), ("fsdp", 8, True), ("zero3", 8, True),
                                                ("zero2", 8, True)])
def test_staging_is_the_ranks_part_of_a_checkpoint_in_the_cpu_column(strategy, n, sharded):
    arch = A.load_architecture("meta-llama/Meta-Llama-3.1-8B-Instruct")
    off = M.estimate(arch, M.Setup(strategy), world_size=n, mixed_precision="bf16")
    on = M.estimate(arch, M.Setup(strategy), world_size=n, mixed_precision="bf16", async_save=True)
    pb, _, ob = M.strategy_for(strategy).state_bytes("bf16")
    params = arch.num_parameters()
    weights = params * pb / (n if M.strategy_for(strategy).shards_params else 1)
    optimizer = params * ob / (n if sharded else 1)
    want = weights + optimizer
    tmpfs = max(weights, optimizer) if strategy == "fsdp" else 0  # each DCP save's files pass through the tmpfs
    assert on.staging == round(want + tmpfs) and on.cpu - off.cpu == on.staging
    assert on.staging_tmpfs == round(tmpfs), "only fsdp's DCP files need room in the staging tmpfs"
    assert on.peak == off.peak, "staging is host memory, not GPU memory"


def recipe(*overrides):
    return apply_overrides(load_recipe_module("tiny"), ["mixed_precision=no", *overrides])


def test_async_save_that_does_not_fit_host_memory_is_refused_with_the_numbers(tmp_path):
    from in_process import run_main

    args = ["--recipe", "tiny", "mixed_precision=no", "model=meta-llama/Llama-2-70b-hf", "async_save=true",
            "strategy=ddp", f"output_dir={tmp_path / 'out'}"]
    code, _, err = run_main(args)
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: async_save=true keeps a copy of each checkpoint in host memory: "), \
        err[-2000:]
    assert "GiB on this node" in line and "GiB of memory available" in line and "async_save=false" in line
    staged = float(line.split("memory: ")[1].split(" GiB")[0])
    assert staged == pytest.approx(68_976_648_192 * 12 / 2**30, rel=1e-3)  # fp32 weights and Adam, whole on rank 0
    code, out, _ = run_main([*args, "--dry-run"])  # the dry run says it instead
    assert code == 0 and "not runnable on this machine: async_save=true keeps a copy of each checkpoint" in out
    assert S.staging_problem(recipe("async_save=true"), 2, 2) is None  # the tiny model's fits
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_memory_and_tmpfs_are_asked_for_what_each_holds(tmp_path):
    """The snapshot is process memory (the host's available memory bounds it); only fsdp's DCP files pass
    through the staging tmpfs (its free space bounds them), here a real directory's free space."""
    import shutil

    free, available = shutil.disk_usage(tmp_path).free, S.mem_available()
    assert S.host_memory_problem(available // 2, 0, staging=tmp_path) is None
    assert "GiB of memory available" in S.host_memory_problem(available + 2**30, 0, staging=tmp_path)
    problem = S.host_memory_problem(1, free + 2**30, staging=tmp_path)
    assert problem.startswith("async_save=true writes fsdp's checkpoint files through") and "GiB free" in problem
    assert "FINETUNE_STAGING_DIR" in problem


def test_no_staging_directory_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("FINETUNE_STAGING_DIR", str(tmp_path / "absent"))
    assert "FINETUNE_STAGING_DIR to a writable tmpfs directory" in S.staging_problem(recipe("async_save=true"), 1, 1)


def test_unusable_staging_is_refused_before_the_launch(monkeypatch, tmp_path):
    """A staging path that is a file, or a read-only directory, passed the check before the launch and
    failed the first save after training started; now the run (and the front) refuse it with one line."""
    from in_process import run_main
    from test_cli import _make_read_only, _undo_read_only

    a_file, read_only = tmp_path / "a_file", tmp_path / "read-only"
    a_file.write_text("")
    _make_read_only(read_only)
    try:
        for staging, words in ((a_file, "which is a file"), (read_only, "which is not writable")):
            monkeypatch.setenv("FINETUNE_STAGING_DIR", str(staging))
            code, _, err = run_main(["--recipe", "tiny", "async_save=true", f"output_dir={tmp_path / 'out'}"])
            assert code == 2 and err.strip().splitlines() == [
                f"error: async_save=true stages each checkpoint in host memory under {staging} (FINETUNE_STAGING_DIR), "
                f"{words}" + (" (permissions or a read-only filesystem)" if staging == read_only else "")
                + "; set FINETUNE_STAGING_DIR to a writable tmpfs directory, or async_save=false"], err
            assert S.staging_problem(recipe("async_save=false"), 1, 1) is None  # only async_save stages
    finally:
        _undo_read_only(read_only)
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_small_staging_tmpfs_is_said_in_mib(monkeypatch, tmp_path):
    """A container's default 64 MiB /dev/shm, nearly full: the numbers in MiB, not "0.00 GiB"."""
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 63 << 20, 1 << 20))
    problem = S.host_memory_problem(1, 5 << 20, staging=tmp_path)
    assert ": 5.0 MiB on this node at once, but it has 1.0 MiB free;" in problem, problem
    assert S.bytes_text(3 << 30) == "3.00 GiB" and S.bytes_text(1023 << 20) == "1023.0 MiB"


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", "0"])
def test_a_bad_async_wait_is_one_line_naming_the_variable(monkeypatch, tmp_path, value):
    """FINETUNE_ASYNC_WAIT_S was read at import (a bare ValueError in every run, async_save or not): now it
    is read where it is used, and refused before the launch of an async_save run, naming it and its value."""
    from in_process import run_main

    monkeypatch.setenv("FINETUNE_ASYNC_WAIT_S", value)
    with pytest.raises(S.RecipeError, match=f"FINETUNE_ASYNC_WAIT_S='{value}': not a positive number of seconds"):
        S.wait_limit_s()
    code, _, err = run_main(["--recipe", "tiny", "async_save=true", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and err.strip().splitlines() == [f"error: FINETUNE_ASYNC_WAIT_S='{value}': not a positive number "
                                                      "of seconds; set it to how long the end of a run waits for a "
                                                      "background checkpoint write (default 1800), or unset it"], err
    assert S.staging_problem(recipe("async_save=false"), 1, 1) is None  # a run without async_save never reads it
    monkeypatch.setenv("FINETUNE_ASYNC_WAIT_S", " 90 ")
    assert S.wait_limit_s() == 90.0


def test_staging_directory_is_one_per_output_dir(tmp_path):
    assert S.run_staging_dir(tmp_path / "a") != S.run_staging_dir(tmp_path / "b")
    assert S.run_staging_dir(tmp_path / "a") == S.run_staging_dir(tmp_path / "x" / ".." / "a")


def test_a_staging_directory_another_could_write_or_read_is_refused(monkeypatch, tmp_path):
    """The run's staging directory in a shared tmpfs is this user's alone (0700): one that another user made
    first, one anyone may write, or a link at its name is refused in one line, before the launch
    (staging_problem) and at the save (claim_staging_dir), rather than staged into: whoever holds it could
    read the checkpoint or plant files that the background write copies into it."""
    import os

    monkeypatch.setenv("FINETUNE_STAGING_DIR", str(tmp_path))
    r = recipe("async_save=true", f"output_dir={tmp_path / 'out'}")
    staging = S.run_staging_dir(r.output_dir)
    assert S.staging_problem(r, 1, 1) is None and not staging.exists()
    S.claim_staging_dir(staging)
    assert staging.is_dir() and staging.stat().st_mode & 0o777 == 0o700
    S.claim_staging_dir(staging)  # again: its own
    staging.chmod(0o777)
    assert "may be written by others (mode 777)" in S.staging_problem(r, 1, 1)
    with pytest.raises(S.RecipeError, match="may be written by others"):
        S.claim_staging_dir(staging)
    staging.rmdir()
    (tmp_path / "elsewhere").mkdir()
    staging.symlink_to(tmp_path / "elsewhere")
    assert "is not a directory (a link)" in S.staging_problem(r, 1, 1)
    staging.unlink()
    if os.getuid() == 0:  # as root, a directory of another user can be made here
        staging.mkdir(mode=0o700)
        os.chown(staging, 12345, 12345)
        assert "belongs to another user (uid 12345)" in S.staging_problem(r, 1, 1)
        with pytest.raises(S.RecipeError) as e:
            S.claim_staging_dir(staging)
        assert str(e.value).endswith("set FINETUNE_STAGING_DIR to a directory of your own") and "\n" not in str(e.value)


# ---------------------------------------------------------------- the universal conversion's workers


def test_conversion_workers_one_per_cpu_up_to_the_ranks_and_the_memory():
    from finetune.checkpointing.resume import ResumePoint, conversion_workers

    files = {f"pytorch_model/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 2**30 for r in range(8)}
    point = ResumePoint(path=None, step=5, world_size=8, global_batch_size=16, strategy="zero2", recipe={},
                        manifest={"files": files})
    gib = 2**30
    assert conversion_workers(point, cpus=16, available=100 * gib) == ["--num_extract_workers", "8",
                                                                        "--num_merge_workers", "8"]
    assert conversion_workers(point, cpus=2, available=100 * gib)[1] == "2"  # the CPUs
    assert conversion_workers(point, cpus=16, available=7 * gib)[1] == "2"  # 3 GiB a worker
    assert conversion_workers(point, cpus=16, available=gib)[1] == "1"  # never fewer than one


def test_the_background_writer_yields_the_cpu_to_training():
    """The writer's thread runs at a nice value 10 above the training thread's (Linux: per thread), and
    the training thread's own priority is untouched."""
    import os
    import threading

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def writer():
        B.lower_this_threads_priority()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen["nice"] == min(19, main + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
