"""Our KTO (objective=kto) against TRL's KTOTrainer as a user runs it: tiny_kto's rows and model, the same
hyper-parameters, step by step, and the final weights.

    python bench/studies/kto_vs_trl.py                      # every setting below, ~15 min on 2 CPU cores
    python bench/studies/kto_vs_trl.py --steps 6 --only default

TRL is a bench-only dependency (pip install -e .[bench], or `pip install --no-deps 'trl>=1.16'` beside the
project's pinned accelerate/datasets/transformers). Exit 1 when a compared metric differs by more than
1e-5 x max(1, |TRL's value|) at some step, a final weight by more than WEIGHT_TOLERANCE, or our 2-process run
is not our 1-process run bit for bit.

TRL's side is KTOTrainer as its documentation shows it: KTOConfig with the recipe's numbers (lr, AdamW
betas/eps, weight decay 0, constant lr without warmup, max_grad_norm 1.0, seed, per_device_train_batch_size
16, no accumulation, dropout off, fp32 on CPU) and nothing else changed: its own sampler, which for
loss_type kto must be its default, `train_sampling_strategy="sequential"` (TRL refuses any other, because it
pairs each row with the previous row's completion within each chunk of per_device_train_batch_size rows of
the dataset, KTOTrainer._prepare_dataset), so it reads the rows in their file order, and accelerate deals
batch k to rank k mod world. Ours shuffles its rows (finetune.data.BatchSchedule) and makes each micro-batch's
KL rows from the batch as fetched, TRL's rule. So that both train on the same batches, our run is given
TRL's row order: the same rows written in the order our schedule's first-epoch permutation reads back as
the file's order (ours_order). The runs stay within one epoch (TRL would read the same order again, we would
reshuffle).

The rows: builtin:tiny-kto (finetune/assets.py tiny_kto_file: 4000 unpaired rows, the tiny preference
tasks' right answer labelled true or a wrong one false); the model: tiny_kto's, builtin:tiny-llama (random
weights, 2 layers, the character tokenizer). Compared per step (TRL's names, which our metrics.jsonl uses
too): loss, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected, kl; then every
weight of final/ against TRL's saved model.

SETTINGS: TRL's defaults (loss_type kto, beta 0.1, desirable and undesirable weight 1.0); beta 0.3,
desirable_weight 1.33, undesirable_weight 0.8; apo_zero_unpaired (no KL rows); precompute_reference (TRL's
precompute_ref_log_probs); and 2 processes on each side (TRL's KL is its micro-batch's mean over the
ranks, ours the global batch's: the same with one micro-batch per rank). Our 2-process run is also compared
with our 1 process accumulating the same 2 micro-batches (grad_accum=2): metrics.jsonl and final/ bit for
bit (TRL's KL under accumulation is each micro-batch's, which no 1-process run of TRL repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
SETTINGS = {  # name: (overrides, processes on each side)
    "default": ([], 1),
    "beta0.3_weights": (["kto_beta=0.3", "desirable_weight=1.33", "undesirable_weight=0.8"], 1),
    "apo_zero_unpaired": (["kto_loss=apo_zero_unpaired"], 1),
    "precompute_reference": (["precompute_reference=true"], 1),
    "two_processes": ([], 2),
}
MICRO = 16  # rows per micro-batch, one micro-batch per process and step (the setting: tiny_kto's data)
SEED = 42
# fp32 weights after a few steps of Adam on the same gradients up to summation order: the DPO comparison's
# losses agree to ~1e-7, and Adam's first steps move a weight by about lr whatever its gradient's size, so
# a weight whose gradient is near 0 may differ by a fraction of lr (1e-3 here)
WEIGHT_TOLERANCE = 1e-4
SCRIPT = "bench/studies/kto_vs_trl.py"


def rows() -> list[dict]:
    """tiny_kto's rows (builtin:tiny-kto), in their file's order: the order TRL reads them in."""
    from bench.parts.common import read_jsonl
    from finetune.assets import tiny_kto_file

    return read_jsonl(tiny_kto_file())


def ours_order(rows_in_order: list[dict], seed: int = SEED) -> list[dict]:
    """The rows rearranged so that our schedule's first epoch reads them in the given order: it reads row
    permutation(0)[i] at position i (finetune.data.BatchSchedule), so that row is the i-th given."""
    from finetune.data import BatchSchedule

    perm = BatchSchedule(len(rows_in_order), MICRO, 1, 1, seed).permutation(0).tolist()
    out: list = [None] * len(rows_in_order)
    for i, p in enumerate(perm):
        out[p] = rows_in_order[i]
    return out


def data_files(cache: Path) -> tuple[Path, Path]:
    """TRL's file (tiny_kto's rows in order) and ours (the same rows in ours_order)."""
    made = []
    for name, ordered in (("trl", lambda r: r), ("ours", ours_order)):
        path = cache / "data" / f"kto-tiny-{name}-seed{SEED}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in ordered(rows())))
            tmp.rename(path)
        made.append(path)
    return made[0], made[1]


def overrides(model_dir, data, steps: int, setting: list[str], grad_accum: int = 1) -> list[str]:
    """The recipe each side is given (TRL's side reads the same recipe, trl_main; its dataset is TRL's file)."""
    return [f"model={model_dir}", f"dataset={data}", "dataset_format=unpaired", "objective=kto", *setting,
            "max_seq_len=128", f"micro_batch_size={MICRO}", f"grad_accum={grad_accum}", f"max_steps={steps}",
            "strategy=ddp", "mixed_precision=no", "lr=1e-3", "lr_scheduler=constant", "warmup_steps=0",
            "weight_decay=0.0", "max_grad_norm=1.0", f"seed={SEED}", "log_every=1", "eval_fraction=0",
            "eval_at_start=false", "eval_every=0", "save_every=0", "sample_prompts=0", "plot_loss=false",
            "activation_checkpointing=false"]


def trl_main(argv: list[str]) -> int:
    """`bench/studies/kto_vs_trl.py trl OUT --recipe NAME key=value ...`: TRL's KTOTrainer as a user runs it on
    the recipe's model, rows and numbers; writes OUT/trl_summary.json and OUT/trl_final/ (the trained model)."""
    from bench.helpers import trainer_baseline as TB

    out, r, plan = TB.recipe_and_plan(argv)

    import torch
    import trl
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from bench.parts.common import read_jsonl
    from finetune.model import load_config, load_tokenizer

    hf_logging.set_verbosity_warning()
    model_path, config = load_config(r)
    kw = TB.trainer_kwargs(r, plan, config, plan.device == "cpu")
    targs = trl.KTOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=r.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum, learning_rate=r.lr, adam_beta1=r.adam_beta1,
        adam_beta2=r.adam_beta2, adam_epsilon=r.adam_eps, weight_decay=r.weight_decay,
        max_grad_norm=r.max_grad_norm, lr_scheduler_type=r.lr_scheduler, warmup_steps=r.warmup_steps,
        max_steps=r.max_steps, seed=r.seed, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=r.activation_checkpointing,
        beta=r.kto_beta, loss_type=r.kto_loss, desirable_weight=r.desirable_weight,
        undesirable_weight=r.undesirable_weight, max_length=r.max_seq_len, disable_dropout=True,
        precompute_ref_log_probs=r.precompute_reference,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": r.attn_implementation}, **kw)
    if targs.train_sampling_strategy != "sequential":
        print(f"error: KTOConfig's sampler is {targs.train_sampling_strategy!r}, not TRL's default 'sequential'",
              file=sys.stderr)
        return 2

    data = read_jsonl(Path(r.dataset))
    tokenizer = load_tokenizer(r, model_path)
    logs: dict[int, dict] = {}

    class LoggedKTOTrainer(trl.KTOTrainer):  # its logs kept; nothing of its training changed
        def log(self, entries, start_time=None):
            super().log(entries, start_time)
            if "loss" in entries:
                logs[self.state.global_step] = dict(entries)

    trainer = LoggedKTOTrainer(model=str(model_path), args=targs, train_dataset=Dataset.from_list(data),
                               processing_class=tokenizer)
    if len(trainer.train_dataset) != len(data):
        print(f"error: TRL kept {len(trainer.train_dataset)} of {len(data)} rows; the order would differ",
              file=sys.stderr)
        return 2
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(str(out / "trl_final"))
        summary = {"trl": trl.__version__, "steps": trainer.state.global_step, "rows": len(data),
                   "sampler": targs.train_sampling_strategy,
                   "logs": [logs.get(s) for s in range(1, trainer.state.global_step + 1)]}
        (out / "trl_summary.json").write_text(json.dumps(summary) + "\n")
    return 0


