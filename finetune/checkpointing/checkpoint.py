"""Sharded checkpoints with one narrow interface: `Checkpointer.save(state)` and `.load(point)`;
finetune/checkpointing/resume.py decides, before anything is loaded, which checkpoint a run continues from.

Layout: output_dir/checkpoints/step_000000120/ (names sort by step). A checkpoint is written into a
hidden `.step_000000120.partial/` and renamed into place by rank 0 only after every rank has finished
writing and a manifest (every file and its size) is inside. A crash at any moment therefore leaves
either a complete checkpoint or a `.partial` directory that is never mistaken for one.

Model, optimizer, scheduler and RNG states go through Accelerate's save_state/load_state: FSDP
writes distributed-checkpoint shards (which load resharded on any world size), DeepSpeed its
per-rank files (converted to a universal checkpoint for another world size, see
resume.ensure_universal). The loop's own state is JSON.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from finetune.checkpointing.background import (BackgroundWrite, file_xxh3, read_markers,
                                               remove_markers, run_staging_dir, wait_limit_s)
from finetune.checkpointing.snapshot import Snapshotter, reserve_pinned, state_storage_sizes
from finetune.files import publish
from finetune.recipe import Recipe, RecipeError
from finetune.faults import fault_point
from finetune.optim import nonfinite_count

PREFIX = "step_"
MANIFEST = "manifest.json"
LOOP_STATE = "loop_state.json"
ZERO_REDUNDANCY_OPTIMIZER = "zero_redundancy_optimizer.pt"
HF_DIR = "hf"  # config and tokenizer, for export
RNG_DIR = "rng"  # rank_<i>.safetensors: each rank's torch (and CUDA) generator states
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a shard set: a pickle
CHECKSUM = "xxh3_128"  # of every file, in the manifest (see file_checksums)
# Keys that must match for a checkpoint to continue this run; the first group can never differ.
HARD_KEYS = ("model", "strategy", "lora", "lora_r", "lora_target_modules")
# Every key that changes which rows, and which of their tokens, a step trains on (max_prompt_len: the
# tokens a preference pair's prompt keeps, and so which pairs are dropped). No other recipe key does:
# num_proc, padding_free and sequence_parallel give the same tokens laid out otherwise.
DATA_KEYS = ("dataset", "dataset_split", "dataset_format", "eval_dataset", "eval_fraction", "max_seq_len",
             "packing", "train_on_prompt", "seed", "tokenizer", "chat_template", "datasets", "eval_split",
             "max_prompt_len", "max_completion_len")
# Data keys written into a fingerprint only when set, so that a single-dataset run's fingerprint is the
# one earlier versions wrote (their checkpoints still resume, and new ones resume on older versions).
OPTIONAL_DATA_KEYS = ("datasets", "eval_split", "max_prompt_len", "max_completion_len")


# Where a run's outputs live under output_dir.
CHECKPOINTS = "checkpoints"  # checkpoints/step_<9 digits>/, each complete once its manifest is written
FINAL = "final"  # the finished model (or a LoRA adapter)
FINAL_MERGED = "final_merged"  # a LoRA run's base with the adapter folded in (merge_lora=true)


def checkpoints_dir(output_dir) -> Path:
    return Path(output_dir) / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def saved_names(root: Path) -> list[str]:
    """The names of the checkpoint directories in root (complete or not), oldest first."""
    return sorted(p.name for p in root.glob(f"{PREFIX}*")) if root.is_dir() else []


def fingerprint(recipe: Recipe, model_path: str | None = None) -> dict:
    values, defaults = recipe.to_dict(), Recipe().to_dict()
    fp = {k: values.get(k) for k in HARD_KEYS + DATA_KEYS
          if k not in OPTIONAL_DATA_KEYS or values.get(k) != defaults[k]}
    if model_path is not None:
        fp["model"] = model_path
    return json.loads(json.dumps(fp))  # tuples as lists, as they come back from the manifest


# ---------------------------------------------------------------- finding and checking


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / MANIFEST).is_file())


def existing_checkpoints(root: Path) -> str:
    """What to say after "no checkpoint directory at ROOT/NAME": the complete checkpoints ROOT holds."""
    found = [p.name for p in complete_checkpoints(root)]
    if found:
        return f"; {root} holds {', '.join(found)}"
    return f"; {root} holds no complete checkpoint" if root.is_dir() else f"; {root} does not exist either"


def partial_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(".partial"))


def not_a_checkpoint(path: Path, resume: bool) -> str:
    """Why a directory without a manifest is no checkpoint, and what to give instead: a run's output_dir
    (its checkpoints and final/ named), or a checkpoint whose save never finished (a `.partial`, or one
    cut short: the complete ones beside it named)."""
    if (path / "checkpoints").is_dir() or (path / FINAL).is_dir():
        names = [p.name for p in complete_checkpoints(path / "checkpoints")]
        held = [f"its checkpoints: {', '.join(names)} (in {path / 'checkpoints'})" if names else "no complete checkpoint"]
        if (path / FINAL).is_dir():
            held.append(f"its finished model: {path / FINAL}")
        use = ("continue it with --resume auto, or give one checkpoint with --resume PATH" if resume else
               "give one checkpoint (or final/ to finetune chat)")
        return f"{path} is a run's output directory, not a checkpoint; it holds {'; '.join(held)}; {use}"
    if resume:
        return (f"checkpoint {path} is incomplete (no {MANIFEST}: its save never finished); resume from another one, "
                "or --resume auto to take the newest complete one")
    names = [p.name for p in complete_checkpoints(path.parent)]
    others = (f"give a complete one: {', '.join(names)} (in {path.parent})" if names else
              f"no complete checkpoint is beside it in {path.parent}")
    return f"checkpoint {path} is incomplete (no {MANIFEST}: its save never finished); {others}"


class UnreadableManifest(RecipeError):
    """A manifest that is empty, not JSON or not ours: the checkpoint cannot be trusted or even described.
    `--resume auto` skips such a checkpoint and takes the previous one."""


def read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, empty
        raise UnreadableManifest(f"checkpoint {path}: {MANIFEST} is unreadable ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else 'empty'}); nothing was deleted") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise UnreadableManifest(f"checkpoint {path}: {MANIFEST} is not a finetune manifest ({problem}); "
                                 "nothing was deleted")
    return manifest


def _manifest_problem(manifest) -> str | None:
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    for key in ("step", "world_size", "global_batch_size"):
        if not isinstance(manifest.get(key), int) or isinstance(manifest.get(key), bool):
            return f"no integer {key!r}"
    if not isinstance(manifest.get("fingerprint"), dict) or "strategy" not in manifest["fingerprint"]:
        return "no 'fingerprint' with a strategy"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in files.values()):
        return "no 'files' mapping each file to its size"
    checksums = manifest.get("checksums")
    if checksums is not None and (manifest.get("checksum") != CHECKSUM or not isinstance(checksums, dict)
                                  or set(checksums) != set(files)):
        return f"checksums that are not {CHECKSUM} of exactly the listed files"
    return None


def verify(path: Path, checksums: bool = False, manifest: dict | None = None, resume: bool = True) -> dict:
    """The manifest, after checking that every file it lists is there with its size and that every DCP
    metadata file unpickles within the allow-list (all cheap: every rank does it before anything is
    loaded); with `checksums`, also every file's checksum (reads the whole checkpoint: export, and the
    collective `verify_checksums` before a load, which shares that reading among the ranks). resume:
    the advice for a checkpoint that is incomplete names --resume (False: export and chat, which take
    another checkpoint instead)."""
    if not path.is_dir():
        raise RecipeError(f"no checkpoint directory at {path}{existing_checkpoints(path.parent)}")
    if not (path / MANIFEST).is_file():
        raise RecipeError(not_a_checkpoint(path, resume))
    manifest = manifest if manifest is not None else read_manifest(path)
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise RecipeError(f"checkpoint {path} is damaged: {rel} is missing; nothing was deleted; resume from an "
                              "earlier checkpoint with --resume PATH")
        if f.stat().st_size != size:
            raise RecipeError(f"checkpoint {path} is damaged: {rel} has {f.stat().st_size} bytes, the manifest says "
                              f"{size}; nothing was deleted; resume from an earlier checkpoint with --resume PATH")
    for meta in sorted(path.rglob(DCP_METADATA)):
        with open(meta, "rb") as f:
            try:
                load_dcp_metadata(f)
            except DisallowedPickle as e:
                raise RecipeError(f"checkpoint {path}: {meta.relative_to(path)} is refused: {e}; nothing in it was "
                                  "run or loaded; use a checkpoint from a source you trust") from None
            except Exception as e:  # truncated or garbled: damaged rather than hostile
                raise RecipeError(f"checkpoint {path} is damaged: {meta.relative_to(path)} cannot be read "
                                  f"({type(e).__name__}: {e}); resume from an earlier checkpoint with --resume PATH") \
                    from None
    if checksums:
        bad = checksum_mismatches(path, manifest, sorted(manifest.get("checksums") or {}))
        if bad:
            raise damaged_by_checksum(path, bad)
    return manifest


# ---------------------------------------------------------------- checksums


def file_checksums(directory: Path, rels: list[str], threads: int | None = None) -> dict[str, str]:
    """xxh3-128 of each file, files hashed in parallel (xxhash releases the GIL). xxh3 hashed 6-13 GB/s
    per core here, against 1.5 for sha256 (with SHA-NI), 1.35 for crc32 and 0.6 for blake2b
    (bench/studies/hash_checksums.py), so reading the disk, not hashing, bounds it. It detects
    corruption, not forgery: whoever can rewrite a shard can rewrite the manifest too; code execution
    is stopped by the loaders (safe_loading), not by this."""
    from concurrent.futures import ThreadPoolExecutor

    if not rels:
        return {}
    threads = threads or min(8, os.cpu_count() or 1, len(rels))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        return dict(zip(rels, pool.map(lambda rel: file_xxh3(directory / rel), rels)))


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Files split among `world` ranks with about equal bytes each (largest first, to the lightest rank)."""
    out, load = [[] for _ in range(world)], [0] * world
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        i = load.index(min(load))
        out[i].append(rel)
        load[i] += sizes[rel]
    return out


