"""The training loss: next-token cross-entropy summed over the target tokens, computed from the hidden
states and the output projection a chunk of tokens at a time, so that the [tokens, vocab] logits never
exist at once.

Why: with Llama-3's 128,256-token vocabulary the full logits of 2048 tokens are 1 GB in fp32, and the
loss kept three tensors that size (the logits, their log-softmax, their gradient): 2.5 GiB of the
3.7 GiB peak of a small model on CPU (docs/benchmarks.md section 7), about 20 GB for an 8B model
at 4 x 4096 tokens per GPU. Chunked, the loss needs one chunk's logits (CHUNK_BYTES) whatever the
sequence length.

How it stays correct under every strategy: the loss is computed *inside* the model's forward, by the
output projection module itself. `loss_sum` swaps the forward of `model.get_output_embeddings()` for
the duration of one call (a context manager) so that it receives the hidden states and returns the
summed loss. Whatever gathers that module's weight for its forward gathers it for the loss too:
ZeRO-3's hooks on lm_head, FSDP2's unshard hooks (Accelerate makes lm_head a unit of its own, an
FSDPLinear; a root-owned lm_head is unsharded for the root's whole forward), nothing under DDP. Because the returned loss is that module's (and the model's)
output, the strategies' backward hooks on outputs fire as they would for logits. Tied embeddings
need nothing special (the weight is one Parameter; its gradient accumulates from both uses), nor does
LoRA (peft leaves lm_head a plain frozen Linear unless lm_head is targeted; then the full path runs).

Models that change the logits after lm_head are handled explicitly: final_logit_softcapping (Gemma
2/3/3n/4 and others), Cohere's logit_scale, Granite's 1/logits_scaling, HyperCLOVA X's
logits_scaling and Falcon-H1's lm_head_multiplier are switched off on the model for the call and
applied per chunk here. Any other post-processing is caught: the model must hand our loss back as its
`logits` unchanged, else loss_sum stops with an error that says to use loss_impl=full.

`loss_impl=liger` computes the same inside the same hook with Liger-Kernel's fused linear
cross-entropy (Triton, CUDA only). Liger-Kernel is not a dependency and that path is untested here
(no GPU, no liger on the machine this was written on); plan.py refuses it on CPU or when missing.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.nn.functional as F

from finetune.data import IGNORE
from finetune.unwrap import hf_model

IMPLS = ("chunked", "liger", "full")

# Rows of logits per chunk are chosen so that one chunk's fp32 logits take at most this many bytes:
# a bound on memory that holds for any vocabulary (128k vocab: 523 tokens; 32k: 2097; 256k: 262).
# Measured on CPU (bench/parts/loss_memory.py --sweep, docs/benchmarks.md section 7: 2-layer hidden-64 Llama,
# 128k vocab, 2048 tokens): the process peak grows by about one chunk's logits (0.98, 1.10, 1.38,
# 1.87, 2.80 GiB at 128, 256, 512, 1024, 2048 tokens per chunk; 1.36 at 523), while the step time
# is flat from 512 tokens up (4.37-4.52 s) and 13% slower at 128 and 256 (5.02, 5.04 s); against
# 6.62 s and 3.80 GiB for the full logits. 256 MiB sits at the start of the flat part; the matmuls
# stay large (>= 262 rows for vocabularies up to 256k) for GPUs, whose kernels want big tiles.
CHUNK_BYTES = 256 * 2**20  # the planner counts the same (memory.LOSS_CHUNK_BYTES)

log = logging.getLogger("finetune")


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label of each position is the next token. Shift the labels, not the logits: slicing
    logits[:, :-1] copies the batch x length x vocab tensor (bench/studies/loss_overhead.py)."""
    return F.pad(labels, (0, 1), value=IGNORE)[:, 1:]


def model_inputs(batch: dict) -> tuple[dict, torch.Tensor]:
    """(what the model is called with, each position's target). A sequence-parallel shard
    (finetune/sequence_parallel.py) carries its targets shifted over the whole row before it was
    sliced (shift_labels: its last token's target is the next shard's first token), and its
    attention_mask only for counting: Ulysses attention is causal over the gathered sequence and
    discards masks, and the padding (on the right) has no targets."""
    if "shift_labels" in batch:
        inputs = {k: v for k, v in batch.items() if k not in ("shift_labels", "attention_mask")}
        return inputs, batch["shift_labels"]
    return {k: v for k, v in batch.items() if k != "labels"}, shifted_labels(batch["labels"])


