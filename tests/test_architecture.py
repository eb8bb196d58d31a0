"""The house plan of docs/architecture.md, checked on the code itself (ast only, nothing imported):
the arrows between packages, no import circle between modules, no module over the size limit,
and every module named on the architecture page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

#: What each package may import of the project (cli sits on top and may import all; bench and
#: studies sit under it: benchmarks, and the studies that train and adapt models per event).
ALLOWED = {
    "data_prep": {"data_prep"},
    "runtime": {"runtime", "data_prep"},
    "local_damage": {"local_damage", "runtime", "data_prep"},
    "app": {"app", "runtime", "data_prep"},
    "studies": {"studies", "app", "local_damage", "runtime", "data_prep"},
    "bench": {"bench", "app", "local_damage", "runtime", "data_prep"},
    "cli": {"cli", "bench", "studies", "app", "local_damage", "runtime", "data_prep"},
}
#: Single modules a package may import beyond ALLOWED: none.
ALSO: dict[str, tuple[str, ...]] = {}
#: Packages a scoring machine runs without PyTorch.
TORCH_FREE = ("data_prep", "runtime", "app")
MAX_LINES = 600


def modules() -> dict[str, Path]:
    out = {}
    for package in ALLOWED:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(path: Path, name: str) -> list[str]:
    """Every module ``path`` imports, at any depth (functions included), absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def project_edges(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (a name resolves to its longest module prefix)."""
    edges = set()
    for target in imports(path, name):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name and MODULES[target].name != "__init__.py":
            edges.add(target)
    return edges


def test_the_layout_is_found():
    assert {"runtime.contract", "app.scoring.scene", "cli.main", "data_prep.windows"} <= set(
        MODULES
    )


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_arrows(package):
    wrong = []
    for name, path in MODULES.items():
        if name.split(".")[0] != package:
            continue
        for target in imports(path, name):
            top = target.split(".")[0]
            also = any(target == m or target.startswith(m + ".") for m in ALSO.get(package, ()))
            if top in ALLOWED and top not in ALLOWED[package] and not also:
                wrong.append(f"{path.relative_to(REPO)} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", TORCH_FREE)
def test_serving_packages_never_import_torch(package):
    wrong = [
        f"{path.relative_to(REPO)} imports {target}"
        for name, path in MODULES.items()
        if name.split(".")[0] == package
        for target in imports(path, name)
        if target.split(".")[0] in ("torch", "torchvision", "segmentation_models_pytorch")
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    graph = {name: project_edges(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(circles)


def test_no_module_over_the_size_limit():
    lines = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in MODULES.values()}
    big = {str(p.relative_to(REPO)): n for p, n in lines.items() if n > MAX_LINES}
    assert not big, big


def test_every_module_is_on_the_architecture_page():
    """Each module is a row of the table under its own package's heading (### `pkg/sub/`)."""
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### `([\w/]+)/`[^\n]*\n(.*?)(?=^#)", page, flags=re.M | re.S))
    missing = [
        str(path.relative_to(REPO))
        for path in MODULES.values()
        if path.name != "__init__.py"
        and f"| `{path.name}` |" not in sections.get(str(path.parent.relative_to(REPO)), "")
    ]
    assert not missing, f"not in its package's table on docs/architecture.md: {missing}"


def test_commands_raise_errors_and_main_prints_them():
    """No command prints ``error: ...`` and returns 2 itself: it raises the project's error
    (``data_prep.errors.UsageError`` for options), which ``cli.main.main`` prints once."""
    printing = re.compile(r"print\(\s*f?[\"']error:")
    found = [
        str(path.relative_to(REPO))
        for path in MODULES.values()
        if path.parts[-2] in ("cli", "bench", "studies")
        and path.name != "main.py"
        and printing.search(path.read_text(encoding="utf-8"))
    ]
    assert not found, found


#: The most parameters a public function takes; more travel as an options object.
MAX_PARAMETERS = 8


def wide_functions() -> dict[str, int]:
    """Public functions (and methods) of the packages taking more than :data:`MAX_PARAMETERS`
    parameters (``self``/``cls`` not counted), by dotted name."""
    out = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("_"):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args]
            n = len(names) + len(a.kwonlyargs) - (names[:1] in (["self"], ["cls"]))
            if n > MAX_PARAMETERS:
                out[f"{name}.{node.name}"] = n
    return out


def test_no_public_function_over_the_parameter_limit():
    """No public function takes more than 8 parameters: more travel as an options object."""
    wide = wide_functions()
    assert not wide, f"more than {MAX_PARAMETERS} parameters (pass an options object): {wide}"
