"""One validated, broadcast-aware view of an attention call.

Everything the planner and the engine need to know about a call lives in :class:`Inputs`:
shapes, the GQA grouping, the batch broadcasting, the mask in its *unexpanded* broadcast form,
and byte sizes. User input is checked here once (:func:`make_inputs`), with errors that name the
argument and show the values. :class:`BlockPositions` places a call inside a longer sequence
(what context parallelism runs per block).

Used by the rest of the package: ``Inputs``, ``make_inputs``, ``BlockPositions``, ``check_bool``,
``parse_chunk_size``, ``causal_bias_offset``, ``ScoreMod``, ``MaskMod``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._errors import ArgumentError, ArgumentTypeError

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _BatchGroups:
    """How a call whose batch dims cannot be folded into one as views is cut into groups.

    The caller's batch dims ``S`` split at ``split``: the engine runs one group per index of
    ``S[:split]`` (outer), and folds ``S[split:]`` (inner) into one batch dim as a view.
    """

    tensors: Tuple[Optional[Tensor], ...]  # query, key, value, mask at rank len(S) + 3
    shape: Tuple[int, ...]
    split: int


@dataclass(eq=False)
class Inputs:
    """A validated attention call (or one batch group of it) in the engine's canonical layout.

    ``query`` is ``(Bq, Hq, Lq, E)``, ``key`` ``(Bk, Hk, Lk, E)``, ``value`` ``(Bv, Hk, Lk, Ev)``,
    each batch either ``B`` or 1 (broadcast, never expanded in memory); ``q``/``k``/``v`` are the
    same tensors viewed at batch ``B``. ``B`` is the product of the caller's batch dims
    (``batch_shape``) and ``Hq = G * Hk``: query head ``h`` reads key/value head ``h // G`` (the
    ``repeat_interleave`` convention of ``enable_gqa``). ``attn_mask`` is 4-D and unexpanded,
    ``(B or 1, Hq or 1, Lq or 1, Lk or 1)``. Causal masking lets query ``i`` see keys
    ``j <= i + causal_offset`` (0: top-left as SDPA's ``is_causal``; ``Lk - Lq``: bottom-right).

    A call whose batch broadcasting cannot be folded into one batch dim as a view (some 5-D
    patterns) has ``n_groups > 1``: this object is then its first group, and :meth:`group`
    gives the others; ``b_offset`` is the group's first batch index (what callbacks see as ``b``).

    A call that is one block of a larger sequence (a rank's part of ring attention) has
    ``q_offset``/``kv_offset``: callbacks see query ``i`` at position ``q_offset + i`` and key
    ``j`` at ``kv_offset + j``, and ``total_lengths`` are the whole sequence's ``(Lq, Lk)``; a
    call on a slice of the heads (all-to-all context parallelism) has ``h_offset``.
    ``causal_offset`` stays in the block's own positions.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    batch_shape: Tuple[int, ...]
    attn_mask: Optional[Tensor]
    is_causal: bool
    scale: float
    dropout_p: float
    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None
    causal_offset: int = 0
    q_offset: int = 0
    kv_offset: int = 0
    h_offset: int = 0
    total_lengths: Optional[Tuple[int, int]] = None
    batch: int = 1
    b_offset: int = 0
    squeeze_head: bool = False
    groups: Optional[_BatchGroups] = field(default=None, repr=False, compare=False)

    # ----------------------------------------------------------------- shapes
    @property
    def B(self) -> int:
        return self.batch

    @property
    def Hq(self) -> int:
        return self.query.shape[1]

    @property
    def Hk(self) -> int:
        return self.key.shape[1]

    @property
    def G(self) -> int:
        return self.Hq // self.Hk if self.Hk else 1

    @property
    def Lq(self) -> int:
        return self.query.shape[2]

    @property
    def Lk(self) -> int:
        return self.key.shape[2]

    @property
    def E(self) -> int:
        return self.query.shape[3]

    @property
    def Ev(self) -> int:
        return self.value.shape[3]

    @property
    def q(self) -> Tensor:
        return _at_batch(self.query, self.B)

    @property
    def k(self) -> Tensor:
        return _at_batch(self.key, self.B)

    @property
    def v(self) -> Tensor:
        return _at_batch(self.value, self.B)

    @property
    def kv_broadcast(self) -> bool:
        """Whether key or value is shared by the batch (batch 1 while ``B > 1``)."""
        return self.key.shape[0] != self.B or self.value.shape[0] != self.B

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def itemsize(self) -> int:
        return self.query.element_size()

    @property
    def stats_dtype(self) -> torch.dtype:
        """Row statistics and accumulators: float64 for float64 inputs, else float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def stats_itemsize(self) -> int:
        return 8 if self.dtype == torch.float64 else 4

    @property
    def bias_dtype(self) -> torch.dtype:
        """The dtype of a bias tile fed to a fused kernel.

        The inputs' dtype, except for half-precision inputs with a float32/float64 mask or an
        additive ``score_mod``: those stay float32, so a bias is not rounded to 8 bits of mantissa
        before it is added (fused kernels accept a float32 mask beside half inputs).
        """
        if self.dtype not in (torch.float16, torch.bfloat16):
            return self.dtype
        wide_mask = self.attn_mask is not None and self.attn_mask.dtype in (torch.float32, torch.float64)
        return torch.float32 if wide_mask or self.score_mod is not None else self.dtype

    @property
    def mask_kind(self) -> Optional[str]:
        if self.attn_mask is None:
            return None
        return "bool" if self.attn_mask.dtype == torch.bool else "float"

    @property
    def has_callbacks(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def n_groups(self) -> int:
        if self.groups is None:
            return 1
        return _prod(self.groups.shape[: self.groups.split])

    @property
    def output_shape(self) -> Tuple[int, ...]:
        if self.squeeze_head:
            return (self.Lq, self.Ev)
        return (*self.batch_shape, self.Hq, self.Lq, self.Ev)

    @property
    def empty(self) -> bool:
        """No output element (a zero batch, head or query length): nothing to compute."""
        return self.B * self.Hq * self.Lq * self.Ev == 0

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (self.query, self.key, self.value, self.attn_mask)
        )

    def causal_visible(self, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """Causal visibility of a tile, ``(qn, kn)`` bool (True = attend)."""
        qi = torch.arange(qs + self.causal_offset, qe + self.causal_offset, device=self.device).view(-1, 1)
        ki = torch.arange(ks, ke, device=self.device).view(1, -1)
        return ki <= qi

    # ------------------------------------------------------------- byte sizes
    def mask_tile_elements(self, qc: int, kc: int) -> int:
        """Elements of one mask tile in its broadcast (unexpanded) shape."""
        if self.attn_mask is None:
            return 0
        m = self.attn_mask
        return m.shape[0] * m.shape[1] * (qc if m.shape[-2] != 1 else 1) * (kc if m.shape[-1] != 1 else 1)

    def output_bytes(self) -> int:
        return self.B * self.Hq * self.Lq * self.Ev * self.itemsize

    def lse_bytes(self) -> int:
        return self.B * self.Hq * self.Lq * self.stats_itemsize

    def mask_tile(self, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """The mask restricted to query rows ``[qs, qe)`` and keys ``[ks, ke)``, a view."""
        assert self.attn_mask is not None
        m = self.attn_mask
        if m.shape[-2] != 1:
            m = m[..., qs:qe, :]
        if m.shape[-1] != 1:
            m = m[..., ks:ke]
        return m

    # ----------------------------------------------------------------- groups
    def group(self, g: int) -> "Inputs":
        """Batch group ``g`` of a call with ``n_groups > 1`` (views of the caller's tensors)."""
        if self.groups is None:
            assert g == 0
            return self
        spec = self.groups
        outer = _unravel(g, spec.shape[: spec.split])
        inner = spec.shape[spec.split :]
        q, k, v, m = (
            None if t is None else _fold(t[tuple(i if t.shape[d] != 1 else 0 for d, i in enumerate(outer))], inner)
            for t in spec.tensors
        )
        assert q is not None and k is not None and v is not None
        return replace(self, query=q, key=k, value=v, attn_mask=m, b_offset=g * _prod(inner))

    def all_groups(self) -> Iterator["Inputs"]:
        for g in range(self.n_groups):
            yield self.group(g)


def _at_batch(t: Tensor, B: int) -> Tensor:
    return t if t.shape[0] == B else t.expand(B, *t.shape[1:])


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _unravel(i: int, shape: Sequence[int]) -> Tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        idx.append(i % s)
        i //= s
    return tuple(reversed(idx))


def _fold(t: Tensor, batch: Sequence[int]) -> Optional[Tensor]:
    """``t`` (rank ``len(batch) + 3``) with its batch dims folded into one, as a view, or ``None``.

    Each batch dim of ``t`` is 1 (broadcast) or ``batch[i]``; the folded dim is 1 if all are 1,
    ``prod(batch)`` if none is broadcast and the strides allow a view.
    """
    nb = len(batch)
    sizes, rest = tuple(t.shape[:nb]), tuple(t.shape[nb:])
    if all(s == 1 for s in sizes):
        return t.reshape(1, *rest)
    if any(s != b for s, b in zip(sizes, batch)):
        return None  # broadcast in some batch dims only
    try:
        return t.view(_prod(batch), *rest)
    except RuntimeError:
        return None  # batch dims whose strides do not merge


# ----------------------------------------------------------------- validation
def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise ArgumentTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    if t.is_nested:
        raise NotImplementedError(
            f"{name} is a nested tensor; subquad takes dense (strided) tensors. Pad the sequences "
            "and pass a key padding mask (attn_mask or subquad.mods.key_padding), or run them one by one."
        )
    if t.layout != torch.strided:
        raise ArgumentTypeError(f"Expected {name} to be a dense (strided) tensor, got layout {t.layout}.")
    if t.dtype not in _FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"Expected {name} to be a floating-point tensor (float64, float32, float16 or bfloat16), "
            f"got dtype {t.dtype}."
        )
    if t.dim() < 2:
        raise ArgumentError(f"Expected {name} to have at least 2 dims (..., L, E), got shape {_shape(t)}.")
    return t


def check_bool(name: str, value: object) -> bool:
    """A flag must be a Python bool (as in SDPA, which refuses 1, "no" and numpy bools)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"Expected {name} to be a bool, got {type(value).__name__} {value!r}.")
    return value


def _real(name: str, value: object) -> float:
    """A number: Python and numpy scalars, or a one-element tensor (SDPA accepts all three)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise ArgumentTypeError(f"Expected {name} to be a number, got {type(value).__name__} {value!r}.")
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ArgumentTypeError(f"Expected {name} to be a number, got a tensor of shape {_shape(value)}.")
    return float(value)


def parse_chunk_size(chunk_size: object) -> Optional[Tuple[int, int]]:
    """``None``, a positive int (both sides) or a pair of positive ints ``(q_chunk, kv_chunk)``."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        pair: Tuple[object, ...] = (chunk_size, chunk_size)
    elif isinstance(chunk_size, (tuple, list)) and len(chunk_size) == 2:
        pair = tuple(chunk_size)
    else:
        raise ArgumentError(
            f"Expected chunk_size to be None, a positive int or a pair (q_chunk, kv_chunk), got {chunk_size!r}."
        )
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ArgumentError(f"Expected chunk_size entries to be positive ints, got {chunk_size!r}.")
    return int(pair[0]), int(pair[1])  # type: ignore[arg-type]


def causal_bias_offset(attn_mask: object, Lq: int, Lk: int, is_causal: bool) -> Optional[int]:
    """The causal offset a ``torch.nn.attention.bias.CausalBias`` stands for; ``None`` for any other mask.

    Those masks are tensor subclasses without data: SDPA dispatches on them (upper-left is
    ``is_causal``, lower-right aligns the diagonal to the bottom-right corner), and so does subquad.
    """
    if attn_mask is None or type(attn_mask) is Tensor:
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # a torch without the module has no such masks either
        return None
    if not isinstance(attn_mask, CausalBias):
        return None
    if is_causal:
        raise ArgumentError(
            "CausalBias should not be used with causal=True: the attn_mask already is the causal mask; "
            "pass is_causal=False (torch's SDPA raises the same)."
        )
    variant = getattr(attn_mask, "variant", None)
    if variant == CausalVariant.UPPER_LEFT:
        return 0
    if variant == CausalVariant.LOWER_RIGHT:
        sizes = (getattr(attn_mask, "seq_len_q", None), getattr(attn_mask, "seq_len_kv", None))
        if sizes != (Lq, Lk):
            raise ArgumentError(
                f"attn_mask is causal_lower_right{sizes}, but the call has Lq={Lq} queries and Lk={Lk} keys; "
                f"build it as causal_lower_right({Lq}, {Lk})."
            )
        return Lk - Lq
    raise ArgumentError(f"attn_mask is a CausalBias with an unknown variant {variant!r}.")


def make_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Inputs:
    """Validate a call and bring it to the canonical 4-D layout (views, never copies)."""
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)

    if not (q.dim() == k.dim() == v.dim()):
        raise ArgumentError(
            "Expected query, key and value to have the same number of dims, got "
            f"query {_shape(q)}, key {_shape(k)} and value {_shape(v)}."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ArgumentTypeError(
            "Expected query, key and value to have the same dtype, got "
            f"query {q.dtype}, key {k.dtype} and value {v.dtype}."
        )
    if not (q.device == k.device == v.device):
        raise ArgumentError(
            "Expected query, key and value on the same device, got "
            f"query {q.device}, key {k.device} and value {v.device}."
        )
    if k.shape[-1] != q.shape[-1]:
        raise ArgumentError(
            f"Expected key.shape[-1] == query.shape[-1] (E), got key {_shape(k)} and query {_shape(q)}."
        )
    if k.shape[-2] != v.shape[-2]:
        raise ArgumentError(
            f"Expected key.shape[-2] == value.shape[-2] (Lk), got key {_shape(k)} and value {_shape(v)}."
        )

    # (L, E) inputs have one implicit head.
    squeeze_head = q.dim() == 2
    if squeeze_head:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if k.shape[-3] != v.shape[-3]:
        raise ArgumentError(
            "Expected key and value to agree on their leading dims (..., Hk), got "
            f"key {_shape(k)} and value {_shape(v)}."
        )
    batch_shape = _broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if batch_shape is None:
        raise ArgumentError(
            "Expected query, key and value to have the same batch dims (everything before H, L, E) or "
            f"batch dims that broadcast, got query {_shape(q)}, key {_shape(k)} and value {_shape(v)}."
        )
    Hq, Hk = q.shape[-3], k.shape[-3]
    if Hq != Hk:
        if not enable_gqa:
            raise ArgumentError(
                f"Expected query and key to have the same number of heads (dim -3), got query {_shape(q)} "
                f"and key {_shape(k)}; pass enable_gqa=True for grouped-query attention."
            )
        if Hk == 0 or Hq % Hk != 0:
            raise ArgumentError(
                f"With enable_gqa=True the query heads must be a multiple of the key/value heads, got "
                f"Hq={Hq} (query {_shape(q)}) and Hk={Hk} (key {_shape(k)})."
            )

    if dropout_p is None:
        raise ArgumentTypeError("Expected dropout_p to be a number in [0, 1], got None.")
    p = _real("dropout_p", dropout_p)
    if not (0.0 <= p <= 1.0):
        raise ArgumentError(f"Expected dropout_p in [0, 1], got {dropout_p!r}.")
    if scale is None:
        scale_f = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    else:
        scale_f = _real("scale", scale)
        if not math.isfinite(scale_f):
            raise ArgumentError(f"Expected scale to be None or a finite number, got {scale!r}.")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ArgumentTypeError(f"Expected {name} to be None or a callable, got {type(fn).__name__}.")

    Lq, Lk = q.shape[-2], k.shape[-2]
    causal_offset = 0
    offset = causal_bias_offset(attn_mask, Lq, Lk, is_causal)
    if offset is not None:
        attn_mask, is_causal, causal_offset = None, True, offset
    full_shape = (*batch_shape, Hq, Lq, Lk)
    mask = None
    if attn_mask is not None:
        mask = _check_mask(attn_mask, q, is_causal, squeeze_head, full_shape)

    nb = len(batch_shape)
    tensors = tuple(None if t is None else _pad_rank(t, nb + 3) for t in (q, k, v, mask))
    groups = None
    if nb <= 1:  # one batch dim (or none): each tensor is already its own canonical view
        q4, k4, v4, m4 = (None if t is None else t if nb else t.unsqueeze(0) for t in tensors)
    else:
        # The first split whose inner batch dims fold into one as views (the last one always does).
        split = next(
            j for j in range(nb + 1)
            if all(t is None or _fold(t[(0,) * j] if j else t, batch_shape[j:]) is not None for t in tensors)
        )
        groups = _BatchGroups(tensors, batch_shape, split) if split else None
        first = tuple(None if t is None else t[(0,) * split] if split else t for t in tensors)
        q4, k4, v4, m4 = (None if t is None else _fold(t, batch_shape[split:]) for t in first)
    assert q4 is not None and k4 is not None and v4 is not None
    return Inputs(
        query=q4,
        key=k4,
        value=v4,
        batch_shape=() if squeeze_head else batch_shape,
        attn_mask=m4,
        is_causal=is_causal,
        scale=scale_f,
        dropout_p=p,
        score_mod=score_mod,
        mask_mod=mask_mod,
        causal_offset=causal_offset,
        batch=_prod(batch_shape if groups is None else batch_shape[groups.split :]),
        squeeze_head=squeeze_head,
        groups=groups,
    )


def _pad_rank(t: Tensor, rank: int) -> Tensor:
    while t.dim() < rank:
        t = t.unsqueeze(0)
    return t


def _check_mask(
    attn_mask: object, q: Tensor, is_causal: bool, squeeze_head: bool, full_shape: Tuple[int, ...]
) -> Tensor:
    if not isinstance(attn_mask, Tensor):
        raise ArgumentTypeError(f"Expected attn_mask to be None or a torch.Tensor, got {type(attn_mask).__name__}.")
    if attn_mask.is_nested or attn_mask.layout != torch.strided:
        raise ArgumentTypeError(
            f"Expected attn_mask to be a dense (strided) tensor, got a {'nested' if attn_mask.is_nested else attn_mask.layout} one; "
            "pass a dense mask, or a mask_mod that computes it per tile."
        )
    if is_causal:
        # The text starts with torch's own (its tests match it); the advice follows.
        raise ArgumentError(
            "Explicit attn_mask should not be set when is_causal=True: pass one of them (fold causality "
            "into the mask, or use mask_mod=subquad.mods.causal() together with attn_mask)."
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"Expected attn_mask to be a bool tensor (True = attend) or a float tensor (added to the "
            f"scores), got dtype {attn_mask.dtype}."
        )
    if attn_mask.device != q.device:
        raise ArgumentError(f"Expected attn_mask on {q.device} like query, got {attn_mask.device}.")
    shown = full_shape[1:] if squeeze_head else full_shape
    if (squeeze_head and attn_mask.dim() >= 3) or attn_mask.dim() > len(full_shape):
        raise ArgumentError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape {tuple(shown)}."
        )
    if _broadcast(attn_mask.shape, full_shape) != tuple(full_shape):
        raise ArgumentError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape "
            f"{tuple(shown)} (..., Hq, Lq, Lk)."
        )
    return attn_mask


def _broadcast(*shapes: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The broadcast of ``shapes`` (numpy's rules), or ``None`` if they do not broadcast."""
    if all(len(s) == len(shapes[0]) and tuple(s) == tuple(shapes[0]) for s in shapes):
        return tuple(shapes[0])
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, size in enumerate(s, start=n - len(s)):
            if size != 1:
                if out[i] not in (1, size):
                    return None
                out[i] = size
    return tuple(out)


@dataclass(frozen=True)
class BlockPositions:
    """A call that is one block of a longer sequence (what ring attention runs per step).

    Callbacks see query ``i`` at ``q_offset + i`` and key ``j`` at ``kv_offset + j``; a length-
    dependent ``mask_mod`` (``mods.causal_lower_right``) sees the whole sequence's lengths
    ``total_lengths``; heads are seen from ``h_offset``. ``causal_offset`` (in the block's own
    positions) applies when ``is_causal``: query ``i`` sees keys ``j <= i + causal_offset``.
    """

    q_offset: int
    kv_offset: int
    total_lengths: Tuple[int, int]
    causal_offset: int = 0
    h_offset: int = 0

    def apply(self, inp: Inputs) -> Inputs:
        return replace(
            inp, q_offset=self.q_offset, kv_offset=self.kv_offset, total_lengths=self.total_lengths,
            h_offset=self.h_offset,
            causal_offset=self.causal_offset if inp.is_causal else inp.causal_offset,
        )