def checksum_mismatches(path: Path, manifest: dict, rels: list[str]) -> list[str]:
    expected = manifest.get("checksums") or {}
    got = file_checksums(path, [r for r in rels if r in expected])
    return [rel for rel, digest in got.items() if digest != expected[rel]]


def damaged_by_checksum(path: Path, bad: list[str]) -> RecipeError:
    return RecipeError(f"checkpoint {path} is damaged: {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} "
                       f"do{'es' if len(bad) == 1 else ''} not match the {CHECKSUM} checksum in its {MANIFEST}; "
                       "nothing was deleted; resume from an earlier checkpoint with --resume PATH")


def verify_checksums(path: Path, manifest: dict, rank: int, world: int, all_gather=None, log=print) -> None:
    """Collective when `all_gather` is given: each rank hashes its share of the files (about equal
    bytes), all learn the result, so all refuse together before any shard is read. A manifest
    written before checksums existed is accepted with a line saying only sizes were checked."""
    if "checksums" not in manifest:
        if rank == 0:
            log(f"checkpoint {path} has no checksums (written by an older finetune): only file sizes were checked")
        return
    mine = shares(manifest["files"], world)[rank]
    bad = checksum_mismatches(path, manifest, mine)
    if all_gather is not None:
        bad = sorted(rel for part in all_gather(bad) for rel in part)
    if bad:
        raise damaged_by_checksum(path, bad)


