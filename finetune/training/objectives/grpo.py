"""Group relative policy optimization (GRPO, DAPO, Dr. GRPO) as TRL's GRPOTrainer defines it (trl 1.16),
the objective the loop asks (objectives/base.py): each step's rollout (sampled, scored, recorded, kept
for num_iterations steps and for a resumed run), its micro-batches with the old and the reference's
log-probs, each micro-batch's loss, how a global batch is counted, its metrics. The loss family itself,
pure functions on tensors, is finetune/rl_losses.py; the rollout machinery (seeds, shares, the
generation, records, a rollout kept for a resume) is finetune/training/rollouts.py.

The rollout's own metrics (rewards per function, completion lengths) come from rollouts.rollout_metrics,
on the gathered global batch; the loss's (kl, clip ratios) from rl_losses.policy_loss's sums, reduced over
ranks by sum (the MAXED ones by max).

Under sequence parallelism (finetune/sequence_parallel.py) the rollout (sampling, old and reference
log-probs) runs on whole sequences, the loss on each rank's slice of every row, made whole over the SP
group (SP.whole_tokens); the group's first rank counts the completions, the loss and its metrics."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.data import IGNORE
from finetune.loss import token_logps, token_logps_entropy, token_logps_within
from finetune.model import context_length
from finetune.checkpointing.resume import kept_checkpoint
from finetune.training.objectives.base import Basic
from finetune.training.generators import (ENGINE_METRICS, check_installed, engine_logps_rows, gather_objects,
                                          generator_for, importance_weights)
from finetune.training.metrics import log
from finetune.checkpointing.run_state import load_in_flight
from finetune.objective_rules import grpo as grpo_rules
from finetune.training.rollout_group import RolloutGroup, metric_names as rollout_group_metrics
from finetune.training.rollouts import (CACHE_DIR, DYNAMIC_METRICS, IN_FLIGHT_ROLLOUT, ROLLOUTS, completion_seed,
                                        eval_metrics, eval_prompt_batches, eval_seed, eval_share, fill_groups,
                                        first_failure, generate_completions, joined, keep_rollouts, load_recorded,
                                        model_lengths, padded_rows, rank_prompts, real_rows, refill_schedule,
                                        rollout_batch, rollout_metric_names, rollout_metrics, rollout_record,
                                        rollout_state, rollouts_summary, save_recorded, prompt_schedule,
                                        signal_groups, talk_of, warn_undecodable, write_dropped, write_rollouts)
from finetune.training import agent
from finetune.faults import fault_point
from finetune.training.stopping import Interrupted
from finetune.recipe import RecipeError
from finetune.rewards import RewardError, Rewards, has_get_reward, weighted_rewards
from finetune.tools import Toolbox, environment_reward, tool_metrics
from finetune.rl_losses import (CLIPPED, MAXED, TOKEN_COUNTED, LossSettings, group_advantages, merged_sums, metric_names,
                                metric_values, policy_loss, rloo_advantages)


def masks_of(talk: list) -> list | None:
    """Each completion's tool mask from its conversation record (None without tools)."""
    return [t["tool_mask"] if t is not None else None for t in talk] if any(t is not None for t in talk) else None


def gather_rows(obj) -> list:
    """Every data-parallel rank's obj, in rank order: the ranks of a sequence-parallel group hold the same
    completions, so only each group's first is kept."""
    return gather_objects(obj)[::SP.group_size()]


def loss_note(recipe) -> str:
    """Said once as training starts: why the progress line's loss stays near 0 (users took `loss 0.0000`
    at every step for a run that learns nothing)."""
    ratio = "is 1 on the step's own rollout" if recipe.num_iterations == 1 else \
        f"is 1 on a rollout's first step and near 1 on its later ones (num_iterations={recipe.num_iterations})"
    kl = f"; plus beta={recipe.beta:g} x the KL to the reference, which grows as the policy moves" \
        if recipe.beta and recipe.loss_type != "rloo" else ""
    return (f"note: the loss shown stays about 0 whatever the policy learns: it is the policy loss, whose advantages "
            f"average 0 within each group and whose importance ratio {ratio}{kl}; the reward shows the learning (and "
            "eval reward at each eval)")