def weight_differences(ours: Path, theirs: Path) -> dict:
    """The largest |ours - TRL| over every weight of the two saved models, and the tensor it is in."""
    from safetensors.torch import load_file

    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    if sorted(a) != sorted(b):
        return {"same_names": False, "max_abs_diff": float("inf"), "tensor": None}
    worst = max(((float((a[k].float() - b[k].float()).abs().max()), k) for k in a), default=(0.0, None))
    return {"same_names": True, "max_abs_diff": worst[0], "tensor": worst[1], "tensors": len(a)}


def kl_relative(diffs: dict, ours: list[dict], theirs: list[dict]) -> dict:
    """kl is the mean difference of two sums of ~30 token log-probs around -115 (one fp32 ulp there: 7.6e-6),
    so it is held to TOLERANCE relative to those sums, as logps/chosen and logps/rejected are."""
    from bench.studies.dpo_vs_trl import TOLERANCE

    scaled = [abs(a["kl"] - b["kl"]) / max(1.0, abs(b["logps/chosen"]), abs(b["logps/rejected"]))
              if a and b and "kl" in a and "kl" in b else float("inf") for a, b in zip(ours, theirs)]
    worst = max(scaled, default=float("inf"))
    diffs["kl"] |= {"max_scaled_diff": worst, "within": worst <= TOLERANCE}
    return diffs


