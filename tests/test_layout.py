"""The package's layout rules, read from the source with ast (no imports, well under a second):
its floors (no import from a higher one),
no import cycle between finetune's modules, counting imports made inside functions, no private
name (`_x`) imported from another finetune module, and no strategy name compared outside the
strategy package (finetune/strategy: the rest asks its objects)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"


def modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    """Dotted module name -> parsed source, for every .py file under root (a package's __init__ is
    the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported finetune module, names taken from it, line) for every import statement anywhere in the
    module: at the top, inside functions, inside `if` blocks."""
    package = name if name in known and any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from finetune import data`: the module finetune.data
                    found.append((sub, [], node.lineno))
                elif base in known:
                    found.append((base, [alias.name], node.lineno))
    return [(target, names, line) for target, names, line in found if target != name]


def graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    known = set(trees)
    return {name: {target for target, _, _ in imports(name, tree, known)} for name, tree in trees.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def private_imports(trees: dict[str, ast.Module]) -> list[str]:
    """`from finetune.x import _name` in another module, and `x._name` through a module imported as x."""
    known = set(trees)
    found = []
    for name, tree in trees.items():
        found += [f"{name}:{line} imports {target}.{n}" for target, names, line in imports(name, tree, known)
                  for n in names if n.startswith("_") and not n.startswith("__")]
        aliases = {}  # local name -> finetune module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in known:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != name and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


STRATEGY_NAMES = {"ddp", "fsdp", "hsdp", "zero", "zero1", "zero2", "zero3"}
STRATEGY_PACKAGE = "finetune.strategy"


def _names_a_strategy(node: ast.AST) -> bool:
    """A strategy name written out ("zero3"), a collection of them, or a `.strategy` attribute (a recipe's
    or a setup's strategy name)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in STRATEGY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_strategy(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "strategy"


def strategy_name_tests(trees: dict[str, ast.Module]) -> list[str]:
    """Comparisons of strategy names outside the strategy package: `x == "zero3"`, `x in ("zero2",
    "zero3")`, `r.strategy != ...`, `r.strategy.startswith("zero")`; a `match` on one."""
    found = []
    for name, tree in trees.items():
        if name == STRATEGY_PACKAGE or name.startswith(STRATEGY_PACKAGE + "."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(map(_names_a_strategy, [node.left, *node.comparators])):
                found.append((name, node.lineno, "compares a strategy name"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith") and _names_a_strategy(node.func.value)):
                found.append((name, node.lineno, f"tests a strategy name with {node.func.attr}"))
            elif isinstance(node, ast.Match) and _names_a_strategy(node.subject):
                found.append((name, node.lineno, "matches on a strategy name"))
    return [f"{name}:{line} {what}" for name, line, what in sorted(found)]


# Floors, lowest first: a module imports its own floor and those below, never one above. The ground floor
# is every other module (finetune/*.py, strategy/, data/); the top holds the command lines, the files
# launchers start, and chat.py (a run's outputs loaded for `finetune chat`, on top of checkpointing/).
FLOORS = {"finetune.checkpointing": 1, "finetune.training": 2, "finetune.commands": 3,
          "finetune.run": 3, "finetune.cli": 3, "finetune.chat": 3}
FLOOR_NAMES = {0: "the ground floor", 1: "checkpointing/", 2: "training/", 3: "the commands"}


def floor(module: str) -> int:
    return max((level for prefix, level in FLOORS.items()
                if module == prefix or module.startswith(prefix + ".")), default=0)


def upward_imports(trees: dict[str, ast.Module]) -> list[str]:
    """Imports of a module on a higher floor than the importer's (inside functions too)."""
    known = set(trees)
    return [f"{name}:{line} ({FLOOR_NAMES[floor(name)]}) imports {target} ({FLOOR_NAMES[floor(target)]})"
            for name, tree in trees.items() for target, _, line in imports(name, tree, known)
            if floor(target) > floor(name)]


def test_no_module_imports_one_on_a_higher_floor():
    found = upward_imports(modules())
    assert found == [], "imports that go up a floor (move the shared part down): " + "; ".join(found)


def test_the_floor_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / "finetune"
    for sub in ("training", "checkpointing", "commands"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def f():\n    from finetune.training import loop\n")
    (pkg / "training" / "loop.py").write_text("from finetune.checkpointing import checkpoint\nfrom finetune import model\n")
    (pkg / "checkpointing" / "checkpoint.py").write_text("from finetune.training.loop import x\n")
    (pkg / "commands" / "train.py").write_text("from finetune.training import loop\n")
    assert upward_imports(modules(pkg)) == [
        "finetune.checkpointing.checkpoint:1 (checkpointing/) imports finetune.training.loop (training/)",
        "finetune.model:2 (the ground floor) imports finetune.training.loop (training/)",
    ]

def test_no_strategy_name_compared_outside_the_strategy_package():
    found = strategy_name_tests(modules())
    assert found == [], ("strategy names compared outside finetune/strategy (ask the strategy object, "
                         "strategy_for(name) or Plan.strategy, instead): " + "; ".join(found))


LONGEST = 700  # lines a module may have without its docstring saying why it is longer


def long_modules(root: Path = PACKAGE) -> list[str]:
    """Modules over LONGEST lines whose docstring does not say why ("longer than 700 lines because ...")."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > LONGEST and f"longer than {LONGEST} lines because" not in (ast.get_docstring(ast.parse(text)) or ""):
            found.append(f"{path.relative_to(root.parent)} ({lines} lines)")
    return found


def test_no_module_over_700_lines_without_its_docstring_saying_why(tmp_path):
    found = long_modules()
    assert found == [], ("modules over 700 lines (split them along their seams, or say in the docstring why "
                         "they are one): " + "; ".join(found))
    pkg = tmp_path / "finetune"
    pkg.mkdir()
    (pkg / "long.py").write_text('"""A module."""\n' + "x = 1\n" * LONGEST)
    (pkg / "said.py").write_text(f'"""A spec, longer than {LONGEST} lines because it is one."""\n' + "x = 1\n" * LONGEST)
    assert long_modules(pkg) == [f"finetune/long.py ({LONGEST + 1} lines)"]


def test_no_import_cycle_counting_imports_inside_functions():
    found = cycles(graph(modules()))
    assert found == [], f"import cycles between finetune modules: {found}"


def test_no_private_name_imported_from_another_module():
    found = private_imports(modules())
    assert found == [], "private names imported across modules (make them public where they belong): " + "; ".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The two checks on a package made to break both rules, the way the code once did: a function-level
    import closing a cycle, and a private helper borrowed from another module."""
    pkg = tmp_path / "finetune"
    (pkg / "commands").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def load():\n    from finetune.export import _without_zero3_init\n")
    (pkg / "export.py").write_text("from finetune import model\n")
    (pkg / "samples.py").write_text("from finetune import export as E\nE._private()\n")
    (pkg / "plan.py").write_text("from finetune.strategy import strategy_for\n")
    (pkg / "strategy.py").write_text("def strategy_for(name):\n    return name\n")
    (pkg / "commands" / "plan.py").write_text("from finetune.plan import strategy_for\nfrom ..model import load\n")
    trees = modules(pkg)
    assert cycles(graph(trees)) == [["finetune.export", "finetune.model"]]
    assert private_imports(trees) == ["finetune.model:2 imports finetune.export._without_zero3_init",
                                      "finetune.samples:2 uses finetune.export._private"]
    assert graph(trees)["finetune.commands.plan"] == {"finetune.plan", "finetune.model"}


def test_the_strategy_name_check_finds_each_form(tmp_path):
    """Each way a strategy name was once tested outside the package (recipe.validate did all of these)
    is found; the same tests inside finetune/strategy, and names that are no comparison, are not."""
    pkg = tmp_path / "finetune"
    (pkg / "strategy").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "recipe.py").write_text(
        "def validate(r):\n"
        "    zero = r.strategy.startswith('zero')\n"
        "    if r.offload_params != 'none' and r.strategy not in ('zero3', 'fsdp'):\n"
        "        raise ValueError(f'strategy={r.strategy}')\n"
        "    if r.load_in_4bit and name == 'zero2':\n"
        "        pass\n"
        "    ok = s.strategy == own.strategy\n"
        "    match r.strategy:\n"
        "        case 'ddp':\n"
        "            pass\n"
        "CHOICES = ('ddp', 'fsdp')\n")
    (pkg / "strategy" / "__init__.py").write_text("def strategy_for(name):\n    return name == 'ddp'\n")
    (pkg / "strategy" / "zero.py").write_text("def f(r):\n    return r.strategy in ('zero1', 'zero2')\n")
    assert strategy_name_tests(modules(pkg)) == [
        "finetune.recipe:2 tests a strategy name with startswith",
        "finetune.recipe:3 compares a strategy name",
        "finetune.recipe:5 compares a strategy name",
        "finetune.recipe:7 compares a strategy name",
        "finetune.recipe:8 matches on a strategy name",
    ]
