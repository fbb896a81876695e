"""GRPO's generation on processes of its own (recipe: rollout_processes, max_staleness, weight_sync_steps,
heartbeat_stale_after_s; docs/async-rl.md): the training processes' side, and what both sides share.

The split. A run is launched as any other (`accelerate launch --num_processes N`, `finetune train --num_processes
N`). Before any process group exists (split_world, called by the training command) the last rollout_processes
ranks become generating processes (finetune/training/rollout_worker.py) and never join the trainers' default
group: the trainers see WORLD_SIZE and LOCAL_WORLD_SIZE of their own, so every strategy (ddp, zero1-3, fsdp,
LoRA, sequence parallelism) runs over them unchanged.

The bridge. Every process opens a client of the launch's key-value store (the launcher's TCPStore: under
torchrun the agent's, else the one trainer rank 0 hosts for its default group) under a prefix of its own; it
carries the rollouts (JSON: tokens, rewards, behaviour log-probs), the push announcements and the generators'
check of each push, their heartbeats, pids and failures. The weights go over the link: a process group made
directly (gloo on CPU, NCCL on GPUs) of trainer rank 0 and the generating processes, a broadcast from trainer 0
of each tensor, a bucket of decoder layers at a time (Strategy.weight_buckets: the trainers gather, trainer 0
sends), LoRA merged into the base weights on the way.

The schedule (deterministic: it depends on no timing). Rollout r is what step r (0-based) trains on; it is
generated from the weights of policy_version(r) optimizer steps: those step r - max_staleness started from,
rounded down to a pushed version (weight_sync_steps), the initial weights for the first ones. The trainers push
version v at the start of step v, for each v some rollout is generated from; a generating process takes a push
only when the rollout it starts next needs it, so a push waits for the generators to finish their rollout in
hand, which at a lag of 1 or more is the rollout the trainers need next anyway. max_staleness=0 is the
synchronous run: rollout r comes from the weights step r starts from, bit for bit what the colocated run samples.

The check. At each push the trainers score a probe (the first prompts of the rollout of that step, their own
tokens as labels) with the weights they push; each generating process scores the same probe after loading
them; a mean |difference| of the log-probs above the dtype's tolerance stops the run naming the rank.

In flight. A checkpoint at step s holds the rollouts generated from weights older than its own (steps s to
in_flight_end(s) - 1: they cannot be generated again) and where the generators continue (write_in_flight);
the others are generated again, from the checkpoint's weights on. A resumed run republishes them from the
checkpoint, on any split or process count; nothing in flight is read from anywhere else."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from finetune import sequence_parallel as SP
from finetune.checkpointing.run_state import load_in_flight, ragged, unragged
from finetune.errors import RecipeError
from finetune.objective_rules.rollout_split import IN_FLIGHT, in_flight_end, policy_version, pushed_versions

LAUNCHED = "FINETUNE_LAUNCHED_WORLD_SIZE"  # the launch's world size, once split_world has split it
LAUNCHED_LOCAL = "FINETUNE_LAUNCHED_LOCAL_WORLD_SIZE"  # ... and this node's processes
POLL_S = 0.01  # how often a wait looks at the store (at most; it backs off to 0.05 s)
HEALTH_S = 0.5  # how often a wait reads the generating processes' heartbeats


class RolloutProcessError(RuntimeError):
    """A generating process died or hung: one line naming its rank; not a user error (exit code 1)."""


# ---------------------------------------------------------------- the split and the schedule


def split_world(recipe, env=os.environ, dry_run: bool = False) -> int | None:
    """Before any process group: this process's index among the generating processes, or None for a training
    process, whose environment then says the trainers' world (WORLD_SIZE, LOCAL_WORLD_SIZE: the launch's less
    the last rollout_processes ranks). Idempotent; a front that checks before launching (RANK unset) plans as
    trainer rank 0; a dry run outside any launch (no WORLD_SIZE) plans one training process, the generating
    processes beside it."""
    count = getattr(recipe, "rollout_processes", 0)
    if not count or recipe.objective != "grpo":
        return None
    if dry_run and LAUNCHED not in env and "WORLD_SIZE" not in env:
        return None
    launched = int(env.get(LAUNCHED) or env.get("WORLD_SIZE", "1"))
    if launched <= count:
        raise RecipeError(f"rollout_processes={count} leaves no training process of the {launched} launched; launch "
                          f"more processes (--num_processes {count + 1} or more) or lower rollout_processes")
    trainers, rank = launched - count, int(env.get("RANK", "0"))
    if LAUNCHED not in env:
        env[LAUNCHED] = str(launched)
        env["WORLD_SIZE"] = str(trainers)
        local_rank = int(env.get("LOCAL_RANK", "0"))
        node_start = rank - local_rank  # torchrun numbers a node's ranks contiguously
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(launched)))
        env[LAUNCHED_LOCAL] = str(local_world)
        env["LOCAL_WORLD_SIZE"] = str(max(1, min(node_start + local_world, trainers) - node_start))
    return rank - trainers if rank >= trainers else None


def off_policy(recipe) -> bool:
    """Some rollout lags the weights its step starts from: the loss then weighs it (TRL's correction)."""
    from finetune.objective_rules.rollout_split import off_policy as lagging

    return lagging(recipe)


METRICS = ("sample/staleness_mean", "sample/staleness_max", "perf/rollout_wait_s", "perf/weight_sync_s",
           "rollout/backpressure_s", "rollout/weight_check_logp_diff")
CORRECTION_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                      "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                      "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_clipped")


def metric_names(recipe) -> tuple[str, ...]:
    return METRICS + (CORRECTION_METRICS if off_policy(recipe) else ())


# ---------------------------------------------------------------- the bridge


def bridge_store(timeout_s: float = 1800.0, env=os.environ):
    """A client of the launch's key-value store under this run's prefix (one per launcher attempt)."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(f"finetune/rollouts/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def link_device(env=os.environ) -> torch.device:
    """Where the weights travel: between GPUs (NCCL) where each process of this node has a GPU of its own, else
    through host memory (gloo: a CPU machine, or a GPU that the generating and training processes share)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(env.get(LAUNCHED_LOCAL) or env.get("LOCAL_WORLD_SIZE", "1"))
    if local > torch.cuda.device_count():
        return torch.device("cpu")
    return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))


