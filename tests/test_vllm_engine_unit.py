"""finetune.vllm_engine where vLLM is not installed (the main suite's venv): the module imports without
importing vLLM, and building an engine fails with one line saying how to install it. The engine itself
is tested against transformers in tests/vllm_backend (bash scripts/test_vllm.sh)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import vllm_engine

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_imports_without_importing_vllm():
    code = "import sys, finetune.vllm_engine as v; v.Sampling(4); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_vllm_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(vllm_engine.VLLMUnavailable) as e:
        vllm_engine.VLLMEngine("/nonexistent", dtype="float32")
    message = str(e.value)
    assert "\n" not in message and "docs/vllm.md" in message and "scripts/test_vllm.sh" in message


def test_a_bad_dtype_is_named_before_anything_loads():
    with pytest.raises(ValueError, match=r"dtype='fp8'; allowed: float32, bfloat16, float16"):
        vllm_engine.VLLMEngine("/nonexistent", dtype="fp8")


def test_the_types_match_the_generation_module():
    """Completion and Sampling are finetune.generation's where that module exists (one type for both
    backends); until then, fields of the same names and defaults."""
    assert vllm_engine.Sampling(8) == vllm_engine.Sampling(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0)
    assert vllm_engine.Completion([1], True).seconds == 0.0
    if importlib.util.find_spec("finetune.generation") is not None:
        from finetune import generation

        assert vllm_engine.Completion is generation.Completion and vllm_engine.Sampling is generation.Sampling


def test_padded_rows_get_the_bias_and_more_than_vllm_takes_is_refused():
    """The output rows past the tokenizer are biased away (vllm_engine.never_drawn); more of them than vLLM
    takes per request is one line, raised where the engine is set up, before any rollout."""
    from finetune.errors import RecipeError

    assert vllm_engine.never_drawn(None, 128) is None and vllm_engine.never_drawn(128, 128) is None
    assert vllm_engine.never_drawn(108, 128) == {i: vllm_engine.NEVER_BIAS for i in range(108, 128)}
    assert len(vllm_engine.never_drawn(151665, 151936)) == 271  # Qwen2's padding
    limit = vllm_engine.MAX_BIASED_IDS
    assert len(vllm_engine.never_drawn(1000, 1000 + limit)) == limit
    with pytest.raises(RecipeError, match=r"1025 past the tokenizer's 1000 tokens.*generation_backend=finetune"):
        vllm_engine.never_drawn(1000, 1000 + limit + 1)
