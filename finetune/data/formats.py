"""The dataset formats: detection from the columns, and the checks of a row and its roles."""

from __future__ import annotations

from finetune.recipe import ROLES, RecipeError


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


def sharegpt_hint(fields) -> str:
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
                            f"{', '.join(FORMAT_FIELDS[fmt])}){sharegpt_hint(row)}")
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
