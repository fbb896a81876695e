"""The trained model as a plain Hugging Face directory: config, safetensors (sharded when big),
tokenizer. Two ways in, one way out:

- at the end of a run, `save_final_model` gathers the live sharded model into `final/`;
- `python -m finetune.export CHECKPOINT OUT_DIR` rebuilds the same thing from any checkpoint (FSDP
  distributed-checkpoint shards, DeepSpeed ZeRO files of any stage, a DDP state dict), from any
  number of processes, on one CPU process, and checks its result by reloading it. A LoRA checkpoint
  becomes a peft adapter like final/ of its run, or with `--merge` one plain model.

Either way the directory is written under a temporary name and renamed, so it is complete or absent.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # python finetune/checkpointing/export.py: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.checkpointing.checkpoint import first_failure  # noqa: E402
from finetune.checkpointing.layout import HF_DIR, checkpoints_dir, complete_checkpoints  # noqa: E402
from finetune.checkpointing.manifest import verify  # noqa: E402
from finetune.checkpointing.safe_loading import safe_loading  # noqa: E402
from finetune.end_of_turn import checkpoint_generation_config  # noqa: E402
from finetune.files import publish, staging, why_not_creatable  # noqa: E402
from finetune.model import add_lora, model_class, without_zero3_init  # noqa: E402
from finetune.recipe import Recipe, RecipeError  # noqa: E402
from finetune.faults import fault_point  # noqa: E402
from finetune.strategy import final_in_training_dtype, running_strategy  # noqa: E402


def save_final_model(accelerator, model, tokenizer, out_dir: Path, max_shard_size: str = "5GB",
                     generation_config=None) -> Path:
    """Gather the full weights (ZeRO-3 and FSDP hold shards) and write them on the main process.
    A LoRA model writes its adapter only (see save_final_adapter). generation_config, when given,
    replaces the model's generation_config.json (a chat run's names the end-of-turn token:
    finetune/end_of_turn.py)."""
    if is_lora(accelerator.unwrap_model(model)):
        return save_final_adapter(accelerator, model, tokenizer, out_dir, generation_config)
    state_dict = accelerator.get_state_dict(model)  # collective: every rank must call it
    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=without_tied_copies(unwrapped, state_dict), safe_serialization=True,
                                  max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        _plain_architecture(tmp / "config.json")

    write_on_main(accelerator, out_dir, write)
    return out_dir


class FinalWriteError(RecipeError):
    """Writing final/ failed (a full disk, a read-only filesystem): one line on every rank, naming the
    checkpoint of the same step, which the loop saved just before and `finetune export` turns into the
    same directory."""


def write_on_main(accelerator, out_dir: Path, write) -> None:
    """write(tmp) on the main process, published as out_dir; a failure there removes the partial
    directory and stops every rank with the same line (FinalWriteError), instead of a traceback on one
    rank while the others wait at the barrier."""
    import torch.distributed as dist

    error = None
    if accelerator.is_main_process:
        try:
            with staging(out_dir) as tmp:
                write(tmp)
                fault_point("final_write", 0, 0)
                publish(tmp, out_dir)
        except OSError as e:
            saved = complete_checkpoints(checkpoints_dir(out_dir.parent))
            kept = (f"the checkpoint {saved[-1]} holds the same weights: once there is room, finetune export "
                    f"{saved[-1]} {out_dir}" if saved else "no checkpoint holds these weights")
            error = f"writing {out_dir} failed: {first_failure(e, out_dir.parent)}; the partial directory was " \
                    f"removed and {kept}"
    box = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise FinalWriteError(box[0])


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
    unwrapped = accelerator.unwrap_model(model)
    named = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    return running_strategy(accelerator).gather_trainable(accelerator, named)


def save_final_adapter(accelerator, model, tokenizer, out_dir: Path, generation_config=None) -> Path:
    """final/ of a LoRA run: the adapter in peft's own format (PeftModel.from_pretrained(base, final)),
    with the run's generation_config.json next to it (peft does not read it: final_merged/ carries it,
    or pass GenerationConfig.from_pretrained(final) to generate)."""
    state_dict = trainable_state_dict(accelerator, model)
    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)

    write_on_main(accelerator, out_dir, write)
    return out_dir


def merge_adapter(base_path: str, adapter_dir: Path, out_dir: Path, dtype_name: str = "float32") -> Path:
    """final_merged/: the base with the adapter folded in, as one plain model. Done on one process
    from the files alone, with plain transformers and peft, which also proves the adapter loads. The
    adapter's generation_config.json (the run's, see save_final_adapter) replaces the base's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    adapter = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    with without_zero3_init():
        if adapter.get("task_type") == "SEQ_CLS":  # a reward model's (objective=reward): its base with a score head
            from transformers import AutoConfig, AutoModelForSequenceClassification

            config = AutoConfig.from_pretrained(base_path, num_labels=1,
                                                pad_token_id=AutoTokenizer.from_pretrained(adapter_dir).pad_token_id)
            base = AutoModelForSequenceClassification.from_pretrained(base_path, config=config,
                                                                      dtype=getattr(torch, dtype_name))
        else:
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype_name))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    if (Path(adapter_dir) / "generation_config.json").is_file():
        merged.generation_config = GenerationConfig.from_pretrained(adapter_dir)
    with staging(Path(out_dir)) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
        publish(tmp, Path(out_dir))
    return Path(out_dir)