def loss_sum(model, batch: dict, impl: str = "chunked", chunk: int | None = None,
             aux: list | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over target tokens: the caller divides by the
    target tokens of the whole global batch, so every split of that batch gives the same update.

    impl: "chunked" (default), "liger" (CUDA, Liger-Kernel), "full" (the fp32 logits of every token at
    once: the reference the others are tested against). chunk: target tokens per chunk (the recipe's
    loss_chunk_tokens); None: chunk_rows(vocab).
    """
    if impl not in IMPLS:
        raise ValueError(f"loss impl {impl!r}: must be one of {', '.join(IMPLS)}")
    inputs, targets = model_inputs(batch)
    if impl != "full":
        head = OutputHeadLoss(model, impl, chunk)
        if head.supported:
            with head.computing_loss(targets):
                out = model(**inputs)
            loss = head.check(out.logits)
            return loss + router_aux_loss(model, out, targets.to(loss.device), aux)
    out = model(**inputs)
    labels = targets.to(out.logits.device)
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss + router_aux_loss(model, out, labels, aux)


def router_aux_loss(model, outputs, labels: torch.Tensor, record: list | None = None) -> torch.Tensor | float:
    """A mixture of experts' load-balancing loss, when its config asks for it (output_router_logits),
    while training: coef * aux weighted by this micro-batch's target tokens, so that after the loop's
    division by the global batch's tokens it adds coef * (token-weighted mean aux), as transformers'
    own `loss + router_aux_loss_coef * aux_loss` does for one batch. `record` collects the unweighted
    aux values for the metrics."""
    inner = getattr(model, "module", model)  # DDP and DeepSpeed hold the model as .module; a DeepSpeedEngine's
    aux = getattr(outputs, "aux_loss", None)  # own .config and .training are not the model's
    if aux is None or not inner.training:
        return 0.0
    if record is not None:
        record.append(aux.detach().float())
    coef = getattr(getattr(inner, "config", None), "router_aux_loss_coef", 0.0) or 0.0
    return coef * aux.float() * (labels != IGNORE).sum()


_WARNED: set[str] = set()


class OutputHeadLoss:
    """One call's worth of "the output projection returns the loss": what to switch off on the model
    and what to apply per chunk instead, and the check that the model returned our loss unchanged."""

    def __init__(self, model, impl: str, chunk: int | None, per_token: bool = False, temperature: float = 1.0,
                 vocab_size: int | None = None, entropy: bool = False, head_dtype: torch.dtype | None = None,
                 on_kept=None):
        self.impl, self.chunk, self.per_token = impl, chunk, per_token
        self.entropy = entropy  # per_token: also each token's entropy (self.entropies)
        self.entropies = None
        self.head_dtype = head_dtype  # per_token: the output layer's matmul in this dtype (cast_lm_head_to_fp32)
        # on_kept(hidden, head): another loss from the target positions' hidden states [n, h] and the output
        # layer, returned in place of the cross-entropy (finetune/divergence.py: distillation)
        self.on_kept = on_kept
        self.temperature = temperature  # per_token: the logits, as the model makes them, divided by it
        self.vocab_size = vocab_size  # per_token: also the log-probs over the first vocab_size rows (self.within)
        self.within = None
        self.rows = None  # per_token: the batch row of each target token
        self.positions = None  # per_token: each target token's flat index in the shifted targets
        hf = hf_model(model)
        self.head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        # A Linear whose forward is Linear's own (FSDP2 makes lm_head an FSDPLinear that only adds hooks),
        # in a dtype matmul takes: not a peft LoRA layer, not a quantized Linear subclass.
        self.supported = (isinstance(self.head, torch.nn.Linear) and type(self.head).forward is torch.nn.Linear.forward
                          and self.head.weight.dtype in (torch.float32, torch.bfloat16, torch.float16))
        if not self.supported:
            kind = type(self.head).__name__
            if kind not in _WARNED:
                _WARNED.add(kind)
                log.warning(f"loss_impl={impl}: the output layer is a {kind}, not a plain Linear (LoRA on lm_head? "
                            "quantized?); computing the loss from the full logits instead")
            return
        self.model_type = getattr(hf.config, "model_type", type(hf).__name__)
        # (object, attribute, neutral value): what the model would apply to the logits, switched off
        self.switched: list[tuple[object, str, object]] = []
        self.scale, self.softcap = 1.0, None
        configs = [hf.config]
        text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        if text is not hf.config:
            configs.append(text)
        for owner in [hf, *configs]:
            cap = getattr(owner, "final_logit_softcapping", None)
            if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
                self.softcap = float(cap)
                self.switched.append((owner, "final_logit_softcapping", None))
        family = str(self.model_type)
        if family.startswith("cohere") and isinstance(getattr(hf, "logit_scale", None), (int, float)):
            self.scale *= float(hf.logit_scale)  # logits = logits * self.logit_scale
            self.switched.append((hf, "logit_scale", 1.0))
        for config in configs:
            value = getattr(config, "logits_scaling", None)
            if not isinstance(value, (int, float)) or value == 1:
                continue
            if family.startswith("granite"):  # logits = logits / config.logits_scaling
                self.scale /= float(value)
            elif family.startswith("hyperclovax"):  # logits = lm_head(h) * config.logits_scaling
                self.scale *= float(value)
            else:
                continue  # unknown meaning: check() stops the run if the model applies it
            self.switched.append((config, "logits_scaling", 1.0))
        inner = getattr(hf, "model", None)
        if family.startswith("falcon_h1") and isinstance(getattr(inner, "lm_head_multiplier", None), (int, float)):
            self.scale *= float(inner.lm_head_multiplier)  # logits = lm_head(h) * model.lm_head_multiplier
            self.switched.append((inner, "lm_head_multiplier", 1.0))
        self.loss = None

    @contextlib.contextmanager
    def computing_loss(self, targets: torch.Tensor):
        """targets: each position's target (shifted_labels of the labels)."""
        head = self.head
        saved_forward = head.__dict__.get("forward")  # an instance-level forward someone else set
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.switched]

        def forward(hidden):
            if self.loss is not None:
                raise RuntimeError("the output layer was called twice in one forward; use loss_impl=full")
            flat = targets.to(hidden.device).reshape(-1)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if hidden.shape[0] != flat.shape[0]:
                raise RuntimeError(f"the output layer got {hidden.shape[0]} positions for {flat.shape[0]} labels; "
                                   "use loss_impl=full")
            # Only target tokens need logits: prompts and padding (often most of a fine-tuning batch) are
            # skipped. Counting them is one host sync, after the forward is queued.
            keep = (flat != IGNORE).nonzero().squeeze(1)
            options = {"scale": self.scale, "softcap": self.softcap, "chunk": self.chunk}
            if self.per_token:
                self.rows, self.positions = keep // targets.shape[-1], keep
                compute, options = linear_token_logps, options | {"temperature": self.temperature,
                                                                  "dtype": self.head_dtype}
            else:
                compute = linear_cross_entropy
            kept, kept_targets = hidden.index_select(0, keep), flat.index_select(0, keep)
            if self.on_kept is not None:
                self.loss = self.on_kept(kept, head)
                return self.loss
            if self.per_token and self.entropy:
                self.loss, self.entropies = compute(kept, head.weight, head.bias, kept_targets, self.impl, **options,
                                                    entropy=True)
            else:
                self.loss = compute(kept, head.weight, head.bias, kept_targets, self.impl, **options)
            if self.per_token and self.vocab_size is not None and self.vocab_size >= head.weight.shape[0]:
                self.within = self.loss.detach()  # no padded rows
            elif self.per_token and self.vocab_size is not None:
                with torch.no_grad():  # the same tokens against the first vocab_size rows only (-inf past them)
                    rows = slice(0, self.vocab_size)
                    past = kept_targets >= self.vocab_size
                    self.within = compute(kept, head.weight[rows], head.bias[rows] if head.bias is not None else None,
                                          kept_targets.masked_fill(past, 0), self.impl, **options
                                          ).masked_fill(past, float("-inf"))
            return self.loss

        head.forward = forward
        for owner, name, neutral in self.switched:
            setattr(owner, name, neutral)
        try:
            yield
        finally:
            if saved_forward is None:
                del head.forward
            else:
                head.forward = saved_forward
            for owner, name, value in saved:
                setattr(owner, name, value)

    def check(self, logits) -> torch.Tensor:
        """The model's `logits` must be our loss, unchanged: anything the model did to it after lm_head
        is a computation this module does not reproduce. The strategies wrap outputs in identity
        autograd functions (ZeRO-3 for its backward hooks), so the test is on the value, not the
        object (equal, NaN where NaN: weights gone NaN are the loss guard's to report, not a model that
        changes its logits); it costs a host sync, so it runs on the first call per output layer and
        mode (training/eval), which is enough for what is a property of the model's code."""
        if self.loss is None:
            raise RuntimeError(f"loss_impl={self.impl}: {self.model_type} did not call its output layer "
                               "(get_output_embeddings) in forward; use loss_impl=full")
        seen = _CHECKED.setdefault(self.head, set())
        if torch.is_grad_enabled() not in seen:
            if not (torch.is_tensor(logits) and logits.shape == self.loss.shape
                    and torch.allclose(logits.detach(), self.loss.detach(), rtol=0, atol=0, equal_nan=True)):
                raise RuntimeError(f"loss_impl={self.impl}: {self.model_type} changes the logits after its output "
                                   "layer in a way finetune/loss.py does not know; use loss_impl=full (and report "
                                   "the model)")
            seen.add(torch.is_grad_enabled())
        return logits


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sequence_logps(model, batch: dict, impl: str = "chunked", chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its target tokens (the next token wherever the labels are
    set), and its number of target tokens: what preference losses score a sequence by. As loss_sum,
    computed inside the output layer a chunk of tokens at a time (linear_token_logps), so that no
    [tokens, vocab] logits exist at once; impl=full computes them from the full logits. Of a
    sequence-parallel shard: its own tokens' sums and counts (sequence_parallel.row_logps sums them over
    the shards)."""
    if "shift_labels" in batch:  # a shard: the model gets no attention_mask (see model_inputs)
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
        targets = batch["shift_labels"]
    else:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        targets = shifted_labels(batch["labels"])
    rows = targets.shape[0]
    if impl != "full":
        head = OutputHeadLoss(model, impl, chunk, per_token=True)
        if head.supported:
            with head.computing_loss(targets):
                out = model(**inputs)
            logps = head.check(out.logits)
            where = head.rows.to(logps.device)
            sums = torch.zeros(rows, dtype=logps.dtype, device=logps.device).index_add(0, where, logps)
            counts = torch.zeros(rows, dtype=torch.long, device=logps.device).index_add(
                0, where, torch.ones_like(where))
            return sums, counts
    out = model(**inputs)
    targets = targets.to(out.logits.device)
    mask = targets != IGNORE
    logps = torch.log_softmax(out.logits.float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (logps * mask).sum(-1), mask.sum(-1)


def token_logps(model, batch: dict, impl: str = "chunked", chunk: int | None = None,
                temperature: float = 1.0, head_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each target token's log-probability, [rows, length] fp32 laid out as the labels: out[b, t] =
    log softmax(logits / temperature)[labels[b, t]] of the position before t where labels[b, t] is set, 0
    elsewhere (what a policy-gradient loss weighs token by token, finetune/training/objectives/grpo.py). The
    logits are the model's own (its logit scale and softcap applied), then divided by the temperature: the
    distribution a sampler at that temperature drew from (finetune/generation.py), as TRL's GRPOTrainer
    and verl score a policy. As sequence_logps, computed inside the output layer a chunk of tokens at a
    time, no [tokens, vocab] logits at once; impl=full from the full logits. Of a sequence-parallel
    shard: laid out as its shift_labels (out[b, p] the log-prob of shift_labels[b, p]: the targets are
    shifted over the whole row; sequence_parallel.whole_tokens makes the row's). head_dtype: the output
    layer's matmul (and so
    the logits) in this dtype rather than the weight's or autocast's (float32: cast_lm_head_to_fp32)."""
    return _token_logps(model, batch, impl, chunk, temperature, None, head_dtype=head_dtype)[0]


