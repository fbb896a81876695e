"""A generating process of GRPO's split (rollout_processes; the protocol and the training processes' side:
finetune/training/rollout_group.py): it never joins the trainers' process group. It waits for their hello (where
to start, what ends a completion), builds the model from its config (its weights come from the trainers' first
push), then for each rollout from the hello's on: takes the push of the weights the rollout is generated from
(policy_version) when it does not hold them, checks them (the probe's log-probs, published for the trainers to
compare), generates its share of the rollout's prompts with finetune/generation.py (the same seeds as the
colocated run: the same completions from the same weights), scores them with the recipe's reward functions and
publishes them with their behaviour log-probs. It ends after the run's last rollout, or when the trainers say
stop (a signal stops the trainers, which save what is in flight; this process serves them until they say so).

A reward function's failure goes to the trainers with the rollout (they stop the run with its line, as the
colocated run does); any other failure is one line naming this rank, published for the trainers (who stop) and
said here, and the process exits 1."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch

from finetune.faults import fault_point, injected
from finetune.training.rollout_group import (LAUNCHED, bridge_store, broadcast, broadcast_json, get_json,
                                             host_name, link_device, link_group, policy_version, probe_batch, probe_logps,
                                             set_json)

BEAT_S = 0.2  # the least time between two heartbeats


class Generator:
    """One generating process: its link to trainer 0, its model, its share of every rollout."""

    def __init__(self, recipe, index: int):
        self.recipe, self.index = recipe, index
        self.count = recipe.rollout_processes
        self.rank = int(os.environ.get("RANK", "0"))
        self.trainers = int(os.environ[LAUNCHED]) - self.count
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # its GPU (one that a node's processes share when it has fewer than them), and the weights' way in
        self.device = torch.device(f"cuda:{local % torch.cuda.device_count()}") if torch.cuda.is_available() \
            else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.link_device = link_device()
        self.store = bridge_store()
        self.beaten = 0.0
        self.waited = 0.0  # seconds spent waiting for weights since the last rollout was published
        self.beat(force=True)
        set_json(self.store, f"pid/{index}", [host_name(), os.getpid()])
        self.link = link_group(self.store, 1 + index, 1 + self.count, self.link_device)
        self.model = self.tokenizer = self.train = self.rewards = self.hello = None

    def beat(self, force: bool = False) -> None:
        """A sign of progress for the trainers' health check (a counter: no clocks compared across machines)."""
        now = time.monotonic()
        if force or now - self.beaten >= BEAT_S:
            self.store.add(f"beat/{self.index}", 1)
            self.beaten = now

    def stopped(self) -> bool:
        return self.store.check(["stop"])

    def wait_for(self, key: str) -> bool:
        """Until `key` is in the store (True) or the trainers say stop (False), beating."""
        pause = 0.01
        while not self.store.check([key]):
            if self.stopped():
                return False
            self.beat()
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        return True

    # -- set-up, once the trainers said hello

    def setup(self) -> None:
        from finetune import data as D
        from finetune.model import load_config, load_tokenizer, model_class
        from finetune.rewards import Rewards

        r = self.recipe
        self.hello = get_json(self.store, "hello")
        model_path, config = load_config(r)
        self.tokenizer = load_tokenizer(r, model_path)
        self.train = D.build_datasets(r, self.tokenizer).train  # the trainers built it first: their cache
        self.rewards = Rewards.from_recipe(r)
        with torch.device(self.device):
            self.model = model_class(config).from_config(config, dtype=generator_dtype(r),
                                                         attn_implementation=r.attn_implementation)
        self.model.eval()
        self.params = dict(self.model.named_parameters())

    # -- the weights

    def take_push(self, version: int) -> bool:
        """The trainers' push of `version` received into the model, then its check published; False: stopped."""
        started = time.perf_counter()
        if not self.wait_for(f"push/{version}"):
            return False
        announced = get_json(self.store, f"push/{version}")
        fault = injected("rollout_receive", self.rank, version)
        if fault != "SKIP":
            fault_point("rollout_receive", self.rank, version)  # RAISE, SLEEP: a failed or hung receive (tests)
        while True:
            header = broadcast_json(self.link, None, self.link_device)
            if not header:
                break
            for name, shape, dtype in header:
                buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=self.link_device)
                broadcast(self.link, buffer)
                if fault != "SKIP":  # SKIP: a push that does not take (tests)
                    target = self.params.get(name)
                    if target is None:
                        raise RuntimeError(f"the pushed weight {name} is not one of this model's parameters")
                    with torch.no_grad():
                        target.copy_(buffer)
            self.beat()
        batch = probe_batch(announced["probe"], self.hello["pad_id"])
        set_json(self.store, f"check/{version}/{self.index}",
                 probe_logps(self.model, batch, self.recipe, self.hello["vocab"], self.device))
        self.waited += time.perf_counter() - started
        return True

    # -- a rollout

    def share(self, rollout: int) -> list[int]:
        """This process's contiguous share of rollout `rollout`'s prompt rows (the prompt schedule's)."""
        from finetune.training.rollouts import prompt_schedule, rank_prompts

        h = self.hello
        rows = prompt_schedule(h["num_rows"], h["prompts_per_step"], self.recipe.seed).rows(rollout, 0)[0]
        return rank_prompts(rows, self.index, self.count)

    def generate(self, rollout: int) -> dict:
        """This process's completions of rollout `rollout`, scored: what the trainers join (rollout_group)."""
        from finetune.data import PROMPT_COLUMNS
        from finetune.generation import Sampling, decode_compiled, generate
        from finetune.rewards import RewardError
        from finetune.training.rollouts import completion_seed

        r, h, g = self.recipe, self.hello, self.recipe.num_generations
        t0 = time.perf_counter()
        mine = self.share(rollout)
        cols = self.train[mine]
        prompts = [list(p) for p in cols["prompt_input_ids"] for _ in range(g)]
        seeds = [completion_seed(r.seed, rollout, row, j) for row in mine for j in range(g)]
        sampling = Sampling(r.max_completion_len, r.temperature, r.top_p, r.top_k)
        drawn = []

        def progress() -> bool:  # before each token: a heartbeat, and a fault a test injects mid-generation
            drawn.append(True)
            self.beat()
            if len(drawn) == 2:
                fault_point("rollout_generate", self.rank, rollout)
            return False

        with torch.no_grad():
            outs = generate(self.model, prompts, sampling, stop_ids=h["stop_ids"], pad_id=h["pad_id"],
                            context=h["context"], seeds=seeds if sampling.temperature > 0 else None,
                            should_stop=progress, vocab_size=h["vocab"],
                            compiled=decode_compiled(r.generation_compile, self.device), logprobs=True,
                            logprob_rows=h["logprob_rows"])
        tokens = [o.tokens for o in outs]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        extra = {c: [v for v in cols[c] for _ in range(g)] for c in cols if c not in ("prompt", *PROMPT_COLUMNS)}
        error, rewards = None, []
        try:
            self.beat(force=True)
            per_func = self.rewards.score(rollout + 1, [p for p in cols["prompt"] for _ in range(g)], texts, tokens,
                                          extra)
            rewards = per_func.tolist()
        except RewardError as e:
            error = str(e)
        self.beat(force=True)
        part = {"tokens": tokens, "stopped": [o.stopped for o in outs], "rewards": rewards,
                "logps": [o.logprobs for o in outs], "error": error, "seconds": time.perf_counter() - t0,
                "waited": self.waited}
        self.waited = 0.0
        return part

    # -- the whole life

    def run(self) -> int:
        if not self.wait_for("hello"):
            return 0
        self.setup()
        h = self.hello
        held = None
        for rollout in range(h["first"], h["total"]):
            need = policy_version(rollout, h["lag"], h["sync_every"])
            if held != need:
                if not self.take_push(need):
                    return 0
                held = need
            if self.stopped():
                return 0
            part = self.generate(rollout)
            set_json(self.store, f"rollout/{rollout}/{self.index}", part)
            if part["error"]:  # the trainers stop the run with the reward function's line
                self.wait_for("never")
                return 0
        return 0


