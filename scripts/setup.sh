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
