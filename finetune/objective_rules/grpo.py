"""GRPO's recipe rules (the objective: finetune/training/objectives/grpo.py): its keys only with
objective=grpo; with it, reward functions that import, one weight each, groups of 2 or more that split
into the micro-batches, unpacked rows, a prompt and completion within max_seq_len, a reference the
strategy can hold (beta > 0). Each failure is one RecipeError naming the key, its value and what is
allowed."""

from __future__ import annotations

import math

from finetune.errors import RecipeError, refuse_switched_on
from finetune.objective_rules import rollout_split
from finetune.objective_rules.common import default

NAME = "grpo"
GRPO_FIELDS = ("reward_funcs", "reward_weights", "num_generations", "temperature", "top_p", "top_k",
               "max_completion_len", "loss_type", "scale_rewards", "epsilon", "epsilon_high", "num_iterations", "beta",
               "mask_truncated_completions", "use_bias_correction_kl", "importance_sampling_level",
               "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
               "vespo_lambda_neg", "cast_lm_head_to_fp32", "normalize_advantages", "dynamic_sampling",
               "max_generation_batches", "entropy_coef", "tools", "environment_factory", "max_tool_calling_iterations",
               "tool_timeout", *rollout_split.FIELDS)
GRPO_LISTS = ("reward_funcs", "reward_weights", "tools")
GRPO_OBJECTS = ("environment_factory",)  # a callable or a module:name, checked here (check_tools)
TOOL_SETTINGS = ("max_tool_calling_iterations", "tool_timeout")
FIELDS, LISTS = GRPO_FIELDS, GRPO_LISTS
SHARES = ("max_prompt_len",)
ROWS = ("prompt",)
FORWARD_ROWS = 1
PAIR_BATCHES = False


IN_FLIGHT_ROLLOUT = "grpo_rollout"  # a checkpoint's rollout in flight (finetune/checkpointing/run_state.py)


def in_flight(r, step: int) -> tuple[str, str] | None:
    """A checkpoint inside a rollout (num_iterations > 1, step not a multiple of it) must hold that rollout:
    its next steps train on completions and old log-probs of a policy the checkpoint no longer holds.
    With rollout_processes, the rollouts in flight that lag the checkpoint's weights (rollout_split.in_flight)."""
    if r.rollout_processes:
        return rollout_split.in_flight(r, step)
    if r.num_iterations > 1 and step % r.num_iterations:
        return IN_FLIGHT_ROLLOUT, (f"was saved inside rollout {step // r.num_iterations} (step {step}, num_iterations="
                                   f"{r.num_iterations}) and holds no in-flight rollout (an older finetune kept it "
                                   "outside the checkpoint, where a resume no longer reads it); resume from a "
                                   "checkpoint at a multiple of num_iterations")
    return None


def reference(r) -> str | None:
    """One only with beta > 0 (its KL term): the adapter disabled under LoRA, else a frozen copy."""
    return None if not r.beta else ("adapter" if r.lora else "frozen")