def token_logps_entropy(model, batch: dict, impl: str = "chunked", chunk: int | None = None,
                        temperature: float = 1.0, head_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_logps, each of those positions' entropy of softmax(logits / temperature), laid out as the
    labels: TRL's `entropy` metric, and with its gradient its entropy bonus), from one forward."""
    return _token_logps(model, batch, impl, chunk, temperature, None, entropy=True, head_dtype=head_dtype)


def token_logps_within(model, batch: dict, vocab_size: int, impl: str = "chunked", chunk: int | None = None,
                       temperature: float = 1.0, head_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_logps, the same tokens' log-probs over the output layer's first vocab_size rows only), from one
    forward, the second without gradient. vocab_size: the tokenizer's vocabulary (len(tokenizer)); the rows
    past it (an embedding padded to a multiple) are never sampled (finetune/generation.py, the vLLM engine),
    so the second is the distribution a sampler drew from, which an inference engine's log-probs are
    compared with (finetune/training/generators.py); the first stays the policy's, the loss's."""
    return _token_logps(model, batch, impl, chunk, temperature, vocab_size, head_dtype=head_dtype)


def _token_logps(model, batch: dict, impl: str, chunk: int | None, temperature: float, vocab_size: int | None,
                 entropy: bool = False, head_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not temperature > 0:
        raise ValueError(f"token_logps: temperature={temperature} must be > 0")
    if "shift_labels" in batch:  # a sequence-parallel shard: laid out as its shift_labels (no attention_mask)
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
        targets, offset = batch["shift_labels"], 0
    else:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        targets, offset = shifted_labels(batch["labels"]), 1
    if impl != "full":
        head = OutputHeadLoss(model, impl, chunk, per_token=True, temperature=temperature, vocab_size=vocab_size,
                              entropy=entropy, head_dtype=head_dtype)
        if head.supported:
            with head.computing_loss(targets):
                out = model(**inputs)
            logps = head.check(out.logits)
            # shifted position p predicts the label at p + 1 (the last position of a row has no target)
            where = head.positions.to(logps.device) + offset

            def laid_out(values):
                flat = torch.zeros(targets.numel(), dtype=values.dtype, device=values.device)
                flat = flat.index_put((where,), values)
                return flat.view(targets.shape)

            if entropy:
                return laid_out(logps), laid_out(head.entropies)
            return laid_out(logps), laid_out(head.within) if vocab_size is not None else None
    if head_dtype is not None:
        raise ValueError(f"head_dtype={head_dtype}: the output layer's dtype is chosen on the chunked path only "
                         "(loss_impl=chunked, a plain Linear output layer)")
    out = model(**inputs)
    targets = targets.to(out.logits.device)
    mask = targets != IGNORE
    logits = out.logits.float() / temperature if temperature != 1.0 else out.logits.float()

    def laid_out(values):  # as the labels (shifted one position on), or as a shard's shift_labels
        return F.pad(values[:, :-1], (1, 0)) if offset else values

    def gathered(z):
        past = targets >= z.shape[-1]  # an id past the first vocab_size rows: -inf
        logps = torch.log_softmax(z, dim=-1).gather(-1, targets.clamp(0, z.shape[-1] - 1)[..., None]).squeeze(-1)
        return laid_out(logps.masked_fill(past, float("-inf")) * mask)

    full = gathered(logits)
    if entropy:
        h = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return full, laid_out(h * mask)
    if vocab_size is None:
        return full, None
    return full, (full.detach() if vocab_size >= logits.shape[-1] else gathered(logits[..., :vocab_size].detach()))


def linear_token_logps(hidden, weight, bias, targets, impl: str = "chunked", *, scale: float = 1.0,
                       softcap: float | None = None, chunk: int | None = None, temperature: float = 1.0,
                       dtype: torch.dtype | None = None, entropy: bool = False):
    """log softmax(softcap(scale * (hidden_i @ weight.T + bias)) / temperature)[targets_i] for each i: [n]
    in fp32, a chunk of rows at a time (liger has no per-token form: the chunked path serves it too).
    dtype: the matmul's (None: autocast's, else the weight's). entropy: also each row's entropy of that
    distribution ([n] fp32, differentiable), returned second."""
    device_type = hidden.device.type
    if dtype is None:
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    logps, entropies = _ChunkedTokenLogps.apply(hidden, weight, bias, targets, scale, softcap,
                                                chunk or chunk_rows(weight.shape[0]), dtype, temperature, entropy)
    return (logps, entropies) if entropy else logps


class _ChunkedTokenLogps(torch.autograd.Function):
    """Forward: each token's log-probability, chunk by chunk. Backward: the chunk's logits again (a
    preference loss weighs each sequence's tokens by a factor known only after the forward, so the
    weight's gradient cannot be summed ahead as _ChunkedLinearCrossEntropy does), then the gradients.
    The output layer's weight and bias are kept as the Parameters themselves, not saved tensors:
    ZeRO-3 and FSDP free the gathered weight after the layer's forward and gather it again before the
    layer's backward, which is when this backward reads it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, rows, dtype, temperature=1.0, entropy=False):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            entropies = torch.empty(hidden.shape[0] if entropy else 0, dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                z, _ = chunk_logits(hidden[part].to(dtype), w, b, scale, softcap, temperature)
                lse = torch.logsumexp(z, dim=-1)
                out[part] = z.gather(1, targets[part, None]).squeeze(1) - lse
                if entropy:  # H = logsumexp(z) - sum softmax(z) z
                    entropies[part] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, targets)
        ctx.weight, ctx.bias, ctx.options = weight, bias, (scale, softcap, rows, dtype, temperature)
        ctx.set_materialize_grads(False)  # entropies only a metric: no gradient of theirs to compute
        return out, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_entropies=None):
        hidden, targets = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        scale, softcap, rows, dtype, temperature = ctx.options
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, ctx.needs_input_grad[:3])
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                h = hidden[part].to(dtype)
                z, tanh = chunk_logits(h, w, b, scale, softcap, temperature)
                p = torch.softmax(z, dim=-1)
                # d log p[y] / dz = onehot(y) - p; d H / dz = -p (log p + H) (the entropy bonus)
                g = p.neg() if grad_entropies is not None else p.neg_()
                if grad_out is not None:
                    g[torch.arange(g.shape[0], device=g.device), targets[part]] += 1.0
                    g.mul_(grad_out[part, None].float())
                else:
                    g.zero_()
                if grad_entropies is not None:
                    logp = torch.log_softmax(z, dim=-1)
                    entropy = -(p * logp).sum(-1, keepdim=True)
                    g.sub_(p.mul_(logp.add_(entropy)).mul_(grad_entropies[part, None].float()))
                if temperature != 1.0:  # z is the model's logits / temperature
                    g.div_(temperature)
                if tanh is not None:
                    g.mul_(tanh.mul_(tanh).neg_().add_(1.0))
                if scale != 1.0:
                    g.mul_(scale)
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[part] = (g @ w).to(grad_h.dtype)
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
                if grad_b is not None:
                    grad_b += g.float().sum(0)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None, None, None, None)


