"""On-policy distillation's loss (finetune/training/objectives/distill.py): the generalized Jensen-Shannon
divergence between the student's and the teacher's next-token distributions at each completion token, as
TRL 1.16 defines it (trl/trainer/distillation_trainer.py, its chunked kernel trl/kernels/chunked_divergence.py,
and GKD's generalized_jsd_loss), with p_s, p_t = softmax(logits / temperature) of student and teacher:

    beta = 0:      KL(p_t || p_s)                                   forward KL
    beta = 1:      KL(p_s || p_t)                                   reverse KL (TRL's default)
    otherwise:     beta KL(p_t || m) + (1 - beta) KL(p_s || m),    m = (1 - beta) p_s + beta p_t

summed over the vocabulary; the gradient flows to the student only. The logits are each model's own (its
logit scale and softcap, finetune/loss.py OutputHeadLoss), then divided by the temperature, as TRL's.

How the [tokens, vocab] logits are never held whole, for either model: the teacher runs its forward first
(no gradient) with its output layer swapped for one that keeps only the hidden states of the target
positions and a copy of the layer's weight (whatever gathered it for the forward, ZeRO-3 or FSDP, has it
whole then); the student's forward then computes the loss inside its own output layer (as loss.loss_sum
does), a chunk of target tokens at a time: each chunk's student and teacher logits, the divergence and
its gradient with respect to the student's hidden states, weight and bias, computed in the forward (as
loss._ChunkedLinearCrossEntropy does, so the teacher's copy is released with the forward). A chunk holds
a few [rows, vocab] fp32 tensors (CHUNK_BYTES / 4 per tile): 130 tokens at a time for a 128K vocabulary.
What it costs beside the student's own chunked loss: the teacher's output-layer weight, once, in its
compute dtype (1 GiB for a 128K x 4096 bf16 head), while the student's forward runs.

Metrics per chunk, without gradient: the student's entropy at the temperature (TRL's `entropy`), and
whether the student's likeliest token is the teacher's (top-1 agreement)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from finetune.data import IGNORE
from finetune.loss import CHUNK_BYTES, IMPLS, OutputHeadLoss, chunk_logits, grad_buffers, handed_over, shifted_labels

# divergence, student entropy, top-1 agreement: per token, summed
STATS = 3


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per position (the last dim is the vocabulary) the generalized JSD of the module docstring, in fp32:
    TRL's GKD generalized_jsd_loss before its reduction, and its DistillationTrainer kernel's value."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1]")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
    return (beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)).sum(-1)


def token_stats(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[2] the summed student entropy at the temperature and the count of positions whose likeliest tokens agree."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    entropy = -(log_s.exp() * log_s).sum(-1)
    agree = student_logits.argmax(-1) == teacher_logits.argmax(-1)
    return torch.stack([entropy.sum(), agree.sum().float()]).double()


def chunk_tokens(vocab_size: int) -> int:
    """Target tokens per chunk: a chunk's tiles (student and teacher logits, their log-softmax, the
    gradient: about 4 of [rows, vocab] fp32 at once) within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * 4 * vocab_size))


class Teacher:
    """What the teacher's forward leaves for the student's: the hidden states of the target positions and
    its output layer (weight, bias, logit scale and softcap), copied while its forward had them whole."""

    def __init__(self, model, impl: str, chunk: int | None):
        self.model, self.impl, self.chunk = model, impl, chunk
        self.hidden = self.weight = self.bias = None
        self.scale, self.softcap = 1.0, None

    def run(self, inputs: dict, targets: torch.Tensor) -> torch.Tensor | None:
        """The teacher's forward on the batch. Chunked: keeps the target positions' hidden states and the
        output layer; returns None. Where the chunked path cannot run (impl=full, an output layer that is
        not a plain Linear): the target positions' full logits [n, vocab]."""
        with torch.no_grad():
            head = OutputHeadLoss(self.model, self.impl, self.chunk, on_kept=self._keep)
            if self.impl != "full" and head.supported:
                with head.computing_loss(targets):
                    out = self.model(**inputs)
                head.check(out.logits)
                self.scale, self.softcap = head.scale, head.softcap
                return None
            logits = self.model(**inputs).logits
            return logits[targets.to(logits.device) != IGNORE].float()

    def _keep(self, hidden: torch.Tensor, head) -> torch.Tensor:
        self.hidden = hidden.detach()
        # a copy: ZeRO-3 and FSDP free (or reuse) the gathered weight's storage after this layer's forward
        self.weight = head.weight.detach().clone()
        self.bias = head.bias.detach().clone() if head.bias is not None else None
        return hidden.new_zeros(())

    def release(self) -> None:
        self.hidden = self.weight = self.bias = None


