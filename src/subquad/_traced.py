"""What a user callback *is*, from its traced graph, and the rewrites that enables.

A ``score_mod`` or ``mask_mod`` is traced once with fake tensors (``make_fx``; no data flows) and
its aten graph read: ``score + bias`` (:class:`TracedScoreMod` with ``additive_bias``: a bias
tile on the fused kernel; ALiBi's slopes for the C++ loops), ``where(cond, score, -inf)``
(:class:`ScoreModAsMask`: a mask_mod, tiles skipped), a formula of comparisons of the positions
(:class:`TracedMask`: exact block states, the causal one as the causal flag), or anything else
(runs as is). :func:`normalize` applies those rewrites to a call's :class:`~subquad._inputs.Inputs`;
``explain()`` shows its notes. Results are cached per callback by :func:`callback_key` (code and
what it captures), which the compiled backend also uses.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import threading
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar, cast

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from . import mods
from ._callbacks import EMPTY, FULL, PARTIAL
from ._graphs import PASS_THROUGH, SAME_SHAPE, AlibiForm, alibi_of, same_dtype, same_shape, softcap_of
from ._inputs import Inputs, MaskMod


# ------------------------------------------------------------------ what a score_mod is, from its structure
@dataclass(frozen=True)
class Structure:
    """What a traced ``score_mod`` does to the score.

    ``kind``: ``"additive"`` (``score + bias(b, h, q, kv)``, where ``bias`` may be ``-inf``:
    ``masks``), ``"mask"`` (``where(cond(b, h, q, kv), score, -inf)``), ``"identity"`` or
    ``"general"`` (anything else; ``reason`` says why). ``softcap``: for a general one that is
    exactly ``c * tanh(score / c)`` with a number ``c`` (Gemma 2's soft cap), ``c``; ``alibi``: for
    an additive one that is ALiBi of slopes it captures, its form; the native kernel's loops run
    both themselves.
    """

    kind: str
    masks: bool = False
    reason: str = ""
    softcap: Optional[float] = None
    alibi: Optional[AlibiForm] = None


_T = TypeVar("_T")
# A Structure or a MaskStructure (by the key's kind), with weak references to what the key names.
_STRUCTURES: "collections.OrderedDict[Any, Tuple[object, List[weakref.ref]]]" = collections.OrderedDict()
_STRUCTURE_CACHE_SIZE = 256
_STRUCTURE_LOCK = threading.Lock()


def per_callback(
    kind: str, fn: Callable[..., Any], dtype: torch.dtype, device: torch.device, trace: Callable[[], _T]
) -> _T:
    """``trace()``, computed once per callback ``fn`` (by its code and what it captures), ``kind``,
    dtype and device type, and cached while what it captures lives."""
    refs: List[weakref.ref] = []
    key = callback_key(fn, refs, 0)
    if key is not None:
        key = (kind, key, dtype, device.type)
        with _STRUCTURE_LOCK:
            hit = _STRUCTURES.get(key)
            if hit is not None and all(r() is not None for r in hit[1]):
                _STRUCTURES.move_to_end(key)
                return cast(_T, hit[0])  # the key holds ``kind``: what this kind's trace() made
    found = trace()
    if key is not None:
        with _STRUCTURE_LOCK:
            _STRUCTURES[key] = (found, refs)
            while len(_STRUCTURES) > _STRUCTURE_CACHE_SIZE:
                _STRUCTURES.popitem(last=False)
    return found


def score_mod_structure(fn: Callable[..., Tensor], dtype: torch.dtype, device: torch.device) -> Structure:
    """Classify ``fn`` from the graph it traces to, never from numbers it returns.

    The callback is traced once on a small tile of fake tensors (``make_fx``, fake mode): data
    never flows, so a check such as ``score.clamp(max=50)`` cannot pass for additive on random
    scores, and Python control flow on tensor values makes the trace fail (the callback is then
    ``"general"`` and runs as is). The result is cached per callback (by its code and what it
    captures, tensors by dtype and rank).
    """
    return per_callback("score", fn, dtype, device, lambda: _trace_structure(fn, dtype, device))


def callback_key(x: Any, refs: List[weakref.ref], depth: int = 0, values: bool = False) -> Any:
    """A hashable key for what decides a callback's structure; ``None`` when there is none.

    Functions by code, closure, defaults and the globals they read; tensors by dtype and rank (a
    new tensor of the same kind traces the same way) or, with ``values``, by identity and version
    (what a mask computed from them depends on); other objects by identity, checked alive through
    a weak reference (an ``id`` may be reused after an object dies), and with ``values`` by the
    tensors among their attributes too.
    """
    if depth > 4:
        return None
    if x is None or isinstance(x, (bool, int, float, str, complex, torch.dtype, torch.device)):
        return (type(x), x)
    if isinstance(x, Tensor):
        if values:
            refs.append(weakref.ref(x))
            return ("tensor", id(x), x._version)
        return ("tensor", x.dtype, x.dim(), x.device.type)
    if isinstance(x, types.ModuleType):
        return ("module", x.__name__)

    def sub(y: Any) -> Any:
        return callback_key(y, refs, depth + 1, values)

    if isinstance(x, (TracedScoreMod, ScoreModAsMask, TracedMask)):
        inner = sub(x.fn)  # subquad's wrappers, made anew for every call: what they wrap
        return None if inner is None else ("wrapped", type(x).__name__, inner)
    if isinstance(x, (tuple, list)) and len(x) <= 16:
        items = tuple(sub(i) for i in x)
        return None if any(i is None for i in items) else (type(x), items)
    if inspect.ismethod(x):
        func, owner = sub(x.__func__), sub(x.__self__)
        return None if func is None or owner is None else ("method", func, owner)
    if isinstance(x, functools.partial):
        parts = (sub(x.func), sub(x.args), sub(tuple(sorted(x.keywords.items()))))
        return None if any(p is None for p in parts) else ("partial", parts)
    if inspect.isfunction(x):
        cells = tuple(sub(c.cell_contents) if _cell_full(c) else ("empty",) for c in x.__closure__ or ())
        defaults = sub(tuple(x.__defaults__ or ()))
        read = tuple((n, sub(x.__globals__[n])) for n in x.__code__.co_names if n in x.__globals__)
        parts = (*cells, defaults, *(k for _, k in read))
        return None if any(p is None for p in parts) else ("function", x.__code__, cells, defaults, read)
    try:
        refs.append(weakref.ref(x))
    except TypeError:
        return None  # cannot tell whether a later object with this id is the same one
    if values and hasattr(x, "__dict__"):
        attrs = tuple((n, sub(a)) for n, a in sorted(vars(x).items()) if isinstance(a, (Tensor, int, float, bool)))
        if any(k is None for _, k in attrs):
            return None
        return ("object", type(x), id(x), attrs)
    return ("object", type(x), id(x))


def value_key(x: Any, refs: List[weakref.ref], depth: int = 0) -> Any:
    """Like the structure key, but tensors count by identity and version: for what their values decide."""
    return callback_key(x, refs, depth, values=True)


def _cell_full(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # an empty cell raises
    except ValueError:
        return False
    return True


def _trace_on_tile(fn: Callable[..., Tensor], device: torch.device, score_dtype: Optional[torch.dtype]) -> Any:
    """Trace ``fn`` with fake tensors on a (1, 2, 3, 4) tile: (score,) b, h, q_idx, kv_idx.

    The tile's dimensions are all distinct, so that no broadcast hides one. Raises whatever
    tracing raises; callers fall back to evaluating the callback per tile.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    shape = (1, 2, 3, 4)
    example = tuple(
        torch.arange(n, device=device).view([n if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)
    )
    if score_dtype is not None:
        example = (torch.zeros(shape, dtype=score_dtype, device=device),) + example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_fx(lambda *args: fn(*args), tracing_mode="fake", _allow_non_fake_inputs=True)(*example)


def _trace_structure(fn: Callable[..., Tensor], dtype: torch.dtype, device: torch.device) -> Structure:
    try:
        graph = _trace_on_tile(fn, device, dtype)
    except Exception as e:  # anything untraceable still runs, on the generic path
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return Structure("general", reason=f"it could not be traced ({type(e).__name__}: {first})")
    found = _classify(graph)
    if found.kind == "additive" and not found.masks:
        return dataclasses.replace(found, alibi=alibi_of(fn, graph))
    return found


_SHAPE_ONLY = {
    "aten.full_like.default",
    "aten.zeros_like.default",
    "aten.ones_like.default",
    "aten.empty_like.default",
    "aten.new_full.default",
    "aten.new_zeros.default",
    "aten.new_ones.default",
    "aten.new_empty.default",
    "aten.sym_size.int",
    "aten.sym_numel.default",
    "aten.sym_stride.int",
}


def _classify(graph: Any) -> Structure:
    nodes = list(graph.graph.nodes)
    score = next(n for n in nodes if n.op == "placeholder")
    dep = {score}
    for n in nodes:
        if n.op == "call_function" and str(n.target) not in _SHAPE_ONLY and any(a in dep for a in _node_args(n)):
            dep.add(n)
    out = next(n for n in nodes if n.op == "output").args[0]
    if isinstance(out, (tuple, list)):
        out = out[0] if len(out) == 1 else None
    if out not in dep:
        return Structure("general", reason="its result does not depend on the score")
    cap = softcap_of(score, out, dep)
    if cap is not None:
        return Structure("general", reason="the score goes through aten.tanh.default (a soft cap)", softcap=cap)
    chain, adds, masks, cur = {score}, False, False, out
    while cur is not score:
        chain.add(cur)
        target, args = str(cur.target), cur.args
        nxt = None
        if target == "aten.add.Tensor":
            x, y = args[0], args[1]
            if x in dep and y not in dep:
                nxt = x
            elif y in dep and x not in dep and cur.kwargs.get("alpha", 1) == 1:
                nxt = y
            adds = True
        elif (target == "aten.sub.Tensor" and args[0] in dep and args[1] not in dep) or (
            target in ("aten.add.Scalar", "aten.sub.Scalar") and args[0] in dep
        ):
            nxt, adds = args[0], True
        elif target in ("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf"):
            cond, x, y = args[0], args[1], args[2]
            if cond not in dep and x in dep and y not in dep and _is_neg_inf(graph, y):
                nxt, masks = x, True
            elif cond not in dep and y in dep and x not in dep and _is_neg_inf(graph, x):
                nxt, masks = y, True
        elif target in ("aten.masked_fill.Scalar", "aten.masked_fill.Tensor"):
            if args[0] in dep and args[1] not in dep and args[2] not in dep and _is_neg_inf(graph, args[2]):
                nxt, masks = args[0], True
        elif (
            target in PASS_THROUGH
            or (target in SAME_SHAPE and same_shape(cur, args[0]))
            or (target == "aten._to_copy.default" and same_dtype(cur, args[0]))
        ):
            nxt = args[0]
        if nxt is None or nxt not in dep:
            return Structure("general", reason=f"the score goes through {target}")
        cur = nxt
    if dep - chain:
        used = sorted({str(n.target) for n in dep - chain})
        return Structure("general", reason=f"the score is also used by {', '.join(used)}")
    if adds:
        return Structure("additive", masks=masks)
    return Structure("mask") if masks else Structure("identity")


def _node_args(n: Any) -> List[Any]:
    flat, _ = tree_flatten((n.args, n.kwargs))
    return flat


def _is_neg_inf(graph: Any, x: Any) -> bool:
    if isinstance(x, (int, float)):
        return x == float("-inf")
    if not hasattr(x, "op"):
        return False
    if x.op == "call_function" and str(x.target) in (
        "aten.scalar_tensor.default",
        "aten.full.default",
        "aten.full_like.default",
    ):
        value = x.args[0] if str(x.target) == "aten.scalar_tensor.default" else x.args[1]
        return isinstance(value, (int, float)) and value == float("-inf")
    if x.op == "call_function" and str(x.target) in PASS_THROUGH | SAME_SHAPE | {"aten._to_copy.default"}:
        return _is_neg_inf(graph, x.args[0])
    if x.op == "get_attr":
        const = getattr(graph, x.target, None)
        return isinstance(const, Tensor) and const.numel() > 0 and bool(torch.isneginf(const).all())
    return False


class TracedScoreMod:
    """A user ``score_mod`` with what tracing found out about it.

    Called as the score_mod itself. ``additive_bias(b, h, q_idx, kv_idx)`` (only for the
    additive kind) is the callback on a zero score: exactly its bias (``-inf`` where it masks), the
    float tile a fused kernel adds to its scores. ``not_additive`` says why a general one is not.
    ``softcap``: ``c`` for a soft cap ``c * tanh(score / c)``, else None. ``alibi``: ALiBi with the
    slopes ``fn`` captures now (:class:`~subquad._graphs.Alibi`), else None.
    """

    def __init__(self, fn: Callable[..., Tensor], structure: Structure, dtype: torch.dtype) -> None:
        self.fn, self.structure, self.dtype = fn, structure, dtype
        self.may_mask = structure.masks
        self.softcap = structure.softcap
        self.alibi = None if structure.alibi is None else structure.alibi.on(fn)
        if structure.kind == "general":
            self.not_additive = structure.reason

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(score, b, h, q_idx, kv_idx)

    def __getattr__(self, name: str) -> Any:
        if name == "additive_bias" and self.structure.kind == "additive":
            return self._bias
        raise AttributeError(name)

    def _bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        zero = torch.zeros((), dtype=self.dtype, device=q_idx.device).expand(shape)
        return self.fn(zero, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self.structure.kind} score_mod {self.fn!r}"


class ScoreModAsMask:
    """A ``score_mod`` of the form ``where(cond, score, -inf)`` as the ``mask_mod`` ``cond``."""

    def __init__(self, fn: Callable[..., Tensor], dtype: torch.dtype) -> None:
        self.fn, self.dtype = fn, dtype

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        zero = torch.zeros((), dtype=self.dtype, device=q_idx.device).expand(shape)
        return self.fn(zero, b, h, q_idx, kv_idx) > float("-inf")

    def __repr__(self) -> str:
        return f"mask from score_mod {self.fn!r}"


# ------------------------------------------------------------------ what a mask_mod is, from its structure
class Affine(NamedTuple):
    """``a·q_idx + c·kv_idx + d`` with integer coefficients."""

    a: int
    c: int
    d: int

    def __add__(self, o: "Affine") -> "Affine":  # type: ignore[override]
        return Affine(self.a + o.a, self.c + o.c, self.d + o.d)

    def scaled(self, k: int) -> "Affine":
        return Affine(self.a * k, self.c * k, self.d * k)

    def bounds(self, qs: int, qe: int, ks: int, ke: int) -> Tuple[int, int]:
        """Its minimum and maximum over the integer rectangle ``[qs, qe) x [ks, ke)``."""
        qa = (self.a * qs, self.a * (qe - 1))
        kc = (self.c * ks, self.c * (ke - 1))
        return min(qa) + min(kc) + self.d, max(qa) + max(kc) + self.d


# A formula is ("ge0", Affine) -- true where the affine form is >= 0 -- or ("and" | "or", f, g)
# or ("not", f). Tile states: EMPTY, FULL, PARTIAL (those of subquad._callbacks).
Formula = Tuple[Any, ...]


def tile_state(f: Formula, qs: int, qe: int, ks: int, ke: int) -> int:
    """The state of a formula on a tile, exact for EMPTY and FULL (affine forms reach their
    extremes at the rectangle's corners; ``and``/``or`` of partial parts stay PARTIAL, which is
    always safe)."""
    op = f[0]
    if op == "ge0":
        lo, hi = f[1].bounds(qs, qe, ks, ke)
        return FULL if lo >= 0 else EMPTY if hi < 0 else PARTIAL
    if op == "not":
        return {EMPTY: FULL, FULL: EMPTY, PARTIAL: PARTIAL}[tile_state(f[1], qs, qe, ks, ke)]
    a, b = tile_state(f[1], qs, qe, ks, ke), tile_state(f[2], qs, qe, ks, ke)
    if op == "and":
        return EMPTY if EMPTY in (a, b) else FULL if a == b == FULL else PARTIAL
    return FULL if FULL in (a, b) else EMPTY if a == b == EMPTY else PARTIAL


class MaskStructure(NamedTuple):
    """``kind``: ``"causal"`` (``kv_idx <= q_idx + offset``), ``"affine"`` (a boolean formula of
    comparisons between integer affine forms of the positions: ``formula``) or ``"general"``."""

    kind: str
    offset: int = 0
    formula: Optional[Formula] = None
    reason: str = ""


def mask_mod_structure(fn: Callable[..., Tensor], device: torch.device) -> MaskStructure:
    """Classify a ``mask_mod`` from its traced graph (fake tensors, cached like score_mods)."""
    return per_callback("mask", fn, torch.bool, device, lambda: _trace_mask(fn, device))


def _trace_mask(fn: Callable[..., Tensor], device: torch.device) -> MaskStructure:
    try:
        graph = _trace_on_tile(fn, device, None)
    except Exception as e:  # evaluated per tile instead
        return MaskStructure("general", reason=f"it could not be traced ({type(e).__name__})")
    nodes = list(graph.graph.nodes)
    places = [n for n in nodes if n.op == "placeholder"]
    values: Dict[Any, Any] = {places[2]: ("affine", Affine(1, 0, 0)), places[3]: ("affine", Affine(0, 1, 0))}
    for n in nodes:
        if n.op == "call_function":
            values[n] = _mask_value(str(n.target), [_value(values, a) for a in n.args])
    out = next(n for n in nodes if n.op == "output").args[0]
    if isinstance(out, (tuple, list)):
        out = out[0] if len(out) == 1 else None
    found = values.get(out)
    if found is None or found[0] != "bool":
        return MaskStructure("general", reason="not a formula of comparisons of q_idx and kv_idx")
    formula = found[1]
    if formula[0] == "ge0" and formula[1].a == 1 and formula[1].c == -1:
        return MaskStructure("causal", offset=formula[1].d)  # q - kv + d >= 0: kv <= q + d
    return MaskStructure("affine", formula=formula)


def _value(values: Dict[Any, Any], a: Any) -> Any:
    if isinstance(a, bool):
        return None
    if isinstance(a, int):
        return ("affine", Affine(0, 0, a))
    return values.get(a) if hasattr(a, "op") else None


def _mask_value(target: str, args: List[Any]) -> Any:
    """The symbolic value of one aten op of a mask_mod graph, or ``None`` if outside the fragment."""
    if any(a is None for a in args[:2]) and target not in (
        "aten.bitwise_not.default",
        "aten.logical_not.default",
        "aten.neg.default",
        "aten.abs.default",
    ):
        return None
    kind = lambda i: args[i][0]  # noqa: E731
    if target in ("aten.add.Tensor", "aten.sub.Tensor", "aten.add.Scalar", "aten.sub.Scalar"):
        if kind(0) != "affine" or kind(1) != "affine":
            return None
        other = args[1][1] if target.startswith("aten.add") else args[1][1].scaled(-1)
        return ("affine", args[0][1] + other)
    if target in ("aten.mul.Tensor", "aten.mul.Scalar"):
        (x, y) = args[0], args[1]
        if x[0] == y[0] == "affine" and (y[1].a, y[1].c) == (0, 0):
            return ("affine", x[1].scaled(y[1].d))
        if x[0] == y[0] == "affine" and (x[1].a, x[1].c) == (0, 0):
            return ("affine", y[1].scaled(x[1].d))
        return None
    if target == "aten.neg.default":
        return ("affine", args[0][1].scaled(-1)) if args[0] is not None and args[0][0] == "affine" else None
    if target == "aten.abs.default":
        return ("abs", args[0][1]) if args[0] is not None and args[0][0] == "affine" else None
    if target in ("aten.bitwise_not.default", "aten.logical_not.default"):
        return ("bool", ("not", args[0][1])) if args[0] is not None and args[0][0] == "bool" else None
    if target in (
        "aten.bitwise_and.Tensor",
        "aten.logical_and.default",
        "aten.bitwise_or.Tensor",
        "aten.logical_or.default",
    ):
        if kind(0) != "bool" or kind(1) != "bool":
            return None
        return ("bool", ("and" if "and" in target else "or", args[0][1], args[1][1]))
    for op in ("le", "lt", "ge", "gt", "eq", "ne"):
        if target in (f"aten.{op}.Tensor", f"aten.{op}.Scalar"):
            return _compare(op, args[0], args[1])
    return None


def _compare(op: str, x: Any, y: Any) -> Any:
    """``x op y`` as a formula; ``x`` and ``y`` affine, or one of them ``abs`` of an affine form
    against an affine form (``|e| <= c`` is ``e <= c and -e <= c``)."""
    if op in ("ge", "gt"):  # x >= y is y <= x
        return _compare("le" if op == "ge" else "lt", y, x)
    if op in ("eq", "ne"):
        if x[0] != "affine" or y[0] != "affine":
            return None
        both = ("and", ("ge0", y[1] + x[1].scaled(-1)), ("ge0", x[1] + y[1].scaled(-1)))
        return ("bool", both if op == "eq" else ("not", both))
    strict = 1 if op == "lt" else 0  # integers: x < y is x <= y - 1
    if x[0] == "affine" and y[0] == "affine":
        return ("bool", ("ge0", y[1] + x[1].scaled(-1) + Affine(0, 0, -strict)))
    if x[0] == "abs" and y[0] == "affine":  # |e| <= c: e <= c and -e <= c
        e, c = x[1], y[1] + Affine(0, 0, -strict)
        return ("bool", ("and", ("ge0", c + e.scaled(-1)), ("ge0", c + e)))
    if x[0] == "affine" and y[0] == "abs":  # c <= |e|: e >= c or -e >= c
        e, c = y[1], x[1] + Affine(0, 0, strict)
        return ("bool", ("or", ("ge0", e + c.scaled(-1)), ("ge0", e.scaled(-1) + c.scaled(-1))))
    return None


class TracedMask:
    """A user ``mask_mod`` whose block states (and causal offset) come from its traced formula."""

    def __init__(self, fn: Callable[..., Tensor], structure: MaskStructure) -> None:
        self.fn, self.structure = fn, structure

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        if self.structure.kind == "causal":
            return tile_state(("ge0", Affine(1, -1, self.structure.offset)), qs, qe, ks, ke)
        assert self.structure.formula is not None
        return tile_state(self.structure.formula, qs, qe, ks, ke)

    def causal_offset(self, q_len: int, kv_len: int) -> Optional[int]:
        return self.structure.offset if self.structure.kind == "causal" else None

    def __repr__(self) -> str:
        return f"{self.structure.kind} mask_mod {self.fn!r}"


# ------------------------------------------------------------------ the rewrites
def normalize(inp: Inputs) -> Tuple[Inputs, List[str]]:
    """The call with its callbacks as what tracing shows they are, and the notes saying so."""
    inp, note = _traced_score_mod(inp)
    inp = _traced_mask_mod(inp)
    return _causal_mask_mod_as_flag(inp), [note] if note else []


def _traced_score_mod(inp: Inputs) -> Tuple[Inputs, Optional[str]]:
    """A user ``score_mod`` as what its traced structure shows it is (``explain()`` says which).

    ``score + bias`` gets ``additive_bias`` (so it runs as a bias tile on the fused kernel),
    ``where(cond, score, -inf)`` becomes a ``mask_mod`` (empty tiles are skipped), the identity is
    dropped; anything else runs as is on the generic tiles.
    """
    fn = inp.score_mod
    if fn is None or getattr(fn, "additive_bias", None) is not None:
        return inp, None
    found = score_mod_structure(fn, inp.stats_dtype, inp.device)
    if found.kind == "identity":
        return dataclasses.replace(
            inp, score_mod=None
        ), "score_mod returns the score unchanged (traced): it is left out"
    if found.kind == "mask":
        mask = ScoreModAsMask(fn, inp.stats_dtype)
        mask_mod: Optional[MaskMod] = mask if inp.mask_mod is None else mods.and_masks(inp.mask_mod, mask)
        note = "score_mod is where(cond, score, -inf) (traced): it runs as a mask_mod, empty tiles skipped"
        return dataclasses.replace(inp, score_mod=None, mask_mod=mask_mod), note
    traced = TracedScoreMod(fn, found, inp.stats_dtype)
    if found.softcap is not None:
        note = f"score_mod is the soft cap {found.softcap:g} * tanh(score / {found.softcap:g}) (traced)"
        return dataclasses.replace(inp, score_mod=traced), note
    if found.kind == "general":
        return dataclasses.replace(inp, score_mod=traced), f"score_mod is not additive: {found.reason}"
    mask_mod = inp.mask_mod
    if found.masks:  # its -inf part also skips empty tiles
        mask = ScoreModAsMask(fn, inp.stats_dtype)
        mask_mod = mask if mask_mod is None else mods.and_masks(mask_mod, mask)
    note = "score_mod is score + bias (traced): the bias is evaluated per tile"
    if traced.alibi is not None:
        note = f"score_mod is score + bias (traced), the bias {traced.alibi.describe()}"
    return dataclasses.replace(inp, score_mod=traced, mask_mod=mask_mod), note


def _traced_mask_mod(inp: Inputs) -> Inputs:
    """A hand-written ``mask_mod`` that is a formula of comparisons of the positions (``kv <= q``,
    a window, a prefix) gets exact block states from its traced formula, and the causal one runs
    as the causal flag, as the built-ins do; others are evaluated per tile."""
    fn = inp.mask_mod
    if fn is None or hasattr(fn, "block_state") or isinstance(fn, (ScoreModAsMask, TracedMask)):
        return inp
    found = mask_mod_structure(fn, inp.device)
    if found.kind == "general":
        return inp
    return dataclasses.replace(inp, mask_mod=TracedMask(fn, found))


def _causal_mask_mod_as_flag(inp: Inputs) -> Inputs:
    """A ``mask_mod`` that declares itself the causal mask (``mods.causal()``, ``mods.causal_lower_right``)
    runs as the causal flag: whole tiles skipped, the fused kernel's own causal masking."""
    declared = getattr(inp.mask_mod, "causal_offset", None)
    lengths = inp.total_lengths or (inp.Lq, inp.Lk)
    offset = declared(*lengths) if callable(declared) else None
    if not isinstance(offset, int) or isinstance(offset, bool):
        return inp
    # Declared in the callback's positions; in the block's own: j - ko <= i - qo + offset + (qo - ko).
    offset += inp.q_offset - inp.kv_offset
    if inp.is_causal:  # both: the intersection of two causal masks is the one with the smaller offset
        offset = min(offset, inp.causal_offset)
    return dataclasses.replace(inp, is_causal=True, causal_offset=offset, mask_mod=None)
