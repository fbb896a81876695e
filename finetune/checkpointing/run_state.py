"""The state a run restores beside the model, optimizer and scheduler: the loop's counters (LoopState,
loop_state.json) and each rank's random generators (rng/rank_<i>.safetensors), each read as what it must
be before anything loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from finetune.checkpointing.layout import MANIFEST
from finetune.recipe import RecipeError

LOOP_STATE = "loop_state.json"
RNG_DIR = "rng"  # rank_<i>.safetensors: each rank's torch (and CUDA) generator states


# ---------------------------------------------------------------- RNG states (safetensors, not pickle)


def save_rng(directory: Path, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            tensors[f"cuda_{i}"] = torch.cuda.get_rng_state(i)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / f"rank_{rank}.safetensors"))


def check_small_files(path: Path, manifest: dict) -> None:
    """loop_state.json and the RNG states read as what they must be, before anything loads (every rank
    checks them all, so all refuse alike): a file planted under rng/ after the save (not in the
    manifest), or one that is not safetensors of uint8 generator states, is one line, not a traceback
    at the load."""
    read_loop_state(path)
    rng = path / RNG_DIR
    if not rng.is_dir():
        return
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sizes = {"torch": torch.get_rng_state().numel()}
    for f in sorted(rng.iterdir()):
        rel = f"{RNG_DIR}/{f.name}"
        if rel not in manifest["files"]:
            raise RecipeError(f"checkpoint {path}: {rel} is not in its {MANIFEST} (put there after the save); "
                              f"nothing was loaded; remove {f} and resume again")
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            problem = f"is not a safetensors file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        else:
            bad = [k for k, t in tensors.items() if t.dtype != torch.uint8 or t.dim() != 1
                   or (k in sizes and t.numel() != sizes[k])]
            problem = ("holds no 'torch' generator state" if "torch" not in tensors else
                       f"holds {bad[0]!r}, which is not a generator state (a uint8 vector)" if bad else None)
        if problem:
            raise RecipeError(f"checkpoint {path} is damaged: {rel} {problem}; nothing was loaded; resume from an "
                              "earlier checkpoint with --resume PATH")


def load_rng(directory: Path, rank: int, seed: int, step: int) -> bool:
    """Restore this rank's generators. A rank that did not exist in the saved run (resuming on more
    processes) gets a fresh generator derived from (seed, rank, step); returns whether it was restored."""
    import torch
    from safetensors.torch import load_file

    path = directory / f"rank_{rank}.safetensors"
    if not path.is_file():
        torch.manual_seed(seed * 1_000_003 + rank * 7919 + step)
        return False
    tensors = load_file(str(path))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda_{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda_{i}"], i)
    return True


@dataclass
class LoopState:
    """Everything besides model/optimizer/scheduler that a resume needs to continue exactly."""

    step: int = 0          # optimizer steps done
    tokens: int = 0        # target tokens seen, all ranks
    samples: int = 0       # rows seen, all ranks
    best_eval_loss: float | None = None
    nonfinite_steps: int = 0  # steps skipped for a NaN/inf loss or gradient norm (recipe.max_nonfinite_steps)


def read_loop_state(path: Path) -> LoopState:
    """The loop's state of a checkpoint, its keys and types checked (a missing key, from an older
    finetune, takes its default)."""
    import dataclasses

    f = path / LOOP_STATE
    try:
        values = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"checkpoint {path} is damaged: {LOOP_STATE} is unreadable ({type(e).__name__}); "
                          "resume from an earlier checkpoint with --resume PATH") from None
    fields = {f.name: f.type for f in dataclasses.fields(LoopState)}
    problem = (f"a JSON {type(values).__name__}, not an object" if not isinstance(values, dict) else None)
    if problem is None:
        unknown = sorted(set(values) - set(fields))
        wrong = [k for k, v in values.items() if k in fields and not (
            (v is None and "None" in fields[k]) or (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, float) and "float" in fields[k]))]
        problem = (f"unknown key(s) {', '.join(map(repr, unknown))} (it holds {', '.join(fields)})" if unknown else
                   f"{wrong[0]}={values[wrong[0]]!r}, not a number" if wrong else None)
    if problem:
        raise RecipeError(f"checkpoint {path} is damaged: {LOOP_STATE} holds {problem}; nothing was loaded; restore "
                          "the file as the save wrote it, or resume from an earlier checkpoint with --resume PATH")
    return LoopState(**values)

