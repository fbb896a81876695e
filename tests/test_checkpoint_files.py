"""Checkpoint files without training: manifests that cannot be read, checksums that catch a shard
corrupted without changing its size, the resume point `--resume auto` falls back to, and the
allow-list that stops a distributed checkpoint's `.metadata` pickle from running code.

Why xxh3-128: bench/studies/hash_checksums.py (files in the page cache, this 2-core machine shared with
other jobs): file_checksums 2.0-2.4 GB/s, sha256 0.5-0.6, crc32 0.8-1.4, blake2b 0.2-0.4 GB/s; in
memory on one core xxh3_128 ran 6-13 GB/s, sha256 (SHA-NI) 1.5. Hashing a checkpoint is then bound
by the disk, not the CPU."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from finetune.checkpointing.layout import MANIFEST
from finetune.checkpointing.manifest import (CHECKSUM, UnreadableManifest, file_checksums, read_manifest, shares,
                                             verify, verify_checksums)
from finetune.checkpointing.safe_loading import DCP_METADATA, load_dcp_metadata, safe_loading
from finetune.checkpointing.resume import find as find_resume_point
from finetune.recipe import RecipeError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose


class RunsCode:
    """A pickle that, when loaded by plain pickle, creates `path` (standing in for any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def make_checkpoint(path: Path, step: int = 4, checksums: bool = True, files=None) -> Path:
    """A directory shaped like a finetune checkpoint: files, and a manifest of their sizes and checksums."""
    # the shards: bytes only a distributed-checkpoint reader reads (a torch.save name would be scanned as one)
    files = files or {"pytorch_model/shard_0.distcp": os.urandom(3000),
                      "pytorch_model/shard_1.distcp": os.urandom(1000), "loop_state.json": b'{"step": 4}'}
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    rels = sorted(files)
    manifest = {"step": step, "world_size": 2, "global_batch_size": 16, "fingerprint": {"strategy": "zero3"},
                "files": {rel: len(files[rel]) for rel in rels}}
    if checksums:
        manifest |= {"checksum": CHECKSUM, "checksums": file_checksums(path, rels)}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def flip_byte(path: Path, offset: int = 500) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- manifests


@pytest.mark.parametrize("content,words", [
    (b"", "is unreadable"),
    (b'{"step": 4, "files": {', "is unreadable"),
    (b"\xff\xfe\x00garbage", "is unreadable"),
    (b"[1, 2]", "not a finetune manifest (a JSON list"),
    (b'{"files": {}}', "no integer 'step'"),
    (b'{"step": 4, "world_size": 2, "global_batch_size": 16, "fingerprint": {"strategy": "zero3"}, '
     b'"files": {"a": "12"}}', "no 'files' mapping"),
])
def test_unreadable_manifest_is_one_clear_error(tmp_path, content, words):
    ckpt = make_checkpoint(tmp_path / "step_000000004")
    (ckpt / MANIFEST).write_bytes(content)
    with pytest.raises(UnreadableManifest) as e:
        verify(ckpt)
    message = str(e.value)
    assert words in message and str(ckpt) in message and "\n" not in message
    assert isinstance(e.value, RecipeError)  # run.py and export print it as one `error:` line


def test_resume_auto_skips_a_checkpoint_whose_manifest_is_unreadable(tmp_path):
    root = tmp_path / "checkpoints"
    make_checkpoint(root / "step_000000004", step=4)
    newest = make_checkpoint(root / "step_000000008", step=8)
    (newest / MANIFEST).write_text("")
    lines = []
    point = find_resume_point("auto", tmp_path, log=lines.append)
    assert point.path == root / "step_000000004" and point.step == 4
    assert len(lines) == 1 and "skipping" in lines[0] and "step_000000008" in lines[0] and "unreadable" in lines[0]
    assert (newest / MANIFEST).is_file()  # nothing deleted

    with pytest.raises(RecipeError, match="manifest.json is unreadable"):
        find_resume_point(str(newest), tmp_path)  # named explicitly: an error, no fallback


def test_resume_auto_with_no_readable_manifest_refuses_rather_than_start_over(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 8):
        (make_checkpoint(root / f"step_{step:09d}", step=step) / MANIFEST).write_text("{")
    with pytest.raises(RecipeError, match="no checkpoint in .* has a readable manifest.json") as e:
        find_resume_point("auto", tmp_path, log=lambda m: None)
    assert "step_000000004, step_000000008" in str(e.value)


def test_the_advice_for_a_damaged_checkpoint_works_as_typed(tmp_path):
    """The damaged newest checkpoint's advice was `--resume PATH` of an earlier one, which check_lineage refuses
    while the damaged one (newer) is in checkpoints/. Now it says to move it out of the way and --resume auto:
    done as written, the run continues from the checkpoint before it."""
    import shlex
    import shutil

    from finetune.checkpointing.resume import check_start

    root = tmp_path / "checkpoints"
    make_checkpoint(root / "step_000000004", step=4)
    damaged = make_checkpoint(root / "step_000000008", step=8)
    (damaged / "pytorch_model" / "shard_1.distcp").write_bytes(b"cut")
    with pytest.raises(RecipeError) as e:
        find_resume_point("auto", tmp_path)
    message = str(e.value)
    assert message.startswith(f"checkpoint {damaged} is damaged: pytorch_model/shard_1.distcp has 3 bytes")
    assert "\n" not in message and "--resume PATH" not in message
    mv = shlex.split(message[message.index("(mv ") + 1:message.index(") and --resume auto")])
    assert mv[:2] == ["mv", str(damaged)] and message.endswith("and --resume auto")
    shutil.move(mv[1], mv[2])
    check_start("auto", str(tmp_path))
    assert find_resume_point("auto", tmp_path).step == 4
    check_start(str(root / "step_000000004"), str(tmp_path))  # and by its path: nothing newer is left
    assert (root / "damaged-step_000000008" / MANIFEST).is_file(), "moved, not deleted"


def test_what_a_stopped_run_leaves_is_said_as_it_is(tmp_path):
    """A reward function failing before the first checkpoint said "its last checkpoint is intact": there was none.
    Now the line names the newest checkpoint, or says there is none yet."""
    from finetune.checkpointing.resume import kept_checkpoint

    assert kept_checkpoint(tmp_path) == "no checkpoint had been saved yet (--resume auto starts it again)"
    make_checkpoint(tmp_path / "checkpoints" / "step_000000002", step=2)
    make_checkpoint(tmp_path / "checkpoints" / "step_000000004", step=4)
    (tmp_path / "checkpoints" / ".step_000000006.partial").mkdir()
    assert kept_checkpoint(tmp_path) == "its newest checkpoint, step_000000004, is intact"


# ---------------------------------------------------------------- checksums


def test_checksums_catch_a_same_size_corruption(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    shard = ckpt / "pytorch_model" / "shard_0.distcp"
    verify(ckpt, checksums=True)
    flip_byte(shard)
    verify(ckpt)  # sizes alone cannot see it
    with pytest.raises(RecipeError) as e:
        verify(ckpt, checksums=True)
    assert "is damaged: pytorch_model/shard_0.distcp does not match the xxh3_128 checksum" in str(e.value)
    assert "nothing was deleted" in str(e.value)


def test_checksums_are_verified_in_shares_that_together_cover_every_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    manifest = read_manifest(ckpt)
    parts = shares(manifest["files"], 2)
    assert sorted(sum(parts, [])) == sorted(manifest["files"]) and all(parts)
    assert parts[0] == ["pytorch_model/shard_0.distcp"]  # the largest file alone balances the rest
    flip_byte(ckpt / "pytorch_model" / "shard_0.distcp")
    verify_checksums(ckpt, manifest, rank=1, world=2)  # rank 1's share is intact
    with pytest.raises(RecipeError, match="shard_0.distcp does not match"):
        verify_checksums(ckpt, manifest, rank=0, world=2)
    # collectively every rank learns what any rank found
    with pytest.raises(RecipeError, match="shard_0.distcp does not match"):
        verify_checksums(ckpt, manifest, rank=1, world=2, all_gather=lambda mine: [["pytorch_model/shard_0.distcp"],
                                                                                     mine])


def test_a_manifest_without_checksums_still_loads_on_sizes(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", checksums=False)
    assert "checksums" not in verify(ckpt, checksums=True)
    lines = []
    verify_checksums(ckpt, read_manifest(ckpt), rank=0, world=1, log=lines.append)
    assert lines and "no checksums" in lines[0] and "only file sizes were checked" in lines[0]
    (ckpt / "loop_state.json").write_text("{}")
    with pytest.raises(RecipeError, match="has 2 bytes, the manifest says 11"):
        verify(ckpt)


def test_file_checksums_are_xxh3_128_of_the_content(tmp_path):
    import xxhash

    data = os.urandom((8 << 20) + 123)  # more than one read block
    (tmp_path / "f").write_bytes(data)
    assert file_checksums(tmp_path, ["f"]) == {"f": xxhash.xxh3_128_hexdigest(data)}


# ---------------------------------------------------------------- DCP metadata allow-list


def dcp_checkpoint(path: Path) -> Path:
    """A real torch.distributed.checkpoint directory: tensors and a non-tensor item, as FSDP writes."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "extra": {"lr": 0.1, "names": ["a"]}},
             checkpoint_id=str(path), no_dist=True)
    return path


def test_real_dcp_metadata_passes_the_allow_list_and_loads(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    directory = dcp_checkpoint(tmp_path / "dcp")
    with open(directory / DCP_METADATA, "rb") as f:
        metadata = load_dcp_metadata(f)
    assert set(metadata.state_dict_metadata) == {"w", "extra.lr", "extra.names"}
    target = {"w": torch.zeros(3, 4), "extra": {"lr": 0.0, "names": []}}
    with safe_loading():
        dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert torch.equal(target["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert target["extra"] == {"lr": 0.1, "names": ["a"]}


def test_planted_dcp_metadata_does_not_run(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    directory = dcp_checkpoint(tmp_path / "dcp")
    marker = tmp_path / "code-ran"
    (directory / DCP_METADATA).write_bytes(pickle.dumps(RunsCode(marker)))
    with open(directory / DCP_METADATA, "rb") as f, pytest.raises(pickle.UnpicklingError, match="system"):
        load_dcp_metadata(f)
    original = filesystem.pickle
    with safe_loading(), pytest.raises(pickle.UnpicklingError, match="not on the allow-list"):
        dcp.FileSystemReader(str(directory)).read_metadata()  # what FSDP's load_state and export call
    assert filesystem.pickle is original  # restored after the block
    assert not marker.exists()


def global_ref(module: str, name: str) -> bytes:
    """A pickle (protocol 4) that only looks up module.name: STACK_GLOBAL, then STOP."""
    m, n = module.encode(), name.encode()
    return b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93."


class CallsEval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


@pytest.mark.parametrize("payload", [
    pickle.dumps(RunsCode("/nonexistent/marker")),
    pickle.dumps(CallsEval()),
    global_ref("torch", "load"),  # a torch function, not a dtype
    global_ref("torch.distributed.checkpoint.metadata", "Metadata.mro"),  # dotted: reaches into a class
    global_ref("torch.distributed.checkpoint.metadata", "field"),  # a function imported there
    global_ref("torch.distributed.checkpoint.metadata", "Enum"),  # a class imported there, not defined
], ids=["os.system", "eval", "torch.load", "dotted", "function", "imported-class"])
def test_the_allow_list_refuses_everything_but_metadata_types(payload):
    import io

    with pytest.raises(pickle.UnpicklingError, match="not on the allow-list"):
        load_dcp_metadata(io.BytesIO(payload))


def test_torch_load_of_checkpoint_files_names_what_it_refused(tmp_path):
    """What load_state reads with torch.load (Accelerate's optimizer.bin, scheduler.bin,
    random_states_*.pkl; DeepSpeed's ZeRO files) loads weights_only inside safe_loading; a refusal
    names the file and the global instead of torch's advice to load with weights_only=False."""
    import torch

    from finetune.checkpointing.safe_loading import DisallowedPickle

    marker = tmp_path / "code-ran"
    torch.save({"state": RunsCode(marker)}, tmp_path / "scheduler.bin")
    torch.save({"step": torch.tensor(3), "lr": [0.1]}, tmp_path / "fine.bin")
    with safe_loading():
        assert torch.load(tmp_path / "fine.bin", weights_only=False)["lr"] == [0.1]  # forced weights_only, loads
        with pytest.raises(DisallowedPickle) as e:
            torch.load(tmp_path / "scheduler.bin", weights_only=False)
    assert str(e.value).startswith("scheduler.bin names posix.system, which torch.load(weights_only=True) does not")
    assert "weights_only=False" not in str(e.value) and not marker.exists()


def test_verify_refuses_a_planted_metadata_listed_in_the_manifest(tmp_path):
    marker = tmp_path / "code-ran"
    ckpt = make_checkpoint(tmp_path / "ckpt", files={"pytorch_model_fsdp_0/.metadata": pickle.dumps(RunsCode(marker)),
                                                     "loop_state.json": b"{}"})
    with pytest.raises(RecipeError) as e:
        verify(ckpt, checksums=True)
    message = str(e.value)
    assert "pytorch_model_fsdp_0/.metadata is refused" in message and "posix.system" in message
    assert not marker.exists()


def test_a_garbled_metadata_is_damage_not_an_attack(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", files={"optimizer_0/.metadata": b"\x00garbage", "loop_state.json": b"{}"})
    with pytest.raises(RecipeError, match=r"is damaged: optimizer_0/\.metadata cannot be read \(UnpicklingError"):
        verify(ckpt)



@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                                  "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "zero_redundancy_optimizer.pt"])
@pytest.mark.parametrize("form", ["archive", "bare", "unlisted"])
def test_verify_refuses_pickled_code_in_any_torch_file_before_anything_loads(tmp_path, name, form):
    """Issue 52, item 4: a hostile optimizer.bin or scheduler.bin (any file a torch.load reads) used to be
    refused inside each rank's load, a traceback per rank and exit 1; verify(), which every rank and the
    front run before anything loads, reads each archive's pickle without running it and refuses in one
    line: a global outside the allow-list, a bare pickle, or such a file put there after the save."""
    import torch

    marker = tmp_path / "code-ran"
    ckpt = make_checkpoint(tmp_path / "ckpt", files={"loop_state.json": b'{"step": 4}',
                                                     **({} if form == "unlisted" else {name: b"placeholder"})})
    (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
    if form == "bare":
        (ckpt / name).write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        torch.save({"state": {0: {"step": torch.tensor(3.0)}}, "hook": RunsCode(marker)}, ckpt / name)
    if form != "unlisted":  # the manifest made to match, as an attacker could
        manifest = json.loads((ckpt / MANIFEST).read_text())
        manifest["files"][name] = (ckpt / name).stat().st_size
        manifest["checksums"] |= file_checksums(ckpt, [name])
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RecipeError) as e:
        verify(ckpt, checksums=True)
    message = str(e.value)
    assert message.startswith(f"checkpoint {ckpt}: {name} is refused: it ") and "\n" not in message, message
    assert {"archive": "names posix.system, which torch.load(weights_only=True) does not allow (it could run code)",
            "bare": "is not a torch.save archive but a bare pickle",
            "unlisted": "names posix.system"}[form] in message, message
    assert message.endswith("nothing in it was run or loaded; use a checkpoint from a source you trust")
    assert not marker.exists()


def test_the_scan_passes_what_real_saves_hold(tmp_path):
    """What Accelerate and DeepSpeed pickle beside tensors passes torch_file_problem: numpy's RNG state
    (Accelerate's random_states_*.pkl), DeepSpeed's ZeRO classes; a damaged archive is damage, not an
    attack."""
    import random

    import numpy as np
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from finetune.checkpointing.safe_loading import DAMAGED, torch_file_problem

    torch.save({"step": 1, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, tmp_path / "random_states_0.pkl")
    torch.save({"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": LossScaler(1.0),
                "state": torch.zeros(3)}, tmp_path / "optim_states.pt")
    assert torch_file_problem(tmp_path / "random_states_0.pkl") is None
    assert torch_file_problem(tmp_path / "optim_states.pt") is None
    data = bytearray((tmp_path / "optim_states.pt").read_bytes())
    (tmp_path / "cut.pt").write_bytes(bytes(data[:len(data) // 2]))
    assert torch_file_problem(tmp_path / "cut.pt").startswith(("is not a torch.save archive", DAMAGED))


def test_a_bare_pickle_where_a_torch_save_archive_belongs_is_refused(tmp_path):
    """DeepSpeed's zero_to_fp32 loads with mmap=True, which fails on a bare pickle with a RuntimeError
    that says nothing of safety; safe_loading says what it is."""
    import torch

    from finetune.checkpointing.safe_loading import DisallowedPickle

    marker = tmp_path / "code-ran"
    (tmp_path / "optim_states.pt").write_bytes(pickle.dumps(RunsCode(marker)))
    with safe_loading(), pytest.raises(DisallowedPickle, match="optim_states.pt is not a torch.save archive"):
        torch.load(tmp_path / "optim_states.pt", mmap=True, weights_only=False)
    assert not marker.exists()


def test_rotation_keeps_the_newest_and_the_one_just_written(tmp_path):
    from finetune.checkpointing.layout import rotate

    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20):
        (root / f"step_{step:09d}").mkdir(parents=True)
        (root / f"step_{step:09d}" / MANIFEST).write_text("{}")
    (root / ".step_000000025.partial").mkdir()  # a save in progress (or cut short): not rotation's business
    dropped = rotate(root, keep_last=2, keep=root / "step_000000020")
    assert [p.name for p in dropped] == ["step_000000005", "step_000000010"]
    assert sorted(p.name for p in root.iterdir()) == [".step_000000025.partial", "step_000000015", "step_000000020"]
    # a run resumed from step 5 commits step 10 again while 15 and 20 are newer: 10 is kept
    (root / "step_000000010").mkdir()
    (root / "step_000000010" / MANIFEST).write_text("{}")
    assert rotate(root, keep_last=1, keep=root / "step_000000010") == [root / "step_000000015"]
    assert sorted(p.name for p in root.iterdir()) == [".step_000000025.partial", "step_000000010", "step_000000020"]


def test_a_sealed_directory_is_checked_file_by_file(tmp_path):
    """manifest.seal / seal_problem: the listing a universal conversion carries (resume.ensure_universal)."""
    from finetune.checkpointing.manifest import seal, seal_problem

    d = tmp_path / "universal"
    (d / "pytorch_model" / "zero" / "w").mkdir(parents=True)
    (d / "pytorch_model" / "zero" / "w" / "fp32.pt").write_bytes(os.urandom(4000))
    (d / "latest").write_text("pytorch_model")
    assert seal_problem(d, "conversion.json", {"source_manifest": "a"}).startswith("no conversion.json")
    listing = seal(d, "conversion.json", {"source_manifest": "a"})
    assert sorted(listing["files"]) == ["latest", "pytorch_model/zero/w/fp32.pt"] and listing["checksum"] == CHECKSUM
    assert not list(d.glob(".*"))  # the temporary file was renamed
    assert seal_problem(d, "conversion.json", {"source_manifest": "a"}) is None
    assert "source_manifest" in seal_problem(d, "conversion.json", {"source_manifest": "b"})  # another checkpoint

    f = d / "pytorch_model" / "zero" / "w" / "fp32.pt"
    data = bytearray(f.read_bytes())
    data[2000] ^= 0xFF
    f.write_bytes(bytes(data))  # same size: only the checksum sees it
    assert seal_problem(d, "conversion.json", {"source_manifest": "a"}) == \
        "pytorch_model/zero/w/fp32.pt does not match the xxh3_128 checksum in conversion.json"
    data[2000] ^= 0xFF
    f.write_bytes(bytes(data))
    (d / "extra.pt").write_bytes(b"x")
    assert seal_problem(d, "conversion.json", {"source_manifest": "a"}) == "extra.pt not listed"
    (d / "extra.pt").unlink()
    (d / "latest").unlink()
    assert seal_problem(d, "conversion.json", {"source_manifest": "a"}) == "latest missing"
    (d / "conversion.json").write_text("{")
    assert seal_problem(d, "conversion.json", {}) == "conversion.json is unreadable (JSONDecodeError)"


def test_a_failed_save_is_one_line(tmp_path):
    """DCP's CheckpointException (a BaseException, each failed rank's traceback on many lines) and an
    ENOSPC deep in a chain become one line that says the filesystem is full; other errors say what
    they are; SaveError names the intact checkpoint and the command that continues from it."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from finetune.checkpointing.checkpoint import SaveError, first_failure

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        full = CheckpointException("failed", {1: _wrap_exception(e)})
    line = first_failure(full, tmp_path / ".step_000000004.partial")
    assert line.startswith("the filesystem is full (") and "\n" not in line
    assert line.endswith("; OSError: [Errno 28] No space left on device)"), line
    assert first_failure(RuntimeError("boom\nmore"), tmp_path) == "RuntimeError: boom"
    root = tmp_path / "checkpoints"
    (root / "step_000000002").mkdir(parents=True)
    (root / "step_000000002" / "manifest.json").write_text("{}")
    message = str(SaveError(root, 4, [(1, line)]))
    assert message.startswith(f"saving checkpoint step_000000004 into {root} failed on rank 1: the filesystem is full")
    assert f"continue from it with --resume {root / 'step_000000002'} once there is room" in message


def test_a_missing_checkpoint_is_named_with_the_ones_that_exist(tmp_path, capsys):
    """`finetune export runs/tiny/checkpoints/step_000000200 out` where tiny wrote step_000000236 (what
    docs/recipes.md said): the error lists the complete checkpoints beside it (not a partial one), or
    says the folder is not there either."""
    from finetune.commands.export import main

    root = tmp_path / "checkpoints"
    for name in ("step_000000100", "step_000000236"):
        (root / name).mkdir(parents=True)
        (root / name / MANIFEST).write_text("{}")
    (root / ".step_000000300.partial").mkdir()
    (root / "step_000000250").mkdir()  # no manifest: a save that never finished
    assert main([str(root / "step_000000200"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: no checkpoint directory at {root / 'step_000000200'}; {root} holds "
                                       "step_000000100, step_000000236\n")
    with pytest.raises(RecipeError, match=f"; {tmp_path / 'none'} does not exist either$"):
        verify(tmp_path / "none" / "step_000000001")
    assert not (tmp_path / "out").exists()
