#!/usr/bin/env bash
# async_save on one lent GPU (docs/async-checkpoints.md, section "Results / GPU"): the 1B model in bf16,
# one process, a synchronous and an async_save run saving every 3 steps. One call of about 6-8 minutes:
#   bash bench/gpu/async_checkpoints.sh      # on the device, from the repository root; carry bench/wheels_gpu
# Results to $OUT: async_gpu.txt (the table), async_gpu.log (everything), ddp.json (both runs' figures).
set -uo pipefail
OUT=${OUT:-/tmp/async_gpu_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/async_gpu.log") 2>&1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false BENCH_CACHE=/tmp/bcache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/wheels_gpu/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h /dev/shm /tmp | sed 's/^/disk: /'
free -g | head -2
# staging needs the node's share of a checkpoint (~11.4 GB for the 1B model) in a tmpfs
shm_free=$(df --output=avail -B1G /dev/shm | tail -1)
if [ "${shm_free:-0}" -lt 24 ]; then
  mkdir -p /tmp/staging && export FINETUNE_STAGING_DIR=/tmp/staging
  echo "/dev/shm has ${shm_free} GiB free: staging in $FINETUNE_STAGING_DIR (disk, through the page cache)"
fi
python3 bench/studies/async_checkpoints.py --gpu --steps 24 --every 8 --work /tmp/bw-async --doc docs/async-checkpoints.md \
  | tee "$OUT/async_gpu.txt"
cp /tmp/bw-async/ddp.json "$OUT/" 2>/dev/null
cp docs/async-checkpoints.md "$OUT/" 2>/dev/null
grep -h "checkpoint\|waited\|error" /tmp/bw-async/*.log | tail -40