def manifest_digest(path: Path) -> str:
    """xxh3-128 of a checkpoint's manifest: names that exact checkpoint (its manifest holds every file's
    checksum), so that what is derived from it can say from which one."""
    return file_xxh3(path / MANIFEST)


def seal(directory: Path, name: str, fields: dict) -> dict:
    """Write `name` into `directory`, listing every other file in it with its size and checksum, plus
    `fields`: last, once everything else is written, and atomically (a temporary file, fsync'd, renamed),
    so that a directory with this file is complete and checkable (see seal_problem)."""
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != name}
    listing = {**fields, "files": files, "checksum": CHECKSUM,
               "checksums": dict(sorted(file_checksums(directory, sorted(files)).items()))}
    tmp = directory / f".{name}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(listing, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)
    return listing


def seal_problem(directory: Path, name: str, fields: dict) -> str | None:
    """Why `directory` is not exactly what its `name` (written by seal) lists, with `fields` as given;
    None when every file is there, alone, with its size and checksum."""
    try:
        listing = json.loads((directory / name).read_bytes())
    except FileNotFoundError:
        return f"no {name}: its writing did not finish, or an older finetune wrote it"
    except (OSError, ValueError) as e:
        return f"{name} is unreadable ({type(e).__name__})"
    if not isinstance(listing, dict) or listing.get("checksum") != CHECKSUM \
            or not isinstance(listing.get("files"), dict) or not isinstance(listing.get("checksums"), dict):
        return f"{name} is not a finetune listing"
    for key, value in fields.items():
        if listing.get(key) != value:
            return f"{name} says {key} {listing.get(key)!r}, not {value!r}"
    files = {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")
             if p.is_file() and p.name != name}
    if set(files) != set(listing["files"]):
        missing, extra = sorted(set(listing["files"]) - set(files)), sorted(set(files) - set(listing["files"]))
        return f"{', '.join(missing[:3]) or ', '.join(extra[:3])} {'missing' if missing else 'not listed'}"
    sizes = [rel for rel, size in listing["files"].items() if files[rel] != size]
    if sizes:
        return f"{', '.join(sizes[:3])} {'has' if len(sizes) == 1 else 'have'} another size than {name} lists"
    bad = checksum_mismatches(directory, listing, sorted(files))
    if bad:
        return (f"{', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} do{'es' if len(bad) == 1 else ''} "
                f"not match the {CHECKSUM} checksum in {name}")
    return None


# ---------------------------------------------------------------- loading without unpickling code


