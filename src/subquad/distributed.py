r"""Exact attention over a sequence sharded across processes (context parallelism).

Each rank holds its shard of the sequence, ``(..., H, L/P, E)``; the ranks compute the attention
of the whole sequence together over ``torch.distributed`` (gloo on CPU, NCCL on GPUs, launched
with ``torchrun``), with no transport of subquad's own. Two strategies:

* **ring** (:func:`ring_attention`): key/value shards travel around the ring of ranks with
  point-to-point sends (``batch_isend_irecv``), the next transfer posted before the current
  step's compute; each step is a bounded-memory :mod:`subquad` call with ``return_lse``, and the
  partial results merge exactly by their log-sum-exp. The backward sends dK/dV around the ring
  with K/V (FlashAttention-2: it needs only the saved output and global lse). Nothing of size
  ``L x L`` exists on any rank, forward or backward.
* **all-to-all** (:func:`ulysses_attention`, "Ulysses"): two all-to-alls turn the sequence
  shards into head shards (the whole sequence for ``H/P`` heads), each rank runs
  :func:`subquad.attention` on its heads, and one all-to-all brings the output back.

:func:`attention` picks one (``strategy="auto"``) and :func:`explain` says which, with the
per-rank memory and bytes sent. :func:`shard` / :func:`unshard` split a whole tensor into this
rank's shard and gather it back, in either layout:

* ``layout="zigzag"`` (default): the sequence is cut into ``2P`` equal chunks and rank ``r``
  holds chunks ``r`` and ``2P-1-r``, so that every rank does the same causal work;
* ``layout="contiguous"``: rank ``r`` holds the ``r``-th run of positions (shards may differ
  in length).

Positions are global: ``score_mod``/``mask_mod`` see the global query and key index of every
element, so ALiBi, sliding windows and document masks are exact across shards.

A failure on one rank (an exception in a callback, a lost process) leaves the others waiting on
their next transfer until the process group's timeout (``init_process_group(timeout=...)``;
gloo's default is 30 minutes), when they raise. Invalid arguments are checked on every rank
before any transfer, so that all ranks raise together.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _call
from ._autograd import backward_grads
from ._budget import format_bytes, parse_budget, resolve_budget
from ._callbacks import call_user, captured_tensors
from ._errors import ArgumentError, ArgumentTypeError
from ._inputs import BlockPositions, MaskMod, ScoreMod, check_bool, make_inputs
from ._traced import TracedMask, mask_mod_structure

__all__ = [
    "ring_attention", "ulysses_attention", "attention", "explain", "shard", "unshard",
    "DistributedPlan", "LAYOUTS", "STRATEGIES",
]

LAYOUTS = ("zigzag", "contiguous")
STRATEGIES = ("auto", "ring", "ulysses")
Budget = Union[int, str, None]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


# ------------------------------------------------------------------ the process group
@dataclasses.dataclass(frozen=True)
class _Group:
    """The process group of a call: its size, this rank, and the ring neighbours' global ranks."""

    handle: Any
    size: int
    rank: int

    def global_rank(self, r: int) -> int:
        return int(_dist().get_global_rank(self.handle, r)) if self.handle is not None else r

    @property
    def next(self) -> int:
        return self.global_rank((self.rank + 1) % self.size)

    @property
    def prev(self) -> int:
        return self.global_rank((self.rank - 1) % self.size)

    def comm_device(self, like: Tensor) -> torch.device:
        """Where small control tensors live: NCCL needs them on the GPU, gloo on the CPU."""
        backend = str(_dist().get_backend(self.handle)).lower()
        return like.device if "nccl" in backend else torch.device("cpu")


def _group(group: Any) -> _Group:
    dist = _dist() if torch.distributed.is_available() else None
    if dist is None or not dist.is_initialized():
        raise RuntimeError(
            "subquad.distributed needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first, or launch with torchrun."
        )
    try:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    except (RuntimeError, ValueError) as e:
        raise ArgumentError(f"group={group!r} is not a usable process group ({e}).") from None
    if rank < 0:
        raise ArgumentError("This process is not a member of group; call it only on the group's ranks.")
    return _Group(group, size, rank)


# ------------------------------------------------------------------ layouts
def _check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ArgumentError(f"Unknown layout={layout!r}; expected one of {', '.join(map(repr, LAYOUTS))}.")
    return layout


def _pieces(layout: str, lengths: Sequence[int], rank: int) -> List[Tuple[int, int, int]]:
    """The runs of global positions rank ``rank`` holds: ``(local start, global start, length)``."""
    P = len(lengths)
    if layout == "contiguous":
        runs = [(0, sum(lengths[:rank]), lengths[rank])]
    else:
        c = lengths[rank] // 2
        runs = [(0, rank * c, c), (c, (2 * P - 1 - rank) * c, c)]
    return [r for r in runs if r[2] > 0]


def _split_points(layout: str, total: int, size: int) -> List[List[Tuple[int, int]]]:
    """For each rank, the ``(global start, length)`` runs it holds of a sequence of ``total``."""
    if layout == "contiguous":
        base, extra = divmod(total, size)
        lengths = [base + (1 if r < extra else 0) for r in range(size)]
    else:
        lengths = [total // size] * size
    return [[(g, n) for _, g, n in _pieces(layout, lengths, r)] for r in range(size)]


def shard(x: Tensor, dim: int, group: Any = None, layout: str = "zigzag") -> Tensor:
    """This rank's shard of the whole tensor ``x`` along ``dim`` (the sequence dim, e.g. ``-2``).

    ``layout="zigzag"``: ``x`` is cut into ``2P`` equal chunks and rank ``r`` gets chunks ``r``
    and ``2P-1-r`` (the length must be a multiple of ``2P``). ``layout="contiguous"``: the
    ``r``-th of ``P`` runs, as :func:`torch.tensor_split` cuts them (any length). Equal to::

        chunks = x.chunk(2 * P, dim); torch.cat([chunks[r], chunks[2 * P - 1 - r]], dim)   # zigzag
        x.tensor_split(P, dim)[r]                                                        # contiguous

    Differentiable. Every rank must pass the same ``x``.
    """
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"shard() expects a tensor x, got {type(x).__name__}.")
    layout = _check_layout(layout)
    g = _group(group)
    dim = _check_dim(x, dim)
    L = x.shape[dim]
    if layout == "zigzag" and L % (2 * g.size) != 0:
        raise ArgumentError(
            f"layout='zigzag' cuts the sequence into 2P = {2 * g.size} equal chunks, but x.shape[{dim}] = {L} "
            f"is not a multiple of {2 * g.size}. Pad the sequence, or use layout='contiguous'."
        )
    runs = _split_points(layout, L, g.size)[g.rank]
    parts = [x.narrow(dim, s, n) for s, n in runs]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: Tensor, dim: int, group: Any = None, layout: str = "zigzag") -> Tensor:
    """The whole tensor from every rank's shard ``x`` (collective: all ranks call it).

    The inverse of :func:`shard`; shards of ``layout="contiguous"`` may differ in length.
    Differentiable: the gradient of each rank's shard is the sum over ranks of the gradient of
    its part of the whole (the result is a function of every rank's shard).
    """
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"unshard() expects a tensor x, got {type(x).__name__}.")
    layout = _check_layout(layout)
    g = _group(group)
    dim = _check_dim(x, dim)
    if g.size == 1:
        return x
    return _Unshard.apply(x, dim, g, layout)


