"""The seed package memory-efficient-attention 0.1.3 over subquad: the same two calls, exact.

``efficient_dot_product_attention_pt`` (PyTorch) and ``efficient_dot_product_attention_jax``
(JAX, through :mod:`subquad.jax`) take the seed's arguments, layout and callbacks. The seed cuts
its chunks with a clamped ``dynamic_slice``: when a length is not a multiple of its chunk, the
last chunk moves back over the one before, so 10 queries in chunks of 4 come back as 12 rows and
keys in the overlap count twice. Here every length gives the definition::

    s = einsum("...qhd,...khd->...qhk", query / sqrt(E), key)      # E = query.shape[-1]
    s = s + swap(bias)                      # bias [..., H, q, k]; swap: -> [..., q, H, k]
    s = where(swap(mask), s, finfo(query.dtype).min)
    out = einsum("...qhk,...khf->...qhf", softmax(s, axis=-1), value)

with the callbacks (``bias_calc_fn``, ``mask_calc_fn``, ``weights_calc_fn``) applied in the seed's
order, per (query chunk, key chunk). Because masked scores are a finite number, not ``-inf``, a
row whose every key is masked averages all the values; that is reproduced (subquad itself gives
0 there), and a row whose scores are all ``-inf`` averages them too (the seed: NaN).

How the callbacks run: as one subquad ``score_mod`` whose tiles are the chunks. subquad's tile of
rows ``[q0, q0 + qn)`` and keys ``[k0, k0 + kn)`` becomes the seed's ``attn_weights [batch..., qn,
H, kn]`` with offsets ``(q0, k0)`` and the slices of ``bias``/``mask`` at them; what the callbacks
return goes back into the tile. Masked scores are ``finfo.min`` while the callbacks see them and
``-inf`` for subquad (so that a dead row's backward is exact; see ``_seed_chunk``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

import subquad
from subquad import ArgumentError, ArgumentTypeError

__all__ = ["efficient_dot_product_attention_pt", "efficient_dot_product_attention_jax"]

Shape = Tuple[int, ...]


def efficient_dot_product_attention_pt(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    query_chunk_size: int = 1024,
    key_chunk_size: int = 4096,
    bias_calc_fn: Optional[Callable[..., Any]] = None,
    mask_calc_fn: Optional[Callable[..., Any]] = None,
    weights_calc_fn: Optional[Callable[..., Any]] = None,
    calc_fn_data: Any = None,
) -> Tensor:
    """The seed's PyTorch function: exact attention in tiles, differentiable.

    Shapes (the seed's): ``query [batch..., Lq, H, E]``, ``key [batch..., Lk, H, E]``, ``value
    [batch..., Lk, H, Ev]`` -> ``[batch..., Lq, H, Ev]`` in ``query``'s dtype; batch dims
    broadcast. ``mask`` (bool, True = attend) and ``bias`` (float, added) are laid out ``[batch...,
    H, Lq, Lk]``, each dim 1 or full. Equal to the definition in the module docstring::

        s = torch.einsum("...qhd,...khd->...qhk", query / math.sqrt(E), key)
        s = s + bias.transpose(-3, -2)
        s = torch.where(mask.transpose(-3, -2), s, torch.finfo(query.dtype).min)
        out = torch.einsum("...qhk,...khf->...qhf", s.softmax(-1), value)

    computed in subquad's tiles of at most ``min(query_chunk_size, Lq)`` rows by
    ``min(key_chunk_size, Lk)`` keys (the last tile shorter when a length is not a multiple).

    Callbacks, called per tile exactly as the seed calls them per chunk (``q_offset`` an int,
    ``k_offset`` a 0-d int64 tensor: the seed iterates ``torch.arange``; ``attn_weights [batch...,
    qn, H, kn]``, the scaled scores, float32 for float16/bfloat16 inputs)::

        bias_calc_fn(q_offset, k_offset, bias_chunk, attn_weights, calc_fn_data) -> bias [..., H, qn, kn]
        mask_calc_fn(q_offset, k_offset, mask_chunk, attn_weights, calc_fn_data) -> mask [..., H, qn, kn]
        weights_calc_fn(q_offset, k_offset, attn_weights, calc_fn_data) -> attn_weights

    ``bias_chunk``/``mask_chunk``: the slices of ``bias``/``mask`` at the tile (None without
    them). ``bias_calc_fn`` sees the scores before the bias, ``mask_calc_fn`` after it,
    ``weights_calc_fn`` after the mask (masked scores are ``finfo(query.dtype).min``), before the
    softmax. A score ``<= finfo(query.dtype).min`` after them counts as masked. Tensors the
    callbacks read that require grad get gradients (also those inside ``calc_fn_data``).

    Raises:
        TypeError / ValueError (subquad's classes, also ``RuntimeError``): inputs that are not
            tensors of at least 3 dims, heads or dims that disagree, batch dims or ``mask``/``bias``
            that do not broadcast (the seed raises ``TypeError`` there), a ``mask`` that is not
            bool, callbacks that are not callable, chunk sizes that are not positive ints.
        MemoryBudgetError: tiles of these chunk sizes do not fit subquad's default memory budget
            (half the free memory): pass smaller chunk sizes.

    Whatever the callbacks raise propagates unchanged.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    for name, opt, kind in (("mask", mask, "bool"), ("bias", bias, "float")):
        if opt is not None and not isinstance(opt, Tensor):
            raise ArgumentTypeError(f"Expected {name} to be None or a {kind} torch.Tensor, got {type(opt).__name__}.")
    if mask is not None and mask.dtype != torch.bool:
        raise ArgumentTypeError(
            f"Expected mask to be a bool tensor (True = attend; additive terms go in bias), got {mask.dtype}."
        )
    if bias is not None and not bias.is_floating_point():
        raise ArgumentTypeError(f"Expected bias to be a floating-point tensor (masks go in mask), got {bias.dtype}.")
    call = _prepare(
        query.shape,
        key.shape,
        value.shape,
        mask,
        bias,
        query_chunk_size,
        key_chunk_size,
        _Callbacks(bias_calc_fn, mask_calc_fn, weights_calc_fn, calc_fn_data),
    )
    mask, bias = _at_least_3d(mask), _at_least_3d(bias)
    qt, kt, vt = (t.transpose(-3, -2) for t in (query, key, value))  # subquad's (..., H, L, E), views
    if tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])) != call.batch:
        qt = qt.expand(*call.batch, *qt.shape[-3:])  # mask or bias has more batch than the inputs
    low = torch.finfo(query.dtype).min
    options: Dict[str, Any]
    if call.fns.given:
        score_mod = _torch_score_mod(call, bias, mask, low)
        options = dict(score_mod=score_mod, allow_compile=False)  # per-tile Python: never compiled
    elif mask is not None and bias is not None:
        options = dict(attn_mask=bias, mask_mod=_mask_lookup(mask, call.batch))
    else:
        options = dict(attn_mask=bias if mask is None else mask)
    try:
        out, lse = subquad.attention(qt, kt, vt, chunk_size=call.chunk, return_lse=True, **options)
    except subquad.MemoryBudgetError as e:
        raise subquad.MemoryBudgetError(call.budget_message()) from e
    dead = lse == float("-inf")
    if call.Lk > 0 and bool(dead.any()):
        mean_dtype = torch.promote_types(vt.dtype, torch.float32)
        mean = vt.mean(dim=-2, keepdim=True, dtype=mean_dtype).to(out.dtype)
        out = torch.where(dead.unsqueeze(-1), mean, out)
    return out.transpose(-3, -2)