def _trusted_deepspeed_globals() -> list:
    """The only non-tensor classes DeepSpeed pickles into its ZeRO files (found by loading real
    zero1/2/3 and offload checkpoints with weights_only=True)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextmanager
def weights_only_torch_load():
    """DeepSpeed calls torch.load(weights_only=False) on every checkpoint file; within this block
    those calls load weights_only, with DeepSpeed's own few classes allowed, so that a checkpoint
    from elsewhere cannot run code when it is read."""
    import torch

    original = torch.load
    trusted = _trusted_deepspeed_globals()

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(trusted):
            f = args[0] if args else kwargs.get("f")
            try:
                return original(*args, **kwargs)
            except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: say what it is
                raise DisallowedPickle(f"{_file_name(f)} {_refused_global(e)}, which torch.load(weights_only=True) "
                                       "does not allow (it could run code); nothing in it was run") from None
            except RuntimeError:  # e.g. mmap=True on a file that is not a torch.save archive
                import zipfile

                if isinstance(f, (str, os.PathLike)) and Path(f).is_file() and not zipfile.is_zipfile(f):
                    raise DisallowedPickle(f"{_file_name(f)} is not a torch.save archive but a bare pickle, which is "
                                           "refused (it could run code); nothing in it was run") from None
                raise

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _file_name(f) -> str:
    name = getattr(f, "name", f)
    return Path(name).name if isinstance(name, (str, os.PathLike)) else "a non-tensor item of a distributed checkpoint"


def _refused_global(error: Exception) -> str:
    import re

    found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(error))
    if found:
        return f"names {found.group(1)}"
    after = str(error).split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in str(error) else ""
    reason = next((line.strip() for line in after.splitlines() if line.strip()), "weights_only refused it")
    return f"holds something else than tensors ({reason})"


class UnsafeCheckpointError(RuntimeError):
    """A file that load_state read holds pickled objects outside the allow-list. Not a RecipeError:
    under DeepSpeed each rank reads its own files, so only some ranks may see it, and each says so."""


# What a torch.distributed.checkpoint `.metadata` pickle may name (found by unpickling the metadata of
# real FSDP model, optimizer and LoRA checkpoints): the classes of torch's metadata module, which are
# plain dataclasses and enums, and a few constructors without side effects. Anything else (os.system,
# builtins.eval, ...) is refused before it is called.
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a lookup of "torch.strided" and the like
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class DisallowedPickle(pickle.UnpicklingError):
    """A pickle that names something outside the allow-list: refused before it is called."""


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import importlib

        import torch

        allowed = (module, name) in _DCP_ALLOWED
        if not allowed and "." not in name:
            if module in _DCP_METADATA_MODULES:  # classes defined there, not ones it imports
                obj = getattr(importlib.import_module(module), name, None)
                allowed = isinstance(obj, type) and obj.__module__ == module
            elif module == "torch":
                allowed = isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise DisallowedPickle(f"it names {module}.{name}, which is not on the allow-list of a distributed "
                                         "checkpoint's metadata (it could run code)")
        return super().find_class(module, name)


def load_dcp_metadata(file):
    """torch.distributed.checkpoint reads `.metadata` with plain pickle.load, which runs whatever the
    file names; this reads it with an allow-list instead (see safe_loading)."""
    return _DcpMetadataUnpickler(file).load()


class _AllowListPickle:
    """Stands in for the pickle module inside torch.distributed.checkpoint.filesystem: load is
    load_dcp_metadata, everything else (dump, for saves) is pickle's."""

    load = staticmethod(load_dcp_metadata)

    def __getattr__(self, name):
        return getattr(pickle, name)


