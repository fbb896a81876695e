"""Datasets -> formatted, tokenized, masked (and optionally packed) rows -> per-rank micro-batches.

Which rows global step N consumes on which rank is a pure function of (seed, N, world size,
micro batch, accumulation): `BatchSchedule` answers it without reading the data before N, which is
what makes resume O(1). The global batch at step N is the same set of rows whatever its split into
processes and accumulation steps, so runs on different world sizes see identical batches.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from finetune.assets import resolve_dataset
from finetune.recipe import DATA_EXTENSIONS, ROLES, DataSource, Recipe, RecipeError, looks_local

IGNORE = -100
FORMAT_FIELDS = {
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "text": ("text",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PIPELINE_VERSION = "4"  # bump when tokenization/packing output changes, to invalidate caches


class DataError(RecipeError):
    """Bad dataset content: reported like any recipe error, one line naming file and row."""


# ---------------------------------------------------------------- formats


def detect_format(columns, where: str) -> str:
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    raise DataError(
        f"{where}: cannot tell the dataset format from its fields {sorted(cols)}; expected messages, "
        "instruction+output (alpaca), prompt+completion, or text; or set dataset_format=..."
    )


def _sharegpt_hint(fields) -> str:
    """What to set when rows that hold ShareGPT conversations are read as another format."""
    if "conversations" in fields and "messages" not in fields:
        return ("; these rows hold ShareGPT conversations: set dataset_format=messages (or auto; format='messages' "
                "on a DataSource), which reads conversations of {from, value} as messages")
    return ""


def unknown_role(where: str, index: int, role) -> DataError:
    return DataError(f"{where}: message {index} has role {role!r}, which is none of {', '.join(ROLES)}; map it with "
                     f"roles={{{role!r}: 'assistant'}} (or user, system, tool) on the source's DataSource in the "
                     "recipe file (datasets=[DataSource(path=..., roles={...})])")


def check_roles(messages: list, where: str) -> None:
    """Every message's role is one the chat templates know: a role they do not (ShareGPT's `bot`, a
    typo) would be rendered as a turn nobody trains, or make the template fail later."""
    for j, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in ROLES:
            raise unknown_role(where, j, role)


def check_row(row, fmt: str, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in FORMAT_FIELDS[fmt]:
        if name not in row or row[name] is None:
            raise DataError(f"{where}: missing field {name!r} (dataset_format={fmt} needs "
                            f"{', '.join(FORMAT_FIELDS[fmt])}){_sharegpt_hint(row)}")
    if fmt == "messages":
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: each message needs string 'role' and 'content', got {m!r:.80}")
        check_roles(msgs, where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message to learn from")
    else:
        for name in FORMAT_FIELDS[fmt]:
            if not isinstance(row[name], str):
                raise DataError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")


# ---------------------------------------------------------------- sources, splits and column mapping

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
SHAREGPT_COLUMNS = {"messages": "conversations", "role": "from", "content": "value"}


def with_sharegpt(spec: DataSource, fields, first_row=None) -> DataSource:
    """The source as it is read: rows with a `conversations` field and no `messages` (ShareGPT's
    layout) are read as messages when the source maps no columns and its format is auto or messages:
    each turn's `from`/`value` (or `role`/`content`, as the first turn has them) become role/content,
    with human/gpt/system as user/assistant/system (SHAREGPT_ROLES; others go in roles=...)."""
    fields = set(fields)
    if spec.columns or spec.format not in ("auto", "messages") or "messages" in fields or "conversations" not in fields:
        return spec
    turns = first_row.get("conversations") if isinstance(first_row, dict) else None
    first = turns[0] if isinstance(turns, list) and turns else None
    if isinstance(first, dict) and "from" not in first and "role" in first:
        return replace(spec, columns={"messages": "conversations"})
    return replace(spec, columns=dict(SHAREGPT_COLUMNS))


def _first_row(ds):
    """A datasets.Dataset's first row (one row read from its Arrow table), or None when it is empty."""
    return ds[0] if len(ds) else None


def train_sources(recipe: Recipe) -> list[tuple[str, str, DataSource]]:
    """(key, split key, source) of each training source: the mixture's, or the single `dataset`."""
    if recipe.datasets:
        return [(f"datasets[{i}].path", f"datasets[{i}].split", s) for i, s in enumerate(recipe.datasets)]
    return [("dataset", "dataset_split",
             DataSource(path=recipe.dataset, format=recipe.dataset_format, split=recipe.dataset_split))]


def eval_source(recipe: Recipe) -> tuple[str, str, DataSource] | None:
    """The eval set named by the recipe: eval_dataset (a DataSource, or a path/hub id read with
    eval_split, else dataset_split), or dataset's own eval_split; None: hold out eval_fraction."""
    e = recipe.eval_dataset
    if isinstance(e, DataSource):
        return "eval_dataset.path", "eval_dataset.split", e
    if e:
        return ("eval_dataset", "eval_split" if recipe.eval_split else "dataset_split",
                DataSource(path=e, format="auto" if recipe.datasets else recipe.dataset_format,
                           split=recipe.eval_split or recipe.dataset_split))
    if recipe.eval_split and not recipe.datasets:
        return "dataset", "eval_split", DataSource(path=recipe.dataset, format=recipe.dataset_format,
                                                   split=recipe.eval_split)
    return None


def _top(columns: dict) -> dict:
    """The mapping of top-level fields (role and content name fields inside each message)."""
    return {k: v for k, v in columns.items() if k not in ("role", "content")}


def check_columns(fields, spec: DataSource, where: str) -> list[str]:
    """The field names the format sees once spec.columns is applied; names a mapped field the data lacks."""
    fields = list(fields)
    for target, name in _top(spec.columns).items():
        if name not in fields:
            raise DataError(f"{where}: columns maps {target} to {name!r}, but the rows have no field {name!r} "
                            f"(their fields: {', '.join(sorted(fields)) or 'none'})")
    return sorted(set(fields) | set(_top(spec.columns)))


def _maps_messages(spec: DataSource) -> bool:
    return bool(spec.roles) or bool({"messages", "role", "content"} & set(spec.columns))


