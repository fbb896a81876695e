"""The README and docs/ kept honest: every recipe in recipes/ and every built-in reward is listed; every
fenced command that runs a recipe (`finetune train|plan|data`, `python finetune/run.py`, `accelerate
launch ... finetune/run.py`, `python -m finetune.plan|data`) names a recipe that exists and keys it
knows, with values they take (parsed, not run); no command carries a path of one machine; and the
README's own first recipes load, validate and dry-run as written."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import pytest
from shipped import shipped_recipes

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a path of one machine or one checkout: a user's clone has none of them
MACHINE_PATHS = re.compile(r"(?<![\w.])(/work/|/tmp/|/root/|/home/\w+/|/Users/\w+/)|\.worktrees?/")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def fenced_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line inside a fenced block of the page; a line ending in a backslash
    is joined with the next."""
    text = page.read_text()
    out = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", None
        for k, line in enumerate(block.group(1).splitlines()):
            if start is None:
                start = first + k
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append((start, pending + line))
            pending, start = "", None
    return out


def readme_recipes() -> dict[str, str]:
    """The recipes the README writes out (`# recipes/NAME.py` first), by name."""
    return {m.group(1): m.group(0) for block in FENCE.finditer((REPO / "README.md").read_text())
            for m in [re.match(r"# recipes/(\w+)\.py\n.*", block.group(1), re.S)] if m}


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """Each command of the page's fenced blocks that runs a recipe, as its words from the program on
    (`finetune ...`, `python ...`, `accelerate ...`), a prompt's `$ ` and a venv's `.venv/bin/` dropped."""
    found = []
    for number, line in fenced_lines(page):
        line = line.strip().removeprefix("$ ")
        for part in re.split(r"&&|\|\|?|;", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # a quote left open: prose, not a command
                continue
            if not words:
                continue
            words[0] = words[0].removeprefix(".venv/bin/")
            if words[0] in ("finetune", "python", "accelerate") and any(
                    w in ("finetune/run.py", "finetune.plan", "finetune.data") or w.startswith("finetune/run.py")
                    for w in words) or words[:2] in (["finetune", "train"], ["finetune", "plan"],
                                                     ["finetune", "data"]):
                found.append((number, words))
    return found


def recipe_and_overrides(words: list[str]) -> tuple[str, list[str]]:
    """The recipe a command runs and its key=value words."""
    if words[:2] == ["finetune", "train"]:
        from finetune.commands.cli import _launcher_options

        _, rest = _launcher_options(words[2:])
        name = next(w for w in rest if not w.startswith("-") and "=" not in w)
        return name, [w for w in rest if "=" in w and not w.startswith("-")]
    assert "--recipe" in words, words
    name = words[words.index("--recipe") + 1]
    return name, [w for w in words[words.index("--recipe") + 2:] if "=" in w and not w.startswith("-")]


ALL_COMMANDS = [pytest.param(page, number, words, id=f"{page.name}:{number}")
                for page in PAGES for number, words in commands(page)]


def test_the_pages_have_commands_to_check():
    assert len(ALL_COMMANDS) > 25 and {p.values[0].name for p in ALL_COMMANDS} >= {"README.md", "recipes.md", "rl.md"}


@pytest.mark.parametrize("page,number,words", ALL_COMMANDS)
def test_each_command_names_a_recipe_and_keys_that_exist(page, number, words):
    from finetune.recipe import apply_overrides, load_recipe_module

    name, overrides = recipe_and_overrides(words)
    where = f"{page.name} line {number}: {' '.join(words)}"
    ours = readme_recipes()
    if name in ours:  # the README's own, as a user saves it
        return
    assert name in shipped_recipes(), f"{where}: no recipe {name!r} in recipes/"
    apply_overrides(load_recipe_module(name), overrides)  # unknown keys and bad values raise RecipeError
    if "finetune/run.py" in words:  # the options run.py takes
        from finetune.commands.train import parse_args

        parse_args(words[words.index("finetune/run.py") + 1:])


def inline_commands(page: Path) -> list[str]:
    """Commands quoted in running text (`python bench/run.py --quick`, ...), outside fenced blocks."""
    text = FENCE.sub("", page.read_text())
    starts = ("python", "accelerate", "finetune", "bash", "PYTHONPATH=", ".venv/", "pip", "torchrun", "sbatch")
    return [span for span in re.findall(r"`([^`\n]+)`", text) if span.startswith(starts)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_command_carries_a_path_of_one_machine(page):
    bad = [f"{page.name} line {n}: {line}" for n, line in fenced_lines(page) if MACHINE_PATHS.search(line)]
    bad += [f"{page.name}: `{span}`" for span in inline_commands(page) if MACHINE_PATHS.search(span)]
    assert not bad, "\n".join(bad)


def test_every_recipe_is_listed():
    listed = (REPO / "docs" / "recipes.md").read_text()
    missing = [name for name in shipped_recipes() if f"`{name}`" not in listed]
    assert not missing, f"docs/recipes.md does not list {missing}"


def builtin_rewards() -> list[str]:
    """finetune.rewards' reward functions (their first argument is `completions`) and the factories and
    classes a recipe builds one from."""
    from finetune import rewards

    functions = [name for name, f in vars(rewards).items() if callable(f) and not name.startswith("_")
                 and getattr(f, "__module__", "") == rewards.__name__ and not inspect.isclass(f)
                 and list(inspect.signature(f).parameters)[:1] == ["completions"]]
    return sorted(functions) + ["exact_match_on", "regex_reward", "RewardModel"]


def test_every_builtin_reward_is_listed_in_the_rl_page_and_in_help():
    from finetune.recipe import FIELDS

    rewards = builtin_rewards()
    assert {"exact_match", "char_match", "answer_chars", "math_answer", "think_format"} <= set(rewards)
    page = (REPO / "docs" / "rl.md").read_text()
    assert not [r for r in rewards if f"`{r}" not in page], "docs/rl.md"
    help_text = FIELDS["reward_funcs"].metadata["help"]
    assert not [r for r in rewards if r not in help_text], f"reward_funcs' help: {help_text}"


def test_the_links_lead_to_pages_that_exist():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).is_file():
                broken.append(f"{page.name} -> {target}")
    assert not broken, broken


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_the_readme_is_a_front_door():
    """Read in about five minutes: the two commands, a check of the set-up, a first recipe per objective,
    what a GPU node's user types first, where to read more."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "bash scripts/setup.sh && .venv/bin/finetune train tiny --num_processes 2" in text
    assert "bash .ci/run" in text
    assert sorted(readme_recipes()) == ["my_distill", "my_dpo", "my_grpo", "my_kto", "my_sft"]
    check = readme_section("Check your set-up")
    assert "source .venv/bin/activate" in check and 'python -m pytest -m "not distributed"' in check
    gpu = readme_section("On a GPU node")
    launch = "accelerate launch --config_file accelerate_configs/multi_gpu_8.yaml finetune/run.py --recipe llama7b_zero3"
    assert (REPO / "accelerate_configs" / "multi_gpu_8.yaml").is_file()
    assert f"{launch}\n" in gpu and f"{launch} --resume auto\n" in gpu and "finetune train llama7b_zero3" in gpu
    objectives = readme_section("Where to read more").split("- Objectives, a page each:\n")[1].split("\n- ")[0]
    assert all(line.startswith("  - [") for line in objectives.strip("\n").splitlines()), objectives


# Where a page may write the launcher's own commands (`accelerate launch ... finetune/run.py`, `python
# finetune/run.py`, `python -m finetune.plan|data|export`) instead of the docs' idiom (`finetune train|plan|
# data|export`): recipes.md names them once, the README's "On a GPU node" shows them, layout.md maps the
# entry points, and the benchmark pages record the commands their harness ran.
OTHER_IDIOM = re.compile(r"accelerate launch [^`\n]*finetune/run\.py|python finetune/run\.py --recipe|"
                         r"python -m finetune\.(plan|data|export)\b")
NAMES_THE_LAUNCHER = {"recipes.md", "layout.md", "benchmarks.md", "benchmarks-throughput-3-rounds.md"}


def test_one_idiom_across_the_readme_and_docs():
    found = []
    for page in PAGES:
        if page.name in NAMES_THE_LAUNCHER:
            continue
        text = page.read_text()
        if page.name == "README.md":
            text = text.replace(readme_section("On a GPU node"), "")
        found += [f"{page.name}: {line.strip()}" for line in text.splitlines() if OTHER_IDIOM.search(line)]
    assert not found, "write these as finetune train|plan|data|export:\n" + "\n".join(found)
    named = (REPO / "docs" / "recipes.md").read_text()
    assert "accelerate launch --config_file" in named and "python -m finetune.plan|data|export" in named


@pytest.fixture
def readme_runs(tmp_path, monkeypatch):
    """A directory as the README's commands leave it, the working directory of the test: runs/tiny/final
    (the first command's model) and runs/my_sft/final (the SFT recipe's), which the README's preference
    and distillation recipes start from (the builtin tiny model's files stand in for both)."""
    import shutil

    from finetune.assets import tiny_model_dir

    for run in ("tiny", "my_sft"):
        shutil.copytree(tiny_model_dir(), tmp_path / "runs" / run / "final")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["my_sft", "my_dpo", "my_kto", "my_distill", "my_grpo"])
def test_the_readmes_recipes_load_validate_and_dry_run(name, readme_runs):
    """Each of the README's recipes, saved as a user saves it: at most ten lines of recipe below its
    imports (the GRPO one with its reward function), loaded and validated, and a dry run of it (the data
    prepared, the plan printed) as `finetune train NAME --dry-run` does, where the README's earlier
    commands left their runs."""
    from in_process import run_main

    from finetune.recipe import load_recipe_module, validate

    tmp_path = readme_runs
    source = readme_recipes()[name]
    body = [line for line in source.splitlines()[1:] if line.strip() and not line.startswith(("from ", "import "))]
    assert len(body) <= 10, body
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    recipe = load_recipe_module(str(path))
    validate(recipe)
    if recipe.objective == "grpo":
        [reward] = recipe.reward_funcs
        assert reward(completions=["abc", "", "abcdefgh"], answer=["abc", "abc", "ab"], prompts=["x"] * 3) == \
            [1.0, 0.25, 0.0]
    code, out, err = run_main(["--recipe", str(path), "--dry-run", f"output_dir={tmp_path / 'out'}"])
    assert code == 0, err
    assert f"{recipe.strategy} on 1 " in out and f"data dataset={recipe.dataset}: " in out
    assert recipe.eval_at_start, "a first recipe shows where its metrics start: eval_at_start=True (step 0)"


def test_the_readmes_preference_recipes_start_from_its_sft_run():
    """KTO and DPO on the untrained builtin model move every metric and answer noise ("he he he", issue 52):
    the README's start from its SFT recipe's final/, and the README, kto.md and preference-tuning.md say
    that they need a model that already answers."""
    from finetune.recipe import Recipe

    def recipe(name):
        scope = {}
        exec(readme_recipes()[name], scope)
        return scope["recipe"]

    sft = recipe("my_sft")
    assert sft.objective == "sft" and sft.model == Recipe().model
    for name in ("my_dpo", "my_kto"):
        assert recipe(name).model == f"{sft.output_dir}/final", name
    for page in ("README.md", "docs/kto.md", "docs/preference-tuning.md"):
        assert "a model that already answers" in " ".join((REPO / page).read_text().split()), page


def output_dir_of(words: list[str]) -> str | None:
    """Where a command that trains writes: its output_dir= word, else its recipe's; None for a command
    that does not train (plan, data, a dry run)."""
    from finetune.recipe import load_recipe_module

    trains = words[:2] == ["finetune", "train"] or "finetune/run.py" in words
    if not trains or "--dry-run" in words:
        return None
    name, overrides = recipe_and_overrides(words)
    given = [w.split("=", 1)[1] for w in overrides if w.startswith("output_dir=")]
    if given:
        return given[-1]
    return None if name in readme_recipes() else load_recipe_module(name).output_dir


def test_no_docs_command_trains_into_the_readmes_first_run():
    """The README's first command trains tiny into runs/tiny; a docs command that trains into it again
    fails after it ("output_dir=runs/tiny holds checkpoints: --resume auto or another output_dir"), so
    each has an output_dir of its own."""
    first = "bash scripts/setup.sh && .venv/bin/finetune train tiny --num_processes 2"
    into = [f"{page.name} line {number}: {' '.join(words)}" for page, number, words in
            ((p.values[0], p.values[1], p.values[2]) for p in ALL_COMMANDS)
            if output_dir_of(words) in ("runs/tiny", "runs/tiny/")]
    readme_first = [entry for entry in into if entry.startswith("README.md") and entry.endswith(
        "finetune train tiny --num_processes 2")]
    assert first in (REPO / "README.md").read_text() and len(readme_first) == 1, into
    assert [entry for entry in into if entry not in readme_first] == []
