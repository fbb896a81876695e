"""Our DPO (objective=dpo) against TRL's DPOTrainer: the same pairs, model and hyper-parameters, step by step.

    python bench/studies/dpo_vs_trl.py                            # compare (1 process) and timing (2 processes), ~15 min
    python bench/studies/dpo_vs_trl.py --only compare             # sigmoid and ipo, 20 steps each side, ~4 min
    python bench/studies/dpo_vs_trl.py --only tokens              # pairs' tokens on real tokenizers against TRL's, ~1 min
    python bench/studies/dpo_vs_trl.py --only timing --rounds 2   # zero3 and fsdp, ours vs TRL, 2 processes
    python bench/studies/dpo_vs_trl.py --doc docs/benchmarks.md   # also writes section 12 of the report

TRL is a bench-only dependency (pip install -e .[bench], or `pip install --no-deps 'trl>=1.0'` beside the
project's pinned accelerate/datasets/transformers). Exit 1 when a pair's tokens differ or a compared metric differs
by more than 1e-5 * max(1, |TRL's value|) at some step: 1e-5 absolute for the loss, rewards and accuracies, relative
for logps/chosen|rejected, which are sums of ~30 token log-probs around -120, where one fp32 ulp is already 7.6e-6
(two toolkits summing in a different order differ by a few ulps from step 1 on: a plain-torch loop against TRL
does, by up to 1.5e-5).

1. compare: 64 generated prompt/chosen/rejected string pairs (`rows()`: reverse the words of a phrase; the
   rejected answer is the phrase as it was, one word short, one word long or letter-reversed, so the two
   sides' lengths differ), a random-weight 2-layer Llama saved with save_pretrained with the toolkit's
   character tokenizer (bench/parts/common.py build_model), fp32 on CPU, one process each. Ours is
   `python finetune/run.py --recipe tiny objective=dpo dataset_format=preference ...`; TRL's is this file's
   `trl` mode, DPOTrainer given the same recipe's numbers: lr, AdamW betas/eps, weight decay 0, constant
   lr with no warmup, max_grad_norm 1.0, seed, micro-batch 4 pairs, accumulation 2, dpo_beta 0.1, 20 steps,
   dropout off (both), no gradient checkpointing (both), and the same pairs in the same order: TRL's sampler
   yields finetune.data.BatchSchedule's order (bench/helpers/trainer_baseline.py ScheduleSampler), so step k of both
   runs sees the same pairs on the same ranks. Compared per step (TRL's names, which our metrics.jsonl uses
   too): loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
   logps/rejected; also each pair's tokens (TRL's prompt_ids/chosen_ids/rejected_ids against ours).
2. tokens: each pair's tokens and trained positions, ours against TRL's prepared pairs, on real tokenizers
   (Mistral v1 and v3 sentencepiece and tekken from the mistral_common wheel, a Llama-3-style byte-level BPE;
   tests/family_assets.py): the first 16 pairs and SEAM_PAIRS (a prompt ending in a space, answers starting
   with one, a newline, a word cut by the prompt's end); on tekken also the 16 with an empty prompt; on the BPE
   also the 16 as conversations under TRL's qwen2_5_training.jinja. And per side the length ipo averages over,
   ours (scored) against TRL's (trl_ipo_length). No training. Exit 1 when a pair's tokens differ or the ipo
   lengths differ other than by TRL's count of a sequence's first token (IPO_LENGTH_NOTE).
3. timing: the same pairs on a larger model (bench llama-7m: hidden 256, 4 layers, vocab 8192), 2 processes
   (`accelerate launch --multi_gpu --num_processes 2`, gloo), strategy zero3 and fsdp, ours against TRL:
   seconds per optimizer step, the median of the steps after the first WARMUP, with the CPU load of the rest
   of the machine during each launch (Launch.other_load) and `uptime`'s load average before each pair.
   Rounds alternate who goes first; a pair run on a busy machine is re-run (NOISE_LIMIT).

TRL 1.16's semantics, read from trl/trainer/dpo_trainer.py (and what the bench does about each):
- Tokenization, non-conversational rows: chosen and rejected get the EOS *text* appended unless they end
  with it; `tokenizer(prompt)`, `tokenizer(prompt + chosen)` and `tokenizer(prompt + rejected)` are
  tokenized as whole texts with the tokenizer's special tokens (BOS for Llama/Mistral-style tokenizers; the
  character tokenizer adds <s>); the completion starts at min(common prefix of the prompt's ids with each
  side's ids): one prompt length for both sides, and whatever follows it is trained. Our preference format
  follows our SFT rule (BOS + prompt + completion as one text + EOS, the completion from where the prompt's
  own tokens stop matching), then both sides are scored from the earlier of the two starts
  (finetune/data/preference.py same_prompt, TRL's rule): where one answer merges with the prompt's last
  token ("...is Par" + "is.") and the other does not ("ma."), both score that prompt token. The compare
  and tokens parts check each pair's ids and trained positions against TRL's.
- Truncation: TRL 1.16 has no max_prompt_length (removed in its DPO refactor); `max_length` (default 1024)
  cuts each prompt+completion sequence to its first max_length tokens in the collator, and drops pairs
  whose prompt alone fills max_length. Ours: max_seq_len for a side's whole sequence, max_prompt_len cuts a
  prompt's start. The bench's pairs fit every budget (max_length = max_seq_len = 256, the longest pair side
  is under 130 tokens), so neither truncates.
- Log-probs: the SUM of the per-token log-probs of a side's completion tokens (its EOS included), policy
  and reference alike; chosen and rejected in ONE forward (the micro-batch's B chosen then B rejected rows,
  right-padded), the reference in a second forward under torch.no_grad(). TRL's fused LM head computes the
  log-probs in tiles of hidden states (fp32 here), never the full logits.
- The reference: a second model loaded again from the policy's path (same dtype), dropout off, prepared like
  the policy (DeepSpeed ZeRO-3: its own partitioned inference engine; FSDP: fully_shard). Not a deepcopy
  and, by default (the bench's setting), not precomputed: precompute_ref_log_probs=False, as ours
  precompute_reference=false.
- sigmoid: -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))). TRL 1.16's sigmoid has no label
  smoothing (its label_smoothing feeds the `robust` and `exo_pair` losses only), so the bench compares
  dpo_label_smoothing=0 only.
- ipo: each side's log-ratio divided by ITS OWN number of completion tokens (completion_mask.sum, at least
  1), then (avg_c - avg_r - 1/(2 beta))**2: the per-token mean, not the summed log-ratio. completion_mask is
  not shifted: where the completion starts the sequence (an empty prompt, no BOS) it counts the first token,
  which has no log-prob; ours divides by the tokens summed (IPO_LENGTH_NOTE; the compare part's pairs have
  prompts and a BOS, so the two counts agree there).
- rewards/chosen|rejected = beta * (summed policy logp - summed reference logp) for every loss (ipo too),
  their means over pairs; rewards/margins the mean of their differences; rewards/accuracies the mean of
  (chosen reward > rejected reward), strictly: 0.0 at step 1, where policy and reference are the same
  weights; logps/chosen|rejected the mean over pairs of the summed policy log-probs.
- Reduction: compute_loss returns the mean over the micro-batch's pairs; the Trainer divides it by the
  accumulation steps (DPOTrainer.loss_is_scaled_for_ga = False) and DDP/ZeRO/FSDP average gradients over
  ranks, so a step optimizes the mean of the micro-batches' means. Ours is the mean over the global batch's
  pairs. The two are the same whenever every micro-batch holds the same number of pairs, which the bench's
  configuration guarantees (64 pairs, micro-batch 4, no pair dropped: every micro-batch is full); the
  logged loss (the sum over micro-steps of mean/accumulation, averaged over ranks) and the metrics (each
  micro-step's values gathered over ranks and averaged, then averaged over the micro-steps) are global
  means over pairs as well. With unequal micro-batches (a dropped pair, a short last batch) TRL weighs a
  pair by 1/(its micro-batch's size); ours weighs every pair alike, by design.
- DPOConfig defaults the bench overrides to match the recipe: bf16=True (here fp32), gradient_checkpointing
  =True (here off, as ours), learning_rate=1e-6, logging_steps=10 (here 1), max_length=1024 (here 256).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # finetune and bench.*; family_assets

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
TOLERANCE = 1e-5  # on |ours - TRL| / max(1, |TRL|): absolute for loss and rewards, relative for the summed logps
LOSSES = ("sigmoid", "ipo")
STRATEGIES = ("zero3", "fsdp")
WARMUP = 3  # timed steps left out at the start (first forward, allocator, DeepSpeed/FSDP first gathers)
NOISE_LIMIT = 0.35  # CPU cores used by other processes during a launch, on average, above which a pair is re-run

WORDS = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike", "oscar",
         "papa", "romeo", "sierra", "tango", "victor", "zulu"]


def rows(n: int = 64, seed: int = 11) -> list[dict]:
    """n explicit prompt/chosen/rejected pairs: reverse the words of a phrase. The rejected answer is, in
    turn, the phrase unchanged, the reversal one word short, one word long, or the words letter-reversed:
    chosen and rejected differ in content and in length."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
        chosen = " " + " ".join(reversed(words))
        kind = len(out) % 4
        if kind == 0:
            rejected = " " + " ".join(words)
        elif kind == 1:
            rejected = " " + " ".join(list(reversed(words))[:-1])
        elif kind == 2:
            rejected = chosen + " " + rng.choice(WORDS)
        else:
            rejected = " " + " ".join(w[::-1] for w in words)
        if rejected == chosen:
            continue
        out.append({"prompt": f"Reverse the words: {' '.join(words)}\nAnswer:", "chosen": chosen,
                    "rejected": rejected})
    return out


