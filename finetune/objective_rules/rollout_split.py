"""The recipe rules of GRPO's generation on processes of its own (rollout_processes, max_staleness,
weight_sync_steps, heartbeat_stale_after_s; the machinery: finetune/training/rollout_group.py): each
failure one RecipeError naming the key, its value and what is allowed. The launch's own check (how many
processes are left to train) is rollout_group.split_world's, once the world size is known."""

from __future__ import annotations

from finetune.errors import RecipeError
from finetune.objective_rules.common import default

FIELDS = ("rollout_processes", "max_staleness", "weight_sync_steps", "heartbeat_stale_after_s")
# the vLLM backend's keys the split takes too: the importance-sampling correction a lagging rollout's loss uses
# (TRL's names), the push's buckets of decoder layers and its check's tolerance
SHARED_VLLM_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                      "vllm_importance_sampling_clip_max", "vllm_push_layers", "vllm_logp_tolerance")
IN_FLIGHT = "rollouts_in_flight"  # a checkpoint's rollouts in flight (run_state.save_in_flight's name)


# The schedule (deterministic: it depends on no timing). Rollout r is what step r (0-based) trains on.

def policy_version(rollout: int, lag: int, sync_every: int) -> int:
    """The optimizer steps taken by the weights rollout `rollout` is generated from: those step rollout - lag
    started from, rounded down to a pushed version (a multiple of sync_every); the initial weights (0) for the
    first `lag` rollouts."""
    return (rollout - lag) // sync_every * sync_every if rollout >= lag else 0


def in_flight_end(step: int, lag: int, sync_every: int) -> int:
    """The first rollout from `step` on generated from weights of `step` or later: rollouts step .. this - 1 are
    in flight at a checkpoint of `step` (generated from older weights, so held by the checkpoint)."""
    r = step
    while policy_version(r, lag, sync_every) < step:
        r += 1
    return r


def pushed_versions(start: int, total: int, lag: int, sync_every: int) -> list[int]:
    """The weights the trainers push in a run from step `start` to `total`: each version a rollout they do not
    hold is generated from."""
    return sorted({policy_version(r, lag, sync_every) for r in range(in_flight_end(start, lag, sync_every), total)})



def in_flight(r, step: int) -> tuple[str, str] | None:
    """A checkpoint of `step` must hold the rollouts generated from older weights than its own (a lag or a push
    every few steps): they cannot be generated again."""
    if r.rollout_processes and in_flight_end(step, r.max_staleness, r.weight_sync_steps) > step:
        return IN_FLIGHT, (f"holds no rollouts in flight, and step {step + 1} with max_staleness={r.max_staleness}, "
                           f"weight_sync_steps={r.weight_sync_steps} trains on rollouts generated before it (from "
                           "weights it no longer holds); resume from a checkpoint this run's settings wrote")
    return None



def off_policy(r) -> bool:
    """Whether some rollout is generated from older weights than the step that trains on it starts from: a lag
    (max_staleness) or weights pushed every few steps (weight_sync_steps); then the loss weighs each
    completion by TRL's importance-sampling correction."""
    return r.rollout_processes > 0 and (r.max_staleness > 0 or r.weight_sync_steps > 1)


def check(r) -> None:
    """With objective=grpo: the split's keys only with rollout_processes > 0, and with it what the split does not
    serve (yet): each refused in one line."""
    if not r.rollout_processes:
        changed = [k for k in FIELDS[1:] if getattr(r, k) != default(r, k)]
        if changed:
            key = changed[0]
            raise RecipeError(f"{key}={getattr(r, key)} applies to rollout_processes > 0 only (generation on processes "
                              f"of its own); set rollout_processes=1 or more, or leave {key} out")
        return
    refusals = (
        (r.generation_backend == "vllm", "generation_backend=vllm", "a vLLM engine as the generating processes' "
         "generator is not built yet (the colocated engine is: rollout_processes=0); use generation_backend=finetune"),
        (r.num_iterations > 1, f"num_iterations={r.num_iterations}", "a rollout reused for several steps is not built "
         "with generation on processes of its own (TRL's async trainer has none either); use num_iterations=1, or "
         "rollout_processes=0"),
        (r.dynamic_sampling, "dynamic_sampling=true", "refilling a batch on the generating processes is not built; "
         "use dynamic_sampling=false, or rollout_processes=0"),
        (r.load_in_4bit, "load_in_4bit=true", "the generating processes hold the model in the compute dtype and "
         "pushing a dequantized 4-bit base is not built; use load_in_4bit=false, or rollout_processes=0"),
        (any(getattr(r, key, None) for key in ("tools", "environment_factory")), "tools",
         "multi-turn rollouts with tools on the generating processes are not built; use rollout_processes=0"),
    )
    for refused, what, why in refusals:
        if refused:
            raise RecipeError(f"rollout_processes={r.rollout_processes} with {what}: {why}")
    if off_policy(r) and r.vllm_importance_sampling_clip_max <= 0:
        raise RecipeError(f"vllm_importance_sampling_clip_max={r.vllm_importance_sampling_clip_max:g}: must be > 0 (the "
                          "importance ratio's upper bound: at 0 every completion is clipped to 0 or masked, and the "
                          "run learns nothing); TRL's default is 3")
    if not r.global_batch_size:
        raise RecipeError(f"rollout_processes={r.rollout_processes} needs global_batch_size (prompts per step): the "
                          "generating processes produce whole steps, which the training processes then share; set "
                          "global_batch_size=N")
    if r.global_batch_size % r.rollout_processes:
        raise RecipeError(f"global_batch_size={r.global_batch_size} prompts do not split over rollout_processes="
                          f"{r.rollout_processes} generating processes; use a global_batch_size that is a multiple of "
                          f"{r.rollout_processes}")
