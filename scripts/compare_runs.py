"""Whether two runs wrote the same records: metrics.jsonl, samples.jsonl, rollouts.jsonl (GRPO), recipe.json,
summary.json and the same file names, with the fields that measure time, speed or memory left out. For a
change that must not change behaviour: the same recipe run before and after it.

    python scripts/compare_runs.py runs/before runs/after [--same /cache/a=/cache/b ...]

Each run's own output directory is read as one name in the other's records; --same names other paths
that differ by design (each run's own datasets cache, HF_DATASETS_CACHE, holding the precomputed
reference log-probs). Exit status 0 when everything compared is equal, 1 otherwise (the first
difference of each file printed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMING = {"tokens_per_s", "tokens_per_s_steady", "steady_steps", "mfu", "peak_memory_gib", "peak_memory_per_rank",
          "seconds", "resume_seconds", "train_seconds", "eval_seconds", "checkpoint_seconds", "wall_seconds",
          "rollout_seconds"}


def normal(value, renames: list[tuple[str, str]]):
    """The value without its timing fields, each renamed path written as its counterpart."""
    if isinstance(value, dict):
        return {k: normal(v, renames) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [normal(v, renames) for v in value]
    if isinstance(value, str):
        for old, new in renames:
            value = value.replace(old, new)
    return value


def records(path: Path) -> list | dict | None:
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--same", action="append", default=[], metavar="A=B",
                        help="a path in the first run's records that is B in the second's")
    args = parser.parse_args(argv)
    renames = [(str(args.before), str(args.after))] + [tuple(pair.split("=", 1)) for pair in args.same]
    equal = True
    for name in ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl", "recipe.json", "summary.json"):
        a, b = records(args.before / name), records(args.after / name)
        a, b = normal(a, renames), normal(b, [])
        same = a == b
        equal &= same
        size = f" ({len(a)} records)" if isinstance(a, list) else ""
        print(f"{name}: {'absent in both' if a is None and b is None else 'equal' if same else 'DIFFERENT'}{size}")
        if not same and isinstance(a, list) and isinstance(b, list):
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  record {first}: {a[first] if first < len(a) else None}\n"
                  f"         vs {b[first] if first < len(b) else None}")
        elif not same and isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    print(f"  {key}: {a.get(key)!r} vs {b.get(key)!r}")
    files = [sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
             for d in (args.before, args.after)]
    equal &= files[0] == files[1]
    print(f"files: {len(files[0])} and {len(files[1])}, "
          f"{'the same names' if files[0] == files[1] else 'DIFFERENT: ' + str(sorted(set(files[0]) ^ set(files[1])))}")
    print("equal" if equal else "DIFFERENT")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
