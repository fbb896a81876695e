"""The one place that decides what a file any command reads may contain: tensors and plain data, never
pickled code.

- Before anything loads, torch_file_problem reads a torch.save archive's pickle without running it (its
  opcodes, not its objects) and names any global outside the allow-list (torch's weights-only set,
  DeepSpeed's classes, Accelerate's numpy RNG states); manifest.verify asks it of every such file in a
  checkpoint, on every rank alike, so a hostile optimizer.bin is one line, exit 2.
- At the load, within safe_loading(), every torch.load runs weights_only (DeepSpeed's and Accelerate's
  own calls included, with DeepSpeed's few classes allowed) and torch.distributed.checkpoint's `.metadata`
  pickle is read with an allow-list of its own. Resume, export and chat load through it;
  `python -m finetune.checkpointing.safe_loading to-universal` runs DeepSpeed's conversion under it.
- What finetune writes itself beside tensors is safetensors and JSON (RNG states, work in flight: run_state),
  read with read_tensors / read_plain / safetensors_header: formats that hold no code.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from contextlib import contextmanager
from pathlib import Path

from finetune.errors import RecipeError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a shard set: a pickle


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


class UnsafeCheckpointError(RecipeError):
    """A file that load_state read holds pickled objects outside the allow-list: one line, exit code 2.
    verify() finds such a file before the launch (torch_file_problem, on every rank alike); this is the
    backstop of what only the load itself reads (a distributed checkpoint's non-tensor items)."""


# Files a torch.load may read: each must be a torch.save archive whose pickle names nothing outside
# the allow-list (torch's weights-only set, DeepSpeed's classes, Accelerate's numpy RNG states).
TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DAMAGED = "is a damaged torch.save archive"  # torch_file_problem's answer for garbled bytes, not hostile ones
ZIP_MAGIC = b"PK\x03\x04"


def _allowed_global_names() -> set[str]:
    """The globals a checkpoint's torch.save archives may name beyond torch's own weights-only set: what
    weights_only_torch_load allows (DeepSpeed's) and what Accelerate allows for its RNG states (numpy's
    array reconstruction and dtypes, codecs.encode), under both spellings of numpy's core module."""
    import codecs

    import numpy as np

    objects = [*_trusted_deepspeed_globals(), np.ndarray, np.dtype, codecs.encode]
    if hasattr(np, "dtypes"):
        objects += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    names = {f"{o.__module__}.{o.__qualname__}" for o in objects}
    names |= {f"{core}.multiarray._reconstruct" for core in ("numpy.core", "numpy._core")}
    names |= {"_codecs.encode", "codecs.encode"}
    return names


def torch_file_problem(path: Path) -> str | None:
    """Why torch.load must not read `path` (None: it may): a bare pickle where a torch.save archive belongs,
    or an archive whose pickle names a global outside the allow-list. Reads the archive's pickle without
    running it (torch.serialization.get_unsafe_globals_in_checkpoint: its opcodes, not its objects) and
    never the tensors' bytes: cheap enough for every rank to ask of every file before anything loads."""
    import zipfile

    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e.strerror or e})"
    if head != ZIP_MAGIC or not zipfile.is_zipfile(path):
        return "is not a torch.save archive but a bare pickle or other bytes, which is refused (it could run code)"
    try:
        names = get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged archive: said, not raised
        return f"{DAMAGED} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    refused = sorted(set(names) - _allowed_global_names())
    if refused:
        return (f"names {', '.join(refused[:3])}, which torch.load(weights_only=True) does not allow (it could run "
                "code)")
    return None


def read_tensors(path: Path) -> dict:
    """A safetensors file's tensors: its format is a JSON header and the tensors' bytes, nothing that runs.
    A file that is not one raises ValueError with one line saying what it is."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"is not a safetensors file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'empty'})") from None


def safetensors_header(path: Path) -> list[str]:
    """The names of a safetensors file's tensors, from its header alone (the tensors' bytes are not read).
    ValueError: one line saying what the file is instead."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"is not a safetensors file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'empty'})") from None


def read_plain(path: Path):
    """A JSON file's plain data (objects, lists, strings, numbers, booleans, null). ValueError: one line."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"is not plain JSON ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'})") \
            from None


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


if __name__ == "__main__" and sys.argv[1:2] == ["to-universal"]:
    # DeepSpeed's ds_to_universal, reading the ZeRO files weights_only (see ensure_universal)
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = [sys.argv[0], *sys.argv[2:]]
    with weights_only_torch_load():
        ds_to_universal.main(ds_to_universal.parse_arguments())
