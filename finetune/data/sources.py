"""Sources, splits and column mapping: where a dataset comes from and how its columns map onto a format,
checked before anything is tokenized (prevalidate)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from finetune import objective_rules
from finetune.assets import BUILTIN_FORMATS, resolve_dataset
from finetune.data.formats import (DataError, FORMAT_FIELDS, check_row, detect_format, format_hint, mapping_hint,
                                   unknown_role)
from finetune.recipe import DATA_EXTENSIONS, DataSource, ROLES, Recipe, looks_local


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
SHAREGPT_COLUMNS = {"messages": "conversations", "role": "from", "content": "value"}


def with_sharegpt(spec: DataSource, fields, first_row=None) -> DataSource:
    """The source as it is read: rows with a `conversations` field and no `messages` (ShareGPT's
    layout) are read as messages when the source maps no columns and its format is auto or messages:
    each turn's `from`/`value` (or `role`/`content`, as the first turn has them) become role/content,
    with human/gpt/system as user/assistant/system (SHAREGPT_ROLES; others go in roles=...)."""
    fields = set(fields)
    if spec.columns or spec.format not in ("auto", "messages") or "messages" in fields or "conversations" not in fields \
            or {"chosen", "rejected"} <= fields:  # preference rows: their conversations are chosen and rejected
        return spec
    turns = first_row.get("conversations") if isinstance(first_row, dict) else None
    first = turns[0] if isinstance(turns, list) and turns else None
    if isinstance(first, dict) and "from" not in first and "role" in first:
        return replace(spec, columns={"messages": "conversations"})
    return replace(spec, columns=dict(SHAREGPT_COLUMNS))


def first_row_of(ds):
    """A datasets.Dataset's first row (one row read from its Arrow table), or None when it is empty."""
    return ds[0] if len(ds) else None


def train_sources(recipe: Recipe) -> list[tuple[str, str, DataSource]]:
    """(key, split key, source) of each training source: the mixture's, or the single `dataset`."""
    if recipe.datasets:
        return [(f"datasets[{i}].path", f"datasets[{i}].split", s) for i, s in enumerate(recipe.datasets)]
    return [("dataset", "dataset_split", DataSource(path=recipe.dataset, format=recipe.dataset_format,
                                                    split=recipe.dataset_split, columns=dict(recipe.columns)))]


def eval_source(recipe: Recipe) -> tuple[str, str, DataSource] | None:
    """The eval set named by the recipe: eval_dataset (a DataSource, or a path/hub id read with
    eval_split, else dataset_split), or dataset's own eval_split; None: hold out eval_fraction. The recipe's
    columns map a path's or a split's rows as they map dataset's (a DataSource maps its own)."""
    e = recipe.eval_dataset
    if isinstance(e, DataSource):
        return "eval_dataset.path", "eval_dataset.split", e
    if e:
        return ("eval_dataset", "eval_split" if recipe.eval_split else "dataset_split",
                DataSource(path=e, format="auto" if recipe.datasets else recipe.dataset_format,
                           split=recipe.eval_split or recipe.dataset_split, columns=dict(recipe.columns)))
    if recipe.eval_split and not recipe.datasets:
        return "dataset", "eval_split", DataSource(path=recipe.dataset, format=recipe.dataset_format,
                                                   split=recipe.eval_split, columns=dict(recipe.columns))
    return None


def top_level_columns(columns: dict) -> dict:
    """The mapping of top-level fields (role and content name fields inside each message)."""
    return {k: v for k, v in columns.items() if k not in ("role", "content")}


def check_columns(fields, spec: DataSource, where: str) -> list[str]:
    """The field names the format sees once spec.columns is applied; names a mapped field the data lacks."""
    fields = list(fields)
    for target, name in top_level_columns(spec.columns).items():
        if name not in fields:
            raise DataError(f"{where}: columns maps {target} to {name!r}, but the rows have no field {name!r} "
                            f"(their fields: {', '.join(sorted(fields)) or 'none'})")
    return sorted(set(fields) | set(top_level_columns(spec.columns)))


