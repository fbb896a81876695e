"""Our KTO (objective=kto) against TRL's KTOTrainer: the same unpaired rows, model and hyper-parameters, step by
step, and the final weights.

    python bench/studies/kto_vs_trl.py                      # the settings below, 1 process each side, ~6 min
    python bench/studies/kto_vs_trl.py --steps 10 --only default

TRL is a bench-only dependency (pip install -e .[bench], or `pip install --no-deps 'trl>=1.16'` beside the
project's pinned accelerate/datasets/transformers). Exit 1 when a compared metric differs by more than
1e-5 x max(1, |TRL's value|) at some step, or a final weight by more than WEIGHT_TOLERANCE.

The rows: bench/studies/dpo_vs_trl.py's 64 generated prompt/chosen/rejected pairs (reverse the words of a
phrase), unpaired: pair k gives (prompt, chosen, true) for even k and (prompt, rejected, false) for odd k, so
that neighbouring rows (the KL rows' partners) have different prompts. The model: the same random-weight
2-layer Llama with the toolkit's character tokenizer (bench/parts/common.py build_model), fp32 on CPU. Ours is
`python finetune/run.py --recipe tiny objective=kto dataset_format=unpaired ...`; TRL's is this file's `trl`
mode, KTOTrainer given the same recipe's numbers: lr, AdamW betas/eps, weight decay 0, constant lr with no
warmup, max_grad_norm 1.0, seed, micro-batch 8 rows and one micro-batch per step (TRL's KL estimate is its
micro-batch's, ours its global batch's: the same here), dropout off, and the same rows in the same order (TRL's
sampler yields finetune.data.BatchSchedule's order, bench/helpers/trainer_baseline.py ScheduleSampler; the KL
rows are made in the dataset's order on both sides, TRL's rotation within chunks of
per_device_train_batch_size). Compared per step (TRL's names, which our metrics.jsonl uses too): loss,
rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected, kl; then every weight of
final/ against TRL's saved model.

SETTINGS: TRL's defaults (loss_type kto, beta 0.1, desirable and undesirable weight 1.0), and one non-default
(beta 0.3, desirable_weight 1.33, undesirable_weight 0.8); apo_zero_unpaired (no KL rows) as a third.
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
SETTINGS = {
    "default": [],
    "beta0.3_weights": ["kto_beta=0.3", "desirable_weight=1.33", "undesirable_weight=0.8"],
    "apo_zero_unpaired": ["kto_loss=apo_zero_unpaired"],
}
# fp32 weights after a few steps of Adam on the same gradients up to summation order: the DPO comparison's
# losses agree to ~1e-7, and Adam's first steps move a weight by about lr whatever its gradient's size, so
# a weight whose gradient is near 0 may differ by a fraction of lr (1e-3 here)
WEIGHT_TOLERANCE = 1e-4
SCRIPT = "bench/studies/kto_vs_trl.py"


def rows() -> list[dict]:
    """The unpaired rows: dpo_vs_trl's pairs, the chosen side of the even ones, the rejected of the odd."""
    from bench.studies.dpo_vs_trl import rows as pairs

    return [{"prompt": p["prompt"], "completion": p["chosen"] if k % 2 == 0 else p["rejected"], "label": k % 2 == 0}
            for k, p in enumerate(pairs())]


def data_file(cache: Path) -> Path:
    path = cache / "data" / "kto-rows-64.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        tmp.rename(path)
    return path


def overrides(model_dir: Path, data: Path, steps: int, setting: list[str], micro: int = 8) -> list[str]:
    """The recipe both sides are given (TRL's side reads the same recipe, trl_main)."""
    return [f"model={model_dir}", f"dataset={data}", "dataset_format=unpaired", "objective=kto", *setting,
            "max_seq_len=256", f"micro_batch_size={micro}", "grad_accum=1", f"max_steps={steps}", "strategy=ddp",
            "mixed_precision=no", "lr=1e-3", "lr_scheduler=constant", "warmup_steps=0", "weight_decay=0.0",
            "max_grad_norm=1.0", "seed=42", "log_every=1", "eval_fraction=0", "eval_at_start=false", "eval_every=0",
            "save_every=0", "sample_prompts=0", "plot_loss=false", "activation_checkpointing=false"]


