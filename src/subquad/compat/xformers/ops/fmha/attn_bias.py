r"""xformers' ``fmha.attn_bias`` classes, the same names, fields and constructors (xformers 0.0.35).

A bias object says which keys each query sees without storing the ``Mq x Mkv`` matrix; subquad's
``memory_efficient_attention`` reads it (causal flags, windows, packed sequences) and never
materializes it. ``materialize(shape)`` exists for debugging and tests. Real xformers objects are
read the same way (by class name and fields), so either kind may be passed.

Drawings: rows are queries, columns keys, ``x`` = attended; ``d = Mkv - Mq`` (bottom-right shift).

========================================================  =====================================
class                                                     query ``i`` sees key ``j`` when
========================================================  =====================================
``LowerTriangularMask``                                   ``j <= i``
``LowerTriangularFromBottomRightMask``                    ``j <= i + d``
``LowerTriangularFromBottomRightLocalAttentionMask(w)``   ``i + d - w < j <= i + d``
``LocalAttentionFromBottomRightMask(l, r)``               ``i + d - l <= j <= i + d + r``
``LowerTriangularMaskWithTensorBias(t)``                  ``j <= i``, plus ``t`` added
``BlockDiagonal*``                                        the same rules within each block
                                                          (``d`` per block; *PaddedKeys*:
                                                          the used keys of the block)
========================================================  =====================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, List, Optional, Sequence, Tuple, Type, TypeVar

import torch
from torch import Tensor

from subquad import ArgumentError

from ._bias_base import AttentionBias, _blocks, _moved, _positive_window
from ._seqinfo import Device, GappySeqInfo, PaddedSeqLenInfo, SeqLenInfo, ToDevice, default_device

# xformers' own (underscored) names for the sequence infos.
_SeqLenInfo, _PaddedSeqLenInfo, _GappySeqInfo = SeqLenInfo, PaddedSeqLenInfo, GappySeqInfo
_B = TypeVar("_B")

__all__ = [
    "AttentionBias",
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LocalAttentionFromBottomRightMask",
    "BlockDiagonalMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
    "BlockDiagonalPaddedKeysMask",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask",
    "BlockDiagonalLocalAttentionPaddedKeysMask",
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask",
    "PagedBlockDiagonalPaddedKeysMask",
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
    "BlockDiagonalGappyKeysMask",
    "BlockDiagonalCausalWithOffsetGappyKeysMask",
    "PagedBlockDiagonalGappyKeysMask",
    "PagedBlockDiagonalCausalWithOffsetGappyKeysMask",
    "VARLEN_BIASES",
]


# ----------------------------------------------------------------------------- whole-grid masks
class LowerTriangularMask(AttentionBias):
    """Causal, top-left: query ``i`` sees keys ``j <= i`` (``Mq=3, Mkv=4``)::

    x . . .
    x x . .
    x x x .
    """

    def __init__(self, device: Device = None) -> None:
        """``device`` is unused (kept for older callers), as in xformers."""

    def to(self, device: Device) -> "LowerTriangularMask":
        return self

    def add_bias(self, bias: Tensor) -> "LowerTriangularMaskWithTensorBias":
        """This mask plus an additive tensor ``bias (B, H, Mq, Mkv)``."""
        return LowerTriangularMaskWithTensorBias(bias)


class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """Causal (top-left) plus a tensor added to the scores: ``bias (B, H, Mq, Mkv)`` (it gets gradients)."""

    def __init__(self, bias: Tensor) -> None:
        self._bias = bias

    def to(self, device: Device) -> "LowerTriangularMaskWithTensorBias":
        return LowerTriangularMaskWithTensorBias(self._bias.to(device))


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, bottom-right: the last query sees every key, query ``i`` keys ``j <= i + Mkv - Mq``::

    Mq=3, Mkv=4     Mq=4, Mkv=2 (the first rows see nothing: output 0)
    x x . .         . .
    x x x .         . .
    x x x x         x .
                    x x
    """

    def to(self, device: Device) -> "LowerTriangularFromBottomRightMask":
        return self

    def make_local_attention(self, window_size: int) -> "LowerTriangularFromBottomRightLocalAttentionMask":
        """Also bound on the left: each query sees at most ``window_size`` keys."""
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Bottom-right causal with a window: ``i + d - window_size < j <= i + d`` (``window_size=2``)::

    x . . .
    x x . .
    . x x .
    . . x x
    """

    _window_size: int

    def __post_init__(self) -> None:
        _positive_window(self._window_size)

    def to(self, device: Device) -> "LowerTriangularFromBottomRightLocalAttentionMask":
        return self


@dataclass
class LocalAttentionFromBottomRightMask(AttentionBias):
    """A band around the bottom-right diagonal: ``i + d - window_left <= j <= i + d + window_right``.

    ``window_left=1, window_right=2``::

        Mq=4, Mkv=4     Mq=4, Mkv=5
        x x x .         x x x x .
        x x x x         . x x x x
        . x x x         . . x x x
        . . x x         . . . x x
    """

    window_left: int
    window_right: int

    def __post_init__(self) -> None:
        for name in ("window_left", "window_right"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"Invalid window value passed to `LocalAttentionFromBottomRightMask`: expected "
                    f"`{name} >= 0` but got {name}={getattr(self, name)}"
                )

    def to(self, device: Device) -> "LocalAttentionFromBottomRightMask":
        return self


# ----------------------------------------------------------------------------- block-diagonal
@dataclass
class BlockDiagonalMask(AttentionBias):
    """Packed sequences: queries of block ``i`` see only the keys of block ``i``.

    Inputs are ``(1, sum(M_i), H, K)`` (batch 1). ``from_tensor_list`` packs a list of tensors and
    ``split`` unpacks the output::

        bias, x = BlockDiagonalMask.from_tensor_list([x0, x1, x2])   # x0 (1, 3, H, K), ...
        out = memory_efficient_attention(q(x), k(x), v(x), attn_bias=bias)
        out0, out1, out2 = bias.split(out)

        seqlens [2, 3]:   x x . . .
                          x x . . .
                          . . x x x
                          . . x x x
                          . . x x x
    """

    q_seqinfo: SeqLenInfo
    k_seqinfo: SeqLenInfo
    _batch_sizes: Optional[Sequence[int]] = None

    def to(self, device: ToDevice) -> "BlockDiagonalMask":
        return _moved(self, device)

    @classmethod
    def from_seqlens(
        cls, q_seqlen: Sequence[int], kv_seqlen: Optional[Sequence[int]] = None, *, device: Device = None
    ) -> "BlockDiagonalMask":
        """Blocks of ``q_seqlen[i]`` queries and ``kv_seqlen[i]`` keys (default: ``q_seqlen``)."""
        if kv_seqlen is not None and len(kv_seqlen) != len(q_seqlen):
            raise ArgumentError(f"Expected as many kv_seqlen as q_seqlen, got {len(kv_seqlen)} and {len(q_seqlen)}.")
        dev = default_device(device)
        q_seqinfo = SeqLenInfo.from_seqlens(q_seqlen, device=dev)
        same = kv_seqlen is None or list(q_seqlen) == list(kv_seqlen)
        k_seqinfo = q_seqinfo if same else SeqLenInfo.from_seqlens(kv_seqlen, device=dev)  # type: ignore[arg-type]
        return cls(q_seqinfo=q_seqinfo, k_seqinfo=k_seqinfo)

    @classmethod
    def from_tensor_list(cls, tensors: Sequence[Tensor]) -> Tuple["BlockDiagonalMask", Tensor]:
        """The bias for ``tensors`` (each ``(B_i, M_i, ...)``, every batch entry a block) and them packed ``(1, sum, ...)``."""
        lengths = [x.shape[1] for x in tensors for _ in range(x.shape[0])]
        bias = cls.from_seqlens(lengths)
        bias._batch_sizes = [x.shape[0] for x in tensors]
        return bias, torch.cat([x.reshape(1, -1, *x.shape[2:]) for x in tensors], dim=1)

    @classmethod
    def from_tensor_lists_qkv(
        cls, tensors_q: Sequence[Tensor], tensors_k: Sequence[Tensor], tensors_v: Optional[Sequence[Tensor]] = None
    ) -> Tuple["BlockDiagonalMask", Tensor, Tensor, Optional[Tensor]]:
        """As :meth:`from_tensor_list` for queries and keys/values of different lengths."""
        if len(tensors_q) != len(tensors_k) or (tensors_v is not None and len(tensors_v) != len(tensors_q)):
            raise ArgumentError("Expected as many query, key (and value) tensors.")
        q_lens: List[int] = []
        k_lens: List[int] = []
        for i, (q, k) in enumerate(zip(tensors_q, tensors_k)):
            if q.shape[0] != k.shape[0] or (tensors_v is not None and tensors_v[i].shape[:2] != k.shape[:2]):
                raise ArgumentError(f"Tensor {i}: query {tuple(q.shape)} and key/value batch sizes or lengths differ.")
            q_lens += [q.shape[1]] * q.shape[0]
            k_lens += [k.shape[1]] * k.shape[0]
        bias = cls.from_seqlens(q_lens, k_lens)
        bias._batch_sizes = [q.shape[0] for q in tensors_q]

        def pack(ts: Sequence[Tensor]) -> Tensor:
            return torch.cat([x.reshape(1, -1, *x.shape[2:]) for x in ts], dim=1)

        return bias, pack(tensors_q), pack(tensors_k), None if tensors_v is None else pack(tensors_v)

    def split_queries(self, tensor: Tensor) -> Sequence[Tensor]:
        return self.q_seqinfo.split(tensor, self._batch_sizes)

    def split_kv(self, tensor: Tensor) -> Sequence[Tensor]:
        return self.k_seqinfo.split(tensor, self._batch_sizes)

    def split(self, tensor: Tensor) -> Sequence[Tensor]:
        """The inverse of :meth:`from_tensor_list`: ``(1, sum M_i, ...)`` -> ``[(B_i, M_i, ...)]``."""
        if self.q_seqinfo is not self.k_seqinfo:
            raise ArgumentError(
                "split() is for biases whose queries and keys share blocks; use split_queries / split_kv."
            )
        return self.q_seqinfo.split(tensor, self._batch_sizes)

    def _derived(self, cls: Callable[..., _B], **fields: Any) -> _B:
        return cls(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, _batch_sizes=self._batch_sizes, **fields)

    def make_causal(self) -> "BlockDiagonalCausalMask":
        """Each block causal, top-left."""
        return self._derived(BlockDiagonalCausalMask)

    def make_causal_from_bottomright(self) -> "BlockDiagonalCausalFromBottomRightMask":
        """Each block causal, bottom-right (a non-causal prefix of keys)."""
        return self._derived(BlockDiagonalCausalFromBottomRightMask)

    def make_local_attention(self, window_size: int) -> "BlockDiagonalCausalLocalAttentionMask":
        """Each block causal (top-left), each query seeing at most ``window_size`` keys."""
        return self._derived(BlockDiagonalCausalLocalAttentionMask, _window_size=window_size)

    def make_local_attention_from_bottomright(
        self, window_size: int
    ) -> "BlockDiagonalCausalLocalAttentionFromBottomRightMask":
        """Each block causal (bottom-right), each query seeing at most ``window_size`` keys."""
        return self._derived(BlockDiagonalCausalLocalAttentionFromBottomRightMask, _window_size=window_size)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """:class:`BlockDiagonalMask` with each block causal, top-left (as :class:`LowerTriangularMask`)."""


@dataclass
class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """:class:`BlockDiagonalMask` with each block causal, bottom-right; every block needs ``num_keys >= num_queries``."""

    def __post_init__(self) -> None:
        for i, (n_q, n_k) in enumerate(_blocks(self)):
            if n_k < n_q:
                raise ValueError(
                    f"Block #{i} has num_keys={n_k} and num_queries={n_q}. Expected `num_keys >= num_queries`"
                )


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    """Each block causal (top-left) with a window: ``i - _window_size < j <= i`` within the block."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        _positive_window(self._window_size)
        for n_q, n_k in _blocks(self):
            if n_q - self._window_size >= n_k:
                raise RuntimeError(
                    f"No keys are attended in q_seqlen {n_q} k_seqlen {n_k} with sliding window {self._window_size}"
                )


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):
    """Each block causal (bottom-right) with a window: ``i + d - _window_size < j <= i + d``."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_window(self._window_size)


# ----------------------------------------------------------------------------- padded keys
@dataclass
class BlockDiagonalPaddedKeysMask(AttentionBias):
    """Blocks of queries (packed) against keys in blocks of ``padding`` slots, of which block ``i`` uses ``kv_seqlen[i]``.

    The layout of a KV cache: ``key (1, B * padding, H, K)``; query block ``i`` sees the first
    ``kv_seqlen[i]`` keys of slot block ``i``, never the unused slots.
    """

    q_seqinfo: SeqLenInfo
    k_seqinfo: PaddedSeqLenInfo

    def to(self, device: ToDevice) -> "BlockDiagonalPaddedKeysMask":
        return _moved(self, device)

    @classmethod
    def from_seqlens(
        cls,
        q_seqlen: Sequence[int],
        kv_padding: int,
        kv_seqlen: Sequence[int],
        causal_diagonal: Any = None,
        *,
        device: Device = None,
    ) -> "BlockDiagonalPaddedKeysMask":
        """Query blocks of ``q_seqlen[i]``; key blocks of ``kv_padding`` slots using ``kv_seqlen[i]``. (``causal_diagonal``: unused.)"""
        if len(kv_seqlen) != len(q_seqlen):
            raise ArgumentError(f"Expected as many kv_seqlen as q_seqlen, got {list(kv_seqlen)} and {list(q_seqlen)}.")
        dev = default_device(device)
        return cls(
            q_seqinfo=SeqLenInfo.from_seqlens(q_seqlen, device=dev),
            k_seqinfo=PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, kv_padding, device=dev),
        )

    def make_paged(
        self, block_tables: Tensor, page_size: int, paged_type: Type["PagedBlockDiagonalPaddedKeysMask"]
    ) -> "PagedBlockDiagonalPaddedKeysMask":
        """The same sequences with the keys in pages: ``block_tables (B, pages per row)``."""
        k = self.k_seqinfo
        padded = PaddedSeqLenInfo(
            seqstart=k.seqstart,
            max_seqlen=k.max_seqlen,
            min_seqlen=k.min_seqlen,
            seqstart_py=k.seqstart_py,
            seqlen=k.seqlen,
            seqlen_py=k.seqlen_py,
            padding=block_tables.shape[1] * page_size,
        )
        return paged_type(q_seqinfo=self.q_seqinfo, k_seqinfo=padded, block_tables=block_tables, page_size=page_size)

    def make_local_attention(self, window_left: int, window_right: int) -> "BlockDiagonalLocalAttentionPaddedKeysMask":
        return BlockDiagonalLocalAttentionPaddedKeysMask(self.q_seqinfo, self.k_seqinfo, window_left, window_right)


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """:class:`BlockDiagonalPaddedKeysMask`, causal from the bottom-right of each block's used keys (decoding)."""

    causal_diagonal: Any = None  # unused, kept for old callers