def _check_dim(x: Tensor, dim: object) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < max(x.dim(), 1):
        raise ArgumentError(f"dim={dim!r} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


def _all_lengths(g: _Group, n: int, like: Tensor) -> List[int]:
    t = torch.tensor([n], dtype=torch.int64, device=g.comm_device(like))
    parts = [torch.empty_like(t) for _ in range(g.size)]
    _dist().all_gather(parts, t, group=g.handle)
    return [int(p.item()) for p in parts]


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, g: _Group, layout: str) -> Tensor:  # type: ignore[override]
        lengths = _all_lengths(g, x.shape[dim], x)
        if layout == "zigzag" and len(set(lengths)) > 1:
            raise ArgumentError(f"layout='zigzag' shards must all have the same length, got {lengths} on ranks 0..{g.size - 1}.")
        longest = max(lengths)
        pad = list(x.shape)
        pad[dim] = longest
        buf = x.new_zeros(pad)
        buf.narrow(dim, 0, x.shape[dim]).copy_(x)
        gathered = [torch.empty_like(buf) for _ in range(g.size)]
        _dist().all_gather(gathered, buf.contiguous(), group=g.handle)
        total = sum(lengths)
        out_shape = list(x.shape)
        out_shape[dim] = total
        out = x.new_empty(out_shape)
        for r in range(g.size):
            local = 0
            for _, start, n in _pieces(layout, lengths, r):
                out.narrow(dim, start, n).copy_(gathered[r].narrow(dim, local, n))
                local += n
        ctx.dim, ctx.g, ctx.layout, ctx.lengths = dim, g, layout, lengths
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None, None]:
        total = grad.contiguous().clone()
        _dist().all_reduce(total, group=ctx.g.handle)
        parts = [total.narrow(ctx.dim, s, n) for _, s, n in _pieces(ctx.layout, ctx.lengths, ctx.g.rank)]
        if not parts:
            shape = list(grad.shape)
            shape[ctx.dim] = 0
            return grad.new_zeros(shape), None, None, None
        return (parts[0] if len(parts) == 1 else torch.cat(parts, ctx.dim)), None, None, None


# ------------------------------------------------------------------ what every rank checks
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_MAX_DIMS = 8


@dataclasses.dataclass
class _Call:
    """A ring call after the collective check: every rank's lengths and the shared options."""

    g: _Group
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
    block_state: Optional[Callable[[int, int, int, int], int]] = None

    @property
    def Lq(self) -> int:
        return sum(self.q_lengths)

    @property
    def Lk(self) -> int:
        return sum(self.kv_lengths)

    def q_pieces(self, rank: int) -> List[Tuple[int, int, int]]:
        return _pieces(self.layout, self.q_lengths, rank)

    def kv_pieces(self, rank: int) -> List[Tuple[int, int, int]]:
        return _pieces(self.layout, self.kv_lengths, rank)

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


_FIELDS = ("error", "query", "key", "value", "attn_mask", "dtype", "layout", "is_causal", "enable_gqa",
           "scale", "score_mod", "mask_mod", "strategy")


