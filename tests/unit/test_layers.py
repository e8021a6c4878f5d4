"""The import graph runs one way: a module imports only modules of lower layers (and its
own package's parts). A new module must be given its layer here, which is the map of the
code that docs/design.md draws."""

from __future__ import annotations

import ast
from pathlib import Path

import fluxora_webhooks

# Lowest first. A module may import modules of earlier layers only; within a package
# (embedded/, demo/, commands/) its parts may import each other's lower parts.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "_version",
        "errors",
        "queries",
        "pgarray",
        "logs",
        "gate",
        "host",
        "tracing",
        "waker",
        "egress",
        "terminal",
        "pgtypes",
    ),
    (
        "urlpolicy",
        "signing",
        "secretbox",
        "clientcerts",
        "migrations",
        "outbox",
        "metrics",
        "redis_connect",
    ),
    ("settings", "connector", "retry", "retention", "partitions"),
    ("httpclient",),
    ("delivery", "redis_gate", "inbox", "endpoints", "deadletters"),
    ("targets", "tokens", "telemetry", "tooling"),
    ("batch",),
    ("recording",),
    ("dispatcher", "ops", "deliveries"),
    ("api",),
    ("service", "demo"),
    ("worker", "supervisor"),
    ("embedded",),
    ("commands",),
    ("cli",),
    ("__main__", "fluxora_webhooks"),
)

ROOT = Path(fluxora_webhooks.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "fluxora_webhooks"


def _imports(path: Path) -> set[str]:
    """Project modules ``path`` imports, as names relative to the package."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "fluxora_webhooks":
        package = []
    found: set[str] = set()
    tree = ast.parse(path.read_text("utf-8"))
    # Imports for type checking only (`if TYPE_CHECKING:`) do not run: they may point up.
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:
                found.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "fluxora_webhooks."
        ):
            found.add(str(node.module).removeprefix("fluxora_webhooks."))
    found.discard(name)
    return found


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for rank, names in enumerate(LAYERS):
        if module in names or top in names:
            return rank
    raise AssertionError(f"{module} has no layer in tests/unit/test_layers.py: give it one")


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for target in _imports(path):
            top = module.split(".")[0]
            if target.split(".")[0] == top and (ROOT / top).is_dir():  # a package's parts
                continue
            if _layer(target) >= _layer(module) and module != "fluxora_webhooks":
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_command_imports_the_cli() -> None:
    for path in sorted((ROOT / "commands").glob("*.py")):
        assert "cli" not in {t.split(".")[-1] for t in _imports(path)}, path.name


def test_the_package_root_imports_only_what_it_exports() -> None:
    # The root is the public API, not a place where modules meet.
    assert _imports(ROOT / "__init__.py") <= {
        "_version",
        "errors",
        "outbox",
        "signing",
        "dispatcher",
        "settings",
    }
