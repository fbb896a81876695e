"""What identifies a model's weights, for what is derived from them and must not outlive them: the
precomputed reference log-probs (finetune/training/reference.py keys its file by it) and a checkpoint whose
resume reads the model again (a DPO run's frozen reference, a LoRA run's base: resume.check_identity).

- a local directory: the xxh3-128 of each weight file's content (and config.json). A file rewritten at
  the same size and modification time is another model. Hashing reads the files: xxh3 hashed a 419 MB
  safetensors file in 55 ms from the page cache (7.6 GB/s) and 0.54 s from disk (0.78 GB/s, the disk's
  speed), and the run reads those files right after, so a cold read here warms the load. A safetensors
  header alone (names, shapes, offsets: under 1 ms) does not change when a fine-tune rewrites the values,
  so it cannot stand for the content. Only the runs that need it hash (loop.setup: LoRA, DPO).
- a hub id: the commit of the snapshot the Hugging Face cache resolves it to (refs/main, or the
  revision it names), which is what from_pretrained loads; a repo moved to a new commit is another model.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
IDENTIFYING = ("config.json",)  # besides the weights: how they are read


def weight_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in IDENTIFYING))


def hub_revision(name: str, cache_dir: str | None = None) -> str | None:
    """The commit the Hugging Face cache resolves hub id `name` to (None when it holds no snapshot)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir)
    if not isinstance(found, (str, os.PathLike)):
        return None
    return Path(found).parent.name  # .../models--org--name/snapshots/<commit>/config.json


def model_identity(model_path: str, cache_dir: str | None = None) -> dict:
    """{"files": {name: xxh3}} for a directory, {"hub": id, "revision": commit} for a hub id."""
    path = Path(model_path)
    if path.is_dir():
        from finetune.checkpointing.manifest import file_checksums

        return {"files": file_checksums(path, weight_files(path))}
    return {"hub": model_path, "revision": hub_revision(model_path, cache_dir)}


def identity_change(saved: dict, current: dict) -> str | None:
    """What differs between two identities, in words; None when they are the same model."""
    if saved == current:
        return None
    if "files" in saved and "files" in current:
        old, new = saved["files"], current["files"]
        parts = [f"{n} changed" for n in sorted(set(old) & set(new)) if old[n] != new[n]]
        parts += [f"{n} is gone" for n in sorted(set(old) - set(new))]
        parts += [f"{n} is new" for n in sorted(set(new) - set(old))]
        return ", ".join(parts[:4]) + (" and more" if len(parts) > 4 else "")
    if "revision" in saved and "revision" in current:
        return f"its hub revision {saved['revision']} -> {current['revision']}"
    return f"{describe(saved)} -> {describe(current)}"


def describe(identity: dict) -> str:
    if "files" in identity:
        return f"a directory of {len(identity['files'])} weight file(s)"
    return f"hub id {identity.get('hub')} at revision {identity.get('revision')}"