def link_group(store, rank: int, size: int, device: torch.device, timeout_s: float = 1800.0):
    """Trainer rank 0 (link rank 0) and the generating processes (1..): NCCL between GPUs, gloo on CPU."""
    from torch.distributed import PrefixStore

    prefixed = PrefixStore("link", store)
    if device.type == "cuda":  # (not run yet: no lent GPU has run a split)
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return ProcessGroupNCCL(prefixed, rank, size, options)
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout_s))


def broadcast(group, tensor: torch.Tensor) -> None:
    """From link rank 0 (trainer rank 0) to the generating processes."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def broadcast_json(group, obj, device: torch.device) -> object:
    """A JSON value from link rank 0 (obj there; None elsewhere), its length first."""
    data = json.dumps(obj).encode() if obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    broadcast(group, size)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if obj is not None else
              torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    broadcast(group, buffer)
    return obj if obj is not None else json.loads(bytes(buffer.cpu().tolist()).decode())


def get_json(store, key: str):
    return json.loads(store.get(key).decode())


def set_json(store, key: str, obj) -> None:
    store.set(key, json.dumps(obj))


def probe_batch(prompts: list[list[int]], pad_id: int) -> dict:
    """The push check's probe: each prompt's own tokens (from the second) as labels."""
    from finetune.training.rollouts import rollout_batch

    usable = [p for p in prompts if len(p) > 1]
    return rollout_batch([p[:1] for p in usable], [p[1:] for p in usable], [True] * len(usable),
                         torch.zeros(len(usable)), pad_id)


def probe_logps(model, batch: dict, recipe, vocab_size: int, device) -> list[list[float]]:
    """The probe's log-probs at the sampling temperature over the tokenizer's rows, as the loss's log-probs are
    computed (a collective where the model is sharded), without dropout; each row's labelled tokens."""
    from finetune.data import IGNORE
    from finetune.loss import token_logps_within

    if not len(batch["input_ids"]):
        return []
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            _, within = token_logps_within(model, {k: v.to(device) for k, v in batch.items()}, vocab_size,
                                           recipe.loss_impl, recipe.loss_chunk_tokens or None,
                                           recipe.temperature if recipe.temperature > 0 else 1.0,
                                           torch.float32 if recipe.cast_lm_head_to_fp32 else None)
    finally:
        model.train(was_training)
    mask = batch["labels"] != IGNORE
    return [within[i].float().cpu()[mask[i]].tolist() for i in range(len(mask))]


