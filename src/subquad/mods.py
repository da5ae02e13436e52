r"""Built-in ``score_mod`` / ``mask_mod`` callbacks, FlexAttention's conventions.

Pass them to :func:`subquad.attention`::

    out = subquad.attention(q, k, v, mask_mod=mods.causal(), score_mod=mods.alibi(mods.alibi_slopes(H)))

Signatures (the engine calls them once per tile, never on the whole ``Lq x Lk`` grid)::

    score_mod(score, b, h, q_idx, kv_idx) -> score      # score (B, Hq, qc, kc) float32/float64
    mask_mod(b, h, q_idx, kv_idx) -> bool tensor          # True = attend

with broadcastable int64 indices ``b (B,1,1,1)``, ``h (1,Hq,1,1)`` (the query head), ``q_idx (1,1,qc,1)``
and ``kv_idx (1,1,1,kc)``; ``B`` is the product of the caller's batch dims. Any callable with these
signatures works; the built-ins are small classes that add optional hooks the engine looks for:

* ``mask_mod.causal_offset(Lq, Lk) -> int or None``: declares that on a call of these lengths the
  mask *is* the causal mask ``kv_idx <= q_idx + offset``; the engine then runs it as ``is_causal``
  (:func:`causal` and :func:`causal_lower_right` declare it).
* ``mask_mod.block_state(qs, qe, ks, ke) -> int``: what the mask is on query rows ``[qs, qe)`` x keys
  ``[ks, ke)`` -- :data:`EMPTY` (the tile is skipped, never computed), :data:`FULL` (computed without
  evaluating the mask) or :data:`PARTIAL` (the mask is evaluated on the tile); ``None`` means "unknown,
  evaluate the mask on the tile to find out". EMPTY and FULL must be exact; PARTIAL is always safe.
* ``mask_mod.block_states(qs, qe, q_block, ks, ke, kv_block) -> Tensor or None``: ``block_state`` of
  every tile of a grid at once (blocks of ``q_block`` rows over ``[qs, qe)`` times blocks of
  ``kv_block`` keys over ``[ks, ke)``, the last ones short), an int8 tensor ``(query blocks, key
  blocks)`` on any device with ``-1`` for "unknown". The engine asks it first: one device -> host
  transfer per call instead of a wait per tile when the mask reads tensors on a GPU (``document``).
* ``score_mod.additive_bias(b, h, q_idx, kv_idx) -> Tensor``: declares ``score_mod(s, ...) == s +
  additive_bias(...)``, which lets the planner run the mod on PyTorch's fused CPU kernel (a float
  mask per tile) when none of its tensors needs a gradient. ``mods.alibi``'s also accepts ``out=``
  (a buffer to write the tile into), for an engine that reuses one across tiles.

In the drawings below rows are queries, columns keys, ``x`` = attend, ``.`` = masked; ``Lq = Lk = 6``
unless noted. ALiBi lives in ``_alibi``, the combinators in ``_mask_combinators`` and the masks' base
in ``_mask_base``; all are imported from here.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._alibi import _Alibi as _Alibi  # re-exported: subquad's modules read the built-ins' classes here
from ._alibi import alibi, alibi_slopes
from ._callbacks import EMPTY, FULL, PARTIAL, grid_bounds
from ._mask_base import _diagonal_state, _diagonal_states, _Mask, _states
from ._mask_combinators import _AndMasks as _AndMasks
from ._mask_combinators import _OrMasks as _OrMasks
from ._mask_combinators import and_masks, or_masks

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "causal",
    "causal_lower_right",
    "sliding_window",
    "local_window",
    "alibi",
    "alibi_slopes",
    "document",
    "key_padding",
    "prefix_lm",
    "and_masks",
    "or_masks",
]

IntOrTensor = Union[int, Sequence[int], Tensor]


# ----------------------------------------------------------------------------- causal
class _Causal(_Mask):
    def causal_offset(self, q_len: int, kv_len: int) -> Optional[int]:
        # The engine runs this exactly as is_causal=True (the fused kernel's own causal flag on
        # the diagonal tiles instead of a generated mask).
        return 0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        return _diagonal_state(qs, qe, ks, ke, 0, math.inf)

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        return _diagonal_states(qs, qe, q_block, ks, ke, kv_block, 0, math.inf)

    def __repr__(self) -> str:
        return "causal()"


def causal() -> _Mask:
    """Top-left causal mask: query ``i`` sees keys ``j <= i`` (SDPA's ``is_causal``).

    ::

        Lq=4, Lk=6        keep = q_idx >= kv_idx
        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .

    Tiles above the diagonal are skipped, so it costs about half of full attention.
    """
    return _Causal()


class _CausalLowerRight(_Mask):
    def __init__(self, q_len: int, kv_len: int) -> None:
        self.q_len, self.kv_len = q_len, kv_len
        self.offset = kv_len - q_len

    def causal_offset(self, q_len: int, kv_len: int) -> Optional[int]:
        # On a call of the lengths it was built for, this is the causal mask with the diagonal
        # shifted: the engine runs it as such (tile skipping, the kernel's causal flag).
        return self.offset if (q_len, kv_len) == (self.q_len, self.kv_len) else None

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + self.offset

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        return _diagonal_state(qs, qe, ks, ke, -self.offset, math.inf)

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        return _diagonal_states(qs, qe, q_block, ks, ke, kv_block, -self.offset, math.inf)

    def __repr__(self) -> str:
        return f"causal_lower_right({self.q_len}, {self.kv_len})"


def causal_lower_right(q_len: int, kv_len: int) -> _Mask:
    """Bottom-right causal mask, the alignment of flash-attn and xformers' ``LowerTriangularFromBottomRight``.

    The last query sees every key; query ``i`` sees keys ``j <= i + kv_len - q_len``. A mask_mod is
    not told the lengths, so pass them: ``q_len = query.shape[-2]``, ``kv_len = key.shape[-2]``
    (the usual case is decoding ``q_len`` new tokens against a cache of ``kv_len`` keys).

    ::

        q_len=3, kv_len=6       q_len=5, kv_len=3
        x x x x . .             . . .        rows with no key (i < q_len - kv_len)
        x x x x x .             . . .        give output 0
        x x x x x x             x . .
                                x x .
                                x x x

    Raises:
        ValueError: a length is negative or not an int.
    """
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"causal_lower_right: expected {name} to be an int >= 0, got {n!r}.")
    return _CausalLowerRight(q_len, kv_len)


# ----------------------------------------------------------------------------- sliding window
class _SlidingWindow(_Mask):
    def __init__(self, window: int, causal: bool) -> None:
        self.window, self.causal = window, causal
        self.lo = 0 if causal else -window

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Bounds per query row, then two comparisons: no (qc, kc) int64 difference is formed.
        return (kv_idx >= q_idx - self.window) & (kv_idx <= q_idx - self.lo)

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        return _diagonal_state(qs, qe, ks, ke, self.lo, self.window)

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        return _diagonal_states(qs, qe, q_block, ks, ke, kv_block, self.lo, self.window)

    def __repr__(self) -> str:
        return f"sliding_window({self.window}, causal={self.causal})"


def sliding_window(window: int, causal: bool = False) -> _Mask:
    """Local attention: query ``i`` sees keys with ``|i - j| <= window`` (``0 <= i - j <= window`` if causal).

    Each query sees ``2·window + 1`` keys (``window + 1`` causal), so the cost is about that
    fraction of full attention: tiles outside the band are skipped, tiles inside it run unmasked.

    ::

        sliding_window(1)        sliding_window(2, causal=True)
        x x . . . .              x . . . . .
        x x x . . .              x x . . . .
        . x x x . .              x x x . . .
        . . x x x .              . x x x . .
        . . . x x x              . . x x x .
        . . . . x x              . . . x x x

    Raises:
        ValueError: ``window`` is negative or not an int.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"sliding_window: expected window to be an int >= 0, got {window!r}.")
    return _SlidingWindow(window, bool(causal))


