"""What an xformers attention bias means, read from its class name and fields.

This is the one place that knows the bias classes. It reads subquad's look-alikes
(:mod:`.attn_bias`) and real xformers objects alike -- by ``type(bias).__name__`` and the fields
both define, never by module path (xformers moves these classes between packages) -- into one of
two small descriptions that the rest of the package runs and never materializes:

- :class:`Dense`: the same :class:`Band` on every batch entry's whole ``Mq x Mkv`` grid (causal
  flags, a local window), plus an optional additive tensor;
- :class:`Blocks`: block-diagonal (batch 1): sequence ``s`` is query rows ``q_starts[s]:q_starts[s+1]``
  and keys ``keys[s]`` -- a range of the key tensor, or of the sequence's row of pages.

Used by the rest of the package: :class:`Band`, :class:`Dense`, :class:`Blocks`, :data:`Reading`,
:func:`read_bias`, :data:`KNOWN`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import Tensor

from subquad import ArgumentError


@dataclass(frozen=True)
class Band:
    """The keys query row ``i`` of a block sees: ``d - left <= j <= d + right`` (``None``: unbounded).

    ``d`` is the row's diagonal: ``d = i`` (top-left) or ``d = i + Lk - Lq`` (``bottom_right``, the
    last query facing the last key). ``right = 0`` is causal. ::

        Lq=3, Lk=5   Band()        Band(right=0)   Band(True, right=0)   Band(True, left=1, right=0)
                     x x x x x     x . . . .       x x x . .             . x x . .
                     x x x x x     x x . . .       x x x x .             . . x x .
                     x x x x x     x x x . .       x x x x x             . . . x x
    """

    bottom_right: bool = False
    left: Optional[int] = None
    right: Optional[int] = None

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    @property
    def is_causal(self) -> bool:
        return self.right == 0

    def offset(self, q_len: int, k_len: int) -> int:
        """Where row ``i``'s diagonal is: key ``i + offset``."""
        return k_len - q_len if self.bottom_right else 0


FULL = Band()
CAUSAL = Band(right=0)
CAUSAL_BOTTOM_RIGHT = Band(bottom_right=True, right=0)


@dataclass(frozen=True)
class Dense:
    """A bias on each batch entry's whole grid: ``band``, plus ``tensor`` added to the scores."""

    name: str
    band: Band = FULL
    tensor: Optional[Tensor] = None


@dataclass(frozen=True)
class Blocks:
    """Block-diagonal: sequence ``s`` is query rows ``[q_starts[s], q_starts[s+1])`` and keys ``keys[s]``.

    Unpaged, ``keys[s] = (start, end)`` is a range of the key tensor (built for ``k_total`` keys);
    ranges may be gaps apart, overlap or go backwards (the *GappyKeys* biases). Paged,
    ``keys[s]`` is a range of sequence ``s``'s row of pages: logical key ``t`` is slot ``t %
    page_size`` of physical page ``block_tables[s, t // page_size]``.
    """

    name: str
    band: Band
    q_starts: Tuple[int, ...]
    keys: Tuple[Tuple[int, int], ...]
    k_total: Optional[int] = None
    block_tables: Optional[Tensor] = None
    page_size: Optional[int] = None

    @property
    def paged(self) -> bool:
        return self.block_tables is not None


Reading = Union[Dense, Blocks]


def _field(bias: object, name: str) -> object:
    if not hasattr(bias, name):
        raise ArgumentError(
            f"attn_bias of type {type(bias).__name__} has no field {name!r}, which that class has in xformers 0.0.35."
        )
    return getattr(bias, name)


def _ints(bias: object, path: str) -> List[int]:
    obj: Any = bias  # the user's attribute: checked here
    for part in path.split("."):
        obj = _field(obj, part)
    try:
        if isinstance(obj, Tensor) or any(isinstance(x, bool) for x in obj):
            raise TypeError
        return [operator.index(x) for x in obj]
    except TypeError:
        raise ArgumentError(f"Expected attn_bias.{path} to be a list of ints, got {obj!r}.") from None