@contextmanager
def safe_loading():
    """Within this block no checkpoint file is unpickled without an allow-list: torch.load runs
    weights_only (see weights_only_torch_load; that covers Accelerate's optimizer.bin, scheduler.bin,
    random_states_*.pkl, DeepSpeed's ZeRO files and the non-tensor items inside DCP shards) and DCP's
    `.metadata` goes through load_dcp_metadata."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.pickle
    filesystem.pickle = _AllowListPickle()
    try:
        with weights_only_torch_load():
            yield
    finally:
        filesystem.pickle = original


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


# ---------------------------------------------------------------- saving and loading


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


class Checkpointer:
    """Two calls: `save(state)` writes a checkpoint of everything (collective), `load(point)` restores
    it in place and returns the loop's state. Built once the model and optimizer are prepared."""

    def __init__(self, plan, accelerator, optimizer, model_path: str, model_config=None, tokenizer=None,
                 generation_config=None, records: dict | None = None):
        """records: what each manifest records of the run's inputs (the model's identity, the precomputed
        reference log-probs' file and sha256), for a resume to check (resume.check_identity)."""
        r = plan.recipe
        self.root = checkpoints_dir(r.output_dir)
        # copied in, so export needs nothing else (the generation config: the one final/ gets)
        self.model_config, self.tokenizer, self.generation_config = model_config, tokenizer, generation_config
        self.strategy = plan.strategy
        self.strategy.on_checkpointer(accelerator, r.lora)
        self.accelerator, self.optimizer = accelerator, optimizer
        self.recipe = r
        self.fingerprint = fingerprint(r, model_path)
        self.global_batch_size = plan.global_batch_size
        self.keep_last = r.keep_last
        self.records = dict(records or {})
        # async_save (background.py): the write in flight, if any (every rank has one or none alike),
        # and what the loop reports of each save (take_saved)
        self.async_save = r.async_save
        self.staging = run_staging_dir(r.output_dir)
        self.pending: BackgroundWrite | None = None
        self.snapshotter = Snapshotter()
        self.reserving = None  # the thread reserving the first save's pinned host memory (reserve_host_buffers)
        self.timings: list[dict] = []
        # what is in flight beside the model (GRPO's rollouts generated and not yet trained on): a callable of the
        # step, asked on every rank before a save's collectives, whose result writes it into the checkpoint
        self.in_flight = None
        self._in_flight_writer = None
        self._lines: list[str] = []
        self._records: list[dict] = []
        if accelerator.is_local_main_process:  # what a run killed during a background write left in RAM
            shutil.rmtree(self.staging, ignore_errors=True)

    def save(self, state: LoopState) -> Path:
        """Collective: every rank calls it. Returns the checkpoint directory: committed, or with
        async_save the one its background write will publish (see poll). Refuses (every rank
        alike, NonFiniteWeights) weights that are not finite; a write that fails on any rank (a full disk)
        fails the save on every rank alike (SaveError), the partial directory removed and the newest
        complete checkpoint untouched."""
        self._in_flight_writer = self.in_flight(state.step) if self.in_flight is not None else None
        if self.async_save:
            return self._save_in_background(state)
        t_start = time.perf_counter()
        acc = self.accelerator
        name = checkpoint_name(state.step)
        final, tmp = self.root / name, self.root / f".{name}.partial"
        self.check_finite(state.step)

        def start():
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        self._together(start, tmp, state.step)
        t0 = time.perf_counter()
        self._together(lambda: self._write(state, tmp), tmp, state.step)  # every rank's shards are on disk
        files = None
        if acc.is_main_process:
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        files = _broadcast(acc, files)  # one listing (a shared filesystem may list late on other nodes)
        # each rank hashes about 1/N of the bytes, in parallel
        mine = file_checksums(tmp, shares(files, acc.num_processes)[acc.process_index])
        checksums = {k: v for part in _all_gather(acc)(mine) for k, v in part.items()}

        def commit():
            if acc.is_main_process:
                self._commit(tmp, final, state.step, files, checksums, time.perf_counter() - t0)

        self._together(commit, tmp, state.step)
        self._saved(state.step, final, time.perf_counter() - t_start, None)
        return final

    def _commit(self, tmp: Path, final: Path, step: int, files: dict, checksums: dict, seconds: float) -> None:
        """Rank 0: the manifest (fsync'd: an empty manifest after a power cut would hide a complete
        checkpoint), then the rename that publishes the checkpoint, then keep_last."""
        manifest = {"step": step, "world_size": self.accelerator.num_processes,
                    "global_batch_size": self.global_batch_size, "fingerprint": self.fingerprint,
                    "files": files, "checksum": CHECKSUM, "checksums": dict(sorted(checksums.items())),
                    "seconds": round(seconds, 3), **self.records}
        fault_point("before_publish", self.accelerator.process_index, step)
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, final)  # a checkpoint of this step from an earlier attempt is replaced whole
        rotate(self.root, self.keep_last, keep=final)

    # ------------------------------------------------ async_save: stage, write in the background, publish

    def _save_in_background(self, state: LoopState) -> Path:
        """Waits for the previous background write (published, or its failure raised), stages this
        rank's part with the synchronous save's own code, its serialisations deferred (the state
        copied into host memory: snapshot.py), and starts its writer."""
        acc = self.accelerator
        waited = 0.0
        if self.pending is not None:
            t0 = time.perf_counter()
            previous = self.pending.name
            self.poll(wait=True)
            waited = time.perf_counter() - t0
            self._lines.append(f"step {state.step}: waited {waited:.2f}s for checkpoint "
                               f"{previous}'s background write before this save")
        if self.reserving is not None:  # long done, unless the first save comes at the first steps
            self.reserving.join()
            self.reserving = None
        t_start = time.perf_counter()
        name = checkpoint_name(state.step)
        final, tmp = self.root / name, self.root / f".{name}.partial"
        staged = self.staging / f"{name}.rank_{acc.process_index}"
        self.check_finite(state.step)

        def start():
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        def stage():
            with self.snapshotter.deferring(staged):
                self._write(state, staged, sync=False)

        try:
            self._together(start, tmp, state.step)
            self._together(stage, tmp, state.step)
        except SaveError:
            self.snapshotter.take()
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self.pending = BackgroundWrite(state.step, name, acc.process_index, staged, tmp,
                                       blocking_s=time.perf_counter() - t_start, waited_s=waited,
                                       describe=first_failure, jobs=self.snapshotter.take())
        self.pending.start()
        self._lines.append(f"step {state.step}: checkpoint {final} staged in {self.pending.blocking_s:.2f}s "
                           f"({self.pending.nbytes / 2**20:.1f} MiB on this rank); writing in the background")
        return final

    def reserve_host_buffers(self, model) -> None:
        """async_save on a GPU: the pinned host memory its first save copies into, allocated now, on a thread
        beside the first steps, not while the loop waits at that save (snapshot.reserve_pinned)."""
        import torch

        if self.async_save and torch.cuda.is_available():
            self.reserving = reserve_pinned(state_storage_sizes(model, self.optimizer))

    @property
    def writing(self) -> bool:
        """A background write is in flight (the same on every rank)."""
        return self.pending is not None

    def poll(self, wait: bool = False) -> None:
        """Collective while a background write is in flight (a no-op otherwise; every rank has one or
        none alike). The ranks agree on the main thread: once every rank's write finished, rank 0
        writes the manifest and publishes the checkpoint; a write that failed on any rank raises the
        same SaveError on every rank (its partial directory removed, earlier checkpoints untouched).
        wait: first wait (bounded by FINETUNE_ASYNC_WAIT_S) for this rank's write."""
        w = self.pending
        if w is None:
            return
        if wait and not w.done:
            if not w.join(wait_limit_s()):
                w.error = w.error or (f"its background write did not finish within {wait_limit_s():.0f}s "
                                      "(FINETUNE_ASYNC_WAIT_S)")
        status = "failed" if w.error else "done" if w.done else "running"
        states = _all_gather(self.accelerator)((status, w.error, w.checksums if status == "done" else None))
        failed = [(rank, error) for rank, (s, error, _) in enumerate(states) if s == "failed"]
        if failed:  # every rank's writer stopped before rank 0 removes the partial directory
            self.pending = None
            if not wait:  # (a wait that ran out has waited already)
                w.join(wait_limit_s())
            _all_gather(self.accelerator)(None)
            if self.accelerator.is_main_process:
                shutil.rmtree(w.partial, ignore_errors=True)
            raise SaveError(self.root, w.step, failed)
        if any(s == "running" for s, _, _ in states):
            return
        checksums = {k: v for _, _, part in states for k, v in part.items()}
        final = self.root / w.name
        background = max(w.background_s, 0.0)

        def commit():
            if self.accelerator.is_main_process:
                remove_markers(w.partial)
                files = {rel: (w.partial / rel).stat().st_size for rel in sorted(checksums)}
                self._commit(w.partial, final, w.step, files, checksums, w.blocking_s + background)

        self.pending = None
        self._together(commit, w.partial, w.step)
        self._saved(w.step, final, w.blocking_s, background, w.waited_s)

    def wait(self) -> None:
        """The end of a run (finished, or stopped by a signal): the write in flight finished and
        published, or its failure raised; bounded by FINETUNE_ASYNC_WAIT_S, said in a line. Collective."""
        if self.pending is not None:
            if not self.pending.done:
                self._lines.append(f"waiting (at most {wait_limit_s():.0f}s) for checkpoint {self.pending.name}'s "
                                   "background write before the run ends")
            self.poll(wait=True)
        if self.accelerator.is_local_main_process:
            shutil.rmtree(self.staging, ignore_errors=True)

    def wait_after_error(self, log=print) -> None:
        """On the way out after an error, when the ranks may not reach a collective: each rank waits
        (bounded) for its own write; rank 0 publishes the checkpoint if every rank's marker says its
        write finished, else leaves it `.partial` (never seen as a checkpoint). This run's staging
        directory goes, also after a save that failed (nothing in flight then)."""
        w, self.pending = self.pending, None
        if w is not None:
            self._finish_after_error(w, log)
        if self.accelerator.is_local_main_process:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _finish_after_error(self, w: BackgroundWrite, log) -> None:
        log(f"waiting (at most {wait_limit_s():.0f}s) for checkpoint {w.name}'s background write before exiting")
        w.join(wait_limit_s())
        if self.accelerator.is_main_process and w.done and not w.error:
            deadline = time.perf_counter() + max(60.0, 2 * w.background_s)
            checksums = read_markers(w.partial, self.accelerator.num_processes)
            while checksums is None and time.perf_counter() < deadline:
                time.sleep(0.5)
                checksums = read_markers(w.partial, self.accelerator.num_processes)
            if checksums is None:
                log(f"checkpoint {w.name} not published: not every rank's background write finished")
            else:
                remove_markers(w.partial)
                files = {rel: (w.partial / rel).stat().st_size for rel in sorted(checksums)}
                self._commit(w.partial, self.root / w.name, w.step, files, checksums, w.blocking_s + w.background_s)
                log(f"checkpoint {self.root / w.name} published")

    def _saved(self, step: int, final: Path, blocking: float, background: float | None, waited: float = 0.0) -> None:
        """waited: what the save blocked for before staging, for the previous save's background write."""
        timing = {"step": step, "blocking_s": round(blocking, 3),
                  "background_s": None if background is None else round(background, 3), "waited_s": round(waited, 3)}
        self.timings.append(timing)
        self._records.append({"step": step, "checkpoint": str(final), "checkpoint_blocking_s": timing["blocking_s"],
                              "checkpoint_background_s": timing["background_s"],
                              "checkpoint_waited_s": timing["waited_s"]})
        self._lines.append(f"step {step}: checkpoint {final} ({blocking:.2f}s" + (
            ")" if background is None else f" blocking, {background:.2f}s in the background)"))

    def take_saved(self) -> tuple[list[str], list[dict]]:
        """What the loop reports since it last asked: log lines, and metrics.jsonl records (one per
        published checkpoint: its seconds blocking and in the background)."""
        lines, records, self._lines, self._records = self._lines, self._records, [], []
        return lines, records

    def summary(self) -> dict:
        """The summary's account of the saves: seconds blocking the loop, seconds in the background."""
        background = [t["background_s"] for t in self.timings if t["background_s"] is not None]
        return {"checkpoint_saves": len(self.timings), "async_save": self.async_save,
                "checkpoint_blocking_seconds": round(sum(t["blocking_s"] for t in self.timings), 3),
                "checkpoint_waited_seconds": round(sum(t["waited_s"] for t in self.timings), 3),
                "checkpoint_background_seconds": round(sum(background), 3) if background else None}

    def _write(self, state: LoopState, tmp: Path, sync: bool = True) -> None:
        """This rank's part of a checkpoint (rank 0 also writes the loop state, recipe and hf/); sync:
        flushed to disk (not where it stages in host memory: the background writer fsyncs)."""
        acc, optimizer = self.accelerator, self.optimizer
        self.strategy.save_state(acc, tmp, self.recipe.lora)
        save_rng(tmp / RNG_DIR, acc.process_index)
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather shards on rank 0
            import torch

            optimizer.consolidate_state_dict(to=0)
            if acc.is_main_process:
                torch.save(optimizer.state_dict(), tmp / ZERO_REDUNDANCY_OPTIMIZER)
        fault_point("during_save", acc.process_index, state.step)
        if acc.is_main_process:
            (tmp / LOOP_STATE).write_text(json.dumps(asdict(state), indent=2) + "\n")
            if self._in_flight_writer is not None:
                self._in_flight_writer(tmp)
            (tmp / "recipe.json").write_text(json.dumps(self.recipe.to_dict(), indent=2) + "\n")
            if self.model_config is not None:
                self.model_config.save_pretrained(tmp / HF_DIR)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp / HF_DIR)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(tmp / HF_DIR)
        if sync and acc.local_process_index == 0:
            os.sync()

    def _together(self, fn, tmp: Path, step: int) -> None:
        """fn() on this rank, then a collective in place of a barrier: every rank learns whether any rank
        failed, and then all raise the same SaveError (rank 0 first removes the partial directory). A
        rank raising alone would leave the others waiting at the next barrier; DCP's CheckpointException
        is a BaseException, which would pass run.py's handlers and leave the lock behind."""
        from torch.distributed.checkpoint.api import CheckpointException

        error = None
        try:
            fn()
        except (Exception, CheckpointException) as e:
            error = first_failure(e, tmp)
        failed = [(rank, e) for rank, e in enumerate(_all_gather(self.accelerator)(error)) if e is not None]
        if not failed:
            return
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(self.root, step, failed)

    def check_finite(self, step: int) -> None:
        """Collective: refuse to save weights that hold NaN or inf, on any rank. The guard before each
        update (loop.skip_nonfinite) sees the loss and gradient norm only; an update can still turn
        weights non-finite with both finite (adam_eps=0 can: the recipe refuses it, docs/design-notes.md).
        Each rank counts the non-finite values of its
        part of the weights (updated_weights; one pass over them per save) and one all-reduce adds the
        counts up (averages them where every rank holds all the weights)."""
        import torch

        acc = self.accelerator
        count = nonfinite_count(self.optimizer).to(acc.device, torch.float64)
        replicated = self.strategy.replicates_weights  # every rank holds them all
        bad = math.ceil(acc.reduce(count, reduction="mean" if replicated else "sum").item())
        if bad:
            raise NonFiniteWeights(f"step {step}: the weights to be saved hold {bad} NaN/inf value(s), while the "
                                   f"loss and gradient norm were finite; stopped without saving "
                                   f"({after_nonfinite(self.root, self.recipe, step)})")

    def load(self, point) -> LoopState:
        """Collective. Restores model, optimizer, scheduler and RNG in place from a resume.ResumePoint
        (its `source`: the checkpoint, or its universal conversion); returns the loop state."""
        import logging

        import torch

        acc, optimizer = self.accelerator, self.optimizer
        source = point.source

        verify_checksums(point.path, point.manifest, acc.process_index, acc.num_processes,
                         _all_gather(acc), log=logging.getLogger("finetune").warning)
        with safe_loading():
            try:
                self.strategy.load_state(acc, source, self.recipe.lora)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(f"checkpoint {point.path}: {e}; use a checkpoint from a source you "
                                            "trust") from None
        # DeepSpeed's ZeRO-3 universal load gives every parameter group one shared `step` tensor; torch's
        # Adam increments it in place once per group, so bias correction would run ahead. One each:
        for param_state in _innermost(optimizer).state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
        zro = point.path / ZERO_REDUNDANCY_OPTIMIZER
        if hasattr(optimizer, "consolidate_state_dict") and zro.is_file():
            optimizer.load_state_dict(torch.load(zro, map_location="cpu", weights_only=True))
        state = read_loop_state(point.path)
        load_rng(point.path / RNG_DIR, acc.process_index, self.recipe.seed, state.step)
        return state


