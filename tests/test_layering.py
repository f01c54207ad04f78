"""The coordinator's layers, read from the imports (ast): the core — the service, its request
runs, router, cluster, configuration, served model, metrics and errors — speaks no HTTP and knows
no front door; the server takes from ``coordinator.api`` only the app assembly; no front door
borrows another module's private names; engine/config.py sits below engine.transfer; and no
package imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COORDINATOR = Path(__file__).resolve().parent.parent / "coordinator"
CORE = (
    "errors",
    "inference",
    "request_run",
    "router",
    "routing/cache_view",
    "routing/choice",
    "routing/config",
    "routing/worker_state",
    "routing/worker_view",
    "cluster",
    "pool/fleet",
    "pool/shared",
    "config/cluster",
    "config/loader",
    "config/schema",
    "config/keys",
    "served_model",
    "model_info",
    "metrics",
)
HTTP = ("coordinator.api", "fastapi", "starlette")


def _imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _module(node: ast.ImportFrom, path: Path) -> str:
    """The absolute name of a ``from X import ...`` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = path.relative_to(COORDINATOR.parent).with_suffix("").parts[: -node.level]
    return ".".join((*package, *([node.module] if node.module else [])))


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        else:
            module = _module(node, path)
            names.update([module, *(f"{module}.{alias.name}" for alias in node.names)])
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


@pytest.mark.parametrize("name", CORE)
def test_core_modules_speak_no_http(name):
    found = {m for m in imported_modules(COORDINATOR / f"{name}.py") if _under(m, HTTP)}
    assert not found, f"coordinator/{name}.py imports {sorted(found)}"


def test_server_takes_only_the_app_assembly_from_api():
    found = imported_modules(COORDINATOR / "server.py")
    api = {m for m in found if _under(m, ("coordinator.api",))}
    assert api <= {"coordinator.api.app", "coordinator.api.app.create_predict_app"}, api


@pytest.mark.parametrize(
    "path",
    sorted((COORDINATOR / "api").rglob("*.py")),
    ids=lambda p: str(p.relative_to(COORDINATOR / "api")),
)
def test_no_private_names_cross_modules(path):
    borrowed = [
        f"{_module(node, path)}.{alias.name}"
        for node in _imports(path)
        if isinstance(node, ast.ImportFrom) and _module(node, path).startswith("coordinator")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not borrowed, f"{path.name} imports private names {borrowed}"


def test_the_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from fastapi import Request\n")
    assert "fastapi.Request" in imported_modules(source)


# the packages from the bottom up: none imports from a layer above its own
LAYERS = (
    ("engine",),
    ("workers",),
    ("prefill_worker", "decode_worker"),
    ("elastic_worker",),
    ("coordinator",),
)


def _package_files(package: str) -> list[Path]:
    return sorted((COORDINATOR.parent / package).rglob("*.py"))


@pytest.mark.parametrize("level", range(len(LAYERS) - 1), ids=lambda i: "+".join(LAYERS[i]))
def test_no_package_imports_from_a_layer_above_its_own(level):
    above = tuple(p for layer in LAYERS[level + 1 :] for p in layer)
    found = {
        f"{path.relative_to(COORDINATOR.parent)}: {name}"
        for package in LAYERS[level]
        for path in _package_files(package)
        for name in imported_modules(path)
        if _under(name, above)
    }
    assert not found, sorted(found)


def test_the_two_roles_do_not_import_each_other():
    for role, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker")):
        found = {
            n for p in _package_files(role) for n in imported_modules(p) if _under(n, (other,))
        }
        assert not found, f"{role} imports {sorted(found)}"


def test_engine_config_sits_below_the_transports():
    """engine/config.py is read by every layer; engine.transfer takes its names from it."""
    config = COORDINATOR.parent / "engine" / "config.py"
    found = {m for m in imported_modules(config) if _under(m, ("engine.transfer",))}
    assert not found, f"engine/config.py imports {sorted(found)}"
