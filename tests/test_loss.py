"""The chunked loss (finetune/loss.py) against the full-logits cross-entropy it replaces: the same sum
and the same gradients (hidden states, lm_head, tied embeddings, LoRA adapters) within fp32 rounding,
on real transformers models built from small configs, with prompts masked, padding, a row without
targets and chunks that do not divide the tokens; and that it never makes a [tokens, vocab] tensor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.data import IGNORE
from finetune.loss import chunk_rows, loss_sum
from finetune.plan import make_plan
from finetune.recipe import Recipe, RecipeError

VOCAB = 384
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def build(kind: str):
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig,
                              GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False))
    elif kind == "qwen2_tied":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "gemma2_softcap":
        model = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=2.0,
                                               attn_implementation="eager"))
    elif kind == "cohere_scale":
        model = CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.5))
    elif kind == "granite_scaling":
        model = GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=4.0))
    elif kind == "hyperclovax_scaling":
        from transformers import HyperCLOVAXConfig, HyperCLOVAXForCausalLM

        model = HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**SMALL, logits_scaling=0.25))
    elif kind == "falcon_h1_multiplier":  # one layer and short Mamba chunks: its reference kernels are slow
        from transformers import FalconH1Config, FalconH1ForCausalLM

        model = FalconH1ForCausalLM(FalconH1Config(**dict(SMALL, num_hidden_layers=1), lm_head_multiplier=0.5,
                                                   mamba_chunk_size=16))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # logits of a few units, so that softcap, scale and softmax all matter
        model.get_output_embeddings().weight.mul_(40.0)
    return model.float()


def settings(model) -> tuple:
    c = model.config
    return (getattr(c, "final_logit_softcapping", None), getattr(model, "logit_scale", None),
            getattr(c, "logits_scaling", None), getattr(model.model, "lm_head_multiplier", None))


def make_batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 29), generator=g)
    labels = ids.clone()
    labels[:, :9] = IGNORE  # a prompt
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # a padded row
    labels[1, 20:] = IGNORE
    labels[2, :] = IGNORE  # a row without targets
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run(model, batch, impl: str, chunk: int | None = None):
    """Loss, the gradient of the hidden states lm_head reads, and every parameter's gradient."""
    from finetune.unwrap import hf_model

    model.zero_grad(set_to_none=True)
    hidden = {}

    def keep(_module, args):
        args[0].retain_grad()
        hidden["h"] = args[0]

    handle = hf_model(model).get_output_embeddings().register_forward_pre_hook(keep)
    try:
        loss = loss_sum(model, batch, impl, chunk)
        loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), hidden["h"].grad.clone(), grads


def assert_close(got, want, rtol: float, name: str = ""):
    """Within rtol of the tensor's largest entry: summing in another order moves every entry by
    rounding of the large ones, which an element-wise relative bound would blame on the small ones."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    scale = float(want.abs().max())
    error = float((got.float() - want.float()).abs().max())
    assert error <= rtol * scale + 1e-12, f"{name}: max error {error:.3g} against max {scale:.3g}"


def assert_equal_runs(a, b, rtol=1e-5):
    """fp32: the observed differences are <= 4e-7 of each tensor's largest entry; 1e-5 leaves room."""
    (la, ha, ga), (lb, hb, gb) = a, b
    assert_close(la, lb, rtol, "loss")
    assert_close(ha, hb, rtol, "hidden states")
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert_close(ga[name], gb[name], rtol, name)


POST_PROCESSED = ["gemma2_softcap", "cohere_scale", "granite_scaling", "hyperclovax_scaling", "falcon_h1_multiplier"]


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", *POST_PROCESSED])
def test_chunked_equals_full(kind):
    model = build(kind)
    before = settings(model)
    batch = make_batch()
    full = run(model, batch, "full")
    assert full[0] > 0 and full[1].abs().sum() > 0
    assert full[2]["lm_head.weight" if "lm_head.weight" in full[2] else "model.embed_tokens.weight"].abs().sum() > 0
    for chunk in (7, None):  # 7 divides neither the 40 target tokens nor the 87 positions; None: one chunk here
        assert_equal_runs(run(model, batch, "chunked", chunk), full)
    # the model's own post-processing is switched back on after the call
    assert settings(model) == before
    assert "forward" not in model.get_output_embeddings().__dict__