# ----------------------------------------------------------------------------- local window with an offset
class _LocalWindow(_Mask):
    def __init__(self, left: Optional[int], right: Optional[int], offset: int) -> None:
        self.left, self.right, self.offset = left, right, offset
        # Visible: i + offset - left <= j <= i + offset + right, i.e. lo <= i - j <= hi.
        self.lo = -math.inf if right is None else -offset - right
        self.hi = math.inf if left is None else left - offset

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if self.right is not None:
            keep = keep & (kv_idx <= q_idx + (self.offset + self.right))
        if self.left is not None:
            keep = keep & (kv_idx >= q_idx + (self.offset - self.left))
        return keep

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        return _diagonal_state(qs, qe, ks, ke, self.lo, self.hi)

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        return _diagonal_states(qs, qe, q_block, ks, ke, kv_block, self.lo, self.hi)

    def __repr__(self) -> str:
        return f"local_window(left={self.left}, right={self.right}, offset={self.offset})"


def local_window(left: Optional[int] = None, right: Optional[int] = None, offset: int = 0) -> _Mask:
    """Query ``i`` sees keys ``j`` with ``i + offset - left <= j <= i + offset + right``.

    ``None`` leaves that side unbounded; ``offset`` moves the diagonal (``Lk - Lq`` aligns it to the
    bottom-right corner, as flash-attn's ``window_size`` does). Tiles outside the band are
    skipped. ::

        local_window(1, 0)           local_window(2, 1, offset=2)   (Lq=4, Lk=6)
        x . . . . .                  x x x x . .
        x x . . . .                  . x x x x .
        . x x . . .                  . . x x x x
        . . x x . .                  . . . x x x

    Raises:
        ValueError: ``left``/``right`` negative or not ints, ``offset`` not an int.
    """
    for name, value in (("left", left), ("right", right)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"local_window: expected {name} to be None or an int >= 0, got {value!r}.")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise ValueError(f"local_window: expected offset to be an int, got {offset!r}.")
    return _LocalWindow(left, right, offset)


