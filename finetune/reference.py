"""The reference a preference loss (finetune/objectives/dpo.py) compares the policy with: the model as
training started. Three ways to have it, chosen by the recipe (build_reference):

- LoRA / QLoRA: the policy itself with its adapter switched off (the frozen base): no second copy.
- full fine-tune: a frozen copy of the starting weights, placed by the strategy (Strategy.wrap_reference:
  FSDP2 shards it on the policy's mesh, ZeRO-3 partitions it, ddp/zero1/zero2 hold it whole on each
  rank). It is never written to checkpoints: a resume reads it from the model again.
- precompute_reference=true: one pass over the train and eval pairs before the first step, with the
  policy as it starts (which is the reference), writes each pair's reference log-probs to a file keyed
  by the model, the tokenizer and the prepared data; the pairs then carry them (columns
  ref_chosen_logps, ref_rejected_logps) and training holds no reference. A resume, and any later run
  on the same model and data, reads the file.
SimPO needs none. Under sequence parallelism each runs on the rank's slice of the pairs and its
log-probs are summed over the SP group (sequence_parallel.row_logps), as the policy's are."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.data.loading import cache_fingerprint, tokenizer_fingerprint
from finetune.recipe import RecipeError

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _peft_model(model):
    """The peft model under the DDP / DeepSpeed wrappers (it has disable_adapter)."""
    while not hasattr(model, "disable_adapter") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


class AdapterDisabled:
    """LoRA: the reference is the policy with its adapter off."""
    kind = "the policy with its adapter disabled"

    def __init__(self, recipe):
        self.impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None

    def logps(self, model, batch: dict) -> torch.Tensor:
        with torch.no_grad(), _peft_model(model).disable_adapter():
            return SP.row_logps(model, batch, self.impl, self.chunk)[0]


class Frozen:
    """A frozen copy of the starting weights under the run's strategy."""
    kind = "a frozen copy"

    def __init__(self, model, accelerator, recipe):
        self.model, self.accelerator = model, accelerator
        self.impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None

    def logps(self, policy, batch: dict) -> torch.Tensor:
        with torch.no_grad(), self.accelerator.autocast():
            return SP.row_logps(self.model, batch, self.impl, self.chunk)[0]


class Precomputed:
    """The reference's log-probs, carried by the pairs (written before training by precompute)."""
    kind = "precomputed"

    def logps(self, policy, batch: dict) -> torch.Tensor:
        return batch["ref_logps"]


def compute_dtype(recipe) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.mixed_precision, torch.float32)


def build_reference(plan, accelerator, model_path: str, config, weights_on_this_rank: bool):
    """The recipe's reference (None: SFT, SimPO). A full fine-tune's frozen copy is loaded here, in the
    compute dtype, and placed by the strategy."""
    from finetune.model import load_model

    r = plan.recipe
    if r.objective != "dpo" or r.dpo_loss == "simpo":
        return None
    if r.precompute_reference:
        return Precomputed()
    if r.lora:
        return AdapterDisabled(r)
    plain = dataclasses.replace(r, activation_checkpointing=False, compile=False)
    model = load_model(plain, model_path, config, weights_on_this_rank, dtype=compute_dtype(r))
    model.requires_grad_(False)
    model.eval()
    return Frozen(plan.strategy.wrap_reference(accelerator, model), accelerator, r)


# ---------------------------------------------------------------- precomputed log-probs


def _model_fingerprint(model_path: str) -> str:
    """The model's files by name, size and modification time (reading 100 GB of weights to hash them
    would cost more than the pass it saves)."""
    path = Path(model_path)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in path.iterdir()
                   if p.is_file()) if path.is_dir() else []
    return cache_fingerprint(str(path.resolve()) if path.exists() else model_path, files)