def logp_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The mean |a - b| over the probe's tokens (inf where the shapes differ)."""
    if [len(x) for x in a] != [len(x) for x in b]:
        return float("inf")
    x, y = torch.tensor([v for row in a for v in row]), torch.tensor([v for row in b for v in row])
    return (x - y).abs().mean().item() if len(x) else 0.0


# ---------------------------------------------------------------- health: heartbeats, pids, failures


class Health:
    """What a training process knows of the generating processes while it waits for them: a failure one
    reported (its line), a process that died (its pid gone, on this machine) or made no progress (its heartbeat
    counter unchanged) for heartbeat_stale_after_s: each raised as one line naming the rank."""

    def __init__(self, store, trainers: int, generators: int, stale_after_s: float):
        self.store, self.trainers, self.generators = store, trainers, generators
        self.stale_after_s = stale_after_s
        self.beats = {g: (None, time.monotonic()) for g in range(generators)}
        self.looked = 0.0
        self.pids: dict[int, int | None] = {}

    def rank(self, g: int) -> int:
        return self.trainers + g

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.looked < HEALTH_S:
            return
        self.looked = now
        for g in range(self.generators):
            if self.store.check([f"failed/{g}"]):
                failure = get_json(self.store, f"failed/{g}")
                error = RecipeError if failure.get("user") else RolloutProcessError
                raise error(failure["line"])
            beat = self.store.add(f"beat/{g}", 0)
            last, since = self.beats[g]
            if beat != last:
                self.beats[g] = (beat, now)
            elif now - since > self.stale_after_s:
                raise RolloutProcessError(f"rollout process rank {self.rank(g)} made no progress for "
                                          f"{now - since:.0f} s (heartbeat_stale_after_s={self.stale_after_s:g}): hung; "
                                          "the run stopped, its last checkpoint is intact")
            pid = self.pid(g)
            if pid is not None and not Path(f"/proc/{pid}").exists():
                raise RolloutProcessError(f"rollout process rank {self.rank(g)} (pid {pid}) died; the run stopped, its "
                                          "last checkpoint is intact")

    def pid(self, g: int) -> int | None:
        """The process id of generating process g where it runs on this machine (else None: its heartbeat alone
        tells)."""
        if g not in self.pids and self.store.check([f"pid/{g}"]):
            host, pid = get_json(self.store, f"pid/{g}")
            self.pids[g] = pid if host == host_name() else None
        return self.pids.get(g)

    def wait(self, keys: list[str], stop=None) -> bool:
        """Until every key is in the store (True), or a stop request (False) when `stop` is given; a failure
        raises."""
        pause = POLL_S
        while not self.store.check(keys):
            if stop is not None and stop.requested:
                return False
            self.check()
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        return True


def host_name() -> str:
    import socket

    return socket.gethostname()


# ---------------------------------------------------------------- in flight, in the checkpoint


