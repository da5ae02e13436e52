"""The wings (``integrations/``, ``compat/``) reach the core through the names it exports for them.

A wing imports ``subquad`` itself (the public names), its own package's modules, and of the core's
private modules only ``subquad._for_wings``, which lists what the core owes its wings. Checked on
the source (every import statement, inside functions too), as ``tests/test_architecture.py``
checks the layers.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, List, Tuple

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "subquad"
WINGS = ("integrations", "compat")
EXPORTED = "subquad._for_wings"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
    """``(line, module)`` for every module an import statement of ``path`` names (``from x import y``:
    ``x.y`` where ``y`` is a module, else ``x``), relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                yield node.lineno, sub if is_module else source


def _offence(wing: str, target: str) -> bool:
    """Whether a module of ``subquad.<wing>`` may not import ``target``: a private module of
    subquad's (a name part starting with ``_``) outside the wing's own package, other than the
    exported names."""
    if not target.startswith("subquad.") or target == EXPORTED:
        return False
    if target == f"subquad.{wing}" or target.startswith(f"subquad.{wing}."):
        return False  # the wing's own modules, private ones included (comfyui/_which -> comfyui/_nodes)
    return any(part.startswith("_") for part in target.split(".")[1:])


def _wing_modules() -> List[Tuple[str, pathlib.Path]]:
    return [(wing, path) for wing in WINGS for path in sorted((PACKAGE / wing).rglob("*.py"))]


def test_there_are_wings_to_check():
    names = {_module_name(path) for _, path in _wing_modules()}
    assert {"subquad.integrations.torch_varlen", "subquad.integrations.comfyui._which"} <= names
    assert "subquad.compat.flash_attn" in names and (PACKAGE / "_for_wings.py").exists()


def test_wings_import_no_private_core_module_but_the_exported_names():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for wing, path in _wing_modules()
        for line, target in _imported(path)
        if _offence(wing, target)
    ]
    assert not found, (
        "wings reach past the names the core exports for them (take them from subquad._for_wings, "
        "or from subquad itself where they are public):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "wing, target, offends",
    [
        ("integrations", "subquad._call", True),
        ("integrations", "subquad._backends.sdpa", True),
        ("compat", "subquad._errors", True),
        ("integrations", "subquad.compat.flash_attn._run", True),  # another wing's private module
        ("integrations", "subquad._for_wings", False),
        ("integrations", "subquad", False),
        ("integrations", "subquad.mods", False),
        ("integrations", "subquad.integrations.comfyui._nodes", False),
        ("compat", "subquad.compat.xformers.ops.fmha._api", False),
        ("compat", "torch._C", False),
    ],
)
def test_the_rule_itself(wing, target, offends):
    assert _offence(wing, target) is offends


def test_the_exported_names_are_listed_and_importable():
    import subquad._for_wings as exported

    assert len(set(exported.__all__)) == len(exported.__all__), "a name listed twice"
    missing = [n for n in exported.__all__ if not hasattr(exported, n)]
    assert not missing, missing
    tree = ast.parse((PACKAGE / "_for_wings.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    assert not defined, f"_for_wings defines {defined}: it only re-exports"
    doc = ast.get_docstring(tree) or ""
    unsaid = [n for n in exported.__all__ if f"``{n}``" not in doc]
    assert not unsaid, f"names the module docstring does not describe: {unsaid}"