@pytest.mark.parametrize("kind", POST_PROCESSED)
def test_post_processing_is_reproduced_not_dropped(kind):
    """The comparison above could pass if both paths skipped the softcap/scale; they must not."""
    model = build(kind)
    batch = make_batch()
    with torch.no_grad():
        with_it = loss_sum(model, batch, "chunked")
    attr = {"gemma2_softcap": (model.config, "final_logit_softcapping", None),
            "cohere_scale": (model, "logit_scale", 1.0),
            "granite_scaling": (model.config, "logits_scaling", 1.0),
            "hyperclovax_scaling": (model.config, "logits_scaling", 1.0),
            "falcon_h1_multiplier": (model.model, "lm_head_multiplier", 1.0)}[kind]
    setattr(attr[0], attr[1], attr[2])
    with torch.no_grad():
        without = loss_sum(model, batch, "full")
    assert abs(float(with_it) - float(without)) > 1e-3 * float(without)


def test_tied_embedding_gradient_has_both_uses():
    model = build("qwen2_tied")
    _, _, grads = run(model, make_batch(), "chunked", 7)
    # input rows of tokens that occur get the embedding use's gradient on top of the output's
    _, _, full = run(model, make_batch(), "full")
    assert_close(grads["model.embed_tokens.weight"], full["model.embed_tokens.weight"], 1e-5)
    assert "lm_head.weight" not in grads  # one parameter, one gradient


def test_lora_adapters_get_the_same_gradients():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                        "down_proj"]))
    for name, p in model.named_parameters():  # B starts at zero; give it values so A's gradient is not zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch = make_batch()
    full = run(model, batch, "full")
    chunked = run(model, batch, "chunked", 7)
    assert_equal_runs(chunked, full)
    assert all("lora_" in name for name in chunked[2]) and len(chunked[2]) == 12


def test_lora_on_lm_head_falls_back_to_full_logits(caplog):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    batch = make_batch()
    with caplog.at_level("WARNING", logger="finetune"):
        chunked = run(model, batch, "chunked", 7)
    assert_equal_runs(chunked, run(model, batch, "full"))
    assert "computing the loss from the full logits instead" in caplog.text


def test_autocast_bf16_matches_full_path_under_autocast():
    """Mixed precision (Accelerate's autocast on DDP/FSDP): matmuls in bf16, softmax in fp32, as the
    full path's autocast linear + logits.float() does; bf16 rounding allows no tighter a bound."""
    model = build("llama")
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = run(model, batch, "full")
        chunked = run(model, batch, "chunked", 7)
    assert_equal_runs(chunked, full, rtol=2e-2)
    assert chunked[2]["lm_head.weight"].dtype == torch.float32


def test_bf16_weights_like_deepspeed_bf16():
    model = build("llama").to(torch.bfloat16)
    batch = make_batch()
    full = run(model, batch, "full")
    chunked = run(model, batch, "chunked", 7)
    assert chunked[2]["lm_head.weight"].dtype == torch.bfloat16
    assert_equal_runs(chunked, full, rtol=2e-2)


def test_eval_without_grad_and_batches_without_targets():
    model = build("llama")
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(loss_sum(model, batch, "chunked"), loss_sum(model, batch, "full"))
    batch["labels"][:] = IGNORE
    loss, hidden_grad, grads = run(model, batch, "chunked", 7)
    assert float(loss) == 0.0 and hidden_grad.abs().sum() == 0
    assert grads["lm_head.weight"].abs().sum() == 0  # present (DDP needs every gradient), and zero


def test_never_holds_the_full_logits():
    """The largest tensor any operation makes, forward and backward: [positions, vocab] under the full
    loss, at most [chunk, vocab] (or the [vocab, hidden] weight) under the chunked one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    model = build("llama")
    batch = make_batch()
    positions = batch["input_ids"].numel()
    largest = {}
    for impl in ("full", "chunked"):
        with Largest() as mode:
            loss_sum(model, batch, impl, 7).backward()
        largest[impl] = mode.numel
    assert largest["full"] >= positions * VOCAB
    assert largest["chunked"] <= max(7 * VOCAB, VOCAB * 32), largest


def test_unknown_post_processing_is_an_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, **kwargs):
            out = super().forward(**kwargs)
            out.logits = out.logits * 2  # what finetune/loss.py cannot know
            return out

    model = Doubled(LlamaConfig(**SMALL))
    with pytest.raises(RuntimeError, match="changes the logits after its output layer.*loss_impl=full"):
        loss_sum(model, make_batch(), "chunked")
    assert "forward" not in model.lm_head.__dict__  # restored after the error too


def test_nan_logits_are_not_taken_for_post_processing():
    """Weights gone NaN (a checkpoint saved before saves checked them) give NaN logits, equal to the loss
    module's own NaN logits: the loss is NaN, for the loop's guard to report, not "changes the logits"."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    assert torch.isnan(loss_sum(model, make_batch(), "chunked"))


def test_chunk_bounds_bytes_by_vocab():
    assert chunk_rows(128256) == 523 and chunk_rows(32000) == 2097 and chunk_rows(256000) == 262
    assert all(r * v * 4 <= 256 * 2**20 for v in (1000, 32000, 128256, 256000) for r in [chunk_rows(v)])