def _agree(
    g: _Group, local_error: Optional[BaseException], query: Tensor, key: Tensor, value: Tensor,
    attn_mask: Optional[Tensor], layout: str, is_causal: bool, enable_gqa: bool, scale: Optional[float],
    score_mod: Any, mask_mod: Any, strategy: str,
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
    row += [dtype_code, LAYOUTS.index(layout) if layout in LAYOUTS else -1, int(bool(is_causal)), int(bool(enable_gqa)),
            _float_bits(scale) if ok else 0, int(score_mod is not None), int(mask_mod is not None), STRATEGIES.index(strategy)]
    like = query if isinstance(query, Tensor) else torch.empty(0)
    t = torch.tensor(row, dtype=torch.int64, device=g.comm_device(like))
    parts = [torch.empty_like(t) for _ in range(g.size)]
    _dist().all_gather(parts, t, group=g.handle)
    rows = []
    w = _MAX_DIMS + 1
    for p in parts:
        v = [int(x) for x in p.tolist()]
        rows.append({
            "error": v[0], "query": _fields_shape(v[1 : 1 + w]), "key": _fields_shape(v[1 + w : 1 + 2 * w]),
            "value": _fields_shape(v[1 + 2 * w : 1 + 3 * w]), "attn_mask": _fields_shape(v[1 + 3 * w : 1 + 4 * w]),
            **dict(zip(_FIELDS[5:], v[1 + 4 * w :])),
        })
    failed = [r for r, row_ in enumerate(rows) if row_["error"]]
    if failed:
        if local_error is not None:
            raise local_error
        raise ArgumentError(
            f"subquad.distributed: rank(s) {failed} rejected their arguments (see the error raised there); "
            "no rank ran the call."
        )
    return rows


def _check_agreement(rows: List[Dict[str, Any]], layout: str) -> Tuple[List[int], List[int]]:
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
        ("dtype", ""), ("layout", ""), ("is_causal", ""), ("enable_gqa", ""), ("scale", ""),
        ("score_mod", " (pass a callback on every rank or on none)"), ("mask_mod", " (pass a callback on every rank or on none)"),
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
        differ("whether attn_mask is given", [row["attn_mask"] is not None for row in rows], " (pass a mask shard on every rank or on none)")
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


def _validate_local(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
    score_mod: Any, mask_mod: Any, scale: Optional[float], enable_gqa: bool, return_lse: bool,
) -> None:
    """What one rank can check alone (types, dims, heads, devices), as :func:`subquad.attention` does."""
    check_bool("return_lse", return_lse)
    make_inputs(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                score_mod=score_mod, mask_mod=mask_mod)
    if query.dim() < 3:
        raise ArgumentError(f"Expected query, key and value of shape (..., H, L, E) (3 dims or more), got query {tuple(query.shape)}.")
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
            raise ArgumentError(f"attn_mask has more dims than query: {tuple(attn_mask.shape)} vs {tuple(query.shape)}.")
        if is_causal:
            raise ArgumentError("Pass either attn_mask or is_causal=True, not both (as in SDPA).")


# ------------------------------------------------------------------ the ring
@dataclasses.dataclass(frozen=True)
class _Block:
    """One attention call of a ring step: local query rows x local key rows of the K/V in hand."""

    q: Tuple[int, int]
    kv: Tuple[int, int]
    positions: BlockPositions
    is_causal: bool
    mask_cols: Optional[Tuple[int, int]]


def _blocks(call: _Call, src: int) -> List[_Block]:
    """The calls that attend this rank's queries to rank ``src``'s keys; masked blocks are left out.

    With no position-dependent argument (mask, callbacks), neighbouring runs that are entirely
    visible are joined into one call (attention does not depend on the order of its keys).
    """
    rank = call.g.rank
    total = (call.Lq, call.Lk)
    q_runs = call.q_pieces(rank)
    pairs: List[Tuple[Tuple[int, int, int], Tuple[int, int, int], str]] = []
    for qp in q_runs:
        for kp in call.kv_pieces(src):
            state = "full"
            if call.is_causal:
                _, qg, qn = qp
                _, kg, kn = kp
                if kg > qg + qn - 1:
                    state = "none"
                elif kg + kn - 1 > qg:
                    state = "partial"
            pairs.append((qp, kp, state))

    def block(qp: Tuple[int, int, int], kp: Tuple[int, int, int], state: str) -> _Block:
        (ql, qg, qn), (kl, kg, kn) = qp, kp
        return _Block(
            (ql, ql + qn), (kl, kl + kn), BlockPositions(qg, kg, total, causal_offset=qg - kg),
            state == "partial", (kg, kg + kn) if call.attn_mask is not None else None,
        )

    if call.positional:
        return [block(qp, kp, s) for qp, kp, s in pairs if s != "none"]
    out: List[_Block] = []
    for qp in q_runs:
        mine = [(kp, s) for q_, kp, s in pairs if q_ is qp and s != "none"]
        if not mine:
            continue
        kv_runs = [kp for kp, _ in mine]
        joinable = all(s == "full" for _, s in mine) and all(
            a[0] + a[2] == b[0] for a, b in zip(kv_runs, kv_runs[1:])
        )
        if joinable:
            ql, qg, qn = qp
            span = (kv_runs[0][0], kv_runs[-1][0] + kv_runs[-1][2])
            prev = out[-1] if out else None
            if prev is not None and not prev.is_causal and prev.kv == span and prev.q[1] == ql:
                out[-1] = dataclasses.replace(prev, q=(prev.q[0], ql + qn))  # the next run of rows, same keys
            else:
                out.append(_Block((ql, ql + qn), span, BlockPositions(qg, kv_runs[0][1], total), False, None))
        else:
            out.extend(block(qp, kp, s) for kp, s in mine)
    return out


_SUB_BLOCK_BYTES = 2 << 20
"""A ring block runs as calls whose query rows (and, in the backward, keys) take at most about
this much, or an eighth of the shard: a call's output and gradients are new tensors of its size,
merged into the accumulators, so the transient memory stays a fraction of the shard."""


def _sub_block_caps(B: int, Hq: int, Hk: int, Lq: int, E: int, Ev: int) -> Tuple[int, int]:
    target = max(_SUB_BLOCK_BYTES, B * Hq * Lq * max(E, Ev) * 4 // 8)
    rows = max(16, target // max(1, B * Hq * max(E, Ev) * 4))
    cols = max(16, target // max(1, B * Hk * max(E, Ev) * 4))
    return rows, cols


def _split(call: _Call, b: _Block, rows_cap: int, cols_cap: int) -> Iterator[_Block]:
    """The block as calls of at most ``rows_cap`` query rows x ``cols_cap`` keys.

    Parts that the causal mask or the ``mask_mod``'s declared block state hides entirely are
    left out; parts entirely below the diagonal run without the causal mask.
    """
    p = b.positions
    for r0 in range(b.q[0], b.q[1], rows_cap):
        r1 = min(r0 + rows_cap, b.q[1])
        qg = p.q_offset + (r0 - b.q[0])
        for c0 in range(b.kv[0], b.kv[1], cols_cap):
            c1 = min(c0 + cols_cap, b.kv[1])
            kg = p.kv_offset + (c0 - b.kv[0])
            causal = b.is_causal
            if causal:
                if kg > qg + (r1 - r0) - 1:
                    continue
                if kg + (c1 - c0) - 1 <= qg:
                    causal = False
            if call.block_state is not None and call.block_state(qg, qg + r1 - r0, kg, kg + c1 - c0) == 0:
                continue
            cols = None if b.mask_cols is None else (b.mask_cols[0] + c0 - b.kv[0], b.mask_cols[0] + c1 - b.kv[0])
            pos = BlockPositions(qg, kg, p.total_lengths, causal_offset=qg - kg, h_offset=p.h_offset)
            yield _Block((r0, r1), (c0, c1), pos, causal, cols)


def _block_state_of(mask_mod: Any, device: torch.device) -> Optional[Callable[[int, int, int, int], int]]:
    """The mask_mod's state on a block of global positions (0 empty, 1 full, 2 partial), when it is known."""
    if mask_mod is None:
        return None
    declared = getattr(mask_mod, "block_state", None)
    if declared is None:
        found = mask_mod_structure(mask_mod, device)
        if found.kind == "general":
            return None
        declared = TracedMask(mask_mod, found).block_state

    def state(qs: int, qe: int, ks: int, ke: int) -> int:
        got = call_user(declared, qs, qe, ks, ke)
        return got if got in (0, 1, 2) else 2

    return state


def _mask_block(mask: Optional[Tensor], b: _Block) -> Optional[Tensor]:
    if mask is None:
        return None
    m = mask
    if m.shape[-2] != 1:
        m = m[..., b.q[0] : b.q[1], :]
    if m.shape[-1] != 1 and b.mask_cols is not None:
        m = m[..., b.mask_cols[0] : b.mask_cols[1]]
    return m


def _merge(acc_out: Tensor, acc_lse: Tensor, rows: Tuple[int, int], out: Tensor, lse: Tensor) -> None:
    """Fold a partial result over some keys into the running one: exact, by the log-sum-exp."""
    a_out, a_lse = acc_out[:, :, rows[0] : rows[1]], acc_lse[:, :, rows[0] : rows[1]]
    lse = lse.to(a_lse.dtype)
    new = torch.logaddexp(a_lse, lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # rows that still see nothing stay 0
    a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1))
    a_out.add_(out.to(a_out.dtype).mul_(torch.exp(lse - ref).unsqueeze(-1)))
    a_lse.copy_(new)


class _Stats:
    """What the last ring calls did (the benchmark and tests read it)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.blocks = 0
        self.skipped_steps = 0
        self.bytes_sent = 0


STATS = _Stats()


class _Transfer:
    """Tensors in flight to the next rank and from the previous one (``batch_isend_irecv``)."""

    def __init__(self, g: _Group, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int) -> None:
        dist = _dist()
        self.send = [t.contiguous() for t in send]  # alive until the sends complete
        self.recv = list(recv)
        ops = [dist.P2POp(dist.isend, t, g.next, g.handle, tag) for t in self.send]
        ops += [dist.P2POp(dist.irecv, t, g.prev, g.handle, tag) for t in self.recv]
        self.works = dist.batch_isend_irecv(ops) if ops else []
        STATS.bytes_sent += sum(t.numel() * t.element_size() for t in self.send)

    def wait(self) -> List[Tensor]:
        for w in self.works:
            w.wait()
        self.send = []
        return self.recv


_KV_TAG, _GRAD_TAG = 1, 2


def _kv_buffers(like_k: Tensor, like_v: Tensor, length: int) -> List[Tensor]:
    ks, vs = list(like_k.shape), list(like_v.shape)
    ks[-2] = vs[-2] = length
    return [like_k.new_empty(ks), like_v.new_empty(vs)]


def _ring_forward(call: _Call, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of this rank's queries against every rank's keys, in ``P`` ring steps."""
    g = call.g
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    Ev = v.shape[-1]
    stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc_out = torch.zeros((B, Hq, Lq, Ev), dtype=stats_dtype, device=q.device)
    acc_lse = torch.full((B, Hq, Lq), float("-inf"), dtype=stats_dtype, device=q.device)
    kv = [k, v]
    for step in range(g.size):
        src = (g.rank - step) % g.size
        transfer = None
        if step < g.size - 1:
            transfer = _Transfer(g, kv, _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size]), _KV_TAG)
        parts = [part for b in _blocks(call, src) for part in _split(call, b, call.sub_rows, 1 << 62)]
        if not parts:
            STATS.skipped_steps += 1
        for b in parts:
            with torch.no_grad():
                o, l = _run_block(call, b, q, kv, mask)
            _merge(acc_out, acc_lse, b.q, o, l)
            STATS.blocks += 1
            del o, l
        if transfer is not None:
            kv = transfer.wait()
    return acc_out.to(q.dtype), acc_lse


def _run_block(call: _Call, b: _Block, q: Tensor, kv: Sequence[Tensor], mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block through subquad's tiles, without a graph (the ring has its own backward)."""
    qb = q.detach()[:, :, b.q[0] : b.q[1]]
    kb, vb = (t.detach()[:, :, b.kv[0] : b.kv[1]] for t in kv)
    m = _mask_block(mask, b)
    out, lse, _ = _call.attention_block(
        qb, kb, vb, b.positions, attn_mask=None if m is None else m.detach(), is_causal=b.is_causal,
        score_mod=call.score_mod, mask_mod=call.mask_mod, scale=call.scale, enable_gqa=call.enable_gqa,
        memory_budget=call.budget, captured=(),
    )
    return out, lse


def _block_grads(
    call: _Call, b: _Block, q: Tensor, kv: Sequence[Tensor], mask: Optional[Tensor], grad_out: Tensor,
    out: Tensor, lse: Tensor, grad_lse: Optional[Tensor], want_mask: bool, captured: Sequence[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], List[Tensor]]:
    """dQ of the block's rows, dK/dV of its keys (and dmask, d captured) from the *global* out and lse.

    FlashAttention-2's backward needs only ``P = exp(S - lse)`` and ``D = rowsum(dO * O)``: with
    the global lse and output, the block's share of the gradients comes out directly.
    """
    rows = slice(b.q[0], b.q[1])
    qb = q[:, :, rows].detach().requires_grad_()
    kb = kv[0][:, :, b.kv[0] : b.kv[1]].detach().requires_grad_()
    vb = kv[1][:, :, b.kv[0] : b.kv[1]].detach().requires_grad_()
    mb = _mask_block(mask, b)
    if mb is not None and want_mask:
        mb = mb.detach().requires_grad_()
    with torch.enable_grad():
        inp, _, budget, plan, _ = _call.prepare(
            qb, kb, vb, attn_mask=mb, is_causal=b.is_causal, score_mod=call.score_mod, mask_mod=call.mask_mod,
            scale=call.scale, enable_gqa=call.enable_gqa, memory_budget=call.budget, return_lse=True,
            allow_compile=False, block=b.positions,
        )
    kernel = plan.backward_backend or plan.backend
    if kernel not in ("fused", "matmul"):
        kernel = "matmul"
    chunk = plan.backward_chunk_size or plan.chunk_size or (max(inp.Lq, 1), max(inp.Lk, 1))
    dq, dk, dv, dmask, dcap = backward_grads(
        inp, kernel, chunk, 0, budget, grad_out[:, :, rows], out[:, :, rows], lse[:, :, rows],
        None if grad_lse is None else grad_lse[:, :, rows], wanted=(True, True, True, want_mask), captured=captured,
    )
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv, dmask, dcap


class _Ring(torch.autograd.Function):
    """Ring attention with its own backward: dK/dV travel around the ring with K/V."""

    @staticmethod
    def forward(ctx: Any, call: _Call, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *captured: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        out, lse = _ring_forward(call, q, k, v, mask)
        ctx.save_for_backward(q, k, v, mask, out, lse, *captured)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        q, k, v, mask, out, lse, *captured = ctx.saved_tensors
        call: _Call = ctx.call
        g = call.g
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None:
            grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
        want_mask = bool(ctx.needs_input_grad[4]) and mask is not None
        acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dmask = torch.zeros(mask.shape, dtype=lse.dtype, device=q.device) if want_mask else None
        dcaptured = [torch.zeros_like(c) for c in captured]
        kv = [k, v]
        incoming: Optional[_Transfer] = None  # the dK/dV accumulator of the next keys, on its way
        for step in range(g.size):
            src = (g.rank - step) % g.size
            transfer = None
            if step < g.size - 1:
                transfer = _Transfer(g, kv, _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size]), _KV_TAG)
            # The accumulator of the keys in hand: this rank's own keys start from zero, the others
            # arrive with what the previous ranks added. Waiting for it here (not after the compute)
            # keeps one accumulator alive instead of two; the K/V transfer still overlaps.
            if incoming is None:
                dkv = [torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv]
            else:
                dkv = incoming.wait()
                incoming = None
            parts = (part for b in _blocks(call, src) for part in _split(call, b, call.sub_rows, call.sub_cols))
            for b in parts:
                gq, gk, gv, gm, gc = _block_grads(call, b, q, kv, mask, grad_out, out, lse, grad_lse, want_mask, captured)
                dq[:, :, b.q[0] : b.q[1]] += gq
                dkv[0][:, :, b.kv[0] : b.kv[1]] += gk
                dkv[1][:, :, b.kv[0] : b.kv[1]] += gv
                if dmask is not None and gm is not None:
                    target = dmask
                    if target.shape[-2] != 1:
                        target = target[..., b.q[0] : b.q[1], :]
                    if target.shape[-1] != 1 and b.mask_cols is not None:
                        target = target[..., b.mask_cols[0] : b.mask_cols[1]]
                    target += gm
                for acc, gc_ in zip(dcaptured, gc):
                    acc += gc_
                del gq, gk, gv, gm, gc
            # Send the accumulator on; after the last step it reaches the rank that owns these keys.
            arriving = [t.to(acc_dtype) for t in _kv_buffers(k, v, call.kv_lengths[(src - 1) % g.size])]
            incoming = _Transfer(g, dkv, arriving, _GRAD_TAG)
            del dkv
            if transfer is not None:
                kv = transfer.wait()
                transfer = None
        assert incoming is not None
        dk, dv = incoming.wait()
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
        return (
            None,
            *[gr if ctx.needs_input_grad[i + 1] else None for i, gr in enumerate(grads)],
            None if dmask is None else dmask.to(mask.dtype),
            *[d if ctx.needs_input_grad[5 + i] else None for i, d in enumerate(dcaptured)],
        )


# ------------------------------------------------------------------ the all-to-all (Ulysses)
def _all_to_all(g: _Group, send: List[Tensor], recv: List[Tensor]) -> None:
    _dist().all_to_all(recv, [t.contiguous() for t in send], group=g.handle)
    STATS.bytes_sent += sum(t.numel() * t.element_size() for r, t in enumerate(send) if r != g.rank)


def _seq_to_heads(g: _Group, x: Tensor, layout: str, lengths: Sequence[int]) -> Tensor:
    """``(B, H, L/P, D)`` sequence shards -> ``(B, H/P, L, D)``: this rank's heads, the whole sequence."""
    B, H, _, D = x.shape
    h = H // g.size
    send = list(x.split(h, dim=1))
    recv = [x.new_empty((B, h, lengths[r], D)) for r in range(g.size)]
    _all_to_all(g, send, recv)
    out = x.new_empty((B, h, sum(lengths), D))
    for r in range(g.size):
        for local, start, n in _pieces(layout, lengths, r):
            out[:, :, start : start + n].copy_(recv[r][:, :, local : local + n])
    return out


def _heads_to_seq(g: _Group, x: Tensor, layout: str, lengths: Sequence[int]) -> Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, H/P, L, D)`` -> ``(B, H, L/P, D)``."""
    B, h, _, D = x.shape
    send = []
    for r in range(g.size):
        runs = _pieces(layout, lengths, r)
        send.append(torch.cat([x[:, :, s : s + n] for _, s, n in runs], 2) if runs else x[:, :, :0])
    recv = [x.new_empty((B, h, lengths[g.rank], D)) for _ in range(g.size)]
    _all_to_all(g, send, recv)
    return torch.cat(recv, 1)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, g: _Group, layout: str, lengths: List[int], inverse: bool) -> Tensor:  # type: ignore[override]
        ctx.args = (g, layout, lengths, inverse)
        return (_heads_to_seq if inverse else _seq_to_heads)(g, x, layout, lengths)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None, None, None]:
        g, layout, lengths, inverse = ctx.args
        return (_seq_to_heads if inverse else _heads_to_seq)(g, grad.contiguous(), layout, lengths), None, None, None, None


# ------------------------------------------------------------------ planning and the public calls
@dataclasses.dataclass
class DistributedPlan:
    """What :func:`attention` runs on this rank: the strategy, memory and traffic, and why.

    ``per_rank_peak_bytes`` is this rank's predicted peak beyond its input shards and output:
    the transfer buffers and accumulators of the strategy plus the largest block's own peak
    (within ``memory_budget``). ``bytes_sent`` is what this rank sends, forward (and backward).
    """

    strategy: str
    world_size: int
    rank: int
    layout: str
    per_rank_peak_bytes: int
    bytes_sent_forward: int
    bytes_sent_backward: int
    steps: List[int]
    rejected: Dict[str, List[str]]
    block: Any = None

    def __str__(self) -> str:
        lines = [
            f"subquad.distributed: {self.strategy} over {self.world_size} ranks (this is rank {self.rank}), layout={self.layout}",
            f"  per-rank peak: ≈{format_bytes(self.per_rank_peak_bytes)} beyond the shards and output",
            f"  sent per rank: {format_bytes(self.bytes_sent_forward)} forward, {format_bytes(self.bytes_sent_backward)} backward",
        ]
        if self.strategy == "ring":
            lines.append(f"  ring steps: attention calls per step {self.steps} (0 = masked step, skipped)")
        for name, reasons in self.rejected.items():
            lines.append(f"  not {name}: {'; '.join(reasons)}")
        if self.block is not None:
            lines.append("  largest block: " + str(self.block).replace("\n", "\n  "))
        return "\n".join(lines)


def _ulysses_reasons(call: _Call, Hq: int, Hk: int) -> List[str]:
    P = call.g.size
    reasons = []
    if Hq % P or Hk % P:
        reasons.append(f"the heads (query {Hq}, key/value {Hk}) are not divisible by the {P} ranks")
    if call.attn_mask is not None:
        reasons.append("attn_mask: each rank would need the mask rows of every rank (Lq x Lk); use a mask_mod")
    return reasons


def _traffic(call: _Call, q: Tensor, k: Tensor, v: Tensor, strategy: str) -> Tuple[int, int]:
    """Bytes this rank sends, forward and backward."""
    P, r = call.g.size, call.g.rank
    it = q.element_size()
    acc = 4 if q.dtype in (torch.float16, torch.bfloat16) else it
    B, Hq, Hk, E, Ev = q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    if strategy == "ring":
        held = [call.kv_lengths[(r - s) % P] for s in range(P)]
        fwd = sum(held[: P - 1]) * B * Hk * (E + Ev) * it
        bwd = fwd + sum(held) * B * Hk * (E + Ev) * acc
        return fwd, bwd
    share = (P - 1) / P
    lq, lk = call.q_lengths[r], call.kv_lengths[r]
    fwd = int(share * (B * Hq * lq * (E + Ev + 1) * it + B * Hk * lk * (E + Ev) * it))
    return fwd, 2 * fwd


def _plan(call: _Call, q: Tensor, k: Tensor, v: Tensor, strategy: str, need_grad: bool) -> DistributedPlan:
    """The strategy for ``strategy='auto'`` (fewer bytes sent; ring on a tie) and its memory model."""
    P = call.g.size
    Hq, Hk = q.shape[1], k.shape[1]
    rejected: Dict[str, List[str]] = {}
    u_reasons = _ulysses_reasons(call, Hq, Hk)
    if strategy == "auto":
        if u_reasons:
            rejected["ulysses"] = u_reasons
            strategy = "ring"
        else:
            ring_bytes, uly_bytes = _traffic(call, q, k, v, "ring")[0], _traffic(call, q, k, v, "ulysses")[0]
            strategy = "ulysses" if uly_bytes < ring_bytes else "ring"
            loser = "ring" if strategy == "ulysses" else "ulysses"
            rejected[loser] = [
                f"sends {format_bytes(max(ring_bytes, uly_bytes))} per rank forward, "
                f"{strategy} {format_bytes(min(ring_bytes, uly_bytes))}" + (" (a tie goes to the ring)" if ring_bytes == uly_bytes else "")
            ]
    elif strategy == "ulysses" and u_reasons:
        raise ArgumentError("strategy='ulysses' cannot run this call: " + "; ".join(u_reasons) + ". Use strategy='ring'.")
    fwd, bwd = _traffic(call, q, k, v, strategy)
    B, E, Ev, it = q.shape[0], q.shape[-1], v.shape[-1], q.element_size()
    sit = 8 if q.dtype == torch.float64 else 4
    lq = call.q_lengths[call.g.rank]
    steps: List[int] = []
    block_plan = None
    if strategy == "ring":
        steps = [
            sum(1 for b in _blocks(call, (call.g.rank - s) % P) for _ in _split(call, b, call.sub_rows, 1 << 62))
            for s in range(P)
        ]
        longest = max(call.kv_lengths)
        kv_buf = B * Hk * longest * (E + Ev)
        peak = kv_buf * it + B * Hq * lq * (Ev + 1) * sit + B * Hq * lq * (Ev * it + sit)
        if need_grad:
            peak += B * Hq * lq * E * sit + 3 * kv_buf * sit + B * Hq * lq * E * it + kv_buf * it
        block_plan = _largest_block_plan(call, q, k, v, need_grad)
    else:
        h_q, h_k = Hq // P, Hk // P
        whole = B * h_q * call.Lq * (E + Ev + 1) * it + B * h_k * call.Lk * (E + Ev) * it
        peak = 2 * whole
        if need_grad:
            peak += 2 * whole
        block_plan = _ulysses_block_plan(call, q, k, v, need_grad)
    if block_plan is not None:
        peak += block_plan.predicted_peak_bytes
    return DistributedPlan(strategy, P, call.g.rank, call.layout, int(peak), int(fwd), int(bwd) if need_grad else 0, steps, rejected, block_plan)


def _largest_block_plan(call: _Call, q: Tensor, k: Tensor, v: Tensor, need_grad: bool) -> Any:
    best = None
    for s in range(call.g.size):
        src = (call.g.rank - s) % call.g.size
        for b in _blocks(call, src):
            size = (b.q[1] - b.q[0]) * (b.kv[1] - b.kv[0])
            if best is None or size > best[0]:
                best = (size, b, src)
    if best is None:
        return None
    _, b, src = best
    qb = q[:, :, b.q[0] : b.q[1]].detach()
    shape_k, shape_v = list(k.shape), list(v.shape)
    shape_k[2] = shape_v[2] = b.kv[1] - b.kv[0]
    kb = torch.zeros(1, dtype=k.dtype, device=k.device).expand(shape_k)
    vb = torch.zeros(1, dtype=v.dtype, device=v.device).expand(shape_v)
    if need_grad:
        qb, kb, vb = (t.detach().requires_grad_() for t in (qb, kb, vb))
    with torch.enable_grad() if need_grad else torch.no_grad():
        m = _mask_block(call.attn_mask, b)
        return _call.explain(
            qb, kb, vb, attn_mask=m, is_causal=b.is_causal, score_mod=call.score_mod, mask_mod=call.mask_mod,
            scale=call.scale, enable_gqa=call.enable_gqa, memory_budget=call.budget, return_lse=True,
            allow_compile=False, block=b.positions,
        )


def _ulysses_block_plan(call: _Call, q: Tensor, k: Tensor, v: Tensor, need_grad: bool) -> Any:
    P = call.g.size
    sq, sk, sv = list(q.shape), list(k.shape), list(v.shape)
    sq[1] //= P
    sk[1] //= P
    sv[1] //= P
    sq[2], sk[2], sv[2] = call.Lq, call.Lk, call.Lk
    qb, kb, vb = (torch.zeros(1, dtype=t.dtype, device=t.device).expand(s) for t, s in ((q, sq), (k, sk), (v, sv)))
    if need_grad:
        qb, kb, vb = (t.detach().requires_grad_() for t in (qb, kb, vb))
    with torch.enable_grad() if need_grad else torch.no_grad():
        return _call.explain(
            qb, kb, vb, is_causal=call.is_causal, score_mod=call.score_mod, mask_mod=call.mask_mod, scale=call.scale,
            enable_gqa=call.enable_gqa, memory_budget=call.budget, return_lse=True, allow_compile=False,
            block=BlockPositions(0, 0, (call.Lq, call.Lk), h_offset=call.g.rank * (q.shape[1] // P)),
        )


def _setup(
    strategy: str, query: Any, key: Any, value: Any, group: Any, is_causal: Any, score_mod: Any, mask_mod: Any,
    attn_mask: Any, scale: Any, enable_gqa: Any, memory_budget: Budget, layout: Any, return_lse: Any,
) -> Optional[Tuple[_Call, Tensor, Tensor, Tensor, Optional[Tensor]]]:
    """Check the call on every rank together; ``None`` for a group of one (run it locally)."""
    g = _group(group)
    local_error: Optional[BaseException] = None
    budget = 0
    try:
        if strategy not in STRATEGIES:
            raise ArgumentError(f"Unknown strategy={strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))}.")
        _check_layout(layout)
        _validate_local(query, key, value, attn_mask, is_causal, score_mod, mask_mod, scale, enable_gqa, return_lse)
        budget = resolve_budget(memory_budget, query.device) if memory_budget is None else parse_budget(memory_budget)
    except (TypeError, ValueError, RuntimeError) as e:
        local_error = e
    if g.size == 1:
        if local_error is not None:
            raise local_error
        return None
    rows = _agree(g, local_error, query, key, value, attn_mask, layout, is_causal, enable_gqa, scale, score_mod, mask_mod, strategy)
    q_lengths, kv_lengths = _check_agreement(rows, layout)
    batch_shape = tuple(query.shape[:-3])
    q4 = query.reshape(-1, *query.shape[-3:])
    k4 = key.reshape(-1, *key.shape[-3:])
    v4 = value.reshape(-1, *value.shape[-3:])
    m4 = None if attn_mask is None else _mask_4d(attn_mask, query)
    rows, cols = _sub_block_caps(q4.shape[0], q4.shape[1], k4.shape[1], q4.shape[2], q4.shape[3], v4.shape[3])
    call = _Call(g, layout, q_lengths, kv_lengths, batch_shape, bool(is_causal), m4, score_mod, mask_mod, scale,
                 bool(enable_gqa), budget, rows, cols, _block_state_of(mask_mod, q4.device))
    return call, q4, k4, v4, m4


def _mask_4d(mask: Tensor, query: Tensor) -> Tensor:
    """A mask shard in the engine's 4-D layout ``(B or 1, Hq or 1, Lq or 1, Lk or 1)`` (a view when it can be)."""
    m = mask.reshape((1,) * (query.dim() - mask.dim()) + tuple(mask.shape))
    batch = tuple(query.shape[:-3])
    mb = tuple(m.shape[:-3])
    if all(d == 1 for d in mb):
        return m.reshape(1, *m.shape[-3:])
    if mb == batch:
        return m.reshape(-1, *m.shape[-3:])
    try:
        return m.expand(*batch, *m.shape[-3:]).reshape(-1, *m.shape[-3:])
    except RuntimeError:
        raise ArgumentError(f"attn_mask {tuple(mask.shape)} does not broadcast to query's batch dims {batch}.") from None