def efficient_dot_product_attention_jax(
    query: Any,
    key: Any,
    value: Any,
    mask: Any = None,
    bias: Any = None,
    precision: Any = "highest",
    query_chunk_size: int = 1024,
    key_chunk_size: int = 4096,
    bias_calc_fn: Optional[Callable[..., Any]] = None,
    mask_calc_fn: Optional[Callable[..., Any]] = None,
    weights_calc_fn: Optional[Callable[..., Any]] = None,
    calc_fn_data: Any = None,
) -> Any:
    """The seed's JAX function (same signature, ``precision`` included), through :mod:`subquad.jax`.

    Shapes, semantics, chunks and callbacks as :func:`efficient_dot_product_attention_pt`, on JAX
    arrays; the callbacks get the offsets as traced integer scalars of ``jnp.arange``'s dtype (as
    in the seed, whose chunks run under ``lax.scan``/``lax.map``), so they slice with
    ``jax.lax.dynamic_slice``. subquad.jax's last chunk of a length that is not a multiple ends at
    the last row or key (as the seed's), but its overlap is masked, not counted twice, and the
    callbacks get its true offset. Works under ``jit`` (callbacks static) and ``grad``; arrays the
    callbacks read get gradients.

    Args:
        precision: the matmuls' precision: a ``jax.lax.Precision``, its name (the default
            ``"highest"`` is the seed's ``Precision.HIGHEST``), or another name that
            ``jax.default_matmul_precision`` takes (``"float32"``, ``"tensorfloat32"``, ...);
            ``None``: JAX's default. It applies to the forward; under ``jax.grad`` the backward
            runs with the precision in effect where the gradient is taken.

    Raises:
        TypeError / ValueError / MemoryBudgetError: as :func:`efficient_dot_product_attention_pt`.
        NotImplementedError: a pair of different precisions.
        ImportError: JAX is not installed (``pip install 'subquad[jax]'``).
    """
    import jax  # optional dependency (pip install 'subquad[jax]')
    import jax.numpy as jnp

    import subquad.jax as sqj  # optional: JAX

    arrays: List[Any] = []  # query, key, value; mask and bias may be None
    for name, x in (("query", query), ("key", key), ("value", value), ("mask", mask), ("bias", bias)):
        try:
            arrays.append(None if x is None else jnp.asarray(x))
        except TypeError:
            raise ArgumentTypeError(f"Expected {name} to be an array, got {type(x).__name__}.") from None
    q, k, v, mask, bias = arrays
    if mask is not None and mask.dtype != jnp.bool_:
        raise ArgumentTypeError(
            f"Expected mask to be bool (True = attend; additive terms go in bias), got {mask.dtype}."
        )
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ArgumentTypeError(f"Expected bias to have a floating dtype (masks go in mask), got {bias.dtype}.")
    call = _prepare(
        q.shape,
        k.shape,
        v.shape,
        mask,
        bias,
        query_chunk_size,
        key_chunk_size,
        _Callbacks(bias_calc_fn, mask_calc_fn, weights_calc_fn, calc_fn_data),
    )
    mask, bias = _at_least_3d(mask), _at_least_3d(bias)
    B, batch = call.B, call.batch
    q4, k4, v4 = (jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((B,) + x.shape[-3:]) for x in (q, k, v))
    low = float(jnp.finfo(q.dtype).min)
    with _matmul_precision(precision, jax):
        if call.fns.given:
            score_mod = _jax_score_mod(call, bias, mask, low, jnp, jax.lax)
            out, lse = sqj.attention(q4, k4, v4, score_mod=score_mod, chunk_size=call.chunk, return_lse=True)
        else:
            flat_bias, flat_mask = (_flat_batch(t, batch, jnp) for t in (bias, mask))
            out, lse = sqj.attention(q4, k4, v4, flat_bias, flat_mask, chunk_size=call.chunk, return_lse=True)
    if call.Lk > 0:
        mean = v4.astype(jnp.promote_types(v4.dtype, jnp.float32)).mean(axis=1, keepdims=True)  # (B, 1, H, Ev)
        out = jnp.where((lse == -jnp.inf)[..., None], mean.astype(out.dtype), out)
    return out.reshape(batch + out.shape[1:])