def check(r, strategy) -> None:
    """With objective=grpo: reward functions that import, one weight each, groups of 2 or more."""
    from finetune import rewards

    toolbox = check_tools(r)
    extra = int(toolbox is not None and toolbox.environment is not None and rewards.has_get_reward(toolbox.environment))
    if not r.reward_funcs and not extra:
        raise RecipeError("objective=grpo needs reward functions: reward_funcs=module:function,... (or callables in "
                          "the recipe file); built in: finetune.rewards:exact_match, finetune.rewards:math_answer, "
                          "finetune.rewards:think_format (or an environment_factory whose class has get_reward)")
    try:
        rewards.resolve_all(r.reward_funcs)
        if not (extra and len(r.reward_weights) == len(r.reward_funcs) + 1):  # the environment's reward weighed too
            rewards.weights(r.reward_weights, len(r.reward_funcs))
    except rewards.RewardSpecError as e:
        raise RecipeError(str(e)) from None
    if r.num_generations < 2:
        raise RecipeError(f"num_generations={r.num_generations}: a group needs at least 2 completions (its advantages "
                          "are rewards minus the group's mean); set num_generations=2 or more (TRL's default: 8)")
    if r.global_batch_size and r.global_batch_size * r.num_generations % r.micro_batch_size:
        raise RecipeError(f"global_batch_size={r.global_batch_size} prompts x num_generations={r.num_generations} = "
                          f"{r.global_batch_size * r.num_generations} completions do not split into micro-batches of "
                          f"micro_batch_size={r.micro_batch_size}; make micro_batch_size divide it")
    if not r.global_batch_size and r.micro_batch_size * r.grad_accum % r.num_generations:
        raise RecipeError(f"micro_batch_size={r.micro_batch_size} x grad_accum={r.grad_accum} completions per process "
                          f"do not split into whole groups of num_generations={r.num_generations}; set "
                          "global_batch_size=N (prompts per step), or make micro_batch_size x grad_accum a multiple "
                          "of num_generations")
    refuse_switched_on(r, ("packing", "padding_free", "train_on_prompt"), "objective=grpo",
                       "a completion is scored on its own tokens")
    if r.max_prompt_len and r.max_prompt_len + r.max_completion_len > r.max_seq_len:
        raise RecipeError(f"max_prompt_len={r.max_prompt_len} + max_completion_len={r.max_completion_len} exceed "
                          f"max_seq_len={r.max_seq_len}; lower one of them or raise max_seq_len")
    problem = strategy.frozen_reference_problem(r) if r.beta and not r.lora else None
    if problem:
        raise RecipeError(f"objective=grpo with beta > 0 and {problem}, or beta=0 (no reference held)")
    problem = sampling_problem(r)
    if problem:
        raise RecipeError(problem)
    check_rloo(r)
    rollout_split.check(r)
    if r.max_generation_batches != default(r, "max_generation_batches") and not r.dynamic_sampling:
        raise RecipeError(f"max_generation_batches={r.max_generation_batches} applies to dynamic_sampling=true only; "
                          "set dynamic_sampling=true, or leave max_generation_batches out")
    if r.dynamic_sampling and r.generation_backend == "vllm":
        raise RecipeError("dynamic_sampling=true with generation_backend=vllm: not tried (a refilled batch trains a "
                          "rank on completions another rank's engine sampled, whose log-probs it does not hold); use "
                          "generation_backend=finetune")
    if r.cast_lm_head_to_fp32 and r.loss_impl == "full":
        raise RecipeError("cast_lm_head_to_fp32=true with loss_impl=full: the output layer's matmul is computed in "
                          "float32 on the chunked path (loss_impl=chunked, the default); set loss_impl=chunked or "
                          "cast_lm_head_to_fp32=false")
    for loss_type, keys in LOSS_TYPE_KEYS.items():
        changed = [k for k in keys if getattr(r, k) != default(r, k)]
        if changed and r.loss_type != loss_type:
            raise RecipeError(f"{changed[0]}={getattr(r, changed[0]):g} applies to loss_type={loss_type} only "
                              f"(loss_type={r.loss_type} has no use for it); set loss_type={loss_type}, or leave "
                              f"{changed[0]} out")
    if r.loss_type == "sapo" and min(r.sapo_temperature_pos, r.sapo_temperature_neg) <= 0:
        key = "sapo_temperature_pos" if r.sapo_temperature_pos <= 0 else "sapo_temperature_neg"
        raise RecipeError(f"{key}={getattr(r, key):g}: sapo's gate divides by its temperature; use a value above 0 "
                          "(TRL's defaults: 1.0 and 1.05)")
    if r.loss_type == "vespo":
        for side in ("pos", "neg"):
            problem = vespo_problem(getattr(r, f"vespo_k_{side}"), getattr(r, f"vespo_lambda_{side}"), side)
            if problem:
                raise RecipeError(problem)


# The keys of one loss type only (TRL's GRPOConfig names); the others' runs would ignore them
LOSS_TYPE_KEYS = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
                  "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
# vespo's weight phi(w) = exp(lambda + k log w - lambda w) (rl_losses.gamma_weights; 1 at w = 1) over the
# sequence ratios it is computed for, w in [1e-8, e^20]: above this peak one sequence's term outweighs a
# step's others by orders of magnitude (TRL's defaults peak at 1.2 and 1.24)
VESPO_PEAK_MAX = 1e3


def vespo_peak(k: float, lam: float) -> tuple[float, float]:
    """The largest log phi(w) over w in [1e-8, e^20], and the w where it is: at w = k / lambda where that is
    in the range (k >= 0, lambda > 0), else at an end."""
    low, high = 1e-8, math.exp(20.0)
    candidates = [low, high] + ([k / lam] if low < k / lam < high else [])
    return max((lam + k * math.log(w) - lam * w, w) for w in candidates)


