"""rollout_processes' pure parts (the launches are tests/distributed/test_async_grpo.py): the recipe rules, the
split of the launch's environment, the deterministic schedule (which weights each rollout is generated from,
what a checkpoint holds in flight, which versions are pushed), the rollouts' parts joined and split again,
what a checkpoint holds in flight written and read back, the generator's behaviour log-probs against the
trainer's, and the health check's lines."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.errors import RecipeError
from finetune.recipe import Recipe, apply_overrides, validate
from finetune.checkpointing.run_state import in_flight_files, load_in_flight, save_in_flight
from finetune.training.rollout_group import (IN_FLIGHT, Health, RolloutProcessError, in_flight_end, in_flight_state,
                                             join_parts, logp_difference, policy_version, pushed_versions,
                                             rollouts_of_state, split_rollout, split_world)

GRPO = ["objective=grpo", "reward_funcs=finetune.rewards:exact_match", "num_generations=2", "global_batch_size=2",
        "micro_batch_size=2"]


def recipe(*overrides: str) -> Recipe:
    return validate(apply_overrides(Recipe(), list(overrides)))


def test_the_split_keys_and_what_the_split_does_not_serve_are_one_line_each():
    r = recipe(*GRPO, "rollout_processes=1", "max_staleness=2", "weight_sync_steps=2",
               "vllm_importance_sampling_mode=token_truncate")
    assert (r.rollout_processes, r.max_staleness, r.weight_sync_steps) == (1, 2, 2)
    with pytest.raises(RecipeError, match=r"^max_staleness=1 applies to rollout_processes > 0 only"):
        recipe(*GRPO, "max_staleness=1")
    with pytest.raises(RecipeError, match=r"^rollout_processes=1 applies to objective=grpo only"):
        recipe("rollout_processes=1")
    with pytest.raises(RecipeError, match=r"^vllm_importance_sampling_mode=token_mask applies to generation_backend=vllm"):
        recipe(*GRPO, "vllm_importance_sampling_mode=token_mask")  # the correction's keys: with the split or vLLM
    refused = {"generation_backend=vllm": "a vLLM engine as the generating processes' generator is not built",
               "num_iterations=2": "a rollout reused for several steps is not built",
               "dynamic_sampling=true": "refilling a batch on the generating processes is not built",
               "global_batch_size=3": "global_batch_size=3 prompts do not split over rollout_processes=2"}
    for override, why in refused.items():
        with pytest.raises(RecipeError, match=why):
            recipe(*GRPO, "micro_batch_size=1", "rollout_processes=2", override)
    with pytest.raises(RecipeError, match=r"^rollout_processes=1 needs global_batch_size \(prompts per step\)"):
        recipe(*GRPO, "global_batch_size=0", "rollout_processes=1")


def test_the_last_ranks_generate_and_the_others_see_a_world_of_their_own():
    r = recipe(*GRPO, "rollout_processes=2")
    envs = [{"RANK": str(i), "LOCAL_RANK": str(i % 4), "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"} for i in range(8)]
    roles = [split_world(r, env) for env in envs]
    assert roles == [None] * 6 + [0, 1]
    assert [e["WORLD_SIZE"] for e in envs] == ["6"] * 8
    assert [e["LOCAL_WORLD_SIZE"] for e in envs[:6]] == ["4"] * 4 + ["2"] * 2  # node 2 keeps 2 trainers of 4
    assert split_world(r, envs[3]) is None and envs[3]["WORLD_SIZE"] == "6", "called twice: the same world"
    front = {"WORLD_SIZE": "3"}  # `finetune train --num_processes 3` checks as trainer rank 0 would
    assert split_world(recipe(*GRPO, "rollout_processes=1"), front) is None and front["WORLD_SIZE"] == "2"
    with pytest.raises(RecipeError, match=r"^rollout_processes=2 leaves no training process of the 2 launched; "
                                          r"launch more processes \(--num_processes 3 or more\)"):
        split_world(r, {"WORLD_SIZE": "2"})
    assert split_world(recipe(*GRPO), {"WORLD_SIZE": "2"}) is None
    alone = {}  # `python finetune/run.py --recipe R --dry-run`, outside a launch: one training process planned
    assert split_world(r, alone, dry_run=True) is None and alone == {}
    with pytest.raises(RecipeError, match=r"^rollout_processes=2 leaves no training process of the 1 launched"):
        split_world(r, {})  # the same, to train: refused


def test_each_rollout_comes_from_the_weights_its_step_started_from_lagged():
    # max_staleness=0: the synchronous run, every step pushes and nothing is in flight at a checkpoint
    assert [policy_version(r, 0, 1) for r in range(5)] == [0, 1, 2, 3, 4]
    assert [in_flight_end(s, 0, 1) for s in range(5)] == [0, 1, 2, 3, 4]
    # a lag of 1: the first two rollouts from the initial weights, then the weights one step older
    assert [policy_version(r, 1, 1) for r in range(6)] == [0, 0, 1, 2, 3, 4]
    assert in_flight_end(3, 1, 1) == 4, "a checkpoint at step 3 holds rollout 3 (generated from version 2)"
    assert pushed_versions(0, 6, 1, 1) == [0, 1, 2, 3, 4] and pushed_versions(3, 6, 1, 1) == [3, 4]
    # weights pushed every 2 steps: the lag between 1 and 2
    assert [policy_version(r, 1, 2) for r in range(7)] == [0, 0, 0, 2, 2, 4, 4]
    assert pushed_versions(0, 8, 1, 2) == [0, 2, 4, 6]
    assert in_flight_end(5, 0, 4) == 8, "w=4: rollouts 5, 6, 7 come from version 4"
    for lag in range(4):
        for every in (1, 2, 3):
            for step in range(12):
                end = in_flight_end(step, lag, every)
                assert all(policy_version(r, lag, every) < step for r in range(step, end))
                assert policy_version(end, lag, every) >= step
                assert all(v >= step for v in pushed_versions(step, 40, lag, every))


def part(n: int, first: int) -> dict:
    return {"tokens": [[first + i] for i in range(n)], "stopped": [True] * n, "rewards": [[float(first + i)] for i in range(n)],
            "logps": [[-0.5]] * n, "seconds": 1.0 + first, "waited": 0.25, "error": None}


def test_parts_join_in_order_and_split_again_over_another_count(tmp_path):
    whole = join_parts([part(4, 0), part(4, 4)])
    assert [t[0] for t in whole["tokens"]] == list(range(8)) and whole["seconds"] == 5.0
    again = split_rollout({**whole, "rollout": 3}, 4)
    assert [len(p["tokens"]) for p in again] == [2, 2, 2, 2]
    assert join_parts(again)["tokens"] == whole["tokens"] and join_parts(again)["rewards"] == whole["rewards"]
    # what a checkpoint holds: exact (float32 log-probs, NaN rewards of a function that scored nothing)
    whole = {**whole, "logps": [[-0.123456789 * (i + 1)] * (i % 3) for i in range(8)],
             "rewards": torch.tensor([[float("nan")] if i % 2 else [0.1 * i] for i in range(8)]).tolist()}
    whole["logps"] = [torch.tensor(row, dtype=torch.float32).tolist() for row in whole["logps"]]
    tensors, data = in_flight_state([{"rollout": 3, "version": 2, **whole}], {"step": 3, "next_rollout": 4})
    save_in_flight(tmp_path, IN_FLIGHT, tensors, data)  # what Checkpointer._write does with GRPO.in_flight's
    listing = {"files": {rel: (tmp_path / rel).stat().st_size for rel in in_flight_files(IN_FLIGHT)}}
    back = rollouts_of_state(*load_in_flight(tmp_path, IN_FLIGHT, listing, "here"), what="here")
    assert data["next_rollout"] == 4 and [x["rollout"] for x in back] == [3] and back[0]["version"] == 2
    for key in ("tokens", "stopped", "logps"):
        assert back[0][key] == whole[key], key
    assert json.dumps(back[0]["rewards"]) == json.dumps(whole["rewards"]), "NaN where it was, float32 exact"
    assert load_in_flight(tmp_path / "elsewhere", IN_FLIGHT, listing, "here") is None
    with pytest.raises(RecipeError, match=r"here is damaged: its rollouts in flight lack 'rollouts'; nothing was loaded"):
        rollouts_of_state(tensors, {"step": 3}, what="here")
    with pytest.raises(RecipeError, match=r"here is damaged: its rollouts in flight lack '3.logps'"):
        rollouts_of_state({k: v for k, v in tensors.items() if k != "3.logps"}, data, what="here")


def test_a_checkpoint_of_a_lagging_run_must_hold_its_rollouts_in_flight():
    """The objective's in_flight rule (resume.check_in_flight_held refuses before the launch a checkpoint
    without them): at a lag or a push every few steps, never at max_staleness=0."""
    from finetune.objective_rules import grpo as rules

    assert rules.in_flight(recipe(*GRPO, "rollout_processes=1"), 3) is None
    name, why = rules.in_flight(recipe(*GRPO, "rollout_processes=1", "max_staleness=1"), 3)
    assert name == IN_FLIGHT and why.startswith("holds no rollouts in flight, and step 4 with max_staleness=1")
    assert rules.in_flight(recipe(*GRPO, "rollout_processes=1", "weight_sync_steps=2"), 2) is None
    assert rules.in_flight(recipe(*GRPO, "rollout_processes=1", "weight_sync_steps=2"), 3)[0] == IN_FLIGHT


def test_the_generators_behaviour_logprobs_are_the_trainers_of_the_same_weights():
    """generate(logprobs=True): each drawn token's log-probability of the distribution the trainer scores (the
    logits / temperature over the tokenizer's rows), as token_logps_within computes it from one forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.generation import Sampling, generate
    from finetune.loss import token_logps_within
    from finetune.training.rollouts import rollout_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    prompts = [[1, 5, 7], [1, 9]]
    outs = generate(model, prompts, Sampling(6, temperature=0.7), stop_ids=[2], pad_id=0, context=None, seeds=[3, 4],
                    vocab_size=36, logprobs=True)
    assert [len(o.logprobs) for o in outs] == [len(o.tokens) for o in outs]
    batch = rollout_batch(prompts, [o.tokens for o in outs], [o.stopped for o in outs], torch.zeros(2), 0)
    with torch.no_grad():
        _, within = token_logps_within(model, batch, 36, "full", None, 0.7)
    for i, out in enumerate(outs):
        trainer = within[i, len(prompts[i]):len(prompts[i]) + len(out.tokens)]
        assert torch.allclose(trainer, torch.tensor(out.logprobs), atol=1e-5)
    assert logp_difference([o.logprobs for o in outs], [o.logprobs for o in outs]) == 0.0
    assert logp_difference([[0.0]], [[0.0, 1.0]]) == float("inf")


