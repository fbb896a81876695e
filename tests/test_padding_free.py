"""padding_free=true (issue 12, item 2): every micro-batch is one row of its examples, concatenated with no
pad token, position ids restarting at 0 per example, no attention mask. The layout (collate/fetch,
placeholders), the loss of a real model on it against the padded batch's for each model family, the
refusals, the resume rule and the planner. The 2-process launch is in tests/distributed/test_padding_free_run.py."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

import family_assets as FA
from finetune import data as D
from finetune import memory as M
from finetune.data import IGNORE
from finetune.model import SEQUENCE_STATE_MODELS, concatenation_problem, loss_sum
from finetune.recipe import Recipe, RecipeError, validate

PAD = 0


def examples(n: int, seed: int = 0, low: int = 2, high: int = 30, vocab: int = 100) -> list[dict]:
    """Rows as tokenize_dataset leaves them: ids never PAD, labels set on a tail that holds at least one
    target after the first token (rows without one are dropped); some labelled from their first token
    (text format, train_on_prompt)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = rng.randint(low, high)
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        prompt = 0 if k % 3 == 0 else rng.randint(1, length - 1)
        out.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return out


def dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def packed_dataset(rows, max_len: int):
    packed = D.pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], max_len, PAD)
    return dataset([{k: packed[k][i] for k in packed} for i in range(len(packed["input_ids"]))])


def segments(positions: list[int]) -> list[tuple[int, int]]:
    starts = [k for k, p in enumerate(positions) if p == 0] + [len(positions)]
    return list(zip(starts, starts[1:]))


# ---------------------------------------------------------------- layout


def test_unpacked_micro_batch_becomes_one_row_without_padding():
    rows = examples(6, seed=1)
    ds = dataset(rows)
    free = D.fetch(ds, [4, 0, 2], PAD, packed=False, padding_free=True)
    padded = D.fetch(ds, [4, 0, 2], PAD, packed=False)
    assert set(free) == {"input_ids", "labels", "position_ids"}  # no attention mask
    picked = [rows[i] for i in (4, 0, 2)]
    total = sum(len(r["input_ids"]) for r in picked)
    assert free["input_ids"].shape == free["labels"].shape == free["position_ids"].shape == (1, total)
    assert free["input_ids"][0].tolist() == [t for r in picked for t in r["input_ids"]]
    assert PAD not in free["input_ids"][0].tolist()
    assert free["position_ids"][0].tolist() == [p for r in picked for p in range(len(r["input_ids"]))]
    labels = free["labels"][0].tolist()
    for (a, b), r in zip(segments(free["position_ids"][0].tolist()), picked):
        assert labels[a] == IGNORE  # never the target of the previous example's last token
        assert labels[a + 1:b] == r["labels"][1:]
    assert picked[1]["labels"][0] != IGNORE  # labelled from its first token, after another: the test bites
    assert D.target_tokens(free) == D.target_tokens(padded)
    assert D.input_tokens(free) == D.input_tokens(padded) == total  # real tokens, no padding either way


@pytest.mark.parametrize("max_len,seed", [(32, 0), (48, 3), (64, 5)])
def test_packed_rows_are_concatenated_up_to_their_real_length(max_len, seed):
    rows = examples(40, seed=seed, high=max_len)
    ds = packed_dataset(rows, max_len)
    plan = D.plan_packing([len(r["input_ids"]) for r in rows], max_len)
    assert len(ds) == len(plan) and any(sum(len(rows[i]["input_ids"]) for i in row) < max_len for row in plan)
    picks = list(range(0, len(ds), 2))[:4]
    free = D.fetch(ds, picks, PAD, packed=True, padding_free=True)
    padded = D.fetch(ds, picks, PAD, packed=True)
    order = [i for p in picks for i in plan[p]]
    assert free["input_ids"][0].tolist() == [t for i in order for t in rows[i]["input_ids"]]
    assert PAD not in free["input_ids"][0].tolist()
    assert free["position_ids"][0].tolist() == [p for i in order for p in range(len(rows[i]["input_ids"]))]
    assert free["labels"][0].tolist() == [x for i in order for x in [IGNORE] + rows[i]["labels"][1:]]
    assert D.target_tokens(free) == D.target_tokens(padded)
    assert D.input_tokens(free) == sum(len(rows[i]["input_ids"]) for i in order) < D.input_tokens(padded)


