"""Mixtures: the train and eval sets of a recipe, from one source or a weighted mixture of several."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from finetune.data.formats import DataError, detect_format
from finetune.data.loading import (COUNTS, RowNames, budget_note, cache_fingerprint, load_source, pack_dataset,
                                   tokenize_dataset)
from finetune.data.sources import (check_columns, check_objective, eval_source, first_row_of, map_row,
                                   train_sources, with_sharegpt)
from finetune.recipe import DataSource, Recipe


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
    """Each row's counts; prompt rows (objective=grpo) have no targets (their completions are generated)."""
    present = [k for k in COUNTS if k in ds.column_names]
    cols = ds.select_columns(present).with_format("numpy")[:]
    return {k: np.asarray(cols[k], dtype=np.int64) if k in present else np.zeros(len(ds), dtype=np.int64)
            for k in COUNTS}


def _longest(ds, n_tokens: np.ndarray) -> np.ndarray:
    """Each row's tokens (n_tokens), or a pair's longer side's: what max_seq_len cuts."""
    if "chosen_input_ids" not in ds.column_names:
        return n_tokens
    import pyarrow.compute as pc

    table = ds.select_columns(["chosen_input_ids", "rejected_input_ids"]).with_format("arrow")[:]
    return np.maximum(*(pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False).astype(np.int64)
                        for c in ("chosen_input_ids", "rejected_input_ids")))


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
    parts, held, formats, raw_rows, drops, pairs = [], [], [], [], [], []
    for i, (key, split_key, spec) in enumerate(sources):
        raw = load_source(spec, key, split_key)
        spec = with_sharegpt(spec, raw.column_names, first_row_of(raw))
        where = spec.path if not recipe.datasets else f"datasets[{i}] {spec.path}"
        names = check_columns(raw.column_names, spec, where)
        fmt = spec.format if spec.format != "auto" else detect_format(names, where)
        check_objective(recipe, fmt, key, spec.path, lambda: names)
        raw_held = None
        if evaluated is None and recipe.eval_fraction > 0 and len(raw) >= 2:
            split = raw.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed, shuffle=True)
            raw, raw_held = split["train"], split["test"]
        names = RowNames.of(raw, where, spec)
        raw_rows.append(len(raw))
        formats.append(fmt)
        drops.append({})
        if fmt in ("preference", "unpaired"):  # how its prompts were rendered, for `finetune chat` (recipe.json)
            first = map_row(first_row_of(raw), spec, where) if len(raw) else {}
            side = first.get("chosen" if fmt == "preference" else "completion")
            pairs.append("conversational" if isinstance(side, list) else "text")
        elif fmt == "prompt":  # GRPO's prompts: text (BOS + text) or conversations (the chat template)
            first = map_row(first_row_of(raw), spec, where) if len(raw) else {}
            pairs.append("conversational" if isinstance(first.get("prompt"), list) else "text")
        else:
            pairs.append(None)
        parts.append(tokenize_dataset(raw, fmt, tokenizer, recipe, where, spec=spec, pack=False, keep_counts=True,
                                      dropped=drops[-1], row_names=names))
        if raw_held is not None:
            held.append(tokenize_dataset(raw_held, fmt, tokenizer, recipe, where + " (eval)", spec=spec,
                                         pack=False, keep_counts=True, row_names=RowNames.of(raw_held, where, spec)))
    specs = [spec for _, _, spec in sources]
    available = [len(p) for p in parts]
    counts = mixture_counts(available, specs, [key for key, _, _ in sources])
    picks = mixture_indices(available, counts, recipe.seed)
    stats = []
    for i, ((key, split_key, spec), part, pick) in enumerate(zip(sources, parts, picks)):
        rows = _row_counts(part)
        stats.append({"source": key.removesuffix(".path"), "path": spec.path, "format": formats[i],
                      "split": spec.split, "weight": spec.weight, "rows_wanted": spec.rows, "rows": raw_rows[i],
                      "kept": available[i], "dropped_no_target": drops[i].get("no_target", 0),
                      "dropped_identical": drops[i].get("identical", 0),
                      "at_max_seq_len": int((_longest(part, rows["n_tokens"]) >= recipe.max_seq_len).sum()),
                      "rows_in_mix": int(len(pick)), "tokens": int(rows["n_tokens"][pick].sum()),
                      "target_tokens": int(rows["n_targets"][pick].sum())}
                     | ({("prompts" if formats[i] == "prompt" else "pairs"): pairs[i]} if pairs[i] else {}))
    train = parts[0] if len(parts) == 1 else hf.concatenate_datasets(parts)
    offsets = np.cumsum([0] + available[:-1])
    order = np.concatenate([pick + off for pick, off in zip(picks, offsets)])
    row_sources = np.concatenate([np.full(len(pick), i, dtype=np.int32) for i, pick in enumerate(picks)])
    if not (len(order) == len(train) and np.array_equal(order, np.arange(len(train)))):
        train = train.select(order, new_fingerprint=cache_fingerprint(
            [p._fingerprint for p in parts], counts, recipe.seed, "mix"))
    summary = {"rows": len(train), "tokens": sum(s["tokens"] for s in stats),
               "target_tokens": sum(s["target_tokens"] for s in stats)}
    if recipe.packing:
        train = pack_dataset(train, tokenizer, recipe, "train")
        summary |= {"packed_rows": len(train),
                    "packing_efficiency": summary["tokens"] / (len(train) * recipe.max_seq_len)}
        row_sources = None
    else:
        train = train.remove_columns([c for c in COUNTS if c in train.column_names])

    fmt = formats[0] if len(set(formats)) == 1 else "mixed"
    evals = None
    if evaluated is not None:
        key, split_key, spec = evaluated
        raw_eval = load_source(spec, key, split_key)
        spec = with_sharegpt(spec, raw_eval.column_names, first_row_of(raw_eval))
        eval_fmt = formats[0] if not recipe.datasets and spec.format == "auto" and not isinstance(
            recipe.eval_dataset, DataSource) else spec.format
        if eval_fmt == "auto":
            where = f"{spec.path} (eval)"
            eval_fmt = detect_format(check_columns(raw_eval.column_names, spec, where), where)
        check_objective(recipe, eval_fmt, key, spec.path, lambda: raw_eval.column_names)
        evals = tokenize_dataset(raw_eval, eval_fmt, tokenizer, recipe, f"{spec.path} (eval)", spec=spec,
                                 pack=False, keep_counts=True,
                                 row_names=RowNames.of(raw_eval, f"{spec.path} (eval)", spec))
    elif held:
        evals = held[0] if len(held) == 1 else hf.concatenate_datasets(held)
    if evals is not None:
        rows = _row_counts(evals)
        summary["eval"] = {"rows": len(evals), "tokens": int(rows["n_tokens"].sum()),
                           "target_tokens": int(rows["n_targets"].sum())}
        evals = pack_dataset(evals, tokenizer, recipe, "eval") if recipe.packing else evals.remove_columns(
            [c for c in COUNTS if c in evals.column_names])
    return Datasets(train=train, eval=evals, format=fmt, sources=stats, summary=summary, row_sources=row_sources)


