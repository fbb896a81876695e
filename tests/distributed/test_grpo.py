"""objective=grpo on real launches (recipes/tiny_grpo.py's model and prompts, shortened): the rollouts
of 2 processes under ZeRO-3 and FSDP equal those of 1 process (identical completions, token for token,
rewards and advantages in rollouts.jsonl; the loss and metrics within 1e-5), with num_iterations=2
(one rollout serves two optimizer steps, its old log-probs kept) and beta > 0 (a frozen reference:
partitioned by ZeRO-3, sharded by FSDP); a SIGKILLed ZeRO-3 run resumed inside a rollout logs and
samples exactly what the uninterrupted one did, and resumed on 1 process logs and samples what the
2-process run did; LoRA under FSDP with a reward model (a sequence-classification directory) as one
reward function samples, scores and trains on 2 processes as on 1; a RewardModel as a reward function
under ZeRO-3 on 2 processes scores as the directory does in this process; a reward function that raises stops the run with one
line naming the step, the function and the prompt, its last checkpoint intact. Every launch but the last
evaluates at steps 0, 3 and 6 (the eval prompts' completions sampled and scored): the eval records of 2
processes equal those of 1, and a resumed run's those of the uninterrupted one."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from conftest import REPO
from finetune.training.metrics import read_metrics, run_history

# 4 prompts x 4 completions a step at temperature 0.7 (the loss, old and reference log-probs of the logits
# / 0.7 under every strategy); each of 2 processes holds 2 prompts' groups in 2 micro-batches
# evaluated at steps 0, 3 and 6 on an eval dataset (the training prompts' first 5: the training rows stay
# all 4000), 5 prompts x 4 completions in batches of a rollout's 4 prompts (the second batch's one prompt on
# rank 0, none on rank 1)
GRPO = ["global_batch_size=4", "num_generations=4", "micro_batch_size=4", "max_steps=6", "num_iterations=2",
        "beta=0.04", "temperature=0.7", "eval_fraction=0", "eval_dataset=builtin:tiny-prompts", "eval_max_samples=5", "eval_every=3",
        "eval_at_start=true",
        "save_every=3", "keep_last=3", "loss_chunk_tokens=8", "log_every=1"]
TIMING = ("tokens_per_s", "rollout_seconds", "peak_memory_gib", "step_seconds", "mfu")


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def records(run) -> list[dict]:
    history = run_history(read_metrics(run.output_dir / "metrics.jsonl"))
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("tokens_per")}
            for r in history if "loss" in r]


def eval_records(run) -> list[dict]:
    """The eval records of the run's history: its eval prompts' completions scored (no eval loss)."""
    return [r for r in run_history(read_metrics(run.output_dir / "metrics.jsonl"))
            if any(k.startswith("eval_") for k in r)]


@pytest.fixture(scope="module")
def grpo_run(launch):
    runs = {}

    def get(strategy: str, nprocs: int, *extra: str):
        if (strategy, nprocs, *extra) not in runs:
            runs[strategy, nprocs, *extra] = launch(nprocs, f"strategy={strategy}", *GRPO, *extra, recipe="tiny_grpo")
        return runs[strategy, nprocs, *extra]

    return get


def assert_same_run(got, want, tolerance=1e-5, reward="exact_match", steps=6):
    assert rollouts(got) == rollouts(want), "the same completions, rewards and advantages"
    a, b = records(got), records(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if isinstance(v, float):
                assert v == pytest.approx(y[k], abs=tolerance, rel=tolerance), (x["step"], k, v, y[k])
    # the eval samples the same completions (seeded per eval prompt and completion), scored alike
    evals = eval_records(got)
    assert [r["step"] for r in evals] == [0, 3, 6][:1 + steps // 3] and evals == eval_records(want)
    assert all("eval_loss" not in r and math.isfinite(v) for r in evals for k, v in r.items())
    assert {"eval_reward", "eval_reward_std", f"eval_rewards/{reward}/mean", f"eval_rewards/{reward}/std",
            "eval_completions/mean_length"} <= set(evals[0])


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_two_processes_sample_and_train_as_one(grpo_run, strategy):
    one, two = grpo_run("ddp", 1), grpo_run(strategy, 2)
    assert f"{strategy} on 2" in two.stderr
    lines = rollouts(one)
    # every step's 16 completions, written at each rollout's first step (num_iterations=2: steps 1, 3, 5)
    assert [r["step"] for r in lines] == [1] * 16 + [3] * 16 + [5] * 16
    assert len({r["row"] for r in lines}) == 12 and all(r["completion_ids"] for r in lines)
    assert all(set(r["rewards"]) == {"exact_match", "char_match", "answer_chars"} for r in lines)
    for step in (1, 3, 5):  # the advantages are group-relative: each group's sum to 0
        group = [r["advantage"] for r in lines if r["step"] == step][:4]
        assert abs(sum(group)) < 1e-4
    assert_same_run(two, one)
    recs = records(one)
    assert recs[0]["kl"] == 0.0 and recs[1]["kl"] > 0, "the policy moved from its reference after one step"
    assert recs[0]["reward"] == recs[1]["reward"], "steps 1 and 2 train on the same rollout"
    evals = eval_records(one)
    assert 0 < evals[0]["eval_completions/mean_length"] <= 8 and evals[0]["eval_reward"] > 0
    assert f"step 3: eval reward {evals[1]['eval_reward']:.4f}" in two.stderr
    summary = json.loads((two.output_dir / "summary.json").read_text())
    assert summary["final_eval_reward"] == evals[2]["eval_reward"] and summary["final_eval_loss"] is None
    assert "eval metrics" in two.stderr and "eval loss" not in two.stderr
    # why the loss shown is about 0, said once (beta > 0 here: its KL term too)
    assert two.stderr.count("note: the loss shown stays about 0 whatever the policy learns") == 1
    assert "plus beta=" in two.stderr
    assert all(0 <= r["completions/clipped_ratio"] <= 1 and r["completions/max_length"] <= 8 for r in recs)


SP2 = "sequence_parallel=2"
# Adam divides each gradient component by its size + adam_eps: components whose terms nearly cancel (a
# group's advantages sum to 0) are float noise of about 1e-9, which the shards sum in another order, and at
# eps=1e-8 that noise moves the update: measured kl 4.6e-5 apart at step 3 (1.5e-3 relative; 1.4e-7 with
# beta=0). At adam_eps=1e-5 SP 2 logs the 1-process curve within 8e-7 relative for every loss type.
SP_EXACT = ("adam_eps=1e-5",)
# GRPO's loss with sequence-level importance ratios (GSPO), 3 steps: the other per-completion sums under SP
SEQUENCE_LEVEL = (*SP_EXACT, "loss_type=grpo", "importance_sampling_level=sequence", "max_steps=3")


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_sequence_parallel_2_samples_and_trains_as_one_process(grpo_run, strategy):
    """2 processes with sequence_parallel=2 (one data-parallel rank; each completion's row split in two for
    the loss, the sampling and the old and reference log-probs on whole rows): the 1-process run's
    completions, rewards and advantages, loss and metrics within 1e-5, evals alike; dapo (the recipe's)
    with num_iterations=2 and beta > 0 over 6 steps, and (zero3) grpo at the sequence level over 3."""
    sp = grpo_run(strategy, 2, SP2, *SP_EXACT)
    resolved = json.loads((sp.output_dir / "recipe.json").read_text())
    assert (resolved["sequence_parallel"], resolved["world_size"], resolved["loss_type"]) == (2, 2, "dapo")
    assert_same_run(sp, grpo_run("ddp", 1, *SP_EXACT))
    if strategy == "zero3":
        assert_same_run(grpo_run(strategy, 2, SP2, *SEQUENCE_LEVEL), grpo_run("ddp", 1, *SEQUENCE_LEVEL), steps=3)


@pytest.fixture(scope="module")
def killed_zero3(launch, tmp_path_factory):
    """A 2-process ZeRO-3 run SIGKILLed after step 5 (rank 1), and a copy of its output directory as the
    kill left it (checkpoints at step 3 only) for a resume on another process count."""
    out = tmp_path_factory.mktemp("grpo-fault")
    first = launch(2, "strategy=zero3", *GRPO, output_dir=out, check=False, recipe="tiny_grpo",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0
    snapshot = tmp_path_factory.mktemp("grpo-fault-copy") / "run"
    shutil.copytree(out, snapshot)
    return out, snapshot


def plant_another_runs_rollout_cache(out, marker) -> None:
    """What another run can leave in output_dir/rollout-cache (issue 52): the file an older finetune read on
    resume with torch.load(weights_only=False), here a payload that creates `marker`, and an entry of a
    rollout recorded after another run's checkpoint, well formed, with other completions and advantages."""
    import pickle

    import torch

    from finetune.training.rollouts import CACHE_DIR, save_recorded

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    other = {"values": {"reward": 1.0}, "old_logps": [[0.0] * 8] * 16, "is_ratio": None, "rows": [0, 1, 2, 3],
             "tokens": [[5] * 3] * 16, "stopped": [True] * 16, "rewards": torch.ones(16, 1),
             "advantages": torch.full((16,), 3.0)}
    save_recorded(out, 1, other, after="another-run", keep=8)
    (out / CACHE_DIR / "1.pt").write_bytes(pickle.dumps(RunsCode()))


def test_sigkill_and_exact_resume_inside_a_rollout(grpo_run, launch, killed_zero3, tmp_path):
    """Killed after step 5 (rank 1), resumed from step 3's checkpoint: step 4 is the second step of the
    rollout generated at step 3, whose completions and old log-probs are read back from the checkpoint
    (its in-flight state, in its manifest), and nowhere else: another run's rollout cache left in
    output_dir, a pickle payload among it, is never read (issue 52: it ran, or step 4 trained on the other
    run's completions)."""
    want = grpo_run("zero3", 2)
    out, _ = killed_zero3
    ckpt = out / "checkpoints" / "step_000000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"in_flight/grpo_rollout.safetensors", "in_flight/grpo_rollout.json"} <= set(manifest["files"])
    assert manifest["save_id"] and not (out / "rollout-cache").exists(), "nothing kept outside the checkpoint"
    marker = tmp_path / "code-ran"
    plant_another_runs_rollout_cache(out, marker)
    second = launch(2, "strategy=zero3", *GRPO, "--resume", "auto", output_dir=out, recipe="tiny_grpo")
    assert "at step 3" in second.stderr
    assert not marker.exists(), "a planted rollout-cache file ran code"
    assert rollouts(second) == rollouts(want)
    assert records(second) == records(want)
    assert eval_records(second) == eval_records(want), "the eval at step 6, after the resume, as uninterrupted"
    # the checkpoint at step 6 (a rollout's end) holds none; step 3's of the resumed line holds rollout 1 again
    assert not (out / "checkpoints" / "step_000000006" / "in_flight").exists()


@pytest.mark.parametrize("damage,words", [
    ("cut", "is damaged: in_flight/grpo_rollout.safetensors has 100 bytes, the manifest says"),
    ("payload", "is damaged: in_flight/grpo_rollout.safetensors is not a safetensors file"),
    ("payload-json", "is damaged: in_flight/grpo_rollout.json is not plain JSON"),
    ("gone", "was saved inside rollout 1 (step 3, num_iterations=2) and holds no in-flight rollout"),
])
def test_a_damaged_or_planted_in_flight_rollout_is_one_line(killed_zero3, run_in_process, tmp_path, damage, words):
    """The in-flight rollout of step 3's checkpoint cut to 100 bytes, replaced by a pickle payload (the
    manifest made to match), or absent (a checkpoint of an older finetune, which kept it outside): one line,
    exit 2, before any model loads, and the payload never runs."""
    import pickle

    out = tmp_path / "run"
    shutil.copytree(killed_zero3[1] / "checkpoints" / "step_000000003", out / "checkpoints" / "step_000000003")
    ckpt, marker = out / "checkpoints" / "step_000000003", tmp_path / "code-ran"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    target = ckpt / "in_flight" / ("grpo_rollout.json" if damage == "payload-json" else "grpo_rollout.safetensors")

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    if damage == "cut":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "gone":
        shutil.rmtree(ckpt / "in_flight")
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("in_flight/")}
        manifest["checksums"] = {k: v for k, v in manifest["checksums"].items() if k in manifest["files"]}
    else:
        from finetune.checkpointing.manifest import file_checksums

        target.write_bytes(pickle.dumps(RunsCode()))
        rel = str(target.relative_to(ckpt))
        manifest["files"][rel] = target.stat().st_size
        manifest["checksums"] |= file_checksums(ckpt, [rel])
    if damage != "cut":
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    run = run_in_process("strategy=zero3", *GRPO, "--resume", "auto", "--dry-run", output_dir=out, recipe="tiny_grpo")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert words in errors[0], errors[0]
    assert not marker.exists()