def map_row(row: dict, spec: DataSource, where: str) -> dict:
    """A row as its format expects it: spec.columns applied (ShareGPT's conversations of from/value with
    human/gpt become messages of role/content with user/assistant)."""
    if not spec.columns and not spec.roles:
        return row
    out = dict(row)
    for target, name in _top(spec.columns).items():
        if row.get(name) is None:  # absent from a JSON row; null in an Arrow one whose other rows have it
            fields = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
            raise DataError(f"{where}: columns maps {target} to {name!r}, but the row has no field {name!r} "
                            f"(its fields: {fields})")
        out[target] = row[name]
    messages = out.get("messages")
    if isinstance(messages, list) and _maps_messages(spec):
        role_key, content_key = spec.columns.get("role", "role"), spec.columns.get("content", "content")
        roles = {**SHAREGPT_ROLES, **spec.roles}
        mapped = []
        for j, m in enumerate(messages):
            for name, what in ((role_key, "role"), (content_key, "content")):
                if not isinstance(m, dict) or m.get(name) is None:
                    have = ", ".join(sorted(k for k, v in m.items() if v is not None)) if isinstance(m, dict) \
                        else type(m).__name__
                    raise DataError(f"{where}: message {j} has no field {name!r} (the {what}; columns maps {what} "
                                    f"to {name!r}); its fields: {have}")
            role = roles.get(m[role_key], m[role_key])
            if role not in ROLES:
                raise unknown_role(where, j, m[role_key])
            mapped.append({"role": role, "content": m[content_key]})
        out["messages"] = mapped
    return out


def is_saved_dataset(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def saved_splits(path: Path) -> list[str]:
    if (path / "dataset_dict.json").is_file():
        return list(json.loads((path / "dataset_dict.json").read_text()).get("splits", []))
    return ["train"]


def local_splits(path: Path) -> dict[str, list[Path]]:
    """A local file is split train; a directory's files are split by their names as datasets splits
    them (train.jsonl, test.jsonl, data/validation-0000.parquet), or all are train where no file is
    named after a split."""
    if path.is_file():
        return {"train": [path]}
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(str(path))
    except Exception:  # no recognisable file names: everything is train
        patterns = {}
    if {str(k) for k in patterns} - {"train"}:
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(path))
        splits = {str(name): sorted(Path(f) for f in files if Path(f).suffix.lower() in DATA_EXTENSIONS)
                  for name, files in resolved.items()}
        splits = {k: v for k, v in splits.items() if v}
        if splits:
            return splits
    return {"train": _data_files(path)}


def _need_split(split_key: str, source: str, split: str, available: list[str]) -> None:
    if split not in available:
        raise DataError(f"{split_key}={split}: {source} has no split {split!r}; its splits: "
                        f"{', '.join(available) or 'none'}")


def _need_fields(names, fmt: str, where: str) -> None:
    missing = [c for c in FORMAT_FIELDS[fmt] if c not in names]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing} for dataset_format={fmt}{_sharegpt_hint(names)}")


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS)
    if not files:
        raise DataError(f"{path}: directory holds no {'/'.join(DATA_EXTENSIONS)} files")
    return files


def prevalidate(source: str, fmt: str, key: str = "dataset", *, spec: DataSource | None = None,
                split: str = "train", split_key: str = "dataset_split") -> str:
    """Scan local JSON/JSONL files row by row before anything expensive: names file and line.

    Returns the resolved format. Parquet/CSV are checked by their column names, a save_to_disk folder
    by its features; hub datasets cannot be checked before they are downloaded. `spec` carries the
    source's column mapping, checked against the rows; `split` must be one the source has.
    """
    if not looks_local(source):
        return fmt
    spec = spec or DataSource(path=source, format=fmt, split=split)
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        import datasets

        _need_split(split_key, source, split, saved_splits(path))
        saved = datasets.load_from_disk(str(path))  # memory-mapped: reads the features, not the rows
        saved = saved[split] if isinstance(saved, datasets.DatasetDict) else saved
        spec = with_sharegpt(spec, saved.column_names, _first_row(saved))
        names = check_columns(saved.column_names, spec, str(path))
        fmt = detect_format(names, str(path)) if fmt == "auto" else fmt
        _need_fields(names, fmt, str(path))
        if len(saved) == 0:
            raise DataError(f"{key}={source}: the dataset is empty")
        return fmt
    splits = local_splits(path)
    _need_split(split_key, source, split, list(splits))
    rows_seen = 0
    for path in splits[split]:
        suffix = path.suffix.lower()
        if suffix == ".jsonl" or suffix == ".json":
            text = _utf8(path, path.read_bytes())
            stripped = text.lstrip()
            if suffix == ".json" and stripped.startswith("["):
                try:
                    rows = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}") from None
                numbered = ((f"{path} item {i}", r) for i, r in enumerate(rows))
            else:
                numbered = _jsonl_rows(path, text)
            for where, row in numbered:
                if isinstance(row, dict):
                    if rows_seen == 0:  # the source's first row tells ShareGPT's layout (with_sharegpt)
                        spec = with_sharegpt(spec, row.keys(), row)
                    row = map_row(row, spec, where)
                if fmt == "auto":
                    fmt = detect_format(row.keys() if isinstance(row, dict) else [], where)
                check_row(row, fmt, where)
                rows_seen += 1
        else:
            columns = _columns(path)
            spec = with_sharegpt(spec, columns, _parquet_first_row(path, columns))
            names = check_columns(columns, spec, str(path))
            if fmt == "auto":
                fmt = detect_format(names, str(path))
            missing = [c for c in FORMAT_FIELDS[fmt] if c not in names]
            if missing:
                raise DataError(f"{path}: missing column(s) {missing} for dataset_format={fmt}{_sharegpt_hint(names)}")
            rows_seen += _num_rows(path, [_top(spec.columns).get(c, c) for c in FORMAT_FIELDS[fmt]], fmt)
    if rows_seen == 0:
        raise DataError(f"{key}={source}: the dataset is empty")
    return fmt


def prevalidate_recipe(recipe: Recipe) -> None:
    """prevalidate every source of the recipe: the training source(s) and the eval set."""
    for key, split_key, spec in train_sources(recipe) + ([eval_source(recipe)] if eval_source(recipe) else []):
        if spec.path.startswith("builtin:"):
            _need_split(split_key, spec.path, spec.split, ["train"])
        prevalidate(spec.path, spec.format, key, spec=spec, split=spec.split, split_key=split_key)


