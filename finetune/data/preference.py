"""Preference pairs (objective=dpo): the three row shapes users have (read by split_pair and checked by
check_pair, in finetune/data/formats.py) and each pair tokenized into its chosen and rejected
sequences, each as an SFT row of the same data would be.

The shapes, as TRL's DPOTrainer reads them (trl/data_utils.py: is_conversational, maybe_extract_prompt,
extract_prompt, apply_chat_template):
- explicit prompt: `prompt`, `chosen`, `rejected` strings; each side is the prompt_completion row
  (prompt, side): one BOS, prompt + side tokenized as one text (the completion starts where the
  prompt's own tokens stop matching), one EOS, labels on the side and its EOS;
- conversational: `prompt` a list of messages, `chosen` and `rejected` lists of (assistant) messages
  (trl-lib/ultrafeedback_binarized); each side is the chat row prompt + side, rendered by the chat
  template, labels on the side's own assistant turns only (with their end-of-turn markers);
- implicit prompt: `chosen` and `rejected` alone, whole conversations (Anthropic/hh-rlhf as
  messages) or texts sharing a prefix: the prompt is their longest common prefix (of messages, or of
  characters, a space before the first difference going to the sides), as TRL's extract_prompt cuts
  it. Where one side is the other's start, TRL's cut leaves the shorter side its last message (or
  character); that is kept, so no side is empty. A `prompt` of the other kind than the sides (the
  string prompt of HuggingFaceH4/ultrafeedback_binarized, whose chosen and rejected are whole
  conversations) is ignored, as TRL ignores it.

Both sides are scored from the same position (same_prompt, TRL's rule): where the prompt ends inside a
word one side continues, the other side's last prompt tokens are scored too. A conversational side
trains nothing that the prompt as generation is given it (its generation prompt included) already
holds (after_prompt, TRL's rule), whatever the template's {% generation %} blocks cover.

A prepared pair is the columns PAIR_COLUMNS (labels unshifted, IGNORE off the response, as SFT rows'
labels) and the counts n_tokens (both sides) and n_targets (both sides' trained tokens; NO_TARGET marks
a pair to drop because a side has no trained token left within the budgets, IDENTICAL one to drop
because its sides are the same tokens once cut: a pair that prefers nothing, as check_pair refuses
identical rows; tokenize_dataset counts both). Truncation: the prompt keeps its last
max_prompt_len tokens (TRL's keep_end for prompts; the BOS, where the row starts with one, stays
first and counts in the budget), then each side is cut at max_seq_len.
"""

from __future__ import annotations

import sys

from finetune.data.formats import IGNORE, split_pair
from finetune.data.tokenization import encode_batch, encode_conversations, render_chats

PAIR_COLUMNS = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
PREFERENCE_VERSION = "3"  # bump when a pair's tokens or labels change, to invalidate cached preference data
NO_LIMIT = sys.maxsize
# n_targets of a pair to drop (kept rows have n_targets > 0). A pair whose sides differ only past
# max_seq_len is the same tokens on both sides: its DPO margin is 0 whatever the weights, so it adds no
# gradient and only dilutes the batch's mean loss (log 2 each).
NO_TARGET, IDENTICAL = 0, -1


def fit_budgets(ids: list[int], labels: list[int], bos_id, max_len: int, max_prompt_len: int):
    """A side within the budgets: the prompt (the tokens before the first trained one) keeps its last
    max_prompt_len tokens, its BOS staying first; then the whole is cut at max_len."""
    start = next((k for k, x in enumerate(labels) if x != IGNORE), len(ids))
    if max_prompt_len and start > max_prompt_len:
        keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
        cut = start - (max_prompt_len - keep)
        ids, labels = ids[:keep] + ids[cut:], labels[:keep] + labels[cut:]
    return ids[:max_len], labels[:max_len]


def encode_sides(rows: list[dict], tokenizer) -> list[tuple]:
    """Per pair, ((chosen ids, labels), (rejected ids, labels)), untruncated (encode_completions of its two
    sides)."""
    split = [split_pair(r) for r in rows]
    out = encode_completions([(prompt, side, chat) for prompt, chosen, rejected, chat in split
                              for side in (chosen, rejected)], tokenizer)
    return [(out[2 * k], out[2 * k + 1]) for k in range(len(rows))]


def encode_completions(items: list[tuple], tokenizer, rows: str = "preference rows") -> list[tuple]:
    """Per (prompt, completion, conversational), its (ids, labels), untruncated: a text is the
    prompt_completion row (prompt, completion), a conversation the chat row prompt + completion, trained on
    the completion's own assistant turns after the served prompt; one tokenizer call for all the texts,
    one for all the conversations. rows: what they are, in a refusal (encode_conversations)."""
    texts = [k for k, item in enumerate(items) if not item[2]]
    chats = [k for k, item in enumerate(items) if item[2]]
    out: list = [None] * len(items)
    if texts:
        pc = [{"prompt": items[k][0], "completion": items[k][1]} for k in texts]
        for k, row in zip(texts, encode_batch(pc, "prompt_completion", tokenizer, False, NO_LIMIT)):
            out[k] = row
    if chats:
        conversations = [list(items[k][0]) + list(items[k][1]) for k in chats]
        skips = [sum(1 for m in items[k][0] if m["role"] == "assistant") for k in chats]
        encoded = encode_conversations(tokenizer, conversations, skips, rows)
        served = served_prompts(tokenizer, [items[k][0] for k in chats])
        for j, k in enumerate(chats):
            out[k] = after_prompt(served[j], *encoded[j])
    return out


