"""Predicates on traced aten graphs (``make_fx`` of a user callback), for :mod:`subquad._traced`:
the nodes that pass a tensor through unchanged, and the soft cap ``c * tanh(score / c)``, the one
non-additive ``score_mod`` the native kernel's loops run themselves."""

from __future__ import annotations

from typing import Any, Optional, Set, Tuple

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
