"""The Hugging Face model inside what a run wraps it in. A module of its own on the ground floor (it
imports nothing of finetune): loss.py needs it for the output layer, model.py for the score head and
the decoder layers, and model.py imports loss.py, so it can live in neither. without_zero3_init is here
too: rewards.py loads reward models with it, and model.py imports recipe.py, which imports rewards.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def hf_model(model):
    """The Hugging Face model under DDP / DeepSpeed / FSDP1 wrappers, torch.compile and peft."""
    while True:
        if isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, DeepSpeedEngine, FSDP1
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            break
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


@contextmanager
def without_zero3_init():
    """Inside a ZeRO-3 run, transformers builds every model under deepspeed.zero.Init, which partitions
    it with collectives; a load on the main process alone would then wait for the other ranks forever."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
