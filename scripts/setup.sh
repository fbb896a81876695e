#!/usr/bin/env bash
# Set up .venv for finetune on a fresh machine (idempotent; re-running is cheap).
# On a machine without an NVIDIA GPU the CPU build of torch is installed first; a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
python -c "import torch, transformers, accelerate, deepspeed, datasets; print('finetune env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| deepspeed', deepspeed.__version__)" 2>/dev/null

# NVMe offload (offload_optimizer/offload_params=nvme) needs DeepSpeed's async_io op, which needs
# libaio; finetune checks for it at validation (finetune/plan.py async_io_problem).
nvme_problem() {
  python -c "import sys, torch; from finetune.plan import async_io_problem; p = async_io_problem(torch.cuda.is_available()); print(p or ''); sys.exit(1 if p else 0)" 2>/dev/null | tail -1
}
if ! problem=$(nvme_problem); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing libaio-dev (apt-get) for NVMe offload"
    (timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq libaio-dev) >/dev/null 2>&1 || true
  fi
  problem=$(nvme_problem) || echo "NVMe offload will be unavailable: $problem"
fi
# On a CPU machine (where the tests run) build the op now, once, rather than inside the first run
# that uses it: it compiles for minutes (cached in ~/.cache/torch_extensions). On a GPU node
# DeepSpeed builds it on first use.
# Under torch 2.13 a build that was killed leaves its `lock` file, and torch's builder then waits on it
# forever: clear locks older than any real build (finetune's validation names them too:
# plan.stale_build_lock_problems). Under torch 2.14 the file stays after every build, held only by
# an OS lock while one runs: nothing is removed (removing a held one would let two builds run at once).
clear_build_locks() {  # [older than, in seconds] [op ...]
  python - "$@" <<'PY' 2>/dev/null || true
import sys
from finetune.plan import STALE_BUILD_LOCK_S, clear_stale_build_locks
older_than = float(sys.argv[1]) if len(sys.argv) > 1 else STALE_BUILD_LOCK_S
for lock in clear_stale_build_locks(older_than, sys.argv[2:] or None):
    print("removed a stale build lock:", lock)
PY
}
clear_build_locks
if [ -z "${problem:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  start=$(date +%s)
  if DS_ACCELERATOR=cpu timeout 1200 python -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()" >/dev/null 2>&1; then
    echo "DeepSpeed async_io op (NVMe offload) ready ($(( $(date +%s) - start )) s)"
  else
    # under torch 2.13 a build cut off by the timeout leaves its lock, and every later build (and finetune's
    # validation) would wait on it: no other build of ours is running, so remove it
    clear_build_locks 0 async_io >/dev/null
    echo "NVMe offload will be unavailable: building DeepSpeed's async_io op failed (run python -c \"from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=True)\" to see why)"
  fi
fi
