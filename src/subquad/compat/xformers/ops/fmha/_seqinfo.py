"""How a block-diagonal bias divides the packed length: xformers' ``_SeqLenInfo`` and its two variants.

The rest of the package uses :class:`SeqLenInfo`, :class:`PaddedSeqLenInfo`, :class:`GappySeqInfo`
(``attn_bias`` also publishes them under xformers' names ``_SeqLenInfo``, ...) and
:func:`default_device`. Each keeps its offsets twice, as xformers does: a Python list (``*_py``,
what subquad reads, so no device sync is needed) and an int32 tensor (``seqstart``/``seqlen``, for
code that hands them to a kernel).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from subquad import ArgumentError

Device = Union[str, torch.device, None]
ToDevice = Union[str, torch.device]  # what the offsets' .to() takes (torch.device(None) raises)


def default_device(device: Device = None) -> torch.device:
    """xformers' default for the offsets: the accelerator when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    mtia = getattr(torch, "mtia", None)
    if mtia is not None and mtia.is_available():
        return torch.device("mtia")
    return torch.device("cpu")


def _int32(values: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _moved(t: Tensor, device: Device) -> Tensor:
    return t if device is None or t.device == torch.device(device) else t.to(device)


def _check_lengths(name: str, lengths: Any) -> List[int]:
    """Python ints >= 0 (numpy integers too); a tensor is refused (its values would need a device sync)."""
    try:
        if isinstance(lengths, Tensor) or any(isinstance(n, bool) for n in lengths):
            raise TypeError
        values = [operator.index(n) for n in lengths]
    except TypeError:
        values = [-1]
    if any(n < 0 for n in values):
        raise ArgumentError(
            f"Expected {name} to be a sequence of ints >= 0 (a Python list, not a tensor), got {lengths!r}."
        )
    return values


@dataclass
class SeqLenInfo:
    """A length divided into consecutive blocks: block ``i`` is ``[seqstart_py[i], seqstart_py[i+1])``.

    ``from_seqlens([2, 3, 2])`` gives ``seqstart_py = [0, 2, 5, 7]``, ``max_seqlen = 3``,
    ``min_seqlen = 2`` (both ``-1`` when there are no blocks).
    """

    seqstart: Tensor
    max_seqlen: int
    min_seqlen: int
    seqstart_py: List[int]

    def to(self, device: ToDevice) -> "SeqLenInfo":
        if self.seqstart.device == torch.device(device):
            return self
        return SeqLenInfo(_moved(self.seqstart, device), self.max_seqlen, self.min_seqlen, self.seqstart_py)

    def intervals(self) -> Iterator[Tuple[int, int]]:
        """``(start, end)`` of each block."""
        yield from zip(self.seqstart_py, self.seqstart_py[1:])

    @staticmethod
    def _starts(seqlens: Iterable[int]) -> Tuple[int, int, List[int]]:
        lengths = _check_lengths("seqlens", list(seqlens) if not isinstance(seqlens, Tensor) else seqlens)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return (min(lengths) if lengths else -1), (max(lengths) if lengths else -1), starts

    @classmethod
    def from_seqlens(cls, seqlens: Iterable[int], *, device: Device = None) -> "SeqLenInfo":
        """Consecutive blocks of these lengths (offsets on ``device``, default as xformers')."""
        lo, hi, starts = cls._starts(seqlens)
        return cls(seqstart=_int32(starts, default_device(device)), max_seqlen=hi, min_seqlen=lo, seqstart_py=starts)

    def from_seqlens_inplace(self, seqlens: Iterable[int]) -> None:
        """Update in place with as many blocks, none longer than ``max_seqlen`` (CUDA graphs)."""
        _lo, hi, starts = self._starts(seqlens)
        if len(starts) != len(self.seqstart_py) or hi > self.max_seqlen:
            raise ArgumentError(
                f"An in-place update keeps the number of blocks ({len(self.seqstart_py) - 1}) and max_seqlen "
                f"({self.max_seqlen}); got {len(starts) - 1} blocks of max length {hi}."
            )
        self.seqstart_py[:] = starts
        self.seqstart.copy_(_int32(starts, self.seqstart.device))

    def split(self, x: Tensor, batch_sizes: Optional[Sequence[int]] = None) -> List[Tensor]:
        """``x (1, total, ...)`` back into one tensor per input of ``from_tensor_list`` (``(b_i, M_i, ...)``)."""
        if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != self.seqstart_py[-1]:
            raise ArgumentError(
                f"Invalid `torch.Tensor` of shape {tuple(x.shape)}, expected format (B, M, *) with B=1 and "
                f"M={self.seqstart_py[-1]}\n seqstart: {self.seqstart_py}"
            )
        sizes = [1] * (len(self.seqstart_py) - 1) if batch_sizes is None else list(batch_sizes)
        chunks, first = [], 0
        for b in sizes:
            chunks.append(self.seqstart_py[first + b] - self.seqstart_py[first])
            first += b
        return [t.reshape(b, -1, *t.shape[2:]) for b, t in zip(sizes, x.split(chunks, dim=1))]


@dataclass
class PaddedSeqLenInfo(SeqLenInfo):
    """Blocks of ``padding`` slots each, of which block ``i`` uses the first ``seqlen_py[i]``.

    ``from_seqlens_padded([2, 3, 2], 4)``: ``seqstart_py = [0, 4, 8, 12]``, used ``[0, 2)``,
    ``[4, 7)``, ``[8, 10)``.
    """

    seqlen: Tensor
    seqlen_py: List[int]
    padding: int

    def __post_init__(self) -> None:
        if len(self.seqstart_py) != len(self.seqlen_py) + 1:
            raise ArgumentError(
                f"Expected one more seqstart than seqlen, got {len(self.seqstart_py)} and {len(self.seqlen_py)}."
            )

    def to(self, device: ToDevice) -> "PaddedSeqLenInfo":
        if self.seqlen.device == torch.device(device):
            return self
        return PaddedSeqLenInfo(
            _moved(self.seqstart, device),
            self.max_seqlen,
            self.min_seqlen,
            self.seqstart_py,
            _moved(self.seqlen, device),
            self.seqlen_py,
            self.padding,
        )

    def intervals(self) -> Iterator[Tuple[int, int]]:
        for start, n in zip(self.seqstart_py, self.seqlen_py):
            yield start, start + n

    @classmethod
    def from_seqlens(cls, seqlens: Iterable[int], *, device: Device = None) -> "SeqLenInfo":
        raise RuntimeError("Use either `_SeqLenInfo.from_seqlens` or `_PaddedSeqLenInfo.from_seqlens_padded`")

    @classmethod
    def from_seqlens_padded(cls, seqlens: Sequence[int], padding: int, *, device: Device = None) -> "PaddedSeqLenInfo":
        """Blocks of ``padding`` slots, block ``i`` using ``seqlens[i]`` of them."""
        lengths = _check_lengths("seqlens", seqlens)
        if any(n > padding for n in lengths):
            raise ArgumentError(f"Expected every seqlen <= padding, got seqlens {lengths} and padding {padding}.")
        dev = default_device(device)
        starts = list(range(0, len(lengths) * padding + 1, padding)) if padding > 0 else [0] * (len(lengths) + 1)
        return cls(
            seqstart=_int32(starts, dev),
            max_seqlen=max(lengths, default=-1),
            min_seqlen=min(lengths, default=-1),
            seqstart_py=starts,
            seqlen=_int32(lengths, dev),
            seqlen_py=lengths,
            padding=padding,
        )

    def from_seqlens_padded_inplace(self, seqlens: Sequence[int]) -> None:
        """Update the used lengths in place (same count, none over ``max_seqlen``); padding is kept."""
        lengths = _check_lengths("seqlens", seqlens)
        if len(lengths) != len(self.seqlen_py) or max(lengths, default=-1) > self.max_seqlen:
            raise ArgumentError(
                f"An in-place update keeps the number of blocks ({len(self.seqlen_py)}) and max_seqlen "
                f"({self.max_seqlen}); got {lengths}."
            )
        self.seqlen_py[:] = lengths
        self.seqlen.copy_(_int32(lengths, self.seqlen.device))

    def split(self, x: Tensor, batch_sizes: Optional[Sequence[int]] = None) -> List[Tensor]:
        raise NotImplementedError("_PaddedSeqLenInfo.split")


@dataclass
class GappySeqInfo(SeqLenInfo):
    """Blocks anywhere: block ``i`` is ``[seqstart_py[i], seqstart_py[i] + seqlen_py[i])`` (they may overlap).

    The last ``seqstart_py`` entry is the total length. Paged (``paged=True``): each block lives in
    its own row of pages, ``seqstart_py[i]`` is its first slot in that row and ``seqlen_py[i]`` its
    end (start + length); the last start is ``-1``. (``intervals()`` keeps the unpaged reading, as
    xformers' does.)
    """

    seqlen: Tensor
    seqlen_py: Sequence[int]

    def to(self, device: ToDevice) -> "GappySeqInfo":
        if self.seqlen.device == torch.device(device):
            return self
        return GappySeqInfo(
            _moved(self.seqstart, device),
            self.max_seqlen,
            self.min_seqlen,
            self.seqstart_py,
            _moved(self.seqlen, device),
            self.seqlen_py,
        )

    def intervals(self) -> Iterator[Tuple[int, int]]:
        for start, n in zip(self.seqstart_py, self.seqlen_py):
            yield start, start + n

    @classmethod
    def from_seqlens(cls, seqlens: Iterable[int], *, device: Device = None) -> "SeqLenInfo":
        raise NotImplementedError()

    @classmethod
    def from_seqlens_gappy(
        cls, seqstarts: Sequence[int], seqlens: Sequence[int], paged: bool, *, device: Device
    ) -> "GappySeqInfo":
        """Blocks starting at ``seqstarts[i]`` (one more entry: the total) of ``seqlens[i]`` keys."""
        lengths = _check_lengths("seqlens", seqlens)
        if not lengths:
            raise ValueError("No elements")
        # Paged: one start per block (xformers 0.0.35 demands one more here, which its own paged
        # from_seqlens never passes; the extra entry is accepted and ignored).
        extra = len(seqstarts) - len(lengths)
        if extra != 1 and not (paged and extra == 0):
            raise ValueError(f"len(seqstarts)={seqstarts} should be len(seqlens)={lengths}")
        starts = list(seqstarts)
        ends = lengths
        if paged:
            starts = starts[: len(lengths)] + [-1]
            ends = [s + n for s, n in zip(starts, lengths)]
        dev = torch.device(device) if device is not None else default_device()
        return cls(
            seqstart=_int32(starts, dev),
            max_seqlen=max(lengths),
            min_seqlen=min(lengths),
            seqstart_py=starts,
            seqlen=_int32(ends, dev),
            seqlen_py=ends,
        )

    def split(self, x: Tensor, batch_sizes: Optional[Sequence[int]] = None) -> List[Tensor]:
        raise NotImplementedError("_GappySeqInfo.split")
