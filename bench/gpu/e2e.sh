#!/usr/bin/env bash
# What a GPU user runs, end to end, in one call on a lent GPU (issue 46). Whenever a GPU is lent, this runs
# first. Every phase records its result and the script goes on when something fails.
#   1. recipes: every tiny recipe through `finetune train` at its own settings and mixed_precision=bf16 (a GPU
#      user's precision; generation_compile stays auto: the compiled decode loop on a GPU): tiny, tiny_dpo,
#      tiny_reward, tiny_kto, tiny_grpo, tiny_rloo, tiny_distill (its teacher: this run's tiny, final/) and
#      tiny_grpo with generation_compile=false. Each must reach the metric its header promises
#      (bench/gpu/e2e_check.py TARGETS).
#   2. fp32: the compiled decode loop's tokens against the eager loop's in fp32 (must be equal).
#   3. grpo: whole GRPO steps of a 1B model, ours against TRL's GRPOTrainer (bench/gpu/grpo_rollout.py --steps),
#      rollout and step seconds; TRL's row is given the time to finish.
#   4. async: async_save against synchronous saves of the 1B model for ddp, fsdp and zero3
#      (bench/studies/async_checkpoints.py --gpu): seconds the loop blocks per save.
# Results go to $OUT: e2e.md (the table, with the commit), e2e.log (everything), rows.jsonl, the phases' files.
#
#   bash bench/gpu/e2e.sh            # on the device, from the repository root; carry bench/wheels_gpu
#   E2E_SMOKE=1 bash bench/gpu/e2e.sh  # on CPU (2 processes, a few steps each, the 1B phases on small models):
#                                      # checks the script itself; tests/distributed/test_gpu_e2e_smoke.py runs it
# The smoke mode trains only E2E_RECIPES (the test: one recipe), so that its cost stays flat as rows are added;
# every row of the default list is then checked without training (e2e_check.py resolve): the recipe and the
# script's overrides resolve and validate as `finetune train` takes them, the row has a target, its metric is
# one the run logs at eval, and tiny_distill's teacher is made by a row before it. What only training shows
# (that the figure is reached) is the GPU run's to say.
# E2E_BUDGET (default 530): seconds in all; a phase that would not finish is skipped and says so.
# E2E_PHASES (default recipes,fp32,grpo,async): the phases to run, in that order; E2E_RECIPES (comma-separated)
# the recipes phase's runs; E2E_ASYNC the async phase's strategies.
set -uo pipefail
T0=$SECONDS
BUDGET=${E2E_BUDGET:-530}
SMOKE=${E2E_SMOKE:-0}
PHASES=${E2E_PHASES:-recipes,fp32,grpo,async}
OUT=${OUT:-/tmp/e2e_out}
STATE=${E2E_STATE:-/tmp/e2e}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STATE/runs"
: > "$OUT/rows.jsonl"
exec > >(tee -a "$OUT/e2e.log") 2>&1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 BENCH_CACHE=$STATE/bcache
note() { echo "[e2e $((SECONDS - T0))s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
has() { [[ ",$PHASES," == *",$1,"* ]]; }
DEFAULT_RECIPES="tiny,tiny_dpo,tiny_reward,tiny_kto,tiny_grpo,tiny_rloo,tiny_distill,tiny_grpo generation_compile=false"
# tiny_distill's teacher: the tiny row's final/ (a row of its own would be the same run)
teacher() { [[ "$1" == tiny_distill* && "$1" != *teacher_model=* ]] && echo "teacher_model=$STATE/runs/tiny/final"; }

commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${E2E_COMMIT:-unknown}")
note "start: budget ${BUDGET}s, smoke=$SMOKE, phases $PHASES, commit $commit"
if [ "$SMOKE" = 1 ]; then
    export PYTHONPATH=$PWD
    NPROC=2
    SHORT=(max_steps=4 warmup_steps=1 eval_every=4 eval_max_samples=8 save_every=0)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if ls bench/wheels_gpu/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            bench/wheels_gpu/*.whl && export PYTHONPATH=/tmp/site:$PWD || note "wheels: install FAILED"
    else
        export PYTHONPATH=$PWD
        note "no bench/wheels_gpu: datasets, deepspeed and trl must be installed already"
    fi
    NPROC=1
    SHORT=()
fi
$PY -c "import torch, transformers, accelerate; print('versions: torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"

# 1. every tiny recipe as a user runs it
if has recipes; then
    while IFS= read -r spec; do
        [ -z "$spec" ] && continue
        name=${spec// /_}; name=${name//=/-}
        run_dir=$STATE/runs/$name
        if [ "$(left)" -lt 45 ]; then
            echo "{\"recipe\": \"$spec\", \"ok\": false, \"rc\": -1, \"seconds\": 0, \"steps\": 0, \"metric\": \"-\", \"target\": \"-\", \"first\": null, \"last\": null, \"error\": \"skipped: out of time\"}" >> "$OUT/rows.jsonl"
            continue
        fi
        rm -rf "$run_dir"
        start=$SECONDS
        # shellcheck disable=SC2086
        timeout $(( $(left) - 10 )) $PY -m finetune.cli train $spec $(teacher "$spec") --num_processes $NPROC \
            mixed_precision=bf16 "output_dir=$run_dir" "${SHORT[@]}" > "$run_dir.log" 2>&1
        rc=$?
        $PY bench/gpu/e2e_check.py recipe "$spec" "$run_dir" $((SECONDS - start)) $rc $([ "$SMOKE" = 1 ] && echo --smoke) \
            >> "$OUT/rows.jsonl" || note "check of $spec FAILED"
        tail -1 "$OUT/rows.jsonl"
        tail -3 "$run_dir.log" | sed 's/^/    /'
        cp -f "$run_dir/summary.json" "$OUT/$name.summary.json" 2>/dev/null
        cp -f "$run_dir.log" "$OUT/$name.log" 2>/dev/null
        rm -rf "$run_dir/checkpoints"
    done < <(echo "${E2E_RECIPES:-$DEFAULT_RECIPES}" | tr ',' '\n')
    if [ "$SMOKE" = 1 ]; then  # every default row, not trained here: see the header
        $PY bench/gpu/e2e_check.py resolve "$DEFAULT_RECIPES" "$STATE" >> "$OUT/rows.jsonl" || note "resolve FAILED to run"
        tail -1 "$OUT/rows.jsonl"
    fi
fi

# 2. the compiled loop's tokens equal the eager loop's in fp32
if has fp32; then
    $PY bench/gpu/e2e_check.py compiled-equals-eager >> "$OUT/rows.jsonl" || note "fp32 check FAILED to run"
    tail -1 "$OUT/rows.jsonl"
fi

# 3. whole GRPO steps at 1B, ours against TRL's GRPOTrainer
if has grpo; then
    if [ "$(left)" -gt 150 ]; then
        if [ "$SMOKE" = 1 ]; then
            $PY bench/gpu/grpo_rollout.py --smoke --out "$OUT/rollout.json" || note "grpo steps FAILED"
        else
            $PY bench/gpu/grpo_rollout.py --no-generation --steps 4 --completions 32 --new-tokens 256 \
                --out "$OUT/rollout.json" --deadline $(( $(left) - 120 )) || note "grpo steps FAILED"
        fi
    else
        note "grpo steps: skipped, $(left)s left"
    fi
fi

# 4. async_save against synchronous saves at 1B, ddp fsdp zero3
if has async; then
    if [ "$(left)" -gt 120 ]; then
        if [ "$SMOKE" = 1 ]; then
            timeout $(( $(left) - 10 )) $PY bench/studies/async_checkpoints.py --model llama-7m --strategies ddp \
                --steps 4 --every 2 --work "$STATE/async" > "$OUT/async.txt" 2>&1 || note "async FAILED"
        else
            timeout $(( $(left) - 10 )) $PY bench/studies/async_checkpoints.py --gpu --strategies "${E2E_ASYNC:-ddp,fsdp,zero3}" \
                --steps 6 --every 3 --work "$STATE/async" > "$OUT/async.txt" 2>&1 || note "async FAILED"
        fi
        cat "$OUT/async.txt" | tail -30
        cp -f "$STATE"/async/*.json "$OUT/" 2>/dev/null
    else
        note "async: skipped, $(left)s left"
    fi
fi

{
    echo "bench/gpu/e2e.sh at $commit ($(date -u +%Y-%m-%d), smoke=$SMOKE, $((SECONDS - T0)) s):"
    echo
    $PY bench/gpu/e2e_check.py table "$OUT/rows.jsonl"
} > "$OUT/e2e.md"
cat "$OUT/e2e.md"
note "done"