def _maps_messages(spec: DataSource) -> bool:
    return bool(spec.roles) or bool({"messages", "role", "content"} & set(spec.columns))


def map_row(row: dict, spec: DataSource, where: str) -> dict:
    """A row as its format expects it: spec.columns applied (ShareGPT's conversations of from/value with
    human/gpt become messages of role/content with user/assistant)."""
    if not spec.columns and not spec.roles:
        return row
    out = dict(row)
    for target, name in top_level_columns(spec.columns).items():
        if row.get(name) is None:  # absent from a JSON row; null in an Arrow one whose other rows have it
            fields = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
            raise DataError(f"{where}: columns maps {target} to {name!r}, but the row has no field {name!r} "
                            f"(its fields: {fields})")
        out[target] = row[name]
    if _maps_messages(spec):
        for field in MESSAGE_FIELDS:  # a chat row's messages; a preference row's conversations
            if isinstance(out.get(field), list):
                out[field] = _map_messages(out[field], spec, where if field == "messages" else f"{where} {field}")
    return out


MESSAGE_FIELDS = ("messages", "prompt", "chosen", "rejected")


def _map_messages(messages: list, spec: DataSource, where: str) -> list[dict]:
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
    return mapped


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


def need_split(split_key: str, source: str, split: str, available: list[str]) -> None:
    if split not in available:
        raise DataError(f"{split_key}={split}: {source} has no split {split!r}; its splits: "
                        f"{', '.join(available) or 'none'}")


def need_fields(names, fmt: str, where: str) -> None:
    missing = [c for c in FORMAT_FIELDS[fmt] if c not in names]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing} for dataset_format={fmt}{format_hint(names, fmt)}")


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS)
    if not files:
        raise DataError(f"{path}: directory holds no {'/'.join(DATA_EXTENSIONS)} files")
    return files


def prevalidate(source: str, fmt: str, key: str = "dataset", *, spec: DataSource | None = None,
                split: str = "train", split_key: str = "dataset_split", counts: dict | None = None) -> str:
    """Scan local JSON/JSONL files row by row before anything expensive: names file and line.

    Returns the resolved format. Parquet/CSV are checked by their column names, a save_to_disk folder
    by its features; hub datasets cannot be checked before they are downloaded. `spec` carries the
    source's column mapping, checked against the rows; `split` must be one the source has. counts: a
    dict that gets the rows as stored ("rows") and, for unpaired rows, the desirable ones ("desirable";
    not for CSV, whose cells are text until datasets reads them).
    """
    counts = {} if counts is None else counts
    if not looks_local(source):
        return fmt
    spec = spec or DataSource(path=source, format=fmt, split=split)
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        import datasets

        need_split(split_key, source, split, saved_splits(path))
        saved = datasets.load_from_disk(str(path))  # memory-mapped: reads the features, not the rows
        saved = saved[split] if isinstance(saved, datasets.DatasetDict) else saved
        spec = with_sharegpt(spec, saved.column_names, first_row_of(saved))
        names = check_columns(saved.column_names, spec, str(path))
        fmt = detect_format(names, str(path)) if fmt == "auto" else fmt
        need_fields(names, fmt, str(path))
        if len(saved) == 0:
            raise DataError(f"{key}={source}: the dataset is empty")
        counts["rows"] = len(saved)
        if fmt == "unpaired":
            counts["desirable"] = sum(map(bool, saved[top_level_columns(spec.columns).get("label", "label")]))
        if fmt == "preference":
            _check_pairs(saved.select_columns(_pair_fields(saved.column_names, spec)), spec, f"{path} row")
        return fmt
    splits = local_splits(path)
    need_split(split_key, source, split, list(splits))
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
                if fmt == "unpaired":
                    counts["desirable"] = counts.get("desirable", 0) + bool(row["label"])
        else:
            columns = _columns(path)
            spec = with_sharegpt(spec, columns, _parquet_first_row(path, columns))
            names = check_columns(columns, spec, str(path))
            if fmt == "auto":
                fmt = detect_format(names, str(path))
            missing = [c for c in FORMAT_FIELDS[fmt] if c not in names]
            if missing:
                mapped = mapping_hint(names, FORMAT_FIELDS[fmt])
                raise DataError(f"{path}: missing column(s) {missing} for dataset_format={fmt}"
                                + (format_hint(names, fmt) or (mapped and f"; {mapped}")))
            rows_seen += _num_rows(path, [top_level_columns(spec.columns).get(c, c) for c in FORMAT_FIELDS[fmt]], fmt)
            if fmt == "unpaired" and suffix == ".parquet":
                import pyarrow.parquet as pq

                label = top_level_columns(spec.columns).get("label", "label")
                counts["desirable"] = counts.get("desirable", 0) + sum(
                    map(bool, pq.read_table(path, columns=[label]).column(label).to_pylist()))
            elif fmt == "unpaired":
                counts["desirable"] = None
            if fmt == "preference":
                _check_pairs(_table_rows(path, _pair_fields(columns, spec)), spec, f"{path} row")
    if rows_seen == 0:
        raise DataError(f"{key}={source}: the dataset is empty")
    counts["rows"] = rows_seen
    return fmt


