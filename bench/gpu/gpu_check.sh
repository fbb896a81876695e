#!/usr/bin/env bash
# The checks for one call on a lent GPU machine (one H100 or H200; a call of at most about 480 s):
#   1. the carried wheels installed (bench/README.md: datasets, deepspeed, pydantic, liger-kernel, ...),
#   2. the README's DPO command on one GPU: accelerate launch finetune/run.py --recipe tiny_dpo
#      (issue 34 defect 1: it died at the first step after step 20's eval and samples),
#   3. python bench/run.py --gpu: finetune against the Trainer, eager and compiled (section 6), each
#      run's outputs removed once its row is read, stopped by --deadline before the call's limit.
# Logs and results go to $OUT (the device tool's folder that comes back): gpu_check.txt (one line per
# phase and the bench's table), gpu_check.log (everything), tiny_dpo.{log,summary.json,metrics.jsonl},
# bench.log, gpu.json, rows/ (one log and row file per bench run), benchmarks.md (with the new section).
#
#   bash bench/gpu/gpu_check.sh          # on the device, from the repository root; carry bench/wheels_gpu
#
# Run it again on the same warm machine to finish what a call left: the wheels and the DPO run are
# not repeated (their results are kept in $STATE), the bench keeps its finished rows (--reuse).
# GPU_CHECK_BUDGET (default 450): seconds this script may take in all; the bench gets what is left.
# GPU_CHECK_SMOKE=1: the same steps on a CPU machine (no install, tiny_dpo on CPU, bench --gpu-smoke),
# to check the script itself; it measures nothing.
set -uo pipefail

T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-450}
SMOKE=${GPU_CHECK_SMOKE:-0}
OUT=${OUT:-/tmp/gpu_check_out}
STATE=${GPU_CHECK_STATE:-/tmp/gpu_check}    # survives between calls on a warm machine, not in $OUT
WORK=$STATE/bw                               # the bench's --work: row files, logs, each run while it runs
PY=${PYTHON:-python3}
DPO_LIMIT=${GPU_CHECK_DPO_S:-150}            # tiny on one H200 took 58 s; tiny_dpo evaluates and samples 4 times
mkdir -p "$OUT" "$STATE"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false BENCH_CACHE=$STATE/bcache

