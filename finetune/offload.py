"""Activation offload (recipe.activation_offload=true): the tensors autograd keeps for the backward
are copied to CPU memory during the forward and back to the device when the backward needs them.

With activation checkpointing (which it requires: recipe.validate) what the forward keeps is each
decoder layer's input (torch's non-reentrant checkpoint saves a layer's inputs as saved tensors, so
saved-tensor hooks around the forward see them; what a layer computes inside is recomputed in the
backward and never packed) and the few tensors outside the layers (the final norm's input and output).
So the device keeps one layer's input at a time, that of the layer being recomputed, instead of one
per layer: the L*B*T*h term of finetune/memory.py's activations moves to CPU memory (the planner
counts it there).

One mechanism for every strategy: torch.autograd.graph.saved_tensors_hooks around the micro-batch's
forward (finetune/training/loop.py), as torch's save_on_cpu and torchtune's OffloadActivations. It is below
DDP, FSDP2 and DeepSpeed (they see the same autograd graph). Parameters are never copied: autograd
saves a weight by reference, and ZeRO-3 and FSDP2 re-gather theirs for the backward; a copy would
move whole gathered weights to the CPU. On a GPU the copy goes to pinned memory asynchronously on
the compute stream (the stream orders it before the device memory is reused) and comes back the same
way; on CPU it is a copy into a separate tensor, so that the CPU tests exercise the same round trip.
"""

from __future__ import annotations

import torch

MIN_BYTES = 1024  # smaller tensors (token ids, norms' per-token scales) stay where they are: not worth a copy


class ActivationOffload:
    """The context around one forward; `packed` counts the bytes it moved (for tests and benches)."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.packed = 0
        self.tensors = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        base = tensor._base if tensor._base is not None else tensor  # a weight is often saved as a view (w.t())
        weight = isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
        if weight or size < self.min_bytes or tensor.layout != torch.strided:
            return tensor
        pin = tensor.device.type == "cuda"
        copy = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        copy.copy_(tensor, non_blocking=pin)
        self.packed += size
        self.tensors += 1
        return tensor.device, copy

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, copy = packed
        return copy.to(device, non_blocking=copy.is_pinned())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def activation_offload(enabled: bool):
    """The context for a micro-batch's forward: ActivationOffload when enabled, else nothing."""
    import contextlib

    return ActivationOffload() if enabled else contextlib.nullcontext()
