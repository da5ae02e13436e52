"""The layout (docs/architecture.md): one direction through the package.

Checked on the source, never on numbers: the import graph has no cycle and no arrow up the
layers but the documented lazy wing; no function imports subquad's own modules except to guard
an optional dependency (and says which); the face is thin and no module outgrows one job; and
``memory_budget`` goes down the layers instead of climbing back (``tools/budget_trace.py``).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import sys
from typing import Dict, List, Set, Tuple

import pytest

import _machine

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "subquad"
sys.path.insert(0, str(ROOT / "tools"))

# The layers, top to bottom (docs/architecture.md). A module may import modules of its own layer
# or of a layer below; anything else is an arrow up.
LAYERS: List[Tuple[str, ...]] = [
    ("subquad.__main__", "subquad._cli", "subquad.bench"),
    ("subquad.integrations", "subquad.compat", "subquad.distributed", "subquad.jax"),
    ("subquad",),  # the package face: __init__
    ("subquad._for_wings",),  # what the core exports for its wings
    ("subquad._api", "subquad._api_varlen", "subquad._calibrate"),
    ("subquad._compile",),
    ("subquad._call",),
    ("subquad._fast",),
    ("subquad._autograd",),
    ("subquad._engine",),
    ("subquad._buckets",),
    ("subquad._planner",),
    ("subquad._time_model",),
    ("subquad._backends",),
    ("subquad._native",),
    ("subquad._traced",),
    ("subquad._graphs",),
    ("subquad.mods", "subquad._alibi", "subquad._mask_combinators", "subquad._mask_base"),
    ("subquad._tiles",),
    ("subquad._callbacks",),
    ("subquad._validate",),
    ("subquad._options",),  # the call's options, one record from the face down
    ("subquad._inputs",),
    ("subquad._meters", "subquad._verdicts"),  # measurement shared by subquad bench and the wings
    ("subquad._budget",),
    ("subquad._errors", "subquad._requires", "subquad._probes", "subquad._settings"),
]

# The one deliberate arrow up: the package face's lazy attributes (``subquad.patch_sdpa``,
# ``subquad.distributed``, ``subquad.jax``, ...) import their wing when first used.
LAZY_WING = {"subquad"}

# Modules allowed over 600 lines, each for one job that needs it (said in its docstring); none now.
LONG_MODULES: Set[str] = set()

# The most lines a function may take, its docstring aside (nested functions count within their
# parent), and the functions allowed more, each named with why; prefer none.
FUNCTION_LINES = 80
LONG_FUNCTIONS: Set[str] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: Dict[str, pathlib.Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


class Import:
    def __init__(self, source: str, target: str, line: int, in_function: str, comment: str) -> None:
        self.source, self.target, self.line, self.in_function, self.comment = source, target, line, in_function, comment


def _imports() -> List[Import]:
    found = []
    for module, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        owner: Dict[int, str] = {}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    owner.setdefault(id(node), fn.name)
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    targets.append(sub if sub in MODULES else mod)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            comment = lines[node.lineno - 1].partition("#")[2].strip()
            for target in targets:
                if target in MODULES and target != module:
                    found.append(Import(module, target, node.lineno, owner.get(id(node), ""), comment))
    return found


IMPORTS = _imports()


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = collections.defaultdict(set)
    for imp in IMPORTS:
        if not imp.in_function:
            graph[imp.source].add(imp.target)
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_arrows_point_down_except_the_lazy_wing():
    up = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in IMPORTS
        if _layer(i.target) < _layer(i.source) and not (i.source in LAZY_WING and i.in_function)
    ]
    assert not up, "imports that point up the layers:\n" + "\n".join(up)


def test_function_local_imports_only_guard_optional_dependencies():
    local = [i for i in IMPORTS if i.in_function]
    for i in local:
        assert i.comment, f"{i.source}:{i.line} imports {i.target} inside {i.in_function}() without saying why"
    allowed = {(i.source, i.target) for i in local if i.source in LAZY_WING or "optional" in i.comment}
    stray = [
        f"{i.source}:{i.line} in {i.in_function}(): {i.target}  # {i.comment}"
        for i in local
        if (i.source, i.target) not in allowed
    ]
    assert not stray, "function-local imports of subquad's own modules:\n" + "\n".join(stray)


def test_the_face_is_thin_and_modules_hold_one_job():
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert lines["subquad._api"] <= 250, lines["subquad._api"]
    too_long = {m: n for m, n in lines.items() if n > 600 and m not in LONG_MODULES}
    assert not too_long, too_long
    for package in ("subquad", "subquad.distributed", "subquad.jax", "subquad._backends", "subquad.integrations"):
        tree = ast.parse(MODULES[package].read_text())
        defined = [
            n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name != "__getattr__"
        ]
        assert not defined, f"{package}/__init__.py defines {defined}: package faces re-export only"


def test_no_caller_reaches_past_the_backend_protocol():
    hits = [
        f"{m}:{n}"
        for m, p in MODULES.items()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "type: ignore[attr-defined]" in line and "BACKENDS" in line
    ]
    assert not hits, hits


@pytest.mark.parametrize(
    "name",
    [
        "forward",
        "forward, tiles",
        "causal forward+backward",
        "bool mask, matmul",
        "score_mod forward+backward",
        "explain",
        "torch.compile operator",
        "packed sequences forward+backward",
    ],
)
def test_memory_budget_goes_down_the_layers(name):
    """Issue 19's bound: at most 10 returns to a module the budget had left, the face entered at
    most twice (at 1765e92: 18 and 4 for the causal backward, 21 and 4 with a score_mod)."""
    import budget_trace

    fn = budget_trace.representative_calls()[name]
    fn()  # warm: traced callbacks and probes are cached
    with _machine.plans_once():  # under SUBQUAD_TEST_RECORD the recorder would plan each call again
        summary = budget_trace.summary(budget_trace.trace(fn))
    assert summary["returns"] <= 10, summary
    assert summary["entered"].get("subquad._api", 0) <= 2, summary


def test_the_planner_does_not_import_the_loops():
    # The C++ loops answer the planner through the dispatch layer (which backend goes first, and
    # what the time model needs to know of them): the planner never reaches into their module.
    reached = {i.target for i in IMPORTS if i.source == "subquad._planner"}
    assert "subquad._backends.segments" not in reached and "subquad._backends.calibration" not in reached, reached


def test_the_code_says_what_it_does_and_the_docs_what_was_measured():
    # Figures measured on one machine belong on a docs page with that machine and the command;
    # the code names no CPU or GPU model and no date (issue 57).
    pattern = re.compile(r"EPYC|Xeon|Ryzen|Graviton|Sapphire Rapids|\bH100\b|\bH200\b|\bA100\b|\b20\d\d-\d\d-\d\d\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.suffix in (".py", ".cpp")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


def _function_lines() -> Dict[str, int]:
    """Each function's lines without its docstring, by ``module.Class.function`` (nested ones
    also by their own name under their parent's)."""
    lines: Dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                if ast.get_docstring(child, clean=False) is not None:
                    doc = child.body[0]
                    n -= (doc.end_lineno or doc.lineno) - doc.lineno + 1
                lines[name] = max(n, lines.get(name, 0))  # a name defined twice (a property's setter)
                visit(child, name)
            else:
                visit(child, f"{prefix}.{child.name}" if isinstance(child, ast.ClassDef) else prefix)

    for module, path in MODULES.items():
        visit(ast.parse(path.read_text()), module)
    return lines


def test_functions_are_short():
    # A function over a screen names no steps: split it by the steps it takes (issue 57).
    lines = _function_lines()
    too_long = {f: n for f, n in sorted(lines.items()) if n > FUNCTION_LINES and f not in LONG_FUNCTIONS}
    assert not too_long, f"functions over {FUNCTION_LINES} lines, docstring aside: {too_long}"
    stale = sorted(f for f in LONG_FUNCTIONS if lines.get(f, 0) <= FUNCTION_LINES)
    assert not stale, f"no longer over {FUNCTION_LINES} lines (or gone), take them out of LONG_FUNCTIONS: {stale}"
