"""What every objective's rules use: a field's default, and the one refusal of a key set under another
objective."""

from __future__ import annotations

import dataclasses

from finetune.errors import RecipeError


def default(recipe, key: str):
    """The recipe field's default (the schema's, read from the dataclass: this package sits below recipe.py)."""
    field = next(f for f in dataclasses.fields(recipe) if f.name == key)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def refuse_foreign(r, name: str, fields: tuple[str, ...], shared: tuple[str, ...] = (), lists: tuple[str, ...] = ()
                   ) -> None:
    """Objective `name`'s keys left at their defaults under another objective (r.objective), but for the
    ones that objective shares (`shared`): the first changed one refused, naming it. lists: keys whose
    value is written comma-separated."""
    changed = [k for k in fields if k not in shared and getattr(r, k) != default(r, k)]
    if changed:
        key = changed[0]
        shown = ",".join(map(str, getattr(r, key))) if key in lists else getattr(r, key)
        raise RecipeError(f"{key}={shown} applies to objective={name} only; set objective={name}, or leave {key} out")


def check_prompt_budget(r) -> None:
    """A preference-style objective's prompt cut (max_prompt_len) leaves room for a response."""
    if r.max_prompt_len and r.max_prompt_len >= r.max_seq_len:
        raise RecipeError(f"max_prompt_len={r.max_prompt_len} leaves no room for a response within "
                          f"max_seq_len={r.max_seq_len}; lower max_prompt_len (or 0: no limit but max_seq_len)")