def trl_main(argv: list[str]) -> int:
    """`bench/studies/kto_vs_trl.py trl OUT --recipe NAME key=value ...`: TRL's KTOTrainer on the recipe's model,
    rows and numbers; writes OUT/trl_summary.json and OUT/trl_final/ (the trained model)."""
    from bench.helpers import trainer_baseline as TB

    out, r, plan = TB.recipe_and_plan(argv)

    import torch
    import trl
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from bench.parts.common import read_jsonl
    from finetune import data as D
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
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": r.attn_implementation}, **kw)

    data = read_jsonl(Path(r.dataset))
    tokenizer = load_tokenizer(r, model_path)
    schedule = D.BatchSchedule(len(data), r.micro_batch_size, plan.grad_accum, targs.world_size, r.seed)
    logs: dict[int, dict] = {}

    class SameRowsKTOTrainer(trl.KTOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return TB.ScheduleSampler(schedule, r.max_steps)

        def log(self, entries, start_time=None):
            super().log(entries, start_time)
            if "loss" in entries:
                logs[self.state.global_step] = dict(entries)

    trainer = SameRowsKTOTrainer(model=str(model_path), args=targs, train_dataset=Dataset.from_list(data),
                                 processing_class=tokenizer)
    if len(trainer.train_dataset) != len(data):
        print(f"error: TRL kept {len(trainer.train_dataset)} of {len(data)} rows; the order would differ",
              file=sys.stderr)
        return 2
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(str(out / "trl_final"))
        summary = {"trl": trl.__version__, "steps": trainer.state.global_step,
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


def compare(work: Path, cache: Path, steps: int, settings: list[str]) -> dict:
    from bench.parts.common import ModelSpec, build_model
    from bench.studies.dpo_vs_trl import TOLERANCE, differences, run_ours, run_trl

    model = build_model(ModelSpec("llama-2l-h64-v128", 64, 2, 4, 176, vocab_size=128, num_key_value_heads=2),
                        cache / "models")
    data = data_file(cache)
    results = {"model": str(model), "data": str(data), "steps": steps, "tolerance": TOLERANCE,
               "weight_tolerance": WEIGHT_TOLERANCE, "settings": {}}
    for name in settings:
        over = overrides(model, data, steps, SETTINGS[name])
        ours = run_ours(f"kto-{name}", over, work, 1)
        theirs = run_trl(f"kto-{name}", over, work, 1, script=SCRIPT)
        res = {"overrides": SETTINGS[name], "ours_command": ours["command"], "trl_command": theirs["command"],
               "ok": ours["ok"] and theirs["ok"]}
        if not ours["ok"]:
            res["error"] = "ours: " + ours["error"]
        elif not theirs["ok"]:
            res["error"] = "TRL: " + theirs["error"]
        else:
            a, b = ours["records"], theirs["logs"]
            res.update(steps_ours=len(a), steps_trl=len(b), diffs=kl_relative(differences(a, b, METRICS), a, b),
                       first=[{m: r.get(m) for m in METRICS} for r in (a[0], b[0] or {})],
                       last=[{m: r.get(m) for m in METRICS} for r in (a[-1], b[-1] or {})],
                       weights=weight_differences(Path(ours["output_dir"]) / "final",
                                                  Path(theirs["output_dir"]) / "trl_final"))
            res["match"] = (len(a) == len(b) == steps and all(d["within"] for d in res["diffs"].values())
                            and res["weights"]["max_abs_diff"] <= WEIGHT_TOLERANCE)
        results["settings"][name] = res
        print(f"{name}: " + (json.dumps({"diffs": res.get("diffs"), "weights": res.get("weights")}) if res["ok"]
                             else res["error"]), flush=True)
    return results


def section(results: dict) -> str:
    """The report: per setting, each metric's largest difference and the final weights'."""
    from bench.parts.common import table

    lines = [f"`{results['command']}` (git {results['git']}, {results['started']}, {results['minutes']:.1f} min; "
             f"TRL {results['versions'].get('trl')}): {results['compare']['steps']} steps, one process each side, "
             f"fp32 on CPU.", ""]
    rows = []
    for name, res in results["compare"]["settings"].items():
        if not res["ok"]:
            rows.append([name, "failed: " + res["error"].splitlines()[0][:80]] + [""] * (len(METRICS) + 1))
            continue
        rows.append([name, "yes" if res["match"] else "NO"]
                    + [f"{res['diffs'][m]['max_abs_diff']:.1e}" for m in METRICS]
                    + [f"{res['weights']['max_abs_diff']:.1e}"])
    lines.append(table(["setting", "within"] + [f"{m} max diff" for m in METRICS] + ["final weights max diff"], rows))
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
