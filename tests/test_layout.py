"""The package's layout: the engine (``bcg_diffusion.core``) imports nothing above it, every other layer
imports only its own or deeper ones, and nothing imports in a cycle. Read from the sources (``ast``), so a
planted upward import fails here whether or not anything runs it."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

import bcg_diffusion

ROOT = Path(bcg_diffusion.__file__).parent
PACKAGE = "bcg_diffusion"

# Layers, from the top: a module may import modules of its own layer or deeper ones, never shallower.
# The demo and the model builders use the library as a user does; the public entry (api, config, state,
# group, warmup) descends into the features and adapters, they into the patches, and those into the core.
LAYERS = (
    ("demo", ("bcg_diffusion.demo",)),
    ("entry", ("bcg_diffusion", "bcg_diffusion.api", "bcg_diffusion.config", "bcg_diffusion.state",
               "bcg_diffusion.group", "bcg_diffusion.warmup")),
    ("features and adapters", ("bcg_diffusion.features", "bcg_diffusion.pipelines")),
    ("patches", ("bcg_diffusion.patches",)),
    ("kernels", ("bcg_diffusion.kernels",)),
    ("core", ("bcg_diffusion.core",)),
    ("models", ("bcg_diffusion.models",)),
)  # fmt: skip


def _layer(module: str) -> int:
    """The index in ``LAYERS`` of ``module`` (the longest matching prefix)."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py")
    return found


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, root: Path = ROOT, type_checking: bool = False) -> set[str]:
    """Modules of the package that ``path`` imports, at any depth; those under ``if TYPE_CHECKING:`` only
    with ``type_checking``."""
    tree = ast.parse(path.read_text())
    module = _module_name(path, root)
    parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            return
        if isinstance(node, ast.ImportFrom):
            base = parent
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            name = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            if name.startswith(PACKAGE):
                if node.module is not None:  # ``from . import x`` imports x, not the package again
                    found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(PACKAGE))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(path, root): path for path in root.rglob("*.py")}


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a shallower layer than the importing module's, as ``importer -> imported``; the
    core's imports under ``TYPE_CHECKING`` count too."""
    known = modules(root)
    found = []
    for name, path in sorted(known.items()):
        layer = _layer(name)
        core = LAYERS[layer][0] == "core"
        for other in sorted(imports(path, root, type_checking=core)):
            if other in known and other != name and _layer(other) < layer:
                found.append(f"{name} -> {other}")
    return found


def cycles(root: Path = ROOT) -> list[str]:
    """An import cycle at run time (outside ``TYPE_CHECKING``), as ``a -> b -> a``, or nothing."""
    known = modules(root)
    graph = {name: {m for m in imports(path, root) if m in known and m != name} for name, path in known.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1 and not found:
                found.append(" -> ".join(stack[stack.index(other) :] + [other]))
            if other not in state:
                visit(other)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return found


def test_each_layer_imports_only_its_own_or_deeper_ones():
    assert upward_imports() == []


def test_the_package_has_no_import_cycle():
    assert cycles() == []


def test_the_top_level_holds_the_public_entry_and_the_subpackages():
    top = sorted(path.stem for path in ROOT.glob("*.py"))
    assert top == ["__init__", "api", "components", "config", "group", "state", "warmup"], top
    assert len(top) <= 10


@pytest.fixture
def copy_of_the_package(tmp_path):
    """The package's sources in a temporary folder, to plant imports in."""
    target = tmp_path / PACKAGE
    for path in ROOT.rglob("*.py"):
        destination = target / path.relative_to(ROOT)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(path.read_text())
    return target


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("core/runner.py", "from ..features import FEATURES\n"),
        (
            "core/graphs.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..group import GraphGroup\n",
        ),
        ("patches/scoped.py", "from ..pipelines import adapter_for\n"),
        ("features/quantization.py", "from ..api import accelerate\n"),
    ],
)
def test_a_planted_upward_import_is_found(copy_of_the_package, where, line):
    path = copy_of_the_package / where
    path.write_text(path.read_text() + "\n" + textwrap.dedent(line))
    assert len(upward_imports(copy_of_the_package)) == 1


def test_a_planted_cycle_is_found(copy_of_the_package):
    path = copy_of_the_package / "core" / "tree.py"
    path.write_text(path.read_text() + "\nfrom .runner import GraphRunner\n")
    assert cycles(copy_of_the_package)
