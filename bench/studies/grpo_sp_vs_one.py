"""GRPO under Ulysses sequence parallelism against 1 process, per loss type: for each setting, 1 process
(strategy=ddp, whole rows) and 2 processes (NPROCS) with sequence_parallel=2 under the given strategy
(processes / 2 data-parallel ranks, each row split in two for the loss) run recipes/tiny_grpo.py shortened (3 steps, 4
prompts x 4 completions, num_iterations=2, beta=0.04, temperature 0.7, no eval); printed: whether
rollouts.jsonl is the same (completions, rewards, advantages), the largest difference of the advantages,
and the largest difference of the logged loss and metrics (timings left out), relative for values above 1
and absolute below (rloo's loss is about 1e-10: its advantages' float residue).

    python bench/studies/grpo_sp_vs_one.py zero3 "loss_type=dapo adam_eps=1e-5" "loss_type=vespo adam_eps=1e-5" ...
    NOSP=1 python bench/studies/grpo_sp_vs_one.py zero3 "loss_type=dr_grpo"   # 2 processes without SP
    NPROCS=4 python bench/studies/grpo_sp_vs_one.py zero3 "adam_eps=1e-5"     # SP 2 x data parallel 2

Each setting is a space-separated list of recipe overrides. Runs go under $WORK (default /tmp/grpo-sp-vs-one);
a run directory that holds final/ is read again, not rerun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from finetune.training.metrics import read_metrics, run_history  # noqa: E402

WORK = Path(os.environ.get("WORK", "/tmp/grpo-sp-vs-one"))
BASE = ["global_batch_size=4", "num_generations=4", "micro_batch_size=4", "max_steps=3", "num_iterations=2",
        "beta=0.04", "temperature=0.7", "eval_every=0", "log_every=1", "save_every=0", "loss_chunk_tokens=8"]
TIMING = ("tokens_per_s", "rollout_seconds", "peak_memory_gib", "step_seconds", "mfu")
ENV = dict(os.environ, PYTHONPATH=str(REPO), FINETUNE_CACHE=str(WORK / "cache"), HF_HUB_OFFLINE="1",
           OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def launch(nprocs: int, out: Path, extra: list[str], strategy: str) -> tuple[str, list[dict]]:
    args = ["finetune/run.py", "--recipe", "tiny_grpo", f"strategy={strategy}", *BASE, *extra, f"output_dir={out}"]
    if nprocs == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nprocs),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               "29651", *args, *([] if os.environ.get("NOSP") else ["sequence_parallel=2"])]
    if not (out / "final").exists():
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
    records = [r for r in run_history(read_metrics(out / "metrics.jsonl")) if "loss" in r]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return rollouts, records


def largest_difference(want: list[dict], got: list[dict]) -> float:
    worst = 0.0
    for a, b in zip(want, got, strict=True):
        for k, v in a.items():
            if not isinstance(v, float) or k in TIMING or k.startswith("tokens_per") or v != v:
                continue
            worst = max(worst, abs(v - b[k]) / max(abs(v), 1.0))
    return worst


def main() -> None:
    strategy = sys.argv[1]
    for setting in sys.argv[2:]:
        extra = setting.split()
        tag = "_".join(extra).replace("=", "-")
        one = launch(1, WORK / f"one-{tag}", extra, "ddp")
        n = int(os.environ.get("NPROCS", "2"))
        two = launch(n, WORK / f"{n}{'-nosp' if os.environ.get('NOSP') else '-sp2'}-{tag}-{strategy}", extra, strategy)
        advantages = max(abs(a["advantage"] - b["advantage"]) for a, b in zip(one[0], two[0], strict=True))
        same = [{**a, "advantage": 0} for a in one[0]] == [{**b, "advantage": 0} for b in two[0]]
        print(f"{strategy} {setting}: completions and rewards identical {same}, advantages within {advantages:.1e}, "
              f"loss and metrics within {largest_difference(one[1], two[1]):.1e}", flush=True)


if __name__ == "__main__":
    main()