class FakeStore:
    """The store's calls Health makes, in memory."""

    def __init__(self):
        self.values = {}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def add(self, key, n):
        self.values[key] = int(self.values.get(key, 0)) + n
        return self.values[key]

    def get(self, key):
        v = self.values[key]
        return v if isinstance(v, bytes) else str(v).encode()

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value


def test_a_failed_hung_or_dead_generating_process_is_one_line_naming_its_rank(monkeypatch):
    import subprocess
    import time

    from finetune.training.rollout_group import host_name

    store = FakeStore()
    health = Health(store, trainers=2, generators=1, stale_after_s=0.2)
    health.check(force=True)
    store.set("failed/0", json.dumps({"line": "rollout process rank 2 failed: ValueError: x", "user": False}))
    with pytest.raises(RolloutProcessError, match=r"^rollout process rank 2 failed: ValueError: x$"):
        health.check(force=True)
    store.set("failed/0", json.dumps({"line": "step 3: reward function f raised", "user": True}))
    with pytest.raises(RecipeError, match=r"^step 3: reward function f raised$"):
        health.check(force=True)
    del store.values["failed/0"]
    health = Health(store, trainers=2, generators=1, stale_after_s=0.2)
    health.check(force=True)
    time.sleep(0.3)
    with pytest.raises(RolloutProcessError, match=r"^rollout process rank 2 made no progress for 0 s "
                                                  r"\(heartbeat_stale_after_s=0.2\): hung; the run stopped"):
        health.check(force=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    store.set("pid/0", json.dumps([host_name(), gone.pid]))
    health = Health(store, trainers=2, generators=1, stale_after_s=60)
    with pytest.raises(RolloutProcessError, match=rf"^rollout process rank 2 \(pid {gone.pid}\) died; the run stopped, "
                                                  "its last checkpoint is intact"):
        health.check(force=True)
    store.set("pid/0", json.dumps(["another-machine", gone.pid]))
    Health(store, trainers=2, generators=1, stale_after_s=60).check(force=True)  # its heartbeat alone tells there


def test_the_front_plans_the_trainers_world_and_refuses_a_launch_with_none(tmp_path, capsys, monkeypatch):
    """`finetune train tiny_grpo_async --num_processes 3`: the checks and the dry run see 2 training processes (the
    third generates); 1 process leaves none to train: one line, nothing launched."""
    from finetune.commands import cli

    def launched(cmd, output_dir):
        raise AssertionError(f"launched {cmd}")

    monkeypatch.setattr(cli, "supervise", launched)
    capsys.readouterr()
    assert cli.main(["train", "tiny_grpo_async", "--num_processes", "3", "--dry-run",
                     f"output_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert "zero3 on 2 cpu process(es)" in out and "16 prompts x 8 = 128 completions" in out
    assert "memory per GPU with rollout_processes=1: training GPUs (2, zero3)" in out
    code = cli.main(["train", "tiny_grpo_async", "--num_processes", "1", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: rollout_processes=1 leaves no training process of the 1 launched")


def test_the_planner_splits_the_gpus_and_the_recipe_header_says_what_it_prints(capsys):
    """python -m finetune.plan --split: every split the global batch divides, memory per group, the modelled step
    at a lag of 0 and 1, and the one it would run; recipes/llama8b_grpo_async.py's header holds its figures."""
    from pathlib import Path

    from finetune.commands.plan import main

    assert main(["--recipe", "llama8b_grpo_async", "--gpus", "8", "--gpu-mem", "80GB", "--split"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "6"), ("4", "4"), ("6", "2")]
    assert [r[4] for r in rows] == ["yes", "yes", "no"]
    for r in rows:  # a lag of 1 overlaps the groups: the step is the longer of the two, never their sum
        gen, train, push, k0, k1 = map(float, r[5:10])
        assert k1 == pytest.approx(max(gen, train + push), abs=0.011) and k0 == pytest.approx(gen + train + push, abs=0.011)
    assert "recommended: rollout_processes=2 (6 training GPUs) with max_staleness=1" in out
    header = (Path(__file__).resolve().parents[1] / "recipes" / "llama8b_grpo_async.py").read_text()
    for r in rows:
        assert " ".join(r[:4]) in " ".join(header.split()), r
    assert main(["--recipe", "tiny_grpo", "--gpus", "1", "--split"]) == 2
    assert "--split --gpus 1: a split needs at least 2 GPUs" in capsys.readouterr().err
    # without --split, a recipe's own split: the setups table of its training GPUs, and each group's memory
    assert main(["--recipe", "llama8b_grpo_async", "--gpus", "8", "--gpu-mem", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU with rollout_processes=2: training GPUs (6, fsdp) 36.00 GiB" in out
    assert "generating GPUs (2) 51.71 GiB" in out and "x 6 GPUs" in out and "kv cache" not in out
    assert main(["--recipe", "llama8b_grpo_async", "--gpus", "2"]) == 2
    assert "--gpus 2 with rollout_processes=2 leaves no training GPU" in capsys.readouterr().err


def test_the_gpu_scripts_split_row_reads_the_steps_and_the_waits(tmp_path):
    """bench/gpu/e2e.sh's split phase: its row from a run's metrics.jsonl (the median step after the first 3, and the
    share of it each group waited), and a failed run's row says so."""
    from bench.gpu.e2e_check import split_row

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 0.0, "tokens": 100 * s, "tokens_per_s": 100.0 / (1.0 + (s == 1)),
                "perf/rollout_wait_s": 0.25, "perf/weight_sync_s": 0.05, "rollout/backpressure_s": 0.5}
               for s in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = split_row(1, str(run), 30.0, 0)
    assert row["ok"] and row["step_s"] == pytest.approx(1.0) and row["trainers_wait"] == pytest.approx(0.3)
    assert row["generator_wait"] == pytest.approx(0.5) and "trainers wait 30% of it, the generating process 50%" \
        in row["what"]
    failed = split_row(0, str(tmp_path / "none"), 3.0, 1)
    assert not failed["ok"] and failed["error"] == "exit code 1, 0 steps"


def test_a_generating_process_that_hangs_inside_a_push_ends_trainer_0_with_one_line():
    """Trainer 0 blocked in a push's broadcast (the generating process never joins it): the watchdog beside it reads
    the health every second; its line names the rank and the process exits 1 instead of hanging."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent("""
        import time
        from finetune.training.rollout_group import RolloutProcessError, Watchdog

        class Hung:
            def check(self, force=False):
                raise RolloutProcessError("rollout process rank 2 made no progress for 301 s "
                                          "(heartbeat_stale_after_s=300): hung")

        with Watchdog(Hung()):
            time.sleep(600)  # the broadcast that never returns
    """)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and time.perf_counter() - start < 60
    assert proc.stderr.splitlines()[-1] == ("error: rollout process rank 2 made no progress for 301 s "
                                            "(heartbeat_stale_after_s=300): hung"), proc.stderr