class NonFiniteWeights(RecipeError):
    """Weights about to be saved hold NaN or inf: said as one line (exit code 2); nothing is written."""


class SaveError(RecipeError):
    """Writing a checkpoint failed on some rank (a full disk, a read-only or vanished filesystem): one
    line naming the rank, the error and the newest complete checkpoint, which is left as it was."""

    def __init__(self, root: Path, step: int, failed: list):
        rank, error = failed[0]
        saved = complete_checkpoints(root)
        kept = (f"the newest complete checkpoint, {saved[-1]}, is intact; continue from it with --resume {saved[-1]} "
                "once there is room (free space, lower keep_last, or move output_dir to a larger filesystem)"
                if saved else "no complete checkpoint had been saved")
        super().__init__(f"saving checkpoint {checkpoint_name(step)} into {root} failed on rank {rank}: {error}; the "
                         f"partial checkpoint was removed and {kept}")


def first_failure(error: BaseException, directory: Path) -> str:
    """One line for an exception of a save: for DCP's CheckpointException (each failed rank's exception
    and traceback, many lines), the first rank's exception; led by "the filesystem is full" when it
    is: ENOSPC, or torch.save's short write ("unexpected pos"), which loses the errno, on a filesystem
    with (almost) nothing left."""
    import errno

    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    try:
        usage = shutil.disk_usage(directory if directory.exists() else directory.parent)
    except OSError:
        return line
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(getattr(e, "errno", None) == errno.ENOSPC for e in chain) or usage.free <= usage.total // 100:
        return f"the filesystem is full ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB; {line})"
    return line


