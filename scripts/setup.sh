#!/usr/bin/env bash
# Set up .venv for finetune on a fresh machine (idempotent; re-running is cheap).
#   bash scripts/setup.sh          the environment: enough for every strategy and CPU offload
#   bash scripts/setup.sh --nvme   also NVMe offload: libaio and DeepSpeed's async_io op (minutes to compile)
#   bash scripts/setup.sh --nvme --no-build   libaio only; the op compiles on first use (or with --build-ops)
#   bash scripts/setup.sh --build-ops   only compile DeepSpeed's CPU ops the tests use (async_io, cpu_adam) in .venv
#                                       (.ci/run does it beside the suite; a run that needs one waits for its build)
# On a machine without an NVIDIA GPU the CPU build of torch is installed first; a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
nvme=0 build=1 ops_only=0
for arg in "$@"; do
  case "$arg" in
    --nvme) nvme=1 ;;
    --no-build) build=0 ;;
    --build-ops) ops_only=1 ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $arg (scripts/setup.sh [--nvme [--no-build]] [--build-ops])" >&2; exit 2 ;;
  esac
done
say() { echo "setup: $*"; }
if [ "$ops_only" = 1 ]; then
  [ -x .venv/bin/python ] || { echo "error: no .venv: run bash scripts/setup.sh first" >&2; exit 2; }
  . .venv/bin/activate
  start=$(date +%s)
  # .venv/bin (its ninja) first on PATH, as every run builds: another ninja discards the build log and compiles again.
  # No time limit: beside a busy suite a build takes many times its quiet 4 minutes, and under torch 2.13 a build
  # cut off leaves its lock, on which every later build of that op waits.
  if DS_ACCELERATOR=cpu python -c "
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
CPUAdamBuilder().load(verbose=False)
AsyncIOBuilder().load(verbose=False)"; then
    echo "setup: DeepSpeed's cpu_adam and async_io ops ready ($(( $(date +%s) - start )) s)"
    exit 0
  fi
  echo "setup: building DeepSpeed's cpu_adam and async_io ops failed (the output above says why)" >&2
  exit 1
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv/ (a virtual environment of $("$PY" --version 2>&1)): everything installs there, nothing system-wide"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  if ! python -c "import torch" 2>/dev/null; then
    say "installing torch 2.13.0, CPU build (no NVIDIA GPU here; a plain 'torch' would pull a multi-GB CUDA build)"
    python -m pip install -q "torch==2.13.0"
  fi
fi
say "installing finetune and its dependencies (transformers, accelerate, deepspeed, datasets, peft, pytest, ...) at the versions in scripts/constraints.txt: a minute or two on a fresh machine"
python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
python -c "import torch, transformers, accelerate, deepspeed, datasets; print('finetune env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| deepspeed', deepspeed.__version__)" 2>/dev/null

say "done: activate it with 'source .venv/bin/activate' (or call .venv/bin/finetune, .venv/bin/python)"
[ "$nvme" = 1 ] || say "NVMe offload (offload_*=nvme) not prepared: 'bash scripts/setup.sh --nvme' installs libaio and compiles DeepSpeed's async_io op (about 4 minutes on 2 cores), or the first nvme run compiles it"

# NVMe offload (offload_optimizer/offload_params=nvme) needs DeepSpeed's async_io op, which needs
# libaio; finetune checks for it at validation (finetune/plan.py async_io_problem).
nvme_problem() {
  python -c "import sys, torch; from finetune.plan import async_io_problem; p = async_io_problem(torch.cuda.is_available()); print(p or ''); sys.exit(1 if p else 0)" 2>/dev/null | tail -1
}
problem=
if [ "$nvme" = 1 ] && ! problem=$(nvme_problem); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing libaio-dev (apt-get): the Linux asynchronous I/O library NVMe offload reads and writes through"
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
ext_root=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
if [ "$nvme" = 1 ] && [ "$build" = 1 ] && [ -z "${problem:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  say "compiling DeepSpeed's async_io op for NVMe offload (about 4 minutes on 2 cores, once: cached in $ext_root)"
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