FAILED=()
note() { echo "[gpu_check $((SECONDS - T0))s] $*" | tee -a "$OUT/gpu_check.txt"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
copy_back() {  # the small files only: a run's checkpoints never go to $OUT
    mkdir -p "$OUT/rows"
    cp -f "$WORK"/gpu*/*.log "$WORK"/gpu*/*.row.json "$OUT/rows/" 2>/dev/null
    cp -f "$WORK/gpu.json" "$OUT/" 2>/dev/null
    for kept in "$WORK"/gpu*/*/; do  # what prune_outputs kept of each run
        [ -d "$kept" ] || continue
        for f in summary.json trainer_summary.json; do
            [ -f "$kept$f" ] && cp -f "$kept$f" "$OUT/rows/$(basename "$kept").$f"
        done
    done
    cp -f docs/benchmarks.md "$OUT/benchmarks.md" 2>/dev/null
    { df -h "$STATE" | tail -1; du -sh "$WORK" 2>/dev/null; } > "$OUT/disk.txt"
}
trap copy_back EXIT

note "start: budget ${BUDGET}s, smoke=$SMOKE, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') $(git status --porcelain 2>/dev/null | wc -l) changed files"
if [ "$SMOKE" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu_check.txt"
    df -h "$STATE" | tail -1 | tee -a "$OUT/gpu_check.txt"
fi

# 1. the wheels (bench/README.md "On a lent GPU machine without deepspeed or datasets")
if [ "$SMOKE" = 1 ]; then
    export PYTHONPATH=$PWD  # this checkout's finetune, not one installed elsewhere
    note "wheels: not installed (smoke: $($PY -c 'import deepspeed, datasets; print("deepspeed", deepspeed.__version__, "datasets", datasets.__version__)' 2>/dev/null | tail -1))"
elif [ -f "$STATE/wheels.done" ]; then
    note "wheels: installed by an earlier call"
    export PYTHONPATH=/tmp/site
else
    if ! ls bench/wheels_gpu/*.whl > /dev/null 2>&1; then
        note "wheels: bench/wheels_gpu/*.whl missing: build them as bench/README.md says and pass carry=[\"bench/wheels_gpu\"]"
        exit 2
    fi
    t=$SECONDS
    "$PY" -m pip install -q --upgrade --no-index --no-deps --target /tmp/site bench/wheels_gpu/*.whl
    rc=$?
    export PYTHONPATH=/tmp/site
    "$PY" -c "import datasets, deepspeed, pydantic; from accelerate.utils import DummyOptim; print('imports ok: deepspeed', deepspeed.__version__, 'datasets', datasets.__version__)"
    rc=$((rc || $?))
    note "wheels: rc=$rc in $((SECONDS - t))s"
    [ $rc = 0 ] && touch "$STATE/wheels.done" || exit 3
fi

# 2. the README's DPO command on one GPU (one process)
DPO_OUT=$STATE/tiny_dpo
if [ -f "$STATE/dpo.rc" ]; then
    [ "$(cat "$STATE/dpo.rc")" = 0 ] || FAILED+=(tiny_dpo)
    note "tiny_dpo: run by an earlier call, rc=$(cat "$STATE/dpo.rc") (its files are in \$OUT from that call)"
else
    rm -rf "$DPO_OUT"
    t=$SECONDS
    timeout -k 10 "$DPO_LIMIT" "$PY" -m accelerate.commands.launch finetune/run.py --recipe tiny_dpo \
        "output_dir=$DPO_OUT" > "$OUT/tiny_dpo.log" 2>&1
    rc=$?
    echo $rc > "$STATE/dpo.rc"
    cp -f "$DPO_OUT/summary.json" "$OUT/tiny_dpo.summary.json" 2>/dev/null
    cp -f "$DPO_OUT/metrics.jsonl" "$OUT/tiny_dpo.metrics.jsonl" 2>/dev/null
    steps=$($PY -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['steps'], 'steps, eval accuracy', s.get('final_eval_rewards/accuracies'), ', steady tok/s', s.get('tokens_per_s_steady'))" "$DPO_OUT/summary.json" 2>/dev/null || echo "no summary.json")
    last=$(grep -o "^step [0-9]*" "$OUT/tiny_dpo.log" | tail -1)
    err=$(grep -m1 "^error:" "$OUT/tiny_dpo.log" | cut -c1-160)
    [ $rc = 0 ] || FAILED+=(tiny_dpo)
    note "tiny_dpo: rc=$rc in $((SECONDS - t))s ($([ $rc = 124 ] && echo "timed out at ${DPO_LIMIT}s; ")$steps; last logged: ${last:-none})${err:+; $err}"
fi

# 3. the bench, bounded by what is left of the budget (15 s kept for copying the results back)
deadline=$(( $(left) - 15 ))
if [ "$deadline" -lt 90 ]; then
    note "bench: not started, ${deadline}s left of the budget; run this script again on the warm machine"
    exit 4
fi
mode=--gpu; [ "$SMOKE" = 1 ] && mode=--gpu-smoke
t=$SECONDS
timeout -k 10 $((deadline + 60)) "$PY" bench/run.py $mode --work "$WORK" --reuse --deadline "$deadline" \
    > >(tee "$OUT/bench.log") 2>&1
rc=$?
[ $rc = 0 ] || FAILED+=(bench)
note "bench: rc=$rc in $((SECONDS - t))s (--deadline ${deadline}s)"
$PY - "$WORK" <<'EOF' | tee -a "$OUT/gpu_check.txt"
import json, sys
from pathlib import Path
res = json.loads((Path(sys.argv[1]) / "gpu.json").read_text())
for r in res.get("rows", []):
    what = (f"not run: {r['skipped']}" if r.get("skipped") else f"failed: {str(r.get('error'))[:200]}" if not r.get("ok")
            else f"{r['tokens_per_s']:,.0f} tok/s" + (f", MFU {r['mfu']:.1%}" if r.get("mfu") else "")
            + (f", summary steady {r['summary_tokens_per_s_steady']:,.0f}" if r.get("summary_tokens_per_s_steady") else "")
            + (", compiled" if r.get("compiled") else ""))
    freed = r.get("outputs_removed_bytes")
    print(f"  {r['toolkit']:8} {r['strategy']:5} {r['variant']:15} {what}"
          + (f"; removed {freed / 2**30:.1f} GiB" if freed else ""))
print(f"  rows not run for the deadline: {res.get('not_run_deadline', 0)}, failed: {res.get('failed')}")
if res.get("not_run_deadline"):
    print("  to run them: bash bench/gpu/gpu_check.sh again on the same warm machine (finished rows and the DPO run are kept)")
EOF
note "done in $((SECONDS - T0))s${FAILED[*]:+; failed: ${FAILED[*]}}"
[ ${#FAILED[@]} = 0 ]