def data_file(cache: Path) -> Path:
    path = cache / "data" / "dpo-pairs-64.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        tmp.rename(path)
    return path


def overrides(model_dir: Path, data: Path, loss: str, steps: int, strategy: str, micro: int = 4, accum: int = 2,
              lr: float = 1e-3) -> list[str]:
    """The recipe both sides are given (TRL's side reads the same recipe, trl_main)."""
    return [f"model={model_dir}", f"dataset={data}", "dataset_format=preference", "objective=dpo",
            f"dpo_loss={loss}", "dpo_beta=0.1", "max_seq_len=256", f"micro_batch_size={micro}",
            f"grad_accum={accum}", f"max_steps={steps}", f"strategy={strategy}", "mixed_precision=no",
            f"lr={lr}", "lr_scheduler=constant", "warmup_steps=0", "weight_decay=0.0", "max_grad_norm=1.0",
            "seed=42", "log_every=1", "eval_fraction=0", "eval_at_start=false", "eval_every=0", "save_every=0",
            "sample_prompts=0", "plot_loss=false", "activation_checkpointing=false"]


# ---------------------------------------------------------------- TRL's side (a process of its own)


def trl_main(argv: list[str]) -> int:
    """`[accelerate launch ...] bench/studies/dpo_vs_trl.py trl OUT --recipe NAME key=value ...`: TRL's DPOTrainer
    on the recipe's model, pairs and numbers; writes OUT/trl_summary.json on rank 0."""
    from bench.helpers import trainer_baseline as TB

    out, r, plan = TB.recipe_and_plan(argv)

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from bench.parts.common import read_jsonl
    from finetune import data as D
    from finetune.training import loop
    from finetune.model import load_config, load_tokenizer

    hf_logging.set_verbosity_warning()
    model_path, config = load_config(r)
    on_cpu = plan.device == "cpu"
    kw = TB.trainer_kwargs(r, plan, config, on_cpu)
    targs = trl.DPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=r.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum, learning_rate=r.lr, adam_beta1=r.adam_beta1,
        adam_beta2=r.adam_beta2, adam_epsilon=r.adam_eps, weight_decay=r.weight_decay,
        max_grad_norm=r.max_grad_norm, lr_scheduler_type=r.lr_scheduler, warmup_steps=r.warmup_steps,
        max_steps=r.max_steps, seed=r.seed, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=r.activation_checkpointing,
        beta=r.dpo_beta, loss_type=[r.dpo_loss], label_smoothing=0.0, max_length=r.max_seq_len,
        precompute_ref_log_probs=r.precompute_reference, disable_dropout=True,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": r.attn_implementation}, **kw)
    autocast_off = TB.fsdp_mixed_precision(targs, r)

    pairs = read_jsonl(Path(r.dataset))
    tokenizer = load_tokenizer(r, model_path)
    schedule = D.BatchSchedule(len(pairs), r.micro_batch_size, plan.grad_accum, targs.world_size, r.seed)

    logs: dict[int, dict] = {}
    step_end: list[float] = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

    class SameRowsDPOTrainer(trl.DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return TB.ScheduleSampler(schedule, r.max_steps)

        def _build_accelerator_args(self, **kwargs):
            args = super()._build_accelerator_args(**kwargs)
            if autocast_off:
                from accelerate.utils import AutocastKwargs

                args["kwargs_handlers"] = [*args.get("kwargs_handlers", []), AutocastKwargs(enabled=False)]
            return args

        def log(self, entries, start_time=None):
            super().log(entries, start_time)
            if "loss" in entries:
                logs[self.state.global_step] = dict(entries)

    trainer = SameRowsDPOTrainer(model=str(model_path), args=targs, train_dataset=Dataset.from_list(pairs),
                                 processing_class=tokenizer, callbacks=[Recorder()])
    prepared = trainer.train_dataset
    if len(prepared) != len(pairs):
        print(f"error: TRL kept {len(prepared)} of {len(pairs)} pairs; the row order would not be the same",
              file=sys.stderr)
        return 2
    result = trainer.train()
    if trainer.is_world_process_zero():
        summary = {
            "trl": trl.__version__, "strategy": r.strategy, "world_size": targs.world_size,
            "grad_accum": plan.grad_accum, "engine": type(trainer.model_wrapped).__name__,
            "reference": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
            "steps": trainer.state.global_step, "train_runtime": result.metrics.get("train_runtime"),
            "step_seconds": [b - a for a, b in zip(step_end, step_end[1:])],
            "logs": [logs.get(s) for s in range(1, trainer.state.global_step + 1)],
            "tokens": [{k: list(prepared[i][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                       for i in range(len(prepared))],
            **TB.what_ran(trainer),
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "trl_summary.json").write_text(json.dumps(summary) + "\n")
    loop.KEEP_UNTIL_EXIT.append(trainer)
    loop.finish_together()
    return 0


# ---------------------------------------------------------------- our side


def ours_records(out: Path) -> list[dict]:
    """metrics.jsonl's step records, step 1 first."""
    from bench.parts.common import read_jsonl
    from finetune.training.metrics import run_history

    return [r for r in run_history(read_jsonl(out / "metrics.jsonl")) if "loss" in r and "step" in r]


def ours_step_seconds(records: list[dict]) -> list[float]:
    """Each step's wall-clock seconds: its record's window (tokens / tokens_per_s), from the end of the
    previous step's logging to the end of this one's, as TRL's on_step_end clock measures."""
    seconds, prev = [], 0
    for r in records:
        seconds.append((r["tokens"] - prev) / r["tokens_per_s"] if r.get("tokens_per_s") else float("nan"))
        prev = r["tokens"]
    return seconds


def ours_sides(model_dir: Path, over: list[str]) -> list[dict]:
    """Our prepared pairs (finetune.data.build_datasets, the rows finetune/run.py trains on, in its
    order), each side as (input ids, which of them are trained)."""
    from finetune import data as D
    from finetune.model import load_tokenizer
    from finetune.recipe import resolve

    r = resolve("tiny", over)
    tokenizer = load_tokenizer(r, str(model_dir))
    train = D.build_datasets(r, tokenizer).train
    out = []
    for i in range(len(train)):
        row = train[i]
        out.append({side: (list(row[f"{side}_input_ids"]), [int(x != D.IGNORE) for x in row[f"{side}_labels"]])
                    for side in ("chosen", "rejected")})
    return out


def trl_sides(pair: dict) -> dict:
    """One of TRL's prepared pairs (prompt_ids, chosen_ids, rejected_ids) as ours: each side's whole
    sequence and its trained tokens (TRL's completion_mask)."""
    p = pair["prompt_ids"]
    return {side: (p + pair[f"{side}_ids"], [0] * len(p) + [1] * len(pair[f"{side}_ids"]))
            for side in ("chosen", "rejected")}


# ---------------------------------------------------------------- orchestration


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return None


def run_ours(name: str, over: list[str], work: Path, nprocs: int) -> dict:
    from bench.parts.common import PY, accelerate_launch, fresh_dir, run, shown

    out = fresh_dir(work / f"ours-{name}")
    args = ["--recipe", "tiny", *over, f"output_dir={out}"]
    cmd = accelerate_launch("finetune/run.py", args) if nprocs > 1 else [PY, "finetune/run.py", *args]
    launch = run(cmd, work / f"ours-{name}.log", done=(out / "summary.json").exists)
    res = {"command": shown(cmd), "ok": launch.ok, "seconds": round(launch.seconds, 1), "other_load": launch.other_load,
           "output_dir": str(out)}
    if launch.ok:
        records = ours_records(out)
        res["records"] = records
        res["step_seconds"] = ours_step_seconds(records)
    else:
        res["error"] = launch.error(4)
    return res


def run_trl(name: str, over: list[str], work: Path, nprocs: int, script: str = "bench/studies/dpo_vs_trl.py") -> dict:
    """`script trl OUT --recipe tiny OVERRIDES` (its TRL side), its trl_summary.json read back."""
    from bench.parts.common import PY, accelerate_launch, fresh_dir, run, shown

    out = fresh_dir(work / f"trl-{name}")
    args = [str(out), "--recipe", "tiny", *over, f"output_dir={out}"]
    cmd = accelerate_launch(script, ["trl", *args]) if nprocs > 1 else [PY, script, "trl", *args]
    launch = run(cmd, work / f"trl-{name}.log", done=(out / "trl_summary.json").exists)
    summary = out / "trl_summary.json"
    res = {"command": shown(cmd), "ok": launch.ok and summary.exists(), "seconds": round(launch.seconds, 1),
           "other_load": launch.other_load, "output_dir": str(out)}
    if res["ok"]:
        res.update(json.loads(summary.read_text()))
    else:
        res["error"] = launch.error(4)
    return res


def differences(ours: list[dict], theirs: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """Per metric: the largest |ours - TRL| over the steps both logged and its step, the largest relative
    difference, and whether every step is within TOLERANCE * max(1, |TRL|) (inf: a step lacks the metric)."""
    out = {}
    for m in metrics:
        diffs, rel = [], []
        for a, b in zip(ours, theirs):
            if a and b and m in a and m in b:
                d = abs(float(a[m]) - float(b[m]))
                diffs.append(d)
                rel.append(d / max(1.0, abs(float(b[m]))))
            else:
                diffs.append(float("inf"))
                rel.append(float("inf"))
        worst = max(diffs, default=float("inf"))
        out[m] = {"max_abs_diff": worst, "step": diffs.index(worst) + 1 if diffs else None,
                  "max_scaled_diff": max(rel, default=float("inf"))}
        out[m]["within"] = out[m]["max_scaled_diff"] <= TOLERANCE
    return out


def compare(work: Path, cache: Path, steps: int) -> dict:
    from bench.parts.common import build_model, ModelSpec

    model = build_model(ModelSpec("llama-2l-h64-v128", 64, 2, 4, 176, vocab_size=128, num_key_value_heads=2),
                        cache / "models")
    data = data_file(cache)
    results = {"model": str(model), "data": str(data), "steps": steps, "losses": {}}
    for loss in LOSSES:
        over = overrides(model, data, loss, steps, "ddp")
        ours = run_ours(f"compare-{loss}", over, work, 1)
        theirs = run_trl(f"compare-{loss}", over, work, 1)
        res = {"ours_command": ours["command"], "trl_command": theirs["command"], "ok": ours["ok"] and theirs["ok"]}
        if not ours["ok"]:
            res["error"] = "ours: " + ours["error"]
        elif not theirs["ok"]:
            res["error"] = "TRL: " + theirs["error"]
        else:
            a, b = ours["records"], theirs["logs"]
            res.update(steps_ours=len(a), steps_trl=len(b), diffs=differences(a, b),
                       ours=[{m: r.get(m) for m in METRICS} for r in a], trl=[{m: r.get(m) for m in METRICS}
                                                                            for r in (x or {} for x in b)],
                       trl_version=theirs["trl"])
            mine, theirs_sides = ours_sides(model, over), [trl_sides(t) for t in theirs["tokens"]]
            res["pairs"], res["pairs_trl"] = len(mine), len(theirs_sides)
            res["same_tokens"] = sum(x == y for x, y in zip(mine, theirs_sides))
            res["first_different_pair"] = next((i for i, (x, y) in enumerate(zip(mine, theirs_sides)) if x != y), None)
            res["match"] = (len(a) == len(b) == steps and res["same_tokens"] == len(mine) == len(theirs_sides)
                            and all(d["within"] for d in res["diffs"].values()))
        results["losses"][loss] = res
        print(f"{loss}: " + (json.dumps(res.get("diffs")) if res["ok"] else res["error"]), flush=True)
    return results


SEAM_PAIRS = [  # prompt/chosen/rejected seams (tests/test_tokenization.py SEAMS): where a tokenizer may merge across
    ("Question: What is the capital of France? Answer: ", "Paris", "Lyon"),  # a prompt ending in a space
    ("Question: What is the capital of France? Answer:", " Paris", " Lyon"),  # the space in the answers
    ("Question: What is the capital of France?\n", "Paris", "Lyon"),
    ("The capital of France is Par", "is.", "ma."),  # a word cut by the prompt's end
    ("The capital of France is Par", "is.", " Rome."),  # ... which only one side continues
]


IPO_LENGTH_NOTE = (
    "The ipo lengths differ where a side's answer starts the sequence (an empty prompt on a tokenizer that adds no "
    "BOS): its first token follows nothing and has no log-prob, on both sides, yet TRL 1.16 divides the summed "
    "log-ratio by completion_mask.sum(), which counts it; finetune divides by the tokens summed. ipo's per-token "
    "average (TRL's own comment: normalize by the number of completion tokens, the average per token) is the "
    "sum over its terms; TRL's is the sum over n - 1 tokens divided by n. The pairs' tokens and the sigmoid loss "
    "are the same; ipo's loss is not, by design.")


def scored(mask: list[int]) -> int:
    """The tokens a side's summed log-probs cover, on both sides: its trained positions after the
    first (a sequence's first token follows nothing, so no log-prob is computed for it)."""
    return sum(mask[1:])


def trl_ipo_length(mask: list[int]) -> int:
    """What TRL 1.16's ipo divides a side's summed log-ratio by: its completion_mask's sum (at least 1),
    the first position included. That is scored(mask) + 1 where the completion starts the sequence (an
    empty prompt on a tokenizer that adds no BOS, tekken's or Qwen's): a token without a log-prob is
    counted in the average. Ours divides by scored(mask), the tokens summed."""
    return max(1, sum(mask))


def first_token_counted(mask: list[int]) -> bool:
    """Whether TRL's ipo length exceeds ours only by the sequence's first token (IPO_LENGTH_NOTE)."""
    return bool(mask) and mask[0] == 1 and trl_ipo_length(mask) == scored(mask) + 1


def tokens_match(tok: dict) -> bool:
    """The tokens part passes: every pair's tokens equal TRL's, and the ipo lengths differ only by
    TRL's count of a sequence's first token."""
    return all(r["same"] == r["pairs"] == r["ours"] == r["trl"]
               and all(d.get("first_token") for d in r.get("ipo_lengths", [])) for r in tok.values())


def empty_prompt_pairs(pairs: list[dict]) -> list[dict]:
    """The pairs with an empty prompt (chosen and rejected alone, nothing before them)."""
    return [{"prompt": "", "chosen": r["chosen"], "rejected": r["rejected"]} for r in pairs]


def conversational_pairs(pairs: list[dict]) -> list[dict]:
    """The pairs as conversations (trl-lib/ultrafeedback_binarized's shape): the prompt a user message,
    each side an assistant message."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in pairs]


def tokens(work: Path) -> dict:
    """Each pair's tokens and trained positions, ours against TRL's (no training), on real tokenizers:
    Mistral v1 and v3 sentencepiece and tekken (mistral_common's files, tests/family_assets.py) and a
    Llama-3-style byte-level BPE; the bench's pairs and the seam pairs above, with empty prompts on
    tekken (no BOS: the answer starts the sequence), and as conversations under TRL's own
    qwen2_5_training.jinja (its {% generation %} block opens before the generation prompt's newline; on
    that BPE <|im_end|> is plain text). Also, per side, the length each toolkit's ipo averages over
    (scored, trl_ipo_length)."""
    import transformers
    import trl
    from datasets import Dataset

    import family_assets as FA
    from finetune import data as D
    from finetune.model import load_tokenizer
    from finetune.recipe import resolve

    pairs = rows()[:16] + [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in SEAM_PAIRS]
    texts = [t for r in pairs for t in r.values()]
    tmp = work / "tokenizers"
    qwen_training = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja").read_text()
    cases = {  # name: (the tokenizer, its chat template or None, the pairs)
        "mistral-v1": (lambda: FA.mistral_tokenizer("v1", tmp / "v1"), None, pairs),
        "mistral-v3": (lambda: FA.mistral_tokenizer("v3", tmp / "v3"), None, pairs),
        "llama3-bpe": (lambda: FA.make_tokenizer(FA.FAMILIES["llama3"], texts, tmp / "l3"), None, pairs),
        "tekken, empty prompts": (lambda: FA.tekken_tokenizer(tmp / "tekken"), None,
                                  pairs + empty_prompt_pairs(pairs[:16])),
        "llama3-bpe, TRL's qwen2_5_training chats": (lambda: FA.make_tokenizer(FA.FAMILIES["llama3"], texts,
                                                                               tmp / "l3-chatml"),
                                                     qwen_training, conversational_pairs(pairs[:16])),
    }
    config = transformers.LlamaConfig(vocab_size=131072, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    out = {}
    for k, (name, (make, template, these)) in enumerate(cases.items()):
        data = work / f"token-pairs-{k}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in these))
        tok = make()
        if template is not None:
            tok.chat_template = template
        path = tmp / f"{k}-saved"  # as a tokenizer directory a recipe names (tokenizer.json)
        tok.save_pretrained(path)
        r = resolve("tiny", [f"tokenizer={path}", f"dataset={data}", "dataset_format=preference", "objective=dpo",
                             "max_seq_len=512", "eval_fraction=0"])
        ours_tok = load_tokenizer(r, str(path))
        train = D.build_datasets(r, ours_tok).train
        mine = [{side: (list(train[i][f"{side}_input_ids"]),
                        [int(x != D.IGNORE) for x in train[i][f"{side}_labels"]]) for side in ("chosen", "rejected")}
                for i in range(len(train))]
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        args = trl.DPOConfig(output_dir=str(work / "trl-tokens"), report_to=[], max_length=None, bf16=False,
                             use_cpu=True)
        prepared = trl.DPOTrainer(model=transformers.LlamaForCausalLM(config),
                                  ref_model=transformers.LlamaForCausalLM(config), args=args,
                                  train_dataset=Dataset.from_list(these), processing_class=tok).train_dataset
        theirs = [trl_sides({c: list(prepared[i][c]) for c in ("prompt_ids", "chosen_ids", "rejected_ids")})
                  for i in range(len(prepared))]
        differ, ipo = [], []
        for i, (x, y) in enumerate(zip(mine, theirs)):
            if x != y:
                side = "chosen" if x["chosen"] != y["chosen"] else "rejected"
                (ids, m), (tids, tm) = x[side], y[side]
                differ.append({"pair": i, "side": side, "ours": tok.convert_ids_to_tokens(
                    [t for t, j in zip(ids, m) if j]), "trl": tok.convert_ids_to_tokens([t for t, j in zip(tids, tm)
                                                                                         if j])})
            for side in ("chosen", "rejected"):
                if scored(x[side][1]) != trl_ipo_length(y[side][1]):
                    ipo.append({"pair": i, "side": side, "ours": scored(x[side][1]),
                                "trl": trl_ipo_length(y[side][1]), "first_token": first_token_counted(y[side][1])})
        out[name] = {"pairs": len(these), "ours": len(mine), "trl": len(theirs),
                     "same": sum(x == y for x, y in zip(mine, theirs)), "differ": differ, "ipo_lengths": ipo}
        print(f"tokens {name}: {out[name]['same']} of {len(these)} pairs equal to TRL's; ipo lengths differ on "
              f"{len(ipo)} sides", flush=True)
        for d in differ:
            print(f"  pair {d['pair']} {d['side']}: ours trains {d['ours']}, TRL {d['trl']}", flush=True)
    return out


def median_after_warmup(seconds: list[float]) -> float | None:
    kept = [s for s in seconds[WARMUP:] if s == s]
    return statistics.median(kept) if kept else None


def timing(work: Path, cache: Path, steps: int, rounds: int) -> dict:
    from bench.parts.common import MODELS, build_model, wait_quiet

    model = build_model(MODELS["llama-7m"], cache / "models")
    data = data_file(cache)
    results = {"model": MODELS["llama-7m"].describe(), "steps": steps, "warmup": WARMUP, "strategies": {}}
    for strategy in STRATEGIES:
        results["strategies"][strategy] = []
    for rnd in range(rounds):
        for i, strategy in enumerate(STRATEGIES):
            over = overrides(model, data, "sigmoid", steps, strategy)
            for attempt in range(2):
                wait_quiet(45)
                load_before = uptime()
                first_ours = (rnd + i) % 2 == 0
                name = f"time-{strategy}-{rnd}-{attempt}"  # a re-run keeps the noisy run's files
                pair = {}
                for side in (("ours", "trl") if first_ours else ("trl", "ours")):
                    pair[side] = (run_ours if side == "ours" else run_trl)(name, over, work, 2)
                row = {"round": rnd, "attempt": attempt, "uptime_before": load_before, "ours_first": first_ours}
                for side in ("ours", "trl"):
                    res = pair[side]
                    row[side] = {"ok": res["ok"], "command": res["command"], "other_load": res["other_load"],
                                 "seconds_per_step": median_after_warmup(res.get("step_seconds", [])) if res["ok"]
                                 else None, "step_seconds": res.get("step_seconds"), "error": res.get("error"),
                                 "engine": res.get("engine"), "reference": res.get("reference")}
                row["uptime_after"] = uptime()
                if pair["ours"]["ok"] and pair["trl"]["ok"]:  # the same pairs, 2 processes: the metrics agree too
                    diffs = differences(pair["ours"]["records"], pair["trl"]["logs"])
                    row["worst_metric"] = max(diffs, key=lambda m: diffs[m]["max_scaled_diff"])
                    row["worst_scaled_diff"] = diffs[row["worst_metric"]]["max_scaled_diff"]
                    row["loss_max_abs_diff"] = diffs["loss"]["max_abs_diff"]
                a, b = row["ours"]["seconds_per_step"], row["trl"]["seconds_per_step"]
                row["trl_over_ours"] = b / a if a and b else None
                noisy = max(row["ours"]["other_load"] or 0, row["trl"]["other_load"] or 0) > NOISE_LIMIT
                row["noisy"] = noisy
                results["strategies"][strategy].append(row)
                print(f"timing {strategy} round {rnd}: ours {a} s/step, TRL {b} s/step, other load "
                      f"{row['ours']['other_load']}/{row['trl']['other_load']}", flush=True)
                if not noisy:
                    break
    return results


# ---------------------------------------------------------------- the report


def section(results: dict) -> str:
    from bench.parts.common import table

    lines = [f"Measured by `{results['command']}` at git {results['git']} on {results['started']} "
             f"({results['minutes']:.0f} min in all); {results['machine']['cpu']}, {results['machine']['cores']} "
             f"cores, shared with other jobs; " + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
             + ".", ""]
    if results.get("kept"):
        lines += ["Kept from an earlier run: " + "; ".join(results["kept"]) + ".", ""]
    comp = results.get("compare")
    if comp:
        lines += [f"**Same pairs, same numbers.** {len(rows())} generated prompt/chosen/rejected pairs, a random-weight "
                  "2-layer Llama (hidden 64, vocab 128) with the toolkit's character tokenizer, fp32, one process "
                  "each: micro-batch 4 pairs, accumulation 2, lr 1e-3 constant, no warmup, AdamW (0.9, 0.999, "
                  "1e-8), weight decay 0, max_grad_norm 1.0, dpo_beta 0.1, seed 42, dropout off, "
                  f"{comp['steps']} steps, the pairs in finetune's BatchSchedule order on both sides. "
                  "Largest |finetune - TRL| over the steps, per metric (TRL's names):", ""]
        done = {loss: res for loss, res in comp["losses"].items() if res["ok"]}
        header = ["metric"] + [f"{loss}: {what}" for loss in done for what in ("max abs diff (step)", "diff / max(1, abs TRL)")]
        body = [[m] + [cell for res in done.values() for cell in
                       (f"{res['diffs'][m]['max_abs_diff']:.1e} ({res['diffs'][m]['step']})",
                        f"{res['diffs'][m]['max_scaled_diff']:.1e}")] for m in METRICS]
        lines += [table(header, body), ""]
        for loss, res in comp["losses"].items():
            if not res["ok"]:
                lines.append(f"{loss}: failed: {res['error']}")
                continue
            lines.append(f"{loss}: steps logged {res['steps_ours']} (finetune) / {res['steps_trl']} (TRL); pairs whose "
                         f"tokens and trained positions equal TRL's: {res['same_tokens']} of {res['pairs']} (TRL kept "
                         f"{res['pairs_trl']}); every "
                         f"metric within 1e-5 x max(1, |TRL|) at every step: {'yes' if res['match'] else 'NO'}.")
        lines.append("")
        for loss, res in comp["losses"].items():
            if res["ok"] and res.get("ours"):
                first, last = res["ours"][0], res["ours"][-1]
                lines.append(f"{loss}, finetune's own values: loss {first['loss']:.6f} at step 1, {last['loss']:.6f} "
                             f"at step {len(res['ours'])}; rewards/accuracies {last['rewards/accuracies']:.3f}, "
                             f"rewards/margins {last['rewards/margins']:.5f} at the last step.")
        lines.append("")
    tok = results.get("tokens")
    if tok:
        lines += ["**Tokens on real tokenizers** (no training): the first 16 pairs and 5 prompt/answer seams "
                  "(`SEAM_PAIRS`); on tekken also the 16 with an empty prompt; on the Llama-3-style BPE also the 16 as "
                  "conversations under TRL's qwen2_5_training.jinja. Our prepared pairs (finetune.data.build_datasets) "
                  "against TRL's (`DPOTrainer(...).train_dataset`): each side's ids and which of them are trained; and "
                  "the sides whose length ipo averages over differs (ours: the tokens scored; TRL's: "
                  "completion_mask.sum()).", ""]
        body = [[name, f"{r['same']} of {r['pairs']}", "; ".join(
            f"pair {d['pair']} {d['side']}: finetune trains {' '.join(d['ours'])}, TRL {' '.join(d['trl'])}"
            for d in r["differ"]).replace("|", "\\|") or "-",  # <|end_of_text|>
            f"{len(r['ipo_lengths'])}" + (f" (e.g. pair {r['ipo_lengths'][0]['pair']} "
                                          f"{r['ipo_lengths'][0]['side']}: {r['ipo_lengths'][0]['ours']} / "
                                          f"{r['ipo_lengths'][0]['trl']})" if r["ipo_lengths"] else "")
            if "ipo_lengths" in r else "-"] for name, r in tok.items()]
        lines += [table(["tokenizer", "pairs equal to TRL's", "the others",
                         "sides whose ipo length differs (finetune / TRL)"], body), ""]
        if any(r["differ"] for r in tok.values()):
            lines += ["Where they differ the prompt ends inside a word that one answer continues and the other "
                      "does not (\"...is Par\" + \"is.\" / \"ma.\"): TRL cuts both sides at one prompt length, the "
                      "shorter of the two sides' common prefixes with the prompt, so its rejected side also scores "
                      "the prompt's last token; finetune cuts each side where its own tokens leave the prompt's, as "
                      "its SFT rows do, and scores answer tokens only. By design; the compare part's pairs end their "
                      "prompts on a token boundary.", ""]
        if any(r.get("ipo_lengths") for r in tok.values()):
            lines += [IPO_LENGTH_NOTE, ""]
    tim = results.get("timing")
    if tim:
        lines += [f"**Seconds per step, 2 processes.** The same pairs on bench's llama-7m ({tim['model']}), dpo_loss "
                  f"sigmoid, the same recipe numbers as above, {tim['steps']} steps, `accelerate launch "
                  f"--num_processes 2` (gloo); median of each run's steps after the first {tim['warmup']}. other "
                  "load: CPU cores used by the rest of the machine during the launch (ours / TRL). The last columns compare "
                  "these 2-process runs' metrics, ours against TRL, over their steps: the loss, and the metric "
                  "farthest apart. On this model the summed log-probs are near -230, where an fp32 ulp is 1.5e-5, "
                  "and a reward is beta times the difference of two of them: its rounding is beta times theirs, so "
                  "rewards/* can differ by about 1e-5 while the loss agrees within 1e-6.", ""]
        header = ["strategy", "run (UTC)", "finetune s/step", "TRL s/step", "TRL / finetune", "other load",
                  "load average before", "loss: max abs diff", "worst metric: diff / max(1, abs TRL)",
                  "TRL's engine / reference"]
        body = []
        for strategy, runs in tim["strategies"].items():
            for row in runs:
                o, t = row["ours"], row["trl"]
                body.append([strategy, f"{row.get('started', results['started'])[11:]}, round {row['round']}, "
                             f"attempt {row.get('attempt', 0) + 1}{' (noisy)' if row['noisy'] else ''}",
                             f"{o['seconds_per_step']:.3f}" if o["seconds_per_step"] else "failed",
                             f"{t['seconds_per_step']:.3f}" if t["seconds_per_step"] else "failed",
                             f"{row['trl_over_ours']:.2f}x" if row["trl_over_ours"] else "-",
                             f"{(o['other_load'] or 0):.2f} / {(t['other_load'] or 0):.2f}",
                             row["uptime_before"].split("load average:")[-1].strip() if row["uptime_before"] else "-",
                             f"{row['loss_max_abs_diff']:.1e}" if row.get("loss_max_abs_diff") is not None else "-",
                             f"{row.get('worst_metric', '')} {row['worst_scaled_diff']:.1e}"
                             if row.get("worst_scaled_diff") is not None else "-",
                             f"{t.get('engine')} / {t.get('reference')}"])
        lines += [table(header, body), ""]
        ratios = {strategy: [row["trl_over_ours"] for row in runs if row.get("trl_over_ours")]
                  for strategy, runs in tim["strategies"].items()}
        every = [x for r in ratios.values() for x in r]
        all_noisy = all(row["noisy"] for runs in tim["strategies"].values() for row in runs)
        lines.append("TRL / finetune, the median over these runs: " + ", ".join(
            f"{strategy} {statistics.median(r):.2f}x ({len(r)} runs)" for strategy, r in ratios.items() if r)
            + (f", every run between {min(every):.2f}x and {max(every):.2f}x" if every else "")
            + f". (noisy): the rest of the machine used more than {NOISE_LIMIT} cores on average during one of the "
            "pair's launches, and the bench ran the pair again (once)"
            + ("; on this shared machine every run was, so read the ratios rather than the absolute seconds."
               if all_noisy else ".")
            + (" -: not recorded for that run (its files were replaced by its re-run's, before the bench kept both)."
               if any(row.get("loss_max_abs_diff") is None for runs in tim["strategies"].values() for row in runs)
               else ""))
    return "\n".join(lines).rstrip()


def write_doc(doc: Path, text: str) -> None:
    from bench.parts.report import DPO_BEGIN, DPO_END, DPO_TITLE, write_marked_section

    write_marked_section(doc, DPO_TITLE, DPO_BEGIN, DPO_END, text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="compare,tokens,timing", help="compare, tokens, timing (comma-separated)")
    p.add_argument("--steps", type=int, default=20, help="steps of the compare runs")
    p.add_argument("--timing-steps", type=int, default=13)
    p.add_argument("--rounds", type=int, default=1, help="timing rounds (the order of ours and TRL alternates)")
    p.add_argument("--work", default=f"/tmp/dpo-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--doc", default="", help="write the section into this report (docs/benchmarks.md)")
    p.add_argument("--render", default="", help="only write the report from a run's results.json")
    p.add_argument("--keep", default="", help="an earlier run's results.json: its parts not run now go in the "
                   "report, and its timing rows before this run's")
    a = p.parse_args(argv)
    if a.render:
        text = section(json.loads(Path(a.render).read_text()))
        print(text)
        if a.doc:
            write_doc(Path(a.doc), text)
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from bench.parts.common import CACHE, git_state, machine, versions

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = set(a.only.split(","))
    import trl

    t0 = time.time()
    results = {"command": "python bench/studies/dpo_vs_trl.py " + " ".join(argv), "git": git_state(),
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "versions": {**versions(), "trl": trl.__version__}, "uptime_start": uptime()}
    if "compare" in parts:
        results["compare"] = compare(work, CACHE, a.steps)
    if "tokens" in parts:
        results["tokens"] = tokens(work)
    if "timing" in parts:
        results["timing"] = timing(work, CACHE, a.timing_steps, a.rounds)
    results["minutes"] = (time.time() - t0) / 60
    if a.keep:  # an earlier run's parts, with when and how they were measured
        earlier = json.loads(Path(a.keep).read_text())
        if "timing" in results and "timing" in earlier:  # timing rounds add up: the earlier run's rows first
            for strategy, runs in results["timing"]["strategies"].items():
                runs[:0] = [dict(row, started=earlier["started"]) for row in
                            earlier["timing"]["strategies"].get(strategy, [])]
            results["kept"] = [f"the timing rows of {earlier['started']} from `{earlier['command']}` at git "
                               f"{earlier['git']}"]
        for part in ("compare", "tokens", "timing"):
            if part not in results and part in earlier:
                results[part] = earlier[part]
                results.setdefault("kept", []).append(earlier.get("provenance", {}).get(part) or (
                    f"{part} from `{earlier['command']}` at git {earlier['git']} on {earlier['started']}"))
    results["uptime_end"] = uptime()
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = section(results)
    print(text)
    print(f"results: {work / 'results.json'}")
    if a.doc:
        write_doc(Path(a.doc), text)
    comp = results.get("compare", {}).get("losses", {})
    tokens_ok = "tokens" not in parts or tokens_match(results["tokens"])
    return 0 if all(r.get("match") for r in comp.values()) and tokens_ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl":
        if not __import__("torch").cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from finetune.run import exit_without_teardown

        exit_without_teardown(trl_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
