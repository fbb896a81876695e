"""The recipes this repository ships: those git tracks in recipes/. A user's own recipes beside them (the
README says to put them there) and their reward modules are theirs: the catalog's tests judge ours only,
so that a quick check after following the README still passes. Outside a git checkout (an unpacked
release, a copy without .git) every recipe file there is shipped."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_recipes(repo: Path = REPO) -> list[str] | None:
    """The names of the recipe files git tracks in repo/recipes/ that are there, or None where git cannot
    say (no git, not a checkout)."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--", "recipes/*.py"], cwd=repo, capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    paths = [repo / p for p in proc.stdout.split("\0") if p]
    return sorted(p.stem for p in paths if p.is_file() and p.parent == repo / "recipes" and not p.stem.startswith("_"))


@functools.cache
def shipped_recipes(repo: Path = REPO) -> list[str]:
    tracked = tracked_recipes(repo)
    if tracked is not None:
        return tracked
    return sorted(p.stem for p in (repo / "recipes").glob("*.py") if not p.stem.startswith("_"))