def vespo_problem(k: float, lam: float, side: str) -> str | None:
    """Why vespo's weight with these k and lambda (the advantage's sign `side`) would blow the loss up, or None."""
    sign = ">=" if side == "pos" else "<"
    if k < 0:
        return (f"vespo_k_{side}={k:g}: must be >= 0; the weight phi(w) = exp(lambda + k log w - lambda w) of a "
                f"sequence whose advantage is {sign} 0 grows as w^k while its ratio w falls (to {1e-8 ** k:.1e} at "
                f"w = 1e-8), and the loss with it (TRL's default: {2.0 if side == 'pos' else 3.0:g})")
    if lam <= 0:
        return (f"vespo_lambda_{side}={lam:g}: must be > 0 (TRL's weight clamps it to 1e-4, where the weight is "
                f"about w^k and reaches e^(20k) at the largest ratio it is computed for; TRL's default: "
                f"{3.0 if side == 'pos' else 2.0:g})")
    log_peak, at = vespo_peak(k, lam)
    if log_peak > math.log(VESPO_PEAK_MAX):
        return (f"vespo_k_{side}={k:g} with vespo_lambda_{side}={lam:g}: the weight phi(w) = exp(lambda + k log w - "
                f"lambda w) peaks at {math.exp(min(log_peak, 700.0)):.2g} (at the ratio w = {at:.3g}), where one "
                f"sequence's term outweighs a step's others and the loss blows up; keep the peak under "
                f"{VESPO_PEAK_MAX:g} (lambda near k keeps it near 1; TRL's defaults k 2, lambda 3 and k 3, lambda 2)")
    return None


def loss_settings_named(r) -> str | None:
    """The loss's own settings changed from TRL's defaults (entropy_coef, sapo's, vespo's), named where a run's
    loss stopped being finite: they can make it blow up, whatever the learning rate and the data."""
    keys = ("entropy_coef",) + LOSS_TYPE_KEYS.get(r.loss_type, ())
    changed = [f"{k}={getattr(r, k):g} (TRL's default: {default(r, k):g})" for k in keys
               if getattr(r, k) != default(r, k)]
    if not changed:
        return None
    return (f"{' and '.join(changed)} {'enters' if len(changed) == 1 else 'enter'} this loss and can make it blow up: "
            "try the default first")


def check_tools(r):
    """tools and environment_factory (finetune/tools.py): each one a function the model can be shown (type hints and
    a docstring), an environment class with reset; the tool settings only with them; what the multi-turn rollout
    is not built for refused. The Toolbox, or None without tools."""
    from finetune.tools import Toolbox, ToolSpecError

    try:
        toolbox = Toolbox.from_recipe(r)
    except ToolSpecError as e:
        raise RecipeError(str(e)) from None
    if toolbox is None:
        changed = [k for k in TOOL_SETTINGS if getattr(r, k) != default(r, k)]
        if changed:
            raise RecipeError(f"{changed[0]}={getattr(r, changed[0])} applies to a rollout with tools only; set "
                              f"tools=module:function (or environment_factory=module:Class), or leave {changed[0]} out")
        return None
    if r.sequence_parallel > 1:
        raise RecipeError(f"tools with sequence_parallel={r.sequence_parallel}: not tried (every rank of a group would "
                          "run the same tool calls); set sequence_parallel=1")
    return toolbox


# GRPO's keys that loss_type=rloo (TRL's RLOOTrainer) has no use for, and normalize_advantages, rloo's only
NOT_RLOO = ("scale_rewards", "importance_sampling_level", "use_bias_correction_kl", "entropy_coef")


def check_rloo(r) -> None:
    """loss_type=rloo: its advantages are leave-one-out (not scaled), its ratio a whole sequence's, its KL in
    the reward (k1): GRPO's keys for those left at their defaults; normalize_advantages only with it; the
    vLLM engine not tried with it."""
    if r.loss_type != "rloo":
        if r.normalize_advantages:
            raise RecipeError(f"normalize_advantages=true applies to loss_type=rloo only (loss_type={r.loss_type} "
                              "scales advantages by scale_rewards); set loss_type=rloo, or leave normalize_advantages "
                              "out")
        return
    changed = [k for k in NOT_RLOO if getattr(r, k) != default(r, k)]
    if changed:
        key = changed[0]
        raise RecipeError(f"{key}={getattr(r, key)} does not apply to loss_type=rloo (TRL's RLOOTrainer: leave-one-out "
                          "advantages, normalize_advantages to scale them; the ratio of whole sequences; the KL as a "
                          f"reward penalty); leave {key} out")
    if r.generation_backend == "vllm":
        raise RecipeError("loss_type=rloo with generation_backend=vllm: not tried (TRL's RLOOTrainer applies no "
                          "importance-sampling correction); use generation_backend=finetune")