def _jsonl_rows(path: Path, text: str):
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
        yield f"{path} line {lineno}", row


def _utf8(path: Path, raw: bytes) -> str:
    """The file's text, or one line saying where it stops being UTF-8 (a Latin-1 export, or not
    text at all) instead of a UnicodeDecodeError traceback."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        what = "binary data, not text" if b"\0" in raw[:8192] else "not UTF-8 text (Latin-1 or Windows-1252?)"
        raise DataError(f"{path} line {line} (byte offset {e.start}, byte 0x{raw[e.start]:02x}): {what}; save it as "
                        "UTF-8 (for example: iconv -f latin1 -t utf-8 FILE > FILE.utf8)") from None


# Cells that datasets' CSV reader (pandas, keep_default_na) turns into None: a required field with
# one of these is missing, and would fail later in tokenization, after the model has loaded.
CSV_MISSING = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                         "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})


def _csv_rows(path: Path):
    import csv
    import io

    return csv.reader(io.StringIO(_utf8(path, path.read_bytes()), newline=""))


def _columns(path: Path) -> list[str]:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return [c.strip() for c in next(_csv_rows(path), [])]


def _parquet_first_row(path: Path, columns: list[str]) -> dict | None:
    """A parquet file's first `conversations` value (what with_sharegpt looks at), read alone."""
    if path.suffix.lower() != ".parquet" or "conversations" not in columns:
        return None
    import pyarrow.parquet as pq

    batch = next(pq.ParquetFile(path).iter_batches(batch_size=1, columns=["conversations"]), None)
    return batch.to_pylist()[0] if batch is not None and batch.num_rows else None


def _num_rows(path: Path, required=(), fmt: str = "") -> int:
    """Rows of a parquet or csv file, after checking that no required field is missing in any row."""
    needs = f"dataset_format={fmt} needs {', '.join(FORMAT_FIELDS[fmt])}" if fmt else "it is required"
    if path.suffix.lower() == ".parquet":
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        flat = [meta.schema.column(i).path for i in range(meta.num_columns)]  # a nested column has no one path
        for name in required:
            stats = [meta.row_group(g).column(flat.index(name)).statistics for g in range(meta.num_row_groups)] \
                if name in flat else [None]
            if all(s is not None and s.has_null_count and s.null_count == 0 for s in stats):
                continue  # the footer says so; no need to read the column
            nulls = pc.is_null(pq.read_table(path, columns=[name]).column(name))
            first = pc.index(nulls, True).as_py()
            if first >= 0:
                raise DataError(f"{path} row {first}: {name!r} is null ({needs})")
        return meta.num_rows
    reader = _csv_rows(path)
    header = [c.strip() for c in next(reader, [])]
    positions = {name: header.index(name) for name in required if name in header}
    rows = 0
    for row in reader:
        if not row:
            continue  # a blank line, which the CSV reader skips too
        rows += 1
        where = f"{path} line {reader.line_num} (row {rows})"
        if len(row) != len(header):
            raise DataError(f"{where}: {len(row)} cells, the header has {len(header)} (a comma inside a cell needs "
                            "\"double quotes\" around the cell)")
        for name, i in positions.items():
            if row[i] in CSV_MISSING:
                shown = "empty" if row[i] == "" else f"{row[i]!r}, which the CSV reader reads as missing"
                raise DataError(f"{where}: column {name!r} is {shown} ({needs}); fill it in or drop the row")
    return rows


# ---------------------------------------------------------------- tokenization
#
# One rule for every format: a row starts the way inference starts it: a prompt_completion/alpaca/text
# row as `tokenizer(prompt)` does (the BOS that the tokenizer adds by itself: Llama, Mistral, Gemma;
# nothing for Qwen or GPT-2), a chat row as `apply_chat_template(messages, tokenize=True)` does (the
# template's BOS if it renders one, else none: serving adds none); texts are tokenized without special
# tokens so that nothing is added twice; a prompt_completion/alpaca/text row ends with one EOS, a chat
# row with the end-of-turn markers its template renders, which are labelled as part of their
# assistant turn. The row's text is its parts joined (prompt + completion; the template's rendering),
# tokenized as one text, so it decodes to exactly that text; a token is trained where it holds a
# character of what the model learns to produce (see _trained_from and _span_labels).


