"""What every rank checks before any transfer, together: one small all-gather of each rank's view.

Used by the rest of ``subquad.distributed``: ``Call`` (a call after the check), ``STRATEGIES``,
``agree``, ``check_agreement``, ``validate_local``.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._errors import ArgumentError, ArgumentTypeError
from .._inputs import MaskMod, ScoreMod
from .._validate import check_bool, make_inputs
from ._group import Group, torch_distributed
from ._layouts import LAYOUTS, pieces

STRATEGIES = ("auto", "ring", "ulysses")
"""The ``strategy=`` values of :func:`~subquad.distributed.attention`: ``"ring"``, ``"ulysses"``
(all-to-all over heads) or ``"auto"`` (the one that sends fewer bytes; ``explain()`` says why)."""


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_MAX_DIMS = 8


@dataclasses.dataclass
class Call:
    """A ring call after the collective check: every rank's lengths and the shared options."""

    g: Group
    layout: str
    q_lengths: List[int]
    kv_lengths: List[int]
    batch_shape: Tuple[int, ...]
    is_causal: bool
    attn_mask: Optional[Tensor]
    score_mod: Optional[ScoreMod]
    mask_mod: Optional[MaskMod]
    scale: Optional[float]
    enable_gqa: bool
    budget: int
    sub_rows: int = 1 << 30
    sub_cols: int = 1 << 30
    block_states: Optional[Callable[..., Optional[List[List[int]]]]] = None

    @property
    def Lq(self) -> int:
        return sum(self.q_lengths)

    @property
    def Lk(self) -> int:
        return sum(self.kv_lengths)

    def q_pieces(self, rank: int) -> List[Tuple[int, int, int]]:
        return pieces(self.layout, self.q_lengths, rank)

    def kv_pieces(self, rank: int) -> List[Tuple[int, int, int]]:
        return pieces(self.layout, self.kv_lengths, rank)

    @property
    def positional(self) -> bool:
        """Whether a block's result depends on where its rows and keys sit in the sequence."""
        return self.attn_mask is not None or self.score_mod is not None or self.mask_mod is not None


def _shape_fields(t: Optional[Tensor]) -> List[int]:
    if t is None:
        return [-2] * (_MAX_DIMS + 1)
    dims = list(t.shape)[-_MAX_DIMS:]
    return [t.dim()] + [-1] * (_MAX_DIMS - len(dims)) + dims


def _fields_shape(fields: Sequence[int]) -> Optional[Tuple[int, ...]]:
    if fields[0] == -2:
        return None
    return tuple(int(f) for f in fields[1:] if f != -1)


def _float_bits(x: Optional[float]) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


_FIELDS = (
    "error",
    "query",
    "key",
    "value",
    "attn_mask",
    "dtype",
    "layout",
    "is_causal",
    "enable_gqa",
    "scale",
    "score_mod",
    "mask_mod",
    "strategy",
)


def agree(
    g: Group,
    local_error: Optional[BaseException],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    layout: str,
    is_causal: bool,
    enable_gqa: bool,
    scale: Optional[float],
    score_mod: Any,
    mask_mod: Any,
    strategy: str,
) -> List[Dict[str, Any]]:
    """Every rank's view of the call, gathered with one small all-gather before any transfer.

    A rank whose arguments were invalid still takes part, so that all ranks raise together
    instead of leaving the others waiting.
    """
    ok = local_error is None
    dtype_code = _DTYPES.index(query.dtype) if ok and query.dtype in _DTYPES else -1
    row = [0 if ok else 1]
    for t in (query, key, value, attn_mask):
        row += _shape_fields(t if ok else None)
    row += [
        dtype_code,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        int(bool(is_causal)),
        int(bool(enable_gqa)),
        _float_bits(scale) if ok else 0,
        int(score_mod is not None),
        int(mask_mod is not None),
        STRATEGIES.index(strategy),
    ]
    like = query if isinstance(query, Tensor) else torch.empty(0)
    t = torch.tensor(row, dtype=torch.int64, device=g.comm_device(like))
    parts = [torch.empty_like(t) for _ in range(g.size)]
    torch_distributed().all_gather(parts, t, group=g.handle)
    rows = []
    w = _MAX_DIMS + 1
    for p in parts:
        v = [int(x) for x in p.tolist()]
        rows.append(
            {
                "error": v[0],
                "query": _fields_shape(v[1 : 1 + w]),
                "key": _fields_shape(v[1 + w : 1 + 2 * w]),
                "value": _fields_shape(v[1 + 2 * w : 1 + 3 * w]),
                "attn_mask": _fields_shape(v[1 + 3 * w : 1 + 4 * w]),
                **dict(zip(_FIELDS[5:], v[1 + 4 * w :])),
            }
        )
    failed = [r for r, row_ in enumerate(rows) if row_["error"]]
    if failed:
        if local_error is not None:
            raise local_error
        raise ArgumentError(
            f"subquad.distributed: rank(s) {failed} rejected their arguments (see the error raised there); "
            "no rank ran the call."
        )
    return rows


