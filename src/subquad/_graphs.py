"""Predicates on traced aten graphs (``make_fx`` of a user callback), for :mod:`subquad._traced`:
the nodes that pass a tensor through unchanged; the soft cap ``c * tanh(score / c)`` and ALiBi
(:func:`alibi_of`, with the slopes the callback captures: :func:`captured_paths`, :func:`captured`),
the ``score_mod``s the native kernel's loops run themselves; and a ``mask_mod``'s formula as the
loops' band of diagonals (:func:`formula_band`).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import Tensor

PASS_THROUGH = {"aten.clone.default", "aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default"}
SAME_SHAPE = {"aten.view.default", "aten.reshape.default", "aten.expand.default", "aten._unsafe_view.default"}


def same_shape(node: Any, source: Any) -> bool:
    a, b = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    return isinstance(a, Tensor) and isinstance(b, Tensor) and tuple(a.shape) == tuple(b.shape)


def same_dtype(node: Any, source: Any) -> bool:
    a, b = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def softcap_of(score: Any, out: Any, dep: Set[Any]) -> Optional[float]:
    """``c`` where the graph is exactly ``c * tanh(score / c)`` (or ``tanh(score * (1 / c)) * c``)
    for a positive number ``c``, every step in the score's dtype and shape, nothing else reading
    the score; else None."""
    path = set()

    def strip(n: Any) -> Any:  # through clones, views and same-dtype copies
        path.add(n)
        while hasattr(n, "target") and str(n.target) in PASS_THROUGH | SAME_SHAPE | {"aten._to_copy.default"}:
            if not (same_dtype(n, n.args[0]) and same_shape(n, n.args[0])):
                return n
            n = n.args[0]
            path.add(n)
        return n

    def times(n: Any, target: str) -> Optional[Tuple[Any, float]]:
        """(node, c) where ``n`` is ``node <target> c`` for a number ``c`` (either order for ``mul``)."""
        if not hasattr(n, "target") or str(n.target) != target or n.kwargs or not same_dtype(n, score):
            return None
        for x, y in ((n.args[0], n.args[1]), (n.args[1], n.args[0]) if target == "aten.mul.Tensor" else (None, None)):
            if hasattr(x, "op") and isinstance(y, (int, float)) and not isinstance(y, bool):
                return x, float(y)
        return None

    outer = times(strip(out), "aten.mul.Tensor")
    if outer is None or outer[1] <= 0:
        return None
    c, tanh = outer[1], strip(outer[0])
    if str(getattr(tanh, "target", "")) != "aten.tanh.default" or not same_dtype(tanh, score):
        return None
    inner = strip(tanh.args[0])
    divided, multiplied = times(inner, "aten.div.Tensor"), times(inner, "aten.mul.Tensor")
    if divided is not None and divided[1] == c:
        src = divided[0]
    elif multiplied is not None and abs(multiplied[1] * c - 1.0) <= 1e-6:
        src = multiplied[0]
    else:
        return None
    if strip(src) is not score or dep - path:
        return None
    return c


# ------------------------------------------------------------------ ALiBi, from a score_mod's graph
class AlibiForm(NamedTuple):
    """A ``score_mod`` whose graph is ALiBi: ``score - slopes[h] * |q_idx - kv_idx + shift|`` or,
    ``signed``, ``score - slopes[h] * (q_idx - kv_idx + shift)`` (``score + slopes[h] * (kv_idx -
    q_idx)``: equal to ALiBi only where ``kv_idx <= q_idx + shift``, under a causal mask). ``where``:
    the steps from the callback to the captured 1-D tensor of slopes (:func:`captured`), so that
    the same code with other slopes finds its own."""

    where: Tuple[Tuple[str, Any], ...]
    shift: int
    signed: bool

    def on(self, fn: Any) -> Optional["Alibi"]:
        """The form with the slopes ``fn`` holds now; None where it holds no 1-D float tensor there."""
        t = captured(fn, self.where)
        if not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point():
            return None
        return Alibi(t, self.shift, self.signed)


class Alibi(NamedTuple):
    """A traced ALiBi with its slopes (:class:`AlibiForm`)."""

    slopes: Tensor
    shift: int
    signed: bool

    def describe(self) -> str:
        """What ``explain()`` says of the bias: its formula, the slopes and where the loops take it."""
        shown = ", ".join(f"{x:g}" for x in self.slopes.detach().flatten()[:8].tolist())
        slopes = f"slopes [{shown}{', ...' if self.slopes.numel() > 8 else ''}]"
        e = "q_idx - kv_idx" + (f" + {self.shift}" if self.shift > 0 else f" - {-self.shift}" if self.shift else "")
        if self.signed:
            return (
                f"-slopes[h] * ({e}): ALiBi with {slopes} where {e} >= 0, so under a causal mask "
                "the C++ loops evaluate it, other paths add it per tile"
            )
        return f"ALiBi's -slopes[h] * |{e}| with {slopes}: the C++ loops evaluate it, other paths add it per tile"


class _Lin(NamedTuple):
    """``a·q_idx + c·kv_idx + d``: integer arithmetic of the positions."""

    a: int
    c: int
    d: int


class _Prod(NamedTuple):
    """``coef · table[h] · dist`` where present: ``table`` a graph constant (indexed by the heads
    or not yet), ``dist`` ``|form|`` (``absolute``) or ``form``, converted to floats."""

    coef: float
    table: Optional[str] = None
    indexed: bool = False
    dist: Optional[Tuple[bool, _Lin]] = None


class _Score(NamedTuple):
    """The score plus ``terms``."""

    terms: Tuple[_Prod, ...] = ()


_WIDE = (torch.float32, torch.float64)  # products and conversions no coarser than the loops' float32


def alibi_of(fn: Any, graph: Any) -> Optional[AlibiForm]:
    """The ALiBi form of an additive ``score_mod``'s graph (``make_fx`` on the tile ``(score, b, h,
    q_idx, kv_idx)``): ``score`` plus exactly one term ``coef · slopes[h] · dist`` with ``slopes``
    a tensor ``fn`` captures (at one place only), ``dist`` ``|±(q_idx - kv_idx) + d|`` or
    ``±(q_idx - kv_idx) + d`` and the coefficient that makes it ALiBi's; every float product and
    conversion float32 or float64. Read from the graph only, never from numbers. Else None."""
    places = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(places) != 5:
        return None
    values: Dict[Any, Any] = {places[0]: _Score(), places[2]: "h", places[3]: _Lin(1, 0, 0)}
    values[places[4]] = _Lin(0, 1, 0)

    def value(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return [value(i) for i in a]
        return values.get(a) if hasattr(a, "op") else a

    for n in graph.graph.nodes:
        if n.op == "get_attr":
            const = getattr(graph, n.target, None)
            if isinstance(const, Tensor) and const.dim() == 1 and const.is_floating_point():
                values[n] = _Prod(1.0, table=n.target)
        elif n.op == "call_function":
            values[n] = _alibi_value(n, [value(a) for a in n.args])
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    if isinstance(out, (tuple, list)):
        out = out[0] if len(out) == 1 else None
    found = values.get(out)
    if not isinstance(found, _Score) or len(found.terms) != 1:
        return None
    term = found.terms[0]
    if term.table is None or not term.indexed or term.dist is None:
        return None
    absolute, (a, c, d) = term.dist
    if (a, c) not in ((1, -1), (-1, 1)):
        return None
    sign = 1 if absolute else a  # the term is coef · sign · slopes[h] · (q - kv + shift)
    if term.coef * sign != -1.0:
        return None
    paths = captured_paths(fn, getattr(graph, term.table))
    return AlibiForm(paths[0], d * a, not absolute) if len(paths) == 1 else None


def _alibi_value(n: Any, args: List[Any]) -> Any:
    """The symbolic value of one aten node of an ALiBi ``score_mod`` (:func:`alibi_of`), or None."""
    target, x = str(n.target).replace(".Scalar", ".Tensor"), args[0] if args else None
    target = "aten.rsub.Scalar" if target == "aten.rsub.Tensor" else target
    val = n.meta.get("val")
    if target in PASS_THROUGH or (target in SAME_SHAPE and same_shape(n, n.args[0])):
        return x
    if isinstance(x, _Score):  # the score's own chain: score + terms
        if target == "aten._to_copy.default" and same_dtype(n, n.args[0]):
            return x
        if target in ("aten.add.Tensor", "aten.sub.Tensor") and isinstance(args[1], _Prod) and not n.kwargs:
            term = args[1] if target == "aten.add.Tensor" else args[1]._replace(coef=-args[1].coef)
            return _Score(x.terms + (term,))
        return None
    if target == "aten.add.Tensor" and len(args) > 1 and isinstance(args[1], _Score) and not n.kwargs:
        return _Score(args[1].terms + (x,)) if isinstance(x, _Prod) else None
    if not isinstance(val, Tensor) or (val.is_floating_point() and val.dtype not in _WIDE):
        return None
    if target == "aten._to_copy.default":
        if isinstance(x, _Lin):
            return _Prod(1.0, dist=(False, x)) if val.is_floating_point() else x
        return x if isinstance(x, _Prod) else None
    if target == "aten.index.Tensor" and isinstance(x, _Prod) and x.table and not x.indexed and x.dist is None:
        return x._replace(indexed=True) if len(args[1]) == 1 and args[1][0] == "h" else None
    return _position_value(target, n.kwargs, args)


def _position_value(target: str, kwargs: Any, args: List[Any]) -> Any:
    """Integer arithmetic of the positions and products of the parts (:func:`_alibi_value`)."""
    x, y = (args + [None, None])[:2]
    if target == "aten.neg.default":
        if isinstance(x, _Lin):
            return _Lin(-x.a, -x.c, -x.d)
        return x._replace(coef=-x.coef) if isinstance(x, _Prod) else None
    if target == "aten.abs.default":
        return _Prod(1.0, dist=(True, x)) if isinstance(x, _Lin) else None
    if kwargs or target not in _ARITHMETIC:
        return None
    if target in ("aten.add.Tensor", "aten.sub.Tensor", "aten.rsub.Scalar"):
        x, y = (_Lin(0, 0, p) if isinstance(p, int) and not isinstance(p, bool) else p for p in (x, y))
        if not (isinstance(x, _Lin) and isinstance(y, _Lin)):
            return None
        x, y = (y, x) if target == "aten.rsub.Scalar" else (x, y)
        k = 1 if target == "aten.add.Tensor" else -1
        return _Lin(x.a + k * y.a, x.c + k * y.c, x.d + k * y.d)
    if target == "aten.div.Tensor":
        return x._replace(coef=x.coef / y) if isinstance(x, _Prod) and _number(y) and y != 0 else None
    return _product(x, y)


_ARITHMETIC = {"aten.add.Tensor", "aten.sub.Tensor", "aten.rsub.Scalar", "aten.mul.Tensor", "aten.div.Tensor"}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _product(x: Any, y: Any) -> Any:
    """``x * y`` of two parts: positions by an integer stay positions; otherwise one table and one
    distance at most between them."""
    if _number(x):
        x, y = y, x
    if isinstance(x, _Lin) and isinstance(y, int) and not isinstance(y, bool):
        return _Lin(x.a * y, x.c * y, x.d * y)
    x, y = (_Prod(1.0, dist=(False, p)) if isinstance(p, _Lin) else p for p in (x, y))
    if isinstance(x, _Prod) and _number(y):
        return x._replace(coef=x.coef * y)
    if not (isinstance(x, _Prod) and isinstance(y, _Prod)) or (x.table and y.table) or (x.dist and y.dist):
        return None
    table = x if x.table else y
    return _Prod(x.coef * y.coef, table.table, table.indexed, x.dist or y.dist)


# ------------------------------------------------------------------ where a graph's constant lies in the callback
def captured_paths(fn: Any, target: Tensor) -> List[Tuple[Tuple[str, Any], ...]]:
    """Every way from ``fn`` to the tensor ``target`` through what it captures (closure cells,
    defaults, the globals its code reads, a method's object, a partial's arguments, an object's
    attributes, items of small tuples, lists and dicts), four steps deep at most."""
    found: List[Tuple[Tuple[str, Any], ...]] = []

    def walk(x: Any, path: Tuple[Tuple[str, Any], ...]) -> None:
        if x is target:
            found.append(path)
        elif len(path) < 4 and not isinstance(x, Tensor):
            for step, child in _steps(x):
                walk(child, path + (step,))

    walk(fn, ())
    return found


def captured(fn: Any, path: Tuple[Tuple[str, Any], ...]) -> Any:
    """What ``fn`` holds at ``path`` (:func:`captured_paths`); None where it holds nothing there."""
    x = fn
    for step in path:
        x = dict(_steps(x)).get(step)
        if x is None:
            return None
    return x


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _steps(x: Any) -> Iterator[Tuple[Tuple[str, Any], Any]]:
    """Each thing ``x`` captures, with the step that names it."""
    if x is None or isinstance(x, (bool, int, float, str, type, types.ModuleType, Tensor)):
        return
    if inspect.isfunction(x):
        for i, cell in enumerate(x.__closure__ or ()):
            yield ("cell", i), _contents(cell)
        for i, d in enumerate(x.__defaults__ or ()):
            yield ("default", i), d
        for name in x.__code__.co_names:
            if name in x.__globals__:
                yield ("global", name), x.__globals__[name]
    elif inspect.ismethod(x):
        yield ("func", None), x.__func__
        yield ("self", None), x.__self__
    elif isinstance(x, functools.partial):
        yield ("func", None), x.func
        yield ("args", None), x.args
        yield ("keywords", None), x.keywords
    elif isinstance(x, (tuple, list)) and len(x) <= 16:
        yield from ((("item", i), v) for i, v in enumerate(x))
    elif isinstance(x, dict) and len(x) <= 16:
        yield from ((("key", k), v) for k, v in x.items() if isinstance(k, str))
    elif hasattr(x, "__dict__") and not callable(getattr(x, "__get__", None)):
        yield from ((("attr", k), v) for k, v in vars(x).items())


# ------------------------------------------------------------------ a mask_mod's formula as a band of diagonals
Band = Tuple[Optional[int], Optional[int]]


def formula_band(formula: Tuple[Any, ...]) -> Optional[Tuple[Band, List[Tuple[str, int]]]]:
    """A traced ``mask_mod``'s formula (:mod:`subquad._traced`: ``("ge0", (a, c, d))``, true where
    ``a·q_idx + c·kv_idx + d >= 0``, and ``"and"``, ``"or"``, ``"not"`` of formulas) as the band
    ``lo <= q_idx - kv_idx <= hi`` of its comparisons of ``q_idx - kv_idx`` with numbers (None:
    that side open) and the ranges of keys it intersects with the band: ``("prefix_lm", P)`` for
    ``(kv_idx < P) | (kv_idx <= q_idx)``, ``("key_padding", n)`` for ``kv_idx < n``. None for any
    other formula (another ``or``, a comparison of ``q_idx`` or ``kv_idx`` alone, one never true)."""
    lo: Optional[int] = None
    hi: Optional[int] = None
    ranged: List[Tuple[str, int]] = []
    for part in _conjuncts(formula):
        if part is not None and part[0] == "or":
            sides = sorted((_atom(part[1]), _atom(part[2])))
            if sides[0][0] != "keys" or sides[1] != ("lo", 0):
                return None
            ranged.append(("prefix_lm", max(sides[0][1], 0)))
            continue
        kind, n = _atom(part)
        if kind == "lo":
            lo = n if lo is None else max(lo, n)
        elif kind == "hi":
            hi = n if hi is None else min(hi, n)
        elif kind == "keys":
            ranged.append(("key_padding", max(n, 0)))
        elif kind != "true":
            return None
    return (lo, hi), ranged


def _conjuncts(f: Tuple[Any, ...]) -> List[Any]:
    """The parts of a formula's outer ``and`` (a negated comparison as its complement, De Morgan
    through ``not``); None for a part that is the negation of an ``and``."""
    if f[0] == "and":
        return _conjuncts(f[1]) + _conjuncts(f[2])
    if f[0] != "not":
        return [f]
    g = f[1]
    if g[0] == "ge0":  # not (e >= 0): -e - 1 >= 0 in integers
        a, c, d = g[1]
        return [("ge0", (-a, -c, -d - 1))]
    if g[0] == "not":
        return _conjuncts(g[1])
    return _conjuncts(("not", g[1])) + _conjuncts(("not", g[2])) if g[0] == "or" else [None]


def _atom(f: Any) -> Tuple[str, int]:
    """One comparison ``a·q + c·kv + d >= 0`` as ``("lo", n)`` (``q - kv >= n``), ``("hi", n)``
    (``q - kv <= n``), ``("keys", n)`` (``kv < n``), ``("true", 0)`` or ``("other", 0)``."""
    if f is None or f[0] != "ge0":
        return "other", 0
    a, c, d = f[1]
    if a == -c and a > 0:
        return "lo", -(d // a)  # q - kv >= ceil(-d / a)
    if a == -c and a < 0:
        return "hi", d // -a
    if a == 0 and c < 0:
        return "keys", d // -c + 1  # kv <= floor(d / -c)
    return ("true", 0) if a == c == 0 and d >= 0 else ("other", 0)
