"""async_save=true on real 2-process launches, every strategy: a checkpoint written in the background
holds the bytes a synchronous save of the same step holds, and every way a run can end around a
background write leaves complete checkpoints only, from which `--resume auto` continues exactly.

Two launches per strategy, each asserted on by several tests: the first is cut at a fault inside the
background write of step 10 (or, zero2, stopped by SIGTERM while step 5 is still being written); the
second resumes with `--resume auto` (on 2 processes, or on 1 for fsdp and zero3: DCP resharding and
DeepSpeed's universal conversion of an async-saved checkpoint) and finishes. The uninterrupted,
synchronously saved run of each strategy is the suite's shared launch (conftest.strategy_run).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import once
from suite_runs import SAVE
from test_checkpoint import assert_close_after, assert_same_weights, records

ASYNC = [*SAVE, "async_save=true"]
# strategy -> (FINETUNE_FAULT of the first launch, the checkpoint the second resumes from, its processes)
CASES = {
    # SIGKILL of rank 0 before its background write of step 10 wrote any file
    "ddp": ("async_before_shard:0:10", 5, 2),
    # SIGKILL of rank 1 with half of its largest file of step 10 written
    "fsdp": ("async_mid_shard:1:10", 5, 1),
    # SIGKILL of rank 0 once every file of step 10 is written and synced, before it is published
    "zero3": ("async_before_publish:0:10", 5, 1),
    # a full disk in rank 1's background write of step 10: one error line, step 5 intact
    "zero1": ("async_mid_shard:1:10:ENOSPC", 5, 2),
    # SIGTERM after step 7 (all ranks stop after step 8: no eval there for the stop to cut short) while
    # step 5 is still being written (a slow disk: 15 s on rank 0)
    "zero2": ("async_mid_shard:0:5:SLEEP15,after_step:1:7:SIGTERM", 8, 2),
}
STEPS = ["step_000000005", "step_000000010", "step_000000012"]


@pytest.fixture(scope="module")
def cut(launch, tmp_path_factory):
    """cut(strategy) -> the first launch, async_save=true, with the strategy's fault; its `left`: the
    checkpoints directory as that launch left it, `finished` whether it wrote final/, `steps` the steps
    it logged (the resume then writes into the same output_dir)."""
    def make(strategy):
        fault = CASES[strategy][0]
        out = tmp_path_factory.mktemp(f"async-{strategy}")
        run = launch(2, f"strategy={strategy}", *ASYNC, output_dir=out, check=False,
                     extra_env={"FINETUNE_FAULT": fault})
        run.left, run.finished = checkpoint_names(out), (out / "final").exists()
        run.steps = [r["step"] for r in run.train_records]
        return run

    return once(make)


@pytest.fixture(scope="module")
def resumed(launch, cut):
    """resumed(strategy) -> `--resume auto` of the cut launch's output_dir, to the end, async_save=true."""
    def make(strategy):
        first = cut(strategy)
        return launch(CASES[strategy][2], f"strategy={strategy}", *ASYNC, "--resume", "auto",
                      output_dir=first.output_dir)

    return once(make)


class AfterResume:
    """A resumed launch's records after `step` (its output_dir's history also holds the first launch's)."""

    def __init__(self, run, step):
        self.train_records = [r for r in run.train_records if r["step"] > step]
        self.eval_records = [r for r in run.eval_records if r["step"] > step]


def checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def staging_left(out: Path) -> list[Path]:
    from finetune.checkpointing.staging import run_staging_dir

    return list(run_staging_dir(out).glob("*")) if run_staging_dir(out).exists() else []


# ------------------------------------------------------------------ same bytes as a synchronous save


def per_save(rel: str, data: bytes):
    """A file's content less what differs between any two saves of the same state: DCP's .metadata
    records the directory it was written to and a random save_id; Accelerate's random_states_*.pkl
    holds Python's and NumPy's generators, which nothing seeds (the run draws from neither: the
    resumes below are exact); recipe.json names output_dir and async_save; the manifest the seconds,
    its save_id and those files' checksums."""
    name = Path(rel).name
    if name == ".metadata":
        meta = pickle.loads(data)
        meta.storage_meta = None
        return pickle.dumps(meta)
    if name.startswith("random_states_"):
        import io

        states = torch.load(io.BytesIO(data), weights_only=False)
        return {k: v for k, v in states.items() if k not in ("random_state", "numpy_random_seed")}
    if name == "recipe.json":
        return {k: v for k, v in json.loads(data).items() if k not in ("output_dir", "async_save")}
    if name == "manifest.json":
        m = json.loads(data)
        varying = [r for r in m["files"] if Path(r).name in (".metadata", "recipe.json")
                   or Path(r).name.startswith("random_states_")]
        return {k: ({f: v for f, v in m[k].items() if f not in varying} if k in ("files", "checksums") else m[k])
                for k in m if k not in ("seconds", "save_id")}  # save_id: a random id of each save
    return data


def assert_same_checkpoint(sync: Path, background: Path):
    """Every file the manifests list (not the universal conversion a resume on another world size
    adds beside a checkpoint), the same."""
    files = sorted(json.loads((sync / "manifest.json").read_text())["files"]) + ["manifest.json"]
    assert files == sorted(json.loads((background / "manifest.json").read_text())["files"]) + ["manifest.json"]
    for rel in files:
        a, b = per_save(rel, (sync / rel).read_bytes()), per_save(rel, (background / rel).read_bytes())
        if isinstance(a, dict) and any(torch.is_tensor(v) for v in a.values()):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                                for k in a), rel
        else:
            assert a == b, f"{rel} differs from the synchronous save's"


