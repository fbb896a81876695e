"""Activation offload (finetune/offload.py): with activation checkpointing, what the forward keeps for
the backward is copied to CPU memory and back; loss and gradients are those without offload, and what
is moved is each decoder layer's checkpointed input, never a weight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.loss import loss_sum
from finetune.offload import ActivationOffload, activation_offload
from finetune.recipe import Recipe, RecipeError, validate

LAYERS, HIDDEN, ROWS, LENGTH = 3, 64, 2, 96


def tiny_model(checkpointing: bool = True):
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def step(model, batch, offload: bool, impl: str = "chunked"):
    model.zero_grad(set_to_none=True)
    with activation_offload(offload) as moved:
        loss = loss_sum(model, batch, impl)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, moved


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_offload_gives_the_same_loss_and_gradients(impl):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (ROWS, LENGTH))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    model = tiny_model()
    loss, grads, _ = step(model, batch, offload=False, impl=impl)
    loss_off, grads_off, moved = step(model, batch, offload=True, impl=impl)
    assert torch.equal(loss, loss_off)
    for name, g in grads.items():
        assert torch.equal(g, grads_off[name]), name
    # the checkpointed inputs of the layers (and the final norm's input) went to the CPU copy
    layer_input = ROWS * LENGTH * HIDDEN * 4
    assert isinstance(moved, ActivationOffload)
    assert moved.packed >= LAYERS * layer_input, moved.packed


def test_offload_moves_each_layer_input_not_weights():
    """Packed tensors are activations ([rows, tokens, ...]); parameters (and their views, w.t()) stay."""
    ids = torch.randint(0, 256, (ROWS, LENGTH))
    model = tiny_model()
    weights = {p.data_ptr() for p in model.parameters()}
    shapes = []

    class Recording(ActivationOffload):
        def pack(self, tensor):
            packed = super().pack(tensor)
            if packed is not tensor:
                assert tensor.untyped_storage().data_ptr() not in weights
                shapes.append(tuple(tensor.shape))
            return packed

    with Recording():
        loss = loss_sum(model, {"input_ids": ids, "labels": ids.clone()}, "chunked")
    loss.backward()
    assert shapes.count((ROWS, LENGTH, HIDDEN)) >= LAYERS, shapes


def test_offload_is_refused_without_checkpointing_or_with_compile():
    base = Recipe(activation_offload=True, activation_checkpointing=True)
    validate(dataclasses.replace(base, dataset="builtin:tiny-tasks"))
    with pytest.raises(RecipeError, match="activation_offload=true without activation_checkpointing.*"
                                          "set activation_checkpointing=true"):
        validate(dataclasses.replace(base, activation_checkpointing=False))
    with pytest.raises(RecipeError, match="activation_offload=true with compile=true"):
        validate(dataclasses.replace(base, compile=True, strategy="ddp"))
