"""Unpaired rows (objective=kto): TRL's unpaired preference format, a `prompt`, a `completion` and a
`label` (true: desirable, false: undesirable), the thumbs-up/down logs many users have instead of pairs.
Two shapes, as TRL's KTOTrainer reads them: strings (the prompt_completion row prompt + completion: one
BOS, one EOS, labels on the completion and its EOS) and conversations (`prompt` a list of messages,
`completion` a list of assistant messages; the chat row prompt + completion, trained on the completion's
assistant turns after the prompt as generation is served it). Tokenized as a preference pair's side is
(finetune/data/preference.py encode_completions), cut as one: the prompt keeps its last max_prompt_len
tokens, then the whole is cut at max_seq_len.

A prepared row is input_ids, labels (unshifted, IGNORE off the completion) and `desirable` (1 or 0),
with n_tokens and n_targets (NO_TARGET: no completion token left within the budgets, dropped).

KTO's KL estimate scores each prompt with another row's completion (TRL's mismatched pairs), by TRL's rule:
within each micro-batch of rows, row k's KL row is its prompt followed by row k-1's completion (the first
row's takes the last's), cut at max_seq_len. TRL's KTOTrainer rotates the completions by one within each
chunk of per_device_train_batch_size rows of its dataset and reads the dataset in order (it refuses any
other sampler), so each batch it reads holds its rows' partners. The training split here is shuffled
(finetune.data.BatchSchedule), so its KL rows are made from each micro-batch as fetched (kl_rows, through
fetch's kl_max_len); a split read in order, the eval split, carries them as columns made once over chunks of
micro_batch_size rows (with_kl_rows: kl_input_ids, kl_labels). A micro-batch is laid out as a preference
pair's (batches.collate_unpaired): its n rows, then their n KL rows."""

from __future__ import annotations

from finetune.data.formats import IGNORE
from finetune.data.preference import encode_completions, fit_budgets, prompt_length, trained

UNPAIRED_VERSION = "1"  # bump when an unpaired row's tokens or labels change, to invalidate cached data


def encode_unpaired(rows: list[dict], tokenizer, max_len: int, max_prompt_len: int = 0) -> dict:
    """Checked unpaired rows (formats.check_unpaired) -> the columns of prepared rows."""
    items = [(r["prompt"], r["completion"], isinstance(r["completion"], list)) for r in rows]
    out = {"input_ids": [], "labels": [], "desirable": [], "n_tokens": [], "n_targets": []}
    encoded = encode_completions(items, tokenizer, rows="unpaired rows (objective=kto)")
    for row, (ids, labels) in zip(rows, encoded):
        ids, labels = fit_budgets(ids, labels, tokenizer.bos_token_id, max_len, max_prompt_len)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["desirable"].append(int(bool(row["label"])))
        out["n_tokens"].append(len(ids))
        out["n_targets"].append(trained(labels))  # 0 (NO_TARGET): nothing left to score, dropped
    return out


def one_sided(desirable: list[int]) -> str | None:
    """A line where every row has the same label (None where both occur). KTO's loss takes each row alone
    against the KL estimate, so it trains on one side only (TRL trains too, without a word), but such data is
    more often a label column read wrong than a choice."""
    if not desirable or 0 < sum(desirable) < len(desirable):
        return None
    if desirable[0]:
        return (f"every one of the {len(desirable)} training rows is labelled desirable (label true): KTO only raises "
                "their likelihood against the reference's, with no undesirable row to push down (rewards/rejected "
                "and rewards/margins stay null); if the labels mean otherwise, check which field they are read from")
    return (f"every one of the {len(desirable)} training rows is labelled undesirable (label false): KTO only pushes "
            "their likelihood down against the reference's, with no desirable row to hold it to good answers "
            "(rewards/chosen and rewards/margins stay null), which can degrade every answer; if the labels mean "
            "otherwise, check which field they are read from")


def kl_partners(num_rows: int, chunk: int) -> list[int]:
    """Each row's KL partner, the row whose completion its KL row takes: the one before it within its chunk
    of `chunk` rows (the chunk's first row takes the chunk's last), TRL's rotation by one."""
    partners = []
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        partners += [end - 1] + list(range(start, end - 1))
    return partners


def kl_row(ids: list[int], labels: list[int], partner_ids: list[int], partner_labels: list[int],
           max_len: int) -> tuple[list[int], list[int]]:
    """A row's prompt followed by its partner's completion (the tokens from its first trained one on), cut at
    max_len; trained on the completion's tokens as the partner's row is."""
    start, other = prompt_length(ids, labels), prompt_length(partner_ids, partner_labels)
    return (ids[:start] + partner_ids[other:])[:max_len], ([IGNORE] * start + partner_labels[other:])[:max_len]


def kl_rows(rows: list[dict], max_len: int) -> list[tuple[list[int], list[int]]]:
    """The KL rows of a micro-batch as fetched (its prepared rows, in order): row k's prompt with row k-1's
    completion, the first row's with the last's (TRL's rotation by one within the batch it reads)."""
    partners = kl_partners(len(rows), len(rows))
    return [kl_row(row["input_ids"], row["labels"], rows[p]["input_ids"], rows[p]["labels"], max_len)
            for row, p in zip(rows, partners)]


def with_kl_rows(ds, chunk: int, max_len: int):
    """A split read in order (the eval split) with each row's KL row (kl_input_ids, kl_labels): its prompt and
    its partner's completion (kl_partners over chunks of `chunk` rows). A map batch is a whole number of chunks, so that
    every partner is in it; cached by the split's fingerprint."""
    import hashlib

    def add(batch, indices):
        start = indices[0]
        partners = kl_partners(len(indices), chunk)  # the map batch starts at a chunk's start
        assert start % chunk == 0, (start, chunk)
        made = [kl_row(batch["input_ids"][k], batch["labels"][k], batch["input_ids"][p], batch["labels"][p], max_len)
                for k, p in enumerate(partners)]
        return {"kl_input_ids": [ids for ids, _ in made], "kl_labels": [labels for _, labels in made]}

    return ds.map(add, batched=True, batch_size=chunk * max(1, 1024 // chunk), with_indices=True,
                  keep_in_memory=True,  # every rank makes them; no cache file two ranks would both write
                  new_fingerprint=hashlib.sha256(repr((ds._fingerprint, "kl rows", UNPAIRED_VERSION, chunk,
                                                       max_len)).encode()).hexdigest()[:16], desc="KTO's KL rows")
