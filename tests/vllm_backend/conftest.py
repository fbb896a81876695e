"""The real launches of tests/distributed (its launch and launch_env fixtures, the same command a user types)
for the vLLM backend's runs, in the venv scripts/test_vllm.sh builds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"
sys.path.insert(0, str(DISTRIBUTED))
_spec = importlib.util.spec_from_file_location("distributed_conftest", DISTRIBUTED / "conftest.py")
distributed = importlib.util.module_from_spec(_spec)
sys.modules["distributed_conftest"] = distributed
_spec.loader.exec_module(distributed)

launch_env = distributed.launch_env
launch = distributed.launch
