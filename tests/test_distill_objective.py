"""On-policy distillation's loss (finetune/divergence.py) and the objective's pure parts (training/objectives/
distill.py, objective_rules/distill.py). TRL is not a dependency of the project, so TRL 1.16's lines are
reproduced below as written: trl/experimental/gkd/gkd_trainer.py generalized_jsd_loss (lines 238-320) for the
value, and trl/kernels/chunked_divergence.py _backward_tile (the torch path of DistillationTrainer's kernel)
for the gradient with respect to the student's logits. The chunked loss is checked against the full logits'
on real models (the builtin tiny Llama as student, its wider sibling as teacher), values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from finetune.data import IGNORE
from finetune.divergence import divergence_sum, generalized_jsd
from finetune.errors import RecipeError
from finetune.recipe import Recipe, validate
from finetune.training.objectives.distill import (completion_seed, on_policy_batch, on_policy_step, prompt_of,
                                                  same_vocabulary)


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean"):
    """TRL 1.16 GKDTrainer.generalized_jsd_loss, transcribed (num_items_in_batch None)."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    return jsd.mean()


def trl_backward_tile(zs_raw, zt_raw, beta, temperature):
    """TRL 1.16 chunked_divergence._backward_tile's gradient of the per-token divergence with respect to the
    student's logits (scale 1, no softcap, grad_divergence 1), with the aux its forward saves."""
    inv_t = 1 / temperature
    log_ps = F.log_softmax(zs_raw * inv_t, -1)
    log_pt = F.log_softmax(zt_raw * inv_t, -1)
    ps = torch.exp(log_ps)
    if beta == 0.0:
        grad = ps - torch.exp(log_pt)
    elif beta == 1.0:
        aux = (ps * (log_ps - log_pt)).sum(-1)
        grad = ps * (log_ps - log_pt - aux.unsqueeze(-1))
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
        aux = (ps * (log_ps - log_m)).sum(-1)
        grad = (1 - beta) * ps * (log_ps - log_m - aux.unsqueeze(-1))
    return grad * inv_t


BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
TEMPERATURES = (1.0, 0.7, 2.0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_value_and_gradient_are_trl_1_16s(beta, temperature):
    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 10))
    student = torch.randn(4, 6, 50, generator=g) * 3
    teacher = torch.randn(4, 6, 50, generator=g) * 3
    labels = torch.randint(0, 50, (4, 6), generator=g)
    labels[0, :3] = -100
    labels[3] = -100
    ours_student = student.clone().requires_grad_()
    ours = generalized_jsd(ours_student, teacher, beta, temperature)
    mask = labels != -100
    want = trl_generalized_jsd_loss(student, teacher, labels, beta, temperature, reduction="sum")
    assert torch.allclose(ours[mask].sum(), want, rtol=1e-5, atol=1e-6)
    ours[mask].sum().backward()
    assert torch.allclose(ours_student.grad[mask], trl_backward_tile(student, teacher, beta, temperature)[mask],
                          rtol=1e-4, atol=1e-6)
    assert torch.all(ours_student.grad[~mask] == 0)


def test_beta_ends_are_the_two_kls_and_zero_at_the_teacher():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 30, generator=g), torch.randn(5, 30, generator=g)
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    assert torch.allclose(generalized_jsd(s, t, 0.0), (lt.exp() * (lt - ls)).sum(-1), atol=1e-6)  # forward KL
    assert torch.allclose(generalized_jsd(s, t, 1.0), (ls.exp() * (ls - lt)).sum(-1), atol=1e-6)  # reverse KL
    for beta in BETAS:
        assert torch.allclose(generalized_jsd(t, t, beta), torch.zeros(5), atol=1e-6)
    with pytest.raises(ValueError, match="beta=1.5"):
        generalized_jsd(s, t, 1.5)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    from finetune.assets import resolve_model

    student = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-llama"))
    teacher = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-llama-h64"))
    teacher.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 100, (3, 14), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE
    labels[2, 10:] = IGNORE
    attention = torch.ones_like(ids)
    attention[2, 10:] = 0
    return student, teacher, {"input_ids": ids, "attention_mask": attention, "labels": labels}


