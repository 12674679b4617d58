"""The library apart from the reproduction: ``softmoe`` never imports ``softmoe_repro``, which uses only the
library's public names; ``import softmoe`` stays light; both commands work through ``python -m softmoe``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import softmoe
import softmoe_repro

LIBRARY = Path(softmoe.__file__).parent
REPRODUCTION = Path(softmoe_repro.__file__).parent


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_the_library_never_imports_the_reproduction():
    offenders = [
        f"{path.relative_to(LIBRARY.parent)} imports {module}"
        for path in LIBRARY.rglob("*.py")
        for module, _ in imports(path)
        if module.split(".")[0] == "softmoe_repro"
    ]
    assert offenders == []


def test_the_reproduction_uses_only_public_library_names():
    private = [
        f"{path.name}: {module} {names}"
        for path in REPRODUCTION.rglob("*.py")
        for module, names in imports(path)
        if module.split(".")[0] == "softmoe"
        and (any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names))
    ]
    assert private == []


@pytest.mark.slow
def test_importing_every_library_module_loads_neither_the_reproduction_nor_matplotlib():
    code = (
        "import pkgutil, sys, softmoe\n"
        "light = not any(m.split('.')[0] in ('matplotlib', 'softmoe_repro') for m in sys.modules)\n"
        "for info in pkgutil.walk_packages(softmoe.__path__, 'softmoe.'):\n"
        "    if info.name != 'softmoe.__main__':\n"
        "        __import__(info.name)\n"
        "print(light, sorted({m.split('.')[0] for m in sys.modules} & {'softmoe_repro'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True []"


@pytest.mark.slow
def test_the_cli_offers_the_library_and_the_reproduction_commands():
    out = subprocess.run([sys.executable, "-m", "softmoe", "--help"], capture_output=True, text=True, check=True)
    for command in ("train", "evaluate", "reproduce", "report"):
        assert f"    {command}" in out.stdout