def bos_ids(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before any text by itself (its BOS, or nothing).

    Read from the tokenizer's own behaviour, not from `bos_token`: a sentencepiece Llama/Mistral
    tokenizer adds `<s>`, a Llama-3 tokenizer `<|begin_of_text|>` through its post-processor, GPT-2's
    has a bos_token it never adds, Qwen's has none."""
    plain = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return full[:1] if full and full[0] == tokenizer.bos_token_id else []


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _without_eos(tokenizer, text: str) -> str:
    """A response that already ends with the EOS string gets its EOS from us, once."""
    eos = tokenizer.eos_token
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _trained_from(prompt_ids: list[int], both: list[int]) -> int:
    """Where the completion's tokens start in prompt + completion tokenized together: after the tokens
    it shares with the prompt tokenized alone (TRL's common_prefix_length). Usually that is all of the
    prompt's tokens; where a token merges across the seam (a prompt ending in a space: sentencepiece's
    `▁` and a byte-level BPE's ` ` join the completion's first word, `▁Paris`), the merged token holds
    the completion's first characters and is trained with it."""
    n = 0
    while n < min(len(prompt_ids), len(both)) and prompt_ids[n] == both[n]:
        n += 1
    return n


def _prompt_completion_row(bos, prompt_ids, both, eos, train_on_prompt: bool, max_len: int):
    start = _trained_from(prompt_ids, both)
    prompt, completion = bos + both[:start], both[start:] + eos
    ids = (prompt + completion)[:max_len]
    labels = (prompt if train_on_prompt else [IGNORE] * len(prompt)) + completion
    return ids, labels[:max_len]


def encode_prompt_completion(tokenizer, prompt: str, completion: str, train_on_prompt: bool, max_len: int):
    """BOS + (prompt + completion, tokenized as one text) + EOS; labels on the completion and its EOS.

    As TRL's SFTTrainer does: the row decodes to exactly prompt + completion (the completion
    tokenized alone would start with sentencepiece's word-start `▁`: "Answer: " + "Paris" would read
    "Answer:  Paris"), and the completion starts where the prompt's own tokens stop matching
    (_trained_from)."""
    completion = _without_eos(tokenizer, completion)
    return _prompt_completion_row(bos_ids(tokenizer), text_ids(tokenizer, prompt),
                                  text_ids(tokenizer, prompt + completion), _eos(tokenizer), train_on_prompt, max_len)


def encode_text(tokenizer, text: str, max_len: int):
    ids = (bos_ids(tokenizer) + text_ids(tokenizer, _without_eos(tokenizer, text)) + _eos(tokenizer))[:max_len]
    return ids, list(ids)


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template_failed(tokenizer, error: Exception) -> DataError:
    """A chat template that fails while rendering: raise_exception() and Jinja's own errors
    (TemplateError), and the Python errors of its expressions (a TypeError adding a str to an int,
    a ZeroDivisionError), said as one line naming where the template comes from."""
    where = getattr(tokenizer, "chat_template_source", None) or f"the tokenizer's, {tokenizer.name_or_path}"
    message = str(error).splitlines()[0] if str(error) else ""
    return DataError(f"the chat template ({where}) failed on a conversation ({type(error).__name__}: {message}); "
                     "fix the template (or set the recipe's chat_template to one that renders this data), or the data")


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool, spans: bool = False):
    """The chat template's text (and, with spans=True, its {% generation %} character spans), rendered
    the way `apply_chat_template` renders it, with the tokenizer's special tokens as variables."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=[messages], chat_template=tokenizer.chat_template, return_assistant_tokens_mask=spans,
            add_generation_prompt=generation_prompt, **tokenizer.special_tokens_map)
    except Exception as e:  # a template bug, or one that refuses this conversation (roles, order)
        raise _template_failed(tokenizer, e) from None
    return (texts[0], [tuple(s) for s in indices[0]]) if spans else texts[0]


def _render_many(tokenizer, conversations: list[list[dict]], spans: bool = False):
    """render_chat of many conversations in one call (one template lookup and setup for the batch)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=conversations, chat_template=tokenizer.chat_template, return_assistant_tokens_mask=spans,
            add_generation_prompt=False, **tokenizer.special_tokens_map)
    except Exception as e:
        raise _template_failed(tokenizer, e) from None
    return [(t, [tuple(s) for s in i]) for t, i in zip(texts, indices)] if spans else list(texts)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and, per assistant turn, the characters the model learns to produce there:
    from the end of its generation prompt through its end-of-turn marker, as the turn appears in the
    full rendering.

    A template with {% generation %} blocks says so itself (the spans transformers'
    `return_assistant_tokens_mask` uses). Otherwise a turn is found by rendering the conversation up to
    it with and without the turn: for templates that render prefix by prefix, that is the span. For
    templates that rewrite earlier turns (Qwen3 drops the reasoning of answers before the last user
    message; Mistral's moves the system prompt into the last user message), the turn's own rendering
    is searched in the full one after its generation prompt: whole, or else its longest tail, which
    must still hold the end of the turn's content (the answer and end-of-turn marker that remain once a
    reasoning block is dropped)."""
    if GENERATION_TAG.search(tokenizer.chat_template):
        return render_chat(tokenizer, messages, False, spans=True)
    full = render_chat(tokenizer, messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render_chat(tokenizer, messages[:i], True), render_chat(tokenizer, messages[:i + 1], False)
        if not through.startswith(before):
            raise DataError(f"the chat template renders the conversation before assistant message {i} differently "
                            "once that message is added, so its tokens cannot be located; mark assistant turns with "
                            "{% generation %}...{% endgeneration %} in chat_template, or set train_on_prompt=true")
        if full.startswith(through) and len(before) >= cursor:
            spans.append((len(before), len(through)))
        else:
            without = render_chat(tokenizer, messages[:i], False)
            same = next((k for k, (a, b) in enumerate(zip(before, without)) if a != b), min(len(before), len(without)))
            prompt = before[same:]  # the generation prompt (or its end, where a closing EOS shares its first chars)
            start, limit = cursor, len(full)
            if prompt and full.find(prompt, cursor) >= 0:
                start = full.find(prompt, cursor) + len(prompt)
                limit = full.find(prompt, start) % (len(full) + 1)  # the next turn's prompt, else the end
            spans.append(_find_turn(full[:limit], through[len(before):], start, m["content"], i,
                                    list(tokenizer.get_added_vocab())))
        cursor = spans[-1][1]
    return full, spans


def _find_turn(full: str, body: str, start: int, content: str, index: int,
               added: list[str] = ()) -> tuple[int, int]:
    """Where a turn whose own rendering is `body` sits in `full` (cut where the next turn's generation
    prompt begins), its own generation prompt ending at `start`.

    Tried in order, each kept only if it still holds the end of the turn's content: the longest
    prefix of body found at start (a template that closes the conversation, not each turn, with an
    EOS, as Phi-3's does); else the longest tail of body found after start (a dropped reasoning block,
    or a turn placed after text the template moved in front of it)."""
    end = re.search(r"\S{1,8}$", content.rstrip())  # the content's last characters, up to its last space
    tail_of_content = end.group(0) if end else ""

    def holds_content(lo: int, hi: int) -> bool:
        at = body.rfind(tail_of_content, lo, hi)
        return bool(tail_of_content) and at >= 0

    same = 0
    while same < len(body) and start + same < len(full) and full[start + same] == body[same]:
        same += 1
    for token in added:  # a match that stops inside an added token ("<|" of Phi-3's <|user|>) stops before it
        at = full.rfind(token, max(0, start + same - len(token) + 1), start + same + len(token) - 1)
        if 0 <= at - start < same < at - start + len(token):
            same = at - start
    if same == len(body) or holds_content(0, same):
        return start, start + same
    lo, hi = 0, len(body)  # the longest tail found after start (a found tail's own tails are found too)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if full.find(body[-mid:], start) >= 0:
            lo = mid
        else:
            hi = mid - 1
    if not holds_content(len(body) - lo, len(body)):
        raise DataError(f"assistant message {index} does not appear in the chat template's rendering of the whole "
                        "conversation; mark assistant turns with {% generation %}...{% endgeneration %} in "
                        "chat_template, or set train_on_prompt=true")
    at = full.find(body[len(body) - lo:], start)
    return at, at + lo


def encode_messages(tokenizer, messages: list[dict], train_on_prompt: bool, max_len: int):
    """Render with the chat template and label every assistant turn (see assistant_spans), mapped from
    characters to tokens with the tokenizer's offsets (_span_labels: a token that holds any character
    of a turn is labelled, as transformers' return_assistant_tokens_mask does). The tokens are
    `apply_chat_template(messages, tokenize=True)`'s: the rendering without added special tokens, so a
    row has the BOS the template renders, and none where it renders none."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("dataset_format=messages needs a tokenizer with a chat_template; set chat_template=... (a "
                        "file or the template itself), tokenizer=... to one that has it, or use "
                        "dataset_format=prompt_completion")
    text, spans = (render_chat(tokenizer, messages, False), []) if train_on_prompt else assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=not train_on_prompt)
    ids = enc.input_ids[:max_len]
    if train_on_prompt:
        return ids, list(ids)
    return ids, _span_labels(ids, enc.offset_mapping, spans)