def precomputed_path(recipe, datasets, model_path: str, tokenizer) -> list[Path]:
    """Where a precompute_reference run's log-probs are (the first that exists) or go (the first
    writable): beside the prepared data in the datasets cache, else in the output directory."""
    key = cache_fingerprint("reference-logps-1", datasets.train._fingerprint,
                            datasets.eval._fingerprint if datasets.eval is not None else None,
                            _model_fingerprint(model_path), tokenizer_fingerprint(tokenizer), recipe.mixed_precision,
                            recipe.attn_implementation, recipe.lora, recipe.load_in_4bit)
    name = f"reference-logps-{key}.json"
    places = [Path(f["filename"]).parent / name for f in datasets.train.cache_files[:1]]
    return places + [Path(recipe.output_dir) / "reference" / name]


def check_precomputed(recipe, paths: list[Path], resuming: bool) -> Path | None:
    """The file that holds this run's reference log-probs, if one does. A resume needs it: the policy
    has moved since the start, so it can no longer give the reference's values."""
    found = next((p for p in paths if p.is_file()), None)
    if found is None and resuming:
        raise RecipeError(f"precompute_reference=true: the reference log-probs computed when this run started are "
                          f"gone (looked in {', '.join(map(str, paths))}), and the resumed policy is no longer the "
                          "reference; restore that file, or resume with precompute_reference=false (a reference "
                          "model is loaded instead)")
    return found


def precompute(accelerator, model, datasets, recipe, pad_id: int, paths: list[Path], to_device,
               layout: SP.Layout) -> Path:
    """One pass over the train and eval pairs with the policy as it starts (adapter off under LoRA):
    each data-parallel rank scores its share (under sequence parallelism each rank of its group a slice
    of every pair, summed over the group), rank 0 writes them all (atomically), every rank waits for
    the file."""
    reference = AdapterDisabled(recipe) if recipe.lora else None
    values = {}
    model.eval()
    for split, ds in (("train", datasets.train), ("eval", datasets.eval)):
        if ds is None:
            continue
        mine = {}
        for rows in D.eval_batches(ds, recipe.micro_batch_size, layout.dp_rank, layout.dp_size):
            batch = to_device(layout.shard(D.fetch(ds, rows, pad_id, False)), accelerator.device)
            if reference is not None:
                sums = reference.logps(model, batch)
            else:
                with torch.no_grad():
                    sums = SP.row_logps(model, batch, recipe.loss_impl, recipe.loss_chunk_tokens or None)[0]
            sums = sums.float().cpu().tolist()
            n = len(sums) // 2  # chosen first (a sequence-parallel shard's sides are padded to micro_batch_size)
            for j, row in enumerate(rows):
                if row >= 0:
                    mine[row] = (sums[j], sums[n + j])
        gathered = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(gathered, mine)
        merged = {k: v for part in gathered for k, v in part.items()}
        values[split] = [merged[i] for i in range(len(ds))]
    model.train()
    target = None
    if accelerator.is_main_process:
        target = _write(paths, values)
    where = [str(target) if target else None]
    torch.distributed.broadcast_object_list(where, src=0)
    return Path(where[0])


def _write(paths: list[Path], values: dict) -> Path:
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(values))
            os.replace(tmp, path)
            return path
        except OSError:
            continue
    raise RecipeError(f"precompute_reference=true: could not write the reference log-probs to any of "
                      f"{', '.join(map(str, paths))}; make one of them writable")


def attach(datasets, path: Path):
    """The train and eval pairs with their reference log-probs as two columns."""
    values = json.loads(path.read_text())
    for split in ("train", "eval"):
        ds = getattr(datasets, split)
        if ds is None:
            continue
        pairs = values.get(split) or []
        if len(pairs) != len(ds):
            raise RecipeError(f"{path}: holds {len(pairs)} {split} pairs' reference log-probs for {len(ds)} pairs; "
                              "delete it to compute them again")
        ds = ds.add_column(COLUMNS[0], [float(c) for c, _ in pairs])
        setattr(datasets, split, ds.add_column(COLUMNS[1], [float(r) for _, r in pairs]))
    return datasets