# ------------------------------------------------------------------ the call, shapes only
class _Callbacks(NamedTuple):
    bias: Optional[Callable[..., Any]]
    mask: Optional[Callable[..., Any]]
    weights: Optional[Callable[..., Any]]
    data: Any

    @property
    def given(self) -> bool:
        return self.bias is not None or self.mask is not None or self.weights is not None


class _Call(NamedTuple):
    """A validated call: the broadcast batch dims, the sizes, the tiles, the callbacks."""

    batch: Shape
    H: int
    Lq: int
    Lk: int
    chunk: Optional[Tuple[int, int]]
    sizes: Tuple[int, int]
    fns: _Callbacks

    @property
    def B(self) -> int:
        return math.prod(self.batch)

    def budget_message(self) -> str:
        return (
            f"query_chunk_size={self.sizes[0]} and key_chunk_size={self.sizes[1]} make tiles of {self.chunk}, which "
            "do not fit subquad's memory budget (half the free memory); pass smaller chunk sizes."
        )


def _prepare(
    q: Sequence[int],
    k: Sequence[int],
    v: Sequence[int],
    mask: Any,
    bias: Any,
    query_chunk_size: object,
    key_chunk_size: object,
    fns: _Callbacks,
) -> _Call:
    """Check the seed's layout and arguments on shapes (errors name the argument)."""
    for name, s in (("query", q), ("key", k), ("value", v)):
        if len(s) < 3:
            raise ArgumentError(f"Expected {name} to be [batch..., L, H, E] (at least 3 dims), got shape {tuple(s)}.")
    Lq, H, E = q[-3:]
    Lk = k[-3]
    if tuple(k[-2:]) != (H, E) or tuple(v[-3:-1]) != (Lk, H):
        raise ArgumentError(
            f"Expected key [batch..., Lk, H, E] and value [batch..., Lk, H, Ev] with H={H}, E={E} of query "
            f"[batch..., Lq, H, E] = {tuple(q)} and one Lk; got key {tuple(k)}, value {tuple(v)}."
        )
    extra = {name: tuple(t.shape) for name, t in (("mask", mask), ("bias", bias)) if t is not None}
    for name, s in extra.items():
        s3 = (1,) * (3 - len(s)) + s
        if not all(n in (1, want) for n, want in zip(s3[-3:], (H, Lq, Lk))):
            raise ArgumentError(
                f"Expected {name} [batch..., H, Lq, Lk] with each of its last three dims 1 or ({H}, {Lq}, {Lk}), "
                f"got shape {s}."
            )
    batches = [tuple(q[:-3]), tuple(k[:-3]), tuple(v[:-3])] + [s[:-3] for s in extra.values()]
    try:
        batch = tuple(torch.broadcast_shapes(*batches))
    except RuntimeError:
        raise ArgumentError(
            f"The batch dims of query {tuple(q)}, key {tuple(k)}, value {tuple(v)}"
            + "".join(f", {n} {s}" for n, s in extra.items())
            + " do not broadcast."
        ) from None
    for name, size in (("query_chunk_size", query_chunk_size), ("key_chunk_size", key_chunk_size)):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ArgumentTypeError(f"Expected {name} to be an int, got {size!r}.")
        if size < 1:
            raise ArgumentError(f"Expected {name} >= 1, got {size}.")
    for name, fn in (("bias_calc_fn", fns.bias), ("mask_calc_fn", fns.mask), ("weights_calc_fn", fns.weights)):
        if fn is not None and not callable(fn):
            raise ArgumentTypeError(f"Expected {name} to be None or callable, got {type(fn).__name__}.")
    sizes = (int(query_chunk_size), int(key_chunk_size))  # type: ignore[call-overload]
    chunk = (min(sizes[0], Lq), min(sizes[1], Lk)) if Lq > 0 and Lk > 0 else None
    return _Call(batch, H, Lq, Lk, chunk, sizes, fns)


