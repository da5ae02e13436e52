"""The base of xformers' bias classes (:class:`AttentionBias`, re-exported by ``attn_bias``) and
the helpers the classes share."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple, TypeVar, Union

import torch
from torch import Tensor

from ._materialize import materialize as _materialize
from ._reading import read_bias
from ._seqinfo import SeqLenInfo, ToDevice

_B = TypeVar("_B")


class AttentionBias:
    """Base of the bias classes: a mask (and maybe a tensor) added to ``q @ k.T`` before the softmax."""

    def materialize(
        self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
    ) -> Tensor:
        """The bias as a tensor of ``shape (..., Mq, Mkv)``: 0 where attended, ``-inf`` elsewhere (slow; for tests)."""
        return _materialize(read_bias(self), shape, dtype, device)


def _moved(bias: _B, device: ToDevice) -> _B:
    """A copy of a dataclass bias with its tensors (offsets, block tables) on ``device``."""
    data: Any = bias  # one of the dataclass biases below
    changes = {}
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if isinstance(value, (SeqLenInfo, Tensor)):
            changes[f.name] = value.to(device)
    moved: _B = dataclasses.replace(data, **changes)
    return moved


def _positive_window(window_size: int) -> None:
    if window_size <= 0:
        raise ValueError(f"Expected `window_size > 0`, but window_size={window_size}")


def _blocks(bias: Any) -> List[Tuple[int, int]]:
    """``(num_queries, num_keys)`` of each block."""
    return [(qe - qs, ke - ks) for (qs, qe), (ks, ke) in zip(bias.q_seqinfo.intervals(), bias.k_seqinfo.intervals())]