@dataclass
class BlockDiagonalLocalAttentionPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """:class:`BlockDiagonalPaddedKeysMask` with :class:`LocalAttentionFromBottomRightMask`'s band in each block."""

    window_left: int
    window_right: int

    def __post_init__(self) -> None:
        if self.window_left < 0 or self.window_right < 0:
            raise ValueError(f"Expected window_left, window_right >= 0, got {self.window_left}, {self.window_right}.")

    @classmethod
    def from_seqlens_local(
        cls, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen: Sequence[int], window_left: int, window_right: int
    ) -> "BlockDiagonalLocalAttentionPaddedKeysMask":
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen)
        return cls(base.q_seqinfo, base.k_seqinfo, window_left, window_right)


@dataclass
class BlockDiagonalCausalLocalAttentionPaddedKeysMask(BlockDiagonalPaddedKeysMask):
    """Bottom-right causal with a window of ``_window_size`` keys in each block's used keys."""

    _window_size: int

    def __post_init__(self) -> None:
        _positive_window(self._window_size)

    @classmethod
    def from_seqlens_local(
        cls, q_seqlen: Sequence[int], kv_padding: int, kv_seqlen: Sequence[int], window_size: int
    ) -> "BlockDiagonalCausalLocalAttentionPaddedKeysMask":
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen)
        return cls(base.q_seqinfo, base.k_seqinfo, window_size)