def _at_least_3d(t: Any) -> Any:
    """The seed slices ``[..., H, q, k]``; a 2-D ``(q, k)`` mask or bias gets its leading 1s."""
    if t is None or t.ndim >= 3:
        return t
    return t.reshape((1,) * (3 - t.ndim) + tuple(t.shape))


# ------------------------------------------------------------------ one tile, as the seed's chunk
def _seed_chunk(
    w: Any,
    q_offset: Any,
    k_offset: Any,
    bias_chunk: Any,
    mask_chunk: Any,
    fns: _Callbacks,
    low: float,
    swap: Callable[[Any], Any],
    where: Callable[[Any, Any, Any], Any],
) -> Any:
    """The seed's steps on one chunk's scores ``w [..., q, H, k]``, masked scores left at ``low``.

    The caller then turns every score ``<= low`` into ``-inf``: subquad's softmax treats both
    alike, but a row at ``finfo.min`` everywhere would keep a finite lse that float32 cannot tell
    from ``finfo.min`` itself (``finfo.min + log Lk`` rounds back), and its backward would count
    each key once instead of ``1/Lk``; a dead row (lse ``-inf``) is averaged after the call.
    """
    if fns.bias is not None:
        bias_chunk = fns.bias(q_offset, k_offset, bias_chunk, w, fns.data)
    if bias_chunk is not None:
        w = w + swap(_laid_out_hqk(bias_chunk, "bias_calc_fn"))
    if fns.mask is not None:
        mask_chunk = fns.mask(q_offset, k_offset, mask_chunk, w, fns.data)
    if mask_chunk is not None:
        w = where(swap(_laid_out_hqk(mask_chunk, "mask_calc_fn")), w, low)
    if fns.weights is not None:
        w = fns.weights(q_offset, k_offset, w, fns.data)
    return w


