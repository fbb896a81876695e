"""Tokenization: a row -> input ids and labels (the target tokens) for each format, chat templates
rendered with their assistant spans, and packing."""

from __future__ import annotations

import bisect
import re

import numpy as np

from finetune.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, DataError, IGNORE


#
# One rule for every format: a row starts the way inference starts it: a prompt_completion/alpaca/text
# row as `tokenizer(prompt)` does (the BOS that the tokenizer adds by itself: Llama, Mistral, Gemma;
# nothing for Qwen or GPT-2), a chat row as `apply_chat_template(messages, tokenize=True)` does (the
# template's BOS if it renders one, else none: serving adds none); texts are tokenized without special
# tokens so that nothing is added twice; a prompt_completion/alpaca/text row ends with one EOS, a chat
# row with the end-of-turn markers its template renders, which are labelled as part of their
# assistant turn. The row's text is its parts joined (prompt + completion; the template's rendering),
# tokenized as one text, so it decodes to exactly that text; a token is trained where it holds a
# character of what the model learns to produce (see _trained_from and _span_labels).


def bos_ids(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before any text by itself (its BOS, or nothing).

    Read from the tokenizer's own behaviour, not from `bos_token`: a sentencepiece Llama/Mistral
    tokenizer adds `<s>`, a Llama-3 tokenizer `<|begin_of_text|>` through its post-processor, GPT-2's
    has a bos_token it never adds, Qwen's has none."""
    plain = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return list(full[:k])
    return full[:1] if full and full[0] == tokenizer.bos_token_id else []


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _without_eos(tokenizer, text: str) -> str:
    """A response that already ends with the EOS string gets its EOS from us, once."""
    eos = tokenizer.eos_token
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _trained_from(prompt_ids: list[int], both: list[int]) -> int:
    """Where the completion's tokens start in prompt + completion tokenized together: after the tokens
    it shares with the prompt tokenized alone (TRL's common_prefix_length). Usually that is all of the
    prompt's tokens; where a token merges across the seam (a prompt ending in a space: sentencepiece's
    `▁` and a byte-level BPE's ` ` join the completion's first word, `▁Paris`), the merged token holds
    the completion's first characters and is trained with it."""
    n = 0
    while n < min(len(prompt_ids), len(both)) and prompt_ids[n] == both[n]:
        n += 1
    return n


def _prompt_completion_row(bos, prompt_ids, both, eos, train_on_prompt: bool, max_len: int):
    start = _trained_from(prompt_ids, both)
    prompt, completion = bos + both[:start], both[start:] + eos
    ids = (prompt + completion)[:max_len]
    labels = (prompt if train_on_prompt else [IGNORE] * len(prompt)) + completion
    return ids, labels[:max_len]


def encode_prompt_completion(tokenizer, prompt: str, completion: str, train_on_prompt: bool, max_len: int):
    """BOS + (prompt + completion, tokenized as one text) + EOS; labels on the completion and its EOS.

    As TRL's SFTTrainer does: the row decodes to exactly prompt + completion (the completion
    tokenized alone would start with sentencepiece's word-start `▁`: "Answer: " + "Paris" would read
    "Answer:  Paris"), and the completion starts where the prompt's own tokens stop matching
    (_trained_from)."""
    completion = _without_eos(tokenizer, completion)
    return _prompt_completion_row(bos_ids(tokenizer), text_ids(tokenizer, prompt),
                                  text_ids(tokenizer, prompt + completion), _eos(tokenizer), train_on_prompt, max_len)


def encode_text(tokenizer, text: str, max_len: int):
    ids = (bos_ids(tokenizer) + text_ids(tokenizer, _without_eos(tokenizer, text)) + _eos(tokenizer))[:max_len]
    return ids, list(ids)


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template_failed(tokenizer, error: Exception) -> DataError:
    """A chat template that fails while rendering: raise_exception() and Jinja's own errors
    (TemplateError), and the Python errors of its expressions (a TypeError adding a str to an int,
    a ZeroDivisionError), said as one line naming where the template comes from."""
    where = getattr(tokenizer, "chat_template_source", None) or f"the tokenizer's, {tokenizer.name_or_path}"
    message = str(error).splitlines()[0] if str(error) else ""
    return DataError(f"the chat template ({where}) failed on a conversation ({type(error).__name__}: {message}); "
                     "fix the template (or set the recipe's chat_template to one that renders this data), or the data")


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool, spans: bool = False, tools=None):
    """The chat template's text (and, with spans=True, its {% generation %} character spans), rendered
    the way `apply_chat_template` renders it, with the tokenizer's special tokens as variables (and the
    tools' JSON schemas, where given)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=[messages], chat_template=tokenizer.chat_template, return_assistant_tokens_mask=spans,
            add_generation_prompt=generation_prompt, tools=tools or None, **tokenizer.special_tokens_map)
    except Exception as e:  # a template bug, or one that refuses this conversation (roles, order)
        raise _template_failed(tokenizer, e) from None
    return (texts[0], [tuple(s) for s in indices[0]]) if spans else texts[0]


def render_chats(tokenizer, conversations: list[list[dict]], spans: bool = False, generation_prompt: bool = False,
                 tools=None):
    """render_chat of many conversations in one call (one template lookup and setup for the batch)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=conversations, chat_template=tokenizer.chat_template, return_assistant_tokens_mask=spans,
            add_generation_prompt=generation_prompt, tools=tools or None, **tokenizer.special_tokens_map)
    except Exception as e:
        raise _template_failed(tokenizer, e) from None
    return [(t, [tuple(s) for s in i]) for t, i in zip(texts, indices)] if spans else list(texts)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and, per assistant turn, the characters the model learns to produce there:
    from the end of its generation prompt through its end-of-turn marker, as the turn appears in the
    full rendering.

    A template with {% generation %} blocks says so itself (the spans transformers'
    `return_assistant_tokens_mask` uses). Otherwise a turn is found by rendering the conversation up to
    it with and without the turn: for templates that render prefix by prefix, that is the span. For
    templates that rewrite earlier turns (Qwen3 drops the reasoning of answers before the last user
    message; Mistral's moves the system prompt into the last user message), the turn's own rendering
    is searched in the full one after its generation prompt: whole, or else its longest tail, which
    must still hold the end of the turn's content (the answer and end-of-turn marker that remain once a
    reasoning block is dropped)."""
    if GENERATION_TAG.search(tokenizer.chat_template):
        return render_chat(tokenizer, messages, False, spans=True)
    full = render_chat(tokenizer, messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render_chat(tokenizer, messages[:i], True), render_chat(tokenizer, messages[:i + 1], False)
        if not through.startswith(before):
            raise DataError(f"the chat template renders the conversation before assistant message {i} differently "
                            "once that message is added, so its tokens cannot be located; mark assistant turns with "
                            "{% generation %}...{% endgeneration %} in chat_template, or set train_on_prompt=true")
        if full.startswith(through) and len(before) >= cursor:
            spans.append((len(before), len(through)))
        else:
            without = render_chat(tokenizer, messages[:i], False)
            same = next((k for k, (a, b) in enumerate(zip(before, without)) if a != b), min(len(before), len(without)))
            prompt = before[same:]  # the generation prompt (or its end, where a closing EOS shares its first chars)
            start, limit = cursor, len(full)
            if prompt and full.find(prompt, cursor) >= 0:
                start = full.find(prompt, cursor) + len(prompt)
                limit = full.find(prompt, start) % (len(full) + 1)  # the next turn's prompt, else the end
            spans.append(_find_turn(full[:limit], through[len(before):], start, m["content"], i,
                                    list(tokenizer.get_added_vocab())))
        cursor = spans[-1][1]
    return full, spans


def _find_turn(full: str, body: str, start: int, content: str, index: int,
               added: list[str] = ()) -> tuple[int, int]:
    """Where a turn whose own rendering is `body` sits in `full` (cut where the next turn's generation
    prompt begins), its own generation prompt ending at `start`.

    Tried in order, each kept only if it still holds the end of the turn's content: the longest
    prefix of body found at start (a template that closes the conversation, not each turn, with an
    EOS, as Phi-3's does); else the longest tail of body found after start (a dropped reasoning block,
    or a turn placed after text the template moved in front of it)."""
    end = re.search(r"\S{1,8}$", content.rstrip())  # the content's last characters, up to its last space
    tail_of_content = end.group(0) if end else ""

    def holds_content(lo: int, hi: int) -> bool:
        at = body.rfind(tail_of_content, lo, hi)
        return bool(tail_of_content) and at >= 0

    same = 0
    while same < len(body) and start + same < len(full) and full[start + same] == body[same]:
        same += 1
    for token in added:  # a match that stops inside an added token ("<|" of Phi-3's <|user|>) stops before it
        at = full.rfind(token, max(0, start + same - len(token) + 1), start + same + len(token) - 1)
        if 0 <= at - start < same < at - start + len(token):
            same = at - start
    if same == len(body) or holds_content(0, same):
        return start, start + same
    lo, hi = 0, len(body)  # the longest tail found after start (a found tail's own tails are found too)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if full.find(body[-mid:], start) >= 0:
            lo = mid
        else:
            hi = mid - 1
    if not holds_content(len(body) - lo, len(body)):
        raise DataError(f"assistant message {index} does not appear in the chat template's rendering of the whole "
                        "conversation; mark assistant turns with {% generation %}...{% endgeneration %} in "
                        "chat_template, or set train_on_prompt=true")
    at = full.find(body[len(body) - lo:], start)
    return at, at + lo


def encode_messages(tokenizer, messages: list[dict], train_on_prompt: bool, max_len: int):
    """Render with the chat template and label every assistant turn (see assistant_spans), mapped from
    characters to tokens with the tokenizer's offsets (_span_labels: a token that holds any character
    of a turn is labelled, as transformers' return_assistant_tokens_mask does). The tokens are
    `apply_chat_template(messages, tokenize=True)`'s: the rendering without added special tokens, so a
    row has the BOS the template renders, and none where it renders none."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("dataset_format=messages needs a tokenizer with a chat_template; set chat_template=... (a "
                        "file or the template itself), tokenizer=... to one that has it, or use "
                        "dataset_format=prompt_completion")
    text, spans = (render_chat(tokenizer, messages, False), []) if train_on_prompt else assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=not train_on_prompt)
    ids = enc.input_ids[:max_len]
    if train_on_prompt:
        return ids, list(ids)
    return ids, _span_labels(ids, enc.offset_mapping, spans)