def chunk_logits(h, w, b, scale: float, softcap: float | None, temperature: float = 1.0):
    """A chunk's fp32 logits as the model would produce them (its scale, then its softcap), divided by
    the sampling temperature, and the softcap's tanh for the backward."""
    z = F.linear(h, w, b).float()
    if scale != 1.0:
        z = z * scale
    tanh = None
    if softcap is not None:
        tanh = (z / softcap).tanh()
        z = tanh * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, tanh


def linear_cross_entropy(hidden, weight, bias, targets, impl: str = "chunked", *, scale: float = 1.0,
                         softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """sum_i CE(softcap(scale * (hidden_i @ weight.T + bias)), targets_i) for hidden [n, h], targets [n]
    (no IGNORE among them), without materialising the [n, vocab] logits."""
    if impl == "liger" and hidden.shape[0]:  # no target tokens: the chunked path's zero loss and gradients
        return _liger(hidden, weight, bias, targets, scale, softcap)
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    rows = chunk or chunk_rows(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, scale, softcap, rows, dtype, needs)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes, chunk by chunk, the loss and already the gradients of the hidden states,
    weight and bias (as Liger's fused linear cross-entropy does); backward only scales them by the
    incoming gradient. Against recomputing each chunk's logits in backward this saves one of the four
    [chunk, vocab, hidden] matmuls, and costs no memory at the peak: lm_head is the last op of the
    forward and the first of the backward, so the weight's gradient would be allocated at that point
    anyway. Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as autocast's
    linear followed by `logits.float()` would do; one backward only (the gradients are handed over)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, rows, dtype, needs):
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, needs)
            for start in range(0, n, rows):
                part = slice(start, start + rows)
                total += _chunk(hidden[part].to(dtype), w, b, targets[part], scale, softcap,
                                grad_h[part] if grad_h is not None else None, grad_w, grad_b)
        ctx.grads = [grad_h, grad_w, grad_b]
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        return (*handed_over(ctx, grad_out), None, None, None, None, None, None)


