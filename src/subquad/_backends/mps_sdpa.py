"""Torch's SDPA on Apple MPS, release by release: the kernel a call reaches, whether it holds the
``B·H·Lq·Lk`` scores, and the known defects subquad routes around.

The paths are read off torch's own dispatch for each release, ``_scaled_dot_product_attention_math_mps``
in ``aten/src/ATen/native/mps/operations/Attention.mm`` (with the Metal kernels in
``aten/src/ATen/native/mps/kernels/{DecodeAttention,PrefillAttention,MppAttention}.h`` from 2.13 on)
and the choice between it and the composite math path in
``aten/src/ATen/native/transformers/attention.cpp`` (``scaled_dot_product_attention``). The release
each kernel ships in was checked against the macOS wheels' Metal libraries. docs/devices.md has
the table with its sources; the defects are the pytorch issues named in :data:`DEFECTS`.

A call goes through :func:`route`: it names the path torch would take, applies the cheapest exact
detour for every defect of the running release that the call meets, and says where the call must
go to the tiles instead. :func:`apply` turns a route into torch's arguments. Nothing here runs on
CPU or CUDA; a release outside a defect's range pays nothing for it.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._inputs import Inputs
from . import base

Release = Tuple[int, int]

HALF = (torch.float16, torch.bfloat16)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    """What torch's MPS dispatch reads of an SDPA call."""

    dtype: torch.dtype
    B: int
    Hq: int
    Hk: int
    Lq: int
    Lk: int
    E: int
    Ev: int
    mask: Optional[torch.dtype]  # the mask's dtype; None: no mask
    is_causal: bool
    dropout: bool
    grad: bool  # autograd records the call: torch takes its composite math path
    query_rows_packed: bool  # the query's rows lie E apart (a (B, L, H, E) tensor transposed does not)
    batch_strides_packed: bool  # each of q, k, v: batch stride = heads x head stride (or batch 1)
    explicit_scale: bool  # a scale other than torch's default 1/sqrt(E)

    @property
    def scores(self) -> int:
        return self.B * self.Hq * self.Lq * self.Lk

    @classmethod
    def of(cls, inp: Inputs) -> "Call":
        q, k, v = inp.query, inp.key, inp.value
        grad = torch.is_grad_enabled() and (
            q.requires_grad
            or k.requires_grad
            or v.requires_grad
            or (inp.attn_mask is not None and inp.attn_mask.requires_grad)
        )
        return cls(
            dtype=inp.dtype,
            B=inp.B,
            Hq=inp.Hq,
            Hk=inp.Hk,
            Lq=inp.Lq,
            Lk=inp.Lk,
            E=inp.E,
            Ev=inp.Ev,
            mask=None if inp.attn_mask is None else inp.attn_mask.dtype,
            is_causal=inp.is_causal,
            dropout=inp.dropout_p > 0,
            grad=grad,
            query_rows_packed=inp.Lq <= 1 or q.stride(2) == inp.E,
            batch_strides_packed=inp.B == 1 or all(_batch_packed(t) for t in (q, k, v)),
            explicit_scale=inp.scale != default_scale(inp.E),
        )


def _batch_packed(t: Tensor) -> bool:
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def default_scale(E: int) -> float:
    """Torch's scale when none is given (``sdp::calculate_scale``: 1/sqrt(E) in double)."""
    return 1.0 / math.sqrt(E) if E > 0 else 1.0


def release(version: Optional[str] = None) -> Release:
    """``(major, minor)`` of a torch version string (the running torch's by default)."""
    text = str(torch.__version__) if version is None else version
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return (int(found.group(1)), int(found.group(2)))


# ------------------------------------------------------------------ the paths
@dataclass(frozen=True)
class Path:
    name: str
    materializes: bool
    """Whether the path holds the ``B·H·Lq·Lk`` scores (in float32, and their softmax)."""
    what: str


