"""The ``flex`` backend: PyTorch's FlexAttention, compiled, for calls with callbacks.

``torch.compile(flex_attention)`` turns ``score_mod``/``mask_mod`` into one fused kernel (on CPU an
inductor C++ template, on CUDA a Triton kernel): scores, the callback, the mask and the online
softmax in one loop, with no tile ever materialized. subquad hands it:

* a ``BlockMask`` built on the call's device from subquad's own tile states (causal analytically,
  built-in masks by their ``block_states`` for the whole grid at once, read back in one transfer,
  other ``mask_mod``\\ s evaluated on the device one block row at a time), never from an
  ``Lq x Lk`` evaluation, and cached per (mask, shapes);
* the call's ``score_mod`` and a ``mask_mod`` that combines the causal flag and the caller's mask.

Compiling costs seconds on the first call of a signature (``explain()`` says so); torch
recompiles for new shapes at most once more (then with dynamic shapes). A call that cannot be
compiled (no C++ compiler, an untraceable callback, torch's recompile limit), or whose BlockMask
cannot be built, runs the tiles instead, with a warning naming the reason (``explain()`` names it
for the later calls of its signature). ``allow_compile=False`` or ``SUBQUAD_COMPILE=0``
turn this backend off. Inference only: FlexAttention has no CPU backward, and on CUDA its backward
is not wired into subquad's budget yet, so calls that need gradients run the tiles.
"""

from __future__ import annotations

import collections
import importlib.util
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._callbacks import EMPTY, FULL, PARTIAL, UNKNOWN, eval_mask_mod, grid_states
from .._inputs import Inputs
from .._tiles import TILES
from .._traced import callback_key, value_key
from .base import Backend, Options, _threads

BLOCK = 128
"""FlexAttention's block size (queries and keys); the BlockMask says which blocks to compute."""

MIN_SCORES = 1 << 20
"""Calls with fewer scores run the tiles: compiling cannot pay off there."""

# A mask_mod without declared block states is evaluated one block row at a time, over as many
# keys as keep its result (bool, per batch entry and head) and two int64 intermediates (per
# position) near this size.
_EVAL_BYTES = 2 << 20