def test_packed_length_reads_the_tail_padding():
    # exact fit, one pad token, a single example with padding, a single example filling the row
    packed = D.pack_rows([[5] * 4, [6] * 4, [7] * 7, [8] * 3], [[5] * 4, [IGNORE] * 3 + [6], [7] * 7, [8] * 3], 8, PAD)
    lengths = {tuple(r): D.packed_length({"input_ids": r, "labels": lab, "position_ids": pos})
               for r, lab, pos in zip(packed["input_ids"], packed["labels"], packed["position_ids"])}
    assert lengths == {(7,) * 7 + (PAD,): 7, (5,) * 4 + (6,) * 4: 8, (8, 8, 8) + (PAD,) * 5: 3}
    full = D.pack_rows([[9] * 8], [[9] * 8], 8, PAD)
    assert D.packed_length({k: v[0] for k, v in full.items()}) == 8


@pytest.mark.parametrize("packed", [False, True])
def test_placeholders_keep_every_rank_in_the_forward(packed):
    rows = examples(12, seed=2)
    ds = packed_dataset(rows, 40) if packed else dataset(rows)
    real = D.fetch(ds, [0], PAD, packed, padding_free=True)
    mixed = D.fetch(ds, [1, -1], PAD, packed, padding_free=True)
    alone = D.fetch(ds, [1], PAD, packed, padding_free=True)
    n = alone["input_ids"].shape[1]
    assert torch.equal(mixed["input_ids"][:, n:], real["input_ids"])  # laid out as row 0 is, real length
    assert torch.equal(mixed["position_ids"][:, n:], real["position_ids"])
    assert (mixed["labels"][:, n:] == IGNORE).all() and D.target_tokens(mixed) == D.target_tokens(alone)
    only = D.fetch(ds, [-1, -1], PAD, packed, padding_free=True)
    assert only["input_ids"].shape[1] == 2 * real["input_ids"].shape[1] > 0  # something to run forward on
    assert D.target_tokens(only) == 0 and PAD not in only["input_ids"][0].tolist()


def test_padding_free_false_is_todays_batch():
    rows = examples(8, seed=4)
    for ds, packed in ((dataset(rows), False), (packed_dataset(rows, 40), True)):
        a, b = D.fetch(ds, [3, 1, -1], PAD, packed), D.fetch(ds, [3, 1, -1], PAD, packed, padding_free=False)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert ("attention_mask" in a) != packed and a["input_ids"].shape[0] == 3


# ---------------------------------------------------------------- the loss of real model families

FAMILIES = [(name, attn) for name in FA.FAMILIES for attn in ("sdpa", "eager")
            if not (name == "gemma2" and attn == "sdpa")]  # gemma2 runs eager (FA.FAMILIES recipe)


def family_model(name: str, attn: str):
    from transformers import AutoModelForCausalLM

    config = FA.family_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval(), config.vocab_size


@pytest.mark.parametrize("name,attn", FAMILIES)
def test_padding_free_loss_equals_the_padded_loss(name, attn):
    """The model's loss on one concatenated row equals its loss on the padded micro-batch (and on packed
    rows, padded and padding-free): transformers' packed-sequence detection (masking_utils
    find_packed_sequence_indices) keeps our examples apart. Examples longer than the sliding window (16 in
    the mistral and gemma2 configs) check the sliding mask too."""
    model, vocab = family_model(name, attn)
    rows = examples(6, seed=11, low=3, high=40, vocab=vocab)
    ds = dataset(rows)
    picks = [0, 1, 2, 3, 4, 5]
    padded, free = D.fetch(ds, picks, PAD, False), D.fetch(ds, picks, PAD, False, padding_free=True)
    packed_ds = packed_dataset(rows, 64)
    all_packed = list(range(len(packed_ds)))
    packed, packed_free = D.fetch(packed_ds, all_packed, PAD, True), D.fetch(packed_ds, all_packed, PAD, True, True)
    assert D.target_tokens(padded) == D.target_tokens(free) == D.target_tokens(packed) == D.target_tokens(packed_free)
    with torch.no_grad():
        want = loss_sum(model, padded, "full")
        for batch in (free, packed, packed_free):
            for impl in ("full", "chunked"):
                torch.testing.assert_close(loss_sum(model, batch, impl, 16), want, rtol=1e-5, atol=1e-4)
        # control: the same row with positions running on (one long sequence) computes other logits
        running = torch.arange(free["input_ids"].shape[1])[None]
        apart = model(input_ids=free["input_ids"], position_ids=free["position_ids"]).logits
        leaking = model(input_ids=free["input_ids"], position_ids=running).logits
        assert (apart - leaking).abs().max() > 1e-3


