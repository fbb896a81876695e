"""How a run's work is split over its processes, as one object the loop holds: the strategy (how the
model's weights, gradients and optimizer states are sharded or replicated over the ranks:
finetune/strategy) and the sequence-parallel layout (which rows this rank reads, which slice of each
it keeps: finetune/sequence_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.sequence_parallel import Layout
from finetune.strategy import Strategy


@dataclass(frozen=True)
class Parallel:
    strategy: Strategy
    sp: Layout = Layout()

    @classmethod
    def of(cls, plan, rank: int, world_size: int, pad_id: int = 0) -> "Parallel":
        """This rank's place in the plan's layout."""
        return cls(plan.strategy, Layout.of(plan.recipe, rank, world_size, pad_id))