@pytest.mark.parametrize("beta,temperature", [(1.0, 1.0), (0.0, 0.7), (0.5, 2.0)])
def test_chunked_equals_full_logits_on_real_models(models, beta, temperature):
    """The chunked loss (each chunk's logits of both models inside the student's output layer; 3 tokens a
    chunk, and the default) gives the full logits' value, metrics and gradients."""
    student, teacher, batch = models
    results = []
    for impl, chunk in (("full", None), ("chunked", None), ("chunked", 3)):
        student.zero_grad()
        loss, sums = divergence_sum(student, teacher, batch, beta, temperature, impl, chunk)
        loss.backward()
        results.append((loss.detach(), sums, [p.grad.clone() for p in student.parameters()]))
    full = results[0]
    assert full[0] > 0
    # the full path checked against TRL's own formula on the same logits
    with torch.no_grad():
        labels = F.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:]
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        want = trl_generalized_jsd_loss(student(**inputs).logits, teacher(**inputs).logits, labels, beta,
                                        temperature, reduction="sum")
    assert torch.allclose(full[0], want, rtol=1e-5)
    for loss, sums, grads in results[1:]:
        assert torch.allclose(loss, full[0], rtol=1e-5)
        assert torch.allclose(sums, full[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, full[2]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_no_gradient_without_grad_mode(models):
    student, teacher, batch = models
    with torch.no_grad():
        loss, sums = divergence_sum(student, teacher, batch, 1.0, 1.0, "chunked", 4)
    assert not loss.requires_grad and sums[0] == pytest.approx(loss.item(), rel=1e-6)
    tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert 0 <= sums[2] <= tokens and sums[1] > 0  # agreement counts tokens, entropy is positive


# ---------------------------------------------------------------- the objective's pure parts


def test_on_policy_steps_follow_lmbda_and_the_seed_alone():
    assert all(on_policy_step(1, s, 1.0) for s in range(50))
    assert not any(on_policy_step(1, s, 0.0) for s in range(50))
    drawn = [on_policy_step(3, s, 0.3) for s in range(2000)]
    assert 0.25 < sum(drawn) / len(drawn) < 0.35
    assert drawn == [on_policy_step(3, s, 0.3) for s in range(2000)]  # a pure function: every rank agrees
    assert completion_seed(42, 5, 17) == completion_seed(42, 5, 17) != completion_seed(42, 6, 17)


def test_prompts_and_on_policy_rows():
    ids = torch.tensor([1, 5, 6, 7, 8, 0])
    labels = torch.tensor([IGNORE, IGNORE, IGNORE, 7, 8, IGNORE])
    assert prompt_of(ids, labels) == [1, 5, 6]
    assert prompt_of(ids, torch.full_like(labels, IGNORE)) is None  # a placeholder row
    b = on_policy_batch([[1, 5], None, [1]], [[9, 3], [], [4, 4, 4]], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 9, 3], [0, 0, 0, 0], [1, 4, 4, 4]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert b["labels"].tolist() == [[IGNORE, IGNORE, 9, 3], [IGNORE] * 4, [IGNORE, 4, 4, 4]]


def test_teacher_of_another_vocabulary_is_one_line():
    from transformers import AutoConfig, AutoTokenizer

    from finetune.assets import resolve_model

    path = resolve_model("builtin:tiny-llama")
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert same_vocabulary(tokenizer, resolve_model("builtin:tiny-llama-h64"), config,
                           AutoConfig.from_pretrained(resolve_model("builtin:tiny-llama-h64"))) is None
    other = AutoConfig.from_pretrained(path)
    other.vocab_size = 256
    assert "256 tokens, the student's 128" in same_vocabulary(tokenizer, path, config, other)


@pytest.mark.parametrize("overrides,message", [
    ({}, "objective=distill needs a teacher"),
    ({"teacher_model": "t", "temperature": 0.0}, "temperature=0 with objective=distill"),
    ({"teacher_model": "t", "packing": True}, "packing=true with objective=distill"),
    ({"teacher_model": "t", "sequence_parallel": 2, "strategy": "zero3"}, "sequence_parallel=2 with objective=distill"),
])
def test_distill_rules(overrides, message):
    with pytest.raises(RecipeError, match=message):
        validate(Recipe(objective="distill", **overrides))


def test_distill_keys_only_with_distill_and_sampling_keys_shared():
    with pytest.raises(RecipeError, match="lmbda=0.5 applies to objective=distill only"):
        validate(Recipe(lmbda=0.5))
    with pytest.raises(RecipeError, match="teacher_model=x applies to objective=distill only"):
        validate(Recipe(objective="dpo", teacher_model="x"))
    validate(Recipe(objective="distill", teacher_model="t", temperature=0.7, top_k=5, max_completion_len=32,
                    distill_beta=0.5, lmbda=0.5))


def test_a_missing_teacher_is_one_line_before_the_models_load(tmp_path):
    import types

    from finetune.training.objectives.distill import Distill

    objective = Distill(Recipe(objective="distill", teacher_model=str(tmp_path / "final")))
    context = types.SimpleNamespace(recipe=objective.recipe, tokenizer=None, config=None)
    with pytest.raises(RecipeError, match=r"teacher_model=.*final: no such directory; .*run it first"):
        objective.before_model(context)


def test_a_teacher_that_is_the_student_is_said(tmp_path, monkeypatch):
    """Distilling a model into itself: the divergence and its gradient start at 0, so the student learns
    nothing; one line says so (before_model logs it on the main process)."""
    from finetune.training.objectives.distill import same_model

    line = same_model(Recipe(objective="distill", model="builtin:tiny-llama", teacher_model="builtin:tiny-llama"))
    assert line.startswith("teacher_model=builtin:tiny-llama is the student's own model (model=builtin:tiny-llama)")
    assert "has nothing to learn from its copy" in line and "\n" not in line
    (tmp_path / "final").mkdir()
    monkeypatch.chdir(tmp_path)
    assert same_model(Recipe(objective="distill", model="final", teacher_model=str(tmp_path / "final")))
    assert same_model(Recipe(objective="distill", model="builtin:tiny-llama", teacher_model="final")) is None
    assert same_model(Recipe(objective="distill", model="org/a", teacher_model="org/b")) is None