# ----------------------------------------------------------------------------- documents
def _as_ids(name: str, ids: object) -> Tensor:
    t = ids if isinstance(ids, Tensor) else torch.as_tensor(ids)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() not in (1, 2):
        raise ValueError(
            f"document: expected {name} to be an integer tensor of shape (L,) or (B, L), "
            f"got {tuple(t.shape)} {t.dtype}."
        )
    return t.long()


class _Document(_Mask):
    def __init__(self, q_ids: Tensor, kv_ids: Tensor) -> None:
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def _lookup(self, ids: Tensor, b: Tensor, idx: Tensor) -> Tensor:
        ids = self._on(ids, idx.device)
        return ids[idx] if ids.dim() == 1 else ids[b, idx]

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self._lookup(self.q_ids, b, q_idx) == self._lookup(self.kv_ids, b, kv_idx)

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        # Per batch row: disjoint id ranges -> nothing attends; one single shared id -> everything
        # does. Exact for those two answers whatever the ids' order; otherwise PARTIAL.
        q = self.q_ids[..., qs:qe]
        k = self.kv_ids[..., ks:ke]
        if q.shape[-1] == 0 or k.shape[-1] == 0:
            return EMPTY
        q_lo, q_hi = q.amin(dim=-1), q.amax(dim=-1)
        k_lo, k_hi = k.amin(dim=-1), k.amax(dim=-1)
        if bool(((q_hi < k_lo) | (k_hi < q_lo)).all()):
            return EMPTY
        if bool(((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()):
            return FULL
        return PARTIAL

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        # block_state's test for every tile at once, on the ids' device: the caller reads the
        # grid back once, where block_state per tile waits for the device twice.
        q_lo, q_hi = _block_min_max(self.q_ids, qs, qe, q_block)
        k_lo, k_hi = _block_min_max(self.kv_ids, ks, ke, kv_block)
        q_lo, q_hi = q_lo.unsqueeze(-1), q_hi.unsqueeze(-1)
        k_lo, k_hi = k_lo.unsqueeze(-2), k_hi.unsqueeze(-2)
        empty = (q_hi < k_lo) | (k_hi < q_lo)
        full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        if empty.dim() == 3:  # per batch row: a tile is EMPTY (FULL) when it is for every row
            empty, full = empty.all(dim=0), full.all(dim=0)
        return _states(empty, full)

    def __repr__(self) -> str:
        return f"document(q_ids {tuple(self.q_ids.shape)}, kv_ids {tuple(self.kv_ids.shape)})"


def _block_min_max(ids: Tensor, start: int, end: int, block: int) -> Tuple[Tensor, Tensor]:
    """Least and greatest id of each block of ``block`` positions over ``[start, end)``, ``(..., blocks)``.

    Positions past the ids count as absent, as in ``block_state``'s slices: a block with none has
    an empty range (least > greatest), so it meets no other.
    """
    n, length = -(-(end - start) // block), ids.shape[-1]
    part = ids.narrow(-1, min(start, length), max(0, min(end, length) - start))
    shape = (*part.shape[:-1], n * block - part.shape[-1])
    info = torch.iinfo(part.dtype)
    lo = torch.cat([part, part.new_full(shape, info.max)], dim=-1).unflatten(-1, (n, block)).amin(dim=-1)
    hi = torch.cat([part, part.new_full(shape, info.min)], dim=-1).unflatten(-1, (n, block)).amax(dim=-1)
    return lo, hi


def document(ids: object, kv_ids: object = None) -> _Mask:
    """Block-diagonal mask of packed sequences: a query sees the keys of its own document.

    ``document(ids)`` for self-attention, ``document(q_ids, kv_ids)`` when queries and keys differ.
    Ids are integers of shape ``(L,)`` (shared by the batch) or ``(B, L)`` (per batch row, ``B`` the
    product of the batch dims); ``keep = q_ids[b, q_idx] == kv_ids[b, kv_idx]``.

    ::

        ids = [0, 0, 0, 1, 1, 2]
        x x x . . .
        x x x . . .
        x x x . . .
        . . . x x .
        . . . x x .
        . . . . . x

    Tiles whose query and key id ranges do not meet are skipped, so with sorted ids the cost is
    about ``sum(len_d**2) / L**2`` of full attention. Combine with :func:`causal` through
    :func:`and_masks` for causal packing.

    Raises:
        ValueError: ids that are not integer tensors of shape ``(L,)`` or ``(B, L)``.
    """
    q = _as_ids("ids" if kv_ids is None else "q_ids", ids)
    k = q if kv_ids is None else _as_ids("kv_ids", kv_ids)
    if q.device != k.device:
        raise ValueError(f"document: q_ids is on {q.device} and kv_ids on {k.device}; put them on one device.")
    if q.dim() == 2 and k.dim() == 2 and q.shape[0] != k.shape[0]:
        raise ValueError(f"document: q_ids {tuple(q.shape)} and kv_ids {tuple(k.shape)} disagree on the batch size B.")
    if q.dim() != k.dim():
        # One per-batch, one shared: give both the batch dim.
        B = max(q.shape[0] if q.dim() == 2 else 1, k.shape[0] if k.dim() == 2 else 1)
        q = q.expand(B, -1) if q.dim() == 1 else q
        k = k.expand(B, -1) if k.dim() == 1 else k
    return _Document(q.contiguous(), k.contiguous())


# ----------------------------------------------------------------------------- padding and prefix-LM
def _per_batch(name: str, value: IntOrTensor, fn: str) -> Union[int, Tensor]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{fn}: expected {name} >= 0, got {value}.")
        return value
    t = value if isinstance(value, Tensor) else torch.as_tensor(value)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() != 1:
        raise ValueError(f"{fn}: expected {name} to be an int or an integer tensor of shape (B,), got {value!r}.")
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{fn}: expected {name} >= 0, got {t.tolist()}.")
    return t.long()


def _min_max(x: Union[int, Tensor]) -> tuple:
    if isinstance(x, int):
        return x, x
    return (int(x.min()), int(x.max())) if x.numel() else (0, 0)


class _KeyPadding(_Mask):
    def __init__(self, lengths: Union[int, Tensor]) -> None:
        self.lengths = lengths
        self.lo, self.hi = _min_max(lengths)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if isinstance(self.lengths, int):
            return kv_idx < self.lengths
        return kv_idx < self._on(self.lengths, b.device)[b]

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        if ks >= self.hi:
            return EMPTY
        if ke <= self.lo:
            return FULL
        return PARTIAL

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        k0, k1 = grid_bounds(ks, ke, kv_block)
        rows = len(range(qs, qe, q_block))
        return _states(k0 >= self.hi, k1 <= self.lo).expand(rows, -1)

    def __repr__(self) -> str:
        shown = self.lengths if isinstance(self.lengths, int) else self.lengths.tolist()
        return f"key_padding({shown})"


def key_padding(lengths: IntOrTensor) -> _Mask:
    """Right padding of the keys: batch row ``b`` sees only its first ``lengths[b]`` keys.

    ``lengths`` is an int (every row) or integers of shape ``(B,)``; ``keep = kv_idx < lengths[b]``.

    ::

        lengths[b] = 4           (a row with length 0 sees nothing: its output is 0)
        x x x x . .
        x x x x . .
        ...
        x x x x . .

    Key tiles past the longest length are skipped; those inside the shortest run unmasked.

    Raises:
        ValueError: negative lengths, or not an int / 1-D integer tensor.
    """
    return _KeyPadding(_per_batch("lengths", lengths, "key_padding"))


class _PrefixLM(_Mask):
    def __init__(self, prefix_len: Union[int, Tensor]) -> None:
        self.prefix_len = prefix_len
        self.lo, self.hi = _min_max(prefix_len)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        p = self.prefix_len if isinstance(self.prefix_len, int) else self._on(self.prefix_len, b.device)[b]
        return (kv_idx < p) | (kv_idx <= q_idx)

    def block_state(self, qs: int, qe: int, ks: int, ke: int) -> int:
        causal = _diagonal_state(qs, qe, ks, ke, 0, math.inf)
        if causal == FULL or ke <= self.lo:
            return FULL
        if causal == EMPTY and ks >= self.hi:
            return EMPTY
        return PARTIAL

    def block_states(self, qs: int, qe: int, q_block: int, ks: int, ke: int, kv_block: int) -> Tensor:
        causal = _diagonal_states(qs, qe, q_block, ks, ke, kv_block, 0, math.inf)
        k0, k1 = grid_bounds(ks, ke, kv_block)
        full = (causal == FULL) | (k1 <= self.lo)
        return _states((causal == EMPTY) & (k0 >= self.hi) & ~full, full)

    def __repr__(self) -> str:
        shown = self.prefix_len if isinstance(self.prefix_len, int) else self.prefix_len.tolist()
        return f"prefix_lm({shown})"


def prefix_lm(prefix_len: IntOrTensor) -> _Mask:
    """Prefix-LM (T5/UL2, PaliGemma): bidirectional over the prefix, causal after it.

    Query ``i`` sees key ``j`` if ``j < prefix_len`` or ``j <= i``; ``prefix_len`` is an int or
    integers of shape ``(B,)`` (per batch row).

    ::

        prefix_len = 3
        x x x . . .
        x x x . . .
        x x x . . .
        x x x x . .
        x x x x x .
        x x x x x x

    Raises:
        ValueError: a negative prefix length, or not an int / 1-D integer tensor.
    """
    return _PrefixLM(_per_batch("prefix_len", prefix_len, "prefix_lm"))
