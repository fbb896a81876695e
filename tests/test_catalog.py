"""The shipped catalog: every recipe git tracks in recipes/ (tests/shipped.py: not a user's own beside them)
loads and validates offline through the loading finetune/run.py uses, dry-runs (in-process, so the whole catalog costs one torch import), and states
in its header a launch command and the planner's current estimate; every launcher config in
accelerate_configs/ is valid YAML that accelerate accepts, says in its first comment what it is for,
and passes check_launcher with every recipe (the recipe decides the strategy)."""

import ast
import functools
import re
from pathlib import Path

import pytest
import yaml

from finetune import memory as M
from finetune import memory_tables as MT
from finetune.plan import check_launcher, derive_grad_accum
from finetune.recipe import RECIPES_DIR, Recipe, resolve
from shipped import shipped_recipes

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
RECIPES = shipped_recipes()  # ours, not a user's own recipes beside them
PLANNED = re.compile(r"python -m finetune\.plan --recipe (\S+) --gpus (\d+) --gpu-mem (\S+?)\)")
TOTAL = re.compile(r"= total ([0-9.]+) GiB")
OFFLOADED = re.compile(r"offloaded to CPU ([0-9.]+) GiB")
ROLLOUT = re.compile(r"= rollout peak ([0-9.]+) GiB")


def docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((RECIPES_DIR / f"{name}.py").read_text())) or ""


def test_catalog_is_there():
    for name in ("llama7b_zero3", "llama7b_fsdp", "llama7b_zero2", "llama7b_zero3_offload", "llama7b_fsdp_offload",
                 "llama8b_lora_fsdp", "llama70b_lora_zero3_offload", "mistral7b_zero3", "qwen7b_fsdp"):
        assert name in RECIPES


