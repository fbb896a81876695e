"""The 4-process layouts laid out as 2 nodes x 2 GPUs (tests/distributed/test_multinode.py, test_dpo.py,
test_grpo.py): what several modules launch, and the check that the planner's bytes per step
(finetune/comm.py) are the bytes the real run's collectives moved (finetune/collectives.py)."""

from __future__ import annotations

from finetune.collectives import ENV as COUNT_COLLECTIVES
from finetune.collectives import read_counts, sent_bytes

NODES, GPUS_PER_NODE = 2, 2  # 4 processes; ranks 0-1 are node 0, ranks 2-3 node 1
HYBRID = ["strategy=hsdp", "shard_size=2"]  # shard within a node, replicate across the two
HPZ = ["strategy=zero3", "zero_hpz_partition_size=2"]
PLANNER_RTOL = 0.10  # the planner's bytes against the counted ones
# Left out of the planner: what moves data, not the model (the loss and token counts, the gradient norm,
# GRPO's gathered completions and rewards): below 1% of a step's bytes here, and far less on real models.
SMALL = 0.01


def counting(tmp_path_factory) -> dict:
    """The environment of a launch whose collectives are counted, into a directory of its own."""
    return {COUNT_COLLECTIVES: str(tmp_path_factory.mktemp("collectives"))}


def counted(directory, steps) -> dict:
    """Rank 0's collectives over `steps`, per step on average: (op, group size, spans nodes) -> bytes."""
    records = [r for r in read_counts(directory) if r["rank"] == 0 and r["step"] in steps]
    assert sorted(r["step"] for r in records) == sorted(steps), "every step counted once"
    out: dict = {}
    for record in records:
        for call in record["calls"]:
            nodes = {rank // GPUS_PER_NODE for rank in call["group"]}
            key = (call["op"], len(call["group"]), len(nodes) > 1)
            out[key] = out.get(key, 0) + call["bytes"] / len(steps)
    total = sum(out.values())
    return {k: v for k, v in out.items() if v >= SMALL * total}


def assert_planner_matches(run, counts: dict, recipe_name: str, overrides: list[str], steps) -> dict:
    """The planner's collectives of this recipe on 2 nodes x 2 GPUs equal the run's counted ones within
    10%, collective by collective, and so do the bytes each GPU sends inside and across nodes. counts:
    the launch's environment from counting()."""
    import json

    from finetune.arch import load_architecture
    from finetune.comm import layout_traffic
    from finetune.memory import Setup
    from finetune.recipe import resolve

    from conftest import FAST

    recipe = resolve(recipe_name, [*FAST, *overrides])
    arch = load_architecture(json.loads((run.output_dir / "recipe.json").read_text())["model"])
    planned = layout_traffic(recipe, arch, Setup.of(recipe), NODES, GPUS_PER_NODE)
    want = {(l.op, l.group, l.across): l.buffer_bytes for l in planned.links}
    got = counted(counts[COUNT_COLLECTIVES], list(steps))
    assert got.keys() == {k for k, v in want.items() if v}, (got, want)
    for key, value in got.items():
        assert abs(value - want[key]) <= PLANNER_RTOL * want[key], (key, value, want[key], got)
    for across in (False, True):
        sent = sum(sent_bytes(op, size, b) for (op, size, a), b in got.items() if a == across)
        planned_sent = planned.across if across else planned.inside
        assert abs(sent - planned_sent) <= PLANNER_RTOL * max(planned_sent, 1), (across, sent, planned_sent)
    return got
