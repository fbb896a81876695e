"""The training strategies, one object each: `strategy_for(name)` (or `Plan.strategy`) gives a Ddp,
Zero(1 or 2), Zero3 or Fsdp, which answers every question whose answer depends on the strategy
(base.py lists them). The rest of the package asks these objects and never compares strategy names
(tests/test_layout.py checks).

One file per strategy: base.py (what they share), ddp.py, zero.py (ZeRO-1/2 and its ZeRO-3 subclass,
the DeepSpeed config), fsdp.py (the plugin, the mixed-precision policy). What every strategy shares
lives outside the package: the process environment and the Accelerator in finetune/distributed.py,
the optimizer's groups and LR schedule in finetune/optim.py; their names are re-exported here, where
callers found them before.
"""

from __future__ import annotations

from finetune.distributed import (accumulate, build_accelerator, ensure_process_env, prefer_environment_ninja,
                                  prepare, reads_weights)
from finetune.optim import (build_optimizer_and_scheduler, build_scheduler, lr_factor, nonfinite_count, param_groups,
                            updated_weights)
from finetune.strategy.base import Strategy
from finetune.strategy.ddp import Ddp
from finetune.strategy.fsdp import Fsdp, Hsdp, adapter_only_fsdp, fsdp2_mixed_precision, fsdp_plugin, no_split_modules
from finetune.strategy.zero import Zero, Zero3, deepspeed_config

NAMES = ("ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3")  # recipe.strategy's choices


def strategy_for(name: str) -> Strategy:
    """The strategy object of a recipe's `strategy` value."""
    if name == "ddp":
        return Ddp()
    if name == "fsdp":
        return Fsdp()
    if name == "hsdp":
        return Hsdp()
    if name == "zero3":
        return Zero3()
    if name in ("zero1", "zero2"):
        return Zero(int(name[-1]))
    raise ValueError(f"unknown strategy {name!r}")


def final_in_training_dtype(recipe: dict) -> bool:
    """Whether final/ of the run with this recipe.json holds 16-bit weights (a DeepSpeed run in bf16 or
    fp16), which an export or a model rebuilt from its checkpoints then matches."""
    name = recipe.get("strategy")
    return bool(name) and strategy_for(name).final_in_training_dtype and recipe.get("mixed_precision") in (
        "bf16", "fp16")


def running_strategy(accelerator) -> Strategy:
    """The strategy a live Accelerator runs (for code that has the Accelerator but not the plan)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        return strategy_for(f"zero{int(plugin.zero_stage)}")
    if getattr(accelerator.state, "fsdp_plugin", None) is not None:
        config = getattr(accelerator.state, "parallelism_config", None)
        return Hsdp() if config is not None and config.dp_replicate_enabled else Fsdp()
    return Ddp()


__all__ = ["NAMES", "Strategy", "Ddp", "Zero", "Zero3", "Fsdp", "Hsdp", "strategy_for", "final_in_training_dtype", "running_strategy",
           "deepspeed_config", "fsdp_plugin", "fsdp2_mixed_precision", "no_split_modules", "adapter_only_fsdp",
           "accumulate", "build_accelerator", "ensure_process_env", "prefer_environment_ninja", "prepare",
           "reads_weights", "build_optimizer_and_scheduler", "build_scheduler", "lr_factor", "param_groups",
           "nonfinite_count", "updated_weights"]
