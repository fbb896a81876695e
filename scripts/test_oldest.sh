#!/usr/bin/env bash
# The tests marked `internals` (paths that rest on a dependency's internals: the compiled decode loop's
# StaticCache under autocast, the 2-process GRPO launches at bf16 that use it, ...) run again with the
# oldest releases pyproject.toml allows (scripts/constraints-oldest.txt), so both ends of the range are
# tested. .venv-oldest is a venv that sees .venv's packages (a .pth line adds .venv's site-packages after
# its own) and holds only those releases itself: set up in seconds, nothing downloaded twice.
#   bash scripts/test_oldest.sh [pytest args]     (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "error: no .venv: run bash scripts/setup.sh first" >&2; exit 2; }
if [ ! -x .venv-oldest/bin/python ]; then
  echo "test_oldest: creating .venv-oldest (the oldest transformers pyproject allows, over .venv's packages)"
  .venv/bin/python -c "import sys; print(sys.base_prefix)" >/dev/null
  "$(.venv/bin/python -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')" -m venv .venv-oldest
fi
base=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
own=$(.venv-oldest/bin/python -c "import site; print(site.getsitepackages()[0])")
echo "import site; site.addsitedir('$base')" > "$own/zz_finetune_venv.pth"
# .venv's ninja too: a run builds DeepSpeed's ops with the ninja beside its interpreter, else the system's, whose
# older build log makes .venv's ninja compile the op again for the suite (and the suite's for this venv)
[ -e ".venv-oldest/bin/ninja" ] || [ ! -x .venv/bin/ninja ] || ln -s "$PWD/.venv/bin/ninja" ".venv-oldest/bin/ninja"
.venv-oldest/bin/python -m pip install -q --disable-pip-version-check -r scripts/constraints-oldest.txt
.venv-oldest/bin/python - <<'PY'
import transformers, finetune
from finetune.versions import TESTED
assert transformers.__version__ == TESTED["transformers"][0], (transformers.__version__, TESTED)
print(f"test_oldest: transformers {transformers.__version__} (finetune from {finetune.__path__[0]})")
PY
export HF_HUB_OFFLINE=1
exec .venv-oldest/bin/python -m pytest -q -m internals -p no:cacheprovider "$@"