def same_run(a: dict, b: dict) -> dict:
    """Two of our runs (run_ours results): whether every step's compared metrics (and grad_norm) and every final
    weight are equal bit for bit."""
    from safetensors.torch import load_file

    keys = METRICS + ("grad_norm",)
    ra, rb = ([{k: r.get(k) for k in keys} for r in run["records"]] for run in (a, b))
    wa, wb = (load_file(str(Path(run["output_dir"]) / "final" / "model.safetensors")) for run in (a, b))
    weights = sorted(wa) == sorted(wb) and all(bool((wa[k] == wb[k]).all()) for k in wa)
    return {"metrics": ra == rb, "weights": weights, "equal": ra == rb and weights and len(ra) > 0}


def rows_read(run: dict) -> int | None:
    """The training rows our run reports (its log's "N training rows")."""
    import re

    log = Path(run["output_dir"]).parent / (Path(run["output_dir"]).name + ".log")
    found = re.search(r"(\d+) training rows", log.read_text()) if log.is_file() else None
    return int(found.group(1)) if found else None


def compare(work: Path, cache: Path, steps: int, settings: list[str]) -> dict:
    from bench.studies.dpo_vs_trl import TOLERANCE, differences, run_ours, run_trl
    from finetune.assets import tiny_model_dir

    model = tiny_model_dir()
    trl_data, ours_data = data_files(cache)
    n = len(rows())
    results = {"model": str(model), "data": str(trl_data), "ours_data": str(ours_data), "rows": n, "steps": steps,
               "micro_batch_size": MICRO, "tolerance": TOLERANCE, "weight_tolerance": WEIGHT_TOLERANCE,
               "settings": {}}
    for name in settings:
        setting, procs = SETTINGS[name]
        if steps * MICRO * procs > n:
            raise SystemExit(f"--steps {steps}: {steps * MICRO * procs} rows, more than one epoch of {n} (TRL reads "
                             "them again in order, ours reshuffles): use fewer steps")
        ours = run_ours(f"kto-{name}", overrides(model, ours_data, steps, setting), work, procs)
        theirs = run_trl(f"kto-{name}", overrides(model, trl_data, steps, setting), work, procs, script=SCRIPT)
        res = {"overrides": setting, "processes": procs, "ours_command": ours["command"],
               "trl_command": theirs["command"], "ok": ours["ok"] and theirs["ok"]}
        if not ours["ok"]:
            res["error"] = "ours: " + ours["error"]
        elif not theirs["ok"]:
            res["error"] = "TRL: " + theirs["error"]
        elif rows_read(ours) != n:
            res.update(ok=False, error=f"ours: read {rows_read(ours)} training rows, not {n}: the orders differ")
        else:
            a, b = ours["records"], theirs["logs"]
            res.update(steps_ours=len(a), steps_trl=len(b), trl_sampler=theirs.get("sampler"),
                       diffs=kl_relative(differences(a, b, METRICS), a, b),
                       first=[{m: r.get(m) for m in METRICS} for r in (a[0], b[0] or {})],
                       last=[{m: r.get(m) for m in METRICS} for r in (a[-1], b[-1] or {})],
                       weights=weight_differences(Path(ours["output_dir"]) / "final",
                                                  Path(theirs["output_dir"]) / "trl_final"))
            res["match"] = (len(a) == len(b) == steps and all(d["within"] for d in res["diffs"].values())
                            and res["weights"]["max_abs_diff"] <= WEIGHT_TOLERANCE)
            if procs > 1:  # 2 = 1: one process accumulating the same micro-batches, bit for bit
                one = run_ours(f"kto-{name}-1proc", overrides(model, ours_data, steps, setting, grad_accum=procs),
                               work, 1)
                res["one_process_command"] = one["command"]
                res["two_equals_one"] = same_run(ours, one) if one["ok"] else {"equal": False, "error": one["error"]}
                res["match"] = res["match"] and res["two_equals_one"]["equal"]
        results["settings"][name] = res
        print(f"{name}: " + (json.dumps({k: res.get(k) for k in ("diffs", "weights", "two_equals_one")})
                             if res["ok"] else res["error"]), flush=True)
    return results