def _check_paged(block_tables: Tensor, page_size: int) -> None:
    if not isinstance(block_tables, Tensor) or block_tables.dim() != 2:
        raise ArgumentError(
            f"Expected block_tables to be a 2-D int tensor (batch, pages per row), got {block_tables!r}."
        )
    if not isinstance(page_size, int) or page_size <= 0:
        raise ArgumentError(f"Expected page_size to be an int > 0, got {page_size!r}.")


@dataclass
class PagedBlockDiagonalPaddedKeysMask(AttentionBias):
    """:class:`BlockDiagonalPaddedKeysMask` over a paged cache.

    ``key (1, num_pages * page_size, H, K)``; sequence ``b``'s logical key ``t`` is slot ``t %
    page_size`` of page ``block_tables[b, t // page_size]``; it uses its first ``kv_seqlen[b]``.
    """

    q_seqinfo: SeqLenInfo
    k_seqinfo: PaddedSeqLenInfo
    block_tables: Tensor
    page_size: int

    _UNPAGED_TYPE: ClassVar[Type[BlockDiagonalPaddedKeysMask]] = BlockDiagonalPaddedKeysMask

    def __post_init__(self) -> None:
        _check_paged(self.block_tables, self.page_size)

    def to(self, device: ToDevice) -> "PagedBlockDiagonalPaddedKeysMask":
        return _moved(self, device)

    @classmethod
    def from_seqlens(
        cls,
        q_seqlen: Sequence[int],
        kv_seqlen: Sequence[int],
        block_tables: Tensor,
        page_size: int,
        *,
        device: Device = None,
    ) -> "PagedBlockDiagonalPaddedKeysMask":
        if len(kv_seqlen) != len(q_seqlen):
            raise ArgumentError(f"Expected as many kv_seqlen as q_seqlen, got {list(kv_seqlen)} and {list(q_seqlen)}.")
        dev = default_device(device)
        return cls(
            q_seqinfo=SeqLenInfo.from_seqlens(q_seqlen, device=dev),
            k_seqinfo=PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, block_tables.shape[1] * page_size, device=dev),
            block_tables=block_tables,
            page_size=page_size,
        )


