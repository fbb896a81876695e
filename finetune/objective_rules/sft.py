"""SFT's recipe rules: it owns no key and takes none of the other objectives' (finetune/training/objectives/sft.py)."""

from __future__ import annotations

NAME = "sft"
FIELDS: tuple[str, ...] = ()
SHARES: tuple[str, ...] = ()
ROWS = ()  # any SFT format (alpaca, messages, prompt_completion, text)
FORWARD_ROWS = 1
PAIR_BATCHES = False


def check(r, strategy) -> None:
    return None


def reference(r) -> str | None:
    return None