def _laid_out_hqk(x: Any, name: str) -> Any:
    if getattr(x, "ndim", 0) < 3:
        raise ArgumentError(
            f"{name} returned {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}; the seed lays a chunk's "
            "bias and mask out [..., H, q_chunk, k_chunk] (at least 3 dims)."
        )
    return x


def _runs(positions: List[int]) -> List[Tuple[int, int]]:
    """``[start, end)`` index ranges of consecutive positions: one for a tile; subquad's probe of a
    ``score_mod`` (which tensors it reads) passes the first and last position only."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _torch_score_mod(call: _Call, bias: Optional[Tensor], mask: Optional[Tensor], low: float) -> Callable[..., Tensor]:
    batch, H, B = call.batch, call.H, call.B

    def part(t: Optional[Tensor], q0: int, qn: int, k0: int, kn: int) -> Optional[Tensor]:
        if t is None:
            return None
        if t.shape[-2] != 1:
            t = t.narrow(-2, q0, qn)
        return t if t.shape[-1] == 1 else t.narrow(-1, k0, kn)

    def chunk(s: Tensor, q0: int, k0: int) -> Tensor:
        qn, kn = s.shape[-2], s.shape[-1]
        w: Tensor = s.reshape(*batch, H, qn, kn).transpose(-3, -2)
        # The seed's key offsets come from iterating torch.arange (0-d int64 tensors), its query offsets are ints.
        w = _seed_chunk(
            w,
            q0,
            torch.tensor(k0),
            part(bias, q0, qn, k0, kn),
            part(mask, q0, qn, k0, kn),
            call.fns,
            low,
            lambda x: x.transpose(-3, -2),
            torch.where,
        )
        w = w.masked_fill(w <= low, float("-inf"))
        return w.transpose(-3, -2).expand(*batch, H, qn, kn).reshape(B, H, qn, kn)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if tuple(score.shape[:2]) != (B, H):
            # subquad traces a score_mod on a small made-up tile to classify it (explain() shows this).
            raise ArgumentError("the seed's callbacks run in Python on each tile of the call, not on a trace")
        rows, keys = q_idx.flatten().tolist(), kv_idx.flatten().tolist()
        pieces = []
        for qa, qb in _runs(rows):
            row = [chunk(score[:, :, qa:qb, ka:kb], rows[qa], keys[ka]) for ka, kb in _runs(keys)]
            pieces.append(row[0] if len(row) == 1 else torch.cat(row, dim=-1))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)

    return score_mod


def _mask_lookup(mask: Tensor, batch: Shape) -> Callable[..., Tensor]:
    """``mask [batch..., H, Lq, Lk]`` (dims 1 or full) read at subquad's tile indices, as a
    ``mask_mod``: ``b`` runs over the batch dims flattened, so it is split back into them."""
    mask = mask.reshape((1,) * (len(batch) + 3 - mask.dim()) + tuple(mask.shape))
    strides = [math.prod(batch[i + 1 :]) for i in range(len(batch))]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        index: List[Any] = [(b // s) % n if own != 1 else 0 for s, n, own in zip(strides, batch, mask.shape)]
        index += [i if own != 1 else 0 for i, own in zip((h, q_idx, kv_idx), mask.shape[-3:])]
        return mask[tuple(index)]

    return mask_mod


def _jax_score_mod(call: _Call, bias: Any, mask: Any, low: float, jnp: Any, lax: Any) -> Callable[..., Any]:
    batch, H, B = call.batch, call.H, call.B
    offset_dtype = jnp.arange(0).dtype  # the seed's offsets come from jnp.arange: int64 under jax_enable_x64

    def part(t: Any, q0: Any, qn: int, k0: Any, kn: int) -> Any:
        if t is None:
            return None
        if t.shape[-2] != 1:
            t = lax.dynamic_slice_in_dim(t, q0, qn, axis=t.ndim - 2)
        return t if t.shape[-1] == 1 else lax.dynamic_slice_in_dim(t, k0, kn, axis=t.ndim - 1)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        qn, kn = score.shape[-2], score.shape[-1]
        # subquad.jax's chunks are consecutive positions: the first is the offset.
        q0, k0 = q_idx[0, 0, 0, 0].astype(offset_dtype), kv_idx[0, 0, 0, 0].astype(offset_dtype)
        w = jnp.swapaxes(score.reshape(batch + (H, qn, kn)), -3, -2)
        w = _seed_chunk(
            w,
            q0,
            k0,
            part(bias, q0, qn, k0, kn),
            part(mask, q0, qn, k0, kn),
            call.fns,
            low,
            lambda x: jnp.swapaxes(x, -3, -2),
            jnp.where,
        )
        w = jnp.where(w <= low, -jnp.inf, w)
        return jnp.broadcast_to(jnp.swapaxes(w, -3, -2), batch + (H, qn, kn)).reshape(B, H, qn, kn)

    return score_mod


def _flat_batch(t: Any, batch: Shape, jnp: Any) -> Any:
    """``[batch..., H, Lq, Lk]`` -> subquad.jax's ``(B | 1, H, Lq, Lk)``: a view unless ``t``
    broadcasts over some batch dims but not all (then it is expanded over them)."""
    if t is None:
        return None
    t = t.reshape((1,) * (len(batch) + 3 - t.ndim) + tuple(t.shape))
    if all(n == 1 for n in t.shape[: len(batch)]):
        return t.reshape((1,) + tuple(t.shape[-3:]))
    return jnp.broadcast_to(t, batch + tuple(t.shape[-3:])).reshape((math.prod(batch),) + tuple(t.shape[-3:]))


def _matmul_precision(precision: Any, jax: Any) -> contextlib.ExitStack:
    """The seed passes ``precision`` to its einsums; here it is JAX's default while the call traces."""
    stack = contextlib.ExitStack()
    if precision is None:
        return stack
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            raise NotImplementedError(
                f"precision={precision!r}: subquad.jax runs every matmul at one precision; pass one value."
            )
        precision = precision[0]
    if isinstance(precision, jax.lax.Precision):
        precision = precision.name.lower()
    if not isinstance(precision, str):
        raise ArgumentTypeError(f"Expected precision to be None, a jax.lax.Precision or its name, got {precision!r}.")
    try:
        stack.enter_context(jax.default_matmul_precision(precision))
    except ValueError as e:
        raise ArgumentError(f"precision={precision!r} is not a matmul precision JAX knows: {e}") from None
    return stack