def _plain_architecture(config_path: Path) -> None:
    """FSDP2 swaps the model's class for a generated `FSDP<Name>`; record the plain class name."""
    config = json.loads(config_path.read_text())
    config["architectures"] = [a[4:] if a.startswith("FSDP") else a for a in config.get("architectures") or []]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- export of a checkpoint


class ExportError(Exception):
    pass


def _unwritable(out_dir: Path) -> str | None:
    """OUT_DIR's directory cannot be written (permissions, a read-only filesystem): said before the
    checkpoint is read. out_dir is written beside itself under a temporary name, then renamed."""
    problem = why_not_creatable(out_dir)
    if problem:
        reason, choice = problem
        return f"{out_dir} cannot be created: {reason}; choose {choice} OUT_DIR (nothing was written)"
    return None


def checkpoint_state_dict(ckpt: Path, template: dict | None) -> dict:
    """Full, unsharded fp32 weights from a checkpoint, whatever wrote it. `template` is the plain
    model's state dict (its keys and shapes), filled in place for the FSDP case; None for a LoRA
    checkpoint, which holds the adapter only."""
    import torch

    fsdp_dir = ckpt / "pytorch_model_fsdp_0"
    zero_dir = ckpt / "pytorch_model"
    if fsdp_dir.is_dir():
        # Accelerate stores {"model": model.state_dict()} of the FSDP-wrapped model: keys gain "model."
        import torch.distributed.checkpoint as dcp

        with safe_loading():
            metadata = dcp.FileSystemReader(str(fsdp_dir)).read_metadata().state_dict_metadata
            if template is None:  # a LoRA adapter: whatever tensors were saved, as saved
                wanted = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
                          if hasattr(m, "properties")}
            else:
                wanted = {f"model.{k}": v for k, v in template.items()}
                wanted = {k: v for k, v in wanted.items() if k in metadata}  # tied weights are stored once
            dcp.load(wanted, checkpoint_id=str(fsdp_dir), no_dist=True)
        return {k.removeprefix("model."): v for k, v in wanted.items()}
    if zero_dir.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed's reader prints a dozen lines and two progress bars: kept to its one line of result
        printed = io.StringIO()
        with safe_loading(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model",
                                                             exclude_frozen_parameters=template is None)
        done = [line.split(" with ", 1)[-1] for line in printed.getvalue().splitlines()
                if line.startswith("Reconstructed ") and "fp32 state dict with" in line]
        print(f"zero_to_fp32: the fp32 state dict rebuilt from the ZeRO shards ({'; '.join(done) or 'done'})",
              file=sys.stderr)
        return state
    if (ckpt / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(ckpt / "model.safetensors"))
    if (ckpt / "pytorch_model.bin").is_file():
        return torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ExportError(f"{ckpt} holds no model weights this tool knows (pytorch_model_fsdp_0/, pytorch_model/ "
                      "with ZeRO files, or model.safetensors)")


def export_checkpoint(ckpt: Path, out_dir: Path, max_shard_size: str = "5GB", merge: bool = False,
                      base: str | None = None, log=print) -> dict:
    """Write `out_dir` from `ckpt` and prove it: reload with from_pretrained and compare logits on a
    probe batch against the model rebuilt from the checkpoint. Returns what was checked. A LoRA
    checkpoint becomes a peft adapter, or with `merge` a plain model (see export_lora)."""
    ckpt, out_dir = Path(ckpt), Path(out_dir)
    if out_dir.exists():
        raise ExportError(f"{out_dir} already exists; choose another OUT_DIR or move that one away (nothing was "
                          "overwritten)")
    problem = _unwritable(out_dir)
    if problem:
        raise ExportError(problem)
    try:
        manifest = verify(ckpt, checksums=True, resume=False)
    except RecipeError as e:
        raise ExportError(str(e)) from None
    if "checksums" not in manifest:
        log(f"note: {ckpt} has no checksums (written by an older finetune): only file sizes were checked")
    try:
        return _export_verified(ckpt, out_dir, manifest, max_shard_size, merge, base)
    except (ExportError, OSError):
        gone = next((rel for rel in manifest["files"] if not (ckpt / rel).is_file()), None)
        if gone is None:
            raise
        raise ExportError(f"checkpoint {ckpt} was deleted while it was being exported ({gone} is gone: a run still "
                          "training keeps only its keep_last newest checkpoints); nothing was written; export a newer "
                          "checkpoint, or copy this one out of the run's checkpoints/ first") from None


