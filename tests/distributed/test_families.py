"""Each model family trains for real on 2 processes, under fsdp or zero3 (issue 11): a small
random-weight Llama 3 (GQA, llama3 rope scaling), Mistral (sliding window, Mistral's own v3
sentencepiece tokenizer), Qwen2 (qkv bias, tied embeddings), Gemma 2 (tied, soft-capping), Phi-3
(fused qkv_proj/gate_up_proj) and Qwen3-MoE (router aux loss), each with its family's chat template,
loaded through model=<dir>. One launch per family, shared by every assert here: the loss falls,
final/ reloads with from_pretrained and reproduces the logged eval loss, an export of the last
checkpoint equals final/ tensor for tensor, tied embeddings stay one tensor, the MoE logs its router
loss. The strategies alternate so that each sharding meets tied embeddings (qwen2 on fsdp, where they
once failed to map; gemma2 on zero3), fused projections and a mixture of experts; that the two
shardings follow one curve is test_strategies'."""

from __future__ import annotations

import json
import math

import pytest
import torch

import family_assets as FA
from finetune import data as D
from finetune.model import loss_sum
from finetune.recipe import FIELDS, Recipe

STRATEGY = {"llama3": "fsdp", "mistral": "zero3", "qwen2": "fsdp", "gemma2": "zero3", "phi3": "fsdp",
            "qwen3_moe": "zero3"}
RUN = ["dataset_format=messages", "max_seq_len=256", "max_steps=4", "eval_every=0", "eval_at_start=false",
       "global_batch_size=8", "micro_batch_size=2", "warmup_steps=0", "log_every=1", "lr=3e-3"]


@pytest.fixture(scope="module")
def families(launch_env):
    from pathlib import Path

    root = Path(launch_env["FINETUNE_CACHE"]) / "families"
    return {name: FA.build_family(name, root / name) for name in FA.FAMILIES}


@pytest.fixture(scope="module")
def family_run(launch, families):
    runs = {}

    def get(name, strategy):
        if (name, strategy) not in runs:
            built = families[name]
            runs[name, strategy] = launch(2, f"model={built['model']}", f"dataset={built['train']}",
                                          f"eval_dataset={built['eval']}", f"strategy={strategy}", *RUN,
                                          *built["family"].recipe)
        return runs[name, strategy]

    return get


def reloaded_eval_loss(run, monkeypatch) -> float:
    """The run's eval loss recomputed in this process from final/ alone (plain from_pretrained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("FINETUNE_CACHE", run.env["FINETUNE_CACHE"])
    monkeypatch.setenv("HF_DATASETS_CACHE", run.env["HF_DATASETS_CACHE"])
    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    recipe = Recipe(**{k: v for k, v in resolved.items() if k in FIELDS})
    final = run.output_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final, attn_implementation=recipe.attn_implementation).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    evals = D.build_datasets(recipe, tokenizer).eval
    total, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(resolved["world_size"]):
            for rows in D.eval_batches(evals, recipe.micro_batch_size, rank, resolved["world_size"]):
                batch = D.fetch(evals, rows, tokenizer.pad_token_id, recipe.packing)
                total += float(loss_sum(model, batch))
                tokens += D.target_tokens(batch)
    return total / tokens


def final_tensors(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.parametrize("name", list(FA.FAMILIES))
def test_family_trains_exports_and_reloads(name, family_run, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.export import export_checkpoint

    run = family_run(name, STRATEGY[name])
    losses = run.losses
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    logged = run.eval_records[-1]["eval_loss"]
    assert math.isclose(reloaded_eval_loss(run, monkeypatch), logged, rel_tol=1e-5)

    final = run.output_dir / "final"
    config = json.loads((final / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(final)
    assert config["architectures"] == [type(model).__name__] and not type(model).__name__.startswith("FSDP")
    weights = final_tensors(final)
    if config.get("tie_word_embeddings"):  # one tensor in the file, one parameter once loaded
        assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights

    checkpoint = sorted((run.output_dir / "checkpoints").glob("step_*"))[-1]
    exported = export_checkpoint(checkpoint, tmp_path / "export")  # reloads and compares probe logits itself
    assert exported["probe_max_abs_diff"] == 0.0
    again = final_tensors(tmp_path / "export")
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)

    if name == "qwen3_moe":  # the router's load-balancing loss, logged every step
        aux = [r["aux_loss"] for r in run.train_records]
        assert len(aux) == 4 and all(math.isfinite(a) and a > 0 for a in aux)
    else:
        assert all("aux_loss" not in r for r in run.train_records)
