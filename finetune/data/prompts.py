"""Prompt rows (objective=grpo): a `prompt` column, text or a list of messages, and any other columns
(answer, ...), which are kept as they are for the reward functions (finetune/rewards.py).

A prompt's tokens are what generation continues from: a text prompt is the tokenizer's BOS (where it
adds one) then the text's tokens, as a prompt_completion row's prompt; a conversation is rendered by
the chat template with its generation prompt (the assistant turn opened), its tokens without added
special tokens, as apply_chat_template(messages, add_generation_prompt=True, tokenize=True) makes them.

A prompt longer than its budget: with max_prompt_len its start is cut, keeping its last max_prompt_len
tokens (the BOS, where the row starts with one, stays first and counts in the budget); without, a
prompt that leaves no room for max_completion_len within max_seq_len stops the run with the row named.

A prepared prompt row is its original columns plus PROMPT_COLUMNS: prompt_input_ids and n_tokens."""

from __future__ import annotations

from finetune.data.formats import DataError
from finetune.data.tokenization import bos_ids, render_chats

PROMPT_COLUMNS = ["prompt_input_ids", "n_tokens"]
PROMPT_VERSION = "1"  # bump when a prompt's tokens change, to invalidate cached prompt data


def fit_prompt(ids: list[int], bos: list[int], max_prompt_len: int) -> list[int]:
    """The prompt's last max_prompt_len tokens, its leading BOS kept first (0: as it is)."""
    if not max_prompt_len or len(ids) <= max_prompt_len:
        return ids
    keep = len(bos) if bos and ids[:len(bos)] == bos else 0
    return ids[:keep] + ids[len(ids) - (max_prompt_len - keep):]


def as_messages(prompt) -> list[dict]:
    """A prompt as a conversation: a text prompt is one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def encode_prompts(rows: list[dict], tokenizer, *, max_prompt_len: int = 0, room: int = 0,
                   where: list[str] | None = None, tools: list[dict] | None = None) -> dict:
    """PROMPT_COLUMNS of checked prompt rows: text prompts in one tokenizer call, conversations rendered
    in one template call. room: the most tokens a prompt may keep when max_prompt_len is 0
    (max_seq_len - max_completion_len; 0: no limit); a longer one is an error naming its row. tools: the
    JSON schemas of a multi-turn rollout's tools, which the template shows in every conversation (as
    TRL's apply_chat_template(..., tools=...)); a text prompt is then the user's message of one."""
    texts = [k for k, r in enumerate(rows) if isinstance(r["prompt"], str)]
    chats = [k for k, r in enumerate(rows) if not isinstance(r["prompt"], str)]
    ids: list = [None] * len(rows)
    bos = bos_ids(tokenizer)
    if tools:  # a multi-turn rollout's prompts are conversations: a text prompt is the user's message
        texts, chats = [], list(range(len(rows)))
    if texts:
        enc = tokenizer([rows[k]["prompt"] for k in texts], add_special_tokens=False).input_ids
        for k, e in zip(texts, enc):
            ids[k] = bos + e
    if chats:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("prompts given as messages need a tokenizer with a chat_template; set chat_template=... (a "
                            "file or the template itself), tokenizer=... to one that has it, or give prompts as text")
        rendered = render_chats(tokenizer, [as_messages(rows[k]["prompt"]) for k in chats], generation_prompt=True,
                                tools=tools)
        enc = tokenizer(rendered, add_special_tokens=False).input_ids
        for k, e in zip(chats, enc):
            ids[k] = e
    out = {"prompt_input_ids": [], "n_tokens": []}
    for k, row_ids in enumerate(ids):
        if max_prompt_len:
            row_ids = fit_prompt(row_ids, bos, max_prompt_len)
        elif room and len(row_ids) > room:
            name = where[k] if where else f"row {k}"
            raise DataError(f"{name}: the prompt has {len(row_ids)} tokens, more than the {room} that max_seq_len - "
                            "max_completion_len leaves; set max_prompt_len (its start is then cut), raise max_seq_len, "
                            "or shorten the prompt")
        out["prompt_input_ids"].append(row_ids)
        out["n_tokens"].append(len(row_ids))
    return out
