"""DPO's pure parts: the losses on hand-computed cases, each sequence's log-probability computed a chunk
at a time against the full logits (values and gradients), the objective against a direct computation,
and the pair batch's layout. No training here: tests/distributed/test_dpo.py runs it."""

import math

import pytest
import torch

from finetune.data import IGNORE, collate_pairs, fetch
from finetune.loss import sequence_logps
from finetune.training.objectives.dpo import DPO, pair_losses, real_pairs
from finetune.recipe import Recipe


def softplus(x):
    return math.log1p(math.exp(x))


def test_sigmoid_ipo_simpo_on_a_hand_computed_pair():
    policy = torch.tensor([-1.0, -2.0], dtype=torch.float64)  # chosen, rejected
    reference = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    # z = (pc - pr) - (rc - rr) = 1; sigmoid: -log sigmoid(beta z) = softplus(-beta z)
    loss = pair_losses("sigmoid", 0.1, policy, reference)
    assert loss.item() == pytest.approx(softplus(-0.1), abs=1e-12)
    loss = pair_losses("sigmoid", 0.1, policy, reference, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * softplus(-0.1) + 0.1 * softplus(0.1), abs=1e-12)
    loss = pair_losses("ipo", 0.1, policy, reference)  # (z - 1 / (2 beta))^2 = (1 - 5)^2
    assert loss.item() == pytest.approx(16.0)
    # SimPO: z = pc - pr - gamma / beta = 1 - 0.25; no reference
    loss = pair_losses("simpo", 2.0, policy, None, gamma=0.5)
    assert loss.item() == pytest.approx(softplus(-1.5), abs=1e-12)


@pytest.mark.parametrize("overrides,words", [
    (["dpo_beta=1e39"], "dpo_beta=1e+39: must be in [0.001, 1000], where the loss and its gradient stay finite in "
                        "float32"),
    (["dpo_beta=0"], "dpo_beta=0: must be in [0.001, 1000]"),
    (["dpo_loss=ipo", "dpo_beta=1e-40"], "dpo_beta=1e-40: must be in [0.001, 1000]"),
    (["dpo_loss=simpo", "dpo_beta=2", "simpo_gamma=1e39"], "simpo_gamma=1e+39: must be in [0, 1000]"),
    (["dpo_label_smoothing=0.7"], "dpo_label_smoothing=0.7: must be <= 0.5"),
    (["dpo_beta=nan"], "dpo_beta=nan: must be a finite number"),
])
def test_dpo_numbers_whose_loss_is_not_finite_are_refused_in_one_line(overrides, words):
    from finetune.recipe import RecipeError, resolve

    with pytest.raises(RecipeError) as info:
        resolve("tiny", ["objective=dpo"] + overrides)
    assert str(info.value).startswith(words) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_the_dpo_ranges_keep_loss_and_gradient_finite_in_float32(kind):
    """At the ends of the allowed ranges, with a margin of 1e7 nats (the comment's bound), the float32
    loss and gradient are finite; past them (1e39 rounds to inf in float32, ipo's 1/(2 beta) squared
    overflows at 1e-40) they are not."""
    from finetune.recipe import DPO_BETA_RANGE, SIMPO_GAMMA_MAX

    def loss_and_grad(beta, margin):
        policy = torch.tensor([-1.0, -1.0 - margin], requires_grad=True)
        reference = None if kind == "simpo" else torch.tensor([-1.0, -1.0])
        loss = pair_losses(kind, beta, policy, reference, gamma=SIMPO_GAMMA_MAX if kind == "simpo" else 0.0)
        loss.sum().backward()
        return torch.cat([loss.detach(), policy.grad])

    for beta in DPO_BETA_RANGE:
        for margin in (0.0, 1e7, -1e7):
            assert torch.isfinite(loss_and_grad(beta, margin)).all(), (beta, margin)
    past = 1e-40 if kind == "ipo" else 1e39  # ipo squares 1/(2 beta); the others multiply by beta
    assert not torch.isfinite(loss_and_grad(past, 0.0)).all()


def tiny_model(tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)  # fp32: the chunked path takes fp32/bf16/fp16 output layers


def pair_rows(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(3, 97, (2 + i,), generator=g).tolist()
        row = {}
        for side, length in (("chosen", 3 + i), ("rejected", 5 - i)):
            answer = torch.randint(3, 97, (length,), generator=g).tolist()
            row[f"{side}_input_ids"] = [1] + prompt + answer
            row[f"{side}_labels"] = [IGNORE] * (1 + len(prompt)) + answer
        rows.append(row)
    return rows


def direct_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:]
    mask = targets != IGNORE
    logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (logps * mask).sum(-1), mask.sum(-1)