def encode_row(row: dict, fmt: str, tokenizer, train_on_prompt: bool, max_len: int):
    if fmt == "messages":
        return encode_messages(tokenizer, row["messages"], train_on_prompt, max_len)
    if fmt == "text":
        return encode_text(tokenizer, row["text"], max_len)
    if fmt == "alpaca":
        template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=row["instruction"], input=row.get("input") or "")
        return encode_prompt_completion(tokenizer, prompt, row["output"], train_on_prompt, max_len)
    return encode_prompt_completion(tokenizer, row["prompt"], row["completion"], train_on_prompt, max_len)


def _span_labels(ids: list[int], offsets, spans: list[tuple[int, int]]) -> list[int]:
    """The labels of a chat row: a token is labelled if it holds any character of a span (its
    characters [start, end) meet some [lo, hi)). That is transformers' return_assistant_tokens_mask,
    which marks the tokens from the one holding a span's first character through the one holding its
    last: a token that straddles a turn's end (`><` finishing `<|eot_id|>` and starting the next
    header, in a tokenizer without those special tokens) is trained, as is one that carries the space
    before an answer (`▁4`). Spans are disjoint: the first span ending after a token's start is the
    only one it can meet."""
    if not spans:
        return [IGNORE] * len(ids)
    spans = sorted(spans)
    los, his = np.array([lo for lo, _ in spans]), np.array([hi for _, hi in spans])
    cuts = np.asarray(offsets[:len(ids)], dtype=np.int64).reshape(-1, 2)
    starts, ends = cuts[:, 0], cuts[:, 1]
    at = np.searchsorted(his, starts, side="right")
    inside = (at < len(spans)) & (los[np.minimum(at, len(spans) - 1)] < ends)
    return np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE).tolist()


def _prompt_and_completion(row: dict, fmt: str) -> tuple[str, str]:
    if fmt == "alpaca":
        template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
        return template.format(instruction=row["instruction"], input=row.get("input") or ""), row["output"]
    return row["prompt"], row["completion"]


def encode_batch(rows: list[dict], fmt: str, tokenizer, train_on_prompt: bool, max_len: int):
    """encode_row of many rows: the same (ids, labels), with one tokenizer call per kind of text
    (tests/test_mixture.py checks it against encode_row on real tokenizers)."""
    bos, eos = bos_ids(tokenizer), _eos(tokenizer)
    out = []
    if fmt == "messages":
        if not getattr(tokenizer, "chat_template", None):
            encode_messages(tokenizer, [], train_on_prompt, max_len)  # raises its error
        conversations = [r["messages"] for r in rows]
        if train_on_prompt:
            rendered = [(text, []) for text in _render_many(tokenizer, conversations)]
        elif GENERATION_TAG.search(tokenizer.chat_template):
            rendered = _render_many(tokenizer, conversations, spans=True)
        else:
            rendered = [assistant_spans(tokenizer, c) for c in conversations]
        enc = tokenizer([text for text, _ in rendered], add_special_tokens=False,
                        return_offsets_mapping=not train_on_prompt)
        for k, (_, spans) in enumerate(rendered):
            ids = enc.input_ids[k][:max_len]
            out.append((ids, list(ids)) if train_on_prompt else (ids, _span_labels(ids, enc.offset_mapping[k], spans)))
        return out
    if fmt == "text":
        texts = tokenizer([_without_eos(tokenizer, r["text"]) for r in rows], add_special_tokens=False).input_ids
        for tokens in texts:
            ids = (bos + tokens + eos)[:max_len]
            out.append((ids, list(ids)))
        return out
    pairs = [_prompt_and_completion(r, fmt) for r in rows]
    prompts = [p for p, _ in pairs]
    completions = [_without_eos(tokenizer, c) for _, c in pairs]
    prompt_ids = tokenizer(prompts, add_special_tokens=False).input_ids
    both = tokenizer([p + c for p, c in zip(prompts, completions)], add_special_tokens=False).input_ids
    return [_prompt_completion_row(bos, prompt_ids[k], both[k], eos, train_on_prompt, max_len)
            for k in range(len(rows))]