MATH = Path("math", True, "torch's composite math path (the scores, their softmax and any dropout mask)")
GRAPH = Path("mpsgraph", True, "MPSGraph (the scores and their softmax in float32)")
DECODE_1 = Path("decode-1pass", False, "the one-pass decode kernel")
DECODE_2 = Path("decode-2pass", False, "the two-pass decode kernel")
PREFILL = Path("prefill", False, "the prefill kernel (no scores in memory)")
MPP = Path("prefill-mpp", False, "the Metal Performance Primitives prefill kernel (no scores in memory)")

DECODE_HEAD_DIMS: Dict[Release, Tuple[int, ...]] = {(2, 8): (64, 96, 128), (2, 13): (64, 96, 128, 256)}
"""The decode kernels' head dims, from the release that first has them."""
TYPED_MASKS_FROM: Release = (2, 13)
"""Before 2.13 the decode kernels took no mask but a bool one, and no causal flag (both went to
MPSGraph); from 2.13 on they take a mask of the query's dtype too, and causal calls without a mask."""
PREFILL_FROM: Release = (2, 13)
PREFILL_HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)
MPP_FROM: Release = (2, 14)
MPP_HEAD_DIMS = (64, 96, 128, 256)


def _since(table: Dict[Release, Tuple[int, ...]], rel: Release) -> Tuple[int, ...]:
    found: Tuple[int, ...] = ()
    for first, value in sorted(table.items()):
        if rel >= first:
            found = value
    return found


@functools.lru_cache(maxsize=None)
def has_mpp() -> bool:
    """Whether this Mac has Metal Performance Primitives' tensor ops (macOS 26.2 or later), which
    torch 2.14's ``at::mps::has_mpp()`` asks. Off a Mac: no."""
    import platform

    mac = platform.mac_ver()[0]
    if not mac:
        return False
    parts = tuple(int(p) for p in mac.split(".")[:2] if p.isdigit())
    return parts >= (26, 2)


def torch_path(call: Call, rel: Release, mpp: bool = False) -> Path:
    """The kernel torch ``rel`` runs ``call`` in on MPS (``mpp``: the Mac has MPP)."""
    if call.dropout or call.grad:
        return MATH
    if call.Lq == 0 or call.Lk == 0:
        return GRAPH
    mask_ok = call.mask is None or call.mask in (torch.bool, call.dtype)
    same_dims = call.E == call.Ev
    if rel >= TYPED_MASKS_FROM:
        decode_takes = mask_ok and not (call.is_causal and call.mask is not None)
    else:
        decode_takes = call.mask in (None, torch.bool) and not call.is_causal
    decode = (
        call.Lq <= 8 and call.Lq <= call.Lk and same_dims and call.E in _since(DECODE_HEAD_DIMS, rel) and decode_takes
    )
    if decode:
        two_pass = call.Lk >= 1024 or (call.Hk < call.Hq and call.Lk >= 4096)
        return DECODE_2 if two_pass else DECODE_1
    if rel >= PREFILL_FROM and call.dtype in KERNEL_DTYPES and mask_ok and same_dims and call.Lq > 8:
        if os.environ.get("PYTORCH_MPS_DISABLE_PREFILL_ATTENTION", "0") not in ("", "0"):
            return GRAPH
        if rel >= MPP_FROM and mpp and call.dtype in HALF and call.E in MPP_HEAD_DIMS:
            return MPP
        if call.E in PREFILL_HEAD_DIMS:
            return PREFILL
    return GRAPH


# ------------------------------------------------------------------ the defects
DETOURS = {
    "contiguous": "contiguous copies",
    "causal-mask": "an explicit mask",
    "zero-mask": "a float32 mask, which takes MPSGraph,",
    "default-scale": "the scale folded into the query",
    "tiles": "subquad's tiles",
}
"""Detours, cheapest first: what each does to the call torch receives."""


@dataclass(frozen=True)
class Defect:
    """A wrong result of torch's SDPA on MPS: the releases it is in, when a call meets it, and the
    detour that avoids it exactly."""

    issue: int
    since: Release
    fixed_in: Optional[Release]  # the first release with the fix; None: not fixed, or unconfirmed
    summary: str
    meets: Callable[[Call, Path], bool]
    detour: str

    def active(self, rel: Release) -> bool:
        return rel >= self.since and (self.fixed_in is None or rel < self.fixed_in)

    @property
    def releases(self) -> str:
        since = "%d.%d" % self.since
        if self.fixed_in is None:
            return f"{since} on (not fixed)"
        last = "%d.%d" % (self.fixed_in[0], self.fixed_in[1] - 1)
        return since if last == since else f"{since}-{last}"