def after_nonfinite(root: Path, recipe, step: int) -> str:
    """What a NaN stop leaves, and what continues from it: commands that run. A resumed run keeps the
    checkpoint's lr and Adam settings (resume.changes refuses another lr), so a lower lr is a new run."""
    saved = complete_checkpoints(root)
    lower = (f"for a lower lr (now {recipe.lr}) start a new run in another output_dir (a resumed run keeps the "
             "checkpoint's lr)")
    if not saved:
        return f"no checkpoint had been saved; {lower}, or check the data of step {step}"
    return (f"the newest checkpoint, {saved[-1]}, is from before it; continue from it with --resume {saved[-1]} "
            f"(with max_grad_norm lower, or max_nonfinite_steps=N to skip such steps), or {lower}, or check the data "
            f"of step {step}")


def rotate(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Drop the oldest complete checkpoints beyond keep_last, never `keep` (the one just committed,
    which may not be the newest: a run resumed from an older step); partial ones are not touched."""
    complete = complete_checkpoints(root)
    dropped = [old for old in complete[: max(0, len(complete) - keep_last)] if old != keep]
    for old in dropped:
        shutil.rmtree(old, ignore_errors=True)
    return dropped


def _all_gather(acc):
    """gather(obj) -> [obj of rank 0, obj of rank 1, ...]; [obj] without a process group."""
    import torch.distributed as dist

    def gather(obj):
        if not (dist.is_available() and dist.is_initialized()) or acc.num_processes == 1:
            return [obj]
        out = [None] * acc.num_processes
        dist.all_gather_object(out, obj)
        return out

    return gather


def _broadcast(acc, obj):
    """rank 0's obj on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or acc.num_processes == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _innermost(optimizer):
    """Accelerate wraps DeepSpeed's optimizer, which wraps the torch optimizer that holds the groups."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


if __name__ == "__main__" and sys.argv[1:2] == ["to-universal"]:
    # DeepSpeed's ds_to_universal, reading the ZeRO files weights_only (see ensure_universal)
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = [sys.argv[0], *sys.argv[2:]]
    with weights_only_torch_load():
        ds_to_universal.main(ds_to_universal.parse_arguments())
