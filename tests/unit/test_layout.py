"""The layout's rules, checked on the source (docs/design.md §13): the arrows between packages run one way, there
is no import cycle, and the product packages stay in small modules."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("fthsdp", "ftar", "lighthouse")
PRODUCT = ("fthsdp/runtime", "fthsdp/catchup", "fthsdp/launch", "ftar", "lighthouse")
HARNESS = ("fthsdp.testing", "fthsdp.bench", "fthsdp.chaos")
"""The test harness and the tools built on it: the product (``PRODUCT``, the examples) never imports them."""
GENERATED = "lighthouse/v1"
MAX_LINES = 420
"""~400 lines, with a little slack for a docstring."""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """Project modules ``path`` imports, at any depth (a function-level import is still an arrow)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, name, known) for name, path in mods.items()}


def test_lighthouse_and_ftar_never_import_fthsdp() -> None:
    wrong = sorted(f"{a} -> {b}" for a, deps in _graph().items() if a.split(".")[0] in ("lighthouse", "ftar")
                   for b in deps if b.split(".")[0] == "fthsdp")
    assert not wrong, "imports that run back up into fthsdp:\n" + "\n".join(wrong)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_product_never_imports_the_harness() -> None:
    product = tuple(f.replace("/", ".") for f in PRODUCT) + ("fthsdp.examples",)
    wrong = sorted(f"{a} -> {b}" for a, deps in _graph().items() if _in(a, product) for b in deps if _in(b, HARNESS))
    assert not wrong, "product modules importing the test harness or the benchmarks:\n" + "\n".join(wrong)


def test_the_harness_never_imports_the_benchmarks() -> None:
    wrong = sorted(f"{a} -> {b}" for a, deps in _graph().items() if _in(a, ("fthsdp.testing",))
                   for b in deps if _in(b, ("fthsdp.bench", "fthsdp.chaos")))
    assert not wrong, "\n".join(wrong)


def test_the_command_and_the_launcher_never_import_torch() -> None:
    """``fthsdp lighthouse``, ``status`` and the launcher behind ``run``/``demo`` start in a fifth of a second, not the
    2.5 s of CPU that importing torch costs (every test's lighthouse process paid it)."""
    code = ("import sys, fthsdp.cli.main, fthsdp.launch.cluster, lighthouse.server.app; "
            "sys.exit('torch imported' if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_lighthouse_never_imports_ftar() -> None:
    wrong = sorted(f"{a} -> {b}" for a, deps in _graph().items() if a.startswith("lighthouse")
                   for b in deps if b.startswith("ftar"))
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle() -> None:
    # A package's __init__ importing its own submodules is not a cycle between modules: leave those arrows out.
    graph = {a: {b for b in deps if not (a != b and b.startswith(a + "."))} for a, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("folder", PRODUCT)
def test_product_modules_stay_small(folder: str) -> None:
    big = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
           if not str(p.relative_to(ROOT)).startswith(GENERATED) and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