@pytest.mark.parametrize("tie", [False, True])
def test_sequence_logps_chunked_equals_the_full_logits(tie):
    batch = collate_pairs(pair_rows(), pad_id=0)
    model = tiny_model(tie)
    weights = torch.randn(batch["input_ids"].shape[0])
    from finetune.loss import OutputHeadLoss

    assert OutputHeadLoss(model, "chunked", 4).supported  # the chunked path, not the full-logits fallback
    sums, counts = sequence_logps(model, batch, "chunked", chunk=4)
    (sums * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected, expected_counts = direct_logps(model, batch)
    (expected * weights).sum().backward()
    assert counts.tolist() == expected_counts.tolist() == [3, 4, 5, 5, 4, 3]
    assert torch.allclose(sums, expected, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_objective_loss_and_gradients_equal_a_direct_computation(kind):
    rows = pair_rows(4)
    batch = collate_pairs(rows, pad_id=0)
    reference_model = tiny_model(seed=5)
    recipe = Recipe(objective="dpo", dpo_loss=kind, dpo_beta=2.0 if kind == "simpo" else 0.1)

    class Reference:
        def logps(self, policy, batch):
            with torch.no_grad():
                return direct_logps(reference_model, batch)[0]

    model = tiny_model()
    objective = DPO(recipe, None if kind == "simpo" else Reference())
    loss = objective.loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    summed, counts = direct_logps(model, batch)
    ref_summed = direct_logps(reference_model, batch)[0]
    sums, ref = (summed / counts, ref_summed / counts) if kind != "sigmoid" else (summed, ref_summed)
    n = 4
    if kind == "simpo":
        z = sums[:n] - sums[n:] - 0.5 / 2.0
        expected = torch.nn.functional.softplus(-2.0 * z).sum()
    else:
        z = (sums[:n] - sums[n:]) - (ref[:n] - ref[n:])
        expected = ((z - 1 / 0.2) ** 2).sum() if kind == "ipo" else torch.nn.functional.softplus(-0.1 * z).sum()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=1e-4), name
    metrics = dict(zip(objective.metrics, (objective.take_metrics() / n).tolist()))
    beta = recipe.dpo_beta
    # TRL's metrics: rewards on summed log-probs (ipo too); SimPO's on averaged ones, without a reference
    logps = sums if kind == "simpo" else summed
    chosen = beta * (logps[:n] if kind == "simpo" else logps[:n] - ref_summed[:n])
    rejected = beta * (logps[n:] if kind == "simpo" else logps[n:] - ref_summed[n:])
    assert metrics["rewards/chosen"] == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert metrics["rewards/margins"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert metrics["rewards/accuracies"] == pytest.approx((chosen > rejected).double().mean().item())
    assert metrics["logps/rejected"] == pytest.approx(logps[n:].mean().item(), abs=1e-5)
    assert objective.take_metrics() is None  # taken: the next step starts from nothing


def test_pairs_batch_layout_and_placeholders():
    import datasets

    rows = pair_rows(2)
    ds = datasets.Dataset.from_list(rows)
    batch = fetch(ds, [1, -1], pad_id=0, packed=False)
    # chosen of row 1, chosen of the placeholder (row 0), rejected of row 1, rejected of row 0
    assert batch["input_ids"].shape[0] == 4
    assert batch["input_ids"][0, :len(rows[1]["chosen_input_ids"])].tolist() == rows[1]["chosen_input_ids"]
    assert batch["input_ids"][2, :len(rows[1]["rejected_input_ids"])].tolist() == rows[1]["rejected_input_ids"]
    assert real_pairs(batch).tolist() == [True, False]
    assert (batch["labels"][[1, 3]] == IGNORE).all()
    assert batch["attention_mask"][2].sum().item() == len(rows[1]["rejected_input_ids"])
    with_reference = ds.add_column("ref_chosen_logps", [-1.0, -2.0]).add_column("ref_rejected_logps", [-3.0, -4.0])
    assert fetch(with_reference, [1, 0], 0, False)["ref_logps"].tolist() == [-2.0, -1.0, -4.0, -3.0]


def test_planner_counts_the_reference_per_strategy_and_pairs_in_activations():
    import dataclasses

    from finetune.memory import Setup, holds_reference, load_architecture, recipe_estimate

    base = Recipe(model="meta-llama/Llama-2-7b-hf", objective="dpo", mixed_precision="bf16", max_seq_len=1024)
    arch = load_architecture(base.model)
    n = arch.num_parameters()
    zero3 = recipe_estimate(base, 8, arch, Setup("zero3"))
    assert zero3.reference == round(n * 2 / 8)  # bf16, partitioned over 8
    assert recipe_estimate(base, 8, arch, Setup("zero2")).reference == round(n * 2)  # whole on each GPU
    assert recipe_estimate(base, 8, arch, Setup("fsdp")).reference == round(n * 2 / 8)
    offloaded = recipe_estimate(base, 8, arch, Setup("zero3", "cpu", offload_params="cpu"))
    assert offloaded.reference == 0 and offloaded.cpu >= round(n * 2 / 8)
    assert zero3.total == zero3.model_states + zero3.reference + zero3.activations + zero3.buffers
    for change in ({"lora": True}, {"dpo_loss": "simpo", "dpo_beta": 2.0}, {"precompute_reference": True}):
        other = dataclasses.replace(base, **change)
        assert not holds_reference(other) and recipe_estimate(other, 8, arch, Setup("zero3")).reference == 0
    sft = dataclasses.replace(base, objective="sft")
    doubled = dataclasses.replace(sft, micro_batch_size=2)
    assert zero3.activations == recipe_estimate(doubled, 8, arch, Setup("zero3")).activations  # 2 sequences a pair
