"""Sequence parallelism's pure parts (finetune/sequence_parallel.py): the slicing of a micro-batch, the
rank layout, the one-line refusals and the plan's batch arithmetic. The real 2-process runs are
tests/distributed/test_sequence_parallel.py."""

from __future__ import annotations

import types

import pytest
import torch

from finetune import data as D
from finetune import sequence_parallel as SP
from finetune.loss import model_inputs, shifted_labels
from finetune.plan import make_plan
from finetune.recipe import RecipeError, apply_overrides, load_recipe_module, validate
from finetune.strategy import deepspeed_config

IGNORE = D.IGNORE


def recipe(*overrides):
    return apply_overrides(load_recipe_module("tiny"), ["mixed_precision=no", *overrides])


def batch(lengths, pad_id=0, seed=0):
    """A padded micro-batch as D.collate makes it: random ids, the first 3 labels of each row unset."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(5, 100, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * 3 + ids[3:]})
    return D.collate(rows, pad_id, packed=False)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("lengths", [[9, 6, 7], [8, 8], [13]])
def test_shards_put_together_are_the_whole_row_with_global_positions_and_targets(size, lengths):
    whole = batch(lengths)
    rows = 4
    shards = [SP.shard(whole, size, rank, rows, pad_id=0) for rank in range(size)]
    width = shards[0]["input_ids"].shape[1] * size
    assert width % size == 0 and max(lengths) <= width < max(lengths) + size  # padded to a multiple of size
    for s in shards:
        assert all(t.shape == (rows, width // size) for t in s.values())
        assert set(s) == {"input_ids", "position_ids", "shift_labels", "attention_mask"}
    cat = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    b, n = whole["input_ids"].shape
    assert torch.equal(cat["input_ids"][:b, :n], whole["input_ids"])
    assert torch.equal(cat["position_ids"], torch.arange(width).expand(rows, width))  # global, not per shard
    # targets shifted over the whole row: a shard's last position predicts the next shard's first token
    assert torch.equal(cat["shift_labels"][:b, :n], shifted_labels(whole["labels"]))
    assert (cat["shift_labels"][:b, n:] == IGNORE).all() and (cat["shift_labels"][b:] == IGNORE).all()
    assert torch.equal(cat["attention_mask"][:b, :n], whole["attention_mask"])
    assert cat["attention_mask"][:, n:].sum() == 0 and cat["attention_mask"][b:].sum() == 0
    # counts per shard, summed over the ranks, are the whole batch's
    assert sum(D.target_tokens(s) for s in shards) == D.target_tokens(whole)
    assert sum(D.input_tokens(s) for s in shards) == D.input_tokens(whole)


def test_the_boundary_token_is_a_target_of_the_shard_before_it():
    whole = batch([8])
    first = SP.shard(whole, 2, 0, 1, pad_id=0)
    assert first["shift_labels"][0, -1] == whole["labels"][0, 4]  # position 3 predicts token 4, on rank 1
    assert first["shift_labels"][0, -1] != IGNORE


def test_a_shard_gives_the_model_no_mask_and_the_loss_its_shifted_targets():
    s = SP.shard(batch([7, 5]), 2, 1, 2, pad_id=0)
    inputs, targets = model_inputs(s)
    assert set(inputs) == {"input_ids", "position_ids"}
    assert targets is s["shift_labels"]
    whole = batch([7, 5])
    inputs, targets = model_inputs(whole)
    assert set(inputs) == {"input_ids", "attention_mask"} and torch.equal(targets, shifted_labels(whole["labels"]))


def pairs(lengths, placeholders=0, seed=0):
    """A micro-batch of preference pairs as D.fetch makes it (every chosen sequence, then every rejected
    one), with precomputed reference log-probs; the last `placeholders` pairs carry no targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, (c, r) in enumerate(lengths):
        row = {}
        for side, n in (("chosen", c), ("rejected", r)):
            ids = torch.randint(5, 100, (n,), generator=g).tolist()
            real = k < len(lengths) - placeholders
            row[f"{side}_input_ids"], row[f"{side}_labels"] = ids, [IGNORE] * 4 + (ids[4:] if real else [IGNORE] * (n - 4))
        row["ref_chosen_logps"], row["ref_rejected_logps"] = -1.0 - k, -2.0 - k
        rows.append(row)
    return D.collate_pairs(rows, pad_id=0)