def section(results: dict) -> str:
    """The report: per setting, each metric's largest difference and the final weights'."""
    from bench.parts.common import table

    c = results["compare"]
    lines = [f"`{results['command']}` (git {results['git']}, {results['started']}, {results['minutes']:.1f} min; "
             f"TRL {results['versions'].get('trl')}): {c['steps']} steps of {c['micro_batch_size']} rows per process, "
             f"fp32 on CPU.", ""]
    rows = []
    for name, res in c["settings"].items():
        if not res["ok"]:
            rows.append([name, str(res.get("processes", "")), "failed: " + res["error"].splitlines()[0][:80]]
                        + [""] * (len(METRICS) + 2))
            continue
        same = res.get("two_equals_one")
        rows.append([name, str(res["processes"]), "yes" if res["match"] else "NO"]
                    + [f"{res['diffs'][m]['max_abs_diff']:.1e}" for m in METRICS]
                    + [f"{res['weights']['max_abs_diff']:.1e}",
                       "" if same is None else ("bit for bit" if same["equal"] else "NO")])
    lines.append(table(["setting", "processes", "within"] + [f"{m} max diff" for m in METRICS]
                       + ["final weights max diff", "2 = 1"], rows))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SETTINGS), help="settings, comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--work", default=f"/tmp/kto-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    a = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import trl

    from bench.parts.common import CACHE, git_state, machine, versions

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = {"command": "python bench/studies/kto_vs_trl.py " + " ".join(argv), "git": git_state(),
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "versions": {**versions(), "trl": trl.__version__}}
    results["compare"] = compare(work, CACHE, a.steps, a.only.split(","))
    results["minutes"] = (time.time() - t0) / 60
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(section(results))
    print(f"results: {work / 'results.json'}")
    return 0 if all(r.get("match") for r in results["compare"]["settings"].values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trl":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from finetune.run import exit_without_teardown

        exit_without_teardown(trl_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
