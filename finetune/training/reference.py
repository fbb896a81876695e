"""The reference a preference loss (finetune/training/objectives/dpo.py) compares the policy with: the model as
training started. Three ways to have it, chosen by the recipe (recipe.reference_kind), set up by the
DPO objective (its before_model and after_prepare):

- LoRA / QLoRA: the policy itself with its adapter switched off (the frozen base): no second copy.
- full fine-tune: a frozen copy of the starting weights, placed by the strategy (Strategy.wrap_reference:
  FSDP2 shards it on the policy's mesh, ZeRO-3 partitions it, ddp/zero1/zero2 hold it whole on each
  rank). It is never written to checkpoints: a resume reads it from the model again.
- precompute_reference=true: one pass over the train and eval pairs before the first step, with the
  policy as it starts (which is the reference), writes each pair's reference log-probs to a file keyed
  by the model's identity (its weights' content or hub revision, finetune/checkpointing/identity.py), the tokenizer
  and the prepared data; the pairs then carry them (columns ref_chosen_logps, ref_rejected_logps) and
  training holds no reference. Any later run on the same model and data reads the file; a resume reads
  the very file its run started with, named with its sha256 in every checkpoint's manifest (and in
  recipe.json). Every read checks the file: whole, of these pairs, of this model (or of that sha256).
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
from finetune.loss import token_logps
from finetune.recipe import RecipeError, reference_kind

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
FORMAT = "finetune reference log-probs 2"


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

    def token_logps(self, model, batch: dict, temperature: float = 1.0, head_dtype=None) -> torch.Tensor:
        """Per target token, laid out as the labels, of the logits / temperature (GRPO's KL term:
        loss.token_logps at the policy's sampling temperature, its output layer in head_dtype)."""
        with torch.no_grad(), _peft_model(model).disable_adapter():
            return token_logps(model, batch, self.impl, self.chunk, temperature, head_dtype)


class Frozen:
    """A frozen copy of the starting weights under the run's strategy."""
    kind = "a frozen copy"

    def __init__(self, model, accelerator, recipe):
        self.model, self.accelerator = model, accelerator
        self.impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None

    def logps(self, policy, batch: dict) -> torch.Tensor:
        with torch.no_grad(), self.accelerator.autocast():
            return SP.row_logps(self.model, batch, self.impl, self.chunk)[0]

    def token_logps(self, policy, batch: dict, temperature: float = 1.0, head_dtype=None) -> torch.Tensor:
        """Per target token, laid out as the labels, of the logits / temperature (GRPO's KL term:
        loss.token_logps at the policy's sampling temperature, its output layer in head_dtype)."""
        with torch.no_grad(), self.accelerator.autocast():
            return token_logps(self.model, batch, self.impl, self.chunk, temperature, head_dtype)


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
    kind = reference_kind(r)
    if kind is None:
        return None
    if kind == "precomputed":
        return Precomputed()
    if kind == "adapter":
        return AdapterDisabled(r)
    plain = dataclasses.replace(r, activation_checkpointing=False, compile=False)
    model = load_model(plain, model_path, config, weights_on_this_rank, dtype=compute_dtype(r))
    model.requires_grad_(False)
    model.eval()
    return Frozen(plan.strategy.wrap_reference(accelerator, model), accelerator, r)


# ---------------------------------------------------------------- precomputed log-probs


def precompute_key(recipe, datasets, identity: dict, tokenizer) -> dict:
    """What the log-probs are of: the prepared pairs (and the tokenizer that made them), and the model that
    scored them (its weights' identity, finetune/checkpointing/identity.py, and how it computed)."""
    return {"data": cache_fingerprint(datasets.train._fingerprint,
                                      datasets.eval._fingerprint if datasets.eval is not None else None,
                                      tokenizer_fingerprint(tokenizer)),
            "model": cache_fingerprint(identity, recipe.mixed_precision, recipe.attn_implementation, recipe.lora,
                                       recipe.load_in_4bit)}


def precomputed_path(recipe, datasets, key: dict) -> list[Path]:
    """Where a precompute_reference run's log-probs are (the first that exists) or go (the first
    writable): beside the prepared data in the datasets cache, else in the output directory."""
    name = f"reference-logps-{cache_fingerprint(FORMAT, key['data'], key['model'])}.json"
    places = [Path(f["filename"]).parent / name for f in datasets.train.cache_files[:1]]
    return places + [Path(recipe.output_dir) / "reference" / name]


def check_precomputed(recipe, paths: list[Path], saved: dict | None) -> tuple[Path | None, str | None]:
    """The file that holds this run's reference log-probs, if one does, and the sha256 it must have.

    saved: what a resumed checkpoint says of them (resume.reference_record: the file it was trained with
    and its sha256; None on a fresh run). A resume needs that very file: the policy has moved since the
    start, so it can no longer give the reference's values."""
    if saved is None:
        return next((p for p in paths if p.is_file()), None), None
    way_out = "or resume with precompute_reference=false (the reference model is loaded instead)"
    if saved.get("sha256") is None:
        raise RecipeError(f"precompute_reference=true: {saved['why']}; the resumed policy is no longer the "
                          f"reference, so its log-probs cannot be computed now; {way_out}")
    candidates = list(dict.fromkeys([*paths, Path(saved["path"])]))
    present = [p for p in candidates if p.is_file()]
    for path in present:
        if sha256_file(path) == saved["sha256"]:
            return path, saved["sha256"]
    if present:
        raise RecipeError(f"precompute_reference=true: {present[0]} is not the reference log-probs file this run was "
                          f"trained with (its sha256 is {sha256_file(present[0])[:16]}..., the checkpoint recorded "
                          f"{saved['sha256'][:16]}...: rewritten, or of another model or data); restore the file "
                          f"it was{'' if str(present[0]) == saved['path'] else ' (' + saved['path'] + ')'}, {way_out}")
    raise RecipeError(f"precompute_reference=true: the reference log-probs this run was trained with "
                      f"({saved['path']}, sha256 {saved['sha256'][:16]}...) are in none of "
                      f"{', '.join(map(str, candidates))}; restore that file, {way_out}")


def sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def split_passes(datasets, recipe, layout: SP.Layout) -> list[tuple]:
    """What precompute scores: each split's rows once, this data-parallel rank's share of them in micro-batches
    ((name, split, this rank's micro-batches as row lists, kl_max_len 0: the rows' own second halves))."""
    return [(name, ds, D.eval_batches(ds, recipe.micro_batch_size, layout.dp_rank, layout.dp_size), 0)
            for name, ds in (("train", datasets.train), ("eval", datasets.eval)) if ds is not None]


def precompute(accelerator, model, passes: list[tuple], recipe, pad_id: int, paths: list[Path], to_device, key: dict,
               layout: SP.Layout) -> Path:
    """One pass with the policy as it starts (adapter off under LoRA) over each of `passes` (split_passes;
    KTO's also scores its training KL rows as each epoch's micro-batches make them): each data-parallel rank
    scores its micro-batches (under sequence parallelism each rank of its group a slice of every pair, summed
    over the group), each row's two values under the pass's name (None for a row the pass does not score),
    rank 0 writes them all (atomically), every rank waits for the file."""
    reference = AdapterDisabled(recipe) if recipe.lora else None
    values = {}
    model.eval()
    for name, ds, batches, kl_max_len in passes:
        mine = {}
        for rows in batches:
            batch = to_device(layout.shard(D.fetch(ds, rows, pad_id, False, kl_max_len=kl_max_len)),
                              accelerator.device)
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
        values[name] = [merged.get(i) for i in range(len(ds))]
    model.train()
    target = None
    if accelerator.is_main_process:
        target = _write(paths, values, key)
    where = [str(target) if target else None]
    torch.distributed.broadcast_object_list(where, src=0)
    return Path(where[0])


def _write(paths: list[Path], values: dict, key: dict) -> Path:
    """The file: a header line (format, key, the body's sha256), then the body (each split's pairs)."""
    import hashlib

    body = json.dumps(values).encode()
    header = json.dumps({"format": FORMAT, "key": key, "body_sha256": hashlib.sha256(body).hexdigest()}).encode()
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(header + b"\n" + body)
            os.replace(tmp, path)
            return path
        except OSError:
            continue
    raise RecipeError(f"precompute_reference=true: could not write the reference log-probs to any of "
                      f"{', '.join(map(str, paths))}; make one of them writable")


def read_precomputed(path: Path, key: dict, sha256: str | None = None) -> tuple[dict, str]:
    """The file's log-probs and its sha256, read once and checked: whole (its body's sha256), of these
    pairs (the key's data part), and of this model (the key's model part) unless `sha256` is given (a
    resume: the checkpoint names the very file its run started with, whatever `model=` holds now)."""
    import hashlib

    fix = ("restore the file the run started with, or resume with precompute_reference=false" if sha256 else
           "delete it to compute them again")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the reference log-probs ({e.strerror or e}); {fix}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256:
        raise RecipeError(f"{path}: the reference log-probs file changed since this run started (sha256 "
                          f"{digest[:16]}..., the checkpoint recorded {sha256[:16]}...); {fix}")
    first, _, body = raw.partition(b"\n")
    try:
        header = json.loads(first)
        damaged = (not isinstance(header, dict) or header.get("format") != FORMAT or
                   header.get("body_sha256") != hashlib.sha256(body).hexdigest())
        values = None if damaged else json.loads(body)
    except ValueError:
        damaged = True
    if damaged or not isinstance(values, dict):
        raise RecipeError(f"{path}: is not a whole reference log-probs file of this finetune (truncated, garbled "
                          f"or of another version); {fix}")
    saved = header.get("key") or {}
    if saved.get("data") != key["data"]:
        raise RecipeError(f"{path}: holds the reference log-probs of other pairs (another dataset, tokenizer or "
                          "data setting); " + ("the resumed run's data differ from those its run started with: "
                                               "resume with those, or with precompute_reference=false" if sha256
                                               else fix))
    if sha256 is None and saved.get("model") != key["model"]:
        raise RecipeError(f"{path}: holds the reference log-probs of another model (or precision, attention or "
                          f"quantization); {fix}")
    return values, digest


def attach(datasets, path: Path, values: dict, splits: tuple[str, ...] = ("train", "eval")):
    """The splits' pairs with their reference log-probs (read from `path`) as two columns."""
    for split in splits:
        ds = getattr(datasets, split)
        if ds is None:
            continue
        pairs = values.get(split) or []
        if len(pairs) != len(ds) or None in pairs:
            raise RecipeError(f"{path}: holds {len(pairs)} {split} pairs' reference log-probs for {len(ds)} pairs; "
                              "delete it to compute them again")
        ds = ds.add_column(COLUMNS[0], [float(c) for c, _ in pairs])
        setattr(datasets, split, ds.add_column(COLUMNS[1], [float(r) for _, r in pairs]))
    return datasets
