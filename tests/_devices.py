"""Simulated CUDA and MPS devices: what the suite checks of their code paths on a machine without them.

No CUDA or MPS device runs here; four simulations stand in (issue 27):

- :func:`fake_tensors`: tensors that report ``cuda``/``mps`` (``FakeTensorMode``: shapes, dtypes and
  devices, no data). Enough to plan a call, build its inputs and ask for its memory; the tile
  loop itself cannot run on them (Python indexing of a fake CUDA tensor asks for a CUDA device
  guard, which a CPU build of torch does not have).
- :func:`as_device`: real CPU tensors with every device-specific choice of subquad taken as on
  ``cuda``/``mps`` (``Inputs.device_type`` overridden): the GPU branches of the planner and the
  tile loop run here, on data, and are compared with float64.
- :func:`device_memory`: the memory queries of a device (``torch.cuda.mem_get_info``, the
  per-process fraction, ``torch.mps.recommended_max_memory``) answered with given numbers.
- :class:`OpRecorder`: every aten op a call runs, with the dtypes it produced, and the ops that
  make a GPU wait for the host (``aten._local_scalar_dense`` is ``.item()``, ``bool(tensor)``,
  ``.tolist()``; ``nonzero`` and friends have data-dependent shapes).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from subquad import _budget
from subquad._inputs import Inputs

SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten._unique2.default",
        "aten.unique_consecutive.default",
        "aten.unique_dim.default",
    }
)
"""Ops whose result a GPU must hand to the host before Python can go on (a device -> host sync)."""


@contextlib.contextmanager
def fake_tensors() -> Iterator[Any]:
    """Tensors made inside report any device (``torch.randn(..., device="mps")``) and hold no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def as_device(monkeypatch: Any, device_type: str) -> None:
    """Until the test ends, subquad takes every device-specific choice as on ``device_type``
    (``"cuda"``, ``"mps"``) while the tensors stay on the CPU."""
    monkeypatch.setattr(Inputs, "device_type", property(lambda self: device_type))


def device_memory(
    monkeypatch: Any,
    *,
    cuda_free: Optional[int] = None,
    cuda_total: Optional[int] = None,
    cuda_fraction: Optional[float] = None,
    cuda_allocated: int = 0,
    cuda_reserved: int = 0,
    mps_recommended: Optional[int] = None,
    mps_allocated: int = 0,
) -> None:
    """The device memory queries subquad makes, answered with these numbers (bytes)."""
    if cuda_free is not None:
        total = cuda_total if cuda_total is not None else cuda_free
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (cuda_free, total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: cuda_allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cuda_reserved)
        stats = {
            "allocated_bytes": {"all": {"current": cuda_allocated}},
            "reserved_bytes": {"all": {"current": cuda_reserved}},
        }
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
        monkeypatch.setattr(_budget, "_CUDA_FREE_CACHE", {})  # the driver's numbers are read afresh
        fraction = 1.0 if cuda_fraction is None else cuda_fraction  # 1.0: torch's default, no cap
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction, raising=False)
    if mps_recommended is not None:
        monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: mps_recommended, raising=False)
        monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: mps_allocated, raising=False)


@dataclass
class Op:
    name: str
    out_dtypes: Tuple[torch.dtype, ...]
    in_dtypes: Tuple[torch.dtype, ...]
    out_shapes: Tuple[Tuple[int, ...], ...]


@dataclass
class OpRecorder(TorchDispatchMode):
    """Records every aten op run inside it: ``ops`` in order, ``syncs`` (device -> host waits)."""

    ops: List[Op] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        ins = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        tensors = [o for o in outs if isinstance(o, torch.Tensor)]
        self.ops.append(
            Op(
                str(func),
                tuple(o.dtype for o in tensors),
                tuple(a.dtype for a in ins),
                tuple(tuple(o.shape) for o in tensors),
            )
        )
        return out

    @property
    def syncs(self) -> int:
        return sum(1 for op in self.ops if op.name in SYNC_OPS)

    def count(self, name: str) -> int:
        return sum(1 for op in self.ops if op.name.startswith(name))

    def named(self, *names: str) -> List[Op]:
        """The ops whose aten name starts with one of ``names`` (``"aten.bmm"``, ``"aten.baddbmm"``)."""
        return [op for op in self.ops if op.name.startswith(names)]

    def summary(self) -> Counter:
        return Counter(op.name for op in self.ops)