def divergence_sum(model, teacher_model, batch: dict, beta: float, temperature: float = 1.0, impl: str = "chunked",
                   chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed divergence over the batch's target tokens, with the student's gradient; [3] float64 sums
    of divergence, student entropy and top-1 agreement over them). The teacher runs first, without gradient;
    both see the same input_ids, attention_mask and labels."""
    if impl not in IMPLS:
        raise ValueError(f"loss impl {impl!r}: must be one of {', '.join(IMPLS)}")
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    targets = shifted_labels(batch["labels"])
    teacher = Teacher(teacher_model, impl, chunk)
    teacher_logits = teacher.run(inputs, targets)
    stats = []
    if teacher_logits is None:
        def on_kept(hidden, head):
            return chunked_divergence(hidden, head.weight, head.bias, teacher, beta, temperature, student.scale,
                                      student.softcap, chunk, stats)

        student = OutputHeadLoss(model, impl, chunk, on_kept=on_kept)
        if student.supported:
            with student.computing_loss(targets):
                out = model(**inputs)
            teacher.release()
            return student.check(out.logits), stats[0]
        # the student's head is no plain Linear (LoRA on lm_head): the teacher's logits from its kept layer
        teacher_logits = chunk_logits(teacher.hidden.to(teacher.weight.dtype), teacher.weight, teacher.bias,
                                 teacher.scale, teacher.softcap)[0]
        teacher.release()
    out = model(**inputs)
    logits = out.logits[targets.to(out.logits.device) != IGNORE]
    teacher_logits = teacher_logits.to(logits.device)
    per_token = generalized_jsd(logits, teacher_logits, beta, temperature)
    with torch.no_grad():
        sums = torch.cat([per_token.detach().sum()[None].double(), token_stats(logits, teacher_logits, temperature)])
    return per_token.sum(), sums


def chunked_divergence(hidden, weight, bias, teacher: Teacher, beta: float, temperature: float, scale: float = 1.0,
                       softcap: float | None = None, chunk: int | None = None, stats: list | None = None) -> torch.Tensor:
    """The summed divergence over n target tokens from the student's hidden states [n, h] and output layer
    and the teacher's kept ones ([n, h_t]), a chunk of tokens at a time; appends the [3] sums of
    divergence_sum to `stats`."""
    if teacher.hidden is None or teacher.hidden.shape[0] != hidden.shape[0]:
        raise RuntimeError(f"the teacher kept {None if teacher.hidden is None else teacher.hidden.shape[0]} target "
                           f"positions for the student's {hidden.shape[0]}")
    if teacher.weight.shape[0] != weight.shape[0]:
        raise RuntimeError(f"the teacher's output layer has {teacher.weight.shape[0]} rows, the student's "
                           f"{weight.shape[0]}: distillation needs one vocabulary")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    options = (beta, temperature, scale, softcap, chunk or chunk_tokens(weight.shape[0]), dtype, needs)
    sums = torch.zeros(STATS, dtype=torch.float64, device=hidden.device)
    loss = _ChunkedDivergence.apply(hidden, weight, bias, teacher, options, sums)
    if stats is not None:
        stats.append(sums)
    return loss


class _ChunkedDivergence(torch.autograd.Function):
    """Forward: each chunk's student and teacher logits, the divergence, and already the gradients of the
    student's hidden states, weight and bias (as loss._ChunkedLinearCrossEntropy: the teacher's output
    layer is needed in the forward only, and the student's is gathered for its forward anyway); backward
    scales them by the incoming gradient. The tile's divergence and its gradient come from autograd on
    the chunk's fp32 logits (generalized_jsd), so the formula is written once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, options, sums):
        beta, temperature, scale, softcap, rows, dtype, needs = options
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            tw, tb = teacher.weight, teacher.bias
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, needs)
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                h = hidden[part].to(dtype)
                total += _chunk(h, w, b, teacher.hidden[part].to(tw.dtype), tw, tb, teacher.scale, teacher.softcap,
                                beta, temperature, scale, softcap, sums, grad_h[part] if grad_h is not None else None,
                                grad_w, grad_b)
        ctx.grads = [grad_h, grad_w, grad_b]
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        return (*handed_over(ctx, grad_out), None, None, None)


def _chunk(h, w, b, th, tw, tb, t_scale, t_softcap, beta, temperature, scale, softcap, sums, grad_h, grad_w,
           grad_b) -> torch.Tensor:
    """One chunk's summed divergence; adds its metrics into sums and its gradients into grad_h (this chunk's
    rows), grad_w and grad_b where given. A function of its own so that the chunk's [rows, vocab] tensors
    are freed on return, before the next chunk allocates its own."""
    teacher_logits = chunk_logits(th, tw, tb, t_scale, t_softcap)[0]
    z = F.linear(h, w, b).float()
    wanted = grad_h is not None or grad_w is not None or grad_b is not None
    with torch.enable_grad():
        z.requires_grad_(wanted)
        logits = z * scale if scale != 1.0 else z
        if softcap is not None:
            logits = (logits / softcap).tanh() * softcap
        loss = generalized_jsd(logits, teacher_logits, beta, temperature).sum()
        g = torch.autograd.grad(loss, z)[0] if wanted else None
    with torch.no_grad():
        sums += torch.cat([loss.detach()[None].double(), token_stats(logits.detach(), teacher_logits, temperature)])
    if g is None:
        return loss.detach()
    g = g.to(h.dtype)
    if grad_h is not None:
        grad_h.copy_(g @ w)
    if grad_w is not None:
        grad_w += (g.t() @ h).float()
    if grad_b is not None:
        grad_b += g.float().sum(0)
    return loss.detach()