def test_resume_on_another_process_count(grpo_run, launch, killed_zero3, tmp_path_factory):
    """The killed 2-process ZeRO-3 run resumed on 1 process (ZeRO-3 still) from step 3's checkpoint,
    inside the rollout generated at step 3: the rollouts and metrics of the uninterrupted 2-process run.
    As issue 52 found it: `--resume OTHER/checkpoints/step_3 output_dir=X` where X holds another run's
    rollout-cache (a pickle payload among it); nothing of it is read."""
    want = grpo_run("zero3", 2)
    other = tmp_path_factory.mktemp("grpo-fault-1proc") / "other"
    shutil.copytree(killed_zero3[1], other)
    assert sorted(p.name for p in (other / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_000000003"], "the kill left step 3's checkpoint only"
    out = other.parent / "x"
    out.mkdir()
    for record in ("rollouts.jsonl", "metrics.jsonl"):  # what the comparison reads of steps 1-3
        shutil.copy(other / record, out / record)
    marker = other.parent / "code-ran"
    plant_another_runs_rollout_cache(out, marker)
    resumed = launch(1, "strategy=zero3", *GRPO, "--resume", str(other / "checkpoints" / "step_000000003"),
                     output_dir=out, recipe="tiny_grpo")
    assert "at step 3" in resumed.stderr and not marker.exists()
    assert_same_run(resumed, want)


def test_resume_refuses_another_num_generations_or_num_iterations(killed_zero3, run_in_process, tmp_path):
    """The killed run's step-3 checkpoint resumed with num_generations 4 -> 2 and num_iterations 2 -> 1 is
    refused in one line before any model loads (before: `num_generations: 4 -> 2 (applies from this
    step on)`, then other prompts at every step, and step 4 retrained on a new rollout)."""
    out = tmp_path / "run"
    shutil.copytree(killed_zero3[1], out)
    run = run_in_process("strategy=zero3", *GRPO, "num_generations=2", "num_iterations=1", "--resume", "auto",
                         output_dir=out, recipe="tiny_grpo")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-3000:]
    assert "cannot continue with num_generations: 4 -> 2, num_iterations: 2 -> 1: the checkpoint's prompt " \
           "schedule and rollouts were made with the old value" in errors[0]
    assert "restore it, or export the checkpoint (python -m finetune.export" in errors[0]
    assert (out / "rollouts.jsonl").read_bytes() == (killed_zero3[1] / "rollouts.jsonl").read_bytes()


def test_sampling_and_rewards_without_a_learning_signal_are_said(launch, tmp_path_factory):
    """One process, one step: top_k=1 samples greedily (said before the model loads), and a reward
    function that scores nothing (None for every completion) is said at the step; metrics.jsonl stays
    JSON, the reward null (before: no word at all, and a bare NaN in metrics.jsonl)."""
    out = tmp_path_factory.mktemp("grpo-unscored")
    run = launch(1, "strategy=ddp", "global_batch_size=2", "num_generations=2", "micro_batch_size=4", "max_steps=1",
                 "warmup_steps=0", "max_completion_len=4", "eval_max_samples=2", "top_k=1", "reward_funcs=grpo_rewards:unscored",
                 output_dir=out, recipe="tiny_grpo",
                 extra_env={"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'distributed'}"})
    assert run.stderr.count("top_k=1 keeps only the likeliest token: the num_generations=2 completions of a prompt "
                            "are all the same") == 1, run.stderr[-3000:]
    assert run.stderr.count("step 1: no reward function scored any of the 4 completions (every reward None)") == 1

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    records = [json.loads(line, parse_constant=refuse)
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "loss" in r)
    assert step["reward"] is None and step["rewards/unscored/mean"] is None and step["loss"] == 0.0
    assert next(r for r in records if "eval_reward" in r)["eval_reward"] is None


def test_a_failing_reward_function_stops_the_run_in_one_line(launch, tmp_path_factory, reward_model_dir):
    """Under ZeRO-3 on 2 processes, beside a reward function that raises at step 5: a RewardModel itself
    as a reward function (grpo_rewards:scorer), checked before the policy loads and loaded whole on each
    process outside zero.Init (before: the check built its skeleton under zero.Init and the run stopped
    with 'Cannot copy out of meta tensor', called 'no sequence-classification form'). Its scores in
    rollouts.jsonl are the directory's own, scored here in this process."""
    from conftest import one_thread

    from finetune.rewards import RewardModel

    out = tmp_path_factory.mktemp("grpo-bad-reward")
    run = launch(2, "strategy=zero3", *GRPO, "save_every=2", "eval_dataset=",
                 "reward_funcs=finetune.rewards:exact_match,grpo_rewards:scorer,grpo_rewards:broken",
                 output_dir=out, check=False, recipe="tiny_grpo",
                 extra_env={"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'distributed'}",
                            "GRPO_REWARD_MODEL": str(reward_model_dir)})
    assert run.returncode != 0 and (out / "rollouts.jsonl").is_file(), run.stderr[-3000:]
    lines = rollouts(run)
    assert len(lines) == 32 and all(set(r["rewards"]) == {"exact_match", "scorer", "broken"} for r in lines)
    with one_thread():
        want = RewardModel(str(reward_model_dir))([r["prompt"] for r in lines], [r["completion"] for r in lines])
    got = [r["rewards"]["scorer"] for r in lines]
    assert len(set(got)) > 1 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    # num_iterations=2: the function's fourth call (the first is the check before the model loads) is at step
    # 5's rollout
    assert errors[0].startswith("error: step 5: reward function broken raised ZeroDivisionError: division by zero "
                                "(prompt: '"), errors[0]
    assert "its newest checkpoint, step_000000004, is intact: fix the function" in errors[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000002", "step_000000004"]
    assert [r["step"] for r in rollouts(run)] == [1] * 16 + [3] * 16


@pytest.fixture(scope="module")
def reward_model_dir(launch_env, tmp_path_factory):
    """A sequence-classification model directory as objective=reward's final/ is: the tiny Llama's config
    with one label, random weights (seeded), the tiny tokenizer beside it."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from finetune import assets

    old = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = launch_env["FINETUNE_CACHE"]
    try:
        tiny = assets.tiny_model_dir()
    finally:
        if old is None:
            os.environ.pop("FINETUNE_CACHE")
        else:
            os.environ["FINETUNE_CACHE"] = old
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = AutoConfig.from_pretrained(tiny, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = AutoModelForSequenceClassification.from_config(config)
    out = tmp_path_factory.mktemp("grpo-reward-model") / "rm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_lora_under_fsdp_with_a_reward_model_as_one_reward(launch, reward_model_dir):
    """LoRA (the adapter disabled as the beta > 0 reference) under FSDP on 2 processes against 1 process
    under ZeRO-3, a reward model (finetune.rewards.RewardModel on a real sequence-classification
    directory) scoring beside exact_match: the same completions, rewards (the model's scores included)
    and metrics. ZeRO-3 on the one process: the reward model is loaded whole there too, not partitioned
    by zero.Init (which failed its first forward: 'weight' must be 2-D)."""
    overrides = [*GRPO, "lora=true", "lora_dropout=0",
                 "reward_funcs=finetune.rewards:exact_match,finetune.rewards:char_match,grpo_rewards:reward_model"]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'distributed'}", "GRPO_REWARD_MODEL": str(reward_model_dir)}
    one = launch(1, "strategy=zero3", *overrides, recipe="tiny_grpo", extra_env=env)
    assert "zero3 on 1" in one.stderr
    two = launch(2, "strategy=fsdp", *overrides, recipe="tiny_grpo", extra_env=env)
    assert "fsdp on 2" in two.stderr
    lines = rollouts(one)
    assert all(set(r["rewards"]) == {"exact_match", "char_match", "reward_model"} for r in lines)
    scores = [r["rewards"]["reward_model"] for r in lines]
    assert all(isinstance(s, float) for s in scores) and len(set(scores)) > 1, "the model scores each completion"
    assert_same_run(two, one)
    recs = records(one)
    assert "rewards/reward_model/mean" in recs[0], sorted(recs[0])
    assert recs[1]["kl"] > 0, "the adapter moved the policy from its reference (the adapter disabled)"


def test_hybrid_2x2_on_four_processes_equals_one(grpo_run, launch, tmp_path_factory):
    """hsdp over 2 nodes x 2 (4 processes, one prompt's group each): the same completions and metrics as 1
    process within 1e-6 (the rollout gathers the hybrid-sharded model whole on each rank), and the planner's
    bytes per step, averaged over the rollout cycles (a rollout every num_iterations=2 steps), within 10%
    of the collectives counted (tests/distributed/layouts.py)."""
    from layouts import HYBRID, assert_planner_matches, counting

    counts = counting(tmp_path_factory)
    run = launch(4, *HYBRID, *GRPO, recipe="tiny_grpo", extra_env=counts)
    assert "hsdp (2 replicas, each sharded over 2 GPUs) on 4 cpu process(es)" in run.stderr
    assert_same_run(run, grpo_run("ddp", 1), tolerance=1e-6)
    assert_planner_matches(run, counts, "tiny_grpo", [*HYBRID, *GRPO], steps=range(1, 7))


# loss_type=rloo (recipes/tiny_rloo.py, TRL's RLOOTrainer) on GRPO's numbers: its KL penalty in the reward
# needs the old and reference log-probs at every rollout; normalize_advantages over the gathered batch
RLOO = ["beta=0.05", "normalize_advantages=true"]


@pytest.fixture(scope="module")
def rloo_runs(launch, tmp_path_factory):
    """loss_type=rloo under ZeRO-3: a 2-process run; the same run SIGKILLed after step 5 (rank 1), then
    resumed on 1 process from step 3's checkpoint, inside the rollout generated at step 3."""
    want = launch(2, "strategy=zero3", *GRPO, *RLOO, recipe="tiny_rloo")
    out = tmp_path_factory.mktemp("rloo-fault")
    first = launch(2, "strategy=zero3", *GRPO, *RLOO, output_dir=out, check=False, recipe="tiny_rloo",
                   extra_env={"FINETUNE_FAULT": "after_step:1:5"})
    assert first.returncode != 0
    resumed = launch(1, "strategy=zero3", *GRPO, *RLOO, "--resume", "auto", output_dir=out, recipe="tiny_rloo")
    return want, resumed


def test_rloo_resumed_on_one_process_equals_two(rloo_runs):
    """RLOO's resume inside a rollout is exact and its steps on 1 process equal those on 2: the same
    completions, rewards and leave-one-out advantages (each group's KL-penalised, normalised over the
    batch), the same losses and metrics, TRL's RLOO metrics among them."""
    want, resumed = rloo_runs
    assert "at step 3" in resumed.stderr and "zero3 on 1" in resumed.stderr
    assert_same_run(resumed, want)
    recs = records(want)
    assert {"kl", "entropy", "clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/region_mean"} <= set(recs[0])
    assert recs[0]["kl"] == 0.0 and recs[2]["kl"] != 0.0, "the old policy's KL to the reference, once it moved"
    lines = rollouts(want)
    for step in (1, 3, 5):  # normalised over the batch: mean 0
        assert abs(sum(r["advantage"] for r in lines if r["step"] == step)) < 1e-3


# dynamic sampling: a reward that gives every completion of about half the prompts 0.0 (equal rewards)
DYNAMIC = ["dynamic_sampling=true", "reward_funcs=grpo_rewards:half_equal"]


@pytest.fixture(scope="module")
def dynamic_runs(launch, tmp_path_factory):
    """dynamic_sampling=true: a 1-process run; a 2-process ZeRO-3 run SIGKILLed (rank 1) in the middle of
    refilling step 5's batch, then resumed (on 2 processes) from step 3's checkpoint."""
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'distributed'}"}
    one = launch(1, "strategy=ddp", *GRPO, *DYNAMIC, recipe="tiny_grpo", extra_env=env)
    out = tmp_path_factory.mktemp("dynamic-fault")
    first = launch(2, "strategy=zero3", *GRPO, *DYNAMIC, output_dir=out, check=False, recipe="tiny_grpo",
                   extra_env=env | {"FINETUNE_FAULT": "refill:1:5"})
    assert first.returncode != 0  # killed while refilling step 5 (its batch 0 had groups of equal rewards)
    resumed = launch(2, "strategy=zero3", *GRPO, *DYNAMIC, "--resume", "auto", output_dir=out, recipe="tiny_grpo",
                     extra_env=env)
    return one, resumed


def test_dynamic_sampling_fills_batches_on_two_processes_as_on_one_and_resumes_mid_refill(dynamic_runs):
    """Half the groups have equal rewards: each rollout drops them and samples more prompts until its 4
    groups all have a signal; the dropped groups are lines of rollouts.jsonl, the counts metrics. A kill
    while refilling step 5 resumed on 2 processes repeats the 1-process run: the same completions, dropped
    groups, losses and metrics."""
    one, resumed = dynamic_runs
    assert "at step 3" in resumed.stderr
    assert_same_run(resumed, one, reward="half_equal")
    lines = rollouts(one)
    trained = [r for r in lines if not r.get("dropped")]
    dropped = [r for r in lines if r.get("dropped")]
    assert [r["step"] for r in trained] == [1] * 16 + [3] * 16 + [5] * 16
    assert dropped and all(len(set(r["rewards"])) == 1 for r in dropped)  # each dropped group: equal rewards
    for step in (1, 3, 5):  # every trained group has unequal rewards: a learning signal
        group_rewards = [[r["reward"] for r in trained if r["step"] == step][i:i + 4] for i in range(0, 16, 4)]
        assert all(len(set(g)) > 1 for g in group_rewards)
    recs = records(one)
    assert all(r["frac_reward_zero_std"] == 0.0 for r in recs)
    assert any(r["dynamic_sampling/generation_batches"] >= 2 for r in recs)  # refilled
    assert sum(r["dynamic_sampling/dropped_groups"] for r in recs[::2]) == len(dropped)
    assert all(r["dynamic_sampling/short_groups"] == 0 for r in recs)