DECODE = (DECODE_1, DECODE_2)

DEFECTS: Tuple[Defect, ...] = (
    Defect(
        156707,
        (2, 0),
        (2, 9),
        "returns NaN for a row its mask hides entirely",
        lambda c, p: c.mask is not None,
        "tiles",
    ),
    Defect(
        163597,
        (2, 8),
        (2, 9),
        "reads a query whose rows are not E apart wrongly in its decode kernels",
        lambda c, p: p in DECODE and not c.query_rows_packed,
        "contiguous",
    ),
    Defect(
        169222,
        (2, 8),
        (2, 10),
        "reads past the keys in its decode kernels when their number is not a multiple of 32",
        lambda c, p: p in DECODE and c.Lk % 32 != 0,
        "zero-mask",
    ),
    Defect(
        174861,
        (2, 8),
        (2, 11),
        "overruns the two-pass decode kernel's scratch buffer in half precision (results vary between runs)",
        lambda c, p: p is DECODE_2 and c.dtype in HALF,
        "zero-mask",
    ),
    Defect(
        176767,
        (2, 0),
        (2, 12),
        "gets the output's shape and values wrong when the value head dim differs from the query's",
        lambda c, p: c.E != c.Ev,
        "tiles",
    ),
    Defect(
        181133,
        (2, 9),
        (2, 13),
        "ignores the batch stride of a permuted query, key or value in its decode kernels",
        lambda c, p: p in DECODE and not c.batch_strides_packed,
        "contiguous",
    ),
    Defect(
        195910,
        (2, 10),
        None,
        "leaks future keys in causal half-precision attention",
        lambda c, p: p is GRAPH and c.is_causal and c.dtype in HALF and c.Lq > 8,
        "causal-mask",
    ),
    Defect(
        184122,
        (2, 0),
        (2, 13),
        "reuses the first scale it was given for later calls of the same shapes",
        lambda c, p: c.explicit_scale,
        "default-scale",
    ),
    Defect(
        179352,
        (2, 0),
        None,
        "corrupts results, or aborts the process, on a matmul of 2^31 elements or more (subquad keeps below 2^30)",
        lambda c, p: p.materializes and c.scores >= base.MPS_MAX_MATMUL_ELEMENTS,
        "tiles",
    ),
)
"""The defects known to give wrong results, with the detour for each. ``fixed_in`` is the first
release whose source has the fix; an entry whose fix is not confirmed stays active."""


def active_defects(version: Optional[str] = None) -> List[Defect]:
    """The entries of :data:`DEFECTS` in this torch (or ``version``)."""
    rel = release(version)
    return [d for d in DEFECTS if d.active(rel)]


# ------------------------------------------------------------------ routing a call
@dataclass(frozen=True)
class Route:
    """How a call reaches torch on MPS: the call torch receives, its path, the detours taken
    (``(defect, detour)``), and ``refusal`` where only the tiles are exact."""

    call: Call
    path: Path
    detours: Tuple[Tuple[Defect, str], ...]
    refusal: Optional[str]
    version: str

    def notes(self) -> List[str]:
        return [
            f"torch {self.version} on MPS {d.summary} (pytorch#{d.issue}): {DETOURS[how]} instead"
            for d, how in self.detours
        ]


def _detoured(call: Call, how: str) -> Call:
    if how == "contiguous":
        return replace(call, query_rows_packed=True, batch_strides_packed=True)
    if how == "causal-mask":
        return replace(call, is_causal=False, mask=torch.bool)
    if how == "zero-mask":
        return replace(call, mask=torch.float32)
    if how == "default-scale":
        return replace(call, explicit_scale=False)
    raise AssertionError(how)


