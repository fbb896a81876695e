"""Where async_save stages a checkpoint, and whether it can, asked before the launch: the staging
directory (RAM, a tmpfs: /dev/shm unless FINETUNE_STAGING_DIR names another; one per output_dir), the host
memory and tmpfs space a node's share of a checkpoint needs (the planner's staging term, memory.py), and how
long the end of a run waits for a background write (FINETUNE_ASYNC_WAIT_S). background.py writes what is
staged there.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.arch import EstimateError, load_architecture
from finetune.errors import RecipeError
from finetune.memory import GiB, recipe_estimate
from finetune.recipe import Recipe
from finetune.strategy import strategy_for


def staging_problem(recipe: Recipe, world_size: int, local_processes: int) -> str | None:
    """async_save=true where this node's host memory cannot stage its ranks' parts of a checkpoint: one
    line with the numbers (None where it fits, or the model's size cannot be read here)."""
    if not recipe.async_save:
        return None
    try:
        wait_limit_s()
    except RecipeError as e:
        return str(e)
    problem = staging_dir_problem(staging_root())
    if problem:
        return problem
    mine = foreign_directory_problem(run_staging_dir(recipe.output_dir))
    if mine:
        return (f"async_save=true stages checkpoints in {run_staging_dir(recipe.output_dir)}, but {mine}; remove it, "
                "or set FINETUNE_STAGING_DIR to a directory of your own")
    try:
        e = recipe_estimate(recipe, world_size, load_architecture(recipe.model))
    except EstimateError:
        return None
    ranks = min(local_processes, world_size) if strategy_for(recipe.strategy).shards_optimizer else 1
    return host_memory_problem(e.staging * ranks, e.staging_tmpfs * ranks)


# Where async_save stages a checkpoint (finetune/checkpointing/background.py): RAM (a tmpfs) on Linux;
# FINETUNE_STAGING_DIR overrides (a larger tmpfs).
DEFAULT_STAGING_ROOT = "/dev/shm"


WAIT_LIMIT_VARIABLE, WAIT_LIMIT_DEFAULT_S = "FINETUNE_ASYNC_WAIT_S", 1800.0


def wait_limit_s() -> float:
    """How long the end of a run (its last save, a stop by signal, an error) waits for a background
    write: FINETUNE_ASYNC_WAIT_S seconds, 1800 unless set; a value that is not a positive number of
    seconds is refused naming it (staging_problem asks before the launch)."""
    text = os.environ.get(WAIT_LIMIT_VARIABLE, "").strip()
    if not text:
        return WAIT_LIMIT_DEFAULT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise RecipeError(f"{WAIT_LIMIT_VARIABLE}={os.environ[WAIT_LIMIT_VARIABLE]!r}: not a positive number of "
                          f"seconds; set it to how long the end of a run waits for a background checkpoint write "
                          f"(default {WAIT_LIMIT_DEFAULT_S:.0f}), or unset it")
    return seconds


def staging_root() -> Path:
    return Path(os.environ.get("FINETUNE_STAGING_DIR", DEFAULT_STAGING_ROOT))


def staging_dir_problem(staging) -> str | None:
    """Where async_save stages a checkpoint, a directory this user can write: found before the launch,
    not at the first save after training started."""
    where = f"{staging} (FINETUNE_STAGING_DIR)" if os.environ.get("FINETUNE_STAGING_DIR") else str(staging)
    fix = "set FINETUNE_STAGING_DIR to a writable tmpfs directory, or async_save=false"
    if not staging.exists():
        return f"async_save=true stages each checkpoint in host memory under {where}, which does not exist here; {fix}"
    if not staging.is_dir():
        return f"async_save=true stages each checkpoint in host memory under {where}, which is a file; {fix}"
    if not os.access(staging, os.W_OK | os.X_OK):
        return (f"async_save=true stages each checkpoint in host memory under {where}, which is not writable "
                f"(permissions or a read-only filesystem); {fix}")
    return None


def host_memory_problem(node_bytes: int, tmpfs_bytes: int = 0, staging=None) -> str | None:
    """async_save=true keeps a copy of a node's share of a checkpoint in host memory (node_bytes), of which
    tmpfs_bytes pass through the staging tmpfs at once (fsdp's DCP files; small files always do): refused,
    with the numbers, where the host has less memory available or the tmpfs less free space."""
    staging = staging or staging_root()
    import shutil

    try:
        free = shutil.disk_usage(staging).free
    except OSError:
        return staging_dir_problem(staging) or f"async_save=true cannot stage checkpoints under {staging}"
    available = mem_available()
    if available is not None and node_bytes > available:
        return (f"async_save=true keeps a copy of each checkpoint in host memory: {bytes_text(node_bytes)} on this "
                f"node, but the host has {bytes_text(available)} of memory available; use async_save=false or "
                "more nodes")
    if tmpfs_bytes > free:
        return (f"async_save=true writes fsdp's checkpoint files through {staging}: {bytes_text(tmpfs_bytes)} on "
                f"this node at once, but it has {bytes_text(free)} free; use a larger tmpfs "
                "(FINETUNE_STAGING_DIR; containers: --shm-size) or async_save=false")
    return None


def bytes_text(n: float) -> str:
    """Bytes in GiB, or in MiB below a GiB (a tiny tmpfs is not "0.00 GiB")."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def foreign_directory_problem(path: Path) -> str | None:
    """Why this run must not stage in `path` (None: it is absent, or a directory of this user's that no one
    else may write): another user's directory, or a link, at the name this run's staging takes in a shared
    tmpfs would let them read or replace what a save stages before it is copied into the checkpoint."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path} cannot be examined ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a {'link' if stat.S_ISLNK(st.st_mode) else 'file'})"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def claim_staging_dir(path: Path) -> None:
    """This run's staging directory, made this user's alone (0700) or refused (RecipeError, one line)."""
    problem = foreign_directory_problem(path)
    if problem is None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = foreign_directory_problem(path)
    if problem:
        raise RecipeError(f"async_save=true stages checkpoints in {path}, but {problem}; nothing was staged there; "
                          "remove it, or set FINETUNE_STAGING_DIR to a directory of your own")


def run_staging_dir(output_dir) -> Path:
    """This run's staging directory: one per output_dir (and user), so that a run resumed after a
    SIGKILL finds, and removes, what the killed one left."""
    import xxhash

    key = xxhash.xxh3_64_hexdigest(str(Path(output_dir).resolve()).encode())
    return staging_root() / f"finetune-staging-{os.getuid()}-{key}"
