"""QLoRA evaluation on either of bitsandbytes' CPU paths, whatever this machine's CPU. bitsandbytes
decides per Linear4bit, when it makes the layer, whether the CPU has AVX512-BF16 (has_avx512bf16()); if
so, the layer's first eval forward without grad repacks its weight into a CPU inference layout that
asserts out_features % 32 == 0. The tiny model's MLP has 176 outputs. Each test forces the decision
both ways, so a machine without the instruction set runs what one with it would (see
finetune.model.keep_4bit_layout and docs/host-dependence.md)."""

from __future__ import annotations

import pytest
import torch

TINY_LINEAR4BIT = 14  # 2 decoder layers x (q, k, v, o, gate, up, down)


@pytest.fixture(params=[False, True], ids=["no-avx512bf16", "avx512bf16"])
def avx512bf16(request, monkeypatch):
    """bitsandbytes' AVX512-BF16 decision, forced: Linear4bit.__init__ reads has_avx512bf16 from
    bitsandbytes.nn.modules."""
    import bitsandbytes as bnb
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: request.param)
    layer = bnb.nn.Linear4bit(64, 176, bias=False, quant_type="nf4")
    assert layer.support_avx512bf16_for_cpu is request.param, \
        "bitsandbytes no longer decides the CPU path where this fixture forces it; update the fixture"
    return request.param


@pytest.fixture(scope="module")
def tiny():
    from finetune.assets import tiny_model_dir

    return str(tiny_model_dir())


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    """A LoRA adapter in peft's format (what final/ of a QLoRA run holds), with B non-zero so it counts."""
    from transformers import AutoModelForCausalLM

    from finetune.model import add_lora
    from finetune.recipe import Recipe

    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                     Recipe(lora=True, lora_dropout=0.0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return out


def probe():
    return torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(0))


def plain_quantized(path):
    """transformers + bitsandbytes alone, with the run's quantization settings: no finetune code."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32,
                                                device_map={"": "cpu"})


def test_forcing_reproduces_the_packed_layout_failure(avx512bf16, tiny):
    """The control: without finetune's loader, a 4-bit tiny model stops at its first eval forward exactly
    when bitsandbytes decides AVX512-BF16, as on such a CPU; so the tests below would catch it here."""
    model = plain_quantized(tiny).eval()
    if avx512bf16:
        with pytest.raises(AssertionError, match="N must be divisible by block_n"), torch.no_grad():
            model(input_ids=probe())
    else:
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=probe()).logits).all()


def _reload(tiny, adapter):
    from peft import PeftModel

    from finetune.model import load_4bit_base

    return PeftModel.from_pretrained(load_4bit_base(tiny, torch.float32), adapter)


def _training(tiny, adapter):
    from finetune.model import load_model
    from finetune.recipe import Recipe, apply_overrides, validate

    recipe = validate(apply_overrides(Recipe(mixed_precision="no"), [
        "strategy=ddp", "lora=true", "load_in_4bit=true", "lora_dropout=0"]))
    return load_model(recipe, tiny, None)


@pytest.mark.parametrize("loader", [_reload, _training], ids=["reload-adapter", "training-load"])
def test_qlora_eval_on_4bit_base_either_cpu_path(loader, avx512bf16, tiny, adapter):
    """Reloading final/ on a freshly quantized base (what a user does to evaluate or generate from a QLoRA
    adapter) and the run's own load: the eval forward under no_grad works with a 176-wide MLP, computes
    exactly the training forward's logits, and leaves the 4-bit weights and quantization constants as
    loaded (nothing repacked that a checkpoint or save_pretrained could write)."""
    import bitsandbytes as bnb

    model = loader(tiny, adapter)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == TINY_LINEAR4BIT and any(m.out_features % 32 for m in layers)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with torch.no_grad():
        evaluated = model.eval()(input_ids=probe()).logits
        trained = model.train()(input_ids=probe()).logits  # a training forward never takes the packed path
    assert torch.equal(evaluated, trained)
    assert not any(m.support_avx512bf16_for_cpu for m in layers)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)

    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():  # bytes: packed NF4 bits held in fp32 can read as NaN
        assert after[key].dtype == value.dtype and after[key].shape == value.shape, key
        assert torch.equal(_bytes(after[key]), _bytes(value)), key
    if loader is _reload:
        assert any(k.endswith("weight.absmax") for k in before)  # the quantization constants were compared too


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
