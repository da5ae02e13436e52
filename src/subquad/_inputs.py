"""One validated, broadcast-aware view of an attention call.

Everything the planner and the engine need to know about a call lives in :class:`Inputs`:
shapes, the GQA grouping, the mask in its *unexpanded* broadcast form, and byte sizes. User input
is checked here once, with errors that name the argument and show the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Inputs:
    """A validated attention call in the engine's canonical layout.

    ``query`` is ``(B, Hq, Lq, E)``, ``key`` ``(B, Hk, Lk, E)``, ``value`` ``(B, Hk, Lk, Ev)``, where
    ``B`` is the product of the caller's leading batch dims (``batch_shape``) and ``Hq = G * Hk``.
    Query head ``h`` reads key/value head ``h // G`` (the ``repeat_interleave`` convention of
    ``enable_gqa``). ``attn_mask`` keeps the caller's broadcast dims (size-1 dims are never
    expanded) and has rank ``len(batch_shape) + 3``: it broadcasts to ``(*batch_shape, Hq, Lq, Lk)``.
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

    # ----------------------------------------------------------------- shapes
    @property
    def B(self) -> int:
        return self.query.shape[0]

    @property
    def Hq(self) -> int:
        return self.query.shape[1]

    @property
    def Hk(self) -> int:
        return self.key.shape[1]

    @property
    def G(self) -> int:
        return self.Hq // self.Hk

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
    def mask_kind(self) -> Optional[str]:
        if self.attn_mask is None:
            return None
        return "bool" if self.attn_mask.dtype == torch.bool else "float"

    @property
    def has_callbacks(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def output_shape(self) -> Tuple[int, ...]:
        return (*self.batch_shape, self.Hq, self.Lq, self.Ev)

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (self.query, self.key, self.value, self.attn_mask)
        )

    # ------------------------------------------------------------- byte sizes
    def mask_tile_elements(self, qc: int, kc: int) -> int:
        """Elements of one mask tile in its broadcast (unexpanded) shape."""
        if self.attn_mask is None:
            return 0
        n = 1
        for size in self.attn_mask.shape[:-2]:
            n *= size
        return n * (qc if self.attn_mask.shape[-2] != 1 else 1) * (kc if self.attn_mask.shape[-1] != 1 else 1)

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


# ----------------------------------------------------------------- validation
def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"Expected {name} to be a floating-point tensor (float64, float32, float16 or bfloat16), "
            f"got dtype {t.dtype}."
        )
    if t.dim() < 2:
        raise ValueError(f"Expected {name} to have at least 2 dims (..., L, E), got shape {_shape(t)}.")
    return t


def parse_chunk_size(chunk_size: object) -> Optional[Tuple[int, int]]:
    """``None``, a positive int (both sides) or a pair of positive ints ``(q_chunk, kv_chunk)``."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        pair: Tuple[object, ...] = (chunk_size, chunk_size)
    elif isinstance(chunk_size, (tuple, list)) and len(chunk_size) == 2:
        pair = tuple(chunk_size)
    else:
        raise ValueError(
            f"Expected chunk_size to be None, a positive int or a pair (q_chunk, kv_chunk), got {chunk_size!r}."
        )
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"Expected chunk_size entries to be positive ints, got {chunk_size!r}.")
    return int(pair[0]), int(pair[1])  # type: ignore[arg-type]


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
    """Validate a call and bring it to the canonical 4-D layout (views where possible)."""
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)

    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            "Expected query, key and value to have the same number of dims, got "
            f"query {_shape(q)}, key {_shape(k)} and value {_shape(v)}."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "Expected query, key and value to have the same dtype, got "
            f"query {q.dtype}, key {k.dtype} and value {v.dtype}."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            "Expected query, key and value on the same device, got "
            f"query {q.device}, key {k.device} and value {v.device}."
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"Expected key.shape[-1] == query.shape[-1] (E), got key {_shape(k)} and query {_shape(q)}."
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"Expected key.shape[-2] == value.shape[-2] (Lk), got key {_shape(k)} and value {_shape(v)}."
        )

    # (L, E) inputs have one implicit head.
    if q.dim() == 2:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        squeeze_head = True
    else:
        squeeze_head = False
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "Expected key and value to agree on their leading dims (..., Hk), got "
            f"key {_shape(k)} and value {_shape(v)}."
        )
    batch_shape = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch_shape:
        raise ValueError(
            "Expected query and key to have the same batch dims (everything before H, L, E), got "
            f"query {_shape(q)} and key {_shape(k)}."
        )
    Hq, Hk = q.shape[-3], k.shape[-3]
    if Hq != Hk:
        if not enable_gqa:
            raise ValueError(
                f"Expected query and key to have the same number of heads (dim -3), got query {_shape(q)} "
                f"and key {_shape(k)}; pass enable_gqa=True for grouped-query attention."
            )
        if Hk == 0 or Hq % Hk != 0:
            raise ValueError(
                f"With enable_gqa=True the query heads must be a multiple of the key/value heads, got "
                f"Hq={Hq} (query {_shape(q)}) and Hk={Hk} (key {_shape(k)})."
            )

    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"Expected dropout_p in [0, 1), got {dropout_p!r}.")
    if scale is None:
        scale_f = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"Expected scale to be None or a finite number, got {scale!r}.")
        scale_f = float(scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"Expected is_causal to be a bool, got {type(is_causal).__name__}.")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"Expected {name} to be None or a callable, got {type(fn).__name__}.")

    Lq, Lk = q.shape[-2], k.shape[-2]
    full_shape = (*batch_shape, Hq, Lq, Lk)
    mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"Expected attn_mask to be None or a torch.Tensor, got {type(attn_mask).__name__}.")
        if is_causal:
            raise ValueError(
                "Got both attn_mask and is_causal=True; pass one of them (fold causality into the mask, "
                "or use mask_mod=subquad.mods.causal() together with attn_mask)."
            )
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"Expected attn_mask to be a bool tensor (True = attend) or a float tensor (added to the "
                f"scores), got dtype {attn_mask.dtype}."
            )
        if attn_mask.device != q.device:
            raise ValueError(f"Expected attn_mask on {q.device} like query, got {attn_mask.device}.")
        if squeeze_head and attn_mask.dim() >= 3:
            raise ValueError(
                f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape {(Lq, Lk)}."
            )
        try:
            if torch.broadcast_shapes(attn_mask.shape, full_shape) != torch.Size(full_shape):
                raise RuntimeError
        except RuntimeError:
            shown = full_shape[1:] if squeeze_head else full_shape
            raise ValueError(
                f"attn_mask of shape {_shape(attn_mask)} does not broadcast to the scores' shape "
                f"{tuple(shown)} (..., Hq, Lq, Lk)."
            ) from None
        mask = attn_mask
        while mask.dim() < len(full_shape):
            mask = mask.unsqueeze(0)

    B = 1
    for s in batch_shape:
        B *= s
    q4 = q.reshape(B, Hq, Lq, q.shape[-1])
    k4 = k.reshape(B, Hk, Lk, k.shape[-1])
    v4 = v.reshape(B, Hk, Lk, v.shape[-1])
    return Inputs(
        query=q4,
        key=k4,
        value=v4,
        batch_shape=batch_shape if not squeeze_head else (),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale_f,
        dropout_p=float(dropout_p),
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