VLLM_FIELDS = ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_importance_sampling_correction",
               "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_logp_tolerance",
               "vllm_push_timeout", "vllm_push_layers")


def check_generation_backend(r) -> None:
    """generation_backend and the vllm_ keys: only with objective=grpo, the vllm_ keys only with the engine;
    the engine only with what it can serve (a 16-bit or fp32 base, no sequence parallelism). Whether vLLM is
    installed is the run's check (a recipe plans on any machine): generators.check_installed."""
    vllm = r.generation_backend == "vllm"
    if r.objective not in ("grpo", "distill") and vllm:
        raise RecipeError("generation_backend=vllm applies to objective=grpo and distill only (the sampled "
                          "completions); set objective=grpo or distill, or leave generation_backend out")
    changed = [k for k in VLLM_FIELDS if getattr(r, k) != default(r, k)
               and not (r.rollout_processes and k in rollout_split.SHARED_VLLM_FIELDS)]
    if changed and not vllm:
        key = changed[0]
        raise RecipeError(f"{key}={getattr(r, key)} applies to generation_backend=vllm only; set "
                          f"generation_backend=vllm, or leave {key} out")
    if not vllm:
        return
    if r.vllm_importance_sampling_clip_max <= 0:
        raise RecipeError(f"vllm_importance_sampling_clip_max={r.vllm_importance_sampling_clip_max:g}: must be > 0 "
                          "(the importance ratio's upper bound: at 0 every token's weight is clipped to 0 or masked, "
                          "and the run learns nothing); TRL's default is 3")
    if r.load_in_4bit:
        raise RecipeError("generation_backend=vllm with load_in_4bit=true: the engine serves the 16-bit base from the "
                          "model's directory while the trainer computes with its 4-bit (NF4) quantization, so they "
                          "would sample different policies from the first rollout, and pushing a dequantized 4-bit "
                          "base is not built; set load_in_4bit=false (lora=true keeps the base frozen) or "
                          "generation_backend=finetune")
    filtered = [f"{k}={getattr(r, k):g}" for k, off in (("top_p", 1.0), ("top_k", 0)) if getattr(r, k) != off]
    if filtered:
        raise RecipeError(f"generation_backend=vllm with {' '.join(filtered)}: vLLM returns the log-probs of the "
                          "filtered distribution (renormalised over the tokens top_p/top_k keep) and the trainer "
                          "scores the whole one, so the push check and the importance weights would compare "
                          "different distributions; set top_p=1 and top_k=0 (TRL's defaults), or "
                          "generation_backend=finetune")
    if r.sequence_parallel > 1:
        raise RecipeError(f"generation_backend=vllm with sequence_parallel={r.sequence_parallel}: not tried (each "
                          "rank of a sequence-parallel group would run its own engine on the same prompts); set "
                          "sequence_parallel=1 or generation_backend=finetune")


# ---------------------------------------------------------------- sampling (temperature, top_p, top_k)

# Below this the logits divided by the temperature leave float32's range (inf - inf: NaN probabilities)
# while sampling as greedy already would; 0 is greedy itself.
MIN_TEMPERATURE = 1e-3


def sampling_problem(recipe) -> str | None:
    """Why the recipe's sampling cannot run (one line), or None."""
    if 0 < recipe.temperature < MIN_TEMPERATURE:
        return (f"temperature={recipe.temperature:g}: a temperature this small divides the logits beyond float range "
                f"(NaN probabilities) and samples as greedy would; use temperature=0 (greedy) or at least "
                f"{MIN_TEMPERATURE:g}")
    if recipe.top_p <= 0:
        return f"top_p={recipe.top_p:g} keeps no token to sample from; use a value in (0, 1] (1: off)"
    return None


def no_signal(recipe, vocab_size: int | None = None) -> str | None:
    """Why every completion of a prompt would be the same (greedy sampling), which makes each group's
    rewards equal and every advantage 0: the run would train on nothing. None when it samples."""
    if recipe.temperature == 0:
        why = "temperature=0 samples greedily"
    elif recipe.top_k == 1:
        why = "top_k=1 keeps only the likeliest token"
    elif vocab_size and recipe.top_p <= 1 / vocab_size:  # the likeliest token alone always reaches it
        why = f"top_p={recipe.top_p:g} (not above 1/{vocab_size}, one over the vocabulary) keeps only the likeliest token"
    else:
        return None
    return (f"{why}: the num_generations={recipe.num_generations} completions of a prompt are all the same, so each "
            "group's rewards are equal and every advantage is 0: no learning signal; sample with temperature > 0 "
            "(TRL's default: 1), top_k=0 or above 1, top_p near 1")