def plan_packing(lengths: list[int], max_len: int) -> list[list[int]]:
    """Which examples share a row: best-fit decreasing, rows in the order they were opened.

    Longest examples first, each into the fullest row it still fits in, else a new row. Rows end
    up nearly full (packing in arrival order leaves about half an average example of padding per
    row), so a step carries more real tokens for the same compute. Deterministic: ties keep the
    examples' original order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted: the best fit is a bisect
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (max_len - lengths[i], len(rows) - 1))
        else:
            space, row = free.pop(at)
            rows[row].append(i)
            bisect.insort(free, (space - lengths[i], row))
    return rows


def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_len: int, pad_id: int) -> dict:
    """Whole examples packed into rows of exactly max_len (plan_packing decides which share a row).

    Each example keeps its own position ids (restarting at 0), which is how the model's attention
    masks keep examples from attending to one another; the first token of each example is never a
    target of the previous example's last token.
    """
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for row in plan_packing([len(ids) for ids in input_ids], max_len):
        ids = [t for i in row for t in input_ids[i]]
        labs = [t for i in row for t in [IGNORE] + labels[i][1:]]
        pos = [p for i in row for p in range(len(input_ids[i]))]
        pad = max_len - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["labels"].append(labs + [IGNORE] * pad)
        out["position_ids"].append(pos + list(range(pad)))
    return out


# ---------------------------------------------------------------- loading


def load_source(spec: DataSource, key: str = "dataset", split_key: str = "dataset_split"):
    """One source's rows of its split: a local file or directory (split by file names), a save_to_disk
    folder, or a hub dataset (with its config and revision)."""
    import datasets

    source = resolve_dataset(spec.path)
    try:
        if looks_local(source):
            path = Path(source).expanduser()
            if is_saved_dataset(path):
                _need_split(split_key, spec.path, spec.split, saved_splits(path))
                saved = datasets.load_from_disk(str(path))
                return saved[spec.split] if isinstance(saved, datasets.DatasetDict) else saved
            splits = local_splits(path)
            _need_split(split_key, spec.path, spec.split, list(splits))
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


def _load(source: str, split: str):
    return load_source(DataSource(path=source, split=split))


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
    return _fingerprint(body, getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token)


ROWS_PER_PROCESS = 20_000  # num_proc=0: one tokenizing process per this many rows (a process costs ~1 s to start)


def num_processes(recipe: Recipe, rows: int) -> int | None:
    import os

    n = recipe.num_proc or min(8, os.cpu_count() or 1, rows // ROWS_PER_PROCESS)
    n = min(n, rows)
    return n if n > 1 else None


COUNTS = ["n_tokens", "n_targets"]  # per-row columns kept while sources are mixed, dropped before training


def tokenize_dataset(ds, fmt: str, tokenizer, recipe: Recipe, where: str, *, spec: DataSource | None = None,
                     pack: bool | None = None, keep_counts: bool = False):
    """Map columns, format, tokenize (a batch of rows per tokenizer call, in num_proc processes), drop
    examples with no target token, and pack; cached by content fingerprint. keep_counts: keep each
    row's n_tokens and n_targets (for mixing and the summary; never with packing)."""
    if len(ds) == 0:
        raise DataError(f"{where}: the dataset is empty")
    spec = spec or DataSource(path=where)
    if fmt in ("auto", "messages"):
        spec = with_sharegpt(spec, ds.column_names, _first_row(ds))
    names = check_columns(ds.column_names, spec, where)
    if fmt == "auto":
        fmt = detect_format(names, where)
    _need_fields(names, fmt, where)
    needed = set(FORMAT_FIELDS[fmt]) | ({"input"} if fmt == "alpaca" else set())
    used = [c for c in ds.column_names if c in {_top(spec.columns).get(f, f) for f in needed}]
    tok_fp = tokenizer_fingerprint(tokenizer)
    max_len, train_on_prompt = recipe.max_seq_len, recipe.train_on_prompt
    procs = num_processes(recipe, len(ds))

    def encode(batch, indices):
        rows = [map_row({k: batch[k][i] for k in batch}, spec, f"{where} row {index}")
                for i, index in enumerate(indices)]
        if fmt == "messages":
            for row, index in zip(rows, indices):
                check_roles(row["messages"] or [], f"{where} row {index}")
        out = {"input_ids": [], "labels": [], "n_tokens": [], "n_targets": []}
        for ids, labels in encode_batch(rows, fmt, tokenizer, train_on_prompt, max_len):
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["n_tokens"].append(len(ids))
            out["n_targets"].append(sum(1 for x in labels[1:] if x != IGNORE))
        return out

    fp = _fingerprint(PIPELINE_VERSION, ds._fingerprint, fmt, tok_fp, max_len, train_on_prompt, spec.columns,
                      spec.roles)
    ds = ds.select_columns(used) if len(used) < len(ds.column_names) else ds
    ds = ds.map(encode, batched=True, with_indices=True, remove_columns=used, new_fingerprint=fp, num_proc=procs,
                desc=f"tokenize {where}")
    ds = ds.filter(lambda n: [x > 0 for x in n], input_columns="n_targets", batched=True, num_proc=procs,
                   new_fingerprint=_fingerprint(fp, "filter"), desc="drop rows without targets")
    if len(ds) == 0:
        raise DataError(f"{where}: no example has a response token left within max_seq_len={max_len}; "
                        "raise max_seq_len or set train_on_prompt=true")
    if recipe.packing if pack is None else pack:
        return pack_dataset(ds, tokenizer, recipe, where)
    return ds if keep_counts else ds.remove_columns(COUNTS)