def route(inp: Inputs, version: Optional[str] = None, mpp: Optional[bool] = None) -> Route:
    """The route of an MPS call through torch ``version`` (the running one by default; ``mpp``:
    whether the Mac has Metal Performance Primitives, asked of this one by default)."""
    version = str(torch.__version__) if version is None else version
    return _route(Call.of(inp), version, has_mpp() if mpp is None else mpp)


@functools.lru_cache(maxsize=4096)
def _route(call: Call, version: str, mpp: bool) -> Route:
    rel = release(version)
    defects = [d for d in DEFECTS if d.active(rel)]
    taken: List[Tuple[Defect, str]] = []
    for _ in range(len(defects) + 1):
        path = torch_path(call, rel, mpp)
        met = [d for d in defects if d.meets(call, path)]
        if not met:
            return Route(call, path, tuple(taken), None, version)
        d = met[0]
        if d.detour == "tiles" or any(t is d for t, _ in taken):
            reason = f"torch {version} on MPS {d.summary} (pytorch#{d.issue}); subquad's tiles run it instead"
            return Route(call, path, tuple(taken), reason, version)
        taken.append((d, d.detour))
        call = _detoured(call, d.detour)
    raise AssertionError("the detours did not settle")  # each defect is taken at most once


def detour_bytes(inp: Inputs, r: Route) -> int:
    """What the detours add in memory: a contiguous or scaled copy of the query, a mask."""
    n = 0
    for _, how in r.detours:
        if how == "contiguous":
            n += sum(t.numel() for t in (inp.query, inp.key, inp.value) if not t.is_contiguous()) * inp.itemsize
        elif how == "default-scale":
            n += inp.query.numel() * inp.itemsize
        elif how == "causal-mask":
            n += inp.Lq * inp.Lk
        elif how == "zero-mask":
            n += (inp.Lq * inp.Lk if inp.attn_mask is None else inp.attn_mask.numel()) * 4
    return n


def path_bytes(inp: Inputs, path: Path) -> int:
    """What torch's kernel holds beyond its output on ``path``."""
    bh = inp.B * inp.Hq
    if path is MATH:  # the scores, their softmax, and dropout's float32 mask
        return bh * inp.Lq * inp.Lk * (12 if inp.dropout_p > 0 else 8)
    if path is GRAPH:  # float32 scores and softmax
        return bh * inp.Lq * inp.Lk * 8
    if path is DECODE_1:  # an attention buffer of the query's dtype, allocated and returned
        return bh * inp.Lq * inp.Lk * inp.itemsize
    if path is DECODE_2:  # 32 partial rows per query and their statistics
        return bh * inp.Lq * 32 * (inp.E * inp.itemsize + 8)
    return 0  # prefill, MPP: blocks in threadgroup memory


def _float32_mask(mask: Optional[Tensor], inp: Inputs) -> Tensor:
    """The call's mask as a float32 additive one (zeros without one)."""
    if mask is None:
        return torch.zeros(inp.Lq, inp.Lk, dtype=torch.float32, device=inp.device)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


@dataclass
class Arguments:
    """What torch's SDPA receives for a call on its route (``scale`` ``None``: torch's default)."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Optional[Tensor]
    is_causal: bool
    scale: Optional[float]


def apply(inp: Inputs, r: Route) -> Arguments:
    """Torch's arguments for ``inp`` on route ``r``: the detours applied, and the scale left to
    torch's default where it is that (a call never hands MPSGraph a scale it could confuse)."""
    a = Arguments(inp.query, inp.key, inp.value, inp.attn_mask, inp.is_causal, inp.scale)
    for _, how in r.detours:
        if how == "contiguous":
            a.query, a.key, a.value = a.query.contiguous(), a.key.contiguous(), a.value.contiguous()
        elif how == "causal-mask":
            a.attn_mask = torch.ones(inp.Lq, inp.Lk, dtype=torch.bool, device=inp.device).tril()
            a.is_causal = False
        elif how == "zero-mask":
            a.attn_mask = _float32_mask(a.attn_mask, inp)
        elif how == "default-scale":
            a.query = a.query * (inp.scale / default_scale(inp.E))
            a.scale = default_scale(inp.E)
    if a.scale == default_scale(inp.E):
        a.scale = None
    return a
