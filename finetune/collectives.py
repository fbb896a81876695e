"""Counting what each collective moves, per training step, in a real run: FINETUNE_COUNT_COLLECTIVES=DIR
makes every rank wrap torch.distributed's collectives (which FSDP2, DeepSpeed and DDP all call) and
write DIR/rank_<i>.jsonl, one line per optimizer step:

    {"step": 3, "rank": 0, "calls": [{"op": "all_gather", "group": [0, 1], "count": 24, "bytes": 123456}, ...]}

`bytes` is the collective's whole buffer summed over its calls: the gathered output of an all-gather,
the input of a reduce-scatter, the tensor of an all-reduce or broadcast. What one rank of a group of n
sends for it on a ring (the planner's model, finetune/comm.py) is sent_bytes(). Off (the default) it
costs nothing: nothing is wrapped.

Only the optimizer steps are counted (the loop brackets each with counted_step); loading, evals and
checkpoints are not: the planner's figures are per step."""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

ENV = "FINETUNE_COUNT_COLLECTIVES"

# torch.distributed name -> the kind of collective, and which argument holds the whole buffer
_WRAPPED = {
    "all_gather_single": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0), "all_gather": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0), "reduce": ("reduce", 0),
    "all_to_all_single": ("all_to_all", 1),
}

_KEYWORDS = {0: ("output_tensor", "tensor", "output", "tensor_list", "output_tensor_list"),
             1: ("input", "input_tensor", "input_list", "input_tensor_list")}
_state = threading.local()
_counts: dict | None = None  # (op, group ranks) -> [calls, bytes] of the step being counted


def sent_bytes(op: str, size: int, buffer_bytes: float) -> float:
    """What each rank of a group of `size` sends on a ring for a collective over `buffer_bytes`:
    (n-1)/n of it for an all-gather, reduce-scatter, broadcast or all-to-all, twice that for an
    all-reduce (a reduce-scatter, then an all-gather)."""
    if size <= 1:
        return 0.0
    share = buffer_bytes * (size - 1) / size
    return 2 * share if op == "all_reduce" else share


def _nbytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    numel = getattr(value, "numel", None)
    return int(numel() * value.element_size()) if numel is not None else 0


def _group_ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except Exception:  # a group this rank is not in, or no group yet
        return ()


def _wrap(fn, op: str, index: int):
    def counted(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if _counts is None or depth:  # not counting, or called by a collective already counted
            return fn(*args, **kwargs)
        buffer = args[index] if len(args) > index else next(
            (kwargs[k] for k in _KEYWORDS[index] if k in kwargs), None)
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if type(a).__name__ == "ProcessGroup"), None)
        key = (op, _group_ranks(group))
        entry = _counts.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += _nbytes(buffer)
        _state.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.depth = depth

    counted.__wrapped__ = fn
    counted._finetune_counted = True
    return counted


def _install() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist, "_finetune_counting", False):
        return
    for name, (op, index) in _WRAPPED.items():
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "_finetune_counted", False):
                setattr(module, name, _wrap(fn, op, index))
    dist._finetune_counting = True


def install_if_asked() -> None:
    """Wrap the collectives before any framework starts its communication (DeepSpeed keeps references
    to torch's functions from then on); nothing is counted outside counted_step."""
    if os.environ.get(ENV):
        _install()


@contextmanager
def counted_step(step: int):
    """Count the collectives of optimizer step `step` (1-based) when FINETUNE_COUNT_COLLECTIVES is set."""
    global _counts
    directory = os.environ.get(ENV)
    if not directory:
        yield
        return
    _install()
    _counts = {}
    try:
        yield
    finally:
        counts, _counts = _counts, None
        rank = int(os.environ.get("RANK", "0"))
        calls = [{"op": op, "group": list(group), "count": c, "bytes": b}
                 for (op, group), (c, b) in sorted(counts.items())]
        Path(directory).mkdir(parents=True, exist_ok=True)
        with open(Path(directory) / f"rank_{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rank": rank, "calls": calls}) + "\n")


def read_counts(directory) -> list[dict]:
    """Every rank's per-step records under directory."""
    records = []
    for path in sorted(Path(directory).glob("rank_*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records