def _finish(out: Tensor, lse: Tensor, batch_shape: Tuple[int, ...], return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    out = out.reshape(*batch_shape, *out.shape[1:])
    if return_lse:
        return out, lse.reshape(*batch_shape, *lse.shape[1:])
    return out


def _local(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool, score_mod: Any, mask_mod: Any, attn_mask: Any,
    scale: Any, enable_gqa: bool, memory_budget: Budget, return_lse: bool,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    return _call.attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, score_mod=score_mod, mask_mod=mask_mod,
        scale=scale, enable_gqa=enable_gqa, memory_budget=memory_budget, return_lse=return_lse, allow_compile=False,
    )


def _trivial(call: _Call, q: Tensor, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """No transfer for a call with nothing to compute (no batch, no heads, no keys anywhere)."""
    if q.shape[0] * q.shape[1] * q.shape[-1] * v.shape[-1] != 0 and call.Lk != 0:
        return None
    stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=stats, device=q.device)
    if q.requires_grad or k.requires_grad or v.requires_grad:
        out = out + 0 * (q.sum() + k.sum() + v.sum())  # connected to the inputs: zero gradients, not None
    return out, lse


def _captured(call: _Call, q: Tensor, k: Tensor, v: Tensor) -> List[Tensor]:
    if call.score_mod is None or not torch.is_grad_enabled():
        return []
    mine = call.q_pieces(call.g.rank)[:1]
    theirs = call.kv_pieces(call.g.rank)[:1]
    if not mine or not theirs:
        return []
    inp = make_inputs(q, k, v, is_causal=False, scale=call.scale, enable_gqa=call.enable_gqa, score_mod=call.score_mod)
    inp = BlockPositions(mine[0][1], theirs[0][1], (call.Lq, call.Lk), h_offset=0).apply(inp)
    return captured_tensors(inp)


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact attention of a sequence sharded across the ranks of ``group``, K/V passed around a ring.

    Shapes on each rank: ``query (..., Hq, Lq/P, E)``, ``key (..., Hk, Lk/P, E)``, ``value (..., Hk,
    Lk/P, Ev)``: this rank's shard in ``layout`` (see :func:`shard`) -> ``out (..., Hq, Lq/P, Ev)``
    (and ``lse (..., Hq, Lq/P)``), this rank's rows of the whole attention. Collective: every rank
    of the group calls it with its own shards and the same options. Equal, up to rounding, to::

        whole = lambda x: unshard(x, -2, group, layout)
        out = subquad.attention(whole(query), whole(key), whole(value), is_causal=is_causal, ...)
        out = shard(out, -2, group, layout)

    without ever gathering the sequence: in ``P`` steps this rank attends its queries to each
    rank's K/V shard as it arrives (the next transfer posted before the step's compute), each
    step a :func:`subquad.attention` call with ``return_lse`` under ``memory_budget``, and merges
    the partial results by their log-sum-exp. Blocks that ``is_causal`` masks entirely are not
    computed. Causal alignment is top-left in global positions (query ``i`` sees keys ``j <= i``).

    Args:
        group: the process group (``None``: the default group). A group of one runs
            :func:`subquad.attention`.
        score_mod, mask_mod: as in :func:`subquad.attention`, called with **global** query and key
            positions (and ``b``, ``h`` as there).
        attn_mask: this rank's shard of a mask: its query rows and every key, ``(..., Lq/P, Lk)``
            (bool, True = attend, or float, added; dims of size 1 broadcast). Float masks get gradients.
        memory_budget: the extra memory of each step's attention call (the ring adds two K/V
            shards in flight and float32 accumulators of this rank's output; see :func:`explain`).
        layout: ``"zigzag"`` (each rank holds chunks ``r`` and ``2P-1-r`` of ``2P``: the causal work is
            even) or ``"contiguous"`` (shards may differ in length).
        return_lse: also return the log-sum-exp of this rank's rows (float32; float64 for float64).

    Differentiable: the backward sends dK/dV around the ring with K/V (FlashAttention-2 with the
    saved output and global lse); nothing of size ``Lq x Lk`` exists on any rank.

    Raises:
        RuntimeError: no initialized process group.
        TypeError / ValueError: invalid arguments, or ranks that disagree (shapes other than the
            sequence length, dtype, options; zigzag shards of unequal length), raised on every rank.
        Whatever a callback raises, on its rank; the other ranks then raise when the group's
            timeout (``init_process_group(timeout=...)``) expires while they wait for it.
    """
    setup = _setup("ring", query, key, value, group, is_causal, score_mod, mask_mod, attn_mask, scale, enable_gqa,
                   memory_budget, layout, return_lse)
    if setup is None:
        return _local(query, key, value, is_causal, score_mod, mask_mod, attn_mask, scale, enable_gqa, memory_budget, return_lse)
    call, q, k, v, m = setup
    trivial = _trivial(call, q, k, v)
    if trivial is not None:
        return _finish(*trivial, call.batch_shape, return_lse)
    captured = _captured(call, q, k, v)
    out, lse = _Ring.apply(call, q, k, v, m, *captured)
    return _finish(out, lse, call.batch_shape, return_lse)


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact attention of a sharded sequence by all-to-all over heads ("Ulysses", DeepSpeed).

    Same shapes, arguments and result as :func:`ring_attention` (no ``attn_mask``: use a
    ``mask_mod``). Needs ``Hq`` and ``Hk`` divisible by the group size ``P``. An all-to-all turns
    this rank's sequence shard of all heads into the whole sequence of ``H/P`` heads; the rank
    runs :func:`subquad.attention` on them (callbacks see global positions and head indices);
    an all-to-all brings its rows back. Sends about ``(P-1)/P`` of its q, k, v and output, once;
    holds the whole sequence of ``H/P`` heads (as much as its shards). Differentiable through
    the all-to-alls.
    """
    setup = _setup("ulysses", query, key, value, group, is_causal, score_mod, mask_mod, None, scale, enable_gqa,
                   memory_budget, layout, return_lse)
    if setup is None:
        return _local(query, key, value, is_causal, score_mod, mask_mod, None, scale, enable_gqa, memory_budget, return_lse)
    call, q, k, v, _ = setup
    reasons = _ulysses_reasons(call, q.shape[1], k.shape[1])
    if reasons:
        raise ArgumentError("ulysses_attention cannot run this call: " + "; ".join(reasons) + ". Use ring_attention.")
    trivial = _trivial(call, q, k, v)
    if trivial is not None:
        return _finish(*trivial, call.batch_shape, return_lse)
    return _finish(*_ulysses(call, q, k, v), call.batch_shape, return_lse)


