"""QLoRA without training: which combinations validation refuses (one line naming the key and the fix),
the bitsandbytes check, and the planner's arithmetic for a 4-bit base per strategy."""

from __future__ import annotations

import dataclasses

import pytest

from finetune import memory as M
from finetune.arch import known_architecture
from finetune.plan import bitsandbytes_problem, make_plan
from finetune.recipe import Recipe, RecipeError, apply_overrides, resolve, validate

GIB = 2**30


def recipe(*overrides) -> Recipe:
    return validate(apply_overrides(Recipe(mixed_precision="no"), ["lora=true", "load_in_4bit=true", *overrides]))


@pytest.mark.parametrize("strategy", ["fsdp", "zero3", "ddp"])
def test_4bit_runs_sharded_and_on_cpu(strategy):
    r = recipe(f"strategy={strategy}")
    plan = make_plan(r, env={"WORLD_SIZE": "2"}, cuda_available=False)  # no longer refused on CPU
    assert plan.device == "cpu" and not plan.unchecked


@pytest.mark.parametrize("overrides, message", [
    (["lora=false"], r"^load_in_4bit=True applies to LoRA runs only; set lora=true or load_in_4bit=false$"),
    (["strategy=zero2"], r"^load_in_4bit=true with strategy=zero2: .* use one of those$"),
    (["strategy=zero1"], r"^load_in_4bit=true with strategy=zero1: .*strategy=fsdp or zero3"),
    (["strategy=fsdp", "fsdp_version=1"], r"^load_in_4bit=true with fsdp_version=1: .*use fsdp_version=2$"),
    (["strategy=fsdp", "offload_params=cpu"], r"^load_in_4bit=true with offload_params=cpu: .*offload_params=none"),
    (["strategy=zero3", "offload_params=cpu"], r"^load_in_4bit=true with offload_params=cpu: "),
])
def test_bad_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(RecipeError, match=message) as e:
        recipe(*overrides)
    assert "\n" not in str(e.value)


def test_missing_or_old_bitsandbytes_is_refused_before_loading(monkeypatch):
    missing = bitsandbytes_problem(find_spec=lambda name: None)
    assert missing.startswith("load_in_4bit=true (QLoRA) needs bitsandbytes, which is not installed: pip install "
                              "bitsandbytes")
    old = bitsandbytes_problem(version="0.43.1")
    assert "needs bitsandbytes >= 0.45 (found 0.43.1): pip install -U bitsandbytes" in old
    assert bitsandbytes_problem(version="0.50.2") is None

    import finetune.plan as P

    monkeypatch.setattr(P, "bitsandbytes_problem", lambda: missing)
    with pytest.raises(RecipeError, match="needs bitsandbytes, which is not installed"):
        make_plan(recipe("strategy=fsdp"), env={}, cuda_available=False)
    dry = make_plan(recipe("strategy=fsdp"), env={}, cuda_available=False, dry_run=True)
    assert missing in dry.unchecked  # a dry run (another machine's plan) says it instead


LLAMA70B = known_architecture("meta-llama/Llama-3.1-70B-Instruct")


@pytest.mark.parametrize("mp, width", [("bf16", 2), ("no", 4)])
def test_planner_counts_the_4bit_base_per_strategy(mp, width):
    a = LLAMA70B
    adapters = M.lora_parameters(a, 16)
    q = a.decoder_linear_weights()
    rest = a.num_parameters() - q  # embeddings, lm_head, norms: in the training dtype
    # double-quantized absmax and each Linear's two code tables, kept whole on every rank
    constants = q * (1 / 64 + 4 / (64 * 256)) + 80 * 7 * (16 + 256) * 4
    assert constants / q == pytest.approx(0.0159, abs=1e-4)
    for n in (2, 8):
        for strategy in ("fsdp", "zero3"):
            e = M.estimate(a, M.Setup(strategy), world_size=n, mixed_precision=mp, lora_params=adapters,
                           quantized_base=True)
            pb = 4 if strategy == "fsdp" or mp == "no" else 2  # fsdp keeps fp32 adapters; DeepSpeed 16-bit
            assert e.params == pytest.approx((0.5 * q + width * rest + pb * adapters) / n + constants, abs=2)
        ddp = M.estimate(a, M.Setup("ddp"), world_size=n, mixed_precision=mp, lora_params=adapters,
                         quantized_base=True)
        assert ddp.params == pytest.approx(0.5 * q + width * rest + 4 * adapters + constants, abs=2)
    # about 0.5 byte per quantized weight plus its constants, against 2 or 4 bytes unquantized
    plain = M.estimate(a, M.Setup("fsdp"), world_size=2, mixed_precision=mp, lora_params=adapters)
    four = M.estimate(a, M.Setup("fsdp"), world_size=2, mixed_precision=mp, lora_params=adapters, quantized_base=True)
    assert plain.params - four.params == pytest.approx(q * (width - 0.5) / 2 - constants, abs=2)
    # a gathered layer is packed too; one Linear at a time is dequantized into the compute dtype
    assert four.buffers < plain.buffers


def test_planner_counts_the_tiny_run_as_measured():
    """Measured on CPU (bench/helpers/memory_probe.py, 2 processes, fp32, strategy=fsdp lora=true load_in_4bit=true):
    held_bytes per rank 131,200 bytes of parameters, 74,752 of gradients, 149,504 of Adam states; the
    quantization constants (QuantState tensors of the 14 Linear4bit) 16,784 bytes on every rank."""
    r = recipe("strategy=fsdp", "model=builtin:tiny-llama", "grad_accum=2", "micro_batch_size=2", "max_seq_len=64")
    e = M.recipe_estimate(r, 2, M.load_architecture(r.model))
    constants = e.params - 131_200
    assert (e.grads, e.optimizer) == (74_752, 149_504)
    assert constants == pytest.approx(16_784, rel=0.01)


def test_planner_offers_only_setups_a_4bit_base_runs_under():
    r = resolve("llama70b_qlora_fsdp", [])
    rows = M.all_estimates(r, 2, LLAMA70B)
    labels = {e.setup.label for _, e in rows}
    assert labels == {"ddp", "ddp + sharded optimizer", "fsdp", "zero3", "zero3, optimizer->cpu"}
    plain = M.all_estimates(dataclasses.replace(r, load_in_4bit=False), 2, LLAMA70B)
    assert len(plain) > len(rows)


def test_qlora_70b_recipe_plan_on_two_gpus(capsys):
    from finetune.commands.plan import main

    r = resolve("llama70b_qlora_fsdp", [])
    assert (r.strategy, r.lora, r.load_in_4bit, r.mixed_precision, r.offload_params) == \
        ("fsdp", True, True, "bf16", "none")
    assert main(["--recipe", "llama70b_qlora_fsdp", "--gpus", "2", "--gpu-mem", "48GB"]) == 0
    out = capsys.readouterr().out
    assert "the recipe's setup (fsdp): 29.55 GiB per GPU, fits" in out
    assert main(["--recipe", "llama70b_qlora_fsdp", "--gpus", "2", "--gpu-mem", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "the recipe's setup (fsdp): 29.55 GiB per GPU, does NOT fit" in out
    assert "nothing fits in 20.12 GiB per GPU: use more GPUs, a smaller micro_batch_size or max_seq_len\n" in out
    fsdp = M.recipe_estimate(r, 2, LLAMA70B)
    assert fsdp.params / GIB == pytest.approx(19.29, abs=0.01)
