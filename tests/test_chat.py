"""`finetune chat` on what a user may point it at: a checkpoint is verified as export verifies it
(sizes and checksums: finetune.checkpoint.verify), a damaged or foreign directory is one `error:` line
and exit 2, and the prompt is rendered the way the run trained its prompts. The checkpoints here are
the tiny model's real weights written the way a DDP run's save_state writes them (model.safetensors,
hf/, recipe.json, a sealed manifest); chat on the checkpoints of real launches is in
tests/distributed/test_samples_run.py."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from test_checkpoint_files import flip_byte


def write_checkpoint(path: Path, weights: str = "safetensors", checksums: bool = True, recipe: dict | None = None):
    """The tiny model's weights as a checkpoint: model.safetensors (or pytorch_model.bin), hf/ (config,
    tokenizer), recipe.json and a manifest listing every file with its size (and checksum)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.assets import tiny_model_dir
    from finetune.checkpoint import HF_DIR, MANIFEST, seal

    tiny = tiny_model_dir()
    path.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if weights == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    model.config.save_pretrained(path / HF_DIR)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path / HF_DIR)
    (path / "recipe.json").write_text(json.dumps(recipe or {"model": str(tiny), "mixed_precision": "no",
                                                            "dataset_format": "alpaca"}))
    manifest = seal(path, MANIFEST, {"step": 4, "world_size": 1, "global_batch_size": 8,
                                     "fingerprint": {"strategy": "ddp", "model": str(tiny)}})
    if not checksums:  # as an older finetune wrote it
        manifest = {k: v for k, v in manifest.items() if k not in ("checksum", "checksums")}
        (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def chat(capsys, *argv) -> tuple[int, str, str]:
    from finetune.commands.chat import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def pickle_offset(archive: Path) -> int:
    """Where the pickle (data.pkl) of a torch.save archive starts: a byte flipped there is in the pickle."""
    with zipfile.ZipFile(archive) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with open(archive, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def test_chat_verifies_a_checkpoints_checksums_as_export_does(tmp_path, capsys):
    """A shard corrupted at the same size passes a size check; chat answered from it (exit 0) where
    export refused. Now both refuse with the same line, before any weight is read."""
    from finetune.commands.export import main as export_main

    ckpt = write_checkpoint(tmp_path / "step_000000004")
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    assert code == 0 and out.strip(), err  # the intact checkpoint answers
    flip_byte(ckpt / "model.safetensors", offset=(ckpt / "model.safetensors").stat().st_size - 1000)  # a weight
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    assert line == (f"error: checkpoint {ckpt} is damaged: model.safetensors does not match the xxh3_128 checksum in "
                    "its manifest.json; nothing was deleted; resume from an earlier checkpoint with --resume PATH")
    capsys.readouterr()
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == line


@pytest.mark.parametrize("checksums", [True, False])
def test_a_flipped_pickle_byte_is_one_line(tmp_path, capsys, checksums):
    """A checkpoint whose weights are a torch.save archive, one byte of its pickle flipped: with
    checksums the checksum names the file; without (an older manifest) torch's weights-only unpickler
    refuses it, in one line rather than a traceback."""
    ckpt = write_checkpoint(tmp_path / "step_000000004", weights="bin", checksums=checksums)
    flip_byte(ckpt / "pytorch_model.bin", offset=pickle_offset(ckpt / "pytorch_model.bin") + 40)
    code, out, err = chat(capsys, ckpt, "Say hi", "--max-new-tokens", "4")
    line = one_error_line(err)
    assert code == 2 and out == "", err
    if checksums:
        assert line.startswith(f"error: checkpoint {ckpt} is damaged: pytorch_model.bin does not match the xxh3_128")
    else:
        # torch's weights-only unpickler refuses it, or fails on what the flip made (a string no longer UTF-8)
        assert line.startswith(f"error: {ckpt}") and "cannot be loaded" in line and "weights_only" not in line
        assert "has no checksums (written by an older finetune)" in err