def _ulysses(call: _Call, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    g, P = call.g, call.g.size
    qh = _SeqToHeads.apply(q, g, call.layout, call.q_lengths, False)
    kh = _SeqToHeads.apply(k, g, call.layout, call.kv_lengths, False)
    vh = _SeqToHeads.apply(v, g, call.layout, call.kv_lengths, False)
    block = BlockPositions(0, 0, (call.Lq, call.Lk), h_offset=g.rank * (q.shape[1] // P))
    out, lse, _ = _call.attention_block(
        qh, kh, vh, block, attn_mask=None, is_causal=call.is_causal, score_mod=call.score_mod, mask_mod=call.mask_mod,
        scale=call.scale, enable_gqa=call.enable_gqa, memory_budget=call.budget,
    )
    del qh, kh, vh
    out = _SeqToHeads.apply(out, g, call.layout, call.q_lengths, True)
    lse = _SeqToHeads.apply(lse.unsqueeze(-1), g, call.layout, call.q_lengths, True).squeeze(-1)
    return out, lse


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    strategy: str = "auto",
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Context-parallel attention with the strategy :func:`explain` picks (or ``strategy``).

    ``"auto"``: the all-to-all when the heads divide among the ranks, no ``attn_mask`` is given
    and it sends fewer bytes than the ring (``P > 2`` for equal query and key heads), else the
    ring. Arguments and result as :func:`ring_attention`.
    """
    if strategy not in STRATEGIES:
        raise ArgumentError(f"Unknown strategy={strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))}.")
    if strategy == "auto":
        plan = explain(query, key, value, group=group, is_causal=is_causal, score_mod=score_mod, mask_mod=mask_mod,
                       attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, memory_budget=memory_budget, layout=layout)
        strategy = plan.strategy
    kwargs: Dict[str, Any] = dict(group=group, is_causal=is_causal, score_mod=score_mod, mask_mod=mask_mod, scale=scale,
                                  enable_gqa=enable_gqa, memory_budget=memory_budget, layout=layout, return_lse=return_lse)
    if strategy == "ulysses":
        if attn_mask is not None:
            raise ArgumentError("strategy='ulysses' takes no attn_mask (each rank would need every row of it); use a mask_mod or strategy='ring'.")
        return ulysses_attention(query, key, value, **kwargs)
    return ring_attention(query, key, value, attn_mask=attn_mask, **kwargs)


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    strategy: str = "auto",
    group: Any = None,
    is_causal: bool = False,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    memory_budget: Budget = None,
    layout: str = "zigzag",
) -> DistributedPlan:
    """What :func:`attention` would run on this rank, without running it (collective: one small all-gather).

    Returns a :class:`DistributedPlan`: the strategy and why the other was not taken, this rank's
    predicted peak memory beyond its shards, the bytes it sends forward and backward, the ring's
    attention calls per step, and the plan (:class:`subquad.Plan`) of its largest block.
    """
    setup = _setup(strategy, query, key, value, group, is_causal, score_mod, mask_mod, attn_mask, scale, enable_gqa,
                   memory_budget, layout, False)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if setup is None:
        block = _call.explain(query, key, value, attn_mask=attn_mask, is_causal=is_causal, score_mod=score_mod,
                              mask_mod=mask_mod, scale=scale, enable_gqa=enable_gqa, memory_budget=memory_budget,
                              return_lse=True, allow_compile=False)
        return DistributedPlan("local", 1, 0, layout, block.predicted_peak_bytes, 0, 0, [1], {}, block)
    call, q, k, v, _ = setup
    return _plan(call, q, k, v, strategy, need_grad)
