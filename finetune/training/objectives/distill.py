"""On-policy distillation (objective=distill) as TRL 1.16's DistillationTrainer defines it (trl/trainer/
distillation_trainer.py), with GKD's lmbda (trl/experimental/gkd) for the share of on-policy steps: the
student learns the teacher's next-token distribution at every completion token, under the generalized
Jensen-Shannon divergence of finetune/divergence.py (distill_beta, TRL's `beta`: 0 forward KL, 1 reverse
KL, TRL's default; at `temperature`, TRL's, which also samples).

The data are SFT rows (prompt and completion, or messages: finetune/data). A step is on-policy with
probability lmbda, drawn from (seed, step) alone (on_policy_step), so every rank, any process count and a
resumed run agree: its rows keep their prompt (each row's tokens before its first target token) and get
the student's own completion in place of the dataset's, sampled through the generator seam
(finetune/training/generators.py: ours, or a vLLM engine) at temperature, top_p, top_k, up to
max_completion_len tokens (and within max_seq_len with the prompt). Completion of dataset row i at step s samples with its own seed
completion_seed(seed, s, i), which keys the noise of its every token (finetune/generation.py), so the
tokens do not depend on the process count nor on the other rows of the batch, and a resumed run samples
what the uninterrupted one did. Other steps train on the dataset's completions as they are (GKD's
off-policy batches; lmbda=0 is supervised KD).

The teacher (teacher_model: a hub id, local directory or builtin:NAME, of the student's vocabulary,
checked before either model loads) is a frozen model beside the student, loaded in the compute dtype and
placed by the strategy as DPO's reference is (Strategy.wrap_reference: ZeRO-3 partitions it, FSDP2 shards
it on the student's mesh and offloads it with the parameters, ddp/zero1/zero2 hold it whole); never in
checkpoints: a resume reads it from teacher_model again, refused in one line where its weights are not those
the checkpoint recorded (teacher_identity, in every checkpoint's manifest and recipe.json).

The loss a step optimizes is the mean divergence over the global batch's completion tokens (TRL's:
the sum over a micro-batch divided by the global batch's completion tokens), whatever its split into
ranks and micro-batches: `loss` returns a micro-batch's sum, `counts` says what it is averaged over.
Metrics (means over completion tokens): teacher_agreement (the share where the student's likeliest token
is the teacher's), entropy (the student's at the temperature, TRL's), on_policy (the share of completion
tokens the student sampled: 1 or 0 a step), completions/mean_length (completion tokens per row). The eval
scores the eval split's dataset completions (off-policy: the same tokens at every eval, so its curve
shows the student's distance to the teacher alone)."""

from __future__ import annotations

import hashlib

import torch

from finetune import data as D
from finetune.data import IGNORE
from finetune.checkpointing.identity import identity_change
from finetune.divergence import divergence_sum
from finetune.errors import RecipeError
from finetune.training.generators import generator_for
from finetune.training.metrics import log
from finetune.training.objectives.base import Basic, Context