def in_flight_state(rollouts: list[dict], meta: dict) -> tuple[dict, dict]:
    """Whole rollouts (join_parts' with their index and version) as a checkpoint holds them (run_state.save_in_flight):
    tensors (each rollout's tokens and behaviour log-probs as flat rows with their lengths, its [completions,
    functions] rewards: exact, NaN kept) and plain data (the rest, and `meta`: where the generators continue)."""
    tensors, entries = {}, []
    for x in rollouts:
        r = x["rollout"]
        tensors[f"{r}.tokens"], tensors[f"{r}.token_counts"] = ragged(x["tokens"], torch.int64)
        tensors[f"{r}.logps"], tensors[f"{r}.logp_counts"] = ragged(x["logps"], torch.float32)
        tensors[f"{r}.rewards"] = torch.tensor(x["rewards"], dtype=torch.float32).view(len(x["tokens"]), -1)
        entries.append({"rollout": r, "version": x["version"], "stopped": x["stopped"], "seconds": x["seconds"]})
    return tensors, {**meta, "rollouts": entries}


def rollouts_of_state(tensors: dict, data: dict, what: str) -> list[dict]:
    """in_flight_state's rollouts back (the same Python numbers); a part missing is one line naming `what`."""
    out = []
    try:
        for entry in data["rollouts"]:
            r = entry["rollout"]
            out.append({**entry, "tokens": unragged(tensors[f"{r}.tokens"], tensors[f"{r}.token_counts"]),
                        "logps": unragged(tensors[f"{r}.logps"], tensors[f"{r}.logp_counts"]),
                        "rewards": tensors[f"{r}.rewards"].tolist(), "waited": 0.0, "error": None})
    except (KeyError, TypeError) as e:
        raise RecipeError(f"{what} is damaged: its rollouts in flight lack {e}; nothing was loaded; resume from an "
                          "earlier checkpoint with --resume PATH") from None
    return out


# ---------------------------------------------------------------- the training processes' side


