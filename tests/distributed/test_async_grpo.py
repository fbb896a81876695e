"""objective=grpo with generation on processes of its own (rollout_processes=1: 2 training processes + 1
generating process, launched together as 3; finetune/training/rollout_group.py), on recipes/tiny_grpo.py's model
and prompts, under ddp, zero3 and fsdp:

- max_staleness=0 is the synchronous run bit for bit: rollouts.jsonl byte-identical to 2 colocated processes',
  every metric of theirs equal (the split adds its own: staleness, waits, the push check's difference), under ddp
  (the push under zero3's and fsdp's gathers is checked by their lagged runs: the push check at every step);
- max_staleness=1 (each step trains on a rollout generated from the weights the step before started from): the
  launch is the reference of its strategy; a second launch of the same recipe, SIGKILLed as a whole job (the
  launcher first: every process dies at once), resumed from its newest checkpoint (which holds the rollout in
  flight), ends with the reference's rollouts.jsonl byte for byte and its every metric: zero3 killed in turn
  mid-generation, mid-push, mid-step and mid-save, ddp mid-save, fsdp mid-push; 1 training process logs what 2
  do (zero3); a resume on another split (1 trainer + 2 generating processes) continues the same trajectory (ddp);
- faults: a generating process that dies, or whose weights do not take (its push check), stops the run with one
  line naming its rank, its checkpoints intact."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

from conftest import once
from finetune.training.metrics import read_metrics, run_history

# 4 prompts x 4 completions a step at temperature 0.7, 6 steps, a checkpoint after each (a save of the tiny model
# costs 0.15 s; every step a resume point for the kills below); each training process holds 2 prompts' groups
ASYNC = ["global_batch_size=4", "num_generations=4", "micro_batch_size=4", "max_steps=6", "temperature=0.7",
         "save_every=1", "keep_last=10", "log_every=1"]
SPLIT = ["rollout_processes=1"]
LAG = [*SPLIT, "max_staleness=1"]
TIMING = ("tokens_per_s", "rollout_seconds", "peak_memory_gib", "step_seconds", "mfu", "perf/rollout_wait_s",
          "perf/weight_sync_s", "rollout/backpressure_s")


def rollouts_bytes(run) -> bytes:
    return (run.output_dir / "rollouts.jsonl").read_bytes()


def records(run, kind: str = "loss") -> list[dict]:
    history = run_history(read_metrics(run.output_dir / "metrics.jsonl"))
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith(("tokens_per", "checkpoint"))}
            for r in history if kind in r or (kind == "eval" and any(k.startswith("eval_") for k in r))]


@pytest.fixture(scope="module")
def runs(launch):
    """runs(strategy, nprocs, *overrides) -> the uninterrupted launch, once per module."""
    return once(lambda strategy, nprocs, *extra: launch(nprocs, f"strategy={strategy}", *ASYNC, *extra,
                                                        recipe="tiny_grpo"))


def test_no_staleness_is_the_synchronous_run_bit_for_bit(runs, strategy="ddp"):
    colocated, split = runs(strategy, 2), runs(strategy, 3, *SPLIT)
    assert f"{strategy} on 2 cpu process(es)" in split.stderr, "the generating process is not one of the trainers"
    assert rollouts_bytes(split) == rollouts_bytes(colocated)
    lines = [json.loads(line) for line in rollouts_bytes(split).splitlines()]
    assert [x["policy_version"] for x in lines] == [x["step"] - 1 for x in lines], "each step's own weights"
    for want, got in ((records(colocated), records(split)), (records(colocated, "eval"), records(split, "eval"))):
        assert len(got) == len(want) > 0
        for a, b in zip(want, got):
            assert {k: v for k, v in b.items() if k in a} == a
    split_only = records(split)[-1]
    assert split_only["sample/staleness_max"] == 0.0 and split_only["rollout/weight_check_logp_diff"] < 1e-5
    assert "sampling/importance_sampling_ratio/mean" not in split_only, "nothing lags: no correction"


# Each strategy's run killed as a whole job (FINETUNE_FAULT=...:JOBKILL: the launcher, then the process) at these
# places, in turn, each attempt resuming the previous one's newest checkpoint: (fault, the checkpoint it resumes).
# zero3 takes every kill; ddp the save's (which writes the rollouts in flight), fsdp the push's (its gathers). The
# generating process is rank 2.
KILLS = {"zero3": [("rollout_generate:2:2:JOBKILL", 1), ("rollout_push:0:3:JOBKILL", 3),
                   ("before_update:0:5:JOBKILL", 4), ("during_save:0:5:JOBKILL", 4)],
         "ddp": [("during_save:0:4:JOBKILL", 3)],
         "fsdp": [("rollout_push:0:3:JOBKILL", 3)]}


@pytest.mark.parametrize("strategy", list(KILLS))
def test_a_lag_of_one_resumes_exactly_after_a_whole_job_is_killed(runs, launch, strategy, tmp_path_factory):
    """max_staleness=1: the checkpoint at step s holds rollout s (generated from step s - 1's weights, which no
    checkpoint holds); every resume continues the uninterrupted run byte for byte."""
    want = runs(strategy, 3, *LAG)
    lines = [json.loads(line) for line in rollouts_bytes(want).splitlines()]
    assert [x["policy_version"] for x in lines] == [max(0, x["step"] - 2) for x in lines]
    last = records(want)[-1]
    assert last["sample/staleness_max"] == 1.0 and 0 < last["sampling/importance_sampling_ratio/mean"] < 3
    assert 0 <= last["sampling/importance_sampling_clipped"] <= 1
    checks = [r["rollout/weight_check_logp_diff"] for r in records(want)]
    assert checks[-1] is None and all(c < 1e-5 for c in checks[:-1]), "a check at every push; none after the last"
    out = tmp_path_factory.mktemp(f"async-kills-{strategy}")
    # JOBKILL SIGKILLs the rank's parent, which must be the launcher: where the suite forks launches from a server
    # of its own (h55suite's tests/distributed/forkserver.py: a launch(real=...)), the killed launches are real
    real = {"real": True} if "real" in inspect.signature(launch).parameters else {}
    resume = []
    for fault, step in KILLS[strategy]:
        killed = launch(3, f"strategy={strategy}", *ASYNC, *LAG, *resume, output_dir=out, check=False,
                        recipe="tiny_grpo", extra_env={"FINETUNE_FAULT": fault}, **real)
        assert killed.returncode != 0, fault
        held = json.loads((out / "checkpoints" / f"step_{step:09d}" / "in_flight" / "rollouts_in_flight.json").read_text())
        assert [x["rollout"] for x in held["rollouts"]] == [step] and held["next_rollout"] == step + 1
        resume = ["--resume", "auto"]
    done = launch(3, f"strategy={strategy}", *ASYNC, *LAG, *resume, output_dir=out, recipe="tiny_grpo")
    assert f"at step {KILLS[strategy][-1][1]}" in done.stderr
    assert rollouts_bytes(done) == rollouts_bytes(want), "the uninterrupted run's completions, byte for byte"
    assert records(done) == records(want) and records(done, "eval") == records(want, "eval")


def test_one_training_process_logs_what_two_do(runs, strategy="zero3"):
    one, two = runs(strategy, 2, *LAG), runs(strategy, 3, *LAG)
    assert f"{strategy} on 1 cpu process(es)" in one.stderr
    assert rollouts_bytes(one) == rollouts_bytes(two)
    for a, b in zip(records(one), records(two), strict=True):
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)


def test_a_resume_on_another_split_continues_the_trajectory(runs, launch, tmp_path_factory):
    """ddp's step-3 checkpoint (rollout 3 in flight) resumed by 1 training and 2 generating processes."""
    want = runs("ddp", 3, *LAG)
    out = tmp_path_factory.mktemp("async-other-split")
    shutil.copytree(want.output_dir / "checkpoints" / "step_000000003", out / "checkpoints" / "step_000000003")
    shutil.copy(want.output_dir / "rollouts.jsonl", out / "rollouts.jsonl")
    resumed = launch(3, "strategy=ddp", *ASYNC, *LAG, "rollout_processes=2", "--resume", "auto", output_dir=out,
                     recipe="tiny_grpo")
    assert "ddp on 1 cpu process(es)" in resumed.stderr and "at step 3" in resumed.stderr
    assert rollouts_bytes(resumed) == rollouts_bytes(want)
    for a, b in zip(records(resumed), records(want)[3:], strict=True):
        for key, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)


FAULTS = {
    # the generating process SIGKILLed while it generates rollout 3: the trainers find its pid gone
    "dies": ("rollout_generate:1:3:SIGKILL", r"rollout process rank 1 \(pid \d+\) died; the run stopped"),
    # the weights of version 2 received but not loaded: the probe's log-probs differ
    "push that does not take": ("rollout_receive:1:2:SKIP",
                                r"rollout process rank 1 does not hold the pushed weights \(after 2 updates\)"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_generating_process_that_fails_stops_the_run_naming_it(launch, fault, tmp_path_factory):
    """1 training + 1 generating process, max_staleness=1: one error line naming the generating rank; the
    checkpoints written before it intact (the newest resumes)."""
    spec, line = FAULTS[fault]
    out = tmp_path_factory.mktemp("async-fault")
    run = launch(2, "strategy=ddp", *ASYNC, *LAG, output_dir=out, check=False, recipe="tiny_grpo",
                 extra_env={"FINETUNE_FAULT": spec})
    import re

    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert run.returncode != 0 and len(errors) == 1 and re.search(line, errors[0]), run.stderr[-4000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved and all((out / "checkpoints" / name / "manifest.json").is_file() for name in saved)