@pytest.mark.parametrize("size", [2, 4])
def test_pair_shards_pad_each_side_with_placeholder_pairs_and_carry_whole_row_facts(size):
    """2 pairs (one a placeholder) in a micro-batch of 3: each side padded to 3 rows, chosen rows first;
    which pairs are real and their reference log-probs are carried whole, not sliced."""
    whole = pairs([(9, 6), (7, 11)], placeholders=1)
    shards = [SP.shard(whole, size, rank, 3, pad_id=0, pairs=True) for rank in range(size)]
    for s in shards:
        assert s["input_ids"].shape[0] == 6
        assert s["real_pairs"].tolist() == [True, False, False]
        assert s["ref_logps"].tolist() == [-1.0, -2.0, 0.0, -2.0, -3.0, 0.0]
    cat = torch.cat([s["shift_labels"] for s in shards], dim=1)
    n = whole["input_ids"].shape[1]
    want = shifted_labels(whole["labels"])
    assert torch.equal(cat[0, :n], want[0]) and torch.equal(cat[3, :n], want[2])  # the first pair, both sides
    assert (cat[[1, 2, 4, 5]] == IGNORE).all()  # the placeholder pair and the padding pair: no targets
    # which pairs are real is read from the whole rows: a shard may hold no target of a real pair
    from finetune.training.objectives.dpo import real_pairs

    assert real_pairs(whole).tolist() == [True, False]
    assert sum(D.target_tokens(s) for s in shards) == D.target_tokens(whole)


def test_a_mixture_of_experts_router_loss_is_refused_under_sp():
    moe = config(4, 2, "mixtral")
    text = moe.get_text_config()
    text.output_router_logits, text.router_aux_loss_coef = True, 0.02
    problem = SP.config_problem(recipe("sequence_parallel=2"), moe)
    assert "router loss (output_router_logits=true)" in problem and "\n" not in problem
    text.output_router_logits = False  # no router loss: nothing is computed per shard
    assert SP.config_problem(recipe("sequence_parallel=2"), moe) is None
    text.output_router_logits = True
    assert SP.config_problem(recipe(), moe) is None


def test_layout_puts_consecutive_ranks_in_one_sp_group():
    # DeepSpeed's parallel_state_sp: SP groups [0, 1], [2, 3]; data parallel over rank // N
    r = recipe("sequence_parallel=2", "micro_batch_size=3")
    layouts = [SP.Layout.of(r, rank, 4) for rank in range(4)]
    assert [(x.rank, x.dp_rank, x.dp_size, x.rows) for x in layouts] == [(0, 0, 2, 3), (1, 0, 2, 3), (0, 1, 2, 3),
                                                                        (1, 1, 2, 3)]
    plain = SP.Layout.of(recipe(), 3, 4)
    assert (plain.size, plain.dp_rank, plain.dp_size) == (1, 3, 4)
    b = batch([5])
    assert plain.shard(b) is b


def test_sp_group_reads_the_same_rows_and_the_global_batch_counts_data_parallel_ranks():
    schedule = D.BatchSchedule(num_rows=64, micro_batch_size=2, grad_accum=2, world_size=2, seed=1)  # dp 2 of 4
    layouts = [SP.Layout.of(recipe("sequence_parallel=2", "micro_batch_size=2"), rank, 4) for rank in range(4)]
    rows = [schedule.rows(0, x.dp_rank) for x in layouts]
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]
    assert schedule.global_batch == 8


def config(heads, kv, model_type="llama"):
    text = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    return types.SimpleNamespace(model_type=model_type, get_text_config=lambda: text)