class RolloutGroup:
    """The training processes' side of the split, held by the GRPO objective: each step's rollout from the
    generating processes (receive), the pushes and their check, what a checkpoint holds in flight."""

    def __init__(self, context):
        r = context.recipe
        self.recipe, self.plan = r, context.plan
        self.accelerator = context.accelerator
        self.trainers, self.generators = context.accelerator.num_processes, r.rollout_processes
        self.rank = context.accelerator.process_index
        self.lag, self.sync_every = r.max_staleness, r.weight_sync_steps
        self.vocab = len(context.tokenizer)
        self.store = bridge_store()
        self.health = Health(self.store, self.trainers, self.generators, r.heartbeat_stale_after_s)
        # trainer rank 0 sends the weights; its link to the generating processes is made now (they made theirs
        # when they started: each side waits for the other here)
        self.device = link_device()
        self.link = link_group(self.store, 0, 1 + self.generators, self.device) if self.rank == 0 else None
        self.started = False
        self.pushes: set[int] = set()
        self.total = 0
        self.behaviour: list = []  # the rollout's behaviour log-probs, every completion's (receive)
        self.timing: dict = {}
        OPEN.append(self)

    # -- the schedule from the first step this process trains

    def start(self, run, step: int) -> None:
        """At the first rollout: the rollouts in flight republished from the resumed checkpoint (trainer 0), the
        generating processes told where to start and what they generate with (hello), the pushes to make."""
        from finetune.generation import pad_id_for, stop_ids
        from finetune.model import context_length

        self.total = run.total_steps
        end = min(in_flight_end(step, self.lag, self.sync_every), self.total)
        self.pushes = set(pushed_versions(step, self.total, self.lag, self.sync_every))
        if self.rank == 0:
            self.republish(step, end)
            model = run.accelerator.unwrap_model(run.model)
            hello = {"start": step, "first": end, "total": self.total, "lag": self.lag, "sync_every": self.sync_every,
                     "trainers": self.trainers, "num_rows": len(run.datasets.train),
                     "prompts_per_step": run.plan.global_batch_size // self.recipe.num_generations,
                     "stop_ids": sorted(stop_ids(run.tokenizer, model, run.generation_config)),
                     "pad_id": pad_id_for(run.tokenizer), "context": context_length(run.config), "vocab": self.vocab,
                     # the behaviour log-probs over the tokenizer's ids (the correction's, as an engine's), or over
                     # every output row (without it they are the loss's old log-probs: token_logps')
                     "logprob_rows": None if self.recipe.vllm_importance_sampling_correction else run.config.vocab_size}
            set_json(self.store, "hello", hello)
        self.started = True

    def republish(self, step: int, end: int) -> None:
        """A resumed run's rollouts in flight, from its checkpoint into the store, split over the generating
        processes of this run as theirs would be."""
        expected = list(range(step, end))
        resume = self.plan.resume
        what = f"checkpoint {resume.path}" if resume is not None else ""
        state = load_in_flight(resume.path, IN_FLIGHT, resume.manifest, what) if resume is not None else None
        held = [] if state is None else rollouts_of_state(*state, what=what)
        if [x.get("rollout") for x in held] != expected:
            where = f"checkpoint {resume.path}" if resume is not None else "a fresh run"
            raise RecipeError(f"{where} holds rollouts {[x.get('rollout') for x in held]} in flight, and step {step} "
                              f"with max_staleness={self.lag}, weight_sync_steps={self.sync_every} needs {expected}; "
                              "resume from a checkpoint this run's settings wrote")
        for x in held:
            for g, part in enumerate(split_rollout(x, self.generators)):
                set_json(self.store, f"rollout/{x['rollout']}/{g}", part)

    # -- each step

    def receive(self, run, k: int, stop=None):
        """Rollout k (the step's), every completion of it in order: (tokens, stopped, [completions, functions]
        rewards, the generation's seconds); the behaviour log-probs in self.behaviour. Pushes version k first
        when a rollout is generated from it. None where a stop request came before the rollout did (agreed by
        the training processes: a collective)."""
        from finetune.training.generators import gather_objects

        if not self.started:
            self.start(run, k)
        push_s, check = self.push(run, k) if k in self.pushes else (0.0, float("nan"))
        t0 = time.perf_counter()
        keys = [f"rollout/{k}/{g}" for g in range(self.generators)]
        arrived = self.health.wait(keys, stop)
        if not all(gather_objects(arrived)):
            return None
        waited = time.perf_counter() - t0
        parts = [get_json(self.store, key) for key in keys]
        if self.store.add(f"read/{k}", 1) == self.trainers:  # the last reader: what stays is what a checkpoint needs
            for key in (*keys, f"read/{k}"):
                self.store.delete_key(key)
        failed = next((p["error"] for p in parts if p["error"]), None)
        if failed is not None:
            raise RecipeError(f"{failed}; the run stopped before step {k + 1}'s update, its last checkpoint is "
                              "intact: fix the function and continue with --resume auto")
        joined = join_parts(parts)
        self.behaviour = joined["logps"]
        version = policy_version(k, self.lag, self.sync_every)
        self.timing = {"sample/staleness_mean": float(k - version), "sample/staleness_max": float(k - version),
                       "perf/rollout_wait_s": waited, "perf/weight_sync_s": push_s,
                       "rollout/backpressure_s": max(p["waited"] for p in parts), "rollout/weight_check_logp_diff": check}
        functions = len(parts[0]["rewards"][0]) if parts[0]["rewards"] else len(self.recipe.reward_funcs)
        rewards = torch.tensor(joined["rewards"], dtype=torch.float32).view(len(joined["tokens"]), functions)
        return joined["tokens"], joined["stopped"], rewards, max(p["seconds"] for p in parts)

    def version(self, k: int) -> int:
        return policy_version(k, self.lag, self.sync_every)

    def behaviour_rows(self, share: slice) -> list | None:
        """This rank's completions' behaviour log-probs where the loss weighs them (off-policy), else None."""
        return self.behaviour[share] if off_policy(self.recipe) else None

    def old_rows(self, prompts: list[list[int]], behaviour: list) -> list | None:
        """Without the correction (vllm_importance_sampling_correction=false) a lagging rollout's old log-probs
        are its behaviour log-probs, laid out as the loss's (the prompt's positions 0): the ratio is then against
        the policy that sampled, TRL's AsyncGRPOTrainer's loss. None with the correction (the trainer's log-probs
        at the step are the old ones, the behaviour's weigh them)."""
        if self.recipe.vllm_importance_sampling_correction:
            return None
        return [[0.0] * len(p) + list(lp) for p, lp in zip(prompts, behaviour)]

    def values(self, sums: list[list[float]]) -> dict:
        """The step's metrics of the split: staleness, waits, the push check's difference, and (off-policy) the
        policy's drift from the behaviour log-probs and the importance weights', over every rank's completions
        (sums: each rank's GRPO.engine_sums, gathered), with TRL's names."""
        values = dict(self.timing)
        if not off_policy(self.recipe) or not sums:
            return values
        parts = torch.tensor(sums, dtype=torch.float64)
        tokens, count = parts[:, 1].sum().item(), parts[:, 5].sum().item()
        values["sampling/sampling_logp_difference/mean"] = parts[:, 0].sum().item() / max(tokens, 1.0)
        values["sampling/sampling_logp_difference/max"] = parts[:, 2].max().item()
        if count:
            values |= {"sampling/importance_sampling_ratio/min": parts[:, 3].min().item(),
                       "sampling/importance_sampling_ratio/mean": parts[:, 4].sum().item() / count,
                       "sampling/importance_sampling_ratio/max": parts[:, 6].max().item(),
                       "sampling/importance_sampling_clipped": parts[:, 7].sum().item() / count}
        return values

    # -- the push and its check

    def push(self, run, v: int) -> tuple[float, float]:
        """The weights of version v (the trainers' now) to the generating processes, then their check (module
        docstring). Every training process takes part (the gathers); trainer 0 sends. Its seconds, and the
        check's largest mean |difference| over the generating processes."""
        from finetune.training.generators import lora_scaling, merged_hf_tensors

        t0 = time.perf_counter()
        rows = run.schedule.rows(v, 0)[0][:PROBE_PROMPTS]
        prompts = [list(p) for p in run.datasets.train[rows]["prompt_input_ids"]]
        batch = probe_batch(prompts, run.tokenizer.pad_token_id)
        with SP.whole_sequences():  # every rank of a sequence-parallel group scores whole rows
            mine = probe_logps(run.model, batch, self.recipe, self.vocab, self.accelerator.device)
        buckets = run.parallel.strategy.weight_buckets(run.accelerator, run.model, self.recipe.vllm_push_layers)
        named = merged_hf_tensors(buckets, lora_scaling(run.accelerator.unwrap_model(run.model)))
        if self.rank == 0:
            set_json(self.store, f"push/{v}", {"version": v, "probe": prompts})
            with Watchdog(self.health):
                send_weights(self.link, named, self.device, v)
        else:
            for _ in named:  # the gathers the sharded strategies need from every rank
                pass
        keys = [f"check/{v}/{g}" for g in range(self.generators)]
        self.health.wait(keys)
        worst = 0.0
        tolerance = self.tolerance()
        for g, key in enumerate(keys):
            theirs = get_json(self.store, key)
            difference = logp_difference(mine, theirs)
            worst = max(worst, difference)
            if not difference <= tolerance:
                raise RecipeError(f"rollout process rank {self.trainers + g} does not hold the pushed weights (after {v} "
                                  f"updates): its log-probs of the check's tokens differ from the trainers' by "
                                  f"{difference:.3g} on average, more than {tolerance:g} (a weight push that did not "
                                  "take); the run stopped, its last checkpoint is intact")
        return time.perf_counter() - t0, worst

    def tolerance(self) -> float:
        from finetune.training.generators import ENGINE_DTYPES, LOGP_TOLERANCE

        return self.recipe.vllm_logp_tolerance or LOGP_TOLERANCE[ENGINE_DTYPES[self.recipe.mixed_precision]]

    # -- in flight

    def in_flight(self, step: int) -> dict:
        """What a checkpoint of `step` holds in flight (GRPO.in_flight, on trainer 0, which writes it): the rollouts
        generated from weights older than the checkpoint's (waited for), whole, and where the generators continue."""
        return {IN_FLIGHT: self.in_flight_state(step)} if self.rank == 0 and self.started else {}

    def in_flight_state(self, step: int) -> tuple[dict, dict]:
        """The rollouts in flight at a checkpoint of `step` (waited for), as tensors and plain data."""
        end = min(in_flight_end(step, self.lag, self.sync_every), self.total)  # none past the run's last step
        rollouts = []
        for r in range(step, end):
            keys = [f"rollout/{r}/{g}" for g in range(self.generators)]
            self.health.wait(keys)
            joined = join_parts([get_json(self.store, key) for key in keys])
            rollouts.append({"rollout": r, "version": policy_version(r, self.lag, self.sync_every), **joined})
        return in_flight_state(rollouts, {"format": 1, "step": step, "max_staleness": self.lag,
                                          "weight_sync_steps": self.sync_every, "next_rollout": end})

    def release(self) -> None:
        """The training is over (finished, stopped, failed): the generating processes may exit."""
        if self.rank == 0:
            self.store.set("stop", "1")


