"""Batches: which rows global step N consumes on which rank (BatchSchedule), and the collated micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.data.formats import IGNORE
from finetune.data.unpaired import kl_rows


@dataclass(frozen=True)
class BatchSchedule:
    """Which rows each rank reads at each step: a pure function of its fields."""

    num_rows: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch

    def problem(self) -> str | None:
        """Why no step can be made: fewer rows than one global batch."""
        if self.steps_per_epoch:
            return None
        return (f"the dataset has {self.num_rows} training rows, fewer than one global batch of {self.global_batch}; "
                "lower micro_batch_size or grad_accum, or add data")

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g)

    def rows(self, step: int, rank: int) -> list[list[int]]:
        """The micro-batches (lists of row indices) that `rank` runs at optimizer step `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)[within * self.global_batch:(within + 1) * self.global_batch].tolist()
        m, w = self.micro_batch_size, self.world_size
        return [perm[(a * w + rank) * m:(a * w + rank + 1) * m] for a in range(self.grad_accum)]


def collate(rows: list[dict], pad_id: int, packed: bool, padding_free: bool = False,
            lengths: list[int] | None = None) -> dict:
    """Pad right to the longest row; packed rows are all full length and carry position ids instead of
    an attention mask, from which the model builds one block-causal mask per example.

    padding_free: the micro-batch as one row instead (see concatenate; lengths: the packed rows' real
    lengths, else read from each row)."""
    if padding_free:
        return concatenate(rows, packed, lengths)
    width = max(len(r["input_ids"]) for r in rows)

    def padded(key, fill):
        return torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows], dtype=torch.long)

    batch = {"input_ids": padded("input_ids", pad_id), "labels": padded("labels", IGNORE)}
    if packed:
        batch["position_ids"] = padded("position_ids", 0)
    else:
        batch["attention_mask"] = torch.tensor(
            [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows], dtype=torch.long)
    return batch


PAIR_SIDES = ("chosen", "rejected")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # finetune/training/reference.py attaches them


def is_preference(ds) -> bool:
    return "chosen_input_ids" in ds.column_names


def collate_pairs(rows: list[dict], pad_id: int) -> dict:
    """A micro-batch of preference pairs as 2n rows, every pair's chosen sequence then every pair's
    rejected one (so one forward scores both sides), padded right to the longest; and, where the pairs
    carry them, the reference's log-probs in the same order (ref_logps, [2n])."""
    sides = [(r[f"{side}_input_ids"], r[f"{side}_labels"]) for side in PAIR_SIDES for r in rows]
    width = max(len(ids) for ids, _ in sides)
    batch = {"input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in sides], dtype=torch.long),
             "labels": torch.tensor([labels + [IGNORE] * (width - len(labels)) for _, labels in sides],
                                    dtype=torch.long),
             "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in sides],
                                            dtype=torch.long)}
    if REFERENCE_COLUMNS[0] in rows[0]:
        batch["ref_logps"] = torch.tensor([r[column] for column in REFERENCE_COLUMNS for r in rows],
                                          dtype=torch.float32)
    return batch


def collate_unpaired(rows: list[dict], indices: list[int], pad_id: int, kl_max_len: int = 0) -> dict:
    """A micro-batch of unpaired rows (objective=kto, finetune/data/unpaired.py) laid out as preference
    pairs are (collate_pairs): its n rows, then their n KL rows, and `desirable` [n]; where the rows carry
    them, the reference's log-probs of both (ref_logps [2n]). The KL rows: the rows' own (kl_input_ids,
    kl_labels: a split read in order), else with kl_max_len those of this micro-batch (unpaired.kl_rows:
    each row's prompt with the completion of the row before it), else (kto_loss=apo_zero_unpaired) the rows
    repeated, which nothing reads. A placeholder (index -1) has no trained token in either of its rows."""
    if "kl_input_ids" in rows[0]:
        kl = [(row["kl_input_ids"], row["kl_labels"]) for row in rows]
    elif kl_max_len:
        kl = kl_rows(rows, kl_max_len)
    else:
        kl = [(row["input_ids"], row["labels"]) for row in rows]
    sides = []
    for row, i, (kl_ids, kl_labels) in zip(rows, indices, kl):
        side = {"chosen_input_ids": row["input_ids"], "chosen_labels": row["labels"],
                "rejected_input_ids": kl_ids, "rejected_labels": kl_labels}
        side |= {c: row[c] for c in REFERENCE_COLUMNS if c in row}
        if i < 0:
            for name in PAIR_SIDES:
                side[f"{name}_labels"] = [IGNORE] * len(side[f"{name}_labels"])
        sides.append(side)
    batch = collate_pairs(sides, pad_id)
    batch["desirable"] = torch.tensor([bool(r["desirable"]) for r in rows])
    return batch


def packed_length(row: dict) -> int:
    """The real tokens of a packed row (pack_rows): all of it, less the tail padding. The padding is
    the row's last segment of position ids (they restart at 0 there, as at every example) when none
    of its labels is set: every example kept has a target token after its first (tokenize_dataset
    drops the others), so an example's segment never looks like padding. Read from the row itself, so
    that packed data keeps the layout (and cache keys) it has without padding_free."""
    positions, labels = row["position_ids"], row["labels"]
    start = len(positions) - 1 - positions[::-1].index(0)
    if start > 0 and all(label == IGNORE for label in labels[start:]):
        return start
    return len(positions)


def concatenate(rows: list[dict], packed: bool, lengths: list[int] | None = None) -> dict:
    """The micro-batch as ONE row without a single pad token (padding_free=true): its examples (a
    packed row's, up to its real length; or each unpacked row whole) one after the other, position ids
    restarting at 0 at each, no attention mask: transformers reads the examples' boundaries from the
    position ids (masking_utils.find_packed_sequence_indices: a block-diagonal causal mask for
    sdpa/eager; flash_attention_2 runs varlen on a batch of one row). An example's first label is
    dropped, as pack_rows does: it would be the target of the previous example's last token, and in a
    padded row no token predicts it either, so the targets are the padded batch's."""
    ids, labels, positions = [], [], []
    for k, r in enumerate(rows):
        if packed:
            n = lengths[k] if lengths is not None else packed_length(r)
            ids += r["input_ids"][:n]
            labels += r["labels"][:n]
            positions += r["position_ids"][:n]
        else:
            n = len(r["input_ids"])
            ids += r["input_ids"]
            labels += [IGNORE] + r["labels"][1:]
            positions += range(n)
    return {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long)}


def target_tokens(batch: dict) -> int:
    if "shift_labels" in batch:  # a sequence-parallel shard (finetune/sequence_parallel.py): shifted already
        return int((batch["shift_labels"] != IGNORE).sum())
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def input_tokens(batch: dict) -> int:
    """Real tokens the model computes on: padding excluded (a packed row's tail pad is counted; it is
    shorter than one example; a padding-free row has none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def fetch(ds, indices: list[int], pad_id: int, packed: bool, padding_free: bool = False, kl_max_len: int = 0) -> dict:
    """Rows by index; index -1 is a placeholder (keeps ranks in lock-step) that carries no targets.
    A placeholder is row 0 with its labels unset; padding-free, it is laid out as row 0 is (a packed
    row's real length is read before its labels are cleared), so every rank still runs the forward.
    kl_max_len: unpaired rows get their KL rows from this micro-batch, cut at it (collate_unpaired)."""
    real = [i if i >= 0 else 0 for i in indices]
    cols = ds[real]
    rows = [{k: cols[k][j] for k in cols} for j in range(len(real))]
    if "desirable" in cols:
        return collate_unpaired(rows, indices, pad_id, kl_max_len)
    if "chosen_input_ids" in cols:
        for j, i in enumerate(indices):
            if i < 0:
                for side in PAIR_SIDES:
                    rows[j][f"{side}_labels"] = [IGNORE] * len(rows[j][f"{side}_labels"])
        return collate_pairs(rows, pad_id)
    lengths = [packed_length(r) for r in rows] if padding_free and packed else None
    for j, i in enumerate(indices):
        if i < 0:
            rows[j]["labels"] = [IGNORE] * len(rows[j]["labels"])
    return collate(rows, pad_id, packed, padding_free, lengths)


def eval_batches(ds, micro_batch_size: int, rank: int, world_size: int, max_samples: int = 0) -> list[list[int]]:
    """The first `max_samples` eval rows (all if 0), each once across ranks, every rank the same number
    of batches (sharded models need every rank in every forward); the same rows whatever the world size."""
    n = min(len(ds), max_samples) if max_samples else len(ds)
    per_rank = -(-n // world_size)
    mine = [i if i < n else -1 for i in range(rank, per_rank * world_size, world_size)]
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
