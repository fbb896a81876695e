"""Group relative policy optimization (GRPO, DAPO, Dr. GRPO) as TRL's GRPOTrainer defines it (trl 1.16,
trl/trainer/grpo_trainer.py: _generate_and_score_completions for the advantages, _compute_loss for the
loss and its metrics), so that users can carry their settings over.

Each prompt of a step has num_generations completions (a group). Their rewards (one column per reward
function, NaN where a function did not score, finetune/rewards.py) are summed with the weights (nansum)
and the advantage of each completion is its reward minus its group's mean, divided by (std + 1e-4)
where std is the group's (scale_rewards=group), the whole batch's (batch), or not divided (none); a
completion no function scored gets advantage 0. Per completion token, with r = exp(logp - old_logp):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = r (exp(ref_logp - logp) - (ref_logp - logp) - 1)  (only when beta > 0)

kl_t is the k3 estimator times the importance ratio (use_bias_correction_kl=true, TRL 1.16's default: the
gradient of the unbiased reverse KL, DeepSeek-V3.2); use_bias_correction_kl=false leaves the plain k3
term. The ratio is differentiable, so it changes the KL's gradient even where its value is 1.
old_logp is the policy's at the rollout (num_iterations > 1 steps reuse one rollout); with one iteration
it is logp itself, detached, so r = 1 and only its gradient acts.

Every log-prob (logp, old_logp, ref_logp) is of the logits divided by the sampling temperature
(loss.token_logps): the distribution the completions were drawn from, as TRL's GRPOTrainer and verl
score them; temperature=0 (greedy) scores the logits as they are. How the token losses make the loss
the optimizer steps on, over the whole global batch whatever its split into ranks and micro-batches
(TRL's per micro-batch normalisations, averaged by DDP over ranks and summed over accumulation steps,
come to the same when every micro-batch holds as many completions):

    grpo:     the mean over completions of each completion's mean token loss
    dapo:     the mean over all completion tokens of the global batch
    dr_grpo:  the sum over all completion tokens / (completions x max_completion_len)

so `loss` returns a micro-batch's sum of those terms and `counts` says what it is averaged over
(completions, or completion tokens for dapo), as SFT and DPO do.

What the rollout phase (the objective's `rollout`, objectives/base.py) gives the loop, per micro-batch
(`rollout_batch` builds it):
    input_ids, attention_mask   [rows, length]: prompt then completion, right-padded
    labels                      [rows, length]: the completion's tokens where they count in the loss,
                                IGNORE elsewhere (prompt, padding, a truncated completion when
                                mask_truncated_completions)
    advantages                  [rows] float32 (group_advantages, computed on the whole global batch)
    real                        [rows] bool: False for a placeholder row keeping ranks in lock-step
    old_logps                   [rows, length] fp32 laid out as the labels (loss.token_logps under
                                no_grad at the rollout): only when num_iterations > 1
    ref_logps                   [rows, length] fp32, the reference's: only when beta > 0

Metrics (take_metrics gives their sums; `means` turns the rank-summed sums into values): kl (beta > 0),
clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, each a mean over the global batch's
completion tokens (TRL: a mean per micro-batch, then over micro-batches; the same with one micro-batch
per rank). TRL's clip_ratio/low_min and high_max (a min / max over sequences) are not kept: the loop
reduces metrics by sum. The rollout's own metrics (rewards per function, completion lengths) come from
`rollout_metrics`, on the gathered global batch."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from finetune import data as D
from finetune.data import IGNORE
from finetune.loss import token_logps, token_logps_within
from finetune.training.objectives.base import Basic
from finetune.generation import Sampling, decode_compiled, generate, pad_id_for, stop_ids
from finetune.training.generators import (ENGINE_METRICS, check_installed, engine_logps_rows, gather_objects,
                                          generator_for, importance_weights)
from finetune.training.metrics import json_values, log
from finetune.training.stopping import Interrupted
from finetune.model import context_length
from finetune.recipe import RecipeError
from finetune.rewards import RewardError, Rewards, weighted_rewards

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction; NaN where fewer than 2 values
    (TRL's trl/trainer/utils.py nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages of a whole global batch of completions, each prompt's num_generations adjacent,
    and whether each one's std was zero (TRL's frac_reward_zero_std): TRL's sum_then_normalize."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: must be one of {', '.join(SCALE_REWARDS)}")
    # in float64: the squares of float32 rewards beyond about 1e19 overflow float32 (an inf std would make
    # every advantage 0); the advantages themselves are of order 1, float32 again
    rewards = weighted_rewards(per_func.double(), weights)
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0).float(), zero_std


def rollout_metrics(per_func: torch.Tensor, weights: torch.Tensor, names: list[str], zero_std: torch.Tensor,
                    lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """A step's rollout metrics, on the gathered global batch, under TRL's names: reward (mean, std) in
    all and per function (over the completions it scored), the share of completions in a group of
    equal rewards, completion lengths (mean, min, max, and the share cut at max_completion_len)."""
    out = {}
    per_func = per_func.double()  # as group_advantages: float32 squares of large rewards overflow
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    rewards = weighted_rewards(per_func, weights)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    lengths = lengths.float()
    out["completions/mean_length"] = lengths.mean().item()
    out["completions/min_length"] = lengths.min().item()
    out["completions/max_length"] = lengths.max().item()
    out["completions/clipped_ratio"] = truncated.float().mean().item()
    return out


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, old_logps=None,
                ref_logps=None, loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, max_completion_len: int = 1, bias_correction_kl: bool = True,
                is_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss terms of some completions ([rows, length] per-token log-probs, their rows'
    advantages [rows], the tokens that count [rows, length]) and the sums of the metrics over their
    counted tokens: [kl, clipped low, clipped high, clipped either, tokens], float64. The sum's unit is
    the loss type's (module docstring): divided by the global batch's count it is TRL's loss."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if is_ratio is not None:  # vLLM's completions: TRL's importance-sampling correction (generators.importance_weights)
        per_token = per_token * is_ratio.to(per_token)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps) in the batch")
        delta = ref_logps.to(logps) - logps
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / max_completion_len
    else:
        loss = (per_token * mask).sum()
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        sums = [(kl * mask).sum() if kl is not None else mask.new_zeros(()),
                (low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum(), mask.sum()]
        sums = torch.stack(sums).double()
    return loss, sums


def real_rows(batch: dict) -> torch.Tensor:
    """Which rows are completions of the step (not placeholders keeping ranks in lock-step)."""
    real = batch.get("real")
    return torch.ones(batch["input_ids"].shape[0], dtype=torch.bool) if real is None else real.bool()


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], stopped: list[bool],
                  advantages: torch.Tensor, pad_id: int, *, mask_truncated: bool = False,
                  real: list[bool] | None = None) -> dict:
    """One micro-batch of the rollout as the loss reads it: each row the prompt's tokens then the
    completion's, right-padded; the completion's tokens as labels, none for a truncated completion
    (not stopped) when mask_truncated. old_logps / ref_logps are added by the caller (token_logps of
    this batch under no_grad)."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attention[i, :len(p) + len(c)] = 1
        if not (mask_truncated and not stopped[i]):
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
            "advantages": advantages.float(),
            "real": torch.tensor([True] * len(rows) if real is None else real, dtype=torch.bool)}


