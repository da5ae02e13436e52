"""What a backend is: a way to run an attention call, described as data (xformers' ``fmha`` ops).

Each backend is one class in one module: what it supports (:meth:`Backend.not_supported_reasons`,
sentences the planner shows), its memory model (the extra bytes of a call for a tile size), the
search for the largest tiles that fit a budget (:meth:`Backend.fit`) and its compute. Adding a
backend means adding its module and naming it in :mod:`subquad._backends`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _settings as settings
from .._errors import ArgumentError
from .._inputs import Inputs
from .._tiles import Grads, Segment

TARGET_TILE_BYTES = 16 << 20
"""Preferred ceiling on what one tile materializes; larger tiles are used only if nothing smaller exists."""

ACCELERATOR_TILE_BYTES = 1 << 30
"""The same ceiling on CUDA and MPS. A GPU streams a tile's elementwise passes from its memory at
terabytes per second, so what a tile costs there is its kernel launches and Python unless it is
large: measured per ceiling on docs/benchmarks/gpu.md. The budget still bounds the tiles: this
is a preference."""

MIN_KV_CHUNK = 32
"""Key segments shorter than this cost more in per-call overhead than they save in memory."""

MPS_MAX_MATMUL_ELEMENTS = 1 << 30
"""The MPS matmul errors at 2**32 elements and has been reported to corrupt results near 2**31."""


@dataclass(frozen=True)
class Options:
    """The call's options that are not part of :class:`Inputs`."""

    return_lse: bool = False
    chunk_size: Optional[Tuple[int, int]] = None
    captured_requires_grad: bool = False
    allow_compile: bool = True
    packed: bool = False
    """The call packs sequences along its length: planned by its longest sequences (the
    :class:`Inputs` the planner sees), run in tiles one sequence at a time."""


def compile_allowed(allow_compile: Optional[bool]) -> bool:
    """``allow_compile`` if given, else the ``SUBQUAD_COMPILE`` environment variable (default on)."""
    if allow_compile is not None:
        return allow_compile
    return settings.switch("SUBQUAD_COMPILE")


def _threads() -> int:
    return max(1, torch.get_num_threads())


class Fit(NamedTuple):
    """A backend's answer to a budget: forward and backward tiles (``None``: the whole input, or
    none fit), the predicted peak, and the least any tiles would need when none fit."""

    forward: Optional[Tuple[int, int]]
    backward: Optional[Tuple[int, int]]
    predicted: int
    smallest: int


def candidates(n: int, smallest: int = 1) -> List[int]:
    """The whole length, then powers of two below it down to ``smallest``, descending."""
    if n <= max(1, smallest):
        return [max(n, 1)]
    out = [n]
    p = 1 << (n - 1).bit_length() - 1
    if p == n:
        p //= 2
    while p >= smallest:
        out.append(p)
        p //= 2
    return out