def _export_verified(ckpt: Path, out_dir: Path, manifest: dict, max_shard_size: str, merge: bool,
                     base: str | None) -> dict:
    """export_checkpoint's work once the checkpoint verified."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    hf = ckpt / HF_DIR
    if not (hf / "config.json").is_file():
        raise ExportError(f"{ckpt} has no {HF_DIR}/config.json (written by every checkpoint of this toolkit); "
                          "is it a finetune checkpoint?")
    recipe = json.loads((ckpt / "recipe.json").read_text())
    if recipe.get("lora"):
        return export_lora(ckpt, out_dir, manifest, recipe, merge, base, max_shard_size)
    if merge or base:
        raise ExportError(f"{'--merge' if merge else '--base'} applies to LoRA checkpoints; {ckpt} is a full "
                          "fine-tune, whose export is a plain model already")
    config = AutoConfig.from_pretrained(hf)
    auto = model_class(config)  # a causal LM, or a reward model's sequence-classification class
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32)
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
    if final_in_training_dtype(recipe):
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    if getattr(model, "generation_config", None) is not None:  # a reward model generates nothing
        model.generation_config = checkpoint_generation_config(hf, model.generation_config, recipe, tokenizer)

    with staging(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _plain_architecture(tmp / "config.json")
        write_run_recipe(ckpt, tmp)

        reloaded = auto.from_pretrained(tmp, dtype=model.dtype).eval()
        probe = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want, got = model(probe).logits, reloaded(probe).logits
        max_diff = float((want.float() - got.float()).abs().max())
        if not torch.equal(want, got):
            raise ExportError(f"the exported model's logits differ from the checkpoint's by up to {max_diff:.3g}; "
                              "nothing was written")
        publish(tmp, out_dir)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "world_size": manifest["world_size"],
            "out_dir": str(out_dir), "dtype": str(model.dtype).replace("torch.", ""),
            "parameters": sum(p.numel() for p in model.parameters()), "probe_max_abs_diff": max_diff}


def write_run_recipe(ckpt: Path, tmp: Path) -> None:
    """The run's recipe.json beside the exported model, as chat finds one beside final/ (in the output_dir
    above it): the prompt format and answer length `finetune chat` takes from it (finetune/chat.py
    run_format, max_new_tokens_of), so that chat on an export answers as chat on final/. The output_dir's
    where the checkpoint still sits in OUTPUT_DIR/checkpoints/ (it also records the data's sources), else
    the checkpoint's own."""
    run = ckpt.parent.parent / "recipe.json"
    source = run if ckpt.parent.name == "checkpoints" and run.is_file() else ckpt / "recipe.json"
    shutil.copyfile(source, tmp / "recipe.json")


def lora_keys(state_dict: dict) -> dict:
    """Adapter tensors named as in peft's adapter_model.safetensors: DeepSpeed and DDP keep the adapter
    name in the key (`lora_A.default.weight`), peft's saved form (and FSDP's adapter_only save) has none."""
    import re

    keys = {re.sub(r"\.(lora_[A-Za-z_]+)\.default(?=\.|$)", r".\1", k): v for k, v in state_dict.items()}
    # a reward model's score head (peft's modules_to_save): saved under the module's own name
    return {k.replace(".modules_to_save.default.", "."): v for k, v in keys.items()}


def export_lora(ckpt: Path, out_dir: Path, manifest: dict, recipe: dict, merge: bool, base: str | None,
                max_shard_size: str = "5GB") -> dict:
    """A LoRA checkpoint holds the adapter, not the frozen base: rebuild the run's peft model on the base
    (the model the run loaded, or `base`), load the adapter into it, and write it as a peft adapter
    (PeftModel.from_pretrained(base, out_dir)), or with `merge` as one plain model. Either way the
    result is reloaded and must give the rebuilt model's probe logits exactly; a merged model must
    also give the adapter's within float tolerance."""
    import dataclasses

    import torch
    from peft import PeftModel, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = base or manifest["fingerprint"]["model"]
    reward = recipe.get("objective") == "reward"  # the base with its score head, config as the run's (hf/)
    try:
        with without_zero3_init():
            if reward:
                from transformers import AutoConfig, AutoModelForSequenceClassification

                base_model = AutoModelForSequenceClassification.from_pretrained(
                    base_path, config=AutoConfig.from_pretrained(ckpt / HF_DIR), dtype=torch.float32)
            else:
                base_model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ExportError(f"{ckpt} holds a LoRA adapter, not a whole model, and its base {base_path} cannot be "
                          f"loaded ({str(e).strip().splitlines()[0]}); pass --base PATH_OR_HUB_ID of the model it "
                          "was trained on") from None
    adapter = lora_keys(checkpoint_state_dict(ckpt, None))
    not_lora = [k for k in adapter if "lora_" not in k and not (reward and ".score." in f".{k}")]
    if not adapter or not_lora:
        raise ExportError(f"{ckpt} is marked lora=true but holds {not_lora[:3] or 'no tensors'} besides/instead of "
                          "LoRA weights; is it damaged?")
    lora = dataclasses.replace(Recipe(), lora=True, lora_r=recipe["lora_r"], lora_alpha=recipe["lora_alpha"],
                               lora_dropout=recipe["lora_dropout"],
                               lora_target_modules=tuple(recipe.get("lora_target_modules") or ()))
    try:
        model = add_lora(base_model, lora)
        result = set_peft_model_state_dict(model, adapter)
    except (RecipeError, RuntimeError) as e:  # another base: other module names or shapes
        raise ExportError(f"the adapter in {ckpt} does not fit the base {base_path}: "
                          f"{str(e).strip().splitlines()[0]}; pass --base with the model it was trained on") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ExportError(f"the adapter in {ckpt} does not fit the base {base_path}: missing {missing[:3]}, "
                          f"unexpected {list(result.unexpected_keys)[:3]}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt / HF_DIR)
    generation_config = checkpoint_generation_config(ckpt / HF_DIR, getattr(base_model, "generation_config", None),
                                                     recipe, tokenizer)
    probe = torch.randint(0, base_model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=probe).logits

    info = {"checkpoint": str(ckpt), "step": manifest["step"], "world_size": manifest["world_size"],
            "out_dir": str(out_dir), "base": str(base_path), "lora": True, "merged": merge,
            "adapter_parameters": sum(v.numel() for v in adapter.values()), "probe_max_abs_diff": 0.0}
    with staging(out_dir, "adapter.tmp" if merge else "tmp") as adapter_tmp:
        model.save_pretrained(adapter_tmp, safe_serialization=True)
        tokenizer.save_pretrained(adapter_tmp)
        generation_config.save_pretrained(adapter_tmp)
        write_run_recipe(ckpt, adapter_tmp)
        reloaded = PeftModel.from_pretrained(model.unload(), adapter_tmp).eval()  # the base again, adapter from disk
        with torch.no_grad():
            got = reloaded(input_ids=probe).logits
        if not torch.equal(want, got):
            raise ExportError(f"the exported adapter's logits differ from the checkpoint's by up to "
                              f"{float((want - got).abs().max()):.3g}; nothing was written")
        if not merge:
            publish(adapter_tmp, out_dir)
            return info | {"dtype": "float32"}
    return info | export_merged(reloaded.merge_and_unload(), ckpt, out_dir, recipe, tokenizer, generation_config,
                                base_model.config, probe, want, max_shard_size)


def export_merged(merged, ckpt: Path, out_dir: Path, recipe: dict, tokenizer, generation_config, config, probe,
                  want, max_shard_size: str) -> dict:
    """export_lora --merge: base + adapter as one plain model, written, reloaded and compared with its own
    logits (exactly) and with the adapter's (within float tolerance), then published."""
    import torch

    if recipe.get("mixed_precision") == "bf16":  # as final_merged/ of a bf16 run
        merged = merged.to(torch.bfloat16)
    merged.generation_config = generation_config
    with staging(out_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _plain_architecture(tmp / "config.json")
        write_run_recipe(ckpt, tmp)
        with torch.no_grad():
            merged_logits = merged(input_ids=probe).logits
            del merged
            again = model_class(config).from_pretrained(tmp, dtype=merged_logits.dtype).eval()
            reread = again(input_ids=probe).logits
        deviation = float((merged_logits.float() - want).abs().max())
        tolerance = 1e-4 if merged_logits.dtype == torch.float32 else 0.1  # W + BA is not W x + B(A x) bit for bit
        if not torch.equal(merged_logits, reread) or not deviation <= tolerance * (1 + float(want.abs().max())):
            raise ExportError(f"the merged model's logits differ from its reload or from base + adapter (by up to "
                              f"{deviation:.3g}); nothing was written")
        publish(tmp, out_dir)
    return {"dtype": str(merged_logits.dtype).replace("torch.", ""), "probe_max_abs_diff": deviation,
            "parameters": sum(p.numel() for p in again.parameters())}