def overview_lines(recipe: Recipe) -> list[str]:
    """What a dry run says of the data without tokenizing it, read as prevalidate reads it: each training
    source's and the eval set's format and rows as stored, and for unpaired rows (KTO) how many are
    desirable; a hub dataset is read only once downloaded. `finetune data` shows the rows as tokenized."""
    lines = []
    evaluated = eval_source(recipe)
    for key, split_key, spec in train_sources(recipe) + ([evaluated] if evaluated else []):
        name = f"{key.removesuffix('.path')}={spec.path}" + (f" (split {spec.split})" if spec.split != "train" else "")
        path = resolve_dataset(spec.path)
        if not looks_local(path):
            lines.append(f"data {name}: a hub dataset, not read by a dry run (its rows are counted once it is "
                         "downloaded: finetune data reads it)")
            continue
        counts = {}
        fmt = prevalidate(path, spec.format, key, spec=replace(spec, path=path), split=spec.split,
                          split_key=split_key, counts=counts)
        if fmt == "auto" and spec.path.startswith("builtin:"):
            fmt = BUILTIN_FORMATS.get(spec.path[len("builtin:"):], fmt)
        line = f"data {name}: {counts['rows']:,} {fmt} rows as stored"
        if counts.get("desirable") is not None:
            good = counts["desirable"]
            line += f"; labels: {good:,} desirable (true), {counts['rows'] - good:,} undesirable (false)"
        lines.append(line)
    if evaluated is None and recipe.eval_fraction > 0:
        lines.append(f"data eval: {recipe.eval_fraction:.0%} of the rows held out "
                     f"(eval_fraction={recipe.eval_fraction:g})")
    return lines


def prevalidate_recipe(recipe: Recipe) -> None:
    """prevalidate every source of the recipe: the training source(s) and the eval set, each of the
    kind of rows the recipe's objective trains on."""
    for key, split_key, spec in train_sources(recipe) + ([eval_source(recipe)] if eval_source(recipe) else []):
        if spec.path.startswith("builtin:"):
            need_split(split_key, spec.path, spec.split, ["train"])
        fmt = prevalidate(spec.path, spec.format, key, spec=spec, split=spec.split, split_key=split_key)
        if fmt == "auto" and spec.path.startswith("builtin:"):
            fmt = BUILTIN_FORMATS.get(spec.path[len("builtin:"):], fmt)
        check_objective(recipe, fmt, key, spec.path, lambda: local_fields(spec))


def local_fields(spec: DataSource) -> list[str]:
    """A local source's fields (its first row's, or its columns), for advice after an error; [] where they
    cannot be read cheaply (a hub dataset, an unreadable file)."""
    path = Path(spec.path).expanduser()
    try:
        if is_saved_dataset(path) or not looks_local(spec.path):
            return []
        first = (local_splits(path).get(spec.split) or [None])[0]
        if first is None or first.suffix.lower() not in (".json", ".jsonl"):
            return _columns(first) if first is not None else []
        text = first.read_text(encoding="utf-8").lstrip()
        row = json.loads(text)[0] if text.startswith("[") else next(row for _, row in _jsonl_rows(first, text))
        return list(row) if isinstance(row, dict) else []
    except (OSError, ValueError, IndexError, StopIteration, DataError):
        return []


