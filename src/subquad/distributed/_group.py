"""The process group of a call, and what the transfers of the last calls did.

Used by the rest of ``subquad.distributed``: ``Group``, ``resolve_group``, ``torch_distributed``,
``STATS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from .._errors import ArgumentError


def torch_distributed() -> Any:
    import torch.distributed as dist

    return dist


@dataclasses.dataclass(frozen=True)
class Group:
    """The process group of a call: its size, this rank, and the ring neighbours' global ranks."""

    handle: Any
    size: int
    rank: int

    def global_rank(self, r: int) -> int:
        return int(torch_distributed().get_global_rank(self.handle, r)) if self.handle is not None else r

    @property
    def next(self) -> int:
        return self.global_rank((self.rank + 1) % self.size)

    @property
    def prev(self) -> int:
        return self.global_rank((self.rank - 1) % self.size)

    def comm_device(self, like: Tensor) -> torch.device:
        """Where small control tensors live: NCCL needs them on the GPU, gloo on the CPU."""
        backend = str(torch_distributed().get_backend(self.handle)).lower()
        return like.device if "nccl" in backend else torch.device("cpu")


def resolve_group(group: Any) -> Group:
    dist = torch_distributed() if torch.distributed.is_available() else None
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
    return Group(group, size, rank)


class Stats:
    """What the last ring calls did (the benchmark and tests read it)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.blocks = 0
        self.skipped_steps = 0
        self.bytes_sent = 0


STATS = Stats()
"""Counters of this process's context-parallel calls since the last ``STATS.reset()``: ``blocks``
(attention blocks computed by the ring), ``skipped_steps`` (ring steps whose blocks the causal
mask hides entirely) and ``bytes_sent`` (by the ring and the all-to-alls). Read by the benchmark
and the tests."""