def test_padding_free_logits_equal_each_example_alone(tiny_tokenizer):
    """Token by token, on the builtin tiny Llama with real tokenized examples (sdpa)."""
    from transformers import AutoModelForCausalLM

    from finetune.assets import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    model.config.use_cache = False  # as load_model leaves it: with a cache, transformers builds no packed mask
    tok = tiny_tokenizer
    texts = [("Reverse: abc", " cba"), ("Add: 12 + 30 =", " 42"), ("Say hi", " hi there, how are you")]
    rows = []
    for prompt, completion in texts:
        ids, labels = D.encode_row({"prompt": prompt, "completion": completion}, "prompt_completion", tok, False, 64)
        rows.append({"input_ids": ids, "labels": labels})
    free = D.fetch(dataset(rows), [0, 1, 2], tok.pad_token_id, False, padding_free=True)
    with torch.no_grad():
        logits = model(input_ids=free["input_ids"], position_ids=free["position_ids"]).logits[0]
        at = 0
        for r in rows:
            n = len(r["input_ids"])
            alone = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
            torch.testing.assert_close(logits[at:at + n], alone, atol=1e-5, rtol=0)
            at += n


# ---------------------------------------------------------------- refusals, resume, planner


def test_flash_attention_packing_with_several_rows_is_refused():
    bad = Recipe(packing=True, attn_implementation="flash_attention_2", micro_batch_size=4)
    with pytest.raises(RecipeError) as e:
        validate(bad)
    message = str(e.value)
    assert "\n" not in message and "micro_batch_size=4" in message and "padding_free=true" in message
    for fine in (dataclasses.replace(bad, padding_free=True), dataclasses.replace(bad, micro_batch_size=1),
                 dataclasses.replace(bad, packing=False), dataclasses.replace(bad, attn_implementation="sdpa")):
        validate(fine)


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next", "lfm2"])
def test_models_that_carry_state_along_the_row_are_refused(model_type):
    from types import SimpleNamespace

    config = SimpleNamespace(model_type=model_type)
    assert model_type in SEQUENCE_STATE_MODELS
    assert concatenation_problem(Recipe(), config) is None  # padded rows, one example each: fine
    message = concatenation_problem(Recipe(padding_free=True), config)
    assert message and f"padding_free=true with model type {model_type}" in message and "\n" not in message
    assert "packing=true with" in concatenation_problem(Recipe(packing=True), config)
    for name in FA.FAMILIES:  # every family the suite trains concatenates fine
        assert concatenation_problem(Recipe(padding_free=True), FA.family_config(name)) is None


def test_padding_free_may_change_on_resume():
    from finetune.checkpointing.manifest import fingerprint
    from finetune.checkpointing.resume import ResumePoint, changes

    saved = Recipe(max_steps=12, micro_batch_size=4, global_batch_size=16, packing=True)
    point = ResumePoint(path=Path("/runs/a/checkpoints/step_000000005"), step=5, world_size=2, global_batch_size=16,
                        strategy=saved.strategy, recipe=json.loads(json.dumps(saved.to_dict())))
    notes = changes(point, dataclasses.replace(saved, padding_free=True))
    assert len(notes) == 1 and notes[0].startswith("padding_free: False -> True (the same rows at every step")
    assert fingerprint(saved) == fingerprint(dataclasses.replace(saved, padding_free=True))  # not a data key


def test_planner_counts_the_block_diagonal_mask_under_sdpa_only():
    """padding_free under sdpa: one row of B*T tokens under a block-diagonal mask, (B*T)^2 booleans held
    for the step; SDPA's kernels keep no scores (finetune/memory.py activation_bytes, measured by
    bench/studies/activation_memory.py); flash_attention_2's varlen path needs no mask: the padded figure."""
    arch = M.load_architecture("builtin:tiny-llama")
    base = Recipe(model="builtin:tiny-llama", micro_batch_size=4, max_seq_len=512, mixed_precision="bf16")
    padded = M.recipe_estimate(base, 1, arch).activations
    one_row = M.recipe_estimate(dataclasses.replace(base, padding_free=True), 1, arch).activations
    b, t = 4, 512
    assert one_row - padded == (b * t) ** 2
    flash = dataclasses.replace(base, padding_free=True, attn_implementation="flash_attention_2")
    assert M.recipe_estimate(flash, 1, arch).activations == padded  # varlen: the padded bound holds
    # a micro-batch of one row: the same tokens, plus the mask a padding-free row carries (T^2 booleans)
    assert M.recipe_estimate(dataclasses.replace(base, micro_batch_size=1, padding_free=True), 1, arch).activations \
        == M.recipe_estimate(dataclasses.replace(base, micro_batch_size=1), 1, arch).activations + t * t