class GRPO(Basic):
    name = "grpo"
    makes_batches = True  # the loop hands rollout() no fetched rows: it reads the step's prompts itself
    evaluates = True  # the eval split's prompts sampled and scored (evaluate): TRL's eval metrics

    def __init__(self, recipe):
        self.recipe = recipe
        self.loss_type, self.beta = recipe.loss_type, recipe.beta
        self.bias_correction_kl = recipe.use_bias_correction_kl
        # the log-probs of the distribution the completions were sampled from (greedy: the logits as they are)
        self.temperature = recipe.temperature if recipe.temperature > 0 else 1.0
        self.epsilon, self.epsilon_high = recipe.epsilon, recipe.epsilon_high or recipe.epsilon  # 0: epsilon
        self.max_completion_len = recipe.max_completion_len
        self.num_iterations, self.num_generations = recipe.num_iterations, recipe.num_generations
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        self.rewards = Rewards.from_recipe(recipe)
        self.rollout_names = rollout_metric_names(self.rewards.names) + (
            ENGINE_METRICS if recipe.generation_backend == "vllm" else ())
        self.generator = None  # finetune's generator or a vLLM engine, chosen by the recipe (after_prepare)
        self.sampled_logps: list = []  # the engine's log-probs of the last sample()'s completions
        self.loss_metrics = (("kl",) if self.beta != 0.0 else ()) + CLIP_METRICS
        self.metrics = self.loss_metrics + self.rollout_names
        self.shown = {"reward": "reward"} | ({"kl": "kl"} if self.beta != 0.0 else {})
        # loss.png: not the policy loss, which is about 0 whatever the policy
        self.panels = (("reward: the weighted sum of the reward functions", "reward (mean per completion)", "reward"),
                       ("completion length", "tokens per completion (mean)", "completions/mean_length"),
                       *([("KL to the reference", "KL (mean per completion token)", "kl")] if self.beta else []))
        self.identifies_model = bool(self.beta)  # a resume reads the frozen reference from the model again
        self.reference = None
        self.cached = None  # (rollout index, this rank's micro-batches, the rollout's metrics)
        self.rollout_values: dict = {}
        self.sums = None
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
        from finetune.objective_rules import grpo as grpo_rules
        from finetune.rewards import missing_column_problem

        check_installed(context.recipe)  # generation_backend=vllm where vLLM imports, before the model loads
        self.check_reward_models()
        train = context.datasets.train
        columns = [c for c in train.column_names if c not in ("prompt", *D.PROMPT_COLUMNS)]
        problem = missing_column_problem(self.rewards, train[0], columns) if len(train) else None
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
        self.generator = generator_for(context, generate_completions)
        self.resumed = context.plan.resume is not None
        return {}

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict] | None:
        """This rank's micro-batches of step `step` (0-based): rollout step // num_iterations, generated
        now at its first step, kept for the next num_iterations - 1, read back from its cache file when a
        resumed run starts inside it. None where a stop request (stop: finetune.training.stopping.StopRequest)
        ended the generation or the reward functions on any rank: the step is dropped."""
        k = step // self.num_iterations
        if self.cached is None or self.cached[0] != k:
            # a resumed run whose engine generated rollout k before the interruption trains on those completions
            recorded = self.resumed and self.generator.logprobs and (run.out / CACHE_DIR / f"{k}.pt").is_file()
            if step % self.num_iterations or recorded:
                made = self.read_rollout(run, k, step, first=not step % self.num_iterations)
            else:
                made = self.new_rollout(run, k, step, stop)
            if made is None:
                return None
            self.cached = (k, *made)
        self.rollout_values = self.cached[2]
        return self.cached[1]

    def new_rollout(self, run, k: int, step: int, stop=None) -> tuple[list[dict], dict] | None:
        r, accelerator = run.recipe, run.accelerator
        sp, g = run.parallel.sp, self.num_generations
        rows = run.schedule.rows(k, 0)[0]  # the prompt schedule: one micro-batch of the step's prompts
        mine = rank_prompts(rows, sp.dp_rank, sp.dp_size)
        seeds = [completion_seed(r.seed, k, row, j) for row in mine for j in range(g)]
        prompt_ids, tokens, stopped, per_func, error, seconds, cut = self.sample(run, run.datasets.train, mine, seeds,
                                                                                 step + 1, updates=step, stop=stop)
        parts = gather_objects((tokens, stopped, per_func.tolist(), error, cut))
        if any(p[4] for p in parts):
            return None
        failed = first_failure(parts)
        if failed is not None:
            raise RecipeError(f"{failed}; the run stopped before step {step + 1}'s update, its last checkpoint is "
                              "intact: fix the function and continue with --resume auto")
        all_tokens, all_stopped, all_rewards = joined(parts, len(self.rewards.names))
        if torch.isnan(all_rewards).all() and not self.said_unscored and accelerator.is_main_process:
            self.said_unscored = True
            log.warning(f"step {step + 1}: no reward function scored any of the {len(all_tokens)} completions (every "
                        "reward None): their advantages are 0 and the step trains on nothing (its reward is null in "
                        "metrics.jsonl); said once")
        advantages, zero_std = group_advantages(all_rewards, self.rewards.weights, g, r.scale_rewards)
        values = rollout_metrics(all_rewards, self.rewards.weights, self.rewards.names, zero_std,
                                 torch.tensor([len(t) for t in all_tokens]),
                                 ~torch.tensor(all_stopped, dtype=torch.bool))
        values["rollout_seconds"] = seconds
        share = slice(sp.dp_rank * len(tokens), (sp.dp_rank + 1) * len(tokens))
        engine = self.generator.logprobs  # a vLLM engine: its log-probs against the trainer's, and the correction
        batches = self.batches(run, prompt_ids, tokens, stopped, advantages[share],
                               engine_logps=self.sampled_logps if engine else None)
        if engine:
            values |= self.engine_values(batches, k)
            values["vllm/push_seconds"] = self.generator.push_seconds
        if self.num_iterations > 1 or engine:  # kept for a run resumed inside (or, with the engine, at) rollout k
            def rows_of(key):
                kept = [[b[key][i, :int(b["attention_mask"][i].sum())].tolist() for i in range(len(b["real"]))]
                        for b in batches]
                return [x for part in gather_objects([row for rows_ in kept for row in rows_]) for x in part]

            olds = rows_of("old_logps")
            ratios = rows_of("is_ratio") if "is_ratio" in batches[0] else None
            if accelerator.is_main_process:
                # the engine's rollouts back to the last checkpoint's: a resumed run trains on them, not on new ones
                keep = 2 if not engine else max(2, -(-r.save_every // self.num_iterations) + 1)
                save_rollout(run.out, k, {"values": values, "old_logps": olds, "is_ratio": ratios,
                                          "rows": rows, "tokens": all_tokens, "stopped": all_stopped,
                                          "rewards": all_rewards, "advantages": advantages}, keep)
        if accelerator.is_main_process:
            self.record(run, step + 1, k, rows, all_tokens, all_stopped, all_rewards, advantages)
            self.warned = warn_undecodable(step + 1, all_tokens, len(run.tokenizer), self.warned)
        return batches, values

    def record(self, run, step: int, k: int, rows: list[int], tokens, stopped, rewards, advantages) -> None:
        """Rank 0: rollout k's completions, their rewards and advantages into rollouts.jsonl, under `step`
        (1-based)."""
        write_rollouts(run.out / ROLLOUTS, step, k, rows, run.datasets.train, self.num_generations, tokens,
                       run.tokenizer.batch_decode(tokens, skip_special_tokens=True), stopped, self.rewards.names,
                       rewards, weighted_rewards(rewards, self.rewards.weights), advantages, len(run.tokenizer))

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
        outs = self.generator(run, prompt_ids, seeds, updates, stop)
        self.generator.sleep()  # a vLLM engine on GPUs gives its memory back to the step (vllm_enable_sleep_mode)
        tokens, stopped = [o.tokens for o in outs], [o.stopped for o in outs]
        self.sampled_logps = [o.logprobs for o in outs] if self.generator.logprobs else []
        texts = run.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        seconds = time.perf_counter() - t0
        extra = {c: [v for v in cols[c] for _ in range(g)] for c in cols if c not in ("prompt", *D.PROMPT_COLUMNS)}
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
        return prompt_ids, tokens, stopped, per_func, error, seconds, cut

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
            _, tokens, stopped, per_func, error, _, cut = self.sample(run, ds, mine, seeds, step, updates=step, stop=stop)
            parts = gather_objects((tokens, stopped, per_func.tolist(), error, cut))
            if any(p[4] for p in parts):
                return None
            failed = first_failure(parts)
            if failed is not None:
                raise RecipeError(f"eval at {failed}; the run stopped at the eval after step {step}, its last "
                                  "checkpoint is intact: fix the function and continue with --resume auto")
            batches.append(parts)
        return None, eval_metrics(batches, self.rewards.weights, self.rewards.names, g, r.scale_rewards)

    def read_rollout(self, run, k: int, step: int, first: bool = False) -> tuple[list[dict], dict]:
        """A resumed run starting inside rollout k: its completions, advantages and old log-probs (and a vLLM
        engine's importance weights) from the cache file the run wrote when it generated them (the policy has
        moved since). first: the resumed run starts at rollout k's first step, which the engine had generated
        before the interruption; its rollouts.jsonl records are written again."""
        sp, g = run.parallel.sp, self.num_generations
        saved = load_rollout(run.out, k, step)
        rows = saved["rows"]
        mine = rank_prompts(rows, sp.dp_rank, sp.dp_size)
        n = len(mine) * g
        share = slice(sp.dp_rank * n, (sp.dp_rank + 1) * n)
        prompt_ids = run.datasets.train[mine]["prompt_input_ids"]
        ratios = saved.get("is_ratio")
        batches = self.batches(run, [p for p in prompt_ids for _ in range(g)], saved["tokens"][share],
                               saved["stopped"][share], saved["advantages"][share], saved["old_logps"][share],
                               is_rows=ratios[share] if ratios is not None else None)
        if first and run.accelerator.is_main_process:
            self.record(run, step + 1, k, rows, saved["tokens"], saved["stopped"], saved["rewards"],
                        saved["advantages"])
        return batches, saved["values"]

    def batches(self, run, prompts, tokens, stopped, advantages, old_rows=None, engine_logps=None,
                is_rows=None) -> list[dict]:
        """This rank's completions as micro-batches of micro_batch_size, with the old log-probs
        (num_iterations > 1 or a vLLM engine's completions: computed now, or the saved rows) and the
        reference's (beta > 0). engine_logps: the engine's log-probs of the completions (one list each), for
        the importance weights (is_ratio, vllm_importance_sampling_correction) and the push check
        (self.engine_sums); is_rows: the weights saved with a recorded rollout."""
        r, model = run.recipe, run.model
        m = r.micro_batch_size
        keep_old = self.num_iterations > 1 or engine_logps is not None or is_rows is not None
        self.engine_sums = torch.tensor([0.0, 0.0, 0.0, math.inf, 0.0, 0.0, 0.0], dtype=torch.float64)
        out = []
        for a in range(0, len(tokens), m):
            b = rollout_batch(prompts[a:a + m], tokens[a:a + m], stopped[a:a + m], advantages[a:a + m],
                              run.tokenizer.pad_token_id, mask_truncated=r.mask_truncated_completions)
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
                            full, within = token_logps_within(model, device_batch, len(run.tokenizer), self.loss_impl,
                                                              self.chunk, self.temperature)
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
                    b["ref_logps"] = self.reference.token_logps(model, device_batch, self.temperature).float().cpu()
            out.append(b)
        return out

    def token_logps(self, model, batch: dict) -> torch.Tensor:
        """The policy's per-token log-probs of a micro-batch at the sampling temperature (the loss's, and
        the old ones kept at the rollout)."""
        return token_logps(model, batch, self.loss_impl, self.chunk, self.temperature)

    def weigh(self, b: dict, trainer: torch.Tensor, sampled: torch.Tensor) -> None:
        """A micro-batch of the engine's completions: its importance weights (TRL's correction, when on) and
        the push check's sums (|engine - trainer| log-prob sum, tokens, largest; the weights' min, sum,
        count, max). trainer: the policy's log-probs of the distribution the engine draws from (the
        tokenizer's rows, without the padded ones: loss.token_logps_within), as the engine returns them."""
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
        seen = ratio[:, :1][mask.sum(-1) > 0].flatten() if r.vllm_importance_sampling_mode.startswith("sequence") \
            else ratio[mask.bool()]
        if seen.numel():
            sums[3] = min(sums[3].item(), seen.min().item())
            sums[4] += seen.sum().item()
            sums[5] += seen.numel()
            sums[6] = max(sums[6].item(), seen.max().item())

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
        logps = self.token_logps(model, batch)
        mask = (batch["labels"] != IGNORE).to(logps.device)
        loss, sums = policy_loss(
            logps, batch["advantages"], mask, old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"),
            loss_type=self.loss_type, epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta,
            max_completion_len=self.max_completion_len, bias_correction_kl=self.bias_correction_kl,
            is_ratio=batch.get("is_ratio"))
        self.sums = sums if self.sums is None else self.sums + sums
        return loss

    def count(self, batch: dict) -> int:
        """What a micro-batch's loss is averaged over: completions, or completion tokens for dapo."""
        if self.loss_type == "dapo":
            return D.target_tokens(batch)
        return int(real_rows(batch).sum())

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
        """The metrics' sums since the last call ([kl, clipped low, high, either, tokens]), or None."""
        sums, self.sums = self.sums, None
        return sums

    def means(self, sums: torch.Tensor, count: torch.Tensor | None = None) -> list[float]:
        """The metrics' values (in `metrics` order) from take_metrics' sums reduced over ranks: means
        over the completion tokens they count themselves (not over the global batch's count), then the
        step's rollout metrics (computed on the whole gathered rollout, the same on every rank)."""
        values = (sums[:4] / sums[4].clamp(min=1)).tolist()
        values = values if self.beta != 0.0 else values[1:]
        return values + [self.rollout_values.get(n, float("nan")) for n in self.rollout_names]


ROLLOUTS = "rollouts.jsonl"
CACHE_DIR = "rollout-cache"


def rollout_metric_names(reward_names: list[str]) -> tuple[str, ...]:
    per_func = tuple(f"rewards/{n}/{s}" for n in reward_names for s in ("mean", "std"))
    return per_func + ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                       "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                       "rollout_seconds")


def padded_rows(rows: list[list[float]], shape, fill: float = 0.0) -> torch.Tensor:
    """Saved per-row values (each row's first tokens) back into a [rows, length] fp32 tensor."""
    out = torch.full(shape, fill, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def first_failure(parts: list) -> str | None:
    """The first rank's reward failure (the fourth item of each rank's gathered part), or None."""
    return next((p[3] for p in parts if p[3] is not None), None)


def joined(parts: list, functions: int) -> tuple[list, list, torch.Tensor]:
    """The ranks' gathered parts ((tokens, stopped, [completions, functions] rewards, failure) per rank)
    joined in their order: every completion's tokens, whether it stopped, and the rewards as one
    [completions, functions] tensor."""
    tokens = [t for p in parts for t in p[0]]
    stopped = [s for p in parts for s in p[1]]
    rewards = torch.tensor([v for p in parts for v in p[2]], dtype=torch.float32).view(len(tokens), functions)
    return tokens, stopped, rewards


def eval_metrics(batches: list[list], weights: torch.Tensor, names: list[str], g: int,
                 scale_rewards: str = "group") -> dict:
    """An eval's metrics (rollout_metrics' but the rollout's seconds) from its batches, each the ranks'
    gathered parts in rank order ((tokens, stopped, [completions, functions] rewards, failure) per rank):
    the completions in their global order (batch, then rank: each rank's share is contiguous), so the
    values do not depend on how many ranks generated them."""
    tokens, stopped, per_func = joined([p for batch in batches for p in batch], len(names))
    _, zero_std = group_advantages(per_func, weights, g, scale_rewards)
    return rollout_metrics(per_func, weights, names, zero_std, torch.tensor([len(t) for t in tokens]),
                           ~torch.tensor(stopped, dtype=torch.bool))


def generate_completions(run, prompts: list[list[int]], seeds: list[int], stop=None) -> list:
    """This rank's completions of its prompts (each repeated num_generations times), the weights gathered
    once for the whole batch (a collective: every rank calls it), in eval mode, back to train after. A
    rank without prompts (an eval batch's uneven split) runs one forward of a one-token prompt, its token
    discarded: FSDP2 gathers each module's weights at its first forward, which every rank must join. A
    stop request (stop) ends the generation before its next token, from the second on (the first
    forward is that collective)."""
    r, model, accelerator = run.recipe, run.model, run.accelerator
    sampling = Sampling(r.max_completion_len, r.temperature, r.top_p, r.top_k)
    idle = not prompts
    if idle:
        prompts, seeds, sampling = [[pad_id_for(run.tokenizer)]], None, Sampling(1)
    was_training = model.training
    asked = []  # should_stop's calls: none before the first token

    def should_stop() -> bool:
        asked.append(True)
        return stop is not None and len(asked) > 1 and bool(stop.requested)

    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"), \
                run.parallel.strategy.whole_weights(accelerator, model) as whole:
            out = generate(whole, prompts, sampling, stop_ids=stop_ids(run.tokenizer, whole, run.generation_config),
                           pad_id=pad_id_for(run.tokenizer), context=context_length(whole.config),
                           seeds=seeds if sampling.temperature > 0 else None, should_stop=should_stop,
                           vocab_size=len(run.tokenizer), compiled=decode_compiled(r.generation_compile, accelerator.device))
            return [] if idle else out
    finally:
        model.train(was_training)


def undecodable(tokens: list[list[int]], vocab: int) -> tuple[int, int]:
    """(completions holding ids the tokenizer has no token for, how many such ids): ids of the output
    layer's rows past len(tokenizer) (a vocabulary padded to a multiple), which decode to nothing."""
    counts = undecodable_counts(tokens, vocab)
    return sum(c > 0 for c in counts), sum(counts)


def undecodable_counts(tokens: list[list[int]], vocab: int) -> list[int]:
    """Each completion's ids past the tokenizer's `vocab` tokens."""
    return [sum(t >= vocab for t in ids) for ids in tokens]


def warn_undecodable(step: int, tokens: list[list[int]], vocab: int, warned: bool) -> bool:
    """One line, the first time a rollout holds ids the tokenizer cannot decode: the reward functions
    see those completions shorter than the model wrote them (an empty text where all ids are such).
    Whether that line has been written now."""
    completions, ids = undecodable(tokens, vocab)
    if completions and not warned:
        log.warning(f"step {step}: {completions} of {len(tokens)} completions hold {ids} token ids past the "
                    f"tokenizer's {vocab} tokens, which decode to nothing (the reward functions see the text "
                    "without them); rollouts.jsonl counts them per completion (undecodable_ids), the run summary "
                    "in all")
    return warned or bool(completions)


def rollouts_summary(path) -> dict:
    """The run summary's count of completions whose ids the tokenizer could not decode (rollouts.jsonl,
    the run's history, resumed attempts included): {} where there were none."""
    import json
    from pathlib import Path

    completions = ids = total = 0
    if Path(path).is_file():
        with open(path) as f:
            for line in f:
                total += 1
                if '"undecodable_ids": 0,' in line:  # the usual case, without parsing the line
                    continue
                try:
                    n = json.loads(line).get("undecodable_ids") or 0
                except ValueError:  # a torn last line
                    continue
                completions, ids = completions + (n > 0), ids + n
    return {"undecodable_completions": completions, "undecodable_ids": ids, "completions": total} if ids else {}


def write_rollouts(path, step: int, rollout: int, rows: list[int], ds, g: int, tokens, texts, stopped,
                   names: list[str], per_func: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor,
                   vocab: int | None = None):
    """One line per completion: the step that generated it, its prompt (dataset row and value), the
    row's other columns as the reward functions received them (`answer`, ...), its text and token ids,
    how many of those ids the tokenizer cannot decode (past its `vocab` tokens), whether it stopped, each
    function's reward (None: not scored), the weighted reward and the advantage."""
    import json

    data = ds[rows]
    prompts = data["prompt"]
    columns = [c for c in ds.column_names if c not in ("prompt", *D.PROMPT_COLUMNS)]
    undecodable_ids = undecodable_counts(tokens, vocab) if vocab else [0] * len(tokens)

    def number(x):
        return json_values(float(x))  # None for NaN (not scored), as metrics.jsonl writes it

    lines = "".join(json.dumps({"step": step, "rollout": rollout, "row": rows[i // g], "prompt": prompts[i // g],
                                "columns": {c: data[c][i // g] for c in columns},
                                "undecodable_ids": undecodable_ids[i],
                                "completion": text, "completion_ids": t, "stopped": stopped[i],
                                "rewards": {n: number(per_func[i, j]) for j, n in enumerate(names)},
                                "reward": number(rewards[i]), "advantage": float(advantages[i])}) + "\n"
                    for i, (t, text) in enumerate(zip(tokens, texts)))
    try:
        with open(path, "a") as f:
            f.write(lines)
    except OSError as e:  # a full disk: what it left past the last checkpoint is cut on resume (keep_rollouts)
        raise RecipeError(f"cannot write {path} at step {step}: {e.strerror or e}; the run stopped before step {step}'s "
                          "update, its last checkpoint is intact: free space there and continue with --resume "
                          "auto") from None


def save_rollout(out, k: int, record: dict, keep: int = 2) -> None:
    """num_iterations > 1 or a vLLM engine: rollout k kept on disk (the main process), so that a run resumed
    inside it (or, with the engine, at it) trains on the same completions with the same old log-probs; the
    files of rollouts before the last `keep` removed."""
    import os

    folder = out / CACHE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{k}.pt.tmp{os.getpid()}"
    torch.save(record, tmp)
    os.replace(tmp, folder / f"{k}.pt")
    for old in folder.glob("*.pt"):
        if old.stem.isdigit() and int(old.stem) <= k - keep:
            old.unlink()


def load_rollout(out, k: int, step: int) -> dict:
    path = out / CACHE_DIR / f"{k}.pt"
    if not path.is_file():
        raise RecipeError(f"resuming at step {step} (inside rollout {k}, num_iterations > 1) needs {path}, written "
                          "when that rollout was generated, and it is gone; resume from a checkpoint at a multiple "
                          "of num_iterations")
    return torch.load(path, weights_only=False)


# ---------------------------------------------------------------- the rollout phase
#
# Each rollout serves num_iterations optimizer steps: steps k*n .. k*n + n - 1 (0-based, n =
# num_iterations) train on rollout k, generated at step k*n with the policy as it was then (TRL's
# num_iterations: the same generations reused; its old log-probs are that policy's). Rollout k's prompts
# are the k-th global batch of prompts of the prompt schedule (finetune/data/batches.py BatchSchedule over
# the prompt rows, one "micro-batch" of all the step's prompts), split into contiguous equal shares, one
# per data-parallel rank: every prompt's whole group on one rank. Completion j of the prompt at dataset row
# i in rollout k samples with its own seed completion_seed(seed, k, i, j), which keys the noise of its every
# token (finetune/generation.py next_tokens), so the tokens do not depend on the process count nor on the
# other sequences in the batch, and a resumed run samples what the uninterrupted one did.


def completion_seed(seed: int, rollout: int, row: int, completion: int) -> int:
    """A completion's sampling seed: a stable 63-bit hash of (recipe seed, rollout index, the prompt's
    dataset row, the completion's index in its group); not Python's hash(), which varies per process."""
    import hashlib

    digest = hashlib.blake2b(f"grpo:{seed}:{rollout}:{row}:{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eval_seed(seed: int, row: int, completion: int) -> int:
    """An eval completion's sampling seed: completion j of eval row i, the same at every eval (a stable
    63-bit hash as completion_seed's, apart from the training rollouts' seeds)."""
    import hashlib

    digest = hashlib.blake2b(f"grpo-eval:{seed}:{row}:{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def eval_prompt_batches(count: int, size: int) -> list[list[int]]:
    """The eval rows 0..count-1 in batches of `size` prompts (the last may be smaller)."""
    return [list(range(a, min(a + size, count))) for a in range(0, count, size)]


def eval_share(rows: list[int], rank: int, ranks: int) -> list[int]:
    """This rank's contiguous share of an eval batch: the first len(rows) % ranks ranks one row more (a
    rank may get none; it joins the generation's collective all the same)."""
    q, extra = divmod(len(rows), ranks)
    start = rank * q + min(rank, extra)
    return rows[start:start + q + (rank < extra)]


def rank_prompts(prompts: list[int], rank: int, ranks: int) -> list[int]:
    """This data-parallel rank's contiguous share of a step's prompts (len(prompts) divisible by ranks)."""
    if len(prompts) % ranks:
        raise ValueError(f"{len(prompts)} prompts do not split over {ranks} ranks")
    share = len(prompts) // ranks
    return prompts[rank * share:(rank + 1) * share]


def prompt_schedule(num_rows: int, prompts_per_step: int, seed: int):
    """The prompt rows each rollout reads: a BatchSchedule whose one micro-batch is the step's prompts."""
    return D.BatchSchedule(num_rows, prompts_per_step, 1, 1, seed)


def read_rollouts(path) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def kept_length(lines, step: int) -> int:
    """How many bytes at the start of rollouts.jsonl (`lines`: the file opened in binary) hold the records
    of steps up to `step`: the lines up to the first one of a later step, or the first one that is not
    a whole record line (a write cut short by a kill or a full disk). Each line is read only as far as
    its step ({"step": N, ... as write_rollouts starts it); nothing past the cut is parsed."""
    import re

    head = re.compile(rb'\{"step": (\d+), .*\}\n\Z', re.DOTALL)
    end = 0
    for line in lines:
        match = head.match(line)
        if match is None or int(match.group(1)) > step:
            break
        end += len(line)
    return end


def keep_rollouts(path, step: int) -> None:
    """rollouts.jsonl cut to the records of steps up to `step` (a resumed run writes the rest again), or
    removed (step 0: a fresh run)."""
    import os
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    with path.open("rb") as lines:
        end = kept_length(lines, step)
    if end < path.stat().st_size:
        os.truncate(path, end)
