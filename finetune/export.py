"""The trained model as a plain Hugging Face directory: config, safetensors (sharded when big),
tokenizer. Two ways in, one way out:

- at the end of a run, `save_final_model` gathers the live sharded model into `final/`;
- `python -m finetune.export CHECKPOINT OUT_DIR` rebuilds the same thing from any checkpoint (FSDP
  distributed-checkpoint shards, DeepSpeed ZeRO files of any stage, a DDP state dict), from any
  number of processes, on one CPU process, and checks its result by reloading it.

Either way the directory is written under a temporary name and renamed, so it is complete or absent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # python finetune/export.py: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def save_final_model(accelerator, model, tokenizer, out_dir: Path, max_shard_size: str = "5GB") -> Path:
    """Gather the full weights (ZeRO-3 and FSDP hold shards) and write them on the main process.
    A LoRA model writes its adapter only (see save_final_adapter)."""
    if is_lora(accelerator.unwrap_model(model)):
        return save_final_adapter(accelerator, model, tokenizer, out_dir)
    state_dict = accelerator.get_state_dict(model)  # collective: every rank must call it
    out_dir = Path(out_dir)
    if accelerator.is_main_process:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        state_dict = without_tied_copies(unwrapped, state_dict)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _plain_architecture(tmp / "config.json")
        _publish(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def without_tied_copies(model, state_dict: dict) -> dict:
    """One entry per tied weight (Qwen2.5, Llama 3.2, Gemma tie lm_head to the embedding), as
    `save_pretrained` writes a plain model: the gathered state dict of a sharded model holds a separate
    full copy under each name, which would be saved twice and could be read back untied."""
    first, drop = {}, []
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state_dict:
            if id(param) in first:
                drop.append(name)
            else:
                first[id(param)] = name
    return {k: v for k, v in state_dict.items() if k not in drop} if drop else state_dict


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def trainable_state_dict(accelerator, model) -> dict:
    """Full tensors of the trainable parameters only (a LoRA adapter), on the main process: gathering
    them is cheap, unlike the frozen base. Collective: every rank must call it."""
    import torch

    unwrapped = accelerator.unwrap_model(model)
    named = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    out = {}
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            if accelerator.is_main_process:
                out = {n: p.detach().to("cpu", copy=True) for n, p in named}
        return out
    from torch.distributed.tensor import DTensor

    for name, param in named:
        full = param.full_tensor() if isinstance(param, DTensor) else param  # collective for FSDP2 shards
        if accelerator.is_main_process:
            out[name] = full.detach().to("cpu", torch.float32, copy=True)
    return out


def save_final_adapter(accelerator, model, tokenizer, out_dir: Path) -> Path:
    """final/ of a LoRA run: the adapter in peft's own format (PeftModel.from_pretrained(base, final))."""
    state_dict = trainable_state_dict(accelerator, model)
    out_dir = Path(out_dir)
    if accelerator.is_main_process:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def merge_adapter(base_path: str, adapter_dir: Path, out_dir: Path, dtype_name: str = "float32") -> Path:
    """final_merged/: the base with the adapter folded in, as one plain model. Done on one process
    from the files alone, with plain transformers and peft, which also proves the adapter loads."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _without_zero3_init():
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype_name))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    tmp = Path(out_dir).with_name(Path(out_dir).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
    _publish(tmp, Path(out_dir))
    return Path(out_dir)


@contextmanager
def _without_zero3_init():
    """Inside a ZeRO-3 run, transformers builds every model under deepspeed.zero.Init, which partitions
    it with collectives; a load on the main process alone would then wait for the other ranks forever."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".previous")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)


def _plain_architecture(config_path: Path) -> None:
    """FSDP2 swaps the model's class for a generated `FSDP<Name>`; record the plain class name."""
    config = json.loads(config_path.read_text())
    config["architectures"] = [a[4:] if a.startswith("FSDP") else a for a in config.get("architectures") or []]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- export of a checkpoint


class ExportError(Exception):
    pass