@pytest.mark.parametrize("strategy", list(CASES))
def test_async_checkpoint_holds_the_synchronous_bytes(strategy, resumed, strategy_run):
    """On 2 processes both launches' checkpoints (10 and 12 written after the resume); after a resume on
    1 process, the first launch's step 5."""
    out = resumed(strategy).output_dir
    sync = strategy_run(strategy).output_dir / "checkpoints"
    names = [n for n in checkpoint_names(out) if (sync / n).is_dir()]
    if CASES[strategy][2] == 1:
        names = ["step_000000005"]
    assert len(names) >= (1 if CASES[strategy][2] == 1 else 2), names
    for name in names:
        assert_same_checkpoint(sync / name, out / "checkpoints" / name)


# ------------------------------------------------------------------ faults inside the background write


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_sigkill_in_the_background_write_leaves_the_previous_checkpoint(strategy, cut, resumed, strategy_run):
    first = cut(strategy)
    out = first.output_dir
    assert first.returncode != 0, "a killed rank must fail the launch"
    # step 10 never became a checkpoint: its .partial directory is all there is of it
    assert first.left == [".step_000000010.partial", "step_000000005"]
    second = resumed(strategy)
    assert f"ignoring incomplete checkpoint {out / 'checkpoints' / '.step_000000010.partial'}" in second.stderr
    assert f"resumed from {out / 'checkpoints' / 'step_000000005'} at step 5" in second.stderr
    reference = strategy_run(strategy)
    if CASES[strategy][2] == 2:
        assert records(second) == records(reference), "a resumed run must log exactly what the uninterrupted one did"
        assert_same_weights(out / "final", reference.output_dir / "final")
    else:  # 2 -> 1 processes: sums in another order (test_checkpoint.test_two_processes_to_one)
        assert "(2 -> 1 processes)" in second.stderr
        assert [r for r in records(second) if r[0] <= 5] == [r for r in records(reference) if r[0] <= 5]
        assert_close_after(AfterResume(second, 5), reference, 5)
    assert checkpoint_names(out) == STEPS, "keep_last=3 of complete checkpoints, no partial one left"
    assert not staging_left(out), "the staging in host memory is removed (the resumed run removes the killed one's)"


def test_full_disk_in_the_background_write_is_one_line(cut, resumed, strategy_run):
    first = cut("zero1")
    out = first.output_dir
    assert first.returncode != 0
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(e == errors[0] for e in errors), errors  # the same line on every rank
    assert "saving checkpoint step_000000010" in errors[0] and "the filesystem is full" in errors[0]
    assert f"{out / 'checkpoints' / 'step_000000005'}, is intact" in errors[0]
    # no rank crashed (the one traceback is the launcher's report that its workers exited with 2)
    assert "error: rank" not in first.stderr and first.stderr.count("Traceback") <= 1
    # the run stopped at a step boundary after the failed save: no later save, no final model
    assert max(first.steps) >= 10
    assert first.left == ["step_000000005"]
    assert not first.finished
    second = resumed("zero1")
    assert records(second) == records(strategy_run("zero1"))


def test_sigterm_with_a_write_in_flight_saves_and_resumes_exactly(cut, resumed, strategy_run):
    first = cut("zero2")
    out = first.output_dir
    assert first.returncode == 0, first.stderr[-3000:]
    assert "waited" in first.stderr and "for checkpoint step_000000005's background write" in first.stderr
    assert first.left == ["step_000000005", "step_000000008"]
    assert first.stderr.count("stopped by signal") == 1, first.stderr[-3000:]  # SIGTERM to rank 1: said once
    assert "stopped by signal at step 8" in first.stderr
    second = resumed("zero2")
    assert f"resumed from {out / 'checkpoints' / 'step_000000008'} at step 8" in second.stderr
    assert records(second) == records(strategy_run("zero2"))
    assert_same_weights(out / "final", strategy_run("zero2").output_dir / "final")


def test_each_save_reports_blocking_and_background_seconds(resumed):
    out = resumed("ddp").output_dir
    saves = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"checkpoint"' in line]
    assert [s["step"] for s in saves][-2:] == [10, 12]
    assert all(s["checkpoint_blocking_s"] > 0 and s["checkpoint_background_s"] > 0 for s in saves)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["async_save"] is True and summary["checkpoint_saves"] == 2
    assert summary["checkpoint_background_seconds"] > 0
    assert "s blocking" in resumed("ddp").stderr and "s in the background" in resumed("ddp").stderr
    assert "async_save since the resume: 2 save(s), " in resumed("ddp").stderr  # this launch's, not the run's


def test_a_user_error_with_a_write_in_flight_waits_and_publishes_it(launch, tmp_path):
    """lr=1e30 diverges: steps 3 and 4 are skipped (max_nonfinite_steps=2), step 5 stops the run with one
    error line on every rank alike, while the save of step 4 is still being written (15 s on rank 0).
    Every rank waits for its own write on the way out; rank 0 publishes the checkpoint once every rank's
    marker says its write finished (no collective: the ranks are leaving after an error)."""
    out = tmp_path / "out"
    run = launch(2, "strategy=fsdp", "lr=1e30", "save_every=2", "max_nonfinite_steps=2", "async_save=true",
                 output_dir=out, check=False, extra_env={"FINETUNE_FAULT": "async_mid_shard:0:4:SLEEP15"})
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 5: loss nan"), run.stderr[-4000:]
    assert "waiting (at most 1800s) for checkpoint step_000000004's background write before exiting" in run.stderr
    assert f"checkpoint {out / 'checkpoints' / 'step_000000004'} published" in run.stderr
    assert checkpoint_names(out) == ["step_000000002", "step_000000004"]
    from finetune.checkpointing.manifest import verify

    verify(out / "checkpoints" / "step_000000004", checksums=True)  # whole: every file, size and checksum
    assert not staging_left(out)
