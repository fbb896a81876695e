"""The dataset formats: detection from the columns, and the checks of a row and its roles."""

from __future__ import annotations

from finetune.recipe import ROLES, RecipeError


IGNORE = -100
FORMAT_FIELDS = {
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "text": ("text",),
    "preference": ("chosen", "rejected"),  # and an optional prompt (split_pair reads the three shapes)
    "prompt": ("prompt",),  # objective=grpo: prompts alone, other columns kept for the rewards (data/prompts.py)
    "unpaired": ("prompt", "completion", "label"),  # objective=kto: a completion, desirable or not (data/unpaired.py)
}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PIPELINE_VERSION = "4"  # bump when tokenization/packing output changes, to invalidate caches


class DataError(RecipeError):
    """Bad dataset content: reported like any recipe error, one line naming file and row."""


def detect_format(columns, where: str) -> str:
    cols = set(columns)
    if {"chosen", "rejected"} <= cols:  # before messages: UltraFeedback-binarized rows carry both
        return "preference"
    if {"completion", "label"} <= cols:  # before prompt_completion: KTO's rows are those and a label
        return "unpaired"
    if "messages" in cols:
        return "messages"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    if "prompt" in cols:  # a prompt and no answer to train on: prompts to generate from (objective=grpo)
        return "prompt"
    raise DataError(
        f"{where}: cannot tell the dataset format from its fields {sorted(cols)}; expected messages, "
        "instruction+output (alpaca), prompt+completion, text, chosen+rejected (preference), "
        "prompt+completion+label (unpaired, for objective=kto), or prompt alone "
        "(prompts, for objective=grpo); or set dataset_format=..."
    )


def sharegpt_hint(fields) -> str:
    """What to set when rows that hold ShareGPT conversations are read as another format."""
    if "conversations" in fields and "messages" not in fields:
        return ("; these rows hold ShareGPT conversations: set dataset_format=messages (or auto; format='messages' "
                "on a DataSource), which reads conversations of {from, value} as messages")
    return ""


ROWS_OF = {"preference": "preference pairs (chosen, rejected), which train with objective=dpo",
           "messages": "conversations (messages)", "alpaca": "alpaca rows (instruction, output)",
           "prompt_completion": "prompt_completion rows (prompt, completion)", "text": "plain text rows (text)",
           "prompt": "prompt rows (prompt, other columns for the rewards), which train with objective=grpo",
           "unpaired": "unpaired rows (prompt, completion, label), which train with objective=kto"}


def format_hint(fields, fmt: str) -> str:
    """What to set when rows of another format (as dataset_format=auto would read them) are read as
    fmt: ShareGPT conversations, preference pairs, or another format's fields."""
    if sharegpt_hint(fields):
        return sharegpt_hint(fields)
    try:
        found = detect_format(fields, "")
    except DataError:
        return ""
    if set(FORMAT_FIELDS[found]) <= set(FORMAT_FIELDS[fmt]):  # fmt's row lacking a field (a prompt row: its
        return ""  # completion; a prompt_completion row: an unpaired row's label): not another format
    return f"; these rows hold {ROWS_OF[found]}: set dataset_format={found} (or auto; format='{found}' on a DataSource)"


# every top-level field some format reads (alpaca's optional input, ShareGPT's conversations): a row's
# other fields are those a column mapping may read a missing one from
READ_FIELDS = {name for fields in FORMAT_FIELDS.values() for name in fields} | {"input", "conversations"}


def mapping_hint(fields, needed) -> str:
    """Advice that works as typed for a format's fields the rows lack: read each from a field of the rows
    that no format reads, with the recipe key `columns` (columns=label:thumbs); "" where the rows lack
    nothing or have no such field."""
    have = set(fields)
    missing = [name for name in needed if name not in have]
    unread = sorted(str(name) for name in have if name not in READ_FIELDS)
    if not missing or not unread:
        return ""
    if len(missing) == 1 and len(unread) == 1:
        return f"if the rows' field {unread[0]} holds {missing[0]}, map it: columns={missing[0]}:{unread[0]}"
    return (f"map the rows' fields that hold {', '.join(missing)}: columns={','.join(f'{m}:FIELD' for m in missing)}, "
            f"each FIELD one of {', '.join(unread)}")


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