OPEN: list[RolloutGroup] = []  # this process's (release_all)


def release_all() -> None:
    """The training command's last word, however the run ended: the generating processes may exit."""
    for group in OPEN:
        try:
            group.release()
        except Exception:  # the store is gone with the launcher: nothing is waiting on it
            pass


PROBE_PROMPTS = 2  # the push check's probe: this many prompts of the step's rollout


def join_parts(parts: list[dict]) -> dict:
    """The generating processes' parts of one rollout (each theirs in order) as one: every completion in order."""
    out = {"tokens": [], "stopped": [], "rewards": [], "logps": [], "seconds": 0.0, "waited": 0.0, "error": None}
    for p in parts:
        for key in ("tokens", "stopped", "rewards", "logps"):
            out[key] += p[key]
        out["seconds"] = max(out["seconds"], p["seconds"])
        out["waited"] = max(out["waited"], p["waited"])
        out["error"] = out["error"] or p["error"]
    return out


def split_rollout(rollout: dict, parts: int) -> list[dict]:
    """A whole rollout as `parts` contiguous parts of equal size (its completions split by whole prompts)."""
    n = len(rollout["tokens"]) // parts
    out = []
    for i in range(parts):
        cut = slice(i * n, (i + 1) * n)
        out.append({key: rollout[key][cut] for key in ("tokens", "stopped", "rewards", "logps")} |
                   {"seconds": rollout["seconds"], "waited": 0.0, "error": rollout.get("error")})
    return out


