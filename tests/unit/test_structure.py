"""The shape of the codebase, checked on its source: layers import only downwards, no module
imports one that imports it back, planning stays free of torch.distributed, and the repository
refers to nothing outside itself."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import re
import subprocess

import networkx as nx

from support import REPO

PACKAGE = REPO / "shardshift"

# Each layer may import itself and the layers listed after it (docs/architecture.md).
LAYERS = ["cli", "bench", "netemu", "elastic", "simulate", "train", "models", "reshard", "plots", "collectives", "comm", "base"]
BASE = {"layout", "units", "textfile", "files", "console", "launch", "runtime", "compat", "_exports", "__init__", "data"}
# What harnesses above may use of the layers they sit beside (never the other way round):
SIDEWAYS = {("bench", "netemu"), ("netemu", "collectives")}
# Pure planning: usable with no process group.
PURE = ["collectives/planning", "collectives/topology/model.py", "collectives/topology/io.py",
        "collectives/topology/spec.py", "collectives/topology/presets.py", "collectives/execution/program.py",
        "reshard/space.py", "reshard/plan.py", "reshard/schedule.py", "reshard/training.py", "layout.py", "units.py",
        "train/catalog.py", "models/spec.py", "models/gpt/spec.py", "models/gpt/config.py", "models/llama/spec.py",
        "models/llama/config.py", "elastic/config.py", "simulate/specs.py", "simulate/space.py",
        "simulate/cluster.py", "simulate/switch.py"]


def _module(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_imports(path) -> set[str]:
    """Every module name `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _imports(path) -> set[str]:
    """Every shardshift module `path` imports."""
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    return {name for name in _all_imports(path) if name in modules}


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        graph.add_node(_module(path))
        for target in _imports(path):
            graph.add_edge(_module(path), target)
    return graph


def _layer(module: str) -> str:
    top = module.split(".")[1] if "." in module else "__init__"
    return "cli" if top == "__main__" else "base" if top in BASE else top


def test_no_module_imports_one_that_imports_it_back():
    cycles = [c for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert cycles == [], cycles


def test_layers_import_only_downwards():
    wrong = []
    for src, dst in _graph().edges:
        a, b = _layer(src), _layer(dst)
        if a != b and (a, b) not in SIDEWAYS and LAYERS.index(b) < LAYERS.index(a):
            wrong.append((src, dst))
    assert wrong == [], wrong


def test_planning_does_not_touch_torch_distributed():
    for entry in PURE:
        paths = (PACKAGE / entry).rglob("*.py") if (PACKAGE / entry).is_dir() else [PACKAGE / entry]
        for path in paths:
            assert not any(name.startswith("torch.distributed") for name in _all_imports(path)), path


def test_the_repository_refers_to_nothing_outside_itself():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./shared|shared/(DESIGN|REFERENCE|STYLE)|\b(REFERENCE|DESIGN|STYLE)\.md")
    found = [f"{name}:{line}" for name in files if name.endswith((".py", ".md", ".toml", ".yaml", ".cfg"))
             for line, text in enumerate((REPO / name).read_text().splitlines(), 1) if outside.search(text)]
    assert found == [], found


def test_no_two_public_classes_or_functions_share_a_name():
    """A name means one thing across the package (two `Schedule`s or `execute`s read as one)."""
    defined: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(_module(path))
    allowed = {"register", "run", "main", "report", "run_rank"}  # entry points: one per command module
    clashes = {name: where for name, where in defined.items() if len(where) > 1 and name not in allowed}
    assert clashes == {}, clashes


def test_every_import_of_the_package_resolves():
    """Imports inside functions run only when their command does: check each names something."""
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardshift"):
                module = importlib.import_module(node.module)
                missing += [f"{_module(path)}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}")]
    assert missing == [], missing


def test_every_public_name_of_a_package_resolves():
    for init in itertools.chain([PACKAGE / "__init__.py"], PACKAGE.rglob("*/__init__.py")):
        package = importlib.import_module(_module(init))
        for name in getattr(package, "__all__", ()):
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"


def _is_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_every_package_says_what_it_offers():
    for init in itertools.chain([PACKAGE / "__init__.py"], PACKAGE.rglob("*/__init__.py")):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_no_two_test_modules_share_a_name():
    """Test folders have no __init__.py: pytest imports each test module by its file name, and a
    second module of the same name stops the whole suite's collection."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
