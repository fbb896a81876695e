"""What a run trains on, shown: a prepared row with its trained tokens marked (python -m finetune.data)."""

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
