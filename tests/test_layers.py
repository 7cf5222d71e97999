"""The code reads as the architecture: one import root, one-way layers, no
cycles, torch only in gpu/ (docs/architecture.md, "Layers").

The import graph is read from the source with ``ast`` (every import, those
inside functions included), with module names from pyproject's mapping of
folders onto the ``infergate`` package.
"""

import ast
import gc
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Which layer a module is in, by the longest matching prefix.
LAYERS = {
    "infergate.base": "base",
    "infergate.policies": "policies",
    "infergate.gateway": "gateway",
    "infergate.dispatcher": "dispatcher",
    "infergate.gpu": "gpu",
    "infergate.loadtest": "tools",
    "infergate": "top",  # the command, `up` and the dev Redis: the composition root
}
# What each layer may import (besides itself and third-party packages).
ALLOWED = {
    "base": set(),
    "policies": {"base"},
    "gateway": {"base", "policies"},
    "dispatcher": {"base", "policies"},
    "gpu": {"base", "policies"},
    "tools": {"base", "policies"},
    "top": {"base", "policies", "gateway", "dispatcher", "gpu"},
}
HEAVY = ("torch", "transformers", "tokenizers", "accelerate", "gguf")
BARE_NAMES = ("gateway", "dispatcher", "gpu", "policies", "loadtest", "base", "cli", "tests")


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: ROOT / folder for pkg, folder in config["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of the distribution: its dotted name -> its file."""
    out: dict[str, Path] = {}
    dirs = package_dirs()
    for pkg, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            # A subfolder mapped on its own belongs to its own package.
            owner = max((p for p in dirs if name == p or name.startswith(p + ".")), key=len)
            if owner == pkg:
                out[name] = path
    return out


def parse(text: str, name: str = "<unknown>") -> ast.Module:
    """``ast.parse``, once more after a garbage collection on a SystemError.
    CPython 3.11 keeps the AST constructor's recursion count in the module's
    state: a parse nested inside another one fails the outer one with "AST
    constructor recursion depth mismatch". One comes from the garbage
    collector running during a parse and finalising an earlier test's failed
    asyncio task, whose logged traceback parses its source line for carets."""
    try:
        return ast.parse(text, name)
    except SystemError:
        gc.collect()
        return ast.parse(text, name)


def imports_of(path: Path, module: str) -> set[str]:
    tree = parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import mod` imports pkg.mod when it is a module.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> str | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name) for name, path in mods.items()}


def test_every_mapped_folder_is_found(graph: dict[str, set[str]]) -> None:
    for expected in (
        "infergate.main",
        "infergate.base.queue.store",
        "infergate.policies.loader",
        "infergate.gateway.service",
        "infergate.dispatcher.service",
        "infergate.gpu.worker",
        "infergate.loadtest.bench",
    ):
        assert expected in graph


def test_imports_go_one_way(graph: dict[str, set[str]]) -> None:
    known = set(graph)
    bad = []
    for module, targets in graph.items():
        mine = layer_of(module)
        assert mine is not None
        for target in targets:
            if target not in known:
                continue
            theirs = layer_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert bad == []


def test_nothing_imports_the_composition_root(graph: dict[str, set[str]]) -> None:
    top = {m for m in graph if layer_of(m) == "top"}
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if layer_of(module) != "top"
        for target in targets & top
    ]
    assert bad == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    edges = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    # A package's __init__ is imported by each of its modules: that is not a cycle.
    for module in edges:
        edges[module] = {t for t in edges[module] if not module.startswith(t + ".")}
    visiting: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append([*visiting[visiting.index(node) :], node])
            return
        visiting.append(node)
        for nxt in sorted(edges[node]):
            visit(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(edges):
        visit(node)
    assert cycles == []


def test_torch_and_transformers_only_in_gpu(graph: dict[str, set[str]]) -> None:
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[0] in HEAVY and layer_of(module) != "gpu"
    ]
    assert bad == []
    # ...and in gpu/ only by the modules that need them, so a simulated worker never loads them.
    for module in (
        "infergate.gpu.worker",
        "infergate.gpu.backend",
        "infergate.gpu.backends.simulated",
    ):
        assert not any(t.split(".")[0] in HEAVY for t in graph[module])


def test_no_bare_top_level_names(graph: dict[str, set[str]]) -> None:
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[0] in BARE_NAMES
    ]
    assert bad == []


def test_a_gateway_process_never_loads_torch_or_another_role() -> None:
    code = (
        "import sys, infergate.main, infergate.gateway.app, infergate.gateway.server;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}),"
        " sorted(m for m in sys.modules if m.startswith(('infergate.gpu', 'infergate.dispatcher'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"


def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        env={"PIP_NO_INPUT": "1", "PATH": "/usr/bin:/bin"},
    )
    (wheel,) = tmp_path.glob("infergate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"infergate"}
    # Everything a process needs at run time is in it: the Lua scripts, the
    # example policy, the typing marker.
    assert "infergate/base/queue/lua/take_pop.lua" in names
    assert "infergate/policies/example.yaml" in names
    assert "infergate/py.typed" in names
    # ...and nothing of the tests.
    assert not any(n.startswith("infergate/tests") or "/tests/" in n for n in names)


MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def test_one_concern_a_module_and_a_class() -> None:
    """A source module over 500 lines, or a class over 300, holds two
    concepts: split it along its seam (docs/architecture.md)."""
    too_big = []
    for folder in ("cli", "base", "policies", "gateway", "dispatcher", "gpu", "loadtest"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text("utf-8")
            where = path.relative_to(ROOT)
            if len(lines := text.splitlines()) > MAX_MODULE_LINES:
                too_big.append(f"{where}: {len(lines)} lines")
            for node in ast.walk(parse(text)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_CLASS_LINES:
                        too_big.append(f"{where}: class {node.name} is {size} lines")
    assert too_big == []