def _window(bias: object, name: str, minimum: int) -> int:
    n = _field(bias, name)
    if not isinstance(n, int) or isinstance(n, bool) or n < minimum:
        raise ArgumentError(f"Expected attn_bias.{name} to be an int >= {minimum}, got {n!r} ({type(bias).__name__}).")
    return n


def _q_starts(bias: object) -> Tuple[int, ...]:
    starts = _ints(bias, "q_seqinfo.seqstart_py")
    if not starts or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ArgumentError(f"Expected attn_bias.q_seqinfo.seqstart_py to start at 0 and never decrease, got {starts}.")
    return tuple(starts)


def _consecutive(bias: object) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    starts = _ints(bias, "k_seqinfo.seqstart_py")
    return tuple(zip(starts, starts[1:])), starts[-1]


def _used(bias: object) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    """Padded and gappy keys: block ``s`` is ``seqlen_py[s]`` keys from ``seqstart_py[s]``."""
    starts, lengths = _ints(bias, "k_seqinfo.seqstart_py"), _ints(bias, "k_seqinfo.seqlen_py")
    return tuple((a, a + n) for a, n in zip(starts, lengths)), starts[-1]


def _paged_padded(bias: object) -> Tuple[Tuple[int, int], ...]:
    return tuple((0, n) for n in _ints(bias, "k_seqinfo.seqlen_py"))


def _paged_gappy(bias: object) -> Tuple[Tuple[int, int], ...]:
    starts, ends = _ints(bias, "k_seqinfo.seqstart_py"), _ints(bias, "k_seqinfo.seqlen_py")  # seqlen_py: ends
    return tuple(zip(starts, ends))


KeyReader = Callable[[object], Tuple[Tuple[Tuple[int, int], ...], int]]


def _blocks(keys: KeyReader, band: Callable[[object], Band]) -> Callable[[object], Blocks]:
    def read(bias: object) -> Blocks:
        ranges, total = keys(bias)
        return _checked(Blocks(type(bias).__name__, band(bias), _q_starts(bias), ranges, k_total=total))

    return read


def _paged(keys: Callable[[object], Tuple[Tuple[int, int], ...]], band: Band) -> Callable[[object], Blocks]:
    def read(bias: object) -> Blocks:
        tables, page_size = _field(bias, "block_tables"), _field(bias, "page_size")
        if not isinstance(tables, Tensor) or tables.dim() != 2 or tables.is_floating_point():
            raise ArgumentError(
                f"Expected attn_bias.block_tables to be a 2-D int tensor (batch, pages per row), got {tables!r}."
            )
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ArgumentError(f"Expected attn_bias.page_size to be an int > 0, got {page_size!r}.")
        return _checked(
            Blocks(type(bias).__name__, band, _q_starts(bias), keys(bias), block_tables=tables, page_size=page_size)
        )

    return read


def _checked(blocks: Blocks) -> Blocks:
    n = len(blocks.q_starts) - 1
    if len(blocks.keys) < n:
        raise ArgumentError(f"attn_bias ({blocks.name}) describes {n} query blocks but {len(blocks.keys)} key blocks.")
    keys = blocks.keys[:n]  # paged gappy offsets carry one unused entry
    row = None if blocks.block_tables is None else blocks.block_tables.shape[1] * (blocks.page_size or 0)
    limit = blocks.k_total if row is None else row
    for s, (a, e) in enumerate(keys):
        if not 0 <= a <= e or (limit is not None and e > limit):
            where = f"the {limit} keys of the bias" if row is None else f"a row of {row} paged keys"
            raise ArgumentError(
                f"attn_bias ({blocks.name}): the keys of block {s}, [{a}, {e}), are not within {where}."
            )
    if blocks.block_tables is not None and blocks.block_tables.shape[0] != n:
        raise ArgumentError(
            f"attn_bias ({blocks.name}): block_tables has {blocks.block_tables.shape[0]} rows for {n} sequences."
        )
    return Blocks(
        blocks.name, blocks.band, blocks.q_starts, keys, blocks.k_total, blocks.block_tables, blocks.page_size
    )