@dataclass
class PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """:class:`PagedBlockDiagonalPaddedKeysMask`, causal from the bottom-right of each sequence's used keys."""

    _UNPAGED_TYPE: ClassVar[Type[BlockDiagonalPaddedKeysMask]] = BlockDiagonalCausalWithOffsetPaddedKeysMask


# ----------------------------------------------------------------------------- gappy keys
@dataclass
class BlockDiagonalGappyKeysMask(AttentionBias):
    """Query blocks against key ranges anywhere: block ``i`` sees ``kv_seqlen[i]`` keys from ``kv_seqstarts[i]``.

    The ranges may leave gaps, overlap or go backwards; ``kv_seqstarts`` has one more entry, the
    total key length.
    """

    q_seqinfo: SeqLenInfo
    k_seqinfo: GappySeqInfo

    def to(self, device: ToDevice) -> "BlockDiagonalGappyKeysMask":
        return _moved(self, device)

    @classmethod
    def from_seqlens(
        cls, q_seqlen: Sequence[int], kv_seqstarts: Sequence[int], kv_seqlen: Sequence[int], *, device: Device = None
    ) -> "BlockDiagonalGappyKeysMask":
        if len(kv_seqlen) != len(q_seqlen):
            raise ArgumentError(f"Expected as many kv_seqlen as q_seqlen, got {list(kv_seqlen)} and {list(q_seqlen)}.")
        dev = default_device(device)
        return cls(
            q_seqinfo=SeqLenInfo.from_seqlens(q_seqlen, device=dev),
            k_seqinfo=GappySeqInfo.from_seqlens_gappy(kv_seqstarts, kv_seqlen, False, device=dev),
        )

    def make_paged(
        self,
        block_tables: Tensor,
        page_size: int,
        notional_padding: int,
        paged_type: Type["PagedBlockDiagonalGappyKeysMask"],
    ) -> AttentionBias:
        """The same, with block ``i``'s keys living in row ``i`` of pages (rows ``notional_padding`` keys apart)."""
        if notional_padding % page_size:
            raise ValueError(
                f"Notional padding should be divisible by the page size, but got notional_padding={notional_padding}, "
                f"page_size={page_size}."
            )
        row = block_tables.shape[1] * page_size
        starts = [a - i * notional_padding for i, a in enumerate(self.k_seqinfo.seqstart_py[:-1])]
        if not all(0 <= a < row for a in starts):
            raise ArgumentError(f"Key starts {starts} (within each row) do not fit a row of {row} paged keys.")
        ends = [a + n for a, n in zip(starts, self.k_seqinfo.seqlen_py)]
        dev = block_tables.device
        k_seqinfo = GappySeqInfo(
            seqstart=torch.tensor(starts + [-1], dtype=torch.int32, device=dev),
            max_seqlen=self.k_seqinfo.max_seqlen,
            min_seqlen=self.k_seqinfo.min_seqlen,
            seqstart_py=starts + [-1],
            seqlen=torch.tensor(ends, dtype=torch.int32, device=dev),
            seqlen_py=ends,
        )
        return paged_type(q_seqinfo=self.q_seqinfo, k_seqinfo=k_seqinfo, block_tables=block_tables, page_size=page_size)


