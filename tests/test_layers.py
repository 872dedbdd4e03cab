"""The package's layers (docs/architecture.md): every import points down or stays in its layer.

Read from the source with :mod:`ast`, imports inside functions included, so a lazy import that
points up fails here as surely as one at the top of a module.
"""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gradzip"

# lowest first; a module may import its own layer and every layer below it
LAYERS = [
    ("errors", "options", "config", "version"),
    ("kernels",),
    ("codecs",),
    ("comm",),
    ("sync",),
    ("policy",),
    ("frontends",),
    ("bench",),
    ("tools", "__main__"),
]


def layer_of(module: str) -> int:
    """The layer of ``gradzip.<first>...``; the package root (the public API: codecs, the engine,
    the front ends) sits between the front ends and the benchmarks and tools that use it."""
    parts = module.split(".")
    if len(parts) == 1:
        return 6.5
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: in no layer; add it to LAYERS and docs/architecture.md")


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    """(imported module, line) for every import of gradzip's own modules in ``path``."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "gradzip":
                continue
            if node.module is None or target == "gradzip":  # from . import a, b: each may be a module
                for alias in node.names:
                    candidate = f"{target}.{alias.name}"
                    yield (candidate if (SRC.parent / candidate.replace(".", "/")).exists()
                           or (SRC.parent / (candidate.replace(".", "/") + ".py")).exists() else target), node.lineno
            else:
                yield target, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradzip":
                    yield alias.name, node.lineno


MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    mine = layer_of(module_of(path))
    upward = [
        f"line {line}: {target} (layer {layer_of(target)} > {mine})"
        for target, line in imports(path)
        if layer_of(target) > mine
    ]
    assert not upward, f"{module_of(path)} imports a higher layer: " + "; ".join(upward)


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of(module_of(path))


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: a codec that imports the DDP front end is caught."""
    fake = SRC / "codecs" / "base.py"
    targets = [t for t, _ in imports(fake)]
    assert targets and all(layer_of(t) <= layer_of("gradzip.codecs") for t in targets)
    assert layer_of("gradzip.frontends.ddp") > layer_of("gradzip.codecs.base")
    assert layer_of("gradzip.sync.engine") > layer_of("gradzip.comm.sra") > layer_of("gradzip.kernels.fused")