def test_a_users_recipes_beside_ours_are_not_judged(tmp_path):
    """A user's recipes/my_kto.py (untracked, as the README's first recipes are saved) is not one of the
    shipped recipes these tests check; outside a git checkout every recipe file is."""
    import subprocess

    (tmp_path / "recipes").mkdir()
    for name in ("__init__", "ours", "my_kto"):
        (tmp_path / "recipes" / f"{name}.py").write_text("")
    assert shipped_recipes.__wrapped__(tmp_path) == ["my_kto", "ours"]  # no checkout: every file
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "recipes/ours.py", "recipes/__init__.py"], cwd=tmp_path, check=True)
    assert shipped_recipes.__wrapped__(tmp_path) == ["ours"]
    assert "tiny" in RECIPES and not [n for n in RECIPES if n.startswith("my_")]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_validates_offline(name):
    recipe = resolve(name, [])  # what run.py's --recipe does: import, overrides, validate
    assert isinstance(recipe, Recipe)
    assert M.load_architecture(recipe.model).num_parameters() > 0  # its config is readable offline


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """A plain `python finetune/run.py` of a user: no launcher variables, run from elsewhere."""
    import os

    for key in list(os.environ):
        if key.startswith("ACCELERATE_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_exits_0(name, clean_env, capsys):
    """`python finetune/run.py --recipe NAME --dry-run`, in-process: GPU-only settings are reported on a
    CPU machine, not refused."""
    from finetune import run

    assert run.main(["--recipe", name, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    recipe = resolve(name, [])
    assert recipe.strategy in out


CATALOG = [n for n in RECIPES if PLANNED.search(docstring(n))]


def test_catalog_recipes_state_their_estimate():
    """Every non-tiny recipe says which GPUs it was sized for and the planner's estimate."""
    big = [n for n in RECIPES if not n.startswith("tiny")]
    assert big and set(big) <= set(CATALOG), set(big) - set(CATALOG)


@pytest.mark.parametrize("name", CATALOG)
def test_header_launch_command_and_estimate_are_current(name):
    doc = docstring(name)
    assert re.search(rf"(accelerate launch .*|python )finetune/run\.py --recipe {name}\b", doc), doc
    assert "planner's estimate" in doc
    assert re.search(r"Sized for \d+ x \d+ GB", doc), doc
    planned_name, gpus, mem = PLANNED.search(doc).groups()
    assert planned_name == name
    recipe = resolve(name, [])
    gpus = int(gpus)
    derive_grad_accum(recipe, gpus)  # its global batch splits over those GPUs
    e = M.recipe_estimate(recipe, gpus, M.load_architecture(recipe.model))
    stated = float(TOTAL.search(doc).group(1))
    assert stated == pytest.approx(e.total / M.GiB, abs=0.006), f"{name}: header says {stated}, planner {e.total / M.GiB:.2f}"
    off = OFFLOADED.search(doc)
    assert (float(off.group(1)) if off else 0.0) == pytest.approx((e.cpu + e.nvme) / M.GiB, abs=0.006)
    rollout = ROLLOUT.search(doc)  # GRPO: the generation phase's peak, stated beside the step's
    assert (float(rollout.group(1)) if rollout else 0.0) == pytest.approx(e.rollout_peak / M.GiB, abs=0.006), name
    assert e.fits(MT.parse_size(mem)), f"{name} does not fit the {mem} GPUs its header names"
    for word in ("accelerate_configs/",):
        for path in re.findall(rf"{word}\S+\.yaml", doc):
            assert (REPO / path).is_file(), path


def test_lora_recipes_are_lora():
    for name in ("llama8b_lora_fsdp", "llama70b_lora_zero3_offload"):
        recipe = resolve(name, [])
        assert recipe.lora and recipe.lora_r == 16
        e = M.recipe_estimate(recipe, 8, M.load_architecture(recipe.model))
        assert e.trained_parameters < e.num_parameters / 100


# ---------------------------------------------------------------- launcher configs


def test_there_are_launcher_configs_for_each_use():
    names = {p.name for p in CONFIGS}
    assert {"cpu_2proc.yaml", "multi_gpu_8.yaml", "multi_node_2x8.yaml", "ddp_8gpu.yaml", "fsdp_8gpu.yaml",
            "deepspeed_8gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_launcher_config_parses_and_says_what_it_is_for(path):
    text = path.read_text()
    assert text.startswith("# ") and len(text.splitlines()[0]) > 10, "first line must be a comment saying its use"
    cfg = yaml.safe_load(text)
    for key in ("compute_environment", "distributed_type", "num_processes", "num_machines"):
        assert key in cfg, key
    assert isinstance(cfg["num_processes"], int) and cfg["num_processes"] >= 1
    assert isinstance(cfg["num_machines"], int) and cfg["num_machines"] >= 1
    assert cfg["num_processes"] % cfg["num_machines"] == 0
    # the recipe decides the strategy: no launcher turns FSDP or DeepSpeed on
    assert cfg["distributed_type"] in ("MULTI_GPU", "MULTI_CPU", "NO")
    assert "fsdp_config" not in cfg and "deepspeed_config" not in cfg

    from accelerate.commands.config.config_args import ClusterConfig

    assert ClusterConfig.from_yaml_file(str(path)).num_processes == cfg["num_processes"]


def _launcher_env(path: Path) -> dict:
    """The environment `accelerate launch --config_file PATH` gives each process (without starting any)."""
    # private internals of the pinned accelerate (scripts/constraints.txt): an ImportError here means
    # an upgrade moved them, and this check must be ported rather than skipped
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "finetune/run.py"])
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


@functools.cache
def resolved(name: str) -> Recipe:
    """resolve(name, []) once per session: check_launcher only reads the recipe, and resolving the whole
    catalog again for each launcher config cost 13 CPU-seconds a config."""
    return resolve(name, [])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_launcher_config_agrees_with_every_recipe(path):
    env = _launcher_env(path)
    for name in RECIPES:
        check_launcher(resolved(name), env)


def test_slurm_script_is_valid_bash_and_resumes():
    import subprocess

    script = REPO / "scripts" / "slurm_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "--resume auto" in text and "--machine_rank" in text and "#SBATCH --requeue" in text


def test_grpo_recipes_score_gsm8k(monkeypatch):
    """The 8B GRPO recipes' reward functions: the math check gets GSM8K's final answer (after '####'),
    the format reward a \\boxed{} answer; each is named as recipe.json writes it and resolves back from it."""
    import importlib

    from finetune import rewards

    module = importlib.import_module("recipes.llama8b_grpo_zero3")
    seen = []
    monkeypatch.setattr(module, "math_answer", lambda completions, answer: seen.append(answer) or [1.0] * len(answer))
    assert module.gsm8k_answer(["a", "b"], ["Natalia sold 48/2 = 24 clips.\n#### 72", "#### 1,000"]) == [1.0, 1.0]
    assert seen == [["72", "1,000"]]
    assert module.boxed_format(["so $\\boxed{72}$", "72", "\\boxed{}"]) == [1.0, 0.0, 0.0]
    for name in ("llama8b_grpo_zero3", "llama8b_grpo_lora_fsdp"):
        recipe = resolve(name, [])
        assert recipe.objective == "grpo" and recipe.num_generations == 8 and recipe.beta == 0.0
        assert recipe.max_completion_len == 512 and recipe.datasets[0].columns == {"prompt": "question"}
        specs = [rewards.spec_name(f) for f in recipe.reward_funcs]
        assert specs == ["recipes.llama8b_grpo_zero3:gsm8k_answer", "recipes.llama8b_grpo_zero3:boxed_format"]
        assert rewards.resolve_all(specs)  # a resumed run's recipe.json names them importably