@pytest.mark.parametrize("n,heads,kv,words", [
    (2, 4, 2, None), (4, 32, 8, None), (8, 32, 4, None),  # kv heads replicated when N is a multiple of them
    (3, 4, 2, "4 attention heads, not divisible by 3"),
    (4, 12, 6, "6 key/value heads"),
])
def test_heads_must_divide(n, heads, kv, words):
    problem = SP.config_problem(recipe(f"sequence_parallel={n}"), config(heads, kv))
    if words is None:
        assert problem is None
    else:
        assert words in problem and f"sequence_parallel={n}" in problem


def test_the_tiny_models_heads_take_sp2(tiny_tokenizer):
    from finetune.model import load_config

    _, cfg = load_config(recipe("sequence_parallel=2"))
    assert SP.config_problem(recipe("sequence_parallel=2"), cfg) is None


@pytest.mark.parametrize("overrides,words", [
    (["attn_implementation=eager"], "attn_implementation=eager: Ulysses attention needs"),
    (["packing=true"], "packing=true with sequence_parallel=2"),
    (["padding_free=true"], "padding_free=true with sequence_parallel=2"),
    (["compile=true", "strategy=fsdp"], "compile=true with sequence_parallel=2"),
])
def test_what_sp_cannot_take_is_one_line(overrides, words):
    with pytest.raises(RecipeError) as info:
        validate(recipe("sequence_parallel=2", *overrides))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_context_parallel_is_refused_and_points_to_sequence_parallel():
    with pytest.raises(RecipeError) as info:
        validate(recipe("context_parallel=2"))
    msg = str(info.value)
    assert "no CPU path" in msg and "use sequence_parallel=2" in msg


def test_sp_must_divide_the_processes():
    with pytest.raises(RecipeError) as info:
        make_plan(recipe("sequence_parallel=2"), env={"WORLD_SIZE": "3"}, cuda_available=False)
    assert "sequence_parallel=2 does not divide the 3 process(es)" in str(info.value)
    dry = make_plan(recipe("sequence_parallel=8"), env={"WORLD_SIZE": "1"}, cuda_available=False, dry_run=True)
    assert any("sequence_parallel=8" in p for p in dry.unchecked)


def test_plan_counts_data_parallel_ranks_in_the_global_batch():
    p = make_plan(recipe("sequence_parallel=2", "global_batch_size=16", "micro_batch_size=4"),
                  env={"WORLD_SIZE": "4"}, cuda_available=False)
    assert (p.data_parallel_size, p.grad_accum, p.global_batch_size) == (2, 2, 16)
    assert "global batch 16 = micro 4 x accum 2 x 2 data-parallel (sequence_parallel=2" in p.describe()
    # DeepSpeed is not given the SP groups: its batch check counts every rank
    config = deepspeed_config(replace_strategy(p, "zero3"), hidden_size=64)
    assert config["train_batch_size"] == 4 * 2 * 4
    with pytest.raises(RecipeError) as info:
        make_plan(recipe("sequence_parallel=2", "global_batch_size=12", "micro_batch_size=4"),
                  env={"WORLD_SIZE": "4"}, cuda_available=False)
    assert "micro_batch_size x data-parallel ranks (processes / sequence_parallel) = 4 x 2 = 8" in str(info.value)


def replace_strategy(plan, strategy):
    import dataclasses

    return dataclasses.replace(plan, recipe=dataclasses.replace(plan.recipe, strategy=strategy))


# ---------------------------------------------------------------- the planner