def served_prompts(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """Each conversational prompt's tokens as generation is given them: the chat template's rendering
    with its generation prompt (`apply_chat_template(prompt, add_generation_prompt=True)`); [] for an
    empty prompt."""
    kept = [k for k, p in enumerate(prompts) if p]
    texts = render_chats(tokenizer, [prompts[k] for k in kept], generation_prompt=True) if kept else []
    ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
    out: list[list[int]] = [[] for _ in prompts]
    for k, tokens in zip(kept, ids):
        out[k] = list(tokens)
    return out


def after_prompt(served: list[int], ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """A conversational side with nothing trained among the tokens it shares with its served prompt
    (TRL's common_prefix_length). DPO scores log p(side | prompt), the prompt being what generation
    starts from, generation prompt included; a template whose {% generation %} block opens before the
    end of its generation prompt (TRL's qwen2_5_training.jinja opens it after `<|im_start|>assistant`,
    before the newline that ends the generation prompt) would otherwise train that newline, a token the
    model never produces. It is the same in both sides and cancels in sigmoid's margin, but not in
    ipo's and simpo's per-token averages."""
    n = 0
    while n < min(len(served), len(ids)) and served[n] == ids[n]:
        n += 1
    return ids, [IGNORE] * n + labels[n:]


def same_prompt(chosen: tuple, rejected: tuple) -> tuple[tuple, tuple]:
    """Both sides scored from the same position, TRL's rule: DPO compares log p(chosen | prompt) with
    log p(rejected | prompt), so both must be conditioned on the same tokens. Where the prompt ends
    inside a word that one side continues ("... is Par" + "is." against + "ma."), that side's tokens
    leave the prompt's earlier; the other side's prompt tokens from there on are scored too."""
    (c_ids, c_labels), (r_ids, r_labels) = chosen, rejected
    c_start, r_start = prompt_length(c_ids, c_labels), prompt_length(r_ids, r_labels)
    start = min(c_start, r_start)
    if c_ids[:start] != r_ids[:start]:
        return chosen, rejected

    def scored_from(ids, labels, own):
        return ids, labels[:start] + ids[start:own] + labels[own:]

    return scored_from(c_ids, c_labels, c_start), scored_from(r_ids, r_labels, r_start)


def trained(labels: list[int]) -> int:
    """Trained tokens of a side, as SFT counts them: the first token is no token's target."""
    return sum(1 for x in labels[1:] if x != IGNORE)


def encode_pairs(rows: list[dict], tokenizer, max_len: int, max_prompt_len: int = 0) -> dict:
    """Checked preference rows -> the columns of prepared pairs (PAIR_COLUMNS, n_tokens, n_targets);
    n_targets is NO_TARGET for a pair that a side without a trained token left makes useless, IDENTICAL
    for one whose sides became the same tokens (and labels) when cut at the budgets (both dropped)."""
    out = {c: [] for c in PAIR_COLUMNS + ["n_tokens", "n_targets"]}
    for chosen, rejected in encode_sides(rows, tokenizer):
        chosen, rejected = same_prompt(chosen, rejected)
        chosen = fit_budgets(*chosen, tokenizer.bos_token_id, max_len, max_prompt_len)
        rejected = fit_budgets(*rejected, tokenizer.bos_token_id, max_len, max_prompt_len)
        for name, (ids, labels) in (("chosen", chosen), ("rejected", rejected)):
            out[f"{name}_input_ids"].append(ids)
            out[f"{name}_labels"].append(labels)
        counts = trained(chosen[1]), trained(rejected[1])
        out["n_tokens"].append(len(chosen[0]) + len(rejected[0]))
        out["n_targets"].append(NO_TARGET if min(counts) == 0 else IDENTICAL if chosen == rejected else sum(counts))
    return out


def encode_pair(row: dict, tokenizer, max_len: int, max_prompt_len: int = 0) -> dict:
    """One preference row's prepared pair (encode_pairs of one row), without the counts."""
    out = encode_pairs([row], tokenizer, max_len, max_prompt_len)
    return {c: out[c][0] for c in PAIR_COLUMNS}


def prompt_length(ids: list[int], labels: list[int]) -> int:
    """The prompt's tokens in a prepared side: those before its first trained token."""
    return next((k for k, x in enumerate(labels) if x != IGNORE), len(ids))