def send_weights(link, named, device: torch.device, version: int) -> None:
    """Trainer 0: each bucket's header (names, shapes, dtypes) then its tensors, and an empty header to end."""
    from finetune.faults import fault_point

    bucket: list = []
    sent = 0
    for name, tensor in named:
        bucket.append((name, tensor))
        if len(bucket) < 16:
            continue
        send_bucket(link, bucket, device)
        sent += 1
        if sent == 1:
            fault_point("rollout_push", 0, version)  # a kill mid-push (tests)
        bucket = []
    if bucket:
        send_bucket(link, bucket, device)
    broadcast_json(link, [], device)


def send_bucket(link, bucket: list, device: torch.device) -> None:
    header = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in bucket]
    broadcast_json(link, header, device)
    for _, tensor in bucket:
        broadcast(link, tensor.detach().to(device).contiguous())


class Watchdog:
    """Trainer 0 inside a push (a blocking broadcast): the generating processes' health read beside it every
    second; a failure is one line and the process ends (the launcher ends the others), never a hang."""

    def __init__(self, health: Health):
        self.health, self.done = health, threading.Event()

    def __enter__(self):
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def watch(self) -> None:
        while not self.done.wait(1.0):
            try:
                self.health.check(force=True)
            except (RolloutProcessError, RecipeError) as e:
                sys.stderr.write(f"error: {e}\n")
                sys.stderr.flush()
                os._exit(1)
            except Exception:  # the store itself unreachable: the push's own error says more
                return