def _eval_keys(inp: Inputs) -> int:
    per_key = BLOCK * (inp.B * inp.Hq * 2 + 2 * 8)
    return max(BLOCK, _EVAL_BYTES // per_key // BLOCK * BLOCK)


_COMPILED: List[Callable[..., Tensor]] = []
_LOCK = threading.Lock()
# Why compiling failed: per signature, or per device type where no call on it can compile
# (no Triton on CUDA, no C++ compiler on CPU).
_FAILED: Dict[Any, str] = {}
_STATIC_ONLY: set = set()  # signatures that compile only with static shapes
_NO_BLOCK_MASK: Dict[Any, str] = {}  # signature -> why building its BlockMask failed
_COMPILE_SECONDS: Dict[Any, float] = {}  # signature -> measured first-call time
_BLOCK_MASKS: "collections.OrderedDict[Any, Tuple[Any, Tuple[int, int], List[Any]]]" = collections.OrderedDict()
_BLOCK_MASK_CACHE_SIZE = 16


class FlexUnavailable(RuntimeError):
    """FlexAttention could not run this call (compiling failed); the tiles run it instead."""


def _flex_unavailable_reason(device_type: Optional[str] = None) -> Optional[str]:
    """Why no call (on ``device_type``) can take this path in this process (imports
    torch._dynamo: ask last)."""
    if device_type in _FAILED:
        return _FAILED[device_type]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return "this PyTorch has no torch.nn.attention.flex_attention"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        # FlexAttention compiles to a Triton kernel on CUDA: without Triton the first call would
        # only fail after tracing (seconds), then warn.
        return "FlexAttention on CUDA compiles to Triton, and Triton is not installed (pip install triton)"
    import torch._dynamo

    if torch._dynamo.config.disable:
        return "torch.compile is disabled (torch._dynamo.config.disable)"
    return None


class Flex(Backend):
    """``torch.compile(flex_attention)`` on the whole input, with a BlockMask from subquad's tile states."""

    name = "flex"
    tiled = False
    devices = ("cpu", "cuda")

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = super().not_supported_reasons(inp, opts)
        if opts.packed:
            return reasons + ["packed sequences run in tiles, one sequence at a time"]
        if not opts.allow_compile:
            return reasons + ["compiling is off (allow_compile=False or SUBQUAD_COMPILE=0)"]
        if not inp.has_callbacks:
            reasons.append("no score_mod or mask_mod: the fused kernels need no compiling")
        if inp.B * inp.Hq * inp.Lq * inp.Lk < MIN_SCORES:
            reasons.append(f"fewer than {MIN_SCORES:,} scores: compiling would cost more than it saves")
        if inp.requires_grad or opts.captured_requires_grad:
            reasons.append("gradients: FlexAttention has no CPU backward (and subquad does not plan its CUDA one yet)")
        if opts.return_lse:
            reasons.append("return_lse: FlexAttention on CPU does not return the lse")
        if inp.attn_mask is not None:
            reasons.append("attn_mask: FlexAttention takes masks as mask_mod only")
        if inp.dropout_p > 0:
            reasons.append("FlexAttention does not support dropout")
        if inp.device_type == "cpu" and inp.dtype == torch.float64:
            reasons.append("FlexAttention on CPU takes float32, float16 and bfloat16 only")
        if inp.n_groups > 1 or inp.kv_broadcast or inp.query.shape[0] != inp.B:
            reasons.append("batch dims broadcast between query, key and value")
        if inp.empty or inp.Lk == 0:
            reasons.append("an empty input")
        if inp.q_offset or inp.kv_offset or inp.h_offset:
            reasons.append("a block of a longer sequence (positions offset): runs on the tiles")
        traced = getattr(inp.score_mod, "structure", None)
        if traced is not None and traced.reason.startswith("it could not be traced"):
            reasons.append(f"score_mod cannot be compiled: {traced.reason}")
        if reasons:
            return reasons
        if inp.device_type in _FAILED:  # before the signature: the device's reason is the one to act on
            return [_FAILED[inp.device_type]]
        if _signature(inp) in _FAILED:
            return [f"compiling this signature failed before ({_FAILED[_signature(inp)]})"]
        if _signature(inp) in _NO_BLOCK_MASK:
            return [f"building the BlockMask of this signature failed before ({_NO_BLOCK_MASK[_signature(inp)]})"]
        why = _flex_unavailable_reason(inp.device_type)
        return [why] if why else []

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        nq, nk = -(-max(inp.Lq, 1) // BLOCK), -(-max(inp.Lk, 1) // BLOCK)
        heads = inp.B * inp.Hq
        # The kernel's per-thread block of scores and accumulator rows (measured: 1x4x8192x64 fp32
        # peaked at its output alone, the buffers being reused).
        n = _threads() * (BLOCK * 512 * (4 + inp.itemsize) + BLOCK * (inp.Ev + 2) * 4)
        # The BlockMask: block states (int8), partial and full indices (int32), their transposes.
        n += heads * nq * nk * (1 + 4 * 4 + 8)
        if inp.mask_mod is not None:
            # One block row of the mask evaluated at a time, with the callback's intermediates
            # (the blocks its declared states leave undecided; all if it declares none).
            n += BLOCK * min(inp.Lk, _eval_keys(inp)) * (inp.B * inp.Hq * 2 + 2 * 8)
        return n + (1 << 20)

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        raise NotImplementedError("the flex path runs inference only")

    # ------------------------------------------------------------- compute
    def run_whole(self, inp: Inputs, need_lse: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """``(out (B, Hq, Lq, Ev), None)`` of the call through compiled FlexAttention (no lse).

        Raises :class:`FlexUnavailable` when compiling fails or the BlockMask cannot be built (the
        caller then runs the tiles).
        """
        signature = _signature(inp)
        try:
            block_mask, (computed, skipped) = self.block_mask(inp)
        except Exception as e:  # the tiles need no BlockMask: they run the call (or raise its error)
            reason = _first_line(e)
            with _LOCK:
                _NO_BLOCK_MASK[signature] = reason
            raise FlexUnavailable(f"its BlockMask could not be built: {reason}") from e
        TILES.computed += computed
        TILES.skipped += skipped
        start = time.perf_counter()
        try:
            if signature in _STATIC_ONLY:
                out = _call(_compiled(static=True), inp, block_mask)
            else:
                try:
                    out = _call(_compiled(), inp, block_mask)
                except FlexUnavailable:
                    raise
                except Exception:  # some kernels compile only with static shapes
                    out = _call(_compiled(static=True), inp, block_mask)
                    with _LOCK:
                        _STATIC_ONLY.add(signature)
        except Exception as e:  # any failure to compile hands the call to the tiles
            missing = _missing_toolchain(e)
            reason = missing or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            with _LOCK:
                if missing or isinstance(e, FlexUnavailable):
                    _FAILED[inp.device_type] = (
                        f"FlexAttention cannot compile on {inp.device_type} in this process: {reason}"
                    )
                else:
                    _FAILED[signature] = reason
            raise FlexUnavailable(reason) from e
        with _LOCK:
            _COMPILE_SECONDS.setdefault(signature, time.perf_counter() - start)
        return out, None

    def block_mask(self, inp: Inputs) -> Tuple[Any, Tuple[int, int]]:
        """The call's BlockMask and its (computed, skipped) block counts, cached per (mask, shapes)."""
        refs: List[Any] = []
        mask_key = value_key(inp.mask_mod, refs, 0)
        key = None
        if mask_key is not None:
            key = (mask_key, inp.is_causal, inp.causal_offset, inp.B, inp.Hq, inp.Lq, inp.Lk, inp.device)
            with _LOCK:
                hit = _BLOCK_MASKS.get(key)
                if hit is not None and all(r() is not None for r in hit[2]):
                    _BLOCK_MASKS.move_to_end(key)
                    return hit[0], hit[1]
        built = _build_block_mask(inp)
        if key is not None:
            with _LOCK:
                _BLOCK_MASKS[key] = (built[0], built[1], refs)
                while len(_BLOCK_MASKS) > _BLOCK_MASK_CACHE_SIZE:
                    _BLOCK_MASKS.popitem(last=False)
        return built

    def notes(self, inp: Inputs) -> List[str]:
        seconds = _COMPILE_SECONDS.get(_signature(inp))
        if seconds is not None:
            return [f"flex: compiled for this signature already (its first call took {seconds:.1f} s)"]
        return ["flex: the first call of this signature compiles FlexAttention (seconds; later calls reuse it)"]


def _flex_call(
    q: Tensor, k: Tensor, v: Tensor, score_mod: Any, block_mask: Any, scale: float, enable_gqa: bool
) -> Tensor:
    # Traced by torch.compile, where is_compiling() is True and this check folds away. Run as
    # plain Python instead (dynamo disabled, this frame skipped after a recompile limit, ...),
    # FlexAttention would materialize the scores: refuse before it allocates anything.
    if not torch.compiler.is_compiling():
        raise FlexUnavailable(
            "torch.compile did not compile this call (dynamo disabled, or a recompile limit hit); "
            "FlexAttention would materialize the scores"
        )
    from torch.nn.attention.flex_attention import flex_attention

    # Older torch types the result as any of its return_lse/return_aux forms (a tensor here).
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)  # type: ignore[return-value, unused-ignore]


def _flex_call_static(
    q: Tensor, k: Tensor, v: Tensor, score_mod: Any, block_mask: Any, scale: float, enable_gqa: bool
) -> Tensor:
    # A second entry point (its own code object, so its own compile cache) compiled with static
    # shapes: inductor compiles some FlexAttention kernels only without dynamic shapes.
    return _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa)


def _compiled(static: bool = False) -> Callable[..., Tensor]:
    """subquad's own compiled entry points: their own code objects, so their compile caches and
    recompile limits are not shared with other uses of ``flex_attention`` in the process. The
    first takes torch's automatic dynamic shapes (one recompile for a new length, then none)."""
    with _LOCK:
        if not _COMPILED:
            _COMPILED.append(torch.compile(_flex_call, dynamic=None, fullgraph=True))
            _COMPILED.append(torch.compile(_flex_call_static, dynamic=False, fullgraph=True))
        return _COMPILED[1 if static else 0]


def _call(flex: Callable[..., Tensor], inp: Inputs, block_mask: Any) -> Tensor:
    import torch._dynamo

    # Distinct float constants specialize (a dynamic float trips inductor's flex lowering); a
    # recompile limit that is hit raises instead of running FlexAttention eagerly, which would
    # materialize the scores.
    with (
        torch._dynamo.config.patch(specialize_float=True, recompile_limit=64, fail_on_recompile_limit_hit=True),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        return flex(inp.q, inp.k, inp.v, _score_mod(inp), block_mask, inp.scale, inp.G > 1)


# What a missing toolchain says (the first line that names one is the reason given). Any call on
# the device would fail the same way, so the device is refused for the process. (A C++ compile
# *error* is not one of these: it can be one signature's, or a passing fault.)
_MISSING_TOOLCHAIN = (
    "invalidcxxcompiler",
    "no working c++ compiler",
    "no such file or directory: 'g++'",
    # CUDA: inductor writes Triton kernels; Triton builds a C launcher with a C compiler and Python.h.
    "tritonmissing",
    "cannot find a working triton installation",
    "no module named 'triton'",
    "too old to be supported by the triton",
    "failed to find c compiler",
    "python.h: no such file or directory",
)


def _missing_toolchain(e: BaseException) -> Optional[str]:
    """``"Type: the line that says so"`` when compiling failed for want of a toolchain (no
    Triton, no C or C++ compiler); torch wraps the error (``BackendCompilerFailed``), so the
    causes are read too."""
    seen: List[BaseException] = []
    cause: Optional[BaseException] = e
    while cause is not None and cause not in seen and len(seen) < 8:
        seen.append(cause)
        name = type(cause).__name__
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()] or [""]
        said = [line for line in lines if any(word in line.lower() for word in _MISSING_TOOLCHAIN)]
        if said or name.lower() in _MISSING_TOOLCHAIN:
            return f"{name}: {(said or lines)[0][:200]}"
        cause = cause.__cause__ or cause.__context__
    return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def _signature(inp: Inputs) -> Any:
    """What a compiled FlexAttention kernel depends on, approximately (torch keeps the real guards)."""
    refs: List[Any] = []
    return (
        callback_key(_unwrapped(inp.score_mod), refs, 0),
        callback_key(inp.mask_mod, refs, 0),
        inp.is_causal,
        inp.dtype,
        inp.device_type,
        inp.E,
        inp.Ev,
        inp.G > 1,
    )


def _unwrapped(fn: Any) -> Any:
    return getattr(fn, "fn", fn)


def _score_mod(inp: Inputs) -> Optional[Callable[..., Tensor]]:
    return inp.score_mod


def _flex_mask_mod(inp: Inputs) -> Optional[Callable[..., Tensor]]:
    """The mask FlexAttention applies inside partial blocks: causal (with its offset) and ``mask_mod``."""
    mask_mod, off = inp.mask_mod, inp.causal_offset
    if inp.is_causal and mask_mod is not None:
        return lambda b, h, q, kv: (kv <= q + off) & mask_mod(b, h, q, kv)
    if inp.is_causal:
        return lambda b, h, q, kv: kv <= q + off
    return mask_mod


def _causal_states(inp: Inputs, nq: int, nk: int) -> Tensor:
    """Block states of the causal mask, ``(nq, nk)`` on the CPU: 0 empty, 1 full, 2 partial."""
    qs = torch.arange(nq) * BLOCK
    qe = torch.clamp(qs + BLOCK, max=inp.Lq)
    ks = torch.arange(nk) * BLOCK
    ke = torch.clamp(ks + BLOCK, max=inp.Lk)
    off = inp.causal_offset
    empty = ks.view(1, -1) > (qe - 1 + off).view(-1, 1)
    full = (ke - 1).view(1, -1) <= (qs + off).view(-1, 1)
    return torch.where(empty, 0, torch.where(full, 1, 2)).to(torch.int8)


def _build_block_mask(inp: Inputs) -> Tuple[Any, Tuple[int, int]]:
    """The call's BlockMask, on its device, and its (computed, skipped) block counts.

    What the host can know comes first: causal, and the declared states of the whole grid (one
    device -> host transfer, never one per block). Blocks they leave undecided are evaluated on
    the device, a block row at a time; only then is the device waited for once more, to count.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = -(-inp.Lq // BLOCK), -(-inp.Lk // BLOCK)
    host = _causal_states(inp, nq, nk) if inp.is_causal else torch.full((nq, nk), FULL, dtype=torch.int8)
    rows: List[Tuple[int, int, int]] = []  # (block row, first and end key block to evaluate)
    if inp.mask_mod is not None:
        declared = grid_states(inp, 0, inp.Lq, BLOCK, 0, inp.Lk, BLOCK)
        if declared is None:
            undecided = host != EMPTY
        else:
            undecided = (declared == UNKNOWN) & (host != EMPTY)
            host = _combine(host, torch.where(declared == UNKNOWN, FULL, declared))
        for i, row in enumerate(undecided.tolist()):
            if True in row:
                rows.append((i, row.index(True), len(row) - row[::-1].index(True)))
    states = host.view(1, 1, nq, nk).to(inp.device)
    for i, j0, j1 in rows:
        states = _evaluated_row(inp, states, i, i * BLOCK, min((i + 1) * BLOCK, inp.Lq), j0, j1)
    partial = states == PARTIAL
    full = states == FULL
    kv_num = partial.sum(dim=-1, dtype=torch.int32)
    kv_idx = torch.sort((~partial).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    full_num = full.sum(dim=-1, dtype=torch.int32)
    full_idx = torch.sort((~full).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=_flex_mask_mod(inp),
        seq_lengths=(inp.Lq, inp.Lk),
    )
    used = ((states if rows else host).view(-1, nq, nk) != EMPTY).any(dim=0)
    computed = int(used.sum())
    return mask, (computed, nq * nk - computed)


def _combine(a: Tensor, b: Tensor) -> Tensor:
    """Block states of the intersection of two masks (EMPTY 0, FULL 1, PARTIAL 2)."""
    return torch.where((a == 0) | (b == 0), 0, torch.where((a == 1) & (b == 1), 1, 2)).to(torch.int8)


def _evaluated_row(inp: Inputs, states: Tensor, i: int, qs: int, qe: int, j0: int, j1: int) -> Tensor:
    """Block row ``i`` of a ``mask_mod`` evaluated on the call's device over key blocks ``[j0, j1)``,
    a few thousand keys at a time, combined into ``states`` (on that device too, or combining
    fails); ``states`` grows batch/head dims if the mask has them."""
    step = max(1, _eval_keys(inp) // BLOCK)
    for c0 in range(j0, j1, step):
        c1 = min(c0 + step, j1)
        ks, ke = c0 * BLOCK, min(c1 * BLOCK, inp.Lk)
        keep = eval_mask_mod(inp, qs, qe, ks, ke)  # (B or 1, Hq or 1, qn or 1, kn or 1)
        keep = keep.expand(keep.shape[0], keep.shape[1], qe - qs, ke - ks)
        pad = (c1 - c0) * BLOCK - (ke - ks)
        any_ = (
            torch.nn.functional.pad(keep, (0, pad), value=False).unflatten(-1, (c1 - c0, BLOCK)).any(dim=-1).any(dim=-2)
        )
        all_ = (
            torch.nn.functional.pad(keep, (0, pad), value=True).unflatten(-1, (c1 - c0, BLOCK)).all(dim=-1).all(dim=-2)
        )
        mask_states = torch.where(~any_, EMPTY, torch.where(all_, FULL, PARTIAL)).to(torch.int8)
        if mask_states.shape[:2] != states.shape[:2]:
            states = states.expand(
                max(states.shape[0], mask_states.shape[0]),
                max(states.shape[1], mask_states.shape[1]),
                *states.shape[2:],
            ).clone()
        combined = _combine(states[:, :, i, c0:c1], mask_states)
        states[:, :, i, c0:c1] = combined
    return states