def encode_row(row: dict, fmt: str, tokenizer, train_on_prompt: bool, max_len: int):
    if fmt == "messages":
        return encode_messages(tokenizer, row["messages"], train_on_prompt, max_len)
    if fmt == "text":
        return encode_text(tokenizer, row["text"], max_len)
    if fmt == "alpaca":
        template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=row["instruction"], input=row.get("input") or "")
        return encode_prompt_completion(tokenizer, prompt, row["output"], train_on_prompt, max_len)
    return encode_prompt_completion(tokenizer, row["prompt"], row["completion"], train_on_prompt, max_len)


def encode_conversations(tokenizer, conversations: list[list[dict]], skip_turns: list[int],
                         rows: str = "preference rows"):
    """(ids, labels) of each conversation as encode_messages makes them, but its first skip_turns
    assistant turns not trained (a preference pair's side, or an unpaired row: the prompt's answers are
    context). rows: what the conversations are, in the refusal of a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{rows} of messages need a tokenizer with a chat_template; set chat_template=... "
                        "(a file or the template itself), or tokenizer=... to one that has it")
    if GENERATION_TAG.search(tokenizer.chat_template):
        rendered = render_chats(tokenizer, conversations, spans=True)
    else:
        rendered = [assistant_spans(tokenizer, c) for c in conversations]
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [(enc.input_ids[k], _span_labels(enc.input_ids[k], enc.offset_mapping[k], spans[skip:]))
            for k, ((_, spans), skip) in enumerate(zip(rendered, skip_turns))]


def _span_labels(ids: list[int], offsets, spans: list[tuple[int, int]]) -> list[int]:
    """The labels of a chat row: a token is labelled if it holds any character of a span (its
    characters [start, end) meet some [lo, hi)). That is transformers' return_assistant_tokens_mask,
    which marks the tokens from the one holding a span's first character through the one holding its
    last: a token that straddles a turn's end (`><` finishing `<|eot_id|>` and starting the next
    header, in a tokenizer without those special tokens) is trained, as is one that carries the space
    before an answer (`▁4`). Spans are disjoint: the first span ending after a token's start is the
    only one it can meet."""
    if not spans:
        return [IGNORE] * len(ids)
    spans = sorted(spans)
    los, his = np.array([lo for lo, _ in spans]), np.array([hi for _, hi in spans])
    cuts = np.asarray(offsets[:len(ids)], dtype=np.int64).reshape(-1, 2)
    starts, ends = cuts[:, 0], cuts[:, 1]
    at = np.searchsorted(his, starts, side="right")
    inside = (at < len(spans)) & (los[np.minimum(at, len(spans) - 1)] < ends)
    return np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE).tolist()


def _prompt_and_completion(row: dict, fmt: str) -> tuple[str, str]:
    if fmt == "alpaca":
        template = ALPACA_PROMPT_WITH_INPUT if row.get("input") else ALPACA_PROMPT
        return template.format(instruction=row["instruction"], input=row.get("input") or ""), row["output"]
    return row["prompt"], row["completion"]


def encode_batch(rows: list[dict], fmt: str, tokenizer, train_on_prompt: bool, max_len: int):
    """encode_row of many rows: the same (ids, labels), with one tokenizer call per kind of text
    (tests/test_mixture.py checks it against encode_row on real tokenizers)."""
    bos, eos = bos_ids(tokenizer), _eos(tokenizer)
    out = []
    if fmt == "messages":
        if not getattr(tokenizer, "chat_template", None):
            encode_messages(tokenizer, [], train_on_prompt, max_len)  # raises its error
        conversations = [r["messages"] for r in rows]
        if train_on_prompt:
            rendered = [(text, []) for text in render_chats(tokenizer, conversations)]
        elif GENERATION_TAG.search(tokenizer.chat_template):
            rendered = render_chats(tokenizer, conversations, spans=True)
        else:
            rendered = [assistant_spans(tokenizer, c) for c in conversations]
        enc = tokenizer([text for text, _ in rendered], add_special_tokens=False,
                        return_offsets_mapping=not train_on_prompt)
        for k, (_, spans) in enumerate(rendered):
            ids = enc.input_ids[k][:max_len]
            out.append((ids, list(ids)) if train_on_prompt else (ids, _span_labels(ids, enc.offset_mapping[k], spans)))
        return out
    if fmt == "text":
        texts = tokenizer([_without_eos(tokenizer, r["text"]) for r in rows], add_special_tokens=False).input_ids
        for tokens in texts:
            ids = (bos + tokens + eos)[:max_len]
            out.append((ids, list(ids)))
        return out
    pairs = [_prompt_and_completion(r, fmt) for r in rows]
    prompts = [p for p, _ in pairs]
    completions = [_without_eos(tokenizer, c) for _, c in pairs]
    prompt_ids = tokenizer(prompts, add_special_tokens=False).input_ids
    both = tokenizer([p + c for p, c in zip(prompts, completions)], add_special_tokens=False).input_ids
    return [_prompt_completion_row(bos, prompt_ids[k], both[k], eos, train_on_prompt, max_len)
            for k in range(len(rows))]


def plan_packing(lengths: list[int], max_len: int) -> list[list[int]]:
    """Which examples share a row: best-fit decreasing, rows in the order they were opened.

    Longest examples first, each into the fullest row it still fits in, else a new row. Rows end
    up nearly full (packing in arrival order leaves about half an average example of padding per
    row), so a step carries more real tokens for the same compute. Deterministic: ties keep the
    examples' original order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted: the best fit is a bisect
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (max_len - lengths[i], len(rows) - 1))
        else:
            space, row = free.pop(at)
            rows[row].append(i)
            bisect.insort(free, (space - lengths[i], row))
    return rows


def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_len: int, pad_id: int) -> dict:
    """Whole examples packed into rows of exactly max_len (plan_packing decides which share a row).

    Each example keeps its own position ids (restarting at 0), which is how the model's attention
    masks keep examples from attending to one another; the first token of each example is never a
    target of the previous example's last token.
    """
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for row in plan_packing([len(ids) for ids in input_ids], max_len):
        ids = [t for i in row for t in input_ids[i]]
        labs = [t for i in row for t in [IGNORE] + labels[i][1:]]
        pos = [p for i in row for p in range(len(input_ids[i]))]
        pad = max_len - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["labels"].append(labs + [IGNORE] * pad)
        out["position_ids"].append(pos + list(range(pad)))
    return out
