"""The package's layering, read from the source: no import circles, megatron_patches stays free
of dcp, and the planning core stays free of torch and megatron."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dcp", "megatron_patches", "tools", "pretrain")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Modules ``path`` imports (every ``import``, lazy ones too unless ``top_level_only``);
    ``if TYPE_CHECKING:`` blocks are skipped (they never run)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes, depth: int) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import) and (depth == 0 or not top_level_only):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if depth == 0 or not top_level_only:
                    found.add(node.module)
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
            inner = depth + isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(ast.iter_child_nodes(node), inner)

    visit(tree.body, 0)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ importing its own submodules is not a layering edge.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not d.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                dfs(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)


def test_megatron_patches_import_nothing_from_dcp():
    for name, path in _modules().items():
        if name.startswith("megatron_patches"):
            bad = sorted(m for m in _imports(path) if m == "dcp" or m.startswith("dcp."))
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("package", ["dcp.plan", "dcp.planning", "dcp.costmodel"])
def test_planning_core_loads_without_torch_or_megatron(package):
    """Module-level imports only: the Megatron baseline loads megatron's scheduler lazily, and
    ``dcp.train.measure`` (which spawns ranks) is the one effectful module there."""
    for name, path in _modules().items():
        if name != package and not name.startswith(package + "."):
            continue
        if name == "dcp.train.measure":
            continue
        heavy = sorted(
            m
            for m in _imports(path, top_level_only=True)
            if m.split(".")[0] in ("torch", "megatron") or m.startswith("dcp.runtime")
        )
        assert not heavy, f"{name} imports {heavy} at module level"
