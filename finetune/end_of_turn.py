"""Which token ends an assistant turn, and the generation config a chat run saves with its model.

A chat model learns to end its answer with the token its chat template renders there (ChatML's
`<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`, Phi-3's and the embedded model's
`<|end|>`), which is often not the tokenizer's EOS. `generate`, vLLM and TGI stop at the ids in
generation_config.json's `eos_token_id` (a list is allowed), so a run that trained chats writes the
end-of-turn token there next to the EOS the model already had; otherwise the model would run on to
max_new_tokens after its answer. The token is read from the template the run used (the recipe's
chat_template included), not from a table of names: an assistant message whose content is a
sentinel is rendered, and the first token of what the template puts after it is taken if it is a
special or added token (see end_of_turn).

config.json is left as it is: transformers' `generate` reads the stop ids from generation_config.json
only (config.json's eos_token_id seeds a generation config only when a model has none), vLLM and TGI
read generation_config.json too, and TRL's chat setup (clone_chat_template) likewise changes the
generation config, not the model config. config.json keeps naming the tokenizer's EOS, one int, which
code reading the model config expects.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data import DataError, render_chat

SENTINEL = "Zq7xk"  # an answer no template rewrites (no spaces to trim, no reasoning tags)
CHAT_FORMATS = ("messages",)  # the formats rendered with the chat template (finetune.data.encode_messages)


@dataclass(frozen=True)
class EndOfTurn:
    """What ends an assistant turn under a chat template. ids: the stop token(s) to add to
    generation_config.eos_token_id (empty when the template ends a turn with no special or added
    token); marker: the text the template renders right after an answer; note: why nothing is
    added, when nothing is."""

    ids: tuple[int, ...]
    tokens: tuple[str, ...]
    marker: str
    note: str = ""


def _marker(tokenizer) -> str | None:
    """The text the template renders between an assistant answer's end and whatever comes next: the
    part a conversation that goes on (a next user message) and one that ends there (the conversation's
    own closing text, as Phi-3's closing EOS) have in common. None if the template renders no
    conversation of user, assistant (and user) messages, or drops the answer."""
    user, answer, more = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL},
                          {"role": "user", "content": "Bye"})
    tails = []
    for messages in ([user, answer, more], [user, answer]):
        try:
            text = render_chat(tokenizer, messages, False)
        except DataError:  # a template that refuses a conversation ending with a user/assistant message
            continue
        at = text.find(SENTINEL)
        if at >= 0:
            tails.append(text[at + len(SENTINEL):])
    if not tails:
        return None
    common = tails[0]
    for tail in tails[1:]:
        same = next((k for k, (a, b) in enumerate(zip(common, tail)) if a != b), min(len(common), len(tail)))
        common = common[:same]
    return common


def _is_special(tokenizer, token_id: int) -> bool:
    """A token the tokenizer never makes out of ordinary text: its special tokens and added tokens."""
    return token_id in set(tokenizer.all_special_ids) or token_id in tokenizer.added_tokens_decoder


def end_of_turn(tokenizer) -> EndOfTurn:
    """The end-of-turn token of the tokenizer's chat template: the first token of the text the template
    renders right after an assistant message's content (leading whitespace skipped), if that token is
    a special or added token.

    Only that first token: generation stops at it, so whatever the template renders after it (ChatML's
    "\\n" after `<|im_end|>`, a closing EOS) is never generated. An ordinary token is never made a stop
    token, even where the template's marker is made of ordinary tokens only ("</s>" where the
    tokenizer does not know it, "### End", a bare newline): as an eos_token_id it would cut off
    every answer that contains it in its text. Such a template gets nothing added, and `note` says
    why (the run summary shows it)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return EndOfTurn((), (), "", "the tokenizer has no chat template")
    marker = _marker(tokenizer)
    if marker is None:
        return EndOfTurn((), (), "", "the chat template renders no user/assistant conversation with the answer in it")
    stripped = marker.lstrip()
    ids = tokenizer(stripped, add_special_tokens=False).input_ids if stripped else []
    if ids and _is_special(tokenizer, ids[0]):
        return EndOfTurn((ids[0],), (tokenizer.convert_ids_to_tokens(ids[0]),), marker)
    if not stripped:
        note = "the chat template renders no end-of-turn marker after an answer"
    else:
        shown = stripped.rstrip()
        count = len(tokenizer(shown, add_special_tokens=False).input_ids)
        note = (f"the chat template ends an answer with {shown!r}, {count} ordinary token(s) of this tokenizer, "
                "not a special token that can stop generation; add it to the tokenizer as a special token (or use "
                "a template whose turns end with one), or stop on the string at inference")
    return EndOfTurn((), (), marker, note)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_ids(current, tokenizer, turn: EndOfTurn) -> list[int]:
    """generation_config.eos_token_id for a chat run: the ids it had (the base model's generation
    config, e.g. Llama 3 Instruct's three), the tokenizer's EOS, then the end-of-turn token, each once."""
    ids = _as_list(current) + _as_list(tokenizer.eos_token_id) + list(turn.ids)
    return list(dict.fromkeys(ids))


def trains_chats(formats) -> bool:
    """Whether a run with these data formats (one per source, as resolved) renders chat templates."""
    return any(f in CHAT_FORMATS for f in formats)


def with_end_of_turn(generation_config, tokenizer, chats: bool):
    """(generation config to save, EndOfTurn or None): a copy of generation_config whose eos_token_id
    also names the template's end-of-turn token when the run trained chats; unchanged otherwise (a
    prompt_completion, alpaca or text run ends its rows with the EOS, which the config names already)."""
    import copy

    if not chats:
        return generation_config, None
    turn = end_of_turn(tokenizer)
    ids = stop_ids(generation_config.eos_token_id, tokenizer, turn)
    if ids == _as_list(generation_config.eos_token_id):
        return generation_config, turn
    updated = copy.deepcopy(generation_config)
    updated.eos_token_id = ids if len(ids) > 1 else ids[0]
    return updated, turn


def describe(turn: EndOfTurn | None, generation_config) -> str:
    """One line for the run summary and the log: which tokens stop generation, and why."""
    if turn is None:
        return f"eos_token_id {generation_config.eos_token_id} (the data has no chats)"
    eos = generation_config.eos_token_id
    if turn.ids:
        return (f"{' '.join(turn.tokens)} (id {', '.join(map(str, turn.ids))}) ends an assistant turn; "
                f"generation_config.eos_token_id {eos}")
    return f"generation_config.eos_token_id {eos}; no end-of-turn token added: {turn.note}"


def base_generation_config(model_path: str, config):
    """The model's own generation config (its generation_config.json, else derived from config.json),
    as from_pretrained sets it."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return GenerationConfig.from_model_config(config)


def checkpoint_generation_config(hf_dir, base, recipe: dict, tokenizer):
    """The generation config an export of a checkpoint writes: the one the run saved in the
    checkpoint's hf/ directory (what final/ of the run holds); for a checkpoint written before runs
    saved one, `base` (the model's own) with the end-of-turn token of the saved tokenizer's template
    added when the recipe names messages data (a dataset_format=auto run cannot be told apart then,
    and keeps `base`)."""
    from pathlib import Path

    from transformers import GenerationConfig

    if (Path(hf_dir) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(hf_dir)
    formats = [recipe.get("dataset_format")] + [d.get("format") for d in recipe.get("datasets") or []
                                                if isinstance(d, dict)]
    return with_end_of_turn(base, tokenizer, trains_chats(formats))[0]
