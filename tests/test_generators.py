"""generation_backend=vllm's pure parts, without vLLM (the launches are tests/vllm_backend/test_grpo_vllm.py):
the recipe rules, the push's buckets, names and LoRA merges (against peft's own merge on a real Llama), TRL
1.16's importance weights, a push past its time limit (one line, the process ends), and the planner's engine."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from finetune.errors import RecipeError
from finetune.recipe import Recipe, apply_overrides, validate
from finetune.strategy.base import layer_buckets
from finetune.training.generators import (LOGP_TOLERANCE, check_installed, hf_name, importance_weights,
                                          lora_scaling, merged_hf_tensors)

GRPO = ["objective=grpo", "reward_funcs=finetune.rewards:exact_match", "num_generations=2", "global_batch_size=2",
        "micro_batch_size=2"]


def recipe(*overrides: str) -> Recipe:
    return validate(apply_overrides(Recipe(), list(overrides)))


def test_the_engine_and_its_keys_only_where_they_apply():
    assert recipe(*GRPO, "generation_backend=vllm", "vllm_importance_sampling_clip_max=2").generation_backend == "vllm"
    with pytest.raises(RecipeError, match=r"^generation_backend=vllm applies to objective=grpo and distill only"):
        recipe("generation_backend=vllm")
    with pytest.raises(RecipeError, match=r"^vllm_push_layers=2 applies to generation_backend=vllm only"):
        recipe(*GRPO, "vllm_push_layers=2")
    with pytest.raises(RecipeError, match=r"^generation_backend=vllm with load_in_4bit=true: .*4-bit \(NF4\)"):
        recipe(*GRPO, "generation_backend=vllm", "lora=true", "load_in_4bit=true")
    # vLLM's log-probs are of the filtered distribution: the push check would fail at the first rollout
    with pytest.raises(RecipeError, match=r"^generation_backend=vllm with top_p=0.9: vLLM returns the log-probs of "
                                          r"the filtered distribution.*set top_p=1 and top_k=0"):
        recipe(*GRPO, "generation_backend=vllm", "top_p=0.9")
    with pytest.raises(RecipeError, match=r"^generation_backend=vllm with top_p=0.95 top_k=50: "):
        recipe(*GRPO, "generation_backend=vllm", "top_p=0.95", "top_k=50")
    assert recipe(*GRPO, "top_p=0.9", "top_k=50").top_k == 50  # our own sampler scores them as it draws
    with pytest.raises(RecipeError, match=r"vllm_importance_sampling_mode=x: must be one of token_truncate"):
        recipe(*GRPO, "generation_backend=vllm", "vllm_importance_sampling_mode=x")
    # a bound of 0 zeroes (truncate) or masks every token's weight: the run would learn nothing
    with pytest.raises(RecipeError, match=r"^vllm_importance_sampling_clip_max=0: must be > 0 \(the importance "
                                          r"ratio's upper bound"):
        recipe(*GRPO, "generation_backend=vllm", "vllm_importance_sampling_clip_max=0")


def test_a_missing_vllm_is_one_line_pointing_at_the_docs(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RecipeError, match=r"^generation_backend=vllm needs vLLM, which is not installed here.*docs/vllm.md"):
        check_installed(recipe(*GRPO, "generation_backend=vllm"))
    check_installed(recipe(*GRPO))  # finetune's own generator needs nothing


def test_layer_buckets_cut_runs_of_layers():
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(5) for p in ("a", "b")] + [
        "model.norm.weight", "lm_head.weight"]
    buckets = [[n for n, _ in b] for b in layer_buckets([(n, None) for n in names], 2)]
    assert buckets == [["model.embed_tokens.weight"], names[1:5], names[5:9], names[9:11],
                       ["model.norm.weight", "lm_head.weight"]]
    assert [len(b) for b in layer_buckets([(n, None) for n in names], 8)] == [1, 10, 2]


def test_names_lose_their_wrappers():
    assert hf_name("model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("base_model.model.model.layers.1.mlp.up_proj.base_layer.weight") == "model.layers.1.mlp.up_proj.weight"


def test_lora_merge_equals_peft_merge_and_leaves_the_adapter(tmp_path):
    """A real Llama with a LoRA adapter whose B is not zero: the pushed tensors equal peft's
    merge_and_unload state dict, name for name, and the model keeps its adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert lora_scaling(model) == 2.0
    pushed = dict(merged_hf_tensors(layer_buckets(list(model.named_parameters()), 1), lora_scaling(model)))
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the adapter is untouched"
    want = model.merge_and_unload().state_dict()
    assert set(pushed) == set(want)
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor.float(), want[name].float(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def trl_importance(trainer, engine, mask, mode, clip_max):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions (clip_min None), transcribed."""
    diff = torch.nan_to_num((trainer - engine) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=None, max=clip_max)
    return ratio.masked_fill((ratio < -math.inf) | (ratio > clip_max), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_are_trl_1_16s(mode):
    g = torch.Generator().manual_seed(0)
    trainer, engine = -torch.rand(3, 6, generator=g) * 2, -torch.rand(3, 6, generator=g) * 2
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]], dtype=torch.float32)
    ours = importance_weights(trainer, engine, mask, mode, 3.0)
    want = trl_importance(trainer, engine, mask, mode, 3.0).expand_as(mask)
    assert torch.allclose(ours[mask.bool()], want[mask.bool()])
    assert torch.all(ours[~mask.bool()] == 1.0)
    equal = importance_weights(trainer, trainer.clone(), mask, mode, 3.0)
    assert torch.all(equal == 1.0), "a push that took: every weight 1"


def test_a_push_past_its_time_limit_is_one_line_and_ends_the_process(tmp_path):
    """EngineGenerator.sync with an engine whose push never returns: the watchdog's line names the rank, and
    the process exits 1 within the limit instead of hanging."""
    script = textwrap.dedent("""
        import time, types
        from finetune.training.generators import EngineGenerator

        class Strategy:
            def weight_buckets(self, accelerator, model, layers):
                yield [("model.norm.weight", __import__("torch").ones(2))]

        class Accelerator:
            def unwrap_model(self, model):
                return model

        gen = EngineGenerator.__new__(EngineGenerator)
        gen.engine = types.SimpleNamespace(push=lambda named: time.sleep(600))
        gen.rank, gen.updates, gen.layers, gen.timeout = 1, 0, 4, 1.0
        run = types.SimpleNamespace(parallel=types.SimpleNamespace(strategy=Strategy()), accelerator=Accelerator(),
                                    model=object())
        gen.sync(run, 3)
    """)
    start = __import__("time").perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert __import__("time").perf_counter() - start < 60
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: rank 1: pushing the trained weights (after 3 updates) into the vLLM engine took more "
                     "than vllm_push_timeout=1 s; the run stopped, its last checkpoint is intact"], proc.stderr


def test_the_planner_counts_the_engine():
    from finetune import memory as M
    from finetune.arch import load_architecture

    base = apply_overrides(Recipe(), ["model=builtin:tiny-llama-h64", *GRPO, "max_seq_len=64",
                                      "max_completion_len=16", "mixed_precision=no"])
    arch = load_architecture(base.model)
    ours = M.recipe_estimate(validate(base), 2, arch)
    engine = M.recipe_estimate(validate(apply_overrides(base, ["generation_backend=vllm"])), 2, arch)
    asleep = M.recipe_estimate(validate(apply_overrides(base, ["generation_backend=vllm",
                                                               "vllm_enable_sleep_mode=true"])), 2, arch)
    kv = M.Rollout.of(base, 2).kv_cache(arch, 4)  # our generator, compiled on a GPU: 64 positions cached as 256
    per_token = 2 * arch.num_hidden_layers * arch.kv_heads * arch.head_size * 4
    assert kv == M.Rollout.of(base, 2).rows * 256 * per_token
    engine_kv = M.Rollout.of(engine_recipe := validate(apply_overrides(base, ["generation_backend=vllm"])), 2)
    assert engine_kv.kv_cache(arch, 4) == engine_kv.rows * 64 * per_token, "the engine's paged cache is not rounded"
    assert engine.engine == arch.num_parameters() * 4 + engine_kv.kv_cache(arch, 4)
    assert engine.kv_cache == engine.rollout_weights == 0
    assert engine.engine_asleep == engine.engine and asleep.engine_asleep == 0
    assert engine.total == asleep.total + engine.engine, "without sleep the engine stays through the step"
    assert engine.rollout_peak == engine.model_states + engine.logps + engine.engine + engine.push
    assert ours.engine == 0 and ours.kv_cache == kv
    budget = 10 * 2**30  # a share of a 10 GiB GPU far above the tiny engine's minimum
    extra = round(0.3 * budget) - engine.engine
    assert engine.peak_within(budget) == max(engine.total, engine.rollout_peak) + extra
    assert asleep.peak_within(budget) == max(asleep.total, asleep.rollout_peak + extra)


def test_the_logp_tolerance_defaults_by_dtype():
    assert LOGP_TOLERANCE["float32"] == 1e-3 and LOGP_TOLERANCE["bfloat16"] == 0.1
