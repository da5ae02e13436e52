"""One validated, broadcast-aware view of an attention call.

Everything the planner and the engine need to know about a call lives in :class:`Inputs`:
shapes, the GQA grouping, the batch broadcasting, the mask in its *unexpanded* broadcast form,
packed sequences (:class:`Packed`) and byte sizes. :class:`BlockPositions` places a call inside a
longer sequence (what context parallelism runs per block). User input becomes an ``Inputs`` in
:mod:`subquad._validate`.

Used by the rest of the package: ``Inputs``, ``Packed``, ``BlockPositions``, ``BatchGroups``,
``fold_batch``, ``prod``, ``FLOAT_DTYPES``, ``ScoreMod``, ``MaskMod``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BatchGroups:
    """How a call whose batch dims cannot be folded into one as views is cut into groups.

    The caller's batch dims ``S`` split at ``split``: the engine runs one group per index of
    ``S[:split]`` (outer), and folds ``S[split:]`` (inner) into one batch dim as a view.
    """

    tensors: Tuple[Optional[Tensor], ...]  # query, key, value, mask at rank len(S) + 3
    shape: Tuple[int, ...]
    split: int


@dataclass(frozen=True)
class Packed:
    """Sequences packed along the length axis (flash-attn's and torch's varlen layout).

    Sequence ``s`` holds query rows ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], k_end[s])``
    (``k_end`` is ``cu_k[1:]``, or shorter ends: keys used of a padded or cached block), and
    attends only within itself. With ``bottom_right`` the causal mask and the window are
    aligned to each sequence's bottom-right corner (its diagonal at ``j = i + Lk_s - Lq_s``), else
    top-left. ``window = (left, right)``: query ``i`` sees keys from ``left`` before to ``right``
    after the aligned diagonal (``None``: unbounded on that side).
    """

    cu_q: Tuple[int, ...]
    cu_k: Tuple[int, ...]
    bottom_right: bool = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    k_end: Optional[Tuple[int, ...]] = None

    @property
    def n(self) -> int:
        return len(self.cu_q) - 1

    def rows(self, s: int) -> Tuple[int, int, int, int]:
        """``(qs, qe, ks, ke)`` of sequence ``s``."""
        ke = self.cu_k[s + 1] if self.k_end is None else self.k_end[s]
        return self.cu_q[s], self.cu_q[s + 1], self.cu_k[s], ke

    def offset(self, s: int) -> int:
        """Where sequence ``s``'s aligned diagonal is: query ``i`` faces key ``i + offset``."""
        qs, qe, ks, ke = self.rows(s)
        return (ke - ks) - (qe - qs) if self.bottom_right else 0

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.cu_q, self.cu_q[1:])), default=0)

    @property
    def max_k(self) -> int:
        ends = self.cu_k[1:] if self.k_end is None else self.k_end
        return max((b - a for a, b in zip(self.cu_k, ends)), default=0)


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

    Packed sequences (:class:`Packed`, ``packed``) are one batch entry ``(1, H, total, E)`` whose
    length axis holds every sequence; the engine runs them one sequence at a time, callbacks
    seeing ``b`` = the sequence's index and positions within it. ``lse_rows`` (a planning view
    of such a call) counts the saved lse of every row, not only of the view's own.

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
    groups: Optional[BatchGroups] = field(default=None, repr=False, compare=False)
    packed: Optional[Packed] = None
    lse_rows: Optional[int] = None

    def derive(self, **changes: object) -> "Inputs":
        """This call with some fields changed: ``dataclasses.replace`` without re-running
        ``__init__`` (a shallow copy), which a packed call does once per sequence."""
        unknown = changes.keys() - self.__dataclass_fields__.keys()
        if unknown:
            raise TypeError(f"Inputs has no field {sorted(unknown)}")
        new = object.__new__(Inputs)
        new.__dict__.update(self.__dict__, **changes)
        return new

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
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"``, ``"mps"``…: every device-specific choice reads this one property (the
        suite overrides it to run the CUDA and MPS branches on CPU tensors, tests/_devices.py)."""
        return self.query.device.type

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
    def positive_scale(self) -> bool:
        """Whether the scale is positive in the statistics' arithmetic (:attr:`stats_dtype`): at
        least its smallest normal number. torch's fused kernels apply their own causal flag as
        ``-inf`` scores before they scale them: with a scale of 0 there (1e-46 is 0 in float32; a
        subnormal one is 0 where denormals are flushed) or a negative one, the masked entries
        become NaN or the largest. Without it, causal masks go into a bias."""
        return self.scale >= torch.finfo(self.stats_dtype).tiny

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
    def short_sequences_share_tiles(self) -> bool:
        """Whether a packed call's short sequences run in shared tiles (:mod:`subquad._buckets`):
        no ``score_mod``, ``mask_mod``, window, mask or dropout."""
        p = self.packed
        return (
            p is not None
            and p.window is None
            and self.score_mod is None
            and self.mask_mod is None
            and self.attn_mask is None
            and self.dropout_p == 0.0
        )

    @property
    def has_callbacks(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def n_groups(self) -> int:
        if self.groups is None:
            return 1
        return prod(self.groups.shape[: self.groups.split])

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
            t is not None and t.requires_grad for t in (self.query, self.key, self.value, self.attn_mask)
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
        return self.B * self.Hq * (self.Lq if self.lse_rows is None else self.lse_rows) * self.stats_itemsize

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
            None if t is None else fold_batch(t[tuple(i if t.shape[d] != 1 else 0 for d, i in enumerate(outer))], inner)
            for t in spec.tensors
        )
        assert q is not None and k is not None and v is not None
        return replace(self, query=q, key=k, value=v, attn_mask=m, b_offset=g * prod(inner))


def _at_batch(t: Tensor, B: int) -> Tensor:
    return t if t.shape[0] == B else t.expand(B, *t.shape[1:])


def prod(xs: Sequence[int]) -> int:
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


def fold_batch(t: Tensor, batch: Sequence[int]) -> Optional[Tensor]:
    """``t`` (rank ``len(batch) + 3``) with its batch dims folded into one, as a view, or ``None``.

    Each batch dim of ``t`` is 1 (broadcast) or ``batch[i]``; the folded dim is 1 if all are 1,
    ``prod(batch)`` if none is broadcast and the strides allow a view, and 0 whatever the
    broadcast and the strides if ``batch`` is empty (a view of no elements).
    """
    nb = len(batch)
    sizes, rest = tuple(t.shape[:nb]), tuple(t.shape[nb:])
    if all(s == 1 for s in sizes):
        return t.reshape(1, *rest)
    if prod(batch) == 0:
        return t.expand(*batch, *rest).reshape(0, *rest)
    if any(s != b for s, b in zip(sizes, batch)):
        return None  # broadcast in some batch dims only
    try:
        return t.view(prod(batch), *rest)
    except RuntimeError:
        return None  # batch dims whose strides do not merge


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
            inp,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            total_lengths=self.total_lengths,
            h_offset=self.h_offset,
            causal_offset=self.causal_offset if inp.is_causal else inp.causal_offset,
        )


def describe(inp: Inputs) -> str:
    """How plans and errors name a call: its shape, dtype, device and what it carries
    (``B=1 H=8 Lq=4096 Lk=4096 E=64 bfloat16 on cpu, causal``)."""
    heads = f"{inp.Hq}" if inp.G == 1 else f"{inp.Hq}q/{inp.Hk}kv"
    ev = f", Ev={inp.Ev}" if inp.Ev != inp.E else ""
    extras = []
    if inp.attn_mask is not None:
        extras.append(f"{inp.mask_kind} mask {tuple(inp.attn_mask.shape)}")
    p = inp.packed
    if inp.is_causal and p is not None:
        extras.append("causal (bottom-right per sequence)" if p.bottom_right else "causal")
    elif inp.is_causal:
        extras.append("causal" if inp.causal_offset == 0 else f"causal (bottom-right, offset {inp.causal_offset})")
    if p is not None and p.window is not None:
        extras.append(f"window {p.window}")
    if inp.score_mod is not None:
        extras.append("score_mod")
    if inp.mask_mod is not None:
        extras.append("mask_mod")
    if inp.dropout_p > 0:
        extras.append(f"dropout {inp.dropout_p}")
    tail = (", " + ", ".join(extras)) if extras else ""
    dt = str(inp.dtype).replace("torch.", "")
    if p is not None:
        return (
            f"{p.n} packed sequences (longest Lq={p.max_q}, Lk={p.max_k}; {inp.Lq} x {inp.Lk} rows in all) "
            f"H={heads} E={inp.E}{ev} {dt} on {inp.device_type}{tail}"
        )
    return f"B={inp.B} H={heads} Lq={inp.Lq} Lk={inp.Lk} E={inp.E}{ev} {dt} on {inp.device_type}{tail}"
