"""What a run trains on, shown: a prepared row (or preference pair) with its trained tokens marked, or a
prompt row (objective=grpo) as generation continues it, with the columns its reward functions get
(python -m finetune.data)."""

from __future__ import annotations

import json

from finetune.data.formats import IGNORE
from finetune.data.prompts import PROMPT_COLUMNS


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
        pieces.append(_marked(tokenizer, ids, labels, a, a, b, colour))
    return " || ".join(pieces)


def _marked(tokenizer, ids: list[int], labels: list[int], first: int, a: int, b: int, colour: bool) -> str:
    """ids[a:b] as text, the trained tokens marked; `first` is its example's first token, never trained."""
    text, k = "", a
    while k < b:
        trained = k > first and labels[k] != IGNORE
        end = k
        while end < b and (end > first and labels[end] != IGNORE) == trained:
            end += 1
        piece = tokenizer.decode(ids[k:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text += (f"{GREEN}{piece}{RESET}" if colour else f"[[{piece}]]") if trained else piece
        k = end
    return text


def show_pair(tokenizer, row: dict, colour: bool = False) -> str:
    """A prepared preference pair: its prompt once (the tokens both sides start with, up to the first
    trained one), then each side from there, trained tokens marked as show_row marks them."""
    from finetune.data.preference import prompt_length

    sides = [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for side in ("chosen", "rejected")]
    (chosen, _), (rejected, _) = sides
    shared = min(prompt_length(ids, labels) for ids, labels in sides)
    shared = next((k for k in range(shared) if chosen[k] != rejected[k]), shared)
    lines = ["prompt:   " + _marked(tokenizer, *sides[0], 0, 0, shared, colour)]
    for side, (ids, labels) in zip(("chosen", "rejected"), sides):
        lines.append(f"{side + ':':<10}" + _marked(tokenizer, ids, labels, 0, shared, len(ids), colour))
    return "\n".join(lines)


def prompt_columns(row: dict) -> list[str]:
    """A prompt row's columns handed to the reward functions: all but the prompt and its tokens."""
    return [k for k in row if k != "prompt" and k not in PROMPT_COLUMNS]


def show_prompt(tokenizer, row: dict, colour: bool = False) -> str:
    """A prepared prompt row: its tokens as the model continues them (a conversation rendered by the chat
    template with its generation prompt, a text prompt after the BOS), then each other column, which
    the reward functions get as a keyword argument. Nothing in it is trained: its completions are
    generated at each step."""
    text = tokenizer.decode(row["prompt_input_ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    lines = ["prompt:   " + text]
    for key in prompt_columns(row):
        value = row[key]
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        name = f"{GREEN}{key}:{RESET}" if colour else f"{key}:"
        lines.append(f"{name}{' ' * max(1, 10 - len(key) - 1)}{shown}")
    return "\n".join(lines)