def checkpoint_state_dict(ckpt: Path, template: dict) -> dict:
    """Full, unsharded fp32 weights from a checkpoint, whatever wrote it. `template` is the plain
    model's state dict (its keys and shapes), filled in place for the FSDP case."""
    import torch

    from finetune.checkpoint import weights_only_torch_load

    fsdp_dir = ckpt / "pytorch_model_fsdp_0"
    zero_dir = ckpt / "pytorch_model"
    if fsdp_dir.is_dir():
        # Accelerate stores {"model": model.state_dict()} of the FSDP-wrapped model: keys gain "model."
        import torch.distributed.checkpoint as dcp

        wanted = {f"model.{k}": v for k, v in template.items()}
        available = set(dcp.FileSystemReader(str(fsdp_dir)).read_metadata().state_dict_metadata)
        wanted = {k: v for k, v in wanted.items() if k in available}  # tied weights are stored once
        dcp.load(wanted, checkpoint_id=str(fsdp_dir), no_dist=True)
        return {k[len("model."):]: v for k, v in wanted.items()}
    if zero_dir.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_torch_load():
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    if (ckpt / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(ckpt / "model.safetensors"))
    if (ckpt / "pytorch_model.bin").is_file():
        return torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ExportError(f"{ckpt} holds no model weights this tool knows (pytorch_model_fsdp_0/, pytorch_model/ "
                      "with ZeRO files, or model.safetensors)")


def export_checkpoint(ckpt: Path, out_dir: Path, max_shard_size: str = "5GB") -> dict:
    """Write `out_dir` from `ckpt` and prove it: reload with from_pretrained and compare logits on a
    probe batch against the model rebuilt from the checkpoint. Returns what was checked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.checkpoint import HF_DIR, verify
    from finetune.recipe import RecipeError

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    if out_dir.exists():
        raise ExportError(f"{out_dir} already exists; choose another OUT_DIR or move that one away (nothing was "
                          "overwritten)")
    try:
        manifest = verify(ckpt)
    except RecipeError as e:
        raise ExportError(str(e)) from None
    hf = ckpt / HF_DIR
    if not (hf / "config.json").is_file():
        raise ExportError(f"{ckpt} has no {HF_DIR}/config.json (written by every checkpoint of this toolkit); "
                          "is it a finetune checkpoint?")
    recipe = json.loads((ckpt / "recipe.json").read_text())
    config = AutoConfig.from_pretrained(hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    template = model.state_dict()
    state_dict = checkpoint_state_dict(ckpt, template)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(f"{ckpt} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    # final/ of a DeepSpeed run in bf16/fp16 holds 16-bit weights; the export matches it
    precision = recipe.get("mixed_precision", "no")
    if str(recipe.get("strategy", "")).startswith("zero") and precision in ("bf16", "fp16"):
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    model.eval()

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(hf).save_pretrained(tmp)
    _plain_architecture(tmp / "config.json")

    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype).eval()
    probe = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(probe).logits, reloaded(probe).logits
    max_diff = float((want.float() - got.float()).abs().max())
    if not torch.equal(want, got):
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"the exported model's logits differ from the checkpoint's by up to {max_diff:.3g}; "
                          "nothing was written")
    _publish(tmp, out_dir)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "world_size": manifest["world_size"],
            "out_dir": str(out_dir), "dtype": str(model.dtype).replace("torch.", ""),
            "parameters": sum(p.numel() for p in model.parameters()), "probe_max_abs_diff": max_diff}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.export",
                                     description="Turn any finetune checkpoint into a plain Hugging Face model.")
    parser.add_argument("checkpoint", type=Path, help="e.g. OUTPUT_DIR/checkpoints/step_000000200")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    import os
    import warnings

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # export never needs a GPU
    warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")  # one process is the intent
    from finetune.metrics import setup_logging

    setup_logging("warning", 0)
    try:
        result = export_checkpoint(args.checkpoint, args.out_dir, args.max_shard_size)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {result['step']} (written by {result['world_size']} process(es)) to {result['out_dir']}: "
          f"{result['parameters']:,} parameters, {result['dtype']}; reloaded with from_pretrained, probe logits "
          "identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
