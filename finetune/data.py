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
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.recipe import DATA_EXTENSIONS, Recipe, RecipeError, looks_local

IGNORE = -100
FORMAT_FIELDS = {
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "text": ("text",),
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PIPELINE_VERSION = "2"  # bump when tokenization/packing output changes, to invalidate caches


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


def check_row(row, fmt: str, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in FORMAT_FIELDS[fmt]:
        if name not in row or row[name] is None:
            raise DataError(f"{where}: missing field {name!r} (dataset_format={fmt} needs "
                            f"{', '.join(FORMAT_FIELDS[fmt])})")
    if fmt == "messages":
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: each message needs string 'role' and 'content', got {m!r:.80}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message to learn from")
    else:
        for name in FORMAT_FIELDS[fmt]:
            if not isinstance(row[name], str):
                raise DataError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS)
    if not files:
        raise DataError(f"{path}: directory holds no {'/'.join(DATA_EXTENSIONS)} files")
    return files


def prevalidate(source: str, fmt: str, key: str = "dataset") -> str:
    """Scan local JSON/JSONL files row by row before anything expensive: names file and line.

    Returns the resolved format. Parquet/CSV are checked by their column names; hub datasets cannot
    be checked before they are downloaded.
    """
    if not looks_local(source):
        return fmt
    rows_seen = 0
    for path in _data_files(Path(source).expanduser()):
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
                if fmt == "auto":
                    fmt = detect_format(row.keys() if isinstance(row, dict) else [], where)
                check_row(row, fmt, where)
                rows_seen += 1
        else:
            columns = _columns(path)
            if fmt == "auto":
                fmt = detect_format(columns, str(path))
            missing = [c for c in FORMAT_FIELDS[fmt] if c not in columns]
            if missing:
                raise DataError(f"{path}: missing column(s) {missing} for dataset_format={fmt}")
            rows_seen += _num_rows(path, FORMAT_FIELDS[fmt], fmt)
    if rows_seen == 0:
        raise DataError(f"{key}={source}: the dataset is empty")
    return fmt


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


def _num_rows(path: Path, required=(), fmt: str = "") -> int:
    """Rows of a parquet or csv file, after checking that no required field is missing in any row."""
    needs = f"dataset_format={fmt} needs {', '.join(FORMAT_FIELDS[fmt])}" if fmt else "it is required"
    if path.suffix.lower() == ".parquet":
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        for name in required:
            index = meta.schema.names.index(name)
            stats = [meta.row_group(g).column(index).statistics for g in range(meta.num_row_groups)]
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
# One rule for every format: a row starts the way `tokenizer(prompt)` starts at inference (the BOS that
# the tokenizer adds by itself: Llama, Mistral, Gemma; nothing for Qwen or GPT-2), or the way the chat
# template starts it, exactly once; texts are tokenized without special tokens so that nothing is
# added twice; a prompt_completion/alpaca/text row ends with one EOS, a chat row with the end-of-turn
# markers its template renders, which are labelled as part of their assistant turn.


def _bos(tokenizer) -> list[int]:
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


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _without_eos(tokenizer, text: str) -> str:
    """A response that already ends with the EOS string gets its EOS from us, once."""
    eos = tokenizer.eos_token
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def encode_prompt_completion(tokenizer, prompt: str, completion: str, train_on_prompt: bool, max_len: int):
    """BOS + prompt + completion + EOS; labels on the completion and its EOS.

    The completion is tokenized as it continues the prompt (prompt + completion tokenized together,
    minus the prompt's own tokens), which is what a model continuing the tokenized prompt produces: a
    sentencepiece tokenizer would otherwise put a word-start marker on the completion's first token.
    Where a BPE merge crosses the seam, the completion is tokenized alone."""
    completion = _without_eos(tokenizer, completion)
    prompt_ids = _text_ids(tokenizer, prompt)
    both = _text_ids(tokenizer, prompt + completion)
    if both[:len(prompt_ids)] == prompt_ids:
        completion_ids = both[len(prompt_ids):]
    else:
        completion_ids = _text_ids(tokenizer, completion)
    prompt_ids = _bos(tokenizer) + prompt_ids
    completion_ids = completion_ids + _eos(tokenizer)
    ids = (prompt_ids + completion_ids)[:max_len]
    labels = (prompt_ids if train_on_prompt else [IGNORE] * len(prompt_ids)) + completion_ids
    return ids, labels[:max_len]


def encode_text(tokenizer, text: str, max_len: int):
    ids = (_bos(tokenizer) + _text_ids(tokenizer, _without_eos(tokenizer, text)) + _eos(tokenizer))[:max_len]
    return ids, list(ids)


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _render(tokenizer, messages: list[dict], generation_prompt: bool, spans: bool = False):
    """The chat template's text (and, with spans=True, its {% generation %} character spans), rendered
    the way `apply_chat_template` renders it, with the tokenizer's special tokens as variables."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=[messages], chat_template=tokenizer.chat_template, return_assistant_tokens_mask=spans,
            add_generation_prompt=generation_prompt, **tokenizer.special_tokens_map)
    except TemplateError as e:  # a template bug, or one that refuses this conversation (roles, order)
        raise DataError(f"the chat template failed on a conversation ({type(e).__name__}: {e}); fix chat_template "
                        "or the data") from None
    return (texts[0], [tuple(s) for s in indices[0]]) if spans else texts[0]


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
        return _render(tokenizer, messages, False, spans=True)
    full = _render(tokenizer, messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[:i + 1], False)
        if not through.startswith(before):
            raise DataError(f"the chat template renders the conversation before assistant message {i} differently "
                            "once that message is added, so its tokens cannot be located; mark assistant turns with "
                            "{% generation %}...{% endgeneration %} in chat_template, or set train_on_prompt=true")
        if full.startswith(through) and len(before) >= cursor:
            spans.append((len(before), len(through)))
        else:
            without = _render(tokenizer, messages[:i], False)
            same = next((k for k, (a, b) in enumerate(zip(before, without)) if a != b), min(len(before), len(without)))
            prompt = before[same:]  # the generation prompt (or its end, where a closing EOS shares its first chars)
            start, limit = cursor, len(full)
            if prompt and full.find(prompt, cursor) >= 0:
                start = full.find(prompt, cursor) + len(prompt)
                limit = full.find(prompt, start) % (len(full) + 1)  # the next turn's prompt, else the end
            spans.append(_find_turn(full[:limit], through[len(before):], start, m["content"], i))
        cursor = spans[-1][1]
    return full, spans


def _find_turn(full: str, body: str, start: int, content: str, index: int) -> tuple[int, int]:
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
    characters to tokens with the tokenizer's offsets: a token is labelled if it ends inside a turn (a
    word-start token that carries the space before the answer is the answer's; a token that only begins
    with the turn's last characters is not). The template's BOS is kept; a template that renders none
    gets the tokenizer's own (see _bos), once."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("dataset_format=messages needs a tokenizer with a chat_template; set chat_template=... (a "
                        "file or the template itself), tokenizer=... to one that has it, or use "
                        "dataset_format=prompt_completion")
    text, spans = (_render(tokenizer, messages, False), []) if train_on_prompt else assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    bos = _bos(tokenizer)
    prefix = [] if enc.input_ids[:len(bos)] == bos else bos
    ids = (prefix + enc.input_ids)[:max_len]
    if train_on_prompt:
        return ids, list(ids)
    offsets = [(0, 0)] * len(prefix) + [tuple(o) for o in enc.offset_mapping]
    labels = [tok if any(lo < end <= hi for lo, hi in spans) else IGNORE for tok, (_, end) in zip(ids, offsets)]
    return ids, labels


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


def _load(source: str, split: str):
    import datasets

    try:
        if looks_local(source):
            path = Path(source).expanduser()
            files = [str(p) for p in _data_files(path)]
            suffix = Path(files[0]).suffix.lower().lstrip(".")
            builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[suffix]
            return datasets.load_dataset(builder, data_files=files, split="train")
        return datasets.load_dataset(source, split=split)
    except DataError:
        raise
    except Exception as e:  # network, missing split, unreadable file: all the user's to fix
        raise DataError(f"could not load dataset {source!r} (split {split!r}): {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
    return _fingerprint(body, getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token)


def tokenize_dataset(ds, fmt: str, tokenizer, recipe: Recipe, where: str):
    """Format, tokenize, drop examples with no target token, and pack; cached by content fingerprint."""
    if len(ds) == 0:
        raise DataError(f"{where}: the dataset is empty")
    if fmt == "auto":
        fmt = detect_format(ds.column_names, where)
    missing = [c for c in FORMAT_FIELDS[fmt] if c not in ds.column_names]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing} for dataset_format={fmt}")
    tok_fp = tokenizer_fingerprint(tokenizer)
    max_len, train_on_prompt = recipe.max_seq_len, recipe.train_on_prompt

    def encode(batch):
        out = {"input_ids": [], "labels": []}
        for i in range(len(batch[ds.column_names[0]])):
            row = {k: batch[k][i] for k in batch}
            ids, labels = encode_row(row, fmt, tokenizer, train_on_prompt, max_len)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    fp = _fingerprint(PIPELINE_VERSION, ds._fingerprint, fmt, tok_fp, max_len, train_on_prompt)
    ds = ds.map(encode, batched=True, remove_columns=ds.column_names, new_fingerprint=fp, desc=f"tokenize {where}")
    ds = ds.filter(lambda labels: any(x != IGNORE for x in labels[1:]), input_columns="labels",
                   new_fingerprint=_fingerprint(fp, "filter"), desc="drop rows without targets")
    if len(ds) == 0:
        raise DataError(f"{where}: no example has a response token left within max_seq_len={max_len}; "
                        "raise max_seq_len or set train_on_prompt=true")
    if recipe.packing:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ds = ds.map(lambda b: pack_rows(b["input_ids"], b["labels"], max_len, pad), batched=True, batch_size=1000,
                    new_fingerprint=_fingerprint(fp, "pack", "best-fit decreasing"), desc=f"pack {where}")
    return ds


@dataclass
class Datasets:
    train: object
    eval: object | None
    format: str


def build_datasets(recipe: Recipe, tokenizer) -> Datasets:
    """Load, split and tokenize. The loop runs it on each machine's main process first; the other
    ranks then find every step in the datasets cache (fingerprints are content-derived)."""
    from finetune.assets import resolve_dataset

    source = resolve_dataset(recipe.dataset)
    raw = _load(source, recipe.dataset_split)
    fmt = recipe.dataset_format if recipe.dataset_format != "auto" else detect_format(raw.column_names, source)
    if recipe.eval_dataset:
        raw_eval = _load(resolve_dataset(recipe.eval_dataset), recipe.dataset_split)
    elif recipe.eval_fraction > 0 and len(raw) >= 2:
        split = raw.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed, shuffle=True)
        raw, raw_eval = split["train"], split["test"]
    else:
        raw_eval = None
    train = tokenize_dataset(raw, fmt, tokenizer, recipe, source)
    evals = (tokenize_dataset(raw_eval, fmt, tokenizer, recipe, (recipe.eval_dataset or source) + " (eval)")
             if raw_eval is not None else None)
    return Datasets(train=train, eval=evals, format=fmt)


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


def collate(rows: list[dict], pad_id: int, packed: bool) -> dict:
    """Pad right to the longest row; packed rows are all full length and carry position ids instead of
    an attention mask, from which the model builds one block-causal mask per example."""
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


def target_tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def input_tokens(batch: dict) -> int:
    """Real tokens the model computes on: padding excluded (a packed row's tail pad is counted; it is
    shorter than one example)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def fetch(ds, indices: list[int], pad_id: int, packed: bool) -> dict:
    """Rows by index; index -1 is a placeholder (keeps ranks in lock-step) that carries no targets."""
    real = [i if i >= 0 else 0 for i in indices]
    cols = ds[real]
    rows = [{k: cols[k][j] for k in cols} for j in range(len(real))]
    for j, i in enumerate(indices):
        if i < 0:
            rows[j]["labels"] = [IGNORE] * len(rows[j]["labels"])
    return collate(rows, pad_id, packed)


def eval_batches(ds, micro_batch_size: int, rank: int, world_size: int, max_samples: int = 0) -> list[list[int]]:
    """The first `max_samples` eval rows (all if 0), each once across ranks, every rank the same number
    of batches (sharded models need every rank in every forward); the same rows whatever the world size."""
    n = min(len(ds), max_samples) if max_samples else len(ds)
    per_rank = -(-n // world_size)
    mine = [i if i < n else -1 for i in range(rank, per_rank * world_size, world_size)]
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