class GRPO(Basic):
    name = "grpo"
    makes_batches = True  # the loop hands rollout() no fetched rows: it reads the step's prompts itself
    evaluates = True  # the eval split's prompts sampled and scored (evaluate): TRL's eval metrics

    def __init__(self, recipe):
        self.recipe = recipe
        self.settings = LossSettings.from_recipe(recipe)
        self.loss_type, self.beta = recipe.loss_type, recipe.beta
        # cast_lm_head_to_fp32: the output layer's matmul, so the logits, in float32 (ScaleRL)
        self.head_dtype = torch.float32 if recipe.cast_lm_head_to_fp32 else None
        # the log-probs of the distribution the completions were sampled from (greedy: the logits as they are)
        self.temperature = recipe.temperature if recipe.temperature > 0 else 1.0
        self.max_completion_len = recipe.max_completion_len
        self.num_iterations, self.num_generations = recipe.num_iterations, recipe.num_generations
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        # tools (finetune/training/agent.py): the rollout's conversations, read by the chat template (before_model)
        self.toolbox, self.template = Toolbox.from_recipe(recipe), None
        self.converses = self.toolbox is not None  # the chat template's end-of-turn token ends a turn
        environment = self.toolbox.environment if self.toolbox is not None else None
        self.rewards = Rewards.from_recipe(recipe, [environment_reward(environment)]
                                          if environment is not None and has_get_reward(environment) else [])
        # rloo's kl is the rollout's (its penalty is in the reward), the others' the loss's
        self.rollout_names = (("kl",) if self.loss_type == "rloo" and self.beta != 0.0 else ()) + \
            rollout_metric_names(self.rewards.names, self.toolbox is not None) + (
            DYNAMIC_METRICS if recipe.dynamic_sampling else ()) + (
            ENGINE_METRICS if recipe.generation_backend == "vllm" else ()) + (
            rollout_group_metrics(recipe) if recipe.rollout_processes else ())
        self.generator = None  # finetune's generator or a vLLM engine, chosen by the recipe (after_prepare)
        self.rollout_group = None  # rollout_processes > 0: the rollouts come from processes of their own
        self.sampled_logps: list = []  # the engine's log-probs of the last sample()'s completions
        self.loss_metrics = metric_names(self.loss_type, self.beta)
        self.metrics = self.loss_metrics + self.rollout_names
        self.shown = {"reward": "reward"} | ({"kl": "kl"} if self.beta != 0.0 else {})
        self.loss_note = loss_note(recipe)
        # loss.png: not the policy loss, which is about 0 whatever the policy
        self.panels = (("reward: the weighted sum of the reward functions", "reward (mean per completion)", "reward"),
                       ("completion length", "tokens per completion (mean)", "completions/mean_length"),
                       ("entropy of the sampled distribution", "nats (mean per completion token)", "entropy"),
                       *([("clipped ratios", "share of completion tokens clipped", "clip_ratio/region_mean")]
                         if self.loss_type in CLIPPED else []),
                       *([("KL to the reference", "KL (mean per completion token)", "kl")] if self.beta else []),
                       *(agent.PANELS if self.toolbox is not None else ()))
        self.identifies_model = bool(self.beta)  # a resume reads the frozen reference from the model again
        self.reference = None
        self.cached = None  # (rollout index, this rank's micro-batches, the rollout's metrics)
        self.kept = None  # (rollout index, its record): what a checkpoint inside it holds (in_flight)
        self.replaying = False  # a resumed run with an engine: training on what it generated before (load_recorded)
        self.rollout_values: dict = {}
        self.sums = None
        self.micro_batch_count = float(recipe.micro_batch_size)  # the rollout's (count_per_micro_batch)
        self.maxed = MAXED  # the loss's sums end with a min and a max over completions (rl_losses.SUMS)
        self.said_unscored = False  # a step whose completions no function scored was said
        self.warned = False  # completions with ids the tokenizer cannot decode were logged once

    def schedule(self, plan, num_rows: int, ranks: int):
        """The prompt schedule: a step's global batch counted in prompts (every rank reads the step's
        list and takes its share: rank_prompts)."""
        return prompt_schedule(num_rows, plan.global_batch_size // self.num_generations, self.recipe.seed)

    def check_reward_models(self) -> None:
        """Reward models among the reward functions, read before the policy loads: a directory that is
        missing, cut short or without a score head (which would score at random) is one line."""
        from finetune.rewards import RewardModel, RewardSpecError

        for func in self.rewards.funcs:
            if isinstance(func, RewardModel):
                try:
                    func.check()
                except RewardSpecError as e:
                    raise RecipeError(f"reward_funcs: {e}") from None

    def before_model(self, context) -> None:
        """Checked before the policy loads, so each is one line before any expensive work: the reward
        models (check_reward_models), vLLM where generation_backend=vllm, a reward function that needs a column the prompt rows lack; and
        sampling that gives no learning signal (a warning)."""
        from finetune.rewards import missing_column_problem

        check_installed(context.recipe)  # generation_backend=vllm where vLLM imports, before the model loads
        self.check_reward_models()
        if self.toolbox is not None:  # the chat template renders tool turns as the model writes them (agent.py)
            self.template = agent.template_for(context.tokenizer, self.toolbox.schemas,
                                               agent.chat_stops(context.model_path, context.config, context.tokenizer),
                                               context.recipe.model)
        train = context.datasets.train
        columns = [c for c in train.column_names if c not in ("prompt", *D.PROMPT_COLUMNS)]
        problem = missing_column_problem(self.rewards, train[0], columns, self.toolbox) if len(train) else None
        if problem:
            raise RecipeError(problem)
        warning = grpo_rules.no_signal(self.recipe, getattr(context.config, "vocab_size", None))
        if warning and context.accelerator.is_main_process:
            log.warning(warning)

    def after_prepare(self, context, model) -> dict:
        """The reference (beta > 0), and rollouts.jsonl cut to the resumed step (removed on a fresh run)."""
        from finetune.training.reference import build_reference

        accelerator = context.accelerator
        self.reference = build_reference(context.plan, accelerator, context.model_path, context.config,
                                         context.weights_on_this_rank)
        if self.reference is not None and accelerator.is_main_process:
            log.info(f"reference: {self.reference.kind}")
        if accelerator.is_main_process:
            from pathlib import Path

            resume = context.plan.resume
            keep_rollouts(Path(context.recipe.output_dir) / ROLLOUTS, resume.step if resume is not None else 0)
            if resume is None:  # a fresh run: an earlier run's recorded rollouts are not this run's
                import shutil

                shutil.rmtree(Path(context.recipe.output_dir) / CACHE_DIR, ignore_errors=True)
        self.generator = generator_for(context, generate_completions)  # the eval's, and the rollouts' unless split
        if context.recipe.rollout_processes:
            self.rollout_group = RolloutGroup(context)
        self.resume = context.plan.resume
        self.replaying = self.resume is not None and self.generator.logprobs
        return {}

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict] | None:
        """This rank's micro-batches of step `step` (0-based): rollout step // num_iterations, generated
        now at its first step, kept for the next num_iterations - 1, read back from the checkpoint's in-flight
        state when a resumed run starts inside it (in_flight_record), or from what a vLLM engine generated after
        that checkpoint (load_recorded). None where a stop request (stop: finetune.training.stopping.StopRequest)
        ended the generation or the reward functions on any rank: the step is dropped."""
        k = step // self.num_iterations
        if self.cached is None or self.cached[0] != k:
            # a resumed run whose engine generated rollout k before the interruption trains on those completions
            recorded = None if step % self.num_iterations or not self.replaying else \
                load_recorded(run.out, k, self.resume.manifest.get("save_id"))
            if step % self.num_iterations:
                made = self.read_rollout(run, k, step, self.in_flight_record(k, step))
            elif recorded is not None:
                made = self.read_rollout(run, k, step, recorded, first=True)
            else:
                self.replaying = False  # what the interrupted run generated from here on followed its own updates
                made = self.new_rollout(run, k, step, stop)
            if made is None:
                return None
            self.cached = (k, *made)
        self.rollout_values = self.cached[2]
        return self.cached[1]

    def generation_batch(self, run, k: int, b: int, rows: list[int], step: int, stop=None):
        """Generation batch b of rollout k: this rank's share of the prompt rows sampled (a collective) and
        scored, gathered: (every completion's tokens, whether each stopped, [completions, functions]
        rewards, the generation's seconds, each completion's conversation record or None without tools), or
        None where a stop request cut it."""
        r, sp, g = run.recipe, run.parallel.sp, self.num_generations
        mine = rank_prompts(rows, sp.dp_rank, sp.dp_size)
        seeds = [completion_seed(r.seed, k, row, j, batch=b) for row in mine for j in range(g)]
        prompt_ids, tokens, stopped, per_func, error, seconds, cut, talk = self.sample(
            run, run.datasets.train, mine, seeds, step + 1, updates=step, stop=stop)
        parts = gather_rows((tokens, stopped, per_func.tolist(), error, cut, talk))
        if any(p[4] for p in parts):
            return None
        failed = first_failure(parts)
        if failed is not None:
            raise RecipeError(f"{failed}; the run stopped before step {step + 1}'s update, {kept_checkpoint(run.out)}: "
                              "fix the function and continue with --resume auto")
        return (*joined(parts, len(self.rewards.names)), seconds, talk_of(parts))

    def dynamic_batch(self, run, k: int, step: int, rows: list[int], stop=None):
        """dynamic_sampling=true (rollouts.py, "dynamic sampling"): generation batches until the step's groups
        with a learning signal fill it or max_generation_batches were generated; the dropped groups' lines
        in rollouts.jsonl. (rows, tokens, stopped, rewards, conversation records, seconds, counts) of the
        batch, or None (a stop request)."""
        r, g = run.recipe, self.num_generations
        made, seconds = [], 0.0
        for b in range(r.max_generation_batches):
            if b:
                fault_point("refill", run.accelerator.process_index, step + 1)  # a kill mid-refill (tests)
                rows = refill_schedule(len(run.datasets.train), len(rows), r.seed, b).rows(k, 0)[0]
            out = self.generation_batch(run, k, b, rows, step, stop)
            if out is None:
                return None
            made.append((rows, *out[:3], out[4]))
            seconds += out[3]
            if int(sum(signal_groups(m[3], self.rewards.weights, g).sum() for m in made)) >= len(rows):
                break
        batch_rows, tokens, stopped, rewards, talk, found, dropped = fill_groups(made, len(rows), self.rewards.weights,
                                                                                g)
        if run.accelerator.is_main_process:
            write_dropped(run.out / ROLLOUTS, step + 1, k, made, dropped, run.datasets.train, g, self.rewards.names,
                          self.rewards.weights)
            if found < len(rows):
                log.warning(f"step {step + 1}: dynamic sampling found {found} of {len(rows)} groups with unequal "
                            f"rewards in max_generation_batches={r.max_generation_batches} generation batches; "
                            f"training on them and {len(rows) - found} groups of equal rewards (advantage 0)")
        counts = dict(zip(DYNAMIC_METRICS, (float(len(made)), float(len(made) * len(rows) - found),
                                            float(len(rows) - found))))
        return batch_rows, tokens, stopped, rewards, talk, seconds, counts

    def new_rollout(self, run, k: int, step: int, stop=None) -> tuple[list[dict], dict] | None:
        r, accelerator = run.recipe, run.accelerator
        rows = run.schedule.rows(k, 0)[0]  # the prompt schedule: one micro-batch of the step's prompts
        if r.dynamic_sampling:
            made = self.dynamic_batch(run, k, step, rows, stop)
        elif self.rollout_group is not None:  # generated and scored by the generating processes
            made = self.rollout_group.receive(run, k, stop)
            if made is not None:  # no tools with the split (rollout_split.check refuses them): no conversations
                made = (rows, *made[:3], [None] * len(made[0]), made[3], {})
        else:
            made = self.generation_batch(run, k, 0, rows, step, stop)
            if made is not None:
                made = (rows, *made[:3], made[4], made[3], {})
        if made is None:
            return None
        rows, all_tokens, all_stopped, all_rewards, all_talk, seconds, counts = made
        prompt_ids, share = self.rank_share(run, rows)
        tokens, stopped, talk = all_tokens[share], all_stopped[share], all_talk[share]
        if torch.isnan(all_rewards).all() and not self.said_unscored and accelerator.is_main_process:
            self.said_unscored = True
            log.warning(f"step {step + 1}: no reward function scored any of the {len(all_tokens)} completions (every "
                        "reward None): their advantages are 0 and the step trains on nothing (its reward is null in "
                        "metrics.jsonl); said once")
        engine = self.generator.logprobs  # a vLLM engine: its log-probs against the trainer's, and the correction
        # a lagging rollout's behaviour log-probs: they weigh its loss as an engine's do (TRL's correction), or
        # without the correction are its old log-probs (TRL's async trainer)
        behaviour = self.rollout_group.behaviour_rows(share) if self.rollout_group is not None else None
        old = self.rollout_group.old_rows(prompt_ids, behaviour) if behaviour is not None else None
        # the micro-batches (old and reference log-probs) before the advantages: rloo's penalise the reward by them
        batches = self.batches(run, prompt_ids, tokens, stopped, torch.zeros(len(tokens)), old_rows=old,
                               engine_logps=self.sampled_logps if engine else None if old else behaviour,
                               masks=masks_of(talk))
        advantages, zero_std, kl = self.advantages(all_rewards, batches)
        for b, part in zip(batches, advantages[share].split(r.micro_batch_size)):
            b["advantages"] = part.clone()
        values = rollout_metrics(all_rewards, self.rewards.weights, self.rewards.names, zero_std,
                                 model_lengths(all_tokens, all_talk), ~torch.tensor(all_stopped, dtype=torch.bool))
        values["rollout_seconds"] = seconds
        values |= counts | (tool_metrics(all_talk) if self.toolbox is not None else {})
        self.micro_batch_count = self.count_per_micro_batch(all_tokens, all_stopped, all_talk)
        if kl is not None:
            values["kl"] = kl
        if engine:
            values |= self.engine_values(batches, k)
            values["vllm/push_seconds"] = self.generator.push_seconds
        if self.rollout_group is not None:
            values |= self.rollout_group.values(gather_objects(self.engine_sums.tolist()) if behaviour is not None else [])
        if self.num_iterations > 1 or engine:  # kept for a run resumed inside (or, with the engine, at) rollout k
            def rows_of(key):
                kept = [[b[key][i, :int(b["attention_mask"][i].sum())].tolist() for i in range(len(b["real"]))]
                        for b in batches]
                return [x for part in gather_rows([row for rows_ in kept for row in rows_]) for x in part]

            olds = rows_of("old_logps")
            ratios = rows_of("is_ratio") if "is_ratio" in batches[0] else None
            if accelerator.is_main_process:
                self.kept = (k, {"values": values, "old_logps": olds, "is_ratio": ratios, "rows": rows,
                                 "tokens": all_tokens, "stopped": all_stopped, "rewards": all_rewards,
                                 "advantages": advantages, "talk": all_talk})
                if engine:  # the engine's rollouts back to the last checkpoint's: a resumed run trains on them
                    save_recorded(run.out, k, self.kept[1], run.checkpoints.latest_id,
                                  keep=max(2, -(-r.save_every // self.num_iterations) + 1))
        if accelerator.is_main_process:
            self.record(run, step + 1, k, rows, all_tokens, all_stopped, all_rewards, advantages,
                        self.rollout_group.version(k) if self.rollout_group is not None else step, all_talk)
            self.warned = warn_undecodable(step + 1, all_tokens, len(run.tokenizer), self.warned)
        return batches, values

    def rank_share(self, run, rows: list[int]) -> tuple[list, slice]:
        """This data-parallel rank's part of a rollout of prompt `rows`: its prompts' ids, one per completion,
        and the slice of the rollout's completions that are theirs."""
        sp, g = run.parallel.sp, self.num_generations
        mine = rank_prompts(rows, sp.dp_rank, sp.dp_size)
        n = len(mine) * g
        return [p for p in run.datasets.train[mine]["prompt_input_ids"] for _ in range(g)], \
            slice(sp.dp_rank * n, (sp.dp_rank + 1) * n)

    def count_per_micro_batch(self, tokens: list, stopped: list, talk: list | None = None) -> float:
        """What the loss averages over (counts), of the whole rollout (every rank's completions), per
        micro-batch: the entropy bonus's unit (rl_losses.entropy_bonus)."""
        m = self.recipe.micro_batch_size
        if self.loss_type not in TOKEN_COUNTED:
            return float(m)
        lengths = model_lengths(tokens, talk or [None] * len(tokens)).tolist()
        counted = sum(n for n, s in zip(lengths, stopped) if s or not self.recipe.mask_truncated_completions)
        return counted * m / len(tokens)

    def advantages(self, rewards: torch.Tensor, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """The whole global batch's advantages from its [completions, functions] rewards (every rank's, in
        order), whether each completion's group has reward std 0, and rloo's kl metric (None for the
        others). rloo with beta > 0 (a collective): each completion's k1 KL, sum(old_logp - ref_logp) over
        its tokens, gathered from this rank's micro-batches (TRL's RLOOTrainer)."""
        r, g = self.recipe, self.num_generations
        if self.loss_type != "rloo":
            return (*group_advantages(rewards, self.rewards.weights, g, r.scale_rewards), None)
        kl, metric = None, None
        if self.beta != 0.0:
            per_token = [(b["old_logps"] - b["ref_logps"]) * (b["labels"] != IGNORE) for b in batches]
            parts = gather_rows(([x for t in per_token for x in t.sum(-1).tolist()],
                                    sum(t.sum().item() for t in per_token), sum(D.target_tokens(b) for b in batches)))
            kl = torch.tensor([x for part in parts for x in part[0]], dtype=torch.float64)
            metric = sum(part[1] for part in parts) / max(sum(part[2] for part in parts), 1)
        advantages, zero_std = rloo_advantages(rewards, self.rewards.weights, g, kl, self.beta,
                                               r.normalize_advantages)
        return advantages, zero_std, metric

    def record(self, run, step: int, k: int, rows: list[int], tokens, stopped, rewards, advantages, version: int,
               talk) -> None:
        """Rank 0: rollout k's completions, their rewards and advantages (and conversations) into
        rollouts.jsonl, under `step` (1-based), with the policy version (optimizer steps) that generated them."""
        write_rollouts(run.out / ROLLOUTS, step, k, rows, run.datasets.train, self.num_generations, tokens,
                       run.tokenizer.batch_decode(tokens, skip_special_tokens=True), stopped, self.rewards.names,
                       rewards, weighted_rewards(rewards, self.rewards.weights), advantages, len(run.tokenizer),
                       version=version, talk=talk if self.toolbox is not None else None)

    def sample(self, run, ds, mine: list[int], seeds: list[int], step: int, updates: int, stop=None) -> tuple:
        """This rank's prompts (rows `mine` of ds), num_generations completions each sampled with `seeds` (a
        collective: the weights gathered once for all of them, every rank calls it, with no prompts too),
        scored here by the reward functions: (the prompts' ids, one per completion, the completions'
        tokens, whether each stopped, [completions, functions] rewards, a reward function's failure as
        one line or None, the generation's seconds, whether a stop request cut the generation or the
        scoring short). `step` names the step in a failure's line; `updates`: the optimizer steps the policy
        has taken (a vLLM engine is given its weights when it holds older ones). A stop request (stop) ends
        our generator before its next token and a reward function's call at once (it may never return):
        read as the eval reads it, so that a signal is acted on within a rollout. The engine's log-probs of
        the completions are left in self.sampled_logps."""
        t0, g = time.perf_counter(), self.num_generations
        cols = ds[mine] if mine else {c: [] for c in ds.column_names}
        prompt_ids = [p for p in cols["prompt_input_ids"] for _ in range(g)]
        extra = {c: [v for v in cols[c] for _ in range(g)] for c in cols if c not in ("prompt", *D.PROMPT_COLUMNS)}
        turns = None
        if self.toolbox is not None and mine:  # the conversations, between turns (finetune/training/agent.py)
            rows = [{"prompt": p} | {c: v[i] for c, v in extra.items()}
                    for i, p in enumerate(p for p in cols["prompt"] for _ in range(g))]
            r = run.recipe
            rank = run.accelerator.process_index
            context = context_length(run.config)
            if r.generation_backend == "vllm":  # the engine's max_model_len
                context = min(context or r.max_seq_len, r.max_seq_len)
            turns = agent.Conversations(self.template, self.toolbox, rows, seeds, prompt_ids,
                                        r.max_tool_calling_iterations, r.tool_timeout,
                                        between=lambda: fault_point("turn", rank, step),  # a kill between turns
                                        context=context)
        with SP.whole_sequences():  # every rank of an SP group samples its group's prompts whole
            outs = self.generator(run, prompt_ids, seeds, updates, stop, **({"turns": turns} if turns else {}))
        self.generator.sleep()  # a vLLM engine on GPUs gives its memory back to the step (vllm_enable_sleep_mode)
        tokens, stopped = [o.tokens for o in outs], [o.stopped for o in outs]
        self.sampled_logps = [o.logprobs for o in outs] if self.generator.logprobs else []
        texts = run.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        talk = None
        if turns is not None:  # TRL's completions with tools: each conversation's messages
            talk, texts = turns.finish(outs), turns.messages
            if self.toolbox.environment is not None:
                extra["environments"] = turns.environments
        elif self.toolbox is not None:
            talk = []
        seconds = time.perf_counter() - t0
        error, per_func = None, torch.full((len(tokens), len(self.rewards.names)), float("nan"))
        cut = stop is not None and bool(stop.requested)
        if tokens and not cut:
            try:
                with stop.interrupting() if stop is not None else contextlib.nullcontext():
                    per_func = self.rewards.score(step, [p for p in cols["prompt"] for _ in range(g)], texts,
                                                  tokens, extra)
            except RewardError as e:
                error = str(e)
            except Interrupted:
                cut = True
        return prompt_ids, tokens, stopped, per_func, error, seconds, cut, talk

    def evaluate(self, run, step: int, stop, loss_eval) -> tuple[None, dict] | None:
        """TRL's GRPO eval: each eval prompt (the first eval_max_samples eval rows, all if 0) gets
        num_generations completions sampled as the rollout samples them (the training temperature, top_p,
        top_k, max_completion_len), scored by the recipe's reward functions and weights; the metrics are
        the rollout's (rollout_metrics: reward, reward_std, each function's mean and std, completion
        lengths) over all of them. No eval loss: with fresh samples the policy loss is the advantages'
        mean, about 0 whatever the policy, a number that says nothing (TRL logs it all the same).

        The prompts go in batches of a rollout's (the step's prompts, global_batch_size), each batch split
        into contiguous shares over the data-parallel ranks (eval_share: the last batch's shares may be
        uneven, or empty) and generated in one call per batch, the weights gathered once per call as for
        the rollout. Completion j of eval row i samples with eval_seed(seed, i, j): the same seeds at
        every eval, on any number of ranks and after a resume, so evals differ only by the policy. A stop
        request, read between batches and agreed by the ranks (one all-reduce a batch, as loop.evaluate),
        ends the eval: None. A reward function that fails stops the run as in the rollout."""
        r, sp, g = run.recipe, run.parallel.sp, self.num_generations
        ds = run.datasets.eval
        count = min(len(ds), r.eval_max_samples) if r.eval_max_samples else len(ds)
        device = run.accelerator.device
        batches = []
        for rows in eval_prompt_batches(count, run.plan.global_batch_size // g):
            if run.reduce_sum(torch.tensor([float(bool(stop.requested))], device=device)).item() > 0:
                return None
            mine = eval_share(rows, sp.dp_rank, sp.dp_size)
            seeds = [eval_seed(r.seed, row, j) for row in mine for j in range(g)]
            _, tokens, stopped, per_func, error, _, cut, talk = self.sample(run, ds, mine, seeds, step, updates=step,
                                                                             stop=stop)
            parts = gather_rows((tokens, stopped, per_func.tolist(), error, cut, talk))
            if any(p[4] for p in parts):
                return None
            failed = first_failure(parts)
            if failed is not None:
                raise RecipeError(f"eval at {failed}; the run stopped at the eval after step {step}, "
                                  f"{kept_checkpoint(run.out)}: fix the function and continue with --resume auto")
            batches.append(parts)
        return None, eval_metrics(batches, self.rewards.weights, self.rewards.names, g, r.scale_rewards)

    def in_flight(self, step: int) -> dict:
        """What a checkpoint after `step` steps holds of the rollout in flight: the rollout the next step trains
        on when it was generated before (num_iterations > 1, step inside it), on the main process; with
        rollout_processes, the rollouts generated and not yet trained on (RolloutGroup.in_flight)."""
        if self.rollout_group is not None:
            return self.rollout_group.in_flight(step)
        k = step // self.num_iterations
        if step % self.num_iterations == 0 or self.kept is None or self.kept[0] != k:
            return {}
        return {IN_FLIGHT_ROLLOUT: rollout_state(k, self.kept[1])}

    def in_flight_record(self, k: int, step: int) -> dict:
        """Rollout k from the checkpoint this run resumed from (its in-flight state, which the manifest
        lists and checksums), and nowhere else; one line where it holds none."""
        point = self.resume
        if point is None or point.step != step:
            raise RecipeError(f"step {step + 1} trains on rollout {k}, which this run holds neither in memory nor in "
                              "the checkpoint it resumed from")
        what = f"checkpoint {point.path}"
        found = load_in_flight(point.path, IN_FLIGHT_ROLLOUT, point.manifest, what)
        if found is None:  # (resume.check_in_flight_held said so before the launch)
            raise RecipeError(f"{what} {grpo_rules.in_flight(self.recipe, step)[1]}")
        tensors, data = found
        if data.get("rollout") != k:
            raise RecipeError(f"{what} is damaged: its in-flight rollout is rollout {data.get('rollout')!r}, not {k}; "
                              "nothing was loaded; resume from an earlier checkpoint with --resume PATH")
        return rollout_record(tensors, data, what)

    def read_rollout(self, run, k: int, step: int, saved: dict, first: bool = False) -> tuple[list[dict], dict]:
        """A resumed run starting inside rollout k: its completions, advantages and old log-probs (and a vLLM
        engine's importance weights) from the rollout the run kept when it generated them (the policy has moved
        since): the checkpoint's in-flight rollout, or what the engine recorded after it. first: the resumed run
        starts at rollout k's first step, which the engine had generated before the interruption; its
        rollouts.jsonl records are written again."""
        if run.accelerator.is_main_process:
            self.kept = (k, saved)  # a checkpoint later inside rollout k holds it again
        rows = saved["rows"]
        prompt_ids, share = self.rank_share(run, rows)
        ratios = saved.get("is_ratio")
        talk = saved.get("talk") or [None] * len(saved["tokens"])
        self.micro_batch_count = self.count_per_micro_batch(saved["tokens"], saved["stopped"], talk)
        batches = self.batches(run, prompt_ids, saved["tokens"][share],
                               saved["stopped"][share], saved["advantages"][share], saved["old_logps"][share],
                               is_rows=ratios[share] if ratios is not None else None, masks=masks_of(talk[share]))
        if first and run.accelerator.is_main_process:
            self.record(run, step + 1, k, rows, saved["tokens"], saved["stopped"], saved["rewards"],
                        saved["advantages"], step, talk)
        return batches, saved["values"]

    def batches(self, run, prompts, tokens, stopped, advantages, old_rows=None, engine_logps=None,
                is_rows=None, masks=None) -> list[dict]:
        """This rank's completions as micro-batches of micro_batch_size, with the old log-probs
        (num_iterations > 1 or a vLLM engine's completions: computed now, or the saved rows) and the
        reference's (beta > 0). engine_logps: the engine's log-probs of the completions (one list each), for
        the importance weights (is_ratio, vllm_importance_sampling_correction) and the push check
        (self.engine_sums); is_rows: the weights saved with a recorded rollout; masks: each completion's tool
        mask (its fed tokens out of every term), or None."""
        r, model = run.recipe, run.model
        m = r.micro_batch_size
        # rloo with beta > 0 penalises the reward by the KL of the old log-probs (also with one iteration)
        keep_old = (self.num_iterations > 1 or engine_logps is not None or is_rows is not None or old_rows is not None
                    or (self.loss_type == "rloo" and self.beta != 0.0))
        self.engine_sums = torch.tensor([0.0, 0.0, 0.0, math.inf, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        out = []
        with SP.whole_sequences():  # the old and reference log-probs of whole sequences (every rank of an SP group)
            for a in range(0, len(tokens), m):
                b = rollout_batch(prompts[a:a + m], tokens[a:a + m], stopped[a:a + m], advantages[a:a + m],
                                  run.tokenizer.pad_token_id, mask_truncated=r.mask_truncated_completions,
                                  masks=masks[a:a + m] if masks is not None else None)
                if keep_old or self.reference is not None:
                    device_batch = {k: v.to(run.accelerator.device) for k, v in b.items()}
                    if keep_old and old_rows is None:
                        # against an engine's: the policy that sampled, without dropout (LoRA's lora_dropout)
                        was_training = model.training
                        model.train(was_training and engine_logps is None)
                        with torch.no_grad():
                            if engine_logps is None:
                                b["old_logps"] = self.token_logps(model, device_batch).float().cpu()
                            else:  # and the sampled distribution's: the tokenizer's rows only, as the engine draws
                                full, within = token_logps_within(model, device_batch, len(run.tokenizer),
                                                                  self.loss_impl, self.chunk, self.temperature,
                                                                  self.head_dtype)
                                b["old_logps"], sampler_logps = full.float().cpu(), within.float().cpu()
                        model.train(was_training)
                    elif keep_old:
                        b["old_logps"] = padded_rows(old_rows[a:a + m], b["labels"].shape)
                    if engine_logps is not None:
                        self.weigh(b, sampler_logps,
                                   engine_logps_rows(engine_logps[a:a + m], prompts[a:a + m], b["labels"].shape))
                    elif is_rows is not None:
                        b["is_ratio"] = padded_rows(is_rows[a:a + m], b["labels"].shape, fill=1.0)
                    if self.reference is not None:
                        b["ref_logps"] = self.reference.token_logps(model, device_batch, self.temperature,
                                                                    self.head_dtype).float().cpu()
                out.append(b)
        return out

    def token_logps(self, model, batch: dict) -> torch.Tensor:
        """The policy's per-token log-probs of a micro-batch at the sampling temperature (the loss's, and
        the old ones kept at the rollout)."""
        return token_logps(model, batch, self.loss_impl, self.chunk, self.temperature, self.head_dtype)

    def weigh(self, b: dict, trainer: torch.Tensor, sampled: torch.Tensor) -> None:
        """A micro-batch of the engine's completions (or a lagging rollout's): its importance weights (TRL's
        correction, when on) and the push check's sums (|engine - trainer| log-prob sum, tokens, largest; the
        weights' min, sum, count, max, and how many were clipped or masked). trainer: the policy's log-probs of
        the distribution the engine draws from (the tokenizer's rows, without the padded ones:
        loss.token_logps_within), as the engine returns them."""
        r = self.recipe
        mask = (b["labels"] != IGNORE).float()
        delta = (trainer - sampled).abs() * mask
        sums = self.engine_sums
        sums[0] += delta.sum().item()
        sums[1] += mask.sum().item()
        sums[2] = max(sums[2].item(), delta.max().item() if delta.numel() else 0.0)
        if not r.vllm_importance_sampling_correction:
            return
        ratio = importance_weights(trainer, sampled, mask, r.vllm_importance_sampling_mode,
                                   r.vllm_importance_sampling_clip_max)
        b["is_ratio"] = ratio
        # TRL's metrics: over the sequences (sequence_* modes) or the completion tokens (token_*)
        # (a sequence's weight read at its first completion token: the prompt's positions hold 1)
        seen = ratio.gather(1, mask.argmax(-1, keepdim=True))[mask.sum(-1) > 0].flatten() \
            if r.vllm_importance_sampling_mode.startswith("sequence") else ratio[mask.bool()]
        if seen.numel():
            sums[3] = min(sums[3].item(), seen.min().item())
            sums[4] += seen.sum().item()
            sums[5] += seen.numel()
            sums[6] = max(sums[6].item(), seen.max().item())
            clip = r.vllm_importance_sampling_clip_max
            sums[7] += ((seen == 0) if r.vllm_importance_sampling_mode.endswith("mask") else (seen >= clip)).sum().item()

    def engine_values(self, batches: list[dict], k: int) -> dict:
        """The push check over every rank's completions of rollout k (vllm/logp_diff: the mean and largest
        |engine - trainer| log-prob of the sampled tokens) and TRL's importance-ratio metrics; stops the run
        when the engine does not hold the trained weights (EngineGenerator.check)."""
        parts = torch.stack([torch.as_tensor(p) for p in gather_objects(self.engine_sums.tolist())])
        tokens = parts[:, 1].sum().item()
        mean, largest = parts[:, 0].sum().item() / max(tokens, 1.0), parts[:, 2].max().item()
        self.generator.check(mean, largest, k)
        values = {"vllm/logp_diff/mean": mean, "vllm/logp_diff/max": largest}
        if self.recipe.vllm_importance_sampling_correction and parts[:, 5].sum() > 0:
            values |= {"sampling/importance_sampling_ratio/min": parts[:, 3].min().item(),
                       "sampling/importance_sampling_ratio/mean": parts[:, 4].sum().item() / parts[:, 5].sum().item(),
                       "sampling/importance_sampling_ratio/max": parts[:, 6].max().item()}
        return values

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch of completions; its metrics' sums are kept for take_metrics."""
        logps, entropies = token_logps_entropy(model, batch, self.loss_impl, self.chunk, self.temperature,
                                               self.head_dtype)
        labels = batch["row_labels"] if "row_labels" in batch else batch["labels"]
        if "shift_labels" in batch:  # a sequence-parallel shard: the whole rows' values, on every rank of the group
            logps, entropies = (SP.whole_tokens(x, labels.shape[1])[:labels.shape[0]] for x in (logps, entropies))
        mask = (labels != IGNORE).to(logps.device)
        loss, sums = policy_loss(
            logps, batch["advantages"], mask, old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"),
            entropies=entropies, settings=self.settings, is_ratio=batch.get("is_ratio"),
            micro_batch_count=self.micro_batch_count)
        if not SP.counts_pairs():  # the group's first rank counts the completions; the others pass gradients on
            loss, sums = loss * 0, torch.cat([sums[:-MAXED] * 0, sums[-MAXED:]])
        self.sums = merged_sums(self.sums, sums)
        return loss

    def count(self, batch: dict) -> int:
        """What a micro-batch's loss is averaged over: completions, or completion tokens for dapo."""
        if self.loss_type in TOKEN_COUNTED:
            return D.target_tokens(batch)  # a shard's own: summed over the SP group, the rows'
        return int(real_rows(batch).sum()) if SP.counts_pairs() else 0

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [what the loss is averaged over, completion tokens in
        the loss, input tokens], float64; summed over ranks."""
        return torch.tensor([sum(self.count(b) for b in micro_batches),
                             sum(D.target_tokens(b) for b in micro_batches),
                             sum(D.input_tokens(b) for b in micro_batches)], dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        return self.count(batch)

    def summary(self, out) -> dict:
        """The run summary's fields of this objective: completions holding ids the tokenizer could not
        decode, counted over rollouts.jsonl (none: nothing)."""
        return rollouts_summary(out / ROLLOUTS)

    def take_metrics(self) -> torch.Tensor | None:
        """The loss's metric sums since the last call (rl_losses.SUMS: the last `maxed` reduced by max), or None."""
        sums, self.sums = self.sums, None
        return sums

    def means(self, sums: torch.Tensor, count: torch.Tensor | None = None) -> list[float]:
        """The metrics' values (in `metrics` order) from take_metrics' sums reduced over ranks: means
        over what they count themselves (not over the global batch's count), then the
        step's rollout metrics (computed on the whole gathered rollout, the same on every rank)."""
        return metric_values(sums, self.loss_type, self.beta) + [self.rollout_values.get(n, float("nan")) for n in self.rollout_names]
