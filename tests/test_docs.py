"""The reference site documents every public name (docs/api/*.md, rendered by mkdocstrings).

Everything here reads the source with ``ast``: no optional dependency (JAX, diffusers,
transformers, even torch) is imported, as mkdocstrings does not import them either. A name is
public when its module's ``__all__`` lists it (without ``__all__``: the functions and classes the
module defines whose names do not start with an underscore). Each must have a docstring where it
is defined (a function, class or module docstring, or for a constant the string literal after its
assignment) and must be rendered by a ``::: path`` directive of the API pages: a directive for the
name itself, for a module that lists it, or for wherever the name is re-exported from.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DOCS = ROOT / "docs"
API = DOCS / "api"

MODULES = [
    "subquad",
    "subquad.mods",
    "subquad.jax",
    "subquad.distributed",
    "subquad.compat",
    "subquad.compat.flash_attn",
    "subquad.compat.flash_attn.bert_padding",
    "subquad.compat.flash_attn.flash_attn_interface",
    "subquad.compat.flash_attn.layers",
    "subquad.compat.flash_attn.layers.rotary",
    "subquad.compat.xformers",
    "subquad.compat.xformers.ops",
    "subquad.compat.xformers.ops.fmha",
    "subquad.compat.xformers.ops.fmha.attn_bias",
    "subquad.compat.sub_quadratic",
    "subquad.compat.memory_efficient_attention",
    "subquad.integrations",
    "subquad.integrations.diffusers",
    "subquad.integrations.transformers",
    "subquad.integrations.patch",
    "subquad.integrations.torch_varlen",
    "subquad.integrations.compile",
]


class Definition(NamedTuple):
    """Where a public name is defined: ``path`` (a dotted path) and its docstring (or None)."""

    path: str
    docstring: Optional[str]


def module_file(module: str) -> Optional[Path]:
    base = SRC.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def parse(module: str) -> ast.Module:
    path = module_file(module)
    assert path is not None, f"no source file for module {module}"
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def public_names(module: str) -> List[str]:
    tree = parse(module)
    for node in tree.body:
        if "__all__" in _assigned_names(node):
            return list(ast.literal_eval(node.value))
    return [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    ]


def _import_base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if module_file(module).name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _assigned_names(node: ast.stmt) -> List[str]:
    """The names an assignment binds as documentable attributes: ``A = ...``, ``A: T = ...``.

    Not ``A, B = ...``: mkdocstrings (griffe) documents no name bound by unpacking, so a public
    constant bound that way is reported as undefined and must get its own assignment and docstring.
    """
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _attribute_docstring(body: List[ast.stmt], index: int) -> Optional[str]:
    following = body[index + 1] if index + 1 < len(body) else None
    if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
        value = following.value.value
        return value if isinstance(value, str) else None
    return None


@lru_cache(maxsize=None)
def resolve(module: str, name: str) -> Definition:
    """Follow re-exports statically to the definition of ``module.name``."""
    tree = parse(module)
    for index, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return Definition(f"{module}.{name}", ast.get_docstring(node))
        if name in _assigned_names(node):
            return Definition(f"{module}.{name}", _attribute_docstring(tree.body, index))
    # Imports, also those inside functions (a package's lazy ``__getattr__``).
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = _import_base(module, node)
                    if module_file(f"{base}.{alias.name}") is not None:
                        return resolve_module(f"{base}.{alias.name}")
                    return resolve(base, alias.name)
    if module_file(f"{module}.{name}") is not None:  # a submodule the package imports lazily
        return resolve_module(f"{module}.{name}")
    raise AssertionError(f"{module}.{name} is listed as public but is not defined or imported in {module}")


def resolve_module(module: str) -> Definition:
    return Definition(module, ast.get_docstring(parse(module)))


def resolve_path(path: str) -> Definition:
    if module_file(path) is not None:
        return resolve_module(path)
    module, _, name = path.rpartition(".")
    return resolve(module, name)


class Directive(NamedTuple):
    page: str
    path: str
    members: Optional[List[str]]  # None: every public member of a module; []: the object alone


def directives() -> List[Directive]:
    found = []
    for page in sorted(API.glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            match = re.match(r"^:::\s+(\S+)\s*$", line)
            if not match:
                continue
            options = []
            for following in lines[i + 1 :]:
                if following.strip() and not following.startswith(" "):
                    break
                options.append(following.strip())
            members: Optional[List[str]] = None
            for option in options:
                value = re.match(r"^members:\s*(.*)$", option)
                if value:
                    text = value.group(1).strip()
                    members = [] if text in ("false", "[]", "") else [m.strip() for m in text.strip("[]").split(",")]
            found.append(Directive(page.name, match.group(1), members))
    return found


def rendered() -> Dict[str, str]:
    """The definitions that the API pages render, by path, with the page that renders each."""
    out: Dict[str, str] = {}
    for directive in directives():
        definition = resolve_path(directive.path)
        out.setdefault(definition.path, directive.page)
        if module_file(directive.path) is None:
            continue
        names = public_names(directive.path) if directive.members is None else directive.members
        for name in names:
            out.setdefault(resolve(directive.path, name).path, directive.page)
    return out


def all_public() -> List[Tuple[str, str]]:
    return [(module, name) for module in MODULES for name in public_names(module)]


def test_every_public_name_has_a_docstring():
    missing = []
    for module, name in all_public():
        definition = resolve(module, name)
        if not (definition.docstring or "").strip():
            missing.append(f"{module}.{name} (defined as {definition.path})")
    assert not missing, "public names without a docstring:\n  " + "\n  ".join(missing)


def test_every_public_name_is_in_the_api_reference():
    shown = rendered()
    missing = []
    for module in MODULES:
        if resolve_module(module).path not in shown:
            missing.append(f"module {module}: no '::: {module}' directive in docs/api/*.md")
        for name in public_names(module):
            definition = resolve(module, name)
            if definition.path not in shown:
                missing.append(
                    f"{module}.{name} (defined as {definition.path}): add '::: {module}.{name}' or a "
                    f"'::: {module}' directive that renders its members to docs/api/*.md"
                )
    assert not missing, "public names missing from the API reference:\n  " + "\n  ".join(missing)


def test_directives_point_at_documented_objects():
    unknown = []
    for directive in directives():
        try:
            resolve_path(directive.path)
        except AssertionError as e:
            unknown.append(f"docs/api/{directive.page}: ::: {directive.path}: {e}")
    assert not unknown, "\n".join(unknown)


def nav_pages() -> Set[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r"([\w./-]+\.md)\b", nav))


@pytest.mark.parametrize("pattern", ["*.md", "api/*.md", "benchmarks/README.md"])
def test_mkdocs_nav_lists_every_page(pattern):
    listed = nav_pages()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob(pattern))
    assert pages, f"no pages match docs/{pattern}"
    missing = [page for page in pages if page not in listed]
    assert not missing, f"docs pages missing from the nav of mkdocs.yml: {', '.join(missing)}"