def summary_lines(data: Datasets, recipe: Recipe) -> list[str]:
    """One line per source (rows, rows dropped and why, rows and tokens in the mix), then the totals."""
    lines = []
    for s in data.sources:
        share = f"rows={s['rows_wanted']}" if s["rows_wanted"] else f"weight {s['weight']:g}"
        why = (f"chosen or rejected has no response token within max_seq_len={recipe.max_seq_len}{budget_note(recipe)}"
               if s["format"] == "preference" else f"no target token within max_seq_len={recipe.max_seq_len}")
        dropped = f", {s['dropped_no_target']} dropped ({why})" if s["dropped_no_target"] else ""
        if s["dropped_identical"]:
            dropped += (f", {s['dropped_identical']} dropped (chosen and rejected identical within "
                        f"max_seq_len={recipe.max_seq_len}{budget_note(recipe)}: they differ only after it)")
        dropped = dropped or ", none dropped"
        cut = f", {s['at_max_seq_len']} cut at max_seq_len" if s["at_max_seq_len"] else ""
        lines.append(f"data {s['source']} {s['path']} ({s['format']}, split {s['split']}): {s['rows']} rows"
                     f"{dropped}{cut}; {share}: {s['rows_in_mix']} rows in the mix, {token_counts(s, recipe)}")
    t = data.summary
    line = f"data train: {t['rows']} rows{labels(data.train)}, {token_counts(t, recipe)}"
    if recipe.objective != "grpo":
        line += f" ({100 * t['target_tokens'] / max(t['tokens'], 1):.1f}%)"
    if "packed_rows" in t:
        line += (f"; packed into {t['packed_rows']} rows of {recipe.max_seq_len}: "
                 f"{100 * t['packing_efficiency']:.1f}% of their tokens are real")
    else:
        line += "; packing off"
    lines.append(line)
    if "eval" in t:
        e = t["eval"]
        lines.append(f"data eval: {e['rows']} rows{labels(data.eval)}, {token_counts(e, recipe)}")
    return lines


def labels(ds) -> str:
    """Unpaired rows' (KTO's) labels, counted: ' (N desirable, M undesirable)'; '' for other rows."""
    if ds is None or "desirable" not in ds.column_names:
        return ""
    good = int(sum(ds["desirable"]))
    return f" ({good} desirable, {len(ds) - good} undesirable)"


def token_counts(counts: dict, recipe: Recipe) -> str:
    """Tokens and target tokens; prompts alone for GRPO, whose targets are the completions it samples."""
    if recipe.objective == "grpo":
        return f"{counts['tokens']} prompt tokens (the completions are sampled)"
    return f"{counts['tokens']} tokens, {counts['target_tokens']} target tokens"