def check_objective(recipe: Recipe, fmt: str, key: str, path: str, fields=lambda: ()) -> None:
    """objective=dpo and reward train on preference rows only, and preference rows train with those only;
    likewise grpo and prompt rows, kto and unpaired rows
    (fmt auto: not known yet, as a hub dataset's before it is downloaded: checked again once it is).
    fields: the rows' fields (called on a mismatch only), to say which to map with `columns`."""
    key = key.removesuffix(".path")
    rows = objective_rules.rules(recipe).ROWS

    def mapping(needed) -> str:
        """How to map the fields the objective's rows need, as typed: columns=label:thumbs."""
        named = mapping_hint(fields(), needed)
        return named or f"map its fields with columns={','.join(f'{name}:FIELD' for name in needed)}"

    if rows == ("preference",) and fmt not in ("auto", "preference"):
        raise DataError(f"objective={recipe.objective} needs preference rows (prompt, chosen, rejected); {key}={path} "
                        f"has {fmt} rows: use a preference dataset (or {mapping(('chosen', 'rejected'))}), or set "
                        "objective=sft")
    if "preference" not in rows and fmt == "preference":
        raise DataError(f"{key}={path} has preference rows (chosen, rejected), which train with objective=dpo; set "
                        f"objective=dpo (objective=reward: a reward model), or use a dataset of SFT rows (objective="
                        f"{recipe.objective})")
    if rows == ("prompt",) and fmt not in ("auto", "prompt"):
        raise DataError(f"objective=grpo needs prompt rows (a prompt column, text or messages, and the columns its "
                        f"rewards read); {key}={path} has {fmt} rows: {mapping(('prompt',))} and set "
                        "dataset_format=prompt, or set objective=sft")
    if rows == ("unpaired",) and fmt not in ("auto", "unpaired"):
        raise DataError(f"objective=kto needs unpaired rows (prompt, completion, label: true for a desirable "
                        f"completion, false for an undesirable one); {key}={path} has {fmt} rows: "
                        f"{mapping(('prompt', 'completion', 'label'))} and set dataset_format=unpaired "
                        "(builtin:tiny-kto shows the shape), or set objective=sft")
    if "unpaired" not in rows and fmt == "unpaired":
        raise DataError(f"{key}={path} has unpaired rows (prompt, completion, label), which train with objective=kto; "
                        f"set objective=kto, or use a dataset of SFT rows (objective={recipe.objective})")
    if "prompt" not in rows and fmt == "prompt":
        raise DataError(f"{key}={path} has prompt rows (a prompt and no completion to learn), which train with "
                        f"objective=grpo; set objective=grpo, or use a dataset of SFT rows (objective="
                        f"{recipe.objective}; a field holding the answer is mapped with columns=completion:FIELD)")


def _pair_fields(columns, spec: DataSource) -> list[str]:
    """The fields a preference row is read from (prompt, chosen, rejected, as mapped), of those present."""
    mapped = top_level_columns(spec.columns)
    return [name for name in (mapped.get(f, f) for f in ("prompt", "chosen", "rejected")) if name in columns]


def _table_rows(path: Path, fields: list[str]):
    """A parquet or csv file's rows, as dicts of `fields`."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path, columns=fields).to_pylist()
        return
    reader = _csv_rows(path)
    header = [c.strip() for c in next(reader, [])]
    for row in reader:
        if row:
            yield {name: row[header.index(name)] for name in fields}


def _check_pairs(rows, spec: DataSource, where: str) -> None:
    """check_row of every preference row of a table (`where`: how a row is named, before its index)."""
    for i, row in enumerate(rows):
        row = map_row(row, spec, f"{where} {i}")
        check_row(row, "preference", f"{where} {i}")


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