def test_activations_per_rank_are_divided_by_sequence_parallel():
    from finetune import memory as M

    a = M.Architecture(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=100,
                       num_attention_heads=4)
    b, t = 2, 16
    for n in (2, 4):  # a rank: B*T/N tokens for every term, a/N heads over the whole T
        for ckpt in (False, True):
            whole = M.activation_bytes(a, b * t // n, 1, "bf16", ckpt, "full")  # B*T/N tokens on one rank
            assert M.activation_bytes(a, b, t, "bf16", ckpt, "full", sequence_parallel=n) == whole
    # the chunked loss holds one chunk whatever the split
    eight = M.activation_bytes(a, b, t, "bf16", False, "chunked", 8, sequence_parallel=2)
    assert eight < M.activation_bytes(a, b, t, "bf16", False, "chunked", 16, sequence_parallel=2)


def test_longest_sequence_fits_and_one_step_more_does_not():
    from dataclasses import replace

    from finetune import memory as M
    from finetune import memory_tables as MT

    r = M.Recipe(model="meta-llama/Llama-2-7b-hf", strategy="zero3", activation_checkpointing=True)
    a = M.load_architecture(r.model)
    budget = MT.parse_size("80GB")
    setup = M.Setup("zero3")
    lengths = {}
    for n in (1, 2, 8):
        t = MT.longest_sequence(r, 8, a, setup, budget, sequence_parallel=n)
        assert t % n == 0 and t > 0
        fits = [M.recipe_estimate(replace(r, max_seq_len=x, sequence_parallel=n), 8, a, setup).fits(budget)
                for x in (t, t + n)]
        assert fits == [True, False]
        lengths[n] = t
    assert lengths[1] < lengths[2] < lengths[8]
    assert MT.longest_sequence(r, 1, a, M.Setup("ddp"), budget) == 0  # 16 bytes x 6.7e9 do not fit 80 GB


def test_planner_cli_answers_the_longest_sequence(capsys):
    from finetune.commands.plan import main

    assert main(["--recipe", "llama7b_zero3", "--gpus", "8", "--gpu-mem", "80GB", "--max-seq-len",
                 "sequence_parallel=8", "packing=false"]) == 0
    out = capsys.readouterr().out
    assert "sequence_parallel=1" in out and "sequence_parallel=8" in out and "* zero3" in out
    assert main(["--recipe", "llama7b_zero3", "--gpus", "8", "--max-seq-len"]) == 2
    assert "--max-seq-len needs --gpu-mem" in capsys.readouterr().err


def test_tiled_mlp_gives_the_untiled_loss_and_gradients():
    """tiled_mlp=true (DeepSpeed's TiledMLP on each MLP): the same loss and gradients, on a row long
    enough for several slices (ceil(tokens / hidden) = 4)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.loss import loss_sum
    from finetune.sequence_parallel import tile_mlps

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 128))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    def loss_and_grads(tiled):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
        if tiled:
            assert tile_mlps(model) == 2
        loss = loss_sum(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, tiled = loss_and_grads(False), loss_and_grads(True)
    assert torch.allclose(plain[0], tiled[0], rtol=1e-6, atol=0)
    for name, grad in plain[1].items():
        assert torch.allclose(grad, tiled[1][name], rtol=1e-5, atol=1e-6), name


def test_grpo_shards_carry_whole_rows_and_their_token_logps_make_the_whole_rows(monkeypatch):
    """GRPO under SP: a shard of a rollout micro-batch carries its rows' labels, advantages and placeholder
    flags whole, and its per-token log-probs (laid out as its shift_labels), put in place by whole_tokens
    and summed over the ranks (what the SP all-reduce does), are the whole rows' laid out as the labels.
    A bigram model (logits from the token alone) scores a slice as the whole row does, without Ulysses."""
    from finetune.loss import token_logps
    from finetune.training.rollouts import rollout_batch

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 11)

        def forward(self, input_ids, **_):
            return types.SimpleNamespace(logits=self.table(input_ids))

    torch.manual_seed(0)
    model = Bigram()
    batch = rollout_batch([[1, 2], [3]], [[4, 5, 6], [7, 8]], [True, True], torch.tensor([0.5, -0.5]), pad_id=0)
    whole = token_logps(model, batch, "full", temperature=0.7)
    parts = []
    for rank in range(2):
        shard = SP.shard(batch, 2, rank, rows=3, pad_id=0)  # rows padded to 3, length 5 to 6
        assert shard["input_ids"].shape == (3, 3)
        for key, whole_key in (("row_labels", "labels"), ("advantages", "advantages"), ("real", "real")):
            assert torch.equal(shard[key], batch[whole_key])
        monkeypatch.setattr(SP, "_GROUP", {"size": 2, "rank": rank})  # no process group: the slice in place, unsummed
        parts.append(SP.whole_tokens(token_logps(model, shard, "full", temperature=0.7), 5)[:2])
    assert (whole != 0).sum() == 5, "the completions' 5 tokens scored"
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-6)
