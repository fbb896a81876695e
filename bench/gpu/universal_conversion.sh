#!/usr/bin/env bash
# DeepSpeed's universal conversion of a 0.44B (438M parameters) zero2 checkpoint of 2 ranks, on a lent machine's CPUs
# (the GPU hidden: 2 gloo processes), with 1 and 2 workers (docs/async-checkpoints.md):
#   bash bench/gpu/universal_conversion.sh      # from the repository root; carry bench/wheels_gpu
set -uo pipefail
OUT=${OUT:-/tmp/conv_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/conversion.log") 2>&1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false BENCH_CACHE=/tmp/bcache PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-6} FINETUNE_CACHE=/tmp/fcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/wheels_gpu/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nproc; free -g | head -2
M=$(python3 -c "
from bench.parts.common import ModelSpec, build_model
spec = ModelSpec('llama-440m', 1536, 12, 16, 4096)
print(build_model(spec)); print(spec.num_parameters())" | tail -2 | head -1)
echo "model $M"
t0=$SECONDS
python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
  --dynamo_backend no --main_process_port 29700 finetune/run.py --recipe tiny model=$M strategy=zero2 max_steps=1 \
  warmup_steps=0 save_every=1 eval_fraction=0 eval_at_start=false mixed_precision=no sample_prompts=0 \
  plot_loss=false max_seq_len=256 micro_batch_size=1 global_batch_size=2 output_dir=/tmp/conv > "$OUT/train.log" 2>&1
echo "train rc $? in $((SECONDS - t0)) s"
grep '"seconds"' /tmp/conv/checkpoints/step_000000001/manifest.json
python3 bench/studies/universal_conversion.py /tmp/conv/checkpoints/step_000000001 --workers ${WORKERS:-1,2}