class Backend:
    """A way to run an attention call. Subclasses describe themselves as data."""

    name = ""
    tiled = True
    devices: Tuple[str, ...] = ()
    returns_rows = False
    """Whether :meth:`forward_rows` returns the rows' output (one block: used as the result, no copy)."""
    target_tile_bytes = TARGET_TILE_BYTES
    """Preferred ceiling on what one tile materializes (:meth:`tile_bytes`)."""
    square_tiles = False
    """Among tiles of one size, prefer the squarest (GEMMs of few rows or few keys run slower)."""

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = []
        if self.devices and inp.device_type not in self.devices:
            reasons.append(f"runs on {'/'.join(self.devices)} only, the tensors are on {inp.device_type}")
        elif self.tiled and inp.device_type == "mps" and not self.tile_options(inp):
            reasons.append(
                f"on MPS every matmul must stay below {MPS_MAX_MATMUL_ELEMENTS:,} elements, and even its smallest "
                f"tiles for B*H={_bh(inp):,} exceed that"
            )
        return reasons

    def notes(self, inp: Inputs) -> List[str]:
        """What ``explain()`` should say about running this call here (e.g. a first-call compile)."""
        return []

    def runs_grouped(self, inp: Inputs, tiles: Optional[Tuple[int, int]], budget: int) -> bool:
        """Whether the call, planned on ``tiles`` under ``budget`` without gradients, runs as two
        grouped matmuls instead of this backend's kernel (the fused CPU backend's decode steps)."""
        return False

    # ------------------------------------------------------------- memory model and tiles
    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        raise NotImplementedError

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        raise NotImplementedError

    def backward_backend(self, inp: Inputs, opts: Options) -> str:
        """The backend that runs this call's backward (by name)."""
        return self.name

    def tile_target(self, inp: Inputs) -> int:
        """The ceiling on :meth:`tile_bytes` for ``inp``'s device: :attr:`target_tile_bytes` on the
        CPU (its caches), at least :data:`ACCELERATOR_TILE_BYTES` on CUDA and MPS (launches)."""
        if inp.device_type == "cpu":
            return self.target_tile_bytes
        return max(self.target_tile_bytes, ACCELERATOR_TILE_BYTES)

    def tile_bytes(self, inp: Inputs, qc: int, kc: int) -> int:
        """What one tile materializes (scores, generated masks): the planner's speed heuristic."""
        return 0

    def tile_bytes_of(self, inp: Inputs) -> Callable[[int, int], int]:
        """:meth:`tile_bytes` for ``inp`` as a function of the tile sizes, with what does not
        depend on them decided once (the planner asks it of a dozen tile sizes per call)."""
        return lambda qc, kc: self.tile_bytes(inp, qc, kc)

    def tile_pairs(self, inp: Inputs) -> List[Tuple[int, int]]:
        """The ``(q_chunk, kv_chunk)`` sizes this backend would consider for the call."""
        if inp.is_causal or inp.mask_mod is not None:
            # Square, aligned tiles let whole tiles above the diagonal, or outside the mask's blocks,
            # be skipped (whole key rows would compute every tile of a row).
            pairs = [(qc, qc) for qc in candidates(min(max(inp.Lq, 1), max(inp.Lk, 1)), 8)]
            return [(max(inp.Lq, 1), max(inp.Lk, 1))] + pairs
        return [(qc, kc) for qc in candidates(inp.Lq) for kc in candidates(inp.Lk, MIN_KV_CHUNK)]

    def tile_options(self, inp: Inputs) -> List[Tuple[int, int]]:
        """Tile sizes to try, best first: large tiles, whole key rows preferred."""
        lq, lk = max(inp.Lq, 1), max(inp.Lk, 1)

        def rank(p: Tuple[int, int]) -> Tuple[int, int, int, int]:
            qc, kc = min(p[0], lq), min(p[1], lk)
            return (-qc * kc, -min(qc, kc) if self.square_tiles else 0, -p[1], -p[0])

        pairs = sorted(set(self.tile_pairs(inp)), key=rank)
        if inp.device_type == "mps":
            pairs = [p for p in pairs if inp.B * inp.Hq * p[0] * p[1] < MPS_MAX_MATMUL_ELEMENTS]
        # Bigger tiles stop paying off once what a tile materializes leaves the caches: on a 2-core
        # CPU, 1x4x4096x64 matmul tiles of 256x4096 (16 MiB of scores) ran in 141 ms, the whole
        # 4096x4096 tile in 224 ms; causal ALiBi on the fused kernel 131 ms (512x512) vs 247 ms (whole).
        target = self.tile_target(inp)
        size = self.tile_bytes_of(inp)
        fast = [p for p in pairs if size(*p) <= target]
        return fast or pairs

    def fit(self, inp: Inputs, opts: Options, budget: int, backward: Optional["Backend"] = None) -> Fit:
        """The tiles to run whose predicted peak fits ``budget`` bytes: the largest, unless the
        backend knows faster ones among those that fit (:meth:`fastest`).

        ``backward``: the backend of the call's backward when it needs gradients (its tiles follow
        that backend's own preferences; the forward's saved lse stays alive during it, so both
        share the budget). A forced ``opts.chunk_size`` is taken as is and only predicted.
        """
        need_lse = opts.return_lse or backward is not None

        def bwd(p: Tuple[int, int]) -> int:
            return backward.backward_bytes(inp, p[0], p[1], opts) if backward is not None else 0

        if not self.tiled:
            pred = self.forward_bytes(inp, inp.Lq, inp.Lk, need_lse) + (
                self.backward_bytes(inp, inp.Lq, inp.Lk, opts) if backward is not None else 0
            )
            return Fit(None, None, pred, pred)
        if opts.chunk_size is not None:
            f = opts.chunk_size
            elements = inp.B * inp.Hq * min(f[0], inp.Lq) * min(f[1], inp.Lk)
            if inp.device_type == "mps" and elements >= MPS_MAX_MATMUL_ELEMENTS:
                raise ArgumentError(
                    f"chunk_size={f} makes score tiles of {elements} elements; on MPS every matmul must stay "
                    f"below {MPS_MAX_MATMUL_ELEMENTS} (larger ones error or corrupt results)."
                )
            pred = max(self.forward_bytes(inp, *f, need_lse), inp.lse_bytes() + bwd(f) if backward is not None else 0)
            return Fit(f, f, pred, pred)
        options = self.tile_options(inp)
        fwd = self.fastest(inp, (p for p in options if self.forward_bytes(inp, *p, need_lse) <= budget), False)
        if fwd is None:
            smallest = self.forward_bytes(inp, *options[-1], need_lse) + bwd(options[-1])
            return Fit(None, None, smallest, smallest)
        fwd_pred = self.forward_bytes(inp, *fwd, need_lse)
        if backward is None:
            return Fit(fwd, None, fwd_pred, 0)
        saved = inp.lse_bytes()
        bwd_options = options if backward is self else backward.tile_options(inp)
        bwd_tiles = backward.fastest(inp, (p for p in bwd_options if saved + bwd(p) <= budget), True)
        if bwd_tiles is None:
            smallest = max(self.forward_bytes(inp, *options[-1], need_lse), saved + bwd(bwd_options[-1]))
            return Fit(None, None, smallest, smallest)
        return Fit(fwd, bwd_tiles, max(fwd_pred, saved + bwd(bwd_tiles)), 0)

    def fastest(self, inp: Inputs, fitting: Iterator[Tuple[int, int]], backward: bool) -> Optional[Tuple[int, int]]:
        """The tiles to run among ``fitting`` (those of :meth:`tile_options` that fit the budget, in
        its order), for the forward or the ``backward``; ``None`` if none fit. The first: the
        largest."""
        return next(fitting, None)

    def backward_tiles(self, inp: Inputs, budget: int) -> Tuple[int, int]:
        """Tiles for this backend's backward alone (when another backend's backward cannot run after all)."""
        saved = inp.lse_bytes()
        options = self.tile_options(inp)
        return next((p for p in options if saved + self.backward_bytes(inp, *p, Options()) <= budget), options[-1])

    def computed_blocks(self, Lq: int, Lk: int, tiles: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
        """``(rows, keys)`` of the blocks a causal mask is skipped by: a block with one visible
        score is computed whole (the tiles' own; ``None``: only the visible scores cost)."""
        return None if tiles is None or not self.tiled else (max(1, min(tiles[0], Lq)), max(1, min(tiles[1], Lk)))

    # ------------------------------------------------------------- compute
    def run_whole(self, inp: Inputs, need_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """``(out (B, Hq, Lq, Ev), lse or None)`` of the whole call in one kernel call (whole-input
        backends, and the fast path's one-call plans)."""
        raise NotImplementedError(f"the {self.name} backend runs in tiles")

    def call_buffers(self) -> ContextManager[None]:
        """The scope of one forward or one backward: buffers that the backend reuses across the
        row blocks of that pass live until it ends (none here). The engine enters it around its
        row blocks, and the planner's timing probe around its calls."""
        return contextlib.nullcontext()

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Attention of rows ``[qs, qe)`` over ``segments``: writes ``out[:, :, qs:qe]``, returns the lse
        (``(rows, lse)`` where :attr:`returns_rows`; ``out`` is ``None`` only there)."""
        raise NotImplementedError

    def backward_rows(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        segments: Iterable[Segment],
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: Grads,
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        """Accumulate the gradients of rows ``[qs, qe)`` over ``segments`` into ``grads``."""
        raise NotImplementedError


def _bh(inp: Inputs) -> int:
    return inp.B * inp.Hq


def _strided(t: Tensor) -> bool:
    """Whether the last dim of ``t`` is not contiguous (a transformed tensor has no strides to read)."""
    try:
        return t.stride(-1) != 1
    except RuntimeError:
        return False


def _generated_causal(inp: Inputs, qc: int, kc: int) -> bool:
    """Whether some tile of these sizes needs a generated causal mask (not the kernel's own flag).

    The kernel's flag is top-left within a tile: square tiles aligned with the diagonal use it.
    It returns NaN without a positive scale (:attr:`Inputs.positive_scale`), so then every partly
    visible tile gets a generated mask.
    """
    if not inp.positive_scale:
        return True
    qc, kc = min(qc, max(inp.Lq, 1)), min(kc, max(inp.Lk, 1))
    off = inp.causal_offset
    if qc >= inp.Lq and kc >= inp.Lk:
        return not (off == 0 or off >= inp.Lk - 1)  # one tile: the kernel's flag, or no mask at all
    return not (qc == kc and off % kc == 0)


def _grad_accum_bytes(inp: Inputs) -> int:
    # Half-precision gradients are accumulated across tiles in float32, then cast.
    if inp.dtype in (torch.float16, torch.bfloat16):
        q = inp.B * inp.Hq * inp.Lq * inp.E
        kv = inp.B * inp.Hk * inp.Lk * (inp.E + inp.Ev)
        return (q + kv) * (4 + inp.itemsize)
    return 0


def unit_stride(t: Tensor) -> Tensor:
    """``t`` with its last dim dense, copied only where it is not: the fused kernel and the native
    loop read rows as contiguous."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
