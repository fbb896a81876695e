"""compile=true: which recipes it is refused for (one line, before any model loads), and what
compile_layers compiles: the decoder layers in place, nothing else. Nothing here runs a compiled
graph; tests/distributed/test_compile_run.py trains with one."""

import pytest
import torch

from finetune.recipe import Recipe, RecipeError, apply_overrides, load_recipe_module, validate


def checked(*overrides) -> Recipe:
    return validate(apply_overrides(load_recipe_module("tiny"), ["mixed_precision=no", "compile=true", *overrides]))


def refusal(*overrides) -> str:
    with pytest.raises(RecipeError) as info:
        checked(*overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_off_by_default_and_typed():
    assert Recipe().compile is False
    assert apply_overrides(Recipe(), ["compile=true"]).compile is True
    with pytest.raises(RecipeError, match="compile=maybe: expected a boolean"):
        apply_overrides(Recipe(), ["compile=maybe"])


@pytest.mark.parametrize("overrides", [
    ["strategy=ddp"], ["strategy=fsdp"], ["strategy=zero1"], ["strategy=zero2"],
    ["strategy=fsdp", "activation_checkpointing=true"], ["strategy=ddp", "lora=true"],
    ["strategy=fsdp", "lora=true", "activation_checkpointing=true"], ["strategy=ddp", "lora=true", "load_in_4bit=true"],
])
def test_allowed(overrides):
    assert checked(*overrides).compile


@pytest.mark.parametrize("overrides, words", [
    (["strategy=zero3"], ["compile=true with strategy=zero3", "use strategy=fsdp", "compile=false"]),
    (["strategy=zero3", "lora=true"], ["compile=true with strategy=zero3"]),
    (["strategy=fsdp", "fsdp_version=1"], ["compile=true with fsdp_version=1", "fsdp_version=2", "compile=false"]),
    (["strategy=fsdp", "lora=true", "load_in_4bit=true"],
     ["compile=true with load_in_4bit=true and strategy=fsdp", "compile=false"]),
])
def test_refused(overrides, words):
    message = refusal(*overrides)
    for word in words:
        assert word in message, message


def test_refused_by_the_command_line_before_loading(tmp_path):
    from in_process import run_main

    code, _, err = run_main(["--recipe", "tiny", "compile=true", "strategy=zero3", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and "error: compile=true with strategy=zero3" in err
    assert not (tmp_path / "out").exists()


def tiny_model(*overrides):
    from finetune.assets import tiny_model_dir
    from finetune.model import load_config, load_model

    recipe = checked(f"model={tiny_model_dir()}", *overrides)
    path, config = load_config(recipe)
    return load_model(recipe, path, config)


@pytest.mark.parametrize("overrides", [["strategy=ddp"], ["lora=true", "strategy=fsdp", "activation_checkpointing=true"]])
def test_compiles_the_decoder_layers_in_place(overrides):
    """Only the layers FSDP wraps: their class stays (Accelerate's transformer_based_wrap finds them by
    class name), and lm_head, whose forward the chunked loss swaps, stays outside any compiled graph."""
    model = tiny_model(*overrides)
    compiled = [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    layers = [name for name, m in model.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert compiled == layers and len(layers) == 2, compiled
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert model.get_output_embeddings()._compiled_call_impl is None
