"""The Hugging Face model inside what a run wraps it in. A module of its own on the ground floor (it
imports nothing of finetune): loss.py needs it for the output layer, model.py for the score head and
the decoder layers, and model.py imports loss.py, so it can live in neither."""

from __future__ import annotations

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
