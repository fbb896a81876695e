"""The model families without launching (issue 11): the planner counts each family's parameters on the
model its config builds (the dry run's count is the model's numel; published totals of real configs),
LoRA's default targets find each family's projections (fused ones included, never a MoE router), a
LoRA base is held in the training dtype and counted so, a mixture of experts' router loss enters the
loss as transformers defines it, and the FSDP skeleton keeps tied embeddings tied. The 2-process
launches of each family are in tests/distributed/test_families.py."""

from __future__ import annotations

import pytest
import torch

import family_assets as FA
from bench.helpers.held import held_bytes
from finetune import arch as A
from finetune import memory as M
from finetune import memory_tables as MT
from finetune.data import IGNORE
from finetune.model import add_lora, load_model, loss_sum
from finetune.recipe import Recipe


def meta_numel(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def small_model(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FA.family_config(name))


@pytest.mark.parametrize("name", list(FA.FAMILIES))
def test_dry_run_counts_the_models_parameters(name, tmp_path):
    """What `run.py --dry-run` prints is the numel of the model transformers builds from the config."""
    config = FA.family_config(name)
    config.save_pretrained(tmp_path)
    numel = meta_numel(config)
    report = MT.memory_report(Recipe(model=str(tmp_path), strategy="fsdp"), 2)
    assert f"model: {numel:,} parameters" in report, report
    assert "counted as a Llama-style decoder" not in report
    arch = M.load_architecture(str(tmp_path))
    assert arch.measured and arch.lm_head_parameters == (0 if config.tie_word_embeddings else arch.embedding_parameters)


PUBLISHED = {  # config.json numbers of released models -> their published parameter counts
    "microsoft/Phi-3-mini-4k-instruct": (dict(model_type="phi3", hidden_size=3072, num_hidden_layers=32,
                                              intermediate_size=8192, vocab_size=32064, num_attention_heads=32,
                                              num_key_value_heads=32, pad_token_id=32000), 3_821_079_552),
    "google/gemma-2-2b": (dict(model_type="gemma2", hidden_size=2304, num_hidden_layers=26, intermediate_size=9216,
                               vocab_size=256000, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                               tie_word_embeddings=True), 2_614_341_888),
    "Qwen/Qwen2.5-0.5B": (dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                               vocab_size=151936, num_attention_heads=14, num_key_value_heads=2,
                               tie_word_embeddings=True), 494_032_768),
    "meta-llama/Llama-3.2-1B": (dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                                     intermediate_size=8192, vocab_size=128256, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True), 1_235_814_400),
    "Qwen/Qwen3-30B-A3B": (dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                                intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                num_experts_per_tok=8, vocab_size=151936, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128), 30_532_122_624),
}


@pytest.mark.parametrize("model", list(PUBLISHED))
def test_published_totals(model):
    cfg, total = PUBLISHED[model]
    a = A.architecture_from_config(cfg, model)
    assert a.num_parameters() == total
    assert 0 < a.layer_parameters() < total and a.embedding_parameters == cfg["vocab_size"] * cfg["hidden_size"]


@pytest.mark.parametrize("name", list(FA.FAMILIES))
def test_lora_default_targets_find_each_familys_projections(name):
    model = add_lora(small_model(name), Recipe(lora=True, lora_r=4))
    adapted = sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n})
    assert adapted == FA.FAMILIES[name].lora_targets
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    arch = A.architecture_from_config(FA.family_config(name))
    assert M.lora_parameters(arch, 4) == trained  # the planner's adapter count is peft's


def test_lora_base_is_held_in_the_training_dtype_and_planned_so(tmp_path):
    """mixed_precision=bf16: the frozen base in bf16 (2 bytes), adapters in fp32; the planner's
    parameter bytes for one ddp process equal what the loaded model holds."""
    model = small_model("qwen2")
    model.save_pretrained(tmp_path)
    arch = M.load_architecture(str(tmp_path))
    for precision, base_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", torch.float32)):
        recipe = Recipe(model=str(tmp_path), lora=True, lora_r=4, mixed_precision=precision, strategy="ddp")
        lora = load_model(recipe, str(tmp_path), model.config)
        dtypes = {("lora_" in n, p.dtype) for n, p in lora.named_parameters()}
        assert dtypes == {(False, base_dtype), (True, torch.float32)}, precision
        planned = M.recipe_estimate(recipe, 1, arch)
        assert held_bytes(lora)["params"] == planned.params, precision


def test_fsdp_skeleton_keeps_tied_embeddings_tied(tmp_path):
    """Ranks other than 0 build the model on the meta device; tied embeddings must stay one parameter
    there too, or FSDP2 looks for an lm_head that rank 0 does not have."""
    model = small_model("qwen2")
    model.save_pretrained(tmp_path)
    skeleton = load_model(Recipe(model=str(tmp_path), strategy="fsdp"), str(tmp_path), model.config,
                          weights_on_this_rank=False)
    assert skeleton.lm_head.weight.is_meta and skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(skeleton.named_parameters())


def test_router_aux_loss_enters_the_loss_as_transformers_defines_it():
    model = small_model("qwen3_moe").train()
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.02
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (2, 12), generator=g), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    labels = batch["input_ids"].clone()
    labels[:, :4] = IGNORE
    targets = int((labels[:, 1:] != IGNORE).sum())
    aux: list = []
    ours = loss_sum(model, dict(batch, labels=labels), "full", aux=aux) / targets
    chunked = []  # the chunked loss (the default) and the full-logits one agree, router loss included
    torch.testing.assert_close(loss_sum(model, dict(batch, labels=labels), "chunked", 5, aux=chunked) / targets, ours,
                               rtol=1e-5, atol=1e-6)
    theirs = model(**batch, labels=labels)  # transformers: mean cross-entropy + coef * aux_loss
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-5, atol=1e-6)
    assert len(aux) == 1 and float(aux[0]) == pytest.approx(theirs.aux_loss.item()) and float(aux[0]) > 0
    model.eval()  # evaluation is cross-entropy alone, comparable with dense models' eval_loss
    with torch.no_grad():
        plain = model(**batch, labels=labels)
        assert float(loss_sum(model, dict(batch, labels=labels))) / targets == pytest.approx(
            float(plain.loss - 0.02 * plain.aux_loss), rel=1e-5)
