"""Where a run's outputs live under output_dir, and which of them are checkpoints.

    output_dir/checkpoints/step_000000120/   a checkpoint (names sort by step), complete once its manifest.json
                                             is inside (manifest.py writes and checks it)
    output_dir/checkpoints/.step_000000120.partial/
                                             one being written: renamed into place by rank 0 only after every
                                             rank has finished writing and the manifest is inside, so a crash
                                             leaves a complete checkpoint or a `.partial` never mistaken for one
    output_dir/final/, final_merged/         the finished model (or a LoRA adapter), its base with the adapter merged

Naming, listing (complete and partial), what to say of a directory that is no checkpoint, and keep_last's
rotation.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PREFIX = "step_"
MANIFEST = "manifest.json"  # its presence makes a checkpoint directory complete
HF_DIR = "hf"  # config and tokenizer, for export
UNIVERSAL = "universal"  # beside a DeepSpeed checkpoint's files: its universal conversion (resume.ensure_universal)

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


def rotate(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Drop the oldest complete checkpoints beyond keep_last, never `keep` (the one just committed,
    which may not be the newest: a run resumed from an older step); partial ones are not touched."""
    complete = complete_checkpoints(root)
    dropped = [old for old in complete[: max(0, len(complete) - keep_last)] if old != keep]
    for old in dropped:
        shutil.rmtree(old, ignore_errors=True)
    return dropped


def set_aside(path: Path) -> str:
    """The advice for a damaged checkpoint, as commands that run: --resume of an earlier one is refused while
    this newer one is in checkpoints/ (resume.check_lineage), so it is moved out of the way first (a name
    that does not start with the checkpoints' prefix: neither listed nor rotated)."""
    return (f"to continue from the newest intact checkpoint before it, move it out of the way (mv {path} "
            f"{path.with_name('damaged-' + path.name)}) and --resume auto")
