"""What a run trains on, shown: a prepared row (or preference pair) with its trained tokens marked
(python -m finetune.data)."""

from __future__ import annotations

from finetune.data.formats import IGNORE


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
    """A prepared preference pair: its prompt once (the chosen side's tokens before its first trained
    token), then each side from where its own prompt ends, trained tokens marked as show_row marks them."""
    from finetune.data.preference import prompt_length

    lines = []
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        start = prompt_length(ids, labels)
        if side == "chosen":
            lines.append("prompt:   " + _marked(tokenizer, ids, labels, 0, 0, start, colour))
        lines.append(f"{side + ':':<10}" + _marked(tokenizer, ids, labels, 0, start, len(ids), colour))
    return "\n".join(lines)
