"""One error tree: every exception llmgw defines derives from ``llmgw.errors.LlmgwError``.

Every module under llmgw/ is imported and each exception class it defines is
checked, so a new one cannot be added outside the tree, and no two share a name
(two unrelated ``ProvisionError`` classes once made callers catch both).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import llmgw
from llmgw.errors import LlmgwError

PACKAGE = Path(llmgw.__file__).parent

# Heavy test helpers (aiohttp servers, numpy, gguf): not imported; their classes
# are still checked from their source below.
NOT_IMPORTED = {"llmgw.testing.fake_engine", "llmgw.testing.tiny_model"}


def _walk() -> tuple[list[object], dict[str, str]]:
    modules: list[object] = []
    skipped: dict[str, str] = {}

    def onerror(name: str) -> None:
        skipped[name] = "its package could not be imported"

    for info in pkgutil.walk_packages(llmgw.__path__, "llmgw.", onerror=onerror):
        if info.name in NOT_IMPORTED or info.name.endswith(".__main__"):
            skipped[info.name] = "not imported (a heavy test helper, or a module that runs when imported)"
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError as exc:  # an optional dependency that is not installed here
            skipped[info.name] = f"{type(exc).__name__}: {exc}"
    return modules, skipped


MODULES, SKIPPED = _walk()


def _exception_classes() -> list[type[BaseException]]:
    found: dict[type[BaseException], None] = {}
    for mod in MODULES:
        for obj in vars(mod).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == mod.__name__
                and obj.__module__.startswith("llmgw")
            ):
                found[obj] = None
    return list(found)


def _source_classes(module: str) -> list[tuple[str, list[str]]]:
    """Classes defined in a module not imported here: (name, the base names as written)."""
    rel = Path(*module.split("."))
    path = PACKAGE.parent / rel.with_suffix(".py")
    if not path.exists():
        path = PACKAGE.parent / rel / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (node.name, [ast.unparse(b) for b in node.bases]) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
    ]


def test_the_walk_imports_the_package():
    names = {m.__name__ for m in MODULES}
    assert {
        "llmgw.errors",
        "llmgw.config",
        "llmgw.store",
        "llmgw.pki",
        "llmgw.protocol",
        "llmgw.agent.supervisor",
        "llmgw.mirror.fetcher",
        "llmgw.server.app",
    } <= names
    assert len(_exception_classes()) > 30, "the walk found almost no exception classes: it cannot protect anything"


def test_every_llmgw_exception_derives_from_llmgwerror():
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}({', '.join(b.__name__ for b in c.__bases__)})"
        for c in _exception_classes()
        if not issubclass(c, LlmgwError)
    )
    assert not outside, (
        "exceptions outside the tree; derive each from its area's base or llmgw.errors.LlmgwError "
        '(docs/development.md, "Errors"):\n' + "\n".join(outside)
    )


def test_no_two_llmgw_exceptions_share_a_name():
    by_name: dict[str, list[str]] = {}
    for c in _exception_classes():
        by_name.setdefault(c.__name__, []).append(c.__module__)
    twice = {name: sorted(mods) for name, mods in by_name.items() if len(mods) > 1}
    assert not twice, f"exception names defined more than once (one class per meaning): {twice}"


def test_the_modules_not_imported_define_no_exceptions_outside_the_tree():
    # A module skipped above is read instead: a class there that looks like an
    # exception (a builtin exception, an llmgw one, or a name ending in Error among
    # its bases) must derive from one of llmgw's, under a name not already taken.
    known = {c.__name__ for c in _exception_classes()} | {"LlmgwError"}
    builtin = {n for n, o in vars(builtins).items() if inspect.isclass(o) and issubclass(o, BaseException)}
    broken = []
    for module in sorted(SKIPPED):
        for name, bases in _source_classes(module):
            plain = [b.rsplit(".", 1)[-1] for b in bases]
            if not any(b in builtin or b in known or b.endswith(("Error", "Exception")) for b in plain):
                continue
            if not any(b in known for b in plain):
                broken.append(f"{module}.{name}({', '.join(bases)}): not under LlmgwError")
            if name in known:
                broken.append(f"{module}.{name}: the name is already an exception elsewhere in llmgw")
    assert not broken, "exceptions outside the tree in modules not imported:\n" + "\n".join(broken)


def test_the_root_module_imports_nothing_from_llmgw():
    tree = ast.parse((PACKAGE / "errors.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    named = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
    named += [n.module or "" for n in imports if isinstance(n, ast.ImportFrom) and not n.level]
    assert not [n for n in named if n == "llmgw" or n.startswith("llmgw.")]
    assert not [n for n in imports if isinstance(n, ast.ImportFrom) and n.level]