def check_messages(msgs, where: str, name: str = "messages") -> None:
    """A non-empty list of {role, content} strings with roles the templates know."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: {name!r} must be a non-empty list of {{role, content}}")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message needs string 'role' and 'content', got {m!r:.80}")
    check_roles(msgs, where)


def check_row(row, fmt: str, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in FORMAT_FIELDS[fmt]:
        if name not in row or row[name] is None:
            mapped = mapping_hint([k for k, v in row.items() if v is not None], FORMAT_FIELDS[fmt])
            raise DataError(f"{where}: missing field {name!r} (dataset_format={fmt} needs "
                            f"{', '.join(FORMAT_FIELDS[fmt])})" + (format_hint(row, fmt) or (mapped and f"; {mapped}")))
    if fmt == "preference":
        return check_pair(row, where)
    if fmt == "prompt":
        return check_prompt_row(row, where)
    if fmt == "unpaired":
        return check_unpaired(row, where)
    if fmt == "messages":
        msgs = row["messages"]
        check_messages(msgs, where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message to learn from")
    else:
        for name in FORMAT_FIELDS[fmt]:
            if not isinstance(row[name], str):
                raise DataError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")


# ---------------------------------------------------------------- preference rows (finetune/data/preference.py)


def _kind(value) -> str:
    return "a string" if isinstance(value, str) else "a list of messages" if isinstance(value, list) else \
        f"a {type(value).__name__}"


def extract_prompt(chosen, rejected):
    """(prompt, chosen, rejected) of an implicit-prompt pair: their longest common prefix (of characters
    or of messages) is the prompt, as TRL's extract_prompt cuts it: a space just before the first
    difference goes to the sides; where one is the other's start, the shorter keeps its last item.
    (TRL's cut at a difference in the very first character would move a trailing space of chosen into
    the prompt: the space rule applies after the first item only here.)"""
    n = min(len(chosen), len(rejected))
    at = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if at is None:
        at = max(n - 1, 0)
    elif at > 0 and chosen[at - 1] == " ":
        at -= 1
    return chosen[:at], chosen[at:], rejected[at:]


def split_pair(row: dict):
    """(prompt, chosen, rejected, conversational) of a checked preference row (check_pair)."""
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    conversational = isinstance(chosen, list)
    if prompt is not None and isinstance(prompt, list) == conversational:
        return prompt, chosen, rejected, conversational
    return (*extract_prompt(chosen, rejected), conversational)


def check_pair(row: dict, where: str) -> None:
    """A preference row's checks (chosen and rejected are present): both sides strings or both lists
    of messages, a prompt (if any) a string or messages, the sides different, and, in conversations,
    an assistant message on each side after the prompt."""
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: field {name!r} must be a string or a list of {{role, content}} messages, got "
                            f"{_kind(value)}")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError(f"{where}: 'chosen' is {_kind(chosen)} and 'rejected' {_kind(rejected)}; both must be strings "
                        "or both lists of messages")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise DataError(f"{where}: field 'prompt' must be a string or a list of {{role, content}} messages, got "
                        f"{_kind(prompt)}")
    if isinstance(prompt, list) and isinstance(chosen, str):
        raise DataError(f"{where}: 'prompt' is a list of messages but 'chosen' and 'rejected' are strings; give the "
                        "sides as lists of (assistant) messages, or the prompt as a string")
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical, so the pair prefers nothing; drop the row "
                        "or fix one side")
    if isinstance(chosen, list):
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if name != "prompt" or isinstance(value, list):
                check_messages(value, where, name)
        _, chosen_side, rejected_side, _ = split_pair(row)
        for name, side in (("chosen", chosen_side), ("rejected", rejected_side)):
            if not any(m["role"] == "assistant" for m in side):
                raise DataError(f"{where}: {name!r} has no assistant message after the prompt, so there is no answer "
                                "to prefer; each side needs the assistant's answer")


# ---------------------------------------------------------------- unpaired rows (finetune/data/unpaired.py)


def check_unpaired(row: dict, where: str) -> None:
    """An unpaired row's checks (objective=kto, TRL's unpaired preference format): a prompt and a
    completion, both strings or both lists of messages (the completion's with an assistant message), and
    a label true (desirable) or false (undesirable); 1 and 0 are read as true and false."""
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not (isinstance(label, bool) or type(label) is int and label in (0, 1)):
        raise DataError(f"{where}: field 'label' must be true (a desirable completion) or false (an undesirable one), "
                        f"got {label!r:.40}")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, (str, list)):
            raise DataError(f"{where}: field {name!r} must be a string or a list of {{role, content}} messages, got "
                            f"{_kind(value)}")
    if isinstance(prompt, str) != isinstance(completion, str):
        raise DataError(f"{where}: 'prompt' is {_kind(prompt)} and 'completion' {_kind(completion)}; both must be "
                        "strings or both lists of messages")
    if isinstance(completion, str):
        if not completion:
            raise DataError(f"{where}: the completion is empty, so there is nothing to label")
        return
    check_messages(prompt, where, "prompt")
    check_messages(completion, where, "completion")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}: 'completion' has no assistant message, so there is no answer to label; give the "
                        "assistant's answer as the completion")


# ---------------------------------------------------------------- prompt rows (finetune/data/prompts.py)


def check_prompt_row(row: dict, where: str) -> None:
    """A prompt row: its prompt a non-empty string, or a non-empty list of messages that does not end
    with the assistant's turn (generation writes that turn)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: the prompt is empty")
        return check_text(prompt, where, "the prompt")
    if not isinstance(prompt, list):
        raise DataError(f"{where}: field 'prompt' must be a string or a list of {{role, content}} messages, got "
                        f"{'nothing' if prompt is None else 'a ' + type(prompt).__name__}")
    check_messages(prompt, where, "prompt")
    if prompt[-1]["role"] == "assistant":
        raise DataError(f"{where}: the prompt's last message is the assistant's; a prompt ends with the turn the "
                        "model answers (user, or tool), and its completion is generated")
    for i, message in enumerate(prompt):
        if isinstance(message.get("content"), str):
            check_text(message["content"], where, f"the prompt's message {i}")


def check_text(text: str, where: str, what: str) -> None:
    """Text a tokenizer can read: no lone surrogate (half of a UTF-16 pair, as a JSON escape like
    \\ud83d without its other half decodes), which is not a character and cannot be encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: {what} holds a lone surrogate ({text[e.start]!r} at character {e.start}: half of a "
                        "UTF-16 pair, not a character), which no tokenizer can read; write the whole character, or "
                        "drop it") from None
