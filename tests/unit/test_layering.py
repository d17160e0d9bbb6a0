"""The package layout of DESIGN.md, held by parsing every module's imports.

`server` and `agent` (and the mirror, the third role) share only `protocol`,
`config`, `pki` and the neutral helpers at the package root; the lower layers
import nothing above them; roles never import the CLI; production code never
imports `llmgw.testing`. Imports inside functions count as much as those at
the top: a lazy import still loads the module into the process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw

PACKAGE = Path(llmgw.__file__).parent

NEUTRAL = "(neutral)"  # modules at the package root: files, httpserve, webguard, runtime…
LOWER = {"protocol", "config", "pki", NEUTRAL}

# Which areas each area may import (its own is always allowed).
ALLOWED: dict[str, set[str]] = {
    NEUTRAL: set(),
    "protocol": {NEUTRAL},
    "config": {NEUTRAL},
    "pki": {NEUTRAL},
    "store": {"config", NEUTRAL},
    "agent": set(LOWER),
    "mirror": set(LOWER),
    "server": LOWER | {"store"},
    "up": LOWER | {"store", "server", "agent", "mirror"},
    # Runs on a node and reuses discovery, the engines' NCCL env and the installer's records.
    "doctor": LOWER | {"agent"},
    # `server init`: the steps that make a machine a control plane; it sets up a mirror beside it, names
    # llama.cpp archives as agents ask for them, and serves up's starter model (or its tiny one).
    "init": LOWER | {"store", "agent", "mirror", "up"},
    # `node add` / `node remove --purge`: over SSH, with init's agent.yaml, unit and join wait.
    "onboard": LOWER | {"init"},
    "cli": LOWER | {"store", "server", "agent", "mirror", "up", "doctor", "init", "onboard"},
    "testing": LOWER | {"store", "server", "agent", "mirror", "up"},
}


def _area(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return NEUTRAL  # `from llmgw import __version__`
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return NEUTRAL


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((".".join(parts), path))
    return found


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
    return [(line, target) for line, target in out if target == "llmgw" or target.startswith("llmgw.")]


def test_every_area_of_the_package_has_a_place_in_the_layering_table():
    areas = {_area(module) for module, _ in _modules()}
    missing = sorted(areas - set(ALLOWED))
    assert not missing, (
        f"new areas {missing}: add each to ALLOWED in this test with the areas it may import, "
        "following DESIGN.md's package layout"
    )


def test_no_module_imports_an_area_above_or_beside_its_own():
    broken = []
    for module, path in _modules():
        source = _area(module)
        allowed = ALLOWED.get(source, set()) | {source}
        for line, target in _imports(module, path):
            if _area(target) not in allowed:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source}) imports {target}")
    assert not broken, "imports that break DESIGN.md's layering:\n" + "\n".join(broken)


def test_production_code_never_imports_the_testing_helpers():
    broken = []
    for module, path in _modules():
        if _area(module) == "testing":
            continue
        for line, target in _imports(module, path):
            if target == "llmgw.testing" or target.startswith("llmgw.testing."):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not broken, "production code importing llmgw.testing:\n" + "\n".join(broken)


def test_the_layering_check_sees_relative_and_lazy_imports():
    # A check that cannot fail protects nothing: prove it parses the forms it must catch.
    sample = PACKAGE / "cli" / "main.py"
    found = _imports("llmgw.cli.main", sample)
    assert found, "the CLI's entry point imports llmgw modules; the parser found none"