METRICS = ("teacher_agreement", "entropy", "on_policy", "completions/mean_length")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether step `step` (0-based) trains on the student's own completions: a uniform draw from a stable
    hash of (seed, step) below lmbda (GKD's `random.random() <= lmbda`, made the same on every rank)."""
    if lmbda >= 1.0:
        return True
    if lmbda <= 0.0:
        return False
    return _hash(f"distill-lmbda:{seed}:{step}") / 2**63 < lmbda


def completion_seed(seed: int, step: int, row: int) -> int:
    """A completion's sampling seed: a stable 63-bit hash of (recipe seed, step, dataset row)."""
    return _hash(f"distill:{seed}:{step}:{row}")


def prompt_of(input_ids: torch.Tensor, labels: torch.Tensor) -> list[int] | None:
    """A row's prompt: its tokens before the first target token (None: a placeholder row, no target)."""
    targets = (labels != IGNORE).nonzero()
    if not len(targets):
        return None
    return input_ids[:int(targets[0])].tolist()


def on_policy_batch(prompts: list[list[int] | None], completions: list[list[int]], pad_id: int) -> dict:
    """A micro-batch of the student's completions: each row its prompt then its completion, right-padded,
    the completion's tokens as labels; a placeholder row (prompt None) one pad token without a target."""
    rows = [(p or [pad_id]) + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, :len(row)] = 1
        if p is not None and len(row) > len(p):
            labels[i, len(p):len(row)] = torch.tensor(row[len(p):], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def same_vocabulary(student_tokenizer, teacher_path: str, student_config, teacher_config) -> str | None:
    """Why the teacher cannot teach this student (one line), or None: another output vocabulary size, or a
    tokenizer (where the teacher's directory has one) that maps some token to another id."""
    s, t = getattr(student_config, "vocab_size", None), getattr(teacher_config, "vocab_size", None)
    if s != t:
        return (f"its vocabulary has {t} tokens, the student's {s}: the divergence compares the two models' "
                "distributions over one vocabulary; use a teacher of the student's family and tokenizer")
    from transformers import AutoTokenizer

    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError):
        return None  # no tokenizer beside the weights: the vocabulary sizes are what can be checked
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        return ("its tokenizer maps tokens to other ids than the student's (another tokenizer of the same size): "
                "the divergence compares the two models' distributions token id by token id; use a teacher with "
                "the student's tokenizer")
    return None


def check_teacher(recipe, student_tokenizer, student_config) -> tuple[str, object]:
    """The teacher's directory and config, read without its weights: one line (RecipeError) where it is not
    there, cannot be read, is not a causal language model (a reward model's final/, a classifier) or has
    another vocabulary than the student's. The `finetune` front calls it before launching
    (commands/train.check_model_and_data), each rank before either model loads (before_model)."""
    from pathlib import Path

    from transformers import AutoConfig

    from finetune.assets import resolve_model
    from finetune.recipe import looks_local
    from finetune.unwrap import without_zero3_init

    with without_zero3_init():  # a builtin teacher made now is built whole, not partitioned by ZeRO-3's zero.Init
        path = resolve_model(recipe.teacher_model)
    if looks_local(recipe.teacher_model) and not Path(path).is_dir():
        raise RecipeError(f"teacher_model={recipe.teacher_model}: no such directory; point it at a model directory "
                          "(a run's final/: the tiny_distill recipe's teacher is made by `finetune/run.py --recipe "
                          "tiny`, run it first) or a hub id")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RecipeError(f"teacher_model={recipe.teacher_model}: cannot read its config ({str(e).splitlines()[0]}); "
                          "give a hub id or a directory with config.json (offline? set HF_HUB_OFFLINE=0)") from None
    problem = not_a_language_model(config) or same_vocabulary(student_tokenizer, path, student_config, config)
    if problem:
        raise RecipeError(f"teacher_model={recipe.teacher_model}: {problem}")
    return path, config


def not_a_language_model(config) -> str | None:
    """Why a model of this config cannot teach (one line), or None: its class (config.architectures) is not
    a causal language model's, so it gives no next-token distribution (a reward model: one score per row)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetune.model import is_reward_config

    classes = getattr(config, "architectures", None) or []
    if not classes or any(c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in classes):
        return None
    what = "a reward model (one score per row)" if is_reward_config(config) else "not a causal language model"
    return (f"it is a {'/'.join(classes)}, {what}: distillation learns the teacher's next-token distribution; give "
            "a causal language model of the student's vocabulary (a run's final/ after objective=sft, for example)")


def same_model(recipe) -> str | None:
    """A line where the teacher is the student's own starting model: the divergence starts at 0, and with it
    its gradient (but for rounding), so the student has nothing to learn from its copy."""
    from pathlib import Path

    def where(name):  # a directory by its real path; a hub id or builtin:NAME as it is
        path = Path(name).expanduser()
        return str(path.resolve()) if path.is_dir() else name

    if where(recipe.teacher_model) != where(recipe.model):
        return None
    return (f"teacher_model={recipe.teacher_model} is the student's own model (model={recipe.model}): the divergence "
            "starts at 0, with its gradient, so the student has nothing to learn from its copy (only rounding noise); "
            "give a stronger teacher of the same vocabulary")


def teacher_identity(path: str, main: bool) -> dict:
    """The teacher's weights' identity (finetune/checkpointing/identity.py: its files' hashes, or its hub
    revision), computed on the main process and shared: recorded in every checkpoint, compared on resume."""
    from finetune.checkpointing.identity import model_identity

    identity = [model_identity(path) if main else None]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(identity, src=0)
    return identity[0]


class Distill(Basic):
    name = "distill"
    metrics = METRICS
    shown = {"teacher_agreement": "agree"}
    panels = (("loss: the generalized JSD to the teacher", "divergence (mean per completion token)", "loss"),
              ("top-1 agreement: the student's likeliest token is the teacher's", "share of completion tokens",
               "teacher_agreement"),
              ("student entropy at the temperature", "nats per completion token", "entropy"))

    def __init__(self, recipe):
        self.recipe = recipe
        self.beta, self.temperature, self.lmbda = recipe.distill_beta, recipe.temperature, recipe.lmbda
        self.loss_impl, self.chunk = recipe.loss_impl, recipe.loss_chunk_tokens or None
        self.teacher = None
        self.generator = None
        self.sums = None

    def before_model(self, context: Context) -> None:
        """The teacher checked (check_teacher), before either model loads."""
        from finetune.training.generators import check_installed

        check_installed(context.recipe)
        r = context.recipe
        self.teacher_path, self.teacher_config = check_teacher(r, context.tokenizer, context.config)
        if context.accelerator.is_main_process and same_model(r):
            log.warning(same_model(r))
        self.teacher_identity = teacher_identity(self.teacher_path, context.accelerator.is_main_process)
        resume = context.plan.resume
        saved = resume.manifest.get("teacher_identity") if resume is not None else None
        change = identity_change(saved, self.teacher_identity) if saved else None
        if change:
            raise RecipeError(f"teacher_model={r.teacher_model} is not the teacher checkpoint {resume.path} was trained "
                              f"with ({change}): the resumed steps would learn another model's distributions; restore "
                              f"that teacher, or export the checkpoint (python -m finetune.export {resume.path} OUT) "
                              "and start a new run with model=OUT")

    def after_prepare(self, context: Context, model) -> dict:
        """The teacher, loaded and placed by the strategy, and the generator of the on-policy completions."""
        import dataclasses

        from finetune.model import load_model
        from finetune.training.objectives.grpo import generate_completions
        from finetune.training.reference import compute_dtype

        r = context.recipe
        plain = dataclasses.replace(r, activation_checkpointing=False, compile=False, lora=False,
                                    load_in_4bit=False)
        teacher = load_model(plain, self.teacher_path, self.teacher_config, context.weights_on_this_rank,
                             dtype=compute_dtype(r))
        teacher.requires_grad_(False)
        teacher.eval()
        self.teacher = context.plan.strategy.wrap_reference(context.accelerator, teacher)
        self.accelerator = context.accelerator
        if context.accelerator.is_main_process:  # ZeRO-3 partitions as it loads: ds_numel is the whole count
            count = sum(getattr(p, "ds_numel", p.numel()) for p in teacher.parameters())
            log.info(f"teacher: {r.teacher_model} ({count / 1e6:.1f}M parameters), a frozen model placed by "
                     f"strategy={r.strategy}")
        self.generator = generator_for(context, generate_completions) if r.lmbda > 0 else None
        return {"teacher_model": r.teacher_model, "teacher_identity": self.teacher_identity}

    def rollout(self, run, step: int, micro_batches: list[dict], stop=None) -> list[dict] | None:
        """The step's batches: the dataset's (an off-policy step), or the same rows' prompts with the student's
        completions (generated here, in one call for all of this rank's rows). None where a stop request
        ended the generation on any rank."""
        for b in micro_batches:
            b["on_policy"] = torch.tensor(False)
        if not on_policy_step(self.recipe.seed, step, self.lmbda):
            return micro_batches
        rows = run.schedule.rows(step, run.parallel.sp.dp_rank)
        prompts = [[prompt_of(b["input_ids"][i], b["labels"][i]) for i in range(len(b["input_ids"]))]
                   for b in micro_batches]
        wanted = [(p, completion_seed(self.recipe.seed, step, row))
                  for batch, rows_ in zip(prompts, rows) for p, row in zip(batch, rows_) if p is not None]
        outs = self.generator(run, [p for p, _ in wanted], [s for _, s in wanted], step, stop)
        self.generator.sleep()
        cut = torch.tensor([float(stop is not None and bool(stop.requested))], device=run.accelerator.device)
        if run.reduce_sum(cut).item() > 0:
            return None
        made, it = [], iter(outs)
        for batch in prompts:
            # cut to max_seq_len with the prompt: as if sampling had stopped there (each token is seeded alone)
            completions = [next(it).tokens[:max(0, self.recipe.max_seq_len - len(p))] if p is not None else []
                           for p in batch]
            b = on_policy_batch(batch, completions, run.tokenizer.pad_token_id)
            b["on_policy"] = torch.tensor(True)
            made.append(b)
        return made

    def loss(self, model, batch: dict, aux: list | None = None) -> torch.Tensor:
        """The summed divergence over a micro-batch's completion tokens; the metrics' sums are kept."""
        loss, sums = divergence_sum(model, self.teacher, batch, self.beta, self.temperature, self.loss_impl,
                                    self.chunk)
        tokens = float((batch["labels"][:, 1:] != IGNORE).sum())
        rows = float((batch["labels"][:, 1:] != IGNORE).any(-1).sum())
        on_policy = tokens if bool(batch.get("on_policy", False)) else 0.0
        values = torch.cat([sums[1:].to(loss.device),
                            torch.tensor([tokens, on_policy, rows], dtype=torch.float64, device=loss.device)])
        self.sums = values if self.sums is None else self.sums + values
        return loss

    def counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's part of the global batch as [completion tokens (what the loss is averaged over), the
        same, input tokens], float64; the loop sums it over ranks."""
        targets = sum(D.target_tokens(b) for b in micro_batches)
        return torch.tensor([targets, targets, sum(D.input_tokens(b) for b in micro_batches)], dtype=torch.float64)

    def eval_count(self, batch: dict) -> int:
        return D.target_tokens(batch)

    def means(self, sums: torch.Tensor, count: torch.Tensor | None = None) -> list[float]:
        """[entropy, agreement, tokens, on-policy tokens, rows] summed over ranks -> the metrics' values."""
        entropy, agree, tokens, on_policy, rows = sums.tolist()
        tokens_ = max(tokens, 1.0)
        return [agree / tokens_, entropy / tokens_, on_policy / tokens_, tokens / max(rows, 1.0)]