@dataclass
class BlockDiagonalCausalWithOffsetGappyKeysMask(BlockDiagonalGappyKeysMask):
    """:class:`BlockDiagonalGappyKeysMask`, causal from the bottom-right of each block."""


@dataclass
class PagedBlockDiagonalGappyKeysMask(AttentionBias):
    """:class:`BlockDiagonalGappyKeysMask` over a paged cache: block ``i`` sees slots
    ``[kv_seqstarts[i], kv_seqstarts[i] + kv_seqlen[i])`` of its own row of pages ``block_tables[i]``."""

    q_seqinfo: SeqLenInfo
    k_seqinfo: GappySeqInfo
    block_tables: Tensor
    page_size: int

    _UNPAGED_TYPE: ClassVar[Type[BlockDiagonalGappyKeysMask]] = BlockDiagonalGappyKeysMask

    def __post_init__(self) -> None:
        _check_paged(self.block_tables, self.page_size)

    def to(self, device: ToDevice) -> "PagedBlockDiagonalGappyKeysMask":
        return _moved(self, device)

    @classmethod
    def from_seqlens(
        cls,
        q_seqlen: Sequence[int],
        kv_seqstarts: Sequence[int],
        kv_seqlen: Sequence[int],
        block_tables: Tensor,
        page_size: int,
        *,
        device: Device = None,
    ) -> "PagedBlockDiagonalGappyKeysMask":
        """``kv_seqstarts[i]``: where block ``i``'s keys start within its row (one entry per block)."""
        if not len(q_seqlen) == len(kv_seqlen) == len(kv_seqstarts):
            raise ArgumentError(
                f"Expected one q_seqlen, kv_seqlen and kv_seqstarts per block, got {q_seqlen}, {kv_seqlen}, {kv_seqstarts}."
            )
        dev = block_tables.device if device is None else torch.device(device)
        return cls(
            q_seqinfo=SeqLenInfo.from_seqlens(q_seqlen, device=dev),
            k_seqinfo=GappySeqInfo.from_seqlens_gappy(kv_seqstarts, kv_seqlen, True, device=dev),
            block_tables=block_tables,
            page_size=page_size,
        )


@dataclass
class PagedBlockDiagonalCausalWithOffsetGappyKeysMask(PagedBlockDiagonalGappyKeysMask):
    """:class:`PagedBlockDiagonalGappyKeysMask`, causal from the bottom-right of each block."""

    _UNPAGED_TYPE: ClassVar[Type[BlockDiagonalGappyKeysMask]] = BlockDiagonalCausalWithOffsetGappyKeysMask


VARLEN_BIASES = (
    BlockDiagonalMask,
    BlockDiagonalGappyKeysMask,
    BlockDiagonalPaddedKeysMask,
    PagedBlockDiagonalPaddedKeysMask,
    PagedBlockDiagonalGappyKeysMask,
)
"""The biases of packed sequences (inputs of batch 1), as xformers lists them, for code that checks
``isinstance(attn_bias, VARLEN_BIASES)``."""
