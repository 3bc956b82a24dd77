"""The package's layering, read from the source: every import (lazy, function-local ones too)
goes from a package to the same or a lower layer, the layers are the ones docs/design.md draws,
there are no import circles, megatron_patches stays free of dcp, and the planning core stays free
of torch and megatron."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dcp", "megatron_patches", "tools", "pretrain")

# Lowest first: a package imports only from its own layer and the ones before it. A package is
# ``dcp.<sub>`` (a subpackage or a top module such as ``dcp.plan``), ``dcp`` itself (the lazy
# public names of dcp/__init__.py) or a top-level directory. docs/design.md draws this list.
LAYERS = [
    "megatron_patches",
    "dcp.plan",
    "dcp.mesh",
    "dcp.files",
    "dcp.schema",
    "dcp.console",
    "dcp.versions",
    "dcp.costmodel",
    "dcp.planning",
    "dcp.collectives",
    "dcp.attention",
    "dcp.model",
    "dcp.optim",
    "dcp.data",
    "dcp.observability",
    "dcp.weights",
    "dcp.checkpoint",
    "dcp.runtime",
    "dcp.step",
    "dcp.train",
    "dcp.bench",
    "dcp.integrations",
    "dcp",
    "tools",
    "pretrain",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _package(module: str) -> str:
    """The layer a module belongs to: ``dcp.<sub>`` inside dcp, else its top-level name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "dcp" else parts[0]


def _import_lines(path: Path, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``path`` imports (every ``import``, lazy ones too
    unless ``top_level_only``); ``if TYPE_CHECKING:`` blocks are skipped (they never run)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str]] = []

    def visit(nodes, depth: int) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import) and (depth == 0 or not top_level_only):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if depth == 0 or not top_level_only:
                    found.append((node.lineno, node.module))
                    found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
            inner = depth + isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(ast.iter_child_nodes(node), inner)

    visit(tree.body, 0)
    return found


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    return {m for _, m in _import_lines(path, top_level_only=top_level_only)}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_every_package_has_a_layer():
    missing = sorted({_package(name) for name in _modules()} - set(LAYERS))
    assert not missing, f"packages missing from LAYERS: {missing}"


def test_imports_go_down_the_layers():
    """Lazy imports count: a function-local import of a higher package is still a dependency."""
    modules = _modules()
    rank = {package: i for i, package in enumerate(LAYERS)}
    upward = []
    for name, path in sorted(modules.items()):
        for line, target in _import_lines(path):
            if target not in modules:
                continue
            src, dst = _package(name), _package(target)
            if rank.get(dst, -1) > rank.get(src, len(LAYERS)):  # unknown: the test above
                upward.append(f"{path.relative_to(REPO)}:{line}: {src} imports {target} ({dst})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(set(upward)))


def _diagram_packages() -> list[str]:
    """The package names of docs/design.md's 'Packages and their direction' diagram, top down."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("## Packages and their direction", 1)[1]
    diagram = section.split("```", 2)[1]
    names = []
    for line in diagram.splitlines():
        for path in re.findall(r"(?:^|, )([\w/]+(?:\.py|/))(?=,|\s|$)", line.split("  ")[0]):
            name = path.removesuffix("/").removesuffix(".py").removesuffix("/__init__")
            names.append(name.replace("/", "."))
    return names


def test_design_diagram_draws_the_layers():
    assert _diagram_packages() == LAYERS[::-1]


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


@pytest.mark.parametrize("package", ["dcp.plan", "dcp.mesh", "dcp.planning", "dcp.costmodel"])
def test_planning_core_loads_without_torch_or_megatron(package):
    """Module-level imports only: the Megatron baseline loads megatron's scheduler lazily."""
    for name, path in _modules().items():
        if name != package and not name.startswith(package + "."):
            continue
        heavy = sorted(
            m
            for m in _imports(path, top_level_only=True)
            if m.split(".")[0] in ("torch", "megatron") or m.startswith("dcp.runtime")
        )
        assert not heavy, f"{name} imports {heavy} at module level"


# Every function of torch.distributed that communicates; group creation and set-up are not here.
COLLECTIVES = frozenset(
    """all_reduce all_reduce_coalesced all_gather all_gather_coalesced all_gather_into_tensor
    all_gather_object all_to_all all_to_all_single barrier batch_isend_irecv broadcast
    broadcast_object_list gather gather_object irecv isend monitored_barrier recv
    recv_object_list reduce reduce_scatter reduce_scatter_tensor scatter scatter_object_list send
    send_object_list _all_gather_base _reduce_scatter_base""".split()
)
COLLECTIVES_HOME = "dcp.collectives"


def _direct_collectives(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every torch.distributed collective ``source`` calls or imports by
    name, whatever it called the module (``dist``, ``torch.distributed``, ``c10d``, ...)."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
            if node.module.startswith("torch.distributed"):
                found += [(node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
                aliases.update(
                    a.asname or a.name for a in node.names if a.name == "distributed_c10d"
                )
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            if ast.unparse(node.value) in aliases:
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_collectives_detector_sees_every_spelling():
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather_object\n"
        "dist.all_reduce(x)\ntorch.distributed.barrier()\nd2.broadcast(x, src=0)\n"
        "f = dist.gather\ndist.new_group([0, 1])\ndist.get_rank()\nother.all_reduce(x)\n"
    )
    assert _direct_collectives(source) == [
        (4, "all_gather_object"),
        (5, "all_reduce"),
        (6, "barrier"),
        (7, "broadcast"),
        (8, "gather"),
    ]


def test_collectives_go_through_their_one_home():
    """NCCL takes only CUDA tensors on the group's device: which device a collective's tensor
    lives on is decided in dcp/collectives.py alone, so no other dcp module talks to
    torch.distributed's collectives directly (megatron_patches, tools and pretrain are not dcp)."""
    direct = [
        f"{path.relative_to(REPO)}:{line}: torch.distributed.{name}"
        for module, path in sorted(_modules().items())
        if module.split(".")[0] == "dcp" and module != COLLECTIVES_HOME
        for line, name in _direct_collectives(path.read_text())
    ]
    assert not direct, "collectives outside dcp/collectives.py:\n" + "\n".join(direct)
