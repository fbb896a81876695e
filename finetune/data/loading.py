"""Loading: a source -> a tokenized (and packed) datasets.Dataset, cached by fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from finetune.assets import resolve_dataset
from finetune.data.formats import (DataError, FORMAT_FIELDS, IGNORE, PIPELINE_VERSION, check_roles, check_row,
                                   detect_format)
from finetune.data.preference import IDENTICAL, PREFERENCE_VERSION, encode_pairs
from finetune.data.unpaired import UNPAIRED_VERSION, encode_unpaired
from finetune.data.prompts import PROMPT_VERSION, encode_prompts
from finetune.data.sources import (check_columns, first_row_of, is_saved_dataset, local_splits, map_row, need_fields,
                                   need_split, saved_splits, top_level_columns, with_sharegpt)
from finetune.data.tokenization import encode_batch, pack_rows
from finetune.recipe import DataSource, Recipe, looks_local


def load_source(spec: DataSource, key: str = "dataset", split_key: str = "dataset_split"):
    """One source's rows of its split: a local file or directory (split by file names), a save_to_disk
    folder, or a hub dataset (with its config and revision)."""
    import datasets

    source = resolve_dataset(spec.path)
    try:
        if looks_local(source):
            path = Path(source).expanduser()
            if is_saved_dataset(path):
                need_split(split_key, spec.path, spec.split, saved_splits(path))
                saved = datasets.load_from_disk(str(path))
                return saved[spec.split] if isinstance(saved, datasets.DatasetDict) else saved
            splits = local_splits(path)
            need_split(split_key, spec.path, spec.split, list(splits))
            files = [str(p) for p in splits[spec.split]]
            suffix = Path(files[0]).suffix.lower().lstrip(".")
            builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[suffix]
            return datasets.load_dataset(builder, data_files=files, split="train")
        return datasets.load_dataset(source, name=spec.config or None, revision=spec.revision or None,
                                     split=spec.split)
    except DataError:
        raise
    except Exception as e:  # network, missing split, unreadable file: all the user's to fix
        raise DataError(f"could not load dataset {source!r} (split {spec.split!r}"
                        f"{', config ' + repr(spec.config) if spec.config else ''}): {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None


def cache_fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
    return cache_fingerprint(body, getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token)


ROWS_PER_PROCESS = 20_000  # num_proc=0: one tokenizing process per this many rows (a process costs ~1 s to start)


def num_processes(recipe: Recipe, rows: int) -> int | None:
    import os

    n = recipe.num_proc or min(8, os.cpu_count() or 1, rows // ROWS_PER_PROCESS)
    n = min(n, rows)
    return n if n > 1 else None


COUNTS = ["n_tokens", "n_targets"]  # per-row columns kept while sources are mixed, dropped before training


class RowNames:
    """How an error in tokenizing names a row: by its file and line where the source is local JSON lines
    (a prompt row's error comes after the eval split, whose row numbers are no one's), else as row N of
    the source as loaded (before the split). Files are read only when a row is named."""

    def __init__(self, where: str, original=None, files=()):
        self.where = where
        self.original = original  # each row's index in the source (numpy), None: the rows are the source's
        self.files = [str(f) for f in files]  # the source's files, in its rows' order

    @classmethod
    def of(cls, ds, where: str, spec: DataSource | None = None) -> RowNames:
        """ds: the source's rows as loaded, or a split of them (an indices mapping into them)."""
        original = ds._indices.column(0).to_numpy() if getattr(ds, "_indices", None) is not None else None
        files = []
        if spec is not None and looks_local(spec.path) and not spec.path.startswith("builtin:"):
            path = Path(spec.path).expanduser()
            if not is_saved_dataset(path):
                files = local_splits(path).get(spec.split, [])
        return cls(where, original, files)

    def __call__(self, index: int) -> str:
        row = int(self.original[index]) if self.original is not None else index
        for f in self.files:
            if not f.lower().endswith((".jsonl", ".json")):
                break  # rows of other files are not counted here
            text = Path(f).read_text(encoding="utf-8", errors="replace")
            if f.lower().endswith(".json") and text.lstrip().startswith("["):
                break
            lines = [n for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            if row < len(lines):
                return f"{f} line {lines[row]}"
            row -= len(lines)
        return f"{self.where} row {int(self.original[index]) if self.original is not None else index}"


def tokenize_dataset(ds, fmt: str, tokenizer, recipe: Recipe, where: str, *, spec: DataSource | None = None,
                     pack: bool | None = None, keep_counts: bool = False, dropped: dict | None = None,
                     row_names: RowNames | None = None):
    """Map columns, format, tokenize (a batch of rows per tokenizer call, in num_proc processes), drop
    examples with no target token (and preference pairs whose sides are identical once cut), and pack;
    cached by content fingerprint. keep_counts: keep each row's n_tokens and n_targets (for mixing and
    the summary; never with packing). dropped: a dict given here gets the rows dropped, by reason
    ("no_target", "identical")."""
    if len(ds) == 0:
        raise DataError(f"{where}: the dataset is empty")
    spec = spec or DataSource(path=where)
    if fmt in ("auto", "messages"):
        spec = with_sharegpt(spec, ds.column_names, first_row_of(ds))
    names = check_columns(ds.column_names, spec, where)
    if fmt == "auto":
        fmt = detect_format(names, where)
    need_fields(names, fmt, where)
    if fmt == "prompt":
        return tokenize_prompts(ds, tokenizer, recipe, where, spec, row_names or RowNames(where))
    optional = {"alpaca": {"input"}, "preference": {"prompt"}}.get(fmt, set())
    needed = set(FORMAT_FIELDS[fmt]) | optional
    used = [c for c in ds.column_names if c in {top_level_columns(spec.columns).get(f, f) for f in needed}]
    tok_fp = tokenizer_fingerprint(tokenizer)
    max_len, train_on_prompt = recipe.max_seq_len, recipe.train_on_prompt
    procs = num_processes(recipe, len(ds))

    def encode(batch, indices):
        rows = [map_row({k: batch[k][i] for k in batch}, spec, f"{where} row {index}")
                for i, index in enumerate(indices)]
        if fmt == "messages":
            for row, index in zip(rows, indices):
                check_roles(row["messages"] or [], f"{where} row {index}")
        if fmt == "preference":  # a hub dataset's rows are first seen here (local files: prevalidate)
            for row, index in zip(rows, indices):
                check_row(row, fmt, f"{where} row {index}")
            return encode_pairs(rows, tokenizer, max_len, recipe.max_prompt_len)
        if fmt == "unpaired":
            for row, index in zip(rows, indices):
                check_row(row, fmt, f"{where} row {index}")
            return encode_unpaired(rows, tokenizer, max_len, recipe.max_prompt_len)
        out = {"input_ids": [], "labels": [], "n_tokens": [], "n_targets": []}
        for ids, labels in encode_batch(rows, fmt, tokenizer, train_on_prompt, max_len):
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["n_tokens"].append(len(ids))
            out["n_targets"].append(sum(1 for x in labels[1:] if x != IGNORE))
        return out

    # a preference pair also depends on max_prompt_len; SFT rows keep the fingerprints they had
    pairs = (PREFERENCE_VERSION, recipe.max_prompt_len) if fmt == "preference" else \
        (UNPAIRED_VERSION, recipe.max_prompt_len) if fmt == "unpaired" else ()
    fp = cache_fingerprint(PIPELINE_VERSION, ds._fingerprint, fmt, tok_fp, max_len, train_on_prompt, spec.columns,
                      spec.roles, *pairs)
    ds = ds.select_columns(used) if len(used) < len(ds.column_names) else ds
    ds = ds.map(encode, batched=True, with_indices=True, remove_columns=used, new_fingerprint=fp, num_proc=procs,
                desc=f"tokenize {where}")
    rows = len(ds)
    identical = count_identical(ds) if fmt == "preference" else 0
    ds = ds.filter(lambda n: [x > 0 for x in n], input_columns="n_targets", batched=True, num_proc=procs,
                   new_fingerprint=cache_fingerprint(fp, "filter"), desc="drop rows without targets")
    if dropped is not None:
        dropped |= {"no_target": rows - len(ds) - identical, "identical": identical}
    if len(ds) == 0 and identical:
        raise DataError(f"{where}: no pair left: {identical} of {rows} have chosen and rejected identical within "
                        f"max_seq_len={max_len}{budget_note(recipe)} (they differ only after it), the others no "
                        "response token on both sides; raise max_seq_len")
    if len(ds) == 0 and fmt == "preference":
        fix = "lower max_prompt_len" if recipe.max_prompt_len else \
            "set max_prompt_len below it (a long prompt then loses its start)"
        raise DataError(f"{where}: no pair has a response token left on both sides within max_seq_len={max_len}"
                        f"{budget_note(recipe)}; raise max_seq_len, or {fix}")
    if len(ds) == 0:
        raise DataError(f"{where}: no example has a response token left within max_seq_len={max_len}; "
                        "raise max_seq_len or set train_on_prompt=true")
    if recipe.packing if pack is None else pack:
        return pack_dataset(ds, tokenizer, recipe, where)
    return ds if keep_counts else ds.remove_columns(COUNTS)


def count_identical(ds) -> int:
    """Prepared pairs marked IDENTICAL (their sides the same tokens once cut), read from the Arrow column."""
    import pyarrow.compute as pc

    return int(pc.sum(pc.equal(ds.data.column("n_targets"), IDENTICAL)).as_py() or 0)


def tokenize_prompts(ds, tokenizer, recipe: Recipe, where: str, spec: DataSource, row_names: RowNames):
    """Prompt rows (objective=grpo, finetune/data/prompts.py): each row's prompt (mapped by spec.columns)
    checked and tokenized into prompt_input_ids and n_tokens; every other column kept for the rewards.
    A bad row is named by row_names (its file line where there is one)."""
    source = top_level_columns(spec.columns).get("prompt", "prompt")
    room = max(recipe.max_seq_len - recipe.max_completion_len, 1)
    tools = tool_schemas(recipe)

    def encode(batch, indices):
        rows = [map_row({k: batch[k][i] for k in batch}, spec, f"{where} row {index}")
                for i, index in enumerate(indices)]
        for row, index in zip(rows, indices):
            try:
                check_row(row, "prompt", f"{where} row {index}")
            except DataError:
                check_row(row, "prompt", row_names(index))  # the same error, the row named where it is
        names = _Named(row_names, indices)
        out = encode_prompts(rows, tokenizer, max_prompt_len=recipe.max_prompt_len, room=room, where=names,
                             tools=tools)
        return {"prompt": [r["prompt"] for r in rows], **out}

    fp = cache_fingerprint(PIPELINE_VERSION, PROMPT_VERSION, ds._fingerprint, tokenizer_fingerprint(tokenizer),
                           recipe.max_prompt_len, room, spec.columns, spec.roles, *([tools] if tools else []))
    return ds.map(encode, batched=True, with_indices=True, remove_columns=[source], new_fingerprint=fp,
                  num_proc=num_processes(recipe, len(ds)), desc=f"tokenize prompts {where}")


def tool_schemas(recipe: Recipe) -> list[dict] | None:
    """The JSON schemas of a multi-turn rollout's tools (finetune/tools.py), which every prompt shows; None
    without tools."""
    if not getattr(recipe, "tools", ()) and not getattr(recipe, "environment_factory", None):
        return None
    from finetune.tools import Toolbox

    return Toolbox.from_recipe(recipe).schemas


class _Named:
    """A batch's row names, made when one is asked for (an error)."""

    def __init__(self, row_names: RowNames, indices):
        self.row_names, self.indices = row_names, indices

    def __getitem__(self, k: int) -> str:
        return self.row_names(self.indices[k])

    def __len__(self) -> int:
        return len(self.indices)


def budget_note(recipe: Recipe) -> str:
    return f" and max_prompt_len={recipe.max_prompt_len}" if recipe.max_prompt_len else ""


def pack_dataset(ds, tokenizer, recipe: Recipe, where: str):
    """pack_rows over the dataset, 1000 examples at a time, in one process (a batch's boundaries decide
    which rows share a row, so they must not depend on num_proc)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ds = ds.remove_columns([c for c in COUNTS if c in ds.column_names])
    return ds.map(lambda b: pack_rows(b["input_ids"], b["labels"], recipe.max_seq_len, pad), batched=True,
                  batch_size=1000, new_fingerprint=cache_fingerprint(ds._fingerprint, "pack", "best-fit decreasing",
                                                                recipe.max_seq_len, pad), desc=f"pack {where}")
