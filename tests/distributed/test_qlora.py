"""QLoRA on 2 real processes under FSDP2 and ZeRO-3 (CPU, gloo, fp32: the 4-bit NF4 base's packed bits
stored in fp32): the loss falls; the frozen 4-bit base is unchanged (final/ on a base freshly quantized by
finetune.model.load_4bit_base, the loader a user evaluates or generates from a QLoRA adapter with, gives
exactly the run's final eval loss, and on the unquantized base a different one, so the run computed with
the 4-bit base); final/ is an adapter plain peft loads;
final_merged/ is base + adapter in fp32; checkpoints hold the adapter only; a resume from the middle
checkpoint continues bit for bit.

One uninterrupted run and one resume per strategy: four 2-process launches in all."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import once
from safetensors.torch import load_file

from tests.distributed.test_lora import saved_model_keys

QLORA = ["lora=true", "load_in_4bit=true", "merge_lora=true", "max_steps=6", "eval_every=3", "save_every=3",
         "keep_last=2", "lr=1e-2"]


@pytest.fixture(scope="module")
def qlora_runs(launch):
    return once(lambda strategy: launch(2, f"strategy={strategy}", *QLORA))


def _recipe(run):
    from finetune.recipe import FIELDS, Recipe

    resolved = json.loads((run.output_dir / "recipe.json").read_text())
    recipe = Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in resolved.items() if k in FIELDS})
    return recipe, resolved["model"]


def eval_loss(model, run, monkeypatch) -> float:
    """The run's eval loss computation (finetune.training.loop.evaluate over both ranks' eval batches) in this process."""
    from finetune import data as D
    from finetune.training.loop import evaluate
    from finetune.model import load_tokenizer
    from finetune.training.objectives import objective_for

    for key in ("FINETUNE_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(key, run.env[key])
    recipe, base = _recipe(run)
    tokenizer = load_tokenizer(recipe, base)
    ds = D.build_datasets(recipe, tokenizer).eval
    batches = [b for rank in (0, 1) for b in D.eval_batches(ds, recipe.micro_batch_size, rank, 2, recipe.eval_max_samples)]
    return evaluate(model.eval(), ds, batches, tokenizer.pad_token_id, recipe.packing, torch.device("cpu"),
                    lambda t: t, objective_for(recipe))[0]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_qlora_trains_adapter_on_frozen_4bit_base(strategy, qlora_runs, monkeypatch):
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.model import load_4bit_base

    run = qlora_runs(strategy)
    out = run.output_dir
    assert run.losses[-1] < run.losses[0] - 0.1, run.losses
    evals = [r["eval_loss"] for r in run.eval_records]
    assert evals[-1] < evals[0], evals

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert len(adapter) == 28 and all("lora_" in k for k in adapter)
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: trained
    for checkpoint in (out / "checkpoints").iterdir():
        keys = saved_model_keys(checkpoint)
        assert len(keys) == len(adapter) and all("lora_" in k for k in keys), \
            f"{checkpoint.name} holds frozen base weights or quantization constants: {keys[:3]}"

    _, base_path = _recipe(run)
    # bitsandbytes decides as on a CPU with AVX512-BF16, whatever this one has (tests/test_qlora_cpu_paths.py
    # forces both decisions): the reload must still compute what the run computed.
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    four_bit = load_4bit_base(base_path, torch.float32)  # the run's base_dtype (mixed_precision=no)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in four_bit.modules()) == 14
    on_4bit = eval_loss(PeftModel.from_pretrained(four_bit, out / "final"), run, monkeypatch)
    assert on_4bit == pytest.approx(evals[-1], rel=1e-6, abs=0), \
        "final/ on a freshly quantized base must give the run's final eval loss: the 4-bit base changed in training"

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    on_plain = eval_loss(PeftModel.from_pretrained(base, out / "final"), run, monkeypatch)
    assert abs(on_plain - evals[-1]) > 1e-4, "the run did not compute with a 4-bit base"

    merged = AutoModelForCausalLM.from_pretrained(out / "final_merged").eval()
    assert {p.dtype for p in merged.parameters()} == {torch.float32}  # the training dtype (mixed_precision=no)
    probe = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), out / "final").eval()(
            input_ids=probe).logits
        got = merged(input_ids=probe).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_qlora_resume_is_exact(strategy, qlora_runs, launch, tmp_path_factory):
    reference = qlora_runs(strategy)
    out = tmp_path_factory.mktemp(f"qlora-resume-{strategy}")
    name = "step_000000003"
    shutil.copytree(reference.output_dir / "checkpoints" / name, out / "checkpoints" / name)
    resumed = launch(2, f"strategy={strategy}", *QLORA, "--resume", "auto", output_dir=out)
    assert "at step 3" in resumed.stderr
    tail = [(r["step"], r["loss"], r["grad_norm"]) for r in reference.train_records if r["step"] > 3]
    assert len(tail) == 3
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed.train_records if r["step"] > 3] == tail
    assert [r["eval_loss"] for r in resumed.eval_records if r["step"] > 3] == \
        [r["eval_loss"] for r in reference.eval_records if r["step"] > 3]
    a = load_file(str(reference.output_dir / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