def generator_dtype(recipe) -> torch.dtype:
    """The generating process's weights: the training's compute dtype (16 bits where mixed_precision is, as
    FSDP2 and ZeRO-3 gather them for the colocated run's generation; fp32 otherwise, the trainers' own)."""
    from finetune.model import base_dtype

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.mixed_precision, base_dtype(recipe))


def serve(args, index: int) -> int:
    """A generating process's main (the training command's, for the launch's last rollout_processes ranks): its
    exit code. Signals that ask a run to stop are the trainers' to act on (they save what is in flight, which
    this process may still be generating): this process serves them until they say stop."""
    from finetune.recipe import RecipeError, resolve
    from finetune.training.metrics import setup_logging

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.dry_run:
        return 0
    generator = None
    try:
        recipe = resolve(args.recipe, args.overrides)
        setup_logging(recipe.log_level, int(os.environ.get("RANK", "0")))
        generator = Generator(recipe, index)
        code = generator.run()
    except RecipeError as e:  # what the trainers refuse too: they say it
        code = _failed(generator, index, str(e), user=True)
    except Exception as e:  # a bug or a machine fault: said as this rank's, published for the trainers
        rank = os.environ.get("RANK", "?")
        if generator is not None and not _store_reachable(generator.store):
            # trainer 0, which hosts the store, has gone: the trainers stopped the run and said why
            print(f"rollout process rank {rank}: the training processes are gone ({type(e).__name__}); stopping",
                  file=sys.stderr, flush=True)
            os._exit(1)
        traceback.print_exc()
        code = _failed(generator, index, f"rollout process rank {rank} failed: {type(e).__name__}: {e}; the run "
                                         "stopped, its last checkpoint is intact", user=False)
    # no teardown of the link group (a gloo group's destructor can block on its worker threads: see
    # finetune.commands.train.exit_without_teardown)
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _store_reachable(store) -> bool:
    try:
        store.check(["failed/probe"])
        return True
    except Exception:  # noqa: BLE001 - any failure to reach it means it is gone
        return False


def _failed(generator, index: int, line: str, user: bool) -> int:
    if generator is not None:
        try:
            set_json(generator.store, f"failed/{index}", {"line": line, "user": user})
        except Exception:  # the store is gone: the launcher ends the run
            pass
    if not user:
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 2 if user else 1