def check_agreement(rows: List[Dict[str, Any]], layout: str) -> Tuple[List[int], List[int]]:
    """Raise on every rank alike when the ranks disagree; returns the query and key lengths per rank."""

    def differ(what: str, values: List[Any], hint: str = "") -> None:
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ArgumentError(f"subquad.distributed: {what} must be the same on every rank, got {shown}.{hint}")

    for name in ("query", "key", "value"):
        shapes = [row[name] for row in rows]
        without_len = [s[:-2] + s[-1:] for s in shapes]
        if len(set(without_len)) > 1:
            differ(f"{name}'s shape apart from its sequence length (dim -2)", shapes)
    for name, hint in (
        ("dtype", ""),
        ("layout", ""),
        ("is_causal", ""),
        ("enable_gqa", ""),
        ("scale", ""),
        ("score_mod", " (pass a callback on every rank or on none)"),
        ("mask_mod", " (pass a callback on every rank or on none)"),
        ("strategy", ""),
    ):
        values = [row[name] for row in rows]
        if len(set(values)) > 1:
            if name == "dtype":
                values = [_DTYPES[v] if v >= 0 else "?" for v in values]
            elif name == "layout":
                values = [LAYOUTS[v] for v in values]
            elif name == "scale":
                values = [None if v == -1 else struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            elif name == "strategy":
                values = [STRATEGIES[v] for v in values]
            else:
                values = [bool(v) for v in values]
            differ(name, values, hint)
    if len({row["attn_mask"] is None for row in rows}) > 1:
        differ(
            "whether attn_mask is given",
            [row["attn_mask"] is not None for row in rows],
            " (pass a mask shard on every rank or on none)",
        )
    q_lengths = [row["query"][-2] for row in rows]
    kv_lengths = [row["key"][-2] for row in rows]
    if [row["value"][-2] for row in rows] != kv_lengths:
        differ("value's sequence length (that of key)", [(row["key"][-2], row["value"][-2]) for row in rows])
    if layout == "zigzag":
        for name, lengths in (("query", q_lengths), ("key", kv_lengths)):
            if len(set(lengths)) > 1 or lengths[0] % 2:
                raise ArgumentError(
                    f"layout='zigzag' needs every rank to hold two equal chunks of the sequence: {name}'s local "
                    f"lengths must be equal and even, got {q_lengths if name == 'query' else kv_lengths} on ranks "
                    f"0..{len(rows) - 1}. Shard with subquad.distributed.shard(x, -2, layout='zigzag') (the length "
                    "a multiple of 2P), or use layout='contiguous'."
                )
    Lk = sum(kv_lengths)
    for r, row in enumerate(rows):
        m = row["attn_mask"]
        if m is None:
            continue
        qn, kn = (m[-2] if len(m) >= 2 else 1), (m[-1] if m else 1)
        if qn not in (1, q_lengths[r]) or kn not in (1, Lk):
            raise ArgumentError(
                f"attn_mask on rank {r} has shape {m}; a rank's mask is its shard of the rows and every "
                f"key: (..., {q_lengths[r]} (its query length) or 1, {Lk} (the whole key length) or 1)."
            )
    return q_lengths, kv_lengths


def validate_local(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    score_mod: Any,
    mask_mod: Any,
    scale: Optional[float],
    enable_gqa: bool,
    return_lse: bool,
) -> None:
    """What one rank can check alone (types, dims, heads, devices), as :func:`subquad.attention` does."""
    check_bool("return_lse", return_lse)
    make_inputs(
        query,
        key,
        value,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    if query.dim() < 3:
        raise ArgumentError(
            f"Expected query, key and value of shape (..., H, L, E) (3 dims or more), got query {tuple(query.shape)}."
        )
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise ArgumentError(
            "subquad.distributed needs the same batch dims on query, key and value (no broadcasting), got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)}."
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise ArgumentTypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}.")
        if type(attn_mask) is not Tensor and not isinstance(attn_mask, torch.nn.Parameter):
            raise ArgumentTypeError(
                f"attn_mask of type {type(attn_mask).__name__} is not supported across ranks; pass is_causal=True "
                "or a mask_mod (mods.causal_lower_right(Lq, Lk)) for torch's causal masks."
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ArgumentTypeError(f"attn_mask must be bool (True = attend) or floating point, got {attn_mask.dtype}.")
        if attn_mask.device != query.device:
            raise ArgumentError(f"attn_mask is on {attn_mask.device}, query on {query.device}.")
        if attn_mask.dim() > query.dim():
            raise ArgumentError(
                f"attn_mask has more dims than query: {tuple(attn_mask.shape)} vs {tuple(query.shape)}."
            )
        if is_causal:
            raise ArgumentError("Pass either attn_mask or is_causal=True, not both (as in SDPA).")