def pack_dataset(ds, tokenizer, recipe: Recipe, where: str):
    """pack_rows over the dataset, 1000 examples at a time, in one process (a batch's boundaries decide
    which rows share a row, so they must not depend on num_proc)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ds = ds.remove_columns([c for c in COUNTS if c in ds.column_names])
    return ds.map(lambda b: pack_rows(b["input_ids"], b["labels"], recipe.max_seq_len, pad), batched=True,
                  batch_size=1000, new_fingerprint=_fingerprint(ds._fingerprint, "pack", "best-fit decreasing",
                                                                recipe.max_seq_len, pad), desc=f"pack {where}")


# ---------------------------------------------------------------- mixtures


def mixture_counts(available: list[int], sources: list[DataSource], keys: list[str] | None = None) -> list[int]:
    """Rows each source contributes per epoch: `rows`, else round(weight x its rows)."""
    counts = []
    for i, (n, spec) in enumerate(zip(available, sources)):
        count = spec.rows or round(spec.weight * n)
        if count == 0:
            key = keys[i] if keys else f"datasets[{i}]"
            raise DataError(f"{key.removesuffix('.path')}: weight={spec.weight} of its {n} rows rounds to no row; raise "
                            "weight, or set rows=N")
        counts.append(count)
    return counts


def mixture_indices(available: list[int], counts: list[int], seed: int) -> list[np.ndarray]:
    """Which rows of each source the mix takes, per source: every row count // n times, then count % n
    distinct rows drawn with a generator seeded by (seed, source index); in the source's order (the
    BatchSchedule shuffles the mix). A pure function of its arguments, as the schedule is."""
    out = []
    for i, (n, count) in enumerate(zip(available, counts)):
        whole, part = divmod(count, n)
        extra = np.sort(np.random.default_rng([seed, i]).permutation(n)[:part])
        out.append(np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), extra.astype(np.int64)]))
    return out


def _row_counts(ds) -> dict:
    cols = ds.select_columns(COUNTS).with_format("numpy")[:]
    return {k: np.asarray(cols[k], dtype=np.int64) for k in COUNTS}


@dataclass
class Datasets:
    train: object
    eval: object | None
    format: str
    sources: list = field(default_factory=list)  # per source: rows, dropped, rows in the mix, tokens, targets
    summary: dict = field(default_factory=dict)  # the whole train (and eval) set: rows, tokens, packing
    row_sources: object = None  # unpacked: the source index of each train row (numpy), for the --show view


def build_datasets(recipe: Recipe, tokenizer) -> Datasets:
    """Load, split, map columns, tokenize and mix the sources. The loop runs it on each machine's main
    process first; the other ranks then find every step in the datasets cache (fingerprints are
    content-derived)."""
    import datasets as hf

    sources = train_sources(recipe)
    evaluated = eval_source(recipe)
    parts, held, formats, raw_rows = [], [], [], []
    for i, (key, split_key, spec) in enumerate(sources):
        raw = load_source(spec, key, split_key)
        spec = with_sharegpt(spec, raw.column_names, _first_row(raw))
        where = spec.path if not recipe.datasets else f"datasets[{i}] {spec.path}"
        names = check_columns(raw.column_names, spec, where)
        fmt = spec.format if spec.format != "auto" else detect_format(names, where)
        raw_held = None
        if evaluated is None and recipe.eval_fraction > 0 and len(raw) >= 2:
            split = raw.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed, shuffle=True)
            raw, raw_held = split["train"], split["test"]
        raw_rows.append(len(raw))
        formats.append(fmt)
        parts.append(tokenize_dataset(raw, fmt, tokenizer, recipe, where, spec=spec, pack=False, keep_counts=True))
        if raw_held is not None:
            held.append(tokenize_dataset(raw_held, fmt, tokenizer, recipe, where + " (eval)", spec=spec,
                                         pack=False, keep_counts=True))
    specs = [spec for _, _, spec in sources]
    available = [len(p) for p in parts]
    counts = mixture_counts(available, specs, [key for key, _, _ in sources])
    picks = mixture_indices(available, counts, recipe.seed)
    stats = []
    for i, ((key, split_key, spec), part, pick) in enumerate(zip(sources, parts, picks)):
        rows = _row_counts(part)
        stats.append({"source": key.removesuffix(".path"), "path": spec.path, "format": formats[i],
                      "split": spec.split, "weight": spec.weight, "rows_wanted": spec.rows, "rows": raw_rows[i],
                      "kept": available[i], "dropped_no_target": raw_rows[i] - available[i],
                      "at_max_seq_len": int((rows["n_tokens"] >= recipe.max_seq_len).sum()),
                      "rows_in_mix": int(len(pick)), "tokens": int(rows["n_tokens"][pick].sum()),
                      "target_tokens": int(rows["n_targets"][pick].sum())})
    train = parts[0] if len(parts) == 1 else hf.concatenate_datasets(parts)
    offsets = np.cumsum([0] + available[:-1])
    order = np.concatenate([pick + off for pick, off in zip(picks, offsets)])
    row_sources = np.concatenate([np.full(len(pick), i, dtype=np.int32) for i, pick in enumerate(picks)])
    if not (len(order) == len(train) and np.array_equal(order, np.arange(len(train)))):
        train = train.select(order, new_fingerprint=_fingerprint(
            [p._fingerprint for p in parts], counts, recipe.seed, "mix"))
    summary = {"rows": len(train), "tokens": sum(s["tokens"] for s in stats),
               "target_tokens": sum(s["target_tokens"] for s in stats)}
    if recipe.packing:
        train = pack_dataset(train, tokenizer, recipe, "train")
        summary |= {"packed_rows": len(train),
                    "packing_efficiency": summary["tokens"] / (len(train) * recipe.max_seq_len)}
        row_sources = None
    else:
        train = train.remove_columns(COUNTS)

    fmt = formats[0] if len(set(formats)) == 1 else "mixed"
    evals = None
    if evaluated is not None:
        key, split_key, spec = evaluated
        raw_eval = load_source(spec, key, split_key)
        spec = with_sharegpt(spec, raw_eval.column_names, _first_row(raw_eval))
        eval_fmt = formats[0] if not recipe.datasets and spec.format == "auto" and not isinstance(
            recipe.eval_dataset, DataSource) else spec.format
        evals = tokenize_dataset(raw_eval, eval_fmt, tokenizer, recipe, f"{spec.path} (eval)", spec=spec,
                                 pack=False, keep_counts=True)
    elif held:
        evals = held[0] if len(held) == 1 else hf.concatenate_datasets(held)
    if evals is not None:
        rows = _row_counts(evals)
        summary["eval"] = {"rows": len(evals), "tokens": int(rows["n_tokens"].sum()),
                           "target_tokens": int(rows["n_targets"].sum())}
        evals = pack_dataset(evals, tokenizer, recipe, "eval") if recipe.packing else evals.remove_columns(COUNTS)
    return Datasets(train=train, eval=evals, format=fmt, sources=stats, summary=summary, row_sources=row_sources)


def summary_lines(data: Datasets, recipe: Recipe) -> list[str]:
    """One line per source (rows, rows dropped and why, rows and tokens in the mix), then the totals."""
    lines = []
    for s in data.sources:
        share = f"rows={s['rows_wanted']}" if s["rows_wanted"] else f"weight {s['weight']:g}"
        dropped = (f", {s['dropped_no_target']} dropped (no target token within max_seq_len={recipe.max_seq_len})"
                   if s["dropped_no_target"] else ", none dropped")
        cut = f", {s['at_max_seq_len']} cut at max_seq_len" if s["at_max_seq_len"] else ""
        lines.append(f"data {s['source']} {s['path']} ({s['format']}, split {s['split']}): {s['rows']} rows"
                     f"{dropped}{cut}; {share}: {s['rows_in_mix']} rows in the mix, {s['tokens']} tokens, "
                     f"{s['target_tokens']} target tokens")
    t = data.summary
    line = (f"data train: {t['rows']} rows, {t['tokens']} tokens, {t['target_tokens']} target tokens "
            f"({100 * t['target_tokens'] / max(t['tokens'], 1):.1f}%)")
    if "packed_rows" in t:
        line += (f"; packed into {t['packed_rows']} rows of {recipe.max_seq_len}: "
                 f"{100 * t['packing_efficiency']:.1f}% of their tokens are real")
    else:
        line += "; packing off"
    lines.append(line)
    if "eval" in t:
        e = t["eval"]
        lines.append(f"data eval: {e['rows']} rows, {e['tokens']} tokens, {e['target_tokens']} target tokens")
    return lines


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class BatchSchedule:
    """Which rows each rank reads at each step: a pure function of its fields."""

    num_rows: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g)

    def rows(self, step: int, rank: int) -> list[list[int]]:
        """The micro-batches (lists of row indices) that `rank` runs at optimizer step `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)[within * self.global_batch:(within + 1) * self.global_batch].tolist()
        m, w = self.micro_batch_size, self.world_size
        return [perm[(a * w + rank) * m:(a * w + rank + 1) * m] for a in range(self.grad_accum)]


def collate(rows: list[dict], pad_id: int, packed: bool, padding_free: bool = False,
            lengths: list[int] | None = None) -> dict:
    """Pad right to the longest row; packed rows are all full length and carry position ids instead of
    an attention mask, from which the model builds one block-causal mask per example.

    padding_free: the micro-batch as one row instead (see concatenate; lengths: the packed rows' real
    lengths, else read from each row)."""
    if padding_free:
        return concatenate(rows, packed, lengths)
    width = max(len(r["input_ids"]) for r in rows)

    def padded(key, fill):
        return torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows], dtype=torch.long)

    batch = {"input_ids": padded("input_ids", pad_id), "labels": padded("labels", IGNORE)}
    if packed:
        batch["position_ids"] = padded("position_ids", 0)
    else:
        batch["attention_mask"] = torch.tensor(
            [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows], dtype=torch.long)
    return batch


def packed_length(row: dict) -> int:
    """The real tokens of a packed row (pack_rows): all of it, less the tail padding. The padding is
    the row's last segment of position ids (they restart at 0 there, as at every example) when none
    of its labels is set: every example kept has a target token after its first (tokenize_dataset
    drops the others), so an example's segment never looks like padding. Read from the row itself, so
    that packed data keeps the layout (and cache keys) it has without padding_free."""
    positions, labels = row["position_ids"], row["labels"]
    start = len(positions) - 1 - positions[::-1].index(0)
    if start > 0 and all(label == IGNORE for label in labels[start:]):
        return start
    return len(positions)


def concatenate(rows: list[dict], packed: bool, lengths: list[int] | None = None) -> dict:
    """The micro-batch as ONE row without a single pad token (padding_free=true): its examples (a
    packed row's, up to its real length; or each unpacked row whole) one after the other, position ids
    restarting at 0 at each, no attention mask: transformers reads the examples' boundaries from the
    position ids (masking_utils.find_packed_sequence_indices: a block-diagonal causal mask for
    sdpa/eager; flash_attention_2 runs varlen on a batch of one row). An example's first label is
    dropped, as pack_rows does: it would be the target of the previous example's last token, and in a
    padded row no token predicts it either, so the targets are the padded batch's."""
    ids, labels, positions = [], [], []
    for k, r in enumerate(rows):
        if packed:
            n = lengths[k] if lengths is not None else packed_length(r)
            ids += r["input_ids"][:n]
            labels += r["labels"][:n]
            positions += r["position_ids"][:n]
        else:
            n = len(r["input_ids"])
            ids += r["input_ids"]
            labels += [IGNORE] + r["labels"][1:]
            positions += range(n)
    return {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long)}


def target_tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def input_tokens(batch: dict) -> int:
    """Real tokens the model computes on: padding excluded (a packed row's tail pad is counted; it is
    shorter than one example; a padding-free row has none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def fetch(ds, indices: list[int], pad_id: int, packed: bool, padding_free: bool = False) -> dict:
    """Rows by index; index -1 is a placeholder (keeps ranks in lock-step) that carries no targets.
    A placeholder is row 0 with its labels unset; padding-free, it is laid out as row 0 is (a packed
    row's real length is read before its labels are cleared), so every rank still runs the forward."""
    real = [i if i >= 0 else 0 for i in indices]
    cols = ds[real]
    rows = [{k: cols[k][j] for k in cols} for j in range(len(real))]
    lengths = [packed_length(r) for r in rows] if padding_free and packed else None
    for j, i in enumerate(indices):
        if i < 0:
            rows[j]["labels"] = [IGNORE] * len(rows[j]["labels"])
    return collate(rows, pad_id, packed, padding_free, lengths)


def eval_batches(ds, micro_batch_size: int, rank: int, world_size: int, max_samples: int = 0) -> list[list[int]]:
    """The first `max_samples` eval rows (all if 0), each once across ranks, every rank the same number
    of batches (sharded models need every rank in every forward); the same rows whatever the world size."""
    n = min(len(ds), max_samples) if max_samples else len(ds)
    per_rank = -(-n // world_size)
    mine = [i if i < n else -1 for i in range(rank, per_rank * world_size, world_size)]
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


# ---------------------------------------------------------------- python -m finetune.data: what is trained

GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def show_row(tokenizer, ids: list[int], labels: list[int], position_ids: list[int] | None = None,
             colour: bool = False) -> str:
    """A prepared row as text with its trained tokens marked: bold green with colour, else [[...]]. A
    token is trained where its label is set and it is not the row's (or a packed example's) first token,
    which no earlier token predicts. Examples packed into one row are separated by ' || ', the padding
    after them is shown as <pad x N>."""
    starts = [k for k, p in enumerate(position_ids) if p == 0] if position_ids else [0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # as packed
    pieces = []
    for a, b in zip(starts, starts[1:] + [len(ids)]):
        if position_ids and a > 0 and all(t == pad for t in ids[a:b]) and b == len(ids):
            pieces.append(f"<pad x {b - a}>")
            continue
        text, k = "", a
        while k < b:
            trained = k > a and labels[k] != IGNORE
            end = k
            while end < b and (end > a and labels[end] != IGNORE) == trained:
                end += 1
            piece = tokenizer.decode(ids[k:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            text += (f"{GREEN}{piece}{RESET}" if colour else f"[[{piece}]]") if trained else piece
            k = end
        pieces.append(text)
    return " || ".join(pieces)


if __name__ == "__main__":  # python -m finetune.data
    import runpy

    runpy.run_module("finetune.commands.data", run_name="__main__")