def _local_causal(bottom_right: bool) -> Callable[[object], Band]:
    return lambda bias: Band(bottom_right, _window(bias, "_window_size", 1) - 1, 0)


def _local(bias: object) -> Band:
    return Band(True, _window(bias, "window_left", 0), _window(bias, "window_right", 0))


def _constant(band: Band) -> Callable[[object], Band]:
    return lambda bias: band


def _dense(band: Callable[[object], Band], tensor: bool = False) -> Callable[[object], Dense]:
    def read(bias: object) -> Dense:
        t = _field(bias, "_bias") if tensor else None
        if tensor and not isinstance(t, Tensor):
            raise ArgumentError(f"Expected attn_bias._bias to be a tensor, got {type(t).__name__}.")
        return Dense(type(bias).__name__, band(bias), t)  # type: ignore[arg-type]

    return read


_READERS: Dict[str, Callable[[object], Reading]] = {
    "LowerTriangularMask": _dense(_constant(CAUSAL)),
    "LowerTriangularMaskWithTensorBias": _dense(_constant(CAUSAL), tensor=True),
    "LowerTriangularFromBottomRightMask": _dense(_constant(CAUSAL_BOTTOM_RIGHT)),
    "LowerTriangularFromBottomRightLocalAttentionMask": _dense(_local_causal(True)),
    "LocalAttentionFromBottomRightMask": _dense(_local),
    "BlockDiagonalMask": _blocks(_consecutive, _constant(FULL)),
    "BlockDiagonalCausalMask": _blocks(_consecutive, _constant(CAUSAL)),
    "BlockDiagonalCausalFromBottomRightMask": _blocks(_consecutive, _constant(CAUSAL_BOTTOM_RIGHT)),
    "BlockDiagonalCausalLocalAttentionMask": _blocks(_consecutive, _local_causal(False)),
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask": _blocks(_consecutive, _local_causal(True)),
    "BlockDiagonalPaddedKeysMask": _blocks(_used, _constant(FULL)),
    "BlockDiagonalCausalWithOffsetPaddedKeysMask": _blocks(_used, _constant(CAUSAL_BOTTOM_RIGHT)),
    "BlockDiagonalLocalAttentionPaddedKeysMask": _blocks(_used, _local),
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask": _blocks(_used, _local_causal(True)),
    "BlockDiagonalGappyKeysMask": _blocks(_used, _constant(FULL)),
    "BlockDiagonalCausalWithOffsetGappyKeysMask": _blocks(_used, _constant(CAUSAL_BOTTOM_RIGHT)),
    "PagedBlockDiagonalPaddedKeysMask": _paged(_paged_padded, FULL),
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask": _paged(_paged_padded, CAUSAL_BOTTOM_RIGHT),
    "PagedBlockDiagonalGappyKeysMask": _paged(_paged_gappy, FULL),
    "PagedBlockDiagonalCausalWithOffsetGappyKeysMask": _paged(_paged_gappy, CAUSAL_BOTTOM_RIGHT),
}

#: Every bias class of xformers 0.0.35 that subquad reads, by name.
KNOWN: Sequence[str] = tuple(_READERS)


def read_bias(bias: object) -> Reading:
    """``attn_bias`` (``None``, a tensor, or an xformers bias object) as a :data:`Reading`.

    Raises:
        NotImplementedError: a class this package does not know (named, with the known ones).
        ValueError: a known class whose fields are not what xformers 0.0.35 gives it.
    """
    if bias is None:
        return Dense("NoneType")
    if isinstance(bias, Tensor):
        return Dense("Tensor", FULL, bias)
    reader = _READERS.get(type(bias).__name__)
    if reader is None:
        raise NotImplementedError(
            f"attn_bias of type {type(bias).__module__}.{type(bias).__qualname__} is not one subquad knows. It reads "
            f"None, a tensor, and xformers 0.0.35's classes: {', '.join(KNOWN)}. Pass a materialized tensor instead "
            f"(bias.materialize((B, H, Mq, Mkv), dtype, device))."
        )
    return reader(bias)
