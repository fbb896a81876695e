"""The trained model as a plain Hugging Face directory: config, safetensors (sharded when big),
tokenizer. Written to a temporary directory and renamed, so `final/` is either complete or absent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def save_final_model(accelerator, model, tokenizer, out_dir: Path, max_shard_size: str = "5GB") -> Path:
    """Gather the full weights (ZeRO-3 and FSDP hold shards) and write them on the main process."""
    state_dict = accelerator.get_state_dict(model)  # collective: every rank must call it
    out_dir = Path(out_dir)
    if accelerator.is_main_process:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _plain_architecture(tmp / "config.json")
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".previous")
            shutil.rmtree(old, ignore_errors=True)
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def _plain_architecture(config_path: Path) -> None:
    """FSDP2 swaps the model's class for a generated `FSDP<Name>`; record the plain class name."""
    config = json.loads(config_path.read_text())
    config["architectures"] = [a[4:] if a.startswith("FSDP") else a for a in config.get("architectures") or []]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
