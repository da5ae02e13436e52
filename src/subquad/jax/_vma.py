"""Varying manual axes: arrays that ``subquad.jax`` creates inside ``shard_map`` get their inputs' type.

Under ``jax.shard_map`` with its default checks (``check_vma=True``) every array carries the set of
mesh axes it varies over. A loop carry built with ``jnp.zeros`` varies over none, but after one
step it holds values computed from the (varying) inputs, and ``lax.while_loop`` refuses carries
whose type changes. A custom VJP's cotangent must also have its primal's type: the gradient of an
array that every device holds alike (a replicated ALiBi slope table) is the sum of the devices'
contributions.

Used by the rest of ``subquad.jax``: ``varying_axes``, ``vary``, ``match``. Outside ``shard_map``
and on JAX versions without these types (before 0.6) they change nothing.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Set, Tuple

import jax
from jax import lax


def _axes_of(x: Any) -> Tuple[Any, ...]:
    typeof = getattr(jax, "typeof", None)
    try:
        # get_aval: JAX before 0.6 (newer stubs lack it)
        aval = typeof(x) if typeof is not None else jax.core.get_aval(x)  # type: ignore[attr-defined, unused-ignore]
    except TypeError:  # a Python scalar or None: varies over nothing
        return ()
    vma = getattr(aval, "vma", None)  # JAX 0.6 - 0.9
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", ())  # JAX 0.10: the manual axis type
    return tuple(vma or ())


def varying_axes(*trees: Any) -> FrozenSet[Any]:
    """The mesh axes any array in ``trees`` varies over (empty outside ``shard_map``)."""
    found: Set[Any] = set()
    for leaf in jax.tree_util.tree_leaves(trees):
        found.update(_axes_of(leaf))
    return frozenset(found)


def _ordered(axes: Any) -> Tuple[Any, ...]:
    return tuple(sorted(axes, key=str))


def vary(x: Any, axes: FrozenSet[Any]) -> Any:
    """``x`` (a tree) marked as varying over ``axes`` too: a loop carry with its loop's type."""

    def one(leaf: Any) -> Any:
        missing = _ordered(set(axes) - set(_axes_of(leaf)))
        if not missing:
            return leaf
        if hasattr(lax, "pcast"):
            return lax.pcast(leaf, missing, to="varying")
        if hasattr(lax, "pvary"):  # JAX 0.6 - 0.7
            return lax.pvary(leaf, missing)
        return leaf

    return jax.tree_util.tree_map(one, x) if axes else x


def match(cotangent: Any, primal: Any) -> Any:
    """A cotangent with its primal's type: summed over the axes the primal does not vary over."""
    if cotangent is None or primal is None:
        return cotangent
    extra = _ordered(set(_axes_of(cotangent)) - set(_axes_of(primal)))
    if extra:
        cotangent = lax.psum(cotangent, extra)
    missing = set(_axes_of(primal)) - set(_axes_of(cotangent))
    return vary(cotangent, frozenset(missing)) if missing else cotangent
