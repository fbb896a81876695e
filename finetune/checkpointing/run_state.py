"""The state a run restores beside the model, optimizer and scheduler, each read as what it must be
before anything loads: the loop's counters (LoopState, loop_state.json), each rank's random generators
(rng/rank_<i>.safetensors), and work in flight (in_flight/<name>.safetensors + <name>.json).

Work in flight is what a resumed run must train on but cannot make again: GRPO's rollout when a checkpoint
falls inside it (num_iterations > 1: the completions and old log-probs of a policy the checkpoint no longer
holds). An objective hands it to the Checkpointer as tensors and plain JSON data (Objective.in_flight);
save_in_flight writes it into the checkpoint being written, so the manifest lists and checksums it like
every other file (and async_save stages it as it does the rest); load_in_flight reads it back from the
checkpoint a run resumes from, and only from there, through safe_loading's readers (safetensors and
JSON: nothing in either can run code).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.checkpointing.layout import MANIFEST, set_aside
from finetune.checkpointing.manifest import CHECKSUM, checksum_mismatches
from finetune.checkpointing.safe_loading import read_plain, read_tensors
from finetune.recipe import RecipeError

LOOP_STATE = "loop_state.json"
RNG_DIR = "rng"  # rank_<i>.safetensors: each rank's torch (and CUDA) generator states
IN_FLIGHT_DIR = "in_flight"  # <name>.safetensors (tensors) and <name>.json (plain data): work in flight
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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
    check_in_flight(path, manifest)
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
            raise RecipeError(f"checkpoint {path} is damaged: {rel} {problem}; nothing was loaded; "
                              + set_aside(path))


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
                          + set_aside(path)) from None
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
                          "the file as the save wrote it, or " + set_aside(path))
    return LoopState(**values)


# ---------------------------------------------------------------- work in flight


def save_in_flight(directory: Path, name: str, tensors: dict, data: dict) -> None:
    """Work in flight into `directory` (a checkpoint being written: Checkpointer._write calls it with what
    Objective.in_flight returns), as in_flight/<name>.safetensors (tensors, saved as they are: dtype and
    shape kept) and in_flight/<name>.json (data: JSON's plain types only)."""
    from safetensors.torch import save_file

    if not _NAME.fullmatch(name):
        raise ValueError(f"in-flight state name {name!r}: letters, digits, '_', '.' and '-' only")
    folder = directory / IN_FLIGHT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data) + "\n")
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(folder / f"{name}.safetensors"))


def in_flight_files(name: str) -> tuple[str, str]:
    return f"{IN_FLIGHT_DIR}/{name}.safetensors", f"{IN_FLIGHT_DIR}/{name}.json"


def load_in_flight(directory: Path, name: str, listing: dict, what: str,
                   listing_name: str = MANIFEST) -> tuple[dict, dict] | None:
    """The work in flight `name` that save_in_flight wrote into `directory`: (tensors, data), or None where
    it holds none. listing: the manifest (or a seal, named listing_name) of the directory: both files must be
    in it with their size and checksum, so that only what was saved with it is read. what: how a refusal
    names the directory ("checkpoint PATH"). Anything else is one line (RecipeError), nothing loaded."""
    rels = in_flight_files(name)
    present = [rel for rel in rels if (directory / rel).is_file()]
    if not present:
        return None
    unlisted = [rel for rel in present if rel not in listing.get("files", {})]
    if unlisted:
        raise RecipeError(f"{what}: {unlisted[0]} is not in its {listing_name} (put there after the save); nothing "
                          "was loaded; remove it and resume again")
    missing = [rel for rel in rels if rel not in present]
    if missing:
        raise RecipeError(f"{what} is damaged: {missing[0]} is missing; nothing was loaded; resume from an earlier "
                          "checkpoint with --resume PATH")
    sizes = [rel for rel in rels if (directory / rel).stat().st_size != listing["files"][rel]]
    bad = sizes or (checksum_mismatches(directory, listing, list(rels)) if listing.get("checksum") == CHECKSUM else [])
    if bad:
        raise RecipeError(f"{what} is damaged: {bad[0]} does not match its {listing_name} "
                          f"({'size' if sizes else CHECKSUM}); "
                          "nothing was loaded; resume from an earlier checkpoint with --resume PATH")
    try:
        tensors = read_tensors(directory / rels[0])
        data = read_plain(directory / rels[1])
    except ValueError as e:
        failed = rels[0] if "safetensors" in str(e) else rels[1]
        raise RecipeError(f"{what} is damaged: {failed} {e}; nothing was loaded; resume from an earlier checkpoint "
                          "with --resume PATH") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{what} is damaged: {rels[1]} holds a JSON {type(data).__name__}, not an object; nothing "
                          "was loaded; resume from an earlier checkpoint with --resume PATH")
    return tensors, data


def check_in_flight(path: Path, manifest: dict) -> None:
    """Every file under in_flight/ listed in the manifest and readable as tensors or plain data, before
    anything loads (check_small_files)."""
    folder = path / IN_FLIGHT_DIR
    if not folder.is_dir():
        return
    names = sorted({f.name.rsplit(".", 1)[0] for f in folder.iterdir()})
    for f in sorted(folder.iterdir()):
        if f.suffix not in (".safetensors", ".json") or not f.is_file():
            raise RecipeError(f"checkpoint {path}: {IN_FLIGHT_DIR}/{f.name} is not work in flight a save writes "
                              f"(put there after the save); nothing was loaded; remove {f} and resume again")
    for name in names:
        load_in_flight(path, name, manifest, f"checkpoint {path}")


def ragged(rows: list, dtype) -> tuple:
    """Rows of different lengths (each completion's tokens, its log-probs) as one flat tensor and the rows'
    lengths, for save_in_flight; unragged gives them back as lists (the same Python numbers: float32
    values round-trip exactly)."""
    import torch

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.tensor([x for r in rows for x in r], dtype=dtype)
    return flat, lengths


def unragged(flat, lengths) -> list[list]:
    out, at = [], 0
    for n in lengths.tolist():
        out.append(flat[at:at + n].tolist())
        at += n
    return out