def test_liger_is_refused_on_cpu_and_when_missing():
    import importlib.util

    recipe = Recipe(loss_impl="liger", mixed_precision="no")
    with pytest.raises(RecipeError, match="loss_impl=liger needs a CUDA GPU"):
        make_plan(recipe, env={}, cuda_available=False)
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(RecipeError, match="pip install liger-kernel"):
            make_plan(recipe, env={}, cuda_available=True)
    else:
        make_plan(recipe, env={}, cuda_available=True)
    assert make_plan(Recipe(mixed_precision="no"), env={}, cuda_available=False).recipe.loss_impl == "chunked"


def test_liger_on_cpu_is_one_error_line(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCELERATE_") and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "finetune/run.py", "--recipe", "tiny", "mixed_precision=no",
                           "loss_impl=liger", f"output_dir={tmp_path}"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    want = "needs a CUDA GPU" if not torch.cuda.is_available() else "pip install liger-kernel"
    assert len(lines) == 1 and lines[0].startswith("error: loss_impl=liger") and want in lines[0], proc.stderr


@pytest.mark.parametrize("kind", ["llama", "gemma2_softcap", "cohere_scale"])
def test_token_logps_at_a_temperature_are_log_softmax_of_the_logits_over_it(kind):
    """GRPO scores completions as they were sampled: log_softmax(logits / T) of the model's own logits
    (softcap and scale applied first, as the sampler sees them), values and gradients, chunked and full."""
    from finetune.loss import shifted_labels, token_logps

    model = build(kind)
    batch = make_batch()
    targets = shifted_labels(batch["labels"])
    mask = targets != IGNORE
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))

    def direct(temperature):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        logps = torch.log_softmax(logits / temperature, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        logps = torch.nn.functional.pad((logps * mask)[:, :-1], (1, 0))  # laid out as the labels
        (logps * weights).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = direct(0.7)
    assert not torch.allclose(want, direct(1.0)[0], atol=1e-3), "the temperature changes the log-probs"
    for impl, chunk in (("chunked", 7), ("full", None)):
        model.zero_grad(set_to_none=True)
        got = token_logps(model, batch, impl, chunk, temperature=0.7)
        (got * weights).sum().backward()
        assert_close(got.detach(), want, 1e-5, f"{impl} log-probs")
        for name, grad in want_grads.items():
            assert_close(model.get_parameter(name).grad, grad, 1e-5, f"{impl} {name}")
    with pytest.raises(ValueError, match="temperature"):
        token_logps(model, batch, "chunked", temperature=0.0)


@pytest.mark.parametrize("kind", ["llama", "gemma2_softcap"])
def test_token_logps_within_the_tokenizer_rows_are_the_sampled_distribution(kind):
    """An output layer padded past the tokenizer's vocabulary: token_logps_within gives token_logps unchanged
    and the same tokens' log-probs over the first vocab_size rows (the distribution finetune's sampler and the
    vLLM engine draw from), chunked and full, from one forward; a target past those rows is -inf there."""
    from finetune.loss import shifted_labels, token_logps, token_logps_within

    model = build(kind)
    batch = make_batch()
    rows = VOCAB - 7
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] >= rows, 3)
    batch["input_ids"] = torch.where(batch["labels"] != IGNORE, batch["labels"], batch["input_ids"])
    targets = shifted_labels(batch["labels"])
    mask = targets != IGNORE
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / 0.7
    want = torch.log_softmax(logits[..., :rows], -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    want = torch.nn.functional.pad((want * mask)[:, :-1], (1, 0))
    for impl, chunk in (("chunked", 7), ("full", None)):
        full, within = token_logps_within(model, batch, rows, impl, chunk, temperature=0.7)
        assert torch.equal(full, token_logps(model, batch, impl, chunk, temperature=0.7)), impl
        assert_close(within, want, 1e-5, f"{impl} within the vocabulary")
        assert not within.requires_grad
        targeted = batch["labels"] != IGNORE
        assert (within[targeted] >= full[targeted]).all() and (within[targeted] > full[targeted]).any(), \
            "the padded rows' mass is left out"
        same, again = token_logps_within(model, batch, VOCAB, impl, chunk, temperature=0.7)
        assert torch.equal(again, same.detach()), "no padded rows: the policy's own log-probs"
    batch["labels"][0, 12] = rows + 2  # an id no sampler draws
    for impl, chunk in (("chunked", 7), ("full", None)):
        _, within = token_logps_within(model, batch, rows, impl, chunk, temperature=0.7)
        assert within[0, 12] == float("-inf") and torch.isfinite(within[1]).all(), impl
