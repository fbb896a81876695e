"""A checkpoint's manifest and its checks: what identifies a run's data (fingerprint), every file with its
size and xxh3-128 checksum (written last, by Checkpointer._commit), reading and verifying it (sizes, the
DCP metadata's allow-list, checksums shared among the ranks), and the same listing for any directory
(seal / seal_problem: a universal conversion, an export).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.checkpointing.layout import (MANIFEST, UNIVERSAL, existing_checkpoints, not_a_checkpoint,
                                          set_aside)
from finetune.checkpointing.safe_loading import (DAMAGED, DCP_METADATA, TORCH_SUFFIXES, DisallowedPickle,
                                                load_dcp_metadata, read_plain, safetensors_header,
                                                torch_file_problem)
from finetune.recipe import Recipe, RecipeError

CHECKSUM = "xxh3_128"  # of every file, in the manifest (see file_checksums)
# Keys that must match for a checkpoint to continue this run; the first group can never differ.
HARD_KEYS = ("model", "strategy", "lora", "lora_r", "lora_target_modules")
# Every key that changes which rows, and which of their tokens, a step trains on (max_prompt_len: the
# tokens a preference pair's prompt keeps, and so which pairs are dropped). No other recipe key does:
# num_proc, padding_free and sequence_parallel give the same tokens laid out otherwise.
DATA_KEYS = ("dataset", "dataset_split", "dataset_format", "eval_dataset", "eval_fraction", "max_seq_len",
             "packing", "train_on_prompt", "seed", "tokenizer", "chat_template", "datasets", "eval_split",
             "max_prompt_len", "max_completion_len", "columns")
# Data keys written into a fingerprint only when set, so that a single-dataset run's fingerprint is the
# one earlier versions wrote (their checkpoints still resume, and new ones resume on older versions).
OPTIONAL_DATA_KEYS = ("datasets", "eval_split", "max_prompt_len", "max_completion_len", "columns")


BLOCK = 8 << 20  # bytes read at a time when hashing


def fingerprint(recipe: Recipe, model_path: str | None = None) -> dict:
    values, defaults = recipe.to_dict(), Recipe().to_dict()
    fp = {k: values.get(k) for k in HARD_KEYS + DATA_KEYS
          if k not in OPTIONAL_DATA_KEYS or values.get(k) != defaults[k]}
    if model_path is not None:
        fp["model"] = model_path
    return json.loads(json.dumps(fp))  # tuples as lists, as they come back from the manifest


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
            raise RecipeError(f"checkpoint {path} is damaged: {rel} is missing; nothing was deleted; "
                              + set_aside(path))
        if f.stat().st_size != size:
            raise RecipeError(f"checkpoint {path} is damaged: {rel} has {f.stat().st_size} bytes, the manifest says "
                              f"{size}; nothing was deleted; " + set_aside(path))
    refuse_pickled_code(path, manifest)
    for meta in sorted(path.rglob(DCP_METADATA)):
        with open(meta, "rb") as f:
            try:
                load_dcp_metadata(f)
            except DisallowedPickle as e:
                raise RecipeError(f"checkpoint {path}: {meta.relative_to(path)} is refused: {e}; nothing in it was "
                                  "run or loaded; use a checkpoint from a source you trust") from None
            except Exception as e:  # truncated or garbled: damaged rather than hostile
                raise RecipeError(f"checkpoint {path} is damaged: {meta.relative_to(path)} cannot be read "
                                  f"({type(e).__name__}: {e}); " + set_aside(path)) \
                    from None
    if checksums:
        bad = checksum_mismatches(path, manifest, sorted(manifest.get("checksums") or {}))
        if bad:
            raise damaged_by_checksum(path, bad)
    return manifest


def refuse_pickled_code(path: Path, manifest: dict) -> None:
    """Every file under the checkpoint that a reader will read holds what its name says, checked before
    anything loads, on every rank alike, in one line naming the file:
    - what a torch.load could read (optimizer.bin, scheduler.bin, the RNG states' .pkl, DeepSpeed's ZeRO
      files, the ZeroRedundancyOptimizer's), listed in the manifest or put there after the save: a
      torch.save archive whose pickle names nothing outside the allow-list (safe_loading.torch_file_problem),
      instead of a refusal inside each rank's load (a traceback per rank);
    - the JSON files (recipe.json, hf/'s config and tokenizer files) and the safetensors files (the weights,
      the RNG states, work in flight): readable as such (their formats cannot run code; damage is said here,
      not as a reader's traceback)."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = str(f.relative_to(path))
        if rel.split("/")[0] == UNIVERSAL or rel.startswith(f".{UNIVERSAL}.") or rel == MANIFEST:
            continue  # its DeepSpeed conversion, made from this checkpoint and sealed (resume.ensure_universal)
        problem = file_kind_problem(f)
        if problem is None and f.suffix in TORCH_SUFFIXES and rel not in manifest["files"]:
            problem = f"is not in its {MANIFEST} (put there after the save)"
        elif problem and checksum_mismatches(path, manifest, [rel]):
            raise damaged_by_checksum(path, [rel])  # damaged by accident, as its checksum says
        if problem and (problem.startswith(DAMAGED) or f.suffix not in TORCH_SUFFIXES):  # garbled, not hostile
            raise RecipeError(f"checkpoint {path} is damaged: {rel} {problem}; nothing in it was run or loaded; "
                              + set_aside(path))
        if problem:
            raise RecipeError(f"checkpoint {path}: {rel} is refused: it {problem}; nothing in it was run or loaded; "
                              "use a checkpoint from a source you trust")


def file_kind_problem(f: Path) -> str | None:
    """What is wrong with a checkpoint file for the reader its name goes to (None: nothing)."""
    if f.suffix in TORCH_SUFFIXES:
        return torch_file_problem(f)
    try:
        if f.suffix == ".json":
            read_plain(f)
        elif f.suffix == ".safetensors":
            safetensors_header(f)
    except ValueError as e:
        return str(e)
    return None


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
                       "nothing was deleted; " + set_aside(path))


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




def file_xxh3(path: Path, fsync: bool = False) -> str:
    """The xxh3-128 of a file's bytes (the manifest's checksum); fsync: also flush a file just written to
    disk (its bytes are then read back from the page cache)."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()