def grad_buffers(hidden, weight, bias, needs) -> tuple:
    """The fp32 gradients of the hidden states, the output layer's weight and bias a chunked loss fills in its
    forward (None where not needed: needs, three booleans)."""
    need_h, need_w, need_b = needs
    return (torch.empty_like(hidden) if need_h else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None)


def handed_over(ctx, grad_out) -> tuple:
    """The gradients a forward computed (ctx.grads: hidden states, weight, bias), scaled by the incoming
    gradient, in the parameters' dtypes (ctx.dtypes); one backward only."""
    if ctx.grads is None:
        raise RuntimeError("the chunked loss supports one backward per forward")
    grad_h, grad_w, grad_b = ctx.grads
    ctx.grads = None
    if grad_h is not None:
        grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))
    if grad_w is not None:
        grad_w = grad_w.mul_(grad_out).to(ctx.dtypes[0])
    if grad_b is not None:
        grad_b = grad_b.mul_(grad_out).to(ctx.dtypes[1])
    return grad_h, grad_w, grad_b


def _chunk(h, w, b, y, scale: float, softcap: float | None, grad_h, grad_w, grad_b) -> torch.Tensor:
    """One chunk's summed loss; adds its gradients into grad_h (a view of this chunk's rows), grad_w
    and grad_b where given. A function of its own so that the chunk's [rows, vocab] tensors are freed
    on return, before the next chunk allocates its own (RSS would otherwise hold two)."""
    z = F.linear(h, w, b).float()
    if scale != 1.0:
        z.mul_(scale)
    tanh = None
    if softcap is not None:
        tanh = z.div_(softcap).tanh_()
        z = tanh * softcap
    lse = torch.logsumexp(z, dim=-1)
    loss = (lse - z.gather(1, y[:, None]).squeeze(1)).sum()
    if grad_h is None and grad_w is None and grad_b is None:
        return loss
    g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    g[torch.arange(g.shape[0], device=g.device), y] -= 1.0
    if tanh is not None:  # d(cap * tanh(x / cap))/dx = 1 - tanh^2, in place of tanh
        g.mul_(tanh.mul_(tanh).neg_().add_(1.0))
        del tanh
    if scale != 1.0:
        g.mul_(scale)
    g = g.to(h.dtype)
    if grad_h is not None and grad_h.dtype == g.dtype:
        torch.matmul(g, w, out=grad_h)
    elif grad_h is not None:
        grad_h.copy_(g @ w)
    if grad_w is not None and g.dtype == torch.float32:
        grad_w.addmm_(g.t(), h)
    elif grad_w is not None:
        grad_w += (g.t() @ h).float()
    if grad_b is not None:
        grad_b += g.float().sum(0)
    return loss


def _liger(hidden, weight, bias, targets, scale, softcap):
    """Liger-Kernel's fused linear cross-entropy (Triton; CUDA). Untested in this repository: no GPU
    and no liger_kernel where it was written; plan.py makes loss_impl=liger an error on CPU or when
    the package is missing. A logit scale folds into the hidden states: s * (h W^T + b) = (s h) W^T + s b."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    if scale != 1.0:
        hidden = hidden * scale
        bias = bias * scale if bias is not None else None
    options = {"softcap": softcap} if softcap is not None else {}  # older releases have no softcap
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum", **options)(weight, hidden, targets,
                                                                                            bias)
    return loss[0] if isinstance(loss, tuple) else loss
